"""Where a served token's CPU goes: per-process CPU milliseconds per generated token, against a running server.

    python -m tools.serve_cpu --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct --requests 8 \
        --max-tokens 128 --streams 1

Sends `requests` greedy streaming chat requests (the peer chat prompts), `streams` at a time, after one
warm-up request, and reads every process's CPU time (`/proc/PID/stat`, user + system) before and after:
the table is each process's CPU per generated token (from the server's `usage`), heaviest first, with
the wall time per token. Linux only; it sees every process on the machine, so run it on a quiet one.

`--idle SECONDS` first reads the same counters across SECONDS in which nothing is sent: what each process
spends with no request in flight (timers, health checks, metrics pushes), in percent of one core. On a
machine whose cores the engine's spinning threads fill, that is CPU taken from the engine.

`--ab OUT_DIR RUN...` starts each server in turn, alone (the peer bench's servers: `vllm`,
`tandem_vllm_none`, ...; `RUN:VAR=VALUE,...` adds environment variables, `RUN:config=PATH` gives a tandem
side its own Serve config, `RUN:via=proxy` calls a tandem side through Serve's proxy instead of its replica's
own port), waits until it decodes, then reads
10 s idle, one stream (12 x 128 tokens) and 16 streams (48 x 64), and stops it; each run's table goes to
OUT_DIR/N-RUN.txt, its server's log beside it (BENCHMARKS.md, "Serve's throughput mode"):

    python -m tools.serve_cpu --ab /tmp/ab vllm tandem_vllm_none:RAY_SERVE_THROUGHPUT_OPTIMIZED=0 tandem_vllm_none
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from cluster.core.workloads import PEER_CHAT_PROMPTS
from cluster.model import models
from tools.peer_bench import Process, openmp_env, server_argv, server_env, warn_orphans


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's (command line, CPU seconds so far), keyed by pid. A Ray worker's command line changes
    with the method it runs (`ray::ProxyActor.receive_asgi_messages`), so readings are matched by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                name = f.read().replace("\0", " ").strip()[:80] or stat.split("(", 1)[1].split(")", 1)[0]
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(pid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def spent_between(before: dict, after: dict) -> collections.Counter:
    """CPU seconds each process spent between two readings, keyed by "pid command line" (the later one's);
    a process started between them counts from zero."""
    spent = collections.Counter()
    for pid, (name, seconds) in after.items():
        delta = seconds - (before[pid][1] if pid in before else 0.0)
        if delta > 0:
            spent[f"{pid} {name}"] = delta
    return spent


def spent_around(work) -> tuple[float, object, collections.Counter]:
    """(wall seconds, what `work()` returned, CPU seconds each process spent meanwhile)."""
    before, start = cpu_seconds(), time.perf_counter()
    result = work()
    return time.perf_counter() - start, result, spent_between(before, cpu_seconds())


def stream_tokens(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def measure(url: str, model: str, requests: int, max_tokens: int, streams: int) -> dict:
    client = httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0))
    stream_tokens(client, url, model, PEER_CHAT_PROMPTS[0], 8)  # warm-up
    prompts = [PEER_CHAT_PROMPTS[i % len(PEER_CHAT_PROMPTS)] for i in range(requests)]
    with ThreadPoolExecutor(streams) as pool:
        wall, tokens, spent = spent_around(
            lambda: sum(pool.map(lambda p: stream_tokens(client, url, model, p, max_tokens), prompts)))
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "cpu_ms_per_token": {k: 1e3 * v / tokens for k, v in spent.most_common()}}


def idle(seconds: float) -> dict:
    """Each process's CPU while nothing is sent, in percent of one core, heaviest first."""
    wall, _, spent = spent_around(lambda: time.sleep(seconds))
    return {"wall_s": wall, "percent_of_a_core": {k: 100 * v / wall for k, v in spent.most_common()}}


def format_idle(quiet: dict, top: int) -> str:
    lines = [f"idle, {quiet['wall_s']:.0f} s with nothing sent:"]
    lines += [f"{pct:8.2f} % of a core  {name}" for name, pct in list(quiet["percent_of_a_core"].items())[:top]]
    return "\n".join(lines + [f"{sum(quiet['percent_of_a_core'].values()):8.2f} % of a core in all"])


def format_load(report: dict, top: int) -> str:
    lines = [f"{report['tokens']} tokens in {report['wall_s']:.1f} s: {report['tokens_per_s']:.1f} tok/s, "
             f"{1e3 / report['tokens_per_s']:.1f} ms a token (wall)"]
    lines += [f"{ms:8.2f} ms CPU/token  {name}" for name, ms in list(report["cpu_ms_per_token"].items())[:top]]
    return "\n".join(lines + [f"{sum(report['cpu_ms_per_token'].values()):8.2f} ms CPU/token in all"])


def ab(out_dir: str, runs: list[str], config: str, bind: str, port: int = 8300, top: int = 10) -> None:
    """Each of `runs` started alone, read (idle, one stream, 16 streams) and stopped; see the module docstring."""
    model_dir = str(models.resolve_model_path("default"))
    os.makedirs(out_dir, exist_ok=True)
    warn_orphans("before the first server starts")
    for n, run in enumerate(runs, 1):
        name, _, extra = run.partition(":")
        settings = dict(kv.split("=", 1) for kv in extra.split(",") if kv)
        run_config = settings.pop("config", config)  # a tandem side's own Serve config
        via = settings.pop("via", "direct")  # a tandem side called at its replica's own port or through the proxy
        env = {**server_env(bind), **openmp_env(name), **settings}  # vLLM alone on Intel's OpenMP, as tandem's engine
        tag = f"{n}-{run}".replace(":", "-").replace(",", "-").replace("/", "_")
        server = Process(run, server_argv(name, model_dir, run_config, "bfloat16", 2048, port), f"http://127.0.0.1:{port}",
                         env, os.path.join(out_dir, f"{tag}.log"))
        try:
            time.sleep(10)  # the start's own work settles
            quiet = idle(10)
            url = server.client_url(via)
            one = measure(url, server.model, 12, 128, 1)
            many = measure(url, server.model, 48, 64, 16)
            text = "\n".join([format_idle(quiet, top), format_load(one, top), format_load(many, top)])
        finally:
            server.stop()
        with open(os.path.join(out_dir, f"{tag}.txt"), "w") as f:
            f.write(text + "\n")
        print(f"{tag}: {1e3 / one['tokens_per_s']:.1f} ms a token at one stream, {many['tokens_per_s']:.0f} tokens/s "
              f"at 16 streams", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--top", type=int, default=10, help="processes shown")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of idle CPU measured first (0: none)")
    parser.add_argument("--ab", nargs="+", metavar=("OUT_DIR", "RUN"), help="start, read and stop each server in turn")
    parser.add_argument("--config", default="ray_config.yaml", help="with --ab: tandem's Serve config")
    parser.add_argument("--bind", default="0-1", help="with --ab: VLLM_CPU_OMP_THREADS_BIND of every vLLM engine")
    args = parser.parse_args(argv)
    if args.ab:
        if len(args.ab) < 2:
            parser.error("--ab needs OUT_DIR and at least one RUN")
        ab(args.ab[0], args.ab[1:], args.config, args.bind, top=args.top)
        return 0
    if args.idle > 0:
        print(format_idle(idle(args.idle), args.top))
    report = measure(args.url, args.model, args.requests, args.max_tokens, args.streams)
    print(format_load(report, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
