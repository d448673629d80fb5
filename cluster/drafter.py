"""The drafter: a Ray actor that owns a proposer and serves many sessions.

It runs threaded (`max_concurrency`): concurrent `propose` calls of different sessions are gathered
and drafted together, one batched forward per draft position. A session has at most one call in
flight; the router folds the previous round's rollback and feedback into the next `propose`
(`sync`), so no ordering between separate calls is needed. Draft distributions leave as sparse
(ids, probs) rows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cluster.messages import DraftReply, SyncOp
from cluster.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Propose:
    """A queued `propose`: its sync ops are applied, then it is drafted with the others of its batch."""

    session: str
    k: int
    sync: list[SyncOp]


class Drafter:
    """The actor body (wrapped with `ray.remote` by the runtime)."""

    def __init__(self, engine_config: dict, max_support: int = 256, max_batch: int = 64):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from cluster import models
        from cluster.engine import EngineConfig, make_proposer
        from drafts.draft_model import DraftModelProposer

        config = EngineConfig(**engine_config)
        if config.threads:
            torch.set_num_threads(config.threads)
        path = models.resolve_model_path(config.target, config.cache_dir)
        tokenizer = models.load_tokenizer(path)
        from drafts.small_draft import is_tandem_draft

        target = None
        if config.proposer == "draft" and config.draft == "int8":
            target = models.load_causal_lm(path, "float32", "cpu")  # only to copy and quantise
        elif config.proposer == "draft" and is_tandem_draft(config.draft):
            target = models.load_causal_lm(path, config.dtype, config.device)  # lends embeddings (and layers)
        self.proposer = make_proposer(config, target, tokenizer)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.max_support = max_support
        del target
        self.name = config.proposer
        self.draft_s = 0.0
        self.idle_since = time.time()
        self.idle_s = 0.0
        self.max_batch = max_batch
        self.batches = 0
        self._cond = threading.Condition()
        self._queue: list[tuple[_Propose | Callable[[], object], Future]] = []
        threading.Thread(target=self._loop, daemon=True, name="drafter-loop").start()

    def ready(self) -> str:
        return self.name

    # -- calls (from Ray's threads): queued, executed by the one drafting thread ------------------

    def _submit(self, op: _Propose | Callable[[], object]):
        future: Future = Future()
        with self._cond:
            self._queue.append((op, future))
            self._cond.notify()
        return future.result()

    def start(self, session: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        prompt_ids = list(prompt_ids)
        return self._submit(lambda: self.proposer.start(session, prompt_ids, params))

    def propose(self, session: str, k: int, sync: Sequence[SyncOp] = ()) -> DraftReply:
        """Apply the `sync` ops in order (rollback, then learn, each where present), then draft k tokens."""
        return self._submit(_Propose(session, k, list(sync)))

    def release(self, session: str) -> None:
        return self._submit(lambda: self.proposer.release(session))

    # -- the drafting thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                batch, self._queue = self._queue, []
            proposes: dict[str, tuple[int, Future]] = {}
            for op, future in batch:
                try:
                    if isinstance(op, _Propose):
                        self._sync(op.session, op.sync)
                        proposes[op.session] = (op.k, future)
                    else:  # start or release
                        future.set_result(op())
                except Exception as e:
                    future.set_exception(e)
            if proposes:
                self._draft(proposes)

    def _sync(self, session: str, sync: Sequence[SyncOp]) -> None:
        for op in sync:
            if op.rollback:
                self.proposer.rollback(session, op.length, op.token_ids)
            if op.num_drafted:
                self.proposer.learn(session, op.num_drafted, op.num_accepted)

    def _draft(self, proposes: dict[str, tuple[int, Future]]) -> None:
        start = time.time()
        self.idle_s += max(0.0, start - self.idle_since)
        try:
            proposals = self.proposer.propose_batch({s: k for s, (k, _) in proposes.items()})
        except Exception as e:
            for _, future in proposes.values():
                future.set_exception(e)
            return
        end = time.time()
        self.draft_s += end - start
        self.idle_since = end
        self.batches += 1
        for session, (_, future) in proposes.items():
            proposal = proposals[session]
            future.set_result(DraftReply(proposal.token_ids, proposal.sparse_probs(), start, end, len(proposes)))

    def stats(self) -> dict:
        with self._cond:
            backlog = sum(1 for op, _ in self._queue if isinstance(op, _Propose))
        return {"draft_s": self.draft_s, "idle_s": self.idle_s, "batches": self.batches, "backlog": backlog,
                "sessions": self.proposer.num_sessions}

    def pid(self) -> int:
        return os.getpid()
