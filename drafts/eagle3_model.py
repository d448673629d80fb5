"""An EAGLE-3 draft in the layout vLLM's `eagle3` method loads (`Eagle3LlamaForCausalLM`, SpecForge's
`LlamaForCausalLMEagle3`): three target layers fused, one decoder layer, a reduced-vocabulary head.

The draft reads, at position t, the target's hidden states entering three of its layers (low, mid,
high: ≈ 2, L/2, L − 3; `fusion_layers`, vLLM's `eagle_aux_hidden_state_layer_ids`), fused by one linear
map `fc` into u_t. Its one decoder layer (`midlayer`) attends from [norm(emb(x_{t+1})); norm(u_t)]
(q, k and v read both, 2H wide), adds the attention to u_t, then the MLP: g_{t+1}, whose normed head row
predicts x_{t+2}. Beyond the committed point the draft feeds its own g (before the final norm) in place
of u (EAGLE-3's "training-time test" trains it that way; there is no feature regression: g lives in the
draft's own space). The head covers a reduced vocabulary; `d2t` maps each of its rows to the target's
token id. The token embedding and the head rows are the target's, frozen and not saved, so the shipped
weights (fc, the layer, the norm, d2t) stay small; `export_vllm` writes the directory vLLM loads (with
the head rows, d2t as vLLM's offsets, and a config.json).

Training: `python -m tools.eagle3` (on `tools.draftdata`'s shards).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from cluster.core.tree import additive_mask

KIND = "eagle3"
WEIGHTS, META = "draft.safetensors", "tandem_draft.json"
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"


def fusion_layers(num_layers: int) -> tuple[int, int, int]:
    """Indices into transformers' `hidden_states` (entry i is the input of layer i; vLLM's aux layer ids
    count the same way): low, mid, high."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class Eagle3Layer(nn.Module):
    """vLLM's first EAGLE-3 decoder layer: attention over [input_layernorm(e); hidden_norm(u)] (2H wide),
    residual u, then the usual post-attention norm and MLP."""

    def __init__(self, config, like):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        hidden = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.mlp = LlamaMLP(config)
        self.self_attn.load_state_dict(like.self_attn.state_dict())
        self.mlp.load_state_dict(like.mlp.state_dict())
        for norm in (self.input_layernorm, self.hidden_norm):
            norm.load_state_dict(like.input_layernorm.state_dict())
        self.post_attention_layernorm.load_state_dict(like.post_attention_layernorm.state_dict())
        attn = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # widen to 2H: the embedding half starts at zero
            old = getattr(attn, name)
            new = nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None)
            with torch.no_grad():
                new.weight.zero_()
                new.weight[:, hidden:] = old.weight
                if old.bias is not None:
                    new.bias.copy_(old.bias)
            setattr(attn, name, new)

    def forward(self, u, e, rope, mask, past):
        x = torch.cat([self.input_layernorm(e), self.hidden_norm(u)], -1)
        a, _ = self.self_attn(x, rope, mask, past)
        h = u + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, target, d2t: torch.Tensor, layers: tuple[int, int, int] | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        config = copy.deepcopy(target.config)
        config._attn_implementation = "sdpa"
        self.config = config
        self.layers = tuple(layers or fusion_layers(config.num_hidden_layers))
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as "the high layer's state"
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * hidden:] = torch.eye(hidden)
        self.midlayer = Eagle3Layer(config, target.model.layers[-1])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm.load_state_dict(target.model.norm.state_dict())
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", d2t.long())  # [K]: the target id of each head row
        self.register_buffer("embed", target.model.embed_tokens.weight.detach().float().clone(), persistent=False)
        self.register_buffer("head", target.lm_head.weight.detach().float()[d2t].clone(), persistent=False)

    @property
    def vocab(self) -> torch.Tensor:
        """The target id of each head row (the feature-fed proposer's name for d2t)  # [K]"""
        return self.d2t

    @property
    def feature_layers(self) -> tuple[int, int, int]:
        """The target layers whose input states it reads (the torch runner's `feature_layers`)."""
        return self.layers

    @property
    def feature_width(self) -> int:
        """The width of the target's features it reads: the three layers side by side."""
        return self.fc.in_features

    def fuse(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's features [m, 3H] (the three layers side by side, as the torch runner captures them with
        `feature_layers=self.layers`) -> u  # [m, H]"""
        return self.fc(rows.to(self.fc.weight.dtype))

    def fused(self, hidden_states) -> torch.Tensor:
        """transformers' `hidden_states` tuple (each [B, T, H]) -> u  # [B, T, H]."""
        low, mid, high = (hidden_states[i] for i in self.layers)
        return self.fc(torch.cat([low, mid, high], -1).to(self.fc.weight.dtype))

    def forward(self, u, next_ids, past=None, pos=None, mask=None):
        """u [B, T, H] (fused states or the draft's own g), next_ids [B, T] (x_{t+1}) -> (g [B, T, H], cache).
        `pos` [1, T] (default: after the cached entries); `mask`: an additive attention mask
        [B, 1, T, cached + T] (default causal)."""
        T = u.shape[1]
        cached = past.get_seq_length() if past is not None else 0
        if pos is None:
            pos = torch.arange(cached, cached + T)[None]
        if mask is None:
            mask = additive_mask(torch.ones(T, cached + T, dtype=torch.bool).tril(cached), u.dtype)[None, None]
        e = F.embedding(next_ids, self.embed).to(u.dtype)
        g = self.midlayer(u, e, self.rotary(u, pos), mask.to(u.dtype), past)
        return g, past

    def logits(self, g):
        return self.norm(g) @ self.head.T.to(g.dtype)  # [..., K]


def export_vllm(draft: Eagle3Draft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The directory vLLM's `speculative_config={"method": "eagle3", "model": DIR}` loads: config.json
    (`LlamaForCausalLMEagle3`, one layer, `draft_vocab_size`, the aux layer ids) and model.safetensors
    (fc, midlayer.*, norm, lm_head = the target's rows at d2t, d2t as vLLM's offsets: target id = row + d2t)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(dtype).contiguous() for k, v in draft.state_dict().items()
               if k != "d2t" and not k.startswith("rotary.")}
    weights["lm_head.weight"] = draft.head.to(dtype).contiguous()
    weights["d2t"] = (draft.d2t - torch.arange(len(draft.d2t))).long()
    save_file(weights, out / "model.safetensors")
    config = draft.config.to_dict()
    for key in ("_attn_implementation", "_attn_implementation_autoset", "torch_dtype", "dtype", "_name_or_path",
                "transformers_version"):
        config.pop(key, None)
    config.update({"architectures": [VLLM_ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
                   "draft_vocab_size": len(draft.d2t), "vocab_size": draft.embed.shape[0],
                   "eagle_aux_hidden_state_layer_ids": list(draft.layers), "tie_word_embeddings": False,
                   "torch_dtype": str(dtype).removeprefix("torch.")})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def save_tandem(draft: Eagle3Draft, out_dir, meta: dict) -> dict:
    """tandem's own files for the draft, which `load_eagle3` reads (the torch runner's proposer 'eagle3'):
    draft.safetensors (bf16: fc, the layer, the norm, d2t; the embedding and head rows come from the target)
    and tandem_draft.json (`meta` with the kind and the fused layers). They can share a directory with
    `export_vllm`'s files, so one directory serves on either engine. Returns the tandem_draft.json written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.bfloat16().contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in draft.state_dict().items()}, out / WEIGHTS)
    meta = {**meta, "kind": KIND, "vocab_size": len(draft.d2t), "fusion_layers": list(draft.layers)}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def load_eagle3(target, out_dir, dtype: torch.dtype = torch.bfloat16) -> Eagle3Draft:
    out = Path(out_dir)
    meta = json.loads((out / META).read_text())
    if meta.get("kind") != KIND:
        raise ValueError(f"{out} holds a draft of kind {meta.get('kind')!r}, not {KIND!r}")
    weights = load_file(out / WEIGHTS)
    draft = Eagle3Draft(target, weights["d2t"], tuple(meta["fusion_layers"]))
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    return draft.to(dtype).eval()
