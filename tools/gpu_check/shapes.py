"""Model shapes of real checkpoints, hard-coded (the device machine reads no files), and their builders.

Targets: SmolLM2-135M (its config.json), Llama-3.2-1B and Llama-3.1-8B, as Llama configurations with
random weights: exactness and timings do not depend on the weights. Drafts: a SmolLM2-135M-shaped
Llama (with the target's vocabulary, so it could share its tokenizer) and the feature-fed draft
(`drafts.feature_model.FeatureDraft`: one decoder layer of the target's width reading its features).
`--tiny` swaps every shape for a small one of the same kind, so CI runs the same code in seconds.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafts.feature_model import FeatureDraft


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ~/.cache/tandem/models/SmolLM2-135M-Instruct/config.json
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
# meta-llama/Llama-3.2-1B
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, max_position_embeddings=131072, rope_parameters=_llama3_rope(32.0))
# meta-llama/Llama-3.1-8B
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, max_position_embeddings=131072, rope_parameters=_llama3_rope(8.0))

TINY_VOCAB = 384
_TINY_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
TINY = {
    "smollm2-135m": dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_parameters=_TINY_ROPE),
    "llama-3.2-1b": dict(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_parameters=_TINY_ROPE),
    "llama-3.1-8b": dict(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                         max_position_embeddings=4096, rope_parameters=_TINY_ROPE),
}
REAL = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_32_1B, "llama-3.1-8b": LLAMA_31_8B}

# (target shape, dtypes): the 8B in bf16 only (~16 GB; fp32 would be 32 GB and adds nothing)
TARGETS = [("smollm2-135m", ("float32", "bfloat16")), ("llama-3.2-1b", ("float32", "bfloat16")),
           ("llama-3.1-8b", ("bfloat16",))]
EQUALITY_TARGETS = ["smollm2-135m", "llama-3.2-1b"]  # fp32 greedy equality
DRAFTS = ["smollm2-135m", "feature"]  # draft shapes: a small Llama and the feature-fed draft
# the draft each target is served with: SmolLM2's shipped draft is the feature-fed one
PAIRS = {"smollm2-135m": "feature", "llama-3.2-1b": "smollm2-135m", "llama-3.1-8b": "smollm2-135m"}
FEATURE_VOCAB = 8192  # the shipped feature draft's reduced head (drafts/trained/*/tandem_draft.json)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shape(name: str, tiny: bool, vocab_size: int | None = None) -> dict:
    """The configuration fields of shape `name` (with another vocabulary when given: a draft shares its
    target's tokenizer)."""
    fields = dict((TINY if tiny else REAL)[name])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    return fields


def num_parameters(fields: dict) -> int:
    """Parameter count of a Llama of these fields (no model built)."""
    h, i, v, d = fields["hidden_size"], fields["intermediate_size"], fields["vocab_size"], fields["head_dim"]
    q, kv = fields["num_attention_heads"] * d, fields["num_key_value_heads"] * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return fields["num_hidden_layers"] * layer + v * h * (1 if fields["tie_word_embeddings"] else 2) + h


@contextlib.contextmanager
def _default(dtype: torch.dtype, device: torch.device):
    """Build parameters directly in `dtype` on `device` (an 8B never passes through fp32 on the CPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_llama(fields: dict, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaForCausalLM:
    """A random-weight Llama of `fields`, in eval mode, with no EOS (generation always runs to max_tokens)."""
    config = LlamaConfig(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with _default(dtype, device):
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.eval()


def build_feature_draft(target: LlamaForCausalLM, tiny: bool, device: torch.device) -> FeatureDraft:
    """The feature-fed draft of `target`: fc([f; emb]) -> the target's last layer's shape -> its head
    restricted to a reduced vocabulary (the first FEATURE_VOCAB ids), in the target's dtype."""
    vocab_size = target.config.vocab_size
    k = min(FEATURE_VOCAB, vocab_size // 2 if tiny else vocab_size)
    dtype = next(target.parameters()).dtype
    with _default(torch.float32, device):
        draft = FeatureDraft(target, torch.arange(k, device=device))  # vocab: [K]
    return draft.to(device=device, dtype=dtype).eval()


class Models:
    """Random-weight models built once and kept: targets by (shape, dtype), drafts by (shape, target, dtype)."""

    def __init__(self, device: torch.device, tiny: bool):
        self.device, self.tiny = device, tiny
        self._cache: dict = {}

    def target(self, name: str, dtype: str) -> LlamaForCausalLM:
        key = ("target", name, dtype)
        if key not in self._cache:
            self._cache[key] = build_llama(shape(name, self.tiny), DTYPES[dtype], self.device, seed=1)
        return self._cache[key]

    def draft(self, name: str, target_name: str, dtype: str):
        """Draft shape `name` for target `target_name`: a Llama (with the target's vocabulary) or the
        feature-fed draft (FeatureDraft)."""
        key = ("draft", name, target_name, dtype)
        if key not in self._cache:
            target = self.target(target_name, dtype)
            if name == "feature":
                self._cache[key] = build_feature_draft(target, self.tiny, self.device)
            else:
                fields = shape(name, self.tiny, vocab_size=target.config.vocab_size)
                self._cache[key] = build_llama(fields, DTYPES[dtype], self.device, seed=2)
        return self._cache[key]

    def drop(self, dtype: str) -> None:
        """Free every model of `dtype` (the fp32 targets once their sections are done)."""
        for key in [k for k in self._cache if k[-1] == dtype]:
            del self._cache[key]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def describe(self) -> dict:
        """The shapes, for the report: configuration fields and parameter counts."""
        out = {}
        for name in REAL:
            fields = shape(name, self.tiny)
            out[name] = {**{k: v for k, v in fields.items() if k != "rope_parameters"},
                         "parameters": num_parameters(fields)}
        return out
