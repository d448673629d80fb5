"""A BENCHMARKS.md section from a gpu_check.json: `python -m tools.gpu_check.markdown FILE [--title T]`.

Prints Markdown tables of the figures the issue asks for: greedy equality, the verify-cost curve, c, the
loop's overhead and the speedups at controlled α against the pipeline model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def render(report: dict, title: str) -> str:
    env, s = report["environment"], report["sections"]
    lines = [f"## {title}", "",
             f"`python -m tools.gpu_check` on {env.get('gpu', env['device'])}: torch {env['torch']} (CUDA {env['cuda']}), "
             f"transformers {env['transformers']}, Python {env['python']}; {report['wall_s']} s of a "
             f"{report['budget_s']:.0f} s budget; random-weight models of real shapes."
             + ("" if report["verified_on_gpu"] else " **Unverified on a GPU (tiny shapes).**"), ""]
    for name, sec in s.items():
        if sec.get("status") != "ok":
            lines.append(f"- section {name}: {sec.get('status')} {sec.get('reason') or sec.get('error') or ''}")
    for item in report.get("skipped", []):
        lines.append(f"- skipped {item['what']}: {item['reason']}")
    lines.append("")
    eq = s.get("greedy_equality", {})
    if "targets" in eq:
        rows = [[t, c["case"], "yes" if c["equal"] else "**NO**", c.get("drafted", ""), c.get("accepted", ""),
                 c.get("error", "")[:80]] for t, v in eq["targets"].items() for c in v["cases"]]
        rows += [[t, v["sampled"]["case"], "runs" if v["sampled"].get("ok") else "**fails**", "", "",
                  v["sampled"].get("error", "")[:80]] for t, v in eq["targets"].items()]
        lines += [f"Greedy equality, fp32, γ {eq['gamma']}, {eq['max_tokens']} tokens, prompts of "
                  f"{eq['prompt_lengths']} tokens: **{'all equal' if eq['all_equal'] else 'NOT all equal'}**", ""]
        lines += _table(["target", "case", "equal", "drafted", "accepted", "error"], rows)
    curves = s.get("verify_cost", {}).get("targets", {})
    if curves:
        points = s["verify_cost"]["points"]
        rows = [[k, b, f"{_get(c['seconds'], b, 1) * 1e3:.2f}"] + [f"{_get(c['ratio'], b, n):.2f}" for n in points]
                for k, c in curves.items() for b in s["verify_cost"]["batches"]]
        lines += [f"Verify cost: one forward of n tokens over one step (n = 1), context "
                  f"{next(iter(curves.values()))['context']}:", ""]
        lines += _table(["target", "batch", "step ms"] + [f"n={n}" for n in points], rows)
    ratios = s.get("cost_ratio", {}).get("targets", {})
    if ratios:
        drafts = s["cost_ratio"]["drafts"]
        rows = [[k, f"{r['target_step_s'] * 1e3:.2f}"] + [f"{r[d]['c']:.3f} ({r[d]['draft_step_s'] * 1e3:.2f} ms)"
                                                          for d in drafts] for k, r in ratios.items()]
        lines += ["Cost ratio c = draft step / target step (batch 1):", ""]
        lines += _table(["target", "step ms"] + drafts, rows)
    overhead = s.get("loop_overhead", {}).get("targets", {})
    if overhead:
        modes = ("plain", "sequential", "pipelined")
        rows = [[k] + [f"{o[m]['overhead_per_round_s'] * 1e3:.2f} ms ({o[m]['overhead_fraction_of_verify']:.2f})"
                       for m in modes] for k, o in overhead.items()]
        lines += ["Loop overhead per round (Python, sampler, syncs; fraction of the round's forward):", ""]
        lines += _table(["target"] + list(modes), rows)
    graphed = s.get("graphed_step", {}).get("targets", {})
    if graphed:
        rows = [[k, f"{g['eager_step_s'] * 1e3:.2f}",
                 f"{g['graph_step_s'] * 1e3:.2f}" if "graph_step_s" in g else g.get("graph", g.get("error", "")),
                 f"{g['eager_over_graph']:.1f}" if "eager_over_graph" in g else "",
                 ("yes" if g["same_argmax"] else "no") if "same_argmax" in g else ""]
                for k, g in graphed.items() if "eager_step_s" in g]
        rows += [[k, "", g["error"], "", ""] for k, g in graphed.items() if "eager_step_s" not in g]
        lines += ["One-token step, bf16, batch 1, static cache: eager against a CUDA-graph replay:", ""]
        lines += _table(["target", "eager ms", "graph ms", "eager / graph", "same argmax"], rows)
    speed = s.get("speedups", {}).get("targets", {})
    if speed:
        rows = [[f"{k} + {t['draft']}", f"{t['c']:.2f}", r["alpha"], r["mode"], f"{r['acceptance']:.2f}",
                 f"{r['measured_speedup']:.2f}", f"{r['predicted']['pipeline_model']:.2f}",
                 f"{r['predicted']['pipeline_model_with_curve']:.2f}", "yes" if r["matches_plain"] else "no"]
                for k, t in speed.items() for r in t["runs"]]
        lines += [f"Speedup over plain decoding at controlled α (γ {s['speedups']['gamma']}, "
                  f"{s['speedups'].get('dtype', 'bfloat16')}; pipelined: "
                  f"{s['speedups']['pipelined_mode']}):", ""]
        lines += _table(["target + draft", "c", "α", "mode", "accepted", "measured", "model", "model with curve",
                         "output = plain"], rows)
    runner = s.get("runner_graphs", {}).get("targets", {})
    if runner:
        rows = []
        for k, t in runner.items():
            eq, sp = t.get("equality", {}), t.get("speed", {})
            yes = lambda key: ("yes" if eq[key] else "no") if key in eq else ""
            rows.append([k, yes("graphed_plain_equal"), yes("graphed_draft_equal"), yes("eager_equals_transformers"),
                         f"{sp['eager_ms']:.2f}" if "eager_ms" in sp else "",
                         f"{sp['graphed_ms']:.2f}" if "graphed_ms" in sp else "",
                         f"{sp['eager_over_graphed']:.1f}" if "eager_over_graphed" in sp else "",
                         str(sp["stats"]["replays"]) if "stats" in sp else "",
                         *_verify(sp),
                         eq.get("error", "") or sp.get("error", "")])
        lines += ["The runner's CUDA-graph slots (`cuda_graphs`): fp32 greedy equality, bf16 ms a token:", ""]
        lines += _table(["target", "plain = eager", "speculative with slots = eager", "eager = transformers", "eager ms",
                         "graphed ms", "eager / graphed", "replays", "verify γ+1 eager ms", "verify γ+1 graphed ms",
                         "error"], rows)
    return "\n".join(lines)


def _verify(speed: dict) -> tuple[str, str]:
    """(eager ms, graphed ms) of the chain verification in a runner_graphs speed entry; blank when absent."""
    v = next((v for k, v in speed.items() if k.startswith("verify_")), None)
    return (f"{v['eager_ms']:.2f}", f"{v['graphed_ms']:.2f}") if v else ("", "")


def _get(table: dict, batch, n) -> float:
    row = table.get(str(batch), table.get(batch))
    return row.get(str(n), row.get(n))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.markdown")
    p.add_argument("report", type=Path)
    p.add_argument("--title", default="GPU check (issue 26)")
    args = p.parse_args(argv)
    print(render(json.loads(args.report.read_text()), args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
