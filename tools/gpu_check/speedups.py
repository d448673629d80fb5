"""Speedups of the in-process loop at controlled acceptance, against the pipeline model's prediction.

Per target (fp32: see below) with the draft it is served with: a `ControlledOracle` paced by that draft's real-shaped
forward (so c is the draft's) proposes the target's greedy continuation, each token wrong with probability
1 − α, for α 0.6, 0.8, 0.9, in sequential rounds and pipelined (depth 2, the drafter in a thread of its own
and, on CUDA, on a stream of its own). Measured: decode tokens/s over plain decoding's (the same loop with
γ = 0). Predicted from the same α, the measured c and the verify-cost curve:

- `pipeline_model`: `drafts/pipeline_model.py` as it is (every verify round costs one target step);
- `pipeline_model_with_curve`: the same in units of the round's own verify forward v = T(n) / T(1)
  (n = γ + 1 fed tokens sequentially, γ pipelined): simulate(α, c / v, γ) / v;
- `closed_form`: `drafts/cost_model.predicted_speedup` with verify_token_cost (v − 1) / γ.

fp32, not bf16: the oracle knows the target's continuation from a plain run, which holds only where verifying
n tokens gives the same argmax as n single steps. On the H200 in bf16 it did not (cuBLAS picks other kernels
for 1 and for 5 rows; with random weights the logits are near ties), so the runs drifted off the reference
and the 1B's acceptance fell to 0.01 at α 0.8 (first device run, 2026-12-04). In fp32 (TF32 off) every
equality case held, and `matches_plain` checks it again here.
"""

from __future__ import annotations

import torch

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.cost_model import effective_alpha, predicted_speedup
from drafts.pipeline_model import simulate_pipelined, simulate_sequential
from tools.gpu_check.costs import (
    context_length,
    draft_step_time,
    make_pacer,
    one_step_time,
)
from tools.gpu_check.equality import random_prompts
from tools.gpu_check.oracles import ControlledOracle
from tools.gpu_check.shapes import PAIRS, Models
from tools.gpu_check.timing import median_time

ALPHAS = [0.6, 0.8, 0.9]
GAMMA = 4
MODES = {"sequential": 1, "pipelined": 2}
SIM_TOKENS = 20_000


def _forward_ratio(runner: TorchModelRunner, n: int, step_s: float, tiny: bool, reps: int) -> float:
    """T(n) / T(1) at the context length, batch 1."""
    prompt = random_prompts(runner.vocab_size, [context_length(tiny) + n], seed=8)[0]
    session = runner.add_session()
    try:
        runner.extend(session, prompt[:-n], num_logits=0)
        length = runner.length(session)
        t = median_time(lambda: runner.extend(session, prompt[-n:]), runner.device, reps,
                        reset=lambda: runner.truncate(session, length))
    finally:
        runner.release(session)
    return t / step_s


def predictions(alpha: float, c: float, v_seq: float, v_pipe: float) -> dict:
    """Speedup over plain decoding predicted for both modes (see the module's docstring)."""
    seq = {"pipeline_model": simulate_sequential(alpha, c, GAMMA, SIM_TOKENS),
           "pipeline_model_with_curve": simulate_sequential(alpha, c / v_seq, GAMMA, SIM_TOKENS) / v_seq,
           "closed_form": predicted_speedup(alpha, GAMMA, c, False, (v_seq - 1) / GAMMA)}
    pipe = {"pipeline_model": simulate_pipelined(alpha, c, GAMMA, 2, tokens=SIM_TOKENS),
            "pipeline_model_with_curve": simulate_pipelined(alpha, c / v_pipe, GAMMA, 2, tokens=SIM_TOKENS) / v_pipe,
            "closed_form": predicted_speedup(alpha, GAMMA, c, True, (v_pipe - 1) / GAMMA)}
    return {"sequential": seq, "pipelined": pipe}


def _decode(decoder: SpeculativeDecoder, prompts, params) -> dict:
    """Sums over the prompts: decode seconds (prefill excluded), tokens, rounds, drafted, accepted."""
    out = {"decode_s": 0.0, "tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0, "outputs": []}
    for ids in prompts:
        r = decoder.generate(ids, params)
        out["decode_s"] += r.stats.total_s - r.stats.prefill_s
        out["tokens"] += len(r.token_ids)
        out["rounds"] += r.stats.rounds
        out["drafted"] += r.stats.drafted
        out["accepted"] += r.stats.accepted
        out["outputs"].append(r.token_ids)
    return out


DTYPE = "float32"


def speedup_target(models: Models, name: str, tiny: bool, budget) -> dict:
    dtype = DTYPE
    draft = PAIRS[name]
    runner = TorchModelRunner(models.target(name, dtype), name="target")
    device = runner.device
    reps = 2 if tiny else 10
    pacer = make_pacer(models, draft, name, dtype)
    step_s = one_step_time(runner, tiny, reps)
    draft_s = draft_step_time(pacer, runner.vocab_size, tiny, reps, device)
    c = draft_s / step_s
    v_seq, v_pipe = (_forward_ratio(runner, n, step_s, tiny, reps) for n in (GAMMA + 1, GAMMA))
    max_tokens = 12 if tiny else 128
    params = SamplingParams(max_tokens=max_tokens)
    prompts = random_prompts(runner.vocab_size, [context_length(tiny)] * (1 if tiny else 2), seed=9)
    plain_dec = SpeculativeDecoder(runner, None)
    plain_dec.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up
    plain = _decode(plain_dec, prompts, params)
    references = {tuple(ids): out for ids, out in zip(prompts, plain["outputs"])}
    plain_tps = plain["tokens"] / plain["decode_s"]
    out = {"dtype": dtype, "draft": draft, "gamma": GAMMA, "max_tokens": max_tokens, "prompts": len(prompts),
           "target_step_s": step_s, "draft_step_s": draft_s, "c": c, "verify_ratio_seq": v_seq,
           "verify_ratio_pipelined": v_pipe, "plain_tokens_per_s": plain_tps,
           "plain_loop_over_step": 1 / (plain_tps * step_s), "runs": []}
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    for alpha in ALPHAS:
        predicted = predictions(alpha, c, v_seq, v_pipe)
        for mode, depth in MODES.items():
            if not budget.allows(f"speedups/{name}/alpha={alpha}/{mode}", 1 if tiny else 8):
                continue
            oracle = ControlledOracle(references, runner.vocab_size, alpha=alpha, seed=10, pacer=pacer,
                                      stream=stream if depth > 1 else None)
            decoder = SpeculativeDecoder(runner, oracle, None, GAMMA, pipeline_depth=depth, overlap=depth > 1)
            spec = _decode(decoder, prompts, params)
            speedup = (spec["tokens"] / spec["decode_s"]) / plain_tps
            tokens_per_round = spec["tokens"] / max(1, spec["rounds"])
            run = {"alpha": alpha, "mode": mode, "measured_speedup": speedup, "tokens_per_s": spec["tokens"] / spec["decode_s"],
                   "acceptance": spec["accepted"] / max(1, spec["drafted"]), "tokens_per_round": tokens_per_round,
                   "matches_plain": spec["outputs"] == plain["outputs"], "predicted": predicted[mode],
                   "measured_over_model": speedup / predicted[mode]["pipeline_model_with_curve"]}
            if mode == "sequential":
                run["effective_alpha"] = effective_alpha(tokens_per_round, GAMMA)
            out["runs"].append(run)
    return out


def speedup_section(models: Models, targets: list[str], tiny: bool, budget) -> dict:
    out: dict = {"dtype": DTYPE, "alphas": ALPHAS, "gamma": GAMMA, "modes": list(MODES), "pairs": {t: PAIRS[t] for t in targets},
                 "pipelined_mode": "depth 2, overlap (drafter thread), draft on a side CUDA stream on CUDA",
                 "targets": {}}
    for name in targets:
        if budget.allows(f"speedups/{name}", 3 if tiny else 30):
            out["targets"][name] = speedup_target(models, name, tiny, budget)
    return out
