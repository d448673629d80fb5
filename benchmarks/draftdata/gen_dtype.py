"""Generated tokens/s of the draft-data engine (`tools.draftdata.engines.VllmEngine`, one bound core) in one dtype:
64 chat prompts at once, greedy, up to 192 tokens each (BENCHMARKS.md, "Draft data in bf16").

    PYTHONPATH=. .venv/bin/python benchmarks/draftdata/gen_dtype.py bfloat16
    PYTHONPATH=. .venv/bin/python benchmarks/draftdata/gen_dtype.py float32
"""

import sys
import time


def main() -> None:
    from cluster.model import models
    from tools.draftdata.engines import GenRequest, VllmEngine

    dtype = sys.argv[1]
    model_dir = models.prepare_default_model()
    tok = models.load_tokenizer(model_dir)
    engine = VllmEngine(model_dir, dtype=dtype, threads=1)
    topics = ["rivers", "compilers", "music", "cats", "stars", "bread", "chess", "trains"] * 8
    reqs = [GenRequest(models.encode_prompt(tok, f"Explain topic number {i} about {w} in detail.", True), 192,
                       0.0, 1.0, i, (2,)) for i, w in enumerate(topics)]
    engine.generate(reqs[:2])  # warm-up
    t = time.perf_counter()
    res = engine.generate(reqs)
    dt = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in res)
    print(f"RESULT {dtype}: {len(reqs)} prompts, {n} tokens in {dt:.1f} s = {n / dt:.1f} tok/s")


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the main module must not start it on import
    main()
