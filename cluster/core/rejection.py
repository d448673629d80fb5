"""The rejection sampler: a pure function of token ids and probabilities (no model, cache or RPC).

Leviathan et al. 2023 / Chen et al. 2023 speculative sampling: draft token d at a position is
accepted with probability min(1, p(d) / q(d)); on the first rejection a *recovered* token is drawn
from norm(max(0, p - q)); when every draft is accepted, a *bonus* token is drawn from the target's
distribution at the next position. A deterministic proposer (`draft_probs is None`) has q = one-hot.
Greedy decoding (temperature 0) accepts exactly the drafts that equal the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.core.sampling import RandomStream, SamplingParams, probabilities, sample, uniform


@dataclass(frozen=True)
class RejectionResult:
    num_accepted: int  # drafts accepted, a prefix of the proposal
    output_token_ids: list[int]  # the accepted drafts, then one recovered or bonus token (if any)
    recovered: bool  # True: the last output token replaces a rejected draft

    @property
    def bonus(self) -> bool:
        return not self.recovered and len(self.output_token_ids) > self.num_accepted


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q))  # [vocab_size]; p itself where p == q (rejection then has probability 0)."""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def rejection_sample(
    draft_token_ids: Sequence[int],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    start_position: int,
) -> RejectionResult:
    """Verify one round of drafts.

    draft_token_ids  # [k]
    target_logits    # [k + 1, vocab_size] (bonus row present) or [k, vocab_size] (no bonus:
                     #   the next round's first draft is tested against that distribution instead)
    draft_probs      # [k, vocab_size], already processed with `params`; None for a deterministic proposer
    start_position   # sequence position of draft_token_ids[0]; keys the random numbers
    """
    k = len(draft_token_ids)
    if target_logits.shape[0] not in (k, k + 1):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {k} drafts (want {k} or {k + 1})")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_logits.shape[-1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, want {(k, target_logits.shape[-1])}")
    has_bonus_row = target_logits.shape[0] == k + 1

    if params.greedy:
        target_ids = target_logits.argmax(dim=-1).tolist()  # [k(+1)]
        for i, d in enumerate(draft_token_ids):
            if d != target_ids[i]:
                return RejectionResult(i, [*draft_token_ids[:i], target_ids[i]], recovered=True)
        tail = [target_ids[k]] if has_bonus_row else []
        return RejectionResult(k, [*draft_token_ids, *tail], recovered=False)

    seed = params.seed if params.seed is not None else 0
    p_all = probabilities(target_logits, params)  # [k(+1), vocab_size]
    for i, d in enumerate(draft_token_ids):
        position = start_position + i
        p = p_all[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d <= 0.0:
            raise ValueError(f"draft token {d} at position {position} has draft probability 0")
        if uniform(seed, position, RandomStream.ACCEPT) < min(1.0, float(p[d]) / q_d):
            continue
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[i].float()
        recovered = sample(residual_distribution(p, q), seed, position, RandomStream.TARGET)
        return RejectionResult(i, [*draft_token_ids[:i], recovered], recovered=True)
    tail = [sample(p_all[k], seed, start_position + k, RandomStream.TARGET)] if has_bonus_row else []
    return RejectionResult(k, [*draft_token_ids, *tail], recovered=False)
