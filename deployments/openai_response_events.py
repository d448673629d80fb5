"""The answer of `POST /v1/responses` (deployments/openai_responses_api.py has the request): one `response` object,
or, with `stream`, OpenAI's events for it, from the session's chunks (`deployments/chunks.py`). Its output is one
assistant `message` item of one `output_text` part, or, with tools in play, the model's calls as `function_call`
items (after a message of the text before them, if any)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from deployments.chunks import Chunk, ErrorChunk, FinishChunk, TokensChunk
from deployments.openai_choices import speculation
from deployments.openai_logprobs import LogprobFormat
from deployments.openai_responses_api import NamedFunction, ResponsesRequest
from deployments.openai_tools import OPEN_TAG, held_from, parse


class ResponseBuilder:
    """One response's objects: its envelope, its message item, and the stream's events."""

    def __init__(self, body: ResponsesRequest, prompt_tokens: int, tokenizer):
        self.body, self.prompt_tokens = body, prompt_tokens
        self.id, self.item_id = body.request_id or f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"  # vLLM's
        self.created = int(time.time())
        self.logprobs = LogprobFormat(tokenizer, "chat", body.return_tokens_as_token_ids) \
            if body.num_logprobs() is not None else None
        self.mode = body.tool_mode()  # tools in play: the calls are parsed out of the finished text
        self.sequence = 0

    def envelope(self, status: str, output: list, finish: FinishChunk | None = None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        fmt = {"type": "text"} if fmt is None or fmt.type == "text" else {"type": "json_object"} \
            if fmt.type == "json_object" else fmt.model_dump(mode="json", by_alias=True, exclude_none=True)
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": b.model,
               "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
               "previous_response_id": None,
               "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs,
               "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction)
               else b.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
               "text": {"format": fmt}, "truncation": b.truncation,
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

    def output(self, text: str, entries: list, status: str) -> list[dict]:
        """The finished output: one message, or with tools in play the model's calls as `function_call` items
        (after a message of the text before them, if any)."""
        content, calls = parse(text, self.mode) if self.mode is not None else (text, [])
        if not calls:
            return [self.item(status, [self.part(text, entries)])]
        if self.mode == "auto":  # the text before the first call as it was streamed (parse strips it)
            content = text[:text.find(OPEN_TAG)]
        head = [self.item(status, [self.part(content, [])])] if content else []
        return head + [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                       for c in calls]

    def event(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(data)}\n\n"


async def collect_response(chunks: AsyncIterator[tuple[int, Chunk]], builder: ResponseBuilder) -> dict | ErrorChunk:
    """The non-streamed response, or the error that ended the session."""
    text, entries, end = await _gathered(chunks)
    return end if isinstance(end, ErrorChunk) else builder.envelope(
        builder.status(end), builder.output(text, entries, builder.status(end)), end)


async def _gathered(chunks: AsyncIterator[tuple[int, Chunk]]) -> tuple[str, list, FinishChunk | ErrorChunk]:
    """The session's text, its tokens' logprobs, and its finish (or the error that ended it)."""
    text, entries = "", []
    async for _, chunk in chunks:
        match chunk:
            case ErrorChunk():
                return text, entries, chunk
            case TokensChunk():
                text += chunk.text
                entries += chunk.logprobs or []
            case FinishChunk():
                return text + chunk.text, entries, chunk
    return text, entries, ErrorChunk("server_error", "the session ended without a finish")


async def response_events(chunks: AsyncIterator[tuple[int, Chunk]], builder: ResponseBuilder) -> AsyncIterator[str]:
    """The streamed response: OpenAI's events (`_events`); the session is closed when the stream ends or the
    client goes away."""
    try:
        async for event in _events(chunks, builder):
            yield event
    finally:
        await chunks.aclose()


def _error_event(b: ResponseBuilder, error: ErrorChunk) -> str:
    return b.event("error", code=error.type, message=error.message, param=None,
                   error={"message": error.message, "type": error.type, "param": None, "code": None})


async def _events(chunks: AsyncIterator[tuple[int, Chunk]], b: ResponseBuilder) -> AsyncIterator[str]:
    """The stream's events. No tools in play: the text as it comes, a delta with the logprobs of the tokens whose
    text it completes (`TokensChunk.settled`; the rest with the last text). Tools with `auto`: the text up to
    where a call may start (`<tool_call>`, or a possible start of it at the end), as chat streams it; a required
    or named choice's output is all calls, so nothing goes out before the end. The calls come whole at the end."""
    yield b.event("response.created", response=b.envelope("in_progress", []))
    yield b.event("response.in_progress", response=b.envelope("in_progress", []))
    text, entries, sent, released, opened, end = "", [], 0, 0, False, None
    part_at = {"output_index": 0, "item_id": b.item_id, "content_index": 0}

    def stream_text(upto: int, settled: int, last: bool = False):
        """The message's text up to `upto` and the logprobs of its first `settled` tokens (no tools only)."""
        nonlocal sent, released, opened
        settled = settled if b.mode is None else released
        if not opened and (upto > sent or last):  # the message item opens with its first text
            opened = True
            yield b.event("response.output_item.added", item=b.item("in_progress", []), output_index=0)
            yield b.event("response.content_part.added", part=b.part("", []), **part_at)
        if upto > sent or (last and settled > released):
            lps = b.part("", entries[released:settled])["logprobs"]
            yield b.event("response.output_text.delta", delta=text[sent:upto], logprobs=lps, **part_at)
            sent, released = max(sent, upto), max(released, settled)

    async for _, chunk in chunks:
        match chunk:
            case ErrorChunk():
                yield _error_event(b, chunk)
                return
            case TokensChunk():
                text += chunk.text
                entries += chunk.logprobs or []
                for event in stream_text(len(text) if b.mode is None else held_from(text, b.mode), chunk.settled):
                    yield event
            case FinishChunk():
                text, end = text + chunk.text, chunk
                break
    if end is None:
        yield _error_event(b, ErrorChunk("server_error", "the session ended without a finish"))
        return
    status = b.status(end)
    output = b.output(text, entries, status)
    for index, item in enumerate(output):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":  # first, and its text starts with what went out already
            part = item["content"][0]
            for event in stream_text(len(part["text"]), len(entries), last=True):
                yield event
            yield b.event("response.output_text.done", text=part["text"], logprobs=part["logprobs"], **part_at)
            yield b.event("response.content_part.done", part=part, **part_at)
        else:
            yield b.event("response.output_item.added", item={**item, "arguments": "", "status": "in_progress"},
                          output_index=index)
            yield b.event("response.function_call_arguments.delta", delta=item["arguments"], **at)
            yield b.event("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"],
                          **at)
        yield b.event("response.output_item.done", item=item, output_index=index)
    # as vLLM: `response.completed` ends every stream (its response's status says incomplete), which the openai
    # client's stream helper needs (it waits for that event)
    yield b.event("response.completed", response=b.envelope(status, output, end))
