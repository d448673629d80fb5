"""Draft-length policy: how many tokens to draft per round (γ), per session, from the cost model
(`drafts/cost_model.py`: E(α, γ) over the time of a sequential or pipelined round).

The policy picks the γ in 0..max that maximises E / time (γ = 0 is plain decoding, speedup 1) from
an online estimate of α per session, and drafts nothing in the three cases where speculation does
not pay: the verifiers are saturated (batched plain decoding already uses the compute), the request
has too few tokens left to gain, or the text is unpredictable (low α). A session at γ = 0 drafts
one token every `probe_every` rounds so that α can recover.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from drafts.cost_model import predicted_speedup


class SpeculationPolicyConfig(BaseModel):
    """The knobs of the draft-length policy (documented in the README)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adaptive: bool = Field(True, description="Choose γ per round from the cost model; False always drafts the maximum γ.")
    prior_acceptance: float = Field(0.7, gt=0.0, lt=1.0, description="α assumed for a new session before any round is verified.")
    acceptance_weight: float = Field(0.25, gt=0.0, le=1.0, description="Weight of the newest round in the session's running α estimate.")
    prior_cost_ratio: float = Field(0.4, gt=0.0, description="c assumed until draft and verify times have been measured.")
    verify_token_cost: float = Field(0.03, ge=0.0, description="Extra verify time per drafted token, as a fraction of one target step, until the router has measured it (two round sizes seen: `CostEstimates.verify_token_cost`).")
    min_speedup: float = Field(1.05, ge=1.0, description="Draft only when the predicted speedup reaches this; else plain decoding.")
    min_remaining_tokens: int = Field(2, ge=1, description="Plain decoding when fewer tokens than this are left to generate.")
    saturation_sessions: int = Field(0, ge=0, description="Plain decoding when a verifier replica holds at least this many sessions (0: never); applies with adaptive: false too.")
    probe_every: int = Field(16, ge=1, description="A session at γ = 0 drafts one token every this many rounds to re-estimate α.")


class SpeculationPolicy:
    """Shared by every session of a router (or a single-process loop); `session()` makes the per-session state."""

    def __init__(self, config: SpeculationPolicyConfig | None = None, max_gamma: int = 3, pipelined: bool = False):
        self.config = config or SpeculationPolicyConfig()
        self.max_gamma = max_gamma
        self.pipelined = pipelined

    def best_gamma(self, alpha: float, cost_ratio: float, pipelined: bool | None = None,
                   verify_token_cost: float | None = None) -> tuple[int, float]:
        """(γ, predicted speedup) maximising E / time over 0..max_gamma (`pipelined`: this round's mode;
        `verify_token_cost`: v as measured, else the config's prior)."""
        pipelined = self.pipelined if pipelined is None else pipelined
        v = self.config.verify_token_cost if verify_token_cost is None else verify_token_cost
        best = (0, 1.0)
        for gamma in range(1, self.max_gamma + 1):
            speedup = predicted_speedup(alpha, gamma, cost_ratio, pipelined, v)
            if speedup > best[1]:
                best = (gamma, speedup)
        return best if best[1] >= self.config.min_speedup else (0, 1.0)

    def session(self) -> "SessionPolicy":
        return SessionPolicy(self)


class SessionPolicy:
    """One session's running α estimate and its γ decisions."""

    def __init__(self, policy: SpeculationPolicy):
        self.policy = policy
        config = policy.config
        # α = accepted / trials, where every accepted draft is a success and a rejection one failure
        self._successes = config.prior_acceptance
        self._trials = 1.0
        self._plain_rounds = 0

    @property
    def alpha(self) -> float:
        return self._successes / self._trials if self._trials else 0.0

    def learn(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        w = self.policy.config.acceptance_weight
        rejected = int(num_accepted < num_drafted)
        self._successes = (1 - w) * self._successes + w * num_accepted
        self._trials = (1 - w) * self._trials + w * (num_accepted + rejected)

    def saturated(self, verifier_sessions: int) -> bool:
        """Whether the verifier replica holds so many sessions that plain decoding is chosen (adaptive or not)."""
        config = self.policy.config
        return bool(config.saturation_sessions and verifier_sessions >= config.saturation_sessions)

    def gamma(self, remaining: int, limit: int | None = None, cost_ratio: float | None = None,
              verifier_sessions: int = 0, pipelined: bool | None = None,
              verify_token_cost: float | None = None) -> int:
        """Drafts for the next round: at most `limit` (default: max_gamma and remaining − 1, leaving
        room for the round's own recovered or bonus token); `cost_ratio` and `verify_token_cost` as
        measured (None: the priors)."""
        config, policy = self.policy.config, self.policy
        limit = min(policy.max_gamma, remaining - 1 if limit is None else limit)
        if limit <= 0 or self.saturated(verifier_sessions):
            return 0
        if not config.adaptive:
            return limit
        if remaining < config.min_remaining_tokens:
            return 0
        gamma, _ = policy.best_gamma(self.alpha, cost_ratio or config.prior_cost_ratio, pipelined, verify_token_cost)
        if gamma == 0:
            self._plain_rounds += 1
            if self._plain_rounds >= config.probe_every:
                self._plain_rounds = 0
                return 1
            return 0
        self._plain_rounds = 0
        return min(gamma, limit)
