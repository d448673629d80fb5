"""Log probabilities of emitted tokens: a pure function of the target's rows (no model, cache or RPC).

The modes are vLLM's (`logprobs_mode`, 0.32 `v1/sample/sampler.py`). `raw_logprobs` (the default): the
log-softmax of the target's raw logits at the position the token was emitted at, before any logits
processor or temperature. `processed_logprobs`: the log of the distribution the token was drawn from,
the processors (`cluster.core.processors`) applied, then temperature, min-p, top-k and top-p
(`cluster.core.sampling.probabilities`); a greedy request's processed logits are log-softmaxed, with
no temperature. Always the target's distribution, never the draft's: a recovered token (drawn from the
residual) reports the target's p, as vLLM's rejection sampler does. Tokens a processor masks have
log probability -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.core.sampling import SamplingParams, probabilities


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log probability and the most likely tokens at its position (best first,
    `SamplingParams.logprobs` of them). Builtins only: it crosses Ray and Serve pickled."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log probability)


def log_distribution(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """rows  # [m, vocab_size] logits (raw, or processed for `processed_logprobs`) -> log probabilities
    # [m, vocab_size] float32 in the request's mode."""
    if params.logprobs_mode == "processed_logprobs" and not params.greedy:
        return probabilities(rows, params).log()
    return torch.log_softmax(rows.float(), dim=-1)


def token_logprobs(rows: torch.Tensor, token_ids: Sequence[int], params: SamplingParams) -> list[TokenLogprob]:
    """The log probability of token_ids[j] under row j, with the row's `params.logprobs` top tokens.

    rows       # [m, vocab_size]: the target's logits each token was drawn from, raw or processed as
               #   `params.logprobs_mode` says (the caller picks them)
    token_ids  # [m]
    """
    if rows.shape[0] != len(token_ids):
        raise ValueError(f"{rows.shape[0]} rows for {len(token_ids)} tokens")
    if not token_ids:
        return []
    logp = log_distribution(rows, params)  # [m, vocab_size]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)  # [m]
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()  # [m]
    k = min(params.logprobs or 0, logp.shape[-1])
    if k:
        top = torch.topk(logp, k, dim=-1)  # values, indices  # [m, k]
        tops = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(int(t), lp, top) for t, lp, top in zip(token_ids, chosen, tops)]
