"""tools/serve_cpu.py: the per-process CPU reading its table is made of."""

import os
import subprocess
import sys
import time

from tools.serve_cpu import cpu_seconds, idle, spent_between


def test_cpu_seconds_sees_this_process_spend_cpu():
    before = cpu_seconds()[os.getpid()][1]
    total = 0
    for i in range(6_000_000):  # a few tenths of a second of CPU
        total += i * i
    assert total > 0 and cpu_seconds()[os.getpid()][1] >= before + 0.05


def test_a_renamed_process_is_matched_by_pid():
    """Ray retitles a worker with the method it runs: the reading must not count its whole life again."""
    before = {7: ("ray::ProxyActor", 100.0), 8: ("ray::IDLE", 5.0)}
    after = {7: ("ray::ProxyActor.receive_asgi_messages", 100.5), 8: ("ray::IDLE", 5.0), 9: ("new", 0.25)}
    assert spent_between(before, after) == {"7 ray::ProxyActor.receive_asgi_messages": 0.5, "9 new": 0.25}


def test_idle_reading_sees_a_busy_child_and_not_a_sleeping_one():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # both started (their imports' CPU before the window)
        shares = {k.split(" ", 1)[0]: v for k, v in idle(1.5)["percent_of_a_core"].items()}
    finally:
        busy.kill()
        sleeping.kill()
    assert shares.get(str(busy.pid), 0.0) > 20.0  # a spinning process: most of a core (two cores shared)
    assert shares.get(str(sleeping.pid), 0.0) < 5.0
