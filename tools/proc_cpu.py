"""Where a command's CPU time goes, by process kind: run it, poll /proc, add each process's CPU seconds to its kind.

    python -m tools.proc_cpu --json OUT.json [--interval 0.5] -- COMMAND ...

Every process on the machine is watched while COMMAND runs (Ray's and vLLM's processes are not COMMAND's
children once their parents exit); a process's CPU counts from the first poll that sees it (what a process had
used before the command started is left out). A kind is what the process says it is: a Ray worker's title
(`ray::ServeReplica:tandem:Router`, `ray::Drafter`), vLLM's (`VLLM::Worker`), a pytest-xdist worker, or the
program's name. A process that lives less than one interval is missed. Used for the test suite's CPU by kind
(BENCHMARKS.md, "The test suite's time").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def kind(cmdline: str) -> str:
    """A process's kind from its command line (NUL-separated arguments joined by spaces)."""
    words = cmdline.split()
    if not words:
        return "?"
    if words[0].startswith(("ray::", "VLLM::")):
        return words[0]
    if cmdline.startswith("[pytest-xdist"):  # an xdist worker's title
        return "pytest-worker"
    program = words[0].rsplit("/", 1)[-1]
    if program in ("pytest", "py.test") or words[1:3] == ["-m", "pytest"]:
        return "pytest"
    if program.startswith("python") and len(words) > 1:
        script = words[2] if words[1] == "-m" and len(words) > 2 else words[1]
        return f"python {script.rsplit('/', 1)[-1]}"
    return program


def _read(pid: str) -> tuple[str, float] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return cmdline, (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def watch(process: subprocess.Popen, interval: float) -> dict[str, float]:
    """CPU seconds by kind of every process seen while `process` runs (the kind a process last had)."""
    me = str(os.getpid())
    start: dict[str, float] = {}  # CPU a process had when first seen
    last: dict[str, tuple[str, float]] = {}
    totals: collections.Counter = collections.Counter()
    first = True
    while True:
        running = process.poll() is None
        seen = set()
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            read = _read(pid)
            if read is None:
                continue
            cmdline, cpu = read
            seen.add(pid)
            if pid not in start:
                start[pid] = cpu if first else 0.0
            last[pid] = (kind(cmdline) if cmdline else last.get(pid, ("kernel", 0))[0], cpu - start[pid])
        for pid in [p for p in last if p not in seen]:  # exited: its last reading counts
            name, cpu = last.pop(pid)
            totals[name] += cpu
        first = False
        if not running:
            break
        time.sleep(interval)
    for name, cpu in last.values():
        totals[name] += cpu
    return {name: round(cpu, 1) for name, cpu in totals.most_common() if cpu > 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where the CPU seconds by kind go")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    t0 = time.time()
    process = subprocess.Popen(command)
    totals = watch(process, args.interval)
    wall = time.time() - t0
    report = {"command": command, "returncode": process.returncode, "wall_s": round(wall, 1),
              "cpus": os.cpu_count(), "cpu_s": round(sum(totals.values()), 1), "by_kind": totals}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{report['cpu_s']:.0f} CPU-s in {wall:.0f} s on {os.cpu_count()} CPUs; top: "
          + ", ".join(f"{k} {v:.0f}" for k, v in list(totals.items())[:6]), file=sys.stderr)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
