"""CPU tests of the attention / FlashAttention sweeps: rows, statuses, speedups, tuned-config round trip.

The GPU parts (Triton timings, SDPA backends, Ray Tune trials) need a GPU; here the scripts run their CPU
paths on tiny grids, and the table logic runs on hand-made rows whose answers are known.
"""

from __future__ import annotations

import dataclasses

import json
import sys
import time

import pandas as pd
import pytest
import torch

from sweeps import attention, flash_bench, flash_summary, flash_tiles


def test_flash_bench_cpu_rows(tmp_path):
    df = flash_bench.main(["--study", "target", "--quick", "--device", "cpu", "--out", str(tmp_path),
                           "--providers", "naive,pytorch_tiled,triton,sdpa_flash"])
    on_disk = pd.read_parquet(tmp_path / "flash_bench.parquet")
    assert len(on_disk) == len(df) == 4
    status = dict(zip(df["provider"], df["status"]))
    assert status == {"naive": "ok", "pytorch_tiled": "ok", "triton": "skipped", "sdpa_flash": "skipped"}
    ok = df[df["status"] == "ok"]
    assert (ok[["fwd_median_s", "bwd_median_s", "fwd_bwd_median_s", "fwd_tflops"]] > 0).all().all()
    assert (ok["max_abs_err"] < 1e-5).all()  # fp32 providers against fp32 SDPA
    assert df.loc[df["provider"] == "triton", "error"].str.contains("CUDA").all()


def test_flash_bench_rejects_unknown_provider(tmp_path):
    with pytest.raises(ValueError, match=r"--providers: \[.cutlass.\]"):
        flash_bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--providers", "cutlass"])


def test_speedups_against_each_sdpa_backend():
    shape = dict(study="target", batch=1, heads=16, seq=16384, head_dim=128, dtype="bf16", causal=True, status="ok")
    rows = [dict(shape, provider="triton", fwd_median_s=1.0, bwd_median_s=4.0, fwd_bwd_median_s=5.0),
            dict(shape, provider="sdpa_flash", fwd_median_s=2.0, bwd_median_s=6.0, fwd_bwd_median_s=8.0),
            dict(shape, provider="sdpa_cudnn", fwd_median_s=1.5, bwd_median_s=3.0, fwd_bwd_median_s=4.5),
            dict(shape, provider="naive", status="oom", fwd_median_s=float("nan"), bwd_median_s=float("nan"),
                 fwd_bwd_median_s=float("nan"))]
    df = flash_bench.add_speedups(pd.DataFrame(rows)).set_index("provider")
    assert df.loc["triton", "speedup_fwd_vs_sdpa_flash"] == pytest.approx(2.0)
    assert df.loc["triton", "speedup_fwd_vs_sdpa_cudnn"] == pytest.approx(1.5)
    assert df.loc["triton", "speedup_fwd_vs_best_sdpa"] == pytest.approx(1.5)
    assert df.loc["triton", "speedup_fwd_bwd_vs_best_sdpa"] == pytest.approx(0.9)
    assert df.loc["triton", "speedup_bwd_vs_sdpa_flash"] == pytest.approx(1.5)
    assert pd.isna(df.loc["naive", "speedup_fwd_vs_best_sdpa"])


@pytest.mark.parametrize("rounds", ["-1", "2"])
def test_flash_bench_paired_rounds_rule(tmp_path, rounds):
    with pytest.raises(ValueError, match=f"--paired-rounds \\({rounds}\\) must be"):
        flash_bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--paired-rounds", rounds])
    assert not (tmp_path / "flash_bench.parquet").exists()


def test_flash_tiles_grids_hold_only_valid_configs():
    from kernels.attention.triton.tuning import FlashConfig

    spaces = flash_tiles.param_spaces(False, flash_tiles.SHAPES)
    for kernel, space in spaces.items():
        configs = flash_tiles.grid_configs(space)
        assert len(configs) == (len(flash_tiles.TILES[kernel]) * len(flash_tiles.WARPS) * len(flash_tiles.STAGES)
                                * len(flash_tiles.SHAPES))
        for c in configs:
            m, n = map(int, c["tile"].split("x"))
            FlashConfig(m, n, c["num_warps"], c["num_stages"]).check(kernel)
            flash_tiles.parse_shape(c["shape"])
    with pytest.raises(ValueError, match="shape"):
        flash_tiles.parse_shape("4096/128/int8/causal")


def _tile_row(kernel, tile, warps, stages, shape, ms, status="ok"):
    m, n = map(int, tile.split("x"))
    return dict(kernel=kernel, tile=tile, num_warps=warps, num_stages=stages, shape=shape, status=status,
                block_m=m, block_n=n, time_median_s=ms / 1e3, tflops=100.0 / ms, error="",
                **flash_tiles.parse_shape(shape))


def test_best_configs_round_trip_into_the_kernels_loader(tmp_path):
    from kernels.attention.triton.tuning import load_tuned_configs

    a, b = "16384/128/bfloat16/causal", "4096/128/bfloat16/causal"
    rows = [_tile_row("fwd", "128x64", 8, 3, a, 2.0), _tile_row("fwd", "128x64", 8, 3, b, 0.6),
            _tile_row("fwd", "128x128", 8, 3, a, 1.9), _tile_row("fwd", "128x128", 8, 3, b, 0.9),  # worse geomean
            _tile_row("fwd", "64x64", 4, 2, a, 1.5),  # fastest on a, but never ran on b
            _tile_row("fwd", "64x32", 4, 2, b, 0.1, status="error")]
    best = flash_tiles.best_configs(pd.DataFrame(rows), min_configs=1)
    first = best["fwd"][0]
    assert (first["block_m"], first["block_n"], first["num_warps"], first["num_stages"]) == (128, 64, 8, 3)
    assert first["head_dim"] == 128 and first["dtype"] == "bfloat16"
    per_shape = {e["shape"]: (e["block_m"], e["block_n"]) for e in best["fwd"][1:]}
    assert per_shape == {a: (64, 64), b: (128, 64)}
    assert best["dkdv"] == [] and best["dq"] == []
    path = tmp_path / "tuned.json"
    df = pd.DataFrame(rows).assign(device_name="H", torch_version="2.11", triton_version="3.6")
    flash_tiles.write_json({"note": flash_tiles.json_note(df), **best}, path)
    assert load_tuned_configs(path)["fwd"] == json.loads(path.read_text())["fwd"]
    assert json.loads(path.read_text())["note"].endswith("the 5 measured trials (6 in all) of flash_tiles.parquet "
                                                         "(H, torch 2.11, triton 3.6)")


def test_flash_tiles_variants_grids_and_tuned_entries_per_path(tmp_path):
    """The tma variants' grids hold only configs their path takes (warp specialisation: 4 warps, no dQ loop), and
    a sweep of one path writes that path's entries, keeping the file's entries of the other."""
    from kernels.attention.triton.tuning import FlashConfig, load_tuned_configs

    shape = "4096/64/bfloat16/causal"
    for quick in (False, True):
        spaces = flash_tiles.param_spaces(quick, (shape,), ("tma", "tma_ws", "tma_persistent"))
        variants = {s["variant"] for s in spaces.values()}
        assert variants == {"tma", "tma_ws", "tma_persistent"} if not quick else variants <= {"tma", "tma_persistent"}
        for space in spaces.values():
            path, ws, persistent = flash_tiles.VARIANTS[space["variant"]]
            assert not (ws and space["kernel"] in ("dq", "dkdvq"))
            for c in flash_tiles.grid_configs(space):
                m, n = map(int, c["tile"].split("x"))
                FlashConfig(m, n, c["num_warps"], c["num_stages"], ws, persistent).check(c["kernel"], path)
                assert c["num_warps"] == 4 or not ws
    with pytest.raises(ValueError, match="variants"):
        flash_tiles.param_spaces(True, (shape,), ("tma_fast",))
    rows = [dict(_tile_row("fwd", tile, 8, 3, shape, ms), path="tma", variant="tma", warp_specialize=False,
                 persistent=False) for tile, ms in (("128x64", 1.0), ("64x64", 0.8))]
    df = pd.DataFrame(rows).assign(device_name="H200", torch_version="2.11", triton_version="3.6")
    path = tmp_path / "tuned.json"
    portable = dict(block_m=128, block_n=64, num_warps=8, num_stages=3, head_dim=64, dtype="bfloat16")
    stale_tma = dict(portable, path="tma", block_m=32, block_n=32)
    flash_tiles.write_json({"note": "earlier", "fwd": [portable, stale_tma]}, path)
    flash_tiles.write_tuned(df, flash_tiles.best_configs(df, min_configs=1), path)
    entries = load_tuned_configs(path)["fwd"]
    assert [(e.get("path", "portable"), e["block_m"], e["block_n"]) for e in entries] == [
        ("tma", 64, 64), ("tma", 64, 64), ("portable", 128, 64)]  # geomean, per-shape; the stale tma entry gone
    data = json.loads(path.read_text())
    assert data["device"] == ["H200"] and data["triton"] == ["3.6"] and data["note"].endswith("earlier")

def test_gluon_entries_per_card(tmp_path, monkeypatch):
    """Each card's rows give entries naming it; a run on one card replaces that card's entries in the tuned file and
    keeps the others'; the launchers take the entry of their card, else one naming none, else another card's."""
    from kernels.attention import dispatch

    a = "16384/128/bfloat16/causal"

    def rows(card, fastest_stages):
        return pd.DataFrame([dict(_tile_row("dkdvq", "64x64", 4, s, a, 1.0 - 0.5 * (s == fastest_stages)),
                                  variant="gluon", path="gluon", num_consumers=2, head_group=4, device_name=card)
                             for s in (1, 2, 3)]).assign(torch_version="2.11", triton_version="3.6")

    h200, h100 = rows("NVIDIA H200", 3), rows("NVIDIA H100 80GB HBM3", 2)
    both = flash_tiles.gluon_best_configs(pd.concat([h200, h100]), min_configs=3)
    assert {(e["device"], e["num_stages"]) for e in both["bwd"] if "shapes" in e} == {
        ("NVIDIA H200", 3), ("NVIDIA H100 80GB HBM3", 2)}  # each card's rows ranked apart
    path = tmp_path / "tuned.json"
    flash_tiles.write_tuned(h200, {}, path, flash_tiles.gluon_best_configs(h200, min_configs=3))
    flash_tiles.write_tuned(h100, {}, path, flash_tiles.gluon_best_configs(h100, min_configs=3))
    again = rows("NVIDIA H100 80GB HBM3", 1)  # the H100 swept again: its entries replaced, the H200's kept
    flash_tiles.write_tuned(again, {}, path, flash_tiles.gluon_best_configs(again, min_configs=3))
    data = json.loads(path.read_text())
    assert sorted((e["device"], e["num_stages"]) for e in data["gluon"]["bwd"] if "shapes" in e) == [
        ("NVIDIA H100 80GB HBM3", 1), ("NVIDIA H200", 3)]
    assert "bwd kept from the previous file" in data["gluon_note"]
    tuned = dispatch.load_gluon_tuned(path)
    winner = next(e for e in tuned["bwd"] if "shapes" in e)
    tuned["bwd"].append({**winner, "num_stages": 2, "device": "NVIDIA H20"})
    unnamed = {k: v for k, v in winner.items() if k != "device"}
    monkeypatch.setattr(dispatch, "_GLUON_TUNED", tuned)
    stages = lambda card: dispatch.gluon_tuned_fields("bwd", 128, torch.bfloat16, card)["num_stages"]  # noqa: E731
    assert stages("NVIDIA H200") == 3 and stages("NVIDIA H100 80GB HBM3") == 1 and stages("NVIDIA H20") == 2
    assert stages("NVIDIA GH200 480GB") in (1, 3) and stages(None) in (1, 3)  # no entry of its own: another card's
    tuned["bwd"].append({**unnamed, "num_stages": 4})
    assert stages("NVIDIA GH200 480GB") == 4 and stages("NVIDIA H200") == 3  # one naming no card before another's


def test_a_paired_winner_within_its_half_width_leaves_the_card_on_the_reference(tmp_path):
    """A paired winner that is not faster than the launcher's config by more than its rows' half-width gives no entry
    (sweep-wide or per shape) for its head dim and dtype; a re-sweep replaces only the entries of its card, head dim
    and dtype."""
    a, b = "16384/128/bfloat16/causal", "8x16/4096/64/bfloat16/causal"
    h100 = "NVIDIA H100 80GB HBM3"

    def frame(ratios, ci, card=h100):
        return pd.DataFrame([dict(_tile_row("dkdvq", "64x64", 4, stages, shape, 1.0), variant="gluon", path="gluon",
                                  num_consumers=2, head_group=4, reference="ref", device_name=card,
                                  **{flash_tiles.PAIRED_KEY: ratio, flash_tiles.PAIRED_CI_KEY: ci})
                             for (stages, shape), ratio in ratios.items()]).assign(torch_version="2.11",
                                                                                 triton_version="3.6")

    ratios = {(1, a): 0.95, (2, a): 0.94, (3, a): 0.9, (1, b): 1.0, (2, b): 1.013, (3, b): 0.99}
    assert flash_tiles.gluon_best_configs(frame(ratios, 0.033), min_configs=3) == {"bwd": []}
    bwd = flash_tiles.gluon_best_configs(frame(ratios, 0.005), min_configs=3)["bwd"]
    assert [(e["head_dim"], e["num_stages"], e.get("shape")) for e in bwd] == [(64, 2, None), (64, 2, b)]
    path = tmp_path / "tuned.json"
    h200 = frame({(s, sh): 1.0 + 0.1 * (s == 3) for s in (1, 2, 3) for sh in (a, b)}, 0.01, "NVIDIA H200")
    flash_tiles.write_tuned(h200, {}, path, flash_tiles.gluon_best_configs(h200, min_configs=3))
    flash_tiles.write_tuned(h200, {}, path, flash_tiles.gluon_best_configs(frame(ratios, 0.005), min_configs=3))
    d128 = frame({**ratios, (1, a): 1.2}, 0.005)[lambda df: df["head_dim"] == 128]  # the H100 swept again at d 128
    flash_tiles.write_tuned(d128, {}, path, flash_tiles.gluon_best_configs(d128, min_configs=3))
    winners = json.loads(path.read_text())["gluon"]["bwd"]
    assert sorted((e["device"], e["head_dim"], e["num_stages"]) for e in winners if "shapes" in e) == [
        (h100, 64, 2), (h100, 128, 1), ("NVIDIA H200", 64, 3), ("NVIDIA H200", 128, 3)]


def test_gluon_variant_grids_and_tuned_part(tmp_path, monkeypatch):
    """`--variants gluon`: the Gluon forward's and one-pass backward's knobs, only on shapes they take; their winners
    go to the tuned file's `gluon` part (beside the tl entries and `auto_path`, which stay), and the Gluon
    launchers read it."""
    import kernels.attention.gluon.backward as one_pass
    import kernels.attention.gluon.forward as gluon_fwd
    from kernels.attention import dispatch

    a, b = "16384/128/bfloat16/causal", "4096/128/bfloat16/causal"
    spaces = flash_tiles.param_spaces(False, (a, b, "4096/32/bfloat16/causal", "4096/64/float32/causal"), ("gluon",))
    assert set(spaces) == {"fwd/gluon", "dkdvq/gluon"}
    fwd, bwd = (flash_tiles.grid_configs(spaces[k]) for k in ("fwd/gluon", "dkdvq/gluon"))
    assert len(fwd) == 18 * 2 * 2 * 2 * 2 and len(bwd) == 3 * 3 * 3 * 2 * 2
    assert {c["shape"] for c in fwd + bwd} == {a, b}
    assert {c["exp2_emulated"] for c in fwd} == set(flash_tiles.GLUON_EXP2) and all("exp2_emulated" not in c
                                                                                   for c in bwd)
    assert {c["rescale_under_s"] for c in fwd} == {False, True} and all("rescale_under_s" not in c for c in bwd)
    assert {c["dq_buffers"] for c in bwd} == {1, 2} and all("dq_buffers" not in c for c in fwd)
    assert {c["dq"] for c in bwd} == {"whole", "halves", "whole_dk_late"} and all("dq" not in c for c in fwd)
    for c in bwd:  # every grid point is a valid config
        dq_whole, dk_late = flash_tiles.GLUON_DQ[c["dq"]]
        one_pass.GluonBwdConfig(num_stages=c["num_stages"], head_group=c["head_group"], dq_whole=dq_whole,
                                dk_late=dk_late, dq_buffers=c["dq_buffers"])
    for c in fwd:  # every grid point is a valid config
        m, n = map(int, c["tile"].split("x"))
        gluon_fwd.GluonConfig(block_m=m, block_n=n, num_stages=c["num_stages"], num_consumers=c["num_consumers"],
                              head_group=c["head_group"], exp2_emulated=c["exp2_emulated"],
                              rescale_under_s=c["rescale_under_s"])
    assert {c["head_group"] for c in fwd} == {0, 8} and {c["head_group"] for c in bwd} == {0, 4, 8}

    def row(kernel, tile, stages, consumers, shape, ms):
        return dict(_tile_row(kernel, tile, 4, stages, shape, ms), variant="gluon", path="gluon",
                    num_consumers=consumers, device_name="H200")  # (each card's rows are ranked apart)
    rows = [row("fwd", t, s, c, sh, 1.0 + 0.1 * c + 0.01 * s + (0.5 if t == "128x64" else 0) + (sh == b))
            for t in ("64x128", "128x64") for s in (2, 3) for c in (1, 2) for sh in (a, b)]
    rows[0]["time_median_s"] = 0.5e-3  # 64x128, 2 stages, 1 consumer: fastest on a only
    rows += [dict(row("dkdvq", "64x64", s, 2, sh, 2.0 - 0.1 * s - 0.01 * g), head_group=g)
             for s in (1, 2, 3) for g in (0, 4, 8) for sh in (a, b)]  # fwd rows: no head_group (earlier runs: 0)
    rows += [_tile_row("fwd", "64x64", 4, 3, a, 0.1)]  # a tl row: not the Gluon kernels'
    df = pd.DataFrame(rows).assign(device_name="H200", torch_version="2.11", triton_version="3.6")
    gluon = flash_tiles.gluon_best_configs(df, min_configs=8)
    assert gluon["fwd"][0] == dict(block_m=64, block_n=128, num_stages=2, num_consumers=1, persistent=False,
                                   head_group=0, exp2_emulated=0, head_dim=128, dtype="bfloat16", shapes=[a, b],
                                   geomean_ms=gluon["fwd"][0]["geomean_ms"], device="H200")
    assert {k: gluon["bwd"][0][k] for k in ("block_m", "num_stages", "head_group", "shapes", "dq_whole",
                                            "dk_late", "rows_tma")} == dict(
        block_m=64, num_stages=3, head_group=8, shapes=[a, b], dq_whole=False, dk_late=False,
        rows_tma=False)  # rows without them
    assert "dq_whole" not in gluon["fwd"][0]
    assert "block_n" not in gluon["bwd"][0] and all(e.get("path") != "gluon" for e in
                                                    flash_tiles.best_configs(df, min_configs=1)["fwd"])
    path = tmp_path / "tuned.json"
    flash_tiles.write_json({"note": "earlier", "auto_path": "tma", "fwd": []}, path)
    flash_tiles.write_tuned(df, flash_tiles.best_configs(df, min_configs=1), path, gluon)
    data = json.loads(path.read_text())
    assert data["auto_path"] == "tma" and data["gluon"] == json.loads(json.dumps(gluon))
    assert data["gluon_note"].startswith("written by sweeps/flash_tiles.py") and "earlier" not in data["gluon_note"]
    # A later run of the tl kernels alone keeps the gluon part and its note; one of the Gluon kernels alone keeps
    # the tl part's note (and its entries).
    tl_only = pd.DataFrame([_tile_row("fwd", "64x64", 4, 3, a, 0.2)]).assign(
        device_name="H100", torch_version="2.11", triton_version="3.6")
    flash_tiles.write_tuned(tl_only, flash_tiles.best_configs(tl_only, min_configs=1), path)
    after_tl = json.loads(path.read_text())
    assert after_tl["gluon"] == data["gluon"] and after_tl["gluon_note"] == data["gluon_note"]
    assert after_tl["note"] != data["note"] and after_tl["device"] == ["H100", "H200"]
    gluon_rows = df[df["path"] == "gluon"]
    flash_tiles.write_tuned(gluon_rows, flash_tiles.best_configs(gluon_rows, min_configs=1), path,
                            {"fwd": gluon["fwd"]})
    after_gluon = json.loads(path.read_text())
    assert after_gluon["note"] == after_tl["note"] and after_gluon["fwd"] == after_tl["fwd"]
    assert "bwd kept from the previous file" in after_gluon["gluon_note"]
    monkeypatch.setattr(dispatch, "_GLUON_TUNED", dispatch.load_gluon_tuned(path))
    assert dispatch.gluon_fwd_default(128, torch.bfloat16) == gluon_fwd.GluonConfig(
        block_m=64, block_n=128, num_stages=2, num_consumers=1)
    assert dispatch.gluon_bwd_default(128, torch.bfloat16) == one_pass.GluonBwdConfig(
        block_m=64, num_stages=3, head_group=8, dq_whole=False, rows_tma=False)
    # The persistent forward: its own variant (fwd only, two consumer groups); a winner carries `persistent`.
    spaces = flash_tiles.param_spaces(False, (a,), ("gluon_persistent",))
    assert set(spaces) == {"fwd/gluon_persistent", "dkdvq/gluon_persistent"}
    grid = flash_tiles.grid_configs(spaces["fwd/gluon_persistent"])
    assert len(grid) == 6 * 2 * 2 * 2 and {c["num_consumers"] for c in grid} == {2}
    assert len(flash_tiles.grid_configs(spaces["dkdvq/gluon_persistent"])) == 3 * 3 * 3 * 2
    fast = dict(row("fwd", "64x128", 2, 2, a, 0.2), variant="gluon_persistent", persistent=True)
    df_p = pd.concat([df, pd.DataFrame([fast, dict(fast, shape=b)])], ignore_index=True)
    winner = flash_tiles.gluon_best_configs(df_p, min_configs=8)["fwd"][0]
    assert winner["persistent"] is True and winner["num_consumers"] == 2
    assert gluon_fwd.GluonConfig(**{k: winner[k] for k in dispatch.GLUON_FIELDS["fwd"] if k in winner}).persistent
    # The persistent one-pass backward: a winner carries `persistent`, which its config takes.
    fast_bwd = dict(row("dkdvq", "64x64", 2, 2, a, 0.3), head_group=4, variant="gluon_persistent", persistent=True)
    df_b = pd.concat([df, pd.DataFrame([fast_bwd, dict(fast_bwd, shape=b)])], ignore_index=True)
    bwd_winner = flash_tiles.gluon_best_configs(df_b, min_configs=8)["bwd"][0]
    assert bwd_winner["persistent"] is True and bwd_winner["head_group"] == 4
    assert one_pass.GluonBwdConfig(**{k: bwd_winner[k] for k in dispatch.GLUON_FIELDS["bwd"]}).persistent
    # dq_whole swept: the grid doubles, and a winner carries it.
    whole = [dict(row("dkdvq", "64x64", s, 2, sh, 1.5 - 0.1 * s - 0.01 * g), head_group=g, dq_whole=w)
             for s in (1, 2, 3) for g in (0, 4, 8) for w in (True, False) for sh in (a, b)]
    df_w = pd.concat([df[df["kernel"] == "fwd"], pd.DataFrame(whole)], ignore_index=True)
    df_w.loc[(df_w["kernel"] == "dkdvq") & (df_w["dq_whole"] == True), "time_median_s"] -= 0.2e-3  # noqa: E712
    w_winner = flash_tiles.gluon_best_configs(df_w, min_configs=8)["bwd"][0]
    assert w_winner["dq_whole"] is True and w_winner["num_stages"] == 3
    assert one_pass.GluonBwdConfig(**{k: w_winner[k] for k in dispatch.GLUON_FIELDS["bwd"]}).dq_whole
    # The three-valued dQ axis (dk_late swept, 27 configs a shape): a winner carries dk_late, which its config takes.
    modes = flash_tiles.GLUON_DQ.values()
    late = [dict(row("dkdvq", "64x64", s, 2, sh, 1.5 - 0.1 * s - 0.01 * g - 0.3 * dkl), head_group=g, dq_whole=w,
                 dk_late=dkl) for s in (1, 2, 3) for g in (0, 4, 8) for w, dkl in modes for sh in (a, b)]
    df_l = pd.concat([df[df["kernel"] == "fwd"], pd.DataFrame(late)], ignore_index=True)
    l_winner = flash_tiles.gluon_best_configs(df_l, min_configs=27)["bwd"][0]
    assert l_winner["dk_late"] is True and l_winner["dq_whole"] is True and l_winner["shapes"] == [a, b]
    assert one_pass.GluonBwdConfig(**{k: l_winner[k] for k in dispatch.GLUON_FIELDS["bwd"]}).dk_late
    assert l_winner["rows_tma"] is False  # rows of runs before rows_tma: L and D from global memory
    # rows_tma is not swept: the winners carry the value the rows record (the default a run ran).
    df_r = df_l.assign(rows_tma=df_l["kernel"] == "dkdvq")
    r_winner = flash_tiles.gluon_best_configs(df_r, min_configs=27)["bwd"][0]
    assert r_winner["rows_tma"] is True and r_winner["dk_late"] is True
    assert one_pass.GluonBwdConfig(**{k: r_winner[k] for k in dispatch.GLUON_FIELDS["bwd"]}).rows_tma
    # Rows of runs before the dq_buffers axis: the winners carry what the rows record, 1 before the field existed.
    assert r_winner["dq_buffers"] == 1
    q_winner = flash_tiles.gluon_best_configs(df_r.assign(dq_buffers=2), min_configs=27)["bwd"][0]
    assert q_winner["dq_buffers"] == 2
    assert one_pass.GluonBwdConfig(**{k: q_winner[k] for k in dispatch.GLUON_FIELDS["bwd"]}).dq_buffers == 2
    # Rows of a run that swept dq_whole alone: its grid (18 configs a shape) caps the count asked for.
    assert flash_tiles.gluon_best_configs(df_w, min_configs=27)["bwd"][0]["dq_whole"] is True
    # The forward's rescale order swept: a winner carries it, and a d-64 entry that says False overrides
    # RESCALE_UNDER_S's True (the file's measurement wins over the module's default).
    ru = [dict(row("fwd", "64x128", s, c, sh, 1.0 + 0.1 * c + 0.01 * s - 0.3 * r), rescale_under_s=r)
          for s in (2, 3) for c in (1, 2) for r in (False, True) for sh in (a, b)]
    ru_winner = flash_tiles.gluon_best_configs(pd.DataFrame(ru), min_configs=8)["fwd"][0]
    assert ru_winner["rescale_under_s"] is True and ru_winner["num_consumers"] == 1
    fields = {k: ru_winner[k] for k in dispatch.GLUON_FIELDS["fwd"] if k in ru_winner}
    assert gluon_fwd.GluonConfig(**fields).rescale_under_s
    # Rows of runs before the axis ran False where `auto` runs True: their entries leave the order to the default.
    assert "rescale_under_s" not in gluon["fwd"][0]
    d64 = {**gluon["fwd"][0], "head_dim": 64, "rescale_under_s": False}
    monkeypatch.setattr(dispatch, "_GLUON_TUNED", {"fwd": [d64], "bwd": []})
    assert dispatch.gluon_fwd_default(64, torch.bfloat16).rescale_under_s is False
    monkeypatch.setattr(dispatch, "_GLUON_TUNED", {"fwd": [{k: v for k, v in d64.items() if k != "rescale_under_s"}],
                                                 "bwd": []})
    assert dispatch.gluon_fwd_default(64, torch.bfloat16).rescale_under_s is dispatch.RESCALE_UNDER_S[64]
    monkeypatch.setattr(dispatch, "_GLUON_TUNED", dispatch.load_gluon_tuned(path))
    assert dispatch.gluon_fwd_default(64, torch.bfloat16) == dataclasses.replace(  # no d-64 entry: the defaults
        dispatch.DEFAULT_FWD_CONFIGS[64], exp2_emulated=dispatch.EXP2_EMULATED[64],
        rescale_under_s=dispatch.RESCALE_UNDER_S[64])
    assert dispatch.gluon_bwd_default(128, torch.float16) == dispatch.DEFAULT_BWD_CONFIGS[128]
    # Bad input, before any work: no shape the Gluon kernels take; a tuned entry with a field no config has.
    with pytest.raises(ValueError, match="variant gluon runs shapes of head dim 64 or 128"):
        flash_tiles.param_spaces(False, ("4096/32/bfloat16/causal",), ("tma", "gluon"))
    data["gluon"]["fwd"][0]["num_warps"] = 8
    flash_tiles.write_json(data, path)
    with pytest.raises(ValueError, match=r"gluon fwd entry .* fields \['num_warps'\]"):
        dispatch.load_gluon_tuned(path)


def test_gluon_winner_counts_configs_that_do_not_fit_as_swept():
    """A one-pass backward config whose build runs out of shared memory (the 3-slot ring at d 128) never runs at that
    head dim: the 6 configs that fit make the shape swept; a trial that failed otherwise still leaves it short."""
    a = "16384/128/bfloat16/causal"

    def row(stages, group, ms=None, error=""):
        base = dict(_tile_row("dkdvq", "64x64", 4, stages, a, ms or 1.0), variant="gluon", num_consumers=2,
                    head_group=group)
        if not error:
            return dict(base, path="gluon")
        return dict(base, status="error", error=error, block_m=None, block_n=None, head_dim=None, dtype=None,
                    time_median_s=None, tflops=None, path=None)
    rows = [row(s, g, ms=2.0 - 0.1 * s - 0.01 * g) for s in (1, 2) for g in (0, 4, 8)]
    oor = "OutOfResources: out of resource: shared memory, Required: 246256, Hardware limit: 232448."
    df = pd.DataFrame(rows + [row(3, g, error=oor) for g in (0, 4, 8)])
    bwd = flash_tiles.gluon_best_configs(df, min_configs=8)["bwd"]
    assert [(e["num_stages"], e["head_group"], e.get("shapes", e.get("shape"))) for e in bwd] == [
        (2, 8, [a]), (2, 8, a)]
    # The launcher's own check before the build counts the same way.
    refused = "SharedMemoryExceeded: bwd2x64xq64/s3/dqw/rt needs 262400 bytes of shared memory at head_dim 128, ..."
    df_refused = pd.DataFrame(rows + [row(3, g, error=refused) for g in (0, 4, 8)])
    assert flash_tiles.gluon_best_configs(df_refused, min_configs=8)["bwd"] == bwd
    crashed = pd.DataFrame(rows + [row(3, g, error="RuntimeError: illegal memory access") for g in (0, 4, 8)])
    assert flash_tiles.gluon_best_configs(crashed, min_configs=8)["bwd"] == []


def test_gluon_dq_buffers_axis_counts_toward_a_swept_shape():
    """The one-pass backward's `dq_buffers` axis doubles the grid a shape must have run to be swept: a run cut off
    after 10 of its 18 configs (3 ring depths x 3 head groups x 1 or 2 dQ tiles) makes no sweep-wide winner; where two
    whole d-128 tiles do not fit (refused before the build), the configs left make the shape swept, each refused
    config counted once with its `dq_buffers`."""
    d64, d128 = "8x16/4096/64/bfloat16/causal", "16384/128/bfloat16/causal"

    def row(shape, stages, group, buffers, ms=None, error=""):
        head_dim = int(shape.split("/")[-3])
        base = dict(_tile_row("dkdvq", "64x64", 4, stages, shape, ms or 1.0), variant="gluon", num_consumers=2,
                    head_group=group, dq_buffers=buffers, head_dim=head_dim)
        if not error:
            return dict(base, path="gluon")
        return dict(base, status="error", error=error, block_m=None, block_n=None, head_dim=None, dtype=None,
                    time_median_s=None, tflops=None, path=None)
    full = [row(d64, s, g, q, ms=2.0 - 0.1 * s - 0.01 * g - 0.2 * (q == 2)) for s in (1, 2, 3) for g in (0, 4, 8)
            for q in (1, 2)]
    winner = flash_tiles.gluon_best_configs(pd.DataFrame(full), min_configs=27)["bwd"][0]
    assert (winner["dq_buffers"], winner["num_stages"], winner["head_group"], winner["shapes"]) == (2, 3, 8, [d64])
    cut = flash_tiles.gluon_best_configs(pd.DataFrame(full[:10]), min_configs=27)["bwd"]
    assert [e for e in cut if "shapes" in e] == []
    refused = "SharedMemoryExceeded: bwd2x64xq64/s2/dqw/rt/q2 needs 245760 bytes of shared memory at head_dim 128"
    oor = "OutOfResources: out of resource: shared memory, Required: 262400, Hardware limit: 232448."
    rows = [row(d128, s, g, 1, ms=2.0 - 0.1 * s - 0.01 * g) for s in (1, 2) for g in (0, 4, 8)]
    rows += [row(d128, 3, g, 1, error=oor) for g in (0, 4, 8)]
    rows += [row(d128, s, g, 2, error=refused) for s in (1, 2, 3) for g in (0, 4, 8)]
    entries = flash_tiles.gluon_best_configs(pd.DataFrame(rows), min_configs=27)["bwd"]
    assert [(e["num_stages"], e["head_group"], e["dq_buffers"], e["shapes"]) for e in entries if "shapes" in e] == [
        (2, 8, 1, [d128])]


def test_best_configs_ignore_a_partly_swept_shape():
    """A shape a cut-short run reached with two configs must not decide the winner (its times are smaller)."""
    a, b = "16384/128/bfloat16/causal", "4096/128/bfloat16/causal"
    tiles = ["128x128", "128x64", "128x32", "64x64", "64x32"]
    rows = [_tile_row("fwd", tile, warps, 3, a, 2.0 + 0.1 * i + 0.01 * warps)
            for i, tile in enumerate(tiles) for warps in (4, 8)]                 # 10 configs on a; 128x128/4 best
    rows += [_tile_row("fwd", "64x32", 8, 3, b, 0.5), _tile_row("fwd", "64x64", 4, 3, b, 0.6)]
    best = flash_tiles.best_configs(pd.DataFrame(rows))
    first = best["fwd"][0]
    assert (first["block_m"], first["block_n"], first["num_warps"], first["shapes"]) == (128, 128, 4, [a])
    assert [e["shape"] for e in best["fwd"][1:]] == [a]  # b: too few configs for a per-shape entry
    assert flash_tiles.best_configs(pd.DataFrame(rows[:5]))["fwd"] == []  # under MIN_CONFIGS: no entry at all


def test_the_studies_draw_their_tables_and_the_summary_prints_them(tmp_path, capsys):
    rows = [_tile_row("dq", "128x32", 8, 3, "16384/128/bfloat16/causal", 2.8),
            _tile_row("dq", "64x16", 8, 2, "16384/128/bfloat16/causal", float("nan"), status="error")]
    text = flash_tiles.markdown(pd.DataFrame(rows))
    assert "128x32" in text and "{'error': 1} failed" in text and "64x16" not in text
    assert "none measured ({'error': 1} failed)" in flash_tiles.markdown(pd.DataFrame(rows[1:]))
    shape = dict(study="target", batch=1, heads=16, seq=16384, head_dim=128, dtype="bf16", causal=True, status="ok")
    bench = flash_bench.add_speedups(pd.DataFrame([dict(shape, provider=p, fwd_median_s=ms, bwd_median_s=2 * ms,
                                                        fwd_bwd_median_s=3 * ms,
                                                        fwd_tflops=1.0, fwd_bwd_tflops=1.0, max_abs_err=0.0)
                                                   for p, ms in (("triton", 1.0), ("sdpa_flash", 2.0))]))
    assert "Target: batch 1, 16 heads, seq 16384" in flash_bench.markdown(bench)
    flash_tiles.write_report(pd.DataFrame(rows).assign(sweep="flash_tiles", trial_id=["a", "b"]), tmp_path)
    pd.DataFrame(rows).assign(sweep="flash_tiles", trial_id=["a", "b"]).to_parquet(tmp_path / "flash_tiles.parquet")
    assert flash_summary.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "## flash_tiles" in printed and text.strip().splitlines()[0] in printed


def test_attention_sweep_cpu_rows_and_saved_bytes(tmp_path):
    df = attention.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert (tmp_path / "attention.parquet").exists() and len(df) == 2 and (df["status"] == "ok").all()
    # autograd keeps three B x N x N fp32 matrices, the N x N mask and Q, K, V: the analytic count holds
    ratio = df["saved_for_backward_bytes"] / df["expected_saved_bytes"]
    assert ((ratio > 0.99) & (ratio < 1.02)).all()
    assert (df["backward_mean_s"] > 0).all()
    assert "largest: batch 8, seq 128" in (tmp_path / "attention_memory.md").read_text()


def test_attention_oom_is_a_row_and_gets_accounted(tmp_path, monkeypatch):
    def fake_trial(cfg, device, steps, warmup):
        if cfg["seq"] >= 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return {"forward_mean_s": 1e-3, "forward_std_s": 0.0, "backward_mean_s": 2e-3, "backward_std_s": 0.0,
                "memory_before_backward_bytes": float("nan"), "saved_for_backward_bytes": 1.0}

    monkeypatch.setattr(attention, "run_trial", fake_trial)
    df = attention.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert dict(zip(df["seq"], df["status"])) == {64: "ok", 128: "oom"}
    report = (tmp_path / "attention_memory.md").read_text()
    assert "ran out of memory: batch 8, seq 128, d 16" in report
    assert f"{8 * 128 * 128 * 4 / 2**30:.2f} GiB" in report


def test_flash_bench_grid_runs_the_informative_configs_first():
    trials = flash_bench.grid("grid", False)
    assert len(trials) == 10 * 4 * 2 * len(flash_bench.PROVIDERS)
    blocks = list(dict.fromkeys((t["dtype"], t["head_dim"]) for t in trials))
    assert blocks == [("bf16", 128), ("bf16", 64), ("bf16", 32), ("bf16", 16),
                      ("fp32", 128), ("fp32", 64), ("fp32", 32), ("fp32", 16)]
    first = [t["seq"] for t in trials if (t["dtype"], t["head_dim"]) == ("bf16", 128)]
    assert first == sorted(first) and first[0] == 128 and first[-1] == 65536
    # narrowed grids keep the order whatever order the flags list
    narrowed = flash_bench.grid("grid", False, seqs=(4096, 1024), head_dims=(16, 128), dtypes=("fp32", "bf16"))
    assert [(t["dtype"], t["head_dim"], t["seq"]) for t in narrowed[::len(flash_bench.PROVIDERS)]] == [
        ("bf16", 128, 1024), ("bf16", 128, 4096), ("bf16", 16, 1024), ("bf16", 16, 4096),
        ("fp32", 128, 1024), ("fp32", 128, 4096), ("fp32", 16, 1024), ("fp32", 16, 4096)]


def test_flash_bench_resume_runs_what_the_time_budget_skipped(tmp_path):
    args = ["--study", "grid", "--quick", "--device", "cpu", "--out", str(tmp_path), "--providers", "naive,triton"]
    first = flash_bench.main(args)
    assert dict(zip(zip(first["provider"], first["seq"]), first["status"])) == {
        ("naive", 64): "ok", ("naive", 128): "ok", ("triton", 64): "skipped", ("triton", 128): "skipped"}
    # As a --max-seconds run leaves it: naive at seq 128 was never run (the wording of both versions counts).
    path = tmp_path / "flash_bench.parquet"
    df = pd.read_parquet(path)
    budget = (df["provider"] == "naive") & (df["seq"] == 128)
    df.loc[budget, ["status", "error"]] = ["skipped", "--max-seconds 160.0 spent"]
    df.loc[budget, [c for c in df.columns if c.endswith("_median_s")]] = float("nan")
    df["host"] = "previous-run"  # a rerun trial gets this host's name
    df.to_parquet(path)

    again = flash_bench.main(args + ["--resume"]).set_index(["provider", "seq"])
    assert again["status"].to_dict() == {("naive", 64): "ok", ("naive", 128): "ok", ("triton", 64): "skipped",
                                         ("triton", 128): "skipped"}
    assert again.loc[("naive", 128), "fwd_median_s"] > 0 and again.loc[("naive", 128), "host"] != "previous-run"
    assert again.drop(index=[("naive", 128)])["host"].eq("previous-run").all()  # final rows are not run again


def test_flash_bench_budget_skips_say_how_to_continue(tmp_path):
    df = flash_bench.main(["--studies", "grid", "--quick", "--device", "cpu", "--out", str(tmp_path),
                           "--providers", "naive", "--time-budget-s", "1e-9"])
    assert (df["status"] == "skipped").all() and df["error"].str.contains("--resume runs it").all()
    writer = flash_tiles.ResultWriter(tmp_path, "flash_bench", resume=True)
    assert not any(flash_bench.finished(writer, tid) for tid in df["trial_id"])


def test_flash_tiles_short_dtype_names_are_one_spelling():
    assert flash_tiles.parse_shape("4096/64/bf16/causal") == flash_tiles.parse_shape("4096/64/bfloat16/causal") == \
        dict(batch=1, heads=flash_tiles.HEADS, seq=4096, head_dim=64, dtype="bfloat16", causal=True)
    assert flash_tiles.canonical_shape("1024/128/fp32/full") == "1024/128/float32/full"
    assert flash_tiles.canonical_shape("1024/128/fp16/causal") == "1024/128/float16/causal"
    # An explicit batch x heads (the hopper study's shapes); the default one keeps the short spelling (trial ids).
    assert flash_tiles.parse_shape("8x16/4096/64/bf16/causal") == dict(
        batch=8, heads=16, seq=4096, head_dim=64, dtype="bfloat16", causal=True)
    assert flash_tiles.canonical_shape("8x16/4096/64/bf16/causal") == "8x16/4096/64/bfloat16/causal"
    assert flash_tiles.canonical_shape(f"1x{flash_tiles.HEADS}/4096/64/bf16/causal") == "4096/64/bfloat16/causal"
    for bad in ("4096/64/bf8/causal", "4096/64/bf16", "4096/x/bf16/causal", "4096/64/bf16/sliding"):
        with pytest.raises(ValueError, match="bf16,fp16,fp32"):
            flash_tiles.parse_shape(bad)
    for bad in ("8/4096/64/bf16/causal", "0x16/4096/64/bf16/causal", "8x16x2/4096/64/bf16/causal"):
        with pytest.raises(ValueError, match="positive B and H"):
            flash_tiles.parse_shape(bad)


def _fake_tile_trial(config: dict) -> dict:
    m, n = map(int, config["tile"].split("x"))
    return {"block_m": m, "block_n": n, **flash_tiles.parse_shape(config["shape"]),
            "time_median_s": (1.0 + m / 1000) / 1e3, "tflops": 1.0, "max_abs_err": 0.0}


def test_flash_tiles_max_trials_then_resume_continues(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(flash_tiles, "trial", lambda config, device: ran.append(config) or _fake_tile_trial(config))
    args = ["--launcher", "local", "--quick", "--kernels", "fwd", "--shapes", "256/64/bf16/causal", "--no-json",
            "--out", str(tmp_path)]
    grid = flash_tiles.grid_configs(flash_tiles.param_spaces(True, ("256/64/bfloat16/causal",))["fwd"])
    first = flash_tiles.main(args + ["--max-trials", "3"])
    assert len(first) == 3 and (first["shape"] == "256/64/bfloat16/causal").all()
    assert list(first["trial_id"]) == [flash_tiles.trial_id(c) for c in grid[:3]]
    # resumed with the long dtype name: the same trials, the next two of the grid run
    args[args.index("256/64/bf16/causal")] = "256/64/bfloat16/causal"
    second = flash_tiles.main(args + ["--max-trials", "2", "--resume"])
    assert list(second["trial_id"]) == [flash_tiles.trial_id(c) for c in grid[:5]]
    assert ran == grid[:5]  # each trial ran once
    with pytest.raises(ValueError, match="--max-trials"):
        flash_tiles.main(args + ["--max-trials", "-1"])


def test_flash_tiles_time_budget_stops_starting_trials(tmp_path, monkeypatch):
    def slow_trial(config, device):
        time.sleep(1.5)
        return _fake_tile_trial(config)

    monkeypatch.setattr(flash_tiles, "trial", slow_trial)
    df = flash_tiles.main(["--launcher", "local", "--quick", "--kernels", "fwd", "--no-json", "--out", str(tmp_path),
                           "--time-budget-s", "2"])
    assert 1 <= len(df) <= 2 and (df["status"] == "ok").all()  # trials start at ~0 s and ~1.5 s, not at ~3 s
    with pytest.raises(ValueError, match="--time-budget-s"):
        flash_tiles.main(["--launcher", "local", "--quick", "--out", str(tmp_path), "--time-budget-s", "0"])


def test_gluon_check_rows_follow_the_results_convention(tmp_path, capsys):
    """The Gluon check script's rows: provenance, times in seconds, ratios against cuDNN in the printed table
    only; the file is readable by `raysys.results.records.read_results`."""
    from raysys.results.records import read_results
    from sweeps import flash_gluon_check as check

    shape = dict(kind="time", config="", shape="1x2x64x64", head_dim=64, causal=True, dtype="torch.bfloat16")
    rows = [check._row(dict(shape, provider="sdpa_cudnn"), dict(median_s=2e-3, tflops=500.0)),
            check._row(dict(shape, provider="gluon", config="2x64x128/s3"), dict(median_s=1e-3, tflops=1000.0)),
            check._row(dict(kind="check", config="2x64x128/s3", head_dim=64), dict(ok=False), status="error",
                       error="RuntimeError: boom")]
    check.write(rows, str(tmp_path), time.time())
    df = read_results(tmp_path / "flash_gluon.parquet")
    assert {"run_id", "git_sha", "median_s", "status"} <= set(df.columns) and "ms" not in df.columns
    assert df.set_index("provider")["vs_cudnn"].dropna().to_dict() == {"sdpa_cudnn": 1.0, "gluon": 2.0}
    assert list(df.status) == ["ok", "ok", "error"]
    assert "2x64x128/s3" in capsys.readouterr().out


def test_gluon_check_names_the_backward_auto_ran(monkeypatch):
    """The check's `auto_bwd` rows say which kernels `flash_attention_bwd` picked (the Gluon one-pass or the tl ones)."""
    from sweeps import flash_gluon_check as check

    monkeypatch.setattr(check, "LAST_PATH", {"fwd": "gluon", "dkdvq": "gluon", "dkdv": "portable", "bwd": "one_pass"})
    assert check._bwd_path() == "gluon, one_pass"
    monkeypatch.setattr(check, "LAST_PATH", {"dkdvq": "gluon", "dkdv": "portable", "bwd": "two_pass"})
    assert check._bwd_path() == "portable, two_pass"


@pytest.mark.parametrize("argv, message", [
    (["--paired-rounds", "2"], "--paired-rounds (2) must be 0 (off) or >= 3"),
    (["--shapes", "4x32x2048"], "shape '4x32x2048' must be BxHxNxD with positive ints"),
    (["--shapes", "4x32x2048x128,1x2x64x80"], "shape '1x2x64x80' has head dim 80; must be one of (64, 128)")])
def test_gluon_check_refuses_bad_flags_before_any_work(argv, message, monkeypatch, capsys):
    """One line naming the value and the rule, exit 2, before the GPU check (this host has no GPU: a flag that got
    through would end on that refusal instead)."""
    from sweeps import flash_gluon_check as check

    monkeypatch.setattr(check, "BENCH_SHAPES", list(check.BENCH_SHAPES))
    monkeypatch.setattr(sys, "argv", ["flash_gluon_check.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        check.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flops_count_causal_half():
    """The Gluon study's TFLOP/s count a causal mask as half of the unmasked 4 B H N^2 d (its rows' convention; the
    kernels' `flash_attention_flops` counts the n (n + 1) / 2 pairs)."""
    from sweeps import flash_gluon_check as check

    assert check._causal_flops(1, 32, 32768, 128) == 2 * 32 * 32768**2 * 128
    assert check._causal_flops(2, 2, 10, 64) == 4 * 2 * 2 * 10 * 10 * 64 / 2


def test_gluon_check_pairs_each_config_against_the_launched_one(capsys):
    """`paired_against_default`: one row per config but the launched one, its ratio the launched config's time over
    the config's (median over alternating rounds), kind 'paired' for the forward and 'paired_bwd' for the backward;
    a config whose run fails prints one line and gets no row."""
    from kernels.attention.gluon.backward import GluonBwdConfig
    from sweeps import flash_gluon_check as check

    default, faster, slower, broken = (GluonBwdConfig(head_group=g) for g in (3, 1, 8, 2))
    times = {default: 5.0, faster: 4.0, slower: 6.25}

    def run(config):
        if config == broken:
            raise RuntimeError("launch failed")
        return times[config]
    rows = check.paired_against_default((1, 16, 16384, 128), [default, faster, slower, broken], default, run, 3,
                                        mode="bwd", bench=lambda fn: fn())
    assert [(r["kind"], r["config"], r["default"], r["shape"]) for r in rows] == [
        ("paired_bwd", faster.name, default.name, "1x16x16384x128"),
        ("paired_bwd", slower.name, default.name, "1x16x16384x128")]
    assert [r["paired_speedup_bwd_vs_default"] for r in rows] == [1.25, 0.8]
    assert all(r["paired_rounds"] == 3 and "paired_speedup_fwd_vs_default" not in r for r in rows)
    assert f"paired gluon bwd {broken.name}" in capsys.readouterr().out
    fwd = check.paired_against_default((1, 16, 16384, 128), [faster], default, run, 3, bench=lambda fn: fn())
    assert fwd[0]["kind"] == "paired" and fwd[0]["paired_speedup_fwd_vs_default"] == 1.25


def test_gluon_check_shapes_flag_sets_the_timed_shapes():
    from sweeps import flash_gluon_check as check

    assert check.parse_shape(" 8x16x2048x128") == (8, 16, 2048, 128)


def test_gluon_winners_by_paired_ratio_where_every_row_has_one(tmp_path, monkeypatch):
    """--paired-rounds: the gluon grids carry the rounds (and nothing else does); winners go by the trials' paired
    ratios against the launcher's config, not by their medians, whose GPU speed drifted between trials; rows of a
    head dim without a ratio each, or paired against two references at one shape, fall back to the medians."""
    import kernels.attention.gluon.forward as gluon_fwd
    from kernels.attention import dispatch

    a, b = "16384/128/bfloat16/causal", "4x32/2048/128/bfloat16/causal"
    spaces = flash_tiles.param_spaces(False, (a, b), ("gluon", "tma"), paired_rounds=5)
    assert all(("paired_rounds" in space) == ("gluon" in key) for key, space in spaces.items())
    assert {c["paired_rounds"] for c in flash_tiles.grid_configs(spaces["fwd/gluon"])} == {5}
    assert all("paired_rounds" not in s for s in flash_tiles.param_spaces(False, (a,), ("gluon",)).values())

    def row(stages, group, shape, ms, ratio):
        return dict(_tile_row("fwd", "64x128", 4, stages, shape, ms), variant="gluon", path="gluon",
                    num_consumers=2, head_group=group, reference="2x64x128/s2/g8",
                    **{flash_tiles.PAIRED_KEY: ratio})
    # g4 is 3% faster than the reference in its own rounds but its trials ran while the GPU was slow.
    rows = [row(s, g, sh, (1.2 if g == 4 else 1.0) * (1 + 0.01 * s), (1.03 if g == 4 else 1.0) - 0.01 * s)
            for s in (2, 3) for g in (0, 4, 8) for sh in (a, b)]
    df = pd.DataFrame(rows).assign(device_name="H200", torch_version="2.11", triton_version="3.6")
    fwd = flash_tiles.gluon_best_configs(df, min_configs=4)["fwd"]
    assert (fwd[0]["head_group"], fwd[0]["num_stages"]) == (4, 2) and fwd[0]["geomean_vs_reference"] == 1.01
    assert all(e["head_group"] == 4 and e["vs_reference"] == 1.01 for e in fwd[1:]) and len(fwd) == 3
    unpaired = df.copy()
    unpaired.loc[0, flash_tiles.PAIRED_KEY] = float("nan")
    two_refs = df.copy()
    two_refs.loc[0, "reference"] = "2x64x128/s2/p/g4"
    for rows_ in (unpaired, two_refs):
        fwd = flash_tiles.gluon_best_configs(rows_, min_configs=4)["fwd"]
        assert fwd[0]["head_group"] != 4 and "geomean_vs_reference" not in fwd[0]
    # The tuned file takes the paired entries; the launcher reads only their config fields.
    path = tmp_path / "tuned.json"
    flash_tiles.write_tuned(df, {}, path, flash_tiles.gluon_best_configs(df, min_configs=4))
    monkeypatch.setattr(dispatch, "_GLUON_TUNED", dispatch.load_gluon_tuned(path))
    assert dispatch.gluon_fwd_default(128, torch.bfloat16) == gluon_fwd.GluonConfig(head_group=4)
    with pytest.raises(ValueError, match=r"--paired-rounds \(2\) must be 0 \(off\) or >= 3"):
        flash_tiles.main(["--launcher", "local", "--variants", "gluon", "--paired-rounds", "2", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="pairs the gluon variants' trials only"):
        flash_tiles.main(["--launcher", "local", "--quick", "--paired-rounds", "4", "--out", str(tmp_path)])


def test_gluon_forward_entry_ranked_beyond_the_persistent_grid_length():
    """The tuned forward entry (d 128) is ranked over the shapes longer than PERSISTENT_GRID's: up to it the launcher
    runs that grid instead, so the ratios there say nothing of the entry's use; each shape keeps its own
    winner; d 64 (no PERSISTENT_GRID) ranks over all; a sweep of short shapes only still gets an entry."""
    from kernels.attention.dispatch import PERSISTENT_GRID

    n_max = PERSISTENT_GRID[128][0]
    long, short = f"{2 * n_max}/128/bfloat16/causal", f"4x32/{n_max}/128/bfloat16/causal"

    def row(group, shape, ratio):
        return dict(_tile_row("fwd", "64x128", 4, 2, shape, 1.0), variant="gluon", path="gluon", num_consumers=2,
                    head_group=group, reference="ref", **{flash_tiles.PAIRED_KEY: ratio})

    def frame(rows):
        return pd.DataFrame(rows).assign(device_name="H200", torch_version="2.11", triton_version="3.6")
    # g8 wins the short shape by far, g4 the long one by a little: a geomean over both would take g8.
    ratios = {(0, long): 0.99, (4, long): 1.02, (8, long): 1.0, (0, short): 0.9, (4, short): 0.9, (8, short): 1.2}
    df = frame([row(g, sh, r) for (g, sh), r in ratios.items()])
    fwd = flash_tiles.gluon_best_configs(df, min_configs=3)["fwd"]
    assert (fwd[0]["head_group"], fwd[0]["shapes"]) == (4, [long])
    assert {e["shape"]: e["head_group"] for e in fwd[1:]} == {long: 4, short: 8}
    only_short = flash_tiles.gluon_best_configs(df[df["shape"] == short], min_configs=3)["fwd"]
    assert (only_short[0]["head_group"], only_short[0]["shapes"]) == (8, [short])
    d64 = {long: "8x16/4096/64/bfloat16/causal", short: f"8x16/{n_max}/64/bfloat16/causal"}
    df64 = frame([row(g, d64[sh], r) for (g, sh), r in ratios.items()])
    entry64 = flash_tiles.gluon_best_configs(df64, min_configs=3)["fwd"][0]
    assert 64 not in PERSISTENT_GRID
    assert (entry64["head_group"], entry64["shapes"]) == (8, sorted(d64.values()))
