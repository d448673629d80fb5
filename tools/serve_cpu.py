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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--top", type=int, default=10, help="processes shown")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of idle CPU measured first (0: none)")
    args = parser.parse_args(argv)
    if args.idle > 0:
        quiet = idle(args.idle)
        print(f"idle, {quiet['wall_s']:.0f} s with nothing sent:")
        for name, pct in list(quiet["percent_of_a_core"].items())[:args.top]:
            print(f"{pct:8.2f} % of a core  {name}")
        print(f"{sum(quiet['percent_of_a_core'].values()):8.2f} % of a core in all")
    report = measure(args.url, args.model, args.requests, args.max_tokens, args.streams)
    print(f"{report['tokens']} tokens in {report['wall_s']:.1f} s: {report['tokens_per_s']:.1f} tok/s, "
          f"{1e3 / report['tokens_per_s']:.1f} ms a token (wall)")
    for name, ms in list(report["cpu_ms_per_token"].items())[:args.top]:
        print(f"{ms:8.2f} ms CPU/token  {name}")
    print(f"{sum(report['cpu_ms_per_token'].values()):8.2f} ms CPU/token in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
