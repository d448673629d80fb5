"""What the router's round policy can reach at best: a discrete-event model of one session.

The closed-form pipelined bound E / max(1, γc) assumes every round is accepted whole. It is not:
a rejection throws away the round drafted meanwhile and the drafter must start again from the
corrected token. This model plays the router's own policy (sequential rounds with a bonus token;
or `depth` rounds in flight without one, a plain step filling the bubble after each rejection)
with zero overhead, i.i.d. per-token acceptance α, a draft token costing c and any verify round
costing one target step. Its tokens per target step are the ceiling the real system is held to.
"""

from __future__ import annotations

import random
from collections import deque

from drafts.cost_model import round_time


def _accepted(rng: random.Random, alpha: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


def simulate_sequential(alpha: float, c: float, gamma: int, tokens: int = 50_000, seed: int = 0) -> float:
    """Tokens per target step of sequential speculation (draft γ, verify, bonus token)."""
    rng = random.Random(seed)
    produced, t = 0, 0.0
    while produced < tokens:
        produced += _accepted(rng, alpha, gamma) + 1
        t += round_time(gamma, c)
    return produced / t


def simulate_pipelined(alpha: float, c: float, gamma: int, depth: int = 2, fill_bubbles: bool = True,
                       tokens: int = 50_000, seed: int = 0) -> float:
    """Tokens per target step of the router's pipelined policy: up to `depth` rounds of γ drafts in flight
    (no bonus token: the next round's first draft is tested at the end of this one); the router drafts the
    next round while the verifier verifies; a rejection makes the rounds in flight stale (skipped at no
    cost) and, with `fill_bubbles`, a plain step runs while the drafter redrafts γ + 1 from the corrected
    token; the first redraft is checked against the step's token."""
    if depth < 2:
        raise ValueError("depth must be >= 2 (depth 1 is simulate_sequential)")
    rng = random.Random(seed)
    produced, t, verifier_free = 0, 0.0, 0.0
    in_flight: deque = deque()  # verify end times of live rounds
    after_rejection, ready = False, None  # ready: when already-drafted drafts of the next round are there

    def verify(at: float) -> None:
        nonlocal verifier_free
        start = max(at, verifier_free)
        verifier_free = start + 1.0
        in_flight.append(verifier_free)

    while produced < tokens:
        while len(in_flight) < depth:
            if after_rejection and fill_bubbles and not in_flight:
                start = max(t, verifier_free)  # the plain step
                verifier_free = t = start + 1.0
                drafted = start + (gamma + 1) * c  # the drafter redrafts γ + 1 meanwhile
                produced += 1
                if rng.random() < alpha:  # its first draft is the step's token: the rest is the next round
                    t = max(t, drafted)
                    verify(t)
                    after_rejection = False
                continue
            t = (ready if ready is not None else t) + gamma * c  # the router drafts, then sends
            ready = None
            verify(t)
        end = in_flight.popleft()
        t = max(t, end)
        n = _accepted(rng, alpha, gamma)
        if n == gamma:
            produced += gamma
        else:
            produced += n + 1
            in_flight.clear()  # stale: the verifier answers them without a forward
            verifier_free = t
            after_rejection = True
    return produced / t


def pipelined_ceiling(alpha: float, c: float, max_gamma: int, depth: int = 2, fill_bubbles: bool = True) -> dict:
    """The best γ ≤ max_gamma for the pipelined policy, and its speedup over target-only decoding."""
    best = max((simulate_pipelined(alpha, c, g, depth, fill_bubbles), g) for g in range(1, max_gamma + 1))
    seq = max((simulate_sequential(alpha, c, g), g) for g in range(1, max_gamma + 1))
    return {"pipelined_speedup": best[0], "pipelined_gamma": best[1],
            "sequential_speedup": seq[0], "sequential_gamma": seq[1],
            "pipelined_over_sequential": best[0] / seq[0]}
