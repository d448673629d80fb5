"""fp32 linear layers of a few rows as W·xᵀ (cluster/model/gemm.py): the linear's numbers to fp32 rounding, its
own bits past GEMM_ROWS, the weights shared, what the engine builds and what it leaves alone. That the engine's
greedy tokens on this path are transformers' own is what tests/test_greedy_equality.py and the other lossless
tests check: their runners decode on `engine_fp32`, their references come from the model as loaded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cluster.core.config import EngineConfig
from cluster.model import gemm
from cluster.model.runner import TorchModelRunner
from cluster.session.engine import build_decoder
from tests.helpers import tiny_llama


@pytest.mark.parametrize("bias", [False, True])
def test_a_gemm_linear_computes_the_linear(bias):
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    layer = gemm.GemmLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias  # shared, not copied
    for shape in ((1, 64), (1, 1, 64), (1, 5, 64), (2, 4, 64), (64,)):
        x = torch.randn(*shape, generator=g)
        out = layer(x)
        assert out.shape == linear(x).shape and out.is_contiguous(), shape
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
    many = torch.randn(3, gemm.GEMM_ROWS, 64, generator=g)  # past GEMM_ROWS rows: nn.Linear's own kernel
    assert torch.equal(layer(many), linear(many))
    assert layer(torch.randn(0, 64)).shape == (0, 96)


def test_gemm_linears_swaps_fp32_cpu_linears_and_leaves_bf16_alone():
    model = tiny_llama(1)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    twin = gemm.gemm_copy(model, "twin")
    assert sum(isinstance(m, gemm.GemmLinear) for m in twin.modules()) == linears > 0
    assert not any(type(m) is nn.Linear for m in twin.modules())
    assert sum(type(m) is nn.Linear for m in model.modules()) == linears  # the model as loaded is untouched
    assert all(a is b for a, b in zip(model.parameters(), twin.parameters()))  # no weight copied
    ids = [1, 4, 2, 7, 3]
    plain, fast = TorchModelRunner(model), TorchModelRunner(twin)
    a, b = plain.add_session(), fast.add_session()
    torch.testing.assert_close(fast.extend(b, ids), plain.extend(a, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.extend(b, [5]), plain.extend(a, [5]), atol=1e-5, rtol=1e-5)  # one row
    bf16 = tiny_llama(1).bfloat16()
    assert gemm.can_gemm(bf16) == "in torch.bfloat16" and gemm.gemm_linears(bf16) == 0
    assert not any(isinstance(m, gemm.GemmLinear) for m in bf16.modules())


@pytest.mark.parametrize("on", [True, False])
def test_the_torch_engine_runs_its_fp32_target_as_configured(on):
    decoder = build_decoder(EngineConfig.build(backend="torch", proposer="none", dtype="float32", fp32_gemm=on))
    swapped = [m for m in decoder.target.model.modules() if isinstance(m, gemm.GemmLinear)]
    plain = [m for m in decoder.target.model.modules() if type(m) is nn.Linear]
    assert (len(swapped) > 0, len(plain) == 0) == (on, on)
