"""Export an EAGLE-3 training checkpoint (`python -m tools.eagle3`'s checkpoint.pt, mid-run) in the layout
vLLM's `eagle3` method loads, to measure or serve the draft before the run ends:

    python -m tools.eagle3_export_checkpoint OUT_DIR [--checkpoint ~/.cache/tandem/eagle3/smollm2-135m/checkpoint.pt]

then `python -m tools bench --engine vllm --eagle3 OUT_DIR`, or `tandem serve` with
`engine: {backend: vllm, proposer: eagle3, draft: OUT_DIR}`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cluster.model import models
from drafts.eagle3_model import Eagle3Draft, export_vllm

DEFAULT_CHECKPOINT = Path.home() / ".cache" / "tandem" / "eagle3" / "smollm2-135m" / "checkpoint.pt"


def export_checkpoint(checkpoint: Path, out_dir: Path, target) -> tuple[Path, int | None]:
    """(the exported directory, the checkpoint's step): the draft's weights and vocabulary map from the
    checkpoint, the embedding and head rows rebuilt from `target`."""
    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    weights = state["draft"]
    draft = Eagle3Draft(target, weights["d2t"])
    draft.load_state_dict(weights)
    return export_vllm(draft.eval(), out_dir), state.get("step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.eagle3_export_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--target", default="default")
    args = p.parse_args(argv)
    target = models.load_causal_lm(models.resolve_model_path(args.target), "float32", "cpu")
    out, step = export_checkpoint(args.checkpoint, args.out, target)
    print(f"exported the step-{step} draft to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
