"""The torch runner's step, side by side in one process: against another runner module (`--old`), or with
its bf16 linear weights laid out for oneDNN against plain `nn.Linear` (`--onednn`), or its fp32 linears of a few
rows as W·xᵀ against plain `nn.Linear` (`--gemm`).

Times `extend_batch` (median of repeats, each rolled back) at several batch sizes, cached lengths and new
tokens a session, for the runner of this checkout and for a runner module from a file (`--old`, e.g. the
left-padded one before the packed step):

    git show a6bd975~1:cluster/model/runner.py > /tmp/runner_old.py
    python -m tools.bench_packed --old /tmp/runner_old.py --threads 1

The two runners share one model (bf16 by default), the same sessions and the same order of runs (old,
new, old, new; the faster of each pair's runs is kept). With `--onednn` both are this checkout's runner, one
on the model as loaded and one on a copy whose linears `cluster.model.onednn.pack_linears` swapped (one
session: `extend`, the step a single stream takes):

    python -m tools.bench_packed --onednn --threads 1

`--gemm` is the same in fp32, the copy's linears swapped by `cluster.model.gemm.gemm_linears`:

    python -m tools.bench_packed --gemm --threads 2
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cluster.model.gemm import gemm_copy
from cluster.model.models import load_causal_lm
from cluster.model.onednn import pack_linears
from cluster.model.runner import TorchModelRunner

CASES = [(1, 300, 1), (4, 300, 1), (8, 300, 1), (16, 300, 1), (8, 300, 6), (16, 300, 6), (16, 1000, 1)]
GEMM_CASES = [(1, 300, 1), (1, 300, 2), (1, 300, 4), (1, 300, 6), (4, 300, 1), (8, 300, 1), (16, 300, 1), (4, 300, 4),
              (16, 300, 6)]
ONEDNN_CASES = [(1, 300, 1), (1, 300, 4), (1, 300, 6), (8, 300, 1), (16, 300, 1), (16, 300, 6)]


def _load_runner(path: str):
    spec = importlib.util.spec_from_file_location("runner_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.TorchModelRunner


def _setup(runner_cls, model, batch: int, length: int):
    g = torch.Generator().manual_seed(0)
    runner = runner_cls(model)
    for i in range(batch):
        runner.add_session(i)
        runner.extend(i, torch.randint(0, 49000, (length + 7 * i,), generator=g).tolist())
    return runner


def _time(runner, batch: int, n: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        lengths = {i: runner.length(i) for i in range(batch)}
        start = time.perf_counter()
        if batch == 1:
            runner.extend(0, [5] * n)
        else:
            runner.extend_batch({i: [5] * n for i in range(batch)}, num_logits={i: n for i in range(batch)})
        times.append(time.perf_counter() - start)
        for i in range(batch):
            runner.truncate(i, lengths[i])
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--old", help="a runner module's file to compare with")
    mode.add_argument("--onednn", action="store_true", help="linears laid out for oneDNN against nn.Linear")
    mode.add_argument("--gemm", action="store_true", help="fp32 linears of a few rows as W·xᵀ against nn.Linear")
    parser.add_argument("--model", default=str(Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = "float32" if args.gemm else args.dtype  # W·xᵀ is the fp32 path
    model = load_causal_lm(args.model, dtype)
    if args.gemm:
        sides, cases, names = [(TorchModelRunner, model), (TorchModelRunner, gemm_copy(model, "W·xᵀ side"))], \
            GEMM_CASES, ("nn.Linear", "W·xᵀ")
    elif args.onednn:
        laid_out = copy.deepcopy(model)
        pack_linears(laid_out, "oneDNN side")
        sides, cases = [(TorchModelRunner, model), (TorchModelRunner, laid_out)], ONEDNN_CASES
        names = ("nn.Linear", "oneDNN")
    else:
        sides, cases, names = [(_load_runner(args.old), model), (TorchModelRunner, model)], CASES, ("old", "packed")
    rows = []
    print(f"| sessions | cached tokens | new tokens each | {names[0]} ms | {names[1]} ms | speedup |\n|---|---|---|---|---|---|")
    for batch, length, n in cases:
        old, new = (_setup(cls, m, batch, length) for cls, m in sides)
        runs = [_time(r, batch, n, args.repeats) for r in (old, new, old, new)]
        row = {"sessions": batch, "cached": length, "new": n, "old_ms": min(runs[0], runs[2]),
               "new_ms": min(runs[1], runs[3])}
        rows.append(row)
        print(f"| {batch} | {length}+ | {n} | {row['old_ms']:.1f} | {row['new_ms']:.1f} | "
              f"{row['old_ms'] / row['new_ms']:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "dtype": dtype, "sides": names,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
