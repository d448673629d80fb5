"""One drafting thread over a proposer: the drafter actor's and vLLM's in-process client's batching.

Calls from any thread queue an operation and get a Future. The thread takes everything queued,
applies each propose's sync ops (rollback, then learn) and drafts the proposes of several sessions
together, one `propose_batch` (one batched forward per draft position). Order per session is kept:
a start, a release, any other call, or a second propose of a session first drafts what was queued
before it, so a release never frees a session under its own pending draft.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.core.messages import SyncOp, apply_sync
from drafts.proposer import DraftProposal, Proposer, shapes_sequential_rounds

log = logging.getLogger(__name__)


@dataclass
class Drafted:
    """A propose's result: the proposal and when its batch was drafted, with how many sessions."""

    proposal: DraftProposal
    start: float
    end: float
    batch_size: int


@dataclass
class _Propose:
    session: str
    k: int
    sync: list[SyncOp]
    tree: bool  # a token tree (when the proposer makes them), else a chain


class DraftBatcher:
    """The drafting thread. `draft_s`, `idle_s`, `batches`: what it spent drafting and waiting."""

    def __init__(self, proposer: Proposer, name: str = "drafter-loop"):
        self.proposer = proposer
        self.draft_s = 0.0
        self.idle_s = 0.0
        self.idle_since = time.time()
        self.batches = 0
        self._closed = False
        self._cond = threading.Condition()
        self._queue: list[tuple[_Propose | Callable[[], object] | None, Future | None]] = []
        threading.Thread(target=self._loop, daemon=True, name=name).start()

    def propose(self, session: str, k: int, sync: Sequence[SyncOp] = (), tree: bool = False) -> Future:
        """Apply `sync` in order, then draft k tokens (with `tree`: a token tree whose chain is k long,
        where the proposer makes them). A Future of `Drafted`."""
        return self._put(_Propose(session, k, list(sync), tree))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the drafting thread, after every draft queued before it (start, release, ...)."""
        return self._put(fn)

    def backlog(self) -> int:
        """Proposes queued and not yet drafted."""
        with self._cond:
            return sum(1 for op, _ in self._queue if isinstance(op, _Propose))

    def close(self) -> None:
        """Fail what is queued, and stop the thread."""
        with self._cond:
            self._closed = True
            self._queue.append((None, None))
            self._cond.notify()

    def _put(self, op) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                future.set_exception(RuntimeError("the drafter is closed"))
                return future
            self._queue.append((op, future))
            self._cond.notify()
        return future

    # -- the drafting thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                items, self._queue = self._queue, []
            batch: dict[str, tuple[_Propose, Future]] = {}
            for op, future in items:
                if op is None:  # closed
                    self._fail(batch)
                    for rest, f in items:
                        if f is not None and not f.done():
                            f.set_exception(RuntimeError("the drafter is closed"))
                    return
                if not isinstance(op, _Propose) or op.session in batch:  # draft what was queued before it
                    self._draft(batch)
                    batch = {}
                try:
                    if isinstance(op, _Propose):
                        apply_sync(self.proposer, op.session, op.sync)
                        batch[op.session] = (op, future)
                    else:
                        future.set_result(op())
                except Exception as e:  # noqa: BLE001 - raised to whoever waits for this call
                    future.set_exception(e)
            self._draft(batch)

    def _draft(self, batch: dict[str, tuple[_Propose, Future]]) -> None:
        if not batch:
            return
        start = time.time()
        self.idle_s += max(0.0, start - self.idle_since)
        requests = {s: op.k for s, (op, _) in batch.items()}
        trees = {s for s, (op, _) in batch.items() if op.tree}
        try:
            if trees and shapes_sequential_rounds(self.proposer):
                proposals = self.proposer.propose_batch(requests, trees=trees)
            else:
                proposals = self.proposer.propose_batch(requests)
        except Exception as e:  # noqa: BLE001 - every propose of the batch fails with it
            for _, future in batch.values():
                future.set_exception(e)
            return
        end = time.time()
        self.draft_s += end - start
        self.idle_since = end
        self.batches += 1
        for session, (_, future) in batch.items():
            future.set_result(Drafted(proposals[session], start, end, len(batch)))

    @staticmethod
    def _fail(batch: dict[str, tuple[_Propose, Future]]) -> None:
        for _, future in batch.values():
            future.set_exception(RuntimeError("the drafter is closed"))
