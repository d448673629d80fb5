"""A prompt's KV kept after its session ends (`cluster.model.prompt_cache`) for a later session that opens with
exactly the same tokens: on the target's verifier and on the draft model. What a kept prompt gives is a prefill's
own keys and values, bit for bit, so decoding is unchanged; nothing but an exact match is used, under the same
`cache_salt`; the kept tokens stay within the budget."""

from __future__ import annotations

import torch

from cluster.core.sampling import SamplingParams
from cluster.model.prompt_cache import PromptCache
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import VerifierEngine
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer
from tests.helpers import tiny_llama
from tests.test_choices import _decode

PROMPT = [5, 9, 2, 7, 7, 3, 1, 4]  # tiny_llama's vocabulary is 10 tokens


def _kv(runner: TorchModelRunner, session, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone())
            for layer in runner._get(session).cache.layers]


def test_a_kept_prompt_is_its_prefill_bit_for_bit_and_decodes_the_same():
    runner = TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=64)
    engine = VerifierEngine(runner)
    params = SamplingParams(temperature=1.0, seed=7)
    engine.open("first", PROMPT, params)
    fresh = _kv(runner, "first", len(PROMPT) - 1)
    first = _decode(engine, ["first"], 6)["first"]
    engine.release("first")
    assert runner.num_sessions == 0 and runner.num_kept == 1 and engine.prompt_cache.tokens == len(PROMPT) - 1
    engine.open("again", PROMPT, params)
    assert engine.prompt_cache.stats.hits == 1 and engine.prompt_cache.stats.hit_tokens == len(PROMPT) - 1
    assert all(torch.equal(a, b) and torch.equal(c, d)
               for (a, c), (b, d) in zip(fresh, _kv(runner, "again", len(PROMPT) - 1)))
    assert _decode(engine, ["again"], 6)["again"] == first
    engine.release("again")
    assert runner.num_kept == 1 and engine.prompt_cache.stats.kept == 1  # kept once


def test_only_an_exact_prompt_is_taken():
    """A prompt that shares a prefix with a kept one, or extends it, is prefilled: the first positions of
    another shape's prefill may differ in the last bit. One whose prefilled tokens (all but its last) are the
    same is a hit: its last token is fed with the first round, as always."""
    engine = VerifierEngine(TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=64))
    params = SamplingParams()
    engine.open("a", PROMPT, params)
    engine.release("a")
    for i, prompt in enumerate([PROMPT[:-1], PROMPT + [2], PROMPT[:-1] + [0]]):
        engine.open(f"b{i}", prompt, params)
        engine.release(f"b{i}")
    stats = engine.prompt_cache.stats
    assert stats.hits == 1 and stats.misses == 3 and stats.kept == 3  # "a" missed too


def test_prompt_logprobs_and_features_prefill_as_before():
    """Both need the prefill's own rows (every position's logits, the target's features)."""
    runner = TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=64)
    engine = VerifierEngine(runner)
    engine.open("a", PROMPT, SamplingParams())
    engine.release("a")
    opened = engine.open("logprobs", PROMPT, SamplingParams(prompt_logprobs=1))
    assert len(opened.prompt_logprobs) == len(PROMPT) - 1
    opened = engine.open("features", PROMPT, SamplingParams(), features=True)
    assert opened.features is not None and opened.features.shape[0] == len(PROMPT) - 1
    assert engine.prompt_cache.stats.hits == 0


def test_the_budget_keeps_the_most_recent_prompts():
    runner = TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=20)  # two prompts of 7 kept tokens, not three
    engine = VerifierEngine(runner)
    prompts = [[i, *PROMPT[1:]] for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.open(f"s{i}", prompt, SamplingParams())
        engine.release(f"s{i}")
    cache = engine.prompt_cache
    assert cache.tokens == 14 <= cache.max_tokens and len(cache) == runner.num_kept == 2 and cache.stats.evicted == 1
    engine.open("old", prompts[0], SamplingParams())  # the least recently used went first
    engine.open("new", prompts[2], SamplingParams())
    assert cache.stats.hits == 1
    long = PromptCache(runner, 4)
    assert not long.keep("new", prompts[2][:-1]) and len(long) == 0  # longer than the whole budget
    off = VerifierEngine(TorchModelRunner(tiny_llama(seed=5)))  # a runner's own default: none
    off.open("a", PROMPT, SamplingParams())
    off.release("a")
    assert off.runner.num_kept == 0 and not off.prompt_cache.enabled
    cache.clear()
    assert runner.num_kept == 0 and cache.tokens == 0


def test_a_kept_prompt_is_for_the_thread_count_it_was_computed_with():
    """Another torch thread count may split a prefill's sums otherwise: its prompts are kept apart, under the
    count their prefill ran with (not the one at their release)."""
    engine = VerifierEngine(TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=64))
    threads = torch.get_num_threads()
    engine.open("a", PROMPT, SamplingParams())
    engine.release("a")
    try:
        torch.set_num_threads(threads + 1)
        engine.open("b", PROMPT, SamplingParams())
        assert engine.prompt_cache.stats.hits == 0
    finally:
        torch.set_num_threads(threads)
    engine.release("b")  # prefilled with one thread more: kept apart
    assert len(engine.prompt_cache) == 2
    engine.open("c", PROMPT, SamplingParams())
    assert engine.prompt_cache.stats.hits == 1
    engine.release("c")
    torch.set_num_threads(threads + 1)
    try:
        engine.open("d", PROMPT, SamplingParams())
        assert engine.prompt_cache.stats.hits == 2
    finally:
        torch.set_num_threads(threads)


def test_repeated_requests_decode_as_without_the_cache_on_target_and_draft():
    """The same prompt sampled again (seeds 0..5, twice) through the whole loop with a draft model: the
    second pass takes both prefills from the caches, and every output equals a decoder's without them."""
    target, draft = tiny_llama(seed=1), tiny_llama(seed=2)

    def decoder(cache_tokens: int) -> SpeculativeDecoder:
        proposer = DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=cache_tokens))
        return SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=cache_tokens), proposer, None, 3)

    cached, plain = decoder(256), decoder(0)
    requests = [SamplingParams(temperature=1.0, seed=seed, max_tokens=12) for seed in range(6)] * 2
    outputs = [cached.generate(PROMPT, params).token_ids for params in requests]
    assert outputs == [plain.generate(PROMPT, params).token_ids for params in requests]
    assert outputs[:6] == outputs[6:] and len(set(map(tuple, outputs))) > 1
    assert cached.engine.prompt_cache.stats.hits == len(requests) - 1
    assert cached.proposer.prompt_cache.stats.hits == len(requests) - 1
    assert plain.engine.prompt_cache.stats.hits == plain.proposer.prompt_cache.stats.hits == 0
    assert cached.target.num_sessions == cached.proposer.runner.num_sessions == 0  # only the kept prompts stay
    assert cached.target.num_kept == cached.proposer.runner.num_kept == 1


def test_a_salted_session_takes_only_a_prompt_kept_under_its_own_salt(monkeypatch):
    """vLLM's `cache_salt`: a prompt kept by an unsalted session, or one of another salt, is a miss (the session
    prefills); one kept under the same salt is a hit, its KV a prefill's own; greedy output is the same bit for bit
    whatever the salt."""
    runner = TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=64)
    engine = VerifierEngine(runner)
    prefills = []  # the sessions the runner prefilled (extend is called for nothing else before a round)
    extend = runner.extend
    monkeypatch.setattr(runner, "extend", lambda sid, *args, **kw: prefills.append(sid) or extend(sid, *args, **kw))
    engine.open("plain", PROMPT, SamplingParams())
    fresh = _kv(runner, "plain", len(PROMPT) - 1)
    plain = _decode(engine, ["plain"], 6)["plain"]
    engine.release("plain")
    outputs, stats, expected = {}, engine.prompt_cache.stats, [0, 1]  # hits, misses ("plain" missed)
    for sid, salt, hit in [("a", "tenant-a", False), ("b", "tenant-b", False), ("a2", "tenant-a", True),
                           ("unsalted", None, True)]:
        engine.open(sid, PROMPT, SamplingParams(cache_salt=salt))
        expected[not hit] += 1
        assert [stats.hits, stats.misses] == expected and (sid in prefills) is not hit
        assert all(torch.equal(k, k2) and torch.equal(v, v2)
                   for (k, v), (k2, v2) in zip(fresh, _kv(runner, sid, len(PROMPT) - 1)))
        outputs[sid] = _decode(engine, [sid], 6)[sid]
        engine.release(sid)
    assert all(out == plain for out in outputs.values())
    assert len(engine.prompt_cache) == runner.num_kept == 3  # unsalted, tenant-a, tenant-b: kept apart


def test_salted_requests_decode_as_unsalted_and_share_neither_cache_across_salts():
    """The whole loop with a draft model: the target's and the draft's kept prompts are each taken only under the
    salt they were kept with, and every output (greedy) equals an unsalted decoder's without the caches."""
    target, draft = tiny_llama(seed=1), tiny_llama(seed=2)

    def decoder(cache_tokens: int) -> SpeculativeDecoder:
        proposer = DraftModelProposer(TorchModelRunner(draft, prompt_cache_tokens=cache_tokens))
        return SpeculativeDecoder(TorchModelRunner(target, prompt_cache_tokens=cache_tokens), proposer, None, 3)

    cached, plain = decoder(256), decoder(0)
    reference = plain.generate(PROMPT, SamplingParams(max_tokens=12)).token_ids
    for salt in (None, "tenant-a", "tenant-b", "tenant-a"):
        assert cached.generate(PROMPT, SamplingParams(max_tokens=12, cache_salt=salt)).token_ids == reference
    assert cached.engine.prompt_cache.stats.hits == cached.proposer.prompt_cache.stats.hits == 1  # the second "a"
    assert cached.target.num_kept == cached.proposer.runner.num_kept == 3


def test_engines_on_one_runner_share_its_kept_prompts():
    """Engines and proposers come and go on a long-lived runner: its kept prompts serve each of them."""
    runner = TorchModelRunner(tiny_llama(seed=5), prompt_cache_tokens=64)
    for i in range(5):
        engine = VerifierEngine(runner)
        engine.open("s", PROMPT, SamplingParams())
        engine.release("s")
    assert runner.prompt_cache.stats.hits == 4 and runner.num_kept == 1 and runner.num_sessions == 0


def test_caches_on_one_runner_keep_apart_one_after_another():
    """Several caches over one runner (a tensor-parallel leader's over its rank's runner, which has its own):
    one made after another was dropped may get its id(), never its kept sessions' names."""
    runner = TorchModelRunner(tiny_llama(seed=5))
    runner.add_session("s")
    runner.extend("s", PROMPT, num_logits=0)
    for i in range(20):
        cache = PromptCache(runner, 64)
        assert cache.keep("s", PROMPT[:-1] + [i % 10])
        del cache
    assert runner.num_kept == 20 and runner.num_sessions == 1


def test_the_benchmark_opens_prefill_without_the_cache_and_copy_with_it():
    from tools.prompt_cache_bench import measure

    result = measure(tiny_llama(seed=5), lambda text: {"input_ids": [ord(c) % 10 for c in text]}, lengths=(8, 24))
    assert set(result) == {8, 24}
    assert all(row["hits"] == 5 and row["prefill_ms"] > 0 and row["kept_ms"] > 0 for row in result.values())
