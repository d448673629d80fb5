"""tools.match_replay's replay, on synthetic references (no model, no vLLM)."""

from drafts.suffix import PricedMatch
from tools.match_replay import replay

REFS = [{"prompt": [1, 2, 3, 4, 5, 6], "out": [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]}]


def test_replay_counts_steps_from_the_verdicts():
    out = REFS[0]["out"]
    oracle = lambda history, limit: (out[len(history) - 6:len(history) - 6 + limit], 0)  # noqa: E731
    right = replay(REFS, oracle)
    assert right["acceptance"] == 1.0 and right["tokens_per_step"] == 10.0  # one step: 9 drafts + 1
    plain = replay(REFS, lambda history, limit: ([], 0), v=0.1)
    assert plain["tokens_per_step"] == 1.0 and plain["speedup"] == 1.0
    wrong = replay(REFS, lambda history, limit: ([0] * min(limit, 2), 0), v=0.5)
    assert wrong["acceptance"] == 0.0 and wrong["speedup"] < 1.0  # rejected drafts cost verify width


def test_replay_feeds_priced_matches_their_verdicts():
    priced = PricedMatch(max_tokens=8, max_match=8)
    seen = []
    result = replay(REFS, priced.propose, lambda m, d, a: seen.append((m, d, a)) or priced.learn(m, d, a))
    assert any(d for _, d, _ in seen) and result["tokens_per_step"] > 1.0  # the repeat was drafted


def test_replay_brackets_each_reference_for_rules_with_per_request_state():
    events = []
    refs = REFS + [{"prompt": [7, 8], "out": [9, 9, 9]}]
    replay(refs, lambda history, limit: ([], 0), begin=lambda prompt: events.append(("begin", prompt)),
           end=lambda: events.append(("end",)))
    assert events == [("begin", [1, 2, 3, 4, 5, 6]), ("end",), ("begin", [7, 8]), ("end",)]


def test_vllms_suffix_method_is_a_rule_exactly_where_arctic_inference_is_installed():
    import importlib.util

    from tools.match_replay import rules

    rules_by_name = dict(rules())
    installed = importlib.util.find_spec("arctic_inference") is not None
    assert ("vLLM suffix, own tree" in rules_by_name) == installed
    if installed:  # (`make peer-extras`) its suffix tree drafts the repeat of the prompt
        propose, learn, begin, end = rules_by_name["vLLM suffix, own tree"]()
        result = replay(REFS, propose, learn, 0.03, begin, end)
        assert result["tokens_per_step"] > 1.0
