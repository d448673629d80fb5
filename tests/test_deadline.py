"""The per-request deadline of `deployments.failover.resumable_stream`, in process.

The end-to-end cases (504, the streaming error event) run against a real Serve application in
`test_bad_input.py`. What this module pins down without a server is timing that a loaded machine makes
likely but a test server cannot force: the deadline passing while the *caller* holds a chunk (writing it
to the HTTP stream) rather than while the stream waits for the router. The router handle here is a
double (named as one: `SlowRouterHandle`), a stand-in for `router.options(stream=True).generate.remote`.
"""

from __future__ import annotations

import asyncio

from cluster.core.sampling import SamplingParams
from deployments.chunks import ErrorChunk, TokensChunk
from deployments.failover import resumable_stream


class SlowRouterHandle:
    """Double of a router deployment handle: `generate` streams one token every `every_s` seconds,
    forever; `cancelled` records that the stream was cancelled (as the ingress must when it gives up)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.cancelled = False

    def options(self, stream: bool):
        assert stream
        return self

    @property
    def generate(self):
        return self

    def remote(self, prompt_ids, params, max_speculative_tokens, progress):
        handle = self

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                await asyncio.sleep(handle.every_s)
                return TokensChunk([1], "x", {})

            def cancel(self):
                handle.cancelled = True

        return Stream()


def _consume(handle, timeout_s: float, hold_s: float) -> list:
    """The chunks a caller gets that spends `hold_s` on each chunk (awaiting, as an HTTP write does)."""

    async def main():
        got = []
        async for chunk in resumable_stream(handle, [1, 2], SamplingParams(max_tokens=100), None, 0, 0.0,
                                            timeout_s=timeout_s):
            got.append(chunk)
            await asyncio.sleep(hold_s)
        return got

    return asyncio.run(main())


def test_deadline_passing_while_the_caller_holds_a_chunk_ends_with_a_timeout_event():
    # the router is quick (10 ms a chunk), the caller slow (100 ms a chunk): the 0.35 s deadline passes
    # while the caller is busy, which used to cancel the caller's task and cut the stream off
    handle = SlowRouterHandle(every_s=0.01)
    got = _consume(handle, timeout_s=0.35, hold_s=0.1)
    assert isinstance(got[-1], ErrorChunk) and got[-1].type == "timeout", got[-1]
    assert all(isinstance(c, TokensChunk) for c in got[:-1]) and 2 <= len(got) - 1 <= 5, len(got)
    assert f"({len(got) - 1} tokens sent)" in got[-1].message
    assert handle.cancelled


def test_deadline_passing_while_waiting_for_the_router_ends_with_a_timeout_event():
    handle = SlowRouterHandle(every_s=0.1)
    got = _consume(handle, timeout_s=0.35, hold_s=0.0)
    assert isinstance(got[-1], ErrorChunk) and got[-1].type == "timeout"
    assert 2 <= len(got) - 1 <= 4 and handle.cancelled


def test_a_stream_that_ends_in_time_is_passed_through_whole():
    class Finite(SlowRouterHandle):
        def remote(self, *args):
            async def chunks():
                for i in range(3):
                    await asyncio.sleep(0.01)
                    yield TokensChunk([i], str(i), {})

            class Stream:
                def __init__(self):
                    self.inner = chunks()

                def __aiter__(self):
                    return self.inner

                def cancel(self):
                    pass

            return Stream()

    got = _consume(Finite(0.0), timeout_s=5.0, hold_s=0.0)
    assert [c.token_ids for c in got] == [[0], [1], [2]]
