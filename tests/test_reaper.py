"""`cluster.vllm.reaper`: a process killed with its vLLM engine running takes the engine with it; an engine
that ended on its own, or a pid reused since, is left alone. Real processes (an engine core's title given to
`sleep`), real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cluster.vllm import reaper

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the reaper reads /proc (Linux)")

# a parent that starts an "engine core" (sleep titled as vLLM titles it) with a child of its own, as vLLM's
# engine core has its workers, then the reaper for it; it prints the pids and waits to be killed
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from cluster.vllm import reaper
    core = subprocess.Popen(["bash", "-c", "sleep 300 & exec -a VLLM::EngineCore sleep 300"])
    time.sleep(0.3)
    found = reaper.named_children(os.getpid(), reaper.ENGINE_CORE)
    proc = reaper.watch(found)
    print(core.pid, proc.pid if proc else 0, *found, flush=True)
    if sys.argv[1] == "end-engine":  # the engine's own shutdown: it and its child end while the parent runs
        reaper.stop([core.pid]); core.wait()
    time.sleep(300)
""")

# an "engine core" that, as vLLM's does, maps shared memory in /dev/shm (one file of its own, one that a bystander
# maps too), binds a Unix socket under VLLM_RPC_BASE_PATH and writes Intel OpenMP's registration file, with a
# "worker" that maps its own file and binds its own socket; its parent binds one too (vLLM's client) and one it
# closes (the handshake's), starts the reaper once they are in place, prints the pids and waits to be killed
ENGINE = textwrap.dedent("""
    import mmap, os, socket, subprocess, sys, time
    ipc = socket.socket(socket.AF_UNIX)
    ipc.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], sys.argv[1] + ".sock"))
    def share(name):
        fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        mapped = mmap.mmap(fd, 4096)
        mapped[0] = 1
        return mapped
    held = [share(name) for name in sys.argv[1:3]]
    if len(sys.argv) > 3:
        worker = subprocess.Popen([os.environ["ENGINE_PYTHON"], "-c", sys.argv[3], sys.argv[4], sys.argv[2]])
    open(f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_0", "w").close()
    time.sleep(300)
""")
PARENT_SHM = textwrap.dedent("""
    import os, socket, subprocess, sys, time
    from cluster.vllm import reaper
    engine, own, shared, worker_own = sys.argv[1:5]
    before = reaper.socket_files()
    client, handshake = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    client.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], own + "-client.sock"))
    handshake.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], own + "-handshake.sock"))
    handshake.close()  # as vLLM's client does once its engine has started: the file stays
    core = subprocess.Popen(["bash", "-c", 'exec -a VLLM::EngineCore "$0" "$@"', sys.executable, "-c", engine, own,
                             shared, engine, worker_own], env={**os.environ, "ENGINE_PYTHON": sys.executable})
    deadline = time.monotonic() + 30
    def wait_for(ready):
        while not ready():
            if time.monotonic() > deadline or core.poll() is not None:
                sys.exit("the engine did not start")
            time.sleep(0.05)
    wait_for(lambda: os.path.exists(f"/dev/shm/__KMP_REGISTERED_LIB_{core.pid}_0") and reaper.children_of(core.pid))
    worker = reaper.children_of(core.pid)[0]
    wait_for(lambda: os.path.exists(f"/dev/shm/__KMP_REGISTERED_LIB_{worker}_0"))
    proc = reaper.watch(reaper.named_children(os.getpid(), reaper.ENGINE_CORE), sockets=reaper.socket_files() - before)
    print(core.pid, worker, proc.pid if proc else 0, flush=True)
    time.sleep(300)
""")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reaper.start_time(pid) is None:
            return True
        time.sleep(0.1)
    return False


def _parent(mode: str):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True, env=env)
    core, reaper_pid, *found = map(int, parent.stdout.readline().split())
    return parent, core, reaper_pid, found


def test_a_killed_parent_takes_its_engine_and_the_engines_children_with_it():
    parent, core, reaper_pid, found = _parent("wait")
    try:
        assert found == [core] and reaper_pid  # found by its title among the parent's children
        worker = reaper.children_of(core)
        assert len(worker) == 1  # the "engine core"'s own child, as vLLM's worker
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(core, 10) and _gone(worker[0], 10)
        assert _gone(reaper_pid, 10)  # and the reaper ends
    finally:
        reaper.stop([core])
        parent.kill()


def test_an_engine_that_ended_on_its_own_ends_the_reaper_and_nothing_else():
    parent, core, reaper_pid, _ = _parent("end-engine")
    try:
        assert _gone(core, 5)
        assert _gone(reaper_pid, 5)  # the reaper ended with no engine left to watch...
        assert reaper.start_time(parent.pid) is not None  # ...and the parent runs on untouched
    finally:
        parent.kill()
        parent.wait()


def test_a_pid_reused_since_is_left_alone():
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        started = reaper.start_time(bystander.pid)
        dead = subprocess.Popen(["true"])
        dead.wait()
        # the parent has ended; the watched pid runs, but not the process that was watched (another start time)
        stopped = reaper.reap_when_parent_ends(dead.pid, 1, {bystander.pid: started + 1}, poll_s=0.01)
        assert stopped == [] and bystander.poll() is None
        # the same pid with its own start time is stopped
        assert reaper.reap_when_parent_ends(dead.pid, 1, {bystander.pid: started}, poll_s=0.01) == [bystander.pid]
        assert bystander.wait(5) == -signal.SIGTERM
    finally:
        bystander.kill()


@pytest.fixture
def sockets_dir():
    """A short directory for Unix sockets (a socket's path is at most 107 bytes; pytest's tmp_path under xdist went past
    it in a clean-clone run)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="tandem-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_killed_engine_leaves_nothing_in_dev_shm_that_no_running_process_maps(sockets_dir):
    """Ray kills a stopped replica's process group and its children: the engine's processes die before their own
    cleanup. The reaper (detached: not a child of the process it watches) then removes the /dev/shm files they mapped
    and their OpenMP files, and keeps a file another running process still maps; and the IPC socket files the engine's
    processes and the parent bound under VLLM_RPC_BASE_PATH, and one made and closed while the engine started."""
    import mmap

    tag = f"tandem-test-{os.getpid()}"
    own, shared, worker_own = f"{tag}-core", f"{tag}-shared", f"{tag}-worker"
    fd = os.open(f"/dev/shm/{shared}", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    bystander_map = mmap.mmap(fd, 4096)  # this process maps the shared file, and runs on
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "VLLM_RPC_BASE_PATH": str(sockets_dir)}
    sockets = [sockets_dir / f"{name}.sock" for name in (own, worker_own, f"{own}-client", f"{own}-handshake")]
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SHM, ENGINE, own, shared, worker_own],
                              stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        core, worker, reaper_pid = map(int, parent.stdout.readline().split())
        assert reaper_pid and int(reaper._stat(reaper_pid)[1]) != parent.pid  # detached from the parent
        assert {own, shared} <= reaper.shm_names(core) and {worker_own, shared} <= reaper.shm_names(worker)
        kmp = [f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_0" for pid in (core, worker)]
        assert all(os.path.exists(path) for path in kmp)
        assert reaper.bound_sockets(core, where=sockets_dir) == {str(sockets[0])}
        assert all(path.is_socket() for path in sockets)
        os.killpg(parent.pid, signal.SIGKILL)  # the parent, the engine core and its worker: one process group
        parent.wait()
        assert _gone(reaper_pid, 10)
        assert not os.path.exists(f"/dev/shm/{own}") and not os.path.exists(f"/dev/shm/{worker_own}")
        assert not any(os.path.exists(path) for path in kmp)
        assert os.path.exists(f"/dev/shm/{shared}")  # still mapped here
        assert not any(path.exists() for path in sockets)
    finally:
        parent.kill()
        bystander_map.close()
        os.close(fd)
        for name in (own, shared, worker_own):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_remove_leftovers_keeps_what_a_running_process_maps_and_a_running_pids_openmp_file():
    """Unit: of the ended processes' names, a file no one maps is removed, one this process maps is kept; an OpenMP
    file is removed only for a pid that no process has now."""
    import mmap

    tag = f"tandem-unit-{os.getpid()}"
    paths = {name: f"/dev/shm/{tag}-{name}" for name in ("free", "mapped")}
    for path in paths.values():
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    dead = subprocess.Popen(["true"])
    dead.wait()
    kmp_dead, kmp_mine = f"/dev/shm/__KMP_REGISTERED_LIB_{dead.pid}_0", f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_0"
    for path in (kmp_dead, kmp_mine):
        open(path, "w").close()
    with open(paths["mapped"], "r+b") as f:
        held = mmap.mmap(f.fileno(), 4096)
    try:
        removed = reaper.remove_leftovers([dead.pid, os.getpid()], [f"{tag}-free", f"{tag}-mapped"])
        assert removed == sorted([f"{tag}-free", os.path.basename(kmp_dead)])
        assert os.path.exists(paths["mapped"]) and os.path.exists(kmp_mine) and not os.path.exists(paths["free"])
    finally:
        held.close()
        for path in [*paths.values(), kmp_dead, kmp_mine]:
            if os.path.exists(path):
                os.unlink(path)


def test_release_sockets_removes_only_socket_files_no_socket_is_bound_to(sockets_dir):
    """Unit: a socket file whose socket was closed is removed; one a socket is still bound to, and a plain file, stay.
    With a wait, a socket closed meanwhile is removed too."""
    import socket
    import threading

    paths = {name: str(sockets_dir / name) for name in ("closed", "bound", "plain", "later")}
    sockets = {name: socket.socket(socket.AF_UNIX) for name in ("closed", "bound", "later")}
    for name, sock in sockets.items():
        sock.bind(paths[name])
    sockets["closed"].close()
    open(paths["plain"], "w").close()
    try:
        assert reaper.release_sockets(paths.values()) == ["closed"]
        assert os.path.exists(paths["bound"]) and os.path.exists(paths["plain"]) and os.path.exists(paths["later"])
        threading.Timer(0.3, sockets["later"].close).start()
        assert reaper.release_sockets([paths["later"]], wait_s=5.0) == ["later"]
    finally:
        for sock in sockets.values():
            sock.close()


def test_no_process_of_its_own_means_no_reaper():
    assert reaper.watch([]) is None
