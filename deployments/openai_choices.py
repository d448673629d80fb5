"""The HTTP answer to one request of `n` choices: each choice is one session's stream of chunks
(`deployments/chunks.py`); here they become one JSON body or one stream of server-sent events.

Choice i is a session of its own with seed `seed + i` (vLLM's `n`: each child request gets the parent's
seed plus its index), so `n` greedy choices are the same text and `n` sampled ones are independent
samples of the target's distribution. Usage counts the prompt once and the completion tokens of every
choice (OpenAI's and vLLM's `n`).

Completions may carry several prompts: choice `p * n + j` is prompt p's choice j (vLLM's order), usage counts
each prompt once.

`echo` (completions, one `Echo` per choice): each choice's text starts with its prompt's, and its `logprobs`
with the prompt tokens' (a choice's `PromptChunk`: the target's, scored as the verifier prefilled the
prompt); streamed, the prompt comes in an event of its own before the choice's first tokens. A choice whose
session sent a `PromptChunk` carries vLLM's `prompt_logprobs` (not streamed, as in vLLM; chat's at the top level).
Chat's `echo` (vLLM's): the last message's text before each choice's content, streamed after the role.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from cluster.core.sampling import SamplingParams
from deployments.chunks import Chunk, ErrorChunk, FinishChunk, PromptChunk, TokensChunk
from deployments.openai_api import StreamOptions
from deployments.openai_logprobs import LogprobFormat
from deployments.openai_prediction import prediction_details

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Echo:
    """A completion's `echo`: the prompt's `text` goes before each choice's; `first_token`, the prompt's
    first token id (echoed logprobs start with it, a token without a logprob); `scored`: each choice's
    session sends the prompt's logprobs (a `PromptChunk`), and a streamed echo waits for them."""

    text: str
    first_token: int
    scored: bool


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: the request's (seeded already) with seed + index; choice 0 is the request."""
    if index == 0:
        return params
    return params.model_copy(update={"seed": (params.seed + index) % 2**63})


def usage(prompt_tokens: int, completion_tokens: int, details: dict | None = None) -> dict:
    """OpenAI's usage; `details`: its `completion_tokens_details` (a prediction's, `prediction_details`)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if details is not None:
        out["completion_tokens_details"] = details
    return out


def speculation(stats: dict) -> dict:
    """The extension field: speculation figures of one session, in the project's vocabulary."""
    return {key: stats[key] for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "rounds",
                                        "accepted_per_position", "drafted_per_position", "gamma_counts")}


def total_speculation(finals: list[FinishChunk]) -> dict:
    """One choice: its figures; several: drafted, accepted and rounds summed, the rates over the sums."""
    if len(finals) == 1:
        return speculation(finals[0].stats)
    drafted = sum(f.stats["drafted"] for f in finals)
    accepted = sum(f.stats["accepted"] for f in finals)
    rounds = sum(f.stats["rounds"] for f in finals)
    def summed(key: str) -> list[int]:  # per position (or per γ) lists of any lengths, added up
        width = max(len(f.stats[key]) for f in finals)
        return [sum(f.stats[key][i] for f in finals if i < len(f.stats[key])) for i in range(width)]

    return {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": sum(f.completion_tokens for f in finals) / rounds if rounds else 0.0,
            "rounds": rounds,
            "accepted_per_position": summed("accepted_per_position"),
            "drafted_per_position": summed("drafted_per_position"), "gamma_counts": summed("gamma_counts")}


async def open_choices(streams: list[AsyncIterator[Chunk]]) -> tuple[ErrorChunk | None, AsyncIterator | None]:
    """(the refusal, None) when a choice's first chunk is an error (all choices are then closed), else
    (None, its (choice index, chunk) pairs). Each stream is iterated from its first chunk to its last by
    one task (the caller's for one choice, one task per choice for several): a stream's deadline
    (`asyncio.timeout` in `resumable_stream`) cancels the task that entered it."""
    if len(streams) == 1:
        first = await anext(streams[0])
        if isinstance(first, ErrorChunk):
            await streams[0].aclose()
            return first, None
        return None, merge([_prepend([first], streams[0])])
    merged = merge(streams)
    buffered: list[tuple[int, Chunk]] = []
    started: set[int] = set()
    while len(started) < len(streams):
        i, chunk = await anext(merged)
        if i not in started and isinstance(chunk, ErrorChunk):  # refused before anything was sent
            await merged.aclose()
            return chunk, None
        started.add(i)
        buffered.append((i, chunk))
    return None, _prepend(buffered, merged)


async def _prepend(items: list, rest: AsyncIterator) -> AsyncIterator:
    """`items`, then the rest of the stream (closing it when the caller stops early)."""
    try:
        for item in items:
            yield item
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) from every stream as they come; closing this closes them all. One stream
    is iterated by the caller's task, several by a task each."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        except Exception as e:  # noqa: BLE001 - reported as this choice's error, the others go on
            await queue.put((i, ErrorChunk("server_error", f"generation failed: {e!r}")))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, chunk = await queue.get()
            if chunk is done:
                left -= 1
            else:
                yield i, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _choice(kind: Kind, index: int, text: str, finish: str | None, token_ids: list[int] | None,
            logprobs: dict | None) -> dict:
    out: dict = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if token_ids is not None:
        out["token_ids"] = token_ids
    if kind == "completion":
        out["text"] = text
    else:
        out["message"] = {"role": "assistant", "content": text}
    return out


@dataclass(frozen=True)
class Answer:
    """What one request's answer is written from, besides its chunks: `n` choices of `kind`, the prompt's token
    count (`prompt_tokens`, each prompt once) and each choice's prompt ids (`prompt_ids`, written with
    `return_token_ids`, as vLLM: a completion choice's `prompt_token_ids`, chat's top-level); `echo`: each choice's
    (completions: text and prompt logprobs; chat: the text before its content); `prompt_text`: chat's
    `return_prompt_text`."""

    n: int
    kind: Kind
    request_id: str
    model: str
    prompt_tokens: int
    return_token_ids: bool
    prompt_ids: list[list[int]]
    echo: list[Echo] | None = None
    prompt_text: str | None = None
    prediction: list[int] | None = None  # the request's prediction's ids (usage then says how much the answer holds)

    def usage(self, finals: list[FinishChunk], outputs: list[list[int]]) -> dict:
        """The whole request's usage, from its choices' finishes and output ids."""
        return usage(self.prompt_tokens, sum(f.completion_tokens for f in finals),
                     prediction_details(self.prediction, outputs))

    def top_level(self) -> dict:
        """Chat's fields beside the choices (the non-streamed body's, the first streamed event's)."""
        out: dict = {}
        if self.kind == "chat" and self.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids[0]
        if self.prompt_text is not None:
            out["prompt_text"] = self.prompt_text
        return out


def echo_chat(body: dict, echo: list[Echo] | None) -> dict:
    """A non-streamed chat body with vLLM's `echo`: each choice's content after the echoed text (after its tool
    calls were parsed out of it, as vLLM does)."""
    for choice in body["choices"] if echo is not None else ():
        choice["message"]["content"] = echo[choice["index"]].text + (choice["message"]["content"] or "")
    return body


async def collect(chunks: AsyncIterator[tuple[int, Chunk]], answer: Answer, logprobs: LogprobFormat | None = None,
                  prompt_format: LogprobFormat | None = None) -> dict | ErrorChunk:
    """The non-streamed body of `answer.n` choices, or the first error (the other choices are then stopped).
    `logprobs`: the request asked for them (each choice's, of all its tokens; with a completion's `echo`, the
    prompt's first). `prompt_format`: writes the `prompt_logprobs` a session sent (a completion choice's; chat's
    at the top level, as vLLM: the choices share the prompt). Chat's `echo` is `echo_chat`'s."""
    n, kind = answer.n, answer.kind
    echo = answer.echo if kind == "completion" else None
    texts, ids, lps = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    prompts: list[list | None] = [None] * n
    finals: list[FinishChunk | None] = [None] * n
    async for i, chunk in chunks:
        match chunk:
            case ErrorChunk():
                return chunk
            case PromptChunk():
                prompts[i] = chunk.logprobs
            case TokensChunk():
                texts[i] += chunk.text
                ids[i] += chunk.token_ids
                lps[i] += chunk.logprobs or []
            case FinishChunk():
                texts[i] += chunk.text
                finals[i] = chunk
    head = [[echo[i].first_token, *(prompts[i] or [])] if echo is not None else [] for i in range(n)]
    choices = [_choice(kind, i, (echo[i].text if echo is not None else "") + texts[i], finals[i].finish_reason,
                       ids[i] if answer.return_token_ids else None,
                       logprobs(head[i] + lps[i]) if logprobs is not None else None) for i in range(n)]
    extra = answer.top_level()
    for i, choice in enumerate(choices):
        if kind == "completion" and answer.return_token_ids:
            choice["prompt_token_ids"] = answer.prompt_ids[i]
        if prompts[i] is not None and prompt_format is not None:
            if kind == "completion":
                choice["prompt_logprobs"] = prompt_format.prompt(prompts[i])
            else:
                extra.setdefault("prompt_logprobs", prompt_format.prompt(prompts[i]))
    return {"id": answer.request_id, "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": int(time.time()), "model": answer.model, "choices": choices,
            "usage": answer.usage(finals, ids),
            "speculation": total_speculation(finals), **extra}


async def sse(chunks: AsyncIterator[tuple[int, Chunk]], answer: Answer, options: StreamOptions,
              logprobs: LogprobFormat | None = None) -> AsyncIterator[str]:
    """Server-sent events of `answer.n` choices (each event carries one choice, by index); with
    `options.continuous_usage_stats` every event carries the usage so far, with `include_usage` a last
    event carries the whole request's. `logprobs`: the request asked for them; an event carries those of
    the tokens whose text it carries (`TokensChunk.settled`), the finish those still held back. `echo`:
    each choice's first event is its prompt (with its logprobs when `scored`, at its `PromptChunk`); chat's
    comes after the role. A choice's first event carries its `prompt_token_ids` (completions; chat's, the
    first event's top level)."""
    n, kind, echo, return_token_ids = answer.n, answer.kind, answer.echo, answer.return_token_ids
    created = int(time.time())
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    completion_tokens = 0
    received, released, sent_text = [[] for _ in range(n)], [0] * n, [0] * n
    outputs: list[list[int]] = [[] for _ in range(n)]  # each choice's ids (a prediction's usage)
    ids_sent = [kind == "chat" or not return_token_ids] * n  # a completion choice's prompt ids go out once

    def release(i: int, upto: int, text: str) -> dict | None:
        """Choice i's logprobs of its tokens up to `upto` not sent yet, formatted (None: none)."""
        entries = received[i][released[i]:upto]
        released[i] = max(released[i], upto)
        offset = sent_text[i]
        sent_text[i] += len(text)
        return logprobs(entries, offset) if logprobs is not None and entries else None

    def event(choices: list, **extra) -> str:
        if options.continuous_usage_stats:
            extra = {"usage": usage(answer.prompt_tokens, completion_tokens), **extra}
        return "data: " + json.dumps({"id": answer.request_id, "object": obj, "created": created,
                                      "model": answer.model, "choices": choices, **extra}) + "\n\n"

    def choice(i: int, text: str | None, finish: str | None, first: bool = False, token_ids=(),
               lp: dict | None = None) -> dict:
        if kind == "completion":
            out = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
        else:
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            out = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
        if return_token_ids:
            out["token_ids"] = list(token_ids)
        if not ids_sent[i]:
            out["prompt_token_ids"], ids_sent[i] = answer.prompt_ids[i], True
        return out

    if kind == "chat":
        for i in range(n):
            yield event([choice(i, "", None, first=True)], **(answer.top_level() if i == 0 else {}))
    if echo is not None and not echo[0].scored:
        for i in range(n):
            sent_text[i] += len(echo[i].text)
            yield event([choice(i, echo[i].text, None)])
    finals = []
    async for i, chunk in chunks:
        match chunk:
            case ErrorChunk():
                error = {"message": chunk.message, "type": chunk.type, "param": None, "code": None}
                yield "data: " + json.dumps({"error": error}) + "\n\n"
                break
            case PromptChunk() if echo is not None and echo[i].scored:
                lp = logprobs([echo[i].first_token, *chunk.logprobs]) if logprobs is not None else None
                sent_text[i] += len(echo[i].text)
                yield event([choice(i, echo[i].text, None, lp=lp)])
            case TokensChunk():
                completion_tokens += len(chunk.token_ids)
                outputs[i] += chunk.token_ids
                received[i] += chunk.logprobs or []
                lp = release(i, chunk.settled, chunk.text)
                if chunk.text or lp is not None or (return_token_ids and chunk.token_ids):
                    yield event([choice(i, chunk.text, None, token_ids=chunk.token_ids, lp=lp)])
            case FinishChunk():
                finals.append(chunk)
                lp = release(i, len(received[i]), chunk.text)
                if chunk.text or lp is not None or not ids_sent[i]:
                    yield event([choice(i, chunk.text, None, lp=lp)])
                yield event([choice(i, None if kind == "chat" else "", chunk.finish_reason)],
                            speculation=speculation(chunk.stats))
    else:
        if options.include_usage:
            yield event([], usage=answer.usage(finals, outputs))
    yield "data: [DONE]\n\n"
