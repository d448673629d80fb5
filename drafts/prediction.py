"""OpenAI's Predicted Outputs as drafts: the request's own guess at its answer (`SamplingParams.prediction`).

A client that knows most of the answer already (a file to be edited, a document to be rewritten with small
changes) sends it as `prediction`; OpenAI's API then "speculates" with it. Here it is one more source of
free drafts, like a suffix match: while the output so far is a prefix of the prediction, the drafts are the
prediction's next tokens; after the output leaves it (an edit, or an answer that goes its own way), the drafts
are what followed the longest match of the output's last tokens in the prediction, once that match is
`min_match` tokens long.

A prediction can be wrong for most of an answer (a model that writes other code than the file it was shown), and
then long drafts after short matches cost verify work and take the place of better drafts. So drafts are priced
as suffix matches are (`drafts.suffix.PricedMatch`: a learned chance of acceptance per match length and position,
cut where a further token no longer pays its verify price): the prediction's own table, with the aligned case
(the output a prefix of the prediction) in its top row, where a right prediction earns long drafts. Lossless like
every draft: verified by the target, depending only on the committed output, the request's own prediction and the
verdicts (the caller keeps a seeded sampled request's random numbers independent of its prediction:
`cluster.core.sampling.prediction_seed`).
"""

from __future__ import annotations

from collections.abc import Sequence

from drafts.suffix import PricedMatch, suffix_match


def prediction_prices(max_tokens: int = 16, threshold: float = 0.1, per_row: float = 0.04,
                      busy_rows: int = 0) -> PricedMatch:
    """The price table of prediction drafts (one per session loop, or per vLLM worker); the match length's table
    rows up to `PredictionMatch.max_match`, the aligned case in the last."""
    return PricedMatch(max_tokens, PredictionMatch.max_match, PredictionMatch.max_ngram, threshold, per_row,
                       busy_rows=busy_rows)


class PredictionMatch:
    """Drafts from one request's prediction (token ids), priced by `prices` (shared with other requests, or not):
    `propose(output, limit, rows)` -> (draft, match length; `max_match` when aligned), `learn` its verdict,
    `expected` the tokens a draft is expected to have accepted."""

    min_match = 2  # a 1-token match places nothing
    max_ngram = 4
    max_match = 16  # matches extended back this far share the aligned case's row

    def __init__(self, prediction: Sequence[int], prices: PricedMatch):
        self.prediction = list(prediction)
        self.prices = prices

    def propose(self, output: Sequence[int], limit: int, rows: int = 1) -> tuple[list[int], int]:
        """The drafts that continue `output` (the request's committed output tokens, not its prompt), priced for a
        step of `rows` rows; ([], 0) without a match, ([], m) when not even the first token pays."""
        k = min(limit, self.prices.max_tokens)
        n = len(output)
        if k <= 0:
            return [], 0
        if n < len(self.prediction) and list(output) == self.prediction[:n]:  # still on the prediction
            draft, match = self.prediction[n:n + k], self.max_match
        else:  # a match ranks by how far back it extends: a repeated line is placed by its context
            draft, match = suffix_match(output, self.prediction, k, self.max_ngram, self.min_match, self.max_match)
            if match < self.min_match:
                return [], 0
        return self.prices.cut(draft, match, rows), match

    def learn(self, match: int, drafted: int, accepted: int) -> None:
        self.prices.learn(match, drafted, accepted)

    def expected(self, match: int, drafted: int) -> float:
        return self.prices.expected(match, drafted)
