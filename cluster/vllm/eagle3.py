"""vLLM's own `eagle3` method: the draft's directory in vLLM's layout (`checked_eagle3_dir`) and the
speculative config (`eagle3_speculative_config`), with or without tandem's matches in its proposer
(`cluster.vllm.eagle_matches`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from cluster.core.errors import ConfigError
from cluster.model import models
from cluster.vllm.protocol import InlineMatches
from drafts.eagle3_model import WEIGHTS as EAGLE3_WEIGHTS
from drafts.eagle3_model import export_vllm, load_eagle3
from drafts.feature_proposer import feature_draft_dir, is_eagle3_draft

log = logging.getLogger(__name__)


def eagle3_speculative_config(draft_dir: str, gamma: int, matches: InlineMatches | None) -> dict:
    """vLLM's `speculative_config` for its eagle3 method on `draft_dir`: γ tokens a step, or with tandem's matches
    the matches' length (EAGLE-3 itself drafts γ: `EagleMatches`) and per-row draft lengths."""
    if matches is None:
        return {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": gamma}
    return {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": max(gamma, matches.max_tokens),
            "disable_padded_drafter_batch": True}


def checked_eagle3_dir(draft: str | os.PathLike | None, field: str = "engine.draft", target: str | os.PathLike = "default",
                      cache: str | os.PathLike | None = None) -> Path:
    """vLLM's `eagle3` method's draft, resolved: a directory `drafts.eagle3_model.export_vllm` wrote (config.json
    with an Eagle3 architecture, model.safetensors), or a tandem EAGLE-3 draft (tandem_draft.json of kind
    'eagle3', the shorthand 'eagle3' for the shipped one), whose vLLM layout is written once from it and `target`
    under the cache (`<cache>/eagle3-vllm/`); a ConfigError naming `field` otherwise."""
    path = feature_draft_dir(draft) if draft else Path("")
    if draft and _vllm_eagle3_layout(path):
        return path.resolve()
    if draft and is_eagle3_draft(draft):
        weights = path / EAGLE3_WEIGHTS
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
        out = models.cache_dir(cache) / "eagle3-vllm" / f"{path.resolve().name}-{digest}"
        if not _vllm_eagle3_layout(out):
            target_model = models.load_causal_lm(models.resolve_model_path(target, cache), "float32", "cpu")
            export_vllm(load_eagle3(target_model, path, torch.float32), out)
            log.info("tandem's EAGLE-3 draft %s written in vLLM's layout to %s", path, out)
        return out.resolve()
    raise ConfigError(f"vLLM's eagle3 method needs {field} to be an EAGLE-3 draft: a directory "
                      f"drafts.eagle3_model.export_vllm wrote (config.json with an Eagle3 architecture and "
                      f"model.safetensors) or a tandem EAGLE-3 draft (tandem_draft.json of kind 'eagle3'); got {draft!r}")


def _vllm_eagle3_layout(path: Path) -> bool:
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any("Eagle3" in a for a in architectures) and (path / "model.safetensors").is_file()
