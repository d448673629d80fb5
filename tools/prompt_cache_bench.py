"""What a kept prompt saves: opening a verifier session (the prompt's prefill) without and with the prompt cache.

    python -m tools.prompt_cache_bench --json benchmarks/prompt_cache/open-DATE.json [--threads 1]

For prompts of 16 to 1,024 tokens of the default model in fp32: the median time of `VerifierEngine.open` over five
opens of the same prompt after a first one, on a runner without a prompt cache (each open prefills) and on one
with the served default's (each later open copies the kept KV). The same process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.core.sampling import SamplingParams
from cluster.model import models
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import VerifierEngine

LENGTHS = (16, 128, 512, 1024)
TEXT = "The river wound through the valley, past orchards and old stone mills. "


def open_ms(model, ids: list[int], cache_tokens: int, opens: int = 6) -> tuple[float, int]:
    """Median milliseconds of `open` over the opens after the first (which prefills either way), and the kept
    prompt's hits."""
    engine = VerifierEngine(TorchModelRunner(model, name="target", prompt_cache_tokens=cache_tokens))
    times = []
    for i in range(opens):
        start = time.perf_counter()
        engine.open(f"s{i}", ids, SamplingParams())
        times.append(time.perf_counter() - start)
        engine.release(f"s{i}")
    return statistics.median(times[1:]) * 1000, engine.prompt_cache.stats.hits


def measure(model, tokenizer, lengths=LENGTHS) -> dict:
    ids = tokenizer(TEXT * (max(lengths) // 8))["input_ids"]
    out = {}
    for n in lengths:
        (prefill, _), (kept, hits) = open_ms(model, ids[:n], 0), open_ms(model, ids[:n], PROMPT_CACHE_TOKENS)
        out[n] = {"prefill_ms": prefill, "kept_ms": kept, "hits": hits}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = models.prepare_default_model()
    result = measure(models.load_causal_lm(path, "float32", "cpu"), models.load_tokenizer(path))
    for n, row in result.items():
        print(f"{n:5d} tokens: open with a prefill {row['prefill_ms']:8.1f} ms, with the kept prompt "
              f"{row['kept_ms']:6.2f} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": args.threads, "dtype": "float32", "opens": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
