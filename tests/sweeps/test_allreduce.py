"""sweeps/allreduce.py end to end on CPU (gloo) on the session's Ray: rows, skipped world sizes, both
launchers, --resume, the markdown/PNG report; and its argument parsing."""

from __future__ import annotations

import pandas as pd
import pytest

from sweeps import allreduce
from tests.raysys.ray_fixtures import ray_cluster  # noqa: F401  (the session's one Ray)


def test_parse_size_and_label():
    assert allreduce.parse_size("1KB") == 1000 and allreduce.parse_size("10MB") == 10**7
    assert allreduce.parse_size("1GB") == 10**9 and allreduce.parse_size("64MiB") == 64 * 2**20
    assert allreduce.parse_size("4096") == 4096
    assert [allreduce.size_label(n) for n in (1000, 10**7, 10**9, 1500)] == ["1KB", "10MB", "1GB", "1500B"]
    for bad in ("1TB", "ten", "0KB", ""):
        with pytest.raises(ValueError, match="size"):
            allreduce.parse_size(bad)


def test_bad_arguments_fail_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"--ops: \['allreduce'\]"):
        allreduce.main(["--ops", "allreduce", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--launchers"):
        allreduce.main(["--launchers", "torchrun", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--report-only"):
        allreduce.main(["--report-only", "--out", str(tmp_path)])


@pytest.mark.slow
@pytest.mark.ray
def test_sweep_rows_skips_resume_and_report(ray_cluster, tmp_path):  # noqa: F811
    common = ["--device", "cpu", "--sizes", "1KB,8KB", "--ops", "all_reduce,reduce_scatter", "--iters", "2",
              "--out", str(tmp_path)]
    # 16 ranks need 8 CPUs (two ranks per core at most) in one node; the session's largest node has 4.
    first = allreduce.main(common + ["--world-sizes", "2,16", "--launchers", "ray"])
    assert len(first) == 8
    ran, skipped = first[first["world_size"] == 2], first[first["world_size"] == 16]
    assert (ran["status"] == "ok").all() and (ran["verified"]).all() and (ran["busbw_GBps"] > 0).all()
    assert (skipped["status"] == "skipped").all()
    assert skipped["error"].str.contains(r"asked for 16 ranks .* in one node \(STRICT_PACK\)").all()
    assert set(ran["num_bytes"]) == {1000, 8000} and (ran["backend"] == "gloo").all()

    # --resume with the mp launcher added: the Ray trials are kept as they are, the mp ones run.
    second = allreduce.main(common + ["--world-sizes", "2", "--launchers", "ray,mp", "--resume"])
    on_disk = pd.read_parquet(tmp_path / "allreduce.parquet")
    assert len(second) == len(on_disk) == 12
    kept = on_disk[on_disk["launcher"] == "ray"].set_index("trial_id")["utc"]
    assert kept.to_dict() == first.set_index("trial_id")["utc"].to_dict()
    mp = on_disk[on_disk["launcher"] == "mp"]
    assert len(mp) == 4 and (mp["status"] == "ok").all() and (mp["gpu_visibility"] == "none").all()

    md = (tmp_path / "allreduce.md").read_text()
    assert "Bus bandwidth (GB/s)" in md and "ray / mp |" in md and "Not measured" in md
    assert (tmp_path / "allreduce.png").stat().st_size > 10_000
    redrawn = allreduce.main(["--report-only", "--out", str(tmp_path)])
    assert len(redrawn) == 12
