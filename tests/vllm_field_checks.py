"""vLLM's request extensions beyond sampling, and OpenAI's Predicted Outputs, checked through the real `openai` client on a served application:
shared by the torch application's tests (tests/serving/test_vllm_fields.py) and the vLLM application's
(test_vllm_serving), which the ingress serves the same way. Each takes the client, the served model's name and,
where it needs one, the target's tokenizer."""

from __future__ import annotations

import openai
import pytest

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 6


def completion(client: openai.OpenAI, model: str, **fields):
    return client.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0, **fields)


def assert_truncation(client: openai.OpenAI, model: str, tokenizer) -> None:
    """`truncate_prompt_tokens` cuts the prompt before anything runs: the answer is the one of the kept ids sent
    as the prompt, and usage counts them; `right` keeps the first ones (the tokenizer's side here), `left` the last;
    -1 keeps a prompt the context holds; more than the context is a 400; chat cuts the templated prompt."""
    ids = list(tokenizer(PROMPT)["input_ids"])
    assert tokenizer.truncation_side == "right" and len(ids) > 12
    for side, kept in (("left", ids[-10:]), ("right", ids[:10]), (None, ids[:10])):
        extra = {"truncate_prompt_tokens": 10, "return_token_ids": True}
        cut = completion(client, model, prompt=PROMPT, extra_body=extra | ({"truncation_side": side} if side else {}))
        sent = completion(client, model, prompt=kept, extra_body={"return_token_ids": True})
        assert cut.usage.prompt_tokens == 10 and cut.choices[0].model_extra["prompt_token_ids"] == kept, side
        assert cut.choices[0].model_extra["token_ids"] == sent.choices[0].model_extra["token_ids"], side
    whole = completion(client, model, prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        completion(client, model, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 10**6})
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 5, "truncation_side": "left",
                                                      "return_token_ids": True})
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.usage.prompt_tokens == 5 and chat.model_extra["prompt_token_ids"] == list(templated)[-5:]


def assert_prompt_ids_and_special_tokens(client: openai.OpenAI, model: str, tokenizer) -> None:
    """`return_token_ids` carries the prompt's ids (a completion choice's, chat's top level; streamed, in the first
    chunk), tokenized as `add_special_tokens` asks; chat's `return_prompt_text` the templated prompt."""
    for special in (True, False):
        r = completion(client, model, prompt=PROMPT, extra_body={"return_token_ids": True,
                                                                 "add_special_tokens": special})
        want = tokenizer(PROMPT, add_special_tokens=special)["input_ids"]
        assert r.choices[0].model_extra["prompt_token_ids"] == want
    chunks = list(completion(client, model, prompt=[PROMPT, "Hello"], stream=True,
                             extra_body={"return_token_ids": True}))
    firsts: dict = {}
    for c in chunks:
        for choice in c.choices:
            firsts.setdefault(choice.index, choice.model_extra.get("prompt_token_ids"))
    assert firsts == {0: tokenizer(PROMPT)["input_ids"], 1: tokenizer("Hello")["input_ids"]}

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    special_ids = tokenizer(templated, add_special_tokens=True)["input_ids"]
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, stream=stream,
                                           extra_body={"return_token_ids": True, "return_prompt_text": True,
                                                       "add_special_tokens": True})
        first = next(iter(r)) if stream else r
        assert first.model_extra["prompt_token_ids"] == special_ids and first.model_extra["prompt_text"] == templated


def assert_chat_echo(client: openai.OpenAI, model: str) -> None:
    """Chat's `echo` with `continue_final_message`: the content is the assistant's prefix and its continuation,
    the continuation the same as without `echo`, streamed or not; a last message of another role echoes nothing."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}

    def content(stream: bool, **extra) -> str:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=stream, extra_body=options | extra)
        if not stream:
            return r.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)

    plain = content(False)
    assert plain and content(False, echo=True) == "My favourite is" + plain == content(True, echo=True)
    asked = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"echo": True})
    told = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=MAX_TOKENS, temperature=0)
    assert asked.choices[0].message.content == told.choices[0].message.content


def assert_logprob_names_and_request_id(client: openai.OpenAI, model: str) -> None:
    """`return_tokens_as_token_ids` names each logprob token `token_id:N` (values unchanged); the answer's id is
    `cmpl-` + `request_id`, else the `X-Request-Id` header's."""
    named = completion(client, model, prompt=PROMPT, logprobs=2,
                       extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True, "request_id": "r-7"})
    plain = completion(client, model, prompt=PROMPT, logprobs=2)
    ids = named.choices[0].model_extra["token_ids"]
    assert named.id == "cmpl-r-7" and named.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert named.choices[0].logprobs.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert all(all(k.startswith("token_id:") for k in top) for top in named.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True},
                                          extra_headers={"X-Request-Id": "header-1"})
    assert chat.id == "chatcmpl-header-1" and chat.choices[0].logprobs.content[0].token.startswith("token_id:")
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token.startswith("token_id:")


def assert_chat_prompt_logprobs(client: openai.OpenAI, model: str) -> None:
    """Chat's `prompt_logprobs` are the response's (vLLM's place, not a choice's), one per templated prompt token,
    each with the prompt token's own entry."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    ids, served = r.model_extra["prompt_token_ids"], r.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(ids) and "prompt_logprobs" not in r.choices[0].model_extra
    assert all(str(t) in entry for t, entry in zip(ids[1:], served[1:]))


def assert_cache_salt(client: openai.OpenAI, model: str) -> list[int]:
    """`cache_salt` changes no token: the same prompt unsalted, salted, salted again and under another salt gives
    the same greedy tokens (returned); which KV each may reuse is tests/test_prompt_cache.py's and test_choices.py's
    (torch) and vLLM's prefix cache's."""
    runs = [completion(client, model, prompt=PROMPT, extra_body={"return_token_ids": True, **salt}).choices[0]
            for salt in ({}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"})]
    assert len({tuple(c.model_extra["token_ids"]) for c in runs}) == 1
    return runs[0].model_extra["token_ids"]


def assert_responses_extensions(client: openai.OpenAI, model: str) -> None:
    """On `/v1/responses`: `request_id` is the response's id (vLLM's), `truncation` is echoed and
    `truncate_prompt_tokens` cuts the templated input as on chat."""
    r = client.responses.create(model=model, input=PROMPT, max_output_tokens=2, temperature=0, truncation="auto",
                                extra_body={"request_id": "resp-extension-1", "truncate_prompt_tokens": 5})
    assert r.id == "resp-extension-1" and r.truncation == "auto" and r.usage.input_tokens == 5


def assert_prediction(client: openai.OpenAI, model: str) -> tuple[dict, dict]:
    """OpenAI's `prediction` through the `openai` client: with the answer predicted (and with an edit in it), chat
    streamed or not and a completion (an extension) answer what they answer without, and usage says how much of the
    prediction the answer holds. (speculation figures without, with the exact prediction), for the backend's own
    checks."""
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    fields = dict(model=model, messages=messages, max_tokens=32, temperature=0)
    plain = client.chat.completions.create(**fields)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None and len(text) > 40
    edited = text[:20] + "value" + text[25:]
    for prediction in (text, edited):
        out = client.chat.completions.create(**fields, prediction={"type": "content", "content": prediction})
        assert out.choices[0].message.content == text
        details = out.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > (out.usage.completion_tokens // 2 if prediction == edited
                                                     else out.usage.completion_tokens - 2), details
        assert details.rejected_prediction_tokens >= (1 if prediction == edited else 0), details
        if prediction == text:
            exact = out
    stream = client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": [{"type": "text", "text": edited}]})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={
        "prediction": {"type": "content", "content": done.choices[0].text}})
    assert again.choices[0].text == done.choices[0].text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens >= again.usage.completion_tokens - 1
    return plain.model_extra["speculation"], exact.model_extra["speculation"]
