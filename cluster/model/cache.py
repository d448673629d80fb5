"""The runner's KV cache layout: per session and layer, a buffer that grows by doubling with a length
cursor (gpt-fast style). Rollback moves the cursor; nothing is copied. A CUDA-graph slot (graphs.py)
lends a session fixed buffers instead (`adopt`), and a static forward writes at a device position
(`write_index`)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class CursorLayer(DynamicLayer):
    """One layer's keys/values in a buffer that grows by doubling; `length` is the valid prefix.

    `crop` moves the cursor back (rollback without copying); `update` writes at the cursor.
    """

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.write_index: torch.Tensor | None = None  # set for a static forward (graphs.py)  # [n]

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Use these (fixed-capacity) buffers from now on: a CUDA-graph slot's (graphs.py); empty."""
        self.keys, self.values = keys, values  # [1, H, capacity, D]
        self.dtype, self.device = keys.dtype, keys.device
        self.capacity, self.length, self.is_initialized = keys.shape[-2], 0, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, head_dim = key_states.shape
        self.keys = key_states.new_empty(batch, heads, self.capacity, head_dim)  # [B, H, cap, D]
        self.values = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[-2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.write_index is not None:  # a static forward: write at device positions, attend to every slot
            self.keys.index_copy_(2, self.write_index, key_states)
            self.values.index_copy_(2, self.write_index, value_states)
            return self.keys, self.values
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self._grow(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def copy_prefix(self, source: "CursorLayer", length: int) -> None:
        """This (empty) layer holds `source`'s first `length` keys and values, copied once (into its own
        buffers when they are a graph slot's and hold them)."""
        if self.is_initialized and self.keys.shape[-2] >= length and self.keys.shape[:2] == source.keys.shape[:2]:
            self.keys[:, :, :length] = source.keys[:, :, :length]
            self.values[:, :, :length] = source.values[:, :, :length]
            self.length = length
            return
        self.dtype, self.device = source.dtype, source.device
        capacity = max(self.capacity, length)
        self.keys = source.keys.new_empty(*source.keys.shape[:2], capacity, source.keys.shape[-1])  # [1, H, cap, D]
        self.values = source.values.new_empty(*source.values.shape[:2], capacity, source.values.shape[-1])
        self.keys[:, :, :length] = source.keys[:, :, :length]
        self.values[:, :, :length] = source.values[:, :, :length]
        self.length, self.is_initialized = length, True

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        # transformers' convention: a negative value removes that many tokens; positive is a length.
        new_length = self.length + tokens_to_remove if tokens_to_remove < 0 else min(self.length, tokens_to_remove)
        self.length = max(0, new_length)

    def reset(self) -> None:
        self.length = 0


def new_cache(num_layers: int, capacity: int = 256) -> Cache:
    return Cache(layers=[CursorLayer(capacity) for _ in range(num_layers)])
