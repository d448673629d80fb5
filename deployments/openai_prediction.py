"""OpenAI's Predicted Outputs (`prediction`) on the HTTP API: the request field, its token ids, and the usage
it reports (`completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens`).

The prediction's tokens become `SamplingParams.prediction`, drafted by the session loop and by the proposers
inside vLLM (`drafts.prediction`): the output is the target's, with or without it. OpenAI refuses
a prediction with n > 1, logprobs, penalties above 0 or tools (its documentation lists them as not supported);
here every one of them is served (drafts are verified the same way whatever asked for them).
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import prediction_token_ids
from deployments.openai_body import ApiError


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="A text part.")
    text: str = Field(description="The part's text.")


class Prediction(BaseModel):
    """OpenAI's `prediction` (chat completions; here completions too): static content the answer is expected
    to match in large part (a file being edited), as a string or text parts."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"] = Field(description="The only kind OpenAI defines: predicted content.")
    content: str | list[TextPart] = Field(description="The predicted answer: a string, or text parts joined.")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def token_ids(self, tokenizer) -> list[int] | None:
        """The prediction as the target's token ids (`prediction_token_ids`); None when empty. ApiError past
        `MAX_PREDICTION` tokens."""
        try:
            return prediction_token_ids(self.text(), tokenizer)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param="prediction") from None


def prediction_details(prediction: list[int] | None, outputs: list[list[int]]) -> dict | None:
    """`usage.completion_tokens_details` for a request with a prediction (None without one): over its choices,
    the prediction's tokens that appear in the output, in order (`difflib`'s matching blocks), and the rest.
    OpenAI's definitions; which drafts the engine verified is in the `speculation` figures and the metrics."""
    if not prediction:
        return None
    accepted = sum(block.size for out in outputs
                   for block in difflib.SequenceMatcher(None, prediction, out).get_matching_blocks())
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(prediction) * len(outputs) - accepted}
