"""The rejection sampler on synthetic distributions: exact greedy cases, distribution, determinism."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import cluster.core.rejection as rejection
from cluster.core.rejection import rejection_sample
from cluster.core.sampling import SamplingParams, probabilities

GREEDY = SamplingParams(max_tokens=8)
V = 8


def one_hot_logits(ids: list[int], vocab: int = V) -> torch.Tensor:
    logits = torch.zeros(len(ids), vocab)  # [n, vocab]
    for i, t in enumerate(ids):
        logits[i, t] = 5.0
    return logits


def test_greedy_perfect_match_gives_bonus():
    result = rejection_sample([1, 2, 3], one_hot_logits([1, 2, 3, 4]), None, GREEDY, 10)
    assert result.num_accepted == 3 and result.output_token_ids == [1, 2, 3, 4]
    assert result.bonus and not result.recovered


def test_greedy_early_mismatch_recovers():
    result = rejection_sample([1, 2, 3], one_hot_logits([1, 5, 3, 4]), None, GREEDY, 10)
    assert result.num_accepted == 1 and result.output_token_ids == [1, 5]
    assert result.recovered and not result.bonus


def test_greedy_all_rejected():
    result = rejection_sample([1, 2, 3], one_hot_logits([0, 2, 3, 4]), None, GREEDY, 10)
    assert result.num_accepted == 0 and result.output_token_ids == [0] and result.recovered


def test_greedy_without_bonus_row_returns_only_accepted():
    result = rejection_sample([1, 2], one_hot_logits([1, 2]), None, GREEDY, 0)
    assert result.num_accepted == 2 and result.output_token_ids == [1, 2] and not result.bonus


def test_no_drafts_is_plain_decoding():
    result = rejection_sample([], one_hot_logits([6]), None, GREEDY, 0)
    assert result.num_accepted == 0 and result.output_token_ids == [6] and result.bonus


def test_greedy_ignores_draft_probs():
    q = torch.full((2, V), 1.0 / V)
    result = rejection_sample([1, 7], one_hot_logits([1, 2, 3]), q, GREEDY, 0)
    assert result.output_token_ids == [1, 2]


def test_malformed_inputs_are_refused():
    with pytest.raises(ValueError, match="rows"):
        rejection_sample([1, 2, 3], one_hot_logits([1]), None, GREEDY, 0)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample([1, 2], one_hot_logits([1, 2, 3]), torch.ones(3, V) / V, GREEDY, 0)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    q = torch.zeros(1, V)
    q[0, 2] = 1.0
    with pytest.raises(ValueError, match="probability 0"):
        rejection_sample([1], one_hot_logits([1, 2]), q, sampled, 0)


# -- distribution ---------------------------------------------------------------------------------

FALSE_ALARM = 1e-3  # each goodness-of-fit test wrongly fails once in a thousand runs
N_SAMPLES = 6000


def _first_token_counts(target_logits, draft_logits, params, k, deterministic, n=N_SAMPLES, seed=0):
    """Run the sampler n times with fresh request seeds; count the first output token."""
    rng = np.random.default_rng(seed)
    q = probabilities(draft_logits, params)  # [k, V]
    counts = np.zeros(target_logits.shape[-1])
    for i in range(n):
        drafts = [int(rng.choice(V, p=q[j].double().numpy() / q[j].double().sum().item())) for j in range(k)]
        if deterministic:
            drafts = [int(draft_logits[j].argmax()) for j in range(k)]
        params_i = params.model_copy(update={"seed": i + 1000 * seed})
        result = rejection_sample(drafts, target_logits, None if deterministic else q, params_i, 0)
        counts[result.output_token_ids[0]] += 1
    return counts


def _assert_matches(counts, expected_probs, min_expected=5.0):
    """Chi-square goodness of fit; categories expected fewer than `min_expected` times are pooled
    (the chi-square approximation needs it)."""
    p = expected_probs.double().numpy()
    support = p > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    expected = p / p.sum() * counts.sum()
    big = expected >= min_expected
    observed = list(counts[big]) + [counts[support & ~big].sum()]
    pooled = list(expected[big]) + [expected[support & ~big].sum()]
    if pooled[-1] == 0:
        observed, pooled = observed[:-1], pooled[:-1]
    stat = chisquare(observed, np.array(pooled) / np.sum(pooled) * np.sum(observed))
    assert stat.pvalue > FALSE_ALARM, f"distribution differs from the target: {stat}"
    return stat.pvalue


CASES = [
    ("plain", dict(temperature=1.0)),
    ("temperature", dict(temperature=0.6)),
    ("top_k", dict(temperature=1.0, top_k=4)),
    ("top_p", dict(temperature=1.2, top_p=0.9)),
]


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_sampled_first_token_follows_target(name, kw):
    torch.manual_seed(zlib.crc32(name.encode()))  # stable across runs
    target_logits = torch.randn(3, V) * 1.5  # [k + 1, V]
    draft_logits = torch.randn(2, V) * 1.5  # [k, V]
    draft_logits[0, 0] = -1e9  # q = 0 where p > 0: only the residual can produce token 0
    params = SamplingParams(max_tokens=8, **kw)
    counts = _first_token_counts(target_logits, draft_logits, params, k=2, deterministic=False)
    p0 = probabilities(target_logits[:1], params)[0]
    assert (p0 > 0).sum() >= 3, "a degenerate case tests nothing"
    _assert_matches(counts, p0)
    if p0[0] > 0.01:
        assert counts[0] > 0


def test_deterministic_proposer_sampling_follows_target():
    torch.manual_seed(7)
    target_logits = torch.randn(2, V) * 2
    draft_logits = torch.randn(1, V) * 2
    params = SamplingParams(max_tokens=8, temperature=1.0)
    counts = _first_token_counts(target_logits, draft_logits, params, k=1, deterministic=True)
    _assert_matches(counts, probabilities(target_logits[:1], params)[0])


def test_second_token_after_acceptance_follows_target():
    """Accepted first token, then the bonus: the bonus follows p at position 1."""
    torch.manual_seed(3)
    target_logits = torch.randn(2, V) * 2
    params = SamplingParams(max_tokens=8, temperature=1.0)
    counts = np.zeros(V)
    for i in range(N_SAMPLES):
        result = rejection_sample([2], target_logits, None, params.model_copy(update={"seed": i}), 0)
        if result.num_accepted == 1:
            counts[result.output_token_ids[1]] += 1
    _assert_matches(counts, probabilities(target_logits[1:], params)[0])


def test_the_statistical_test_catches_a_wrong_residual(monkeypatch):
    """Power check: resampling from p instead of norm(max(0, p - q)) must be detected."""
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    torch.manual_seed(11)
    target_logits = torch.randn(2, V) * 2
    draft_logits = torch.randn(1, V) * 2
    params = SamplingParams(max_tokens=8, temperature=1.0)
    counts = _first_token_counts(target_logits, draft_logits, params, k=1, deterministic=False)
    p0 = probabilities(target_logits[:1], params)[0].double().numpy()
    assert chisquare(counts, p0 / p0.sum() * counts.sum()).pvalue < 1e-6


def test_seeded_results_are_reproducible():
    torch.manual_seed(5)
    target_logits = torch.randn(4, V)
    q = probabilities(torch.randn(3, V), SamplingParams(temperature=1.0))
    outs = []
    for seed in (42, 42, 43, 44, 45, 46):
        params = SamplingParams(temperature=1.0, seed=seed)
        outs.append(rejection_sample([1, 2, 3], target_logits, q, params, 17).output_token_ids)
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[1:]}) > 1
