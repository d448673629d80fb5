"""Continuous asynchronous drafting: the drafter drafts ahead of the verifier without waiting for rounds.

Per session a `DraftAhead` keeps drafting, one token at a time (batched across its sessions), until
`lookahead` tokens lie beyond the committed point; the session loop `take`s whatever has been drafted
and not yet sent, at each verifier step. A rejection reaches the drafter at once (`resync`): the
session's epoch moves on, drafting checks the epoch between draft tokens, so stale drafting stops
within one draft token step (counted in `stale_tokens`), and the proposer rolls back to the committed
tokens plus the corrected one. When the corrected (bonus or plain-step) token equals the drafter's own
next token, its chain is kept.

Lossless: which drafts a round carries depends on the drafter's timing and on earlier rounds, never
on the random numbers that verify them; each draft is still a draw from q given the committed tokens
and the drafts before it, with q sent along.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cluster.messages import DraftReply
from cluster.sampling import SamplingParams
from drafts.proposer import Proposer

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    params: SamplingParams
    committed: int  # tokens the verifier has committed (the proposer's sequence starts with them)
    lookahead: int
    epoch: int = 0
    drafts: list[int] = field(default_factory=list)  # drafted beyond `committed`, in order
    rows: list[torch.Tensor | None] = field(default_factory=list)  # q of each draft (None: deterministic)
    taken: int = 0  # drafts already handed to the loop
    resync: tuple[int, int, list[int]] | None = None  # (epoch, length, token_ids) owed to the proposer
    learn: list[tuple[int, int]] = field(default_factory=list)
    prompt: list[int] | None = None  # not yet started on the proposer (the drafting thread does it)
    dry: bool = False  # the proposer had nothing to propose (no n-gram match): wait for new tokens
    failed: bool = False  # the proposer could not start the session: it never drafts


class DraftAhead:
    """Owns a proposer; a thread drafts for every session below its lookahead."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self._sessions: dict[object, _Ahead] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self.steps = 0  # draft token steps (one batched forward each)
        self.step_s = 0.0  # EMA of one draft token step
        self.busy_s = 0.0  # time spent in draft steps
        self.stale_tokens = 0  # tokens drafted in a step that began before its session's resync
        self.cancels = 0
        self.failures = 0
        self.chains_kept = 0  # resyncs whose corrected token equalled the drafter's own next draft
        self._released: list = []  # sessions to release on the proposer (by the drafting thread)
        self._releasing: set = set()  # ... being released or started right now
        threading.Thread(target=self._loop, daemon=True, name="draft-ahead").start()

    # -- calls from session loops ------------------------------------------------------------------

    def start(self, session, token_ids: Sequence[int], params: SamplingParams, lookahead: int) -> None:
        """The proposer is only ever called from the drafting thread: it starts the session there."""
        with self._cond:
            self._sessions[session] = _Ahead(params, len(token_ids), lookahead, prompt=list(token_ids))
            self._cond.notify_all()

    def take(self, session, max_n: int, timeout_s: float = 60.0) -> DraftReply | None:
        """Up to `max_n` drafts not yet taken, waiting for the first; None when none came in time."""
        deadline = time.time() + timeout_s
        with self._cond:
            state = self._sessions[session]
            while len(state.drafts) <= state.taken or state.resync is not None:
                if state.dry and state.resync is None:
                    return None  # nothing to propose until the sequence moves on
                remaining = deadline - time.time()
                if remaining <= 0 or self._stopped:
                    return None
                self._cond.wait(remaining)
            start = time.time()
            lo, hi = state.taken, min(len(state.drafts), state.taken + max_n)
            state.taken = hi
            rows = state.rows[lo:hi]
            dense = None
            if any(r is not None for r in rows):  # a deterministic draft among sampled ones: q one-hot there
                vocab = next(r for r in rows if r is not None).shape[-1]
                dense = torch.stack([r if r is not None else torch.zeros(vocab).index_fill_(0, torch.tensor([t]), 1.0)
                                     for r, t in zip(rows, state.drafts[lo:hi])])
            return DraftReply(state.drafts[lo:hi], None, start, time.time(), 1, dense=dense)

    def commit(self, session, num_tokens: int, accepted_drafts: int, num_drafted: int = 0) -> None:
        """The verifier committed `accepted_drafts` of the taken drafts (all of them in order, no
        correction): they leave the buffer."""
        with self._cond:
            state = self._sessions[session]
            del state.drafts[:accepted_drafts], state.rows[:accepted_drafts]
            state.taken -= accepted_drafts
            state.committed = num_tokens
            state.dry = state.failed
            if num_drafted:
                state.learn.append((num_drafted, accepted_drafts))
            self._cond.notify_all()

    def resync(self, session, length: int, token_ids: list[int], num_drafted: int = 0, num_accepted: int = 0) -> None:
        """The committed sequence is its first `length` tokens (as the drafter had them) plus `token_ids`
        (the recovered or plain-step token): at once, stale drafting stops; a matching chain is kept."""
        with self._cond:
            state = self._sessions[session]
            if num_drafted:
                state.learn.append((num_drafted, num_accepted))
            state.dry = state.failed
            if state.failed:
                return
            keep = length - state.committed  # drafts the verifier accepted before the corrected token
            ahead = state.drafts[keep:keep + len(token_ids)]
            if state.resync is None and keep >= 0 and ahead == token_ids:
                # the drafter's own chain continues with the corrected tokens: keep drafting on it
                del state.drafts[:keep + len(token_ids)], state.rows[:keep + len(token_ids)]
                state.taken = 0
                state.committed = length + len(token_ids)
                self.chains_kept += 1
            else:
                if state.resync is not None:  # not applied yet: only plain steps came since, contiguous
                    _, pending_length, pending_tokens = state.resync
                    if length == pending_length + len(pending_tokens):
                        length, token_ids = pending_length, pending_tokens + list(token_ids)
                state.epoch += 1
                state.resync = (state.epoch, length, list(token_ids))
                state.drafts, state.rows, state.taken = [], [], 0
                state.committed = length + len(token_ids)
                self.cancels += 1
            self._cond.notify_all()

    def release(self, session, timeout_s: float = 30.0) -> None:
        """Forget the session; returns once the proposer has released it (the drafting thread does)."""
        with self._cond:
            state = self._sessions.pop(session, None)
            if state is None:
                return
            self._released.append(session)
            self._cond.notify_all()
            deadline = time.time() + timeout_s
            while session in self._released or session in self._releasing:
                if time.time() > deadline or self._stopped:
                    log.warning("draft-ahead session %s not released in %.0fs", session, timeout_s)
                    return
                self._cond.wait(0.05)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # -- the drafting thread ---------------------------------------------------------------------

    def _release_on_proposer(self, session) -> None:
        try:
            self.proposer.release(session)
        except Exception:
            log.exception("releasing draft-ahead session %s failed", session)

    def _due(self) -> dict:
        return {s: st for s, st in self._sessions.items()
                if st.resync is not None or (len(st.drafts) < st.lookahead and not st.dry)}

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._due() and not self._released:
                    self._cond.wait()
                if self._stopped:
                    return
                released, self._released = self._released, []
                starting = {s: st for s, st in self._due().items() if st.prompt is not None}
                self._releasing = set(released) | set(starting)
            for session in released:  # the proposer is only ever called from this thread
                if session not in starting:
                    self._release_on_proposer(session)
            for session, state in starting.items():  # prefill outside the lock: takes stay instant
                try:
                    self.proposer.start(session, state.prompt, state.params)
                except Exception:  # the session goes on with plain steps: loud, counted
                    log.exception("draft-ahead session %s could not start: plain decoding", session)
                    state.failed, state.dry = True, True
                    self.failures += 1
            with self._cond:
                for session, state in starting.items():
                    state.prompt = None
                    if session not in self._sessions:  # released while starting
                        self._release_on_proposer(session)
                self._releasing = set()
                self._cond.notify_all()
                epochs = {}
                for session, state in self._due().items():
                    if state.prompt is not None or state.failed:
                        continue  # arrived meanwhile: started next time round
                    try:
                        if state.resync is not None:
                            _, length, token_ids = state.resync
                            state.resync = None
                            self.proposer.rollback(session, length, token_ids)
                        for num_drafted, num_accepted in state.learn:
                            self.proposer.learn(session, num_drafted, num_accepted)
                        state.learn = []
                    except Exception:  # the session goes on with plain steps: loud, counted
                        log.exception("draft-ahead session %s lost its sequence: plain decoding", session)
                        state.failed, state.dry, state.drafts, state.rows = True, True, [], []
                        self.failures += 1
                        continue
                    if len(state.drafts) < state.lookahead:
                        epochs[session] = state.epoch
            if not epochs:
                continue
            t0 = time.perf_counter()
            try:
                proposals = self.proposer.propose_batch({s: 1 for s in epochs})  # one draft token step
            except Exception:
                log.exception("continuous drafting failed")
                time.sleep(0.1)
                continue
            elapsed = time.perf_counter() - t0
            with self._cond:
                self.steps += 1
                self.step_s = elapsed if not self.step_s else 0.9 * self.step_s + 0.1 * elapsed
                self.busy_s += elapsed
                for session, proposal in proposals.items():
                    state = self._sessions.get(session)
                    if state is None:
                        continue
                    if state.epoch != epochs[session] or state.resync is not None:
                        self.stale_tokens += len(proposal.token_ids)  # cancelled during this step
                        continue
                    if not proposal.token_ids:
                        state.dry = True
                        continue
                    row = proposal.draft_probs[0] if proposal.draft_probs is not None else None
                    state.drafts.extend(proposal.token_ids)
                    state.rows.extend([row] * len(proposal.token_ids))
                self._cond.notify_all()
