"""Sampled output of the whole speculation loop follows the target's distribution.

Exact distributions come from enumerating every continuation; a chi-square test with a false-alarm
rate of 1e-3 compares them with sampled continuations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import cluster.core.rejection as rejection
from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.core.sampling import SamplingParams, probabilities
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer
from drafts.ngram import NGramProposer, SuffixProposer
from tests.helpers import tiny_llama

FALSE_ALARM = 1e-3


def exact_continuation_probs(model, prompt: list[int], length: int, params: SamplingParams) -> dict[tuple, float]:
    """P(continuation) for every continuation of `length` tokens, by enumeration."""
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            prefixes = list(probs)
            batch = torch.tensor([prompt + list(p) for p in prefixes])
            nxt = probabilities(model(batch).logits[:, -1], params)  # [len(prefixes), vocab]
            probs = {p + (t,): probs[p] * float(nxt[i, t]) for i, p in enumerate(prefixes) for t in range(vocab)
                     if nxt[i, t] > 0}
    return probs


def chi_square_pvalue(samples: list[tuple], exact: dict[tuple, float], min_expected: float = 5.0) -> float:
    n = len(samples)
    assert all(s in exact for s in samples), "sampled a continuation the target gives probability 0"
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for seq, p in exact.items():
        if p * n >= min_expected:
            observed.append(counts.get(seq, 0))
            expected.append(p * n)
        else:  # pool rare continuations into one bin
            rest_obs += counts.get(seq, 0)
            rest_exp += p * n
    observed.append(rest_obs)
    expected.append(rest_exp)
    expected = np.array(expected) * n / np.sum(expected)
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_llama(seed=1), tiny_llama(seed=2)


PROMPT = [1, 4, 2, 7]


def _sample_many(target_model, proposer_factory, params, n, length, gamma, **loop):
    decoder = SpeculativeDecoder(TorchModelRunner(target_model, prompt_cache_tokens=PROMPT_CACHE_TOKENS), proposer_factory(), None, gamma, **loop)
    return [tuple(decoder.generate(PROMPT, params.model_copy(update={"seed": i, "max_tokens": length})).token_ids)
            for i in range(n)]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.85)],
                         ids=["plain", "top_k", "top_p"])
def test_draft_model_speculation_follows_target(tiny_pair, kw):
    target, draft = tiny_pair
    params = SamplingParams(**kw)
    exact = exact_continuation_probs(target, PROMPT, 3, params)
    samples = _sample_many(target, lambda: DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS)), params, 2500, 3, gamma=2)
    assert chi_square_pvalue(samples, exact) > FALSE_ALARM


@pytest.mark.parametrize("proposer", [NGramProposer, SuffixProposer])
def test_ngram_speculation_follows_target(tiny_pair, proposer):
    target, _ = tiny_pair
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, PROMPT, 3, params)
    decoder = SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=PROMPT_CACHE_TOKENS), proposer(), None, 3)
    results = [decoder.generate(PROMPT, params.model_copy(update={"seed": i, "max_tokens": 3})) for i in range(2500)]
    drafted, accepted = sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
    assert drafted > 100 and 0 < accepted < drafted  # matches of the prompt were drafted, both paths ran
    assert chi_square_pvalue([tuple(r.token_ids) for r in results], exact) > FALSE_ALARM


@pytest.mark.parametrize("gamma", [2])
def test_pipelined_loop_sampling_follows_target(tiny_pair, gamma):
    """Depth-2 chain with bubble filling (first drafts tested against the previous round's last row,
    plain steps whose redraft continues on a match): four tokens against the exact distribution."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, PROMPT, 4, params)
    decoder = SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=PROMPT_CACHE_TOKENS), DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS)), None, gamma,
                                 pipeline_depth=2, overlap=True, fill_min_redraft=0.0)  # fills not left to timing
    samples = [tuple(decoder.generate(PROMPT, params.model_copy(update={"seed": i, "max_tokens": 4})).token_ids)
               for i in range(2000)]
    m = decoder.metrics
    assert m.bubble_fill_hits > 0 and m.bubble_fill_misses > 0 and m.stale_rounds > 0  # every path of the chain ran
    assert chi_square_pvalue(samples, exact) > FALSE_ALARM


def test_token_tree_rounds_sampling_follows_target(tiny_pair):
    """Sequential rounds as token trees: a sampled first draft plus the draft's next most likely token
    as a deterministic sibling (one-hot row), then a sampled chain."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, PROMPT, 3, params)
    decoder = SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=PROMPT_CACHE_TOKENS), DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS), tree_width=2),
                                 None, 2)
    samples = [tuple(decoder.generate(PROMPT, params.model_copy(update={"seed": i, "max_tokens": 3})).token_ids)
               for i in range(2500)]
    m = decoder.metrics
    assert m.tree_rounds > 0 and m.tree_branch_hits > 0.02 * m.tree_rounds  # siblings do win
    assert chi_square_pvalue(samples, exact) > FALSE_ALARM


def test_end_to_end_test_catches_a_wrong_residual(tiny_pair, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, PROMPT, 3, params)
    samples = _sample_many(target, lambda: DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS)), params, 2500, 3, gamma=2)
    assert chi_square_pvalue(samples, exact) < 1e-6


def test_smollm2_sampling_with_int8_draft_follows_target(target_fp32, draft_int8, tokenizer, engine_fp32):
    """The real model: two sampled tokens (top-k 4) against the exact two-token distribution."""
    prompt = tokenizer("My favourite colour is")["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=4)
    exact = exact_continuation_probs(target_fp32, prompt, 2, params)
    target = TorchModelRunner(engine_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS)
    decoder = SpeculativeDecoder(target, DraftModelProposer(TorchModelRunner(draft_int8, prompt_cache_tokens=PROMPT_CACHE_TOKENS)), tokenizer, 4)
    samples = [tuple(decoder.generate(prompt, params.model_copy(update={"seed": i, "max_tokens": 2})).token_ids)
               for i in range(200)]
    assert decoder.proposer is not None
    assert chi_square_pvalue(samples, exact) > FALSE_ALARM


def test_seeded_request_is_reproducible(tiny_pair):
    target, draft = tiny_pair
    decoder = SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=PROMPT_CACHE_TOKENS), DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS)), None, 3)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    runs = [decoder.generate(PROMPT, params.model_copy(update={"seed": s})).token_ids for s in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
