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


def test_no_process_of_its_own_means_no_reaper():
    assert reaper.watch([]) is None
