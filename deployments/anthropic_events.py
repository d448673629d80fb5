"""Anthropic's Messages API's answers (`deployments/anthropic_api.py`), made from the chat completions answer of
the same request: one `message` (text and `tool_use` blocks, `stop_reason`, usage), or, with `stream`, Anthropic's
events (`event:` and `data:` lines): `message_start`, per block `content_block_start`, its deltas (`text_delta`;
a call's `input_json_delta`, whole) and `content_block_stop`, then `message_delta` (the stop reason and the output
tokens) and `message_stop`; an error after the stream started is an `error` event. Errors are Anthropic's body
(`{"type": "error", "error": {"type", "message"}}`) with the same status as chat's."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

# chat's HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


class AnthropicErrorBody(BaseModel):
    type: str = Field(description="`invalid_request_error`, `authentication_error`, `not_found_error`, `request_too_large`, `overloaded_error`, `timeout_error` or `api_error`.")
    message: str


class AnthropicError(BaseModel):
    type: str = Field("error", description="`error`.")
    error: AnthropicErrorBody


class MessageBlock(BaseModel):
    type: str = Field(description="`text` or `tool_use`.")
    text: str | None = Field(None, description="A text block's text.")
    id: str | None = Field(None, description="A tool_use block's id.")
    name: str | None = Field(None, description="A tool_use block's tool.")
    input: dict[str, Any] | None = Field(None, description="A tool_use block's arguments.")


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageObject(BaseModel):
    id: str
    type: str = Field("message", description="`message`.")
    role: str = Field("assistant", description="`assistant`.")
    content: list[MessageBlock]
    model: str
    stop_reason: str | None = Field(description="`end_turn`, `max_tokens`, `stop_sequence` or `tool_use`.")
    stop_sequence: str | None = Field(None, description="The stop sequence met (with `stop_sequence`).")
    usage: MessageUsage


class CountTokens(BaseModel):
    input_tokens: int = Field(description="The prompt's tokens: what /v1/messages would read.")


class MessageEvent(BaseModel):
    type: str = Field(description="`message_start`, `content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop` or `error`.")
    message: MessageObject | None = None
    index: int | None = None
    content_block: MessageBlock | None = None
    delta: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    error: AnthropicErrorBody | None = None


def anthropic_error(response: JSONResponse) -> JSONResponse:
    """A chat route's error response as Anthropic's error body, with the same status."""
    message = json.loads(response.body)["error"]["message"]
    return JSONResponse(status_code=response.status_code, headers={k: v for k, v in response.headers.items()
                                                                    if k.lower() == "retry-after"},
                        content={"type": "error", "error": {"type": ERROR_TYPES.get(response.status_code, "api_error"),
                                                            "message": message}})


def stop_reason(finish: str | None, calls: bool, token_ids: list[int], stops: list[str] | None,
                tokenizer) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished answer; the stop sequence met is the one the decoded output
    shows first (the engine ends at the first it meets)."""
    if finish == "length":
        return "max_tokens", None
    if calls or finish == "tool_calls":
        return "tool_use", None
    if stops:
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def _blocks(content: str | None, calls: list[dict]) -> list[dict]:
    out = [{"type": "text", "text": content}] if content else []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
        else:  # arguments cut short (max_tokens) or not an object: the text as it is
            out.append({"type": "text", "text": call["function"]["arguments"]})
    return out


def _message_id(chat: dict) -> str:
    """A message's id from its chat completion's (or chunk's): the same hex, Anthropic's prefix."""
    return "msg_" + chat["id"].split("-")[-1]


def to_message(chat: dict, stops: list[str] | None, tokenizer) -> dict:
    """A chat completion (one choice) as Anthropic's message."""
    choice = chat["choices"][0]
    content, calls = choice["message"].get("content"), choice["message"].get("tool_calls") or []
    blocks = _blocks(content, calls)
    reason, sequence = stop_reason(choice["finish_reason"], any(b["type"] == "tool_use" for b in blocks),
                                   choice.get("token_ids") or [], stops, tokenizer)
    return {"id": _message_id(chat), "type": "message", "role": "assistant", "content": blocks,
            "model": chat["model"], "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": chat["usage"]["prompt_tokens"], "output_tokens": chat["usage"]["completion_tokens"]}}


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


async def message_events(events: AsyncIterator[str], stops: list[str] | None, tokenizer,
                         input_tokens: int) -> AsyncIterator[str]:
    """Anthropic's event stream from chat's (one choice, `include_usage`, token ids where `stops`)."""
    try:
        async for event in _rewritten(events, stops, tokenizer, input_tokens):
            yield event
    finally:  # the client went away (or the stream ended): the chat stream, and its session, end now
        await events.aclose()


async def _rewritten(events: AsyncIterator[str], stops: list[str] | None, tokenizer,
                     input_tokens: int) -> AsyncIterator[str]:
    started, open_block, index = False, None, -1
    finish, calls, token_ids, output_tokens = None, [], [], 0

    def start(data: dict) -> str:
        message = {"id": _message_id(data), "type": "message", "role": "assistant", "content": [],
                   "model": data["model"], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return _event("message_start", message=message)

    async for raw in events:
        if not raw.startswith("data: {"):
            continue
        data = json.loads(raw[6:])
        if "error" in data and "choices" not in data:
            error = data["error"]
            yield _event("error", error={"type": error.get("type") or "api_error", "message": error["message"]})
            return
        if not started:
            started = True
            yield start(data)
        if data.get("usage") and not data["choices"]:
            output_tokens = data["usage"]["completion_tokens"]
        for choice in data["choices"]:
            delta = choice.get("delta", {})
            token_ids += choice.get("token_ids") or []
            if delta.get("content"):
                if open_block != "text":
                    if open_block is not None:
                        yield _event("content_block_stop", index=index)
                    index, open_block = index + 1, "text"
                    yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta["content"]})
            calls += delta.get("tool_calls") or []
            finish = choice.get("finish_reason") or finish
    if open_block is not None:
        yield _event("content_block_stop", index=index)
    blocks = _blocks(None, calls)
    for block in blocks:
        index += 1
        if block["type"] == "tool_use":
            yield _event("content_block_start", index=index, content_block={**block, "input": {}})
            yield _event("content_block_delta", index=index,
                         delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        else:
            yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
        yield _event("content_block_stop", index=index)
    reason, sequence = stop_reason(finish, any(b["type"] == "tool_use" for b in blocks), token_ids, stops, tokenizer)
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage={"output_tokens": output_tokens})
    yield _event("message_stop")


def anthropic_answer(answer, stops: list[str] | None, tokenizer, input_tokens: int):
    """The chat route's answer to a Messages request, rewritten: its error, its stream, or its completion."""
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(message_events(answer.body_iterator, stops, tokenizer, input_tokens),
                                 media_type="text/event-stream")
    if isinstance(answer, JSONResponse):
        return anthropic_error(answer)
    return to_message(answer, stops, tokenizer)
