"""The pipelined chain: a strategy of `SessionLoop` for `pipeline_depth` > 1.

Up to `pipeline_depth` rounds are in flight: while round r is verified the drafter drafts round r+1
as if r were accepted (no bonus token: the next round starts from the last draft). On a rejection
the loop bumps the epoch and forgets the rounds in flight; the drafter redrafts from the corrected
token. Bubble filling: where redrafting (γ + 1 tokens at the measured c) takes at least
`fill_min_redraft` verify steps, the verifier runs a plain decoding step meanwhile and the drafter is
asked for one draft more; if its first draft equals the step's token, the rest go on as the next
round (`take_fill`). With nothing drafted the strategy sends a plain step (or the session's own match). While
nothing is in flight and the request's prediction has drafts, they go as a sequential round first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cluster.core.messages import SyncOp
from cluster.session.loop_state import PipelineState, RoundTiming
from cluster.session.ports import VerifierPort

if TYPE_CHECKING:  # the loop drives this strategy; no import at run time
    from cluster.session.loop import SessionLoop


class PipelinedChain:
    """Fills a session's pipeline; stateless (the state is the loop's `PipelineState`)."""

    def fill(self, loop: SessionLoop, verifier: VerifierPort, p: PipelineState) -> None:
        """Send rounds until `pipeline_depth` are in flight (or a plain step, or a bubble fill, ends the batch)."""
        s, config, stats = loop.state, loop.config, loop.state.stats
        live = sum(1 for entry in p.in_flight if not entry.stale)
        while p.fill is None and live < config.pipeline_depth:
            remaining = loop.remaining(p)
            if remaining <= 0:
                return
            own = loop.prediction_round(remaining, p.verifier_sessions) if not live else None
            if own is not None:  # the request's prediction goes on from here: a sequential round of its drafts
                t = time.time()
                loop.send(verifier, p, own.draft, True, RoundTiming(next(p.round_ids), t, t), own)
                return
            k = loop.gamma_for_round(remaining, False, p)
            if (k > 0 and not live and config.fill_bubbles and stats.rounds > 0
                    and remaining > 2 and (k + 1) * loop.cost() >= config.fill_min_redraft):
                # After a rejection the verifier would idle while the drafter drafts from the corrected
                # token. Give it a plain decoding step meanwhile, and ask the drafter for one draft more:
                # if its first draft equals the step's token, the rest go on as the next round.
                pending = loop.drafter.propose(k + 1, s.take_sync())
                if pending is not None:
                    t = time.time()
                    timing = RoundTiming(next(p.round_ids), t, t)
                    loop.send(verifier, p, None, True, timing)
                    p.fill = (timing.round, pending)
                    loop.metrics.add(bubble_fills=1)
                    return
            t0 = time.time()
            draft = None
            if k > 0 and loop.drafting:
                draft = loop.drafter_round(k, remaining, bonus=False)
            t1 = time.time()
            bonus = False
            if draft is None:
                if live:
                    return  # nothing to add: wait for the rounds in flight
                bonus = True  # a plain decoding step, or the session's own match in its place
                own = loop.own_round(remaining, p.verifier_sessions, prediction=False)  # asked above: nothing live
                draft = own.draft if own is not None else None
            if not p.in_flight and stats.rounds > 0:
                loop.metrics.add(pipeline_stalls=1)  # the verifier had nothing queued for this session
            loop.send(verifier, p, draft, bonus, RoundTiming(next(p.round_ids), t0, t1), own)
            live += 1
            if own is None:  # an own match round teaches the drafter's cost estimate nothing
                loop.record_draft(t1 - t0, len(draft.chain()) if draft is not None else 0)
            if bonus:
                return  # the next round starts from this one's bonus token

    def take_fill(self, loop: SessionLoop, verifier: VerifierPort, p: PipelineState, new_tokens: list[int],
                  op: SyncOp) -> bool:
        """The bubble fill's plain step was committed: send the redraft's rest as the next round when its
        first draft equals the committed token (True: `op` is folded in), else count a miss (False)."""
        s = loop.state
        draft = loop.drafter.result(p.fill[1])
        p.fill = None
        # Lossless either way: the next round's drafts were drawn from q given the drafter's own
        # first token; when that equals the committed one they are ordinary drafts from here.
        if draft is not None and len(draft.token_ids) > 1 and draft.token_ids[0] == new_tokens[-1]:
            s.sync.append(op.without_rollback())  # the drafter's sequence already continues with it
            rest = draft.sliced(1, 1 + s.params.max_tokens - len(s.output))
            loop.record_draft(draft.draft_s, len(draft.token_ids))
            loop.metrics.add(bubble_fill_hits=1)
            loop.send(verifier, p, rest, False, RoundTiming(next(p.round_ids), draft.start, draft.end))
            return True
        loop.metrics.add(bubble_fill_misses=1)
        return False
