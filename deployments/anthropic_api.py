"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as vLLM serves it: what the
`anthropic` client and the tools written for it send to `vllm serve`.

A Messages request is a chat in other words: `system` is the system message, `messages` the conversation (text
blocks; an assistant's `tool_use` blocks are chat's `tool_calls`, a user's `tool_result` blocks chat's `tool`
messages), `tools` chat's function tools (`input_schema` their parameters), `tool_choice` `auto` / `any` / `tool`
/ `none` chat's `auto` / `required` / named / `none`, `stop_sequences` chat's `stop`. The ingress runs it as the
chat completions request `chat_body()` builds (one session, with speculation), so its text is the text chat
completions would give; the answer is rewritten as Anthropic's (`deployments/anthropic_events.py`).
Refused with a 400 that says why: image, document and other non-text blocks, and built-in (server) tools.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments.openai_api import MAX_STOP, MAX_UINT32, _Lenient, first_bad_item, ignored
from deployments.openai_tools import MAX_TOOLS

MAX_BLOCKS = 4096  # content blocks in one message


class TextBlock(_Lenient):
    type: Literal["text"] = Field(description="Text.")
    text: str = Field(description="The text.")
    cache_control: dict[str, Any] | None = ignored("the prompt cache is the server's own.")
    citations: list[Any] | None = ignored("no citations are made.")


class ContentBlock(_Lenient):
    """A block of a message: `text`, an assistant's `tool_use`, a user's `tool_result`; `thinking` blocks of an
    earlier answer are accepted and left out of the prompt (this model does not think)."""

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"] = Field(description="The block's kind.")
    text: str | None = Field(None, description="A text block's text.")
    id: str | None = Field(None, max_length=256, description="A tool_use block's id.")
    name: str | None = Field(None, max_length=64, description="A tool_use block's tool.")
    input: dict[str, Any] | None = Field(None, description="A tool_use block's arguments.")
    tool_use_id: str | None = Field(None, max_length=256, description="A tool_result block's call.")
    content: str | list[TextBlock] | None = Field(None, description="A tool_result block's result: text or text blocks.")
    is_error: bool | None = Field(None, description="A tool_result block's failure flag (the result's text says it).")
    thinking: str | None = ignored("an earlier answer's thinking (this model does not think).")
    signature: str | None = ignored("an earlier answer's thinking signature.")
    data: str | None = ignored("an earlier answer's redacted thinking.")
    cache_control: dict[str, Any] | None = ignored("the prompt cache is the server's own.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_results_only(cls, value: Any) -> Any:
        return first_bad_item(value, TextBlock, "block")

    @field_validator("type", mode="before")
    @classmethod
    def _served_blocks(cls, value: Any) -> Any:
        if value not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise ValueError(f"content blocks of type {str(value)[:40]!r} are not served: only text, tool_use and "
                             "tool_result (images, documents and search results are not)")
        return value

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "ContentBlock":
        needs = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                 "thinking": (), "redacted_thinking": ()}[self.type]
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        return self

    def result_text(self) -> str:
        content = self.content or ""
        return content if isinstance(content, str) else "".join(b.text for b in content)


class Message(_Lenient):
    role: Literal["user", "assistant"] = Field(description="`user` or `assistant`.")
    content: str | list[ContentBlock] = Field(description="Text, or content blocks.", max_length=MAX_BLOCKS)

    @field_validator("content", mode="before")
    @classmethod
    def _blocks_say_what_is_wrong(cls, value: Any) -> Any:
        return first_bad_item(value, ContentBlock, "block")


class Tool(_Lenient):
    """A client tool: a function the model may call."""

    type: Literal["custom"] | None = Field(None, description="`custom` or left out (built-in server tools such as web search or bash are not served).")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$", description="The tool's name.")
    description: str | None = Field(None, description="What it does (shown to the model).")
    input_schema: dict[str, Any] = Field(description="Its input as a JSON schema.")
    cache_control: dict[str, Any] | None = ignored("the prompt cache is the server's own.")

    @field_validator("type", mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        if value not in (None, "custom"):
            raise ValueError(f"built-in tools ({str(value)[:40]!r}) are not served: only client tools (a name, a "
                             "description and an input_schema)")
        return value


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"] = Field(description="`auto` (the model may call), `any` (it calls one of the tools), `tool` (it calls `name`), `none`.")
    name: str | None = Field(None, description="With `tool`: the tool to call.")
    disable_parallel_tool_use: bool | None = Field(None, description="true: with `any` or `tool`, one call at most.")

    @model_validator(mode="after")
    def _tool_names_one(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("a `tool` choice needs the tool's name")
        return self


class _Conversation(_Lenient):
    """What the prompt is made of: the fields `/v1/messages` and `/v1/messages/count_tokens` share."""

    model: str = Field(description="The served model id.")
    messages: list[Message] = Field(min_length=1, description="The conversation, from the user's first message on.")
    system: str | list[TextBlock] | None = Field(None, description="The system prompt: text, or text blocks.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="Tools the model may call (its calls are `tool_use` blocks).")
    tool_choice: ToolChoice | None = Field(None, description="How the model uses the tools (default `auto`).")
    thinking: dict[str, Any] | None = ignored("this model does not think.")

    @field_validator("system", mode="before")
    @classmethod
    def _blocks_say_what_is_wrong(cls, value: Any) -> Any:
        return first_bad_item(value, TextBlock, "block")

    def chat_messages(self) -> list[dict]:
        """The conversation as chat completions messages."""
        system = self.system if isinstance(self.system, str) or self.system is None \
            else "\n\n".join(b.text for b in self.system)
        out = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            blocks = [ContentBlock(type="text", text=message.content)] if isinstance(message.content, str) \
                else message.content
            text = "".join(b.text for b in blocks if b.type == "text")
            if message.role == "user":
                out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
                        for b in blocks if b.type == "tool_result"]
                if text or not any(b.type == "tool_result" for b in blocks):
                    out.append({"role": "user", "content": text})
            else:
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in blocks if b.type == "tool_use"]
                out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
        return out

    def conversation(self) -> dict:
        """The chat completions request's model, messages and tools."""
        return {"model": self.model, "messages": self.chat_messages(), **self.chat_tools()}

    def chat_conversation(self) -> bytes:
        """`conversation()` as a raw chat completions body: what the prompt is made of."""
        return json.dumps(self.conversation()).encode()

    def chat_tools(self) -> dict:
        """Chat completions' `tools`, `tool_choice` and `parallel_tool_calls` for these."""
        if not self.tools:
            return {}
        out: dict = {"tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                  "parameters": t.input_schema}} for t in self.tools]}
        choice = self.tool_choice
        if choice is not None:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                out["parallel_tool_calls"] = False
        return out


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=MAX_UINT32, description="Most tokens to generate.")
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP, description="Texts that end the answer (not included in it); the one met is `stop_sequence`.")
    stream: bool = Field(False, description="Anthropic's server-sent events: message_start, content blocks, message_delta, message_stop.")
    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature (default 1; 0 is greedy).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling.")
    top_k: int | None = Field(None, ge=1, le=MAX_UINT32, description="Top-k sampling.")
    metadata: dict[str, Any] | None = ignored("nothing is kept about the caller.")
    service_tier: str | None = ignored("one tier.")

    @field_validator("stop_sequences")
    @classmethod
    def _stops_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("a stop sequence must not be empty")
        return value

    def chat_body(self) -> bytes:
        """The chat completions request this one is, as a raw body (the ingress checks it as chat's)."""
        body = {**self.conversation(), "max_tokens": self.max_tokens, "stream": self.stream,
                "return_token_ids": bool(self.stop_sequences)}  # which stop sequence ended it: from the tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        body.update({k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                       ("top_k", self.top_k), ("stop", self.stop_sequences)) if v is not None})
        return json.dumps(body).encode()


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""
