"""Decode and chain-verify steps replayed from CUDA graphs, for the torch runner (issue 26).

The GPU check (BENCHMARKS.md, "GPU check on an H200") found the eager runner launch-bound on a GPU: a
one-token step of SmolLM2-135M's shape took 17-37 ms eager and 3.3 ms replayed from a CUDA graph (the
8B's shape 40 ms against 7.9). A graph needs fixed shapes and fixed addresses, which the runner's
cursor cache (a buffer per session that grows by reallocation, read as `[:length]` slices) does not give.

So a session may hold a *slot*: per layer, key and value buffers of a fixed capacity, which its
`CursorLayer`s use as their own (every eager verb of the runner works on them unchanged, in place), and
graphs captured per slot, one for each number of new tokens n up to `max_tokens` (1 for a plain step or a
draft token, γ + 1 for a chain's verification), each a forward over the whole buffer:

- the new tokens' keys and values are written at positions held in a device tensor (`index_copy_`);
- attention reads all `capacity` slots under a 4-D additive mask built inside the graph from those
  positions (each token sees its own position and those before; slots past them hold stale keys of
  earlier sessions and are masked);
- the logits land in a static output tensor.

A replay is two small copies (tokens, positions), `replay()`, and the cursor moved on the host. Anything
the graphs cannot serve runs eagerly as before: a session longer than the capacity (its buffers grew:
the slot is given up, counted in `stats`), feature capture (the feature-fed draft's hidden states), more
than `max_tokens` tokens (prefill), token trees, batches of sessions. The same static forward runs eagerly (no capture) where there
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
class _Graph:
    """One captured forward of `n` tokens over a slot: its static inputs and output."""
    ids: torch.Tensor  # [1, n] long: the tokens
    pos: torch.Tensor  # [1, n] long: their positions (= the write indices)
    graph: object = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [1, n, V]: the replay's output (static)
    failed: bool = False  # its capture raised: these steps run eagerly (logged, counted)


@dataclass
class _Slot:
    keys: list[torch.Tensor]  # per layer  # [1, H, capacity, D]
    values: list[torch.Tensor]
    graphs: dict = field(default_factory=dict)  # n -> _Graph
    owner: object = None  # the session holding it


@dataclass
class GraphStats:
    replays: int = 0
    eager_steps: int = 0  # slot steps run as the same static forward without a graph (no CUDA)
    captures: int = 0
    no_slot: int = 0  # sessions that found every slot taken
    capture_failures: int = 0  # captures that raised (those steps then run eagerly)
    slots_lost: dict = field(default_factory=dict)  # why a session gave its slot up: count

    def as_dict(self) -> dict:
        return {"replays": self.replays, "eager_steps": self.eager_steps, "captures": self.captures,
                "capture_failures": self.capture_failures, "no_slot": self.no_slot, "slots_lost": dict(self.slots_lost)}


def capture_graph(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int = 2, pool=None,
                  error_mode: str = "global") -> tuple[object, torch.Tensor]:
    """(a torch.cuda.CUDAGraph of `fn()`, its static output): `fn` run `warmup` times on a side stream (as
    capture wants), then captured. `error_mode` "thread_local" lets other threads launch kernels meanwhile."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
        out = fn()
    return graph, out


class _WriteAt:
    """Makes a session's cursor layers write at a device position and return their whole buffers, for
    the duration of one static forward (restored afterwards: the eager verbs read `[:length]`)."""

    def __init__(self, cache: Cache, pos: torch.Tensor):
        self.layers, self.index = cache.layers, pos.view(-1)  # [n]

    def __enter__(self):
        for layer in self.layers:
            layer.write_index = self.index

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.write_index = None


class GraphedDecode:
    """Slots and their graphs for one model (its shapes, device and dtype); `step`'s `forward(**kwargs)` is the
    model's own call."""

    def __init__(self, model: torch.nn.Module, capacity: int, slots: int, capture: bool | None = None,
                 max_tokens: int = 8):
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config.get_text_config(decoder=True)
        heads, num_layers = config.num_key_value_heads, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.capacity, self.max_tokens = capacity, max_tokens
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        shape = (1, heads, capacity, head_dim)
        self._slots = [_Slot([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)],
                             [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)])
                       for _ in range(slots)]
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

    def _static_forward(self, cache: Cache, g: _Graph, forward: Callable) -> torch.Tensor:
        """The forward of g's tokens over the whole buffers  # [1, n, V]: each token sees the slots up to
        its own position (the cache, the tokens before it, itself)."""
        allowed = self._positions[None, :] <= g.pos[0][:, None]  # [n, capacity]
        mask = torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(self.dtype)[None, None]  # [1, 1, n, cap]
        with _WriteAt(cache, g.pos):
            return forward(input_ids=g.ids, position_ids=g.pos, attention_mask=mask, past_key_values=cache,
                           use_cache=True)

    def _graph(self, cache: Cache, slot: _Slot, n: int, forward: Callable) -> _Graph:
        """The slot's forward of n tokens; captured at its first use where there is CUDA."""
        g = slot.graphs.get(n)
        if g is None:
            g = slot.graphs[n] = _Graph(torch.zeros(1, n, dtype=torch.long, device=self.device),
                                        torch.zeros(1, n, dtype=torch.long, device=self.device))
        if self.capture and g.graph is None and not g.failed:
            try:
                self._capture(cache, g, forward)
            except Exception:  # noqa: BLE001 - e.g. another thread's kernels during capture: eager, loudly
                g.failed = True
                self.stats.capture_failures += 1
                log.exception("CUDA-graph capture of a %d-token step failed; those steps of this slot run eagerly", n)
        return g

    def _capture(self, cache: Cache, g: _Graph, forward: Callable) -> None:
        # warm-up and capture write the last n slots: past the session's valid prefix (it needs room for its
        # own n), masked until rewritten
        g.pos.copy_(self._positions[self.capacity - g.pos.shape[1]:][None])
        # thread_local: a drafter thread of the same process may launch its own kernels meanwhile
        g.graph, g.logits = capture_graph(lambda: self._static_forward(cache, g, forward), self.device,
                                          pool=self._pool, error_mode="thread_local")
        self.stats.captures += 1

    def step(self, cache: Cache, token_ids, forward: Callable) -> torch.Tensor | None:
        """`token_ids` (1 to `max_tokens` of them) appended to a slot session: float32 logits of every new
        position  # [n, V]; None when the slot cannot serve them (the caller runs its eager forward)."""
        n = len(token_ids)
        slot = self._usable(cache) if 0 < n <= self.max_tokens else None
        if slot is None:
            return None
        start = cache.layers[0].length
        if start + n > self.capacity:
            self._lose(cache, "longer than the capacity")
            return None
        g = self._graph(cache, slot, n, forward)
        if g.failed:
            return None
        if n == 1:
            g.ids.fill_(int(token_ids[0]))
            g.pos.fill_(start)
        else:
            g.ids.copy_(torch.tensor([list(token_ids)], dtype=torch.long))
            g.pos.copy_(self._positions[start:start + n][None])
        if self.capture:
            g.graph.replay()
            logits = g.logits[0].to(torch.float32, copy=True)  # [n, V]: the next replay overwrites the output
            self.stats.replays += 1
        else:
            logits = self._static_forward(cache, g, forward)[0].float()  # [n, V]
            self.stats.eager_steps += 1
        for layer in cache.layers:
            layer.length = start + n
        return logits
