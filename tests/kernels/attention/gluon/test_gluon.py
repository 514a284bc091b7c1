"""Tests of the Gluon Hopper FlashAttention forward and backward (`kernels/flash_attention_gluon.py`).

CPU: the config rules, `supported` refusing what the kernel cannot run, and (under the Triton 3.6 whose Gluon API
the kernel is written against) a compile for sm_90 with Triton's bundled ptxas, no GPU needed (the two-pass
backward's kernels also without spills or wgmma serialisation). GPU (sm_90): O and the natural-log L against fp32
attention on odd shapes, causal and not, n_q != n_k, bf16 and fp16; dQ, dK, dV of both backward modes against fp32
autograd on the same shapes with a random upstream gradient; the two-pass backward bitwise deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest
import torch
import triton

import kernels.attention.gluon.forward as fg
import kernels.attention.gluon.backward_two_pass as fgb
import kernels.attention.gluon.backward as fgo
from tests.kernels.attention.gluon.sm90_builds import extra_tritons, sm90_build

needs_gluon = pytest.mark.skipif(not fg.HAS_GLUON_HOPPER, reason=f"Triton {triton.__version__} has no Gluon Hopper API")
TRITONS = [None, *extra_tritons()]
"""The Tritons the sm_90 compile tests build under: the installed one (None) and RAYSYS_EXTRA_TRITONS' releases."""
over_tritons = pytest.mark.parametrize("release", TRITONS, ids=lambda r: f"triton-{r or triton.__version__}")
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                                or not fg.HAS_GLUON_HOPPER, reason="needs an sm_90 GPU and Gluon's Hopper API")


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


def _work_items(bh, n_q, n_k, tile_m, block_n, is_causal):
    """Key tiles of every (head, query tile), counted key by key: what `fg.work_weights` orders. Under the causal
    mask a tile's loop runs to the last key its last row (padded to a whole tile) sees."""
    found = []
    for _ in range(bh):
        for m in range(triton.cdiv(n_q, tile_m)):
            seen = [j for j in range(n_k) if not is_causal or j < (m + 1) * tile_m]
            found.append(triton.cdiv(max(seen) + 1, block_n))
    return found


def _makespan(lists, weights):
    return max(sum(weights[t] + fg.ITEM_COST for t in items) for items in lists)


@pytest.mark.parametrize("bh, n_q, n_k, group", [(6, 1000, 777, 0), (6, 1000, 777, 4), (5, 513, 1029, 2),
                                                 (3, 777, 777, 8)])
@pytest.mark.parametrize("is_causal", [True, False])
def test_work_weights_follow_the_kernels_item_order(bh, n_q, n_k, group, is_causal):
    """The host's weights are the key tiles each work item's loop runs, in `_work_item`'s numbering: the same
    multiset whatever the head group, and in every group's run of items, the query tiles heaviest first."""
    weights = fg.work_weights(bh, n_q, n_k, 128, 128, group, is_causal)
    assert sorted(weights) == sorted(_work_items(bh, n_q, n_k, 128, 128, is_causal))
    num_m = triton.cdiv(n_q, 128)
    run = num_m * (group or bh)
    for lo in range(0, len(weights), run):
        assert weights[lo:lo + run] == sorted(weights[lo:lo + run], reverse=True)


def test_work_schedule_deals_every_item_once_and_evens_the_programs():
    """Each item goes to one program, in a list it runs in order. Causal items at 8x16x4096 in groups of 8 heads
    (the d-64 forward's launch) leave round robin's busiest program 3% above the mean by the cost model; the
    schedule brings it within 0.5%. Items of one length (not causal) keep round robin. (Figures of the cost model,
    `fg.ITEM_COST`, not timings.)"""
    weights = fg.work_weights(128, 4096, 4096, 128, 128, 8, True)
    lists = fg.work_schedule(weights, 132)
    assert sorted(t for items in lists for t in items) == list(range(len(weights)))
    mean = sum(w + fg.ITEM_COST for w in weights) / 132
    robin = [list(range(p, len(weights), 132)) for p in range(132)]
    assert _makespan(robin, weights) > 1.03 * mean
    assert _makespan(lists, weights) < 1.005 * mean
    flat = fg.work_weights(128, 4096, 4096, 128, 128, 8, False)
    assert fg.work_schedule(flat, 132) == [list(range(p, len(flat), 132)) for p in range(132)]
    # 4x32x2048 in groups of 4 (the d-128 launch there): round robin 3.1% above the mean, items dealt in their
    # numbering 4.5% (each group starts heavy again after the last one's light items); heaviest first within windows
    # of two rounds, under 2%.
    weights = fg.work_weights(128, 2048, 2048, 128, 128, 4, True)
    mean = sum(w + fg.ITEM_COST for w in weights) / 132
    assert fg._deal(range(len(weights)), weights, 132)[1] > 1.04 * mean
    assert _makespan(fg.work_schedule(weights, 132), weights) < 1.02 * mean
    for bh, n, group in ((128, 2048, 4), (16, 2048, 4), (3, 1000, 0)):
        weights = fg.work_weights(bh, n, n, 128, 128, group, True)
        lists = fg.work_schedule(weights, 132)
        robin = [list(range(p, len(weights), 132)) for p in range(132)]
        assert _makespan(lists, weights) <= _makespan(robin, weights)


def test_work_schedule_needs_a_program():
    with pytest.raises(ValueError, match=r"programs \(0\) must be >= 1"):
        fg.work_schedule([1, 2], 0)


def test_schedule_table_is_the_offsets_then_the_lists():
    table = fg.schedule_table(6, 1000, 1000, 128, 128, 4, True, 5, torch.device("cpu")).tolist()
    lists = fg.work_schedule(fg.work_weights(6, 1000, 1000, 128, 128, 4, True), 5)
    offsets, items = table[:6], table[6:]
    assert [items[offsets[p]:offsets[p + 1]] for p in range(5)] == lists
    assert offsets[-1] == len(items) == 6 * 8


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
    monkeypatch.setattr(fg, "capability", lambda device: (9, 0))
    good = _cpu((1, 2, 64, 128))
    assert fg.unsupported_reason(good, good, good) == ""
    assert "float32" in fg.unsupported_reason(*[_cpu((1, 2, 64, 128), torch.float32)] * 3)
    assert "head dim 80" in fg.unsupported_reason(*[_cpu((1, 2, 64, 80))] * 3)
    assert "4-D" in fg.unsupported_reason(*[_cpu((2, 64, 128))] * 3)
    strided = _cpu((1, 2, 64, 256))[..., ::2]
    assert "strides" in fg.unsupported_reason(strided, strided, strided)
    odd = _cpu((1, 2, 64, 130))[..., :128]  # row stride 130 elements: 260 bytes, not 16-byte aligned
    assert "strides" in fg.unsupported_reason(odd, odd, odd)
    empty = _cpu((1, 2, 0, 128))
    assert "(1, 2, 0, 128); needs at least one row" in fg.unsupported_reason(empty, good, good)
    assert "k has shape (0, 2, 64, 128)" in fg.unsupported_reason(good, *[_cpu((0, 2, 64, 128))] * 2)
    monkeypatch.setattr(fg, "capability", lambda device: (8, 0))
    assert "sm_90" in fg.unsupported_reason(good, good, good)


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
    config = dataclasses.replace(fg.DEFAULT_CONFIGS[head_dim], persistent=persistent, head_group=head_group,
                                 round_robin=round_robin)
    compiled = _compile_sm90(config, head_dim, torch.bfloat16, True, release)
    ptx, sass_bytes = compiled.ptx, compiled.cubin
    assert sass_bytes and compiled.shared >= config.shared_bytes(head_dim)
    # Async wgmma (S and P V in flight together, then a wait that leaves one outstanding) and the
    # consumer/producer register split.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{fg.LOADER_REGS};" in ptx
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
    tuned = fg.default_config(head_dim, torch.bfloat16)
    n_max, fields = fg.PERSISTENT_GRID.get(head_dim, (0, {}))
    launched = {dataclasses.replace(tuned, **fields) if n <= n_max else tuned for n in (2048, 8192, 16384, 32768)}
    capped = {dataclasses.replace(c, head_group=fg.l2_head_group(c.head_group, 4 * n * head_dim, 32, 60 * 2**20))
              for c in launched for n in (8192, 16384, 32768)}
    for config in {tuned, _self_attention_config((4, 32, 2048, head_dim)), *launched, *capped}:
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
    entry = {"block_m": 64, "block_n": 128, "num_stages": 3, "num_consumers": 2}
    monkeypatch.setattr(fg, "gluon_tuned_fields", lambda kind, head_dim, dtype: dict(entry))
    assert fg.default_config(64, torch.bfloat16) == fg.GluonConfig(**entry, exp2_emulated=fg.EXP2_EMULATED[64],
                                                                   rescale_under_s=fg.RESCALE_UNDER_S[64])
    assert fg.default_config(128, torch.bfloat16).exp2_emulated == fg.EXP2_EMULATED.get(128, 0)
    assert fg.default_config(128, torch.bfloat16).rescale_under_s == fg.RESCALE_UNDER_S.get(128, False)
    entry["exp2_emulated"] = 0
    assert fg.default_config(64, torch.bfloat16) == fg.GluonConfig(**entry, rescale_under_s=fg.RESCALE_UNDER_S[64])
    monkeypatch.setattr(fg, "gluon_tuned_fields", lambda kind, head_dim, dtype: None)
    assert fg.default_config(64, torch.bfloat16) == dataclasses.replace(
        fg.DEFAULT_CONFIGS[64], exp2_emulated=fg.EXP2_EMULATED[64], rescale_under_s=fg.RESCALE_UNDER_S[64])
    for n in (2, 4, 8, 16):
        asm = fg.exp2_mixed_asm(n)
        assert asm.count("ex2.approx") == n - 1 and f"add.s32 ${n - 1}," in asm and f"${2 * n - 1}, 0fC2FC0000" in asm
    with pytest.raises(ValueError, match="every"):
        fg.exp2_mixed_asm(1)


def _self_attention_config(shape):
    return fg.problem_config(_cpu(shape), _cpu(shape))


def test_problem_config_takes_the_persistent_grid_up_to_its_length(monkeypatch):
    """`problem_config`: PERSISTENT_GRID's fields over the tuned config up to its length (d 128), the tuned config
    beyond it, at other head dims and when the tuned config has three consumer groups."""
    tuned = {64: fg.GluonConfig(num_stages=3, persistent=True, head_group=8), 128: fg.GluonConfig(head_group=8)}
    monkeypatch.setattr(fg, "default_config", lambda head_dim, dtype: tuned[head_dim])
    fg._problem_config.cache_clear()
    n_max, fields = fg.PERSISTENT_GRID[128]
    for n in (1, 1000, n_max):
        assert _self_attention_config((4, 32, n, 128)) == dataclasses.replace(tuned[128], **fields)
    assert _self_attention_config((1, 2, n_max + 1, 128)) == tuned[128]
    assert _self_attention_config((8, 16, 1024, 64)) == tuned[64]
    tuned[128] = fg.GluonConfig(block_n=64, num_consumers=3, head_group=8)
    fg._problem_config.cache_clear()
    assert _self_attention_config((4, 32, 2048, 128)) == tuned[128]
    fg._problem_config.cache_clear()


def test_forward_head_group_fits_the_l2_cache(monkeypatch):
    """`problem_config` caps the forward config's head group (the tuned one's, or PERSISTENT_GRID's) at the heads
    whose K and V (2 * N_K * d elements each) fit their share of the device's L2 together: by the keys' length, not
    the queries'; groups that fit and short d-64 problems kept; no cap off CUDA (no cache size)."""
    mib = 2**20
    tuned = fg.GluonConfig(head_group=8)
    monkeypatch.setattr(fg, "default_config", lambda head_dim, dtype: tuned)
    fg._problem_config.cache_clear()
    monkeypatch.setattr(fg, "l2_cache_bytes", lambda device: 60 * mib)
    n_max, fields = fg.PERSISTENT_GRID[128]
    grid = dataclasses.replace(tuned, **fields)
    assert n_max >= 32768 and grid.head_group == 4
    q = torch.empty(1, 32, 32768, 128, dtype=torch.bfloat16, device="meta")
    assert fg.problem_config(q, q) == dataclasses.replace(grid, head_group=1)  # 16 MiB a head
    assert fg.problem_config(q[:, :16, :16384], q[:, :16, :16384]) == dataclasses.replace(grid, head_group=1)
    assert fg.problem_config(q[:, :, :8192], q[:, :, :8192]) == dataclasses.replace(grid, head_group=3)  # 4 MiB
    assert fg.problem_config(q[:, :, :128], q[:, :, :8192]).head_group == 3  # N_K decides
    assert fg.problem_config(q[:, :, :2048], q[:, :, :2048]) == grid  # 1 MiB a head: 4 fit
    longer = torch.empty(1, 2, 2 * n_max, 128, dtype=torch.bfloat16, device="meta")
    assert fg.problem_config(longer, longer) == dataclasses.replace(tuned, head_group=1)  # past it, the tuned one
    d64 = torch.empty(8, 16, 4096, 64, dtype=torch.bfloat16, device="meta")
    assert fg.problem_config(d64, d64) == tuned  # 1 MiB a head: 8 fit
    assert fg.problem_config(d64.float(), d64.float()).head_group == 7  # 4-byte elements: 2 MiB
    fg._problem_config.cache_clear()
    monkeypatch.undo()
    assert fg.l2_cache_bytes(torch.device("cpu")) is None
    fg._problem_config.cache_clear()


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


def test_head_group_fits_the_l2_cache(monkeypatch):
    mib = 2**20
    # `head_bytes` a head, bf16 d 128. Backward (Q, dO and the fp32 dQ, 1 KiB a row): 16 MiB a head at 16384,
    # 32 MiB at 32768, 2 MiB at 2048. Forward (K and V, 512 bytes a row): 8 MiB at 16384, 1 MiB at 2048. The
    # H200's 60 MiB, a quarter of it (L2_SHARE) for the group: 15 MiB.
    assert fg.L2_SHARE == 4
    assert fg.l2_head_group(4, 16 * mib, 16, 60 * mib) == 1
    assert fg.l2_head_group(8, 32 * mib, 32, 60 * mib) == 1
    assert fg.l2_head_group(8, 8 * mib, 16, 60 * mib) == 1
    assert fg.l2_head_group(4, 2 * mib, 128, 60 * mib) == 4  # the tuned group fits: kept
    assert fg.l2_head_group(8, 2 * mib, 128, 60 * mib) == 7
    assert fg.l2_head_group(0, 2 * mib, 16, 60 * mib) == 7  # all 16 heads do not fit
    assert fg.l2_head_group(0, 1 * mib, 8, 60 * mib) == 0  # all 8 heads fit (8 MiB)
    assert fg.l2_head_group(8, 64 * mib, 4, 60 * mib) == 1  # never below one head
    assert fg.l2_head_group(8, 32 * mib, 32, None) == 8  # no cache size known: the tuned group
    monkeypatch.setattr(fgo, "gluon_tuned_fields", lambda kind, head_dim, dtype: dict(head_group=4, num_stages=2))
    tuned = fgo.default_config(128, torch.bfloat16)
    assert tuned == fgo.GluonBwdConfig(head_group=4, num_stages=2)
    assert fgo.default_config(128, torch.bfloat16, 32768, 32, 60 * mib) == dataclasses.replace(tuned, head_group=1)
    assert fgo.default_config(128, torch.bfloat16, 16384, 16, 60 * mib) == dataclasses.replace(tuned, head_group=1)
    assert fgo.default_config(128, torch.bfloat16, 4096, 32, 60 * mib) == dataclasses.replace(tuned, head_group=3)
    assert fgo.default_config(128, torch.bfloat16, 2048, 128, 60 * mib) == tuned
    assert fgo.l2_cache_bytes(torch.device("cpu")) is None
    # What `auto` and a config-less call launch: the cap from the tensor's shape and its device's L2.
    fgo._problem_config.cache_clear()
    monkeypatch.setattr(fgo, "l2_cache_bytes", lambda device: 60 * mib)
    q = torch.empty(1, 32, 32768, 128, dtype=torch.bfloat16, device="meta")
    assert fgo.problem_config(q) == dataclasses.replace(tuned, head_group=1)
    assert fgo.problem_config(q[:, :, :2048]) == tuned
    fgo._problem_config.cache_clear()


def test_bwd_refuses_a_config_the_device_cannot_hold(monkeypatch):
    """A one-pass config whose shared memory exceeds what a block may use (two whole d-128 dQ tiles per group, a
    3-slot ring at d 128) is refused before any build, naming the config and the sizes; the same configs at d 64,
    and the launched ones at d 128, pass."""
    monkeypatch.setattr(fgo, "shared_memory_limit", lambda device: 232448)  # an H100 / H200 block's opt-in maximum
    lse = torch.zeros(1, 2, 320)
    for head_dim, config, fits in ((128, fgo.GluonBwdConfig(dq_buffers=2), False),
                                   (128, fgo.GluonBwdConfig(num_stages=3), False),
                                   (128, fgo.GluonBwdConfig(dq_whole=False, dq_buffers=2), True),
                                   (128, fgo.DEFAULT_BWD_CONFIGS[128], True),
                                   (64, fgo.GluonBwdConfig(num_stages=3, dq_buffers=2), True)):
        q = _cpu((1, 2, 300, head_dim))
        args = (q, q, q, q, q, q, lse, lse, torch.zeros(q.shape), True, config)
        if fits:
            fgo.bwd_launch_args(*args)
        else:
            with pytest.raises(ValueError, match=rf"{re.escape(config.name)} needs \d+ bytes of shared memory at "
                                                 rf"head_dim {head_dim}, more than the 232448"):
                fgo.bwd_launch_args(*args)


def test_bwd_dq_buffers_default_per_head_dim(monkeypatch):
    """`default_config` takes DQ_BUFFERS' dQ tiles per group at d 64 unless the tuned entry sets them, and keeps one
    at d 128, where two whole tiles per group would not fit shared memory."""
    monkeypatch.setattr(fgo, "gluon_tuned_fields", lambda kind, head_dim, dtype: dict(head_group=4, dk_late=True))
    assert fgo.default_config(64, torch.bfloat16) == fgo.GluonBwdConfig(head_group=4, dk_late=True, dq_buffers=2)
    assert fgo.default_config(128, torch.bfloat16) == fgo.GluonBwdConfig(head_group=4, dk_late=True)
    assert fgo.default_config(128, torch.bfloat16).shared_bytes(128) + 2 * 64 * 128 * 4 > 227 * 1024
    monkeypatch.setattr(fgo, "gluon_tuned_fields", lambda kind, head_dim, dtype: dict(head_group=4, dq_buffers=1))
    assert fgo.default_config(64, torch.bfloat16).dq_buffers == 1  # the file's value wins
    monkeypatch.setattr(fgo, "gluon_tuned_fields", lambda kind, head_dim, dtype: None)
    assert fgo.default_config(64, torch.float16) == dataclasses.replace(fgo.DEFAULT_BWD_CONFIGS[64], dq_buffers=2)


def test_bwd_refuses_cpu_and_bad_lse():
    q = _cpu((1, 2, 64, 128))
    with pytest.raises(ValueError, match="gluon_attention_bwd"):
        fgb.gluon_attention_bwd(q, q, q, q, torch.zeros(1, 2, 64), q, True)


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
            fgb.gluon_attention_bwd(*args, True)


@needs_gluon
def test_launch_keys_cover_what_the_arguments_specialise_on(monkeypatch):
    """The launchers' problem keys (`launch(..., key)`) stand for every argument's specialisation: equal for fresh
    tensors of one geometry, different for another stride, is_causal, config, or an L / O pointer off 16 bytes."""
    keys = []
    record = lambda kernel, grid, args, meta, key=None: keys.append((kernel, key))  # noqa: E731
    monkeypatch.setattr(fg, "launch", record)
    monkeypatch.setattr(fgb, "launch", record)

    def misaligned(shape):  # contiguous, 4 bytes past a 16-byte boundary
        return torch.zeros(math.prod(shape) + 1)[1:].view(shape)

    q, lse = _cpu((1, 2, 64, 128)), torch.zeros(1, 2, 64)
    two_pass, one_pass = fgb.DEFAULT_BWD2_CONFIGS[128], fgo.default_config(128, torch.bfloat16)
    calls = [(q, q, lse, True, two_pass), (q.clone(), q.clone(), lse.clone(), True, two_pass),
             (q, q, misaligned((1, 2, 64)), True, two_pass), (q, q, lse, False, two_pass),
             (q, q, lse, True, one_pass), (q, q.transpose(1, 2).contiguous().transpose(1, 2), lse, True, two_pass)]
    per_call = []
    for k, out, lse_t, causal, config in calls:
        keys.clear()
        fgb.launch_bwd(q, k, k, out, lse_t, q, causal, config)
        per_call.append(list(keys))
    assert per_call[0] == per_call[1]
    assert all(per_call[0] != other for other in per_call[2:]), per_call
    keys.clear()
    fg.launch_fwd(q, q, q, True, fg.default_config(128, torch.bfloat16))
    fg.launch_fwd(q.clone(), q.clone(), q.clone(), True, fg.default_config(128, torch.bfloat16))
    fg.launch_fwd(q, q, q, False, fg.default_config(128, torch.bfloat16))
    assert keys[0] == keys[1] != keys[2]


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
    config = dataclasses.replace(fgo.DEFAULT_BWD_CONFIGS[head_dim], persistent=persistent,
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
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{fg.LOADER_REGS};" in ptx
    # rows_tma: L and D by the loader's 1-D TMA loads, no consumer loads them from global memory.
    assert ("cp.async.bulk.tensor.1d" in ptx) == config.rows_tma
    assert ("ld.global" in ptx) != config.rows_tma
    if persistent and head_dim == 64:  # (at d 128 the loop over work items costs the causal consumers more spills)
        assert "0 bytes spill stores" in compiled.ptxas_log


ALT_BWD2_CONFIGS = {64: fgb.GluonBwd2Config(dkdv_block_m=32, dkdv_stages=3, dq_block_n=64),
                    128: fgb.GluonBwd2Config(dkdv_block_m=64, dkdv_stages=2, dq_block_n=128)}
"""Per head dim, the two-pass config the check sweep times beside the default (the other tile of each kernel)."""


def test_bwd2_config_rules():
    with pytest.raises(ValueError, match="dkdv_block_m"):
        fgb.GluonBwd2Config(dkdv_block_m=128)
    with pytest.raises(ValueError, match="dq_stages"):
        fgb.GluonBwd2Config(dq_stages=0)
    config = fgb.GluonBwd2Config(dkdv_block_m=64, dkdv_stages=2, dq_block_n=64, dq_stages=3)
    # dK/dV: K, V of two consumers (4 x 64 x 128) and the Q/dO ring (2 x 2 x 64 x 128); dQ: Q, dO of two consumers
    # (4 x 64 x 128) and the K/V ring (2 x 3 x 64 x 128); bf16.
    assert config.shared_bytes(128) == (2 * 128 * (4 * 64 + 4 * 64), 2 * 128 * (4 * 64 + 6 * 64))
    assert config.registers() == fg.GluonConfig(num_consumers=2).registers()
    assert config.name != fgb.GluonBwd2Config().name


def test_bwd_refuses_unknown_mode():
    q = _cpu((1, 2, 64, 128))
    with pytest.raises(ValueError, match="mode"):
        fgb.gluon_attention_bwd(q, q, q, q, torch.zeros(1, 2, 64), q, True, mode="three_pass")


@pytest.fixture
def gluon_runs_anywhere(monkeypatch):
    """`gluon_bwd_chosen`'s rules on the CPU: the Gluon kernels' own support check answers "runs"."""
    import kernels.attention.interface as fa
    monkeypatch.setattr(fa, "gluon_unsupported", lambda q, k, v: "")
    monkeypatch.delenv(fa.PATH_ENV, raising=False)
    monkeypatch.delenv(fa.BWD_ENV, raising=False)
    return fa


@pytest.mark.parametrize("path, bwd, shape, chosen", [
    ("gluon", "auto", (1, 2, 300, 64), True),             # the gluon path: its own backward, any size
    ("gluon", "one_pass", (1, 2, 300, 128), True),
    ("gluon", "two_pass", (1, 2, 300, 128), False),       # two_pass: the deterministic tl kernels
    ("auto", "auto", (1, 16, 16384, 128), True),          # auto: d 128 from GLUON_BWD_AUTO_MIN_WORK (2^36) on
    ("auto", "auto", (4, 32, 2048, 128), True),
    ("auto", "auto", (2, 32, 2048, 128), False),          # (below it)
    ("auto", "auto", (8, 16, 4096, 64), True),            # d 64 from 2^37 on (dQ whole per group)
    ("auto", "auto", (4, 16, 4096, 64), False),           # (below it)
    ("auto", "auto", (1, 2, 4096, 80), False),            # (other head dims: the tl kernels)
    ("tma", "auto", (1, 16, 16384, 128), False),
    ("portable", "one_pass", (1, 16, 16384, 128), False),
])
def test_gluon_bwd_rule(gluon_runs_anywhere, path, bwd, shape, chosen):
    fa = gluon_runs_anywhere
    q = torch.empty(shape, device="meta")
    assert fa.gluon_bwd_chosen(path, bwd, q, q, q) is chosen


@pytest.mark.parametrize("shape, chosen", [
    ((1, 16, 16384, 128), True),
    ((4, 32, 2048, 128), True),      # d 128 from 2^36 on
    ((2, 32, 2048, 128), False),     # (below it)
    ((8, 16, 4096, 64), True),       # d 64 from 2^37 on
    ((4, 16, 4096, 64), False),      # (below it)
    ((1, 16, 16384, 64), True),
])
def test_gluon_forward_rule(gluon_runs_anywhere, shape, chosen):
    fa = gluon_runs_anywhere
    q = torch.empty(shape, device="meta")
    assert (fa.resolve_path("auto", q, q, q, forward=True) == "gluon") is chosen
    assert fa.resolve_path("gluon", q, q, q, forward=True) == "gluon"


def test_gluon_bwd_rule_follows_determinism_and_support(gluon_runs_anywhere, monkeypatch):
    fa = gluon_runs_anywhere
    q = torch.empty((1, 16, 16384, 128), device="meta")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not fa.gluon_bwd_chosen("gluon", "auto", q, q, q)  # auto: deterministic kernels when asked for
    assert fa.gluon_bwd_chosen("gluon", "one_pass", q, q, q)  # one_pass asked for explicitly
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    monkeypatch.setenv(fa.BWD_ENV, "two_pass")
    assert not fa.gluon_bwd_chosen("gluon", None, q, q, q)  # None reads RAYSYS_FLASH_BWD
    monkeypatch.setattr(fa, "gluon_unsupported", lambda q, k, v: "no sm_90 GPU")
    assert not fa.gluon_bwd_chosen("gluon", "one_pass", q, q, q)


def _compile_sm90_bwd2(config: fgb.GluonBwd2Config, head_dim: int, dtype: torch.dtype, causal: bool, release=None):
    """(dK/dV kernel, dQ kernel), built for sm_90 from the launcher's own arguments."""
    return tuple(sm90_build("bwd2", config, head_dim, dtype, causal, triton=release))


@pytest.mark.slow
@needs_gluon
@over_tritons
@pytest.mark.parametrize("head_dim, causal, dtype", [(64, True, torch.bfloat16), (128, True, torch.bfloat16),
                                                     (128, False, torch.float16)])
def test_bwd2_compiles_for_sm90_without_spills(head_dim, causal, dtype, release):
    config = fgb.DEFAULT_BWD2_CONFIGS[head_dim]
    for compiled, shared in zip(_compile_sm90_bwd2(config, head_dim, dtype, causal, release),
                                config.shared_bytes(head_dim)):
        ptx = compiled.ptx
        assert compiled.cubin and compiled.shared >= shared
        # Two products in flight (S and dP), no atomics (dQ deterministic), the consumer/producer register split.
        assert "wgmma.wait_group.sync.aligned 1;" in ptx
        assert "atom.global" not in ptx and "red.global" not in ptx
        assert f"setmaxnreg.inc.sync.aligned.u32 \t{config.registers()[1]};" in ptx
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{fg.LOADER_REGS};" in ptx
        # No spills, and no wgmma serialisation (C7512: what an accumulator carried in flight across the loop gives).
        log = compiled.ptxas_log
        assert " 0 bytes spill stores, 0 bytes spill loads" in log and "C7512" not in log, log


@pytest.mark.slow
@needs_gluon
@over_tritons
def test_bwd2_dq_exp2s_run_under_dp_sm90(release):
    """SASS of the dQ loop: the dP wait (DEPBAR <= 0) comes after the exp2s of P, which follow the S wait."""
    import re

    _, dq = _compile_sm90_bwd2(fgb.DEFAULT_BWD2_CONFIGS[128], 128, torch.bfloat16, True, release)
    ops = re.findall(r"(HGMMA|WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2)", dq.sass)
    first = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert ops[first - 1] == "HGMMA" and ops[first + 1] == "MUFU.EX2"
    assert ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", first) > first + 8


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
    base = fg.default_config(q_shape[-1], dtype)
    if base.num_consumers != 2 or base.persistent or base.head_group:
        base = fg.DEFAULT_CONFIGS[q_shape[-1]]
    monkeypatch.setattr(fg, "num_sms", lambda device: 16)
    items = triton.cdiv(q_shape[2], 2 * base.block_m) * q_shape[0] * q_shape[1]
    assert items > 2 * 16 and (q_shape[0] * q_shape[1]) % 5
    want = fg.gluon_attention_fwd(q, k, v, causal, config=base)
    ref_out, _ = _reference(q, k, v, causal)
    for config in (dataclasses.replace(base, persistent=True), dataclasses.replace(base, head_group=5),
                   dataclasses.replace(base, persistent=True, head_group=5),
                   dataclasses.replace(base, persistent=True, round_robin=True),
                   dataclasses.replace(base, persistent=True, head_group=5, round_robin=True)):
        got = fg.gluon_attention_fwd(q, k, v, causal, config=config)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), config.name
    assert (want[0].float() - ref_out).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 4e-3)


if fg.HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _exp2_probe(x_ptr, y_ptr, EXP2_EMULATED: gl.constexpr, N: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
        offs = gl.arange(0, N, layout=layout)
        gl.store(y_ptr + offs, fg._exp2(gl.load(x_ptr + offs), EXP2_EMULATED))


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
    config = dataclasses.replace(fg.DEFAULT_CONFIGS[q_shape[-1]], exp2_emulated=every)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, config=config)
    ref_out, ref_lse = _reference(q, k, v, causal)
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
    config = dataclasses.replace(fg.DEFAULT_CONFIGS[q_shape[-1]], rescale_under_s=True, persistent=persistent)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal, config=config)
    ref_out, ref_lse = _reference(q, k, v, causal)
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
    assert fg.supported(q, k, v)
    out, lse = fg.gluon_attention_fwd(q, k, v, causal)
    ref_out, ref_lse = _reference(q, k, v, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q_shape[:3]
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert (lse - ref_lse).abs().max().item() <= tol
    # Same units as the tl kernels' L (natural log), so their backward can consume it.
    from kernels.attention.interface import flash_attention_fwd
    if q_shape[2] == n_k or not causal:
        _, tl_lse = flash_attention_fwd(q, k, v, causal)
        assert (lse - tl_lse).abs().max().item() <= tol


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 6e-3)])
@pytest.mark.parametrize("q_shape, n_k, causal", [
    ((1, 3, 1000, 128), 1000, True), ((1, 3, 1000, 128), 1000, False), ((2, 2, 777, 64), 777, True),
    ((1, 2, 513, 128), 1029, False), ((1, 2, 1029, 64), 513, True), ((1, 2, 513, 128), 1029, True)])
@pytest.mark.parametrize("mode, alt", [("two_pass", False), ("two_pass", True), ("one_pass", False),
                                       ("one_pass", "halves"), ("one_pass", "dk_late"),
                                       ("one_pass", "rows_global"), ("one_pass", "dq_buffers")])
def test_bwd_matches_fp32_autograd(q_shape, n_k, causal, dtype, tol, mode, alt):
    """Both backwards against fp32 autograd: the two-pass with its default and alternative configs, the one-pass
    with the config `auto` picks, with dQ in head-dim halves per group, with dK's wgmma after the dS^T store, with
    L and D loaded from global memory (`rows_tma=False`), and with two dQ tiles per group (`dq_buffers`; at d 128
    with the halves, which leave shared memory for them)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_shape = q_shape[:2] + (n_k, q_shape[-1])
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    do = torch.randn(q_shape, generator=gen, device="cuda").to(dtype)  # a non-unit upstream gradient
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    _reference(qf, kf, vf, causal)[0].backward(do.float())
    out, lse = fg.gluon_attention_fwd(q, k, v, causal)
    if mode == "one_pass" and alt:
        config = dataclasses.replace(fgo.DEFAULT_BWD_CONFIGS[q_shape[-1]],
                                     dq_whole=not (alt == "halves" or (alt == "dq_buffers" and q_shape[-1] == 128)),
                                     dk_late=alt == "dk_late", rows_tma=alt != "rows_global",
                                     dq_buffers=2 if alt == "dq_buffers" else 1)
    else:
        config = ALT_BWD2_CONFIGS[q_shape[-1]] if alt else None
    grads = fgb.gluon_attention_bwd(q, k, v, out, lse, do, causal, config=config, mode=mode)
    for name, g, ref, t in zip("qkv", grads, (qf.grad, kf.grad, vf.grad), (q, k, v)):
        assert g.dtype == dtype and g.shape == t.shape, name
        # Max error relative to the largest gradient: P and dS are rounded to the input dtype (2^-9 bf16, 2^-12
        # fp16) and summed over ~1000 terms; a wrong row, tail or mask shows up as O(1).
        assert ((g.float() - ref).abs().max() / ref.abs().max()).item() <= tol, name
    if mode == "one_pass" or alt:
        return
    # Through autograd too (the two-pass default).
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    fgb.gluon_attention(qa, ka, va, causal).backward(do)
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
    _reference(qf, kf, vf, causal)[0].backward(do.float())
    out, lse = fg.gluon_attention_fwd(q, k, v, causal)
    if knobs.get("dq_buffers") == 2 and q_shape[-1] == 128:
        knobs = dict(knobs, dq_whole=False)  # two whole d-128 dQ tiles per group do not fit shared memory
    base = fgo.GluonBwdConfig(num_stages=3 if q_shape[-1] == 64 else 2, **knobs)
    monkeypatch.setattr(fgo, "num_sms", lambda device: 16)
    items = triton.cdiv(n_k, 2 * fgo.BWD_BLOCK_N) * q_shape[0] * q_shape[1]
    assert items > 2 * 16 and (q_shape[0] * q_shape[1]) % 5
    want = fgb.gluon_attention_bwd(q, k, v, out, lse, do, causal, config=base, mode="one_pass")
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    for config in (dataclasses.replace(base, persistent=True), dataclasses.replace(base, persistent=True,
                                                                                   head_group=5)):
        got = fgb.gluon_attention_bwd(q, k, v, out, lse, do, causal, config=config, mode="one_pass")
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), config.name
        assert ((got[0].float() - want[0].float()).abs().max() / want[0].float().abs().max()).item() <= rounding
        for name, g, ref in zip("qkv", got, (qf.grad, kf.grad, vf.grad)):
            tol = 3e-2 if dtype == torch.bfloat16 else 6e-3  # as test_bwd_matches_fp32_autograd's
            assert ((g.float() - ref).abs().max() / ref.abs().max()).item() <= tol, (config.name, name)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd2_is_deterministic(head_dim):
    """Two two-pass backwards of the same inputs give bitwise equal dQ, dK, dV (no atomics anywhere)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn((2, 3, 1537, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
                   for _ in range(4))
    out, lse = fg.gluon_attention_fwd(q, k, v, True)
    first = fgb.gluon_attention_bwd(q, k, v, out, lse, do, True, mode="two_pass")
    for _ in range(2):
        again = fgb.gluon_attention_bwd(q, k, v, out, lse, do, True, mode="two_pass")
        for name, a, b in zip("qkv", first, again):
            assert torch.equal(a, b), name


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


def test_launch_builds_once_per_specialisation(monkeypatch):
    """`launch`: the first call of a specialisation builds it (Triton's warmup, then loading it), every call runs the
    compiled kernel with every parameter in order (constexprs from the keyword arguments, not the options) and the
    grid padded to 3-D; a new int value, a misaligned tensor or other keywords build again."""
    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def _init_handles(self):
            calls.append(("load",))

        def launch_metadata(self, grid, stream, *args):
            return ("md", grid)

        def run(self, *args):
            calls.append(("run", args))

    class Kernel:
        params = [type("P", (), {"name": n})() for n in ("x", "n", "scale", "BLOCK", "CAUSAL")]

        def warmup(self, *args, grid, **meta):
            calls.append(("build", grid, args, meta))
            return Compiled()

    monkeypatch.setattr(fg, "current_device", lambda: 0)
    monkeypatch.setattr(fg, "raw_stream", lambda device: 7)
    monkeypatch.setattr(fg, "_COMPILED", {})
    kernel, x = Kernel(), torch.zeros(64)
    meta = dict(BLOCK=64, CAUSAL=True, num_warps=4)
    fg.launch(kernel, (3,), (x, 100, 0.5), meta)
    fg.launch(kernel, (5, 2), (x, 100, 0.25), meta)
    assert [c[0] for c in calls] == ["build", "load", "run", "run"]
    assert calls[0][1:] == ((3,), (x, 100, 0.5), meta)
    hooks = triton.knobs.runtime
    assert calls[2][1][:3] == (3, 1, 1)
    assert calls[3][1] == (5, 2, 1, 7, "fn", "meta", ("md", (5, 2, 1)), hooks.launch_enter_hook,
                           hooks.launch_exit_hook, x, 100, 0.25, 64, True)
    built = lambda: sum(c[0] == "build" for c in calls)  # noqa: E731
    fg.launch(kernel, (3,), (x, 101, 0.5), meta)             # another int value
    fg.launch(kernel, (3,), (x[1:], 100, 0.5), meta)         # 4 bytes off 16-byte alignment
    fg.launch(kernel, (3,), (x, 100, 0.5), dict(meta, num_warps=8))
    assert built() == 4
    fg.launch(kernel, (3,), (x.clone(), 100, 0.5), meta)     # another aligned tensor: the compiled kernel
    assert built() == 4 and calls[-1][0] == "run"
    monkeypatch.setattr(fg, "_CACHE_MAX", len(fg._COMPILED))  # full: a new specialisation starts it afresh
    fg.launch(kernel, (3,), (x, 102, 0.5), meta)
    assert built() == 5 and len(fg._COMPILED) == 1
    # The caller's key stands for the arguments' keys: the same key runs the compiled kernel whatever the values.
    monkeypatch.setattr(fg, "_CACHE_MAX", 4096)
    fg.launch(kernel, (3,), (x, 100, 0.5), meta, ("problem", 1))
    fg.launch(kernel, (4,), (x, 103, 0.5), meta, ("problem", 1))
    fg.launch(kernel, (3,), (x, 100, 0.5), meta, ("problem", 2))
    runs = [c for c in calls if c[0] == "run"]
    assert built() == 7 and runs[-2][1][:3] == (4, 1, 1)


def test_launch_probe_names_a_build_failure_once(monkeypatch):
    """A specialisation whose build fails (compile or load) is a `BuildFailed` naming the kernel, the Triton and the
    innermost error's first line, at its first call and, without building again, at every later one; nothing runs."""
    tries = []

    def gluon_error():
        try:
            raise RuntimeError("async_copy_shared_to_global has been removed; call async_store instead")
        except RuntimeError as inner:
            raise triton.CompilationError("    tma.async_copy_shared_to_global(o_desc, ...)\n    ^", None) from inner

    class Kernel:
        __name__ = "_gluon_attn_fwd_kernel"
        params = []

        def warmup(self, *args, grid, **meta):
            tries.append(grid)
            gluon_error()

    monkeypatch.setattr(fg, "current_device", lambda: 0)
    monkeypatch.setattr(fg, "_COMPILED", {})
    monkeypatch.setattr(fg, "_FAILED", {})
    kernel = Kernel()
    for _ in range(2):
        with pytest.raises(fg.BuildFailed, match=r"_gluon_attn_fwd_kernel does not build on Triton .*: RuntimeError: "
                                                 r"async_copy_shared_to_global has been removed"):
            fg.launch(kernel, (3,), (), {}, ("problem", 1))
    assert tries == [(3,)]


@needs_gluon
def test_tensor_descriptor_checks_once_per_layout_and_always_the_base(monkeypatch):
    """`tensor_descriptor`: the first descriptor of a (shape, strides, dtype, block, layout) is Triton's own, checked;
    later ones carry the same fields over their own base (no field shared with another's base); a misaligned base
    is refused on every call; other strides make a new checked descriptor."""
    monkeypatch.setattr(fg, "_DESCRIPTOR_FIELDS", {})
    checked = []
    monkeypatch.setattr(fg.TensorDescriptor, "__post_init__", lambda self, real=fg.TensorDescriptor.__post_init__:
                        (checked.append(self.shape), real(self)))
    a, b = _cpu((2, 3, 200, 128)), _cpu((2, 3, 200, 128))
    first, second = fg._descriptor(a, 64), fg._descriptor(b, 64)
    want = fg.TensorDescriptor.from_tensor(b, [1, 1, 64, 128], fg.shared_layout((1, 1, 64, 128), torch.bfloat16))
    fields = lambda d: {k: list(v) if isinstance(v, tuple) else v for k, v in vars(d).items()  # noqa: E731
                        if k != "base"}
    assert fields(second) == fields(want) and second.base is b and first.base is a
    assert len(checked) == 2  # the first descriptor and `want`; not the second
    with pytest.raises(ValueError, match="16-byte aligned"):
        fg.tensor_descriptor(_cpu((2 * 3 * 200 * 128 + 8,)).narrow(0, 1, 2 * 3 * 200 * 128).view(2, 3, 200, 128),
                             [1, 1, 64, 128], fg.shared_layout((1, 1, 64, 128), torch.bfloat16))
    strided = _cpu((2, 200, 3, 128)).transpose(1, 2)
    assert tuple(fg._descriptor(strided, 64).strides) == strided.stride() and len(checked) == 3


@needs_gluon
def test_gluon_outputs_come_out_in_the_inputs_layout(monkeypatch):
    """The Gluon launchers allocate O like q and dQ, dK, dV like q, k, v (the model's (B, S, H, D) projections viewed
    as (B, H, S, D)): merging O's heads and the projections' backward read views, not copies. L stays contiguous."""
    monkeypatch.setattr(fg, "launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(fgb, "launch", lambda *args, **kwargs: None)
    q, k = _cpu((1, 200, 2, 128)).transpose(1, 2), _cpu((1, 150, 2, 128)).transpose(1, 2)
    for config in (fg.default_config(128, torch.bfloat16), dataclasses.replace(fg.DEFAULT_CONFIGS[128], persistent=True)):
        out, lse = fg.launch_fwd(q, k, k, True, config)
        assert out.stride() == q.stride() and lse.is_contiguous() and lse.shape == q.shape[:-1]
    for config in (fgb.DEFAULT_BWD2_CONFIGS[128], fgo.default_config(128, torch.bfloat16)):
        dq, dk, dv = fgb.launch_bwd(q, k, k, out, lse, q, True, config)
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), k.stride())


# ----------------------------------------------------------------------------------------------------------
# Seeded fuzz of the dispatch's gluon path against fp64 attention, per head
# ----------------------------------------------------------------------------------------------------------
FUZZ_EDGES = [  # (B, H, n_q, n_k, d, dtype, causal, layout): the shapes an earlier fuzz found wrong, and the edges
    (2, 1, 1, 1, 128, torch.float16, True, "bhnd"), (2, 4, 1, 1, 64, torch.bfloat16, True, "bshd"),
    (3, 4, 4097, 1, 64, torch.bfloat16, False, "bhnd"), (2, 4, 1, 1, 64, torch.float16, True, "bhnd"),
    (1, 1, 1, 1, 64, torch.bfloat16, False, "bshd"), (1, 3, 1, 300, 128, torch.bfloat16, False, "bhnd"),
    (1, 2, 300, 1, 128, torch.float16, False, "bshd"), (1, 1, 17, 17, 64, torch.bfloat16, True, "bhnd"),
    (1, 2, 127, 127, 128, torch.bfloat16, True, "bshd"), (1, 2, 129, 129, 64, torch.float16, True, "bhnd"),
    (2, 3, 300, 300, 128, torch.bfloat16, False, "bshd"), (1, 2, 4097, 4097, 64, torch.bfloat16, True, "bshd"),
    (1, 2, 1000, 777, 128, torch.bfloat16, False, "bhnd"), (1, 2, 777, 1000, 64, torch.float16, False, "bshd"),
    (1, 1, 2, 2, 128, torch.bfloat16, True, "bhnd"), (1, 1, 65, 65, 128, torch.float16, True, "bshd"),
]


def _fuzz_cases(count: int = 18, seed: int = 2026) -> list[tuple]:
    """FUZZ_EDGES and `count` seeded draws: 1-3 sequences of 1-5 heads, lengths log-uniform in [1, 3000]."""
    import random

    rng = random.Random(seed)
    cases = list(FUZZ_EDGES)
    for _ in range(count):
        n_q = int(round(math.exp(rng.uniform(0, math.log(3000)))))
        causal = rng.random() < 0.5
        n_k = n_q if causal else int(round(math.exp(rng.uniform(0, math.log(3000)))))
        cases.append((rng.randint(1, 3), rng.randint(1, 5), n_q, n_k, rng.choice([64, 128]),
                      rng.choice([torch.bfloat16, torch.float16]), causal, rng.choice(["bhnd", "bshd"])))
    return cases


FUZZ_AUTO = [  # above `auto`'s thresholds (GLUON_AUTO_MIN_WORK / GLUON_BWD_AUTO_MIN_WORK): what the model meets
    (2, 4, 8197, 8197, 128, torch.bfloat16, True, "bshd"), (1, 2, 16385, 16385, 128, torch.bfloat16, True, "bshd"),
    (1, 8, 16385, 16385, 64, torch.bfloat16, True, "bhnd"),
]


def _fuzz_inputs(case, gen):
    batch, heads, n_q, n_k, d, dtype, causal, layout = case

    def make(n):
        if layout == "bshd":  # the model's projections, viewed as (B, H, N, d)
            return torch.randn(batch, n, heads, d, generator=gen, device=gen.device).to(dtype).transpose(1, 2)
        return torch.randn(batch, heads, n, d, generator=gen, device=gen.device).to(dtype)

    return make(n_q), make(n_k), make(n_k), make(n_q)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b lie in memory alike: the same shape and strides, a length-1 dimension's stride aside (it addresses
    nothing; `view` and autograd may set it to anything)."""
    return a.shape == b.shape and all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _fuzz_head(q, k, v, do, causal):
    """fp64 attention of one head: O, dQ, dK, dV and, for each, its first-order error scale (the same sums over
    absolute values: what rounding of every term can move it by, which cancellation can make far larger than the
    value itself, e.g. dQ = dK = 0 exactly when there is one key)."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.T * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v
    dp = do @ v.T
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    ds_scale = p * (do.abs() @ v.abs().T + (do * o).abs().sum(-1, keepdim=True))
    values = {"o": o, "dq": ds @ k * scale, "dk": ds.T @ q * scale, "dv": p.T @ do}
    scales = {"o": p @ v.abs(), "dq": ds_scale @ k.abs() * scale, "dk": ds_scale.T @ q.abs() * scale,
              "dv": p.T @ do.abs()}
    return values, scales


def _fuzz_check(case, path: str, gen, corrupt=None) -> dict[str, float]:
    """Run `flash_attention` on the case through autograd; per tensor, ||got - fp64|| / max(||fp64||, eps * ||scale||)
    over all heads (a relative error, floored where cancellation leaves the value far below its error scale).
    `corrupt(got)` may alter the results first (the CPU test of the check itself)."""
    import kernels.attention.interface as fa

    batch, heads, n_q, n_k, d, dtype, causal, layout = case
    q, k, v, do = _fuzz_inputs(case, gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa.flash_attention(*leaves, causal, path=path)
    out.backward(do)
    got = {"o": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if corrupt is not None:
        corrupt(got)
    assert all(_same_layout(g, t) for g, t in zip(got.values(), (q, q, k, v))), [g.stride() for g in got.values()]
    sums = {name: [0.0, 0.0, 0.0] for name in got}  # ||err||^2, ||ref||^2, ||scale||^2
    for b in range(batch):
        for h in range(heads):
            values, scales = _fuzz_head(q[b, h], k[b, h], v[b, h], do[b, h], causal)
            for name, ref in values.items():
                assert torch.isfinite(got[name][b, h]).all(), (case, name)
                sums[name][0] += (got[name][b, h].double() - ref).square().sum().item()
                sums[name][1] += ref.square().sum().item()
                sums[name][2] += scales[name].square().sum().item()
    eps = torch.finfo(dtype).eps
    return {name: math.sqrt(err) / max(math.sqrt(ref), eps * math.sqrt(scale))
            for name, (err, ref, scale) in sums.items()}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _fuzz_cases(), ids=lambda c: "x".join(map(str, c[:5])) + f"-{str(c[5])[6:]}"
                         f"-{'causal' if c[6] else 'full'}-{c[7]}")
def test_gluon_path_fuzz_matches_fp64_attention(case):
    """Forced `path="gluon"` (its forward and one-pass backward), n_q = 1, n_k = 1, one head, one sequence, lengths that
    are no multiple of any tile, both layouts: O, dQ, dK, dV within bf16's / fp16's tolerance of fp64 attention per
    head (`_fuzz_check`), outputs in the inputs' layouts."""
    errors = _fuzz_check(case, "gluon", torch.Generator(device="cuda").manual_seed(hash(case[:5]) % 2**31))
    tol = 2e-2 if case[5] == torch.bfloat16 else 4e-3
    assert max(errors.values()) <= tol, (case, errors)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", FUZZ_AUTO, ids=lambda c: "x".join(map(str, c[:5])))
def test_auto_path_fuzz_matches_fp64_attention(case):
    """`auto` above its Gluon thresholds (what the leaderboard's model runs): the same check."""
    import kernels.attention.interface as fa

    errors = _fuzz_check(case, "auto", torch.Generator(device="cuda").manual_seed(7))
    assert fa.last_paths() == "gluon, one_pass" and max(errors.values()) <= 2e-2, (case, errors, fa.last_paths())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tl kernels on the CPU need the interpreter")
def test_fuzz_check_passes_the_tl_kernels_and_fails_a_wrong_gradient():
    """The fuzz's check itself, on the tl kernels under the interpreter (fp16): the one-key shapes (dQ = dK = 0 in
    exact arithmetic, so a plain relative error divides rounding noise by about zero) and an odd causal shape pass;
    a gradient 2% off, or one entry's dQ wrong, fails."""
    cases = [(2, 1, 1, 1, 128, torch.float16, True, "bhnd"), (3, 2, 97, 1, 64, torch.float16, False, "bshd"),
             (1, 2, 67, 67, 64, torch.float16, True, "bshd")]
    gen = torch.Generator().manual_seed(0)
    for case in cases:
        assert max(_fuzz_check(case, "portable", gen).values()) <= 4e-3, case

    def scaled(got):
        got["dk"].mul_(1.02)

    def one_entry(got):
        got["dq"][0, 0, 5, 3] += 0.5 * got["dq"].abs().max()

    assert _fuzz_check(cases[2], "portable", gen, scaled)["dk"] > 4e-3
    assert _fuzz_check(cases[2], "portable", gen, one_entry)["dq"] > 4e-3
