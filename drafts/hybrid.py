"""Hybrid proposer: a suffix match (prompt lookup) when one is long enough, the draft model otherwise.

Each round, per session, it looks for the longest match of the sequence's suffix in the session's
own tokens (prompt and output) and, optionally, in the recent outputs of released sessions
(SuffixDecoding-style, a bounded pool, used where the session's own tokens match nothing or the
pool's match is confident). With a match it compares the predicted speedup of the two sources,
`E(α, k) / (1 + k·(c + v))` (drafts/cost_model.py), from each source's running per-session
acceptance α (fed by `learn`; the match's α is kept per match length min_match .. max_ngram, as a
1-token match is a weaker guess than a 3-token one): the match is free (c = 0), the model costs
`cost_ratio` per token. A match of at least `confident_match` tokens is taken without asking; a
session that keeps preferring the model still probes the match every `probe_every` rounds so that
its α can recover.

Lossless by construction: a round is one kind only. Model rounds carry the model's q rows for every
position (or none under greedy decoding); match rounds carry none (q one-hot). The source of a round
depends only on the committed prefix, the outcome of earlier rounds and other sessions' outputs, all
independent of the random numbers that verify it; other sessions' outputs drawn with the same seed
(hence the same position-keyed random numbers) are never used under sampling.

The model keeps its own sequence in step with this one: match drafts are appended to it with its
`rollback(length, token_ids)` verb (no compute), and the draft model catches up lazily, feeding every
token it has not seen in one forward at its next draft (its KV never holds rejected match drafts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cluster.core.errors import ConfigError, InvalidRequestError
from cluster.core.sampling import SamplingParams
from cluster.core.tree import first_chain
from drafts.cost_model import predicted_speedup
from drafts.proposer import DraftProposal, Proposer, SessionId
from drafts.suffix import match_tree, suffix_alternatives, suffix_match

NGRAM, MODEL = "ngram", "model"
MAX_PENDING = 64  # rounds proposed and not yet learned, per session (pipelining keeps a few)


class _Acceptance:
    """Running per-token acceptance of one source: EMA of accepted / (accepted + rejected), the
    estimator of `drafts/policy.py` (accepted ÷ drafted under-counts: a rejection ends the round)."""

    def __init__(self, prior: float, weight: float):
        self.successes, self.trials, self.weight = prior, 1.0, weight

    @property
    def alpha(self) -> float:
        return self.successes / self.trials if self.trials else 0.0

    def learn(self, num_drafted: int, num_accepted: int) -> None:
        w = self.weight
        self.successes = (1 - w) * self.successes + w * num_accepted
        self.trials = (1 - w) * self.trials + w * (num_accepted + int(num_accepted < num_drafted))


@dataclass
class SourceStats:
    """Totals over every session, per source (for tests, benchmarks and reports)."""

    rounds: int = 0  # rounds proposed
    drafted: int = 0  # drafts verified (reported by `learn`)
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class _Round:
    source: str
    start: int  # sequence position of the first draft
    token_ids: list[int]
    estimate: tuple  # the key of the acceptance estimate it feeds: (MODEL,) or (NGRAM, match length)


@dataclass
class _Session:
    tokens: list[int]
    params: SamplingParams
    prompt_len: int
    acceptance: dict[tuple, _Acceptance]  # (MODEL,) and (NGRAM, n) for match lengths n = min_match .. max_ngram
    pending: deque = field(default_factory=deque)  # _Round: proposed, not yet learned, in order
    passed_over: int = 0  # consecutive rounds with a match where the model was chosen


@dataclass
class _PoolEntry:
    tokens: list[int]
    seed: int | None  # None: produced by greedy decoding (no random numbers)


class HybridProposer:
    """`Proposer` over a model proposer (normally `DraftModelProposer`) and suffix matching."""

    name = "hybrid"

    def __init__(self, model: Proposer, max_ngram: int = 3, min_match: int = 1, confident_match: int | None = 8,
                 cost_ratio: float = 0.4, verify_token_cost: float = 0.03, prior_model: float = 0.7,
                 prior_ngram: float = 0.5, acceptance_weight: float = 0.25, probe_every: int = 8,
                 history_tokens: int = 8192, tree_width: int = 1, match_tokens: int = 0, extend_min: int = 4):
        """`max_ngram`: longest suffix looked up; `min_match`: shortest match used; `confident_match`: a
        match at least this long is used whatever the estimates say (None: never); `cost_ratio`: the
        model's c (draft token time / target step); `prior_*`: α before a source's first verified
        round; `probe_every`: rounds a match may be passed over before it is tried anyway;
        `history_tokens`: tokens of released sessions' outputs kept for cross-session matches (0: off);
        `tree_width` > 1: a match round asked for a tree (`propose_batch(trees=...)`, sequential rounds)
        proposes up to this many continuations of the session's own suffix with different first tokens,
        as a token tree verified in one forward (the chosen match is the tree's chain); `match_tokens` > k:
        such a round (sequential: it ends in the bonus token) whose match is at least `extend_min` tokens long
        proposes up to `match_tokens` tokens of its continuation instead of k (SuffixDecoding's adaptive
        length: a long match is likely to go on, its drafts cost nothing and verifying more of them little)."""
        if not 1 <= min_match <= max_ngram:
            raise ConfigError(f"need 1 <= {min_match=} <= {max_ngram=}")
        if confident_match is not None and confident_match < min_match:
            raise ConfigError(f"{confident_match=} must be at least {min_match=}")
        if not (0 < prior_model < 1 and 0 < prior_ngram < 1 and 0 < acceptance_weight <= 1):
            raise ConfigError("priors must lie in (0, 1) and acceptance_weight in (0, 1]")
        if match_tokens < 0 or extend_min < 1:
            raise ConfigError(f"need {match_tokens=} >= 0 and {extend_min=} >= 1")
        if cost_ratio < 0 or verify_token_cost < 0 or probe_every < 1 or history_tokens < 0:
            raise ConfigError("cost_ratio, verify_token_cost and history_tokens must be >= 0, probe_every >= 1")
        self.model = model
        self.tree_width = max(1, tree_width)
        self.tree_rounds = 0  # match rounds proposed as a tree of several continuations
        self.match_tokens, self.extend_min = match_tokens, extend_min
        self.extended_rounds = 0  # match rounds longer than asked (`match_tokens`)
        self.max_ngram, self.min_match, self.confident_match = max_ngram, min_match, confident_match
        self.max_match = max(max_ngram, confident_match or 0, extend_min if match_tokens else 0)
        self.cost_ratio, self.verify_token_cost = cost_ratio, verify_token_cost
        self.priors = {NGRAM: prior_ngram, MODEL: prior_model}
        self.acceptance_weight, self.probe_every = acceptance_weight, probe_every
        self.history_tokens = history_tokens
        self._sessions: dict[SessionId, _Session] = {}
        self._pool: deque[_PoolEntry] = deque()
        self._pool_size = 0
        self.stats = {NGRAM: SourceStats(), MODEL: SourceStats()}
        self.pool_rounds = 0  # match rounds whose match came from another session's output
        self.confident_rounds = 0  # match rounds taken because the match was long
        self.probe_rounds = 0  # match rounds taken to re-estimate α

    # -- sessions ------------------------------------------------------------------------------------

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def _get(self, session: SessionId) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise InvalidRequestError(f"unknown session {session!r} on proposer {self.name}") from None

    def tokens(self, session: SessionId) -> list[int]:
        return self._get(session).tokens

    def alpha(self, session: SessionId) -> dict:
        """The session's running α: {"model": α, "ngram": {match length: α}}."""
        acceptance = self._get(session).acceptance
        return {MODEL: acceptance[(MODEL,)].alpha,
                NGRAM: {key[1]: a.alpha for key, a in acceptance.items() if key[0] == NGRAM}}

    def start(self, session: SessionId, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if session in self._sessions:
            raise InvalidRequestError(f"session {session!r} already started on proposer {self.name}")
        self.model.start(session, prompt_ids, params)
        acceptance = {(MODEL,): _Acceptance(self.priors[MODEL], self.acceptance_weight)}
        for n in range(self.min_match, self.max_ngram + 1):
            acceptance[(NGRAM, n)] = _Acceptance(self.priors[NGRAM], self.acceptance_weight)
        self._sessions[session] = _Session(list(prompt_ids), params, len(prompt_ids), acceptance)

    def release(self, session: SessionId) -> None:
        state = self._sessions.pop(session, None)
        self.model.release(session)
        if state is not None and self.history_tokens:
            self._remember(state)

    # -- proposing -----------------------------------------------------------------------------------

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        return self.propose_batch({session: k})[session]

    def propose_batch(self, requests: dict[SessionId, int], trees: Collection[SessionId] = ()
                      ) -> dict[SessionId, DraftProposal]:
        """Match rounds are drafted here; the model's rounds in one batched `propose_batch` call. `trees`:
        sessions whose round is sequential (it ends in the bonus token): it may be a token tree (several match
        continuations, or the model's own tree) or, with `match_tokens`, a match round longer than k."""
        out: dict[SessionId, DraftProposal] = {}
        model_requests: dict[SessionId, int] = {}
        for session, k in requests.items():
            state = self._get(session)
            self._drop_stale(state)
            if k <= 0:
                out[session] = DraftProposal([], None)
                continue
            drafts, estimate = self._choose(state, k, self.match_tokens if session in trees else 0)
            if drafts is None:
                model_requests[session] = k
                continue
            start = len(state.tokens)
            others = []
            if len(drafts) > k:
                self.extended_rounds += 1  # a chain: its length, not siblings, is what this round spends
            elif session in trees and self.tree_width > 1:
                others = suffix_alternatives(state.tokens, len(drafts), self.max_ngram, self.min_match,
                                             self.tree_width - 1, {drafts[0]})
            state.tokens.extend(drafts)
            self.model.rollback(session, start, drafts)  # the model's sequence follows (no compute)
            self._record(state, NGRAM, start, drafts, estimate)
            if others:
                self.tree_rounds += 1
                token_ids, parents = match_tree([drafts, *others])
                out[session] = DraftProposal(token_ids, None, parents)
            else:
                out[session] = DraftProposal(drafts, None)
        if model_requests:
            model_trees = [s for s in trees if s in model_requests]
            if model_trees and getattr(self.model, "tree_width", 1) > 1:
                proposals = self.model.propose_batch(model_requests, trees=model_trees)
            else:
                proposals = self.model.propose_batch(model_requests)
            for session, proposal in proposals.items():
                state = self._sessions[session]
                if proposal.token_ids:
                    start = len(state.tokens)
                    chain = first_chain(proposal.token_ids, proposal.parents)
                    state.tokens.extend(chain)
                    self._record(state, MODEL, start, chain, (MODEL,))
                out[session] = proposal
        return {session: out[session] for session in requests}

    def _choose(self, state: _Session, k: int, extend_to: int = 0) -> tuple[list[int] | None, tuple]:
        """(the match's drafts, its estimate's key) when this round uses the match; (None, ()) for the model.
        `extend_to` > k: a match at least `extend_min` long proposes up to that many drafts."""
        drafts, match, pooled = self._lookup(state, max(k, extend_to))
        if not drafts or match < self.min_match:
            return None, ()
        if match < self.extend_min:
            drafts = drafts[:k]
        estimate = (NGRAM, min(match, self.max_ngram))
        use = self.confident_match is not None and match >= self.confident_match
        if use:
            self.confident_rounds += 1
        else:
            ngram = predicted_speedup(state.acceptance[estimate].alpha, len(drafts), 0.0,
                                      verify_token_cost=self.verify_token_cost)
            model = predicted_speedup(state.acceptance[(MODEL,)].alpha, k, self.cost_ratio,
                                      verify_token_cost=self.verify_token_cost)
            use = ngram >= model
            if not use:
                state.passed_over += 1
                if state.passed_over < self.probe_every:
                    return None, ()
                self.probe_rounds += 1
                use = True
        state.passed_over = 0
        self.pool_rounds += int(pooled)
        return drafts, estimate

    def _lookup(self, state: _Session, k: int) -> tuple[list[int], int, bool]:
        """The session's own longest match; the pool's (newest first) where the session's own tokens
        match nothing, or where the pool's match is longer and confident."""
        tokens = state.tokens
        best, best_len = suffix_match(tokens, tokens, k, self.max_ngram, self.min_match, self.max_match)
        pooled = False
        if self._pool and best_len < self.max_match:
            seed = None if state.params.greedy else state.params.seed
            need = max(best_len + 1, self.confident_match or self.max_match) if best else 1
            for entry in reversed(self._pool):
                # same seed, same position-keyed random numbers: that output is not independent of ours
                if seed is not None and entry.seed == seed:
                    continue
                drafts, match = suffix_match(tokens, entry.tokens, k, self.max_ngram, self.min_match, self.max_match)
                if match >= need and match > best_len:
                    best, best_len, pooled = drafts, match, True
                    if match >= self.max_match:
                        break
        return best, best_len, pooled

    def _record(self, state: _Session, source: str, start: int, token_ids: list[int], estimate: tuple) -> None:
        state.pending.append(_Round(source, start, token_ids, estimate))
        if len(state.pending) > MAX_PENDING:  # a caller that never calls `learn`: stay bounded
            state.pending.popleft()
        self.stats[source].rounds += 1

    @staticmethod
    def _drop_stale(state: _Session) -> None:
        """Forget proposed rounds whose drafts are no longer in the sequence and were never learned
        (rounds in flight behind a rejection, a redraft that was discarded): `learn` then credits
        the right round. A round learned in order is popped before the next propose."""
        tokens = state.tokens
        if state.pending:
            state.pending = deque(r for r in state.pending if r.start + len(r.token_ids) <= len(tokens)
                                  and tokens[r.start:r.start + len(r.token_ids)] == r.token_ids)

    # -- feedback ------------------------------------------------------------------------------------

    @property
    def needs_features(self) -> bool:
        """A feature-fed model reads the target's features (the verifier sends them)."""
        return getattr(self.model, "needs_features", False)

    def add_features(self, session: SessionId, start: int, rows) -> None:
        if self.needs_features:
            self.model.add_features(session, start, rows)

    def rollback(self, session: SessionId, length: int, token_ids: Sequence[int] = ()) -> None:
        state = self._get(session)
        tokens = state.tokens
        if not 0 <= length <= len(tokens):
            raise ValueError(f"cannot roll session {session!r} of length {len(tokens)} back to {length}")
        del tokens[length:]
        tokens.extend(token_ids)
        self.model.rollback(session, length, token_ids)

    def learn(self, session: SessionId, num_drafted: int, num_accepted: int) -> None:
        """Credits the oldest drafts not yet learned, in order (rounds are verified in order). A round
        is usually one proposal; a round that took several proposals (continuous drafting proposes a
        token at a time) credits each its share: the accepted prefix, then the rejected draft; drafts
        behind the rejection were never tested and teach nothing."""
        state = self._get(session)
        offset = 0  # drafts of this round already credited
        while offset < num_drafted and state.pending:
            done = state.pending[0]
            n = min(len(done.token_ids), num_drafted - offset)
            if n < len(done.token_ids):  # the round took part of this proposal: the rest stays pending
                state.pending[0] = _Round(done.source, done.start + n, done.token_ids[n:], done.estimate)
            else:
                state.pending.popleft()
            accepted = min(max(num_accepted - offset, 0), n)
            self.stats[done.source].drafted += n
            self.stats[done.source].accepted += accepted
            if offset <= num_accepted:  # tested: its drafts up to the first rejection were verified
                state.acceptance[done.estimate].learn(n, accepted)
                if done.source == MODEL:
                    self.model.learn(session, n, accepted)
            offset += n

    # -- the cross-session pool ----------------------------------------------------------------------

    def _remember(self, state: _Session) -> None:
        """Keep the released session's output (and the prompt's last tokens, for matches across the
        boundary), up to its oldest unverified round; evict the oldest outputs past `history_tokens`."""
        end = state.pending[0].start if state.pending else len(state.tokens)
        if end <= state.prompt_len:
            return
        begin = max(0, state.prompt_len - self.max_match, end - self.history_tokens)
        entry = _PoolEntry(state.tokens[begin:end], None if state.params.greedy else state.params.seed)
        self._pool.append(entry)
        self._pool_size += len(entry.tokens)
        while self._pool_size > self.history_tokens:
            self._pool_size -= len(self._pool.popleft().tokens)

    def report(self) -> dict:
        """Per source: rounds, drafted, accepted, acceptance rate; and how match rounds were chosen."""
        out = {source: {"rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                        "acceptance_rate": s.acceptance_rate} for source, s in self.stats.items()}
        out.update(pool_rounds=self.pool_rounds, confident_rounds=self.confident_rounds,
                   probe_rounds=self.probe_rounds, pool_tokens=self._pool_size, extended_rounds=self.extended_rounds)
        return out
