"""`python -m tools.drafter_check`: what vLLM's EAGLE-3 drafter gives on this CPU, offline (`VLLMEngine`, bf16).

Two readings, each on one engine of the chosen `--variant`:

- `accept`: greedy, one request at a time, 128 tokens, 8 HumanEval prompts (problems 100 on) and 8 chat prompts
  (the peer bench's): tokens, vLLM's draft and acceptance counters, tokens a step, and tokens/s (offline, eager);
- `seeded`: 12 prompts × 48 tokens at temperature 1 (seeds 1000–1011), each request three times running; how many
  prompts gave the same answer all three times.

Variants: `default` (tandem's default config: EAGLE-3 with tandem's matches, vLLM's drafter without its padded
batch), `unpadded` (vLLM's EAGLE-3 alone on the same draft, γ 3, `disable_padded_drafter_batch`, synchronous
scheduling), `padded` (the same with the padded batch), `eagle3` (tandem's config with `eagle3_matches: false`),
`none` (no proposer). One JSON line per run, appended to `--out`.

To compare with a tree before a change, run this file against a worktree of it (`git worktree add DIR REV`, then
`cd DIR && PYTHONPATH=$PWD python /path/to/tools/drafter_check.py ...`): vLLM's worker imports tandem's worker
extension, and with it tandem's fixes, from that tree.
"""

from __future__ import annotations

import argparse
import json
import time

from cluster.core.config import EngineConfig
from cluster.core.sampling import SamplingParams
from cluster.core.workloads import peer_workload
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.vllm.eagle3 import checked_eagle3_dir, eagle3_speculative_config
from cluster.vllm.engine import VLLMEngine, build_vllm_decoder

VARIANTS = ("default", "unpadded", "padded", "eagle3", "none")
SEEDED_PROMPTS = ("def quicksort(arr):", "Write a haiku about rain.", "Explain TCP in one sentence.")


def build(variant: str):
    """(engine, tokenizer, what to shut down) for a variant."""
    config = EngineConfig.build(backend="vllm", dtype="bfloat16", proposer="eagle3")
    if variant in ("unpadded", "padded"):
        draft = str(checked_eagle3_dir(config.draft))
        speculative = eagle3_speculative_config(draft, 3, None)  # vLLM's own method, as tandem configures it
        if variant == "unpadded":
            speculative["disable_padded_drafter_batch"] = True
        engine = VLLMEngine(models.prepare_default_model(), dtype="bfloat16", method="eagle3", eagle3_dir=draft,
                            num_speculative_tokens=3,
                            llm_kwargs={"speculative_config": speculative, "async_scheduling": False})
        return engine, engine.tokenizer, engine
    update = {"default": {}, "eagle3": {"eagle3_matches": False}, "none": {"proposer": "none"}}[variant]
    decoder = build_vllm_decoder(config.model_copy(update=update))
    return decoder.engine, decoder.tokenizer, decoder


def accept(engine, tokenizer, n: int = 8, max_tokens: int = 128) -> dict:
    out = {}
    for workload in ("humaneval", "chat"):
        prompts, chat = peer_workload(workload, n)
        tokens = drafted = accepted = 0
        wall = 0.0
        for text in prompts:
            result = engine.generate(encode_prompt(tokenizer, text, chat), SamplingParams(max_tokens=max_tokens))
            tokens += result.stats.num_generated_tokens
            drafted += result.stats.drafted or 0
            accepted += result.stats.accepted or 0
            wall += result.stats.total_s
        out[workload] = {"tokens": tokens, "drafted": drafted, "accepted": accepted, "steps": tokens - accepted,
                         "tokens_per_step": round(tokens / max(1, tokens - accepted), 3),
                         "tok_s": round(tokens / wall, 1)}
    return out


def seeded(engine, tokenizer, prompts: int = 12, runs: int = 3, max_tokens: int = 48) -> dict:
    same = 0
    for i in range(prompts):
        ids = encode_prompt(tokenizer, SEEDED_PROMPTS[i % len(SEEDED_PROMPTS)], False)
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i)
        answers = {tuple(engine.generate(ids, params).token_ids) for _ in range(runs)}
        same += len(answers) == 1
    return {"prompts": prompts, "runs": runs, "same_every_run": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.drafter_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("reading", choices=("accept", "seeded"))
    parser.add_argument("--variant", choices=VARIANTS, default="default")
    parser.add_argument("--label", default="", help="a name for the tree or run, kept in the JSON line")
    parser.add_argument("--out", default="drafter-check.jsonl")
    args = parser.parse_args(argv)
    engine, tokenizer, owner = build(args.variant)
    try:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result = accept(engine, tokenizer) if args.reading == "accept" else seeded(engine, tokenizer)
    finally:
        owner.shutdown()
    line = json.dumps({"reading": args.reading, "variant": args.variant, "label": args.label, "at": started, **result})
    with open(args.out, "a") as f:
        f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
