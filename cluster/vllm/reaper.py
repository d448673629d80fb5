"""A vLLM engine outlives no replica: `watch(children)` starts a small process that waits for this process
(the Serve replica that started vLLM's engine) to end, then stops the engine's processes it was given, and
their own children (vLLM's workers).

vLLM's engine core is a child process of the `AsyncLLM` that started it, and stops when that client shuts it
down. A replica that Ray kills (`ray.kill`, a shutdown that outran its timeout, the OOM killer) runs no
shutdown: its engine core and workers were left running with init as their parent, each keeping its KV cache
and its OpenMP threads' spin on the cores (found beside the peer bench, BENCHMARKS.md). The reaper is its own
session, so a signal to the replica's process group does not reach it; it polls the parent once every
`POLL_S`, and names each process by pid and start time, so a pid reused after the engine ended is left alone.
Stops are logged. Linux only (/proc); elsewhere `watch` logs that it does nothing and returns None.

Nothing here imports vLLM, torch or Ray."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_CORE = "VLLM::EngineCore"  # vLLM's title for its engine core process
POLL_S = 0.5  # how often the reaper looks at its parent
TERM_WAIT_S = 5.0  # SIGTERM, then this long for the engine's own shutdown, then SIGKILL
PROC = Path("/proc")


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3: the state, 4: the parent, 22: the start time), or None."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ", whatever comm holds


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when no such process runs (a zombie counts
    as ended)."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def alive(pid: int, started: int | None) -> bool:
    return started is not None and start_time(pid) == started


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    return [int(entry.name) for entry in PROC.iterdir()
            if entry.name.isdigit() and (fields := _stat(entry.name)) is not None and int(fields[1]) == pid]


def named_children(pid: int, prefix: str) -> list[int]:
    """The children of `pid` whose command line starts with `prefix` (vLLM titles its engine core
    "VLLM::EngineCore")."""
    out = []
    for child in children_of(pid):
        try:
            cmdline = (PROC / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith(prefix):
            out.append(child)
    return out


def engine_cores() -> list[int]:
    """This process's vLLM engine core processes."""
    return named_children(os.getpid(), ENGINE_CORE)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def stop(pids: Iterable[int], term_wait_s: float = TERM_WAIT_S) -> list[int]:
    """SIGTERM each of `pids` and its descendants still running, SIGKILL what is left after `term_wait_s`;
    the pids signalled."""
    targets = {}
    for pid in pids:
        for p in [pid, *descendants(pid)]:
            if (started := start_time(p)) is not None:
                targets[p] = started
    for p in targets:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + term_wait_s
    while time.monotonic() < deadline and any(alive(p, s) for p, s in targets.items()):
        time.sleep(0.1)
    for p, s in targets.items():
        if alive(p, s):
            _signal(p, signal.SIGKILL)
    return sorted(targets)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def reap_when_parent_ends(parent: int, parent_started: int, watched: dict[int, int], poll_s: float = POLL_S) -> list[int]:
    """Wait while `parent` (as it started) runs; then stop those of `watched` (pid: start time) still running
    and their descendants. Returns the pids stopped."""
    while alive(parent, parent_started):
        if not any(alive(p, s) for p, s in watched.items()):
            return []  # the engine ended with its replica's own shutdown: nothing to do
        time.sleep(poll_s)
    return stop([p for p, s in watched.items() if alive(p, s)])


def watch(children: Iterable[int], what: str = "vLLM engine") -> subprocess.Popen | None:
    """Start the reaper for `children` of this process (see the module docstring); None where /proc is not."""
    if not PROC.is_dir():
        log.warning("no reaper for the %s (no /proc): it may outlive this process if this process is killed", what)
        return None
    pids = {pid: s for pid in children if (s := start_time(pid)) is not None}
    if not pids:  # e.g. vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): nothing can outlive it
        log.info("no reaper for the %s: no process of its own", what)
        return None
    argv = [sys.executable, "-m", "cluster.vllm.reaper", str(os.getpid()), str(start_time(os.getpid())),
            *(f"{pid}:{s}" for pid, s in pids.items())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))}
    env.pop("LD_PRELOAD", None)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    log.info("the %s's processes %s are reaped if this process (%d) ends without stopping them (reaper %d)",
             what, sorted(pids), os.getpid(), proc.pid)
    return proc


def watch_engine(what: str = "vLLM engine") -> subprocess.Popen | None:
    """`watch` this process's vLLM engine cores: called once its engine has started."""
    return watch(engine_cores(), what)


def _root() -> str:
    return str(Path(__file__).resolve().parents[2])


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="tandem reaper %(process)d: %(message)s")
    parent, parent_started = int(argv[0]), int(argv[1])
    watched = {int(p): int(s) for p, s in (item.split(":") for item in argv[2:])}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the replica's stop, not this
    stopped = reap_when_parent_ends(parent, parent_started, watched)
    if stopped:
        log.warning("process %d ended with its engine still running: stopped %s", parent, stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
