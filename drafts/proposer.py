"""The `Proposer` protocol: everything that proposes tokens has the same verbs.

A proposer keeps, per session, its own optimistic copy of the sequence (committed tokens plus what
it drafted since). `propose` continues that sequence; `rollback` tells it the truth after a round
(keep the first `length` tokens, then append the recovered or bonus token); `learn` reports how
many drafts were accepted, for proposers that adapt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Hashable, Protocol, runtime_checkable

import torch

from cluster.core.errors import InvalidRequestError
from cluster.core.messages import to_sparse
from cluster.core.sampling import SamplingParams

SessionId = Hashable


@dataclass
class DraftProposal:
    token_ids: list[int]  # [k]
    draft_probs: torch.Tensor | None = None  # [k, vocab_size]; None for a deterministic proposer
    parents: list[int] | None = None  # a token tree (`cluster.core.tree.TokenTree` order); None: a chain

    def __len__(self) -> int:
        return len(self.token_ids)

    def sparse_probs(self) -> list[tuple[list[int], list[float]]] | None:
        """q's non-zero entries per position, (ids, probs): what crosses the wire."""
        return None if self.draft_probs is None else to_sparse(self.draft_probs)


def shapes_sequential_rounds(proposer) -> bool:
    """Whether the proposer drafts sequential rounds differently (`propose_batch(requests, trees=...)`): a
    token tree (`tree_width` > 1) or a longer match round (the hybrid's `match_tokens`)."""
    return getattr(proposer, "tree_width", 1) > 1 or getattr(proposer, "match_tokens", 0) > 0


@runtime_checkable
class Proposer(Protocol):
    name: str

    def start(self, session: SessionId, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Open a session whose committed tokens are `prompt_ids`."""

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        """Up to `k` tokens continuing the session's own sequence (fewer when it has no guess)."""

    def propose_batch(self, requests: dict[SessionId, int]) -> dict[SessionId, DraftProposal]:
        """`propose` for several sessions at once."""

    def rollback(self, session: SessionId, length: int, token_ids: Sequence[int] = ()) -> None:
        """Keep the first `length` tokens of the sequence, then append `token_ids`."""

    def learn(self, session: SessionId, num_drafted: int, num_accepted: int) -> None:
        """Feedback after verification of a round."""

    def release(self, session: SessionId) -> None:
        """Forget the session."""


class SequenceProposer:
    """Base class: tracks each session's sequence and sampling parameters."""

    name = "base"

    def __init__(self) -> None:
        self._tokens: dict[SessionId, list[int]] = {}
        self._params: dict[SessionId, SamplingParams] = {}

    def start(self, session: SessionId, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if session in self._tokens:
            raise InvalidRequestError(f"session {session!r} already started on proposer {self.name}")
        self._tokens[session] = list(prompt_ids)
        if params.processes_logits and params.prompt_length is None:  # started with the prompt alone
            params = params.model_copy(update={"prompt_length": len(prompt_ids)})
        self._params[session] = params  # the processors read the prompt / output split from it

    @property
    def num_sessions(self) -> int:
        return len(self._tokens)

    def tokens(self, session: SessionId) -> list[int]:
        try:
            return self._tokens[session]
        except KeyError:
            raise InvalidRequestError(f"unknown session {session!r} on proposer {self.name}") from None

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        raise NotImplementedError

    def propose_batch(self, requests: dict[SessionId, int]) -> dict[SessionId, DraftProposal]:
        """Several sessions at once; proposers that batch (draft models) override this."""
        return {session: self.propose(session, k) for session, k in requests.items()}

    def rollback(self, session: SessionId, length: int, token_ids: Sequence[int] = ()) -> None:
        tokens = self.tokens(session)
        if not 0 <= length <= len(tokens):
            raise ValueError(f"cannot roll session {session!r} of length {len(tokens)} back to {length}")
        del tokens[length:]
        tokens.extend(token_ids)

    def learn(self, session: SessionId, num_drafted: int, num_accepted: int) -> None:
        pass

    def release(self, session: SessionId) -> None:
        self._tokens.pop(session, None)
        self._params.pop(session, None)
