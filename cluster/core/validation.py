"""What every decoding loop refuses before it starts: the checks a request passes in the ingress, the router and
each engine, with no model loaded."""

from __future__ import annotations

from collections.abc import Sequence

from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import SamplingParams


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, max_context: int, tokenizer,
                     vocab_size: int | None = None) -> None:
    """What every decoding loop refuses before it starts (vocabulary checked when `vocab_size` is given)."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})")
    if vocab_size is not None:
        params.check_vocab(vocab_size)
    total = len(prompt_ids) + params.max_tokens
    if total > max_context:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's context length of {max_context} tokens"
        )
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer")
