"""`tandem bench --endpoint URL`: drive a running tandem server over its OpenAI HTTP API.

For each concurrency level it runs the same prompts twice, side by side: speculative (the server's
policy) and plain decoding (`num_speculative_tokens: 0` on each request, same server, same batching),
and reports aggregate throughput, time to first token, time per output token and inter-chunk latency
percentiles, and the speculation figures the server returns with each response.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestRecord:
    ttft_s: float
    total_s: float
    tokens: int
    chunk_gaps_s: list[float]
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    gamma_counts: list[int] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class ModeResult:
    mode: str
    concurrency: int
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)

    def summary(self) -> dict:
        tokens = sum(r.tokens for r in self.records)
        drafted = sum(r.drafted for r in self.records)
        accepted = sum(r.accepted for r in self.records)
        rounds = sum(r.rounds for r in self.records)
        gaps = [g for r in self.records for g in r.chunk_gaps_s]
        gammas: list[int] = []
        for r in self.records:
            gammas.extend([0] * (len(r.gamma_counts) - len(gammas)))
            for g, n in enumerate(r.gamma_counts):
                gammas[g] += n
        return {
            "mode": self.mode, "concurrency": self.concurrency, "requests": len(self.records),
            "tokens": tokens, "wall_s": self.wall_s, "tokens_per_s": tokens / self.wall_s if self.wall_s else 0.0,
            "ttft_s": _percentiles([r.ttft_s for r in self.records]),
            "tpot_s": _percentiles([r.tpot_s for r in self.records if r.tpot_s is not None]),
            "inter_chunk_s": _percentiles(gaps),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": tokens / rounds if rounds else 0.0,
            "rounds_by_gamma": gammas,
        }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": statistics.fmean(ordered)}


def _one(client: httpx.Client, endpoint: str, model: str, prompt: str, max_tokens: int, plain: bool,
         chat: bool = False) -> RequestRecord:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    if chat:
        url, body["messages"] = f"{endpoint}/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        url, body["prompt"] = f"{endpoint}/v1/completions", prompt
    if plain:
        body["num_speculative_tokens"] = 0
    start = time.perf_counter()
    first, last, tokens, gaps, final = None, None, 0, [], {}
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']['message']}")
            now = time.perf_counter()
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if n:
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append(now - last)
                last = now
                tokens += n
            if "speculation" in chunk:
                final = chunk["speculation"]
    end = time.perf_counter()
    return RequestRecord(ttft_s=(first or end) - start, total_s=end - start, tokens=tokens, chunk_gaps_s=gaps,
                         drafted=final.get("drafted", 0), accepted=final.get("accepted", 0),
                         rounds=final.get("rounds", 0), gamma_counts=final.get("gamma_counts", []))


def run_endpoint_bench(endpoint: str, prompts: list[str], max_tokens: int, concurrency: tuple[int, ...],
                       model: str | None = None, api_key: str | None = None, chat: bool = False,
                       modes: tuple[str, ...] = ("speculative", "plain")) -> dict:
    endpoint = endpoint.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=httpx.Timeout(600.0, connect=10.0),
                      limits=httpx.Limits(max_connections=max(concurrency) + 4)) as client:
        if model is None:
            model = client.get(f"{endpoint}/v1/models").raise_for_status().json()["data"][0]["id"]
        _one(client, endpoint, model, prompts[0], 4, False, chat)  # warm-up
        results = []
        for n in concurrency:
            batch = [prompts[i % len(prompts)] for i in range(max(n, len(prompts)))]
            for mode in modes:
                lock, records = threading.Lock(), []

                def work(prompt: str) -> None:
                    record = _one(client, endpoint, model, prompt, max_tokens, mode == "plain", chat)
                    with lock:
                        records.append(record)

                start = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    list(pool.map(work, batch))
                result = ModeResult(mode, n, time.perf_counter() - start, records)
                results.append(result.summary())
    report = {"endpoint": endpoint, "model": model, "max_tokens": max_tokens, "prompts": len(prompts), "chat": chat,
              "results": results}
    by = {(r["mode"], r["concurrency"]): r for r in results}
    report["speedup_over_plain"] = {str(n): by[("speculative", n)]["tokens_per_s"] / by[("plain", n)]["tokens_per_s"]
                                    for n in concurrency if ("speculative", n) in by and ("plain", n) in by}
    return report


def format_endpoint_report(report: dict) -> str:
    lines = [f"endpoint {report['endpoint']} model {report['model']}, {report['prompts']} prompts, "
             f"max_tokens {report['max_tokens']}, greedy",
             f"{'mode':<12}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'p90':>8}{'TPOT p50':>10}{'p90':>8}"
             f"{'chunk p50':>11}{'α':>6}{'E':>6}  rounds by γ"]
    for r in report["results"]:
        lines.append(f"{r['mode']:<12}{r['concurrency']:>5}{r['tokens_per_s']:>9.1f}"
                     f"{r['ttft_s'].get('p50', 0) * 1e3:>8.0f}ms{r['ttft_s'].get('p90', 0) * 1e3:>6.0f}ms"
                     f"{r['tpot_s'].get('p50', 0) * 1e3:>8.1f}ms{r['tpot_s'].get('p90', 0) * 1e3:>6.1f}ms"
                     f"{r['inter_chunk_s'].get('p50', 0) * 1e3:>9.1f}ms"
                     f"{r['acceptance_rate']:>6.2f}{r['mean_accepted_length']:>6.2f}  {r['rounds_by_gamma']}")
    for n, ratio in report["speedup_over_plain"].items():
        lines.append(f"speculative / plain at {n} concurrent streams: {ratio:.2f}x")
    return "\n".join(lines)
