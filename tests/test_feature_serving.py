"""The feature-fed draft served: the verifier sends the target's last hidden state of committed positions
(only to sessions whose draft reads them), the loop hands them to the drafter, and the output stays the
target's: greedy equality against transformers (fp32) in process, sequential and pipelined, alone and
inside the hybrid; the sampled distribution is the target's; the features equal the target's own."""

from __future__ import annotations

import pytest
import torch

from cluster.core.config import EngineConfig
from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import Round, VerifierEngine
from cluster.session.speculate import SpeculativeDecoder
from cluster.wire.codec import features_from_pb, features_to_pb
from drafts.factory import make_proposer
from drafts.routing import needs_features
from drafts.feature_model import FeatureDraft
from drafts.feature_proposer import FeatureProposer
from drafts.hybrid import MODEL, HybridProposer
from protos import pb
from tests.helpers import tiny_llama, torch_threads
from tests.test_sampling_e2e import FALSE_ALARM, chi_square_pvalue, exact_continuation_probs

MAX_TOKENS = 40
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("Write a short poem about the moon.", True),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def feature_proposer(target_fp32, tokenizer):
    """The shipped feature-fed draft (`engine.draft: feature`), as the engine builds it."""
    config = EngineConfig.build(proposer="draft", draft="feature", dtype="float32")
    assert needs_features(config) and not needs_features(EngineConfig.build(proposer="draft"))
    proposer = make_proposer(config, target_fp32, tokenizer)
    assert isinstance(proposer, FeatureProposer) and proposer.needs_features
    return proposer


@pytest.mark.parametrize("loop", [{}, {"pipeline_depth": 2, "overlap": True}], ids=["sequential", "pipelined"])
def test_greedy_equals_transformers(target_fp32, feature_proposer, tokenizer, prompt_ids, references, loop):
    decoder = SpeculativeDecoder(TorchModelRunner(target_fp32, name="target"), feature_proposer, tokenizer, 3, **loop)
    drafted = accepted = 0
    for ids in prompt_ids:
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(ids)][: len(result.token_ids)], f"diverged on {ids[:6]}"
        assert len(result.token_ids) == MAX_TOKENS or result.finish_reason == "stop"
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert feature_proposer.proposals_without_features == 0, "every round had the target's features"
    assert feature_proposer.num_sessions == 0
    # the trained draft reads the features: far better than chance on code (its α is ~0.5 at position 1)
    assert drafted > 0 and accepted / drafted > 0.15, (accepted, drafted)


def test_hybrid_over_the_feature_draft(target_fp32, tokenizer, prompt_ids, references):
    hybrid = make_proposer(EngineConfig.build(proposer="hybrid", draft="feature", dtype="float32"),
                           target_fp32, tokenizer)
    assert isinstance(hybrid, HybridProposer) and hybrid.needs_features
    decoder = SpeculativeDecoder(TorchModelRunner(target_fp32, name="target"), hybrid, tokenizer, 3)
    for ids in prompt_ids:
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(ids)][: len(result.token_ids)]
    report = hybrid.report()
    assert report[MODEL]["rounds"] > 0 and report[MODEL]["accepted"] > 0, report
    assert hybrid.model.proposals_without_features == 0


def test_features_are_the_targets_and_travel_only_when_asked(target_fp32, tokenizer):
    """Engine level: a session opened with features gets, with its prefill and every round, the target's
    last hidden state of exactly the committed positions fed (equal to a plain forward over the committed
    tokens); a session opened without gets none, and nothing is captured for it."""
    engine = VerifierEngine(TorchModelRunner(target_fp32, name="target"))
    ids = tokenizer("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")["input_ids"]
    params = SamplingParams(max_tokens=64)
    truth = target_fp32.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0].tolist()
    n, prompt_features = engine.open("f", ids, params, features=True)[:2]
    assert engine.open("plain", ids, params)[1] is None
    assert prompt_features.shape == (len(ids) - 1, target_fp32.config.hidden_size)
    log = {0: prompt_features}
    committed = list(ids)
    results = []
    drafts = [truth[n:n + 3], [truth[n + 4], 0], [], truth[n + 6:n + 8]]  # accepted, half-rejected, plain, ...
    for r, draft in enumerate(drafts):
        start = len(committed)
        draft = draft if committed == truth[:start] else []
        for sid in ("f", "plain"):
            engine.submit(Round(sid, r, engine._sessions[sid].epoch, draft, None, True), results.append)
        engine.step()
        got, plain = results[-2:] if results[-2].session == "f" else results[-2:][::-1]
        assert plain.features is None and got.features is not None
        assert got.output_token_ids == plain.output_token_ids
        committed += got.output_token_ids
        assert got.feature_start == start - 1 and len(got.features) == 1 + got.num_accepted
        log[got.feature_start] = got.features
    assert "plain" not in engine.runner.capture and "plain" not in engine.runner.hidden
    rows = torch.cat([log[k] for k in sorted(log)])  # [len(committed) - 1, H]
    assert [k for k in sorted(log)] == [0] + [sum(map(len, list(log.values())[:i])) for i in range(1, len(log))]
    with torch.no_grad():
        expected = target_fp32.model(input_ids=torch.tensor([committed])).last_hidden_state[0, :-1]
    assert rows.shape == expected.shape
    torch.testing.assert_close(rows.float(), expected, atol=0.05, rtol=0.02)  # bf16 on the wire
    assert committed == truth[: len(committed)]


def test_features_cross_the_wire_and_malformed_ones_are_refused():
    rows = torch.randn(5, 7).bfloat16()
    start, back = features_from_pb(pb.VerifyResult.FromString(
        pb.VerifyResult(features=features_to_pb(11, rows)).SerializeToString()).features)
    assert start == 11 and torch.equal(back, rows)
    bad = features_to_pb(0, rows)
    bad.rows = 6
    with pytest.raises(InvalidRequestError):
        features_from_pb(bad)


def test_a_runner_without_features_refuses_a_feature_session(target_fp32):
    engine = VerifierEngine(TorchModelRunner(target_fp32, name="target"))
    engine.runner.__class__ = type("NoFeatureRunner", (TorchModelRunner,), {"supports_features": False})
    with pytest.raises(InvalidRequestError, match="cannot send features"):
        engine.open("s", [1, 2, 3], SamplingParams(max_tokens=4), features=True)


# -- sampling: the distribution is the target's --------------------------------------------------

@pytest.mark.parametrize("loop", [{}, {"pipeline_depth": 2}], ids=["sequential", "pipelined"])
def test_sampling_follows_target(loop):
    """A feature-fed draft made from a tiny target (reduced vocabulary: 8 of its 10 tokens, untrained)."""
    target = tiny_llama(seed=1)
    torch.manual_seed(3)
    draft = FeatureDraft(target, torch.arange(8)).eval()
    with torch.no_grad():
        draft.fc.weight.add_(0.3 * torch.randn_like(draft.fc.weight))
    proposer = FeatureProposer(draft)
    decoder = SpeculativeDecoder(TorchModelRunner(target), proposer, None, 3, **loop)
    prompt, params = [1, 4, 2, 7], SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, prompt, 3, params)
    samples = [tuple(decoder.generate(prompt, params.model_copy(update={"seed": i, "max_tokens": 3})).token_ids)
               for i in range(1500)]
    stats = decoder.metrics
    assert stats.rounds > 1500 and proposer.proposals_without_features == 0
    assert chi_square_pvalue(samples, exact) > FALSE_ALARM


# -- the shipped draft: provenance, and it validates above a threshold on held-out prompts -----------

def test_shipped_draft_provenance_and_validate_gate(target_fp32, tokenizer):
    import json

    from cluster.core.workloads import humaneval_prompts
    from drafts.feature_proposer import SHIPPED
    from drafts.training.validate import Agreement, replay_rounds, validate

    meta = json.loads((SHIPPED / "tandem_draft.json").read_text())
    assert meta["kind"] == "feature" and "drafts distill --kind feature" in meta["command"]
    assert meta["steps"] > 0 and "seed" in meta and "HumanEval" in meta["data"]["held_out"]
    assert (SHIPPED / "draft.safetensors").stat().st_size <= 20 * 2**20
    assert {"humaneval", "chat"} <= set(meta["validate"]), "its `drafts validate` report travels with it"

    proposer = make_proposer(EngineConfig.build(draft="feature", dtype="float32"), target_fp32, tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()[:2]]  # held out of its training data
    report = validate(target_fp32, proposer, prompts, max_tokens=24, max_gamma=3)
    assert report["alpha"] >= 0.3, report["alpha"]  # the CLI's --min-acceptance gate, at a CI threshold
    assert 0 < report["cost_ratio"] < 0.5 and proposer.num_sessions == 0
    # rounds are replayed from each position's run of right drafts (its later drafts read its own features)
    record = Agreement([5, 6, 7, 8], [True, True, False, True], runs=[1, 0, 0, 1])
    assert replay_rounds(record, 3) == ([2, 1, 1], [1, 0, 0], 3)  # pos 0: run 1 (+1), pos 2: 0 (+1), pos 3: last


def test_dynamic_tree_greedy_equals_transformers(target_fp32, tokenizer, prompt_ids, references):
    """EAGLE-2's dynamic tree from the feature-fed draft (sequential rounds): the output stays the target's,
    every round is a tree within its budget, and the tree accepts more per round than the draft's chain."""
    per_round = {}
    for width in (1, 4):
        proposer = make_proposer(EngineConfig.build(proposer="draft", draft="feature", dtype="float32",
                                                    tree_width=width, tree_tokens=12), target_fp32, tokenizer)
        decoder = SpeculativeDecoder(TorchModelRunner(target_fp32, name="target"), proposer, tokenizer, 3)
        committed = rounds = 0
        for ids in prompt_ids:
            result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
            assert result.token_ids == references[tuple(ids)][: len(result.token_ids)], f"diverged on {ids[:6]}"
            committed, rounds = committed + len(result.token_ids), rounds + result.stats.rounds
        assert proposer.proposals_without_features == 0 and proposer.num_sessions == 0
        if width > 1:
            assert decoder.metrics.tree_rounds > 0.8 * rounds, (decoder.metrics.tree_rounds, rounds)
        per_round[width] = committed / rounds
    assert per_round[4] > per_round[1], per_round
