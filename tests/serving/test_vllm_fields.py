"""vLLM's request extensions beyond sampling, on the shared Serve application (tests/serving/conftest.py): the
HTTP checks of tests/vllm_field_checks.py (test_vllm_serving runs them on the vLLM backend), gRPC's prompt logprobs
and cache salt, the chat template's variables; the refusals of what tandem cannot honour are test_bad_input's."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from deployments.openai_api import parse_request
from deployments.openai_body import ApiError
from deployments.openai_chat import ChatCompletionRequest
from protos import pb, rpc
from tests.serving import API_KEY, METADATA, MODEL
from tests.vllm_field_checks import (MAX_TOKENS, PROMPT, assert_cache_salt, assert_chat_echo,
                                     assert_chat_prompt_logprobs, assert_logprob_names_and_request_id,
                                     assert_prediction, assert_prompt_ids_and_special_tokens,
                                     assert_responses_extensions, assert_truncation, completion)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_truncation_keeps_the_side_asked(client, tokenizer):
    assert_truncation(client, MODEL, tokenizer)


def test_prompt_ids_text_and_special_tokens(client, tokenizer):
    assert_prompt_ids_and_special_tokens(client, MODEL, tokenizer)


def test_chat_echo_continues_the_assistant_text(client):
    assert_chat_echo(client, MODEL)


def test_logprob_names_and_request_id(client):
    assert_logprob_names_and_request_id(client, MODEL)
    assert_responses_extensions(client, MODEL)


def test_prediction_drafts_and_changes_nothing(client, server):
    """OpenAI's Predicted Outputs on the torch backend: the exact prediction is drafted from in long rounds, so the
    answer takes fewer rounds than without one, and more of its drafts are accepted; gRPC's `params.prediction`
    (token ids) gives the same tokens and fewer rounds too."""
    plain, exact = assert_prediction(client, MODEL)
    assert exact["rounds"] < plain["rounds"] and exact["accepted"] > plain["accepted"], (plain, exact)
    stub = rpc.GenerationStub(grpc.insecure_channel(server.grpc))

    def generate(**params) -> tuple[list[int], int]:
        request = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=pb.SamplingParams(max_tokens=24, **params))
        messages = list(stub.Generate(request, metadata=METADATA, timeout=120))
        return [t for m in messages for t in m.token_ids], messages[-1].stats.rounds

    tokens, rounds = generate()
    predicted, fewer = generate(prediction=tokens)
    assert predicted == tokens and fewer < rounds, (rounds, fewer)


def test_prompt_logprobs_on_chat_and_grpc(client, server, tokenizer):
    """Chat's at the response's top level; gRPC's `params.prompt_logprobs` come in the first message, the same
    numbers, ranks and top count as HTTP's for the same prompt."""
    assert_chat_prompt_logprobs(client, MODEL)
    http = completion(client, MODEL, prompt=PROMPT, extra_body={"prompt_logprobs": 2}).choices[0].model_extra
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=pb.SamplingParams(max_tokens=3, prompt_logprobs=2))
    responses = list(rpc.GenerationStub(grpc.insecure_channel(server.grpc)).Generate(request, metadata=METADATA,
                                                                                     timeout=120))
    scored, prompt = responses[0].prompt_logprobs, tokenizer(PROMPT)["input_ids"]
    assert len(scored) == len(prompt) - 1 and responses[0].prompt_tokens == len(prompt)
    assert not any(m.prompt_logprobs for m in responses[1:]) and responses[-1].finish_reason
    for t, entry, want in zip(prompt[1:], scored, http["prompt_logprobs"][1:]):
        assert entry.token_id == t and entry.logprob == pytest.approx(want[str(t)]["logprob"], abs=1e-5)
        assert entry.rank == want[str(t)]["rank"] and len(entry.top_ids) == 2


def test_cache_salt_changes_no_token(client, server):
    """HTTP (tests/vllm_field_checks.py) and gRPC's `params.cache_salt`; an empty salt is INVALID_ARGUMENT."""
    tokens = assert_cache_salt(client, MODEL)
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPT,
                                 params=pb.SamplingParams(max_tokens=MAX_TOKENS, cache_salt="tenant-a"))
    stub = rpc.GenerationStub(grpc.insecure_channel(server.grpc))
    assert [t for m in stub.Generate(request, metadata=METADATA, timeout=120) for t in m.token_ids] == tokens
    request.params.cache_salt = ""
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, metadata=METADATA, timeout=120))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details()


def test_reasoning_effort_and_documents_reach_the_template(tokenizer):
    """`documents` and `reasoning_effort` are chat template variables, as vLLM passes them (with `enable_thinking`
    unless the request's chat_template_kwargs set it); a malformed `documents` is a 400."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "documents": [{"title": "t", "text": "x"}],
            "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    request = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    template = ("{% for d in documents %}{{ d.title }}={{ d.text }};{% endfor %}"
                "{{ reasoning_effort }} {{ enable_thinking }}")
    assert tokenizer.apply_chat_template(body["messages"], chat_template=template, tokenize=False,
                                         **request.template_options()) == "t=x;low False"
    del body["chat_template_kwargs"]
    assert parse_request(json.dumps(body).encode(), ChatCompletionRequest).template_options()["enable_thinking"] is True
    with pytest.raises(ApiError, match="documents"):
        parse_request(json.dumps(body | {"documents": "not a list"}).encode(), ChatCompletionRequest)
