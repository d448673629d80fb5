"""An EAGLE-3-style draft: three target layers fused, one decoder layer, a reduced-vocabulary head.

The draft reads, at position t, the target's hidden states entering three of its layers (low, mid,
high: ≈ 2, L/2, L − 3; `fusion_layers`), fused by one linear map into u_t; with the next token's
embedding it computes fc([u_t; emb(x_{t+1})]) -> one Llama decoder layer (initialised from the target's
last) -> norm -> g_{t+1}, whose head row predicts x_{t+2}. Beyond the committed point the draft feeds
its own output g in place of u (EAGLE-3's "training-time test" trains it that way; there is no feature
regression: g lives in the draft's own space). The head covers a reduced vocabulary; `d2t` maps each of
its rows to the target's token id. The token embedding and the head rows are the target's, frozen and
not saved, so the exported weights (fuse, fc, the layer, the norm, d2t) stay small.

Training: `python -m tools.eagle3` (on `tools.draftdata`'s shards). Serving it needs the verifier to send the three layers' states
(three times the width the EAGLE-1 draft reads); until then it is trained and measured offline.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

KIND = "eagle3"
WEIGHTS, META = "draft.safetensors", "tandem_draft.json"


def fusion_layers(num_layers: int) -> tuple[int, int, int]:
    """Indices into transformers' `hidden_states` (entry i is the input of layer i): low, mid, high."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class Eagle3Draft(nn.Module):
    def __init__(self, target, d2t: torch.Tensor, layers: tuple[int, int, int] | None = None):
        super().__init__()
        from transformers import LlamaModel

        config = copy.deepcopy(target.config)
        self.layers = tuple(layers or fusion_layers(config.num_hidden_layers))
        config.num_hidden_layers = 1
        self.body = LlamaModel(config)
        self.body.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        self.body.norm.load_state_dict(target.model.norm.state_dict())
        self.body.embed_tokens = None
        hidden = config.hidden_size
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        self.fc = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():  # start as "the high layer's state + the embedding"
            self.fuse.weight.zero_()
            self.fuse.weight[:, 2 * hidden:] = torch.eye(hidden)
            self.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], 1))
            self.fc.bias.zero_()
        self.register_buffer("d2t", d2t.long())  # [K]: the target id of each head row
        self.register_buffer("embed", target.model.embed_tokens.weight.detach().float().clone(), persistent=False)
        self.register_buffer("head", target.lm_head.weight.detach().float()[d2t].clone(), persistent=False)

    def fused(self, hidden_states) -> torch.Tensor:
        """transformers' `hidden_states` tuple (each [B, T, H]) -> u  # [B, T, H]."""
        low, mid, high = (hidden_states[i] for i in self.layers)
        return self.fuse(torch.cat([low, mid, high], -1).to(self.fuse.weight.dtype))

    def forward(self, u, next_ids, past=None, pos=None, mask=None):
        """u [B, T, H] (fused states or the draft's own g), next_ids [B, T] (x_{t+1}) -> (g [B, T, H], cache).
        `mask`: a custom additive attention mask [B, 1, T, cached + T], else causal."""
        x = self.fc(torch.cat([u, F.embedding(next_ids, self.embed).to(u.dtype)], -1))
        out = self.body(inputs_embeds=x, past_key_values=past, use_cache=past is not None, position_ids=pos,
                        attention_mask=mask)
        return out.last_hidden_state, out.past_key_values

    def logits(self, g):
        return g @ self.head.T.to(g.dtype)  # [..., K]


def load_eagle3(target, out_dir, dtype: torch.dtype = torch.bfloat16) -> Eagle3Draft:
    out = Path(out_dir)
    meta = json.loads((out / META).read_text())
    if meta.get("kind") != KIND:
        raise ValueError(f"{out} holds a draft of kind {meta.get('kind')!r}, not {KIND!r}")
    weights = load_file(out / WEIGHTS)
    draft = Eagle3Draft(target, weights["d2t"], tuple(meta["fusion_layers"]))
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    return draft.to(dtype).eval()
