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

from cluster.messages import DraftReply, SyncOp, apply_sync
from cluster.sampling import SamplingParams
from drafts.proposer import shapes_sequential_rounds

log = logging.getLogger(__name__)


@dataclass
class _Propose:
    """A queued `propose`: its sync ops are applied, then it is drafted with the others of its batch."""

    session: str
    k: int
    sync: list[SyncOp]
    tree: bool = False  # a token tree (when the proposer makes them), else a chain


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
        from drafts.feature_proposer import FeatureProposer, is_feature_draft
        from drafts.small_draft import is_tandem_draft

        target = None
        model_draft = config.proposer in ("draft", "hybrid")
        if model_draft and config.draft == "int8":
            target = models.load_causal_lm(path, "float32", "cpu")  # only to copy and quantise
        elif model_draft and (is_tandem_draft(config.draft) or is_feature_draft(config.draft)):
            target = models.load_causal_lm(path, config.dtype, config.device)  # lends embeddings (and layers)
        self.proposer = make_proposer(config, target, tokenizer)
        model = getattr(self.proposer, "model", self.proposer)  # the hybrid's model proposer
        if isinstance(model, (DraftModelProposer, FeatureProposer)):
            model.max_support = max_support  # q rows cross the wire compactly
        del target
        self.name = config.proposer
        self.draft_s = 0.0
        self.idle_since = time.time()
        self.idle_s = 0.0
        self.max_batch = max_batch
        self.batches = 0
        self.ahead = None  # a DraftAhead, once a session drafts continuously
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

    def propose(self, session: str, k: int, sync: Sequence[SyncOp] = (), tree: bool = False) -> DraftReply:
        """Apply the `sync` ops in order (rollback, then learn, each where present), then draft k tokens
        (with `tree`, and a proposer with `tree_width` > 1: a token tree whose chain is k long)."""
        return self._submit(_Propose(session, k, list(sync), tree))

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
            trees: set[str] = set()
            for op, future in batch:
                try:
                    if isinstance(op, _Propose):
                        apply_sync(self.proposer, op.session, op.sync)
                        proposes[op.session] = (op.k, future)
                        if op.tree:
                            trees.add(op.session)
                    else:  # start or release
                        future.set_result(op())
                except Exception as e:
                    future.set_exception(e)
            if proposes:
                self._draft(proposes, trees)

    def _draft(self, proposes: dict[str, tuple[int, Future]], trees: set[str]) -> None:
        start = time.time()
        self.idle_s += max(0.0, start - self.idle_since)
        requests = {s: k for s, (k, _) in proposes.items()}
        try:
            if trees and shapes_sequential_rounds(self.proposer):
                proposals = self.proposer.propose_batch(requests, trees=trees)
            else:
                proposals = self.proposer.propose_batch(requests)
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
            future.set_result(DraftReply(proposal.token_ids, proposal.sparse_probs(), start, end, len(proposes),
                                         parents=proposal.parents))

    # -- continuous drafting (`cluster.draft_ahead`): these calls never wait for a draft batch ----------

    def _ahead(self):
        with self._cond:
            if self.ahead is None:
                from cluster.draft_ahead import DraftAhead

                self.ahead = DraftAhead(self.proposer)  # one mode per drafter: routers share their config
            return self.ahead

    def ahead_start(self, session: str, token_ids: Sequence[int], params: SamplingParams, lookahead: int) -> None:
        self._ahead().start(session, list(token_ids), params, lookahead)

    def take(self, session: str, max_n: int, timeout_s: float) -> DraftReply | None:
        reply = self._ahead().take(session, max_n, timeout_s)
        if reply is None or reply.dense is None:
            return reply
        rows = DraftReply(reply.token_ids, None, 0, 0, 1, dense=reply.dense).rows()  # sparse across the wire
        return DraftReply(reply.token_ids, rows, reply.start, reply.end, reply.batch_size)

    def commit(self, session: str, num_tokens: int, num_accepted: int, num_drafted: int) -> None:
        self._ahead().commit(session, num_tokens, num_accepted, num_drafted)

    def resync(self, session: str, length: int, token_ids: list[int], num_drafted: int, num_accepted: int) -> None:
        self._ahead().resync(session, length, token_ids, num_drafted, num_accepted)

    def ahead_release(self, session: str) -> None:
        self._ahead().release(session)

    def ahead_step_s(self) -> float:
        return self.ahead.step_s if self.ahead is not None else 0.0

    def stats(self) -> dict:
        with self._cond:
            backlog = sum(1 for op, _ in self._queue if isinstance(op, _Propose))
        ahead = self.ahead
        return {"draft_s": self.draft_s + (ahead.busy_s if ahead else 0.0), "idle_s": self.idle_s,
                "batches": self.batches, "backlog": backlog, "sessions": self.proposer.num_sessions,
                "ahead_steps": ahead.steps if ahead else 0, "ahead_cancels": ahead.cancels if ahead else 0,
                "ahead_stale_tokens": ahead.stale_tokens if ahead else 0,
                "proposals_without_features": getattr(getattr(self.proposer, "model", self.proposer),
                                                      "proposals_without_features", 0)}

    def pid(self) -> int:
        return os.getpid()
