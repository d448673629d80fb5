"""Verifier replicas as a router sees them, and the pools that place sessions on them.

A replica handle holds an endpoint, a channel that carries the cluster secret on every call
(`cluster.wire.transport.open_channel`), and a way to find the endpoint again after a restart. A pool hands
out `VerifierLease`s: `StaticVerifierPool` for the `TandemCluster` runtime; the Serve application's
pool is `deployments.leases.ServeVerifierPool`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from cluster.core.errors import InvalidRequestError, TandemError
from cluster.wire.transport import Endpoint, open_channel
from protos import rpc

log = logging.getLogger(__name__)


class VerifierReplicaHandle:
    """A replica as the router sees it: a name, an endpoint and a way to find the endpoint again.

    Its channel carries the cluster secret on every call (`cluster.wire.transport.open_channel`), over TLS
    when the replica's endpoint names a root certificate."""

    def __init__(self, name: str, resolve):
        self.name, self._resolve = name, resolve
        self.endpoint: Endpoint = resolve()
        self.sessions = 0
        self.healthy = True
        self._channel = open_channel(self.endpoint)
        self.stub = rpc.VerifierStub(self._channel)

    @property
    def address(self) -> str:
        return self.endpoint.address

    def refresh(self, timeout_s: float = 300.0) -> bool:
        """Ask for the endpoint again (a restarted replica binds a new port)."""
        try:
            endpoint = self._resolve(timeout_s)
            channel = open_channel(endpoint) if endpoint != self.endpoint else None
        except Exception as e:
            log.warning("verifier replica %s is not back: %s", self.name, e)
            return False
        if channel is not None:
            self._channel.close()
            self.endpoint, self._channel = endpoint, channel
            self.stub = rpc.VerifierStub(channel)
        self.healthy = True
        return True

    def mark_failed(self) -> None:
        """Take the replica out of placement until Ray has restarted it (in the background)."""
        if self.healthy:
            self.healthy = False
            threading.Thread(target=self._recover, daemon=True, name=f"refresh-{self.name}").start()

    def _recover(self) -> None:
        while not self.refresh():  # logged by refresh; the replica stays out of placement meanwhile
            time.sleep(5.0)


class StaticVerifierPool:
    """A fixed list of replicas (the `TandemCluster` runtime): sessions go to the least-loaded healthy one."""

    def __init__(self, replicas: Sequence[VerifierReplicaHandle]):
        if not replicas:
            raise InvalidRequestError("the verifier pool is empty")
        self.replicas = list(replicas)
        self._lock = threading.Lock()

    def acquire(self, session: str) -> "VerifierLease":
        with self._lock:
            candidates = [r for r in self.replicas if r.healthy]
            if not candidates:
                raise TandemError("no verifier replica is serving")
            replica = min(candidates, key=lambda r: r.sessions)  # least loaded
            replica.sessions += 1
        return VerifierLease(replica, release=lambda: self._unpin(replica))

    def _unpin(self, replica: VerifierReplicaHandle) -> None:
        with self._lock:
            replica.sessions -= 1


class VerifierLease:
    """A session's hold on one verifier replica; `release` is called exactly once."""

    def __init__(self, replica: VerifierReplicaHandle, release=lambda: None):
        self.replica = replica
        self._release = release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class StaticDrafter:
    """One drafter actor for every session (the `TandemCluster` runtime)."""

    def __init__(self, actor):
        self.actor = actor

    def acquire(self, session: str):
        """(actor handle, release callback) for one session."""
        return self.actor, lambda: None
