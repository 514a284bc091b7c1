"""The Gluon forward (`kernels/attention/gluon/forward.py`, `fast_math.py`).

CPU: the config rules, and builds for sm_90 with each Triton's own ptxas (no GPU): async wgmma, the register split,
no spills (the launched configs included). GPU (sm_90): O and the natural-log L against fp32 attention on odd shapes,
causal and not, n_q != n_k, bf16 and fp16; the persistent grid, head groups, emulated exp2s and the rescale order.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import triton

import kernels.attention.gluon.forward as fg
from kernels.attention import checks, dispatch
from kernels.attention.gluon import fast_math, runtime
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from tests.kernels.attention.gluon.sm90_builds import sm90_build
from tests.kernels.attention.gluon.support import (
    cpu,
    fp32_attention,
    needs_gluon,
    needs_sm90,
    over_tritons,
)


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
        assert consumer * n + runtime.LOADER_REGS <= maxnreg * (n + 1)
    assert fg.GluonConfig(num_consumers=2).registers() == (168, 240)
    with pytest.raises(ValueError, match="persistent needs num_consumers 2, not 3"):
        fg.GluonConfig(num_consumers=3, persistent=True)
    persistent = fg.GluonConfig(persistent=True)
    assert persistent.name == "2x64x128/s2/p"
    # O gets buffers of its own beside Q's (two 64 x 128 tiles), the K/V ring (2 x 2 x 128 x 128), bf16.
    assert persistent.shared_bytes(128) == fg.GluonConfig().shared_bytes(128) + 2 * 64 * 128 * 2 == 196608
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=rf"head_group \({bad!r}\) must be an int >= 0"):
            fg.GluonConfig(head_group=bad)
    assert fg.GluonConfig(persistent=True, head_group=8).name == "2x64x128/s2/p/g8"
    assert fg.GluonConfig(head_group=8).shared_bytes(128) == fg.GluonConfig().shared_bytes(128)
    assert fg.GluonConfig(persistent=True, round_robin=True).name == "2x64x128/s2/p/rr"
    with pytest.raises(ValueError, match="round_robin needs persistent"):
        fg.GluonConfig(round_robin=True)
    with pytest.raises(ValueError, match=r"round_robin \(1\) must be a bool"):
        fg.GluonConfig(persistent=True, round_robin=1)


def _compile_sm90(config: fg.GluonConfig, head_dim: int, dtype: torch.dtype, causal: bool, release=None):
    """The forward's kernel for `config`, built for sm_90 (`tests/kernels/attention/gluon/sm90_builds.py`)."""
    return sm90_build("fwd", config, head_dim, dtype, causal, triton=release)[0]


@pytest.mark.slow
@needs_gluon
@over_tritons
@pytest.mark.parametrize("head_dim, persistent, head_group, round_robin", [
    (64, False, 0, False), (128, False, 0, False), (128, True, 0, True), (128, False, 8, False), (64, True, 8, False),
    (64, True, 8, True)])
def test_compiles_for_sm90(head_dim, persistent, head_group, round_robin, release):
    """Builds for sm_90 without spills (the d-128 persistent grid reading its schedule spills a few bytes: the
    launched configs' test below bounds them)."""
    config = dataclasses.replace(dispatch.DEFAULT_FWD_CONFIGS[head_dim], persistent=persistent, head_group=head_group,
                                 round_robin=round_robin)
    compiled = _compile_sm90(config, head_dim, torch.bfloat16, True, release)
    ptx, sass_bytes = compiled.ptx, compiled.cubin
    assert sass_bytes and compiled.shared >= config.shared_bytes(head_dim)
    # Async wgmma (S and P V in flight together, then a wait that leaves one outstanding) and the
    # consumer/producer register split.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{runtime.LOADER_REGS};" in ptx
    assert "0 bytes spill stores" in compiled.ptxas_log


@pytest.mark.slow
@needs_gluon
@over_tritons
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tuned_forward_configs_compile_for_sm90_without_spills(head_dim, release):
    """The configs the gluon forward launches by default (the tuned file's sweep-wide winner, else the built-in one,
    and up to its length PERSISTENT_GRID's) build for sm_90 within shared memory and without spills; at d 128 the
    persistent grid spills a few bytes (its timings include them), no more; so do the head groups
    the L2 cap takes at 8192, 16384 and 32768 (the H200's 60 MiB)."""
    tuned = dispatch.gluon_fwd_default(head_dim, torch.bfloat16)
    n_max, fields = dispatch.PERSISTENT_GRID.get(head_dim, (0, {}))
    launched = {dataclasses.replace(tuned, **fields) if n <= n_max else tuned for n in (2048, 8192, 16384, 32768)}
    capped = {dataclasses.replace(c, head_group=dispatch.l2_head_group(c.head_group, 4 * n * head_dim, 32,
                                                                       60 * 2**20))
              for c in launched for n in (8192, 16384, 32768)}
    shape = cpu((4, 32, 2048, head_dim))
    for config in {tuned, dispatch.gluon_fwd_config(shape, shape), *launched, *capped}:
        compiled = _compile_sm90(config, head_dim, torch.bfloat16, True, release)
        assert compiled.shared >= config.shared_bytes(head_dim)
        log = compiled.ptxas_log
        spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
        allowed = 32 if head_dim == 128 and config.persistent else 0
        assert spilled <= allowed, (config.name, log)


def test_exp2_emulated_rules_and_default(monkeypatch):
    """`exp2_emulated` takes 0, 2, 4, 8 or 16 and names itself; `default_config` takes EXP2_EMULATED's where the tuned
    file's entry does not set it, the entry's where it does; the PTX splits each pack of n scores into n - 1 MUFU
    exp2s and one emulated."""
    for bad in (1, 3, 32, True, 4.0):
        with pytest.raises(ValueError, match=rf"exp2_emulated \({bad!r}\) must be 0, 2, 4, 8 or 16"):
            fg.GluonConfig(exp2_emulated=bad)
    assert fg.GluonConfig(persistent=True, head_group=8, exp2_emulated=8).name == "2x64x128/s2/p/g8/e8"
    assert fg.GluonConfig(exp2_emulated=8, rescale_under_s=True).name == "2x64x128/s2/e8/ru"
    with pytest.raises(ValueError, match=r"rescale_under_s \(1\) must be a bool"):
        fg.GluonConfig(rescale_under_s=1)
    assert fg.GluonConfig(exp2_emulated=4).shared_bytes(64) == fg.GluonConfig().shared_bytes(64)
    default = dispatch.gluon_fwd_default
    EXP2_EMULATED, RESCALE_UNDER_S = dispatch.EXP2_EMULATED, dispatch.RESCALE_UNDER_S
    entry = {"block_m": 64, "block_n": 128, "num_stages": 3, "num_consumers": 2}
    monkeypatch.setattr(dispatch, "gluon_tuned_fields", lambda kind, head_dim, dtype, device=None: dict(entry))
    assert default(64, torch.bfloat16) == fg.GluonConfig(**entry, exp2_emulated=EXP2_EMULATED[64],
                                                         rescale_under_s=RESCALE_UNDER_S[64])
    assert default(128, torch.bfloat16).exp2_emulated == EXP2_EMULATED.get(128, 0)
    assert default(128, torch.bfloat16).rescale_under_s == RESCALE_UNDER_S.get(128, False)
    entry["exp2_emulated"] = 0
    assert default(64, torch.bfloat16) == fg.GluonConfig(**entry, rescale_under_s=RESCALE_UNDER_S[64])
    monkeypatch.setattr(dispatch, "gluon_tuned_fields", lambda kind, head_dim, dtype, device=None: None)
    assert default(64, torch.bfloat16) == dataclasses.replace(
        dispatch.DEFAULT_FWD_CONFIGS[64], exp2_emulated=EXP2_EMULATED[64], rescale_under_s=RESCALE_UNDER_S[64])
    for n in (2, 4, 8, 16):
        asm = fast_math.exp2_mixed_asm(n)
        assert asm.count("ex2.approx") == n - 1 and f"add.s32 ${n - 1}," in asm and f"${2 * n - 1}, 0fC2FC0000" in asm
    with pytest.raises(ValueError, match="every"):
        fast_math.exp2_mixed_asm(1)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((4, 3, 1000, 128), 1000, True), ((3, 4, 777, 64), 777, True), ((2, 7, 513, 128), 1029, False),
    ((3, 3, 1029, 64), 513, False)])
def test_persistent_forward_and_head_groups_match_the_one_item_programs(q_shape, n_k, causal, dtype, monkeypatch):
    """The persistent forward on a grid of 16 programs (several work items each, so the ring and Q's barrier run on
    across items), and both forwards with their items taken 5 heads at a time (a smaller last group), the persistent
    one with `work_schedule`'s lists and in round robin: bitwise the one-item programs' O and L in `_work_item`'s
    default order (same tiles, same order of additions)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    base = dispatch.gluon_fwd_default(q_shape[-1], dtype)
    if base.num_consumers != 2 or base.persistent or base.head_group:
        base = dispatch.DEFAULT_FWD_CONFIGS[q_shape[-1]]
    monkeypatch.setattr(fg, "num_sms", lambda device: 16)
    items = triton.cdiv(q_shape[2], 2 * base.block_m) * q_shape[0] * q_shape[1]
    assert items > 2 * 16 and (q_shape[0] * q_shape[1]) % 5
    want = fg.gluon_attention_fwd(q, k, v, causal, config=base)
    ref_out, _ = fp32_attention(q, k, v, causal)
    for config in (dataclasses.replace(base, persistent=True), dataclasses.replace(base, head_group=5),
                   dataclasses.replace(base, persistent=True, head_group=5),
                   dataclasses.replace(base, persistent=True, round_robin=True),
                   dataclasses.replace(base, persistent=True, head_group=5, round_robin=True)):
        got = fg.gluon_attention_fwd(q, k, v, causal, config=config)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), config.name
    assert (want[0].float() - ref_out).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 4e-3)


if HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _exp2_probe(x_ptr, y_ptr, EXP2_EMULATED: gl.constexpr, N: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
        offs = gl.arange(0, N, layout=layout)
        gl.store(y_ptr + offs, fast_math.exp2_mixed(gl.load(x_ptr + offs), EXP2_EMULATED))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("every", [0, 2, 4, 8, 16])
def test_exp2_emulated_matches_exp2(every):
    """`_exp2` on x <= 0 (the softmax's range, -inf for masked scores): within 7.5e-5 of exp2 relative (the
    polynomial's bound; MUFU's ex2 is closer) down to 2^-120, within 2^-125 absolute below; exp2(-inf) = 0 from
    the MUFU unit, at most 2^-125 emulated; with emulation exactly one in `every` values differs from MUFU's."""
    n = 4096
    x = torch.linspace(-140.0, 0.0, n, device="cuda")
    x[::97] = float("-inf")
    y = torch.empty_like(x)
    _exp2_probe[(1,)](x, y, every, n, num_warps=4)
    ref = torch.exp2(x.double())
    big = ref >= 2.0**-120
    assert ((y.double()[big] / ref[big] - 1).abs().max().item() <= 7.5e-5)
    assert ((y.double()[~big] - ref[~big]).abs().max().item() <= 2.0**-125)
    native = torch.empty_like(x)
    _exp2_probe[(1,)](x, native, 0, n, num_warps=4)
    differs = (y != native).float().mean().item()
    assert differs == 0 if every == 0 else 0 < differs <= 1 / every


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("every", [2, 8])
@pytest.mark.parametrize("q_shape, n_k, causal", [((2, 2, 777, 64), 777, True), ((1, 2, 513, 128), 1029, False)])
def test_exp2_emulated_forward_matches_fp32_attention(q_shape, n_k, causal, every, dtype, tol):
    """The forward with one exp2 in `every` emulated, against fp32 attention (O and L), as the MUFU-only one is."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    config = dataclasses.replace(dispatch.DEFAULT_FWD_CONFIGS[q_shape[-1]], exp2_emulated=every)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, config=config)
    ref_out, ref_lse = fp32_attention(q, k, v, causal)
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert (lse - ref_lse).abs().max().item() <= tol


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("q_shape, n_k, causal, drift", [
    ((2, 2, 777, 64), 777, True, 0.0), ((1, 2, 513, 128), 1029, False, 0.0), ((1, 3, 1000, 128), 1000, True, 3.0),
    ((1, 2, 200, 64), 100, False, 3.0)])
def test_rescale_under_s_matches_fp32_attention(q_shape, n_k, causal, drift, persistent, dtype, tol):
    """O's rescale issued under S(j) (`rescale_under_s`) against fp32 attention, O and L: random scores, and scores
    rising by `drift` per key (every tile raises every row's max, so every rescale matters); n_k 100 is one key tile
    (only the last P V's rescale, by tile 0's alpha)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda") for s in (q_shape, k_shape, k_shape))
    if drift:
        q = q.abs() + 1.0
        k = k.abs() * 0.1 + drift * torch.arange(n_k, device="cuda")[:, None] / n_k
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    config = dataclasses.replace(dispatch.DEFAULT_FWD_CONFIGS[q_shape[-1]], rescale_under_s=True, persistent=persistent)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, config=config)
    ref_out, ref_lse = fp32_attention(q, k, v, causal)
    scale = max(1.0, ref_lse.abs().max().item() / 8)
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert (lse - ref_lse).abs().max().item() <= tol * scale


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((1, 3, 1000, 128), 1000, True), ((1, 3, 1000, 128), 1000, False), ((2, 2, 777, 64), 777, True),
    ((1, 2, 513, 128), 1029, False), ((1, 2, 1029, 64), 513, True)])
def test_matches_fp32_attention(q_shape, n_k, causal, dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    assert not checks.unsupported_reason(q, k, v)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, dispatch.gluon_fwd_config(q, k))
    ref_out, ref_lse = fp32_attention(q, k, v, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q_shape[:3]
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert (lse - ref_lse).abs().max().item() <= tol
    # Same units as the tl kernels' L (natural log), so their backward can consume it.
    from kernels.attention.interface import flash_attention_fwd
    if q_shape[2] == n_k or not causal:
        _, tl_lse = flash_attention_fwd(q, k, v, causal)
        assert (lse - tl_lse).abs().max().item() <= tol
