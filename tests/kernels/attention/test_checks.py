"""What the kernels accept (`checks`): the tma path's layout rule, and the Gluon kernels' support rules, each refusal
naming the rule (tensors pretend to sit on an sm_90 GPU to reach the rules past the device)."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.gluon.forward as fg
from kernels.attention import checks, dispatch
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from tests.kernels.attention.gluon.support import cpu


def test_tma_layout_rule():
    x = torch.zeros(2, 3, 40, 24)
    assert checks.tma_layout_ok(x, x.transpose(1, 2).contiguous().transpose(1, 2))  # the model's (B, S, H, D) view
    assert checks.tma_layout_ok(x[..., :20])  # 96-byte rows, 80 bytes used
    assert not checks.tma_layout_ok(torch.zeros(2, 3, 40, 20, dtype=torch.float16))  # 40-byte rows
    assert not checks.tma_layout_ok(x.transpose(-1, -2))  # d not contiguous
    assert not checks.tma_layout_ok(x.half()[..., 1:21])  # start 2 bytes off
    assert not checks.tma_layout_ok(torch.zeros(1, 16, 1).expand(3, 16, 16))  # stride 0 along d
    assert checks.tma_layout_ok(torch.zeros(1, 1, 16).expand(3, 16, 16).contiguous())
    assert checks.tma_layout_ok(torch.zeros(8, 16)[None].expand(4, 8, 16))  # stride 0 on the batch: one matrix


@pytest.mark.parametrize("q, reason", [
    (cpu((1, 2, 64, 128)), "not a CUDA device"),
])
def test_supported_refuses_cpu(q, reason):
    assert checks.unsupported_reason(q, q, q)
    if HAS_GLUON_HOPPER:
        assert reason in checks.unsupported_reason(q, q, q)
    with pytest.raises(ValueError, match="gluon_attention_fwd"):
        fg.gluon_attention_fwd(q, q, q, True, dispatch.gluon_fwd_config(q, q))


@pytest.mark.skipif(not HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API")
def test_unsupported_reasons_name_the_rule(monkeypatch):
    # Pretend tensors live on a GPU so that the dtype / shape / stride rules are reached on a CPU host.
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(checks, "capability", lambda device: (9, 0))
    good = cpu((1, 2, 64, 128))
    assert checks.unsupported_reason(good, good, good) == ""
    assert "float32" in checks.unsupported_reason(*[cpu((1, 2, 64, 128), torch.float32)] * 3)
    assert "head dim 80" in checks.unsupported_reason(*[cpu((1, 2, 64, 80))] * 3)
    assert "4-D" in checks.unsupported_reason(*[cpu((2, 64, 128))] * 3)
    strided = cpu((1, 2, 64, 256))[..., ::2]
    assert "strides" in checks.unsupported_reason(strided, strided, strided)
    odd = cpu((1, 2, 64, 130))[..., :128]  # row stride 130 elements: 260 bytes, not 16-byte aligned
    assert "strides" in checks.unsupported_reason(odd, odd, odd)
    empty = cpu((1, 2, 0, 128))
    assert "(1, 2, 0, 128); needs at least one row" in checks.unsupported_reason(empty, good, good)
    assert "k has shape (0, 2, 64, 128)" in checks.unsupported_reason(good, *[cpu((0, 2, 64, 128))] * 2)
    monkeypatch.setattr(checks, "capability", lambda device: (8, 0))
    assert "sm_90" in checks.unsupported_reason(good, good, good)
