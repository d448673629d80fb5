"""What the session loop (`cluster.session.loop`) keeps and is configured with: the scheduling config shared by
both runtimes, the counters and cost estimates of a router, and one session's state and rounds in flight."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from cluster.core.logprobs import TokenLogprob
from cluster.core.messages import DraftReply, FeatureLog, SyncOp
from cluster.core.sampling import SamplingParams
from cluster.core.stats import SpeculationStats, ema
from drafts.policy import SessionPolicy, SpeculationPolicyConfig


class LoopConfig(BaseModel):
    """How sessions schedule their rounds: one model, the base of both the standalone runtime's
    `ClusterConfig` and the Serve application's `TandemAppConfig` (their fields of the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline_depth: int = Field(2, ge=1, le=8, description="Rounds in flight per session; 1 = sequential speculative decoding.")
    balance_pipeline: bool = Field(True, description="Pipelined mode: cap γ per round at verify time / draft time per token, so neither side idles.")
    fill_bubbles: bool = Field(True, description="Pipelined mode: after a rejection, run a plain decoding step while the drafter redrafts.")
    fill_min_redraft: float = Field(0.5, ge=0.0, description="Fill a bubble only when redrafting (γ + 1 tokens at the measured c) takes at least this many verify steps: with a fast draft the plain step delays the next round more than its token gains, so the verifier waits for the redraft instead.")
    pipeline_max_sessions: int = Field(1, ge=1, description="Pipeline a session's rounds only while at most this many sessions share its verifier replica (beyond, sequential rounds with their bonus token commit more per forward).")
    speculation: SpeculationPolicyConfig = Field(default_factory=SpeculationPolicyConfig, description="The draft-length policy (γ per session from the cost model, plain decoding when it does not pay).")


@dataclass
class LoopMetrics:
    """Counters of a router (or decoder), summed over its sessions."""

    sessions: int = 0
    rounds: int = 0
    stale_rounds: int = 0
    replays: int = 0  # sessions moved to another verifier replica after a failure
    drafter_fallbacks: int = 0  # sessions that lost their drafter and went on with plain decoding
    pipeline_stalls: int = 0  # pipelined rounds sent when the verifier had nothing queued for the session
    bubble_fills: int = 0  # plain steps run while the drafter redrafted after a rejection
    bubble_fill_misses: int = 0  # ... whose token the redrafted first draft did not match (drafts dropped)
    bubble_fill_hits: int = 0  # ... whose redraft went on as the next round (a fill can also end its session)
    shared_sequential_rounds: int = 0  # rounds sent sequentially (not pipelined) because the verifier was shared
    tree_rounds: int = 0  # rounds whose drafts were a token tree (siblings at the first position)
    tree_branch_hits: int = 0  # ... whose accepted branch left the drafter's own chain (a sibling won)
    own_match_rounds: int = 0  # plain steps replaced by the session's own suffix match (`SessionLoop.own_match`)
    own_match_accepted: int = 0  # ... drafts of those rounds accepted
    prediction_rounds: int = 0  # rounds drafted from the request's prediction (OpenAI's Predicted Outputs)
    prediction_accepted: int = 0  # ... drafts of those rounds accepted
    grammar_cut_drafts: int = 0  # deterministic drafts cut before verification: the grammar refuses them
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


class CostEstimates:
    """Online estimates shared by the sessions of one router or decoder: c, the verify-cost curve and the
    verifier's load.

    The verify-cost curve: a round's verify time is fitted as step · (1 + v · drafts), least squares over
    the EMA of each round size seen (the drafts a round carried, siblings of a token tree included). v
    decides whether speculation pays: about 0.02 where a forward of a few tokens costs what one costs
    (a GPU, vLLM's CPU kernels), about 0.6 where every row costs a step of its own (torch's bf16 matmuls
    on a CPU without native bf16). Until two sizes are seen the policy's prior stands (`verify_token_cost`)."""

    def __init__(self) -> None:
        self.draft_token_s = 0.0  # EMA of draft time per token
        self.verify_s = 0.0  # EMA of one verify forward, whatever its size
        self.verify_by_drafts: dict[int, float] = {}  # drafts in the round -> EMA of its verify forward
        self.last_load = 0  # sessions on a verifier replica, as last reported

    def _fit(self) -> tuple[float, float] | None:
        """(step, per-draft) seconds from the round sizes seen; None with fewer than two sizes."""
        points = sorted(self.verify_by_drafts.items())
        if len(points) < 2:
            return None
        n = len(points)
        mean_k = sum(k for k, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        slope = (sum((k - mean_k) * (t - mean_t) for k, t in points)
                 / sum((k - mean_k) ** 2 for k, _ in points))
        step = mean_t - slope * mean_k
        return (step, max(slope, 0.0)) if step > 0 else None

    @property
    def step_s(self) -> float | None:
        """One target step: the fitted curve's value at no drafts, else the mean verify forward."""
        fit = self._fit()
        return fit[0] if fit else (self.verify_s or None)

    @property
    def verify_token_cost(self) -> float | None:
        """Measured v: the verify time each draft adds, as a fraction of one step (None until fitted)."""
        fit = self._fit()
        return fit[1] / fit[0] if fit else None

    @property
    def cost_ratio(self) -> float | None:
        """Measured c: draft time per token over one target step (None until both are measured)."""
        step = self.step_s
        if self.draft_token_s > 0 and step:
            return self.draft_token_s / step
        return None

    def record_draft(self, seconds: float, num_drafts: int) -> None:
        if num_drafts:
            self.draft_token_s = ema(self.draft_token_s, seconds / num_drafts)

    def record_verify(self, seconds: float, num_drafts: int | None = None) -> None:
        self.verify_s = ema(self.verify_s, seconds)
        if num_drafts is not None:
            self.verify_by_drafts[num_drafts] = ema(self.verify_by_drafts.get(num_drafts, 0.0), seconds)


@dataclass
class RoundTiming:
    round: int
    draft_start: float
    draft_end: float
    verify_start: float = 0.0
    verify_end: float = 0.0
    sent: float = 0.0  # caller's clock around the round trip
    received: float = 0.0


@dataclass
class InFlight:
    """A round sent and not yet answered."""

    timing: RoundTiming
    epoch: int
    num_drafts: int  # the drafts' chain (a token tree's siblings are not counted)
    num_fed: int = 0  # every draft token the verifier scores (a token tree's siblings too)
    stale: bool = False  # drafted before a rejection: its answer commits nothing
    tree_chain: list[int] | None = None  # a token tree's round: the drafter's own continuation
    own_match: bool = False  # drafted by the loop itself (`SessionLoop.own_round`), not the drafter
    prediction: int = 0  # ... from the request's prediction (`SessionLoop.prediction`): its match length (0: not)


class OwnRound(NamedTuple):
    """A round the loop drafted itself (`SessionLoop.own_round`): a suffix match's, or the prediction's."""

    draft: DraftReply
    prediction: int = 0  # the prediction's match length (`PredictionMatch.propose`; 0: a suffix match's round)


@dataclass
class SessionState:
    """What a session keeps across verifiers (a replay starts a new `run` from it)."""

    session: str
    params: SamplingParams
    committed: list[int]  # prompt + output: the source of truth
    output: list[int]
    stats: SpeculationStats
    policy: SessionPolicy
    max_gamma: int
    sync: list[SyncOp] = field(default_factory=list)  # owed to the drafter, sent with the next propose
    features: FeatureLog | None = None  # a feature-fed draft: the target's features of committed positions
    max_drafts: int | None = None  # the request's own cap on drafts in any round; None: a long match round
    # (the hybrid's `match_tokens`) may draft more than max_gamma
    logprobs: list[TokenLogprob] | None = None  # the params ask for logprobs: those of the tokens committed here

    def __post_init__(self) -> None:
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    def take_sync(self) -> list[SyncOp]:
        ops, self.sync = self.sync, []
        return ops


@dataclass
class PipelineState:
    """One `run`'s rounds on one verifier connection."""

    epoch: int = 0
    optimistic: int = 0  # drafted tokens in flight beyond the committed ones
    in_flight: deque[InFlight] = field(default_factory=deque)
    round_ids: itertools.count = field(default_factory=itertools.count)
    verifier_sessions: int = 0
    fill: tuple[int, object] | None = None  # (round, pending proposal): a plain step while the drafter redrafts
