"""Suffix matching (prompt lookup) over a session's own tokens: the hybrid's free drafts.

Pure functions over token lists: the longest match of a sequence's suffix in a corpus and what
followed it, the alternatives after several matches (a token tree's branches), and `OwnMatch`, the
session loop's own long match rounds (no drafter call).
"""

from __future__ import annotations

from collections import deque
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
            # a shorter n cannot extend further back: the longer n-gram would have matched
            match = extended_match(tokens, corpus, pos, n, max_match) if n == max_ngram else n
            if match > best_len:
                best, best_len = pos, match
                if match >= max_match:
                    break
        if best >= 0:
            return list(corpus[best + n:best + n + k]), best_len
    return [], 0


def extended_match(tokens: Sequence[int], corpus: Sequence[int], pos: int, n: int, max_match: int) -> int:
    """How long the match of `tokens`' last n tokens at corpus[pos:pos + n] is, extended back token by token
    while both agree (up to `max_match`)."""
    match, length = n, len(tokens)
    while (match < max_match and pos + n - 1 - match >= 0 and length - 1 - match >= 0
           and corpus[pos + n - 1 - match] == tokens[length - 1 - match]):
        match += 1
    return match


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


class PricedMatch:
    """Free drafts priced token by token: the continuation of the longest earlier match of the committed
    tokens' own suffix (`suffix_match`, extended back up to `max_match` tokens), cut where the next
    token's chance of being accepted falls below what verifying it costs.

    How likely a match's continuation is right depends on how long the match is (a 1-token match is
    mostly wrong, an 8-token one mostly right: BENCHMARKS.md). Per match length m (capped at
    `max_match`) and position j it keeps q[m][j], the chance that draft token j is accepted given
    that the tokens before it were, learned from the verdicts (`learn`) with exponential forgetting
    (`weight`) and started from a prior that rises with m. A draft keeps token j while
    q[m][0]·…·q[m][j] (the chance token j is accepted at all, the tokens it adds in expectation)
    stays at or above the price: `threshold` for one row, plus `per_row` for every further row of the
    step (a fuller batch makes each verified token dearer); from `busy_rows` rows on (when > 0) the price is
    `BUSY_PRICE`, near-certain tokens only (on vLLM's CPU step at 16 rows even 0.7 lost, BENCHMARKS.md).
    `match_factor` (when > 0) also keeps a draft
    no longer than that many times its match (SuffixDecoding's spec factor: a short match rarely goes on
    long). Lossless like every match: the drafts depend only on the committed tokens and the learned
    table, never on the target's output."""

    PRIOR_TRIALS = 4.0  # weight of the prior, in verdicts
    BUSY_PRICE = 0.95  # the highest price: a token drafted only when it is near-certain

    def __init__(self, max_tokens: int = 16, max_match: int = 16, max_ngram: int = 3, threshold: float = 0.1,
                 per_row: float = 0.04, weight: float = 0.02, match_factor: float = 0.0, busy_rows: int = 0):
        if not (max_tokens >= 1 and max_match >= max_ngram >= 1 and 0 < threshold < 1 and per_row >= 0
                and 0 < weight < 1 and match_factor >= 0 and busy_rows >= 0):
            raise ValueError("PricedMatch needs max_tokens >= 1, max_match >= max_ngram >= 1, 0 < threshold < 1, "
                             "per_row >= 0, 0 < weight < 1, match_factor >= 0 and busy_rows >= 0")
        self.max_tokens, self.max_match, self.max_ngram = max_tokens, max_match, max_ngram
        self.threshold, self.per_row, self.weight, self.match_factor = threshold, per_row, weight, match_factor
        self.busy_rows = busy_rows
        self._hits = [[self.prior(m, j) * self.PRIOR_TRIALS for j in range(max_tokens)] for m in range(max_match + 1)]
        self._trials = [[self.PRIOR_TRIALS] * max_tokens for _ in range(max_match + 1)]

    @staticmethod
    def prior(m: int, j: int) -> float:
        """The prior q[m][j]: a first token right 20% of the time after a 1-token match, 52% after 2,
        71% after 3, rising towards 1; a later token (its predecessors right) closes 40% of the rest."""
        first = 1.0 - 0.8 * 0.6 ** max(0, m - 1)
        return first if j == 0 else first + 0.4 * (1.0 - first)

    def price(self, rows: int = 1) -> float:
        if self.busy_rows and rows >= self.busy_rows:
            return self.BUSY_PRICE
        return min(self.BUSY_PRICE, self.threshold + self.per_row * max(0, rows - 1))

    def q(self, m: int, j: int) -> float:
        return self._hits[m][j] / self._trials[m][j]

    def propose(self, tokens: Sequence[int], limit: int, rows: int = 1) -> tuple[list[int], int]:
        """(the draft, its match length) for `tokens`, at most `limit` tokens, priced for a step of `rows`
        rows; ([], 0) without a match, ([], m) when not even its first token pays."""
        k = min(limit, self.max_tokens)
        if k <= 0:
            return [], 0
        draft, match = suffix_match(tokens, tokens, k, self.max_ngram, 1, self.max_match)
        if not match:
            return [], 0
        return self.cut(draft, match, rows), match

    def cut(self, draft: list[int], match: int, rows: int = 1) -> list[int]:
        """`draft` (a match of length `match` continued) up to its last token that still pays at `rows` rows (and
        within `match_factor` times the match)."""
        m, price, p, n = min(match, self.max_match), self.price(rows), 1.0, 0
        if self.match_factor > 0:
            draft = draft[:max(1, int(match * self.match_factor))]
        for j in range(len(draft)):
            p *= self.q(m, j)
            if p < price:
                break
            n = j + 1
        return draft[:n]

    def expected(self, match: int, drafted: int) -> float:
        """The tokens a draft of `drafted` tokens after a match of length `match` is expected to have accepted."""
        m, p, total = min(match, self.max_match), 1.0, 0.0
        for j in range(min(drafted, self.max_tokens)):
            p *= self.q(m, j)
            total += p
        return total

    def fresh(self) -> "PricedMatch":
        """A table of the same settings at its prior, as if it had learned nothing."""
        return PricedMatch(self.max_tokens, self.max_match, self.max_ngram, self.threshold, self.per_row, self.weight,
                           self.match_factor, self.busy_rows)

    def learn(self, match: int, drafted: int, accepted: int) -> None:
        """A verdict: of `drafted` tokens drafted after a match of length `match`, the first `accepted`
        were accepted. Tokens 0..accepted were tried (the ones before them right), 0..accepted-1 right."""
        if match <= 0 or drafted <= 0:
            return
        m, keep = min(match, self.max_match), 1.0 - self.weight
        hits, trials = self._hits[m], self._trials[m]
        for j in range(min(accepted + 1, drafted, self.max_tokens)):
            trials[j] = trials[j] * keep + 1.0
            hits[j] = hits[j] * keep + (1.0 if j < accepted else 0.0)


class SuffixPool:
    """Other sessions' finished outputs, where a session's own tokens match nothing as long: the longest match
    of its last tokens in what earlier sessions wrote, and what followed it there (SuffixDecoding's global
    tree of responses, kept as a bounded pool). Outputs are indexed by their `ngram`-token n-grams (a match
    starts from one), newest first; the oldest leave once the pool holds more than `max_tokens` tokens. Like
    every match the drafts depend only on committed tokens; the caller keeps them from a seeded sampled request
    whose seed made a pooled output (tandem's proposer uses the pool for greedy and unseeded requests only).
    Each output is pooled under a `group` (a request's cache salt's, `cluster.vllm.protocol.salt_group`; None:
    unsalted) and matched only by sessions of that group: drafts never come from another tenant's text, so how
    fast a tenant's request runs does not tell it what another was sent. One budget holds every group."""

    def __init__(self, max_tokens: int = 65536, ngram: int = 3, max_match: int = 16, max_candidates: int = 64):
        if not (max_tokens > 0 and max_match >= ngram >= 1 and max_candidates >= 1):
            raise ValueError("SuffixPool needs max_tokens > 0, max_match >= ngram >= 1 and max_candidates >= 1")
        self.max_tokens, self.ngram, self.max_match, self.max_candidates = max_tokens, ngram, max_match, max_candidates
        self._outputs: dict[int, tuple[str | None, list[int]]] = {}  # (group, tokens) by age, oldest first
        self._index: dict[tuple, deque[tuple[int, int]]] = {}  # (group, *n-gram) -> (output, start), oldest first
        self._next = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, output: Sequence[int], group: str | None = None) -> None:
        """A finished session's output joins the pool under `group` (one too short to hold an n-gram and its next
        token is left out)."""
        n = self.ngram
        if len(output) <= n:
            return
        key, tokens = self._next, list(output[-self.max_tokens:])
        self._next += 1
        self._outputs[key] = (group, tokens)
        for start in range(len(tokens) - n):  # a token follows each
            self._index.setdefault((group, *tokens[start:start + n]), deque()).append((key, start))
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        key, (group, tokens) = next(iter(self._outputs.items()))
        del self._outputs[key]
        self.tokens -= len(tokens)
        n = self.ngram
        for gram in {(group, *tokens[start:start + n]) for start in range(len(tokens) - n)}:
            spots = self._index[gram]
            while spots and spots[0][0] == key:  # the oldest output's entries lead every deque
                spots.popleft()
            if not spots:
                del self._index[gram]

    def match(self, tokens: Sequence[int], k: int, group: str | None = None) -> tuple[list[int], int]:
        """(up to `k` tokens that followed the longest match of `tokens`' suffix in `group`'s outputs, the match's
        length, extended back up to `max_match`); the newest output on ties; ([], 0) when the last n-gram is not
        there."""
        n, length = self.ngram, len(tokens)
        if k <= 0 or length < n:
            return [], 0
        spots = self._index.get((group, *tokens[length - n:]))
        if not spots:
            return [], 0
        best, best_len = None, 0
        for i in range(len(spots) - 1, max(-1, len(spots) - 1 - self.max_candidates), -1):  # newest first
            key, start = spots[i]
            seq = self._outputs[key][1]
            match = extended_match(tokens, seq, start, n, self.max_match)
            if match > best_len:
                best, best_len = (seq, start), match
                if match >= self.max_match:
                    break
        seq, start = best
        return list(seq[start + n:start + n + k]), best_len


class PooledPricedMatch:
    """`PricedMatch` over a session's own tokens, and where the pool (`SuffixPool`; None: none) holds a longer
    match, the pool's continuation, priced by a table of its own (another session's text goes on differently
    from a session's own repeats). `propose` -> (draft, match, pooled); `learn` takes `pooled` back."""

    def __init__(self, own: PricedMatch, pool: SuffixPool | None):
        self.own, self.pool = own, pool
        self.pooled = None if pool is None else PricedMatch(
            own.max_tokens, pool.max_match, min(own.max_ngram, pool.ngram), own.threshold, own.per_row, own.weight,
            own.match_factor, own.busy_rows)

    def propose(self, tokens: Sequence[int], limit: int, rows: int = 1, use_pool: bool = True,
                group: str | None = None) -> tuple[list[int], int, bool]:
        draft, match = self.own.propose(tokens, limit, rows)
        k = min(limit, self.own.max_tokens)
        if self.pool is None or not use_pool or k <= 0 or match >= self.pool.max_match:
            return draft, match, False
        pooled, pool_match = self.pool.match(tokens, k, group)  # only the session's own group's outputs
        if pool_match <= match:
            return draft, match, False
        return self.pooled.cut(pooled, pool_match, rows), pool_match, True

    def learn(self, match: int, drafted: int, accepted: int, pooled: bool = False) -> None:
        (self.pooled if pooled else self.own).learn(match, drafted, accepted)

    def expected(self, match: int, drafted: int, pooled: bool = False) -> float:
        return (self.pooled if pooled else self.own).expected(match, drafted)
