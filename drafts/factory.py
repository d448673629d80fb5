"""The one proposer factory: a validated `EngineConfig` in, a proposer (or None) out.

`make_proposer` builds from a target model already loaded in this process (the in-process engine,
`drafts validate`); `build_proposer` loads what the draft needs itself (the drafter actor, vLLM's
worker): the target only when the draft borrows from it (the int8 copy, a tandem or feature draft).
"""

from __future__ import annotations

import logging

import torch

from cluster.core.config import EAGLE3, INT8_DRAFT, EngineConfig
from cluster.core.errors import ConfigError
from cluster.model import models
from cluster.model.runner import TorchModelRunner
from drafts.draft_model import DraftModelProposer, quantized_copy
from drafts.eagle3_model import load_eagle3
from drafts.feature_model import load_feature_draft
from drafts.feature_proposer import FeatureProposer, feature_draft_dir, is_eagle3_draft, is_feature_draft
from drafts.hybrid import HybridProposer
from drafts.ngram import NGramProposer, SuffixProposer
from drafts.proposer import Proposer
from drafts.routing import check_eagle3_draft, feature_cost_ratio, speculates
from drafts.small_draft import is_tandem_draft, load_draft

log = logging.getLogger(__name__)


def load_fed_draft(target_model: torch.nn.Module, path, dtype: torch.dtype = torch.bfloat16):
    """A feature-fed draft from its directory (or the shorthand `feature`): EAGLE-3 or the EAGLE-1 style draft."""
    if is_eagle3_draft(path):
        return load_eagle3(target_model, feature_draft_dir(path), dtype)
    return load_feature_draft(target_model, feature_draft_dir(path), dtype)


def make_proposer(config: EngineConfig, target_model: torch.nn.Module | None, target_tokenizer) -> Proposer | None:
    """The configured proposer; `target_model` is read only by drafts made from it (int8, tandem, feature)."""
    if not speculates(config):
        return None
    if config.proposer == "ngram":
        return NGramProposer(max_ngram=config.max_ngram)
    if config.proposer == "suffix":
        return SuffixProposer(max_tokens=config.suffix_tokens, max_ngram=config.max_ngram)
    if config.proposer == "auto":
        raise ConfigError("proposer 'auto' is chosen with the engine: set engine.backend to torch or vllm, or serve "
                          "the config (its backend 'auto' is resolved first)")
    if config.proposer == EAGLE3:  # the torch runner's EAGLE-3 (vLLM's backend runs its own method)
        check_eagle3_draft(config.draft)
        return FeatureProposer(load_fed_draft(target_model, config.draft), tree_width=config.tree_width,
                               tree_tokens=config.tree_tokens)
    if is_feature_draft(config.draft):  # EAGLE-style: reads the target's features, sent by the verifier
        model = FeatureProposer(load_fed_draft(target_model, config.draft),
                                tree_width=config.tree_width, tree_tokens=config.tree_tokens)
        if config.proposer == "hybrid":
            return HybridProposer(model, max_ngram=config.max_ngram, cost_ratio=feature_cost_ratio(config.draft),
                                  tree_width=config.tree_width, match_tokens=config.match_tokens)
        return model
    if config.draft == INT8_DRAFT:
        draft_model = quantized_copy(target_model)
    elif is_tandem_draft(config.draft):  # a distilled or self-speculative draft made from this target
        draft_model = load_draft(config.draft, target_model)
    else:
        path = models.resolve_model_path(config.draft, config.cache_dir)
        # compared only: a refused draft's tokenizer must not become this process's grammar vocabulary
        models.check_same_tokenizer(target_tokenizer, models.load_tokenizer(path, register=False), str(path))
        draft_model = models.load_causal_lm(path, config.dtype, config.device)
    model = DraftModelProposer(TorchModelRunner(draft_model, name="draft", cuda_graphs=config.cuda_graphs,
                                                prompt_cache_tokens=config.prompt_cache_tokens),
                               tree_width=config.tree_width)
    if config.proposer == "hybrid":
        return HybridProposer(model, max_ngram=config.max_ngram, tree_width=config.tree_width,
                              match_tokens=config.match_tokens)
    return model


def build_proposer(config: EngineConfig, max_support: int | None = None) -> Proposer | None:
    """The configured proposer in a process of its own: loads the target only when the draft borrows from it.
    `max_support` caps the support of the draft's q rows (they cross the wire as sparse rows)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    path = models.resolve_model_path(config.target, config.cache_dir)
    tokenizer = models.load_tokenizer(path)
    target = None
    model_draft = config.proposer in ("draft", "hybrid", EAGLE3)
    if model_draft and config.draft == INT8_DRAFT:
        target = models.load_causal_lm(path, "float32", "cpu")  # only to copy and quantise
    elif model_draft and (is_tandem_draft(config.draft) or is_feature_draft(config.draft)):
        target = models.load_causal_lm(path, config.dtype, config.device)  # lends embeddings (and layers)
    proposer = make_proposer(config, target, tokenizer)
    model = getattr(proposer, "model", proposer)  # the hybrid's model proposer
    if max_support is not None and isinstance(model, (DraftModelProposer, FeatureProposer)):
        model.max_support = max_support
    return proposer
