"""The Gluon one-pass backward (`kernels/attention/gluon/backward.py`) against fp32 autograd.

CPU: the config rules, refusals before any build, builds for sm_90 (async wgmma, dQ by TMA reductions, the register
split), and the one-pass preprocess kernel under the interpreter. GPU (sm_90): dQ, dK, dV against fp32 autograd with a
random upstream gradient on odd shapes; the persistent grid against the one-item programs.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import triton

import kernels.attention.gluon.backward as fgo
import kernels.attention.gluon.forward as fg
from kernels.attention import dispatch, flash_attention
from kernels.attention.gluon import runtime
from tests.kernels.attention.gluon.sm90_builds import sm90_build
from tests.kernels.attention.gluon.support import (
    cpu,
    fp32_attention,
    needs_gluon,
    needs_sm90,
    over_tritons,
)


def test_bwd_config_rules():
    with pytest.raises(ValueError, match="block_m"):
        fgo.GluonBwdConfig(block_m=128)
    with pytest.raises(ValueError, match="num_stages"):
        fgo.GluonBwdConfig(num_stages=0)
    config = fgo.GluonBwdConfig(block_m=64, num_stages=2)
    # K, V (2 x 2 x 64 x 128), the Q/dO ring (2 x 2 x 64 x 128) and dS^T of both groups' keys (2 x 128 x 64), bf16;
    # each group's fp32 dQ tile, the whole head dim (2 x 64 x 128 x 4 bytes) or half of it; the L and D rows of
    # each slot (2 x 2 x 64 x 4 bytes): 225 KB, 193 KB.
    assert config.shared_bytes(128) == (2 * (128 * (4 * 64 + 4 * 64) + 2 * 128 * 64) + 2 * 64 * 128 * 4
                                        + 2 * 2 * 64 * 4)
    halves = dataclasses.replace(config, dq_whole=False)
    assert halves.shared_bytes(128) == config.shared_bytes(128) - 64 * 128 * 4
    assert config.registers() == fg.GluonConfig(num_consumers=2).registers()
    with pytest.raises(ValueError, match="persistent"):
        fgo.GluonBwdConfig(persistent=1)
    with pytest.raises(ValueError, match="dq_whole"):
        fgo.GluonBwdConfig(dq_whole="yes")
    with pytest.raises(ValueError, match="dk_late"):
        fgo.GluonBwdConfig(dq_whole=False, dk_late=True)
    assert fgo.GluonBwdConfig(dk_late=True, head_group=2).name == "bwd2x64xq64/s2/dqw/dkl/rt/g2"
    with pytest.raises(ValueError, match="rows_tma"):
        fgo.GluonBwdConfig(rows_tma=1)
    rows = fgo.GluonBwdConfig(rows_tma=False)
    assert rows.name == "bwd2x64xq64/s2/dqw"
    assert fgo.GluonBwdConfig().shared_bytes(128) == rows.shared_bytes(128) + 2 * 2 * 64 * 4
    persistent = fgo.GluonBwdConfig(persistent=True, head_group=4)
    assert persistent.name == "bwd2x64xq64/s2/dqw/rt/p/g4" and persistent.kernel is not config.kernel
    assert halves.name == "bwd2x64xq64/s2/rt"
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match="dq_buffers"):
            fgo.GluonBwdConfig(dq_buffers=bad)
    double = fgo.GluonBwdConfig(dq_buffers=2, head_group=4)
    assert double.name == "bwd2x64xq64/s2/dqw/rt/q2/g4"
    assert double.shared_bytes(64) == config.shared_bytes(64) + 2 * 64 * 64 * 4  # a second tile per group


def test_bwd_refuses_a_config_the_device_cannot_hold(monkeypatch):
    """A one-pass config whose shared memory exceeds what a block may use (two whole d-128 dQ tiles per group, a
    3-slot ring at d 128) is refused before any build, naming the config and the sizes; the same configs at d 64,
    and the launched ones at d 128, pass."""
    monkeypatch.setattr(fgo, "shared_memory_limit", lambda device: 232448)  # an H100 / H200 block's opt-in maximum
    lse = torch.zeros(1, 2, 320)
    for head_dim, config, fits in ((128, fgo.GluonBwdConfig(dq_buffers=2), False),
                                   (128, fgo.GluonBwdConfig(num_stages=3), False),
                                   (128, fgo.GluonBwdConfig(dq_whole=False, dq_buffers=2), True),
                                   (128, dispatch.DEFAULT_BWD_CONFIGS[128], True),
                                   (64, fgo.GluonBwdConfig(num_stages=3, dq_buffers=2), True)):
        q = cpu((1, 2, 300, head_dim))
        args = (q, q, q, q, q, q, lse, lse, torch.zeros(q.shape), True, config)
        if fits:
            fgo.bwd_launch_args(*args)
        else:
            with pytest.raises(ValueError, match=rf"{re.escape(config.name)} needs \d+ bytes of shared memory at "
                                                 rf"head_dim {head_dim}, more than the 232448"):
                fgo.bwd_launch_args(*args)


def test_bwd_refuses_cpu_and_bad_lse():
    q = cpu((1, 2, 64, 128))
    with pytest.raises(ValueError, match="gluon_attention_bwd"):
        fgo.gluon_attention_bwd(q, q, q, q, torch.zeros(1, 2, 64), q, True, dispatch.DEFAULT_BWD_CONFIGS[128])


@pytest.mark.gpu
@needs_sm90
def test_bwd_refuses_mismatched_out_lse_and_grad_on_the_gpu():
    """Inputs the kernels accept but whose O, L or dO do not fit q: a one-line error, before any launch."""
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(1, 2, 64, device="cuda")
    for args, match in (((q, q, q, q, lse[..., :32], q), "gluon_attention_bwd: lse must be float32 of shape"),
                        ((q, q, q, q, lse.half(), q), "gluon_attention_bwd: lse must be float32"),
                        ((q, q, q, q[:, :, :32], lse, q), "gluon_attention_bwd: out .* must have q's shape"),
                        ((q, q, q, q, lse, q[:, :1]), "gluon_attention_bwd: out .* and grad_out .* must have")):
        with pytest.raises(ValueError, match=match):
            fgo.gluon_attention_bwd(*args, True, dispatch.gluon_bwd_config(q))


def _compile_sm90_bwd(config: fgo.GluonBwdConfig, head_dim: int, dtype: torch.dtype, causal: bool, release=None):
    return sm90_build("bwd", config, head_dim, dtype, causal, triton=release)[0]


@pytest.mark.slow
@needs_gluon
@over_tritons
@pytest.mark.parametrize("head_dim, causal, dtype, persistent, dq_whole", [
    (64, True, torch.bfloat16, False, True), (128, True, torch.bfloat16, False, True),
    (128, False, torch.float16, False, True), (64, True, torch.bfloat16, True, True),
    (128, True, torch.bfloat16, True, True), (128, True, torch.bfloat16, False, False),
    (128, True, torch.bfloat16, False, "dk_late"), (128, True, torch.bfloat16, True, "dk_late"),
    (128, True, torch.bfloat16, False, "rows_global"), (64, True, torch.bfloat16, True, "rows_global"),
    (64, True, torch.bfloat16, False, "dq_buffers"), (128, False, torch.float16, True, "halves_dq_buffers")])
def test_bwd_compiles_for_sm90(head_dim, causal, dtype, persistent, dq_whole, release):
    config = dataclasses.replace(dispatch.DEFAULT_BWD_CONFIGS[head_dim], persistent=persistent,
                                 dq_whole=bool(dq_whole) and dq_whole != "halves_dq_buffers",
                                 dk_late=dq_whole == "dk_late", rows_tma=dq_whole != "rows_global",
                                 dq_buffers=2 if str(dq_whole).endswith("dq_buffers") else 1)
    compiled = _compile_sm90_bwd(config, head_dim, dtype, causal, release)
    ptx = compiled.ptx
    assert compiled.cubin and compiled.shared >= config.shared_bytes(head_dim)
    # S^T and dP^T in flight together (a wait that leaves one outstanding), dQ summed by the TMA unit's bulk
    # reductions (no per-thread atomics), and the consumer/producer register split.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
    # A dQ tile is rewritten once the TMA unit has read it: the last reduction, or with two tiles the one before.
    assert ("cp.async.bulk.wait_group.read \t1;" in ptx) == (config.dq_buffers == 2)
    assert "atom.global" not in ptx and "red.global" not in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{runtime.LOADER_REGS};" in ptx
    # rows_tma: L and D by the loader's 1-D TMA loads, no consumer loads them from global memory.
    assert ("cp.async.bulk.tensor.1d" in ptx) == config.rows_tma
    assert ("ld.global" in ptx) != config.rows_tma
    if persistent and head_dim == 64:  # (at d 128 the loop over work items costs the causal consumers more spills)
        assert "0 bytes spill stores" in compiled.ptxas_log


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 6e-3)])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((1, 3, 1000, 128), 1000, True), ((1, 3, 1000, 128), 1000, False), ((2, 2, 777, 64), 777, True),
    ((1, 2, 513, 128), 1029, False), ((1, 2, 1029, 64), 513, True), ((1, 2, 513, 128), 1029, True)])
@pytest.mark.parametrize("alt", [False, "halves", "dk_late", "rows_global", "dq_buffers"])
def test_bwd_matches_fp32_autograd(q_shape, n_k, causal, dtype, tol, alt):
    """The one-pass backward against fp32 autograd: with the config `auto` picks, with dQ in head-dim halves per group, with dK's wgmma after the dS^T store, with
    L and D loaded from global memory (`rows_tma=False`), and with two dQ tiles per group (`dq_buffers`; at d 128
    with the halves, which leave shared memory for them)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    do = torch.randn(q_shape, generator=gen, device="cuda").to(dtype)  # a non-unit upstream gradient
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    fp32_attention(qf, kf, vf, causal)[0].backward(do.float())
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, dispatch.gluon_fwd_config(q, k))
    if alt:
        config = dataclasses.replace(dispatch.DEFAULT_BWD_CONFIGS[q_shape[-1]],
                                     dq_whole=not (alt == "halves" or (alt == "dq_buffers" and q_shape[-1] == 128)),
                                     dk_late=alt == "dk_late", rows_tma=alt != "rows_global",
                                     dq_buffers=2 if alt == "dq_buffers" else 1)
    else:
        config = dispatch.gluon_bwd_config(q)
    grads = fgo.gluon_attention_bwd(q, k, v, out, lse, do, causal, config)
    for name, g, ref, t in zip("qkv", grads, (qf.grad, kf.grad, vf.grad), (q, k, v)):
        assert g.dtype == dtype and g.shape == t.shape, name
        # Max error relative to the largest gradient: P and dS are rounded to the input dtype (2^-9 bf16, 2^-12
        # fp16) and summed over ~1000 terms; a wrong row, tail or mask shows up as O(1).
        assert ((g.float() - ref).abs().max() / ref.abs().max()).item() <= tol, name
    if alt or (causal and q_shape[-2] != n_k):
        return
    # Through autograd too: `flash_attention` on the gluon path (its forward, then this one-pass backward); its
    # contract takes causal attention only with n_q == n_k (check_attention_inputs).
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention(qa, ka, va, causal, path="gluon").backward(do)
    assert ((qa.grad.float() - qf.grad).abs().max() / qf.grad.abs().max()).item() <= tol


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((4, 3, 1000, 128), 1000, True), ((3, 4, 777, 64), 777, True), ((2, 7, 513, 128), 1029, False),
    ((3, 3, 1029, 64), 513, True), ((2, 6, 1029, 128), 513, False)])
@pytest.mark.parametrize("knobs", [{}, {"dk_late": True}, {"rows_tma": False}, {"dq_buffers": 2}])
def test_persistent_one_pass_backward_matches_the_one_item_programs(q_shape, n_k, causal, dtype, knobs,
                                                                    monkeypatch):
    """The persistent one-pass backward on a grid of 16 programs (several work items each, so the Q/dO ring, K/V's
    barriers and the dQ tiles run on across items), also with its items taken 5 heads at a time: dK and dV bitwise
    the one-item programs' (same tiles, same order of additions), dQ (fp32 sums by the TMA unit, in no fixed
    order) within rounding of theirs, and all three against fp32 autograd. n_k < n_q causal gives items with no
    query tile (dK = dV = 0). Also with `dk_late` (dK's wgmma after the dS^T store), without `rows_tma` (L and D
    from global memory) and with two dQ tiles per group (`dq_buffers`), on both sides."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    do = torch.randn(q_shape, generator=gen, device="cuda").to(dtype)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    fp32_attention(qf, kf, vf, causal)[0].backward(do.float())
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, dispatch.gluon_fwd_config(q, k))
    if knobs.get("dq_buffers") == 2 and q_shape[-1] == 128:
        knobs = dict(knobs, dq_whole=False)  # two whole d-128 dQ tiles per group do not fit shared memory
    base = fgo.GluonBwdConfig(num_stages=3 if q_shape[-1] == 64 else 2, **knobs)
    monkeypatch.setattr(fgo, "num_sms", lambda device: 16)
    items = triton.cdiv(n_k, 2 * fgo.BWD_BLOCK_N) * q_shape[0] * q_shape[1]
    assert items > 2 * 16 and (q_shape[0] * q_shape[1]) % 5
    want = fgo.gluon_attention_bwd(q, k, v, out, lse, do, causal, base)
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    for config in (dataclasses.replace(base, persistent=True), dataclasses.replace(base, persistent=True,
                                                                                   head_group=5)):
        got = fgo.gluon_attention_bwd(q, k, v, out, lse, do, causal, config)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), config.name
        assert ((got[0].float() - want[0].float()).abs().max() / want[0].float().abs().max()).item() <= rounding
        for name, g, ref in zip("qkv", got, (qf.grad, kf.grad, vf.grad)):
            tol = 3e-2 if dtype == torch.bfloat16 else 6e-3  # as test_bwd_matches_fp32_autograd's
            assert ((g.float() - ref).abs().max() / ref.abs().max()).item() <= tol, (config.name, name)


def _padded_rows(t: torch.Tensor, block_m: int) -> torch.Tensor:
    """(B, H, N) `t` as (B, H, N rounded up to whole block_m tiles), zeros past N: the reference layout of the
    one-pass backward's L and D."""
    batch, heads, n = t.shape
    padded = t.new_zeros((batch, heads, triton.cdiv(n, block_m) * block_m))
    padded[..., :n] = t
    return padded


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q, head_dim", [(1, 64), (65, 64), (128, 128), (130, 128)])
def test_onepass_preprocess_pads_rows_and_zeroes_dq(n_q, head_dim, dtype):
    """The one-pass backward's single preprocess launch: D = rowsum(O * dO) and L as `_padded_rows` pads them (zeros
    past N_Q up to whole 64-row tiles), and the fp32 dQ accumulator zeroed over every element, from a
    non-contiguous O and a garbage-filled dQ buffer."""
    from kernels.attention.triton.kernels import _onepass_bwd_preprocess_kernel

    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    batch, heads, block_m = 2, 3, 64
    out = torch.randn((batch, n_q, heads, head_dim), generator=gen, device=device).to(dtype).transpose(1, 2)
    grad_out = torch.randn((batch, heads, n_q, head_dim), generator=gen, device=device).to(dtype)
    lse = torch.randn((batch, heads, n_q), generator=gen, device=device)
    n_pad = triton.cdiv(n_q, block_m) * block_m
    dq_acc = torch.full((batch, heads, n_q, head_dim), float("nan"), device=device)
    delta_pad, lse_pad = (torch.full((batch, heads, n_pad), float("nan"), device=device) for _ in range(2))
    _onepass_bwd_preprocess_kernel[(n_pad // block_m, batch * heads)](
        out, grad_out, lse, dq_acc, delta_pad, lse_pad, *out.stride(), *grad_out.stride(), heads, n_q, n_pad,
        HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m, num_warps=4)
    delta = (out.float() * grad_out.float()).sum(-1)
    torch.testing.assert_close(delta_pad, _padded_rows(delta, block_m), rtol=1e-5, atol=1e-5)
    assert torch.equal(lse_pad, _padded_rows(lse, block_m))
    assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
