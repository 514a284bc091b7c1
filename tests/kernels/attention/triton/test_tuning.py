"""Launch configs of the tl kernels (`triton/tuning.py`): labels and knob rules, the causal split's tile rules, the
pruning predicate's budgets as on an H100 / H200, autotuning off taking the tuned file's config, the tuned file."""

from __future__ import annotations

import json

import pytest
import torch

import kernels.attention.triton.tuning as ft


def test_config_labels_and_knob_validation():
    for label in ("128x64/w8/s3", "128x64/w8/s2/r128", "64x64/w4/s3/lazy/u2", "128x32/w8/s3/persistent/r168"):
        assert ft.FlashConfig.from_label(label).label() == label
    cfg = ft.FlashConfig.from_label("128x64/w8/s2/r128/lazy")
    assert (cfg.maxnreg, cfg.lazy_rescale, cfg.unroll) == (128, True, 1)
    assert cfg.launch_meta("fwd")["LAZY_RESCALE"] and "LAZY_RESCALE" not in cfg.launch_meta("dq")
    assert cfg.to_triton("fwd").maxnreg == 128 and ft.FlashConfig.from_triton(cfg.to_triton("fwd")) == cfg
    with pytest.raises(ValueError, match="config label '128x64/w8/q3' must look like"):
        ft.FlashConfig.from_label("128x64/w8/q3")
    with pytest.raises(ValueError, match=r"maxnreg \(100\) must be None or a multiple of 8"):
        ft.FlashConfig(128, 64, maxnreg=100)
    with pytest.raises(ValueError, match=r"unroll \(3\) must be 1, 2 or 4"):
        ft.FlashConfig(128, 64, unroll=3)
    with pytest.raises(ValueError, match="dkdv: lazy_rescale exists in the forward kernel only"):
        ft.FlashConfig(32, 128, lazy_rescale=True).check("dkdv")


def test_portable_path_refuses_tma_knobs():
    with pytest.raises(ValueError, match="exist on the tma path only"):
        ft.FlashConfig(128, 64, 8, 3, warp_specialize=True).check("fwd", "portable")
    assert ft.FlashConfig(128, 64, 8, 3, persistent=True).check("fwd", "tma").label() == "128x64/w8/s3/persistent"
    with pytest.raises(ValueError, match="persistent"):
        ft.FlashConfig(64, 64, persistent=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=24, block_n=16), "block_m \\(24\\) must be a power of two >= 16"),
    (dict(block_m=64, block_n=8), "block_n \\(8\\)"),
    (dict(block_m=64, block_n=16, num_warps=3), "num_warps"),
    (dict(block_m=64, block_n=16, num_stages=0), "num_stages"),
])
def test_flash_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ft.FlashConfig(**kwargs)


def test_tile_divisibility_rules():
    ft.FlashConfig(128, 64).check("fwd").check("dq")
    ft.FlashConfig(32, 128).check("dkdv")
    with pytest.raises(ValueError, match="dkdv: block_n \\(64\\) must be a multiple of block_m \\(128\\)"):
        ft.FlashConfig(128, 64).check("dkdv")
    with pytest.raises(ValueError, match="kernel 'bwd'"):
        ft.FlashConfig(128, 64).check("bwd")


def test_pruning_predicate(monkeypatch):
    """Shared memory and register budgets as on an H100/H200 (227 KiB opt-in shared memory per block)."""
    monkeypatch.setattr(ft, "INTERPRET", False)
    monkeypatch.setattr(ft, "shared_memory_limit", lambda device: 232448)
    cpu, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert ft.config_fits("fwd", ft.FlashConfig(128, 64, 8, 3), 128, bf16, cpu)
    assert not ft.config_fits("fwd", ft.FlashConfig(128, 64, 4, 3), 128, bf16, cpu)   # accumulators spill
    assert not ft.config_fits("fwd", ft.FlashConfig(128, 128, 8, 4), 128, bf16, cpu)  # 256 KiB of tiles
    assert not ft.config_fits("fwd", ft.FlashConfig(64, 128, 4, 2), 64, bf16, cpu)    # divisibility
    assert ft.config_fits("dkdv", ft.FlashConfig(64, 128, 8, 3), 128, bf16, cpu)
    assert not ft.config_fits("dkdv", ft.FlashConfig(64, 128, 4, 3), 128, bf16, cpu)  # dK, dV accumulators
    assert not ft.config_fits("fwd", ft.FlashConfig(128, 64, 8, 3), 128, fp32, cpu)   # fp32 keeps tiles small
    for kernel in ft.KERNELS:  # every head dim and dtype keeps at least one candidate
        for block_d in (16, 32, 64, 128):
            for dtype in (torch.float16, bf16, fp32):
                assert any(ft.config_fits(kernel, c, block_d, dtype, cpu) for c in ft.config_list(kernel))


def test_autotune_off_takes_tuned_config_for_matching_head_dim(monkeypatch):
    monkeypatch.setattr(ft, "INTERPRET", False)
    monkeypatch.setattr(ft, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(ft, "_TUNED", {"fwd": [dict(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                                    head_dim=64, dtype="bfloat16")]})
    monkeypatch.setenv("RAYSYS_FLASH_AUTOTUNE", "0")
    prune = ft.make_pruner("fwd")
    configs = [c.to_triton("fwd") for c in (ft.FlashConfig(128, 64, 8, 3), ft.FlashConfig(64, 64, 4, 2))]
    q = torch.zeros(1, dtype=torch.bfloat16)
    (picked,) = prune(configs, {"Q": q}, BLOCK_D=64, HEAD_DIM=64)
    assert ft.FlashConfig.from_triton(picked) == ft.FlashConfig(64, 64, 4, 2)
    (picked,) = prune(configs, {"Q": q}, BLOCK_D=128, HEAD_DIM=128)  # no tuned entry: first valid
    assert ft.FlashConfig.from_triton(picked) == ft.FlashConfig(128, 64, 8, 3)
    monkeypatch.setenv("RAYSYS_FLASH_AUTOTUNE", "1")  # autotuning benchmarks the tuned file's configs only
    assert [ft.FlashConfig.from_triton(c) for c in prune(configs, {"Q": q}, BLOCK_D=64, HEAD_DIM=64)] == [
        ft.FlashConfig(64, 64, 4, 2)]
    assert len(prune(configs, {"Q": q}, BLOCK_D=128, HEAD_DIM=128)) == 2  # no tuned entry: every valid one
    # The tma path has its own entries: the portable one above is not used there.
    (picked,) = prune(configs, {"Q": q}, BLOCK_D=64, HEAD_DIM=64, USE_TMA=True)
    assert ft.FlashConfig.from_triton(picked) == ft.FlashConfig(128, 64, 8, 3)


def test_load_tuned_configs(tmp_path):
    path = tmp_path / "tuned.json"
    assert ft.load_tuned_configs(path) == {}
    entry = dict(block_m=128, block_n=64, num_warps=8, num_stages=3, head_dim=128, dtype="bfloat16")
    path.write_text(json.dumps({"fwd": [entry]}))
    assert ft.load_tuned_configs(path) == {"fwd": [entry], "dkdv": [], "dq": [], "dkdvq": []}
    path.write_text(json.dumps({"dkdv": [entry]}))  # block_n 64 < block_m 128 breaks the dK/dV rule
    with pytest.raises(ValueError, match="dkdv"):
        ft.load_tuned_configs(path)
    path.write_text(json.dumps({"fwd": [dict(entry, warp_specialize=True)]}))  # a tma knob on the portable path
    with pytest.raises(ValueError, match="tma path only"):
        ft.load_tuned_configs(path)
    path.write_text(json.dumps({"fwd": [dict(entry, warp_specialize=True, path="tma")], "device": ["H200"]}))
    assert ft.load_tuned_configs(path)["fwd"][0]["path"] == "tma"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ft.load_tuned_configs(path)
