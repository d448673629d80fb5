"""The GPU check (tools/gpu_check, issue 26) on CPU with tiny shapes: the same code the device runs, so it
cannot rot; and its equality check can fail (a broken verifier is caught)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

import cluster.model.verifier as verifier_module
from cluster.core.rejection import RejectionResult
from tools.gpu_check.check import REPORT, UNVERIFIED, main
from tools.gpu_check.equality import greedy_equality
from tools.gpu_check.markdown import render
from tools.gpu_check.shapes import Models
from tools.gpu_check.timing import Budget

SECTIONS = ("greedy_equality", "verify_cost", "cost_ratio", "loop_overhead", "graphed_step", "speedups", "runner_graphs")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny CPU run of the whole command: (exit code, report, printed output)."""
    out = tmp_path_factory.mktemp("gpu_check")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--out", str(out), "--device", "cpu", "--budget-s", "600"])
    return code, json.loads((out / REPORT).read_text()), printed.getvalue()


def test_tiny_run_has_every_section_and_says_it_is_unverified(tiny_run):
    code, report, printed = tiny_run
    assert code == 0
    assert report["verified_on_gpu"] is False and report["tiny"] is True
    assert UNVERIFIED in printed
    assert report["skipped"] == []
    for name in SECTIONS:
        assert report["sections"][name]["status"] == "ok", report["sections"][name]
    assert set(report["shapes"]) == {"smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"}


def test_tiny_run_greedy_equality_holds_for_every_case(tiny_run):
    eq = tiny_run[1]["sections"]["greedy_equality"]
    assert eq["all_equal"] is True and eq["errors"] == []
    assert set(eq["targets"]) == {"smollm2-135m", "llama-3.2-1b"}
    for target in eq["targets"].values():
        names = [c["case"] for c in target["cases"]]
        assert len(names) >= 11 and any("tree" in n for n in names) and any("pipelined" in n for n in names)
        for case in target["cases"]:
            assert case["equal"] is True and case.get("expectation_ok") is not False, case
        tree = next(c for c in target["cases"] if c["case"] == "tree sibling-oracle")
        assert tree["tree_rounds"] > 0 and tree["tree_branch_hits"] == tree["tree_rounds"]
        assert target["sampled"]["ok"] and target["sampled"]["repeatable"]


def _positive(x) -> bool:
    return isinstance(x, float) and x > 0 and math.isfinite(x)


def test_tiny_run_costs_are_sensible(tiny_run):
    s = tiny_run[1]["sections"]
    keys = {"smollm2-135m/float32", "smollm2-135m/bfloat16", "llama-3.2-1b/float32", "llama-3.2-1b/bfloat16",
            "llama-3.1-8b/bfloat16"}
    assert set(s["verify_cost"]["targets"]) == keys
    for curve in s["verify_cost"]["targets"].values():
        for batch in ("1", "8"):
            seconds = curve["seconds"][batch]
            assert list(seconds) == [str(n) for n in s["verify_cost"]["points"]]
            assert all(_positive(t) for t in seconds.values())
            assert curve["ratio"][batch]["1"] == 1.0
    for ratios in s["cost_ratio"]["targets"].values():
        assert _positive(ratios["target_step_s"])
        assert all(_positive(ratios[d]["c"]) for d in ("smollm2-135m", "feature"))
    for key, overhead in s["loop_overhead"]["targets"].items():
        for mode in ("plain", "sequential", "pipelined"):
            assert overhead[mode]["overhead_fraction_of_verify"] >= 0
            # exactness is asserted in fp32 (the house's definition of lossless). In bf16 a verification of k
            # tokens runs other GEMM shapes than a one-token step, and on a CPU with native bf16 dot products
            # (avx512_bf16, 2026-12-05) their rounding differs: random weights' near-ties then flip (the 8 B-shaped
            # tiny target did). The report keeps the bf16 verdict.
            assert isinstance(overhead[mode]["matches_plain"], bool)
            if key.endswith("/float32") or mode == "plain":
                assert overhead[mode]["matches_plain"], (key, mode)


def test_tiny_run_speedups_carry_the_model_prediction(tiny_run):
    sp = tiny_run[1]["sections"]["speedups"]
    assert sp["dtype"] == "float32"  # where the oracle's reference holds (speedups.py)
    assert set(sp["targets"]) == {"smollm2-135m", "llama-3.2-1b"}
    for target in sp["targets"].values():
        assert _positive(target["c"]) and _positive(target["plain_tokens_per_s"])
        runs = {(r["alpha"], r["mode"]) for r in target["runs"]}
        assert runs == {(a, m) for a in (0.6, 0.8, 0.9) for m in ("sequential", "pipelined")}
        for run in target["runs"]:
            assert _positive(run["measured_speedup"]) and 0 <= run["acceptance"] <= 1
            for key in ("pipeline_model", "pipeline_model_with_curve", "closed_form"):
                assert _positive(run["predicted"][key])
            assert run["matches_plain"]  # fp32: the oracle's reference is the run's own continuation


def test_tiny_run_times_the_static_cache_step_and_says_there_is_no_graph_on_cpu(tiny_run):
    g = tiny_run[1]["sections"]["graphed_step"]
    assert set(g["targets"]) == {"smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"}
    for target in g["targets"].values():
        assert _positive(target["eager_step_s"]) and "no CUDA graphs on cpu" in target["graph"]
        # every timed step rewrote the slot after the prompt: the cache did not run on (the first device run
        # ran off its end, transformers' static layers advancing their own cursor)
        assert target["cache_length_after_steps"] == target["context"] + 1


def test_tiny_run_checks_the_runners_graph_slots(tiny_run):
    """On CPU the slots' static step runs eagerly (no capture): equal to the eager runner's output."""
    r = tiny_run[1]["sections"]["runner_graphs"]
    assert set(r["targets"]) == {"smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"}
    for name, t in r["targets"].items():
        if name != "llama-3.1-8b":  # fp32 targets
            eq = t["equality"]
            assert eq["eager_equals_transformers"] and eq["graphed_plain_equal"] and eq["graphed_draft_equal"], eq
            assert eq["target_stats"]["eager_steps"] > 0 and eq["draft_stats"]["eager_steps"] > 0
            assert eq["verifier_stats"]["eager_steps"] > 0  # chains of γ + 1 through the static forward
        speed = t["speed"]
        assert _positive(speed["graphed_ms"]) and speed["stats"]["eager_steps"] > 0 and speed["stats"]["replays"] == 0
        assert _positive(speed["verify_5_tokens"]["graphed_ms"]) and _positive(speed["verify_5_tokens"]["eager_ms"])


def test_sections_runs_only_those_asked_and_rejects_unknown_ones(tmp_path):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--out", str(tmp_path), "--device", "cpu", "--sections", "verify_cost"]) == 0
    report = json.loads((tmp_path / REPORT).read_text())
    assert report["sections"]["verify_cost"]["status"] == "ok"
    assert {report["sections"][n]["status"] for n in SECTIONS if n != "verify_cost"} == {"not asked"}
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["--out", str(tmp_path), "--sections", "verify_cost,nonsense"]) == 2
    assert "nonsense" in err.getvalue()


def test_equality_check_catches_a_broken_verifier(monkeypatch):
    """A rejection sampler that accepts every draft lets an always-wrong drafter's tokens through: the
    check must report the divergence."""
    def accept_all(draft_token_ids, target_logits, draft_probs, params, start_position):
        k = len(draft_token_ids)
        tail = [int(target_logits[k].argmax())] if target_logits.shape[0] == k + 1 else []
        return RejectionResult(k, [*draft_token_ids, *tail], recovered=False)

    monkeypatch.setattr(verifier_module, "rejection_sample", accept_all)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command does on CPU: tiny models, a busy machine
    try:
        out = greedy_equality(Models(torch.device("cpu"), tiny=True), ["smollm2-135m"], True, Budget(120),
                              only={"chain always-wrong", "chain always-right"})
    finally:
        torch.set_num_threads(threads)
    cases = {c["case"]: c for c in out["targets"]["smollm2-135m"]["cases"]}
    assert out["all_equal"] is False
    assert cases["chain always-wrong"]["equal"] is False and cases["chain always-wrong"]["diverged"]
    assert cases["chain always-right"]["equal"] is True  # right drafts are right either way


def test_markdown_section_renders_the_figures(tiny_run):
    text = render(tiny_run[1], "GPU check")
    assert "Unverified on a GPU" in text and "all equal" in text
    for heading in ("Verify cost", "Cost ratio c", "Loop overhead", "Speedup over plain decoding"):
        assert heading in text
