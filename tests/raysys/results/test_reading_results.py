"""Analysis in pandas (issue 20): one column convention in every committed file (seconds, bytes, 12-digit commits,
provenance in every table), `raysys.results.migrate` converting older files without changing a figure, and the question
"which DDP variant was fastest in bf16, by how much" answered by one groupby."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from raysys import cli
from raysys.results.migrate import UNKNOWN_RUN, canonical
from raysys.results.records import PROVENANCE_COLUMNS, make_row, read_results, unit_violations

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = sorted((ROOT / "results").glob("*.parquet")) + sorted((ROOT / "results" / "runs").glob("*.parquet"))
FLAG_COLUMNS = ("bucket_size_mb", "ddp_bucket_mb", "rep_ms", "warmup_ms")  # configuration: the flag's spelling


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_results_follow_the_column_convention(path):
    df = pd.read_parquet(path)
    assert unit_violations(df.columns, config=FLAG_COLUMNS) == []
    assert canonical(df, None if "sweep" in df else path.stem, siblings=path.parent) is df  # nothing to migrate
    assert set(PROVENANCE_COLUMNS) <= set(df.columns), set(PROVENANCE_COLUMNS) - set(df.columns)
    shas = df["git_sha"].astype(str)
    assert shas.str.fullmatch(r"[0-9a-f]{12}(-dirty)?|unknown").all(), sorted(shas.unique())
    assert df["run_id"].notna().all() and "rank_spread" not in df


def _legacy_ddp_rows() -> pd.DataFrame:
    return pd.DataFrame({"sweep": "ddp", "trial_id": ["a", "b"], "variant": ["single", "bucketed"],
                         "bucket_size_mb": [math.nan, 25.0], "step_ms": [101.0, 120.0], "step_ms_median": [100.0, 118.5],
                         "host_forward_ms": [3.0, 4.0], "peak_memory_gib": [1.5, math.nan], "grad_mib": [2.0, 2.0],
                         "rank_spread": [0.01, 0.02], "git_sha": ["4f0b020", "4f0b020-dirty"], "status": "ok"})


def test_migration_converts_names_and_units_and_is_idempotent(tmp_path):
    old = _legacy_ddp_rows()
    new = canonical(old)
    assert new["step_median_s"].tolist() == pytest.approx([0.1, 0.1185])
    assert new["step_mean_s"].tolist() == pytest.approx([0.101, 0.120])
    assert new["host_forward_median_s"].tolist() == pytest.approx([0.003, 0.004])
    assert new["peak_memory_bytes"].iloc[0] == 1.5 * 2**30 and math.isnan(new["peak_memory_bytes"].iloc[1])
    assert new["grad_bytes"].tolist() == [2 * 2**20] * 2 and new["rank_spread_rel"].tolist() == [0.01, 0.02]
    assert new["bucket_size_mb"].equals(old["bucket_size_mb"])  # a configuration column keeps its flag's name
    assert new["git_sha"].tolist() == ["4f0b02073c45", "4f0b02073c45-dirty"]  # the repository knows the commit
    assert (new["run_id"] == UNKNOWN_RUN).all()
    assert unit_violations(new.columns, config=FLAG_COLUMNS) == []
    assert canonical(new) is new
    # the same rows under another study's name: rank_spread there is a ratio (allreduce) or left alone
    assert "rank_spread_ratio" in canonical(old.assign(sweep="allreduce"))
    board = canonical(pd.DataFrame({"sweep": ["leaderboard"], "step_s": [5.5], "attention_ms_sdpa": [250.0]}))
    assert board[["step_median_s", "attention_sdpa_s"]].iloc[0].tolist() == pytest.approx([5.5, 0.25])
    # on disk: the file is rewritten once, a second run changes nothing, and read_results reads old files alike
    old.to_parquet(tmp_path / "ddp.parquet")
    assert read_results(tmp_path / "ddp.parquet")["step_median_s"].tolist() == pytest.approx([0.1, 0.1185])
    assert cli.main(["migrate", "--check", str(tmp_path)]) == 1
    assert cli.main(["migrate", str(tmp_path)]) == 0 and cli.main(["migrate", "--check", str(tmp_path)]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "ddp.parquet"), new, check_like=True)


def test_rows_carry_the_convention_and_full_commits(monkeypatch):
    import raysys.results.records

    monkeypatch.setenv("RAYSYS_GIT_SHA", "0123456789abcdef0123456789abcdef01234567")
    raysys.results.records._git_sha.cache_clear()
    try:
        row = make_row("demo", {"bucket_size_mb": 25}, {"step_median_s": 0.1, "peak_bytes": 10})
    finally:
        raysys.results.records._git_sha.cache_clear()
    assert row["git_sha"] == "0123456789ab"
    assert unit_violations(row, config=["bucket_size_mb"]) == []
    assert unit_violations(["step_ms", "time_p20_s", "peak_gib", "grad_mib", "cpu_us", "step_min_s"]) == [
        "step_ms", "peak_gib", "grad_mib", "cpu_us"]
    for metric in ("step_ms_median", "peak_memory_gib"):  # a study still writing ms or GiB fails at its first row
        with pytest.raises(ValueError, match=f"metric '{metric}' is not in seconds or bytes"):
            make_row("demo", {"bucket_size_mb": 25}, {metric: 1.0})


def test_which_ddp_variant_was_fastest_in_bf16_is_one_groupby():
    """The committed DDP rows answer it with one groupby over (dtype, label), in seconds; the study's own report
    names the same winner among its variants at the same time."""
    from sweeps import ddp

    df = pd.read_parquet(ROOT / "results" / "ddp.parquet")
    assert df.groupby(["dtype", "label"]).size().max() == 1  # `label` names one row per dtype
    ok = df[(df.status == "ok") & (df.variant != "single")]  # single: no communication, the reference
    bf16 = ok.groupby(["dtype", "label"])["step_median_s"].min().loc["bf16"].sort_values()
    fastest, runner_up = bf16.index[0], bf16.index[1]
    by_how_much = bf16.iloc[1] / bf16.iloc[0]
    assert 0 < bf16.iloc[0] < 10 and by_how_much >= 1  # seconds, sorted
    ours = ok[(ok.dtype == "bf16") & (ok.variant != "torch")].groupby("label")["step_median_s"].min()
    line = next(t for t in ddp.targets(ddp.with_ratios(df)) if t.startswith("- bf16"))
    assert f"`{ours.idxmin()}` at {1e3 * ours.min():.1f} ms" in line
    assert fastest != runner_up


def test_reports_read_files_written_before_the_convention(tmp_path):
    """A file of older code (tonight's GPU runs) still reports: the readers go through the migration."""
    from raysys.cluster.sweep import read_sweep
    from sweeps import leaderboard

    old = pd.DataFrame({"sweep": "leaderboard_tune", "trial_id": ["a", "b"], "offset": [0, 1], "status": "ok",
                        "policy": ["full*2", "full*3"], "step_s": [5.5, 5.25], "peak_bytes": [1e9, 9e8],
                        "predicted_peak_bytes": [1e9, 9e8], "git_sha": "unknown"})
    old.to_parquet(tmp_path / "leaderboard_tune.parquet")
    (md,) = leaderboard.write_reports(tmp_path)
    assert "step_median_s" in md.read_text() and "plan / best = 1.048" in md.read_text()
    assert read_sweep(tmp_path, "leaderboard_tune")["step_median_s"].tolist() == [5.5, 5.25]
