"""The routers' side of the pools (`deployments.pools`): a lease on a verifier or drafter replica, taken by a
router replica and held for one session, and the name of the router's actor sent with it (its *holder*, which the
pool replicas watch).

Apart from the pools' deployments so that a router replica, which imports this, does not import what the pools'
replicas run (the drafter's proposers, the torch model runner, the verifier ranks): a router replica starts with
about 3 CPU-seconds less (`tests/test_architecture.py` keeps it so), which is how much sooner a killed router is
replaced or a new one serves."""

from __future__ import annotations

import logging
import threading

import ray

from cluster.core.errors import TandemError
from cluster.wire.transport import Endpoint
from cluster.wire.verifier_pool import VerifierLease, VerifierReplicaHandle

log = logging.getLogger(__name__)

Holder = tuple[str, str]  # (namespace, name) of the actor holding a lease: a router replica
SERVE_NAMESPACE = "serve"  # where Serve names its replicas (ray.serve._private.constants.SERVE_NAMESPACE)


def actor_alive(holder: Holder) -> bool:
    """Whether the named actor is alive. A router replica is a named Serve actor that Serve never restarts
    (`max_restarts=0`) nor names again (a new replica gets a new id): once the name is gone, so is it."""
    namespace, name = holder
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:  # "Failed to look up actor": it died (its name went with it)
        return False
    return True


def lease_holder() -> Holder | None:
    """(namespace, name) of the calling actor, sent with each lease for the pools to watch; None outside a
    named actor (e.g. a driver): such leases are not watched. Serve names its replicas in its own
    namespace, not in their job's (`get_runtime_context().namespace`): the name is looked up once here,
    where the pools will look, so that a holder is never taken for dead because it was sought elsewhere."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    name = context.get_actor_name()
    if not name:
        return None
    for namespace in dict.fromkeys((SERVE_NAMESPACE, context.namespace)):
        if actor_alive((namespace, name)):  # this very actor: found where the pools will look
            return namespace, name
    log.warning("actor %s is not found by its name: the pools will not watch its leases", name)
    return None


class Lease:
    """The router's side of a lease: the first item of a streaming call, then cancel to let go."""

    def __init__(self, handle, session: str, **options):
        self._response = handle.options(stream=True).lease.remote(session, **options)
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
        holder = lease_holder()  # this router replica: the pool releases its sessions if it dies
        self._options = {"holder": holder} if holder is not None else {}

    def acquire(self, session: str) -> VerifierLease:
        try:
            lease = Lease(self.handle, session, **self._options)
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
        holder = lease_holder()  # this router replica: the pool releases its sessions if it dies
        self._options = {"holder": holder} if holder is not None else {}

    def acquire(self, session: str):
        lease = Lease(self.handle, session, **self._options)
        return lease.value, lease.release
