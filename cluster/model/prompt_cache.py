"""Prompts' KV kept after their sessions end, for a later session that opens with exactly the same tokens.

A session's prefill of tokens t0 .. t(n-1) writes the same keys and values each time (the same runner, the same
forward of the same n tokens from position 0, the same torch thread count: the key includes it), so a copy of
them is what a new prefill of those tokens would write, bit for bit: output cannot change. Only an exact match is
used: the first positions of a longer prompt's prefill were computed in a forward of another shape, whose sums
may round differently in the last bit, so a prompt that merely shares a prefix is prefilled as before.

What repeats exactly: the same prompt sampled many times (best-of-n and pass@k across requests, the statistical
tests), a retried request, the same chat turn sent again. The kept tokens are bounded (`max_tokens`, least
recently used first out); each is held as a session of its own on the runner (`NAME/prompt-cache/N`), its buffers
exactly as long as the prompt. A prompt is kept under its session's `cache_salt` (vLLM's; None: unsalted) and taken
only by a session of the same salt, so tenants with salts of their own never reuse each other's prefills.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


_GHOSTS = itertools.count()  # the kept sessions' names, unique in the process: several caches may share a runner


@dataclass
class PromptCacheStats:
    hits: int = 0  # sessions opened with kept KV instead of a prefill
    misses: int = 0  # sessions whose prompt was not kept
    hit_tokens: int = 0  # prefill tokens saved
    kept: int = 0  # prompts kept (copies made at a session's end)
    evicted: int = 0  # prompts dropped for room


class PromptCache:
    """On one runner (a `TorchModelRunner`, or a tensor-parallel leader: anything with `add_session`,
    `share_prefix`, `length` and `release`): `keep(session, tokens)` copies the KV of a session's first
    `len(tokens)` positions, which a prefill of `tokens` wrote; `take(tokens, session)` gives an empty session
    that KV. Both take the session's `salt` (`SamplingParams.cache_salt`): a prompt is taken only under the salt it
    was kept with. Not thread-safe on the runner: call it where the runner's other calls are serialised."""

    def __init__(self, runner, max_tokens: int, name: str = "prompt-cache"):
        if max_tokens < 0:
            raise ValueError(f"{max_tokens=} must be >= 0")
        self.runner, self.max_tokens, self.name = runner, max_tokens, name
        self.stats = PromptCacheStats()
        self.tokens = 0  # held now
        self._kept: OrderedDict[tuple, tuple[str, int]] = OrderedDict()  # key -> (runner session, length)
        self._lock = threading.Lock()
        self.on_hit: Callable[[int], None] | None = None  # called with the prefill tokens each hit saved (metrics)

    @staticmethod
    def of(runner) -> "PromptCache":
        """The runner's own (`TorchModelRunner(prompt_cache_tokens=...)`), or a disabled one for a runner without."""
        cache = getattr(runner, "prompt_cache", None)
        return cache if cache is not None else PromptCache(runner, 0)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @staticmethod
    def _key(tokens: Sequence[int], threads: int | None = None, salt: str | None = None) -> tuple:
        return (threads or torch.get_num_threads(), salt, *map(int, tokens))

    def take(self, tokens: Sequence[int], session, salt: str | None = None) -> bool:
        """Give the empty `session` the kept KV of `tokens` kept under `salt` (moved to most recently used);
        False where none is (the caller prefills)."""
        if not self.enabled or not tokens:
            return False
        key = self._key(tokens, salt=salt)
        with self._lock:
            entry = self._kept.get(key)
            if entry is None:
                self.stats.misses += 1
                return False
            self._kept.move_to_end(key)
            ghost, length = entry
        self.runner.share_prefix(ghost, session, length)
        with self._lock:
            self.stats.hits += 1
            self.stats.hit_tokens += length
        if self.on_hit is not None:
            self.on_hit(length)
        return True

    def keep(self, session, tokens: Sequence[int], threads: int | None = None, salt: str | None = None) -> bool:
        """Copy `session`'s first `len(tokens)` positions, written by a prefill of `tokens` with `threads` torch
        threads (the caller's word; None: as many as now), under the session's `salt`, unless kept already or
        longer than the whole budget; drops the least recently used past it."""
        n = len(tokens)
        if not self.enabled or n == 0 or n > self.max_tokens or self.runner.length(session) < n:
            return False
        key = self._key(tokens, threads, salt)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return False
            ghost = f"{self.name}/{next(_GHOSTS)}"
        self.runner.add_session(ghost, capacity=n, kept=True)
        self.runner.share_prefix(session, ghost, n)
        dropped = []
        with self._lock:
            self._kept[key] = (ghost, n)
            self.tokens += n
            self.stats.kept += 1
            while self.tokens > self.max_tokens:
                _, (old, length) = self._kept.popitem(last=False)
                self.tokens -= length
                self.stats.evicted += 1
                dropped.append(old)
        for old in dropped:
            self.runner.release(old)
        return True

    def clear(self) -> None:
        with self._lock:
            kept, self._kept, self.tokens = list(self._kept.values()), OrderedDict(), 0
        for ghost, _ in kept:
            self.runner.release(ghost)

    def __len__(self) -> int:
        return len(self._kept)
