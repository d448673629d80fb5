"""The torch runner's own CUDA-graph slots (`TorchModelRunner(cuda_graphs=True)`, cluster/model/graphs.py),
checked where they matter: exactness and speed on the GPU.

- equality (fp32 targets): plain decoding with slots against plain decoding without them and against
  transformers' `generate`; speculative decoding with slots on both sides: a draft model (the target's own
  weights, so always right) drafting one-token steps, the target verifying chains of γ + 1 tokens. The graph attends over the whole slot under a mask, where the eager
  step attends over the valid prefix: another reduction length, so the check records any divergence
  (random weights make near-ties) rather than assume there is none.
- speed (bf16 targets): one-token plain decoding, eager against replayed, ms a token over 64 tokens
  after a 128-token prompt, and the replays counted (a replay count of 0 means the graph path never ran);
  a chain's verification (γ + 1 tokens scored, then rolled back), eager against replayed.
"""

from __future__ import annotations

import time
import traceback

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer
from tools.gpu_check.equality import GAMMA, _hf_greedy, first_divergence, random_prompts
from tools.gpu_check.shapes import Models
from tools.gpu_check.timing import median_time, sync

CAPACITY = 512


def _graphed(model, name: str, slots: int = 2) -> TorchModelRunner:
    cuda = next(model.parameters()).device.type == "cuda"  # on CPU (CI): the static step, run eagerly
    return TorchModelRunner(model, name=name, cuda_graphs=slots, graph_capacity=CAPACITY, capture=cuda)


def _decode(runner: TorchModelRunner, prompts, params, proposer=None) -> list[list[int]]:
    dec = SpeculativeDecoder(runner, proposer, None, GAMMA)
    return [dec.generate(ids, params).token_ids for ids in prompts]


def _equality(model, tiny: bool) -> dict:
    lengths, max_tokens = ([5, 24], 10) if tiny else ([12, 300], 48)
    params = SamplingParams(max_tokens=max_tokens)
    prompts = random_prompts(model.config.vocab_size, lengths, seed=5)
    eager = _decode(TorchModelRunner(model, name="target"), prompts, params)
    hf = [_hf_greedy(model, ids, max_tokens, next(model.parameters()).device) for ids in prompts]
    graphed_runner = _graphed(model, "target")
    graphed = _decode(graphed_runner, prompts, params)
    draft_runner, spec_target = _graphed(model, "draft", slots=1), _graphed(model, "target")
    drafted = _decode(spec_target, prompts, params, DraftModelProposer(draft_runner))  # chains of γ + 1 replayed

    def diverged(outs):
        return [{"prompt": i, "first_divergence": first_divergence(o, e)}
                for i, (o, e) in enumerate(zip(outs, eager)) if o != e]

    return {"max_tokens": max_tokens, "prompt_lengths": lengths, "eager_equals_transformers": eager == hf,
            "graphed_plain_equal": graphed == eager, "graphed_plain_diverged": diverged(graphed),
            "graphed_draft_equal": drafted == eager, "graphed_draft_diverged": diverged(drafted),
            "target_stats": graphed_runner.graphs.stats.as_dict(), "draft_stats": draft_runner.graphs.stats.as_dict(),
            "verifier_stats": spec_target.graphs.stats.as_dict()}


def _ms_per_token(runner: TorchModelRunner, prompt: list[int], tokens: int) -> float:
    """Plain one-token steps after a prefill, ms a token (the prefill untimed)."""
    session = runner.add_session()
    try:
        token = int(runner.extend(session, prompt)[-1].argmax())
        runner.extend(session, [token])  # a first step (captures the slot's graph when there is one)
        sync(runner.device)
        t0 = time.perf_counter()
        for _ in range(tokens):
            token = int(runner.extend(session, [token])[-1].argmax())  # the argmax syncs, as decoding does
        sync(runner.device)
        return (time.perf_counter() - t0) / tokens * 1e3
    finally:
        runner.release(session)


def _verify_ms(runner: TorchModelRunner, prompt: list[int], n: int, reps: int) -> float:
    """A chain's verification: n tokens scored and rolled back, the median ms (the warm-up call captures)."""
    session = runner.add_session()
    try:
        runner.extend(session, prompt)
        return 1e3 * median_time(lambda: runner.extend(session, prompt[:n]), runner.device, reps, warmup=1,
                                 reset=lambda: runner.truncate(session, len(prompt)))
    finally:
        runner.release(session)


def _speed(model, tiny: bool) -> dict:
    prompt = random_prompts(model.config.vocab_size, [16 if tiny else 128], seed=9)[0]
    tokens = 8 if tiny else 64
    eager_runner, graphed_runner = TorchModelRunner(model, name="eager"), _graphed(model, "graphed", slots=1)
    eager = [_ms_per_token(eager_runner, prompt, tokens) for _ in range(2)]
    graphed = [_ms_per_token(graphed_runner, prompt, tokens) for _ in range(2)]
    reps = 3 if tiny else 20
    verify = {"eager_ms": _verify_ms(eager_runner, prompt, GAMMA + 1, reps),
              "graphed_ms": _verify_ms(graphed_runner, prompt, GAMMA + 1, reps)}
    return {"prompt": len(prompt), "tokens": tokens, "eager_ms": min(eager), "graphed_ms": min(graphed),
            "eager_over_graphed": min(eager) / min(graphed), f"verify_{GAMMA + 1}_tokens": verify,
            "stats": graphed_runner.graphs.stats.as_dict()}


def runner_graphs_section(models: Models, targets, tiny: bool, budget) -> dict:
    """Per target: equality in fp32 (where the target has an fp32 build), speed in bf16; errors recorded."""
    out: dict = {"capacity": CAPACITY, "gamma": GAMMA, "targets": {}}
    for name, dtypes in targets:
        entry = out["targets"].setdefault(name, {})
        for dtype, part, run, needs in (("float32", "equality", _equality, 20), ("bfloat16", "speed", _speed, 10)):
            if dtype not in dtypes or not budget.allows(f"runner_graphs/{name}/{part}", 1 if tiny else needs):
                continue
            try:
                entry[part] = {"dtype": dtype, **run(models.target(name, dtype), tiny)}
            except Exception as e:  # a failure on the device is a finding, recorded
                entry[part] = {"dtype": dtype, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-3000:]}
    return out
