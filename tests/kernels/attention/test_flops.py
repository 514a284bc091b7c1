"""The FLOP count (`kernels/attention/flops.py`): the formula per mode, the causal pairs, and the count of the
reference's matmuls by torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels.attention import flash_attention_flops, flash_attention_reference


def test_flops_formula_and_modes():
    assert flash_attention_flops(2, 3, 100, 70, 32, False) == 4 * 2 * 3 * 100 * 70 * 32
    assert flash_attention_flops(1, 1, 8, 8, 16, True) == 4 * (8 * 9 // 2) * 16
    fwd = flash_attention_flops(1, 2, 64, 64, 16, True)
    assert flash_attention_flops(1, 2, 64, 64, 16, True, "bwd") == 2.5 * fwd
    assert flash_attention_flops(1, 2, 64, 64, 16, True, "fwd_bwd") == 3.5 * fwd
    with pytest.raises(ValueError, match="mode"):
        flash_attention_flops(1, 1, 8, 8, 16, True, "backward")


def test_flops_match_counted_reference_matmuls():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 30, 16, generator=gen)
    k, v = (torch.randn(2, 20, 16, generator=gen) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        flash_attention_reference(q, k, v, False)
    assert counter.get_total_flops() == flash_attention_flops(2, 1, 30, 20, 16, False)
