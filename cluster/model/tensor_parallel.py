"""Tensor-parallel target: transformers' own TP plan over torch.distributed (gloo on CPU, NCCL on GPU).

Every rank holds a shard of the model and of each session's KV cache, and must run the same
forward passes in the same order. Rank 0's runner (`TPLeaderRunner`) broadcasts each runner call to
the other ranks before running it; the other ranks `follow`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.core import grammar
from cluster.model.models import load_tokenizer, parse_dtype
from cluster.model.prompt_cache import PromptCache
from cluster.model.runner import TorchModelRunner

log = logging.getLogger(__name__)

# A collective with a dead peer fails at once on gloo ("connection closed by peer"); NCCL would wait,
# so every collective gets this timeout and a lost rank becomes an error, never a hung replica.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("TANDEM_TP_TIMEOUT_S", "120")))


class TensorParallelGroupBroken(RuntimeError):
    """A rank of this replica's group is gone: the group must be rebuilt (the runtime does it)."""


def load_tp_model(path, dtype: str, rank: int, world_size: int, master_port: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank if torch.cuda.is_available() else 0))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=parse_dtype(dtype), distributed_config=DistributedConfig(tp_plan="auto", tp_size=world_size))
    grammar.register_tokenizer(loader=lambda: load_tokenizer(path))  # loaded only if a grammar is used
    return model.eval()


def _broadcast(call: tuple | None) -> tuple:
    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TPLeaderRunner:
    """Rank 0's runner: every state-changing call is first broadcast to the follower ranks."""

    def __init__(self, runner: TorchModelRunner):
        self.runner = runner
        self.vocab_size, self.max_context = runner.vocab_size, runner.max_context
        self.broken: str | None = None  # why the group cannot run collectives any more
        # the kept prompts, through the broadcast verbs (each rank holds its shard of their KV)
        self.prompt_cache = PromptCache(self, runner.prompt_cache.max_tokens, name=f"{runner.name}/prompt-cache")

    def _call(self, name: str, *args):
        if self.broken:
            raise TensorParallelGroupBroken(self.broken)
        try:
            _broadcast((name, args))
        except Exception as e:  # a follower died (or the group timed out): this replica is done
            self._break(e)
        try:
            return getattr(self.runner, name)(*args)
        except Exception as e:
            try:  # the forward's own collectives fail the same way when a rank dies mid-call
                _broadcast(("noop", ()))
            except Exception:
                self._break(e)
            raise

    def _break(self, error: Exception):
        self.broken = f"tensor-parallel group lost a rank: {error}"
        log.error("%s; the replica must be rebuilt", self.broken)
        raise TensorParallelGroupBroken(self.broken) from None

    def add_session(self, session=None, capacity=256, kept=False):
        return self._call("add_session", session, capacity, kept)

    def extend(self, session, token_ids, num_logits=None):
        return self._call("extend", session, list(token_ids), num_logits)

    def extend_batch(self, requests, num_logits=None):
        return self._call("extend_batch", {s: list(t) for s, t in requests.items()}, num_logits)

    def truncate(self, session, length):
        return self._call("truncate", session, length)

    def share_prefix(self, source, session, length):
        return self._call("share_prefix", source, session, length)

    def release(self, session):
        return self._call("release", session)

    def length(self, session):
        return self.runner.length(session)

    @property
    def num_sessions(self):
        return self.runner.num_sessions


def follow(runner: TorchModelRunner) -> None:
    """A follower rank (a daemon thread): run whatever rank 0 runs, for the life of the actor."""
    while True:
        name, args = _broadcast(None)
        if name == "noop":
            continue
        try:
            getattr(runner, name)(*args)
        except Exception:  # rank 0 meets the same error and reports it
            log.debug("follower call %s failed", name, exc_info=True)
