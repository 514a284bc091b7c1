"""Which kernels and configs `dispatch` picks: the paths and backward modes asked for or `auto`'s, the Gluon kernels'
thresholds, their configs (the tuned file's, the per-head-dim knobs, PERSISTENT_GRID, head groups fit to the L2 cache).
The rules past the device run on the CPU: tensors pretend to sit on an sm_90 GPU, or the support check answers
"runs"."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels.attention.gluon.backward as fgo
import kernels.attention.gluon.forward as fg
from kernels import device
from kernels.attention import checks, dispatch, flash_attention, flash_attention_fwd
from kernels.attention.triton.tuning import FlashConfig
from tests.kernels.attention.gluon.support import cpu


def test_backward_mode_choice(monkeypatch):
    assert dispatch.resolve_bwd(None, "portable") == dispatch.AUTO_BWD["portable"]
    monkeypatch.setenv(dispatch.BWD_ENV, "one_pass")
    assert dispatch.resolve_bwd(None, "tma") == "one_pass"
    assert dispatch.resolve_bwd("two_pass", "tma") == "two_pass"
    with pytest.raises(ValueError, match="flash backward 'atomic' must be one of auto, two_pass, one_pass"):
        dispatch.resolve_bwd("atomic", "tma")


def test_path_choice(monkeypatch):
    q = torch.zeros(1, 2, 32, 16)
    assert dispatch.resolve_path(None, q, q, q) == "portable"  # CPU: auto never picks tma
    monkeypatch.setenv(dispatch.PATH_ENV, "tma")
    if dispatch.INTERPRET:
        assert dispatch.resolve_path(None, q, q, q) == "tma"
    assert dispatch.resolve_path("portable", q, q, q) == "portable"
    monkeypatch.setenv(dispatch.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="flash path 'fast' must be one of auto, portable, tma, gluon"):
        dispatch.resolve_path(None, q, q, q)
    with pytest.raises(ValueError, match="the tma path needs"):
        dispatch.resolve_path("tma", q, q, torch.zeros(1, 2, 32, 20, dtype=torch.float16))  # rows of 40 bytes


def test_gluon_path_choice(monkeypatch):
    """The gluon forward where it runs (auto, or asked for), the tl kernels elsewhere and for every backward; asked
    for where it cannot run, one line naming the rule."""
    q = torch.zeros(1, 2, 32, 64, dtype=torch.float16)
    assert dispatch.resolve_path("auto", q, q, q, forward=True) == "portable"  # CPU / interpreter
    with pytest.raises(ValueError, match="the gluon path cannot run here: .*(interpreter|Gluon|sm_90)"):
        dispatch.resolve_path("gluon", q, q, q, forward=True)
    with pytest.raises(ValueError, match="the gluon path cannot run here"):
        flash_attention(q, q, q, path="gluon")
    assert dispatch.resolve_path("gluon", q, q, q) == "portable"  # a backward gluon_bwd_chosen declines: tl auto
    # The rules past the device, on tensors that pretend to sit on an sm_90 GPU.
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    monkeypatch.setattr(checks, "HAS_GLUON_HOPPER", True)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    for module in (checks, dispatch):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
    assert dispatch.gluon_unsupported_reason(q, q, q) == ""
    assert dispatch.resolve_path("gluon", q, q, q, forward=True) == "gluon"
    assert dispatch.resolve_path("auto", q, q, q, forward=True) != "gluon"  # too small to hide its launch
    monkeypatch.setattr(dispatch, "GLUON_AUTO_MIN_WORK", {64: q.numel() * 32})
    assert dispatch.resolve_path("auto", q, q, q, forward=True) == "gluon"
    assert dispatch.resolve_path("auto", q, q, q) != "gluon"
    for t, rule in ((q.float(), "bfloat16 or float16"), (torch.zeros(1, 2, 32, 80, dtype=torch.float16), "head dim"),
                    (torch.zeros(1, 2, 32, 128, dtype=torch.float16)[..., ::2], "stride"),
                    (torch.zeros(4096, dtype=torch.float16).as_strided((1, 1, 32, 64), (3, 3, 64, 1)), "stride")):
        assert rule in dispatch.gluon_unsupported_reason(t, t, t)
        assert dispatch.resolve_path("auto", t, t, t, forward=True) != "gluon"
    for module in (checks, dispatch):
        monkeypatch.setattr(module, "capability", lambda device: (8, 0))
    assert "sm_90" in dispatch.gluon_unsupported_reason(q, q, q)
    with pytest.raises(ValueError, match="FlashConfig is a launch config of the tl kernels"):
        flash_attention_fwd(q, q, q, config=FlashConfig(64, 32, 4, 2), path="gluon")


def _self_attention_config(shape):
    return dispatch.gluon_fwd_config(cpu(shape), cpu(shape))


def test_problem_config_takes_the_persistent_grid_up_to_its_length(monkeypatch):
    """`problem_config`: PERSISTENT_GRID's fields over the tuned config up to its length (d 128), the tuned config
    beyond it, at other head dims and when the tuned config has three consumer groups."""
    tuned = {64: fg.GluonConfig(num_stages=3, persistent=True, head_group=8), 128: fg.GluonConfig(head_group=8)}
    monkeypatch.setattr(dispatch, "gluon_fwd_default", lambda head_dim, dtype, device=None: tuned[head_dim])
    dispatch._gluon_fwd_config.cache_clear()
    n_max, fields = dispatch.PERSISTENT_GRID[128]
    for n in (1, 1000, n_max):
        assert _self_attention_config((4, 32, n, 128)) == dataclasses.replace(tuned[128], **fields)
    assert _self_attention_config((1, 2, n_max + 1, 128)) == tuned[128]
    assert _self_attention_config((8, 16, 1024, 64)) == tuned[64]
    tuned[128] = fg.GluonConfig(block_n=64, num_consumers=3, head_group=8)
    dispatch._gluon_fwd_config.cache_clear()
    assert _self_attention_config((4, 32, 2048, 128)) == tuned[128]
    dispatch._gluon_fwd_config.cache_clear()


def test_forward_head_group_fits_the_l2_cache(monkeypatch):
    """`problem_config` caps the forward config's head group (the tuned one's, or PERSISTENT_GRID's) at the heads
    whose K and V (2 * N_K * d elements each) fit their share of the device's L2 together: by the keys' length, not
    the queries'; groups that fit and short d-64 problems kept; no cap off CUDA (no cache size)."""
    mib = 2**20
    tuned = fg.GluonConfig(head_group=8)
    monkeypatch.setattr(dispatch, "gluon_fwd_default", lambda head_dim, dtype, device=None: tuned)
    dispatch._gluon_fwd_config.cache_clear()
    monkeypatch.setattr(dispatch, "l2_cache_bytes", lambda device: 60 * mib)
    n_max, fields = dispatch.PERSISTENT_GRID[128]
    grid = dataclasses.replace(tuned, **fields)
    assert n_max >= 32768 and grid.head_group == 4
    q = torch.empty(1, 32, 32768, 128, dtype=torch.bfloat16, device="meta")
    assert dispatch.gluon_fwd_config(q, q) == dataclasses.replace(grid, head_group=1)  # 16 MiB a head
    assert dispatch.gluon_fwd_config(q[:, :16, :16384], q[:, :16, :16384]) == dataclasses.replace(grid, head_group=1)
    assert dispatch.gluon_fwd_config(q[:, :, :8192], q[:, :, :8192]) == dataclasses.replace(grid, head_group=3)  # 4 MiB
    assert dispatch.gluon_fwd_config(q[:, :, :128], q[:, :, :8192]).head_group == 3  # N_K decides
    assert dispatch.gluon_fwd_config(q[:, :, :2048], q[:, :, :2048]) == grid  # 1 MiB a head: 4 fit
    longer = torch.empty(1, 2, 2 * n_max, 128, dtype=torch.bfloat16, device="meta")
    assert dispatch.gluon_fwd_config(longer, longer) == dataclasses.replace(tuned, head_group=1)  # past it: the tuned
    d64 = torch.empty(8, 16, 4096, 64, dtype=torch.bfloat16, device="meta")
    assert dispatch.gluon_fwd_config(d64, d64) == tuned  # 1 MiB a head: 8 fit
    assert dispatch.gluon_fwd_config(d64.float(), d64.float()).head_group == 7  # 4-byte elements: 2 MiB
    dispatch._gluon_fwd_config.cache_clear()
    monkeypatch.undo()
    assert device.l2_cache_bytes(torch.device("cpu")) is None
    dispatch._gluon_fwd_config.cache_clear()


def test_head_group_fits_the_l2_cache(monkeypatch):
    mib = 2**20
    # `head_bytes` a head, bf16 d 128. Backward (Q, dO and the fp32 dQ, 1 KiB a row): 16 MiB a head at 16384,
    # 32 MiB at 32768, 2 MiB at 2048. Forward (K and V, 512 bytes a row): 8 MiB at 16384, 1 MiB at 2048. The
    # H200's 60 MiB, a quarter of it (L2_SHARE) for the group: 15 MiB.
    assert dispatch.L2_SHARE == 4
    assert dispatch.l2_head_group(4, 16 * mib, 16, 60 * mib) == 1
    assert dispatch.l2_head_group(8, 32 * mib, 32, 60 * mib) == 1
    assert dispatch.l2_head_group(8, 8 * mib, 16, 60 * mib) == 1
    assert dispatch.l2_head_group(4, 2 * mib, 128, 60 * mib) == 4  # the tuned group fits: kept
    assert dispatch.l2_head_group(8, 2 * mib, 128, 60 * mib) == 7
    assert dispatch.l2_head_group(0, 2 * mib, 16, 60 * mib) == 7  # all 16 heads do not fit
    assert dispatch.l2_head_group(0, 1 * mib, 8, 60 * mib) == 0  # all 8 heads fit (8 MiB)
    assert dispatch.l2_head_group(8, 64 * mib, 4, 60 * mib) == 1  # never below one head
    assert dispatch.l2_head_group(8, 32 * mib, 32, None) == 8  # no cache size known: the tuned group
    monkeypatch.setattr(dispatch, "gluon_tuned_fields", lambda kind, head_dim, dtype, device=None: dict(head_group=4, num_stages=2))
    default = dispatch.gluon_bwd_default
    tuned = default(128, torch.bfloat16)
    assert tuned == fgo.GluonBwdConfig(head_group=4, num_stages=2)
    assert default(128, torch.bfloat16, 32768, 32, 60 * mib) == dataclasses.replace(tuned, head_group=1)
    assert default(128, torch.bfloat16, 16384, 16, 60 * mib) == dataclasses.replace(tuned, head_group=1)
    assert default(128, torch.bfloat16, 4096, 32, 60 * mib) == dataclasses.replace(tuned, head_group=3)
    assert default(128, torch.bfloat16, 2048, 128, 60 * mib) == tuned
    assert device.l2_cache_bytes(torch.device("cpu")) is None
    # What `auto` and a config-less call launch: the cap from the tensor's shape and its device's L2.
    dispatch._gluon_bwd_config.cache_clear()
    monkeypatch.setattr(dispatch, "l2_cache_bytes", lambda device: 60 * mib)
    q = torch.empty(1, 32, 32768, 128, dtype=torch.bfloat16, device="meta")
    assert dispatch.gluon_bwd_config(q) == dataclasses.replace(tuned, head_group=1)
    assert dispatch.gluon_bwd_config(q[:, :, :2048]) == tuned
    dispatch._gluon_bwd_config.cache_clear()


def test_bwd_dq_buffers_default_per_head_dim(monkeypatch):
    """`default_config` takes DQ_BUFFERS' dQ tiles per group at d 64 unless the tuned entry sets them, and keeps one
    at d 128, where two whole tiles per group would not fit shared memory."""
    monkeypatch.setattr(dispatch, "gluon_tuned_fields", lambda kind, head_dim, dtype, device=None: dict(head_group=4, dk_late=True))
    assert dispatch.gluon_bwd_default(64, torch.bfloat16) == fgo.GluonBwdConfig(head_group=4, dk_late=True,
                                                                                dq_buffers=2)
    assert dispatch.gluon_bwd_default(128, torch.bfloat16) == fgo.GluonBwdConfig(head_group=4, dk_late=True)
    assert dispatch.gluon_bwd_default(128, torch.bfloat16).shared_bytes(128) + 2 * 64 * 128 * 4 > 227 * 1024
    monkeypatch.setattr(dispatch, "gluon_tuned_fields", lambda kind, head_dim, dtype, device=None: dict(head_group=4, dq_buffers=1))
    assert dispatch.gluon_bwd_default(64, torch.bfloat16).dq_buffers == 1  # the file's value wins
    monkeypatch.setattr(dispatch, "gluon_tuned_fields", lambda kind, head_dim, dtype, device=None: None)
    assert dispatch.gluon_bwd_default(64, torch.float16) == dataclasses.replace(dispatch.DEFAULT_BWD_CONFIGS[64],
                                                                                dq_buffers=2)


@pytest.fixture
def gluon_runs_anywhere(monkeypatch):
    """`gluon_bwd_chosen`'s rules on the CPU: the Gluon kernels' own support check answers "runs"."""
    monkeypatch.setattr(dispatch, "gluon_unsupported_reason", lambda q, k, v: "")
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    monkeypatch.delenv(dispatch.BWD_ENV, raising=False)
    return dispatch


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
    dispatch = gluon_runs_anywhere
    q = torch.empty(shape, device="meta")
    assert dispatch.gluon_bwd_chosen(path, bwd, q, q, q) is chosen


@pytest.mark.parametrize("shape, chosen", [
    ((1, 16, 16384, 128), True),
    ((4, 32, 2048, 128), True),      # d 128 from 2^36 on
    ((2, 32, 2048, 128), False),     # (below it)
    ((8, 16, 4096, 64), True),       # d 64 from 2^37 on
    ((4, 16, 4096, 64), False),      # (below it)
    ((1, 16, 16384, 64), True),
])
def test_gluon_forward_rule(gluon_runs_anywhere, shape, chosen):
    dispatch = gluon_runs_anywhere
    q = torch.empty(shape, device="meta")
    assert (dispatch.resolve_path("auto", q, q, q, forward=True) == "gluon") is chosen
    assert dispatch.resolve_path("gluon", q, q, q, forward=True) == "gluon"


def test_gluon_bwd_rule_follows_determinism_and_support(gluon_runs_anywhere, monkeypatch):
    dispatch = gluon_runs_anywhere
    q = torch.empty((1, 16, 16384, 128), device="meta")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not dispatch.gluon_bwd_chosen("gluon", "auto", q, q, q)  # auto: deterministic kernels when asked for
    assert dispatch.gluon_bwd_chosen("gluon", "one_pass", q, q, q)  # one_pass asked for explicitly
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    monkeypatch.setenv(dispatch.BWD_ENV, "two_pass")
    assert not dispatch.gluon_bwd_chosen("gluon", None, q, q, q)  # None reads RAYSYS_FLASH_BWD
    monkeypatch.setattr(dispatch, "gluon_unsupported_reason", lambda q, k, v: "no sm_90 GPU")
    assert not dispatch.gluon_bwd_chosen("gluon", "one_pass", q, q, q)
