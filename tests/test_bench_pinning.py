"""`tandem bench --distributed --pin-cpus`: pinning reaches every thread of a process, those it starts
later included (the drafter's threads start after it is pinned)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time


def _child(queue) -> None:
    from tools.bench_distributed import pin_threads

    before = threading.Thread(target=time.sleep, args=(1.0,))
    before.start()  # a thread that exists when the process is pinned
    cpus = pin_threads({0})
    later: list = []
    after = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
    after.start()
    after.join()
    threads = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
    queue.put((cpus, threads, before.native_id, later[0]))
    before.join()


def test_pin_threads_pins_every_thread_and_later_ones():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    cpus, threads, before_id, later = queue.get(timeout=120)
    child.join(timeout=60)
    assert cpus == [0] and later == {0}
    assert before_id in threads and len(threads) >= 2
    assert all(affinity == {0} for affinity in threads.values()), threads
    assert os.sched_getaffinity(0) != {0} or os.cpu_count() == 1  # the test process itself is untouched
