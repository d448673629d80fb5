"""Pacing a replica's streams: how often each session's committed tokens leave for the client.

Every message a stream sends costs CPU in each process it crosses (the replica, the ingress, Serve's
proxy), whatever it carries: on this machine about 2 ms per message over the three at 16 streams, as
much as vLLM's own step spends on a token (BENCHMARKS.md). A replica therefore sends at most
`stream_messages_per_s` messages a second over all its sessions: a session waits at least
open sessions / rate between two messages, and the tokens committed meanwhile leave together in one
(`TokensChunk`s merged: the same tokens, text, logprobs and figures, fewer messages). Ray Serve LLM does
the same with a fixed 50 ms window, vLLM's server with `--stream-interval` tokens.

What is never held: a session's first tokens (TTFT), its prompt logprobs, its end and its errors (the
tokens before them are sent first). With one session at 50 messages a second, only steps faster than
20 ms are merged; rate 0 sends every step's tokens as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from deployments.chunks import Chunk, TokensChunk


class StreamPacing:
    """The interval between two messages of one session: open sessions / `messages_per_s` (0: none)."""

    def __init__(self, messages_per_s: float, sessions: Callable[[], int]):
        self.messages_per_s = messages_per_s
        self.sessions = sessions

    def interval_s(self) -> float:
        if self.messages_per_s <= 0:
            return 0.0
        return max(1, self.sessions()) / self.messages_per_s


def merge(first: TokensChunk, then: TokensChunk) -> TokensChunk:
    """One chunk carrying `first` then `then`: their tokens, text and logprobs, the later figures."""
    logprobs = None if first.logprobs is None and then.logprobs is None else \
        list(first.logprobs or []) + list(then.logprobs or [])
    return TokensChunk(first.token_ids + then.token_ids, first.text + then.text, then.stats, logprobs, then.settled)


async def paced(chunks: AsyncIterator[Chunk], interval_s: Callable[[], float],
                clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Chunk]:
    """`chunks` with consecutive `TokensChunk`s merged so that one session sends at most one message per
    `interval_s()` (read at each decision); anything else passes at once, after the tokens held before it.
    Closing (or cancelling) the result closes `chunks`."""
    source = aiter(chunks)
    pending: TokensChunk | None = None
    last_sent = float("-inf")
    waiting: asyncio.Future | None = None  # the source's next chunk, while a held one waits for its time
    try:
        while True:
            if pending is not None:
                delay = last_sent + interval_s() - clock()
                if delay <= 0:
                    yield pending
                    pending, last_sent = None, clock()
                    continue
                if waiting is None:
                    waiting = asyncio.ensure_future(anext(source))
                done, _ = await asyncio.wait({waiting}, timeout=delay)
                if not done:
                    continue  # its time came: sent at the top of the loop
                step, waiting = waiting, None
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    yield pending
                    return
            else:
                step, waiting = waiting, None  # a wait that outlived the chunk it held goes on
                try:
                    chunk = await (step if step is not None else anext(source))
                except StopAsyncIteration:
                    return
            if isinstance(chunk, TokensChunk):
                pending = chunk if pending is None else merge(pending, chunk)
                continue
            if pending is not None:
                yield pending
                pending = None
            yield chunk
            last_sent = clock()
    finally:
        if waiting is not None:
            waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
