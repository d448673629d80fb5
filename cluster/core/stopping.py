"""Stop conditions shared by every decoding loop: EOS and `stop_token_ids`, stop strings, max_tokens.

`min_tokens` holds back EOS and the stop ids in the logits (`cluster.core.processors`); here it holds back
stop strings too, as vLLM does (no stop is looked for before the output has that many tokens)."""

from __future__ import annotations

from collections.abc import Iterable

from cluster.core.sampling import SamplingParams


class StopChecker:
    """Commits new tokens to a request's output and says when (and why) it is finished."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int], params: SamplingParams):
        self.tokenizer = tokenizer
        # stop_token_ids end generation even with ignore_eos (vLLM); kept in the output as EOS is
        self.eos_token_ids = (set() if params.ignore_eos else set(eos_token_ids)) | set(params.stop_token_ids)
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
        floor = _floor(self.tokenizer, output, self.params.min_tokens)
        for end in range(max(len(output) - num_new + 1, self.params.min_tokens), len(output) + 1):
            text = self.tokenizer.decode(output[:end], skip_special_tokens=True)
            if _first_stop(text, self.params.stop, floor) is not None:
                return end
        return None

    def text(self, output: list[int]) -> str:
        """The output's text, ending before the first stop string."""
        if self.tokenizer is None:
            return ""
        return output_text(self.tokenizer, output, self.params.stop, self.params.stop_token_ids,
                           self.params.min_tokens)


def output_text(tokenizer, output: list[int], stop: Iterable[str] = (), stop_token_ids: Iterable[int] = (),
                min_tokens: int = 0) -> str:
    """The text of `output` as a client sees it: a final stop token id's text left out (vLLM), and cut
    before the first stop string that ends past the text of the first `min_tokens - 1` tokens (what
    `StopChecker` stops at: a stop string inside the first tokens `min_tokens` holds back stays text)."""
    if output and output[-1] in set(stop_token_ids):
        output = output[:-1]
    text = tokenizer.decode(output, skip_special_tokens=True)
    if not stop:
        return text
    cut = _first_stop(text, stop, _floor(tokenizer, output, min_tokens))
    return text if cut is None else text[:cut]


def _floor(tokenizer, output: list[int], min_tokens: int) -> int:
    """The length of the text of the first `min_tokens - 1` tokens: a stop string must end past it."""
    return len(tokenizer.decode(output[:min_tokens - 1], skip_special_tokens=True)) if min_tokens > 1 else 0


def _first_stop(text: str, stop: Iterable[str], floor: int) -> int | None:
    """Where the first stop string ending past `floor` starts in `text`, or None."""
    cuts = [at for s in stop if (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(cuts) if cuts else None
