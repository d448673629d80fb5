"""The torch runner on the real SmolLM2 (fp32): rollback, batching, sessions."""

from __future__ import annotations

import pytest
import torch

from cluster.core.errors import InvalidRequestError
from cluster.model.runner import UnknownSessionError

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer(PROMPT)["input_ids"]


def test_extend_matches_one_full_forward(target_runner, target_fp32, ids):
    with torch.inference_mode():
        reference = target_fp32(torch.tensor([ids])).logits[0]  # [n, vocab]
    session = target_runner.add_session()
    head = target_runner.extend(session, ids[:10])
    tail = target_runner.extend(session, ids[10:])
    torch.testing.assert_close(torch.cat([head, tail]), reference, atol=1e-4, rtol=1e-4)
    assert target_runner.length(session) == len(ids)


def test_truncate_then_extend_equals_fresh_prefill(target_runner, ids):
    fresh = target_runner.add_session()
    expected = target_runner.extend(fresh, ids)
    session = target_runner.add_session()
    target_runner.extend(session, ids[:12] + [17, 923, 4, 5, 6])  # a wrong continuation ...
    layer = target_runner._sessions[session].cache.layers[0]
    buffer = layer.keys.data_ptr()
    target_runner.truncate(session, 12)  # ... rolled back
    assert target_runner.length(session) == 12
    assert layer.keys.data_ptr() == buffer, "rollback must move a cursor, not copy the cache"
    again = target_runner.extend(session, ids[12:])
    torch.testing.assert_close(again, expected[12:], atol=1e-5, rtol=1e-5)


def test_batched_extend_equals_per_session_extend(target_runner, ids):
    prefixes = {"a": ids[:3], "b": ids[:15], "c": []}
    news = {"a": ids[3:8], "b": ids[15:16], "c": ids[:6]}
    expected = {}
    for name in prefixes:
        s = target_runner.add_session(("single", name))
        if prefixes[name]:
            target_runner.extend(s, prefixes[name])
        expected[name] = target_runner.extend(s, news[name])
    for name in prefixes:
        target_runner.add_session(name)
        if prefixes[name]:
            target_runner.extend(name, prefixes[name])
    got = target_runner.extend_batch(news)
    for name in prefixes:
        torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)
        assert target_runner.length(name) == len(prefixes[name]) + len(news[name])
    # the batched step wrote each session's cache correctly: the next single step agrees too
    nxt = target_runner.extend("b", [42])
    torch.testing.assert_close(nxt, target_runner.extend(("single", "b"), [42]), atol=1e-4, rtol=1e-4)
    # only the requested logits come back
    got = target_runner.extend_batch({"a": [1, 2, 3], "c": [4, 5]}, num_logits={"a": 1, "c": 2})
    assert got["a"].shape == (1, target_runner.vocab_size) and got["c"].shape == (2, target_runner.vocab_size)


def test_session_errors(target_runner):
    with pytest.raises(UnknownSessionError, match="unknown session"):
        target_runner.extend("nope", [1])
    s = target_runner.add_session()
    with pytest.raises(InvalidRequestError, match="already exists"):
        target_runner.add_session(s)
    with pytest.raises(ValueError, match="cannot truncate"):
        target_runner.truncate(s, 3)
    with pytest.raises(InvalidRequestError, match="context"):
        target_runner.extend(s, [1] * (target_runner.max_context + 1))
    target_runner.release(s)
    assert not target_runner.has_session(s)
