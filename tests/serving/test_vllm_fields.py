"""vLLM's request extensions beyond sampling, on the shared Serve application (tests/serving/conftest.py): the
prompt's truncation and special tokens, chat's `echo`, token ids as logprob names, the answer's id, the prompt's
ids and text in the answer, chat's prompt logprobs at the top level, gRPC's prompt logprobs; the refusals of what
tandem cannot honour are tests/test_bad_input.py's."""

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

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _completion(client, **fields):
    return client.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, **fields)


def test_truncation_keeps_the_side_asked(client, tokenizer):
    """`truncate_prompt_tokens` cuts the prompt before anything runs: the answer is the one of the kept ids sent
    as the prompt, and usage counts them; `right` keeps the first ones (the tokenizer's side here), `left` the last;
    -1 keeps a prompt the context holds; more than the context is a 400."""
    ids = list(tokenizer(PROMPT)["input_ids"])
    assert tokenizer.truncation_side == "right" and len(ids) > 12
    for side, kept in (("left", ids[-10:]), ("right", ids[:10]), (None, ids[:10])):
        extra = {"truncate_prompt_tokens": 10, "return_token_ids": True}
        cut = _completion(client, prompt=PROMPT, extra_body=extra | ({"truncation_side": side} if side else {}))
        sent = _completion(client, prompt=kept, extra_body={"return_token_ids": True})
        assert cut.usage.prompt_tokens == 10 and cut.choices[0].model_extra["prompt_token_ids"] == kept, side
        assert cut.choices[0].model_extra["token_ids"] == sent.choices[0].model_extra["token_ids"], side
    whole = _completion(client, prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        _completion(client, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 10**6})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          temperature=0, extra_body={"truncate_prompt_tokens": 5,
                                                                     "truncation_side": "left",
                                                                     "return_token_ids": True})
    templated = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    assert chat.usage.prompt_tokens == 5 and chat.model_extra["prompt_token_ids"] == list(templated)[-5:]


def test_prompt_ids_text_and_special_tokens(client, server, tokenizer):
    """`return_token_ids` carries the prompt's ids (a completion choice's, chat's top level; streamed, in the first
    chunk), tokenized as `add_special_tokens` asks; chat's `return_prompt_text` the templated prompt."""
    for special in (True, False):
        r = _completion(client, prompt=PROMPT, extra_body={"return_token_ids": True, "add_special_tokens": special})
        want = tokenizer(PROMPT, add_special_tokens=special)["input_ids"]
        assert r.choices[0].model_extra["prompt_token_ids"] == want
    chunks = list(_completion(client, prompt=[PROMPT, "Hello"], stream=True, extra_body={"return_token_ids": True}))
    firsts = {}
    for c in chunks:
        for choice in c.choices:
            firsts.setdefault(choice.index, choice.model_extra.get("prompt_token_ids"))
    assert firsts == {0: tokenizer(PROMPT)["input_ids"], 1: tokenizer("Hello")["input_ids"]}

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    special = tokenizer(templated, add_special_tokens=True)["input_ids"]
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=stream,
                                           extra_body={"return_token_ids": True, "return_prompt_text": True,
                                                       "add_special_tokens": True})
        first = next(iter(r)) if stream else r
        assert first.model_extra["prompt_token_ids"] == special and first.model_extra["prompt_text"] == templated


def test_chat_echo_continues_the_assistant_text(client):
    """Chat's `echo` with `continue_final_message`: the content is the assistant's prefix and its continuation,
    the continuation the same as without `echo`, streamed or not; a last message of another role echoes nothing."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}

    def content(stream: bool, **extra) -> str:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=stream, extra_body=options | extra)
        if not stream:
            return r.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)

    plain = content(False)
    assert plain and content(False, echo=True) == "My favourite is" + plain == content(True, echo=True)
    asked = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"echo": True})
    told = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=MAX_TOKENS, temperature=0)
    assert asked.choices[0].message.content == told.choices[0].message.content


def test_logprob_names_and_request_id(client, server, tokenizer):
    """`return_tokens_as_token_ids` names each logprob token `token_id:N` (values unchanged); the answer's id is
    `cmpl-` + `request_id`, else the `X-Request-Id` header's."""
    named = _completion(client, prompt=PROMPT, logprobs=2,
                        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True, "request_id": "r-7"})
    plain = _completion(client, prompt=PROMPT, logprobs=2)
    ids = named.choices[0].model_extra["token_ids"]
    assert named.id == "cmpl-r-7" and named.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert named.choices[0].logprobs.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert all(all(k.startswith("token_id:") for k in top) for top in named.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True},
                                          extra_headers={"X-Request-Id": "header-1"})
    assert chat.id == "chatcmpl-header-1" and chat.choices[0].logprobs.content[0].token.startswith("token_id:")
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token.startswith("token_id:")


def test_prompt_logprobs_on_chat_and_grpc(client, server, tokenizer):
    """Chat's `prompt_logprobs` are the response's (vLLM's place), one per templated prompt token; gRPC's
    `params.prompt_logprobs` come in the first message, the same numbers as HTTP's for the same prompt."""
    messages = [{"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    ids = r.model_extra["prompt_token_ids"]
    served = r.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(ids) and "prompt_logprobs" not in r.choices[0].model_extra
    assert all(str(t) in entry for t, entry in zip(ids[1:], served[1:]))

    http = _completion(client, prompt=PROMPT, extra_body={"prompt_logprobs": 2}).choices[0].model_extra
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=pb.SamplingParams(max_tokens=3, prompt_logprobs=2))
    responses = list(rpc.GenerationStub(grpc.insecure_channel(server.grpc)).Generate(request, metadata=METADATA,
                                                                                     timeout=120))
    scored = responses[0].prompt_logprobs
    prompt = tokenizer(PROMPT)["input_ids"]
    assert len(scored) == len(prompt) - 1 and responses[0].prompt_tokens == len(prompt)
    assert not any(m.prompt_logprobs for m in responses[1:]) and responses[-1].finish_reason
    for t, entry, want in zip(prompt[1:], scored, http["prompt_logprobs"][1:]):
        assert entry.token_id == t and entry.logprob == pytest.approx(want[str(t)]["logprob"], abs=1e-5)
        assert entry.rank == want[str(t)]["rank"] and len(entry.top_ids) == 2


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


def test_cache_salt_changes_no_token(client, server):
    """`cache_salt` reaches the sessions (HTTP and gRPC): the same prompt sent unsalted, salted and salted again
    gives the same greedy tokens (which KV each may reuse is tests/test_prompt_cache.py's and test_choices.py's)."""
    runs = [_completion(client, prompt=PROMPT, extra_body={"return_token_ids": True, **salt}).choices[0]
            for salt in ({}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"})]
    assert len({tuple(c.model_extra["token_ids"]) for c in runs}) == 1
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPT,
                                 params=pb.SamplingParams(max_tokens=MAX_TOKENS, cache_salt="tenant-a"))
    stub = rpc.GenerationStub(grpc.insecure_channel(server.grpc))
    tokens = [t for m in stub.Generate(request, metadata=METADATA, timeout=120) for t in m.token_ids]
    assert tokens == runs[0].model_extra["token_ids"]
    request.params.cache_salt = ""
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, metadata=METADATA, timeout=120))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details()
