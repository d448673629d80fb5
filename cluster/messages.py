"""Typed messages between the router and the drafter (they travel through Ray, pickled).

A `SyncOp` is what the router owes a drafter session after a round: a rollback to the committed
tokens, feedback for the proposer's `learn`, or both. The router queues them and sends them with the
session's next `propose`, which the drafter answers with a `DraftReply`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """One session's draft proposal, and when the batch that drafted it ran (drafter clock)."""

    token_ids: list[int]  # [k]
    draft_probs: list[SparseRow] | None  # [k] sparse rows of q; None for a deterministic proposer
    start: float
    end: float
    batch_size: int  # sessions drafted together in that batch

    @property
    def draft_s(self) -> float:
        return self.end - self.start
