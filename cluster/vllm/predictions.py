"""Requests' predictions (OpenAI's Predicted Outputs) inside vLLM's workers: drafts before any other source.

The front door puts a request's `SamplingParams.prediction` into vLLM's `extra_args` (`PREDICTION_KEY`,
`cluster.vllm.engine.to_vllm_params`); vLLM carries it to every worker with the request, where the model runner
keeps it (`runner.requests[rid].sampling_params`). Both of tandem's proposers in vLLM (`TandemProposer`, EAGLE-3
with tandem's matches) ask `RequestPredictions.propose` first for each decoding row: the prediction's drafts
(`drafts.prediction.PredictionMatch`) over the request's output so far, or [] (the row's other sources then).
Lossless like every draft vLLM verifies with one-hot q; a sampled request's seed was mixed with its prediction
where it entered (`cluster.core.sampling.prediction_seed`). Each draft's verdict is read from the next step's
committed tokens and counted (`stats`: prediction_rows, _tokens, _accepted; a request's last draft has no next
step, so its acceptance is not counted).
"""

from __future__ import annotations

from collections import Counter

from drafts.prediction import PredictionMatch

PREDICTION_KEY = "tandem_prediction"  # vLLM SamplingParams.extra_args: the prediction's token ids


class RequestPredictions:
    """The predictions of one worker's live requests, each read once from the model runner's request state."""

    def __init__(self, runner, stats: Counter):
        self.runner, self.stats = runner, stats
        self._matches: dict[str, tuple[PredictionMatch, int] | None] = {}  # rid -> (its match, prompt length)
        self._given: dict[str, tuple[int, list[int]]] = {}  # rid -> (history length, draft) at its last step

    def _lookup(self, rid: str) -> tuple[PredictionMatch, int] | None:
        if rid not in self._matches:
            state = (getattr(self.runner, "requests", None) or {}).get(rid)
            params = getattr(state, "sampling_params", None)
            ids = ((getattr(params, "extra_args", None) or {}).get(PREDICTION_KEY)) if params is not None else None
            self._matches[rid] = (PredictionMatch(ids), int(state.num_prompt_tokens)) if ids else None
        return self._matches[rid]

    def propose(self, rid: str, history: list[int], limit: int) -> list[int]:
        """Row `rid`'s drafts from its prediction, at most `limit` ([]: none, or no prediction); `history`: its
        committed tokens (prompt and output)."""
        self._verdict(rid, history)
        found = self._lookup(rid) if limit > 0 else None
        if found is None:
            return []
        match, prompt = found
        draft = match.propose(history[prompt:], limit)
        if draft:
            self._given[rid] = (len(history), draft)
            self.stats["prediction_rows"] += 1
            self.stats["prediction_tokens"] += len(draft)
        return draft

    def _verdict(self, rid: str, history: list[int]) -> None:
        given = self._given.pop(rid, None)
        if given is None:
            return
        at, draft = given
        accepted = 0
        while accepted < len(draft) and at + accepted < len(history) and history[at + accepted] == draft[accepted]:
            accepted += 1
        self.stats["prediction_accepted"] += accepted

    def forget(self, live: set[str]) -> None:
        """Requests no longer `live` (finished or aborted) are dropped."""
        for table in (self._matches, self._given):
            for rid in [r for r in table if r not in live]:
                del table[rid]
