"""`tandem drafts validate`: how good is a draft for a target, on this machine?

Greedy acceptance is measured exactly as the speculation loop would see it: along the target's own
greedy continuation of each prompt, the draft's greedy token at each position (given the target's
prefix) either agrees or not; a round of γ drafts accepts the agreeing run from its start, then
commits one more token (recovered or bonus). Replaying rounds over that agreement sequence gives
acceptance by draft position and mean accepted length for every γ without running γ separate loops.
The cost ratio c is timed here (one draft step / one target step, both with a KV cache, threads
pinned). Predicted speedups use the measured E(γ) with the sequential and pipelined formulas.

Per source (`sources`): the same continuations replayed through the suffix-match source alone (c = 0;
a plain step where nothing matches) and through the hybrid proposer (`drafts/hybrid.py`, its own
per-round choice, the model's rounds costing the measured c), round by round, for every γ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from drafts.cost_model import speedup_from_tokens
from drafts.feature_proposer import target_features
from drafts.training.validate_engines import (CURVE_SIZES, accepted_path, engine_report, tree_budgets, tree_proposal,
                                              tree_report, verify_curve)
from drafts.hybrid import MODEL, NGRAM, HybridProposer
from drafts.proposer import DraftProposal, SequenceProposer
from drafts.suffix import suffix_match


@dataclass
class Agreement:
    tokens: list[int]  # the target's continuation
    agree: list[bool]  # draft greedy == target greedy at each continuation position
    # a draft whose later drafts differ from its first ones (a feature-fed draft reads its own predicted
    # features): per position, how many of a round's drafts starting there are right (up to max γ)
    runs: list[int] | None = None
    # a feature-fed draft's dynamic trees: {node budget: (per position, the continuation's tokens the tree holds
    # along one path from its root; its size)}
    trees: dict[int, tuple[list[int], list[int]]] | None = None

    def run(self, pos: int, k: int) -> int:
        """Drafts accepted of a round of k starting at continuation position `pos`."""
        if self.runs is not None:
            return min(self.runs[pos], k)
        run = 0
        while run < k and pos + run < len(self.agree) and self.agree[pos + run]:
            run += 1
        return run


def agreement(target, draft, prompt_ids: list[int], max_tokens: int) -> Agreement:
    """The target's greedy continuation and, position by position, whether the draft agrees. The draft
    runs step by step with its KV cache, as it drafts in the loop (one forward over the whole sequence
    is not the same computation: dynamic int8 quantisation scales activations per forward)."""
    with torch.inference_mode():
        out = target.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=max_tokens)
        tokens = out[0, len(prompt_ids):].tolist()
    runner = TorchModelRunner(draft, name="validate")
    runner.add_session("v")
    if len(prompt_ids) > 1:
        runner.extend("v", prompt_ids[:-1], num_logits=0)
    agree, last = [], prompt_ids[-1]
    for token in tokens:
        agree.append(int(runner.extend("v", [last])[-1].argmax()) == token)
        last = token
    runner.release("v")
    return Agreement(tokens, agree)


def replay_rounds(agree: list[bool] | Agreement, gamma: int, max_tokens: int | None = None
                  ) -> tuple[list[int], list[int], int]:
    """(drafted per position, accepted per position, rounds) of the sequential loop with γ drafts per
    round over a continuation of len(agree) tokens (the loop's k = min(γ, remaining − 1))."""
    record = agree if isinstance(agree, Agreement) else Agreement([], list(agree))
    n = len(record.agree) if max_tokens is None else min(max_tokens, len(record.agree))
    drafted, accepted = [0] * gamma, [0] * gamma
    pos = rounds = 0
    while pos < n:
        k = min(gamma, n - pos - 1)
        run = record.run(pos, k)
        for i in range(k):
            drafted[i] += 1
            accepted[i] += int(i < run)
        pos += run + 1
        rounds += 1
    return drafted, accepted, rounds


def time_step(model, prompt_ids: list[int], steps: int = 24) -> float:
    """Seconds per single-token decoding step with a KV cache (median)."""
    runner = TorchModelRunner(model, name="timing")
    runner.add_session("t")
    runner.extend("t", prompt_ids, num_logits=1)
    times = []
    token = prompt_ids[-1]
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = runner.extend("t", [token])
        times.append(time.perf_counter() - t0)
        token = int(logits[-1].argmax())
    runner.release("t")
    return sorted(times)[len(times) // 2]


class _ReplayDraft(SequenceProposer):
    """The draft model as `agreement` measured it: the target's token while the draft agrees, then a
    token that matches nothing (-1); `None` agreement: a source that never drafts."""

    def __init__(self, prompt_len: int, record: Agreement | None):
        super().__init__()
        self.prompt_len, self.record = prompt_len, record

    def propose(self, session, k: int) -> DraftProposal:
        tokens = self.tokens(session)
        drafts, i = [], len(tokens) - self.prompt_len
        if self.record is not None and i < len(self.record.agree) and k > 0:
            run = self.record.run(i, k)
            drafts = self.record.tokens[i:i + run] + ([-1] if run < k else [])
        tokens.extend(drafts)
        return DraftProposal(drafts, None)


def replay_sources(prompt_ids: list[int], record: Agreement, gamma: int, cost_ratio: float,
                   hybrid: bool = True, min_match: int = 1) -> dict:
    """Rounds of the sequential loop along the target's continuation with the hybrid proposer
    (`hybrid=False`: the suffix match alone, a plain step where nothing matches): tokens, time in
    target steps (a model draft costs `cost_ratio`, a match nothing) and drafted / accepted per source."""
    model = _ReplayDraft(len(prompt_ids), record if hybrid else None)
    proposer = HybridProposer(model, min_match=min_match, cost_ratio=cost_ratio, history_tokens=0,
                              **({} if hybrid else {"confident_match": min_match}))  # alone: every match
    proposer.start("r", prompt_ids, SamplingParams())
    tokens, n = record.tokens, len(record.tokens)
    out = {"tokens": n, "rounds": 0, "time": 0.0, **{f"{s}_{x}": 0 for s in (NGRAM, MODEL) for x in ("rounds", "drafted", "accepted")}}
    pos = 0
    while pos < n:
        k = min(gamma, n - pos - 1)
        before = proposer.stats[NGRAM].rounds
        drafts = proposer.propose("r", k).token_ids if k > 0 else []
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == tokens[pos + accepted]:
            accepted += 1
        proposer.rollback("r", len(prompt_ids) + pos + accepted, [tokens[pos + accepted]])
        proposer.learn("r", len(drafts), accepted)
        if drafts:
            source = NGRAM if proposer.stats[NGRAM].rounds > before else MODEL
            out[f"{source}_rounds"] += 1
            out[f"{source}_drafted"] += len(drafts)
            out[f"{source}_accepted"] += accepted
            out["time"] += len(drafts) * (cost_ratio if source == MODEL else 0.0)
        out["rounds"] += 1
        out["time"] += 1.0
        pos += accepted + 1
    proposer.release("r")
    return out


def source_report(prompts: list[list[int]], records: list[Agreement], cost_ratio: float, max_gamma: int,
                  min_match: int = 1) -> dict:
    """α, c and predicted sequential speedup per source (the suffix match alone, the hybrid) and γ."""
    matched = agreed = positions = 0
    for ids, r in zip(prompts, records):
        for i, token in enumerate(r.tokens):
            sequence = ids + r.tokens[:i]
            drafts, _ = suffix_match(sequence, sequence, 1, 3, min_match, max_match=8)  # as the hybrid looks up
            positions += 1
            if drafts:
                matched += 1
                agreed += int(drafts[0] == token)
    report = {"ngram": {"alpha": agreed / matched if matched else 0.0, "coverage": matched / positions if positions else 0.0,
                        "cost_ratio": 0.0, "min_match": min_match, "by_gamma": []},
              "hybrid": {"cost_ratio": cost_ratio, "by_gamma": []}}
    for gamma in range(1, max_gamma + 1):
        for kind in ("ngram", "hybrid"):
            total: dict = {}
            for ids, r in zip(prompts, records):
                for key, value in replay_sources(ids, r, gamma, cost_ratio, kind == "hybrid", min_match).items():
                    total[key] = total.get(key, 0) + value
            rounds = total["rounds"] or 1
            row = {"gamma": gamma, "mean_accepted_length": total["tokens"] / rounds,
                   "predicted_sequential_speedup": total["tokens"] / total["time"] if total["time"] else 1.0}
            for source in (NGRAM, MODEL) if kind == "hybrid" else (NGRAM,):
                drafted = total[f"{source}_drafted"]
                row[source] = {"rounds": total[f"{source}_rounds"], "drafted": drafted,
                               "accepted": total[f"{source}_accepted"],
                               "acceptance_rate": total[f"{source}_accepted"] / drafted if drafted else 0.0}
            report[kind]["by_gamma"].append(row)
    for kind in ("ngram", "hybrid"):
        best = max(report[kind]["by_gamma"], key=lambda g: g["predicted_sequential_speedup"])
        report[kind].update(recommended_gamma=best["gamma"],
                            best_predicted_sequential_speedup=best["predicted_sequential_speedup"])
    return report


@torch.inference_mode()
def feature_agreement(target, proposer, prompt_ids: list[int], max_tokens: int, max_gamma: int,
                      tree_budgets: tuple[int, ...] = (), tree_depth: int = 0) -> Agreement:
    """A feature-fed draft (`FeatureProposer`) along the target's greedy continuation, as the loop runs it:
    at each position, given the committed tokens and the target's features of all but the last, it
    drafts `max_gamma` tokens (the later ones from its own predicted features); `runs` counts the right
    ones from the start. With `tree_budgets`, at the same positions its dynamic tree `tree_depth` deep at each
    node budget (`Agreement.trees`)."""
    out = target.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_tokens)
    sequence = out[0].tolist()
    tokens = sequence[len(prompt_ids):]
    feats = target_features(target, out, proposer.feature_layers)  # [L, W]: what the verifier sends
    proposer.start("v", prompt_ids, SamplingParams(max_tokens=max_tokens))
    proposer.add_features("v", 0, feats[: len(prompt_ids) - 1])
    runs, trees = [], {b: ([], []) for b in tree_budgets}
    for i in range(len(tokens)):
        n = len(prompt_ids) + i  # committed: sequence[:n]; features of positions < n - 1
        proposer.rollback("v", n - 1 if i else n, sequence[n - 1:n] if i else [])
        if i:
            proposer.add_features("v", n - 2, feats[n - 2:n - 1])
        drafts = proposer.propose("v", max_gamma).token_ids
        run = 0
        while run < len(drafts) and n + run < len(sequence) and drafts[run] == sequence[n + run]:
            run += 1
        runs.append(run)
        for budget, (held, sizes) in trees.items():
            proposer.rollback("v", n)  # the last proposal's drafts joined the sequence
            tree = tree_proposal(proposer, "v", tree_depth, budget)
            held.append(accepted_path(tree.token_ids, tree.parents or [], sequence[n:]))
            sizes.append(len(tree.token_ids))
    proposer.release("v")
    return Agreement(tokens, [r > 0 for r in runs], runs, trees or None)


def time_feature_step(target, proposer, prompt_ids: list[int], steps: int = 24) -> float:
    """Seconds per draft token of a feature-fed draft, drafting 4 at a time after the prompt (median)."""
    with torch.inference_mode():
        feats = target_features(target, torch.tensor([prompt_ids]), proposer.feature_layers)
    proposer.start("t", prompt_ids, SamplingParams(max_tokens=64))
    proposer.add_features("t", 0, feats[:-1])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        proposer.propose("t", 4)
        times.append((time.perf_counter() - t0) / 4)
        proposer.rollback("t", len(prompt_ids))
    proposer.release("t")
    return sorted(times)[len(times) // 2]


def validate(target, draft, prompts: list[list[int]], max_tokens: int = 64, max_gamma: int = 8,
             timing_prompt: list[int] | None = None, vllm_step_s: float | None = None) -> dict:
    """`draft`: a draft model, or a feature-fed draft's proposer (`FeatureProposer`; with `tree_width` > 1 its
    dynamic tree is replayed too). `vllm_step_s`: vLLM's step on this machine, for its engine's prediction."""
    feature = getattr(draft, "needs_features", False)
    budgets, depth = tree_budgets(draft) if feature else (), min(max_gamma, 6)
    if feature:
        records = [feature_agreement(target, draft, ids, max_tokens, max_gamma, budgets, depth) for ids in prompts]
    else:
        records = [agreement(target, draft, ids, max_tokens) for ids in prompts]
    agree_all = [a for r in records for a in r.agree]
    alpha = sum(agree_all) / len(agree_all) if agree_all else 0.0
    timing_prompt = timing_prompt or prompts[0]
    t_target = time_step(target, timing_prompt)
    t_draft = time_feature_step(target, draft, timing_prompt) if feature else time_step(draft, timing_prompt)
    c = t_draft / t_target
    per_gamma = []
    for gamma in range(1, max_gamma + 1):
        drafted, accepted, rounds, tokens = [0] * gamma, [0] * gamma, 0, 0
        for r in records:
            d, a, n = replay_rounds(r, gamma)
            drafted = [x + y for x, y in zip(drafted, d)]
            accepted = [x + y for x, y in zip(accepted, a)]
            rounds += n
            tokens += len(r.agree)
        e = tokens / rounds if rounds else 1.0
        per_gamma.append({"gamma": gamma, "mean_accepted_length": e,
                          "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else 0.0,
                          "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
                          "drafted": sum(drafted), "accepted": sum(accepted),
                          "predicted_sequential_speedup": speedup_from_tokens(e, gamma, c),
                          "predicted_pipelined_speedup": speedup_from_tokens(e, gamma, c, pipelined=True)})
    best_seq = max(per_gamma, key=lambda g: g["predicted_sequential_speedup"])
    best_pipe = max(per_gamma, key=lambda g: g["predicted_pipelined_speedup"])
    tree = tree_report(records, draft.tree_width, depth) if budgets else None
    widest = max([t["mean_nodes"] for t in tree["budgets"]] if tree else [0])
    curve = verify_curve(target, timing_prompt, sizes=CURVE_SIZES + ((64,) if widest > 31 else ()))
    partial = {"target_step_s": t_target, "draft_step_s": t_draft, "by_gamma": per_gamma}
    return {"engines": engine_report(partial, curve, tree, vllm_step_s), "tree": tree,
            "verify_curve": {n: s / curve[1] for n, s in curve.items()},
            "alpha": alpha, "cost_ratio": c, "target_step_s": t_target, "draft_step_s": t_draft,
            "positions": len(agree_all), "prompts": len(prompts), "max_tokens": max_tokens,
            "acceptance_by_position": per_gamma[-1]["acceptance_by_position"],
            "by_gamma": per_gamma, "recommended_gamma": best_seq["gamma"],
            "recommended_gamma_pipelined": best_pipe["gamma"],
            "best_predicted_sequential_speedup": best_seq["predicted_sequential_speedup"],
            "best_predicted_pipelined_speedup": best_pipe["predicted_pipelined_speedup"],
            "sources": source_report(prompts, records, c, max_gamma)}


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    acc = report["acceptance_by_position"]
    left.bar(range(1, len(acc) + 1), acc)
    left.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1),
             title=f"acceptance by position (α = {report['alpha']:.2f})")
    gammas = [g["gamma"] for g in report["by_gamma"]]
    right.plot(gammas, [g["predicted_sequential_speedup"] for g in report["by_gamma"]], "o-", label="sequential")
    right.plot(gammas, [g["predicted_pipelined_speedup"] for g in report["by_gamma"]], "s-", label="pipelined")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xlabel="γ (draft tokens per round)", ylabel="predicted speedup",
              title=f"c = {report['cost_ratio']:.3f}")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_report(report: dict) -> str:
    lines = [f"α (greedy agreement) {report['alpha']:.3f} over {report['positions']} positions, "
             f"{report['prompts']} prompts; c = {report['cost_ratio']:.3f} "
             f"(draft {report['draft_step_s'] * 1e3:.1f} ms / target {report['target_step_s'] * 1e3:.1f} ms)",
             "acceptance by draft position: " + " ".join(f"{a:.2f}" for a in report["acceptance_by_position"]),
             f"{'γ':>3}{'E':>7}{'seq':>8}{'pipe':>8}"]
    for g in report["by_gamma"]:
        lines.append(f"{g['gamma']:>3}{g['mean_accepted_length']:>7.2f}{g['predicted_sequential_speedup']:>8.2f}"
                     f"{g['predicted_pipelined_speedup']:>8.2f}")
    lines.append(f"recommended γ: {report['recommended_gamma']} sequential "
                 f"({report['best_predicted_sequential_speedup']:.2f}x), {report['recommended_gamma_pipelined']} "
                 f"pipelined ({report['best_predicted_pipelined_speedup']:.2f}x)")
    tree = report.get("tree")
    for t in tree["budgets"] if tree else []:
        lines.append(f"dynamic tree (width {tree['width']}, depth {tree['depth']}, ≤ {t['budget']} nodes): "
                     f"{t['tokens_per_round']:.2f} tokens a round, {t['mean_nodes']:.1f} nodes; accepted at depth "
                     + " ".join(f"{a:.2f}" for a in t["accepted_at_depth"]))
    curve = report.get("verify_curve")
    if curve:
        lines.append("verifying n tokens, in target steps: " + " ".join(f"{n}:{v:.2f}" for n, v in curve.items()))
    for name, e in (report.get("engines") or {}).items():
        line = (f"on {name} (step {e['step_s'] * 1e3:.1f} ms, {e['step_source']}): c {e['cost_ratio']:.3f}, chain γ "
                f"{e['chain_gamma']} {e['chain_tokens_per_round']:.2f} tokens a round, predicted "
                f"{e['chain_predicted_speedup']:.2f}x")
        if "tree_predicted_speedup" in e:
            line += f"; tree of ≤ {e['tree_budget']} nodes {e['tree_predicted_speedup']:.2f}x"
        lines.append(line)
    sources = report.get("sources")
    if sources:
        ngram, hybrid = sources["ngram"], sources["hybrid"]
        h = hybrid["by_gamma"][hybrid["recommended_gamma"] - 1]
        share = h[NGRAM]["rounds"] / max(1, h[NGRAM]["rounds"] + h[MODEL]["rounds"])
        lines += [f"per source (sequential): model α {report['alpha']:.3f} c {report['cost_ratio']:.3f} "
                  f"{report['best_predicted_sequential_speedup']:.2f}x (γ {report['recommended_gamma']}); "
                  f"suffix match α {ngram['alpha']:.3f} where one exists ({ngram['coverage']:.0%} of positions) "
                  f"c 0 {ngram['best_predicted_sequential_speedup']:.2f}x (γ {ngram['recommended_gamma']}); "
                  f"hybrid {hybrid['best_predicted_sequential_speedup']:.2f}x (γ {hybrid['recommended_gamma']}, "
                  f"match rounds {share:.0%}, accepted {h[NGRAM]['acceptance_rate']:.2f} match / "
                  f"{h[MODEL]['acceptance_rate']:.2f} model)"]
    return "\n".join(lines)

