"""Per-request speculation figures and results, shared by every decoding loop."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.core.logprobs import TokenLogprob


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


def ema(old: float, new: float, weight: float = 0.1) -> float:
    """Exponential moving average; the first value is taken as is."""
    return new if old == 0.0 else (1 - weight) * old + weight * new


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (EOS included when it ended the sequence)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: SpeculationStats
    logprobs: list[TokenLogprob] | None = None  # asked for (`SamplingParams.logprobs`): one per token this
    # run committed (a resumed session's output prefix has none here)
    prompt_logprobs: list[TokenLogprob] | None = None  # asked for (`SamplingParams.prompt_logprobs`): one per
    # prompt token after the first, the target's raw (`cluster.core.logprobs.prompt_logprobs`)
