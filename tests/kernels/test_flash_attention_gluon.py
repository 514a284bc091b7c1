"""Tests of the Gluon Hopper FlashAttention forward and backward (`kernels/flash_attention_gluon.py`).

CPU: the config rules, `supported` refusing what the kernel cannot run, and (under the Triton 3.6 whose Gluon API
the kernel is written against) a compile for sm_90 with Triton's bundled ptxas, no GPU needed. GPU (sm_90):
O and the natural-log L against fp32 attention on odd shapes, causal and not, n_q != n_k, bf16 and fp16; dQ, dK, dV
against fp32 autograd on the same shapes with a random upstream gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

import kernels.flash_attention_gluon as fg
import kernels.flash_attention_gluon_bwd as fgb

GLUON_API = "3.6."
"""The Triton release whose Gluon API the kernel uses (the GPU host's); others skip the compile test."""
needs_gluon_api = pytest.mark.skipif(
    not triton.__version__.startswith(GLUON_API),
    reason=f"the kernels are written against Triton {GLUON_API}x's Gluon API, this is {triton.__version__}")


def _cpu(shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def test_config_rules():
    with pytest.raises(ValueError, match="block_n"):
        fg.GluonConfig(block_n=96)
    with pytest.raises(ValueError, match="num_consumers"):
        fg.GluonConfig(num_consumers=4)
    for n in (1, 2, 3):
        maxnreg, consumer = fg.GluonConfig(num_consumers=n).registers()
        # One SM's 64 K registers cover every warp group (the loader's rounded up to one) at maxnreg ...
        assert maxnreg * 128 * (n + 1) <= 65536
        # ... and what the consumers and the loader ask for fits in that budget.
        assert consumer * n + fg.LOADER_REGS <= maxnreg * (n + 1)
    assert fg.GluonConfig(num_consumers=2).registers() == (168, 240)


def test_flops_count_causal_half():
    assert fg.gluon_attention_flops(1, 32, 32768, 32768, 128, True) == pytest.approx(2 * 32 * 32768**2 * 128)
    assert fg.gluon_attention_flops(2, 2, 10, 20, 64, False) == 4 * 2 * 2 * 10 * 20 * 64


@pytest.mark.parametrize("q, reason", [
    (_cpu((1, 2, 64, 128)), "not a CUDA device"),
])
def test_supported_refuses_cpu(q, reason):
    assert not fg.supported(q, q, q)
    if fg.HAS_GLUON_HOPPER:
        assert reason in fg.unsupported_reason(q, q, q)
    with pytest.raises(ValueError, match="gluon_attention_fwd"):
        fg.gluon_attention_fwd(q, q, q, True)


@pytest.mark.skipif(not fg.HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API")
def test_unsupported_reasons_name_the_rule(monkeypatch):
    # Pretend tensors live on a GPU so that the dtype / shape / stride rules are reached on a CPU host.
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    good = _cpu((1, 2, 64, 128))
    assert fg.unsupported_reason(good, good, good) == ""
    assert "float32" in fg.unsupported_reason(*[_cpu((1, 2, 64, 128), torch.float32)] * 3)
    assert "head dim 80" in fg.unsupported_reason(*[_cpu((1, 2, 64, 80))] * 3)
    assert "4-D" in fg.unsupported_reason(*[_cpu((2, 64, 128))] * 3)
    strided = _cpu((1, 2, 64, 256))[..., ::2]
    assert "strides" in fg.unsupported_reason(strided, strided, strided)
    odd = _cpu((1, 2, 64, 130))[..., :128]  # row stride 130 elements: 260 bytes, not 16-byte aligned
    assert "strides" in fg.unsupported_reason(odd, odd, odd)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "sm_90" in fg.unsupported_reason(good, good, good)


def _compile_for_sm90(kernel, args: tuple, meta: dict):
    """Compile a Gluon kernel for sm_90 without a GPU, from its launcher's own arguments (mangled into a
    signature) and keyword arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    meta = dict(meta)
    options = {name: meta.pop(name) for name in ("num_warps", "maxnreg")}
    signature = {p.name: mangle_type(a) for p, a in zip(kernel.params, args)}
    signature.update({name: "constexpr" for name in meta})
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=dict(meta))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _compile_sm90(config: fg.GluonConfig, head_dim: int, dtype: torch.dtype, causal: bool):
    q = _cpu((1, 3, 1000, head_dim), dtype)
    k = _cpu((1, 3, 777, head_dim), dtype)
    _, args, meta = fg.launch_args(q, k, k, torch.zeros_like(q), torch.zeros(1, 3, 1000), causal, config)
    return _compile_for_sm90(fg._gluon_attn_fwd_kernel, args, meta)


@pytest.mark.slow
@needs_gluon_api
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiles_for_sm90(head_dim):
    config = fg.DEFAULT_CONFIGS[head_dim]
    compiled = _compile_sm90(config, head_dim, torch.bfloat16, True)
    ptx, sass_bytes = compiled.asm["ptx"], compiled.asm["cubin"]
    assert sass_bytes and compiled.metadata.shared >= config.shared_bytes(head_dim)
    # Async wgmma (S and P V in flight together, then a wait that leaves one outstanding) and the
    # consumer/producer register split.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{fg.LOADER_REGS};" in ptx


def test_bwd_config_rules():
    with pytest.raises(ValueError, match="block_m"):
        fgb.GluonBwdConfig(block_m=96)
    with pytest.raises(ValueError, match="num_consumers"):
        fgb.GluonBwdConfig(num_consumers=3)
    config = fgb.GluonBwdConfig(block_m=64, num_stages=2, num_consumers=2)
    # K, V (2 x 2 x 64 x 128), the Q/dO ring (2 x 2 x 64 x 128) and dS^T (2 x 64 x 64), bf16.
    assert config.shared_bytes(128) == 2 * (128 * (4 * 64 + 4 * 64) + 2 * 64 * 64)
    assert config.registers() == fg.GluonConfig(num_consumers=2).registers()


def test_bwd_refuses_cpu_and_bad_lse():
    q = _cpu((1, 2, 64, 128))
    with pytest.raises(ValueError, match="gluon_attention_bwd"):
        fgb.gluon_attention_bwd(q, q, q, q, torch.zeros(1, 2, 64), q, True)


def _compile_sm90_bwd(config: fgb.GluonBwdConfig, head_dim: int, dtype: torch.dtype, causal: bool):
    q = _cpu((1, 3, 1000, head_dim), dtype)
    k = _cpu((1, 3, 777, head_dim), dtype)
    lse = torch.zeros(1, 3, 1000)
    _, args, meta = fgb.bwd_launch_args(q, k, k, q, k, k, lse, lse, torch.zeros(q.shape), causal, config)
    return _compile_for_sm90(fgb._gluon_attn_bwd_kernel, args, meta)


@pytest.mark.slow
@needs_gluon_api
@pytest.mark.parametrize("head_dim, causal, dtype", [(64, True, torch.bfloat16), (128, True, torch.bfloat16),
                                                     (128, False, torch.float16)])
def test_bwd_compiles_for_sm90(head_dim, causal, dtype):
    config = fgb.DEFAULT_BWD_CONFIGS[head_dim]
    compiled = _compile_sm90_bwd(config, head_dim, dtype, causal)
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and compiled.metadata.shared >= config.shared_bytes(head_dim)
    # S^T and dP^T in flight together (a wait that leaves one outstanding), dQ summed by fp32 atomics, and the
    # consumer/producer register split.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "atom.global.gpu.relaxed.add.f32" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{fg.LOADER_REGS};" in ptx


# ----------------------------------------------------------------------------------------------------------
# GPU numerics
# ----------------------------------------------------------------------------------------------------------
def _reference(q, k, v, causal):
    qf, kf, vf = (t.float() for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # top-left aligned: query i sees keys j <= i
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
                                    .triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ vf, torch.logsumexp(scores, -1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or not fg.HAS_GLUON_HOPPER, reason="needs an sm_90 GPU and Gluon's Hopper API")
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((1, 3, 1000, 128), 1000, True), ((1, 3, 1000, 128), 1000, False), ((2, 2, 777, 64), 777, True),
    ((1, 2, 513, 128), 1029, False), ((1, 2, 1029, 64), 513, True)])
def test_matches_fp32_attention(q_shape, n_k, causal, dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    assert fg.supported(q, k, v)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal)
    ref_out, ref_lse = _reference(q, k, v, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q_shape[:3]
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert (lse - ref_lse).abs().max().item() <= tol
    # Same units as the tl kernels' L (natural log), so their backward can consume it.
    from kernels.flash_attention import flash_attention_fwd
    if q_shape[2] == n_k or not causal:
        _, tl_lse = flash_attention_fwd(q, k, v, causal)
        assert (lse - tl_lse).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or not fg.HAS_GLUON_HOPPER, reason="needs an sm_90 GPU and Gluon's Hopper API")
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 6e-3)])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((1, 3, 1000, 128), 1000, True), ((1, 3, 1000, 128), 1000, False), ((2, 2, 777, 64), 777, True),
    ((1, 2, 513, 128), 1029, False), ((1, 2, 1029, 64), 513, True), ((1, 2, 513, 128), 1029, True)])
def test_bwd_matches_fp32_autograd(q_shape, n_k, causal, dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    do = torch.randn(q_shape, generator=gen, device="cuda").to(dtype)  # a non-unit upstream gradient
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    _reference(qf, kf, vf, causal)[0].backward(do.float())
    out, lse = fg.gluon_attention_fwd(q, k, v, causal)
    grads = fgb.gluon_attention_bwd(q, k, v, out, lse, do, causal)
    for name, g, ref, t in zip("qkv", grads, (qf.grad, kf.grad, vf.grad), (q, k, v)):
        assert g.dtype == dtype and g.shape == t.shape, name
        # Max error relative to the largest gradient: P and dS are rounded to the input dtype (2^-9 bf16, 2^-12
        # fp16) and summed over ~1000 terms; a wrong row, tail or mask shows up as O(1).
        assert ((g.float() - ref).abs().max() / ref.abs().max()).item() <= tol, name
    # Through autograd too.
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    fgb.gluon_attention(qa, ka, va, causal).backward(do)
    assert ((qa.grad.float() - qf.grad).abs().max() / qf.grad.abs().max()).item() <= tol
