"""The draft-length policy (γ per session from the cost model) and the pools' autoscaling policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deployments.autoscaling import session_pool_policy
from drafts.cost_model import expected_tokens, predicted_speedup
from drafts.policy import SpeculationPolicy, SpeculationPolicyConfig


def test_cost_model_formulas():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert predicted_speedup(0.8, 3, 0.1) == pytest.approx(expected_tokens(0.8, 3) / 1.3)
    assert predicted_speedup(0.8, 3, 0.5, pipelined=True) == pytest.approx(expected_tokens(0.8, 3) / 1.5)
    assert predicted_speedup(0.8, 0, 0.1) == 1.0


def test_gamma_grows_with_an_always_right_drafter_and_falls_to_zero_with_an_always_wrong_one():
    policy = SpeculationPolicy(SpeculationPolicyConfig(prior_acceptance=0.5, probe_every=1000), max_gamma=8)
    right, wrong = policy.session(), policy.session()
    start = right.gamma(remaining=100, cost_ratio=0.1)
    for _ in range(20):
        g = right.gamma(remaining=100, cost_ratio=0.1)
        right.learn(g, g)
    assert right.gamma(remaining=100, cost_ratio=0.1) == 8 > start
    for _ in range(20):
        g = wrong.gamma(remaining=100, cost_ratio=0.1)
        wrong.learn(g, 0)
    assert wrong.alpha < 0.2 and wrong.gamma(remaining=100, cost_ratio=0.1) == 0


def test_plain_decoding_when_speculation_cannot_pay():
    config = SpeculationPolicyConfig(saturation_sessions=8, min_remaining_tokens=3, probe_every=4)
    session = SpeculationPolicy(config, max_gamma=4).session()
    assert session.gamma(remaining=100, cost_ratio=0.1) > 0
    assert session.gamma(remaining=100, cost_ratio=0.1, verifier_sessions=8) == 0  # saturated verifiers
    assert session.gamma(remaining=2, cost_ratio=0.1) == 0  # too short to gain
    assert session.gamma(remaining=100, cost_ratio=2.0) == 0  # a draft slower than the target
    # a session at γ = 0 probes with one draft every `probe_every` rounds, so α can recover
    slow = [session.gamma(remaining=100, cost_ratio=2.0) for _ in range(8)]
    assert slow.count(1) == 2 and set(slow) == {0, 1}
    assert SpeculationPolicy(SpeculationPolicyConfig(adaptive=False), 4).session().gamma(100, cost_ratio=9) == 4
    fixed = SpeculationPolicy(SpeculationPolicyConfig(adaptive=False, saturation_sessions=8), 4).session()
    assert fixed.gamma(100, cost_ratio=9, verifier_sessions=7) == 4 and fixed.gamma(100, verifier_sessions=8) == 0


def test_the_measured_verify_cost_curve_decides_whether_speculation_pays():
    """v fitted from the verify times of rounds of different sizes (`CostEstimates`): where every drafted
    row costs a good part of a step (torch's bf16 matmuls on a CPU without native bf16), plain decoding;
    where a forward of a few tokens costs what one does, speculation."""
    from cluster.session.loop_state import CostEstimates

    steep, flat = CostEstimates(), CostEstimates()
    assert steep.verify_token_cost is None
    steep.record_verify(0.050, 0)
    assert steep.verify_token_cost is None and steep.step_s == pytest.approx(0.050)  # one size: no curve yet
    steep.record_verify(0.140, 3)
    flat.record_verify(0.050, 0)
    flat.record_verify(0.053, 3)
    assert steep.verify_token_cost == pytest.approx(0.6) and steep.step_s == pytest.approx(0.050)
    assert flat.verify_token_cost == pytest.approx(0.02)
    steep.record_draft(0.010, 2)
    assert steep.cost_ratio == pytest.approx(0.1)  # c over the fitted one-token step, not the mean forward
    session = SpeculationPolicy(SpeculationPolicyConfig(prior_acceptance=0.7), max_gamma=3).session()
    assert session.gamma(100, cost_ratio=0.05) == 3  # the prior v (0.03)
    assert session.gamma(100, cost_ratio=0.05, verify_token_cost=flat.verify_token_cost) == 3
    assert session.gamma(100, cost_ratio=0.05, verify_token_cost=steep.verify_token_cost) == 0


def test_the_loop_measures_the_verify_cost_curve(target_fp32, draft_int8, tokenizer):
    """An adaptive session sees at least two round sizes (when all its rounds are one size it spends one
    plain round for a second), so the curve is fitted; the output is the target's either way."""
    from cluster.model.runner import TorchModelRunner
    from cluster.core.sampling import SamplingParams
    from cluster.session.speculate import SpeculativeDecoder
    from drafts.draft_model import DraftModelProposer
    from tests.helpers import greedy_references

    prompt = tokenizer.encode("def add(a, b):\n    return")
    decoder = SpeculativeDecoder(TorchModelRunner(target_fp32, name="target"),
                                 DraftModelProposer(TorchModelRunner(draft_int8, name="draft")), tokenizer, 3,
                                 policy=SpeculationPolicy(SpeculationPolicyConfig(prior_acceptance=0.9), 3))
    result = decoder.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    reference = greedy_references(target_fp32, [prompt], 24)[tuple(prompt)]
    assert len(reference) > 8 and result.token_ids[: len(reference)] == reference
    assert len(decoder.estimates.verify_by_drafts) >= 2  # a plain round, or γ chosen smaller on its own
    assert decoder.estimates.verify_token_cost is not None


def test_pipelined_policy_prefers_longer_drafts_when_drafting_is_cheap_relative_to_verify():
    sequential = SpeculationPolicy(SpeculationPolicyConfig(), max_gamma=8, pipelined=False)
    pipelined = SpeculationPolicy(SpeculationPolicyConfig(), max_gamma=8, pipelined=True)
    g_seq, s_seq = sequential.best_gamma(0.8, 0.2)
    g_pipe, s_pipe = pipelined.best_gamma(0.8, 0.2)
    assert g_pipe >= g_seq and s_pipe > s_seq


def _ctx(current=2, total=10.0, queued=0.0, target=8.0, metrics=None):
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current, total_num_requests=total,
                           total_queued_requests=queued, aggregated_metrics=metrics or {},
                           config=SimpleNamespace(get_target_ongoing_requests=lambda: target))


def test_session_pool_autoscaling_policy():
    assert session_pool_policy(_ctx(total=32.0))[0] == pytest.approx(4.0)  # sessions / target per replica
    assert session_pool_policy(_ctx(total=4.0))[0] == pytest.approx(0.5)  # Serve clamps to min_replicas
    assert session_pool_policy(_ctx(total=10.0, queued=2.0))[0] == 3  # queued sessions: one more now
    backlog = {"drafting_backlog": {"r1": 20.0, "r2": 12.0}}
    assert session_pool_policy(_ctx(total=4.0, metrics=backlog))[0] == 3
    assert session_pool_policy(_ctx(total=4.0, metrics={"drafting_backlog": {"r1": 1.0}}))[0] == pytest.approx(0.5)
