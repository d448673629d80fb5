"""Logprobs under speculation: every emitted token's logprob is the target's (fp32 transformers'
log-softmax at that position; processed mode: the distribution it was drawn from, computed here
independently), for the default drafter, token trees and the pipelined loop; asking for them changes no
token and keeps speculation on; they cross gRPC, stop at a stop string, and are released with the text
that carries them."""

from __future__ import annotations

import pytest
import torch

from cluster.core.config import EngineConfig
from cluster.core.logprobs import TokenLogprob, token_logprobs
from cluster.core.sampling import SamplingParams
from cluster.model.verifier import RoundResult
from cluster.session.speculate import SpeculativeDecoder
from cluster.wire.codec import params_from_pb, params_to_pb, result_from_pb, result_to_pb
from deployments.openai_logprobs import LogprobFormat
from deployments.router import IncrementalText
from drafts.draft_model import DraftModelProposer
from drafts.factory import make_proposer
from tests.helpers import SiblingOracleProposer

MAX_TOKENS = 16
TOP = 5
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("What is the capital of France?", True),
]


@pytest.fixture(scope="module")
def hybrid(target_fp32, tokenizer):
    return make_proposer(EngineConfig.build(proposer="hybrid", dtype="float32"), target_fp32, tokenizer)


def _logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' fp32 logits at each output token's position  # [len(output), vocab_size]"""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)]


def _penalized(logits: torch.Tensor, prompt: list[int], output: list[int], penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty at each output position, written out here: a token of the prompt or of the
    output before that position has its logit divided by the penalty when positive, else multiplied."""
    rows = logits.clone()
    for j in range(len(output)):
        seen = sorted(set(prompt + output[:j]))
        row = rows[j, seen]
        rows[j, seen] = torch.where(row > 0, row / penalty, row * penalty)
    return rows


def _assert_matches(result, reference: torch.Tensor, top: int = TOP) -> None:
    """reference  # [m, vocab_size] log probabilities the result's logprobs must equal."""
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for j, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        assert entry.token_id == token
        assert abs(entry.logprob - reference[j, token].item()) < 1e-4, f"position {j}"
        expected = torch.topk(reference[j], top)
        assert [i for i, _ in entry.top] == expected.indices.tolist(), f"position {j}"
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top, expected.values.tolist())) < 1e-4


@pytest.mark.parametrize("kind", ["hybrid", "sibling-tree", "pipelined"])
def test_greedy_raw_logprobs_are_the_targets(kind, target_fp32, target_runner, draft_runner, tokenizer,
                                              prompt_ids, references, request):
    """The default drafter (hybrid); token trees whose every round a sibling wins (emitted token j > 0 from
    the row after node_path[j - 1]); the pipelined chain (rows from the previous round's forward)."""
    if kind == "hybrid":
        decoder = SpeculativeDecoder(target_runner, request.getfixturevalue("hybrid"), tokenizer, 3)
    elif kind == "sibling-tree":
        decoder = SpeculativeDecoder(target_runner, SiblingOracleProposer(references, target_runner.vocab_size),
                                     tokenizer, 3)
    else:
        decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 3, pipeline_depth=2)
    for ids in prompt_ids if kind == "hybrid" else prompt_ids[:1]:
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP))
        assert result.token_ids == references[tuple(ids)], f"{kind}: logprobs changed the tokens"
        assert result.stats.drafted > 0, f"{kind}: speculation must stay on"
        _assert_matches(result, torch.log_softmax(_logits(target_fp32, ids, result.token_ids), dim=-1))
    if kind == "sibling-tree":
        assert decoder.metrics.tree_rounds == decoder.metrics.tree_branch_hits > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_processed_logprobs_with_a_repetition_penalty(temperature, target_fp32, target_runner, draft_runner,
                                                       tokenizer, prompt_ids):
    """Processed mode: the penalized distribution (then temperature and top-k when sampled); raw mode on the
    same request still reports the raw log-softmax."""
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner, tree_width=2), tokenizer, 3)
    ids = prompt_ids[0]
    base = dict(max_tokens=MAX_TOKENS, repetition_penalty=1.3, temperature=temperature, top_k=40, seed=7)
    processed = decoder.generate(ids, SamplingParams(**base, logprobs=TOP, logprobs_mode="processed_logprobs"))
    raw = decoder.generate(ids, SamplingParams(**base, logprobs=TOP))
    plain = decoder.generate(ids, SamplingParams(**base))
    assert processed.token_ids == raw.token_ids == plain.token_ids and plain.stats.drafted > 0
    logits = _logits(target_fp32, ids, raw.token_ids)
    rows = _penalized(logits, ids, raw.token_ids, 1.3)
    if temperature:
        rows = rows / temperature
        kth = torch.topk(rows, 40, dim=-1).values[:, -1:]
        rows = rows.masked_fill(rows < kth, float("-inf"))
    _assert_matches(processed, torch.log_softmax(rows, dim=-1))
    _assert_matches(raw, torch.log_softmax(logits, dim=-1))
    assert max(abs(a.logprob - b.logprob) for a, b in zip(processed.logprobs, raw.logprobs)) > 1e-3


def test_sampled_tokens_unchanged_by_logprobs(target_runner, draft_runner, tokenizer, prompt_ids):
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 3, pipeline_depth=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=3)
    asked = decoder.generate(prompt_ids[1], params.model_copy(update={"logprobs": 2}))
    plain = decoder.generate(prompt_ids[1], params)
    assert asked.token_ids == plain.token_ids and plain.logprobs is None  # none asked, none computed
    assert len(asked.logprobs) == len(asked.token_ids) and asked.stats.drafted > 0


def test_a_stop_string_keeps_the_logprobs_of_the_kept_tokens(target_runner, draft_runner, tokenizer, prompt_ids,
                                                            references):
    ref = references[tuple(prompt_ids[0])]
    stop = tokenizer.decode(ref[5:7])
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 4)
    result = decoder.generate(prompt_ids[0], SamplingParams(max_tokens=MAX_TOKENS, stop=[stop], logprobs=0))
    assert result.finish_reason == "stop" and len(result.token_ids) < len(ref)
    assert [t.token_id for t in result.logprobs] == result.token_ids and all(t.top == () for t in result.logprobs)


def test_pure_computation_and_the_wire():
    rows = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]])
    params = SamplingParams(logprobs=2, temperature=0.5, top_k=2, logprobs_mode="processed_logprobs")
    out = token_logprobs(rows, [1, 0], params)
    expected = torch.log_softmax(torch.tensor([4.0, 2.0]), dim=-1)
    assert abs(out[0].logprob - expected[1].item()) < 1e-6 and out[0].top[0][0] == 0
    assert out[1].logprob == float("-inf") and out[1].top[0][0] == 1  # top-k left token 0 out of row 1
    raw = token_logprobs(rows, [1, 0], params.model_copy(update={"logprobs_mode": "raw_logprobs"}))
    assert abs(raw[0].logprob - torch.log_softmax(rows[0], dim=-1)[1].item()) < 1e-6
    assert params_from_pb(params_to_pb(params)) == params
    assert params_from_pb(params_to_pb(SamplingParams())).logprobs is None
    result = RoundResult("s", 1, 0, 1, [1, 0], logprobs=out)
    assert result_from_pb(result_to_pb(result))[0].logprobs == out
    assert result_from_pb(result_to_pb(RoundResult("s", 2, 0, stale=True)))[0].logprobs is None


def test_settled_tokens_follow_the_text_sent(tokenizer):
    ids = tokenizer("Hello world, the stop word is here and more")["input_ids"]
    text = IncrementalText(tokenizer, ["stop word"])
    counts = []
    for n in range(1, len(ids) + 1):
        text.update(ids[:n])
        counts.append(text.settled(ids[:n]))
        covered = tokenizer.decode(ids[:counts[-1]])
        assert text.sent.startswith(covered) and len(covered) <= len(text.sent)
    assert counts == sorted(counts) and counts[-1] < len(ids)  # the stop string's tokens are held back
    llama = tokenizer("a🦙", add_special_tokens=False)["input_ids"]
    assert len(llama) == 4, "a character spread over three tokens"
    text = IncrementalText(tokenizer, [])
    for n, settled in ((1, 1), (2, 1), (3, 1), (4, 4)):  # an incomplete character is not covered yet
        text.update(llama[:n])
        assert text.settled(llama[:n]) == settled


def test_openai_shapes(tokenizer):
    entries = [TokenLogprob(tokenizer("Hi")["input_ids"][0], -0.5, ((5, -0.1), (6, float("-inf"))))]
    chat = LogprobFormat(tokenizer, "chat")(entries)
    token = tokenizer.decode(entries[0].token_id)
    assert chat == {"content": [{"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                                 "top_logprobs": [{"token": tokenizer.decode([5]), "logprob": -0.1,
                                                   "bytes": list(tokenizer.decode([5]).encode())},
                                                  {"token": tokenizer.decode([6]), "logprob": -9999.0,
                                                   "bytes": list(tokenizer.decode([6]).encode())}]}]}
    completion = LogprobFormat(tokenizer, "completion")(entries * 2, text_offset=3)
    assert completion["tokens"] == [token, token] and completion["token_logprobs"] == [-0.5, -0.5]
    assert completion["text_offset"] == [3, 3 + len(token)]
    assert completion["top_logprobs"][0] == {token: -0.5, tokenizer.decode([5]): -0.1, tokenizer.decode([6]): -9999.0}
