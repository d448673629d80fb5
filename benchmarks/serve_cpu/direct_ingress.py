"""Serve's direct ingress on tandem's default server: the same server read through Serve's proxy and
through its replica's own HTTP port, alternated (BENCHMARKS.md, "Serve's direct ingress"):

    python benchmarks/serve_cpu/direct_ingress.py OUT_DIR [ROUNDS] [SIDE]

It starts one `tandem serve` (SIDE, a `tools.peer_bench` server name, default `tandem`) with
Serve's direct ingress (the ingress replica also answers HTTP on a port of its own, 30000-31000, which
`tandem serve` prints), and reads it and the proxy's port in turn, ROUNDS times (default 2):
chat, 12 streamed requests x 128 tokens at one stream, 48 x 64 at 16 (`tools.serve_cpu.measure`, with
each process's CPU per token). One server, so the engine, its warm-up and the machine's state are shared
by both sides; only the path of each request differs.
"""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)
from cluster.model import models  # noqa: E402
from tools.peer_bench import Process, openmp_env, server_argv, server_env  # noqa: E402
from tools.serve_cpu import format_load, measure  # noqa: E402

PORT = 8300


def main() -> int:
    out = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    side = sys.argv[3] if len(sys.argv) > 3 else "tandem"
    out.mkdir(parents=True, exist_ok=True)
    argv = server_argv(side, str(models.resolve_model_path("default")), "ray_config.yaml", "bfloat16", 2048, PORT)
    env = {**server_env("0-1"), **openmp_env(side), "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    server = Process(side, argv, f"http://127.0.0.1:{PORT}", env, str(out / "server.log"))
    results = []
    try:
        time.sleep(10)
        direct = server.client_url("direct")  # the address `tandem serve` printed
        if direct == server.url:
            raise RuntimeError("the server printed no replica address")
        print(f"proxy {server.url}, replica {direct}", flush=True)
        for n in range(rounds):
            for name, url in (("proxy", server.url), ("direct", direct)) if n % 2 == 0 else \
                    (("direct", direct), ("proxy", server.url)):
                one = measure(url, server.model, 12, 128, 1)
                many = measure(url, server.model, 48, 64, 16)
                results.append({"path": name, "round": n, "one": one, "sixteen": many})
                (out / f"{len(results)}-{name}.txt").write_text(format_load(one, 10) + "\n" + format_load(many, 10) + "\n")
                print(f"{name}: {1e3 / one['tokens_per_s']:.1f} ms a token at one stream, "
                      f"{many['tokens_per_s']:.0f} tokens/s at 16 streams", flush=True)
    finally:
        server.stop()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
