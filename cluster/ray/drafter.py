"""The drafter: a Ray actor that owns a proposer and serves many sessions.

It runs threaded (`max_concurrency`): concurrent `propose` calls of different sessions are gathered
and drafted together, one batched forward per draft position (`drafts.batcher.DraftBatcher`, the
same drafting thread vLLM's in-process client runs). A session has at most one call in
flight; the router folds the previous round's rollback and feedback into the next `propose`
(`sync`), so no ordering between separate calls is needed. Draft distributions leave as sparse
(ids, probs) rows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import ray

from cluster.core.config import EngineConfig
from cluster.core.messages import DraftReply, SyncOp
from cluster.core.sampling import SamplingParams
from drafts.batcher import DraftBatcher
from drafts.factory import build_proposer

log = logging.getLogger(__name__)


class Drafter:
    """The actor body (wrapped with `ray.remote` by `launch_drafter`)."""

    def __init__(self, engine_config: dict, max_support: int = 256):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        config = EngineConfig(**engine_config)
        self.proposer = build_proposer(config, max_support=max_support)  # q rows cross the wire compactly
        self.name = config.proposer
        self.batcher = DraftBatcher(self.proposer)

    def ready(self) -> str:
        return self.name

    # -- calls (from Ray's threads): queued, run in order by the one drafting thread -----------------

    def start(self, session: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        prompt_ids = list(prompt_ids)
        return self.batcher.call(lambda: self.proposer.start(session, prompt_ids, params)).result()

    def propose(self, session: str, k: int, sync: Sequence[SyncOp] = (), tree: bool = False) -> DraftReply:
        """Apply the `sync` ops in order (rollback, then learn, each where present), then draft k tokens
        (with `tree`, and a proposer with `tree_width` > 1: a token tree whose chain is k long)."""
        drafted = self.batcher.propose(session, k, sync, tree).result()
        proposal = drafted.proposal
        return DraftReply(proposal.token_ids, proposal.sparse_probs(), drafted.start, drafted.end,
                          drafted.batch_size, parents=proposal.parents)

    def release(self, session: str) -> None:
        return self.batcher.call(lambda: self.proposer.release(session)).result()

    def stats(self) -> dict:
        b = self.batcher
        model = getattr(self.proposer, "model", self.proposer)  # a hybrid's draft model
        cache = getattr(model, "prompt_cache", None)  # a draft model's kept prompts (cluster.model.prompt_cache)
        return {"draft_s": b.draft_s, "idle_s": b.idle_s, "batches": b.batches, "backlog": b.backlog(),
                "sessions": self.proposer.num_sessions,
                "proposals_without_features": getattr(model, "proposals_without_features", 0),
                "prompt_cache_hits": cache.stats.hits if cache is not None else 0}

    def pid(self) -> int:
        return os.getpid()


def launch_drafter(engine: EngineConfig | dict, *, name: str | None = None, namespace: str | None = None,
                   num_cpus: float = 1, num_gpus: float = 0, accelerator_type: str | None = None,
                   resources: dict | None = None, scheduling_strategy=None, max_restarts: int = -1):
    """The one way a `Drafter` actor is started (standalone runtime, drafter pool, vLLM replica and engine):
    threaded (concurrent proposes are batched inside), restarted on death unless `max_restarts` says
    otherwise, never retrying a task (the router replays). Returns the actor handle; call `ready`."""
    config = engine.model_dump(mode="json") if isinstance(engine, EngineConfig) else dict(engine)
    options = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None, max_restarts=max_restarts,
                   max_task_retries=0, max_concurrency=256)
    for key, value in (("name", name), ("namespace", namespace), ("accelerator_type", accelerator_type),
                       ("scheduling_strategy", scheduling_strategy)):
        if value is not None:
            options[key] = value
    return ray.remote(Drafter).options(**options).remote(config)
