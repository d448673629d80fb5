"""The `logprobs` of the OpenAI responses, from the target's `TokenLogprob`s, written as vLLM writes them.

Each token's string is that token decoded alone; -inf (a token a logits processor masks) is written as
-9999.0 (JSON has no infinity). Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`,
the top ones the N most likely, best first. Completions: `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`, each `top_logprobs` entry a dict of the token itself and the N most likely tokens, and
`text_offset` each token's offset in the text, counted over the token strings from where the chunk's
text starts; with `echo` the prompt's tokens come first, the first one (an int here: no logprob) with a
null logprob and null top dict. `prompt_logprobs` (vLLM's extension): one entry per prompt token, the
first null, each a dict token id -> {logprob, rank, decoded_token} of the prompt token and the top ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from cluster.core.logprobs import TokenLogprob

FLOOR = -9999.0  # vLLM's stand-in for -inf


class LogprobFormat:
    """Formats one request's logprobs for its endpoint (`kind`)."""

    def __init__(self, tokenizer, kind: Literal["completion", "chat"], as_token_ids: bool = False):
        """`as_token_ids`: vLLM's `return_tokens_as_token_ids`, each token named `token_id:N` (not the prompt
        logprobs' `decoded_token`, as in vLLM)."""
        self.tokenizer, self.kind, self.as_token_ids = tokenizer, kind, as_token_ids

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.decoded(token_id)

    def decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def __call__(self, entries: Sequence[TokenLogprob], text_offset: int = 0) -> dict:
        return self.chat(entries) if self.kind == "chat" else self.completion(entries, text_offset)

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.token(token_id)
        return {"token": token, "logprob": max(logprob, FLOOR), "bytes": list(token.encode("utf-8", errors="replace"))}

    def chat(self, entries: Sequence[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(t.token_id, t.logprob),
                             "top_logprobs": [self._entry(i, lp) for i, lp in t.top]} for t in entries]}

    def completion(self, entries: Sequence[TokenLogprob | int], text_offset: int = 0) -> dict:
        """`entries`: a token id alone (int) is a token without a logprob (the prompt's first, echoed)."""
        tokens, offsets, values, tops = [], [], [], []
        for t in entries:
            token = self.token(t if isinstance(t, int) else t.token_id)
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
            if isinstance(t, int):
                values.append(None)
                tops.append(None)
                continue
            values.append(max(t.logprob, FLOOR))
            top = {token: max(t.logprob, FLOOR)}
            for i, lp in t.top:
                top[self.token(i)] = max(lp, FLOOR)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, entries: Sequence[TokenLogprob]) -> list[dict | None]:
        """vLLM's `prompt_logprobs` of a prompt whose tokens after the first have `entries`."""
        out: list[dict | None] = [None]
        for t in entries:
            entry = {str(t.token_id): self._ranked(t.token_id, t.logprob, t.rank)}
            for rank, (i, lp) in enumerate(t.top, 1):
                entry[str(i)] = self._ranked(i, lp, rank)
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": max(logprob, FLOOR), "rank": rank, "decoded_token": self.decoded(token_id)}
