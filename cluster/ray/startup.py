"""What a failed start of a Ray on this machine left in its session's logs (`init_local_ray` logs it with Ray's
error, which says only that the node timed out)."""

from __future__ import annotations

import os
from pathlib import Path

from ray._common.utils import get_default_ray_temp_dir


def startup_report(temp_dir: str | None = None, pid: int | None = None) -> str:
    """What the logs of this process's newest Ray session say about a failed start: which of Ray's processes
    wrote a log, and the end of the raylet's error output. Ray names a session started here after this
    process (`session_<date>_<pid>`), so another process's Ray on the same machine is not mistaken for it."""
    root = Path(temp_dir or get_default_ray_temp_dir())
    # session_<date>_<time>_<microseconds>_<pid>: by name is by start
    sessions = sorted(root.glob(f"session_*_{pid or os.getpid()}"))
    if not sessions:
        return f"no Ray session of this process under {root}"
    logs = sessions[-1] / "logs"
    lines = [f"Ray session {sessions[-1]}:"]
    for name in ("gcs_server.out", "raylet.out", "dashboard_agent.log", "runtime_env_agent.log"):
        lines.append(f"  {name}: {'written' if (logs / name).is_file() else 'none'}")
    if not (logs / "raylet.out").is_file():
        lines.append("  the raylet wrote no log: it died before it started (a process forked beside busy gRPC "
                     "channels with grpcio's fork handlers on does: cluster/__init__.py, GRPC_FORK_ENV)")
    err = logs / "raylet.err"
    if err.is_file() and (tail := err.read_text(errors="replace").splitlines()[-20:]):
        lines += ["  raylet.err ends:", *(f"    {line}" for line in tail)]
    return "\n".join(lines)
