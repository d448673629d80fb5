"""Tool calling on /v1/chat/completions, as OpenAI and vLLM serve it.

- `tool_choice: "required"` and a named function are structured outputs (`deployments/openai_structured.py`):
  the output follows a JSON schema (vLLM's: an array of `{"name", "parameters"}` for `required`, the
  function's parameters for a named one) and becomes `tool_calls`.
- `tool_choice: "auto"` (the default when tools are given): the model may call tools in the Hermes format
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which tandem parses out of its text (vLLM's
  `hermes` tool parser). A chat template that renders `tools` itself gets them; one that does not (SmolLM2's)
  gets the Hermes system prompt that lists them.
- The conversation may hold the assistant's earlier `tool_calls` and `tool` messages with their results.
- Streamed, content deltas are sent as they come (with `auto`, text from a possible `<tool_call>` on is
  held back) and each tool call comes whole in one delta before the finish, as OpenAI's client accumulates.

The grammar keeps speculation lossless (a token mask at every draft position); parsing changes no token.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.core.errors import InvalidRequestError
from cluster.core.grammar import StructuredOutputs

MAX_TOOLS = 128
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
HERMES_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. For each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>\n<tools>\n')


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$", description="The function's name.")
    description: str | None = Field(None, description="What it does (shown to the model).")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments as a JSON schema (default: any object).")
    strict: bool | None = Field(None, description="Accepted: with a required or named tool choice the arguments always follow the schema.")


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDef


class _Name(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    """An assistant message's earlier tool call (in the conversation)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ---- what the model is asked for ---------------------------------------------------------------------

def _params(fn: FunctionDef) -> dict:
    return fn.parameters if fn.parameters else {"type": "object", "properties": {}}


def tool_mode(tools: list[ToolDef] | None, choice: ToolChoice | None) -> str | None:
    """None (no tools in play), "auto", "required" or the named function's name."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice: needs tools")
        return None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise InvalidRequestError(f"tool_choice: the function {choice.function.name!r} is not among the tools")
        return "named:" + choice.function.name
    return choice or "auto"


def tool_grammar(tools: list[ToolDef], mode: str | None, parallel: bool = True) -> StructuredOutputs | None:
    """The JSON schema a required or named tool choice's output follows (vLLM's), or None."""
    if mode is None or mode == "auto":
        return None
    if mode.startswith("named:"):
        fn = next(t.function for t in tools if t.function.name == mode.removeprefix("named:"))
        return StructuredOutputs.of_schema(_params(fn))
    items = [{"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _params(t.function)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs.of_schema(schema)


def one_grammar(tools: StructuredOutputs | None, asked: StructuredOutputs | None,
                asked_by: str) -> StructuredOutputs | None:
    """A request's one grammar: its required or named tool choice's (`tool_grammar`), or the one its other fields
    (`asked_by`, named in the error) ask for; both at once is the client's error, as in vLLM."""
    if tools is not None and asked is not None:
        raise InvalidRequestError(f"tool_choice: a required or named tool choice cannot be combined with {asked_by}")
    return tools or asked


def template_messages(messages: list[dict], tools: list[ToolDef] | None, mode: str | None,
                      template: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. A template that renders tools gets them as OpenAI sends them;
    for one that does not, the tools go into the system prompt (Hermes) and earlier tool calls and results
    into the text, as Hermes templates write them."""
    renders_tools = "tools" in template
    listed = [t.model_dump(exclude_none=True) for t in tools] if tools and mode is not None else None
    if renders_tools:
        return messages, listed
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}\n</tool_call>"
                           for c in calls)
            m["content"] = (m.get("content") or "") + text
        if m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m["content"] = m.get("content") or ""
        out.append(m)
    if listed:
        prompt = HERMES_PROMPT + "\n".join(json.dumps(t) for t in listed) + "\n</tools>"
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _args(call: dict) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except (ValueError, KeyError):
        return call["function"].get("arguments")


# ---- what the model wrote ----------------------------------------------------------------------------

def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def parse(text: str, mode: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output."""
    if mode.startswith("named:"):
        return None, [_call(mode.removeprefix("named:"), text)]
    if mode == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["parameters"]) for c in calls]
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: left as text
            return text, []
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            calls.append(_call(call["name"], call.get("arguments", call.get("parameters", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []  # not a well-formed call: the text as it is
    if not calls:
        return text, []
    content = text[: text.index(OPEN_TAG)].strip()
    return content or None, calls


def apply(body: dict, mode: str | None) -> dict:
    """A non-streamed chat body with each choice's tool calls parsed out of its text, and the prompt's
    logprobs (asked with `prompt_logprobs`) at the top level, where vLLM's chat puts them."""
    scored = [c.pop("prompt_logprobs") for c in body["choices"] if "prompt_logprobs" in c]
    if scored:
        body["prompt_logprobs"] = scored[0]  # every choice scored the same prompt
    if mode is None:
        return body
    for choice in body["choices"]:
        message = choice["message"]
        content, calls = parse(message["content"], mode)
        if calls:
            message["content"], message["tool_calls"] = content, calls
            if choice["finish_reason"] == "stop" and not mode.startswith("named:"):
                choice["finish_reason"] = "tool_calls"
    return body


def held_from(text: str, mode: str) -> int:
    """Where the text still to be sent starts being held back: all of it for a required or named choice;
    with auto, from `<tool_call>` (or a possible start of it at the end) on."""
    if mode != "auto":
        return 0
    at = text.find(OPEN_TAG)
    if at >= 0:
        return at
    for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:k]):
            return len(text) - k
    return len(text)


async def stream(events: AsyncIterator[str], mode: str | None) -> AsyncIterator[str]:
    """The chat stream's events with tool calls: content deltas held back where they may be a call, and
    at a choice's finish its calls (one delta each, whole) or the held text."""
    if mode is None:
        async for event in events:
            yield event
        return
    texts: dict[int, str] = {}
    sent: dict[int, int] = {}
    async for event in events:
        if not event.startswith("data: {"):
            yield event
            continue
        data = json.loads(event[6:])
        if not data.get("choices"):
            yield event
            continue
        out = []
        for choice in data["choices"]:
            i, delta = choice["index"], choice.get("delta", {})
            if "content" in delta and delta["content"]:
                texts[i] = texts.get(i, "") + delta["content"]
                upto = held_from(texts[i], mode)
                delta["content"] = texts[i][sent.get(i, 0):upto] if upto > sent.get(i, 0) else ""
                sent[i] = max(sent.get(i, 0), upto)
                if not delta["content"] and set(delta) == {"content"} and choice.get("logprobs") is None \
                        and not choice.get("token_ids"):  # nothing to send (token ids are sent as they come)
                    continue
            if choice.get("finish_reason") is not None:
                _, calls = parse(texts.get(i, ""), mode)  # the content before a call went out already
                if calls:
                    deltas = [{"index": k, **call} for k, call in enumerate(calls)]
                    out.append({"index": i, "delta": {"tool_calls": deltas}, "finish_reason": None, "logprobs": None})
                    if choice["finish_reason"] == "stop" and not mode.startswith("named:"):
                        choice["finish_reason"] = "tool_calls"
                rest = texts.get(i, "")[sent.get(i, 0):]  # held back for nothing: no call after all
                if rest and not calls:
                    out.append({"index": i, "delta": {"content": rest}, "finish_reason": None, "logprobs": None})
            out.append(choice)
        if out:
            yield "data: " + json.dumps({**data, "choices": out}) + "\n\n"
