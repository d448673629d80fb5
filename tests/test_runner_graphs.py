"""The torch runner's CUDA-graph slots (cluster/model/graphs.py), checked on CPU: the static one-token
forward a graph captures (fixed buffers, a device write position, a 4-D mask over the whole capacity)
runs eagerly here, and must give transformers' greedy output (fp32) for plain decoding and as a draft
runner that rolls back; sessions past the capacity, or finding every slot taken, decode eagerly and are
counted; a released session's slot serves the next one. Capture and replay need a GPU: the GPU check's
`runner_graphs` section (tools/gpu_check)."""

from __future__ import annotations

import pytest
import torch

from cluster.core.sampling import SamplingParams
from cluster.model.graphs import GraphedDecode
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer

MAX_TOKENS = 24
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Once upon a time, in a small village by the sea,", False),
    ("What is the capital of France?", True),
]


def _plain(runner, ids):
    return SpeculativeDecoder(runner, None, None, 4).generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids


def test_static_step_plain_decoding_equals_transformers(target_fp32, prompt_ids, references):
    runner = TorchModelRunner(target_fp32, "graphed", cuda_graphs=2, capture=False, graph_capacity=128)
    assert runner.graphs is not None and not runner.graphs.capture  # no CUDA here: the same forward, eagerly
    for ids in prompt_ids:
        assert _plain(runner, ids) == references[tuple(ids)]
    stats = runner.graphs.stats.as_dict()
    assert stats["eager_steps"] >= len(prompt_ids) * (MAX_TOKENS // 2)  # the one-token steps took the static path
    assert stats["no_slot"] == 0 and not stats["slots_lost"] and runner.num_sessions == 0


def test_speculation_with_slots_on_both_sides_stays_exact(target_fp32, prompt_ids, references):
    """The target verifies each chain of γ + 1 = 5 tokens with the static forward of 5 (one mask row per
    token), the draft drafts with the one-token one; rejected tokens are rolled back (cursor only) and
    rewritten at the same positions. The output is transformers' greedy."""
    target = TorchModelRunner(target_fp32, "target", cuda_graphs=1, capture=False, graph_capacity=128)
    draft = TorchModelRunner(target_fp32, "draft", cuda_graphs=1, capture=False, graph_capacity=128)
    proposers = {"the target's copy (always right)": DraftModelProposer(draft), "none (plain)": None}
    for name, proposer in proposers.items():
        decoder = SpeculativeDecoder(target, proposer, None, 4)
        ids = prompt_ids[2]  # the chat prompt (the others' one-token steps are the test above's)
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(ids)], name
    assert result.stats.drafted == 0
    assert target.graphs.stats.eager_steps > 0 and draft.graphs.stats.eager_steps > 0
    assert target.num_sessions == draft.num_sessions == 0 and not target.graphs.stats.slots_lost


def test_a_chain_through_the_static_forward_scores_each_position(target_fp32, prompt_ids, references):
    """extend() of 5 tokens through a slot returns the same 5 rows of logits as the eager runner."""
    ids, ref = prompt_ids[0], references[tuple(prompt_ids[0])]
    rows = {}
    for name, runner in (("eager", TorchModelRunner(target_fp32, "e")),
                         ("slot", TorchModelRunner(target_fp32, "s", cuda_graphs=1, capture=False, graph_capacity=128))):
        s = runner.add_session()
        runner.extend(s, ids)
        rows[name] = runner.extend(s, ref[:5])  # [5, V]
        assert runner.length(s) == len(ids) + 5
        if runner.graphs is not None:
            assert runner.graphs.stats.eager_steps == 1
        runner.release(s)
    torch.testing.assert_close(rows["slot"], rows["eager"], rtol=1e-4, atol=1e-4)
    assert rows["slot"].argmax(-1).tolist() == ref[1:6]


def test_sessions_past_the_capacity_or_without_a_slot_decode_eagerly(target_fp32, prompt_ids, references):
    longest = max(prompt_ids, key=len)
    runner = TorchModelRunner(target_fp32, "small", cuda_graphs=1, capture=False, graph_capacity=len(longest) + 4)
    assert _plain(runner, longest) == references[tuple(longest)]  # grows past the slot: given up, counted
    assert sum(runner.graphs.stats.slots_lost.values()) == 1
    a, b = runner.add_session(), runner.add_session()  # the slot is free again; the second finds none
    assert runner.graphs.stats.no_slot == 1
    logits = {}
    for s in (a, b):
        runner.extend(s, prompt_ids[0])
        logits[s] = runner.extend(s, [references[tuple(prompt_ids[0])][0]])  # a: static step; b: eager
    torch.testing.assert_close(logits[a], logits[b], rtol=1e-4, atol=1e-4)
    assert logits[a].argmax() == logits[b].argmax()
    runner.release(a)
    runner.release(b)
    c = runner.add_session()
    assert runner.graphs._slot_of  # the released slot went to the next session
    runner.release(c)


def test_shared_prefix_stays_in_the_slot(target_fp32, prompt_ids, references):
    """`share_prefix` (n choices) copies into the slot's own buffers: the session keeps its slot."""
    runner = TorchModelRunner(target_fp32, "share", cuda_graphs=2, capture=False, graph_capacity=128)
    ids, ref = prompt_ids[1], references[tuple(prompt_ids[1])]
    a, b = runner.add_session(), runner.add_session()
    first = runner.extend(a, ids)[-1].argmax().item()
    runner.share_prefix(a, b, len(ids))
    before = runner.graphs.stats.eager_steps
    assert runner.extend(b, [first]).argmax().item() == ref[1] and first == ref[0]
    assert runner.graphs.stats.eager_steps == before + 1 and not runner.graphs.stats.slots_lost
    runner.release(a)
    runner.release(b)


def test_capture_needs_cuda(target_fp32, caplog):
    with pytest.raises(ValueError, match="CUDA"):
        GraphedDecode(target_fp32, 16, 1, capture=True)
    assert TorchModelRunner(target_fp32, "cpu", cuda_graphs=4).graphs is None  # the config's setting, on a CPU
    assert "cuda_graphs ignored" in caplog.text


def test_a_capture_that_fails_leaves_those_steps_eager(target_fp32, prompt_ids, references, monkeypatch, caplog):
    """Where a capture raises (on a GPU: e.g. another thread's kernels meanwhile), the step runs on the
    runner's eager path, logged and counted, and the output does not change."""
    runner = TorchModelRunner(target_fp32, "failing", cuda_graphs=1, capture=False, graph_capacity=128)
    runner.graphs.capture = True  # as on CUDA, with a capture that always fails

    def broken(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner.graphs, "_capture", broken)
    ids = prompt_ids[1]
    result = SpeculativeDecoder(runner, None, None, 4).generate(ids, SamplingParams(max_tokens=8))
    assert result.token_ids == references[tuple(ids)][:8]
    stats = runner.graphs.stats
    assert stats.capture_failures == 1 and stats.replays == 0 and stats.eager_steps == 0  # one failure per (slot, n)
    assert "capture of a 1-token step failed" in caplog.text



def _tiny_llama() -> torch.nn.Module:
    """A two-layer Llama with random weights (what the trace depends on is the code, not the weights or the size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_the_graphed_forward_reads_no_host_state(monkeypatch):
    """What a CUDA graph freezes, checked on CPU. A graph replays the kernels its capture launched: a value the
    forward computed on the host at capture (a cursor, a length, a branch on a tensor's value) is replayed
    as it was then. TorchDynamo traces the same way and says when a trace would not hold: each (slot, n)
    forward is traced at its first use, as it would be captured, with `fullgraph` (a graph break is a host
    sync or Python reading a tensor's value: a capture would fail) and no recompile allowed (a guard that
    fails at a later step is host state the forward read that has changed since: a replay would be wrong).
    The traced forwards then serve plain decoding and speculation with rollbacks, in two sessions after
    each other in the same slots, with the eager runner's greedy output."""
    import torch._dynamo

    model = _tiny_llama()
    eager = TorchModelRunner(model, "eager")
    prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (9, 23)]
    expected = [_plain(eager, ids) for ids in prompts]
    traced, calls = {}, []
    static_forward = GraphedDecode._static_forward

    def as_captured(self, cache, g, forward):
        if id(g) not in traced:  # a fresh code object per graph: Dynamo keeps its traces per code object
            def replay():
                return static_forward(self, cache, g, forward)
            replay.__code__ = replay.__code__.replace(co_name=f"graph_{len(traced)}")
            traced[id(g)] = (g.ids.shape[1], torch.compile(replay, fullgraph=True, backend="eager", dynamic=False))
        calls.append(id(g))
        return traced[id(g)][1]()

    monkeypatch.setattr(GraphedDecode, "_static_forward", as_captured)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            target = TorchModelRunner(model, "target", cuda_graphs=1, capture=False, graph_capacity=96)
            draft = TorchModelRunner(model, "draft", cuda_graphs=1, capture=False, graph_capacity=96)
            for proposer in (None, DraftModelProposer(draft)):
                for ids, want in zip(prompts, expected):
                    assert _plain(target, ids) == want if proposer is None else \
                        SpeculativeDecoder(target, proposer, None, 4).generate(
                            ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids == want
    finally:
        torch._dynamo.reset()
    sizes = sorted(n for n, _ in traced.values())
    assert sizes[:1] == [1] and 5 in sizes, sizes  # one-token steps (target and draft) and the chain of γ + 1
    assert len(calls) > 4 * len(traced) and not target.graphs.stats.slots_lost and not draft.graphs.stats.slots_lost
