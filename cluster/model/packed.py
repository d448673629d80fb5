"""Batched steps with no KV copies: the new tokens of several sessions packed into one row of a forward.

The weights (what a decode step streams from memory) are read once for all the sessions: the model's
linear layers see every session's new tokens as one sequence of `sum(counts)` tokens, each at its own
position (`position_ids`). Only attention is per session: each layer's `past_key_values.update` writes
a session's new keys and values at its own cache's cursor (`CursorLayer.update`, in place) and the
attention attends that session's queries to that session's cache alone, under its own mask (causal,
or its token tree's). Nothing is padded and no session's cache is copied, where a left-padded batch
copied every session's keys and values into a batch cache and back on every step.

How it hooks into `transformers`: the model's forward runs with its attention implementation switched
(`packed_attention`, for that forward) to `PACKED`, registered in `AttentionInterface` (and, with
sdpa's mask function, in `AttentionMaskInterface`). Its function scores a packed call (which passes a
placeholder 4-D mask, so transformers builds none) session by session with transformers' own
`sdpa_attention_forward`; any other call is scored as sdpa scores it, under the mask sdpa would get.
One query row in bf16 on CPU runs in fp32 (`_attend`): the runner's single-session decode step uses
PACKED for that too.
Any model whose attention calls `past_key_values.update(key, value, layer_idx)` and then the attention
interface works: Llama, Mistral, Qwen2 and their kin.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED = "tandem_packed"


@dataclass
class _Views:
    """What a packed cache's `update` hands the attention as its keys: each session's keys (the values come
    as the values) and the cache, whose `starts`, `counts` and `masks` say which query rows and mask are whose."""

    keys: list[torch.Tensor]  # each [1, H_kv, length_i + n_i, D]
    cache: PackedCache


class PackedCache(Cache):
    """The caches of the sessions of one packed forward, seen by the model as one cache: `update` writes
    each session's slice of the new keys/values into its own cache and returns them as `_Views`."""

    def __init__(self, caches: Sequence[Cache], counts: Sequence[int], masks: Sequence[torch.Tensor | None]):
        super().__init__(layers=[])  # the layers are the sessions' own
        self.caches, self.counts = list(caches), list(counts)
        self.masks = list(masks)  # each [1, 1, n_i, length_i + n_i] bool (True: attend), None: attend to all
        self.starts = [0, *itertools.accumulate(self.counts)][:-1]  # each session's first row in the packed one

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        for cache, start, n in zip(self.caches, self.starts, self.counts):
            k, v = cache.layers[layer_idx].update(key_states[:, :, start:start + n], value_states[:, :, start:start + n])
            keys.append(k)
            values.append(v)
        return _Views(keys, self), values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; nothing may infer them from a packed cache

    @property
    def is_compileable(self) -> bool:
        return False


def _attend(module, query, key, value, mask, scaling):
    """sdpa as transformers' `sdpa_attention_forward` runs it, except one query row in bf16/fp16 on CPU: its
    keys and values go up to fp32 first (exact), where torch's CPU kernel is 5-6x faster than in bf16 at
    one query row (BENCHMARKS.md); the output is rounded back.  # [B, n, H, D]"""
    if query.device.type == "cpu" and query.dtype != torch.float32 and query.shape[-2] == 1 and mask is None:
        out, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), None, scaling=scaling)
        return out.to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)[0]


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    if not isinstance(key, _Views):  # not packed: the mask transformers built for sdpa (registered below)
        return _attend(module, query, key, value, attention_mask, scaling), None
    plan = key.cache
    out = [_attend(module, query[:, :, start:start + n], k, v, mask, scaling)  # [1, n, H, D]
           for k, v, start, n, mask in zip(key.keys, value, plan.starts, plan.counts, plan.masks)]
    return torch.cat(out, dim=1), None  # [1, sum(n), H, D]


AttentionInterface.register(PACKED, _packed_attention)
AttentionMaskInterface.register(PACKED, sdpa_mask)  # a call that is not packed gets sdpa's mask
_switch_lock = threading.Lock()
_switched: dict[int, list] = {}  # id(config) -> [entries, the implementation to restore]


@contextmanager
def packed_attention(model: torch.nn.Module, packed: bool = True):
    """Run the model's forwards with `PACKED` attention, restored when the last concurrent user leaves.
    `packed=False` (one session's forward) switches an sdpa model only: PACKED scores it as sdpa does,
    with the faster one-row CPU attention; a model with another implementation keeps it."""
    configs = list({id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values())
    with _switch_lock:
        if not packed and not all(c._attn_implementation in ("sdpa", PACKED) for c in configs):
            configs = []
        for c in configs:
            entry = _switched.setdefault(id(c), [0, c._attn_implementation])
            entry[0] += 1
            c._attn_implementation = PACKED
    try:
        yield
    finally:
        with _switch_lock:
            for c in configs:
                entry = _switched[id(c)]
                entry[0] -= 1
                if entry[0] == 0:
                    del _switched[id(c)]
                    c._attn_implementation = entry[1]


def chain_mask(length: int, n: int, device) -> torch.Tensor | None:
    """A chain of `n` new tokens after `length` cached ones: causal, None for one token (it sees all)."""
    if n == 1:
        return None
    allowed = torch.ones(n, length + n, dtype=torch.bool, device=device)
    allowed[:, length:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return allowed[None, None]  # [1, 1, n, length + n]


def placeholder_mask(device) -> torch.Tensor:
    """The 4-D mask a packed forward passes so that transformers builds none (each session's is in the cache)."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
