"""`tandem drafts validate`'s per-engine part: the verify-cost curve, the feature-fed draft's dynamic tree, and
the predicted speedup on each target engine.

- `verify_curve`: what verifying n tokens costs on the torch runner, in target steps (one forward over n new
  tokens after the prompt, with the KV cache, against a one-token step), n = 1, 2, 4, ... .
- `tree_report`: a feature-fed draft's EAGLE-2 dynamic tree (`FeatureProposer._propose_tree`, drafted at each
  position of the target's greedy continuation in `validate.feature_agreement`'s walk, at several node budgets)
  replayed as sequential rounds: how many of the continuation's tokens a round's tree holds along one path from
  its root (what verification accepts from it), and how many nodes it had.
- `engine_report`: per engine (torch: its step timed here; vLLM: a step time given with `--vllm-step-ms`, from
  `python -m tools bench --peer` or the peer table in BENCHMARKS.md), the draft's c against that step and the
  predicted sequential speedup of the best chain and, on torch, of the tree. A round costs its drafting (one draft
  step per depth, batched across a tree's nodes) and the verification of all its tokens from the measured curve
  (vLLM's own verify curve is not measured here: the torch curve stands in, said in the report). The
  prediction leaves out the drafter's round trip when it runs in another process, so a served figure is lower
  (BENCHMARKS.md, "EAGLE-3 on the torch runner").
"""

from __future__ import annotations

import time

import torch

from cluster.model.runner import TorchModelRunner

CURVE_SIZES = (1, 2, 4, 8, 16, 32)


def verify_curve(model, prompt_ids: list[int], sizes=CURVE_SIZES, repeats: int = 5) -> dict[int, float]:
    """{n: seconds of one forward over n new tokens after `prompt_ids`} (median of `repeats`; rolled back each time)."""
    runner = TorchModelRunner(model, name="verify-curve")
    runner.add_session("c")
    runner.extend("c", prompt_ids, num_logits=1)
    base, out = len(prompt_ids), {}
    with torch.inference_mode():
        for n in sizes:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.extend("c", [prompt_ids[-1]] * n, num_logits=n)
                times.append(time.perf_counter() - t0)
                runner.truncate("c", base)
            out[n] = sorted(times)[len(times) // 2]
    runner.release("c")
    return out


def verify_cost(curve: dict[int, float], n: int) -> float:
    """Verifying n tokens, in one-token steps: the curve interpolated linearly (extrapolated past its end)."""
    sizes = sorted(curve)
    step = curve[sizes[0]]
    if n <= sizes[0]:
        return curve[sizes[0]] / step
    for lo, hi in zip(sizes, sizes[1:]):
        if n <= hi:
            return (curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)) / step
    lo, hi = sizes[-2], sizes[-1]
    return (curve[hi] + (curve[hi] - curve[lo]) * (n - hi) / (hi - lo)) / step


def tree_budgets(proposer) -> tuple[int, ...]:
    """The node budgets a feature-fed proposer's dynamic tree is replayed at: 4, 8 and its own `tree_tokens`; none
    without a tree (`tree_width` 1)."""
    return tuple(sorted({4, 8, proposer.tree_tokens})) if getattr(proposer, "tree_width", 1) > 1 else ()


def tree_proposal(proposer, session, depth: int, budget: int):
    """The proposer's dynamic tree `depth` deep of at most `budget` nodes (its own `tree_tokens` kept)."""
    kept, proposer.tree_tokens = proposer.tree_tokens, budget
    try:
        return proposer._propose_tree(session, depth)
    finally:
        proposer.tree_tokens = kept


def accepted_path(token_ids: list[int], parents: list[int], truth: list[int]) -> int:
    """How many tokens of `truth` a token tree holds along one path from its root (greedy verification's accepted
    drafts)."""
    node, depth = -1, 0
    while depth < len(truth):
        child = next((i for i, (t, p) in enumerate(zip(token_ids, parents)) if p == node and t == truth[depth]), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def engine_report(report: dict, curve: dict[int, float], tree: dict | None, vllm_step_s: float | None) -> dict:
    """Per engine: the step, c against it, and the predicted sequential speedup of the best chain (and on torch of
    the best tree budget), each round costing its drafting and its verification from `curve`."""
    draft_s = report["draft_step_s"]
    engines = {"torch": {"step_s": report["target_step_s"], "step_source": "timed here"}}
    if vllm_step_s:
        engines["vllm"] = {"step_s": vllm_step_s, "step_source": "given (--vllm-step-ms)",
                           "verify_curve_source": "the torch runner's, measured here"}
    for name, e in engines.items():
        c = draft_s / e["step_s"]
        best = None
        for g in report["by_gamma"]:
            s = g["mean_accepted_length"] / (g["gamma"] * c + verify_cost(curve, g["gamma"] + 1))
            if best is None or s > best[1]:
                best = (g["gamma"], s)
        e.update(cost_ratio=c, chain_gamma=best[0], chain_tokens_per_round=report["by_gamma"][best[0] - 1][
            "mean_accepted_length"], chain_predicted_speedup=best[1])
        if tree is not None and name == "torch":
            speed = {t["budget"]: t["tokens_per_round"] / (tree["depth"] * c + verify_cost(curve, 1 + t["mean_nodes"]))
                     for t in tree["budgets"]}
            budget = max(speed, key=speed.get)
            e.update(tree_budget=budget, tree_predicted_speedup=speed[budget])
    return engines


def tree_report(records, width: int, depth: int) -> dict:
    """Sequential tree rounds replayed over `records` (`validate.Agreement`s with `trees`): per node budget, tokens
    per round, acceptance by depth and mean nodes a round."""
    rows = []
    for b in sorted(records[0].trees):
        tokens = rounds = 0
        node_counts, depth_hits = [], [0] * depth
        for record in records:
            accepted, sizes = record.trees[b]
            pos, n = 0, len(accepted)
            while pos < n:
                k = min(depth, n - pos - 1)
                run = min(accepted[pos], k)
                for j in range(run):
                    depth_hits[j] += 1
                node_counts.append(sizes[pos])
                pos, rounds = pos + run + 1, rounds + 1
            tokens += n
        rows.append({"budget": b, "tokens_per_round": tokens / max(rounds, 1), "rounds": rounds,
                     "mean_nodes": sum(node_counts) / max(len(node_counts), 1),
                     "accepted_at_depth": [h / max(rounds, 1) for h in depth_hits]})
    return {"width": width, "depth": depth, "budgets": rows}
