"""The chat-16 readings of BENCHMARKS.md ("On an Intel Xeon with AMX"), each on one server it starts and stops:

    python benchmarks/serve_cpu/ab-2026-12-05-xeon/readings.py spec SIDE  # not streamed: 6 x 128 at 1 stream,
                                                                          # 48 x 64 at 16, speculation summed
    python benchmarks/serve_cpu/ab-2026-12-05-xeon/readings.py s16 SIDE   # streamed (tools.serve_cpu's client):
                                                                          # three readings of 96 x 64 at 16
    python benchmarks/serve_cpu/ab-2026-12-05-xeon/readings.py cap SIDE   # streamed, every event parsed: 96 x 64
                                                                          # at 16, the default and
                                                                          # num_speculative_tokens 0 alternated
SIDE: a `tools.peer_bench` server name (tandem, tandem_vllm_none, ...).
"""
import contextlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)
from cluster.core.workloads import PEER_CHAT_PROMPTS  # noqa: E402
from cluster.model import models  # noqa: E402
from tools.peer_bench import Process, openmp_env, server_argv, server_env  # noqa: E402
from tools.serve_cpu import measure  # noqa: E402


@contextlib.contextmanager
def server(side: str, mode: str):
    argv = server_argv(side, str(models.resolve_model_path("default")), "ray_config.yaml", "bfloat16", 2048, 8300)
    p = Process(side, argv, "http://127.0.0.1:8300", {**server_env("0-1"), **openmp_env(side)}, f"/tmp/{mode}-{side}.log")
    try:
        time.sleep(10)
        yield p
    finally:
        p.stop()


def batch(request, count: int, streams: int) -> tuple[float, list]:
    """(wall seconds, results) of `request(prompt)` over `count` chat prompts on `streams` threads."""
    prompts = [PEER_CHAT_PROMPTS[i % len(PEER_CHAT_PROMPTS)] for i in range(count)]
    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(request, prompts))
    return time.perf_counter() - t, results


def chat(client: httpx.Client, p: Process, prompt: str, max_tokens: int, stream: bool, extra: dict) -> tuple:
    """(completion tokens, drafted, accepted, rounds, events) of one greedy chat request."""
    body = {"model": p.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    if not stream:
        j = client.post(p.url + "/v1/chat/completions", json=body).json()
        spec = j.get("speculation") or {}
        return j["usage"]["completion_tokens"], spec.get("drafted", 0), spec.get("accepted", 0), spec.get("rounds", 0), 1
    tokens, spec, events = 0, {}, 0
    body.update(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", p.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events += 1
                j = json.loads(line[6:])
                tokens = j["usage"]["completion_tokens"] if j.get("usage") else tokens
                spec = j.get("speculation") or spec
    return tokens, spec.get("drafted", 0), spec.get("accepted", 0), spec.get("rounds", 0), events


def main(mode: str, side: str) -> None:
    client = httpx.Client(timeout=600)
    with server(side, mode) as p:
        if mode == "s16":
            out = [round(measure(p.url, p.model, 96, 64, 16)["tokens_per_s"], 1) for _ in range(3)]
            print(json.dumps({"side": side, "stream16_tok_s": out}), flush=True)
            return
        stream = mode == "cap"
        chat(client, p, PEER_CHAT_PROMPTS[0], 8, stream, {})  # warm-up
        runs = ([(1, 6, 128, "default", {}), (16, 48, 64, "default", {})] if mode == "spec" else
                [(16, 96, 64, name, extra) for _ in range(3)
                 for name, extra in (("default", {}), ("plain", {"num_speculative_tokens": 0}))])
        for streams, count, max_tokens, name, extra in runs:
            wall, res = batch(lambda q: chat(client, p, q, max_tokens, stream, extra), count, streams)
            tokens, drafted, accepted, rounds, events = (sum(col) for col in zip(*res))
            print(json.dumps({"side": side, "run": name, "streams": streams, "tok_s": round(tokens / wall, 1),
                              "tokens": tokens, "drafted": drafted, "accepted": accepted, "rounds": rounds,
                              "events": events}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("spec", "s16", "cap"):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
