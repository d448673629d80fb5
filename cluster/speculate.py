"""The speculation loop in one process: draft, verify, commit, roll back.

The router of the distributed runtime drives the same pieces (runner, proposer, rejection sampler);
here they are called in sequence. Each round the target extends the session by the last committed
token plus the k drafts, which yields k + 1 distributions: one per draft and one for the bonus.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from cluster.errors import InvalidRequestError
from cluster.rejection import rejection_sample
from cluster.runner import TorchModelRunner
from cluster.sampling import SamplingParams
from cluster.stopping import StopChecker
from drafts.proposer import Proposer


@dataclass
class SpeculationStats:
    """Per-request speculation figures, in the project's vocabulary."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # rounds that ended in a recovered token
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at draft position i
    drafted_per_position: list[int] = field(default_factory=list)  # drafted at draft position i
    gamma_counts: list[int] = field(default_factory=list)  # rounds that drafted γ tokens, by γ
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification round (accepted + recovered/bonus)."""
        return self.num_generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.prefill_s
        return self.num_generated_tokens / decode_s if decode_s > 0 else 0.0

    def record_gamma(self, gamma: int) -> None:
        while len(self.gamma_counts) <= gamma:
            self.gamma_counts.append(0)
        self.gamma_counts[gamma] += 1

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        self.rounds += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.rejections += int(num_accepted < num_drafted)
        while len(self.drafted_per_position) < num_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    def merge(self, other: "SpeculationStats") -> None:
        """Add another request's figures to these (for totals over a workload)."""
        for name in ("num_prompt_tokens", "num_generated_tokens", "rounds", "drafted", "accepted", "rejections",
                     "prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted_per_position", "accepted_per_position", "gamma_counts"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                   tokens_per_s=self.tokens_per_s)
        return out


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, max_context: int, tokenizer,
                     vocab_size: int | None = None) -> None:
    """What every decoding loop refuses before it starts (vocabulary checked when `vocab_size` is given)."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if total > max_context:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's context length of {max_context} tokens"
        )
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer")


def ema(old: float, new: float, weight: float = 0.1) -> float:
    """Exponential moving average; the first value is taken as is."""
    return new if old == 0.0 else (1 - weight) * old + weight * new


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (EOS included when it ended the sequence)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: SpeculationStats


class SpeculativeDecoder:
    """Lossless speculative decoding of one request at a time on a local target runner.

    `num_speculative_tokens` (γ) = 0, or `proposer=None`, is plain target decoding.
    """

    def __init__(self, target: TorchModelRunner, proposer: Proposer | None, tokenizer=None,
                 num_speculative_tokens: int = 4, eos_token_ids: Sequence[int] | None = None,
                 policy=None):
        """`policy`: a `drafts.policy.SpeculationPolicy` choosing γ per round (≤ num_speculative_tokens)
        from the session's running α and the measured cost ratio; None drafts γ every round."""
        if num_speculative_tokens < 0:
            raise InvalidRequestError(f"{num_speculative_tokens=} must be >= 0")
        self.target = target
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        if eos_token_ids is None:
            eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
            eos = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = set(eos_token_ids)
        self.policy = policy
        self._ids = itertools.count()
        self._draft_token_s = self._verify_s = 0.0

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.target.max_context, self.tokenizer, self.target.vocab_size)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        params = params.with_seed()
        session = ("local", next(self._ids))
        stats = SpeculationStats(num_prompt_tokens=len(prompt_ids))
        t_start = time.perf_counter()
        self.target.add_session(session)
        if self.proposer is not None:
            self.proposer.start(session, prompt_ids, params)
        try:
            if len(prompt_ids) > 1:  # the last prompt token is fed with the first round's drafts
                self.target.extend(session, prompt_ids[:-1], num_logits=0)
            stats.prefill_s = time.perf_counter() - t_start
            result = self._decode(session, prompt_ids, params, stats)
        finally:
            self.target.release(session)
            if self.proposer is not None:
                self.proposer.release(session)
        stats.total_s = time.perf_counter() - t_start
        return result

    def _decode(self, session, prompt_ids: list[int], params: SamplingParams,
                stats: SpeculationStats) -> GenerationResult:
        committed = list(prompt_ids)  # the source of truth; the target caches all but the last
        output: list[int] = []
        stops = StopChecker(self.tokenizer, self.eos_token_ids, params)
        finish_reason = "length"
        session_policy = self.policy.session() if self.policy is not None else None
        while len(output) < params.max_tokens:
            k = min(self.num_speculative_tokens, params.max_tokens - len(output) - 1)
            if session_policy is not None and k > 0:
                cost = self._draft_token_s / self._verify_s if self._draft_token_s and self._verify_s else None
                k = session_policy.gamma(params.max_tokens - len(output), k, cost)
            t0 = time.perf_counter()
            proposal = self.proposer.propose(session, k) if k > 0 else None
            drafts = proposal.token_ids if proposal else []
            t1 = time.perf_counter()
            target_logits = self.target.extend(session, [committed[-1], *drafts])  # [k + 1, vocab_size]
            result = rejection_sample(drafts, target_logits, proposal.draft_probs if proposal else None,
                                      params, start_position=len(committed))
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            if drafts:
                self._draft_token_s = ema(self._draft_token_s, (t1 - t0) / len(drafts))
            self._verify_s = ema(self._verify_s, time.perf_counter() - t1)
            if session_policy is not None:
                session_policy.learn(len(drafts), result.num_accepted)

            base = len(committed)
            self.target.truncate(session, base + result.num_accepted)  # drop the rejected drafts' KV
            if self.proposer is not None:
                self.proposer.rollback(session, base + result.num_accepted, result.output_token_ids[-1:])
                self.proposer.learn(session, len(drafts), result.num_accepted)
            stats.record_gamma(len(drafts))
            stats.record_round(len(drafts), result.num_accepted)

            committed.extend(result.output_token_ids)
            finish_reason = stops.commit(output, list(result.output_token_ids))
            if finish_reason:
                break
        stats.num_generated_tokens = len(output)
        return GenerationResult(output, stops.text(output), finish_reason, stats)
