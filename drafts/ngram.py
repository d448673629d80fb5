"""Prompt lookup (n-gram) proposer: no model. Finds the earliest occurrence of the sequence's last n
tokens and proposes what followed it (longest n first). Deterministic: q is one-hot.

Earliest rather than latest: on HumanEval (8 prompts, γ = 3, bf16) it accepted 471 of 891 drafts
against 441 of 936 for the latest match (36.98 vs 35.19 tokens/s in one run)."""

from __future__ import annotations

from cluster.core.errors import ConfigError
from drafts.proposer import DraftProposal, SequenceProposer, SessionId
from drafts.suffix import PricedMatch


def ngram_lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the earliest match of the last n tokens (n from long to short)."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[length - n :]
        first, start = pattern[0], -1
        while True:  # starts in [0, length - n): a match ends before the sequence does, so a token follows it
            try:
                start = tokens.index(first, start + 1, length - n)  # the scan runs in C (vLLM's step waits on it)
            except ValueError:
                break
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


class NGramProposer(SequenceProposer):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= {min_ngram=} <= {max_ngram=}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        tokens = self.tokens(session)
        draft = ngram_lookup(tokens, k, self.max_ngram, self.min_ngram) if k > 0 else []
        tokens.extend(draft)  # the proposer's own optimistic sequence
        return DraftProposal(draft, None)


class SuffixProposer(SequenceProposer):
    """Proposer `suffix`: the session's own longest suffix match, each draft as long as its tokens pay for
    their verification (`drafts.suffix.PricedMatch`, learned from the verdicts, priced for the sessions
    this proposer holds). No model; deterministic given the table, so q is one-hot. On the vLLM backend
    the same drafts are made inside vLLM's step (`cluster.vllm.proposer`)."""

    name = "suffix"

    def __init__(self, max_tokens: int = 16, max_ngram: int = 3):
        super().__init__()
        self.priced = PricedMatch(max_tokens=max_tokens, max_ngram=max_ngram)
        self._given: dict[SessionId, int] = {}  # the match length behind the session's last draft

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        tokens = self.tokens(session)
        draft, match = self.priced.propose(tokens, k, max(1, self.num_sessions)) if k > 0 else ([], 0)
        self._given[session] = match
        tokens.extend(draft)  # the proposer's own optimistic sequence
        return DraftProposal(draft, None)

    def learn(self, session: SessionId, num_drafted: int, num_accepted: int) -> None:
        self.priced.learn(self._given.pop(session, 0), num_drafted, num_accepted)

    def release(self, session: SessionId) -> None:
        super().release(session)
        self._given.pop(session, None)
