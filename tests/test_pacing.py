"""Stream pacing (`deployments.pacing`): fewer messages, the same tokens, nothing held that must not be."""

import asyncio

import pytest

from cluster.core.logprobs import TokenLogprob
from deployments.chunks import ErrorChunk, FinishChunk, PromptChunk, TokensChunk
from deployments.pacing import StreamPacing, merge, paced


def _tokens(i: int, logprobs: bool = False) -> TokensChunk:
    return TokensChunk([i], f"t{i} ", {"num_generated_tokens": i + 1},
                       [TokenLogprob(i, -0.1 * i, ())] if logprobs else None, settled=i + 1)


async def _source(chunks, gap_s: float, closed: list | None = None):
    try:
        for chunk in chunks:
            await asyncio.sleep(gap_s)
            yield chunk
    finally:
        if closed is not None:
            closed.append(True)


async def _collect(stream, stamps: list | None = None):
    out = []
    async for chunk in stream:
        out.append(chunk)
        if stamps is not None:
            stamps.append(asyncio.get_running_loop().time())
    return out


def _joined(chunks) -> TokensChunk:
    tokens = [c for c in chunks if isinstance(c, TokensChunk)]
    out = tokens[0]
    for c in tokens[1:]:
        out = merge(out, c)
    return out


def test_interval_follows_the_open_sessions():
    open_ = [0]
    pacing = StreamPacing(50, lambda: open_[0])
    assert pacing.interval_s() == pytest.approx(1 / 50)  # one session (or none yet)
    open_[0] = 16
    assert pacing.interval_s() == pytest.approx(16 / 50)
    assert StreamPacing(0, lambda: 16).interval_s() == 0.0


@pytest.mark.parametrize("logprobs", [False, True])
def test_merged_stream_carries_the_same_tokens_text_and_logprobs_in_fewer_messages(logprobs):
    chunks = [_tokens(i, logprobs) for i in range(30)]
    finish = FinishChunk("length", "", {"num_generated_tokens": 30}, 5, 30)
    stamps: list[float] = []
    out = asyncio.run(_collect(paced(_source(chunks + [finish], 0.005), lambda: 0.05), stamps))
    assert out[-1] == finish
    sent = out[:-1]
    assert 2 <= len(sent) < 12  # 30 steps 5 ms apart, one message per 50 ms at most
    assert len(sent[0].token_ids) == 1  # the first token is never held
    whole = _joined(sent)
    assert whole.token_ids == list(range(30))
    assert whole.text == "".join(c.text for c in chunks)
    assert whole.stats == chunks[-1].stats and whole.settled == 30
    assert whole.logprobs == ([c.logprobs[0] for c in chunks] if logprobs else None)
    # no two token messages closer than the interval, but for the last: the finish sends what is held at once
    gaps = [b - a for a, b in zip(stamps[:-2], stamps[1:-2])]
    assert gaps and min(gaps) >= 0.045


def test_zero_interval_passes_every_chunk_as_it_comes():
    chunks = [_tokens(i) for i in range(5)]
    assert asyncio.run(_collect(paced(_source(chunks, 0.001), lambda: 0.0))) == chunks


def test_prompt_logprobs_and_errors_pass_at_once_after_the_tokens_before_them():
    prompt = PromptChunk([TokenLogprob(7, -1.0, ())])
    error = ErrorChunk("server_error", "boom")
    chunks = [prompt, _tokens(0), _tokens(1), _tokens(2), error]
    stamps: list[float] = []
    start = asyncio.run(_now())
    out = asyncio.run(_collect(paced(_source(chunks, 0.001), lambda: 10.0), stamps))
    assert out[0] == prompt and out[-1] == error
    assert _joined(out[1:-1]).token_ids == [0, 1, 2]
    assert stamps[-1] - stamps[0] < 1.0  # the error did not wait out the 10 s interval
    del start


async def _now():
    return asyncio.get_running_loop().time()


def test_closing_the_paced_stream_closes_its_source_even_while_a_chunk_is_held():
    closed: list = []

    async def run():
        stream = paced(_source([_tokens(i) for i in range(100)], 0.01, closed), lambda: 0.2)
        first = await anext(stream)  # sent at once
        task = asyncio.ensure_future(anext(stream))  # the second is held, waiting for the source's third
        await asyncio.sleep(0.05)
        task.cancel()  # the caller went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        return first

    first = asyncio.run(run())
    assert first.token_ids == [0] and closed == [True]


def test_a_source_ending_while_tokens_are_held_sends_them():
    chunks = [_tokens(i) for i in range(4)]
    out = asyncio.run(_collect(paced(_source(chunks, 0.001), lambda: 10.0)))
    assert _joined(out).token_ids == [0, 1, 2, 3] and len(out) == 2
