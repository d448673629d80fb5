"""tools.proc_cpu: a command's CPU time by process kind, its children's and detached processes' included."""

import json
import sys

from tools.proc_cpu import kind, main

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"


def test_kinds_from_command_lines():
    assert kind("ray::ServeReplica:tandem:Router") == "ray::ServeReplica:tandem:Router"
    assert kind("VLLM::Worker") == "VLLM::Worker"
    assert kind("[pytest-xdist running] tests/test_vllm.py::test_x") == "pytest-worker"
    assert kind("/usr/bin/python3 -m pytest -n 2") == "pytest"
    assert kind("/venv/bin/python /venv/lib/ray/dashboard/dashboard.py --host=127.0.0.1") == "python dashboard.py"
    assert kind("/venv/bin/python -m tools bench") == "python tools"
    assert kind("/venv/lib/ray/core/src/ray/raylet/raylet --raylet_socket_name=x") == "raylet"


def test_an_orphaned_grandchild_is_counted(tmp_path):
    """The command starts a process that starts a busy one and exits (the busy one is orphaned, as Ray's and
    vLLM's processes are once their parents exit), then sleeps: the busy one's CPU counts, under its own kind."""
    out = tmp_path / "cpu.json"
    child = tmp_path / "busy_child.py"
    child.write_text(BUSY)
    spawn = f"import subprocess, sys; subprocess.Popen([sys.executable, {str(child)!r}])"
    starter = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {spawn!r}]); time.sleep(2.5)"
    assert main(["--json", str(out), "--interval", "0.05", "--", sys.executable, "-c", starter]) == 0
    report = json.loads(out.read_text())
    assert report["returncode"] == 0 and 0.8 <= report["by_kind"]["python busy_child.py"] <= 1.6, report
    assert report["cpu_s"] >= report["by_kind"]["python busy_child.py"]


def test_the_commands_own_cpu_is_counted(tmp_path):
    out = tmp_path / "cpu.json"
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    assert main(["--json", str(out), "--interval", "0.05", "--", sys.executable, str(script)]) == 0
    by_kind = json.loads(out.read_text())["by_kind"]
    assert 0.8 <= by_kind["python busy.py"] <= 1.6, by_kind
