"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it with its response store off (its default).

A Responses request is a chat in other words: `instructions` are the system message, `input` the user's text
or the conversation's message items, `max_output_tokens` the length, `text.format` the structured output;
the sampling fields and vLLM's extensions are those of chat completions (`_Common`). The ingress runs it as
one chat session (`deployments/ingress.py`), so everything chat serves with speculation (penalties, grammars,
logprobs) a response serves too, and the text is the one chat completions would give.

The answer is one `response` object with one assistant `message` item of one `output_text` part, or, with
`stream`, OpenAI's event sequence (`event:` and `data:` lines, a `sequence_number` each): `response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`, one
`response.output_text.delta` per group of new text, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`, then `response.completed` (as vLLM sends it, also where `max_output_tokens` ended
the response: the response's status then says `incomplete`). An error after the stream started is an `error`
event. Nothing is stored (`store: false` in every response): `previous_response_id`, `background` and
conversations are refused with a clear 400, as are tools (function calling is served on /v1/chat/completions)
and input items other than text messages.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from deployments.chunks import Chunk, ErrorChunk, FinishChunk, TokensChunk
from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import MAX_LOGPROBS
from deployments.openai_api import MAX_UINT32, _Common, _Lenient, ignored, not_served
from deployments.openai_choices import speculation
from deployments.openai_logprobs import LogprobFormat
from deployments.openai_structured import JsonSchemaFormat, ResponseFormat

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(_Lenient):
    type: Literal["input_text", "output_text"] = Field(description="Text the user sent (`input_text`) or an earlier answer's (`output_text`).")
    text: str = Field(description="The text.")


class InputMessage(_Lenient):
    """One message of the conversation (OpenAI's `EasyInputMessage` / input `message` item)."""

    type: Literal["message"] = Field("message", description="Only message items are served.")
    role: Literal["user", "assistant", "system", "developer"] = Field(description="Who speaks; `developer` is read as `system`.")
    content: str | list[InputText] = Field(description="A string, or text parts.")
    id: str | None = ignored("an earlier output item's id.")
    status: str | None = ignored("an earlier output item's status.")

    @field_validator("type", mode="before")
    @classmethod
    def _messages_only(cls, value: Any) -> Any:
        if value != "message":
            raise ValueError(f"input items of type {str(value)[:40]!r} are not served: only messages of text "
                             "(function calls and their outputs, reasoning, images, files and item references "
                             "are not)")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                                 for p in content):
            raise ValueError("only text parts ({'type': 'input_text', 'text': ...}) are served")
        return content

    def template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(JsonSchemaFormat):
    """`text.format`: `text` (the default), `json_object`, or `json_schema` with its fields beside the type."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="`text`, `json_object` or `json_schema`.")


class TextConfig(_Lenient):
    format: TextFormat | None = Field(None, description="The output's format; `json_schema` and `json_object` are followed with a grammar (served with speculation).")
    verbosity: str | None = ignored("this model has no verbosity setting.")


class ResponsesRequest(_Common):
    """POST /v1/responses."""

    input: str | list[InputMessage] = Field(min_length=1, description="The user's text, or the conversation as message items.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_UINT32, description="Most tokens to generate (wins over max_tokens).")
    text: TextConfig | None = Field(None, description="`{'format': {'type': 'json_schema', 'name': ..., 'schema': {...}}}` or `{'format': {'type': 'json_object'}}`.")
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS, description=f"With `include: ['{LOGPROBS_INCLUDE}']`: also the N (0 .. {MAX_LOGPROBS}) most likely tokens at each position.")
    include: list[Literal["message.output_text.logprobs"]] | None = Field(None, description=f"`{LOGPROBS_INCLUDE}`: each output_text part carries its tokens' logprobs (the only extra output served).")
    store: bool | None = ignored("nothing is stored (vLLM's default); every response says store: false.")
    reasoning: dict[str, Any] | None = ignored("this model does not reason.")
    truncation: Literal["auto", "disabled"] | None = ignored("an input longer than the context is refused, not cut.")
    tool_choice: Any = ignored("no tools are served on this endpoint.")
    parallel_tool_calls: bool | None = ignored("no tools are served on this endpoint.")
    service_tier: str | None = ignored("one tier.")
    prompt_cache_key: str | None = ignored("the prompt cache is the server's own.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 tags, returned in the response.", max_length=16)
    tools: list[Any] | None = not_served(None, "tools on /v1/responses (function calling is served on /v1/chat/completions); only an empty list is served", max_length=0)
    previous_response_id: None = not_served(None, "this server stores no responses (as vLLM's default): send the whole conversation as `input`")
    conversation: None = not_served(None, "this server stores no conversations: send the whole conversation as `input`")
    background: Literal[False] = not_served(False, "background responses (nothing is stored to fetch them from)")
    prompt: None = not_served(None, "stored prompt templates")
    n: Literal[1] = not_served(1, "one output per response (send one request per sample)")
    return_token_ids: Literal[False] = not_served(False, "token ids on /v1/responses (chat completions return them)")

    @field_validator("input", mode="before")
    @classmethod
    def _items_say_what_is_wrong(cls, value: Any) -> Any:
        """A list's first bad item named with its problem (pydantic's union error would speak of the string)."""
        if isinstance(value, list):
            for i, item in enumerate(value):
                try:
                    InputMessage.model_validate(item)
                except ValidationError as e:
                    first = e.errors()[0]
                    where = "".join(f".{x}" for x in first["loc"])
                    message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
                    raise ValueError(f"item {i}{where}: {message}") from None
        return value

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            [m.template_message() for m in self.input]
        return head + items

    def structured(self):
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


# ---- the response ---------------------------------------------------------------------------------


class ResponseBuilder:
    """One response's objects: its envelope, its message item, and the stream's events."""

    def __init__(self, body: ResponsesRequest, prompt_tokens: int, tokenizer):
        self.body, self.prompt_tokens = body, prompt_tokens
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = LogprobFormat(tokenizer, "chat") if body.num_logprobs() is not None else None
        self.sequence = 0

    def envelope(self, status: str, output: list, finish: FinishChunk | None = None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        fmt = {"type": "text"} if fmt is None or fmt.type == "text" else {"type": "json_object"} \
            if fmt.type == "json_object" else fmt.model_dump(mode="json", by_alias=True, exclude_none=True)
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": b.model,
               "output": output, "parallel_tool_calls": True, "previous_response_id": None,
               "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs,
               "tool_choice": "auto", "tools": [], "text": {"format": fmt}, "truncation": "disabled",
               "store": False, "background": False, "metadata": b.metadata or {}, "user": b.user, "usage": None}
        if finish is not None:
            out["usage"] = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": finish.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": self.prompt_tokens + finish.completion_tokens}
            out["speculation"] = speculation(finish.stats)
        return out

    @staticmethod
    def status(finish: FinishChunk) -> str:
        return "incomplete" if finish.finish_reason == "length" else "completed"

    def part(self, text: str, entries: list | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self.logprobs.chat(entries or [])["content"] if self.logprobs is not None else []}

    def item(self, status: str, parts: list) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": parts}

    def event(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(data)}\n\n"


async def collect_response(chunks: AsyncIterator[tuple[int, Chunk]], builder: ResponseBuilder) -> dict | ErrorChunk:
    """The non-streamed response, or the error that ended the session."""
    text, entries, finish = "", [], None
    async for _, chunk in chunks:
        match chunk:
            case ErrorChunk():
                return chunk
            case TokensChunk():
                text += chunk.text
                entries += chunk.logprobs or []
            case FinishChunk():
                text += chunk.text
                finish = chunk
    status = builder.status(finish)
    return builder.envelope(status, [builder.item(status, [builder.part(text, entries)])], finish)


async def response_events(chunks: AsyncIterator[tuple[int, Chunk]], builder: ResponseBuilder) -> AsyncIterator[str]:
    """The streamed response: OpenAI's events for one message of one text part (module docstring). A delta
    carries the logprobs of the tokens whose text it completes (`TokensChunk.settled`); the rest come with the
    last text."""
    try:
        async for event in _events(chunks, builder):
            yield event
    finally:
        await chunks.aclose()


async def _events(chunks: AsyncIterator[tuple[int, Chunk]], builder: ResponseBuilder) -> AsyncIterator[str]:
    b, at = builder, {"output_index": 0}
    yield b.event("response.created", response=b.envelope("in_progress", []))
    yield b.event("response.in_progress", response=b.envelope("in_progress", []))
    yield b.event("response.output_item.added", item=b.item("in_progress", []), **at)
    at = {**at, "item_id": b.item_id, "content_index": 0}
    yield b.event("response.content_part.added", part=b.part("", []), **at)
    text, entries, released = "", [], 0

    def delta(piece: str, upto: int) -> str:
        nonlocal text, released
        lps = b.part("", entries[released:upto])["logprobs"]
        text, released = text + piece, max(released, upto)
        return b.event("response.output_text.delta", delta=piece, logprobs=lps, **at)

    async for _, chunk in chunks:
        match chunk:
            case ErrorChunk():
                yield b.event("error", code=chunk.type, message=chunk.message, param=None,
                              error={"message": chunk.message, "type": chunk.type, "param": None, "code": None})
                return
            case TokensChunk():
                entries += chunk.logprobs or []
                if chunk.text:
                    yield delta(chunk.text, chunk.settled)
            case FinishChunk():
                if chunk.text or released < len(entries):
                    yield delta(chunk.text, len(entries))
                status = b.status(chunk)
                part = b.part(text, entries)
                yield b.event("response.output_text.done", text=text, logprobs=part["logprobs"], **at)
                yield b.event("response.content_part.done", part=part, **at)
                item = b.item(status, [part])
                yield b.event("response.output_item.done", item=item, output_index=0)
                # as vLLM: `response.completed` ends every stream (its response's status says incomplete), which
                # the openai client's stream helper needs (it waits for that event)
                yield b.event("response.completed", response=b.envelope(status, [item], chunk))
