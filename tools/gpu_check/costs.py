"""What one round costs on the device: the verify-cost curve, the draft cost ratio c, the loop's overhead.

- verify cost: one forward of n tokens (n = 1 is one target step) through the runner's own API
  (`extend` for batch 1, `extend_batch` for batch 8: the packed step, per-session attention, cluster/model/packed.py),
  at a fixed context, as a multiple of one step;
- c: one draft step (a `LlamaPacer` / `FeaturePacer` step: what a draft pays per token, its argmax sync
  included) over one target step, for every draft shape against every target;
- loop overhead: a round's wall time in the in-process loop minus its forward (`ForwardTimer`) and
  drafting time: Python, the rejection sampler, syncs, as a fraction of the round's verify forward.
"""

from __future__ import annotations

import torch

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from tools.gpu_check.equality import random_prompts
from tools.gpu_check.oracles import ControlledOracle, FeaturePacer, LlamaPacer
from tools.gpu_check.shapes import DRAFTS, Models
from tools.gpu_check.timing import ForwardTimer, median_time

POINTS = [1, 2, 3, 4, 5, 8, 16, 32, 64]  # tokens in one forward (3 and 5: γ + 1 for γ = 2, 4)
BATCHES = [1, 8]


def context_length(tiny: bool) -> int:
    return 32 if tiny else 512


def verify_curve(runner: TorchModelRunner, tiny: bool, reps: int, warmup: int = 2) -> dict:
    """{batch: {n: seconds}} and the same as multiples of the batch's own n = 1 step."""
    length = context_length(tiny)
    out: dict = {"context": length, "seconds": {}, "ratio": {}}
    g = torch.Generator().manual_seed(4)
    for batch in BATCHES:
        sessions = [runner.add_session() for _ in range(batch)]
        try:
            for s in sessions:
                runner.extend(s, torch.randint(0, runner.vocab_size, (length,), generator=g).tolist(), num_logits=1)
            tokens = torch.randint(0, runner.vocab_size, (max(POINTS),), generator=g).tolist()

            seconds = {}
            for n in POINTS:
                feeds = {s: tokens[:n] for s in sessions}  # {session: [n]}
                seconds[n] = median_time(lambda feeds=feeds: _forward(runner, feeds), runner.device, reps, warmup,
                                         reset=lambda feeds=feeds: _truncate(runner, feeds, length))
        finally:
            for s in sessions:
                runner.release(s)
        out["seconds"][batch] = seconds
        out["ratio"][batch] = {n: t / seconds[1] for n, t in seconds.items()}
    if 8 in out["seconds"] and 1 in out["seconds"]:
        out["batch8_step_over_batch1_step"] = out["seconds"][8][1] / out["seconds"][1][1]
    return out


def _forward(runner: TorchModelRunner, feeds: dict) -> None:
    """The verifier's forward: `extend` for one session, `extend_batch` for several."""
    if len(feeds) == 1:
        session, tokens = next(iter(feeds.items()))
        runner.extend(session, tokens)
    else:
        runner.extend_batch(feeds)


def _truncate(runner: TorchModelRunner, feeds: dict, length: int) -> None:
    for session in feeds:
        runner.truncate(session, length)


def make_pacer(models: Models, draft: str, target: str, dtype: str):
    model = models.draft(draft, target, dtype)
    return FeaturePacer(model) if draft == "feature" else LlamaPacer(model)


def draft_step_time(pacer, vocab_size: int, tiny: bool, reps: int, device) -> float:
    """Median seconds of one draft step at the context length."""
    prompt = random_prompts(vocab_size, [context_length(tiny)], seed=5)[0]
    pacer.start("c", prompt)
    try:
        return median_time(lambda: pacer.step("c"), device, reps)
    finally:
        pacer.release("c")


def cost_ratios(models: Models, target: str, dtype: str, step_s: float, tiny: bool, reps: int) -> dict:
    """c of every draft shape against this target: {draft: {"draft_step_s", "c"}}."""
    out = {}
    for draft in DRAFTS:
        pacer = make_pacer(models, draft, target, dtype)
        vocab = models.target(target, dtype).config.vocab_size
        t = draft_step_time(pacer, vocab, tiny, reps, models.device)
        out[draft] = {"draft_step_s": t, "c": t / step_s}
    return out


def loop_overhead(runner: TorchModelRunner, tiny: bool, gamma: int = 4) -> dict:
    """Overhead per round of plain decoding, sequential and pipelined (depth 2) rounds of an instant
    α = 0.8 oracle: (decode wall time − forward time − draft time) / rounds, and over the mean forward."""
    max_tokens = 10 if tiny else 64
    prompt = random_prompts(runner.vocab_size, [context_length(tiny)], seed=6)[0]
    params = SamplingParams(max_tokens=max_tokens)
    plain = SpeculativeDecoder(runner, None).generate(prompt, params).token_ids
    references = {tuple(prompt): plain}
    out = {"gamma": gamma, "max_tokens": max_tokens, "alpha": 0.8}
    modes = {"plain": (None, 1), "sequential": (0.8, 1), "pipelined": (0.8, 2)}
    for mode, (alpha, depth) in modes.items():
        proposer = None if alpha is None else ControlledOracle(references, runner.vocab_size, alpha=alpha, seed=7)
        decoder = SpeculativeDecoder(runner, proposer, None, gamma, pipeline_depth=depth)
        if not tiny:
            decoder.generate(prompt, params)  # warm-up
        with ForwardTimer(runner) as timer:
            result = decoder.generate(prompt, params)
        stats = result.stats
        forwards = timer.calls[1:]  # the first is the prefill (VerifierEngine.open)
        forward_s = sum(s for _, s in forwards)
        rounds = max(1, len(forwards))
        overhead = max(0.0, (stats.total_s - stats.prefill_s) - forward_s - stats.draft_s) / rounds
        mean_forward = forward_s / rounds
        out[mode] = {"rounds": rounds, "tokens": len(result.token_ids), "mean_forward_s": mean_forward,
                     "overhead_per_round_s": overhead, "overhead_fraction_of_verify": overhead / mean_forward,
                     "draft_s": stats.draft_s, "matches_plain": result.token_ids == plain}
    return out


def _runners(models: Models, targets, tiny: bool, budget, section: str, needs_s: float):
    """(key, name, dtype, runner) of every (target shape, dtype) the budget leaves time for."""
    for name, dtypes in targets:
        for dtype in dtypes:
            if budget.allows(f"{section}/{name}/{dtype}", needs_s):
                yield f"{name}/{dtype}", name, dtype, TorchModelRunner(models.target(name, dtype), name="target")


def verify_cost_section(models: Models, targets, tiny: bool, budget) -> dict:
    reps, warmup = (1, 1) if tiny else (10, 2)
    out: dict = {"points": POINTS, "batches": BATCHES, "reps": reps, "unit": "seconds per forward", "targets": {}}
    for key, _, _, runner in _runners(models, targets, tiny, budget, "verify_cost", 2 if tiny else 25):
        out["targets"][key] = verify_curve(runner, tiny, reps, warmup)
    return out


def cost_ratio_section(models: Models, targets, tiny: bool, budget, curves: dict) -> dict:
    """c per (target, draft shape); the target step from the verify-cost curve (measured here if absent)."""
    reps = 2 if tiny else 20
    out: dict = {"drafts": DRAFTS, "definition": "draft step (batch 1, its argmax sync) / target step (batch 1)",
                 "targets": {}}
    for key, name, dtype, runner in _runners(models, targets, tiny, budget, "cost_ratio", 2 if tiny else 10):
        step_s = curves.get(key, {}).get("seconds", {}).get(1, {}).get(1)
        if step_s is None:
            step_s = one_step_time(runner, tiny, reps)
        out["targets"][key] = {"target_step_s": step_s, **cost_ratios(models, name, dtype, step_s, tiny, reps)}
    return out


def one_step_time(runner: TorchModelRunner, tiny: bool, reps: int) -> float:
    """Median seconds of one target step (batch 1) at the context length."""
    prompt = random_prompts(runner.vocab_size, [context_length(tiny)], seed=5)[0]
    session = runner.add_session()
    try:
        runner.extend(session, prompt[:-1], num_logits=0)
        length = runner.length(session)
        return median_time(lambda: runner.extend(session, prompt[-1:]), runner.device, reps,
                           reset=lambda: runner.truncate(session, length))
    finally:
        runner.release(session)


def loop_overhead_section(models: Models, targets, tiny: bool, budget) -> dict:
    out: dict = {"definition": "(decode wall time - forward time - draft time) per round, and over the mean "
                               "forward of a round", "targets": {}}
    for key, _, _, runner in _runners(models, targets, tiny, budget, "loop_overhead", 2 if tiny else 15):
        out["targets"][key] = loop_overhead(runner, tiny)
    return out
