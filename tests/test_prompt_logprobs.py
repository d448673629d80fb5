"""Prompt logprobs, `echo` and scoring-only requests (`max_tokens: 0`): every prompt token's logprob is the
target's (fp32 transformers' log-softmax at the position before it), computed as the verifier prefills the
prompt; asking for them changes no generated token and keeps speculation on; they cross the verifier's gRPC
port and the OpenAI shapes are vLLM's. The served HTTP checks (`assert_echo_and_scoring`) run against the
package-scoped Serve application of tests/serving/test_serving.py (no extra application is started here)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from cluster.core.logprobs import TokenLogprob, prompt_logprobs
from cluster.core.sampling import SamplingParams
from cluster.model.models import encode_prompt
from cluster.model.verifier import VerifierEngine
from cluster.session.speculate import SpeculativeDecoder
from cluster.wire.codec import logprobs_from_pb, logprobs_to_pb, params_to_pb
from cluster.wire.verifier_server import VerifierServicer
from deployments.openai_api import CompletionRequest, parse_request
from deployments.openai_body import ApiError
from deployments.openai_logprobs import LogprobFormat
from drafts.draft_model import DraftModelProposer
from protos import pb

MAX_TOKENS = 12
TOP = 3
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("What is the capital of France?", True),
]
ECHO_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at every prompt position  # [len(prompt), vocab_size] (row i: the
    distribution of token i + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_prompt_matches(entries, prompt: list[int], reference: torch.Tensor, top: int) -> None:
    """`entries` (TokenLogprob of prompt tokens 1 ..) against the reference rows: logprob, rank, top ones."""
    assert entries is not None and len(entries) == len(prompt) - 1
    for i, entry in enumerate(entries):
        row, token = reference[i], prompt[i + 1]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < 1e-4, f"prompt position {i + 1}"
        assert entry.rank == int((row >= row[token]).sum()), f"rank at prompt position {i + 1}"
        assert len(entry.top) == top
        values, ids = torch.topk(row, top)
        assert [t for t, _ in entry.top] == ids.tolist(), f"top tokens at prompt position {i + 1}"
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top, values.tolist())) < 1e-4


# ---- in process ---------------------------------------------------------------------------------


def test_prompt_logprobs_are_the_targets_and_change_no_token(target_fp32, target_runner, draft_runner, tokenizer,
                                                             prompt_ids, references):
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 3)
    for ids in prompt_ids:
        asked = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=TOP, logprobs=1))
        assert asked.token_ids == references[tuple(ids)], "prompt logprobs changed the tokens"
        assert asked.stats.drafted > 0, "speculation must stay on"
        assert_prompt_matches(asked.prompt_logprobs, ids, reference_logprobs(target_fp32, ids), TOP)
    plain = decoder.generate(prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    assert plain.prompt_logprobs is None and plain.token_ids == references[tuple(prompt_ids[0])]


def test_sampled_tokens_unchanged_by_prompt_logprobs(target_runner, draft_runner, tokenizer, prompt_ids):
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 3)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=5)
    asked = decoder.generate(prompt_ids[1], params.model_copy(update={"prompt_logprobs": 0}))
    plain = decoder.generate(prompt_ids[1], params)
    assert asked.token_ids == plain.token_ids and asked.stats.drafted > 0
    assert len(asked.prompt_logprobs) == len(prompt_ids[1]) - 1 and all(t.top == () for t in asked.prompt_logprobs)


def test_a_scoring_only_request_runs_no_round(target_fp32, target_runner, draft_runner, tokenizer, prompt_ids):
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 3)
    ids = prompt_ids[0]
    result = decoder.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"
    assert result.stats.rounds == 0 and result.stats.drafted == 0
    assert_prompt_matches(result.prompt_logprobs, ids, reference_logprobs(target_fp32, ids), 1)
    one = decoder.generate(ids[:1], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert one.prompt_logprobs == []  # a one-token prompt has nothing to score
    assert decoder.engine.num_sessions == 0


def test_the_verifiers_grpc_port_scores_the_prompt(target_fp32, target_runner, prompt_ids):
    """`Open` with `prompt_logprobs` (what the router sends) answers them in `OpenReply`, ranks included;
    without it, none (and the same prefill)."""
    servicer = VerifierServicer(VerifierEngine(target_runner), "r0")
    ids = prompt_ids[1]
    params = params_to_pb(SamplingParams(max_tokens=4))
    reply = servicer.Open(pb.OpenRequest(session="a", token_ids=ids, params=params, prompt_logprobs=TOP), None)
    assert reply.length == len(ids)
    assert_prompt_matches(logprobs_from_pb(reply.prompt_logprobs), ids, reference_logprobs(target_fp32, ids), TOP)
    reply = servicer.Open(pb.OpenRequest(session="b", token_ids=ids, params=params), None)
    assert len(reply.prompt_logprobs) == 0
    entries = [TokenLogprob(5, -1.5, ((7, -0.5),), 2), TokenLogprob(6, -0.25)]
    assert logprobs_from_pb(logprobs_to_pb(entries)) == entries


def test_pure_computation_in_chunks():
    rows = torch.randn(7, 11)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    whole = prompt_logprobs(rows, prompt, 2)
    assert prompt_logprobs(rows, prompt, 2, chunk=3) == whole
    logp = torch.log_softmax(rows, dim=-1)
    assert [t.token_id for t in whole] == prompt[1:]
    assert all(abs(t.logprob - logp[i, prompt[i + 1]].item()) < 1e-6 for i, t in enumerate(whole))
    with pytest.raises(ValueError):
        prompt_logprobs(rows, prompt[:-1], 2)


# ---- the OpenAI request and response shapes ---------------------------------------------------------


def _request(**fields) -> CompletionRequest:
    return parse_request(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(), CompletionRequest)


def test_completion_request_fields():
    scoring = _request(echo=True, logprobs=1, max_tokens=0)  # lm-evaluation-harness's loglikelihood
    assert scoring.max_tokens == 0 and scoring.logprob_fields()["prompt_logprobs"] == 1
    assert _request(echo=True).logprob_fields()["prompt_logprobs"] is None  # echo alone scores nothing
    assert _request(echo=True, logprobs=2, prompt_logprobs=4).logprob_fields()["prompt_logprobs"] == 4
    assert _request(prompt_logprobs=0).logprob_fields()["prompt_logprobs"] == 0
    assert _request(prompt_logprobs=0, stream=True).logprob_fields()["prompt_logprobs"] is None  # none streamed
    assert _request(stream=True, echo=True, logprobs=1).logprob_fields()["prompt_logprobs"] == 1
    for fields, param in [(dict(max_tokens=0), "max_tokens"), (dict(prompt_logprobs=2, stream=True), "prompt_logprobs"),
                          (dict(prompt_logprobs=21), "prompt_logprobs")]:
        with pytest.raises(ApiError) as info:
            _request(**fields)
        assert param in info.value.response().body.decode()
    request, decoding = _request(prompt=[[1, 2], [3]], echo=True), type("T", (), {"decode": lambda self, ids: str(ids)})()
    assert [request.echo_text(p, decoding) for p in request.prompts()] == ["[1, 2]", "[3]"]  # each prompt's own text
    assert CompletionRequest.echo_text("hi", decoding) == "hi"


def test_openai_prompt_shapes(tokenizer):
    ids = tokenizer("Hello world")["input_ids"]
    entries = [TokenLogprob(ids[1], -2.0, ((ids[1], -2.0), (42, -3.0)), 1)]
    fmt = LogprobFormat(tokenizer, "completion")
    assert fmt.prompt(entries) == [None, {str(ids[1]): {"logprob": -2.0, "rank": 1, "decoded_token": fmt.token(ids[1])},
                                          "42": {"logprob": -3.0, "rank": 2, "decoded_token": fmt.token(42)}}]
    echoed = fmt.completion([ids[0], *entries, TokenLogprob(7, float("-inf"))])
    assert echoed["tokens"] == [fmt.token(t) for t in (ids[0], ids[1], 7)]
    assert echoed["token_logprobs"] == [None, -2.0, -9999.0] and echoed["top_logprobs"][0] is None
    assert echoed["text_offset"] == [0, len(fmt.token(ids[0])), len(fmt.token(ids[0])) + len(fmt.token(ids[1]))]


# ---- through a served application (called by tests/serving/test_serving.py with its server) --------------------


def _rank_bounds(row: torch.Tensor, token: int, tol: float) -> tuple[int, int]:
    """The ranks a token may have when log probabilities may differ from `row` by `tol` (ties aside)."""
    value = row[token].item()
    return int((row > value + 2 * tol).sum()) + 1, int((row >= value - 2 * tol).sum())


def assert_echo_and_scoring(client: openai.OpenAI, model: str, tokenizer, target_fp32, tol: float = 1e-4) -> None:
    """lm-evaluation-harness's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 0`) returns the prompt
    and its target logprobs (within `tol` of transformers' fp32), nothing generated; `echo` with tokens returns
    prompt + the same generated text as without it, streamed or not; `prompt_logprobs` alone adds vLLM's field;
    the refusals are 400s."""
    ids = list(tokenizer(ECHO_PROMPT)["input_ids"])
    reference = reference_logprobs(target_fp32, ids)
    fmt = LogprobFormat(tokenizer, "completion")

    r = client.completions.create(model=model, prompt=ECHO_PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == ECHO_PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [fmt.token(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, t in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[i + 1] - reference[i, t].item()) < tol, f"prompt position {i + 1}"
        (first, second), best = torch.topk(reference[i], 2).values.tolist(), int(reference[i].argmax())
        assert fmt.token(t) in lp.top_logprobs[i + 1] and len(lp.top_logprobs[i + 1]) <= 2
        assert first - second < 2 * tol or fmt.token(best) in lp.top_logprobs[i + 1]
    served = choice.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(ids)
    for i, t in enumerate(ids[1:]):
        entry = served[i + 1][str(t)]
        assert abs(entry["logprob"] - reference[i, t].item()) < tol and entry["decoded_token"] == fmt.token(t)
        low, high = _rank_bounds(reference[i], t, tol)
        assert low <= entry["rank"] <= high, f"rank at prompt position {i + 1}"

    plain = client.completions.create(model=model, prompt=ECHO_PROMPT, max_tokens=6, temperature=0)
    assert plain.usage.completion_tokens == 6 and plain.choices[0].model_extra.get("prompt_logprobs") is None
    echoed = client.completions.create(model=model, prompt=ECHO_PROMPT, max_tokens=6, temperature=0, echo=True,
                                       logprobs=0)
    assert echoed.choices[0].text == ECHO_PROMPT + plain.choices[0].text
    assert len(echoed.choices[0].logprobs.tokens) == len(ids) + 6 and echoed.usage.completion_tokens == 6
    assert abs(echoed.choices[0].logprobs.token_logprobs[1] - reference[0, ids[1]].item()) < tol
    chunks = list(client.completions.create(model=model, prompt=ECHO_PROMPT, max_tokens=6, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == ECHO_PROMPT and "".join(texts) == ECHO_PROMPT + plain.choices[0].text
    first = next(c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs)
    assert first.token_logprobs[0] is None and len(first.tokens) >= len(ids)
    streamed = list(client.completions.create(model=model, prompt=ECHO_PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ECHO_PROMPT

    scored = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    assert scored.choices[0].text == plain.choices[0].text[: len(scored.choices[0].text)]
    extra = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(extra) == len(ids) and all(len(e) in (2, 3) for e in extra[1:])
    assert scored.choices[0].logprobs is None

    # chat: vLLM's top-level prompt_logprobs, over the templated conversation
    chat_ids = encode_prompt(tokenizer, ECHO_PROMPT, chat=True)
    chat_reference = reference_logprobs(target_fp32, chat_ids)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ECHO_PROMPT}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    served = chat.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(chat_ids) == chat.usage.prompt_tokens
    for i, t in enumerate(chat_ids[1:]):
        assert abs(served[i + 1][str(t)]["logprob"] - chat_reference[i, t].item()) < tol, f"chat prompt position {i + 1}"
    assert "prompt_logprobs" not in chat.choices[0].model_extra

    for kwargs, param in [(dict(max_tokens=0), "max_tokens"),
                          (dict(max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=ECHO_PROMPT, **kwargs)
        assert info.value.param == param
