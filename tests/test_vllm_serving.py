"""Serving on vLLM (`engine.backend: vllm`): the same OpenAI HTTP and gRPC APIs, with the target on
vLLM verifier replicas (Ray Serve LLM's LLMServer) and tandem's drafter proposing through vLLM's
custom proposer. Greedy output equals transformers' fp32 greedy; bad input gets the torch path's 4xx;
drafter sessions are registered and released by the front door; a killed drafter costs speed, not
tokens; the proposer's counters reach Prometheus.

Runs when vLLM is importable (CI installs it); one application for the module (~50 s to start).
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import openai
import pytest
import ray

pytest.importorskip("vllm")  # the only skip: this module needs vLLM installed

from cluster.core.config import EngineConfig  # noqa: E402
from cluster.core.errors import ConfigError  # noqa: E402
from cluster.core.messages import SyncOp  # noqa: E402
from cluster.vllm.client import make_client  # noqa: E402
from cluster.vllm.engine import drafter_spec  # noqa: E402
from cluster.vllm.protocol import DrafterSpec, ProposerImport, RequestKey, salt_group  # noqa: E402
from deployments.config import TandemAppConfig  # noqa: E402
from protos import pb, rpc  # noqa: E402
from tests.helpers import (SERVE_PROMPTS, assert_stop_string, assert_text_options, serve_app,  # noqa: E402
                           stream_and_kill)
from tests.openai_checks import (assert_anthropic_messages, assert_hosting_routes,  # noqa: E402
                                 assert_responses_features, assert_responses_greedy, assert_responses_tools,
                                 assert_tokenizer_routes)
from tests.structured_checks import assert_structured_outputs, assert_tool_calls  # noqa: E402
from tests.test_bad_input import GRPC_CASES, HTTP_CASES, _assert_openai_error, _generate  # noqa: E402
from tests.test_prompt_logprobs import assert_echo_and_scoring  # noqa: E402
from tests.vllm_doubles import replay_spec  # noqa: E402
from tests.vllm_field_checks import (assert_cache_salt, assert_prediction, assert_responses_extensions,  # noqa: E402
                                     assert_truncation)

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key"
MAX_TOKENS = 24
PROMPTS = SERVE_PROMPTS
METADATA = (("application", "tandem"), ("authorization", f"Bearer {API_KEY}"))  # the app has api_keys
VERIFIER = f"Verifier:{MODEL}"
_INT8 = drafter_spec(EngineConfig(dtype="float32"))  # the in-worker int8 drafter of tests/test_vllm.py


@pytest.fixture(scope="module")
def server():
    # the hybrid: long matches of a request's own suffix drafted inside vLLM's step, the rest by the int8 drafter
    with serve_app(engine={"backend": "vllm", "dtype": "float32", "proposer": "hybrid", "draft": "int8",
                           "num_speculative_tokens": 3, "threads": 1},
                   api_keys=[API_KEY], vllm={"kv_cache_space_gib": 1, "wait_s": 0.5, "compile": False}) as endpoints:
        yield endpoints


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _verifier():
    from ray import serve

    return serve.get_deployment_handle(VERIFIER, "tandem")


def _ref(references, prompt_ids, i):
    return references[tuple(prompt_ids[i])]


def test_request_ids_carry_the_per_request_cap():
    def request_cap(key):
        return RequestKey.parse(key).cap

    assert str(RequestKey("tandem-ab12", None)) == "tandem-ab12" and request_cap("tandem-ab12") is None
    assert request_cap(str(RequestKey("tandem-ab12", 0))) == 0 and request_cap(str(RequestKey("s~kx", 2))) == 2
    assert request_cap("~k3") is None  # no session before the cap
    # typed: a round trip; vLLM's internal id is the front door's id plus "-" and 8 characters
    assert RequestKey.parse(str(RequestKey("tandem-ab12", 3))) == RequestKey("tandem-ab12", 3)
    assert RequestKey.parse("tandem-ab12") == RequestKey("tandem-ab12")
    assert RequestKey.parse("s~k") == RequestKey("s~k") and RequestKey.parse("s~k-1").cap is None
    assert RequestKey.parse("a~k1~k2") == RequestKey("a~k1", 2)
    with pytest.raises(ValueError):
        RequestKey("s", -1)
    assert RequestKey.from_vllm("tandem-ab12~k0-1a2b3c4d") == "tandem-ab12~k0"
    assert RequestKey.from_vllm("short") == "short" and RequestKey.from_vllm("-1a2b3c4d") == "-1a2b3c4d"
    # a salted request's group (a digest of its cache salt, never the salt) before the cap; both read back
    group = salt_group("tenant-a")
    assert group == salt_group("tenant-a") != salt_group("tenant-b") and len(group) == 16 and salt_group(None) is None
    key = RequestKey("tandem-ab12", 2, group)
    assert str(key) == f"tandem-ab12~g{group}~k2" and "tenant" not in str(key)
    assert RequestKey.parse(str(key)) == key and RequestKey.parse(RequestKey.from_vllm(f"{key}-1a2b3c4d")) == key
    assert RequestKey.parse(str(RequestKey("s", None, group))) == RequestKey("s", None, group)
    assert RequestKey.parse("s~gnothex") == RequestKey("s~gnothex") and RequestKey.parse(f"~g{group}").group is None
    with pytest.raises(ValueError):
        RequestKey("s", None, "tenant-a")


def test_drafter_spec_names_one_drafter_and_keeps_it_across_tuning():
    assert not DrafterSpec().has_drafter and _INT8.has_drafter and _INT8.engine.threads is None
    with pytest.raises(ValueError, match="at most one source"):
        DrafterSpec(engine=_INT8.engine, proposer_import=ProposerImport(path="tests.vllm_doubles:replay"))
    with pytest.raises(ValueError):
        _INT8.tuned(on_miss="later")
    tuned = _INT8.tuned(overlap=False, wait_s=1.0, max_k=2, on_miss="wait", wait_first=False)
    assert tuned.drafter_part() == _INT8.drafter_part() and tuned != _INT8
    assert _INT8.tuned(label="sync").drafter_part() != _INT8.drafter_part()
    assert DrafterSpec.model_validate(tuned.wire()) == tuned  # what collective_rpc carries
    json.dumps(tuned.wire())


def test_local_client_keeps_each_sessions_order_and_batches():
    """The in-worker drafting thread: start before propose, a rollback before the draft it precedes,
    release before later calls; proposes of several sessions queued together are one batch."""
    refs = [[[1, 2], [3, 4, 5, 6]], [[7], [8, 9]]]
    client = make_client(replay_spec(refs, False, 100))
    try:
        assert client.name == "always-right"
        assert client.start_and_propose("a", [1, 2], 2).result(5) == [3, 4]
        assert client.propose("a", 2).result(5) == [5, 6]
        assert client.resume("a", 3, [1, 2, 3, 4], 1).result(5) == [5]  # rolled back to 3 tokens, then 4
        b = client.start_and_propose("b", [7], 2)
        assert b.result(5) == [8, 9]
        client.release("a")
        with pytest.raises(Exception, match="unknown session"):
            client.propose("a", 1).result(5)
        client.start_and_propose("c", [1, 2], 1).result(5)
        batches, entered, gate = [], threading.Event(), threading.Event()
        inner = client.proposer.propose_batch

        def propose_batch(requests):
            batches.append(dict(requests))
            if "b" in requests:  # hold the drafting thread while c and d queue up
                entered.set()
                gate.wait(5)
            return inner(requests)

        client.proposer.propose_batch = propose_batch
        first = client.propose("b", 1)
        assert entered.wait(5)
        c, d = client.propose("c", 1), client.propose("b", 1, [SyncOp(length=2, token_ids=[])])
        gate.set()
        assert first.result(5) == [] and c.result(5) == [4] and d.result(5) == [9]
        assert batches == [{"b": 1}, {"c": 1, "b": 1}]  # queued together: one batch
    finally:
        client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.propose("b", 1).result(5)


def test_replicas_compile_the_model_unless_told_not_to():
    """vLLM's own default (torch.compile) for served replicas: eager measured 1.5x slower a token here."""
    from deployments.vllm_serving import llm_config

    engine = {"backend": "vllm", "proposer": "ngram"}
    served = llm_config(TandemAppConfig.build({"engine": engine})).engine_kwargs
    eager = llm_config(TandemAppConfig.build({"engine": engine, "vllm": {"compile": False}})).engine_kwargs
    assert served["enforce_eager"] is False and eager["enforce_eager"] is True
    assert served["speculative_config"]["method"] == "custom_class"
    assert "num_speculative_tokens_per_batch_size" not in served["speculative_config"]


def test_gamma_by_batch_size_reaches_vllm_and_a_bad_schedule_is_refused():
    """`vllm.speculative_schedule`: γ by batch size, in vLLM's speculative config of either method; with tandem's
    matches in vLLM's EAGLE-3 proposer (`eagle3_matches`, the default) the proposer applies it to EAGLE-3's own drafts
    (`cluster.vllm.eagle_matches.gamma_for`), vLLM drafts per row (no padded batch, synchronous scheduling)."""
    from cluster.vllm.eagle_matches import gamma_for
    from deployments.vllm_serving import llm_config

    schedule = [[5, 8, 1], [1, 2, 3], [3, 4, 2], [9, 9, 0]]
    bare = {"backend": "vllm", "proposer": "eagle3", "eagle3_matches": False}
    for engine in ({"backend": "vllm", "proposer": "suffix"}, bare):
        config = TandemAppConfig.build({"engine": engine, "vllm": {"speculative_schedule": schedule}})
        spec = llm_config(config).engine_kwargs["speculative_config"]
        assert spec["num_speculative_tokens_per_batch_size"] == sorted(schedule), engine
    # 'auto' (the default): the measured schedule for vLLM's eagle3 method, none for tandem's proposer; null: none
    from deployments.config import EAGLE3_SCHEDULE

    for engine, expected in ((bare, [list(r) for r in EAGLE3_SCHEDULE]), ({"backend": "vllm", "proposer": "suffix"}, None)):
        for vllm, want in (({}, expected), ({"speculative_schedule": None}, None)):
            config = TandemAppConfig.build({"engine": engine, "vllm": vllm})
            spec = llm_config(config).engine_kwargs["speculative_config"]
            assert spec.get("num_speculative_tokens_per_batch_size") == want, (engine, vllm)
    config = TandemAppConfig.build({"engine": {"backend": "vllm", "proposer": "eagle3"}})
    kwargs = llm_config(config).engine_kwargs
    spec = kwargs["speculative_config"]
    assert "num_speculative_tokens_per_batch_size" not in spec and spec["disable_padded_drafter_batch"], spec
    assert spec["num_speculative_tokens"] == config.engine.suffix_tokens and kwargs["async_scheduling"] is False
    auto = config.vllm.schedule_for("eagle3")
    assert [gamma_for(auto, 3, rows) for rows in (1, 2, 3, 4, 5, 8, 9, 64)] == [3, 3, 2, 2, 1, 1, 0, 0]
    assert gamma_for(None, 3, 64) == 3 and gamma_for(auto, 1, 1) == 1  # never above the engine's γ
    for bad in ([[2, 4, 1]], [[1, 2, 3], [4, 5, 1]], [[1, 2, -1]], [[1, 0, 2]], "sometimes"):
        with pytest.raises(ConfigError, match="speculative_schedule"):
            TandemAppConfig.build({"engine": {"backend": "vllm"}, "vllm": {"speculative_schedule": bad}})


def test_direct_ingress_admits_to_its_bound_and_closes_what_it_opened():
    """A replica that is its own ingress: `resumable_stream` calls the replica's sessions in process; past the
    bound a request is refused as "overloaded" (HTTP 503, as the ingress deployment's handle refuses it), and a
    stream the caller stops reading is closed (the session's cleanup runs: vLLM aborts the request)."""
    import asyncio

    from cluster.core.sampling import SamplingParams
    from deployments.chunks import ErrorChunk, TokensChunk
    from deployments.failover import resumable_stream
    from deployments.vllm_app import _OwnSessions

    class Replica:  # a test double of the replica: its session count and its sessions' chunks
        open_sessions, closed = 0, []

        async def generate(self, prompt_ids, sampling, gamma=None, resume=None):
            try:
                for t in range(5):
                    yield TokensChunk([t], str(t), {})
            finally:
                self.closed.append(True)

    async def run(replica, limit, take):
        chunks = []
        async for chunk in resumable_stream(_OwnSessions(replica, limit), [1, 2], SamplingParams.build(max_tokens=5),
                                            None, max_resumes=3, resume_delay_s=0.0):
            chunks.append(chunk)
            if len(chunks) == take:
                break
        await asyncio.sleep(0)  # the close scheduled by the stream's cancel runs
        return chunks

    replica = Replica()
    assert [c.token_ids for c in asyncio.run(run(replica, 1, 5))] == [[t] for t in range(5)] and replica.closed
    replica.closed.clear()
    assert len(asyncio.run(run(replica, 1, 2))) == 2 and replica.closed  # the caller went away
    replica.open_sessions = 1
    refused = asyncio.run(run(replica, 1, 5))
    assert len(refused) == 1 and isinstance(refused[0], ErrorChunk) and refused[0].type == "overloaded"


def test_feature_draft_refused_for_vllm():
    with pytest.raises(ConfigError, match="feature-fed draft"):
        TandemAppConfig.build({"engine": {"backend": "vllm", "draft": "feature"}})


def test_greedy_equals_transformers_with_speculation_figures(client, tokenizer, prompt_ids, references):
    for i, (text, chat) in enumerate(PROMPTS):
        ref = _ref(references, prompt_ids, i)
        if chat:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                    max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                    stream_options={"include_usage": True},
                                                    extra_body={"return_token_ids": True})
            ids, pieces, usage = [], [], None
            for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    ids += choice.model_extra.get("token_ids") or []
                    pieces.append(choice.delta.content or "")
            assert ids == ref, (text, ids, ref)
            assert "".join(pieces) == tokenizer.decode(ref, skip_special_tokens=True)
            assert usage.completion_tokens == len(ref) and usage.prompt_tokens == len(prompt_ids[i])
        else:
            r = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == ref, text
            assert r.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
            spec = r.model_extra["speculation"]  # vLLM's per-request figures for tandem's drafts
            assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    stats = _verifier().proposer_stats.remote().result()
    assert stats["drafter"] == "ray" and stats["hits"] > 0 and stats.get("drafter_failures", 0) == 0
    print("proposer stats", stats)


def test_per_request_plain_decoding_and_cap(client, prompt_ids, references):
    """`num_speculative_tokens` per request: 0 is plain decoding (no drafts, no drafter session), 1
    caps each draft at one token; the tokens are the same."""
    ref = _ref(references, prompt_ids, 1)
    before = _verifier().proposer_stats.remote().result()
    for cap in (0, 1):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1][0], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"num_speculative_tokens": cap, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ref
        spec = r.model_extra["speculation"]
        if cap == 0:
            assert spec["drafted"] == 0
        else:
            assert 0 < spec["drafted"] <= len(ref)  # at most one draft token per step
    after = _verifier().proposer_stats.remote().result()
    assert after["plain_rows"] - before.get("plain_rows", 0) >= len(ref) - 1


def test_stop_strings_and_grpc(server, client, tokenizer, prompt_ids, references):
    ref_text = tokenizer.decode(_ref(references, prompt_ids, 0), skip_special_tokens=True)
    assert_stop_string(client, MODEL, PROMPTS[0][0], ref_text, MAX_TOKENS)
    stub = rpc.GenerationStub(grpc.insecure_channel(server.grpc))
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPTS[1][0], params=pb.SamplingParams(max_tokens=MAX_TOKENS))
    responses = list(stub.Generate(request, metadata=METADATA, timeout=300))
    assert [t for r in responses for t in r.token_ids] == _ref(references, prompt_ids, 1)
    assert responses[-1].stats.drafted > 0


def test_text_options(client, tokenizer, prompt_ids, references):
    ref_text = tokenizer.decode(_ref(references, prompt_ids, 0), skip_special_tokens=True)
    assert_text_options(client, MODEL, tokenizer, PROMPTS[0][0], ref_text, MAX_TOKENS)

# the torch path's table of malformed requests (tests/test_bad_input.py), a few of each kind
HTTP_SAMPLE = [c for c in HTTP_CASES if c[0] in ("deep-array", "surrogate-prompt", "surrogate-content", "surrogate-stop")]
GRPC_SAMPLE = [c for c in GRPC_CASES if c[0] in ("corrupt-bytes", "empty-prompt", "role-wizard", "temperature-nan",
                                                 "max-tokens-over-context", "stop-17", "model-unknown")]


@pytest.mark.parametrize("path,body,headers,status,needle", [c[1:] for c in HTTP_SAMPLE],
                         ids=[c[0] for c in HTTP_SAMPLE])
def test_malformed_http_request_as_on_torch(server, path, body, headers, status, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.http + path, content=content, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **headers})
    _assert_openai_error(r, status, needle)


@pytest.mark.parametrize("request_,needle", [c[1:] for c in GRPC_SAMPLE], ids=[c[0] for c in GRPC_SAMPLE])
def test_malformed_grpc_request_as_on_torch(server, request_, needle):
    with pytest.raises(grpc.RpcError) as info:
        _generate(server, request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()


def test_logits_processors_pass_through_to_vllm(server, client, target_fp32, tokenizer, prompt_ids, references):
    """Penalties, bad_words, min_tokens, stop_token_ids and allowed_token_ids reach vLLM, which applies them
    to the target at every draft position: with tandem's drafts the output equals transformers' with the
    same processors (repetition penalty, bad words) and vLLM's own plain decoding (the rest)."""
    import torch

    from cluster.core.processors import tokenize_bad_words

    ids, ref = prompt_ids[1], _ref(references, prompt_ids, 1)
    with torch.inference_mode():
        out = target_fp32.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=MAX_TOKENS, repetition_penalty=1.3)
    want = out[0, len(ids):].tolist()

    def complete(cap=None, **extra):
        body = {"return_token_ids": True, **extra, **({} if cap is None else {"num_speculative_tokens": cap})}
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1][0], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=body)
        return r.choices[0].model_extra["token_ids"], r.model_extra["speculation"]

    got, spec = complete(repetition_penalty=1.3)
    assert want != ref and got == want and spec["drafted"] > 0

    # a word of the reference output whose forms (as it is, after a space) are single tokens: transformers
    # bans those at every position, as vLLM's check over the output does for one-token words
    def forms(token: int) -> list[list[int]]:
        word = tokenizer.decode([token])
        return tokenize_bad_words(tokenizer, [word]) if word.strip() else []

    token = next(t for t in ref[2:] if [t] in forms(t) and all(len(form) == 1 for form in forms(t)))
    word, banned = tokenizer.decode([token]), forms(token)
    with torch.inference_mode():
        out = target_fp32.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=MAX_TOKENS, bad_words_ids=banned)
    want = out[0, len(ids):].tolist()
    got, spec = complete(bad_words=[word])
    assert want != ref and got == want and spec["drafted"] > 0
    assert not {form[0] for form in banned} & set(got)
    extra = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "allowed_token_ids": sorted(set(ref) - {ref[3]}),
             "stop_token_ids": [ref[10]], "min_tokens": 12}
    got, spec = complete(**extra)
    plain, _ = complete(cap=0, **extra)
    assert got == plain and got != ref and spec["drafted"] > 0 and ref[3] not in got
    assert len(got) >= 12 and (len(got) == MAX_TOKENS or got[-1] == ref[10])


def test_structured_outputs_pass_through_to_vllm(client):
    """vLLM masks the target at every draft position and cuts tandem's drafts at their first refused
    token: greedy output the same with speculation off, every output follows its grammar."""
    assert_structured_outputs(client, MODEL)


def test_responses_api_on_vllm(server, client, tokenizer, prompt_ids, references):
    """/v1/responses on the vLLM backend: the chat prompt's greedy text (transformers'), streamed and not, and
    the same features and refusals as on torch (tests/openai_checks.py)."""
    assert_responses_greedy(client, tokenizer, PROMPTS[3][0], prompt_ids[3], references[tuple(prompt_ids[3])], MAX_TOKENS)
    assert_responses_features(client, server.http, API_KEY)
    assert_responses_tools(client)
    assert_tokenizer_routes(server.http, API_KEY, tokenizer, PROMPTS[0][0], PROMPTS[3][0], prompt_ids[3])


def test_hosting_routes_on_vllm(server):
    """vLLM's /ping and SageMaker's /invocations on the vLLM application's direct ingress."""
    assert_hosting_routes(server.http, API_KEY, PROMPTS[3][0], PROMPTS[0][0], 8)


def test_anthropic_messages_on_vllm(server):
    """Anthropic's Messages API on the vLLM application: chat completions' greedy text and the same checks as on torch."""
    assert_anthropic_messages(server.http, API_KEY, PROMPTS[4][0], MAX_TOKENS)


def test_tool_calls_on_vllm(client):
    assert_tool_calls(client, MODEL)


def test_processors_vllm_refuses_under_speculation_are_refused(server, client):
    """vLLM refuses min_p and logit_bias with speculative decoding: a clear 400 / INVALID_ARGUMENT naming
    the torch backend, never a silent drop."""
    for extra in ({"min_p": 0.1}, {"logit_bias": {"1": 2}}):
        with pytest.raises(openai.BadRequestError, match="not served on the vLLM backend") as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
        assert next(iter(extra)) in str(info.value) and "torch backend" in str(info.value)
    with pytest.raises(grpc.RpcError) as info:
        _generate(server, pb.GenerateRequest(model=MODEL, prompt="hi", params=pb.SamplingParams(max_tokens=2, min_p=0.1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vLLM backend" in info.value.details()


def test_prompt_past_vllms_context_is_refused(server, client):
    """vLLM's max_model_len (2048 here) is shorter than the model's 8192: the router refuses with 400."""
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="hello " * 2100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_sampled_speculation(client):
    """Sampled decoding through speculation runs (the CPU rejection-sampler fix is applied in the
    replica's workers; its distribution test is in test_vllm.py)."""
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=32, temperature=0.8,
                                  seed=7, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 32 and r.model_extra["speculation"]["drafted"] > 0
    fix = _verifier().proposer_stats.remote().result()["fix"]
    assert fix["state"] == "applied"


def test_replicas_are_the_ingress_and_streams_are_paced(server):
    """No router deployment on vLLM, and by default no ingress deployment either (`vllm.direct_ingress`): the
    verifier replicas serve the API themselves, so a streamed chunk crosses no Serve hop between the session
    and the HTTP response; a long stream from a replica with one session still sends every token, in order."""
    from ray import serve

    assert set(serve.status().applications["tandem"].deployments) == {VERIFIER}
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 40, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    pieces, usage = [], None
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                pieces += [c["text"] for c in event["choices"] if c.get("text")]
                usage = event.get("usage") or usage
    whole = {k: v for k, v in body.items() if k != "stream_options"}
    plain = httpx.post(server.http + "/v1/completions", json={**whole, "stream": False},
                       timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert usage["completion_tokens"] == 40 and "".join(pieces) == plain["choices"][0]["text"]
    assert 1 < len(pieces) <= 40


def test_a_replica_answers_at_its_own_port_with_the_same_api(server, tokenizer, prompt_ids, references):
    """On one machine Serve's direct ingress is on (`cluster.ray.runtime.LOCAL_SERVE_ENV`): the replica answers
    the same API at its own loopback port, past the proxy: the key checked, the target's greedy tokens streamed,
    a bad request refused with the same OpenAI error body."""
    [direct] = server.direct["tandem"]
    assert direct.startswith("http://127.0.0.1:") and direct != server.http
    body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 8}
    assert httpx.post(direct + "/v1/completions", json=body, timeout=60).status_code == 401
    client = openai.OpenAI(base_url=direct + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    i = next(i for i, (_, chat) in enumerate(PROMPTS) if chat)
    ref = _ref(references, prompt_ids, i)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i][0]}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
    ids = [t for chunk in stream for c in chunk.choices for t in c.model_extra.get("token_ids") or []]
    assert ids == ref
    bad = httpx.post(direct + "/v1/completions", json={**body, "max_tokens": -1}, timeout=60,
                     headers={"Authorization": f"Bearer {API_KEY}"})
    via_proxy = httpx.post(server.http + "/v1/completions", json={**body, "max_tokens": -1}, timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"})
    assert bad.status_code == via_proxy.status_code == 400 and bad.json() == via_proxy.json()


def test_sessions_released_on_finish_and_disconnect(server):
    body = {"model": MODEL, "prompt": "Count from one to a thousand: one, two,", "max_tokens": 1500,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert _verifier().sessions.remote().result() == 1
        assert _verifier().drafter_stats.remote().result()["sessions"] == 1
    deadline = time.time() + 60
    while time.time() < deadline and (_verifier().sessions.remote().result()
                                      or _verifier().drafter_stats.remote().result()["sessions"]):
        time.sleep(0.5)
    assert _verifier().sessions.remote().result() == 0  # vLLM aborted the request
    drafter = _verifier().drafter_stats.remote().result()
    assert drafter["sessions"] == 0, drafter  # and the drafter let its session go


def _wait_restarted(actor, timeout_s: float) -> None:
    """Until `actor` answers `ready`: while Ray restarts it, calls fail at once with ActorUnavailableError
    (they do not queue), so ask again until the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_killed_drafter_costs_speed_not_tokens(client, prompt_ids, references):
    """The drafter dies mid-request: the request ends with the same tokens (plain steps), counted;
    the restarted drafter drafts for the next requests."""
    before = _verifier().proposer_stats.remote().result()
    drafter = next(ray.get_actor(a["name"], namespace=a["namespace"])
                   for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("tandem-vllm-drafter-"))
    ids = stream_and_kill(client, MODEL, PROMPTS[2][0], MAX_TOKENS, lambda: ray.kill(drafter, no_restart=False))
    assert ids == _ref(references, prompt_ids, 2)
    after = _verifier().proposer_stats.remote().result()
    assert after.get("drafter_failures", 0) > before.get("drafter_failures", 0)
    _wait_restarted(drafter, 180)  # Ray restarted it (same actor, same name)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == _ref(references, prompt_ids, 0)
    assert r.model_extra["speculation"]["drafted"] > 0  # and it drafts for new requests


def test_proposer_counters_in_prometheus(client):
    node = ray._private.worker.global_worker.node
    url = f"http://127.0.0.1:{node.metrics_export_port}/metrics"
    wanted = 'ray_tandem_vllm_proposer_rows_total{'
    deadline, lines = time.time() + 90, []
    while time.time() < deadline:
        text = httpx.get(url, timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith(wanted) and 'kind="hits"' in line]
        if lines:
            break
        time.sleep(2)
    assert lines and float(lines[0].rsplit(" ", 1)[1]) > 0
    requests = [line for line in text.splitlines() if line.startswith("ray_tandem_requests_total{")]
    assert requests


def test_logprobs_are_vllms_raw_ones(server, client, tokenizer, target_fp32, prompt_ids, references):
    """vLLM's raw logprobs (its server's logprobs_mode, the default) pass through in the torch engine's
    shapes: the target's log-softmax (fp32 here: within 2e-3 of transformers', another kernel), streamed
    and not, chat and completions; the other mode is refused with a 400 that says why."""
    import torch

    ref = _ref(references, prompt_ids, 3)
    with torch.inference_mode():
        logits = target_fp32(torch.tensor([prompt_ids[3] + ref])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt_ids[3]) - 1: -1], dim=-1)
    messages = [{"role": "user", "content": PROMPTS[3][0]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    assert r.choices[0].model_extra["token_ids"] == ref and r.model_extra["speculation"]["drafted"] > 0
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref]
    for j, c in enumerate(content):
        assert abs(c.logprob - expected[j, ref[j]].item()) < 2e-3, j
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy: the token is the best
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for chunk in stream for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    # the same tokens; each logprob the same up to the last bits: vLLM's fp32 logits differ in them when a step
    # verifies another number of drafts (the drafter's timing picks it; a run saw -0.5655965 against -0.5655933)
    assert [e.token for e in streamed] == [c.token for c in content]
    assert all(abs(e.logprob - c.logprob) < 1e-4 for e, c in zip(streamed, content))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=8, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(t in entry and len(entry) == 1 for t, entry in zip(lp.tokens, lp.top_logprobs))  # greedy: top 1 = it
    with pytest.raises(openai.BadRequestError, match="logprobs_mode") as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
                                  extra_body={"logprobs_mode": "processed_logprobs"})
    assert "raw_logprobs" in str(info.value)


def test_echo_and_prompt_logprobs_are_vllms(client, tokenizer, target_fp32):
    """`echo`, `max_tokens: 0` and `prompt_logprobs` as on the torch engine: vLLM's prompt logprobs (it serves
    them with speculative decoding), fp32 within 2e-3 of transformers' (another kernel)."""
    assert_echo_and_scoring(client, MODEL, tokenizer, target_fp32, tol=2e-3)


def test_vllm_request_extensions_as_on_torch(client, tokenizer):
    """vLLM's extensions (tests/vllm_field_checks.py) where the backend is in play: the cut prompt's ids reach vLLM
    (the same tokens as sending them), the cache salt reaches vLLM's prefix cache (vLLM refuses a malformed one in
    its engine too: here the ingress refuses it first), Responses' id and truncation. The answer's formatting (echo,
    logprob names, the prompt's ids) is the ingress's, the same code as the torch backend's (test_vllm_fields)."""
    assert_truncation(client, MODEL, tokenizer)
    assert_cache_salt(client, MODEL)
    assert_responses_extensions(client, MODEL)
    # OpenAI's Predicted Outputs reach vLLM's worker (`extra_args`): tandem's proposer drafts from them first
    before = _verifier().proposer_stats.remote().result().get("prediction_accepted", 0)
    plain, exact = assert_prediction(client, MODEL)
    stats = _verifier().proposer_stats.remote().result()
    assert stats["prediction_rows"] > 0 and stats["prediction_accepted"] - before > 16, stats
    assert exact["accepted"] > plain["accepted"], (plain, exact)


def test_eagle3_route_with_the_ingress_apart_serves_the_targets_tokens(server, target_fp32, tokenizer, prompt_ids,
                                                                       references, tmp_path):
    """Proposer 'eagle3' (backend vllm): vLLM's own EAGLE-3 method runs a draft `export_vllm` wrote inside its
    step, through tandem's replicas, with no drafter, and tandem's priced matches drafted in its proposer
    (`eagle3_matches`, the default: `cluster.vllm.eagle_matches`). The draft here is untrained: the route and
    losslessness are checked, not α. A request's draft cap holds (`num_speculative_tokens` 0: no drafts, 1: at most
    one a step); the replica counts both kinds of rows. A directory that is no EAGLE-3 export, on either backend, is
    a clear config error.

    This second application also has its ingress apart from the verifier replicas (`vllm.direct_ingress: false`;
    the module's own application has replicas that are their own ingress): the `Ingress` deployment validates,
    tokenizes and writes the OpenAI and gRPC responses and drives each session on a verifier replica through a
    Serve handle (the route where a replica's death is survived: the ingress resumes the stream on a live
    replica). Completions, a streamed chat and gRPC through Serve's proxy serve the target's tokens on it."""
    import torch
    from ray import serve

    from deployments.builder import build_app
    from drafts.eagle3_model import Eagle3Draft, export_vllm

    with pytest.raises(ConfigError, match="eagle3"):
        build_app({"engine": {"backend": "vllm", "proposer": "eagle3", "draft": str(tmp_path)}})
    with pytest.raises(ConfigError, match="tandem_draft.json of kind 'eagle3'"):
        TandemAppConfig.build({"engine": {"backend": "torch", "proposer": "eagle3", "draft": str(tmp_path)}})
    torch.manual_seed(0)
    out = export_vllm(Eagle3Draft(target_fp32, torch.arange(4096)), tmp_path / "eagle3")
    serve.run(build_app({"engine": {"backend": "vllm", "dtype": "float32", "proposer": "eagle3", "draft": str(out),
                                    "num_speculative_tokens": 3, "threads": 1},
                         "api_keys": [API_KEY],
                         "vllm": {"kv_cache_space_gib": 1, "compile": False, "direct_ingress": False}}),
              name="e3", route_prefix="/e3")
    try:
        assert set(serve.status().applications["e3"].deployments) == {"Ingress", VERIFIER}
        e3 = openai.OpenAI(base_url=server.http + "/e3/v1", api_key=API_KEY, max_retries=0, timeout=300)
        for i in (0, 2):
            r = e3.completions.create(model=MODEL, prompt=PROMPTS[i][0], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == _ref(references, prompt_ids, i), i
            assert r.choices[0].text == tokenizer.decode(_ref(references, prompt_ids, i), skip_special_tokens=True)
            spec = r.model_extra["speculation"]  # vLLM's per-request figures for its drafts
            assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"], spec
        chat = next(i for i, (_, is_chat) in enumerate(PROMPTS) if is_chat)
        stream = e3.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[chat][0]}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
        ids = [t for chunk in stream for choice in chunk.choices for t in choice.model_extra.get("token_ids") or []]
        assert ids == _ref(references, prompt_ids, chat)
        with grpc.insecure_channel(server.grpc) as channel:  # Serve's proxy to the ingress deployment
            replies = list(rpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(model=MODEL, prompt=PROMPTS[1][0], params=pb.SamplingParams(max_tokens=MAX_TOKENS)),
                metadata=(("application", "e3"), METADATA[1]), timeout=300))
        assert [t for reply in replies for t in reply.token_ids] == _ref(references, prompt_ids, 1)
        assert replies[-1].finish_reason == "length" and replies[-1].completion_tokens == MAX_TOKENS
        for cap in (0, 1):
            r = e3.completions.create(model=MODEL, prompt=PROMPTS[0][0], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "num_speculative_tokens": cap})
            tokens = r.choices[0].model_extra["token_ids"]
            assert tokens == _ref(references, prompt_ids, 0), cap
            spec = r.model_extra["speculation"]
            assert spec["drafted"] == 0 if cap == 0 else 0 < spec["drafted"] <= len(tokens), (cap, spec)
        stats = serve.get_deployment_handle(VERIFIER, "e3").proposer_stats.remote().result()
        assert stats["eagle_rows"] > 0 and stats["plain_rows"] > 0 and not stats.get("proposer_errors"), stats
        assert stats["eagle_skipped_steps"] > 0, stats  # the capped-at-0 request alone: no EAGLE-3 forward
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert not any(n.startswith("tandem-vllm-drafter-e3-") for n in names), names
    finally:
        serve.delete("e3")


def test_an_idle_replica_reads_the_proposer_counters_once_after_its_last_session():
    """`StatsGate`: the counters' read (a message that sets vLLM's worker busy-looping for a second) happens while
    sessions are open and once after they end, then not again until another session opens."""
    from deployments.metrics import StatsGate

    gate = StatsGate()
    assert not gate.due(0)  # nothing served yet
    gate.open()
    assert gate.due(1) and gate.due(0)
    opened = gate.opened
    gate.open()  # a session opens while the read is in flight: the next check reads again
    gate.mark_read(opened)
    assert gate.due(0)
    gate.mark_read(gate.opened)
    assert not gate.due(0) and gate.due(1)  # idle: skipped; a session still open: read


def test_the_replicas_engine_has_a_reaper_for_when_the_replica_is_killed(server):
    """A replica Ray kills runs no shutdown; the reaper it started (`cluster.vllm.reaper`) then stops its vLLM engine
    core, which otherwise runs on with init as its parent (tests/test_reaper.py kills such a parent)."""
    from cluster.vllm import reaper

    procs = _verifier().processes.remote().result(timeout_s=60)
    assert len(procs["engine"]) == 1 and procs["reaper"], procs
    reaper_pid = procs["reaper"]
    cmdline = open(f"/proc/{reaper_pid}/cmdline", "rb").read().split(b"\0")
    assert b"cluster.vllm.reaper" in cmdline and cmdline[cmdline.index(b"cluster.vllm.reaper") + 1] == str(procs["replica"]).encode()
    engine = procs["engine"][0]
    assert f"{engine}:{reaper.start_time(engine)}".encode() in cmdline  # watching that engine core as it started
    assert reaper.start_time(reaper_pid) is not None  # and still running


def test_no_telemetry_actor_while_rays_usage_stats_are_off(server):
    """`deployments.vllm_replica.skip_llm_telemetry_actor`: Serve LLM starts its detached `TelemetryAgent` only to hold
    usage tags Ray sends with usage stats on; tandem turns them off, so the replica starts no such actor."""
    import ray
    from ray._common.usage import usage_lib
    from ray.llm._internal.serve.observability.usage_telemetry.usage import (
        LLM_SERVE_TELEMETRY_ACTOR_NAME, LLM_SERVE_TELEMETRY_NAMESPACE)

    assert not usage_lib.usage_stats_enabled()
    assert _verifier().processes.remote().result(timeout_s=60)["engine"]  # the replica's engine has started
    with pytest.raises(ValueError):
        ray.get_actor(LLM_SERVE_TELEMETRY_ACTOR_NAME, namespace=LLM_SERVE_TELEMETRY_NAMESPACE)
