"""The verifier pool and the drafter pool as Serve deployments (the routers' view of them: `deployments.leases`).

A session holds a *lease* on one replica of each: a streaming call that yields where to reach the
replica (the verifier's `cluster.wire.transport.Endpoint`: its node's address, plus its TLS root when TLS
is configured; the drafter actor's handle) and then stays open until the session ends. Serve
therefore counts open sessions as ongoing requests: its power-of-two-choices routing places a new
session on the less loaded of two replicas, its queue holds sessions beyond `max_ongoing_requests`,
and autoscaling on `target_ongoing_requests` scales each pool on sessions per replica (plus queued
ones). Drafting and verifying then go straight to the replica (gRPC stream, actor calls), not
through Serve's request path; verifier calls carry the cluster secret, which routers read from Ray
(never from the lease).

Each lease names its *holder*, the router replica's actor (`deployments.leases.lease_holder`). A pool replica checks
every `HOLDER_CHECK_PERIOD_S` whether each holder is still alive (`_Leases`); the sessions of one
that died (a killed router replica) are released there (the verifier's KV, the drafter's session)
and their leases end, so nothing waits for the pool replica to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import ray
from ray import serve
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.model.models import DEFAULT_MODEL_NAME
from cluster.ray.drafter import launch_drafter
from cluster.ray.runtime import VerifierRank, free_port
from deployments.leases import Holder, actor_alive
from deployments.metrics import orphaned_sessions_counter, prompt_cache_counters

log = logging.getLogger(__name__)


HOLDER_CHECK_PERIOD_S = 5.0  # how often a pool replica checks that the holders of its leases are alive

def _model_tag(engine_config: dict) -> str:
    target = engine_config.get("target") or "default"
    return DEFAULT_MODEL_NAME if target == "default" else Path(str(target)).name


class _Leases:
    """Open leases of one pool replica (Serve's ongoing requests on it), by holder.

    A lease with a holder (a router replica's actor) is watched: one asyncio task, running while any
    such lease is open, checks every `period_s` whether each distinct holder is `alive`; for one that is
    gone, each session it held is released (`release(session, kind)`, blocking, run in a thread: it
    must be idempotent) and its lease ends (`held` yields the event that ends it). A call the holder
    sent before it died may still open such a session after that, so each is released once more at
    the next check. `on_orphans(n)` counts them. Leases are added and the task runs on the replica's
    event loop."""

    def __init__(self, release: Callable[[str, object], None] | None = None,
                 alive: Callable[[Holder], bool] = actor_alive, period_s: float = HOLDER_CHECK_PERIOD_S,
                 on_orphans: Callable[[int], None] = lambda n: None, pool: str = "pool replica"):
        self.open = 0
        self.orphans_released = 0
        self._release = release
        self._alive = alive
        self.period_s = period_s
        self._on_orphans = on_orphans
        self._pool = pool
        self._held: dict[Holder, dict[str, tuple[asyncio.Event, object]]] = {}  # holder -> session -> (end, kind)
        self._again: dict[str, object] = {}  # orphaned sessions to release once more at the next check
        self._task: asyncio.Task | None = None

    @contextlib.contextmanager
    def held(self, session: str, holder: Holder | None = None, kind: object = None):
        """Counts the lease open; yields the event that ends it early (its holder died)."""
        ended = asyncio.Event()
        entry = (ended, kind)
        self.open += 1
        if holder is not None and self._release is not None:
            self._held.setdefault(tuple(holder), {})[session] = entry
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._watch())
        try:
            yield ended
        finally:
            self.open -= 1
            if holder is not None:
                sessions = self._held.get(tuple(holder))
                if sessions is not None and sessions.get(session) is entry:  # ended by its holder
                    del sessions[session]
                    if not sessions:
                        del self._held[tuple(holder)]

    async def _watch(self) -> None:
        try:
            while self._held or self._again:
                await asyncio.sleep(self.period_s)
                try:
                    await self.check()
                except Exception:  # never let one bad pass stop the watching
                    log.exception("%s: checking lease holders failed", self._pool)
        finally:
            self._task = None

    async def check(self) -> int:
        """One pass: release the sessions of holders that are gone and end their leases; returns how many."""
        again, self._again = self._again, {}
        for session, kind in again.items():
            await self._release_one(session, kind)
        released = 0
        for holder in list(self._held):
            try:
                alive = await asyncio.to_thread(self._alive, holder)
            except Exception as e:  # e.g. the GCS not answering: ask again next time
                log.warning("%s: could not tell whether lease holder %s is alive: %s", self._pool, holder[1], e)
                continue
            if alive:
                continue
            sessions = self._held.pop(holder, {})
            for session, (ended, kind) in sessions.items():
                await self._release_one(session, kind)
                self._again[session] = kind
                ended.set()
            if sessions:
                released += len(sessions)
                log.warning("%s: lease holder %s is gone; released its %d session(s) and ended their leases",
                            self._pool, holder[1], len(sessions))
        if released:
            self.orphans_released += released
            self._on_orphans(released)
        return released

    async def _release_one(self, session: str, kind: object) -> None:
        try:
            await asyncio.to_thread(self._release, session, kind)
        except Exception:
            log.exception("%s: releasing orphaned session %s failed", self._pool, session)


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
        self.rank0.engine.prompt_cache.on_hit = prompt_cache_counters(_model_tag(engine_config), "verifier")
        orphans = orphaned_sessions_counter(_model_tag(engine_config), "verifier")
        self.leases = _Leases(self._release_orphan, on_orphans=orphans.inc, pool=f"verifier replica {name}")
        self.name = name
        endpoint = self.rank0.endpoint()
        log.info("verifier replica %s serving on %s%s (tensor_parallel_size=%d)", name, endpoint.address,
                 " over TLS" if endpoint.root_certificates else "", tensor_parallel_size)

    async def lease(self, session: str, holder: Holder | None = None):
        """Yields this replica's gRPC endpoint, then holds the session until the caller cancels, or until
        `holder` (the caller's actor, when given) is found dead: the session's KV is then released here."""
        if self.rank0.broken():  # until Serve's health check replaces this replica
            raise RuntimeError(f"verifier replica {self.name} is being replaced: {self.rank0.broken()}")
        with self.leases.held(session, holder) as ended:
            yield self.rank0.endpoint()
            await ended.wait()

    def _release_orphan(self, session: str, kind: object = None) -> None:
        self.rank0.engine.release(session)  # a no-op for a session already released (or never opened)

    def sessions(self) -> int:
        return self.rank0.engine.num_sessions

    def open_leases(self) -> int:
        return self.leases.open

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"sessions": float(self.sessions())}

    def check_health(self) -> None:
        """A replica whose tensor-parallel group is gone for good (rank 0's collectives failed, or a follower
        rank died) ends its own process: Serve replaces a crashed replica at once, where a health check
        that raises is counted three times, ten seconds apart, before the replacement starts (~30 s more of
        a replica that refuses every session). Its followers are its own actors and end with it. A follower
        that is only slow to answer fails this check, and Serve counts that as usual."""
        reason = self.rank0.broken() or self._dead_follower()
        if reason:
            log.error("verifier replica %s: its tensor-parallel group cannot serve (%s); ending the replica so "
                      "that Serve replaces it now", serve.get_replica_context().replica_id.unique_id, reason)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)


    def _dead_follower(self) -> str | None:
        """Why a follower rank is gone (None while every one answers; a slow one raises its timeout)."""
        for follower in self.followers:
            try:
                ray.get(follower.pid.remote(), timeout=30)
            except ray.exceptions.RayActorError as e:
                return f"follower rank died: {type(e).__name__}"
        return None


class DrafterPool:
    """One drafter replica: the drafter actor (on the configured cheap resource) behind a thin Serve replica."""

    def __init__(self, engine_config: dict, placement: dict):
        context = serve.get_replica_context()
        self.actor = launch_drafter(
            engine_config, name=f"tandem-drafter-{context.app_name}-{context.replica_id.unique_id}",
            num_cpus=placement.get("num_cpus", 1), num_gpus=placement.get("num_gpus", 0),
            accelerator_type=placement.get("accelerator_type"), resources=placement.get("resources"))
        ray.get(self.actor.ready.remote(), timeout=600)
        orphans = orphaned_sessions_counter(_model_tag(engine_config), "drafter")
        self.leases = _Leases(self._release_orphan, on_orphans=orphans.inc,
                              pool=f"drafter replica {context.replica_id.unique_id}")

    async def lease(self, session: str, holder: Holder | None = None):
        """Yields the drafter actor's handle, then holds the session until the caller cancels, or until
        `holder` (the caller's actor, when given) is found dead: the session is then released on the
        drafter."""
        with self.leases.held(session, holder) as ended:
            yield self.actor
            await ended.wait()

    def _release_orphan(self, session: str, kind: object = None) -> None:
        # a no-op for a session the drafter no longer (or never) held
        ray.get(self.actor.release.remote(session), timeout=60)

    def sessions(self) -> int:
        """Sessions the drafter actor holds state for."""
        return ray.get(self.actor.stats.remote(), timeout=30)["sessions"]

    def open_leases(self) -> int:
        return self.leases.open

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"drafting_backlog": float(ray.get(self.actor.stats.remote(), timeout=10)["backlog"])}

    def check_health(self) -> None:
        ray.get(self.actor.ready.remote(), timeout=60)
