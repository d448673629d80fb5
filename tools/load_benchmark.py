"""Load benchmark: guidellm against `tandem serve`, speculative vs plain decoding, plus a disconnect run.

One command (from the repository root):

    .venv/bin/python tools/load_benchmark.py --out /tmp/tandem-load

For each mode it writes a copy of `ray_config.yaml` (plain: `engine.num_speculative_tokens: 0`,
everything else identical), starts `tandem serve` on free loopback ports in its own process group,
waits for GET /health and /v1/models, and runs guidellm against it:

  * concurrent streams 1, 4, 16, 64 (synthetic 128-token prompts, 64-token outputs, chat
    completions, streamed), each level bounded by --seconds;
  * a sweep (synchronous, throughput, constant rates in between; --sweep-size levels of
    --sweep-seconds each; concurrency capped at the router's 32 sessions).

On the speculative server it then runs 64 clients for 2 minutes that stream and go away at random
points (before the first token, mid-stream, by a client read timeout) or read to the end,
reconnecting in a loop, and afterwards asks the Router, VerifierPool and DrafterPool deployments
(Serve handles, through the server's own Ray cluster) how many sessions and leases they still hold.
Finally it prints a Markdown table (speculative vs plain) and writes summary.json to --out.

guidellm lives in its own virtual environment (its dependencies conflict with tandem's):
    python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install guidellm==0.8.1
The script creates it when /tmp/gvenv/bin/guidellm is missing. Nothing here talks to anything but
127.0.0.1; the tokenizer is the local model directory (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster import TELEMETRY_OFF

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
GUIDELLM_VENV = Path(os.environ.get("GUIDELLM_VENV", "/tmp/gvenv"))
GUIDELLM = GUIDELLM_VENV / "bin" / "guidellm"
MODEL = "SmolLM2-135M-Instruct"
TOKENIZER = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem")) / "models" / MODEL
LOOPBACK = "127.0.0.1"
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
       "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost",
       "no_proxy": "127.0.0.1,localhost", **TELEMETRY_OFF}
os.environ.update(ENV)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def ensure_guidellm() -> None:
    if GUIDELLM.exists():
        return
    log(f"creating {GUIDELLM_VENV} with guidellm==0.8.1")
    subprocess.run(["python3", "-m", "venv", str(GUIDELLM_VENV)], check=True)
    subprocess.run([str(GUIDELLM_VENV / "bin" / "pip"), "install", "guidellm==0.8.1"], check=True)


def write_config(out: Path, mode: str, engine: str | None = None) -> Path:
    raw = yaml.safe_load((ROOT / "ray_config.yaml").read_text())
    for app in raw["applications"]:
        if mode == "plain":
            app["args"]["engine"]["num_speculative_tokens"] = 0
        if engine:
            app["args"]["engine"]["backend"] = engine
    path = out / f"ray_config.{mode}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ---------------------------------------------------------------- the server


def _children(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(p.name))
    return kids


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for kid in _children(todo.pop()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Server:
    """`tandem serve` in its own process group; stopped with SIGINT (serve.shutdown + ray.shutdown)."""

    def __init__(self, config: Path, out: Path, mode: str):
        self.config, self.mode = config, mode
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://{LOOPBACK}:{self.http_port}"
        self.log_path = out / f"server.{mode}.log"
        self.proc: subprocess.Popen | None = None
        self.tree: set[int] = set()
        self.gcs_address: str | None = None

    def start(self, timeout_s: float = 900) -> None:
        import httpx

        log(f"{self.mode}: starting tandem serve on {self.url} (log {self.log_path})")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "tandem"), "serve", "--config", str(self.config), "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port)],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **ENV},
            # launched from a background job (`cmd &`, nohup), SIGINT arrives ignored and the child would inherit that:
            # give it the default disposition so that Python turns SIGINT into KeyboardInterrupt (a clean stop)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline, t0 = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}; see {self.log_path}")
            self._track()
            try:
                if (httpx.get(f"{self.url}/health", timeout=5).status_code == 200
                        and httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200):
                    log(f"{self.mode}: ready after {time.monotonic() - t0:.0f} s")
                    self._track()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"tandem serve not ready after {timeout_s} s; see {self.log_path}")

    def _track(self) -> None:
        """Remember every process this server started (Ray's GCS, raylet, workers) and the GCS address."""
        if self.proc is None:
            return
        self.tree |= _descendants(self.proc.pid)
        if self.gcs_address is None:
            for pid in self.tree:
                cmd = _cmdline(pid)
                if "gcs_server" in cmd and "--session-dir=" in cmd:  # the port is dynamic: GCS writes it there
                    session = Path(cmd.split("--session-dir=", 1)[1].split()[0])
                    ports = list(session.glob("gcs_server_port_*"))
                    if ports and ports[0].read_text().strip():
                        self.gcs_address = f"{LOOPBACK}:{ports[0].read_text().strip()}"

    def stop(self) -> None:
        if self.proc is None:
            return
        self._track()
        log(f"{self.mode}: stopping (SIGINT to tandem serve, pid {self.proc.pid})")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                log("no exit after 120 s: SIGTERM, then SIGKILL, to its process group")
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        time.sleep(5)
        left = [pid for pid in self.tree if Path(f"/proc/{pid}").exists()]
        for pid in left:  # only processes this server started (its descendants, by pid)
            log(f"leftover process of this server: {pid} {_cmdline(pid)[:100]}: SIGKILL")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        self.proc = None


# ---------------------------------------------------------------- guidellm


def _seconds_arg(seconds: str) -> str:
    """'60' -> seconds=60; '60,60,90,180' -> one duration per benchmark (guidellm takes a list)."""
    values = [v.strip() for v in str(seconds).split(",") if v.strip()]
    if len(values) == 1:
        return f"seconds={values[0]}"
    return ",".join(f"seconds[{i}]={v}" for i, v in enumerate(values))


def guidellm(server: Server, out: Path, name: str, profile: str, seconds: str,
             overrides: list[tuple[str, str]] = (), max_requests: int | None = None) -> Path:
    result = out / f"guidellm.{server.mode}.{name}.json"
    cmd = [str(GUIDELLM), "run",
           "--backend", f"kind=openai_http,target={server.url},model={MODEL},request_format=/v1/chat/completions,"
                        f"timeout=600,http2=false",
           "--profile", profile,
           "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
           "--tokenizer", f"kind=hf_auto,model={TOKENIZER}",
           "--constraint", f"kind=max_duration,{_seconds_arg(seconds)}",
           "--output", f"kind=json,path={result}",
           "--output", "kind=console",
           "--disable-console-interactive"]
    if max_requests:
        cmd += ["--constraint", f"kind=max_requests,count={max_requests}"]
    for key, value in overrides:
        cmd += ["--override", key, value]
    log(f"{server.mode}: guidellm {name}: {' '.join(cmd)}")
    with open(out / f"guidellm.{server.mode}.{name}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, cwd=out).returncode
    if rc != 0 or not result.exists():
        raise RuntimeError(f"guidellm {name} failed (rc {rc}); see {out}/guidellm.{server.mode}.{name}.log")
    return result


# ---------------------------------------------------------------- disconnect run


PROMPT_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly juggle "
                "bright boxes of frozen pizza near the old harbour on a windy afternoon").split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randrange(80, 110)))  # ~128 tokens


async def _disconnect_run(url: str, clients: int, seconds: float, seed: int) -> dict:
    import httpx

    counts = {"requests": 0, "completed": 0, "disconnected_mid_stream": 0, "disconnected_before_first_token": 0,
              "client_read_timeouts": 0, "admission_503": 0, "other_errors": 0}
    examples: list[str] = []
    deadline = time.monotonic() + seconds
    retry_after: list[float] = []

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            how = rng.choice(["mid_stream", "mid_stream", "before_first", "timeout", "complete", "complete"])
            chunks_before_leaving = rng.randrange(1, 40)
            read_timeout = 0.2 + rng.random() * 2 if how == "timeout" else 600
            body = {"model": MODEL, "messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": 64,
                    "temperature": rng.choice([0.0, 0.7]), "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            counts["requests"] += 1
            # A fresh connection per request: leaving closes the TCP connection, as a client that goes away does.
            async with httpx.AsyncClient(timeout=httpx.Timeout(600, read=read_timeout)) as http:
                try:
                    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                        if resp.status_code == 503:
                            counts["admission_503"] += 1
                            ra = float(resp.headers.get("retry-after", "1"))
                            retry_after.append(ra)
                            await resp.aread()
                            await asyncio.sleep(min(ra, 2.0) * rng.random() + 0.1)
                            continue
                        if resp.status_code != 200:
                            counts["other_errors"] += 1
                            examples.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                            continue
                        if how == "before_first":
                            await asyncio.sleep(rng.random() * 0.5)
                            counts["disconnected_before_first_token"] += 1
                            continue  # leaves before reading anything
                        n, done = 0, False
                        async for line in resp.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                done = True
                                break
                            chunk = json.loads(data)
                            if "error" in chunk:
                                counts["other_errors"] += 1
                                examples.append(f"error chunk: {data[:200]}")
                                break
                            n += 1
                            if how == "mid_stream" and n >= chunks_before_leaving:
                                break
                        if done:
                            counts["completed"] += 1
                        elif how == "mid_stream":
                            counts["disconnected_mid_stream"] += 1
                except httpx.ReadTimeout:
                    if how == "timeout":
                        counts["client_read_timeouts"] += 1
                    else:
                        counts["other_errors"] += 1
                        examples.append("unexpected read timeout")
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    counts["other_errors"] += 1
                    examples.append(f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    counts["wall_s"] = round(time.monotonic() - t0, 1)
    counts["disconnects"] = (counts["disconnected_mid_stream"] + counts["disconnected_before_first_token"]
                             + counts["client_read_timeouts"])
    counts["retry_after_s"] = sorted(set(retry_after))
    counts["error_examples"] = examples[:10]
    return counts


LEAK_CHECK = r"""
import json, sys, time
import ray
from ray import serve
ray.init(address="auto", namespace="serve", _node_ip_address="127.0.0.1", log_to_driver=False)
def ask(deployment, method):
    return getattr(serve.get_deployment_handle(deployment, "tandem"), method).remote().result(timeout_s=60)
t0 = time.monotonic()
while True:
    held = {"router_sessions": ask("Router", "sessions"), "verifier_sessions": ask("VerifierPool", "sessions"),
            "verifier_leases": ask("VerifierPool", "open_leases"), "drafter_sessions": ask("DrafterPool", "sessions"),
            "drafter_leases": ask("DrafterPool", "open_leases")}
    held["seconds_after_clients_stopped"] = round(time.time() - float(sys.argv[1]), 1)
    print(json.dumps(held), flush=True)
    if not any(v for k, v in held.items() if k != "seconds_after_clients_stopped") or time.monotonic() - t0 > 60:
        break
    time.sleep(2)
ray.shutdown()
"""


def leak_check(server: Server, clients_stopped_at: float) -> dict:
    if not server.gcs_address:
        raise RuntimeError("could not find the server's Ray GCS address")
    proc = subprocess.run([sys.executable, "-c", LEAK_CHECK, str(clients_stopped_at)], capture_output=True, text=True,
                          env={**os.environ, **ENV, "RAY_ADDRESS": server.gcs_address,
                               # a new local cluster enables Ray's token auth by default (token in ~/.ray);
                               # a client given an explicit address must be told to send it
                               "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}, cwd=ROOT, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"leak check failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return {"polls": [json.loads(ln) for ln in lines], **json.loads(lines[-1])}


# ---------------------------------------------------------------- summary


def _stat(metric: dict, kind: str, key: str) -> float | None:
    try:
        return metric[kind][key]
    except (KeyError, TypeError):
        return None


def summarize(path: Path) -> list[dict]:
    """One row per guidellm benchmark: the figures BENCHMARKS.md reports."""
    data = json.loads(path.read_text())
    rows = []
    for bench in data["benchmarks"]:
        strategy = bench["config"]["strategy"]
        m = bench["metrics"]
        totals = m["request_totals"]
        errors = _error_counts(bench)
        rows.append({
            "strategy": strategy.get("type_"), "streams": strategy.get("streams") or strategy.get("max_concurrency"),
            "rate": strategy.get("rate"),
            "duration_s": bench.get("duration"),
            "requests_successful": totals.get("successful"), "requests_errored": totals.get("errored"),
            "requests_incomplete": totals.get("incomplete"),
            "errors_503": errors["503"], "errors_other": errors["other"], "error_examples": errors["examples"],
            "requests_per_s": _stat(m["requests_per_second"], "successful", "mean"),
            "output_tokens_per_s": _stat(m["output_tokens_per_second"], "successful", "mean"),
            "ttft_ms_p50": _pct(m["time_to_first_token_ms"], "p50"),
            "ttft_ms_p99": _pct(m["time_to_first_token_ms"], "p99"),
            "itl_ms_p50": _pct(m["inter_token_latency_ms"], "p50"),
            "itl_ms_p99": _pct(m["inter_token_latency_ms"], "p99"),
            "latency_s_p50": _pct(m["request_latency"], "p50"),
        })
    return rows


def _pct(metric: dict, p: str) -> float | None:
    try:
        return metric["successful"]["percentiles"][p]
    except (KeyError, TypeError):
        return None


def _error_counts(bench: dict) -> dict:
    errored = (bench.get("requests") or {}).get("errored") or []
    n503 = other = 0
    examples = []
    for req in errored:
        text = str((req.get("info") or {}).get("error") or "")  # guidellm: repr() of the exception
        if "'503 " in text or "Service Unavailable" in text:
            n503 += 1
        else:
            other += 1
            if len(examples) < 3:
                examples.append(text[:300])
    total = bench["metrics"]["request_totals"].get("errored") or 0
    if errored and total != len(errored):  # the kept requests are a sample: apply their split to the total
        n503 = round(total * n503 / len(errored))
    elif not errored:
        n503 = 0
    return {"503": n503, "other": total - n503, "examples": examples}


def fmt(v, digits=1):
    return "–" if v is None else f"{v:.{digits}f}"


def markdown(spec: list[dict], plain: list[dict], spec_sweep: list[dict] = (), plain_sweep: list[dict] = ()) -> str:
    lines = ["| concurrency | mode | requests/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
             "| ok / errors / 503s |", "|---|---|---|---|---|---|---|"]
    rows = [r for pair in zip(spec, plain) for r in zip(("speculative", "plain"), pair)]
    rows += [("speculative", r) for r in spec_sweep] + [("plain", r) for r in plain_sweep]  # rates differ
    for mode, r in rows:
        label = (r["streams"] if r["strategy"] == "concurrent"
                 else f"{r['strategy']} {fmt(r['rate'], 2) if r['rate'] else ''}".strip())
        ok = bool(r["requests_successful"])  # no completed request: no latency figures
        lines.append(f"| {label} | {mode} | {fmt(r['requests_per_s'], 2)} | {fmt(r['output_tokens_per_s'])} "
                     f"| {fmt(r['ttft_ms_p50'] if ok else None, 0)} / {fmt(r['ttft_ms_p99'] if ok else None, 0)} "
                     f"| {fmt(r['itl_ms_p50'] if ok else None)} / {fmt(r['itl_ms_p99'] if ok else None)} "
                     f"| {r['requests_successful']} / {r['errors_other']} / {r['errors_503']} |")
    lines += ["", "| concurrency | output tok/s speculative ÷ plain | ITL p50 plain ÷ speculative |", "|---|---|---|"]
    for s, p in zip(spec, plain):
        if s["strategy"] != "concurrent":
            continue
        r1 = s["output_tokens_per_s"] / p["output_tokens_per_s"] if s["output_tokens_per_s"] and p["output_tokens_per_s"] else None
        r2 = p["itl_ms_p50"] / s["itl_ms_p50"] if s["itl_ms_p50"] and p["itl_ms_p50"] else None
        lines.append(f"| {s['streams']} | {fmt(r1, 2)}× | {fmt(r2, 2)}× |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/tandem-load", help="results directory")
    ap.add_argument("--levels", default="1,4,16,64", help="concurrent streams, one guidellm benchmark each")
    ap.add_argument("--seconds", default="60,60,90,180",
                    help="max duration of each concurrency level (one value, or one per level): requests still "
                         "running at the end count as incomplete, and at 64 streams the 48 admitted requests "
                         "share two cores, so one lasts about a minute")
    ap.add_argument("--sweep-size", type=int, default=5, help="guidellm sweep levels (0: no sweep)")
    ap.add_argument("--sweep-seconds", default="60")
    ap.add_argument("--disconnect-clients", type=int, default=64)
    ap.add_argument("--disconnect-seconds", type=float, default=120, help="0: no disconnect run")
    ap.add_argument("--modes", default="speculative,plain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=["torch", "vllm"],
                    help="engine.backend of both servers (default: ray_config.yaml's); with vllm, plain is vLLM "
                         "alone and speculative is vLLM with tandem's drafter (use --disconnect-seconds 0: the "
                         "leak check asks the torch pools)")
    args = ap.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ensure_guidellm()
    summary: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
                     "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    for mode in args.modes.split(","):
        server = Server(write_config(out, mode, args.engine), out, mode)
        try:
            server.start()
            import httpx  # one warm-up request: the first one compiles/allocates
            httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
            path = guidellm(server, out, "concurrent", "kind=concurrent,streams=1", args.seconds,
                            overrides=[("profile.streams", args.levels)])
            summary.setdefault(mode, {})["concurrent"] = summarize(path)
            if args.sweep_size:
                path = guidellm(server, out, "sweep", f"kind=sweep,sweep_size={args.sweep_size},max_concurrency=32",
                                args.sweep_seconds)
                summary[mode]["sweep"] = summarize(path)
            if mode == "speculative" and args.disconnect_seconds:
                log(f"disconnect run: {args.disconnect_clients} clients x {args.disconnect_seconds:.0f} s")
                result = asyncio.run(_disconnect_run(server.url, args.disconnect_clients, args.disconnect_seconds,
                                                     args.seed))
                t_stop = time.time()
                log(f"disconnect run: {json.dumps(result)}")
                try:
                    result["leaks"] = leak_check(server, t_stop)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    result["leaks"] = {"error": str(e)[-1500:]}
                log(f"leaks: {json.dumps(result['leaks'])}")
                summary["disconnect"] = result
            summary[mode]["health_after"] = httpx.get(f"{server.url}/health", timeout=10).status_code
        finally:
            server.stop()
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["loadavg_end"] = os.getloadavg()
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if "speculative" in summary and "plain" in summary:
        table = markdown(summary["speculative"]["concurrent"], summary["plain"]["concurrent"],
                         summary["speculative"].get("sweep", []), summary["plain"].get("sweep", []))
        (out / "table.md").write_text(table + "\n")
        print(table)
    if "disconnect" in summary:
        print(json.dumps({k: v for k, v in summary["disconnect"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
