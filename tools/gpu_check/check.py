"""The command: runs the sections in order within the time budget and writes DIR/gpu_check.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers

from tools.gpu_check.costs import (
    cost_ratio_section,
    loop_overhead_section,
    verify_cost_section,
)
from tools.gpu_check.equality import greedy_equality
from tools.gpu_check.graphs import graphed_step_section
from tools.gpu_check.runner_graphs import runner_graphs_section
from tools.gpu_check.shapes import EQUALITY_TARGETS, PAIRS, TARGETS, Models
from tools.gpu_check.speedups import speedup_section
from tools.gpu_check.timing import Budget

REPORT = "gpu_check.json"
UNVERIFIED = "unverified on a GPU"
# the in-process path must not need these (issue 26, item 1; the device machine has none of them)
HEAVY = ("ray", "grpc", "protos", "vllm")
# whole-section estimates on an H200, in seconds (tiny shapes: a tenth)
ESTIMATES = {"greedy_equality": 60, "verify_cost": 50, "cost_ratio": 25, "loop_overhead": 25, "graphed_step": 30,
             "speedups": 80, "runner_graphs": 60}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=sys.modules["tools.gpu_check"].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (automatic on cpu): CI, seconds")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all sections")
    p.add_argument("--sections", default=",".join(ESTIMATES),
                   help=f"comma-separated subset of {', '.join(ESTIMATES)} (default: all, in that order)")
    args = p.parse_args(argv)
    args.sections = args.sections.split(",")  # the names, once
    return args


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": str(device), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return env


def _save(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT).write_text(json.dumps(report, indent=1, default=str))


def _section(report: dict, budget: Budget, name: str, tiny: bool, fn) -> dict | None:
    """Run one section unless the budget is spent; errors are recorded, never fatal. The report is saved
    after each section, so a run killed at its time limit still leaves what it measured."""
    if name not in report["args"]["sections"]:
        report["sections"][name] = {"status": "not asked", "reason": "not in --sections"}
        return None
    needs = ESTIMATES[name] / (10 if tiny else 1)
    if not budget.allows(name, needs):
        report["sections"][name] = {"status": "skipped", "reason": budget.skipped[-1]["reason"]}
        return None
    t0 = time.perf_counter()
    skipped_before = len(budget.skipped)
    try:
        result = fn()
        status = "partial" if len(budget.skipped) > skipped_before else "ok"
        report["sections"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1), **result}
        return result
    except Exception as e:
        report["sections"][name] = {"status": "error", "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()[-4000:],
                                    "seconds": round(time.perf_counter() - t0, 1)}
        return None
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        report["wall_s"] = round(budget.elapsed(), 1)
        _save(report, Path(report["args"]["out"]))


def summary(report: dict) -> list[str]:
    """A few lines of headline figures (printed, and kept in the JSON)."""
    s = report["sections"]
    lines = []
    eq = s.get("greedy_equality", {})
    if eq.get("status") in ("ok", "partial"):
        n = sum(len(t["cases"]) for t in eq["targets"].values())
        lines.append(f"greedy equality (fp32, {n} cases): {'ALL EQUAL' if eq['all_equal'] else 'NOT EQUAL'}"
                     f"{'; errors: ' + '; '.join(eq['errors']) if eq['errors'] else ''}")
    for key, curve in s.get("verify_cost", {}).get("targets", {}).items():
        r = curve["ratio"]
        lines.append(f"verify {key}: step {curve['seconds'][1][1] * 1e3:.2f} ms (batch 8: "
                     f"{curve['seconds'][8][1] * 1e3:.2f} ms); T(5)/T(1) {r[1][5]:.2f}, T(64)/T(1) {r[1][64]:.2f}")
    for key, ratios in s.get("cost_ratio", {}).get("targets", {}).items():
        lines.append(f"c vs {key}: " + ", ".join(f"{d} {v['c']:.3f}" for d, v in ratios.items() if isinstance(v, dict)))
    for key, o in s.get("loop_overhead", {}).get("targets", {}).items():
        lines.append(f"loop overhead {key}: " + ", ".join(
            f"{m} {o[m]['overhead_fraction_of_verify']:.2f}" for m in ("plain", "sequential", "pipelined")))
    for name, t in s.get("speedups", {}).get("targets", {}).items():
        for run in t["runs"]:
            lines.append(f"speedup {name}+{t['draft']} (c {t['c']:.2f}) alpha {run['alpha']} {run['mode']}: "
                         f"{run['measured_speedup']:.2f}x measured, "
                         f"{run['predicted']['pipeline_model_with_curve']:.2f}x model"
                         f"{'' if run['matches_plain'] else ', OUTPUT DIFFERS FROM PLAIN'}")
    for name, t in s.get("runner_graphs", {}).get("targets", {}).items():
        eq, speed = t.get("equality", {}), t.get("speed", {})
        if "error" in eq or "error" in speed:
            lines.append(f"runner graphs {name}: {eq.get('error') or speed.get('error')}")
        if "graphed_plain_equal" in eq:
            lines.append(f"runner graphs {name} fp32: plain {'EQUAL' if eq['graphed_plain_equal'] else 'DIFFERS'}, "
                         f"speculative, slots on both sides {'EQUAL' if eq['graphed_draft_equal'] else 'DIFFERS'}")
        if "graphed_ms" in speed:
            verify = next((v for k, v in speed.items() if k.startswith("verify_")), {})
            lines.append(f"runner graphs {name} bf16: eager {speed['eager_ms']:.2f} ms a token, graphed "
                         f"{speed['graphed_ms']:.2f} ms ({speed['eager_over_graphed']:.1f}x), "
                         f"{speed['stats']['replays']} replays; a chain's verification eager "
                         f"{verify.get('eager_ms', 0):.2f} ms, graphed {verify.get('graphed_ms', 0):.2f} ms")
    for name, g in s.get("graphed_step", {}).get("targets", {}).items():
        if "error" in g:
            lines.append(f"graphed step {name}: {g['error']}")
        elif "graph_step_s" in g:
            lines.append(f"graphed step {name}: eager {g['eager_step_s'] * 1e3:.2f} ms, CUDA graph "
                         f"{g['graph_step_s'] * 1e3:.2f} ms ({g['eager_over_graph']:.1f}x), same argmax {g['same_argmax']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = set(args.sections) - set(ESTIMATES)
    if unknown:
        print(f"--sections: unknown {sorted(unknown)}; known: {', '.join(ESTIMATES)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = args.tiny or device.type == "cpu"
    verified = device.type == "cuda" and not tiny
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny models gain nothing from more; the drafter thread takes the other core
    try:
        report = run(args, device, tiny, verified)
    finally:
        torch.set_num_threads(threads)
    for line in report["summary"]:
        print(line)
    print(f"wrote {args.out / REPORT} in {report['wall_s']} s; skipped: {len(report['skipped'])}")
    if not verified:
        print(f"{UNVERIFIED}: tiny shapes on {device.type}; these figures say nothing about a GPU")
    equality = report["sections"].get("greedy_equality", {})
    if equality.get("status") == "not asked":
        return 0
    return 0 if equality.get("all_equal") and not equality.get("errors") else 1


def run(args: argparse.Namespace, device: torch.device, tiny: bool, verified: bool) -> dict:
    """Every section in order within the budget; the report, also written to args.out/gpu_check.json."""
    budget = Budget(args.budget_s)
    models = Models(device, tiny)
    report = {"tool": "tools.gpu_check", "issue": 26, "verified_on_gpu": verified, "tiny": tiny,
              "args": vars(args), "budget_s": args.budget_s,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": environment(device),
              "shapes": models.describe(), "pairs": PAIRS,
              "heavy_modules_imported": sorted(m for m in HEAVY if m in sys.modules), "sections": {}}
    fp32 = [n for n, dtypes in TARGETS if "float32" in dtypes]  # the speedups' targets (speedups.py says why)
    _section(report, budget, "greedy_equality", tiny, lambda: greedy_equality(models, EQUALITY_TARGETS, tiny, budget))
    curves = _section(report, budget, "verify_cost", tiny, lambda: verify_cost_section(models, TARGETS, tiny, budget))
    _section(report, budget, "cost_ratio", tiny,
             lambda: cost_ratio_section(models, TARGETS, tiny, budget, (curves or {}).get("targets", {})))
    _section(report, budget, "loop_overhead", tiny, lambda: loop_overhead_section(models, TARGETS, tiny, budget))
    _section(report, budget, "speedups", tiny, lambda: speedup_section(models, fp32, tiny, budget))
    _section(report, budget, "runner_graphs", tiny, lambda: runner_graphs_section(models, TARGETS, tiny, budget))
    models.drop("float32")
    # last: a device-side assert in a capture poisons the CUDA context for every later section
    _section(report, budget, "graphed_step", tiny, lambda: graphed_step_section(models, TARGETS, tiny, budget))
    report["skipped"] = budget.skipped
    report["wall_s"] = round(budget.elapsed(), 1)
    report["summary"] = summary(report)
    _save(report, args.out)
    return report
