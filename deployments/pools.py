"""The verifier pool and the drafter pool as Serve deployments, and the routers' view of them.

A session holds a *lease* on one replica of each: a streaming call that yields where to reach the
replica (the verifier's `cluster.transport.Endpoint`: its node's address, plus its TLS root when TLS
is configured; the drafter actor's handle) and then stays open until the session ends. Serve
therefore counts open sessions as ongoing requests: its power-of-two-choices routing places a new
session on the less loaded of two replicas, its queue holds sessions beyond `max_ongoing_requests`,
and autoscaling on `target_ongoing_requests` scales each pool on sessions per replica (plus queued
ones). Drafting and verifying then go straight to the replica (gRPC stream, actor calls), not
through Serve's request path; verifier calls carry the cluster secret, which routers read from Ray
(never from the lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import ray
from ray import serve
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.errors import TandemError
from cluster.verifier_pool import VerifierLease, VerifierReplicaHandle
from cluster.runtime import VerifierRank, free_port
from cluster.transport import Endpoint

log = logging.getLogger(__name__)


async def _hold(cancelled: asyncio.Event) -> None:
    await cancelled.wait()


class _Leases:
    """Open leases of one pool replica (Serve's ongoing requests on it), for leak checks."""

    def __init__(self) -> None:
        self.open = 0

    @contextlib.contextmanager
    def held(self):
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


class VerifierPool:
    """One verifier replica: rank 0 runs in this Serve replica (and serves gRPC on its node's address,
    `engine.network`); ranks 1..N−1 are actors in the replica's own STRICT_PACK placement group."""

    def __init__(self, engine_config: dict, tensor_parallel_size: int = 1, rank_placement: dict | None = None):
        context = serve.get_replica_context()
        name = f"verifier-{context.replica_id.unique_id}"
        port = free_port() if tensor_parallel_size > 1 else 0
        self.followers = []
        if tensor_parallel_size > 1:
            group = ray.util.get_current_placement_group()
            rank_placement = rank_placement or {}
            actor_cls = ray.remote(VerifierRank)
            for rank in range(1, tensor_parallel_size):
                self.followers.append(actor_cls.options(
                    name=f"tandem-follower-{context.app_name}-{context.replica_id.unique_id}-rank{rank}",
                    num_cpus=rank_placement.get("num_cpus", 1), num_gpus=rank_placement.get("num_gpus", 0),
                    resources=rank_placement.get("resources") or None, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                ).remote(engine_config, name, rank, tensor_parallel_size, port))
        self.rank0 = VerifierRank(engine_config, name, 0, tensor_parallel_size, port)
        self.leases = _Leases()
        self.name = name
        endpoint = self.rank0.endpoint()
        log.info("verifier replica %s serving on %s%s (tensor_parallel_size=%d)", name, endpoint.address,
                 " over TLS" if endpoint.root_certificates else "", tensor_parallel_size)

    async def lease(self, session: str):
        """Yields this replica's gRPC endpoint, then holds the session until the caller cancels."""
        if self.rank0.broken():  # until Serve's health check replaces this replica
            raise RuntimeError(f"verifier replica {self.name} is being replaced: {self.rank0.broken()}")
        with self.leases.held():
            yield self.rank0.endpoint()
            await _hold(asyncio.Event())

    def sessions(self) -> int:
        return self.rank0.engine.num_sessions

    def open_leases(self) -> int:
        return self.leases.open

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"sessions": float(self.sessions())}

    def check_health(self) -> None:
        if self.rank0.broken():  # its collectives failed: Serve replaces the replica, followers and all
            raise RuntimeError(self.rank0.broken())
        for follower in self.followers:
            ray.get(follower.pid.remote(), timeout=30)  # a dead rank fails the replica; Serve replaces it


class DrafterPool:
    """One drafter replica: the drafter actor (on the configured cheap resource) behind a thin Serve replica."""

    def __init__(self, engine_config: dict, placement: dict):
        from cluster.drafter import Drafter

        context = serve.get_replica_context()
        self.actor = ray.remote(Drafter).options(
            name=f"tandem-drafter-{context.app_name}-{context.replica_id.unique_id}",
            num_cpus=placement.get("num_cpus", 1), num_gpus=placement.get("num_gpus", 0),
            accelerator_type=placement.get("accelerator_type"), resources=placement.get("resources") or None,
            max_restarts=-1, max_task_retries=0, max_concurrency=256,
        ).remote(engine_config)
        ray.get(self.actor.ready.remote(), timeout=600)
        self.leases = _Leases()

    async def lease(self, session: str):
        """Yields the drafter actor's handle, then holds the session until the caller cancels."""
        with self.leases.held():
            yield self.actor
            await _hold(asyncio.Event())

    def sessions(self) -> int:
        """Sessions the drafter actor holds state for."""
        return ray.get(self.actor.stats.remote(), timeout=30)["sessions"]

    def open_leases(self) -> int:
        return self.leases.open

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"drafting_backlog": float(ray.get(self.actor.stats.remote(), timeout=10)["backlog"])}

    def check_health(self) -> None:
        ray.get(self.actor.ready.remote(), timeout=60)


class _Lease:
    """The router's side of a lease: the first item of a streaming call, then cancel to let go."""

    def __init__(self, handle, session: str):
        self._response = handle.options(stream=True).lease.remote(session)
        self.value = next(iter(self._response))
        self._lock = threading.Lock()
        self._done = False

    def release(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                self._response.cancel()


class ServeVerifierPool:
    """`acquire` for the router: a lease on the replica Serve picks; gRPC channels cached by endpoint."""

    def __init__(self, handle):
        self.handle = handle
        self._replicas: dict[Endpoint, VerifierReplicaHandle] = {}
        self._lock = threading.Lock()

    def acquire(self, session: str) -> VerifierLease:
        try:
            lease = _Lease(self.handle, session)
        except Exception as e:  # e.g. a replica being replaced: the router waits and asks again
            raise TandemError(f"no verifier replica took session {session}: {type(e).__name__}: {e}") from e
        endpoint: Endpoint = lease.value
        with self._lock:
            replica = self._replicas.get(endpoint)
            if replica is None or not replica.healthy:
                replica = self._replicas[endpoint] = VerifierReplicaHandle(endpoint.name, lambda *_: endpoint)
        return VerifierLease(replica, release=lease.release)


class ServeDrafterPool:
    """`acquire` for the router: (the drafter actor Serve picked for the session, release callback)."""

    def __init__(self, handle):
        self.handle = handle

    def acquire(self, session: str):
        lease = _Lease(self.handle, session)
        return lease.value, lease.release
