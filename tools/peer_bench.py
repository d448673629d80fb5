"""`python -m tools bench --peer`: tandem beside vLLM's own OpenAI server, side by side in one run.

The bench starts (and stops, with SIGTERM) each server on 127.0.0.1: vLLM alone
(`python -m vllm.entrypoints.openai.api_server`), vLLM with its `ngram` method as its docs configure
it, and `tandem serve` (its default config); tandem's plain decoding is the same tandem server with
`num_speculative_tokens: 0` on each request. Every server gets the same model directory, dtype and
context length. Requests are greedy and streaming with `stream_options.include_usage`, so tokens are
counted from each server's own `usage`.

- One stream: prompt by prompt, each prompt sent to every server in turn, the order rotated from
  prompt to prompt (no server always goes first on a warm cache).
- N streams: N concurrent requests per server, servers in rotated order, `repeats` times.

Per server and workload: tokens/s (one stream: tokens over the time spent in that server's requests;
N streams: tokens over the batch's wall time), TTFT and inter-token latency p50/p99 (a chunk of n
tokens counts n gaps of its gap / n), and, for greedy fp32, whether each output equals the reference
server's. Every figure is measured in this run on this machine; ratios are over vLLM alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cluster import TELEMETRY_OFF
from cluster.core.config import EAGLE3_DRAFT, PROPOSERS
from cluster.vllm import reaper
from deployments.config import VLLMServingConfig

NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}  # vLLM's docs' setting
PLAIN = {"num_speculative_tokens": 0}  # tandem's plain decoding, on the same server
# vLLM's own eagle3 method on tandem's shipped EAGLE-3 draft (its vLLM layout written once under the cache), γ 3;
# "_sched": with vLLM's γ by batch size (`num_speculative_tokens_per_batch_size`), the schedule tandem gives it
# (`deployments.config.EAGLE3_SCHEDULE`)
# "vllm_sync": vLLM alone with its async scheduling off, as vLLM turns it off for any `custom_class` proposer
# (tandem's): what that costs plain decoding, with no tandem process on the path
# "vllm_suffix": vLLM's own `suffix` method (Arctic Inference's suffix decoding, `make peer-extras`) at vLLM's defaults:
# per-request trees over prompt and output, plus a global tree of earlier responses (which recalls the answers of
# prompts the bench sent before: the 16-stream batches repeat prompts); "vllm_suffix_own": the same without that
# global cache (`suffix_decoding_max_cached_requests: 0`), the matches tandem's default makes (a session's own tokens)
SUFFIX_SPEC = {"method": "suffix"}
VLLM_SIDES = ("vllm", "vllm_ngram", "vllm_eagle3", "vllm_eagle3_sched", "vllm_sync", "vllm_suffix", "vllm_suffix_own")


def vllm_spec(name: str) -> dict | None:
    """The speculative config of a vLLM-alone side (None: plain)."""
    if name == "vllm_ngram":
        return NGRAM_SPEC
    if name.startswith("vllm_suffix"):
        _require_arctic_inference()
        return {**SUFFIX_SPEC, "suffix_decoding_max_cached_requests": 0} if name.endswith("_own") else SUFFIX_SPEC
    if name.startswith("vllm_eagle3"):
        from cluster.vllm.eagle3 import checked_eagle3_dir

        spec = {"method": "eagle3", "model": str(checked_eagle3_dir(EAGLE3_DRAFT, "--peer-servers")),
                "num_speculative_tokens": 3}
        schedule = VLLMServingConfig().schedule_for("eagle3")  # what tandem's `speculative_schedule: auto` gives it
        return {**spec, "num_speculative_tokens_per_batch_size": schedule} if name.endswith("_sched") else spec
    return None


def _require_arctic_inference() -> None:
    """vLLM's suffix method imports Arctic Inference in its worker: fail here, before any server starts."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        raise SystemExit("the vllm_suffix sides need Arctic Inference (vLLM's suffix method): run `make peer-extras`")


@dataclass(frozen=True)
class Server:
    """One side of the comparison: a URL, and what every request to it adds to the body."""

    name: str
    url: str
    model: str
    extra: dict = field(default_factory=dict)


@dataclass
class Record:
    """One streamed request, as the client saw it."""

    server: str
    prompt: int
    tokens: int  # from the server's usage
    text: str
    ttft_s: float
    total_s: float
    token_gaps_s: list[float]


def parse_stream(lines, chat: bool, start: float, clock=time.perf_counter) -> tuple[str, int, float, list[float]]:
    """(text, completion tokens from usage, TTFT, per-token gaps) of one SSE stream's lines."""
    text, tokens, first, last, gaps = [], None, None, None, []
    for line in lines:
        if not line.startswith("data: ") or line.strip() == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        piece = "".join((c.get("delta", {}).get("content") or "") if chat else (c.get("text") or "")
                        for c in chunk.get("choices", []))
        if not piece:
            continue
        now = clock()
        if first is None:
            first = now
        elif last is not None:
            ids = [i for c in chunk.get("choices", []) for i in (c.get("token_ids") or [])]
            n = max(1, len(ids))
            gaps.extend([(now - last) / n] * n)
        last = now
        text.append(piece)
    if tokens is None:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    return "".join(text), tokens, (first if first is not None else clock()) - start, gaps


def request(client: httpx.Client, server: Server, prompt: str, max_tokens: int, chat: bool, index: int) -> Record:
    body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **server.extra}
    if chat:
        url, body["messages"] = f"{server.url}/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        url, body["prompt"] = f"{server.url}/v1/completions", prompt
    start = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: {url} answered {response.status_code}: "
                               f"{response.read().decode(errors='replace')[:500]}")
        text, tokens, ttft, gaps = parse_stream(response.iter_lines(), chat, start)
    return Record(server.name, index, tokens, text, ttft, time.perf_counter() - start, gaps)


def rotated(servers: list[Server], k: int) -> list[Server]:
    """The servers in turn, starting with the k-th (mod their count)."""
    k %= len(servers)
    return servers[k:] + servers[:k]


def one_stream(client, servers: list[Server], prompts: list[str], max_tokens: int, chat: bool,
               send=request) -> list[Record]:
    """Each prompt to every server in turn, the order rotated from prompt to prompt."""
    return [send(client, server, prompt, max_tokens, chat, i)
            for i, prompt in enumerate(prompts) for server in rotated(servers, i)]


def many_streams(client, servers: list[Server], prompts: list[str], max_tokens: int, chat: bool,
                 streams: int, repeats: int, send=request, fresh: bool = False) -> dict[str, list[tuple[float, list[Record]]]]:
    """`streams` concurrent requests per server, servers in rotated order, `repeats` times:
    per server, (wall time, records) of each batch. `fresh`: batch r is prompts[r·streams:(r+1)·streams], so no
    prompt repeats (else each batch cycles through `prompts`)."""
    out: dict[str, list] = {s.name: [] for s in servers}
    with ThreadPoolExecutor(streams) as pool:
        for r in range(repeats):
            batch = prompts[r * streams:(r + 1) * streams] if fresh else [prompts[i % len(prompts)] for i in range(streams)]
            for server in rotated(servers, r):
                start = time.perf_counter()
                records = list(pool.map(lambda a: send(client, server, a[1], max_tokens, chat, a[0]),
                                        enumerate(batch)))
                out[server.name].append((time.perf_counter() - start, records))
    return out


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def summarize(records: list[Record], wall_s: float | None = None) -> dict:
    """tokens/s (over `wall_s`, else over the requests' own time), TTFT and ITL p50/p99 in ms."""
    tokens = sum(r.tokens for r in records)
    seconds = wall_s if wall_s is not None else sum(r.total_s for r in records)
    gaps = [g for r in records for g in r.token_gaps_s]
    ttft = [r.ttft_s for r in records]
    return {"requests": len(records), "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "ttft_ms": {"p50": 1e3 * _pct(ttft, 50), "p99": 1e3 * _pct(ttft, 99)},
            "itl_ms": {"p50": 1e3 * _pct(gaps, 50), "p99": 1e3 * _pct(gaps, 99)},
            "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else 0.0}


def same_outputs(records: list[Record], reference: str) -> dict[str, float]:
    """Per server, the fraction of its outputs equal to the reference server's for the same prompt."""
    ref = {r.prompt: r.text for r in records if r.server == reference}
    by: dict[str, list[bool]] = {}
    for r in records:
        if r.server != reference and r.prompt in ref:
            by.setdefault(r.server, []).append(r.text == ref[r.prompt])
    return {name: sum(v) / len(v) for name, v in by.items()}


# -- the servers ------------------------------------------------------------------------------------


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, name: str) -> str:
    """The served model's id, once a one-token completion is answered: tandem's `/v1/models` answers before
    its verifier replica is up, so the model list alone does not say the server can decode."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it served")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=2.0)
            if models.status_code == 200:
                model = models.json()["data"][0]["id"]
                probe = httpx.post(f"{url}/v1/completions", timeout=max(1.0, deadline - time.time()),
                                   json={"model": model, "prompt": "hi", "max_tokens": 1})
                if probe.status_code == 200:
                    return model
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{name} did not serve within {timeout_s:.0f} s")


DIRECT_LINE = re.compile(r"^\s*direct, replica 0: (http://\S+)/v1\b", re.M)


def direct_url(log_path: str) -> str | None:
    """The address `tandem serve` printed for its first replica's own HTTP port (Serve's direct ingress), if any."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return None
    found = DIRECT_LINE.search(text)
    return found.group(1) if found else None


def orphaned_engines(parent: int = 1) -> list[int]:
    """vLLM's processes (titled "VLLM::...") that init has adopted: left running by a server that did not stop its
    engine (`cluster.vllm.reaper` prevents it for tandem's), they take CPU from whatever is measured next."""
    return sorted(reaper.named_children(parent, "VLLM::"))


def warn_orphans(when: str, wait_s: float = 0.0, parent: int = 1) -> list[int]:
    """Orphaned vLLM processes `when` (waiting up to `wait_s` for a reaper to stop them), named loudly on stderr."""
    deadline = time.monotonic() + wait_s
    while (found := orphaned_engines(parent)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if found:
        print(f"WARNING: {len(found)} orphaned vLLM process(es) {when}: {found}; they take CPU from the readings "
              f"(kill {' '.join(map(str, found))})", file=sys.stderr, flush=True)
    return found


class Process:
    """A server process started by the bench; stopped with SIGTERM (a background job ignores SIGINT)."""

    def __init__(self, name: str, argv: list[str], url: str, env: dict, log_path: str, timeout_s: float = 600):
        self.name, self.url = name, url
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)  # --peer-logs DIR need not exist
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self.model = _wait_ready(url, self.proc, timeout_s, name)
        except Exception:
            self.stop()
            raise
        self.direct = direct_url(log_path)

    def client_url(self, via: str = "direct") -> str:
        """Where a client calls this server: a tandem server's first replica itself (`via` "direct", as
        `tandem serve` prints it, Serve's direct ingress on one machine) when it has one, else its `url`."""
        if via not in ("direct", "proxy"):
            raise ValueError(f"via {via!r}: direct or proxy")
        return self.direct if via == "direct" and self.direct else self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
            warn_orphans(f"after {self.name} stopped", wait_s=10)
        self.log.close()


def vllm_argv(model_dir: str, port: int, dtype: str, max_model_len: int, spec: dict | None,
              sync: bool = False) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--served-model-name", "peer"]
    return argv + (["--speculative-config", json.dumps(spec)] if spec else []) + (["--no-async-scheduling"] if sync else [])


TANDEM_ENGINES = ("auto", "torch", "vllm")
TANDEM_PROPOSERS = tuple(p for p in PROPOSERS if p != "auto")  # a side names its proposer (plain "tandem": the config's)


def split_bind(name: str, default: str) -> tuple[str, str]:
    """A server name with an optional "@BIND" (e.g. "vllm@0", "tandem_vllm_none@0-1"): the server, and
    the VLLM_CPU_OMP_THREADS_BIND its vLLM engines get (`default` without one)."""
    server, _, bind = name.partition("@")
    if "@" in name and not re.fullmatch(r"auto|nobind|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*", bind):
        raise ValueError(f"{name!r}: after @ a VLLM_CPU_OMP_THREADS_BIND value (auto, nobind, 0, 0-1, 0,1)")
    return server, bind or default


def tandem_flags(name: str) -> list[str]:
    """`tandem serve` flags for a tandem side's name: "tandem" (the config as it is), then optionally an
    engine and a proposer, e.g. "tandem_vllm", "tandem_torch_hybrid", "tandem_vllm_ngram"
    ("tandem_vllm_none": no speculation at all, not even an idle proposer in the engine), then any engine
    fields as "+FIELD=VALUE" (`tandem serve --set`), e.g. "tandem_torch_hybrid+draft=eagle3+tree_width=4"."""
    name, *sets = name.split("+")
    for item in sets:
        if "=" not in item:
            raise ValueError(f"unknown server {name!r}: after + an engine field as FIELD=VALUE, not {item!r}")
    head, *parts = name.split("_")
    if head != "tandem" or len(parts) > 2:
        raise ValueError(f"unknown server {name!r}: one of {', '.join(VLLM_SIDES)} or tandem[_{'|'.join(TANDEM_ENGINES)}]"
                         f"[_{'|'.join(TANDEM_PROPOSERS)}]")
    flags = []
    if parts and parts[0] in TANDEM_ENGINES:
        flags += ["--engine", parts.pop(0)]
    if parts and parts[0] in TANDEM_PROPOSERS:
        flags += ["--proposer", parts.pop(0)]
    if parts:
        raise ValueError(f"unknown server {name!r}: after tandem_ an engine ({', '.join(TANDEM_ENGINES)}) "
                         f"then a proposer ({', '.join(TANDEM_PROPOSERS)})")
    return flags + [flag for item in sets for flag in ("--set", item)]


def has_plain_side(name: str) -> bool:
    """Whether a server gets a `_plain` side (plain decoding through it, `num_speculative_tokens: 0` per request):
    a speculative tandem, except on vLLM's own eagle3 method without tandem's matches (`eagle3_matches=false`),
    which refuses a per-request draft length."""
    base = name.split("+")[0]
    return base.startswith("tandem") and not base.endswith("_none") and not (
        base.endswith("_eagle3") and "_torch" not in base and "+eagle3_matches=false" in name.lower())


def tandem_argv(config: str, port: int, grpc_port: int, flags: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "deployments.cli", "serve", "--config", config, "--http-port", str(port),
            "--grpc-port", str(grpc_port), *flags]


def server_env(vllm_bind: str = "auto") -> dict[str, str]:
    """What each server process gets: loopback, offline, the same KV space and OMP binding for every vLLM engine
    (tandem's Ray workers inherit it)."""
    return {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_OMP_THREADS_BIND": vllm_bind, **TELEMETRY_OFF}


def openmp_env(name: str, openmp: str = "intel") -> dict[str, str]:
    """What a vLLM-alone side adds for its OpenMP runtime: "intel" (the default) preloads libiomp5 into the whole
    server, as vLLM's CPU guide sets it up (the same runtime tandem gives its own engine's processes,
    `cluster.vllm.openmp`); "gnu" adds nothing (vLLM then preloads PyTorch's libgomp itself). Tandem sides: nothing
    (`vllm.intel_openmp` in their config decides)."""
    if openmp not in ("intel", "gnu"):
        raise ValueError(f"OpenMP runtime {openmp!r}: intel or gnu")
    if name not in VLLM_SIDES or openmp == "gnu":
        return {}
    from cluster.vllm.openmp import intel_openmp_library

    library = intel_openmp_library()
    if library is None:
        raise RuntimeError("intel-openmp (libiomp5.so) is not installed; --peer-vllm-openmp gnu runs vLLM without it")
    return {"LD_PRELOAD": str(library)}


def server_argv(name: str, model_dir: str, config: str, dtype: str, max_model_len: int, port: int) -> list[str]:
    """The command line of the server `name` (`VLLM_SIDES`, tandem[_ENGINE][_PROPOSER]) on `port` (tandem's
    gRPC on port + 1)."""
    if name in VLLM_SIDES:
        return vllm_argv(model_dir, port, dtype, max_model_len, vllm_spec(name), sync=name == "vllm_sync")
    return tandem_argv(config, port, port + 1, tandem_flags(name))  # the config, engine / proposer maybe replaced


def start_servers(model_dir: str, config: str, dtype: str, max_model_len: int, base_port: int, log_dir: str,
                  which: tuple[str, ...], vllm_bind: str = "auto",
                  openmp: str = "intel", via: str = "direct") -> tuple[list[Process], list[Server]]:
    """Start the servers `which` names (vllm, vllm_ngram, tandem, tandem_vllm; each optionally @BIND, its
    own VLLM_CPU_OMP_THREADS_BIND instead of `vllm_bind`; vLLM-alone sides on `openmp`): their processes, and
    the sides of the comparison (each speculative tandem also as <name>_plain: the same server, `num_speculative_tokens: 0`);
    a tandem side is called `via` its replica's own port ("direct") or Serve's proxy ("proxy")."""
    procs, servers = [], []
    warn_orphans("before the servers start")
    try:
        for i, side in enumerate(which):
            name, bind = split_bind(side, vllm_bind)
            port = base_port + 10 * i
            url = f"http://127.0.0.1:{port}"
            argv = server_argv(name, model_dir, config, dtype, max_model_len, port)
            env = {**server_env(bind), **openmp_env(name, openmp)}
            proc = Process(side, argv, url, env, os.path.join(log_dir, f"{side.replace('@', '-')}.log"))
            procs.append(proc)
            url = proc.client_url(via)
            if via == "direct" and name not in VLLM_SIDES and url == proc.url:  # loud: the bench's path changed
                print(f"{side}: printed no replica address; called through Serve's proxy", file=sys.stderr)
            servers.append(Server(side, url, proc.model))
            if has_plain_side(name):
                servers.append(Server(f"{side}_plain", url, proc.model, PLAIN))
    except Exception:
        for proc in procs:
            proc.stop()
        raise
    return procs, servers


def fresh_prompts_needed(one_stream: int, streams: tuple[int, ...], repeats: int) -> int:
    """The prompts a workload needs so that no server sees one twice (`compare(fresh_one_stream=...)`): the
    one-stream prompts, each N-stream batch its own, and one for the warm-up."""
    return (one_stream if 1 in streams else 0) + sum(n * repeats for n in streams if n > 1) + 1


def fresh_plan(prompts: list[str], one_stream: int, streams: tuple[int, ...], repeats: int,
               workload: str = "prompts") -> tuple[str, dict[int, list[str]]]:
    """(the warm-up's prompt, each stream count's prompts) so that no server gets a prompt twice: one stream the
    first `one_stream`, each N-stream count its N·repeats after them, the warm-up the last; a ValueError when
    there are fewer than `fresh_prompts_needed`."""
    needed = fresh_prompts_needed(one_stream, streams, repeats)
    if len(prompts) < needed:
        raise ValueError(f"{workload}: {len(prompts)} prompts, fewer than the {needed} a run without repeats needs")
    plan, taken = {}, 0
    for n in streams:
        size = one_stream if n == 1 else n * repeats
        plan[n], taken = prompts[taken:taken + size], taken + size
    return prompts[-1], plan


def compare(servers: list[Server], workloads: dict[str, tuple[list[str], bool]], max_tokens: int,
            streams: tuple[int, ...], repeats: int, reference: str = "vllm", send=request,
            client: httpx.Client | None = None, fresh_one_stream: int | None = None) -> dict:
    """The side-by-side figures for running servers (every workload, every stream count). `fresh_one_stream`:
    no server gets a prompt twice (a server that keeps earlier outputs, vLLM's suffix method or tandem's pool,
    would recall the answer): the warm-up takes the last prompt, one stream the first `fresh_one_stream`, and
    each N-stream batch the next ones (`fresh_prompts_needed`)."""
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0),
                                    limits=httpx.Limits(max_connections=max(streams) * 2 + 4))
    report: dict = {"servers": [s.name for s in servers], "max_tokens": max_tokens, "reference": reference,
                    "workloads": {}}
    try:
        for workload, (prompts, chat) in workloads.items():
            fresh = fresh_one_stream is not None
            warm, plan = fresh_plan(prompts, fresh_one_stream, streams, repeats, workload) if fresh else \
                (prompts[0], dict.fromkeys(streams, prompts))
            for server in servers:  # warm-up, not measured
                send(client, server, warm, 4, chat, -1)
            rows: dict = {}
            for n in streams:
                if n == 1:
                    records = one_stream(client, servers, plan[n], max_tokens, chat, send)
                    per = {s.name: summarize([r for r in records if r.server == s.name]) for s in servers}
                    for name, equal in same_outputs(records, reference).items():
                        per[name]["same_output_as_reference"] = equal
                    report.setdefault("outputs", {})[workload] = {
                        s.name: [r.text for r in records if r.server == s.name] for s in servers}
                else:
                    batches = many_streams(client, servers, plan[n], max_tokens, chat, n, repeats, send, fresh)
                    per = {name: summarize([r for _, rs in runs for r in rs], sum(w for w, _ in runs))
                           for name, runs in batches.items()}
                ref = per.get(reference, {}).get("tokens_per_s")
                for row in per.values():
                    row["ratio_to_reference"] = row["tokens_per_s"] / ref if ref else None
                rows[str(n)] = per
            report["workloads"][workload] = rows
    finally:
        if own:
            client.close()
    return report


def merge_alone(reports: list[dict], reference: str) -> dict:
    """One report from several `compare` runs, each over the sides of one server measured alone (started,
    measured, stopped): their rows side by side, ratios and output equality over `reference` again."""
    merged: dict = {"servers": [n for r in reports for n in r["servers"]], "max_tokens": reports[0]["max_tokens"],
                    "reference": reference, "workloads": {}, "alone": True}
    for report in reports:
        for workload, rows in report["workloads"].items():
            for n, per in rows.items():
                merged["workloads"].setdefault(workload, {}).setdefault(n, {}).update(per)
    for workload, rows in merged["workloads"].items():
        outputs = {name: texts for r in reports for name, texts in r.get("outputs", {}).get(workload, {}).items()}
        for n, per in rows.items():
            ref = per.get(reference, {}).get("tokens_per_s")
            for name, row in per.items():
                row["ratio_to_reference"] = row["tokens_per_s"] / ref if ref else None
                row.pop("same_output_as_reference", None)
                if n == "1" and name != reference and reference in outputs and name in outputs:
                    pairs = list(zip(outputs[reference], outputs[name], strict=False))
                    row["same_output_as_reference"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return merged


def format_report(report: dict) -> str:
    lines = [f"max_tokens {report['max_tokens']}, greedy, streaming; ratio over {report['reference']}"]
    for workload, rows in report["workloads"].items():
        for n, per in rows.items():
            lines.append(f"\n{workload}, {n} stream(s)")
            lines.append(f"{'server':<14}{'tok/s':>8}{'ratio':>7}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
                         f"{'same':>6}")
            for name, r in per.items():
                same = r.get("same_output_as_reference")
                lines.append(f"{name:<14}{r['tokens_per_s']:>8.1f}{(r['ratio_to_reference'] or 0):>7.2f}"
                             f"{r['ttft_ms']['p50']:>8.0f}ms{r['ttft_ms']['p99']:>6.0f}ms"
                             f"{r['itl_ms']['p50']:>7.1f}ms{r['itl_ms']['p99']:>6.1f}ms"
                             f"{'' if same is None else f'{same:.2f}':>6}")
    return "\n".join(lines)
