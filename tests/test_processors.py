"""Logits processors (penalties, min_p, logit_bias, min_tokens, stop_token_ids, bad_words,
allowed_token_ids): each on synthetic logits against a hand-computed expectation; speculative decoding with
them token-identical to transformers' generate with the same processors (fp32 SmolLM2) or, where
transformers has none, to tandem's plain decoding; sampled output following the processed target
distribution (exact enumeration on a tiny model), and a check that this test can fail."""

from __future__ import annotations

import math

import pytest
import torch

import cluster.model.verifier as verifier_module
from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.core.errors import InvalidRequestError
from cluster.core.processors import process_chain, process_rows, process_sequence, tokenize_bad_words
from cluster.core.sampling import SamplingParams, probabilities
from cluster.core.stopping import StopChecker, output_text, text_options
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from cluster.wire.codec import params_from_pb, params_to_pb
from deployments.router import IncrementalText
from drafts.draft_model import DraftModelProposer
from tests.helpers import OracleProposer, tiny_llama
from tests.test_sampling_e2e import FALSE_ALARM, chi_square_pvalue

NINF = float("-inf")
V = 6


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)])  # [1, V]


# ---- each processor on synthetic logits -----------------------------------------------------------


def test_defaults_return_the_logits_themselves():
    logits = torch.randn(3, V)
    assert process_chain(logits, SamplingParams(), [1], [2], [3, 4]) is logits
    assert not SamplingParams().processes_logits


def test_presence_and_frequency_penalties_count_the_output_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_rows(_row(1, 1, 1, 1, 1, 1), params, prompt_ids=[4], output_ids=[1, 1, 2], suffixes=[[]])
    # token 1: twice (1 - 0.5 - 2 * 0.25), token 2: once (1 - 0.5 - 0.25), token 4 is only in the prompt
    assert out[0].tolist() == [1, 0.0, 0.25, 1, 1, 1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    params = SamplingParams(repetition_penalty=2.0)
    out = process_rows(_row(4, -4, 4, -4, 4, 4), params, prompt_ids=[0, 1], output_ids=[2, 3, 3], suffixes=[[]])
    assert out[0].tolist() == [2, -8, 2, -8, 4, 4]


def test_a_repetition_penalty_near_zero_keeps_the_distribution_finite():
    """A penalty near 0 divides a positive logit past float32's range; it becomes the largest finite value, so p
    and q stay distributions (the schema fuzzing sent 5e-324: the verifier refused the drafter's NaN q, a 500)."""
    params = SamplingParams(repetition_penalty=5e-324, temperature=0.5)
    out = process_rows(_row(4, -4, 3, 0, 1, 2), params, prompt_ids=[0, 1], output_ids=[2], suffixes=[[]])
    assert torch.isfinite(out).all() and out[0, 0] == out[0, 2] == torch.finfo(torch.float32).max
    assert out[0, 1] == 0 and out[0, 3:].tolist() == [0, 1, 2]  # -4 * 5e-324 is -0.0: the rest as they were
    probs = probabilities(out, params)[0]
    assert torch.isfinite(probs).all() and probs.tolist() == pytest.approx([0.5, 0, 0.5, 0, 0, 0])
    assert int(out[0].argmax()) == 0  # greedy: the first of the tied largest


def test_logit_bias_min_tokens_allowed_ids():
    params = SamplingParams(logit_bias={0: 2.5, 5: -100}, max_tokens=8)
    assert process_rows(_row(0, 0, 0, 0, 0, 0), params, [], [], [[]])[0].tolist() == [2.5, 0, 0, 0, 0, -100]
    params = SamplingParams(allowed_token_ids=[1, 3], max_tokens=8)
    assert process_rows(_row(1, 2, 3, 4, 5, 6), params, [], [], [[]])[0].tolist() == [NINF, 2, NINF, 4, NINF, NINF]
    # min_tokens holds back EOS (the model's, from for_session) and stop_token_ids until 2 output tokens
    params = SamplingParams(min_tokens=2, stop_token_ids=[4], max_tokens=8).for_session(1, [5])
    out = process_rows(torch.zeros(3, V), params, [0], [], [[], [1], [1, 2]])
    assert out[0].tolist() == out[1].tolist() == [0, 0, 0, 0, NINF, NINF] and out[2].tolist() == [0] * V
    ignoring = params.model_copy(update={"ignore_eos": True})  # then only the stop ids are held back
    assert process_rows(torch.zeros(1, V), ignoring, [0], [], [[]])[0].tolist() == [0, 0, 0, 0, NINF, 0]


def test_bad_words_mask_the_last_token_where_the_output_ends_with_the_rest():
    params = SamplingParams(bad_words=[[3], [1, 2], [0, 1, 4]])
    rows = process_rows(torch.zeros(3, V), params, [0, 1], [5], [[], [1], [0, 1]])
    assert rows[0].tolist() == [0, 0, 0, NINF, 0, 0]  # the prompt is not looked at (vLLM)
    assert rows[1].tolist() == [0, 0, NINF, NINF, 0, 0]
    assert rows[2].tolist() == [0, 0, NINF, NINF, NINF, 0]


def test_a_position_left_without_any_token_falls_back_to_the_raw_logits():
    params = SamplingParams(allowed_token_ids=[4], bad_words=[[4]])
    logits = torch.arange(V, dtype=torch.float32)[None]
    assert process_rows(logits, params, [], [], [[]])[0].tolist() == logits[0].tolist()


def test_each_draft_row_sees_the_output_plus_the_earlier_drafts():
    params = SamplingParams(frequency_penalty=1.0)
    rows = process_chain(torch.zeros(4, V), params, [0], [2], [2, 3, 2])
    assert rows[:, 2].tolist() == [-1, -2, -2, -3] and rows[:, 3].tolist() == [0, 0, -1, -1]
    # process_sequence splits the sequence at the prompt length
    split = process_sequence(torch.zeros(1, V), params.for_session(2, []), [0, 2, 2, 3])
    assert split[0].tolist() == [0, 0, -1, -1, 0, 0]


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0, 0.0]]) + 1e-30)
    probs = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.35))[0]  # threshold 0.175
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0, 0, 0, 0]))


@pytest.mark.parametrize("fields,needle", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(logit_bias={1: 101}), "logit_bias"), (dict(min_tokens=9), "min_tokens"),
    (dict(bad_words=[[]]), "bad_words"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids")])
def test_out_of_range_values_are_refused(fields, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams.build(max_tokens=8, **fields)


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=[[1, 99]]).check_vocab(50)


def test_the_wire_carries_every_field():
    params = SamplingParams(max_tokens=9, temperature=0.5, presence_penalty=0.3, frequency_penalty=-0.2,
                            repetition_penalty=1.1, min_p=0.05, logit_bias={3: 1.5, 7: -100.0}, min_tokens=2,
                            stop_token_ids=[5], bad_words=[[1, 2], [4]], allowed_token_ids=[1, 2, 3, 4, 5, 7],
                            seed=3, include_stop_str_in_output=True, skip_special_tokens=False).for_session(12, [2, 0])
    assert params_from_pb(params_to_pb(params)) == params
    assert params_from_pb(params_to_pb(SamplingParams())) == SamplingParams()


def test_the_wire_carries_the_cache_salt_set_and_unset():
    salted = SamplingParams(max_tokens=9, cache_salt="tenant-a ü")
    assert params_to_pb(salted).cache_salt == "tenant-a ü" and params_from_pb(params_to_pb(salted)) == salted
    assert not params_to_pb(SamplingParams()).HasField("cache_salt")  # unset stays unset: the unsalted pool
    assert params_from_pb(params_to_pb(SamplingParams())).cache_salt is None
    empty = params_to_pb(SamplingParams())
    empty.cache_salt = ""  # set but empty (vLLM refuses it too): refused by the verifier's port, not read as unset
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        params_from_pb(empty)


def test_stop_token_ids_end_generation_and_min_tokens_holds_back_stop_strings(tokenizer):
    checker = StopChecker(tokenizer, [2], SamplingParams(stop_token_ids=[7], ignore_eos=True, max_tokens=9))
    output: list[int] = []
    assert checker.commit(output, [4, 7, 5]) == "stop" and output == [4, 7]
    ids = tokenizer("a b a b")["input_ids"]
    checker = StopChecker(tokenizer, [], SamplingParams(stop=["a"], min_tokens=3, max_tokens=9))
    output = []
    assert checker.commit(output, ids) == "stop" and len(output) == 3  # the first "a" (token 1) is too early
    assert checker.text(output) == "a b "  # and stays in the text: the cut is at the "a" that stopped it
    assert IncrementalText(tokenizer, ["a"], min_tokens=3).full(output) == "a b "
    # a stop string only inside the held-back tokens neither stops nor cuts
    ids = tokenizer("a b c d")["input_ids"]
    output = []
    assert checker.commit(output, ids) is None and checker.text(output) == "a b c d"


def test_text_options_keep_the_stop_and_special_tokens_as_vllm_does(tokenizer):
    """`include_stop_str_in_output` cuts after the stop string (the one that ends first) and keeps a final
    stop token id's or EOS's text; `skip_special_tokens: false` writes special tokens' text; an ending EOS's
    only with the stop kept (vLLM's detokenizer leaves the stop-terminating token out)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer("Hello world. Bye now")["input_ids"]
    text = tokenizer.decode(ids)
    assert output_text(tokenizer, ids, ["world", "Bye"]) == "Hello "
    assert output_text(tokenizer, ids, ["world", "Bye"], include_stop=True) == "Hello world"
    assert output_text(tokenizer, ids, ["o w", "Hello"], include_stop=True) == "Hello"  # ends first, not starts
    with_eos = [*ids, eos]
    assert output_text(tokenizer, with_eos, eos_token_ids=[eos]) == text
    assert output_text(tokenizer, with_eos, eos_token_ids=[eos], skip_special_tokens=False) == text
    assert output_text(tokenizer, with_eos, eos_token_ids=[eos], skip_special_tokens=False,
                       include_stop=True) == text + "<|im_end|>"
    middle = [eos, *ids]  # ignore_eos: an EOS inside the output is text like any special token
    assert output_text(tokenizer, middle, skip_special_tokens=False) == "<|im_end|>" + text
    assert output_text(tokenizer, middle) == text
    stop_id = ids[2]  # a stop token id that is an ordinary token: its text is kept only with the stop
    assert output_text(tokenizer, ids[:3], stop_token_ids=[stop_id]) == tokenizer.decode(ids[:2])
    assert output_text(tokenizer, ids[:3], stop_token_ids=[stop_id], include_stop=True) == tokenizer.decode(ids[:3])
    # the options as a request sets them, and the streamed text: never held back when the stop is kept
    params = SamplingParams(stop=["Bye"], include_stop_str_in_output=True, skip_special_tokens=False)
    assert text_options(params, [eos]) == {"include_stop": True, "skip_special_tokens": False, "eos_token_ids": (eos,)}
    assert text_options(params.model_copy(update={"ignore_eos": True}), [eos])["eos_token_ids"] == ()
    streamed = IncrementalText.of(tokenizer, params, [eos])
    deltas = [streamed.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(deltas) == "Hello world. Bye" and deltas[0] == tokenizer.decode(ids[:1])
    checker = StopChecker(tokenizer, [eos], params)
    output: list[int] = []
    assert checker.commit(output, ids) == "stop" and checker.text(output) == "Hello world. Bye"


def test_bad_words_are_tokenized_as_vllm_does(tokenizer):
    plain = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert tokenize_bad_words(tokenizer, [" hello"]) == [plain, spaced]  # left-stripped, then both forms
    with pytest.raises(InvalidRequestError, match="bad_words"):
        tokenize_bad_words(tokenizer, [" "])


# ---- greedy equality on SmolLM2 (fp32) ---------------------------------------------------------------

MAX_TOKENS = 16
PROMPTS = [("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
           ("What is the capital of France?", True)]


def _hf(model, ids, **processors) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_TOKENS, **processors)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def cases(target_fp32, prompt_ids, references):
    """(prompt, SamplingParams, reference: transformers' output with the same processors or None (plain
    decoding is the reference)) for each prompt and processor set."""
    out = []
    for ids in prompt_ids:
        plain = references[tuple(ids)]
        a = min(8, len(plain) - 2)
        assert ids[-1] != plain[a], "a bad word's prefix across the prompt would differ from transformers"
        words = [[plain[3]], [plain[a], plain[a + 1]]]
        out.append((ids, SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.3, bad_words=words),
                    _hf(target_fp32, ids, repetition_penalty=1.3, bad_words_ids=words)))
        bias = {plain[0]: -30.0, plain[5]: 4.0}
        min_tokens = min(MAX_TOKENS, len(plain) + 4)
        out.append((ids, SamplingParams(max_tokens=MAX_TOKENS, logit_bias=bias, min_tokens=min_tokens),
                    _hf(target_fp32, ids, sequence_bias=[[[t], b] for t, b in bias.items()], min_new_tokens=min_tokens)))
        allowed = sorted(set(ids) | set(plain) - {plain[2]})
        out.append((ids, SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.8, frequency_penalty=0.6, min_p=0.2,
                                        allowed_token_ids=allowed, stop_token_ids=[plain[min(12, len(plain) - 1)]]),
                    None))
    return out


@pytest.fixture(scope="module")
def expected(cases, engine_fp32, tokenizer) -> list[list[int]]:
    """Each case's reference: transformers' where it has the processors, else tandem's plain decoding."""
    plain = SpeculativeDecoder(TorchModelRunner(engine_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS), None, tokenizer, 0)
    return [ref if ref is not None else plain.generate(ids, params).token_ids for ids, params, ref in cases]


def test_processors_change_the_output(cases, references):
    changed = [ref != references[tuple(ids)] for ids, _, ref in cases if ref is not None]
    assert all(changed), "every transformers processor set must change the greedy output"


@pytest.mark.parametrize("kind", ["always-wrong", "draft-tree"])
def test_greedy_with_processors_equals_the_reference(kind, cases, expected, engine_fp32, draft_runner, tokenizer):
    target = TorchModelRunner(engine_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS)
    drafted = accepted = tree_rounds = 0
    for (ids, params, _), want in zip(cases, expected):
        if kind == "always-wrong":  # proposes a token that is never the reference's
            proposer = OracleProposer({tuple(ids): want}, target.vocab_size, wrong=True)
        else:
            proposer = DraftModelProposer(draft_runner, tree_width=2 if kind == "draft-tree" else 1)
        decoder = SpeculativeDecoder(target, proposer, tokenizer, num_speculative_tokens=4)
        result = decoder.generate(ids, params)
        tree_rounds += decoder.metrics.tree_rounds
        assert result.token_ids == want, f"{kind}: diverged with {params.model_dump(exclude_defaults=True)}"
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert drafted > 0 and (accepted == 0 if kind == "always-wrong" else accepted > 0.2 * drafted)
    assert (tree_rounds > 0) == (kind == "draft-tree")


# ---- sampling follows the processed target distribution ------------------------------------------

PROMPT = [1, 4, 2, 7]
SAMPLES = 1500  # continuations per chi-square test
SAMPLED = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.6,
                         min_p=0.03, logit_bias={3: 1.5, 5: -2.0}, max_tokens=3)


def _exact(model, params: SamplingParams, length: int) -> dict[tuple, float]:
    """P(continuation) of every continuation, the target's processed distribution at each step."""
    probs = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            prefixes = list(probs)
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]  # [n, vocab]
            rows = torch.cat([process_rows(logits[i: i + 1], params, PROMPT, list(p), [[]])
                              for i, p in enumerate(prefixes)])
            nxt = probabilities(rows, params)
            probs = {p + (t,): probs[p] * float(nxt[i, t]) for i, p in enumerate(prefixes)
                     for t in range(nxt.shape[-1]) if nxt[i, t] > 0}
    return probs


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_llama(seed=1), tiny_llama(seed=2)


def _samples(tiny_pair, n: int, tree_width: int = 1) -> list[tuple]:
    target, draft = tiny_pair
    decoder = SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=PROMPT_CACHE_TOKENS), DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS),
                                                                              tree_width=tree_width), None, 2)
    return [tuple(decoder.generate(PROMPT, SAMPLED.model_copy(update={"seed": i})).token_ids) for i in range(n)]


@pytest.mark.parametrize("tree_width", [1, 2], ids=["chain", "tree"])
def test_sampling_with_processors_follows_the_processed_target(tiny_pair, tree_width):
    exact = _exact(tiny_pair[0], SAMPLED, 3)
    assert chi_square_pvalue(_samples(tiny_pair, SAMPLES, tree_width), exact) > FALSE_ALARM


def test_the_sampling_test_fails_when_only_q_is_processed(tiny_pair, monkeypatch):
    monkeypatch.setattr(verifier_module, "process_sequence", lambda logits, *args, **kwargs: logits)
    exact = _exact(tiny_pair[0], SAMPLED, 3)
    samples = _samples(tiny_pair, SAMPLES)
    # the same check as above rejects: a continuation the processed target never gives, or a tiny p-value
    impossible = sum(s not in exact for s in samples)
    assert impossible > 0 or chi_square_pvalue(samples, exact) < 1e-6
