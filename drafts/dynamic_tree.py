"""EAGLE-2's dynamic draft tree: grow by cumulative draft log-probability, then keep the best nodes.

At each depth the draft scores the children of the frontier (the nodes expanded at the previous depth:
the root first); every child becomes a candidate with score = its parent's score + its own log q. The
`width` best candidates of the new depth are the next frontier (they are expanded: the draft runs on
them); after the last depth all candidates are reranked and the best `budget` kept. A child's score
never exceeds its parent's (log q <= 0), and ties go to the shallower node, so the kept set always
holds each node's parent: it is a tree. Its nodes are chosen, not sampled: verification treats them
as deterministic drafts (one-hot q, `cluster.core.tree`), lossless at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = -1


@dataclass(frozen=True)
class Candidate:
    token: int
    parent: int  # index of the parent candidate, ROOT for a child of the root
    score: float  # cumulative draft log-probability of the path to it
    depth: int


def path_tokens(candidates: list[Candidate], node: int) -> list[int]:
    """The tokens from the root's first child down to `node` (none for ROOT)."""
    path = []
    while node != ROOT:
        path.append(candidates[node].token)
        node = candidates[node].parent
    return path[::-1]


def frontier(candidates: list[Candidate], new: range, width: int) -> list[int]:
    """The `width` best candidates among those of the newest depth (indices `new`), best first."""
    return sorted(new, key=lambda i: -candidates[i].score)[:width]


def select_tree(candidates: list[Candidate], budget: int) -> tuple[list[int], list[int]]:
    """The best `budget` candidates as a `TokenTree` (token_ids, parents): nodes ordered by depth, and
    within a depth by score, so each node's first child is its best one (the tree's first chain is the
    draft's greedy path through what was kept)."""
    keep = sorted(range(len(candidates)), key=lambda i: (-candidates[i].score, candidates[i].depth))[:budget]
    kept = set(keep)
    if any(c.parent != ROOT and c.parent not in kept for c in (candidates[i] for i in keep)):
        raise AssertionError("a kept node lost its parent")  # scores never rise along a path
    order = sorted(keep, key=lambda i: (candidates[i].depth, -candidates[i].score))
    index = {old: new for new, old in enumerate(order)}
    return ([candidates[i].token for i in order],
            [ROOT if candidates[i].parent == ROOT else index[candidates[i].parent] for i in order])
