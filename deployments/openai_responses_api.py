"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it with its response store off (its default).

A Responses request is a chat in other words: `instructions` are the system message, `input` the user's text
or the conversation's items, `max_output_tokens` the length, `text.format` the structured output, `tools` chat's
tools (function calls and their outputs in the input are chat's assistant `tool_calls` and `tool` messages);
the sampling fields and vLLM's extensions are those of chat completions (`_Common`). The ingress runs it as
one chat session (`deployments/ingress.py`), so everything chat serves with speculation (penalties, grammars,
logprobs) a response serves too, and the text is the one chat completions would give.

The answer (deployments/openai_response_events.py) is one `response` object with one assistant `message` item
of one `output_text` part, or, with
`stream`, OpenAI's event sequence (`event:` and `data:` lines, a `sequence_number` each): `response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`, one
`response.output_text.delta` per group of new text, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`, then `response.completed` (as vLLM sends it, also where `max_output_tokens` ended
the response: the response's status then says `incomplete`). An error after the stream started is an `error`
event. With tools in play the model's calls are `function_call` output items, parsed from the finished text as
chat parses them: a stream sends text up to where a call may start, and the calls whole at the end. Nothing is stored (`store: false`
in every response): `previous_response_id`, `background` and conversations are refused with a clear 400, as
are built-in tools and input items other than text messages, function calls and their outputs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import MAX_LOGPROBS
from deployments.openai_api import MAX_UINT32, _Common, _Lenient, first_bad_item, ignored, not_served
from deployments.openai_structured import JsonSchemaFormat, ResponseFormat
from deployments.openai_tools import (
    MAX_TOOLS,
    FunctionDef,
    NamedToolChoice,
    ToolDef,
    one_grammar,
    tool_grammar,
    tool_mode,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(_Lenient):
    type: Literal["input_text", "output_text"] = Field(description="Text the user sent (`input_text`) or an earlier answer's (`output_text`).")
    text: str = Field(description="The text.")


class InputItem(_Lenient):
    """One item of the conversation: a `message` (OpenAI's `EasyInputMessage` too), an earlier `function_call`
    of the model, or a `function_call_output` (the call's result)."""

    type: Literal["message", "function_call", "function_call_output"] = Field("message", description="`message` (the default), `function_call` or `function_call_output`.")
    role: Literal["user", "assistant", "system", "developer"] | None = Field(None, description="A message's speaker; `developer` is read as `system`.")
    content: str | list[InputText] | None = Field(None, description="A message's text, or its text parts.")
    call_id: str | None = Field(None, max_length=256, description="A function call's id, and its output's.")
    name: str | None = Field(None, max_length=64, description="A function call's function.")
    arguments: str | None = Field(None, description="A function call's arguments (JSON text).")
    output: str | None = Field(None, description="A function call's result.")
    id: str | None = ignored("an earlier output item's id.")
    status: str | None = ignored("an earlier output item's status.")

    @field_validator("type", mode="before")
    @classmethod
    def _served_items(cls, value: Any) -> Any:
        if value not in ("message", "function_call", "function_call_output"):
            raise ValueError(f"input items of type {str(value)[:40]!r} are not served: only text messages, function "
                             "calls and their outputs (reasoning, images, files and item references are not)")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                                 for p in content):
            raise ValueError("only text parts ({'type': 'input_text', 'text': ...}) are served")
        return content

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "InputItem":
        needs = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                 "function_call_output": ("call_id", "output")}[self.type]
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionTool(_Lenient):
    """A function the model may call (the Responses API's flat form of chat's `tools[].function`)."""

    type: Literal["function"] = Field(description="Only function tools (built-in tools such as web search are not served).")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$", description="The function's name.")
    description: str | None = Field(None, description="What it does (shown to the model).")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments as a JSON schema (default: any object).")
    strict: bool | None = Field(None, description="Accepted: with a required or named tool choice the arguments always follow the schema.")

    def chat(self) -> ToolDef:
        return ToolDef(type="function", function=FunctionDef(name=self.name, description=self.description,
                                                             parameters=self.parameters, strict=self.strict))


class NamedFunction(_Lenient):
    type: Literal["function"] = Field(description="A named function tool.")
    name: str = Field(description="The function the model must call.")


class TextFormat(JsonSchemaFormat):
    """`text.format`: `text` (the default), `json_object`, or `json_schema` with its fields beside the type."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="`text`, `json_object` or `json_schema`.")


class TextConfig(_Lenient):
    format: TextFormat | None = Field(None, description="The output's format; `json_schema` and `json_object` are followed with a grammar (served with speculation).")
    verbosity: str | None = ignored("this model has no verbosity setting.")


class ResponsesRequest(_Common):
    """POST /v1/responses."""

    input: str | list[InputItem] = Field(min_length=1, description="The user's text, or the conversation as items.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_UINT32, description="Most tokens to generate (wins over max_tokens).")
    text: TextConfig | None = Field(None, description="`{'format': {'type': 'json_schema', 'name': ..., 'schema': {...}}}` or `{'format': {'type': 'json_object'}}`.")
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS, description=f"With `include: ['{LOGPROBS_INCLUDE}']`: also the N (0 .. {MAX_LOGPROBS}) most likely tokens at each position.")
    include: list[Literal["message.output_text.logprobs"]] | None = Field(None, description=f"`{LOGPROBS_INCLUDE}`: each output_text part carries its tokens' logprobs (the only extra output served).")
    store: bool | None = ignored("nothing is stored (vLLM's default); every response says store: false.")
    reasoning: dict[str, Any] | None = ignored("this model does not reason.")
    truncation: Literal["auto", "disabled"] = Field("disabled", description="`auto`: an input longer than the context is cut to fit as vLLM cuts it (`truncate_prompt_tokens: -1`, on the tokenizer's side), not refused.")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call (its calls are `function_call` output items).")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(None, description="`none`, `auto` (the default with tools: the model's own calls are parsed), `required` or `{'type': 'function', 'name': ...}` (both enforced by a grammar).")
    parallel_tool_calls: bool | None = Field(None, description="false: a required tool choice makes one call at most.")
    service_tier: str | None = ignored("one tier.")
    prompt_cache_key: str | None = ignored("the prompt cache is the server's own.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 tags, returned in the response.", max_length=16)
    previous_response_id: None = not_served(None, "this server stores no responses (as vLLM's default): send the whole conversation as `input`")
    conversation: None = not_served(None, "this server stores no conversations: send the whole conversation as `input`")
    background: Literal[False] = not_served(False, "background responses (nothing is stored to fetch them from)")
    prompt: None = not_served(None, "stored prompt templates")
    n: Literal[1] = not_served(1, "one output per response (send one request per sample)")
    return_token_ids: Literal[False] = not_served(False, "token ids on /v1/responses (chat completions return them)")

    @field_validator("input", mode="before")
    @classmethod
    def _items_say_what_is_wrong(cls, value: Any) -> Any:
        return first_bad_item(value, InputItem)

    @model_validator(mode="after")
    def _auto_truncation(self) -> "ResponsesRequest":
        if self.truncation == "auto" and self.truncate_prompt_tokens is None:
            self.truncate_prompt_tokens = -1  # vLLM's reading of `auto`
        return self

    def messages(self) -> list[dict]:
        """The conversation as chat messages: consecutive function calls are one assistant message's
        `tool_calls`, an output a `tool` message."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input:
            if item.type == "message":
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            elif item.type == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not (out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls")):
                    out.append({"role": "assistant", "content": "", "tool_calls": []})
                out[-1]["tool_calls"].append(call)
        return out

    def chat_tools(self) -> list[ToolDef] | None:
        return [t.chat() for t in self.tools] if self.tools else None

    def tool_mode(self) -> str | None:
        """As chat's: None (no tools in play), "auto", "required" or "named:<function>"."""
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = NamedToolChoice(function={"name": choice.name})
        return tool_mode(self.chat_tools(), choice)

    def structured(self):
        """The grammar: a required or named tool choice's, else what `text.format` or the base's fields ask."""
        tools = tool_grammar(self.chat_tools() or [], self.tool_mode(), self.parallel_tool_calls is not False)
        return one_grammar(tools, self._asked_grammar(), "text.format or structured outputs")

    def _asked_grammar(self):
        """`text.format` as chat's `response_format` would ask for it (the base's rule on a copy that carries it),
        else the base's fields (vLLM's `structured_outputs` and `guided_*` are served here too)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            if self.response_format is not None:
                raise InvalidRequestError("text.format, response_format: ask for one grammar at a time")
            json_schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict) \
                if fmt.type == "json_schema" else None
            return _Common.structured(self.model_copy(update={
                "response_format": ResponseFormat(type=fmt.type, json_schema=json_schema)}))
        return super().structured()

    def num_logprobs(self) -> int | None:
        return self.top_logprobs if LOGPROBS_INCLUDE in (self.include or []) else None

    def logprob_fields(self) -> dict:
        return {**super().logprob_fields(), "prompt_logprobs": None}

    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens or self.max_tokens
