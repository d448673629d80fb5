"""The pipeline model that BENCHMARKS.md holds the distributed runtime to: checked against closed forms."""

from __future__ import annotations

import pytest

from drafts.cost_model import predicted_speedup
from drafts.pipeline_model import pipelined_ceiling, simulate_pipelined, simulate_sequential


@pytest.mark.parametrize("alpha,c,gamma", [(0.86, 0.46, 3), (0.6, 0.1, 5), (0.95, 0.3, 2)])
def test_sequential_matches_the_closed_form(alpha, c, gamma):
    assert simulate_sequential(alpha, c, gamma) == pytest.approx(predicted_speedup(alpha, gamma, c), rel=0.02)


@pytest.mark.parametrize("c,gamma", [(0.3, 3), (0.5, 4), (0.2, 2)])
def test_all_accepted_pipeline_runs_at_the_slower_side(c, gamma):
    # no rejections: γ tokens per round, one round per max(verify step, γ drafts)
    assert simulate_pipelined(1.0, c, gamma) == pytest.approx(gamma / max(1.0, gamma * c), rel=0.01)


def test_rejections_keep_the_pipeline_below_the_closed_form_bound():
    alpha, c, gamma = 0.86, 0.46, 3
    ceiling = pipelined_ceiling(alpha, c, gamma)
    assert ceiling["pipelined_speedup"] < 0.75 * predicted_speedup(alpha, gamma, c, pipelined=True)
    assert 1.0 < ceiling["pipelined_over_sequential"] < 1.3


def test_filling_bubbles_helps_and_never_hurts_at_full_acceptance():
    assert simulate_pipelined(0.8, 0.4, 2, fill_bubbles=True) > simulate_pipelined(0.8, 0.4, 2, fill_bubbles=False)
    assert simulate_pipelined(1.0, 0.4, 2, fill_bubbles=True) == simulate_pipelined(1.0, 0.4, 2, fill_bubbles=False)
    with pytest.raises(ValueError):
        simulate_pipelined(0.8, 0.4, 2, depth=1)
