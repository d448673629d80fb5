"""Prompt lookup picks the continuation of the earliest, longest match."""

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
