"""The two ports of the session loop, and their in-process implementations.

`cluster.session.loop.SessionLoop` drives one session through a `VerifierPort` (send rounds, receive their
results in order) and a `DrafterPort` (start, propose with the sync ops owed, release). Here both
sides live in this process: a `VerifierEngine` over a local target runner, and a proposer. The
distributed runtime implements the same ports over gRPC and Ray (`cluster.wire.remote_ports`), so the
single-process decoder and the router run one algorithm.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Protocol

from cluster.core.messages import DraftReply, SyncOp, apply_sync
from cluster.core.rounds import Opened, Round, RoundResult
from cluster.core.sampling import SamplingParams
from drafts.proposer import Proposer, shapes_sequential_rounds

if TYPE_CHECKING:  # the in-process port's engine: only the processes that run a target load the runner
    from cluster.model.verifier import VerifierEngine


class VerifierPort(Protocol):
    """One session's ordered stream of rounds to a verifier."""

    def send(self, round: int, epoch: int, bonus: bool, draft: DraftReply | None) -> None:
        """Queue a round: `draft` (None: a plain step, `bonus` then True) drafted in `epoch`."""

    def receive(self) -> tuple[RoundResult, int]:
        """The oldest unanswered round's result, and the sessions active on the verifier."""


class DrafterPort(Protocol):
    """One session's drafter. A lost drafter (`alive` False) means plain decoding from then on."""

    alive: bool
    started: bool

    def start(self, token_ids: list[int]) -> None:
        """Open the session on the drafter with the committed tokens."""

    def propose(self, k: int, sync: list[SyncOp], tree: bool = False):
        """Apply `sync`, then draft k tokens (`tree`: a token tree may be proposed, its chain k long);
        a pending handle for `result` (None if the drafter is lost)."""

    def result(self, pending) -> DraftReply | None:
        """The proposal of a pending handle (None if the drafter was lost meanwhile)."""

    def release(self) -> None:
        """Forget the session on the drafter."""


class LocalVerifierPort:
    """A session on an in-process `VerifierEngine`. Without an engine thread, `receive` runs the engine's
    steps itself (a single-threaded decoder); with one (`VerifierEngine.run_forever`), it waits."""

    def __init__(self, engine: VerifierEngine, session: str, engine_thread: bool = False):
        self.engine, self.session, self.engine_thread = engine, session, engine_thread
        self._results: queue.SimpleQueue = queue.SimpleQueue()

    def open(self, token_ids: Sequence[int], params: SamplingParams, features: bool = False) -> Opened:
        """Prefill; with `features`, the target's features of all but the last token come back, with
        `params.prompt_logprobs` the prompt's logprobs."""
        return self.engine.open(self.session, token_ids, params, features=features)

    def send(self, round: int, epoch: int, bonus: bool, draft: DraftReply | None) -> None:
        token_ids = draft.token_ids if draft is not None else []
        q = draft.q(self.engine.runner.vocab_size) if draft is not None else None
        parents = draft.parents if draft is not None else None
        self.engine.submit(Round(self.session, round, epoch, list(token_ids), q, bonus, parents), self._results.put)

    def receive(self) -> tuple[RoundResult, int]:
        while not self.engine_thread and self._results.empty():
            self.engine.step()
        item = self._results.get()
        if isinstance(item, Exception):
            raise item
        return item, self.engine.num_sessions

    def release(self) -> None:
        self.engine.release(self.session)


class LocalDrafterPort:
    """A session on an in-process proposer. With an `executor`, proposals are drafted in its thread while
    the caller verifies (torch releases the GIL: drafting and verifying overlap); without, at once."""

    def __init__(self, proposer: Proposer, session, params: SamplingParams, executor: Executor | None = None):
        self.proposer, self.session, self.params, self.executor = proposer, session, params, executor
        self.needs_features = getattr(proposer, "needs_features", False)
        self.alive = True
        self.started = False
        self._pending: Future | None = None

    def start(self, token_ids: list[int]) -> None:
        self.proposer.start(self.session, list(token_ids), self.params)
        self.started = True

    def _propose(self, k: int, sync: list[SyncOp], tree: bool) -> DraftReply:
        apply_sync(self.proposer, self.session, sync)
        start = time.time()
        if tree and shapes_sequential_rounds(self.proposer):
            proposal = self.proposer.propose_batch({self.session: k}, trees={self.session})[self.session]
        else:
            proposal = self.proposer.propose(self.session, k)
        return DraftReply(list(proposal.token_ids), None, start, time.time(), 1, dense=proposal.draft_probs,
                          parents=proposal.parents)

    def propose(self, k: int, sync: list[SyncOp], tree: bool = False) -> Future:
        self._wait()  # one call at a time per session, in order
        if self.executor is None:
            future: Future = Future()
            future.set_result(self._propose(k, sync, tree))
        else:
            future = self.executor.submit(self._propose, k, sync, tree)
        self._pending = future
        return future

    def result(self, pending: Future) -> DraftReply:
        return pending.result()  # a proposer that raises is a bug in this process: loud

    def _wait(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception:
                pass  # raised to whoever asked for that result
            self._pending = None

    def release(self) -> None:
        self._wait()  # never free the session under a proposal still drafting
        if self.started:
            self.proposer.release(self.session)
