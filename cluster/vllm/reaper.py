"""A vLLM engine outlives no replica: `watch(children)` starts a small process that waits for this process
(the Serve replica that started vLLM's engine) to end, then stops the engine's processes it was given, and
their own children (vLLM's workers).

vLLM's engine core is a child process of the `AsyncLLM` that started it, and stops when that client shuts it
down. A replica that Ray kills (`ray.kill`, a shutdown that outran its timeout, the OOM killer) runs no
shutdown: its engine core and workers were left running with init as their parent, each keeping its KV cache
and its OpenMP threads' spin on the cores (found beside the peer bench, BENCHMARKS.md). The reaper is detached
(not the replica's child, in a session of its own), so neither a signal to the replica's process group nor Ray's
cleanup of a worker's children reaches it; it polls the parent once every `POLL_S`, and names each process by pid
and start time, so a pid reused after the engine ended is left alone. Stops are logged. Linux only (/proc);
elsewhere `watch` logs that it does nothing and returns None.

An engine process killed before its own cleanup (Ray's cleanup of a stopped replica's processes, the reaper's
SIGKILL, vLLM's own shutdown, which kills its engine core after 5 s) leaves files in /dev/shm: vLLM's two message
queues (160 and 240 MiB, sparse: the pages they touched stay in memory) and Intel OpenMP's registration file per
process. Measured before this: each stop of a Serve application on vLLM left these four files. Whichever way the
engine ends, the reaper then removes the /dev/shm files its processes mapped that no running process maps, and their
OpenMP files (`remove_leftovers`), and logs it. (A multiprocessing semaphore the replica made, one page, no longer
mapped by anyone, stays: Python's resource tracker, which Ray kills with the replica, would have removed it.)

Each vLLM process (the replica's or CLI's client, its engine core, its worker) binds ZMQ IPC sockets under
`VLLM_RPC_BASE_PATH` (the temporary directory) and closes them without removing their files, even at a clean
shutdown: seven files per engine started, 2,320 of them in /tmp on this machine (2026-12-07). The reaper notes the
socket files the engine's processes and its parent bound there, and those made while the engine started (its
handshake's, closed before the reaper starts: `socket_files` before and after), and once they are bound no more
(their processes ended, or closed them), removes them (`release_sockets`).

Nothing here imports vLLM, torch or Ray."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_CORE = "VLLM::EngineCore"  # vLLM's title for its engine core process
POLL_S = 0.5  # how often the reaper looks at its parent
OBSERVE_S = 5.0  # how often it notes the engine's processes (workers started since) and the shared memory they map
TERM_WAIT_S = 5.0  # SIGTERM, then this long for the engine's own shutdown, then SIGKILL
PROC = Path("/proc")
SHM = Path("/dev/shm")
KMP_FILE = "__KMP_REGISTERED_LIB_{pid}_"  # Intel OpenMP's file per process in /dev/shm, removed at a clean exit
RPC_DIR = Path(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir())  # where vLLM binds its IPC sockets
RELEASE_WAIT_S = 2.0  # how long the reaper waits for a client's sockets to close once its engine has ended


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


def shm_names(pid: int | str) -> set[str]:
    """The /dev/shm files the process maps (POSIX shared memory and named semaphores), by name."""
    try:
        lines = (PROC / str(pid) / "maps").read_text(errors="replace").splitlines()
    except OSError:
        return set()
    prefix = f"{SHM}/"
    return {path[len(prefix):] for line in lines if len(fields := line.split(None, 5)) == 6
            and (path := fields[5]).startswith(prefix) and not path.endswith(" (deleted)")}


def remove_leftovers(ended: Iterable[int], names: Iterable[str]) -> list[str]:
    """Remove what the processes `ended` (none of them running) left in /dev/shm: the files of `names` (what they
    mapped) that no running process maps, and Intel OpenMP's file of each pid that no process has now. Files of
    another user are left (/dev/shm is sticky). Returns the names removed."""
    in_use = set().union(*(shm_names(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()))
    paths = [SHM / name for name in set(names) - in_use if "/" not in name]
    paths += [path for pid in ended if start_time(pid) is None for path in SHM.glob(KMP_FILE.format(pid=pid) + "*")]
    removed = []
    for path in paths:
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return sorted(removed)


def unix_sockets() -> dict[int, str]:
    """The Unix sockets bound to a file: inode to path (/proc/net/unix)."""
    try:
        lines = (PROC / "net" / "unix").read_text(errors="replace").splitlines()[1:]
    except OSError:
        return {}
    return {int(fields[6]): fields[7] for line in lines if len(fields := line.split(None, 7)) == 8
            and fields[7].startswith("/")}


def bound_sockets(pid: int | str, table: dict[int, str] | None = None, where: Path = RPC_DIR) -> set[str]:
    """The socket files in `where` that the process has bound (its descriptors' sockets that `table`,
    `unix_sockets()` by default, names)."""
    table = unix_sockets() if table is None else table
    fd_dir, out = PROC / str(pid) / "fd", set()
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and (path := table.get(int(link[8:-1]))) and Path(path).parent == where:
            out.add(path)
    return out


def socket_files(where: Path = RPC_DIR) -> set[str]:
    """The socket files in `where` now (whoever made them)."""
    out = set()
    try:
        entries = list(os.scandir(where))
    except OSError:
        return out
    for entry in entries:
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                out.add(entry.path)
        except OSError:
            continue
    return out


def release_sockets(paths: Iterable[str], wait_s: float = 0.0) -> list[str]:
    """Remove the socket files of `paths` that no socket is bound to, after waiting up to `wait_s` for all of
    them to be let go; the names removed. A file that is not a socket, or that a socket is still bound to, stays."""
    paths = set(paths)
    deadline = time.monotonic() + wait_s
    while (bound := paths & set(unix_sockets().values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    removed = []
    for path in sorted(paths - bound):
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(os.path.basename(path))
        except OSError:
            continue
    return removed


class _Engine:
    """The engine's processes as the reaper has seen them (pid: start time; the watched ones and their
    descendants), the /dev/shm files they mapped, and the IPC socket files they and their client (`parent`, pid:
    start time) bound."""

    def __init__(self, watched: dict[int, int], parent: dict[int, int] | None = None, sockets: Iterable[str] = ()):
        self.procs, self.parent, self.observed = dict(watched), parent or {}, 0.0
        self.names: set[str] = set()
        self.sockets: set[str] = set(sockets)

    def observe(self) -> None:
        for pid, started in list(self.procs.items()):
            if alive(pid, started):
                self.procs.update({p: s for p in descendants(pid) if (s := start_time(p)) is not None})
        running = [p for p, s in [*self.procs.items(), *self.parent.items()] if alive(p, s)]
        self.names |= set().union(*(shm_names(p) for p in running if p not in self.parent))
        table = unix_sockets()
        self.sockets |= set().union(*(bound_sockets(p, table) for p in running))
        self.observed = time.monotonic()

    def running(self) -> bool:
        return any(alive(p, s) for p, s in self.procs.items())

    def clean(self, wait_s: float = 2.0) -> list[str]:
        deadline = time.monotonic() + wait_s  # a SIGKILLed process takes a moment to go
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        removed = remove_leftovers([p for p, s in self.procs.items() if not alive(p, s)], self.names)
        if removed:
            log.info("removed what the engine's processes left in %s: %s", SHM, removed)
        sockets = release_sockets(self.sockets, RELEASE_WAIT_S)  # the client closes its own after its engine ends
        if sockets:
            log.info("removed the engine's IPC socket files in %s: %s", RPC_DIR, sockets)
        return removed + sockets


def reap_when_parent_ends(parent: int, parent_started: int, watched: dict[int, int], poll_s: float = POLL_S,
                          observe_s: float = OBSERVE_S, ready=None, sockets: Iterable[str] = ()) -> list[int]:
    """Wait while `parent` (as it started) runs; then stop those of `watched` (pid: start time) and of their
    descendants (as seen while the parent ran, and since) still running. Either way, once the engine's processes
    have ended, remove what they left in /dev/shm, and the socket files they, the parent or `sockets` name that no
    socket is bound to. Returns the pids stopped. `ready()`, when given, is called once the engine's processes and
    files have been noted."""
    engine = _Engine(watched, {parent: parent_started}, sockets)
    engine.observe()
    if ready is not None:
        ready()
    while alive(parent, parent_started):
        if not engine.running():
            engine.clean()  # the engine ended with its replica's own shutdown: no process to stop
            return []
        if time.monotonic() - engine.observed >= observe_s:
            engine.observe()
        time.sleep(poll_s)
    engine.observe()
    stopped = stop([p for p, s in engine.procs.items() if alive(p, s)])  # a worker may outlive its engine core
    engine.clean()
    return stopped


@dataclass(frozen=True)
class Reaper:
    """A running reaper: its pid (not this process's child: it was detached at its start)."""
    pid: int


def watch(children: Iterable[int], what: str = "vLLM engine", sockets: Iterable[str] = ()) -> Reaper | None:
    """Start the reaper for `children` of this process (see the module docstring); None where /proc is not.
    `sockets`: socket files the engine made that its processes may no longer hold (removed with theirs).

    Returns once the reaper has noted the engine's processes and the files they map (it says its pid then). The
    reaper detaches itself (the process started here forks it and exits): Ray kills a worker's direct
    children when the worker exits (`RAY_kill_child_processes_on_worker_exit`) and its process group
    (`RAY_process_group_cleanup_enabled`), so a direct child, even in a session of its own, died with the replica
    and never removed what the engine had left."""
    if not PROC.is_dir():
        log.warning("no reaper for the %s (no /proc): it may outlive this process if this process is killed", what)
        return None
    pids = {pid: s for pid in children if (s := start_time(pid)) is not None}
    if not pids:  # e.g. vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): nothing can outlive it
        log.info("no reaper for the %s: no process of its own", what)
        return None
    argv = [sys.executable, "-m", "cluster.vllm.reaper", str(os.getpid()), str(start_time(os.getpid())),
            *(f"{pid}:{s}" for pid, s in pids.items()), *sorted(str(path) for path in sockets)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))}
    env.pop("LD_PRELOAD", None)
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True, env=env,
                          text=True) as starter:
        line = starter.stdout.readline().strip()
    if not line.isdigit():
        log.warning("the %s's reaper did not start (exit status %s): its processes may outlive this process if it is "
                    "killed", what, starter.returncode)
        return None
    log.info("the %s's processes %s are reaped if this process (%d) ends without stopping them (reaper %s)",
             what, sorted(pids), os.getpid(), line)
    return Reaper(int(line))


def watch_engine(what: str = "vLLM engine", sockets_before: set[str] | None = None) -> Reaper | None:
    """`watch` this process's vLLM engine cores: called once its engine has started. `sockets_before`: the
    `socket_files()` from before the engine started, so that those made since are removed with the engine's."""
    made = socket_files() - sockets_before if sockets_before is not None else set()
    return watch(engine_cores(), what, made)


def _root() -> str:
    return str(Path(__file__).resolve().parents[2])


def main(argv: list[str]) -> int:
    if os.fork():  # detached (`watch`): the process `watch` started ends at once
        return 0

    def ready() -> None:  # `watch` returns once the reaper has noted the engine's processes and files; then its pipe
        print(os.getpid(), flush=True)  # is let go
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    logging.basicConfig(level=logging.INFO, format="tandem reaper %(process)d: %(message)s")
    parent, parent_started = int(argv[0]), int(argv[1])
    watched = {int(p): int(s) for p, s in (item.split(":") for item in argv[2:] if not item.startswith("/"))}
    sockets = [item for item in argv[2:] if item.startswith("/")]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the replica's stop, not this
    stopped = reap_when_parent_ends(parent, parent_started, watched, ready=ready, sockets=sockets)
    if stopped:
        log.warning("process %d ended with its engine still running: stopped %s", parent, stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
