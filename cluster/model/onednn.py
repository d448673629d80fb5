"""bf16 linear layers on CPU with their weights laid out once for oneDNN (issue 23: "weights laid out for the
fastest kernels").

`F.linear` in bf16 on CPU calls oneDNN with the weight in PyTorch's row-major layout, and oneDNN reorders
it on every call; a decode step is a GEMV per layer, bound by how fast the weights stream, so the reorder
is paid on all of them. `torch.ops.mkldnn._reorder_linear_weight` lays a weight out in oneDNN's blocked
format once (what torch's inductor does when it freezes a CPU graph) and `_linear_pointwise` then
multiplies with it. Measured here: 1.9x at one row, 1.5x at 6, the same bits as `F.linear`
(BENCHMARKS.md). `pack_linears(model)` swaps a bf16 CPU model's `nn.Linear` modules for `PackedLinear`s;
anything else (fp32, CUDA, a torch without oneDNN bf16) is left as it is, and the reason logged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight oneDNN laid out once; the same output bits as the linear it replaces.
    `weight` is kept (the original tensor, shared: tied embeddings stay tied) for code that reads it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def not_on_cpu_in(model: nn.Module, dtype: torch.dtype) -> str | None:
    """None when the model's weights are on the CPU in `dtype`, else where they are."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        return f"on {p.device.type}"
    return f"in {p.dtype}" if p.dtype != dtype else None


def can_pack(model: nn.Module) -> str | None:
    """None when `pack_linears` applies to this model, else why not."""
    if (where := not_on_cpu_in(model, torch.bfloat16)) is not None:
        return where
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "no oneDNN bf16 on this CPU"
    return None


def plain_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of each plain `nn.Linear` in the model (not a subclass, not a swapped one)."""
    return [(parent, child_name, child) for parent in model.modules()
            for child_name, child in parent.named_children() if type(child) is nn.Linear]


def pack_linears(model: nn.Module, name: str = "model") -> int:
    """Swap the bf16 CPU model's linear layers for `PackedLinear`s (in place); the number swapped.
    A layer oneDNN refuses stays as it was (logged); a model `can_pack` rejects is left whole."""
    why = can_pack(model)
    if why is not None:
        log.info("%s: linear layers not laid out for oneDNN (%s)", name, why)
        return 0
    swapped, refused = 0, 0
    for parent, child_name, child in plain_linears(model):
        try:
            setattr(parent, child_name, PackedLinear(child))
            swapped += 1
        except RuntimeError:
            refused += 1
            log.warning("%s: oneDNN refused to lay out %s; it stays a plain linear", name, child_name, exc_info=True)
    log.info("%s: %d linear layers laid out for oneDNN bf16 (%d refused)", name, swapped, refused)
    return swapped
