"""OpenAI's Predicted Outputs as drafts: the request's own guess at its answer (`SamplingParams.prediction`).

A client that knows most of the answer already (a file to be edited, a document to be rewritten with small
changes) sends it as `prediction`; OpenAI's API then "speculates" with it. Here it is one more source of
free drafts, like a suffix match: while the output so far is a prefix of the prediction, the drafts are the
prediction's next tokens; after the output leaves it (an edit), the drafts are what followed the longest
match of the output's last tokens in the prediction, once that match is `min_match` tokens long (the
output has come back to the predicted text). Lossless like every draft: verified by the target, and
depending only on the committed output and the request's own prediction (the caller keeps a seeded sampled
request's random numbers independent of its prediction: `cluster.core.sampling.prediction_seed`).
"""

from __future__ import annotations

from collections.abc import Sequence

from drafts.suffix import suffix_match


class PredictionMatch:
    """Drafts from one request's prediction (token ids): `propose(output, limit)` -> up to `min(limit,
    max_tokens)` tokens, [] when the output's end matches nothing in the prediction."""

    def __init__(self, prediction: Sequence[int], max_tokens: int = 16, min_match: int = 2, max_ngram: int = 4,
                 max_match: int = 64):
        if not (max_tokens >= 1 and max_ngram >= min_match >= 1 and max_match >= max_ngram):
            raise ValueError("PredictionMatch needs max_tokens >= 1, max_ngram >= min_match >= 1 and "
                             "max_match >= max_ngram")
        self.prediction = list(prediction)
        self.max_tokens, self.min_match, self.max_ngram, self.max_match = max_tokens, min_match, max_ngram, max_match

    def propose(self, output: Sequence[int], limit: int) -> list[int]:
        """The drafts that continue `output` (the request's committed output tokens, not its prompt)."""
        k = min(limit, self.max_tokens)
        n = len(output)
        if k <= 0:
            return []
        if n < len(self.prediction) and list(output) == self.prediction[:n]:  # still on the prediction
            return self.prediction[n:n + k]
        # a match ranks by how far back it extends (up to `max_match`): a repeated line is placed by its context
        drafts, match = suffix_match(output, self.prediction, k, self.max_ngram, self.min_match, self.max_match)
        return drafts if match >= self.min_match else []
