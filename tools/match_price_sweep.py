"""Offline: what the matches' verify price does at B concurrent streams on vLLM (proposer 'eagle3' with its matches,
the served default's engine and γ-by-batch schedule). One `vllm.LLM`, prefix caching off (each group is run once per
variant); per group of 16 HumanEval prompts (all of the package's in order, so that there are enough fresh groups)
and per variant, the wrapper is installed anew (fresh tables and pool), a warm-up group runs,
then the group is timed, B at a time; the variants' order rotates from group to group.

    python -m tools.match_price_sweep --batch 16 --groups 3 \\
        --variants '{"rising": {"busy_rows": 0}, "busy9": {"busy_rows": 9}, "t99": {"threshold": 0.99, "per_row": 0, "busy_rows": 0}}'

A variant is a set of `InlineMatches` fields over the default config's (`cluster.vllm.protocol.inline_matches`);
`{}` is the default itself, and `{"threshold": 0.999, "per_row": 1.0, "busy_rows": 0}` drafts no match token at
16 rows (the speculative configuration's floor). `--plain` first runs the same groups on a plain engine (vLLM alone's
configuration) as the variant 'plain'.
Prints one JSON line per (group, variant) and a summary (tok/s per group, mean). BENCHMARKS.md, "The matches' price
at a full batch".
"""

from __future__ import annotations

import argparse
import json
import os
import time

from cluster.core.config import EngineConfig
from cluster.core.sampling import SamplingParams
from cluster.core.workloads import humaneval_prompts
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.vllm.engine import VLLMEngine
from cluster.vllm.protocol import inline_matches
from deployments.config import EAGLE3_SCHEDULE


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="streams at once")
    parser.add_argument("--groups", type=int, default=3, help="groups of 16 prompts, each run once per variant")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variants", default='{"rising": {"busy_rows": 0}, "busy9": {"busy_rows": 9}}')
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="vLLM's enforce_eager (the server compiles)")
    parser.add_argument("--plain", action="store_true",
                        help="first the same groups on a plain engine (no speculative config: vLLM alone's, async "
                             "scheduling on), in its own `vllm.LLM`, as the variant 'plain'")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

    path = models.prepare_default_model(None)
    tokenizer = models.load_tokenizer(path)
    prompts = [encode_prompt(tokenizer, t, False) for t in humaneval_prompts()]
    if len(prompts) < 16 * (args.groups + 1):
        raise SystemExit(f"{args.groups} groups need {16 * (args.groups + 1)} prompts; there are {len(prompts)}")
    params = SamplingParams.build(max_tokens=args.max_tokens)
    warm = prompts[:16]
    readings: dict[str, list[float]] = {}
    if args.plain:
        readings["plain"] = plain_readings(path, prompts, warm, params, args)
    config = EngineConfig.build(target=str(path), proposer="eagle3", dtype=args.dtype)
    matches = inline_matches(config)
    engine = VLLMEngine(path, method="eagle3", eagle3_dir=config.draft, eagle3_matches=matches, dtype=args.dtype,
                        num_speculative_tokens=config.num_speculative_tokens, enforce_eager=args.eager,
                        llm_kwargs={"enable_prefix_caching": False})
    variants = json.loads(args.variants)
    schedule = [list(r) for r in EAGLE3_SCHEDULE]
    engine.generate_batch(warm, params.model_copy(update={"max_tokens": 8}))
    readings.update({name: [] for name in variants})
    try:
        for g in range(args.groups):
            group = prompts[16 * (g + 1): 16 * (g + 2)]
            names = list(variants)[g % len(variants):] + list(variants)[:g % len(variants)]
            for name in names:
                engine.llm.collective_rpc("tandem_eagle_matches", args=(
                    matches.model_copy(update=variants[name]).model_dump(mode="json"),
                    config.num_speculative_tokens, schedule))
                engine.generate_batch(warm, params)
                readings[name].append(timed_group(engine, group, params, args.batch))
                stats = engine.proposer_stats()
                print(json.dumps({"group": g, "variant": name, "tokens_per_s": readings[name][-1],
                                  "stats": {k: stats.get(k) for k in ("matched_tokens", "verdict_drafted",
                                                                      "verdict_accepted", "pooled_rows")}}), flush=True)
    finally:
        engine.shutdown()
    summary = {name: {"per_group": r, "mean": round(sum(r) / len(r), 1)} for name, r in readings.items()}
    print("summary", json.dumps(summary), flush=True)
    return summary


def timed_group(engine, group, params, batch: int) -> float:
    """tok/s of `group` run `batch` requests at a time."""
    t0 = time.perf_counter()
    outputs = [r for i in range(0, len(group), batch) for r in engine.generate_batch(group[i:i + batch], params)]
    return round(sum(len(r.token_ids) for r in outputs) / (time.perf_counter() - t0), 1)


def plain_readings(path, prompts, warm, params, args) -> list[float]:
    """The groups on a plain engine (no speculative config), each after the same warm-up group as the variants'."""
    engine = VLLMEngine(path, dtype=args.dtype, enforce_eager=args.eager, llm_kwargs={"enable_prefix_caching": False})
    readings = []
    try:
        engine.generate_batch(warm, params.model_copy(update={"max_tokens": 8}))
        for g in range(args.groups):
            engine.generate_batch(warm, params)
            readings.append(timed_group(engine, prompts[16 * (g + 1): 16 * (g + 2)], params, args.batch))
            print(json.dumps({"group": g, "variant": "plain", "tokens_per_s": readings[-1]}), flush=True)
    finally:
        engine.shutdown()
    return readings


if __name__ == "__main__":
    main()
