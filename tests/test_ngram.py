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
