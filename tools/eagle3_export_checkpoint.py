"""Export an EAGLE-3 training checkpoint (`python -m tools.eagle3`'s checkpoint.pt, mid-run) to measure or serve
the draft before the run ends. One directory holds both layouts: the one vLLM's `eagle3` method loads
(config.json, model.safetensors) and tandem's own (draft.safetensors, tandem_draft.json), so it serves on
either engine:

    python -m tools.eagle3_export_checkpoint OUT_DIR [--checkpoint ~/.cache/tandem/eagle3/smollm2-135m/checkpoint.pt]

then `python -m tools bench --engine vllm --eagle3 OUT_DIR`, or `tandem serve` with
`engine: {proposer: eagle3, draft: OUT_DIR}` (backend vllm: vLLM's own method; backend torch: tandem's
feature-fed proposer on the verifier's three layers' states, chains or dynamic trees).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from cluster.model import models
from drafts.eagle3_model import Eagle3Draft, export_vllm, save_tandem
from drafts.feature_proposer import draft_meta
from tools.draftdata.shards import Manifest

DEFAULT_CHECKPOINT = Path.home() / ".cache" / "tandem" / "eagle3" / "smollm2-135m" / "checkpoint.pt"
DEFAULT_DATA = Path(__file__).resolve().parent.parent / "drafts" / "data" / "smollm2-135m"
# the run behind the default checkpoint, resumed each session (BENCHMARKS.md, "Draft training data")
TRAINING_COMMAND = ("python -m tools.eagle3 --data drafts/data/smollm2-135m --out ~/.cache/tandem/eagle3/smollm2-135m "
                    "--steps 4000 --eval-every 100 --eval-humaneval 8 --eval-chat 8 --max-minutes 165 --threads 1")


def export_checkpoint(checkpoint: Path, out_dir: Path, target, layout: str = "both",
                      data: Path | None = DEFAULT_DATA, training_command: str | None = None,
                      init: str | None = None) -> tuple[Path, int | None]:
    """(the exported directory, the checkpoint's step): the draft's weights and vocabulary map from the
    checkpoint, the embedding and head rows rebuilt from `target`. `layout`: "both", "vllm" or "tandem" (the
    shipped draft is tandem's files only: vLLM's carry the head rows, twice the size; tandem builds them when
    vLLM serves the draft, `cluster.vllm.engine.checked_eagle3_dir`)."""
    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    weights = state["draft"]
    draft = Eagle3Draft(target, weights["d2t"])
    draft.load_state_dict(weights)
    draft.eval()
    out = Path(out_dir)
    if layout in ("both", "vllm"):
        export_vllm(draft, out)
    if layout in ("both", "tandem"):
        save_tandem(draft, out, provenance(checkpoint, state, target, data, training_command, init))
    return out, state.get("step")


def provenance(checkpoint: Path, state: dict, target, data: Path | None, training_command: str | None = None,
               init: str | None = None) -> dict:
    """tandem_draft.json's story of a checkpoint: how it was trained (the run's command, steps, seed, the last
    point of its learning curve), on what data (the shards, their answer tokens, the manifest's recipe). The
    command is `training_command`, else the one the checkpoint recorded, else the default run's; `init`: the draft
    a warm-started run began from (else the checkpoint's `--init`), whose own provenance tells how it was made."""
    shards = list(state.get("shards", []))
    config = state.get("config") or {}
    command = training_command or state.get("command") or TRAINING_COMMAND
    init = init or config.get("init") or None
    meta = {"target": str(target.config.name_or_path), "steps": state.get("step"),
            "minutes": round(float(state.get("minutes", 0.0)), 1), "checkpoint": str(checkpoint),
            "export_command": shlex.join(["python -m tools.eagle3_export_checkpoint", *sys.argv[1:]]),
            "training_command": command, "seed": config.get("seed", 0), "torch": torch.__version__,
            "weights": "draft.safetensors (bf16): fc, the decoder layer, norm and d2t; the token embedding and the "
                       "head rows at d2t are rebuilt from the target",
            "data": {"dir": str(data) if data else None, "shards": len(shards),
                     "first_shard": shards[0] if shards else None, "last_shard": shards[-1] if shards else None}}
    if init:
        earlier = draft_meta(init)
        meta["init"] = {"dir": str(init), **{k: earlier[k] for k in ("training_command", "command", "steps", "init")
                                             if k in earlier}}
    manifest = Manifest.load(data) if data is not None else None
    if manifest is not None:
        meta["data"].update(recipe=manifest.recipe, answer_tokens=sum(
            r.answer_tokens for r in manifest.shards if r.file in set(shards)))
    curve = checkpoint.parent / "learning_curve.jsonl"
    if curve.is_file():
        points = [json.loads(line) for line in curve.read_text().splitlines() if line.strip()]
        at = [p for p in points if p.get("step") == state.get("step")] or points[-1:]
        if at:
            meta["final_eval"] = {k: v for k, v in at[-1].items() if k not in ("step", "minutes")}
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.eagle3_export_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--target", default="default")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the training data (its manifest, for provenance)")
    p.add_argument("--layout", choices=["both", "vllm", "tandem"], default="both",
                   help="vLLM's files, tandem's, or both (default) in OUT")
    p.add_argument("--training-command", default=None,
                   help="the run's command, for a checkpoint that did not record it (default: the checkpoint's)")
    p.add_argument("--init", default=None, help="the draft a warm-started run began from (default: the checkpoint's)")
    args = p.parse_args(argv)
    target = models.load_causal_lm(models.resolve_model_path(args.target), "float32", "cpu")
    out, step = export_checkpoint(args.checkpoint, args.out, target, args.layout, args.data, args.training_command,
                                  args.init)
    print(f"exported the step-{step} draft to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
