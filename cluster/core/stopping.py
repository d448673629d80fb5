"""Stop conditions shared by every decoding loop: EOS, stop strings, max_tokens."""

from __future__ import annotations

from collections.abc import Iterable

from cluster.core.sampling import SamplingParams


class StopChecker:
    """Commits new tokens to a request's output and says when (and why) it is finished."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.params = params

    def commit(self, output: list[int], new_tokens: list[int]) -> str | None:
        """Append `new_tokens` to `output`, cut at a stop; returns "stop", "length" or None."""
        finish = None
        for i, token in enumerate(new_tokens):
            if token in self.eos_token_ids:  # EOS is kept in the output, as transformers does
                new_tokens, finish = new_tokens[: i + 1], "stop"
                break
        output.extend(new_tokens)
        if self.params.stop and finish is None:
            cut = self._find_stop(output, len(new_tokens))
            if cut is not None:
                del output[cut:]
                finish = "stop"
        if finish is None and len(output) >= self.params.max_tokens:
            del output[self.params.max_tokens :]
            finish = "length"
        return finish

    def _find_stop(self, output: list[int], num_new: int) -> int | None:
        """Smallest token count whose text contains a stop string, looking only at new tokens."""
        for end in range(len(output) - num_new + 1, len(output) + 1):
            text = self.tokenizer.decode(output[:end], skip_special_tokens=True)
            if any(s in text for s in self.params.stop):
                return end
        return None

    def text(self, output: list[int]) -> str:
        """The output's text, ending before the first stop string."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(output, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.params.stop if s in text]
        return text[: min(cuts)] if cuts else text
