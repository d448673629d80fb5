"""One-token decode steps replayed from CUDA graphs, for the torch runner (issue 26).

The GPU check (BENCHMARKS.md, "GPU check on an H200") found the eager runner launch-bound on a GPU: a
one-token step of SmolLM2-135M's shape took 17-37 ms eager and 3.3 ms replayed from a CUDA graph (the
8B's shape 40 ms against 7.9). A graph needs fixed shapes and fixed addresses, which the runner's
cursor cache (a buffer per session that grows by reallocation, read as `[:length]` slices) does not give.

So a session may hold a *slot*: per layer, key and value buffers of a fixed capacity, which its
`CursorLayer`s use as their own (every eager verb of the runner works on them unchanged, in place), and
a graph captured once per slot for the one-token forward over the whole buffer:

- the new token's keys and values are written at a position held in a device tensor (`index_copy_`);
- attention reads all `capacity` slots under a 4-D additive mask built inside the graph from that
  position (slots past it hold stale keys of earlier sessions and are masked);
- the logits land in a static output tensor.

A replay is two scalar fills (token, position), `replay()`, and the cursor moved on the host. Anything
the graph cannot serve runs eagerly as before and is counted (`stats`): a session longer than the
capacity (its buffers grew: the slot is given up), feature capture (the feature-fed draft's hidden
states), more than one token, batches. The same static forward runs eagerly (no capture) where there
is no CUDA, which is how CI checks its exactness; only the capture and replay need a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    keys: list[torch.Tensor]  # per layer  # [1, H, capacity, D]
    values: list[torch.Tensor]
    ids: torch.Tensor  # [1, 1] long: the token of the step
    pos: torch.Tensor  # [1, 1] long: its position (= the write index)
    graph: object = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [1, 1, V]: the replay's output (static)
    owner: object = None  # the session holding it
    steps: int = 0


@dataclass
class GraphStats:
    replays: int = 0
    eager_steps: int = 0  # one-token steps of slot sessions run without a graph (no CUDA: the same forward)
    captures: int = 0
    no_slot: int = 0  # sessions that found every slot taken
    slots_lost: dict = field(default_factory=dict)  # why a session gave its slot up: count

    def as_dict(self) -> dict:
        return {"replays": self.replays, "eager_steps": self.eager_steps, "captures": self.captures,
                "no_slot": self.no_slot, "slots_lost": dict(self.slots_lost)}


class _WriteAt:
    """Makes a session's cursor layers write at a device position and return their whole buffers, for
    the duration of one static forward (restored afterwards: the eager verbs read `[:length]`)."""

    def __init__(self, cache: Cache, pos: torch.Tensor):
        self.layers, self.index = cache.layers, pos.view(1)  # [1]

    def __enter__(self):
        for layer in self.layers:
            layer.write_index = self.index

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.write_index = None


class GraphedDecode:
    """Slots and their graphs for one model. `forward(**kwargs)` is the model's own call."""

    def __init__(self, model: torch.nn.Module, num_layers: int, capacity: int, slots: int,
                 capture: bool | None = None):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config.get_text_config(decoder=True)
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.capacity, self.num_layers = capacity, num_layers
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        shape = (1, heads, capacity, head_dim)
        self._slots = [_Slot([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)],
                             [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)],
                             torch.zeros(1, 1, dtype=torch.long, device=self.device),
                             torch.zeros(1, 1, dtype=torch.long, device=self.device)) for _ in range(slots)]
        self._slot_of: dict[int, _Slot] = {}  # id(cache) -> slot
        self._positions = torch.arange(capacity, device=self.device)  # [capacity]
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stats = GraphStats()

    # -- slots -----------------------------------------------------------------------------------

    def attach(self, cache: Cache, owner) -> bool:
        """Give the (empty) session cache a free slot: its layers use the slot's buffers from now on."""
        slot = next((s for s in self._slots if s.owner is None), None)
        if slot is None:
            self.stats.no_slot += 1
            return False
        for layer, k, v in zip(cache.layers, slot.keys, slot.values):
            layer.adopt(k, v)
        slot.owner = owner
        self._slot_of[id(cache)] = slot
        return True

    def detach(self, cache: Cache) -> None:
        slot = self._slot_of.pop(id(cache), None)
        if slot is not None:
            slot.owner = None

    def _usable(self, cache: Cache) -> _Slot | None:
        slot = self._slot_of.get(id(cache))
        if slot is None:
            return None
        layer = cache.layers[0]
        if layer.keys.data_ptr() != slot.keys[0].data_ptr():  # grew past the capacity, or re-copied
            self._lose(cache, "buffers reallocated (longer than the capacity)")
            return None
        return slot

    def _lose(self, cache: Cache, why: str) -> None:
        self.detach(cache)
        self.stats.slots_lost[why] = self.stats.slots_lost.get(why, 0) + 1
        if self.stats.slots_lost[why] in (1, 10, 100, 1000):
            log.warning("CUDA-graph slot given up: %s (%d so far); that session decodes eagerly", why,
                        self.stats.slots_lost[why])

    # -- the step --------------------------------------------------------------------------------

    def _static_forward(self, cache: Cache, slot: _Slot, forward: Callable) -> torch.Tensor:
        """The one-token forward over the whole buffers  # [1, 1, V]"""
        mask = torch.where(self._positions <= slot.pos[0, 0], 0.0, torch.finfo(self.dtype).min)
        mask = mask.to(self.dtype)[None, None, None, :]  # [1, 1, 1, capacity]
        with _WriteAt(cache, slot.pos):
            return forward(input_ids=slot.ids, position_ids=slot.pos, attention_mask=mask,
                           past_key_values=cache, use_cache=True)

    def _capture(self, cache: Cache, slot: _Slot, forward: Callable) -> None:
        slot.pos.fill_(self.capacity - 1)  # warm-up and capture write the last slot (masked until rewritten)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._static_forward(cache, slot, forward)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            slot.logits = self._static_forward(cache, slot, forward)
        slot.graph = graph
        self.stats.captures += 1

    def step(self, cache: Cache, token_id: int, forward: Callable) -> torch.Tensor | None:
        """One token appended to a slot session: float32 logits  # [1, V]; None when the slot cannot
        serve it (the caller runs its eager forward)."""
        slot = self._usable(cache)
        if slot is None:
            return None
        start = cache.layers[0].length
        if start + 1 > self.capacity:
            self._lose(cache, "longer than the capacity")
            return None
        if self.capture and slot.graph is None:
            self._capture(cache, slot, forward)
        slot.ids.fill_(int(token_id))
        slot.pos.fill_(start)
        if self.capture:
            slot.graph.replay()
            logits = slot.logits[0].to(torch.float32, copy=True)  # [1, V]: the next replay overwrites the output
            self.stats.replays += 1
        else:
            logits = self._static_forward(cache, slot, forward)[0].float()  # [1, V]
            self.stats.eager_steps += 1
        for layer in cache.layers:
            layer.length = start + 1
        slot.steps += 1
        return logits
