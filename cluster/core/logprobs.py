"""Log probabilities of emitted tokens: a pure function of the target's rows (no model, cache or RPC).

The modes are vLLM's (`logprobs_mode`, 0.32 `v1/sample/sampler.py`). `raw_logprobs` (the default): the
log-softmax of the target's raw logits at the position the token was emitted at, before any logits
processor or temperature. `processed_logprobs`: the log of the distribution the token was drawn from,
the processors (`cluster.core.processors`) applied, then temperature, min-p, top-k and top-p
(`cluster.core.sampling.probabilities`); a greedy request's processed logits are log-softmaxed, with
no temperature. Always the target's distribution, never the draft's: a recovered token (drawn from the
residual) reports the target's p, as vLLM's rejection sampler does. Tokens a processor masks have
log probability -inf.

Prompt logprobs (`SamplingParams.prompt_logprobs`, `prompt_logprobs`): prompt token i > 0 under the target's
row at position i - 1, always the raw log-softmax (vLLM's prompt tokens skip the processors in every mode),
with the token's rank in the vocabulary (vLLM's `rank`: how many tokens are at least as likely).
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
    rank: int | None = None  # prompt logprobs: tokens at least as likely as this one (1 = the most likely)


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
    return _gather(log_distribution(rows, params), token_ids, params.logprobs or 0)


def prompt_logprobs(rows: torch.Tensor, prompt_ids: Sequence[int], num_top: int,
                    chunk: int = 256) -> list[TokenLogprob]:
    """The log probability of prompt_ids[i + 1] under row i (the raw log-softmax), with its rank and the row's
    `num_top` most likely tokens; log-softmaxed `chunk` rows at a time (a long prompt's rows are large).

    rows        # [n - 1, vocab_size]: the target's raw logits at prompt positions 0 .. n - 2
    prompt_ids  # [n]; the first token has no logprob (none is returned for it)
    """
    targets = list(prompt_ids)[1:]
    if rows.shape[0] != len(targets):
        raise ValueError(f"{rows.shape[0]} rows for a prompt of {len(prompt_ids)} tokens")
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), chunk):
        logp = torch.log_softmax(rows[start : start + chunk].float(), dim=-1)  # [c, vocab_size]
        out += _gather(logp, targets[start : start + chunk], num_top, ranks=True)
    return out


def _gather(logp: torch.Tensor, token_ids: Sequence[int], num_top: int, ranks: bool = False) -> list[TokenLogprob]:
    """logp  # [m, vocab_size] log probabilities -> token_ids[j]'s under row j, with the row's `num_top` best
    (and, with `ranks`, the token's rank: vLLM's count of tokens at least as likely)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)  # [m]
    chosen_t = logp.gather(-1, ids[:, None])  # [m, 1]
    chosen = chosen_t[:, 0].tolist()  # [m]
    rank = (logp >= chosen_t).sum(-1).tolist() if ranks else [None] * len(chosen)  # [m]
    k = min(num_top, logp.shape[-1])
    if k:
        top = torch.topk(logp, k, dim=-1)  # values, indices  # [m, k]
        tops = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(int(t), lp, top, r) for t, lp, top, r in zip(token_ids, chosen, tops, rank)]
