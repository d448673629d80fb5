"""The speculation loop of one session: transport-free, over a verifier port and a drafter port.

It keeps up to `pipeline_depth` rounds in flight (depth 1 = ordinary sequential speculative decoding,
with a bonus token each fully accepted round). While round r is verified the drafter drafts round
r+1 as if r were accepted. On a rejection: bump the epoch, forget in-flight rounds (the verifier
answers them `stale`), roll the drafter back to the committed tokens plus the recovered token, draft
again; meanwhile the verifier runs a plain decoding step (`fill_bubbles`), and the redraft goes on if
its first token matches. A session whose verifier is shared by others sends sequential rounds
(`pipeline_max_sessions`).

The same loop runs in one process (`cluster.session.ports`, used by `SpeculativeDecoder` and the fast tests)
and distributed (`cluster.wire.remote_ports`: gRPC to a verifier replica, Ray to the drafter), where the
router wraps it with placement and replay (`cluster.ray.router`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cluster.core import grammar
from cluster.core.errors import TandemError
from cluster.core.messages import DraftReply, FeatureLog, SyncOp
from cluster.core.stopping import StopChecker
from cluster.session.loop_state import (
    CostEstimates,
    InFlight,
    LoopConfig,
    LoopMetrics,
    OwnRound,
    PipelineState,
    RoundTiming,
    SessionState,
)
from cluster.session.pipelined import PipelinedChain
from cluster.session.ports import DrafterPort, VerifierPort
from drafts.prediction import PredictionMatch, prediction_prices
from drafts.suffix import OwnMatch

__all__ = ["CostEstimates", "InFlight", "LoopConfig", "LoopMetrics", "RoundTiming", "SessionLoop", "SessionState"]


class SessionLoop:
    def __init__(self, state: SessionState, drafter: DrafterPort | None, stops: StopChecker, config: LoopConfig,
                 estimates: CostEstimates, metrics: LoopMetrics,
                 on_tokens: Callable[[list[int], list | None], None] | None = None,
                 cancelled: threading.Event | None = None, timeline: list[RoundTiming] | None = None,
                 own_match: OwnMatch | None = None):
        """`on_tokens(tokens, logprobs)`: each commit's output tokens and, where the params ask for them,
        their logprobs (else None). `own_match`: a sequential round (or a plain step the policy chose) whose
        committed tokens' own suffix matches long enough sends the match, drafted here: no drafter call (the
        hybrid's long match rounds)."""
        self.state, self.drafter, self.stops, self.config = state, drafter, stops, config
        self.own_match = own_match
        # the request's own prediction (OpenAI's Predicted Outputs): drafted here where it beats the other sources
        self.prediction = PredictionMatch(state.params.prediction, prediction_prices()) \
            if state.params.prediction else None
        self.estimates, self.metrics = estimates, metrics
        self.on_tokens, self.cancelled, self.timeline = on_tokens, cancelled, timeline
        self.pipelined = PipelinedChain()  # the strategy of pipelined rounds (pipeline_depth > 1)
        if self.needs_features and state.features is None:
            state.features = FeatureLog()

    @property
    def drafting(self) -> bool:
        return self.drafter is not None and self.drafter.alive

    @property
    def needs_features(self) -> bool:
        """Whether the drafter reads the target's features (the verifier is then asked for them)."""
        return self.drafter is not None and getattr(self.drafter, "needs_features", False)

    def add_features(self, start: int, rows) -> None:
        """The target's features of committed positions from `start` (a verifier's prefill): kept, and
        owed to the drafter."""
        if rows is None or self.state.features is None:
            return
        self.state.features.add(start, rows)
        self.state.sync.append(SyncOp(features=rows, feature_start=start))

    def gamma(self, remaining: int, bonus: bool, verifier_sessions: int) -> int:
        limit = min(self.state.max_gamma, remaining - (1 if bonus else 0))
        cost, verify_cost = self.estimates.cost_ratio, self.estimates.verify_token_cost
        if not bonus and self.config.balance_pipeline and cost:  # a pipelined round
            limit = min(limit, max(1, round(1 / cost)))
        gamma = self.state.policy.gamma(remaining, limit, cost, verifier_sessions, pipelined=not bonus,
                                        verify_token_cost=verify_cost)
        seen = self.estimates.verify_by_drafts
        if (verify_cost is None and gamma > 0 and list(seen) == [gamma] and self.state.stats.rounds >= 4
                and self.state.policy.policy.config.adaptive):
            gamma = 0  # one plain round: a second point of the verify-cost curve (its slope decides γ)
        return gamma

    def cost(self) -> float:
        """c: measured, else the policy's prior."""
        return self.estimates.cost_ratio or self.state.policy.policy.config.prior_cost_ratio

    def record_draft(self, seconds: float, num_drafts: int) -> None:
        self.state.stats.draft_s += seconds
        self.estimates.record_draft(seconds, num_drafts)

    def own_round(self, remaining: int, verifier_sessions: int, prediction: bool = True) -> OwnRound | None:
        """A round the loop drafts itself: the request's prediction's (`prediction_round`; `prediction` False: the
        caller asked it already), else the session's own suffix match (`own_match`), within the request's end and
        its own cap on drafts; None without one, or while the verifiers are saturated (there a plain step's batch is
        cheapest)."""
        own = self.prediction_round(remaining, verifier_sessions) if prediction else None
        s = self.state
        if own is not None or self.own_match is None or s.max_gamma <= 0 or s.policy.saturated(verifier_sessions):
            return own
        drafts = self.own_match.propose(s.committed, self.draft_limit(remaining, True))
        if not drafts:
            return None
        t = time.time()
        return OwnRound(DraftReply(drafts, None, t, t, 1))

    def prediction_round(self, remaining: int, verifier_sessions: int) -> OwnRound | None:
        """The drafts of the request's prediction (`drafts.prediction`) that continue its output, cut where its
        grammar refuses them; None without a prediction, a match, or a session that may draft, or where the drafter's
        γ drafts are expected to have more accepted (at the session's α)."""
        s = self.state
        if self.prediction is None or s.max_gamma <= 0 or s.policy.saturated(verifier_sessions):
            return None
        drafts, match = self.prediction.propose(s.output, self.draft_limit(remaining, True))
        if drafts and self.drafting:  # the drafter's γ drafts where they are expected to have more accepted
            alpha = s.policy.alpha
            if self.prediction.expected(match, len(drafts)) < sum(alpha ** j for j in range(1, s.max_gamma + 1)):
                return None
        t = time.time()
        draft = self._within_grammar(DraftReply(drafts, None, t, t, 1)) if drafts else None
        return OwnRound(draft, prediction=match) if draft is not None else None

    def send(self, verifier: VerifierPort, p: PipelineState, draft: DraftReply | None, bonus: bool,
              timing: RoundTiming, own: OwnRound | None = None) -> None:
        chain = draft.chain() if draft is not None else []
        num_drafts = len(chain)
        verifier.send(timing.round, p.epoch, bonus, draft)
        timing.sent = time.time()
        tree_chain = chain if draft is not None and draft.parents is not None else None
        p.in_flight.append(InFlight(timing, p.epoch, num_drafts, len(draft.token_ids) if draft is not None else 0,
                                    tree_chain=tree_chain, own_match=own is not None,
                                    prediction=own.prediction if own is not None else 0))
        if own is not None:
            self.metrics.add(**{"prediction_rounds" if own.prediction else "own_match_rounds": 1})
        p.optimistic += num_drafts
        self.state.stats.record_gamma(num_drafts)

    def run(self, verifier: VerifierPort) -> str:
        """Drive rounds until a stop; returns the finish reason. A transport error of the verifier port
        propagates (the caller may replay the session onto another verifier and `run` again)."""
        p = PipelineState()
        while True:
            if self.cancelled is not None and self.cancelled.is_set():
                return "cancelled"
            self._fill_pipeline(verifier, p)
            finish = self._receive(verifier, p)
            if finish:
                return finish

    def _fill_pipeline(self, verifier: VerifierPort, p: PipelineState) -> None:
        """Send the next round(s): the pipelined chain's strategy while this session has the verifier to
        itself (`pipeline_max_sessions`), else one sequential round."""
        config = self.config
        if config.pipeline_depth > 1 and p.verifier_sessions <= config.pipeline_max_sessions:
            self.pipelined.fill(self, verifier, p)
        elif p.fill is None and not any(not entry.stale for entry in p.in_flight):
            self._send_sequential(verifier, p)

    def remaining(self, p: PipelineState) -> int:
        """Tokens the request may still produce beyond those committed and in flight."""
        return self.state.params.max_tokens - len(self.state.output) - p.optimistic

    def draft_limit(self, remaining: int, bonus: bool) -> int:
        """The most drafts a round may carry: within the request's end and its own cap on drafts."""
        s = self.state
        return min(remaining - (1 if bonus else 0), s.max_drafts if s.max_drafts is not None else remaining)

    def gamma_for_round(self, remaining: int, bonus: bool, p: PipelineState) -> int:
        """γ for the next round (0: no draft), opening the session on a drafter that joins late (from the
        committed tokens and their features) when nothing is in flight."""
        if not self.drafting:
            return 0
        k = self.gamma(remaining, bonus, p.verifier_sessions)
        if k > 0 and not self.drafter.started:
            if any(not entry.stale for entry in p.in_flight):
                return 0
            s = self.state
            resend = s.features.sync() if s.features is not None else None
            s.sync = [resend] if resend is not None else []
            self.drafter.start(list(s.committed))
            k = k if self.drafting else 0
        return k

    def drafter_round(self, k: int, remaining: int, bonus: bool) -> DraftReply | None:
        """The drafter's k drafts for the next round (None: lost, or nothing drafted); a sequential
        round may be a token tree. A round longer than asked (the hybrid's long match rounds) stops
        where the request does, and within the request's own cap; the bonus round's sync rolls the
        drafter's sequence back to the committed one."""
        draft = self.drafter.result(self.drafter.propose(k, self.state.take_sync(), tree=bonus))
        if draft is None or not draft.token_ids:
            return None
        limit = self.draft_limit(remaining, bonus)
        if draft.parents is None and len(draft.token_ids) > limit:
            draft = draft.sliced(0, limit)
        return draft

    def _within_grammar(self, draft: DraftReply | None) -> DraftReply | None:
        """A deterministic chain (no q: n-gram, suffix matches) cut at its first token the request's grammar
        refuses: p gives that token 0, so the round would reject it there and verify the rest for nothing;
        the bonus token is then drawn at its place, from p (what the rejection's residual would be). Drafts
        with q are masked by the grammar already."""
        so = self.state.params.structured_outputs
        if so is None or draft is None or draft.parents is not None or draft.draft_probs is not None \
                or draft.dense is not None:
            return draft
        try:
            valid = grammar.valid_prefix(so, self.state.output, draft.token_ids)
        except grammar.NoTokenizer as e:  # a process with no model: drafts go uncut (p still rejects them)
            grammar.warn_once(f"drafts are not cut by the grammar here: {e}")
            return draft
        if valid == len(draft.token_ids):
            return draft
        self.metrics.add(grammar_cut_drafts=len(draft.token_ids) - valid)
        return draft.sliced(0, valid) if valid else None

    def _send_sequential(self, verifier: VerifierPort, p: PipelineState) -> None:
        """One sequential round, with its bonus token: the session's own match if there is one, else the
        drafter's k drafts (a token tree when the proposer makes them), else a plain decoding step."""
        remaining = self.remaining(p)
        if remaining <= 0:
            return
        k = self.gamma_for_round(remaining, True, p)
        t0 = time.time()
        own = self.own_round(remaining, p.verifier_sessions)  # no drafter call
        draft = own.draft if own is not None else None
        if own is None and k > 0 and self.drafting:
            draft = self.drafter_round(k, remaining, bonus=True)
        draft = self._within_grammar(draft)
        t1 = time.time()
        self.send(verifier, p, draft, True, RoundTiming(next(p.round_ids), t0, t1), own)  # draft None: plain
        if self.config.pipeline_depth > 1:
            self.metrics.add(shared_sequential_rounds=1)
        if own is None:  # an own match round teaches the drafter's cost estimate nothing
            self.record_draft(t1 - t0, len(draft.chain()) if draft is not None else 0)

    def drop_in_flight_drafts(self) -> None:
        """The rounds in flight are lost (a replay onto another verifier): the drafter goes on from the
        committed tokens."""
        self.state.sync.append(SyncOp(length=len(self.state.committed)))

    def _receive(self, verifier: VerifierPort, p: PipelineState) -> str | None:
        """Take the oldest round's result and commit it; the finish reason when the session is done."""
        s, stats = self.state, self.state.stats
        result, active_sessions = verifier.receive()
        received = time.time()
        entry = p.in_flight.popleft()
        timing = entry.timing
        if result.round != timing.round:
            raise TandemError(f"verifier answered round {result.round}, expected {timing.round}")
        if entry.stale or result.stale:
            self.metrics.add(stale_rounds=1)
            return None
        p.verifier_sessions = self.estimates.last_load = active_sessions
        timing.verify_start, timing.verify_end, timing.received = result.verify_start, result.verify_end, received
        self.estimates.record_verify(result.verify_end - result.verify_start, entry.num_fed)
        stats.verify_s += result.verify_end - result.verify_start
        if self.timeline is not None:
            self.timeline.append(timing)
        p.optimistic -= entry.num_drafts
        stats.record_round(entry.num_drafts, result.num_accepted)
        if not entry.own_match:  # the policy's α is the drafter's
            s.policy.learn(entry.num_drafts, result.num_accepted)
        self.metrics.add(rounds=1)
        new_tokens = list(result.output_token_ids)
        s.committed.extend(new_tokens)
        op = SyncOp(num_drafted=entry.num_drafts, num_accepted=result.num_accepted)
        if result.recovered or result.bonus:  # the drafter continues from the corrected token
            op = SyncOp(len(s.committed) - 1, new_tokens[-1:], entry.num_drafts, result.num_accepted)
        if entry.own_match:  # the drafter never saw these drafts: it reads the round's tokens, learns nothing
            op = SyncOp(len(s.committed) - len(new_tokens), new_tokens)
            self.metrics.add(**{"prediction_accepted" if entry.prediction else "own_match_accepted":
                                result.num_accepted})
            if entry.prediction:  # the prediction's prices learn the verdict
                self.prediction.learn(entry.prediction, entry.num_drafts, result.num_accepted)
        if entry.tree_chain is not None:
            self.metrics.add(tree_rounds=1)
            if new_tokens[:-1] != entry.tree_chain[: len(new_tokens) - 1]:
                # the accepted branch left the drafter's own chain: it re-reads the branch
                op = SyncOp(len(s.committed) - len(new_tokens), new_tokens, entry.num_drafts, result.num_accepted)
                self.metrics.add(tree_branch_hits=1)
        if result.features is not None and s.features is not None:
            s.features.add(result.feature_start, result.features)
            op = op.with_features(result.feature_start, result.features)
        if result.recovered:
            p.epoch += 1
            p.optimistic = 0
            for other in p.in_flight:
                other.stale = True
        before = len(s.output)
        finish = self.stops.commit(s.output, new_tokens)
        kept = len(s.output) - before  # a stop may keep only a prefix of the round's tokens
        logprobs = None
        if s.logprobs is not None and result.logprobs is not None:
            logprobs = result.logprobs[:kept]
            s.logprobs.extend(logprobs)
        if self.on_tokens is not None and kept > 0:
            self.on_tokens(s.output[before:], logprobs)
        if finish:
            return finish
        if p.fill is not None and timing.round == p.fill[0]:
            if self.pipelined.take_fill(self, verifier, p, new_tokens, op):
                return None
        s.sync.append(op)
        return None
