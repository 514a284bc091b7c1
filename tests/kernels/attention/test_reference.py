"""CPU tests of the tiled PyTorch FlashAttention-2 and the plain-torch reference (`kernels/attention/reference.py`).

The oracle is `flash_attention_reference` in fp64 (eqs. 4-6 and 12); the PyTorch implementation runs in fp32
(or fp64 for gradcheck) and must match it to fp32 round-off, forward (O and L) and backward (dQ, dK, dV
with a random upstream gradient), causal or not, at lengths that are not multiples of the tile.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kernels.attention.reference as fp
from kernels.attention import flash_attention_flops
from kernels.attention.checks import check_attention_inputs
from kernels.attention.dispatch import reference_compiles
from kernels.attention.reference import (
    FlashAttentionPytorch,
    flash_attention_pytorch,
    flash_attention_reference,
)

# (q shape, k shape, causal): odd lengths, partial tiles, n_q != n_k, heads, the course's shape.
CASES = [
    ((2, 37, 16), (2, 37, 16), True),
    ((2, 37, 16), (2, 37, 16), False),
    ((3, 100, 32), (3, 100, 32), True),
    ((1, 2, 45, 24), (1, 2, 70, 24), False),
    ((1, 3, 70, 40), (1, 3, 45, 40), False),
    ((4, 128, 64), (4, 128, 64), True),
]


def _inputs(q_shape, k_shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=gen, dtype=dtype)
    k = torch.randn(k_shape, generator=gen, dtype=dtype)
    v = torch.randn(k_shape, generator=gen, dtype=dtype)
    do = torch.randn(q_shape, generator=gen, dtype=dtype)
    return q, k, v, do


def _reference(q, k, v, do, causal):
    """fp64 output, L and gradients of the reference for inputs of any dtype."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_reference(q64, k64, v64, causal, return_lse=True)
    out.backward(do.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def _saved_lse(out, q):
    lead = tuple(q.shape[:-1])
    found = [t for t in out.grad_fn.saved_tensors if tuple(t.shape) == lead]
    assert len(found) == 1, f"expected exactly one saved tensor of shape {lead}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("q_shape,k_shape,causal", CASES)
def test_forward_output_and_lse_match_fp64_reference(q_shape, k_shape, causal):
    q, k, v, _ = _inputs(q_shape, k_shape)
    q.requires_grad_()
    out = FlashAttentionPytorch.apply(q, k, v, causal)
    ref_out, ref_lse, *_ = _reference(q, k, v, torch.zeros_like(q), causal)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(_saved_lse(out, q).double(), ref_lse, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("q_shape,k_shape,causal", CASES)
def test_gradients_match_fp64_reference(q_shape, k_shape, causal):
    q, k, v, do = _inputs(q_shape, k_shape, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    flash_attention_pytorch(q, k, v, causal).backward(do)
    _, _, dq, dk, dv = _reference(q, k, v, do, causal)
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_gradcheck_in_fp64_with_partial_tiles():
    q, k, v, _ = _inputs((1, 2, 21, 16), (1, 2, 21, 16), dtype=torch.float64, seed=2)
    args = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: FlashAttentionPytorch.apply(a, b, c, True, 16, 16), args,
                                    fast_mode=True)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_forward_close_to_reference(dtype, tol):
    q, k, v, _ = _inputs((2, 50, 32), (2, 50, 32), dtype=dtype, seed=3)
    out = flash_attention_pytorch(q, k, v, True)
    assert out.dtype == dtype
    ref = flash_attention_reference(q.double(), k.double(), v.double(), True)
    assert (out.double() - ref).abs().max() < tol


def test_causal_forward_skips_key_tiles_above_the_diagonal():
    """With 16x16 tiles over 64 positions, causal visits 10 of 16 tile pairs: 10/16 of the matmul FLOPs."""
    q, k, v, _ = _inputs((1, 64, 16), (1, 64, 16))
    counts = {}
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            fp.flash_forward_pytorch(q, k, v, causal, q_tile=16, k_tile=16)
        counts[causal] = counter.get_total_flops()
    assert counts[False] == flash_attention_flops(1, 1, 64, 64, 16, False)
    assert counts[True] * 16 == counts[False] * 10


def test_four_d_input_saves_lse_per_head_and_matches_model_backend():
    q, k, v, _ = _inputs((2, 3, 33, 16), (2, 3, 33, 16))
    q.requires_grad_()
    out = fp.attention_backend(q, k, v, True)
    assert _saved_lse(out, q).shape == (2, 3, 33)
    torch.testing.assert_close(out.double(), flash_attention_reference(q.double(), k.double(), v.double(), True),
                               atol=2e-6, rtol=2e-6)


def test_model_backend_follows_autocast_like_sdpa():
    q, k, v, _ = _inputs((1, 2, 20, 16), (1, 2, 20, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp.attention_backend(q, k, v.bfloat16(), True)
    assert out.dtype == torch.bfloat16
    ref = flash_attention_reference(q.double(), k.double(), v.bfloat16().double(), True)
    assert (out.double() - ref).abs().max() < 2e-2


def test_compile_policy_env(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("RAYSYS_FLASH_COMPILE", raising=False)
    assert not reference_compiles(cpu) and reference_compiles(cuda)
    monkeypatch.setenv("RAYSYS_FLASH_COMPILE", "1")
    assert reference_compiles(cpu)
    monkeypatch.setenv("RAYSYS_FLASH_COMPILE", "maybe")
    with pytest.raises(ValueError, match="RAYSYS_FLASH_COMPILE"):
        reference_compiles(cpu)


def test_failed_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setenv("RAYSYS_FLASH_COMPILE", "1")
    monkeypatch.setattr(fp, "_compiled_backward", None)
    monkeypatch.setattr(fp, "_compile_disabled_reason", None)
    monkeypatch.setattr(fp.torch, "compile", broken_compile)
    q, k, v, do = _inputs((1, 24, 16), (1, 24, 16))
    q.requires_grad_()
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        flash_attention_pytorch(q, k, v, True).backward(do)
    assert "RuntimeError" in fp._compile_disabled_reason
    torch.testing.assert_close(q.grad.double(), _reference(q, k, v, do, True)[2], atol=2e-5, rtol=1e-5)
    q.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second warning: eager from now on
        flash_attention_pytorch(q, k, v, True).backward(do)


@pytest.mark.slow
def test_compiled_backward_matches_eager_on_cpu(monkeypatch):
    """The torch.compile path itself (Inductor C++ codegen on CPU, ~10-40 s cold)."""
    monkeypatch.setenv("RAYSYS_FLASH_COMPILE", "1")
    monkeypatch.setattr(fp, "_compiled_backward", None)
    monkeypatch.setattr(fp, "_compile_disabled_reason", None)
    q, k, v, do = _inputs((2, 37, 16), (2, 37, 16), seed=4)
    out, lse = fp.flash_forward_pytorch(q, k, v, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn: compilation must succeed
        compiled = fp.flash_backward_pytorch(q, k, v, out, do, lse, True)
    assert fp._compile_disabled_reason is None
    eager = fp.flash_backward_reference(q, k, v, out, do, lse, True)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("args,match", [
    ((_t(2, 8, 16, 4, 1), _t(2, 8, 16, 4, 1), _t(2, 8, 16, 4, 1), False), "3-D .* or 4-D"),
    ((_t(2, 8, 16), _t(2, 1, 8, 16), _t(2, 8, 16), False), "same rank"),
    ((_t(2, 8, 16), _t(2, 9, 16), _t(2, 8, 16), False), "k and v must have the same shape"),
    ((_t(2, 8, 16), _t(3, 8, 16), _t(3, 8, 16), False), "leading"),
    ((_t(2, 8, 16), _t(2, 8, 32), _t(2, 8, 32), False), "same head dim"),
    ((_t(2, 8, 8), _t(2, 8, 8), _t(2, 8, 8), False), "head dim 8 must lie in \\[16, 128\\]"),
    ((_t(1, 4, 160), _t(1, 4, 160), _t(1, 4, 160), False), "head dim 160"),
    ((_t(2, 8, 16), _t(2, 9, 16), _t(2, 9, 16), True), "causal attention needs n_queries == n_keys"),
    ((_t(2, 8, 16), _t(2, 8, 16, dtype=torch.float16), _t(2, 8, 16), False), "share one dtype"),
    ((_t(2, 8, 16, dtype=torch.int32),) * 3 + (False,), "dtype torch.int32 is not supported"),
    ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 16), 1), "is_causal must be a bool"),
    ((_t(2, 0, 16), _t(2, 8, 16), _t(2, 8, 16), False), "at least one row"),
])
def test_invalid_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        check_attention_inputs(*args)
    with pytest.raises(ValueError, match=match):
        flash_attention_pytorch(*args)


@pytest.mark.parametrize("tile", [8, 24.0])
def test_tiles_below_16_rejected(tile):
    q = _t(1, 20, 16)
    with pytest.raises(ValueError, match="q_tile"):
        flash_attention_pytorch(q, q, q, False, tile, 16)


def test_reference_masks_with_minus_1e6_like_the_course():
    q, k, v, _ = _inputs((1, 5, 16), (1, 5, 16))
    _, lse = flash_attention_reference(q, k, v, True, return_lse=True)
    scores = q @ k.transpose(-2, -1) / math.sqrt(16)
    assert torch.allclose(lse[0, 0], scores[0, 0, 0])  # first query sees only the first key
