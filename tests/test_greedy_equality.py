"""Greedy output is token-identical to transformers' generate(do_sample=False), in fp32, for every
proposer, an always-right and an always-wrong drafter; EOS and max_tokens stops included."""

from __future__ import annotations

import inspect
import json.decoder

import pytest

from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer
from drafts.ngram import NGramProposer, SuffixProposer
from tests.helpers import OracleProposer, SiblingOracleProposer

MAX_TOKENS = 48  # both stops still occur (asserted below); each prompt is still ~10 rounds at γ 4


def _long_code_prompt() -> str:
    return inspect.getsource(json.decoder)[:1900] + "\n\ndef parse_number(text):\n"


def _long_prose_prompt() -> str:
    paragraph = ("The river wound through the valley, past orchards and old stone mills, carrying the "
                 "snowmelt of the mountains down towards the sea. Every spring the villagers gathered on "
                 "its banks to mark the return of the swallows. ")
    return paragraph * 9 + "That year, however,"


PROMPTS = [  # (text, chat template?)
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
     "    \"\"\" Check if any two numbers are closer than threshold.\"\"\"\n", False),
    ("import os\n\nfor root, dirs, files in os.walk('.'):\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    (_long_code_prompt(), False),
    ("Once upon a time, in a small village by the sea,", False),
    ("The three most important inventions of the twentieth century are", False),
    (_long_prose_prompt(), False),
    ("What is the capital of France?", True),
    ("Write a short poem about the moon.", True),
    ("Explain recursion to a beginner.", True),
    ("List three fruits.", True),
]


@pytest.fixture(scope="module")
def target_runner(engine_fp32):
    """One target runner (and one draft runner) for the module's decoders, with the served default's prompt
    cache: the first test to open a prompt prefills it, the later ones copy that KV, bit for bit the prefill's
    (`test_prompt_cache.py`), so every test decodes from exactly what a prefill gives. Every test still releases
    every session (asserted)."""
    return TorchModelRunner(engine_fp32, name="target", prompt_cache_tokens=PROMPT_CACHE_TOKENS)


@pytest.fixture(scope="module")
def draft_runner(draft_int8):
    return TorchModelRunner(draft_int8, name="draft", prompt_cache_tokens=PROMPT_CACHE_TOKENS)


def test_workload_covers_long_contexts_and_both_stops(prompt_ids, references, target_fp32):
    assert max(len(ids) for ids in prompt_ids) >= 450
    eos = target_fp32.generation_config.eos_token_id
    endings = [ref[-1] == eos and len(ref) < MAX_TOKENS for ref in references.values()]
    assert any(endings), "no prompt ends with EOS: the EOS stop is not exercised"
    assert not all(endings), "every prompt ends with EOS: the max_tokens stop is not exercised"


def _make_proposer(kind, draft_runner, references, vocab):
    if kind == "draft":
        return DraftModelProposer(draft_runner)
    if kind == "ngram":
        return NGramProposer()
    if kind == "suffix":
        return SuffixProposer()
    if kind == "none":
        return None
    return OracleProposer(references, vocab, wrong=(kind == "always-wrong"))


# the other proposers' share of the workload: short and long code and prose, chat, both EOS endings
SUBSET = (0, 4, 6, 7, 8, 10)


@pytest.mark.parametrize("kind", ["draft", "ngram", "suffix", "none", "always-right", "always-wrong"])
def test_greedy_equals_transformers(kind, target_runner, draft_runner, tokenizer, prompt_ids, references):
    proposer = _make_proposer(kind, draft_runner, references, target_runner.vocab_size)
    decoder = SpeculativeDecoder(target_runner, proposer, tokenizer, num_speculative_tokens=4)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    drafted = accepted = 0
    prompts = prompt_ids if kind == "draft" else [prompt_ids[i] for i in SUBSET]
    eos = target_runner.model.generation_config.eos_token_id
    ends = {references[tuple(ids)][-1] == eos for ids in prompts}
    assert ends == {True, False} and max(map(len, prompts)) >= 450, "both stops and a long context, every kind"
    for ids in prompts:
        result = decoder.generate(ids, params)
        reference = references[tuple(ids)]
        assert result.token_ids == reference, f"{kind}: diverged on prompt {ids[:8]}..."
        assert result.finish_reason == ("length" if len(reference) == MAX_TOKENS and reference[-1] != 2 else "stop")
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert target_runner.num_sessions == 0, "sessions must be released"
    if kind == "always-right":
        assert accepted == drafted > 0
    if kind == "always-wrong":
        assert accepted == 0 and drafted > 0
    if kind == "draft":
        assert accepted > 0.3 * drafted
    if kind in ("ngram", "suffix"):
        assert 0 < accepted < drafted  # both the accept and the reject paths ran


@pytest.mark.parametrize("gamma", [1, 8])
def test_greedy_equality_other_draft_lengths(gamma, target_runner, draft_runner, tokenizer, prompt_ids, references):
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, gamma)
    for ids in prompt_ids[:3] + prompt_ids[8:9]:
        assert decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids == references[tuple(ids)]


def test_max_tokens_cuts_exactly(target_runner, draft_runner, tokenizer, prompt_ids, references):
    decoder = SpeculativeDecoder(target_runner, DraftModelProposer(draft_runner), tokenizer, 4)
    ids = prompt_ids[0]
    for n in (1, 2, 17):
        result = decoder.generate(ids, SamplingParams(max_tokens=n))
        assert result.token_ids == references[tuple(ids)][:n] and result.finish_reason == "length"


def test_stop_strings_end_the_text(target_runner, tokenizer, prompt_ids, references):
    decoder = SpeculativeDecoder(target_runner, NGramProposer(), tokenizer, 4)
    ids = prompt_ids[5]
    full = tokenizer.decode(references[tuple(ids)], skip_special_tokens=True)
    stop = full[20:24]
    assert stop.strip(), "pick a visible stop string"
    result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, stop=[stop]))
    assert result.finish_reason == "stop"
    assert result.text == full[: full.find(stop)]
    assert result.token_ids == references[tuple(ids)][: len(result.token_ids)]
    assert stop in tokenizer.decode(result.token_ids) and stop not in tokenizer.decode(result.token_ids[:-1])


# The real draft fills every bubble (0.0): at the default 0.5 whether a fill happens depends on the draft's
# measured cost against the verifier's, i.e. on the machine's timing (CI once saw one fill in 110 rounds).
@pytest.mark.parametrize("kind,overlap,fill_min_redraft", [
    ("draft", True, 0.0), ("always-right", False, 0.5), ("always-wrong", False, 0.0), ("always-wrong", False, 0.5),
    ("ngram", False, 0.5)])
def test_pipelined_loop_greedy_equals_transformers(kind, overlap, fill_min_redraft, target_runner, draft_runner,
                                                   tokenizer, prompt_ids, references):
    """The router's pipelined chain (depth 2, bubble filling where the draft is slow enough), in process."""
    proposer = _make_proposer(kind, draft_runner, references, target_runner.vocab_size)
    decoder = SpeculativeDecoder(target_runner, proposer, tokenizer, num_speculative_tokens=3, pipeline_depth=2,
                                 overlap=overlap, fill_min_redraft=fill_min_redraft)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    drafted = accepted = 0
    # the oracles and n-grams on a code, a prose and a chat prompt (EOS included); the real draft on six
    prompts = prompt_ids[:4] + prompt_ids[8:10] if kind == "draft" else [prompt_ids[i] for i in (0, 5, 8)]
    for ids in prompts:
        result = decoder.generate(ids, params)
        assert result.token_ids == references[tuple(ids)], f"{kind}: diverged on prompt {ids[:8]}..."
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert target_runner.num_sessions == 0 and decoder.engine.num_sessions == 0, "sessions must be released"
    metrics = decoder.metrics
    if kind == "always-right":
        assert accepted == drafted > 0 and metrics.bubble_fills == 0
    if kind == "always-wrong" and fill_min_redraft == 0:
        # every round is rejected: each later round goes stale or starts with a bubble fill that misses
        assert accepted == 0 and metrics.bubble_fill_misses > 0 and metrics.bubble_fill_hits == 0
    if kind == "always-wrong" and fill_min_redraft > 0:
        # an instant drafter (c ≈ 0): the verifier waits for the redraft instead of a plain step
        assert accepted == 0 and metrics.bubble_fills == 0 and metrics.stale_rounds > 0
    if kind == "draft":
        assert metrics.bubble_fill_hits > 0 and metrics.bubble_fill_misses > 0 and metrics.stale_rounds > 0


@pytest.mark.parametrize("kind", ["draft", "sibling-oracle"])
def test_token_tree_rounds_greedy_equal_transformers(kind, target_runner, draft_runner, tokenizer, prompt_ids,
                                                     references):
    """Sequential rounds as token trees (siblings at the first draft position, one tree-masked forward)."""
    if kind == "draft":
        proposer = DraftModelProposer(draft_runner, tree_width=2)
    else:
        proposer = SiblingOracleProposer(references, target_runner.vocab_size)
    decoder = SpeculativeDecoder(target_runner, proposer, tokenizer, num_speculative_tokens=3)
    for ids in prompt_ids[:5] + prompt_ids[8:10]:
        result = decoder.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert result.token_ids == references[tuple(ids)], f"{kind}: diverged on prompt {ids[:8]}..."
    m = decoder.metrics
    assert m.tree_rounds > 0 and decoder.engine.num_sessions == 0
    if kind == "sibling-oracle":  # every tree round is won by the sibling, then a bonus token
        assert m.tree_branch_hits == m.tree_rounds
    else:
        assert 0 < m.tree_branch_hits < m.tree_rounds

