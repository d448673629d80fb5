"""The free drafts made inside vLLM's step (`InlineMatcher`: n-gram lookup, a session's own matches, priced suffix
matches over its tokens and the pool of finished outputs), shared by tandem's proposers in vLLM's workers
(`cluster.vllm.proposer.TandemProposer`, `cluster.vllm.eagle_matches.EagleMatches`), and which rows are seeded
sampled requests' (`seeded_row`)."""

from __future__ import annotations

from cluster.vllm.protocol import InlineMatches
from drafts.ngram import ngram_lookup
from drafts.suffix import OwnMatch, PooledPricedMatch, PricedMatch, SuffixPool


class InlineMatcher:
    """The inline matches of an `InlineMatches`: `propose(history, limit, rows, ...)` -> (draft, match
    length, pooled), `learn(match, drafted, accepted, pooled)` (only priced matches learn); priced matches with
    `pool_tokens` also draw on the pool of finished requests' outputs (`pool`): each request's tokens are
    `track`ed while it runs and pooled once it is gone (`pool_finished`)."""

    def __init__(self, matches: InlineMatches):
        self.matches = matches
        self.priced = PricedMatch(matches.max_tokens, matches.max_match, matches.max_ngram, matches.threshold,
                                  matches.per_row, match_factor=matches.match_factor, busy_rows=matches.busy_rows) \
            if matches.kind == "priced" else None
        self.own = OwnMatch(matches.max_tokens, matches.min_match, matches.max_ngram) if matches.kind == "own" else None
        self.pool = SuffixPool(matches.pool_tokens, matches.max_ngram, matches.max_match) \
            if self.priced is not None and matches.pool_tokens else None
        self.pooled = PooledPricedMatch(self.priced, self.pool) if self.priced is not None else None
        # a seeded sampled request's matches: priced by the prior, which never learns (`seeded_row`)
        self.prior = PooledPricedMatch(self.priced.fresh(), None) if self.priced is not None else None
        # request -> (prompt length, committed tokens, salt group), for the pool
        self.outputs: dict[str, tuple[int, list[int], str | None]] = {}

    def propose(self, history: list[int], limit: int, rows: int, use_pool: bool = True,
                group: str | None = None, seeded: bool = False) -> tuple[list[int], int, bool]:
        """`use_pool`: where a pool is kept, draw on it. `group`: the request's salt group (`RequestKey.group`):
        pooled drafts come from its group's outputs. `seeded`: a seeded sampled request's (`seeded_row`): priced
        by the prior, never from the pool."""
        if self.pooled is not None:
            if seeded:
                return self.prior.propose(history, limit, rows, False, group)
            return self.pooled.propose(history, limit, rows, use_pool, group)
        if self.own is not None:
            return self.own.propose(history, limit), 0, False
        return ngram_lookup(history, min(limit, self.matches.max_tokens), self.matches.max_ngram), 0, False

    def learn(self, match: int, drafted: int, accepted: int, pooled: bool = False) -> None:
        """A verdict, learned by the shared table (a seeded request's verdicts too: the prior stays as it is)."""
        if self.pooled is not None:
            self.pooled.learn(match, drafted, accepted, pooled)

    def expected(self, match: int, drafted: int, pooled: bool = False, seeded: bool = False) -> float:
        """The tokens a priced draft is expected to have accepted, by the table that priced it."""
        return (self.prior if seeded else self.pooled).expected(match, drafted, pooled)

    def track(self, key: str, prompt: int, history: list[int], group: str | None = None) -> None:
        """Request `key`'s committed tokens so far (its prompt: the first `prompt` of them when first tracked); its
        output joins the pool, under its salt `group`, when it ends. Nothing without a pool."""
        if self.pool is not None:
            self.outputs[key] = (self.outputs.get(key, (prompt,))[0], history, group)

    def pool_finished(self, live: set[str]) -> int:
        """Tracked requests no longer `live` (finished or aborted): their outputs join the pool. How many."""
        gone = [k for k in self.outputs if k not in live]
        for key in gone:
            prompt, history, group = self.outputs.pop(key)
            self.pool.add(history[prompt:], group)
        return len(gone)


def seeded_row(runner, rid: str, row: int) -> bool:
    """Whether row `row` (vLLM's request `rid`) is a seeded sampled request's (a runner that does not say: taken as
    one). vLLM draws its random numbers from the request's own generator, as many at a step as it has drafts to
    verify, so what it samples depends on how many tokens each step drafted: drafts priced by tables that learn
    from every request's verdicts made the same seeded request give another answer each time (measured: 3 of 12
    seeded requests the same three times running, 12 of 12 with vLLM's EAGLE-3 alone). Its drafts are priced by
    the tables' priors instead, which never learn: they depend on its own tokens, its prediction and the step's
    rows, as vLLM's own methods' drafts do. Nor does it take another request's output from the pool: its random
    numbers could be those that made a pooled output (the same seed), and a draft must not depend on them."""
    batch = runner.input_batch
    greedy, seeded = getattr(batch, "greedy_reqs", None), getattr(batch, "generators", None)
    if greedy is None or seeded is None:
        return True
    return rid not in greedy and row in seeded
