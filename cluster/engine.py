"""Build a local engine (target runner + proposer + tokenizer) from one validated config."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster import models
from cluster.errors import ConfigError, validation_message
from cluster.runner import TorchModelRunner
from cluster.speculate import SpeculativeDecoder
from cluster.transport import NetworkConfig
from drafts.draft_model import DraftModelProposer, quantized_copy
from drafts.feature_draft import load_feature_draft
from drafts.feature_proposer import FeatureProposer, feature_draft_dir, is_feature_draft
from drafts.hybrid import HybridProposer, OwnMatch
from drafts.small_draft import is_tandem_draft, load_draft
from drafts.ngram import NGramProposer
from drafts.proposer import Proposer

log = logging.getLogger(__name__)

INT8_DRAFT = "int8"


class EngineConfig(BaseModel):
    """What runs where in one process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field("default", description="Target model: 'default' (SmolLM2-135M-Instruct) or a local Hugging Face model directory.")
    proposer: Literal["draft", "ngram", "hybrid", "none"] = Field("draft", description="'draft' (a draft model), 'ngram' (prompt lookup, no model), 'hybrid' (a suffix match when one is long enough, else the draft model, chosen per round from each one's acceptance) or 'none' (plain target decoding).")
    draft: str = Field(INT8_DRAFT, description="Draft model for proposers 'draft' and 'hybrid': 'int8' (int8 dynamic-quantized copy of the target), 'feature' (the feature-fed draft shipped for the default target, drafts/trained/feature-smollm2-135m: it reads the target's last hidden state, which the verifier sends), a tandem draft directory (`tandem drafts distill`) or a local model directory with the target's tokenizer.")
    num_speculative_tokens: int = Field(3, ge=0, le=32, description="Tokens drafted per round (γ); 0 is plain target decoding.")
    dtype: Literal["bfloat16", "float32", "float16"] = Field("bfloat16", description="Target (and model draft) dtype; the int8 draft computes in float32.")
    device: str | None = Field(None, description="torch device; CUDA when visible, else CPU.")
    threads: int | None = Field(1, ge=1, description="torch intra-op threads for this process (None leaves torch's default).")
    cache_dir: str | None = Field(None, description="Model cache root (default $TANDEM_CACHE_DIR or ~/.cache/tandem).")
    max_ngram: int = Field(3, ge=1, le=16, description="Longest n-gram the prompt-lookup proposer matches.")
    tree_width: int = Field(1, ge=1, le=4, description="Sequential rounds, verified as a token tree in one forward: the draft model's candidates at the first draft position (its most likely tokens); the hybrid's match rounds: up to this many continuations of the session's own suffix with different first tokens. 1 drafts a chain.")
    match_tokens: int = Field(16, ge=0, le=32, description="Proposer 'hybrid', sequential rounds: a suffix match at least 4 tokens long proposes up to this many tokens of its continuation instead of γ (a long match tends to go on; its drafts cost nothing and verifying more of them little; BENCHMARKS.md). 0 (or at most γ): match rounds are γ long like the model's.")
    own_matches: bool = Field(True, description="Proposer 'hybrid' with long match rounds: the router drafts a match of the session's own suffix at least 4 tokens long itself, up to match_tokens, without calling the drafter: in sequential rounds, and in place of the plain steps the speculation policy chooses (BENCHMARKS.md).")
    network: NetworkConfig = Field(default_factory=NetworkConfig, description="The verifier's internal gRPC service: the address it binds and advertises ('node' or 'loopback') and optional TLS; calls always need the cluster secret.")
    backend: Literal["torch", "vllm"] = Field("torch", description="Target engine: 'torch' (tandem's own runner over transformers' models, the default) or 'vllm' (vLLM owns the target and its decoding loop; tandem's drafter proposes through vLLM's custom proposer class; needs `pip install -e '.[vllm]'`).")

    @classmethod
    def build(cls, **kwargs) -> "EngineConfig":
        try:
            return cls(**{k: v for k, v in kwargs.items() if v is not None})
        except ValidationError as e:
            raise ConfigError(validation_message(e)) from None


def needs_features(config: EngineConfig) -> bool:
    """Whether the configured proposer is fed the target's features (a feature-fed draft model)."""
    return (config.proposer in ("draft", "hybrid") and config.num_speculative_tokens > 0
            and is_feature_draft(config.draft))


def own_match(config: EngineConfig) -> OwnMatch | None:
    """The hybrid's long match rounds of the session's own tokens, for the session loop to draft itself."""
    if not config.own_matches or config.proposer != "hybrid":
        return None
    return OwnMatch.for_rounds(config.match_tokens, config.num_speculative_tokens, max_ngram=config.max_ngram)


def make_proposer(config: EngineConfig, target_model: torch.nn.Module, target_tokenizer) -> Proposer | None:
    if config.proposer == "none" or config.num_speculative_tokens == 0:
        return None
    if config.proposer == "ngram":
        return NGramProposer(max_ngram=config.max_ngram)
    if is_feature_draft(config.draft):  # EAGLE-style: reads the target's features, sent by the verifier
        model = FeatureProposer(load_feature_draft(target_model, feature_draft_dir(config.draft)))
        if config.proposer == "hybrid":  # its cost ratio, measured on this machine (tandem_draft.json)
            return HybridProposer(model, max_ngram=config.max_ngram, cost_ratio=0.1, tree_width=config.tree_width,
                                  match_tokens=config.match_tokens)
        if config.tree_width > 1:
            raise ConfigError("a feature-fed draft drafts chains: tree_width must be 1 (or use proposer hybrid, "
                              "whose match rounds may be trees)")
        return model
    if config.draft == INT8_DRAFT:
        draft_model = quantized_copy(target_model)
    elif is_tandem_draft(config.draft):  # a distilled or self-speculative draft made from this target
        draft_model = load_draft(config.draft, target_model)
    else:
        path = models.resolve_model_path(config.draft, config.cache_dir)
        models.check_same_tokenizer(target_tokenizer, models.load_tokenizer(path), str(path))
        draft_model = models.load_causal_lm(path, config.dtype, config.device)
    model = DraftModelProposer(TorchModelRunner(draft_model, name="draft"), tree_width=config.tree_width)
    if config.proposer == "hybrid":
        return HybridProposer(model, max_ngram=config.max_ngram, tree_width=config.tree_width,
                              match_tokens=config.match_tokens)
    return model


def build_decoder(config: EngineConfig) -> SpeculativeDecoder:
    if config.backend == "vllm":  # same verbs: .tokenizer, .generate(prompt_ids, params); also .shutdown()
        from cluster.vllm_engine import build_vllm_decoder

        return build_vllm_decoder(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    path = models.resolve_model_path(config.target, config.cache_dir)
    tokenizer = models.load_tokenizer(path)
    target_model = models.load_causal_lm(path, config.dtype, config.device)
    proposer = make_proposer(config, target_model, tokenizer)
    log.info("engine: target=%s proposer=%s γ=%d dtype=%s", path, config.proposer,
             config.num_speculative_tokens, config.dtype)
    return SpeculativeDecoder(TorchModelRunner(target_model, name="target"), proposer, tokenizer,
                              config.num_speculative_tokens)


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer(prompt)["input_ids"])
