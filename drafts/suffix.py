"""Suffix matching (prompt lookup) over a session's own tokens: the hybrid's free drafts.

Pure functions over token lists: the longest match of a sequence's suffix in a corpus and what
followed it, the alternatives after several matches (a token tree's branches), and `OwnMatch`, the
session loop's own long match rounds (no drafter call).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


def suffix_match(tokens: Sequence[int], corpus: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1,
                 max_match: int = 32) -> tuple[list[int], int]:
    """(up to `k` tokens that followed a match of `tokens`' suffix in `corpus`, the match's length).

    The last n tokens (n from `max_ngram` down to `min_ngram`) are looked up in `corpus`; for the longest
    n found, among its occurrences the one whose match extends furthest back (up to `max_match` tokens)
    wins, the earliest on ties. A match must end before `corpus` does, so that a token follows it
    (`corpus` may be `tokens` itself: the suffix is then not its own match). ([], 0) when none."""
    length, size = len(tokens), len(corpus)
    if k <= 0:
        return [], 0
    for n in range(min(max_ngram, length - 1 if corpus is tokens else length), min_ngram - 1, -1):
        pattern = list(tokens[length - n:])
        first, last_start = pattern[0], size - n  # starts in [0, last_start): a token follows
        best, best_len, pos = -1, 0, -1
        while True:
            try:
                pos = corpus.index(first, pos + 1, last_start)
            except ValueError:
                break
            if list(corpus[pos:pos + n]) != pattern:
                continue
            match = n
            if n == max_ngram:  # a shorter n cannot extend further back: the longer n-gram would have matched
                while (match < max_match and pos + n - 1 - match >= 0 and length - 1 - match >= 0
                       and corpus[pos + n - 1 - match] == tokens[length - 1 - match]):
                    match += 1
            if match > best_len:
                best, best_len = pos, match
                if match >= max_match:
                    break
        if best >= 0:
            return list(corpus[best + n:best + n + k]), best_len
    return [], 0


@dataclass(frozen=True)
class OwnMatch:
    """The match the session loop drafts itself (in sequential rounds, and in place of the plain steps its
    policy chooses): up to `max_tokens` tokens that followed the longest earlier match of the committed
    tokens' own suffix, when that match is at least `min_match` tokens long (the hybrid's long match rounds,
    `match_tokens` and `extend_min`). It costs no drafter call. Lossless like any match round: the drafts
    depend only on the committed tokens."""

    max_tokens: int = 16
    min_match: int = 4
    max_ngram: int = 3
    max_match: int = 8  # how far back a match is extended to rank occurrences (the hybrid's confident_match)

    @classmethod
    def for_rounds(cls, match_tokens: int, gamma: int, min_match: int = 4, max_ngram: int = 3) -> "OwnMatch | None":
        """The loop's own matches for a hybrid with long match rounds (`match_tokens` > γ); None otherwise."""
        return cls(match_tokens, min_match, max_ngram) if match_tokens > gamma else None

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        k = min(limit, self.max_tokens)
        if k <= 0:
            return []
        drafts, match = suffix_match(tokens, tokens, k, self.max_ngram, 1,
                                     max(self.max_ngram, self.min_match, self.max_match))
        return drafts if match >= self.min_match else []


def suffix_alternatives(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int, width: int,
                        exclude: Collection[int]) -> list[list[int]]:
    """Up to `width` other continuations of `tokens`' own suffix, each up to `k` tokens long, whose first
    tokens differ from `exclude` and from each other: for n from `max_ngram` down to `min_ngram`, the
    occurrences of the last n tokens, the most recent first."""
    out: list[list[int]] = []
    firsts = set(exclude)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = list(tokens[length - n:])
        for pos in range(length - n - 1, -1, -1):  # a token follows every occurrence (it ends before the suffix)
            if tokens[pos] != pattern[0] or list(tokens[pos:pos + n]) != pattern:
                continue
            follow = list(tokens[pos + n:pos + n + k])
            if follow[0] not in firsts:
                firsts.add(follow[0])
                out.append(follow)
                if len(out) >= width:
                    return out
    return out


def match_tree(chains: list[list[int]]) -> tuple[list[int], list[int]]:
    """(token_ids, parents) of a token tree whose root children start the chains, in order (the first
    chain first, so it is the tree's own chain, `DraftReply.chain`)."""
    token_ids: list[int] = []
    parents: list[int] = []
    for chain in chains:
        for i, token in enumerate(chain):
            parents.append(-1 if i == 0 else len(token_ids) - 1)
            token_ids.append(token)
    return token_ids, parents
