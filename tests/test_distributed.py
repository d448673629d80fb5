"""The distributed runtime on a real local Ray cluster (127.0.0.1) with real gRPC verifiers:
greedy equality, sampling, concurrency, overlap, placement, faults, bad internal input."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import torch

from cluster.core.config import EngineConfig, PlacementConfig
from cluster.core.errors import ConfigError
from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.ray.runtime import ClusterConfig, TandemCluster, init_local_ray
from cluster.session.speculate import SpeculativeDecoder
from drafts.policy import SpeculationPolicyConfig
from protos import pb

MAX_TOKENS = 32
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("import os\n\nfor root, dirs, files in os.walk('.'):\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("def is_palindrome(s: str) -> bool:\n", False),
    ("Once upon a time, in a small village by the sea,", False),
    ("The three most important inventions of the twentieth century are", False),
    ("What is the capital of France?", True),
    ("Write a short poem about the moon.", True),
]


@pytest.fixture(scope="module")
def ray_local():
    init_local_ray(num_cpus=16, num_gpus=4, resources={"draft_gpu": 2})  # fake GPUs for placement
    yield
    ray.shutdown()


def start(ray_local, **kwargs) -> TandemCluster:
    engine = dict(dtype="float32", proposer="draft", num_speculative_tokens=4, threads=1)
    engine.update(kwargs.pop("engine", {}))
    kwargs.setdefault("speculation", SpeculationPolicyConfig(adaptive=False))  # γ pinned: rounds as asserted
    return TandemCluster(ClusterConfig(engine=EngineConfig(**engine), **kwargs))


@pytest.fixture(scope="module")
def pipelined(ray_local):
    # every bubble filled (fill_min_redraft 0): at the default whether one is depends on the machine's timing
    cluster = start(ray_local, pipeline_depth=2, num_verifier_replicas=2, fill_min_redraft=0.0)
    yield cluster
    cluster.shutdown()


# code (twice), prose and chat: the prompts of the cluster tests that need not decode all eight
FOUR_PROMPTS = (0, 2, 4, 6)


def _check_all(cluster, prompt_ids, references, timelines=None) -> list:
    """Each prompt's greedy output through the cluster equals the reference; the results."""
    results = []
    for ids in prompt_ids:
        timeline = [] if timelines is not None else None
        result = cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS), timeline)
        assert result.token_ids == references[tuple(ids)], f"diverged on {ids[:6]}..."
        results.append(result)
        if timelines is not None:
            timelines.append(timeline)
    return results


def _overlaps(timelines) -> int:
    """Rounds whose drafting overlapped the verification of the previous round."""
    count = 0
    for timeline in timelines:
        for prev, nxt in zip(timeline, timeline[1:]):
            if nxt.draft_start < prev.verify_end and nxt.draft_end > prev.verify_start:
                count += 1
    return count


def test_pipelined_greedy_equality_and_overlap(pipelined, prompt_ids, references):
    timelines: list = []
    _check_all(pipelined, prompt_ids, references, timelines)
    assert pipelined.router.metrics.rounds > 0
    assert _overlaps(timelines) > 0, "depth 2 must draft round r+1 while round r is verified"
    metrics = pipelined.router.metrics
    # rejections happened, their bubbles were filled with plain steps, and redrafts went on after them
    assert metrics.bubble_fills > metrics.bubble_fill_misses >= 0 and metrics.stale_rounds > 0
    assert metrics.shared_sequential_rounds == 0  # one session at a time: always pipelined


def test_processors_greedy_equality_through_the_cluster(pipelined, prompt_ids, references, target_fp32, tokenizer,
                                                        engine_fp32):
    """Repetition penalty, bad words and logit bias over Ray + gRPC (pipelined, a real draft) equal
    transformers' generate with the same processors; presence / frequency penalties and allowed ids equal
    tandem's plain decoding in process."""
    plain = SpeculativeDecoder(TorchModelRunner(engine_fp32), None, tokenizer, 0)
    for ids in prompt_ids[:2]:
        ref = references[tuple(ids)]
        words, bias = [[ref[3]]], {ref[5]: -5.0, ref[1]: 2.0}
        with torch.inference_mode():
            out = target_fp32.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       do_sample=False, max_new_tokens=MAX_TOKENS, repetition_penalty=1.2,
                                       bad_words_ids=words, sequence_bias=[[[t], b] for t, b in bias.items()])
        want = out[0, len(ids):].tolist()
        params = SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.2, bad_words=words, logit_bias=bias)
        assert want != ref and pipelined.generate(ids, params).token_ids == want
        params = SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.7, frequency_penalty=0.4,
                                allowed_token_ids=sorted(set(ref) - {ref[2]}))
        assert pipelined.generate(ids, params).token_ids == plain.generate(ids, params).token_ids
    # each prompt's second request took the draft's prefill from the drafter's kept prompts (and the target's from
    # the verifier's, or a verifier replica that had not seen it yet prefilled it): the outputs above are unchanged
    assert ray.get(pipelined.drafter.stats.remote())["prompt_cache_hits"] >= 2


def test_sequential_greedy_equality_without_overlap(ray_local, prompt_ids, references):
    """Sequential rounds drafted as token trees (the draft's top-2 at the first position) over gRPC."""
    cluster = start(ray_local, pipeline_depth=1, engine=dict(tree_width=2))
    try:
        timelines: list = []
        # code, prose and chat (all eight go through the pipelined test's cluster; the trees' exactness in one
        # process, seven prompts, is test_greedy_equality's): this one adds tree rounds over gRPC and the sequential
        # timeline
        _check_all(cluster, [prompt_ids[i] for i in FOUR_PROMPTS], references, timelines)
        assert _overlaps(timelines) == 0, "depth 1 drafts only after the previous verification"
        metrics = cluster.router.metrics
        assert metrics.tree_rounds > 0.8 * metrics.rounds  # all but the plain last steps
        assert metrics.tree_branch_hits > 0, "a sibling of the first draft must have been accepted"
    finally:
        cluster.shutdown()


def test_feature_fed_hybrid_greedy_equality(ray_local, prompt_ids, references):
    """The served default with the feature-fed draft as the hybrid's model: the verifier replica sends the
    target's features over gRPC with each result, the router hands them to the drafter actor."""
    cluster = start(ray_local, pipeline_depth=1, engine=dict(proposer="hybrid", draft="feature",
                                                             num_speculative_tokens=3))
    try:
        results = [cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)) for ids in prompt_ids[:3]]
        for ids, result in zip(prompt_ids, results):
            assert result.token_ids == references[tuple(ids)], f"diverged on {ids[:6]}..."
        assert sum(r.stats.accepted for r in results) > 0
        # long match rounds (engine.match_tokens, on by default) crossed gRPC: more drafts than γ in a round
        assert max(len(r.stats.gamma_counts) - 1 for r in results) > 3, [r.stats.gamma_counts for r in results]
        # a policy that sends plain steps (probing γ 1 every other round): the router drafts the session's
        # own suffix matches in their place; the drafter, fed the target's features of those rounds too,
        # goes on from the committed tokens
        from drafts.policy import SpeculationPolicy

        assert cluster.router.own_match is not None
        cluster.router.policy = SpeculationPolicy(SpeculationPolicyConfig(min_speedup=100.0, probe_every=2), 3)
        for ids in prompt_ids[2:4]:  # their greedy continuations repeat 4-token runs of their own
            assert cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids == references[tuple(ids)]
        assert cluster.router.metrics.own_match_rounds > 0 and cluster.router.metrics.own_match_accepted > 0
        stats = ray.get(cluster.drafter.stats.remote())
        assert stats["proposals_without_features"] == 0, "the drafter got the target's features every round"
    finally:
        cluster.shutdown()


def test_eagle3_dynamic_trees_greedy_equality(ray_local, prompt_ids, references):
    """Proposer 'eagle3' on the torch runner: the verifier replica captures the three fused layers' states and
    sends them over gRPC; the drafter actor's EAGLE-3 draft drafts EAGLE-2 dynamic trees from them."""
    cluster = start(ray_local, pipeline_depth=1, engine=dict(proposer="eagle3", num_speculative_tokens=3,
                                                             tree_width=4, tree_tokens=12))
    try:
        results = [cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)) for ids in prompt_ids[:2]]
        for ids, result in zip(prompt_ids, results):
            assert result.token_ids == references[tuple(ids)], f"diverged on {ids[:6]}..."
        assert sum(r.stats.accepted for r in results) > 0
        assert cluster.router.metrics.tree_rounds > 0
        stats = ray.get(cluster.drafter.stats.remote())
        assert stats["proposals_without_features"] == 0, "the drafter got the target's three layers every round"
    finally:
        cluster.shutdown()


def test_ngram_pipelined_greedy_equality(ray_local, prompt_ids, references):
    cluster = start(ray_local, engine=dict(proposer="ngram"), pipeline_depth=2)
    try:
        # two code prompts (where n-grams match most), prose and chat; all eight go through the pipelined test's
        # cluster with the draft, and n-grams' exactness in one process (six prompts) is test_greedy_equality's
        results = _check_all(cluster, [prompt_ids[i] for i in FOUR_PROMPTS], references)
        drafted, accepted = sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
        assert 0 < accepted < drafted  # both the accept and the reject paths ran over the wire
    finally:
        cluster.shutdown()


def test_no_proposer_is_plain_decoding_through_the_cluster(ray_local, prompt_ids, references):
    cluster = start(ray_local, engine=dict(proposer="none", num_speculative_tokens=0), pipeline_depth=2)
    try:
        assert cluster.drafter is None
        _check_all(cluster, prompt_ids[:3], references)
    finally:
        cluster.shutdown()


def test_concurrent_sessions_with_different_stops(pipelined, prompt_ids, references, tokenizer):
    jobs = []
    for i, ids in enumerate(prompt_ids):
        ref = references[tuple(ids)]
        if i % 3 == 0:
            jobs.append((ids, SamplingParams(max_tokens=5 + i), ref[: 5 + i]))
        elif i % 3 == 1:
            jobs.append((ids, SamplingParams(max_tokens=MAX_TOKENS), ref))
        else:
            text = tokenizer.decode(ref, skip_special_tokens=True)
            stop = text[8:11] if len(text) > 12 and text[8:11].strip() else None
            jobs.append((ids, SamplingParams(max_tokens=MAX_TOKENS, stop=[stop] if stop else []), ref))
    results: dict = {}
    shared_before = pipelined.router.metrics.shared_sequential_rounds

    def run(i, ids, params):
        results[i] = pipelined.generate(ids, params)

    threads = [threading.Thread(target=run, args=(i, ids, params)) for i, (ids, params, _) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(results) == len(jobs)
    for i, (ids, params, expected) in enumerate(jobs):
        got = results[i].token_ids
        if params.stop:
            assert got == expected[: len(got)] and results[i].finish_reason == "stop"
            assert results[i].text == tokenizer.decode(expected, skip_special_tokens=True).split(params.stop[0])[0]
        else:
            assert got == expected
    assert {r.sessions for r in pipelined.router.replicas} == {0}
    # four sessions per replica: their rounds went sequential (bonus tokens) once the sharing was seen
    assert pipelined.router.metrics.shared_sequential_rounds > shared_before


def _generate_and_kill(cluster, ids, kill) -> object:
    """Generate in a thread; once two rounds are verified, call `kill`; return the result."""
    box = {}
    rounds = cluster.router.metrics.rounds
    thread = threading.Thread(target=lambda: box.update(result=cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))))
    thread.start()
    while cluster.router.metrics.rounds < rounds + 2 and thread.is_alive():
        time.sleep(0.01)
    kill()
    thread.join(timeout=600)
    return box["result"]


def test_drafter_killed_mid_generation(pipelined, prompt_ids, references):
    ids = prompt_ids[0]
    before = pipelined.router.metrics.drafter_fallbacks
    result = _generate_and_kill(pipelined, ids, lambda: ray.kill(pipelined.drafter, no_restart=False))
    assert result.token_ids == references[tuple(ids)]
    assert pipelined.router.metrics.drafter_fallbacks > before
    deadline = time.time() + 300
    while True:  # Ray restarts the drafter
        try:
            ray.get(pipelined.drafter.ready.remote(), timeout=60)
            break
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            assert time.time() < deadline, "the drafter did not come back"
            time.sleep(0.5)
    fallbacks = pipelined.router.metrics.drafter_fallbacks
    again = pipelined.generate(ids, SamplingParams(max_tokens=8))
    assert again.token_ids == references[tuple(ids)][:8]
    assert again.stats.drafted > 0 and pipelined.router.metrics.drafter_fallbacks == fallbacks


def test_verifier_killed_mid_generation(pipelined, prompt_ids, references):
    ids = prompt_ids[1]
    before = pipelined.router.metrics.replays

    def kill_busy_replica():
        busy = next(h for h in pipelined.router.replicas if h.sessions > 0)
        replica = next(r for r in pipelined.replicas if r.name == busy.name)
        ray.kill(replica.ranks[0], no_restart=False)

    result = _generate_and_kill(pipelined, ids, kill_busy_replica)
    assert result.token_ids == references[tuple(ids)]
    assert pipelined.router.metrics.replays > before


def test_tensor_parallel_3_on_fake_gpus_and_a_lost_rank(ray_local, prompt_ids, references):
    config = dict(tensor_parallel_size=3, pipeline_depth=2,
                  verifier_rank=PlacementConfig(num_gpus=1), drafter=PlacementConfig(num_gpus=0.25, resources={"draft_gpu": 1}))
    cluster = start(ray_local, **config)
    try:
        table = ray.util.placement_group_table(cluster.replicas[0].placement_group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 3
        assert all(b.get("GPU") == 1 for b in table["bundles"].values())
        drafter_table = ray.util.placement_group_table(cluster.drafter_pg)
        assert drafter_table["bundles"][0] == {"CPU": 1.0, "GPU": 0.25, "draft_gpu": 1.0}
        nodes = {ray.get(a.node_id.remote()) for a in cluster.replicas[0].ranks}
        assert len(nodes) == 1
        _check_all(cluster, prompt_ids[6:7], references)  # the other tests cover more prompts; this one, the layout

        # a follower rank dies mid-generation: the group is rebuilt and the session replayed onto it
        replica = cluster.replicas[0]
        old_pids = set(ray.get([rank.pid.remote() for rank in replica.ranks]))
        replays = cluster.router.metrics.replays
        ids = prompt_ids[3]
        result = _generate_and_kill(cluster, ids, lambda: ray.kill(replica.ranks[2], no_restart=True))
        assert result.token_ids == references[tuple(ids)]
        assert cluster.router.metrics.replays == replays + 1 and replica.restarts == 1
        new_pids = set(ray.get([rank.pid.remote() for rank in replica.ranks]))
        assert len(new_pids) == 3 and not new_pids & old_pids
        again = cluster.generate(prompt_ids[4], SamplingParams(max_tokens=12))  # the rebuilt group serves anew
        assert again.token_ids == references[tuple(prompt_ids[4])][:12]
    finally:
        cluster.shutdown()


def test_unplaceable_pool_is_a_clear_error(ray_local):
    config = ClusterConfig(engine=EngineConfig(proposer="none"), num_verifier_replicas=2, tensor_parallel_size=3,
                           verifier_rank=PlacementConfig(num_gpus=1), placement_timeout_s=3)
    t0 = time.time()
    with pytest.raises(ConfigError, match="cannot place the verifier pool"):
        TandemCluster(config)
    assert time.time() - t0 < 60


def test_tensor_parallel_size_must_divide_kv_heads(ray_local):
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        TandemCluster(ClusterConfig(engine=EngineConfig(proposer="none"), tensor_parallel_size=2))


def test_bad_internal_requests_get_clear_status(pipelined, prompt_ids):
    replica = pipelined.router.replicas[0]
    assert replica.refresh()  # it may have been killed and restarted by the fault test
    stub = replica.stub  # carries the cluster secret (tests/test_auth.py: refused without it)

    def verify(*requests):
        return list(stub.Verify(iter(requests), timeout=60))

    with pytest.raises(grpc.RpcError) as e:
        verify(pb.VerifyRequest(session="nope", round=0, epoch=0, bonus=True))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown session" in e.value.details()

    stub.Open(pb.OpenRequest(session="bad", token_ids=prompt_ids[0], params=pb.SamplingParams(max_tokens=8)))
    with pytest.raises(grpc.RpcError) as e:
        verify(pb.VerifyRequest(session="bad", round=0, epoch=5, bonus=True))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "epoch" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        verify(pb.VerifyRequest(session="bad", round=0, proposal=pb.DraftProposal(token_ids=[10**7])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        bad_q = pb.DraftProposal(token_ids=[5, 6], draft_probs=[pb.DraftDistribution(token_ids=[5], probs=[1.0])])
        verify(pb.VerifyRequest(session="bad", round=0, proposal=bad_q))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Open(pb.OpenRequest(session="empty", token_ids=[], params=pb.SamplingParams(max_tokens=8)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # a stale round is answered, not an error; the session and the server keep serving
    first = verify(pb.VerifyRequest(session="bad", round=0, epoch=0, proposal=pb.DraftProposal(token_ids=[0]), bonus=True),
                   pb.VerifyRequest(session="bad", round=1, epoch=0, bonus=True))
    assert len(first) == 2 and first[0].recovered and first[1].stale
    assert stub.Health(pb.HealthRequest()).serving
    assert stub.Release(pb.ReleaseRequest(session="bad")).released


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny random target and draft sharing a 10-word tokenizer, saved as HF model directories."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import tiny_llama

    dirs = []
    for seed in (1, 2):
        path = tmp_path_factory.mktemp(f"tiny{seed}")
        raw = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0").save_pretrained(path)
        tiny_llama(seed=seed).save_pretrained(path)
        dirs.append(path)
    return dirs


def test_pipelined_sampling_follows_target(ray_local, tiny_dirs):
    from cluster.model.models import load_causal_lm
    from tests.test_sampling_e2e import FALSE_ALARM, chi_square_pvalue, exact_continuation_probs

    target_dir, draft_dir = tiny_dirs
    cluster = start(ray_local, engine=dict(target=str(target_dir), draft=str(draft_dir), num_speculative_tokens=2),
                    pipeline_depth=2)
    try:
        prompt = [1, 4, 2, 7]
        params = SamplingParams(temperature=1.0, max_tokens=3)
        exact = exact_continuation_probs(load_causal_lm(target_dir, "float32", "cpu"), prompt, 3, params)
        # 8 sessions at a time (the router runs them concurrently; the verifier batches their rounds)
        with ThreadPoolExecutor(8) as pool:
            samples = list(pool.map(lambda i: tuple(cluster.generate(prompt, params.model_copy(update={"seed": i}))
                                                    .token_ids), range(1500)))
        assert cluster.router.metrics.stale_rounds > 0, "rejections with rounds in flight must have happened"
        assert chi_square_pvalue(samples, exact) > FALSE_ALARM
    finally:
        cluster.shutdown()
