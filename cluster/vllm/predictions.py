"""Requests' predictions (OpenAI's Predicted Outputs) inside vLLM's workers: one more source of drafts, priced.

The front door puts a request's `SamplingParams.prediction` into vLLM's `extra_args` (`PREDICTION_KEY`,
`cluster.vllm.engine.to_vllm_params`); vLLM carries it to every worker with the request, where the model runner
keeps it (`runner.requests[rid].sampling_params`). Both of tandem's proposers in vLLM (`TandemProposer`, EAGLE-3
with tandem's matches) ask `RequestPredictions.propose` for each decoding row: the prediction's drafts
(`drafts.prediction.PredictionMatch`) over the request's output so far, priced, or [] (the row's other sources then;
EAGLE-3 with matches gives the row whichever draft is expected to have more tokens accepted).
Lossless like every draft vLLM verifies with one-hot q; a sampled request's seed was mixed with its prediction
where it entered (`cluster.core.sampling.prediction_seed`). Each draft's verdict is read from the next step's
committed tokens and counted (`stats`: prediction_rows, _tokens, _accepted; a request's last draft has no next
step, so its acceptance is not counted).
"""

from __future__ import annotations

from collections import Counter

from drafts.prediction import PredictionMatch
from drafts.suffix import PricedMatch

PREDICTION_KEY = "tandem_prediction"  # vLLM SamplingParams.extra_args: the prediction's token ids


class RequestPredictions:
    """The predictions of one worker's live requests, each read once from the model runner's request state, priced
    by one table (`prices`, `drafts.prediction.prediction_prices`) that learns from every request's verdicts."""

    def __init__(self, runner, stats: Counter, prices: PricedMatch):
        self.runner, self.stats, self.prices = runner, stats, prices
        self.prior = prices.fresh()  # a seeded sampled request's table, never learning (`inline.seeded_row`)
        self._matches: dict[str, tuple[PredictionMatch, int] | None] = {}  # rid -> (its match, prompt length)
        self._given: dict[str, tuple[int, list[int], int]] = {}  # rid -> (history length, draft, match) given last

    def _lookup(self, rid: str, seeded: bool = False) -> tuple[PredictionMatch, int] | None:
        if rid not in self._matches:
            state = (getattr(self.runner, "requests", None) or {}).get(rid)
            params = getattr(state, "sampling_params", None)
            ids = ((getattr(params, "extra_args", None) or {}).get(PREDICTION_KEY)) if params is not None else None
            prices = self.prior if seeded else self.prices
            self._matches[rid] = (PredictionMatch(ids, prices), int(state.num_prompt_tokens)) if ids else None
        return self._matches[rid]

    def propose(self, rid: str, history: list[int], limit: int, rows: int = 1,
                seeded: bool = False) -> tuple[list[int], int]:
        """Row `rid`'s drafts from its prediction, at most `limit`, priced for a step of `rows` rows (a `seeded`
        sampled request's by the prior), and their match length (([], 0): none, or no prediction); `history`: its
        committed tokens (prompt and output). The caller `give`s the draft it hands to vLLM."""
        self._verdict(rid, history)
        found = self._lookup(rid, seeded) if limit > 0 else None
        if found is None:
            return [], 0
        match, prompt = found
        return match.propose(history[prompt:], limit, rows)

    def expected(self, rid: str, match: int, drafted: int) -> float:
        """The tokens row `rid`'s prediction draft is expected to have accepted, by the table that priced it."""
        found = self._matches.get(rid)
        return found[0].expected(match, drafted) if found else 0.0

    def give(self, rid: str, history: list[int], draft: list[int], match: int) -> None:
        """`draft` (from `propose`) goes to vLLM for row `rid`: its verdict is learned at the request's next step."""
        self._given[rid] = (len(history), draft, match)
        self.stats["prediction_rows"] += 1
        self.stats["prediction_tokens"] += len(draft)

    def _verdict(self, rid: str, history: list[int]) -> None:
        given = self._given.pop(rid, None)
        if given is None:
            return
        at, draft, match = given
        accepted = 0
        while accepted < len(draft) and at + accepted < len(history) and history[at + accepted] == draft[accepted]:
            accepted += 1
        self.prices.learn(match, len(draft), accepted)
        self.stats["prediction_accepted"] += accepted

    def forget(self, live: set[str]) -> None:
        """Requests no longer `live` (finished or aborted) are dropped."""
        for table in (self._matches, self._given):
            for rid in [r for r in table if r not in live]:
                del table[rid]
