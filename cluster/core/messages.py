"""Typed messages between the router and the drafter (they travel through Ray, pickled).

A `SyncOp` is what the router owes a drafter session after a round: a rollback to the committed
tokens, feedback for the proposer's `learn`, or both. The router queues them and sends them with the
session's next `propose`, which the drafter answers with a `DraftReply`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from cluster.core.tree import first_chain

# q's non-zero entries for one draft position, (token ids, probs): what crosses the wire
SparseRow = tuple[list[int], list[float]]


def to_sparse(dense: torch.Tensor) -> list[SparseRow]:
    """q's non-zero entries per draft position, (ids, probs): what crosses the wire  # dense: [k, vocab_size]."""
    rows = []
    for row in dense:
        ids = torch.nonzero(row > 0).flatten()
        rows.append((ids.tolist(), row[ids].tolist()))
    return rows


def to_dense(rows: Sequence[SparseRow], vocab_size: int) -> torch.Tensor:
    """Sparse rows of q back to q  # [k, vocab_size] (the one sparse -> dense conversion)."""
    q = torch.zeros(len(rows), vocab_size)
    for i, (ids, probs) in enumerate(rows):
        q[i, list(ids)] = torch.tensor(list(probs), dtype=q.dtype)
    return q


@dataclass(frozen=True)
class SyncOp:
    """Applied in order before the next propose. `length` not None: roll back, keeping the first
    `length` tokens, then append `token_ids` (the recovered or bonus token); `num_drafted` > 0: learn
    that `num_accepted` of a round's `num_drafted` drafts were accepted."""

    length: int | None = None
    token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    # a feature-fed draft: the target's features of committed positions feature_start ..  # [m, H]
    features: torch.Tensor | None = None
    feature_start: int = 0

    @property
    def rollback(self) -> bool:
        return self.length is not None

    def without_rollback(self) -> "SyncOp":
        """The same feedback and features, no rollback (the drafter's sequence already continues correctly)."""
        return replace(self, length=None, token_ids=[])

    def with_features(self, start: int, features: torch.Tensor | None) -> "SyncOp":
        return self if features is None else replace(self, features=features, feature_start=start)


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
    parents: list[int] | None = None  # a token tree (`cluster.core.tree.TokenTree` order); None: a chain

    @property
    def draft_s(self) -> float:
        return self.end - self.start

    def chain(self) -> list[int]:
        """The drafter's own continuation: the first child at each level from the root."""
        return first_chain(self.token_ids, self.parents)

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
        return to_sparse(self.dense)

    def q(self, vocab_size: int) -> torch.Tensor | None:
        """q as dense rows  # [k, vocab_size]."""
        if self.dense is not None or self.draft_probs is None:
            return self.dense
        return to_dense(self.draft_probs, vocab_size)


class FeatureLog:
    """The target's features of a session's committed positions, kept by the session loop so a drafter
    that joins late (or a replayed session's) gets them all at once."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # [capacity, H]
        self.length = 0

    def add(self, start: int, rows: torch.Tensor) -> None:
        if start > self.length:
            raise ValueError(f"features from position {start}, only {self.length} known")
        end = start + len(rows)
        if self.rows is None or end > len(self.rows):
            grown = torch.zeros(max(end, 256, 0 if self.rows is None else 2 * len(self.rows)), rows.shape[-1],
                                dtype=rows.dtype)
            if self.rows is not None:
                grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[start:end] = rows
        self.length = end

    def sync(self) -> SyncOp | None:
        """All of them, as one op (None when there are none)."""
        return None if not self.length else SyncOp(features=self.rows[: self.length].clone(), feature_start=0)


def apply_sync(proposer, session, ops: Sequence[SyncOp]) -> None:
    """Apply the ops owed to a proposer session, in order (rollback, then features, then learn, each
    where present)."""
    for op in ops:
        if op.rollback:
            proposer.rollback(session, op.length, op.token_ids)
        if op.features is not None and hasattr(proposer, "add_features"):
            proposer.add_features(session, op.feature_start, op.features)
        if op.num_drafted:
            proposer.learn(session, op.num_drafted, op.num_accepted)
