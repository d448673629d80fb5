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
from collections.abc import Sequence
from concurrent.futures import Future

import torch

log = logging.getLogger(__name__)


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
        self._queue: list[tuple[str, tuple, Future]] = []
        threading.Thread(target=self._loop, daemon=True, name="drafter-loop").start()

    def ready(self) -> str:
        return self.name

    # -- calls (from Ray's threads): queued, executed by the one drafting thread ------------------

    def _submit(self, op: str, *args):
        future: Future = Future()
        with self._cond:
            self._queue.append((op, args, future))
            self._cond.notify()
        return future.result()

    def start(self, session: str, prompt_ids: Sequence[int], params: dict) -> None:
        return self._submit("start", session, list(prompt_ids), params)

    def propose(self, session: str, k: int, sync: list[dict] | None = None) -> dict:
        """Apply the `sync` ops in order (each: optional 'length' + 'token_ids' = rollback, optional
        'num_drafted' + 'num_accepted' = learn), then draft k tokens."""
        return self._submit("propose", session, k, sync)

    def release(self, session: str) -> None:
        return self._submit("release", session)

    # -- the drafting thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                batch, self._queue = self._queue, []
            proposes: dict[str, tuple[int, Future]] = {}
            for op, args, future in batch:
                try:
                    if op == "propose":
                        session, k, sync = args
                        self._sync(session, sync)
                        proposes[session] = (k, future)
                    elif op == "start":
                        from cluster.sampling import SamplingParams

                        future.set_result(self.proposer.start(args[0], args[1], SamplingParams(**args[2])))
                    else:
                        future.set_result(self.proposer.release(args[0]))
                except Exception as e:
                    future.set_exception(e)
            if proposes:
                self._draft(proposes)

    def _sync(self, session: str, sync: list[dict] | None) -> None:
        for op in sync or ():
            if op.get("length") is not None:
                self.proposer.rollback(session, op["length"], op.get("token_ids", []))
            if op.get("num_drafted"):
                self.proposer.learn(session, op["num_drafted"], op["num_accepted"])

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
            future.set_result({"token_ids": proposal.token_ids, "draft_probs": proposal.sparse_probs(),
                               "start": start, "end": end, "batch_size": len(proposes)})

    def stats(self) -> dict:
        with self._cond:
            backlog = sum(1 for op, _, _ in self._queue if op == "propose")
        return {"draft_s": self.draft_s, "idle_s": self.idle_s, "batches": self.batches, "backlog": backlog,
                "sessions": self.proposer.num_sessions}

    def pid(self) -> int:
        return os.getpid()
