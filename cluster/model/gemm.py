"""fp32 linear layers on CPU for a few rows, as a GEMM with the weight as its left operand.

`F.linear(x, W)` computes x·Wᵀ: with a few rows (a decode step's one, a verification's γ + 1) MKL's kernel for
that shape streams the weights slowly on some CPUs (this machine's AMD EPYC: SmolLM2-135M's linear layers
take 45 ms at one row, 77 ms at two, 1 thread or 2). `torch.mm(W, xᵀ)` multiplies the same numbers with W as the
GEMM's left operand, which MKL streams 1.5-4x as fast at 2-8 rows; one row is sent as two (the row twice: a
one-column product is a GEMV again, the slow kind). The result is transposed back, a copy of rows x outputs.

The output is not bit for bit `F.linear`'s (another summation order, ~1e-6 relative in fp32), as a verification's
several rows are not bit for bit one row's either: what a speculative decode must equal is the target's greedy
tokens, which the lossless tests check on this path against transformers' own `generate` (tests/test_gemm.py,
tests/test_greedy_equality.py). `gemm_linears(model)` swaps a fp32 CPU model's `nn.Linear`s for `GemmLinear`s;
anything else (bf16: `onednn.pack_linears`; CUDA) is left as it is, the reason logged.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from cluster.model.onednn import not_on_cpu_in, pack_linears, plain_linears

log = logging.getLogger(__name__)

GEMM_ROWS = 8  # up to this many rows as W·xᵀ, more through F.linear (8 rows: 1.2x at 2 threads, none at 1)


class GemmLinear(nn.Module):
    """An fp32 `nn.Linear` whose products of up to `GEMM_ROWS` rows are W·xᵀ. `weight` and `bias` are the
    original tensors (shared: tied embeddings stay tied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if n > GEMM_ROWS or n == 0:
            return nn.functional.linear(x, self.weight, self.bias)
        wide = torch.cat((rows, rows)) if n == 1 else rows  # one column would be a GEMV
        out = torch.mm(self.weight, wide.t())[:, :n].t().contiguous()  # [out_features, n] -> [n, out_features]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def can_gemm(model: nn.Module) -> str | None:
    """None when `gemm_linears` applies to this model, else why not."""
    return not_on_cpu_in(model, torch.float32)


def gemm_linears(model: nn.Module, name: str = "model") -> int:
    """Swap the fp32 CPU model's `nn.Linear`s for `GemmLinear`s (in place); the number swapped."""
    why = can_gemm(model)
    if why is not None:
        log.info("%s: linear layers left as they are for a few rows (%s)", name, why)
        return 0
    linears = plain_linears(model)
    for parent, child_name, child in linears:
        setattr(parent, child_name, GemmLinear(child))
    log.info("%s: %d fp32 linear layers compute up to %d rows as W·xᵀ", name, len(linears), GEMM_ROWS)
    return len(linears)


def gemm_copy(model: nn.Module, name: str = "model") -> nn.Module:
    """A copy of `model` whose modules are new and whose parameters and buffers are the model's own (no memory
    copied), with `gemm_linears` applied: the model as the torch engine runs it, beside the one as loaded."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    gemm_linears(twin, name)
    return twin


def fast_linears(model: nn.Module, name: str, onednn: bool = True, gemm: bool = True) -> int:
    """The torch engine's linear layers for its dtype (`engine.onednn`, `engine.fp32_gemm`), in place: bf16
    laid out for oneDNN, fp32 as W·xᵀ for a few rows; the number swapped. Apply after a proposer that copies
    the target (an int8 draft quantizes plain `nn.Linear`s)."""
    swapped = pack_linears(model, name) if onednn else 0
    return swapped + (gemm_linears(model, name) if gemm else 0)
