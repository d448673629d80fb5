"""Summarise a py-spy raw profile (`py-spy record --format raw`): the share of samples whose stack passes through
each named function, on the main thread only (the stacks that start at `--root`), and the top leaf frames.

    python -m tools.pyspy_summary PROFILE.raw [--root spawn_main] [--key NAME ...] [--leaves 10]

Used for the profile of vLLM's worker under 16 chat streams (BENCHMARKS.md): a worker started by
multiprocessing runs its busy loop on the stacks that begin `<module>;spawn_main`, while its idle helper
threads (message-queue readers, condition waits) begin at `Thread._bootstrap` and are left out.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# the vLLM worker's step: its forward, attention, sampling, rejection sampling and the custom proposer
KEYS = ("execute_model", "LlamaModel.forward", "Attention", "compute_logits", "_prepare_inputs", "sample_tokens",
        "Sampler.forward", "RejectionSampler", "propose_draft_token_ids", "TandemProposer", "dequeue")


def summarise(lines, root: str | None, keys, leaves: int = 10) -> dict:
    """{"samples": n, "keys": {key: share}, "leaves": [(frame, share), ...]} over the stacks under `root`."""
    total = 0
    by_key: collections.Counter = collections.Counter()
    by_leaf: collections.Counter = collections.Counter()
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if root is not None and not any(root in f for f in frames[:3]):
            continue
        n = int(count)
        total += n
        for key in keys:
            if any(key in f for f in frames):
                by_key[key] += n
        by_leaf[re.sub(r" \(.*", "", frames[-1])] += n
    share = (lambda v: v / total) if total else (lambda v: 0.0)
    return {"samples": total, "keys": {k: share(by_key[k]) for k in keys},
            "leaves": [(f, share(v)) for f, v in by_leaf.most_common(leaves)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.pyspy_summary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", type=Path)
    p.add_argument("--root", default="spawn_main", help="keep stacks with this frame among their first three ('' = all)")
    p.add_argument("--key", action="append", help="a function name to report (repeatable; default: vLLM's step parts)")
    p.add_argument("--leaves", type=int, default=10)
    args = p.parse_args(argv)
    out = summarise(args.profile.read_text().splitlines(), args.root or None, args.key or KEYS, args.leaves)
    print(f"{out['samples']} samples")
    for key, share in out["keys"].items():
        print(f"{100 * share:5.1f}%  {key}")
    print("leaf frames:")
    for frame, share in out["leaves"]:
        print(f"{100 * share:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
