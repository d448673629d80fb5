"""Logits processing matches transformers' warpers; parameters are validated at the edge."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import RandomStream, SamplingParams, probabilities, sample, uniform


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.8, 10, 0.9)])
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, scores.softmax(-1), atol=1e-6, rtol=1e-5)


def test_sample_is_position_keyed_and_never_picks_zero_probability():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = [sample(probs, seed=9, position=p, stream=RandomStream.TARGET) for p in range(200)]
    assert set(draws) == {1, 3}
    assert draws == [sample(probs, 9, p, RandomStream.TARGET) for p in range(200)]
    assert uniform(1, 2, RandomStream.ACCEPT) != uniform(1, 2, RandomStream.TARGET)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(max_tokens="many"), "max_tokens"),
    (dict(bogus=1), "bogus"),
])
def test_bad_sampling_params_give_one_clear_error(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.build(**kwargs)


def test_with_seed_fixes_a_seed_once():
    params = SamplingParams(temperature=1.0).with_seed()
    assert params.seed is not None and params.with_seed().seed == params.seed
