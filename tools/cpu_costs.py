"""The verify-cost curve of the real target on this CPU: what one forward of n tokens costs (n = 1 is one
target step), bf16 and fp32, batch 1 and 8, at a 512-token context, through the runner's own API
(`tools.gpu_check.costs.verify_curve`, the GPU check's measurement on the real SmolLM2-135M weights).

    python -m tools.cpu_costs --out benchmarks/cpu/verify-cost.json [--threads 1] [--reps 5] [--points 1,2,4,8,16]

Speculation pays only where verifying γ + 1 tokens costs little more than one step; the figures say
whether it does on this machine (torch's CPU capability is printed with them: its bf16 matmuls of more
than one row run as that many one-row products where the CPU has no native bf16 support).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from cluster.model import models
from cluster.model.runner import TorchModelRunner
from tools.gpu_check import costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--points", default="1,2,4,8,16", help="tokens per forward")
    parser.add_argument("--batches", default="1", help="sessions per forward (the curve's ratio is per batch)")
    args = parser.parse_args(argv)
    costs.POINTS = [int(n) for n in args.points.split(",")]
    costs.BATCHES = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    path = models.prepare_default_model()
    result = {"threads": args.threads, "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"), "curves": {}}
    for dtype in args.dtypes.split(","):
        runner = TorchModelRunner(models.load_causal_lm(path, dtype, "cpu"), name="target")
        result["curves"][dtype] = costs.verify_curve(runner, tiny=False, reps=args.reps)
        ratio = result["curves"][dtype]["ratio"][1]
        print(dtype, "step %.1f ms;" % (1e3 * result["curves"][dtype]["seconds"][1][1]),
              " ".join(f"{n}:{r:.2f}x" for n, r in ratio.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
