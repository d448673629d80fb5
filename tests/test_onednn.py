"""bf16 linear layers laid out once for oneDNN (cluster/model/onednn.py): the same bits as `nn.Linear`, the
runner's logits unchanged, and models it must not touch left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cluster.model import onednn

pytestmark = pytest.mark.skipif(onednn.can_pack(nn.Linear(2, 2).bfloat16()) is not None,
                                reason="this CPU's torch has no oneDNN bf16 (the packing then stays off, logged)")


def test_a_packed_linear_gives_the_same_bits_as_the_linear():
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        linear = nn.Linear(64, 96, bias=bias).bfloat16()
        packed = onednn.PackedLinear(linear)
        for shape in ((1, 64), (1, 5, 64), (3, 7, 64)):
            x = torch.randn(*shape, generator=g).bfloat16()
            assert torch.equal(packed(x), linear(x)), (bias, shape)
        assert packed.weight is linear.weight  # shared, not copied: tied weights stay tied


def test_pack_linears_keeps_the_models_logits_and_leaves_fp32_alone(target_fp32, tokenizer):
    import copy

    from cluster.model.runner import TorchModelRunner

    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt").input_ids[0].tolist()
    assert onednn.pack_linears(target_fp32) == 0  # fp32: nothing swapped
    assert not any(isinstance(m, onednn.PackedLinear) for m in target_fp32.modules())
    plain = copy.deepcopy(target_fp32).bfloat16().eval()
    model = copy.deepcopy(plain)
    swapped = onednn.pack_linears(model, "test")
    assert swapped == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    a, b = TorchModelRunner(plain), TorchModelRunner(model)
    for r in (a, b):
        r.add_session("s")
    assert torch.equal(a.extend("s", ids), b.extend("s", ids))  # prefill
    for token in (13, 220, 5):  # decode steps
        assert torch.equal(a.extend("s", [token]), b.extend("s", [token]))
