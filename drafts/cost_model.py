"""The speculative cost model, in target-step units: one place for every prediction.

With per-token acceptance α, γ drafts per round, cost ratio c = t_draft / t_target (per token) and
v the extra verify cost per draft (as a fraction of one target step):

- expected tokens per verification round  E(α, γ) = (1 − α^(γ+1)) / (1 − α)   (Leviathan et al. 2023)
- sequential speculation, time per round   1 + γ·(c + v)
- pipelined (draft overlapped with verify)  max(1 + γ·v, γ·c)
- predicted speedup over plain decoding    E / time per round

Used by the draft-length policy (`drafts/policy.py`), the benchmarks (`tools/bench.py`,
`tools/bench_distributed.py`), draft validation (`drafts/training/validate.py`) and the pipeline model.
"""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens committed per round (accepted drafts + the recovered or bonus token)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def effective_alpha(tokens_per_round: float, gamma: int) -> float:
    """The α for which E(α, γ) equals the measured tokens per round (bisection).

    Acceptances are not independent across draft positions (easy stretches are accepted whole), so
    neither accepted ÷ drafted nor the first-position rate reproduces the measured E; this does.
    """
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2


def round_time(gamma: int, cost_ratio: float, pipelined: bool = False, verify_token_cost: float = 0.0) -> float:
    """One round of γ drafts, in target steps: drafting then verifying (sequential), or the slower of
    the two when they overlap (pipelined)."""
    if pipelined:
        return max(1.0 + gamma * verify_token_cost, gamma * cost_ratio)
    return 1.0 + gamma * (cost_ratio + verify_token_cost)


def speedup_from_tokens(tokens_per_round: float, gamma: int, cost_ratio: float, pipelined: bool = False,
                        verify_token_cost: float = 0.0) -> float:
    """Tokens per unit of target-step time for a measured (or expected) number of tokens per round."""
    return tokens_per_round / round_time(gamma, cost_ratio, pipelined, verify_token_cost)


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float, pipelined: bool = False,
                      verify_token_cost: float = 0.0) -> float:
    """Tokens per unit of target-step time, relative to plain decoding (γ = 0 is plain decoding: 1)."""
    if gamma == 0:
        return 1.0
    return speedup_from_tokens(expected_tokens(alpha, gamma), gamma, cost_ratio, pipelined, verify_token_cost)
