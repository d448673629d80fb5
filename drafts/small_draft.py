"""Small drafts made from the target: a few decoder layers and a reduced-vocabulary head.

A *tandem draft* directory holds `tandem_draft.json` (which target layers it was made from, the
vocabulary subset of its head, whether its layers are the target's own, provenance) and
`model.safetensors` with only the weights it owns. The embeddings always come from the target (the
tokenizer is the target's by construction):

- a **distilled** draft owns copies of its layers (initialised from the target's, then trained), the
  final norm and the head;
- a **self-speculative** draft (LayerSkip-style) runs the target's own first L layers and owns only
  an exit head (norm + head): nothing to keep in sync with the target but those few weights.

The head scores only the `vocab` subset (the 49,152 × 576 head dominates a small draft's cost) and
returns full-vocabulary logits with −inf elsewhere, so every loop and runner uses it unchanged; q is
then 0 outside the subset, which the rejection sampler handles (lossless either way).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from cluster.core.errors import ConfigError

DRAFT_FILE = "tandem_draft.json"
WEIGHTS_FILE = "model.safetensors"


def draft_path(name: str | Path) -> Path:
    return Path(name).expanduser()


@dataclass
class DraftSpec:
    layers: list[int]  # target layer indices the draft's layers come from
    vocab: list[int] | None = None  # token ids the head scores (None: all)
    self_speculative: bool = False  # layers are the target's own (must be 0..L-1)
    provenance: dict = field(default_factory=dict)

    def check(self, num_target_layers: int) -> None:
        if not self.layers:
            raise ConfigError("a draft needs at least one layer")
        if any(not 0 <= i < num_target_layers for i in self.layers):
            raise ConfigError(f"draft layers {self.layers} must lie in [0, {num_target_layers})")
        if self.self_speculative and self.layers != list(range(len(self.layers))):
            raise ConfigError("a self-speculative draft runs the target's first L layers: layers must be 0..L-1")


class SubsetHead(nn.Module):
    """Scores `vocab_ids` only; returns full-vocabulary logits (−inf outside the subset)."""

    def __init__(self, hidden_size: int, vocab_ids: torch.Tensor, full_vocab: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.full_vocab = full_vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., full_vocab]
        sub = self.proj(hidden)  # [..., len(vocab_ids)]
        out = sub.new_full((*sub.shape[:-1], self.full_vocab), float("-inf"))
        return out.index_copy_(out.dim() - 1, self.vocab_ids, sub)


def is_tandem_draft(path: str | Path) -> bool:
    return (draft_path(path) / DRAFT_FILE).is_file()


def build_draft(target: nn.Module, spec: DraftSpec) -> nn.Module:
    """A draft initialised from `target` (its layers copied, or shared when self-speculative)."""
    config = copy.deepcopy(target.config)
    spec.check(config.num_hidden_layers)
    config.num_hidden_layers = len(spec.layers)
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in spec.layers]
    draft = type(target)(config).to(dtype=target.dtype).eval()
    draft.model.embed_tokens = target.model.embed_tokens  # shared, never trained
    if spec.self_speculative:
        draft.model.layers = nn.ModuleList([target.model.layers[i] for i in spec.layers])
    else:
        for j, i in enumerate(spec.layers):
            draft.model.layers[j].load_state_dict(target.model.layers[i].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    full = config.vocab_size
    vocab = torch.tensor(spec.vocab if spec.vocab is not None else range(full))
    head = SubsetHead(config.hidden_size, vocab, full).to(dtype=target.dtype)
    with torch.no_grad():
        head.proj.weight.copy_(target.get_output_embeddings().weight[vocab])
    draft.lm_head = head
    draft.tandem_spec = spec
    return draft


def owned_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The weights a draft owns (what is saved): not the embeddings, not shared target layers."""
    spec: DraftSpec = draft.tandem_spec
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.startswith("model.embed_tokens."):
            continue
        if spec.self_speculative and name.startswith("model.layers."):
            continue
        state[name] = tensor
    return state


def trainable_parameters(draft: nn.Module) -> list[nn.Parameter]:
    owned = set(owned_state(draft))
    return [p for name, p in draft.named_parameters() if name in owned]


def save_draft(draft: nn.Module, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in owned_state(draft).items()}
    save_file(state, str(path / WEIGHTS_FILE))
    (path / DRAFT_FILE).write_text(json.dumps(asdict(draft.tandem_spec), indent=1) + "\n")
    return path


def load_spec(path: str | Path) -> DraftSpec:
    path = draft_path(path)
    try:
        return DraftSpec(**json.loads((Path(path) / DRAFT_FILE).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a tandem draft ({DRAFT_FILE}): {e}") from None


def load_draft(path: str | Path, target: nn.Module) -> nn.Module:
    """Rebuild a saved draft on top of `target` (which lends its embeddings and, if self-speculative, layers)."""
    from safetensors.torch import load_file

    path = draft_path(path)
    spec = load_spec(path)
    draft = build_draft(target, spec)
    state = load_file(str(Path(path) / WEIGHTS_FILE))
    missing = set(owned_state(draft)) - set(state)
    if missing:
        raise ConfigError(f"{path}: weights missing for {sorted(missing)[:3]}...")
    draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    return draft.eval()  # in the target's dtype (it shares the target's embeddings)
