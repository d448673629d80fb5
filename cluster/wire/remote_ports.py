"""The session loop's ports over the network: a gRPC `Verify` stream and a Ray drafter actor.

`GrpcVerifierPort` is one session's bidirectional stream to a verifier replica (rounds out, results
back in order; a transport fault raises `grpc.RpcError`, which the router answers with a replay).
`RayDrafterPort` is one session on a drafter actor; any failure of the drafter (dead, unreachable,
raised, timed out) marks the port lost, and the loop goes on with plain target decoding: same output,
logged and counted.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

import ray
import ray.exceptions

from cluster.core.messages import DraftReply, SyncOp
from cluster.core.sampling import SamplingParams
from cluster.core.rounds import RoundResult
from cluster.session.loop import LoopMetrics
from cluster.wire.codec import result_from_pb, round_to_pb
from cluster.wire.verifier_pool import VerifierLease

log = logging.getLogger(__name__)

# A drafter call failing for any of these sends the session on with plain target decoding (same output):
# the actor died or is unreachable, or it raised, e.g. a drafter Ray restarted no longer knows the session.
DRAFTER_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayTaskError)


class GrpcVerifierPort:
    """One session's open bidirectional Verify stream on a leased replica."""

    def __init__(self, lease: VerifierLease, session: str, open_features=None, prompt_logprobs=None):
        self.lease, self.replica, self.session = lease, lease.replica, session
        self.open_features = open_features  # the target's features of the prefilled tokens (if asked)
        self.prompt_logprobs = prompt_logprobs  # list[TokenLogprob] of prompt tokens 1 .. (if asked)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = self.replica.stub.Verify(iter(self._requests.get, None))

    def send(self, round: int, epoch: int, bonus: bool, draft: DraftReply | None) -> None:
        token_ids = draft.token_ids if draft is not None else []
        rows = draft.rows() if draft is not None else None
        parents = draft.parents if draft is not None else None
        self._requests.put(round_to_pb(self.session, round, epoch, bonus, token_ids, rows, parents))

    def receive(self) -> tuple[RoundResult, int]:
        return result_from_pb(next(self._responses))

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


class RayDrafterPort:
    """One session on a drafter actor; `acquire()` gives (actor, release callback) when the session starts."""

    def __init__(self, acquire: Callable[[], tuple], session: str, params: SamplingParams, metrics: LoopMetrics,
                 timeout_s: float = 120.0, needs_features: bool = False):
        self._acquire, self.session, self.params, self.metrics = acquire, session, params, metrics
        self.timeout_s = timeout_s
        self.needs_features = needs_features  # a feature-fed draft: the verifier sends the target's features
        self.alive = True
        self.started = False
        self.actor = None
        self._release_lease: Callable[[], None] = lambda: None

    def _lost(self, what: str, error: Exception) -> None:
        if self.alive:
            log.warning("drafter failed during %s of session %s (%s): continuing with plain target decoding",
                        what, self.session, type(error).__name__)
            self.metrics.add(drafter_fallbacks=1)
        self.alive = False

    def _submit(self, what: str, call: Callable[[], ray.ObjectRef]) -> ray.ObjectRef | None:
        if not self.alive:
            return None
        try:
            return call()
        except DRAFTER_ERRORS as e:
            self._lost(what, e)
            return None

    def _get(self, ref: ray.ObjectRef | None, what: str):
        if ref is None or not self.alive:
            return None
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except DRAFTER_ERRORS + (ray.exceptions.GetTimeoutError,) as e:
            self._lost(what, e)
            return None

    def _start(self, call: Callable[[], ray.ObjectRef]) -> None:
        """Acquire a drafter for the session, then open it there with `call()` (waited for)."""
        self.started = True
        if not self.alive:
            return
        try:
            self.actor, self._release_lease = self._acquire()
        except Exception as e:  # no drafter replica could take the session
            self._lost(f"acquire ({e})", e)
            return
        self._get(self._submit("start", call), "start")

    def start(self, token_ids: list[int]) -> None:
        self._start(lambda: self.actor.start.remote(self.session, token_ids, self.params))

    def propose(self, k: int, sync: list[SyncOp], tree: bool = False) -> ray.ObjectRef | None:
        return self._submit("propose", lambda: self.actor.propose.remote(self.session, k, sync, tree))

    def result(self, pending: ray.ObjectRef | None) -> DraftReply | None:
        return self._get(pending, "propose")

    def release(self) -> None:
        """Not waited for: the drafter frees the session's state in its own time."""
        if self.started and self.actor is not None:
            self._submit("release", lambda: self.actor.release.remote(self.session))
        self._release_lease()
