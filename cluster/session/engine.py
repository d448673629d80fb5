"""Build the in-process engine (target runner + proposer + tokenizer) from one validated config."""

from __future__ import annotations

import logging

import torch

from cluster.core.config import EngineConfig
from cluster.core.errors import ConfigError
from cluster.model import models
from cluster.model.gemm import fast_linears
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.factory import make_proposer
from drafts.routing import target_feature_layers

log = logging.getLogger(__name__)


def build_decoder(config: EngineConfig) -> SpeculativeDecoder:
    """The torch engine in this process (`cluster.vllm.engine.build_vllm_decoder` is vLLM's, same verbs)."""
    if config.backend != "torch":
        raise ConfigError(f"build_decoder builds the torch engine, not backend {config.backend!r}")
    if config.threads:
        torch.set_num_threads(config.threads)
    path = models.resolve_model_path(config.target, config.cache_dir)
    tokenizer = models.load_tokenizer(path)
    target_model = models.load_causal_lm(path, config.dtype, config.device)
    proposer = make_proposer(config, target_model, tokenizer)
    log.info("engine: target=%s proposer=%s γ=%d dtype=%s", path, config.proposer,
             config.num_speculative_tokens, config.dtype)
    # after the proposer: a draft copied from the target copies plain linears
    fast_linears(target_model, "target", onednn=config.onednn, gemm=config.fp32_gemm)
    target = TorchModelRunner(target_model, name="target", cuda_graphs=config.cuda_graphs,
                              feature_layers=target_feature_layers(config), prompt_cache_tokens=config.prompt_cache_tokens)
    return SpeculativeDecoder(target, proposer, tokenizer,
                              config.num_speculative_tokens)
