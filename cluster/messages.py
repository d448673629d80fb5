"""Typed messages between the router and the drafter (they travel through Ray, pickled).

A `SyncOp` is what the router owes a drafter session after a round: a rollback to the committed
tokens, feedback for the proposer's `learn`, or both. The router queues them and sends them with the
session's next `propose`, which the drafter answers with a `DraftReply`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

# q's non-zero entries for one draft position, (token ids, probs): what crosses the wire
SparseRow = tuple[list[int], list[float]]


@dataclass(frozen=True)
class SyncOp:
    """Applied in order before the next propose. `length` not None: roll back, keeping the first
    `length` tokens, then append `token_ids` (the recovered or bonus token); `num_drafted` > 0: learn
    that `num_accepted` of a round's `num_drafted` drafts were accepted."""

    length: int | None = None
    token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def rollback(self) -> bool:
        return self.length is not None

    def without_rollback(self) -> "SyncOp":
        """The same feedback, no rollback (the drafter's sequence already continues correctly)."""
        return SyncOp(num_drafted=self.num_drafted, num_accepted=self.num_accepted)


@dataclass(frozen=True)
class DraftReply:
    """One session's draft proposal, and when the batch that drafted it ran (drafter clock).

    q travels as sparse rows across processes (`draft_probs`); an in-process drafter hands over the
    dense rows instead (`dense`), which are never pickled. Both None: a deterministic proposer."""

    token_ids: list[int]  # [k]
    draft_probs: list[SparseRow] | None  # [k] sparse rows of q
    start: float
    end: float
    batch_size: int  # sessions drafted together in that batch
    dense: torch.Tensor | None = None  # [k, vocab_size]: q, in process only
    parents: list[int] | None = None  # a token tree (`cluster.tree.TokenTree` order); None: a chain

    @property
    def draft_s(self) -> float:
        return self.end - self.start

    def chain(self) -> list[int]:
        """The drafter's own continuation: the first child at each level from the root."""
        if self.parents is None:
            return list(self.token_ids)
        out, node = [], -1
        while True:
            child = next((i for i, parent in enumerate(self.parents) if parent == node), None)
            if child is None:
                return out
            out.append(self.token_ids[child])
            node = child

    @property
    def deterministic(self) -> bool:
        return self.draft_probs is None and self.dense is None

    def sliced(self, start: int, stop: int) -> "DraftReply":
        """Drafts start..stop with their q rows (of a chain)."""
        if self.parents is not None:
            raise ValueError("a token tree cannot be sliced")
        return replace(self, token_ids=self.token_ids[start:stop],
                       draft_probs=None if self.draft_probs is None else self.draft_probs[start:stop],
                       dense=None if self.dense is None else self.dense[start:stop])

    def rows(self) -> list[SparseRow] | None:
        """q as sparse rows (what crosses the wire)."""
        if self.draft_probs is not None or self.dense is None:
            return self.draft_probs
        rows = []
        for row in self.dense:
            ids = torch.nonzero(row > 0).flatten()
            rows.append((ids.tolist(), row[ids].tolist()))
        return rows

    def q(self, vocab_size: int) -> torch.Tensor | None:
        """q as dense rows  # [k, vocab_size]."""
        if self.dense is not None or self.draft_probs is None:
            return self.dense
        q = torch.zeros(len(self.token_ids), vocab_size)
        for i, (ids, probs) in enumerate(self.draft_probs):
            q[i, ids] = torch.tensor(probs)
        return q


def apply_sync(proposer, session, ops: Sequence[SyncOp]) -> None:
    """Apply the ops owed to a proposer session, in order (rollback, then learn, each where present)."""
    for op in ops:
        if op.rollback:
            proposer.rollback(session, op.length, op.token_ids)
        if op.num_drafted:
            proposer.learn(session, op.num_drafted, op.num_accepted)
