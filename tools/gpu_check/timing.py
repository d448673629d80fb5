"""Clocks for the GPU check: a time budget, device-synchronised timers, a forward-time probe on a runner."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from cluster.model.runner import TorchModelRunner


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Budget:
    """The run's time budget: sections ask before they start and are skipped (with the reason) when
    what is left is under their estimate."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, what: str, needs_s: float) -> bool:
        """Whether `what` (estimated at `needs_s` seconds) fits; records it as skipped if not."""
        if self.left() >= needs_s:
            return True
        self.skipped.append({"what": what, "reason": f"time budget: {self.left():.0f} s left of {self.seconds:.0f} s, "
                                                     f"estimated {needs_s:.0f} s"})
        return False


def median_time(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2,
                reset: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn()` in seconds, synchronised before and after each call; `reset()` runs
    untimed after each call (e.g. truncating the KV back)."""
    times = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if reset is not None:
            reset()
    return statistics.median(times)


class ForwardTimer:
    """Times every forward a runner makes (`extend`, `extend_batch`, `extend_tree`), device-synchronised,
    while installed (`with ForwardTimer(runner) as t:`): the outermost call only (extend_batch of one
    session calls extend). `calls`: [(tokens fed, seconds)] in order."""

    METHODS = ("extend", "extend_batch", "extend_tree")

    def __init__(self, runner: TorchModelRunner):
        self.runner = runner
        self.calls: list[tuple[int, float]] = []
        self._depth = 0

    def _wrap(self, name: str, fn: Callable):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            try:
                sync(self.runner.device)
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                sync(self.runner.device)
                self.calls.append((_tokens_fed(name, args), time.perf_counter() - t0))
                return out
            finally:
                self._depth -= 1
        return timed

    def __enter__(self):
        for name in self.METHODS:
            setattr(self.runner, name, self._wrap(name, getattr(self.runner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name in self.METHODS:
            delattr(self.runner, name)  # the instance attribute: the class's method shows again

    def total(self, skip_first: int = 0) -> float:
        return sum(s for _, s in self.calls[skip_first:])


def _tokens_fed(name: str, args: tuple) -> int:
    if name == "extend":
        return len(args[1])
    if name == "extend_tree":
        return len(args[1]) + len(args[2])
    return sum(len(t) for t in args[0].values())
