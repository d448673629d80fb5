"""What an engine config asks of the serving path, read from the config and the draft's metadata alone: whether it
drafts, whether the verifier feeds the draft the target's features (and of which layers), the hybrid's own match
rounds, a feature draft's c. The ingress and the router decide with these without loading a model runner;
`drafts.factory` builds the proposers."""

from __future__ import annotations

from cluster.core.config import EAGLE3, EngineConfig
from cluster.core.errors import ConfigError
from drafts.feature_proposer import draft_meta, feature_layers, is_eagle3_draft, is_feature_draft
from drafts.suffix import OwnMatch

FEATURE_DRAFT_COST_RATIO = 0.1  # the shipped feature-fed draft's c, measured on this machine (tandem_draft.json)


def needs_features(config: EngineConfig) -> bool:
    """Whether the configured proposer is fed the target's features by tandem's verifier (a feature-fed draft
    model; proposer 'eagle3' on the torch runner: on vLLM, vLLM's own method reads them in its step)."""
    if config.num_speculative_tokens <= 0:
        return False
    if config.proposer == EAGLE3:
        return config.backend == "torch"
    return config.proposer in ("draft", "hybrid") and is_feature_draft(config.draft)


def target_feature_layers(config: EngineConfig) -> tuple[int, ...] | None:
    """What the target's runner captures for a feature-fed draft (`TorchModelRunner.feature_layers`): an
    EAGLE-3 draft's fused layers, else None (the last hidden state)."""
    return feature_layers(config.draft) if needs_features(config) else None


def check_eagle3_draft(draft: str) -> None:
    """Proposer 'eagle3' on the torch runner: `draft` must hold tandem's files of an EAGLE-3 draft."""
    if not is_eagle3_draft(draft):
        raise ConfigError(f"proposer 'eagle3' on the torch runner needs `draft`: an EAGLE-3 draft directory with a "
                          f"tandem_draft.json of kind 'eagle3' (python -m tools.eagle3_export_checkpoint writes one); "
                          f"{draft!r} is not one")


def feature_cost_ratio(path) -> float:
    """The hybrid's c for a feature-fed draft: its directory's `cost_ratio` when it records one; for an EAGLE-3
    draft the mean c of its `drafts validate` records (the torch engine's step, as recorded); else the shipped
    EAGLE-1 style draft's, measured served (`FEATURE_DRAFT_COST_RATIO`)."""
    meta = draft_meta(path)
    top = meta.get("cost_ratio")
    if isinstance(top, (int, float)) and 0 < top < 1:
        return float(top)
    records = [r.get("cost_ratio") for r in (meta.get("validate") or {}).values() if isinstance(r, dict)]
    records = [float(c) for c in records if isinstance(c, (int, float)) and 0 < c < 1]
    if is_eagle3_draft(path) and records:
        return sum(records) / len(records)
    return FEATURE_DRAFT_COST_RATIO


def own_match(config: EngineConfig) -> OwnMatch | None:
    """The hybrid's long match rounds of the session's own tokens, for the session loop to draft itself."""
    if not config.own_matches or config.proposer != "hybrid":
        return None
    return OwnMatch.for_rounds(config.match_tokens, config.num_speculative_tokens, max_ngram=config.max_ngram)


def speculates(config: EngineConfig) -> bool:
    """Whether this config drafts at all (a proposer and γ > 0)."""
    return config.proposer != "none" and config.num_speculative_tokens > 0
