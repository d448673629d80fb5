"""OpenAI's Predicted Outputs (`SamplingParams.prediction`) as drafts in the session loop: the drafts follow the
prediction and come back to it after an edit; greedy output equals plain decoding's whatever the prediction;
sampled output follows the target's distribution, also where the prediction is an earlier output of the same
seed (the seed is mixed with the prediction where a request enters); usage counts the prediction's tokens."""

from __future__ import annotations

import json
import re

import pytest

from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.core.sampling import SamplingParams, prediction_seed
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from deployments.cli import main
from deployments.openai_prediction import Prediction, prediction_details
from drafts.draft_model import DraftModelProposer
from drafts.hybrid import HybridProposer
from drafts.prediction import PredictionMatch, prediction_prices
from tests.helpers import tiny_llama, torch_threads
from tests.test_sampling_e2e import FALSE_ALARM, chi_square_pvalue, exact_continuation_probs

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_drafts_follow_the_prediction_and_come_back_after_an_edit():
    m = PredictionMatch([5, 6, 7, 8, 9, 5, 6, 10, 11], prediction_prices(max_tokens=3))
    assert m.propose([], 8) == ([5, 6, 7], PredictionMatch.max_match)  # nothing written yet: the prediction's start
    assert m.propose([5, 6], 8) == ([7, 8, 9], PredictionMatch.max_match)  # still on it
    assert m.propose([5, 6], 2)[0] == [7, 8]  # the loop's limit
    assert m.propose([5, 6, 7, 8, 9, 5, 6, 10, 11], 8) == ([], 0)  # all of it written
    assert m.propose([5, 6, 3], 8) == ([], 0)  # an edit: nothing matches yet
    assert m.propose([5, 6, 3, 8, 9], 8) == ([5, 6, 10], 2)  # back on it: a 2-token match
    assert m.propose([5, 6, 3, 9], 8) == ([], 0)  # a 1-token match is not enough
    # a repeated stretch is placed by what came before it (the match extends back)
    m = PredictionMatch([1, 2, 3, 4, 9, 1, 2, 3, 4, 7], prediction_prices(max_tokens=2))
    assert m.propose([0, 9, 1, 2, 3, 4], 8) == ([7], 5)


def test_drafts_are_priced_by_their_verdicts():
    """A prediction the answer does not follow loses its short matches' drafts; the aligned case keeps its long ones,
    and a fuller step pays less (the same prices as suffix matches)."""
    prices = prediction_prices(max_tokens=8, threshold=0.1, per_row=0.04)
    m = PredictionMatch(list(range(100, 140)), prices)
    assert len(m.propose([100, 101], 8)[0]) == 8 and len(m.propose([7, 120, 121], 8)[0]) == 5  # m=2: 5 pay
    assert len(m.propose([7, 120, 121], 8, rows=16)[0]) < 5  # 16 rows: each token costs more
    for _ in range(40):
        m.learn(2, 6, 0)  # after 2-token matches the answer never goes on as predicted
    assert m.propose([7, 120, 121], 8) == ([], 2) and m.expected(2, 1) < 0.1
    assert len(m.propose([100, 101], 8)[0]) == 8 and m.expected(PredictionMatch.max_match, 8) > 7


def test_the_seed_is_mixed_with_the_prediction_only_where_it_samples():
    assert prediction_seed(7, 0.0, [1, 2]) == 7  # greedy: no random numbers
    assert prediction_seed(None, 1.0, [1, 2]) is None  # unseeded: drawn later, independent of the prediction
    assert prediction_seed(7, 1.0, None) == 7
    mixed = prediction_seed(7, 1.0, [1, 2])
    assert mixed != 7 and mixed == prediction_seed(7, 1.0, [1, 2]) and 0 <= mixed < 2**63
    assert mixed != prediction_seed(7, 1.0, [1, 3]) and mixed != prediction_seed(8, 1.0, [1, 2])


def test_usage_counts_the_predictions_tokens_in_the_answer(tokenizer):
    assert prediction_details(None, [[1, 2]]) is None
    assert prediction_details([1, 2, 3, 4], [[1, 2, 9, 4, 5]]) == {"accepted_prediction_tokens": 3,
                                                                   "rejected_prediction_tokens": 1}
    assert prediction_details([1, 2], [[1, 2], [7]]) == {"accepted_prediction_tokens": 2,
                                                         "rejected_prediction_tokens": 2}
    parts = Prediction(type="content", content=[{"type": "text", "text": "x = "}, {"type": "text", "text": "1"}])
    assert parts.token_ids(tokenizer) == tokenizer("x = 1", add_special_tokens=False)["input_ids"]
    assert Prediction(type="content", content="").token_ids(tokenizer) is None


@pytest.mark.parametrize("loop", [{}, {"pipeline_depth": 2}], ids=["sequential", "pipelined"])
def test_greedy_output_is_plain_decodings_whatever_the_prediction(target_fp32, draft_int8, tokenizer, loop):
    """The real target in fp32 with the int8 draft: a prediction equal to the answer, one with edits (tokens
    changed, dropped, added), and one unrelated all give plain decoding's tokens; the first two are drafted
    from (rounds and accepted tokens counted), and the exact one commits most tokens in prediction rounds."""
    prompt = tokenizer(PROMPT)["input_ids"]
    runner = TorchModelRunner(target_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS)
    plain = SpeculativeDecoder(runner, None, tokenizer, 0).generate(prompt, SamplingParams(max_tokens=MAX_TOKENS))
    answer = plain.token_ids
    edited = answer[:10] + [answer[10] + 1] + answer[11:20] + answer[22:30] + [13, 13] + answer[30:]
    hybrid = HybridProposer(DraftModelProposer(TorchModelRunner(draft_int8, prompt_cache_tokens=PROMPT_CACHE_TOKENS)))
    spec = SpeculativeDecoder(runner, hybrid, tokenizer, 3, **loop)
    for prediction, drafted in ((answer, True), (edited, True), (list(range(1000, 1100)), False)):
        before = (spec.metrics.prediction_rounds, spec.metrics.prediction_accepted)
        out = spec.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, prediction=prediction))
        assert out.token_ids == answer
        rounds, accepted = spec.metrics.prediction_rounds - before[0], spec.metrics.prediction_accepted - before[1]
        assert (rounds > 0 and accepted > 0) == drafted, (rounds, accepted)
        if prediction is answer:
            assert accepted >= MAX_TOKENS - 2 * rounds and rounds <= MAX_TOKENS // 8, (rounds, accepted)
    rounds = spec.metrics.prediction_rounds  # a request's cap of 0 drafts: plain steps, the prediction unused
    spec.generate(prompt, SamplingParams(max_tokens=8, prediction=answer), max_speculative_tokens=0)
    assert spec.metrics.prediction_rounds == rounds


def test_the_cli_drafts_from_a_prediction_file(tmp_path, capsys):
    """`tandem generate --prediction @FILE` (in-process: the CLI's main): the same tokens as without it, drafted
    from it (its rounds and accepted tokens on stderr); a file it cannot read is one error line, before any model
    loads."""
    base = ["generate", PROMPT, "--max-tokens", "24", "--dtype", "float32", "--proposer", "ngram", "--threads", "1",
            "--json"]
    assert main(base + ["--prediction", f"@{tmp_path / 'missing.txt'}"]) == 2
    assert "--prediction: cannot read" in capsys.readouterr().err
    with torch_threads(1):
        assert main(base) == 0
        plain = json.loads(capsys.readouterr().out)
        (tmp_path / "answer.txt").write_text(plain["text"])
        assert main(base + ["--prediction", f"@{tmp_path / 'answer.txt'}"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 24
    rounds, accepted = map(int, re.search(r"prediction: (\d+) rounds drafted from it, (\d+)", out.err).groups())
    assert rounds > 0 and accepted >= 12, out.err


SAMPLE_PROMPT = [1, 4, 2, 7, 1, 4]
LENGTH = 3


def test_sampling_follows_the_target_with_a_prediction_from_the_same_seed():
    """Each request predicts what plain decoding drew with its own seed. With the seed mixed with the prediction
    (as the ingress does) the samples follow the target; without, acceptance and recovery draw the numbers that
    made the drafts, and they do not (the test can fail)."""
    target, draft = tiny_llama(seed=1), tiny_llama(seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH)
    exact = exact_continuation_probs(target, SAMPLE_PROMPT, LENGTH, params)
    runner = TorchModelRunner(target, prompt_cache_tokens=PROMPT_CACHE_TOKENS)
    plain = SpeculativeDecoder(runner, None, None, 0)
    spec = SpeculativeDecoder(runner, DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=PROMPT_CACHE_TOKENS)),
                              None, 3)
    n = 1000
    predictions = [plain.generate(SAMPLE_PROMPT, params.model_copy(update={"seed": i})).token_ids for i in range(n)]

    def samples(mix: bool) -> list[tuple]:
        return [tuple(spec.generate(SAMPLE_PROMPT, params.model_copy(update={
            "seed": prediction_seed(i, 1.0, pred) if mix else i, "prediction": pred})).token_ids)
            for i, pred in enumerate(predictions)]

    assert chi_square_pvalue(samples(True), exact) > FALSE_ALARM
    assert spec.metrics.prediction_rounds >= n
    assert chi_square_pvalue(samples(False), exact) < 1e-6
