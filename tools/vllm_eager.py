"""vLLM's decode step eager against compiled, in process (no server): `python -m tools.vllm_eager eager|compiled`.

Prints one JSON line: startup seconds, ms a token at one stream, tokens/s at 16 streams (greedy, 96 tokens,
`ignore_eos`). Set VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_KVCACHE_SPACE as the run needs (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import sys
import time

from cluster.model import models


def main(mode: str) -> None:
    from vllm import LLM, SamplingParams

    path = str(models.resolve_model_path("default", None))
    t0 = time.time()
    llm = LLM(model=path, dtype="bfloat16", max_model_len=2048, enforce_eager=mode == "eager", seed=0)
    startup = time.time() - t0
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    prompts = [f"def function_{i}(x):\n    " for i in range(16)]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    t = time.time()
    llm.generate(prompts[:1], params, use_tqdm=False)
    one = time.time() - t
    t = time.time()
    llm.generate(prompts, params, use_tqdm=False)
    many = time.time() - t
    print(json.dumps({"mode": mode, "startup_s": round(startup, 1), "ms_per_token": round(1000 * one / 96, 1),
                      "one_stream_tok_s": round(96 / one, 1), "16_streams_tok_s": round(16 * 96 / many, 1)}))


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard is required
    if len(sys.argv) != 2 or sys.argv[1] not in ("eager", "compiled"):
        raise SystemExit("usage: python -m tools.vllm_eager eager|compiled")
    main(sys.argv[1])
