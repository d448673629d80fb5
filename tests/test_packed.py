"""The runner's packed batched step (cluster/model/packed.py): several sessions' new tokens in one row for
the weights, attention per session on its own cache. Exactness against each session's own forward is
in test_runner.py and test_tree.py; here: no cache is copied, the model's attention implementation is
left as it was, the one-row CPU attention in fp32 agrees with sdpa, and a concurrent single-session
forward while a packed one runs is still right."""

from __future__ import annotations

import threading

import pytest
import torch

from cluster.model import packed
from cluster.model.runner import TorchModelRunner

ATOL = 1e-4
PROMPTS = [("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
           ("Write a short poem about the sea.", True)]


def _sessions(runner: TorchModelRunner, prompts: dict[str, list[int]]) -> None:
    for name, ids in prompts.items():
        runner.add_session(name)
        runner.extend(name, ids)


def test_a_batched_step_writes_each_session_in_its_own_buffers(target_fp32, prompt_ids):
    runner = TorchModelRunner(target_fp32)
    _sessions(runner, {"a": prompt_ids[0], "b": prompt_ids[1][:7], "c": prompt_ids[0][:3]})
    lengths = {s: runner.length(s) for s in "abc"}
    buffers = {s: [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in runner._get(s).cache.layers]
               for s in "abc"}
    got = runner.extend_batch({"a": [11], "b": [12, 13, 14], "c": [15, 16]}, num_logits={"b": 2})
    assert {s: tuple(t.shape) for s, t in got.items()} == {"a": (1, runner.vocab_size), "b": (2, runner.vocab_size),
                                                          "c": (2, runner.vocab_size)}
    for s, n in (("a", 1), ("b", 3), ("c", 2)):
        assert runner.length(s) == lengths[s] + n
        # the same buffers: the step wrote at the cursor, it did not regrow or replace a session's cache
        assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in runner._get(s).cache.layers] == buffers[s]
    assert target_fp32.config._attn_implementation == "sdpa"  # restored after the packed forward


def test_packed_attention_restores_the_implementation_after_nested_and_failed_uses(target_fp32):
    before = target_fp32.config._attn_implementation
    with packed.packed_attention(target_fp32):
        with packed.packed_attention(target_fp32, packed=False):
            assert target_fp32.config._attn_implementation == packed.PACKED
        assert target_fp32.config._attn_implementation == packed.PACKED  # the outer user is still inside
    assert target_fp32.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="boom"):
        with packed.packed_attention(target_fp32):
            raise RuntimeError("boom")
    assert target_fp32.config._attn_implementation == before
    target_fp32.set_attn_implementation("eager")
    try:  # one session's forward leaves a model on another implementation alone
        with packed.packed_attention(target_fp32, packed=False):
            assert target_fp32.config._attn_implementation == "eager"
    finally:
        target_fp32.set_attn_implementation(before)


def test_one_row_bf16_attention_on_cpu_runs_in_fp32_and_agrees_with_sdpa():
    """`_attend` upcasts one bf16 query row on CPU: closer to the fp32 result than bf16 sdpa is off it."""
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q = torch.randn(1, 9, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 3, 300, 64, generator=g).bfloat16() for _ in range(2))
    got = packed._attend(module, q, k, v, None, 0.125)  # [1, 1, 9, 64], transformers' layout
    in_fp32 = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                                               scale=0.125).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.125).transpose(1, 2)
    assert got.dtype == torch.bfloat16 and got.shape == in_fp32.shape
    torch.testing.assert_close(got, in_fp32.bfloat16(), atol=0, rtol=0)
    assert (sdpa.float() - got.float()).abs().max() < 2e-2  # the same attention, rounded differently at most


def test_a_single_session_forward_beside_a_packed_one_is_unchanged(target_fp32, prompt_ids):
    """Another thread's one-session forward while a packed forward holds PACKED: scored as sdpa scores it."""
    runner = TorchModelRunner(target_fp32)
    solo = TorchModelRunner(target_fp32)
    _sessions(runner, {"a": prompt_ids[0], "b": prompt_ids[1]})
    solo.add_session("x")
    want = solo.extend("x", prompt_ids[1][:9])
    solo.truncate("x", 0)
    got = {}
    with packed.packed_attention(target_fp32):  # as if a packed forward were running on another thread
        thread = threading.Thread(target=lambda: got.setdefault("x", solo.extend("x", prompt_ids[1][:9])))
        thread.start()
        thread.join()
    torch.testing.assert_close(got["x"], want, atol=ATOL, rtol=ATOL)
