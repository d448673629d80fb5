"""tools/serve_cpu.py: the per-process CPU reading its table is made of."""

import os

from tools.serve_cpu import cpu_seconds


def test_cpu_seconds_sees_this_process_spend_cpu():
    me = next(k for k in cpu_seconds() if k.split(" ", 1)[0] == str(os.getpid()))
    before = cpu_seconds()[me]
    total = 0
    for i in range(6_000_000):  # a few tenths of a second of CPU
        total += i * i
    assert total > 0 and cpu_seconds()[me] >= before + 0.05
