"""The chat completions request (`POST /v1/chat/completions`): the conversation, its chat template's options
(vLLM's `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`), tools and logprobs; the
fields both generation endpoints share are `deployments/openai_api.py`'s `_Common`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.core.sampling import MAX_LOGPROBS
from deployments.openai_api import MAX_UINT32, _Common, _Lenient, ignored, not_served
from deployments.openai_body import ApiError
from deployments.openai_tools import MAX_TOOLS, ToolCall, ToolChoice, ToolDef, one_grammar, tool_grammar, tool_mode

# what apply_chat_template takes itself: a request's chat_template_kwargs may not set these
_TEMPLATE_RESERVED = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class TextPart(_Lenient):
    type: Literal["text"] = Field(description="Only text parts are served.")
    text: str = Field(description="The text.")


class ChatMessage(_Lenient):
    """One message of the conversation; the chat template of the target turns them into the prompt."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks; `developer` is read as `system`; `tool` carries a tool call's result.")
    content: str | list[TextPart] | None = Field(None, description="A string, or text content parts (may be null in an assistant message with tool_calls).")
    name: str | None = ignored("a participant name (the chat template has no place for it).")
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="An assistant message's tool calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")
    function_call: None = not_served(None, "function calling (deprecated; use tool_calls)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
                return content
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are served")
        if not isinstance(content, str):
            raise ValueError("must be a string or a list of text content parts")
        return content

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (it may be null only in an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_message(self) -> dict:
        """The message as a chat template reads it (OpenAI's shape)."""
        out: dict = {"role": self.template_role(), "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class TemplateFields(BaseModel):
    """vLLM's chat template options, on chat completions and /tokenize."""

    add_generation_prompt: bool = Field(True, description="Extension (vLLM): end the prompt with the assistant's turn opening (false: the template's text of the conversation as it is).")
    continue_final_message: bool = Field(False, description="Extension (vLLM): the last message (the assistant's, as a prefix of its answer) is left open and continued; with add_generation_prompt: false.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=16, description="Extension (vLLM): more variables for the chat template (e.g. `enable_thinking`); not its own arguments.")
    chat_template: None = not_served(None, "a request's own chat template (vLLM refuses it too unless started with --trust-request-chat-template)")

    @model_validator(mode="after")
    def _template_options(self) -> "TemplateFields":
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message: needs add_generation_prompt: false (as in vLLM)",
                           param="continue_final_message")
        bad = sorted(k for k in self.chat_template_kwargs or {} if k in _TEMPLATE_RESERVED or not k.isidentifier())
        if bad:
            raise ApiError(400, f"chat_template_kwargs: {', '.join(bad)[:200]} cannot be set here (the template's own "
                                "arguments, or not a name)", param="chat_template_kwargs")
        return self

    def template_options(self) -> dict:
        """Keywords of the tokenizer's apply_chat_template for this request."""
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(_Common, TemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_UINT32, description="Alias of max_tokens (wins when both are set).")
    logprobs: bool = Field(False, description="Return each generated token's log probability (`choices[].logprobs.content`).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"With `logprobs`: also the N (0 .. {MAX_LOGPROBS}) most likely tokens at each position.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"Extension (vLLM): the response's top-level `prompt_logprobs`, one entry per prompt token of the templated conversation (the first null), each a dict token id -> {{logprob, rank, decoded_token}} of the prompt token and the N (0 .. {MAX_LOGPROBS}) most likely; the target's raw log-softmax. Not with `stream` (N > 0), as vLLM.")
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call (`deployments/openai_tools.py`).")
    functions: list[Any] | None = not_served(None, "function calling (deprecated; use tools); only an empty list is served", max_length=0)
    tool_choice: ToolChoice | None = Field(None, description="`none`, `auto` (the default with tools: the model's Hermes-format calls are parsed), `required` or `{'type': 'function', 'function': {'name': ...}}` (both enforced by a grammar).")
    function_call: Literal["none"] | None = not_served(None, "function calling (deprecated; use tool_choice); only 'none' is served")
    parallel_tool_calls: bool | None = Field(None, description="false: a required tool choice makes one call at most.")
    echo: bool = Field(False, description="Extension (vLLM): each choice's content starts with the last message's when that message has the answer's role (with `add_generation_prompt: false` and `continue_final_message`: the whole assistant text, prefix and continuation).")
    add_special_tokens: bool = Field(False, description="Extension (vLLM): the templated prompt is tokenized with the tokenizer's special tokens (BOS) added where it adds any, on top of the template's own.")
    documents: list[dict[str, str]] | None = Field(None, max_length=64, description="Extension (vLLM): documents for a chat template that renders them (retrieval-augmented generation); a template that does not ignores them.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(None, description="Passed to the chat template as vLLM does (`reasoning_effort`, and `enable_thinking: true` unless chat_template_kwargs sets it); a template without them ignores it.")
    return_prompt_text: bool = Field(False, description="Extension (vLLM): the answer carries the templated prompt's text (`prompt_text`).")
    include_reasoning: bool | None = ignored("the target writes no separate reasoning.")
    thinking_token_budget: None = not_served(None, "a thinking budget (the target does not reason)")
    mm_processor_kwargs: None = not_served(None, "multimodal input (the target is a text model)")
    media_io_kwargs: None = not_served(None, "multimodal input (the target is a text model)")

    def template_options(self) -> dict:
        options = super().template_options()
        if self.documents is not None:
            options["documents"] = self.documents
        if self.reasoning_effort is not None:
            options = {"enable_thinking": True, **options, "reasoning_effort": self.reasoning_effort}
        return options

    def echo_text(self) -> str:
        """What vLLM's chat `echo` puts before each choice's content: the last message's text when it has the
        answer's role (the assistant's; without a generation prompt, the last message's own: always), else ""."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.template_role() != "assistant"):
            return ""
        return "\n".join(p.text for p in last.content) if isinstance(last.content, list) else last.text()

    def tool_mode(self) -> str | None:
        """None (no tools in play), "auto", "required" or "named:<function>" (InvalidRequestError if unknown)."""
        return tool_mode(self.tools, self.tool_choice)

    def structured(self):
        """The grammar: a required or named tool choice's, else what the structured-output fields ask."""
        return one_grammar(tool_grammar(self.tools or [], self.tool_mode(), self.parallel_tool_calls is not False),
                           super().structured(), "response_format or structured_outputs")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "ChatCompletionRequest":
        if self.stream and self.prompt_logprobs:
            raise ApiError(400, "prompt_logprobs: not available with stream (as in vLLM)", param="prompt_logprobs")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprob_fields(self) -> dict:
        return {**super().logprob_fields(), "prompt_logprobs": None if self.stream else self.prompt_logprobs}
