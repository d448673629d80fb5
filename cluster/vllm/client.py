"""Non-blocking clients of a tandem drafter, for the proposer inside vLLM's worker (`DraftClient`).

- `LocalDraftClient`: a tandem `Proposer` (from `drafts.factory`, or a test double) on one drafting
  thread in the worker process (`tandem generate --engine vllm`);
- `RayDraftClient`: the remote `cluster.ray.drafter.Drafter` actor (`--distributed`, the Serve
  replicas), called through Ray.

`make_client(spec)` makes the one a `DrafterSpec` names.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future

from cluster.core.messages import SyncOp
from cluster.core.sampling import SamplingParams
from cluster.vllm.protocol import DrafterSpec, ProposerImport, RayDrafter
from drafts.batcher import DraftBatcher
from drafts.factory import build_proposer

log = logging.getLogger(__name__)


class DraftClient:
    """Asynchronous drafter verbs. Per session, calls run in the order they were made."""

    name = "client"

    def start_and_propose(self, session: str, prompt_ids: list[int], k: int) -> Future:
        """Open the session on `prompt_ids` and draft k tokens continuing them: a Future of list[int]."""
        raise NotImplementedError

    def propose(self, session: str, k: int, sync: Sequence = ()) -> Future:
        """Apply `sync` (SyncOps), then draft k tokens continuing the session's sequence."""
        raise NotImplementedError

    def resume(self, session: str, start: int, history: list[int], k: int) -> Future:
        """A session the front door opened on `history[:start]` (its prompt; the drafter may already
        be drafting): append what vLLM committed since, then draft k tokens. A session the drafter does
        not know fails (plain decoding for it): only the front door opens and releases registered
        sessions, so that none outlives its request (a session opened here after the front door's
        release would never be released)."""
        return self.propose(session, k, [SyncOp(length=start, token_ids=history[start:])])

    def release(self, session: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- in this process ---------------------------------------------------------------------------------


def _then(future: Future, fn) -> Future:
    """A Future of fn(future's result), failing as `future` does."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for `out`
            out.set_exception(e)

    future.add_done_callback(done)
    return out


class LocalDraftClient(DraftClient):
    """A tandem `Proposer` on one drafting thread in this process (`drafts.batcher.DraftBatcher`, the
    drafter actor's own): queued proposes of several sessions are drafted together, per-session order
    is kept."""

    def __init__(self, proposer, name: str = "local"):
        self.proposer = proposer
        self.name = name
        self.batcher = DraftBatcher(proposer, name="tandem-vllm-drafter")

    def start_and_propose(self, session, prompt_ids, k):
        prompt_ids = list(prompt_ids)  # drafts: greedy, verified one-hot
        self.batcher.call(lambda: self.proposer.start(session, prompt_ids, SamplingParams()))
        return self.propose(session, k)

    def propose(self, session, k, sync=()):
        return _then(self.batcher.propose(session, k, sync), lambda drafted: list(drafted.proposal.token_ids))

    def release(self, session):
        self.batcher.call(lambda: self.proposer.release(session))

    def close(self):
        self.batcher.close()


# -- the Drafter actor on Ray ---------------------------------------------------------------------------


class RayDraftClient(DraftClient):
    """The remote `cluster.ray.drafter.Drafter` actor, found by name on the Ray cluster at `address`."""

    name = "ray"

    def __init__(self, ref: RayDrafter):
        import ray  # here, not at the top: a worker drafting in process never loads Ray

        if ref.auth_mode and os.environ.get("RAY_AUTH_MODE") != ref.auth_mode:
            # the cluster's mode (a local Ray started by ray.init uses tokens; the token stays in its file).
            # This process imported ray before: refresh Ray's cached config, as ray.init does for itself.
            os.environ["RAY_AUTH_MODE"] = ref.auth_mode
            from ray._raylet import Config

            Config.initialize("")
        if not ray.is_initialized():
            ray.init(address=ref.address or "auto", namespace=ref.namespace, log_to_driver=False,
                     logging_level=logging.WARNING)
        self.actor = ray.get_actor(ref.actor, namespace=ref.namespace)

    def start_and_propose(self, session, prompt_ids, k):
        result: Future = Future()
        started = self.actor.start.remote(session, list(prompt_ids), SamplingParams()).future()

        def after_start(f: Future) -> None:
            try:
                f.result()
                self._chain(self.actor.propose.remote(session, k, []), result)
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)

        started.add_done_callback(after_start)
        return result

    def propose(self, session, k, sync=()):
        result: Future = Future()
        self._chain(self.actor.propose.remote(session, k, list(sync)), result)
        return result

    @staticmethod
    def _chain(ref, result: Future) -> None:
        def done(f: Future) -> None:
            try:
                result.set_result(list(f.result().token_ids))
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)

        ref.future().add_done_callback(done)

    def release(self, session):
        try:
            self.actor.release.remote(session)
        except Exception:  # noqa: BLE001 - a dead actor has nothing to release
            pass


# -- from a spec ---------------------------------------------------------------------------------------------


def imported_proposer(ref: ProposerImport):
    """Tests only: the proposer `ref.path` ("module:callable") makes from `ref.kwargs`."""
    module, _, attr = ref.path.partition(":")
    return getattr(importlib.import_module(module), attr)(**ref.kwargs)


def make_client(spec: DrafterSpec) -> DraftClient | None:
    """The client of the drafter `spec` names; None when it names none (plain decoding)."""
    if spec.ray is not None:
        return RayDraftClient(spec.ray)
    if spec.engine is not None:
        proposer = build_proposer(spec.engine)  # loads what the draft needs in this process
        if proposer is None:
            raise ValueError(f"drafter spec engine {spec.engine.model_dump(mode='json')} has no proposer")
    elif spec.proposer_import is not None:
        proposer = imported_proposer(spec.proposer_import)
    else:
        return None
    return LocalDraftClient(proposer, proposer.name)
