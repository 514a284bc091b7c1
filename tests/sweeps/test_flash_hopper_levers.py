"""CPU tests of issue 16's levers in the studies: flash_bench's candidates study (its grid, its rows on a machine
without a GPU, how its fastest tma configs and auto path go into the tuned-config file) and flash_tiles' register-
capped variant. The timings themselves need an H200."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

import kernels.attention.triton.tuning as ft
from kernels.attention import dispatch
from sweeps import flash_bench, flash_tiles


def test_every_candidate_is_a_valid_config_set_on_its_path():
    for name, spec in flash_bench.CANDIDATES.items():
        for kernel in ("fwd", "dkdv", "dq"):
            cfg = ft.FlashConfig.from_label(spec[kernel]).check(kernel, spec["path"])
            assert cfg.label() == spec[kernel], name
    trials = flash_bench.grid("candidates", False, candidates=("base_tma_d64", "fwd_lazy_d128"))
    shapes = {(t["seq"], t["head_dim"]) for t in trials}
    assert shapes == {(4096, 64), (32768, 128), (16384, 128), (2048, 128)}  # SDPA rows only beside a candidate
    assert trials[0]["seq"] == 32768  # the leaderboard shape first: a time budget cuts the others
    assert sum(t["provider"] in flash_bench.SDPA_PROVIDERS for t in trials) == 2 * len(shapes)
    checks = flash_bench.grid("candidates", False, candidates=("base_tma_d64",), check_only=True)
    assert [t["provider"] for t in checks] == ["triton_candidate"]
    with pytest.raises(ValueError, match="candidate 'nope' must be one of"):
        flash_bench.candidate_configs("nope")


def test_candidates_without_a_gpu_are_skipped_rows(tmp_path):
    df = flash_bench.main(["--studies", "candidates", "--candidates", "base_tma_d64", "--device", "cpu",
                           "--out", str(tmp_path)])
    assert set(df["status"]) == {"skipped"} and len(df) == 3
    with pytest.raises(ValueError, match="need --studies candidates"):
        flash_bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "x"), "--check-only"])


def _rows(fast_fwd: str, fast_dq: str) -> pd.DataFrame:
    rows = []
    for b, h, n, d in flash_bench.HOPPER_SHAPES:
        for name, spec in flash_bench.CANDIDATES.items():
            if spec["head_dim"] != d:
                continue
            fwd = 0.8 if spec["fwd"] == fast_fwd else 1.0
            bwd = 1.9 if spec["dq"] == fast_dq else 2.0
            rows.append(dict(study="candidates", status="ok", provider="triton_candidate", candidate=name,
                             path=f"{spec['path']}, two_pass", batch=b, heads=h, seq=n, head_dim=d,
                             fwd_config=spec["fwd"], dkdv_config=spec["dkdv"], dq_config=spec["dq"],
                             fwd_median_s=fwd * n / 1e6, bwd_median_s=bwd * n / 1e6, device_name="H200",
                             torch_version="2.11", triton_version="3.6"))
    return pd.DataFrame(rows)


def test_fastest_tma_configs_go_first_in_the_tuned_file(tmp_path):
    df = _rows(fast_fwd="128x64/w8/s2/r128", fast_dq="64x64/w4/s2")
    winners = flash_bench.candidate_winners(df)
    (fwd128,) = [e for e in winners["fwd"] if e["head_dim"] == 128]
    assert ft.FlashConfig.from_label("128x64/w8/s2/r128") == ft._entry_config(fwd128)
    (dkdv128,) = [e for e in winners["dkdv"] if e["head_dim"] == 128]
    assert ft._entry_config(dkdv128).label() == "32x64/w4/s3"  # the dK/dV half of the fastest pair
    assert all(e["path"] == "tma" for entries in winners.values() for e in entries)  # never the portable base
    path = tmp_path / "tuned.json"
    shutil.copy(dispatch.TUNED_CONFIGS_PATH, path)
    before = json.loads(path.read_text())
    flash_bench.write_tuned(df, path)
    after = ft.load_tuned_configs(path)
    for kernel in ("fwd", "dkdv", "dq"):
        assert after[kernel][: len(winners[kernel])] == winners[kernel]
        assert after[kernel][len(winners[kernel]):] == before.get(kernel, [])
    assert after["dkdvq"] == before["dkdvq"]
    assert "candidates study" in json.loads(path.read_text())["note"]
    assert dispatch.tuned_auto_path(path) == "tma"  # the fast tma levers beat the portable baseline on every shape
    slow_tma = df.assign(fwd_median_s=df.fwd_median_s.where(~df.path.str.startswith("tma") | (df.seq != 2048), 9.0))
    assert flash_bench.auto_path(slow_tma) == "portable"  # one shape where no tma candidate keeps up


def test_flash_tiles_register_cap_variant_reaches_the_tuned_file(tmp_path):
    spaces = flash_tiles.param_spaces(False, ("4096/64/bfloat16/causal",), ("tma", "tma_r128"))
    assert {s.get("variant") for s in spaces.values()} == {"tma", "tma_r128"}
    quick = flash_tiles.param_spaces(True, ("4096/64/bfloat16/causal",), ("tma_r128",))
    capped_kernels = {k for k in ft.KERNELS
                      if any(c.maxnreg == 128 for c in ft.candidates(k, torch.bfloat16, path="tma"))}
    assert {s["kernel"] for s in quick.values()} == capped_kernels  # the built-in capped candidates (none interpreted)
    capped = ft.FlashConfig(128, 64, 8, 2, maxnreg=128)
    assert flash_tiles.variant_of(capped, "tma") == "tma_r128"
    assert flash_tiles.variant_of(ft.FlashConfig(128, 64, 8, 2), "tma") == "tma"
    shape = "4096/64/bfloat16/causal"
    rows = [dict(kernel="fwd", tile="128x64", num_warps=8, num_stages=2, shape=shape, status="ok", block_m=128,
                 block_n=64, time_median_s=ms, tflops=1.0, error="", path="tma", variant=variant,
                 warp_specialize=False, persistent=False, maxnreg=cap, **flash_tiles.parse_shape(shape))
            for variant, cap, ms in (("tma", 0, 1e-3), ("tma_r128", 128, 0.8e-3))]
    rows.append({k: v for k, v in rows[0].items() if k != "maxnreg"} | {"tile": "64x64", "block_m": 64,
                                                                         "time_median_s": 2e-3})  # an older row
    df = pd.DataFrame(rows).assign(device_name="H200", torch_version="2.11", triton_version="3.6")
    best = flash_tiles.best_configs(df, min_configs=1)
    assert best["fwd"][0]["maxnreg"] == 128 and best["fwd"][0]["geomean_ms"] == 0.8
    path = tmp_path / "tuned.json"
    flash_tiles.write_tuned(df, best, path)
    assert ft._entry_config(ft.load_tuned_configs(path)["fwd"][0]) == capped
