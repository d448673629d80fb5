"""Rule 4: a single-machine Ray sends nothing beyond loopback.

A fresh process starts Ray with `init_local_ray` (importing ray before `cluster`, the order that used to
put the node on the machine's own address), runs a task and stops; meanwhile this process watches every
TCP/UDP socket on the machine. Ray's dashboard asks the cloud metadata service (169.254.169.254) at
start and vLLM posts usage statistics unless told not to; neither may leave loopback.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import textwrap
import time

import psutil

CHILD = textwrap.dedent("""
    import time, ray
    from cluster.ray.runtime import init_local_ray
    init_local_ray(num_cpus=2)
    @ray.remote
    def environment():
        import os
        return {k: os.environ.get(k) for k in ("VLLM_NO_USAGE_STATS", "RAY_USAGE_STATS_ENABLED")}
    print(ray.get_runtime_context().gcs_address, ray.get(environment.remote()), flush=True)
    time.sleep(4)  # the dashboard's probe runs in its first seconds
    ray.shutdown()
""")


def off_loopback(conn) -> str | None:
    peer = conn.raddr.ip if conn.raddr else None
    if conn.status == psutil.CONN_LISTEN or not peer:
        return None
    address = ipaddress.ip_address(peer.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return None if address.is_loopback else f"{conn.status} {conn.laddr.ip}:{conn.laddr.port} -> {peer}:{conn.raddr.port}"


def test_local_ray_stays_on_loopback():
    before = {off_loopback(c) for c in psutil.net_connections("inet")} - {None}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while child.poll() is None and time.monotonic() < deadline:
        seen |= {off_loopback(c) for c in psutil.net_connections("inet")} - {None}
        time.sleep(0.05)
    seen |= {off_loopback(c) for c in psutil.net_connections("inet")} - {None}  # TIME_WAIT lingers
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    gcs, env = out.strip().splitlines()[-1].split(" ", 1)
    assert gcs.startswith("127.0.0.1:"), gcs
    assert "'VLLM_NO_USAGE_STATS': '1'" in env and "'RAY_USAGE_STATS_ENABLED': '0'" in env, env
    assert seen - before == set()
