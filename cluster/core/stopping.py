"""Stop conditions shared by every decoding loop: EOS and `stop_token_ids`, stop strings, max_tokens.

`min_tokens` holds back EOS and the stop ids in the logits (`cluster.core.processors`); here it holds back
stop strings too, as vLLM does (no stop is looked for before the output has that many tokens)."""

from __future__ import annotations

from collections.abc import Iterable

from cluster.core.sampling import SamplingParams


def eos_ids(eos_token_id: int | Iterable[int] | None) -> list[int]:
    """A config's `eos_token_id` (one id, a list of them, or None) as a list of ids."""
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


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
        skip = self.params.skip_special_tokens
        floor = _floor(self.tokenizer, output, self.params.min_tokens, skip)
        for end in range(max(len(output) - num_new + 1, self.params.min_tokens), len(output) + 1):
            text = self.tokenizer.decode(output[:end], skip_special_tokens=skip)
            if _first_stop(text, self.params.stop, floor) is not None:
                return end
        return None

    def text(self, output: list[int]) -> str:
        """The output's text, ending before the first stop string (after it with
        `include_stop_str_in_output`)."""
        if self.tokenizer is None:
            return ""
        return output_text(self.tokenizer, output, self.params.stop, self.params.stop_token_ids,
                           self.params.min_tokens, **text_options(self.params, self.eos_token_ids))


def text_options(params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> dict:
    """`output_text`'s keyword options for a request: how its text is written, and the ids that end an
    output (`eos_token_ids`, unless `ignore_eos`: a final one's text is left out unless the stop is kept)."""
    return {"include_stop": params.include_stop_str_in_output, "skip_special_tokens": params.skip_special_tokens,
            "eos_token_ids": () if params.ignore_eos else tuple(eos_token_ids)}


def output_text(tokenizer, output: list[int], stop: Iterable[str] = (), stop_token_ids: Iterable[int] = (),
                min_tokens: int = 0, *, include_stop: bool = False, skip_special_tokens: bool = True,
                eos_token_ids: Iterable[int] = ()) -> str:
    """The text of `output` as a client sees it (vLLM's rules): a final token that ended it (a stop token id,
    or EOS: `eos_token_ids`) has its text left out, and the text is cut before the first stop string that
    ends past the text of the first `min_tokens - 1` tokens (what `StopChecker` stops at: a stop string
    inside the first tokens `min_tokens` holds back stays text). `include_stop`
    (`include_stop_str_in_output`): that final token's text is kept, and the text is cut after the stop
    string that ends first. `skip_special_tokens`: special tokens' text is left out (EOS's among them)."""
    if output and output[-1] in set(stop_token_ids) | set(eos_token_ids) and not include_stop:
        output = output[:-1]
    text = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    if not stop:
        return text
    floor = _floor(tokenizer, output, min_tokens, skip_special_tokens)
    if include_stop:
        end = _first_stop_end(text, stop, floor)
        return text if end is None else text[:end]
    cut = _first_stop(text, stop, floor)
    return text if cut is None else text[:cut]


def _floor(tokenizer, output: list[int], min_tokens: int, skip_special_tokens: bool = True) -> int:
    """The length of the text of the first `min_tokens - 1` tokens: a stop string must end past it."""
    if min_tokens <= 1:
        return 0
    return len(tokenizer.decode(output[:min_tokens - 1], skip_special_tokens=skip_special_tokens))


def _first_stop(text: str, stop: Iterable[str], floor: int) -> int | None:
    """Where the first stop string ending past `floor` starts in `text`, or None."""
    cuts = [at for s in stop if (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(cuts) if cuts else None


def _first_stop_end(text: str, stop: Iterable[str], floor: int) -> int | None:
    """Where the stop string that ends first (past `floor`) ends in `text`, or None."""
    ends = [at + len(s) for s in stop if (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(ends) if ends else None
