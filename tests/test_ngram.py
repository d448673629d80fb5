"""Prompt lookup picks the continuation of the earliest, longest match."""

import pytest

from cluster.core.sampling import SamplingParams
from drafts.ngram import NGramProposer, ngram_lookup


def test_longest_then_earliest_match():
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(tokens, 2, max_ngram=3) == [9, 9]  # "1 2 3" matches at 0
    assert ngram_lookup([5, 2, 3, 7, 4, 2, 3, 8, 0, 3], 3, max_ngram=3) == [7, 4, 2]  # only "3" matches
    assert ngram_lookup([1, 2, 3], 2) == []


def test_proposer_extends_its_own_sequence_and_rolls_back():
    proposer = NGramProposer()
    proposer.start("s", [4, 5, 6, 4, 5], SamplingParams())
    assert proposer.propose("s", 2).token_ids == [6, 4]
    assert proposer.tokens("s") == [4, 5, 6, 4, 5, 6, 4]
    proposer.rollback("s", 5, [9])
    assert proposer.tokens("s") == [4, 5, 6, 4, 5, 9]
    assert proposer.propose("s", 3).token_ids == []


def _lookup_by_scan(tokens, k, max_ngram, min_ngram=1):
    """The definition, position by position: the earliest start of the longest n-gram suffix's match."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_lookup_equals_its_definition_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice((2, 4, 16))) for _ in range(rng.randrange(0, 40))]
        k, max_ngram = rng.randrange(1, 6), rng.randrange(1, 5)
        assert ngram_lookup(tokens, k, max_ngram) == _lookup_by_scan(tokens, k, max_ngram), (tokens, k, max_ngram)


def test_priced_match_drafts_what_pays_and_learns_from_verdicts():
    from drafts.suffix import PricedMatch

    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # "1 2 3" matches (3 long): continuation 4 5 6 ...
    priced = PricedMatch(max_tokens=6, max_match=8, threshold=0.1, per_row=0.05)
    draft, match = priced.propose(tokens, 6)
    assert match == 3 and draft == [4, 5, 6, 7, 8, 9][:len(draft)] and len(draft) >= 2  # the prior lets it draft
    assert priced.propose(tokens, 1)[0] == [4]  # the limit
    assert len(priced.propose(tokens, 6, rows=16)[0]) < len(draft)  # a full batch prices tokens higher
    busy = PricedMatch(max_tokens=6, max_match=8, threshold=0.1, per_row=0.05, busy_rows=9)
    assert busy.price(8) == priced.price(8) < busy.price(9) == PricedMatch.BUSY_PRICE  # near-certain from 9 rows
    assert busy.propose(tokens, 6, rows=9) == ([], 3)  # a 3-token match's prior (0.71) is not near-certain
    for _ in range(300):  # 3-token matches never right: their drafts stop
        priced.learn(3, len(draft), 0)
    assert priced.propose(tokens, 6) == ([], 3)
    assert priced.q(3, 0) < 0.1 and priced.q(4, 0) == PricedMatch.prior(4, 0)  # other lengths untouched
    longer = PricedMatch(max_tokens=6, max_match=8, threshold=0.3)
    first = len(longer.propose(tokens, 6)[0])
    for _ in range(300):  # always all right: as long as allowed
        longer.learn(3, 6, 6)
    assert longer.propose(tokens, 6)[0] == [4, 5, 6, 7, 8, 9] and first < 6
    assert longer.propose([1, 2, 3, 4], 6) == ([], 0)  # no match at all
    with pytest.raises(ValueError):
        PricedMatch(threshold=0.0)


def test_suffix_proposer_learns_its_own_verdicts():
    from drafts.ngram import SuffixProposer

    proposer = SuffixProposer(max_tokens=8)
    proposer.start("s", [7, 8, 9, 10, 11, 12, 7, 8, 9], SamplingParams())
    first = proposer.propose("s", 8).token_ids
    assert first and first == [10, 11, 12, 7, 8, 9][:len(first)]
    before = proposer.priced.q(3, 0)
    proposer.learn("s", len(first), 0)
    assert proposer.priced.q(3, 0) < before  # the verdict reached the table of its match length
    proposer.release("s")
    assert proposer.num_sessions == 0 and proposer._given == {}


def test_the_suffix_pool_finds_the_longest_match_in_earlier_outputs_and_forgets_the_oldest():
    from drafts.suffix import SuffixPool

    pool = SuffixPool(max_tokens=20, ngram=3, max_match=6)
    pool.add([1, 2, 3, 4, 5, 6, 7])  # "1 2 3" then 4 5 6 7
    pool.add([9, 2, 3, 4, 8, 8])  # "9 2 3 4" then 8 8: the same 3-gram "2 3 4", a longer match for "9 2 3 4"
    pool.add([1, 2])  # too short to hold a 3-gram and its next token: left out
    assert len(pool) == 2 and pool.tokens == 13
    assert pool.match([7, 9, 2, 3, 4], 5) == ([8, 8], 4)  # the longer match wins, its continuation to its end
    assert pool.match([0, 1, 2, 3, 4], 2) == ([5, 6], 4)
    assert pool.match([0, 0, 2, 3, 4], 2) == ([8, 8], 3)  # equal matches: the newest output
    assert pool.match([5, 5, 5], 3) == ([], 0) and pool.match([2, 3], 3) == ([], 0)
    pool.add([5, 5, 5, 1, 1, 1, 1, 1, 1])  # 22 tokens: the oldest output leaves, its n-grams with it
    assert len(pool) == 2 and pool.tokens == 15
    assert pool.match([0, 1, 2, 3], 2) == ([], 0) and pool.match([0, 2, 3, 4], 2) == ([8, 8], 3)
    assert pool.match([5, 5, 5], 2) == ([1, 1], 3)
    pool.add([4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4])  # the two before leave, one with an n-gram twice
    pool.add([7, 7, 7, 7, 7, 7, 7, 7, 7])  # and so does this one's predecessor: "4 4 4" four times over
    assert len(pool) == 1 and pool.match([4, 4, 4], 2) == ([], 0) and pool.match([7, 7, 7], 2) == ([7], 3)
    assert all(pool._index.values())  # no empty entry left behind


def test_the_pool_matches_only_outputs_of_the_sessions_own_salt_group():
    """Each output is pooled under its request's salt group and matched only by that group (None: unsalted), through
    the pool, the priced matches over it and the vLLM proposer's matcher (tracked, then pooled when gone); one budget
    holds every group, and eviction leaves no empty entry."""
    from cluster.vllm.inline import InlineMatcher
    from cluster.vllm.protocol import InlineMatches
    from drafts.suffix import PooledPricedMatch, PricedMatch, SuffixPool

    pool = SuffixPool(max_tokens=24, ngram=3, max_match=6)
    pool.add([1, 2, 3, 4, 5, 6], "a" * 16)
    pool.add([1, 2, 3, 7, 7, 7], None)
    assert pool.match([0, 1, 2, 3], 2, "a" * 16) == ([4, 5], 3) and pool.match([0, 1, 2, 3], 2) == ([7, 7], 3)
    assert pool.match([0, 1, 2, 3], 2, "b" * 16) == ([], 0)
    pool.add([9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], "b" * 16)  # 26 tokens: group a's output, the oldest, leaves
    assert pool.match([0, 1, 2, 3], 2, "a" * 16) == ([], 0) and pool.match([9, 9, 9], 1, "b" * 16) == ([9], 3)
    assert all(pool._index.values())
    matcher = PooledPricedMatch(PricedMatch(max_tokens=4, max_match=8), pool)
    assert matcher.propose([0, 1, 2, 3], 4, group="b" * 16) == ([], 0, False)
    assert matcher.propose([0, 1, 2, 3], 4)[2] is True  # the unsalted output, for an unsalted request

    inline = InlineMatcher(InlineMatches(kind="priced", max_tokens=4, pool_tokens=100))
    inline.track("r1", 2, [50, 51, 10, 11, 12, 13, 14, 15, 16], "c" * 16)  # prompt 50 51, then its output
    assert inline.pool_finished(set()) == 1
    assert inline.propose([1, 10, 11, 12, 13], 4, 1, use_pool=True, group="c" * 16)[2] is True
    assert inline.propose([1, 10, 11, 12, 13], 4, 1, use_pool=True) == ([], 0, False)  # unsalted: not c's text


def test_pooled_priced_matches_draft_from_the_pool_only_where_it_matches_longer():
    from drafts.suffix import PooledPricedMatch, PricedMatch, SuffixPool

    pool = SuffixPool(max_tokens=100, ngram=3, max_match=8)
    pool.add([10, 11, 12, 13, 14, 15, 16, 17])
    matcher = PooledPricedMatch(PricedMatch(max_tokens=4, max_match=8), pool)
    draft, match, pooled = matcher.propose([1, 10, 11, 12, 13], 4)  # no match of its own: the pool's
    assert pooled and match == 4 and draft and draft == [14, 15, 16, 17][:len(draft)]
    own = [10, 11, 12, 13, 14, 99, 5, 10, 11, 12, 13, 14, 15]  # its own 5-token match beats the pool's
    assert matcher.propose(own[:-1], 4)[2] is False
    assert matcher.propose([1, 10, 11, 12, 13], 4, use_pool=False) == ([], 0, False)  # a seeded request
    q = matcher.pooled.q(4, 0)
    matcher.learn(4, len(draft), 0, pooled=True)  # the pool's own table learns its verdicts
    assert matcher.pooled.q(4, 0) < q and matcher.own.q(4, 0) == PricedMatch.prior(4, 0)


def test_a_match_factor_keeps_a_draft_within_its_match_length():
    from drafts.suffix import PricedMatch

    tokens = [5, 6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # "1 2": a 2-token match, continued by 3 4 5 6 ...
    free = PricedMatch(max_tokens=8, threshold=0.01)
    capped = PricedMatch(max_tokens=8, threshold=0.01, match_factor=1.0)
    draft, match = free.propose(tokens, 8)
    assert match == 2 and len(draft) > 2  # priced alone, a cheap price lets it run on
    assert capped.propose(tokens, 8) == (draft[:2], 2)  # no longer than its match
    assert PricedMatch(max_tokens=8, threshold=0.01, match_factor=0.1).propose(tokens, 8) == (draft[:1], 2)  # one at least
    with pytest.raises(ValueError):
        PricedMatch(match_factor=-1.0)


def test_expected_tokens_of_a_match_and_of_a_chain_follow_their_verdicts():
    """What decides a row in vLLM's EAGLE-3 proposer (`cluster.vllm.eagle_matches`): a priced match's expected
    accepted tokens (Σ_j Π_{i≤j} q[m][i]) against a chain draft's, both learned from verdicts."""
    from cluster.vllm.eagle_matches import ChainAcceptance
    from drafts.suffix import PooledPricedMatch, PricedMatch, SuffixPool

    priced = PricedMatch()
    q = [priced.q(6, j) for j in range(3)]
    assert priced.expected(6, 3) == pytest.approx(q[0] + q[0] * q[1] + q[0] * q[1] * q[2])
    assert priced.expected(6, 0) == 0 and priced.expected(1, 3) < priced.expected(6, 3)  # a longer match goes further
    before = priced.expected(6, 4)
    for _ in range(50):
        priced.learn(6, 4, 0)  # always wrong at once
    assert priced.expected(6, 4) < 0.3 * before
    pooled = PooledPricedMatch(PricedMatch(), SuffixPool())
    for _ in range(50):
        pooled.learn(6, 4, 4, pooled=True)  # the pool's own table learns; the session's own stays at its prior
    assert pooled.expected(6, 4, pooled=True) > pooled.expected(6, 4) == PricedMatch().expected(6, 4)
    chain = ChainAcceptance(prior=0.5)
    assert chain.expected(3) == pytest.approx(0.5 + 0.25 + 0.125) and chain.expected(0) == 0
    for _ in range(200):
        chain.learn(3, 1)  # the first token right, the second wrong: the third never tried
    assert chain.expected(1) > 0.95 and chain.expected(3) - chain.expected(1) < 0.1
    assert chain.trials[2] == ChainAcceptance.PRIOR_TRIALS  # an untried position keeps its prior


def test_eagle3_forward_runs_only_for_rows_that_can_take_its_drafts():
    """vLLM's EAGLE-3 forward (`EagleMatches`' wrapped `propose`) runs only while some row may take its drafts: a row
    is stale (a busy step without the forward left its draft KV behind) or capped at 0 (plain decoding). The runner
    is a stand-in for vLLM's GPU model runner (named so): the attributes the wrapper reads, and a fake `propose`."""
    from types import SimpleNamespace

    import numpy as np

    from cluster.vllm.eagle_matches import EagleMatches
    from cluster.vllm.protocol import InlineMatches

    calls = []

    class FakeEagleProposer:  # test double of vLLM's EagleProposer: counts its forwards, drafts 7s
        method = "eagle3"

        def propose(self, num_speculative_tokens, *args, **kwargs):
            calls.append(num_speculative_tokens)
            return np.full((len(batch.req_ids), num_speculative_tokens), 7)

    prompt, out = [1, 2, 3, 4], [5, 6, 8, 9]  # no repeat: no match anywhere
    batch = SimpleNamespace(req_ids=["a", "b~k0"], num_prompt_tokens=np.array([4, 4]),
                            num_tokens_no_spec=np.array([8, 8]), token_ids_cpu=np.array([prompt + out] * 2),
                            greedy_reqs=set(), generators={})
    runner = SimpleNamespace(drafter=FakeEagleProposer(), input_batch=batch, requests={"a": 1, "b~k0": 1},
                             speculative_config=SimpleNamespace(disable_padded_drafter_batch=True,
                                                                draft_sample_method="greedy"))
    matches = EagleMatches(runner, InlineMatches(kind="priced", max_tokens=16), gamma=3)
    matches.install()
    assert runner.drafter.propose(16) == [[7, 7, 7], []] and calls == [3]  # "a" drafts; "b" asked for plain decoding
    matches.stale.add("a")  # "a" lived through a step without the forward
    assert runner.drafter.propose(16) == [[], []] and calls == [3]  # no row can take EAGLE-3's drafts: no forward
    assert matches.snapshot()["eagle_skipped_steps"] == 1
    batch.req_ids, runner.requests = ["a", "b~k0", "c"], {"a": 1, "b~k0": 1, "c": 1}  # a fresh request joins
    batch.num_prompt_tokens, batch.num_tokens_no_spec = np.array([4, 4, 4]), np.array([8, 8, 8])
    batch.token_ids_cpu = np.array([prompt + out] * 3)
    assert runner.drafter.propose(16) == [[], [], [7, 7, 7]] and calls == [3, 3]


def test_a_seeded_sampled_rows_drafts_do_not_depend_on_what_other_requests_taught_the_tables():
    """vLLM draws a seeded request's random numbers from its own generator, as many a step as it has drafts: drafts
    priced by tables that learn from every request's verdicts gave the same seeded request another answer each time.
    A seeded sampled row (`seeded_row`) is decided by the priors: after the shared tables learned that matches are
    always wrong and EAGLE-3's drafts always right, a greedy row switches to EAGLE-3's draft and a seeded row still
    drafts as an untaught proposer does. Stand-in runner as above (named so)."""
    from types import SimpleNamespace

    import numpy as np

    from cluster.vllm.eagle_matches import EagleMatches
    from cluster.vllm.inline import seeded_row
    from cluster.vllm.protocol import InlineMatches

    class FakeEagleProposer:  # test double of vLLM's EagleProposer: drafts 7s
        method = "eagle3"

        def propose(self, num_speculative_tokens, *args, **kwargs):
            return np.full((2, num_speculative_tokens), 7)

    history = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5]  # a repeat: a long match continues with 6 9 1 2

    def proposer():
        batch = SimpleNamespace(req_ids=["g", "s"], num_prompt_tokens=np.array([4, 4]),
                                num_tokens_no_spec=np.array([len(history)] * 2), token_ids_cpu=np.array([history] * 2),
                                greedy_reqs={"g"}, generators={1: object()})  # row 1: seeded and sampled
        runner = SimpleNamespace(drafter=FakeEagleProposer(), input_batch=batch, requests={"g": 1, "s": 1},
                                 speculative_config=SimpleNamespace(disable_padded_drafter_batch=True,
                                                                    draft_sample_method="greedy"))
        matches = EagleMatches(runner, InlineMatches(kind="priced", max_tokens=16, threshold=0.01), gamma=3)
        matches.install()
        return runner, matches

    runner, matches = proposer()
    assert not seeded_row(runner, "g", 0) and seeded_row(runner, "s", 1)
    untaught = runner.drafter.propose(16)
    assert untaught[0] == untaught[1] and untaught[0][:4] == [6, 9, 1, 2]  # the match wins at the priors
    for _ in range(300):  # other requests' verdicts: every match wrong at once, every EAGLE-3 draft right
        for match in range(1, 17):
            matches.matcher.learn(match, 8, 0)
        matches.chain.learn(3, 3)
    runner.requests = {"g": 1, "s": 1}
    matches.given.clear()
    taught = runner.drafter.propose(16)
    assert taught[0] == [7, 7, 7]  # the greedy row follows what was learned
    assert taught[1] == untaught[1]  # the seeded row drafts as the untaught proposer did
    assert proposer()[0].drafter.propose(16)[1] == taught[1]
