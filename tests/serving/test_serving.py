"""The Serve application on a real local Ray (127.0.0.1): the real `openai` client over HTTP, a gRPC
client through Serve's gRPC proxy, concurrency, bad requests, disconnects, config validation."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.core.errors import ConfigError
from deployments.config import TandemAppConfig
from deployments.serving import DEFAULT_CONFIG, load_config
from protos import pb, rpc
from tests.helpers import (SERVE_PROMPTS, TEST_SERVE_ENV, assert_stop_string, assert_text_options, raylet_pid,
                           stream_and_kill)
from tests.openai_checks import (assert_anthropic_messages, assert_hosting_routes, assert_responses_features,
                                 assert_responses_greedy, assert_responses_tools, assert_tokenizer_routes)
from tests.serving import API_KEY, METADATA, MODEL
from tests.structured_checks import assert_structured_outputs, assert_tool_calls
from tests.test_prompt_logprobs import assert_echo_and_scoring

MAX_TOKENS = 24
PROMPTS = SERVE_PROMPTS


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _ref(references, prompt_ids, i):
    return references[tuple(prompt_ids[i])]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    assert httpx.get(server.http + f"/v1/models/{MODEL}").status_code == 401  # the key is asked here too
    assert httpx.get(server.http + "/health").json() == {"status": "ok"}


def test_completions_greedy_equal_transformers(client, tokenizer, prompt_ids, references):
    for i, (text, chat) in enumerate(PROMPTS):
        if chat:
            continue
        ref = _ref(references, prompt_ids, i)
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ref
        assert choice.text == tokenizer.decode(ref, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(prompt_ids[i]) and r.usage.completion_tokens == len(ref)
        assert r.usage.total_tokens == len(prompt_ids[i]) + len(ref)
        spec = r.model_extra["speculation"]
        assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
        assert spec["mean_accepted_length"] >= 1.0


def test_chat_streaming_equal_transformers(client, tokenizer, prompt_ids, references):
    for i, (text, chat) in enumerate(PROMPTS):
        if not chat:
            continue
        ref = _ref(references, prompt_ids, i)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True})
        pieces, ids, finish, usage = [], [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                ids += choice.model_extra.get("token_ids") or []
                finish = choice.finish_reason or finish
        assert ids == ref
        assert "".join(pieces) == tokenizer.decode(ref, skip_special_tokens=True)
        assert finish == ("stop" if ref[-1] == tokenizer.eos_token_id else "length")
        assert usage.prompt_tokens == len(prompt_ids[i]) and usage.completion_tokens == len(ref)


def test_chat_non_streaming_and_completion_streaming(client, tokenizer, prompt_ids, references):
    ref = _ref(references, prompt_ids, 3)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3][0]}],
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == len(ref)
    ref = _ref(references, prompt_ids, 0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0][0], max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
    assert text == tokenizer.decode(ref, skip_special_tokens=True)


def test_stop_strings(client, tokenizer, prompt_ids, references):
    ref_text = tokenizer.decode(_ref(references, prompt_ids, 0), skip_special_tokens=True)
    assert_stop_string(client, MODEL, PROMPTS[0][0], ref_text, MAX_TOKENS)


def test_text_options(client, tokenizer, prompt_ids, references):
    ref_text = tokenizer.decode(_ref(references, prompt_ids, 0), skip_special_tokens=True)
    assert_text_options(client, MODEL, tokenizer, PROMPTS[0][0], ref_text, MAX_TOKENS)

def test_echo_and_prompt_logprobs(client, tokenizer, target_fp32):
    """`echo` (with `max_tokens: 0`, lm-evaluation-harness's loglikelihood) and `prompt_logprobs`: the
    target's, through the router and the verifier's gRPC port (tests/test_prompt_logprobs.py)."""
    assert_echo_and_scoring(client, MODEL, tokenizer, target_fp32)


def test_structured_outputs(client):
    """JSON schema (the client's `parse` with a pydantic model), choice, regex, JSON mode: each follows its
    grammar, greedy output the same with speculation off (tests/structured_checks.py)."""
    assert_structured_outputs(client, MODEL)


def test_tool_calls(client):
    """Required and named tool choices, streamed deltas, a tool result in the conversation."""
    assert_tool_calls(client, MODEL)


def test_plain_decoding_per_request_equal(client, prompt_ids, references):
    ref = _ref(references, prompt_ids, 1)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1][0], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"num_speculative_tokens": 0, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.model_extra["speculation"]["drafted"] == 0


def test_n_choices(client, tokenizer, prompt_ids, references):
    """n greedy choices are n copies of the reference (each its own session, speculating); n sampled
    choices are independent samples (they differ), streamed and not; usage counts the prompt once."""
    ref = _ref(references, prompt_ids, 1)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1][0], max_tokens=MAX_TOKENS, temperature=0, n=3,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.model_extra["token_ids"] == ref for c in r.choices)
    assert r.usage.prompt_tokens == len(prompt_ids[1]) and r.usage.completion_tokens == 3 * len(ref)
    assert r.model_extra["speculation"]["drafted"] > 0

    def sampled(seed: int, n: int, stream: bool) -> list[str]:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3][0]}],
                                             max_tokens=8, temperature=1.0, seed=seed, n=n, stream=stream,
                                             extra_body={"num_speculative_tokens": 0},
                                             **({"stream_options": {"include_usage": True}} if stream else {}))
        if not stream:
            return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
        texts, usage = [""] * n, None
        for chunk in out:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        assert usage.completion_tokens >= n and usage.prompt_tokens == len(prompt_ids[3])
        return texts

    four = sampled(11, 4, stream=True)
    assert len(set(four)) > 1, four  # independent samples, not one sample four times
    two = sampled(11, 2, stream=False)
    assert len(two) == 2 and len(set(two)) == 2 and all(two), two


def test_a_batch_of_prompts(client, tokenizer, prompt_ids, references):
    """Completions with several prompts (strings or token-id lists, as vLLM serves them and lm-evaluation-harness
    sends them with batch_size > 1): choice p * n + j is prompt p's choice j, each the reference's greedy text;
    usage counts each prompt once; streamed the same; `echo` puts each choice's own prompt first; a batch of
    prompts x n over the server's bound is a 400."""
    tokens = 8  # the references' first 8 (greedy: a prefix of the longer run)
    refs = [_ref(references, prompt_ids, i)[:tokens] for i in (0, 2)]
    texts = [tokenizer.decode(ref, skip_special_tokens=True) for ref in refs]
    r = client.completions.create(model=MODEL, prompt=[PROMPTS[0][0], PROMPTS[2][0]], max_tokens=tokens,
                                  temperature=0, n=2, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in r.choices] == [refs[0], refs[0], refs[1], refs[1]]
    assert r.usage.prompt_tokens == len(prompt_ids[0]) + len(prompt_ids[2])
    assert r.usage.completion_tokens == 2 * (len(refs[0]) + len(refs[1]))
    streamed = [""] * 2
    for chunk in client.completions.create(model=MODEL, prompt=[prompt_ids[0], prompt_ids[2]], max_tokens=tokens,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    r = client.completions.create(model=MODEL, prompt=[PROMPTS[0][0], PROMPTS[2][0]], max_tokens=4, temperature=0,
                                  echo=True)
    assert [c.text for c in r.choices] == [PROMPTS[i][0] + tokenizer.decode(
        _ref(references, prompt_ids, i)[:4], skip_special_tokens=True) for i in (0, 2)]
    with pytest.raises(openai.BadRequestError, match="sessions per request"):
        client.completions.create(model=MODEL, prompt=["a"] * 9, n=8, max_tokens=1)


def test_sixteen_concurrent_streams(client, tokenizer, prompt_ids, references):
    def one(i: int) -> tuple[int, str]:
        j = i % len(PROMPTS)
        text, chat = PROMPTS[j]
        kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        if chat:
            stream = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kwargs)
            return j, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stream = client.completions.create(prompt=text, **kwargs)
        return j, "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for j, text in results:
        assert text == tokenizer.decode(_ref(references, prompt_ids, j), skip_special_tokens=True)


BAD_REQUESTS = [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe{\"model\": 1}", 400, "UTF-8"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": "hi"}).encode(), 400, "model"),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 100000}).encode(), 400, "context length"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 17}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 21}).encode(), 400, "logprobs"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"model": MODEL, "prompt": "hi " * 9000}).encode(), 400, "context length"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "empty"),
    (json.dumps({"model": MODEL, "prompt": [10**9]}).encode(), 400, "token ids"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "does not exist"),
]


@pytest.mark.parametrize("body,status,needle", BAD_REQUESTS, ids=[f"bad{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_http_requests_get_4xx(server, body, status, needle):
    r = httpx.post(server.http + "/v1/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_bad_chat_requests_and_auth(server, client):
    url = server.http + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url, json={"model": MODEL, "messages": []}, headers=auth)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, headers=auth)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-0.5)
    # and the server still serves
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_grpc_generate_health_reflection(server, tokenizer, prompt_ids, references):
    channel = grpc.insecure_channel(server.grpc)
    stub = rpc.GenerationStub(channel)
    for i in (0, 3):
        text, chat = PROMPTS[i]
        request = pb.GenerateRequest(model=MODEL, params=pb.SamplingParams(max_tokens=MAX_TOKENS))
        if chat:
            request.messages.messages.add(role="user", content=text)
        else:
            request.prompt = text
        responses = list(stub.Generate(request, metadata=METADATA, timeout=300))
        ref = _ref(references, prompt_ids, i)
        assert [t for r in responses for t in r.token_ids] == ref
        assert "".join(r.text for r in responses) == tokenizer.decode(ref, skip_special_tokens=True)
        assert responses[-1].finish_reason in ("stop", "length") and responses[-1].completion_tokens == len(ref)
        assert responses[-1].stats.drafted > 0
    # the app's api_keys gate Generate as they gate HTTP: a missing or wrong key is UNAUTHENTICATED; the key goes in
    # `authorization: Bearer KEY` (as sent above) or `x-api-key`; the health check is open, as /health is
    small = pb.GenerateRequest(model=MODEL, prompt=PROMPTS[0][0], params=pb.SamplingParams(max_tokens=2))
    for metadata in (METADATA[:1], (METADATA[0], ("authorization", "Bearer wrong")), (METADATA[0], ("x-api-key", ""))):
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(small, metadata=metadata, timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert "API key" in refused.value.details()
    replies = list(stub.Generate(small, metadata=(METADATA[0], ("x-api-key", API_KEY)), timeout=60))
    assert [t for r in replies for t in r.token_ids] == _ref(references, prompt_ids, 0)[:2]
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=METADATA[:1],
                                                       timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=30))
    services = {s.name for s in answer.list_services_response.service}
    assert "tandem.v1.Generation" in services and "grpc.health.v1.Health" in services
    # what grpcurl needs to call Generate without the .proto: the file that defines it
    files = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="tandem.v1.Generation")]), timeout=30)).file_descriptor_response.file_descriptor_proto
    from google.protobuf import descriptor_pb2

    names = set()
    for blob in files:
        fd = descriptor_pb2.FileDescriptorProto.FromString(blob)
        names |= {f"{fd.package}.{m.name}" for m in fd.message_type}
    assert {"tandem.v1.GenerateRequest", "tandem.v1.GenerateResponse"} <= names


def test_grpc_bad_requests_invalid_argument(server):
    stub = rpc.GenerationStub(grpc.insecure_channel(server.grpc))
    bad = [pb.GenerateRequest(model=MODEL, prompt=""),
           pb.GenerateRequest(model=MODEL, prompt="hi", params=pb.SamplingParams(temperature=-1)),
           pb.GenerateRequest(model=MODEL, prompt="hi", params=pb.SamplingParams(max_tokens=100000)),
           pb.GenerateRequest(model="other", prompt="hi")]
    for request in bad:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=METADATA, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    ok = list(stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", params=pb.SamplingParams(max_tokens=2)),
                            metadata=METADATA, timeout=60))
    assert sum(len(r.token_ids) for r in ok) == 2


def _verifier_sessions() -> int:
    from ray import serve

    return serve.get_deployment_handle("VerifierPool", "tandem").sessions.remote().result()


COUNT = "Count from one to a thousand: one, two,"
_TOOL = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": COUNT, "max_tokens": 2000}),
    ("/v1/responses", {"input": COUNT, "max_output_tokens": 2000}),
    ("/v1/responses", {"input": COUNT, "max_output_tokens": 2000, "tools": _TOOL}),  # output held until the end
    ("/v1/messages", {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 2000}),
], ids=["completions", "responses", "responses-with-tools", "anthropic-messages"])
def test_client_disconnect_frees_the_session(server, path, body):
    body = {"model": MODEL, "temperature": 0, "stream": True, "ignore_eos": True, **body}
    with httpx.stream("POST", server.http + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        deadline = time.time() + 30
        while _verifier_sessions() != 1 and time.time() < deadline:  # the session opens as the stream starts
            time.sleep(0.1)
        assert _verifier_sessions() == 1
    deadline = time.time() + 60
    while _verifier_sessions() and time.time() < deadline:
        time.sleep(0.5)
    assert _verifier_sessions() == 0


def _named_actor(prefix: str):
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["name"].startswith(prefix):
            return ray.get_actor(info["name"], namespace=info["namespace"])
    raise AssertionError(f"no actor named {prefix}*")


def test_tensor_parallel_verifier_replica_through_serve(server, prompt_ids, references):
    """A second application whose verifier replicas are TP = 3 (one STRICT_PACK group of 3 bundles:
    rank 0 in the Serve replica, ranks 1-2 as actors in its group): same greedy tokens. Plain decoding
    (no drafter deployment to start): speculation against TP ranks is tests/test_distributed.py's."""
    from ray import serve
    from ray.util import placement_group_table

    from deployments.builder import build_app

    # its replica checked each 2 s: one whose follower died fails three checks in a row before Serve replaces it
    serve.run(build_app({"engine": {"dtype": "float32", "threads": 1, "proposer": "none"}, "tensor_parallel_size": 3,
                         "verifier": TandemAppConfig().verifier.model_copy(update={
                             "health_check_period_s": 2, "graceful_shutdown_wait_loop_s": 0.2}).model_dump(mode="json")}),
              name="tp", route_prefix="/tp")
    try:
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert any(g["strategy"] == "STRICT_PACK" and len(g["bundles"]) == 3 for g in groups), groups
        # a follower rank dies mid-stream: rank 0's collectives fail, the replica refuses new sessions and
        # fails its health check, Serve replaces it (followers and all), the session is replayed onto it.
        # The tokens before the kill came from the first group, the rest from its replacement: all equal
        # the reference's first 12 (greedy: a prefix of the 24-token reference; 12 keep a TP-3 group on
        # two cores short)
        killed_name = next(i["name"] for i in ray.util.list_named_actors(all_namespaces=True)
                           if i["name"].startswith("tandem-follower-tp-") and i["name"].endswith("rank2"))
        follower = _named_actor(killed_name)
        tp = openai.OpenAI(base_url=server.http + "/tp/v1", api_key=API_KEY, max_retries=0, timeout=300)
        ids = stream_and_kill(tp, MODEL, PROMPTS[1][0], 12, lambda: ray.kill(follower, no_restart=True))
        assert len(ids) == 12 and ids == _ref(references, prompt_ids, 1)[:12]
        names = {i["name"] for i in ray.util.list_named_actors(all_namespaces=True)}
        assert killed_name not in names
        assert any(n.startswith("tandem-follower-tp-") and n.endswith("rank2") for n in names), "not replaced"
    finally:
        serve.delete("tp")


def test_invalid_config_names_the_field(tmp_path):
    text = DEFAULT_CONFIG.read_text()
    cases = [("pipeline_depth: 1", "pipeline_depth: 0", "pipeline_depth"),
             ("num_speculative_tokens: 3", "num_speculative_tokens: many", "engine.num_speculative_tokens"),
             ("dtype: bfloat16", "dtype: int4", "engine.dtype"),
             ("target_ongoing_requests: 8}", "target_ongoing_requests: 8, max_replica: 2}", "max_replica"),
             ("default_max_tokens: 256", "default_max_tokens: 256\n      colour: blue", "colour")]
    for old, new, field in cases:
        assert old in text
        path = tmp_path / "bad.yaml"
        path.write_text(text.replace(old, new, 1))
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(path)
    path.write_text("applications: [{name: x, import_path: 5}]")
    with pytest.raises(ConfigError, match="import_path"):
        load_config(path)
    load_config(DEFAULT_CONFIG)  # the shipped one is valid


def test_prometheus_metrics_exported(server, client):
    """Ray's metrics agent exports tandem's metrics (after the requests above) in Prometheus format, and the API
    port's `/metrics` passes the agent's answer on."""
    client.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=8, temperature=0)
    node = ray._private.worker.global_worker.node
    url = f"http://127.0.0.1:{node.metrics_export_port}/metrics"
    wanted = ["ray_tandem_requests_total", "ray_tandem_generated_tokens_total", "ray_tandem_drafted_tokens_total",
              "ray_tandem_accepted_tokens_per_position_total", "ray_tandem_time_to_first_token_s_bucket",
              "ray_tandem_gamma_chosen_total"]
    deadline, text = time.time() + 90, ""
    while time.time() < deadline:
        text = httpx.get(url, timeout=10).text
        if all(name in text for name in wanted):
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, f"not exported: {missing}"
    generated = [line for line in text.splitlines() if line.startswith("ray_tandem_generated_tokens_total{")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= MAX_TOKENS
    served = httpx.get(server.http + "/metrics", timeout=30)  # the API port's route (vLLM's), no key asked as in vLLM
    assert served.status_code == 200 and served.headers["content-type"].startswith("text/plain")
    assert all(name in served.text for name in wanted)


def _target_logprobs(model, prompt: list[int], output: list[int]):
    """transformers' fp32 log-softmax at each output token's position  # [len(output), vocab_size]"""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)], dim=-1)


def test_logprobs_chat_and_completions_streamed_and_not(client, tokenizer, target_fp32, prompt_ids, references):
    """The target's raw logprobs (within 1e-4 of transformers') and top tokens in OpenAI's shapes; a stream
    carries the same ones, each with the chunk that carries its text; the tokens are the reference's."""
    import torch

    ref = _ref(references, prompt_ids, 3)
    expected = _target_logprobs(target_fp32, prompt_ids[3], ref)
    top = torch.topk(expected, 3, dim=-1)
    messages = [{"role": "user", "content": PROMPTS[3][0]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref and r.model_extra["speculation"]["drafted"] > 0
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref]
    for j, c in enumerate(content):
        assert abs(c.logprob - expected[j, ref[j]].item()) < 1e-4 and c.bytes == list(c.token.encode())
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([i]) for i in top.indices[j].tolist()]
        assert max(abs(t.logprob - v) for t, v in zip(c.top_logprobs, top.values[j].tolist())) < 1e-4
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = []
    for chunk in stream:
        for choice in chunk.choices:
            entries = choice.logprobs.content if choice.logprobs is not None else []
            streamed += entries
            text = "".join(e.token for e in entries if e.token != tokenizer.eos_token)
            assert text == (choice.delta.content or ""), "a chunk carries the logprobs of the text it carries"
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]

    ref = _ref(references, prompt_ids, 0)
    expected = _target_logprobs(target_fp32, prompt_ids[0], ref)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref] and lp.text_offset[0] == 0
    assert max(abs(a - expected[j, t].item()) for j, (a, t) in enumerate(zip(lp.token_logprobs, ref))) < 1e-4
    for j, entry in enumerate(lp.top_logprobs):  # the token and the 2 most likely
        assert lp.tokens[j] in entry and 2 <= len(entry) <= 3
        assert set(entry) >= {tokenizer.decode([i]) for i in torch.topk(expected[j], 2).indices.tolist()}
    chunks = [c for c in client.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=MAX_TOKENS,
                                                   temperature=0, logprobs=2, stream=True) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_logprobs_with_n_a_stop_string_and_grpc(server, client, tokenizer, prompt_ids, references):
    """Sampled n=2: each choice's logprobs are those of its own tokens, none when not asked; a stop string keeps
    those of the tokens kept; gRPC answers them with its token ids. That asking for logprobs changes no sampled
    token is `tests/test_logprobs.py::test_sampled_tokens_unchanged_by_logprobs` (in process): through the server
    two seeded sampled requests need not agree, since which positions are drafted (a late draft becomes a plain
    step) depends on timing, and a drafted position's token comes from the rejection test, not from a plain draw."""
    messages = [{"role": "user", "content": PROMPTS[4][0]}]
    common = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=5, n=2)
    asked = client.chat.completions.create(**common, logprobs=True, extra_body={"return_token_ids": True})
    plain = client.chat.completions.create(**common, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in asked.choices) == sorted(c.index for c in plain.choices) == [0, 1]
    assert all(p.logprobs is None and 1 <= len(p.model_extra["token_ids"]) <= 12 for p in plain.choices)
    for a in asked.choices:
        ids = a.model_extra["token_ids"]
        assert 1 <= len(ids) <= 12
        assert [c.token for c in a.logprobs.content] == [tokenizer.decode([t]) for t in ids]
        assert all(c.top_logprobs == [] and c.logprob <= 0 for c in a.logprobs.content)
    ref_text = tokenizer.decode(_ref(references, prompt_ids, 0), skip_special_tokens=True)
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=MAX_TOKENS, temperature=0,
                                      stop=["recursive"], logprobs=0, stream=stream,
                                      extra_body={"return_token_ids": True})
        choices = [c.choices[0] for c in r if c.choices] if stream else r.choices
        ids = [t for c in choices for t in c.model_extra.get("token_ids") or []]
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        assert "".join(c.text for c in choices) == ref_text[: ref_text.index("recursive")]
        assert tokens == [tokenizer.decode([t]) for t in ids] and len(ids) < MAX_TOKENS
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPTS[0][0], params=pb.SamplingParams(max_tokens=8, logprobs=2))
    responses = list(rpc.GenerationStub(grpc.insecure_channel(server.grpc)).Generate(request, metadata=METADATA,
                                                                                     timeout=300))
    for response in responses:
        assert [t.token_id for t in response.logprobs] == list(response.token_ids)
        assert all(len(t.top_ids) == 2 and t.top_ids[0] == t.token_id for t in response.logprobs)
    assert sum(len(r.token_ids) for r in responses) == 8


def test_the_ingress_replica_answers_at_its_own_port(server, prompt_ids, references):
    """Serve's direct ingress on one machine: the torch path's `Ingress` replica answers the same API at its own
    loopback port (the key checked, the target's greedy tokens), and `tandem serve` has the address to print."""
    [direct] = server.direct["tandem"]
    assert direct.startswith("http://127.0.0.1:") and direct != server.http
    body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 4}
    assert httpx.post(direct + "/v1/completions", json=body, timeout=60).status_code == 401
    i = next(i for i, (_, chat) in enumerate(PROMPTS) if not chat)
    r = httpx.post(direct + "/v1/completions", timeout=300, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": PROMPTS[i][0], "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _ref(references, prompt_ids, i)


def _environ(pid: int, names) -> dict[str, str]:
    """The values of `names` in process `pid`'s environment ("" where unset)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return {k: env.get(k.encode(), b"").decode() for k in names}


def test_serve_processes_run_with_the_shipped_serve_settings(server):
    """`SERVE_THROUGHPUT_ENV` (the throughput mode, the controller's 1 s loop) is in the environment of the
    processes that read it: Serve's controller, its proxy and the replicas of this application; a value the
    operator set first is kept (the tests' applications set the controller's loop: `TEST_SERVE_ENV`). With them,
    gRPC's fork handlers off (`cluster.GRPC_FORK_ENV`): these processes import grpcio (Serve's) before tandem's
    modules."""
    from ray._private.state import actors

    from cluster import GRPC_FORK_ENV
    from cluster.ray.runtime import LOCAL_SERVE_ENV, serve_environment

    assert serve_environment(local=True) == LOCAL_SERVE_ENV  # this process: nothing set, the shipped values
    assert all(LOCAL_SERVE_ENV[k] != v for k, v in TEST_SERVE_ENV.items())
    # on one machine: direct ingress on
    SERVE_THROUGHPUT_ENV = {**LOCAL_SERVE_ENV, **TEST_SERVE_ENV, **GRPC_FORK_ENV}

    serve_actors = [a for a in actors(actor_state_name="ALIVE").values()
                    if a["ActorClassName"] in ("ServeController", "ProxyActor")
                    or a["ActorClassName"].startswith("ServeReplica:tandem:")]
    kinds = {a["ActorClassName"].split(":")[0] for a in serve_actors}
    assert kinds == {"ServeController", "ProxyActor", "ServeReplica"}, kinds
    for actor in serve_actors:
        seen = _environ(actor["Pid"], SERVE_THROUGHPUT_ENV)
        assert seen == SERVE_THROUGHPUT_ENV, (actor["ActorClassName"], seen)


def test_a_ray_on_one_machine_keeps_no_idle_workers_waiting(server):
    """`LOCAL_RAY_ENV`: the raylet of a Ray on this machine alone prestarts no Python workers, so no `ray::IDLE`
    process waits beside the server's actors (each polled ~0.6% of a core on a 2-core machine)."""
    from cluster.ray.runtime import LOCAL_RAY_ENV
    from cluster.vllm import reaper

    raylet = raylet_pid()
    assert _environ(raylet, LOCAL_RAY_ENV) == LOCAL_RAY_ENV
    workers = reaper.children_of(raylet)
    titles = [open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode() for pid in workers]
    assert any(t.startswith("ray::ServeReplica") for t in titles), titles  # the raylet's workers, found
    assert not [t for t in titles if t.startswith("ray::IDLE")], titles


def test_responses_api_greedy_streamed_and_refusals(server, client, tokenizer, prompt_ids, references):
    """/v1/responses (OpenAI's Responses API) through the real client: the chat prompts' greedy text
    (transformers'), as one response, as its event stream and through the client's stream helper; its
    features and refusals (tests/openai_checks.py)."""
    assert_responses_greedy(client, tokenizer, PROMPTS[4][0], prompt_ids[4], _ref(references, prompt_ids, 4),
                            MAX_TOKENS)
    assert_responses_features(client, server.http, API_KEY)
    assert_responses_tools(client)


def test_tokenizer_routes(server, tokenizer, prompt_ids):
    """vLLM's /tokenize (a prompt, or a conversation: the chat route's prompt ids), /detokenize, /version."""
    assert_tokenizer_routes(server.http, API_KEY, tokenizer, PROMPTS[0][0], PROMPTS[3][0], prompt_ids[3])


def test_hosting_routes(server):
    """vLLM's /ping and SageMaker's /invocations (tests/openai_checks.py)."""
    assert_hosting_routes(server.http, API_KEY, PROMPTS[3][0], PROMPTS[0][0], 8)


def test_anthropic_messages(server):
    """Anthropic's Messages API through the `anthropic` client: chat completions' greedy text (tests/openai_checks.py)."""
    assert_anthropic_messages(server.http, API_KEY, PROMPTS[4][0], MAX_TOKENS)


def test_chat_template_options(server, client, tokenizer):
    """vLLM's chat template options: `continue_final_message` (the assistant's answer prefix continued) with
    `add_generation_prompt: false` is the same prompt and greedy text as completions on the template's own ids;
    /tokenize builds the same ids; `chat_template_kwargs` reach the template (SmolLM2's ignores
    `enable_thinking`); both options true, a template argument in the kwargs, or a request's own template: 400."""
    messages = [{"role": "user", "content": PROMPTS[3][0]},
                {"role": "assistant", "content": "The capital of France is"}]
    ids = list(tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False))
    assert ids[-3:] != tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[-3:]  # left open
    options = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True,
               "chat_template_kwargs": {"enable_thinking": False}}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body=options)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == plain.choices[0].text
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokenized = httpx.post(server.http + "/tokenize", headers=headers, timeout=60, json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": False}).json()
    assert tokenized["tokens"] == ids
    for fields, needle in [({"continue_final_message": True}, "add_generation_prompt: false"),
                           ({"chat_template_kwargs": {"tokenize": False}}, "tokenize"),
                           ({"chat_template": "{{ messages }}"}, "not supported")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=fields)
