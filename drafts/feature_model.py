"""The feature-fed (EAGLE-style) draft model and its loader; training lives in `drafts.training.feature_draft`.

The draft reads the target's last hidden state f_t (post-norm: what the target's head reads) with the
next token's embedding: fc([f_t; emb(x_{t+1})]) -> one Llama decoder layer -> norm -> f̂_{t+1}, read by
the target's head restricted to a reduced vocabulary to predict x_{t+2}. Beyond the committed point
it drafts from its own f̂.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

CHECKPOINT, CURVE, WEIGHTS, META = "checkpoint.pt", "learning_curve.jsonl", "draft.safetensors", "tandem_draft.json"


class FeatureDraft(nn.Module):
    """fc([f_t; emb(x_{t+1})]) -> one decoder layer -> norm -> f̂_{t+1}; `logits` reads it with the
    target's head rows at `vocab`. The embedding and head are the target's, frozen and not saved."""

    feature_layers = None  # it reads the target's last hidden state (the torch runner's default features)

    def __init__(self, target, vocab: torch.Tensor):
        super().__init__()
        from transformers import LlamaModel

        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        self.body = LlamaModel(config)
        self.body.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        self.body.norm.load_state_dict(target.model.norm.state_dict())
        self.body.embed_tokens = None
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():  # start as "feature + embedding"
            self.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], 1))
            self.fc.bias.zero_()
        self.register_buffer("vocab", vocab.long())  # [K] target token id of each head row
        weight = target.model.embed_tokens.weight.detach().float()
        self.register_buffer("embed", weight.clone(), persistent=False)  # [V, H]
        self.register_buffer("head", target.lm_head.weight.detach().float()[vocab].clone(), persistent=False)  # [K, H]

    def forward(self, feats, next_ids, past=None, pos=None, mask=None):
        """feats [B, T, H] (f_t), next_ids [B, T] (x_{t+1}) -> (f̂ [B, T, H], KV cache). `mask`: a custom
        additive attention mask [B, 1, T, cached + T] (a token tree's), else causal."""
        x = self.fc(torch.cat([feats, F.embedding(next_ids, self.embed).to(feats.dtype)], -1))  # [B, T, H]
        out = self.body(inputs_embeds=x, past_key_values=past, use_cache=past is not None, position_ids=pos,
                        attention_mask=mask)
        return out.last_hidden_state, out.past_key_values

    def logits(self, feats):
        return feats @ self.head.T  # [..., K]

    @property
    def feature_width(self) -> int:
        """The width of the target's features it reads: its last hidden state."""
        return self.embed.shape[1]

    def fuse(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's features as the draft's input at a committed position: as they are."""
        return rows


def load_feature_draft(target, out_dir, dtype: torch.dtype = torch.bfloat16) -> FeatureDraft:
    """Rebuild an exported draft: trained weights from draft.safetensors, embedding and head from `target`."""
    out = Path(out_dir)
    meta = json.loads((out / META).read_text())
    if meta.get("kind") != "feature":
        raise ValueError(f"{out} holds a draft of kind {meta.get('kind')!r}, not 'feature'")
    weights = load_file(out / WEIGHTS)
    draft = FeatureDraft(target, weights["vocab"])
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    return draft.to(dtype).eval()
