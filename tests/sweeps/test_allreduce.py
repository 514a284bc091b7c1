"""sweeps/allreduce.py end to end on CPU (gloo) on the session's Ray: rows, skipped world sizes, both
launchers, --resume, NCCL settings reaching every rank, the markdown/PNG report and its target check; and its
argument parsing."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from sweeps import allreduce
from tests.raysys.ray_fixtures import ray_cluster  # noqa: F401  (the session's one Ray)


def test_parse_size_and_label():
    assert allreduce.parse_size("1KB") == 1000 and allreduce.parse_size("10MB") == 10**7
    assert allreduce.parse_size("1GB") == 10**9 and allreduce.parse_size("64MiB") == 64 * 2**20
    assert allreduce.parse_size("1GiB") == 2**30 and allreduce.parse_size("4096") == 4096
    assert [allreduce.size_label(n) for n in (1000, 10**7, 10**9, 1500)] == ["1KB", "10MB", "1GB", "1500B"]
    assert [allreduce.size_label(n) for n in (2**30, 512 * 2**20, 2**20, 8192, 1024 * 10**6)] == [
        "1GiB", "512MiB", "1MiB", "8KiB", "1024MB"]
    for bad in ("1TB", "ten", "0KB", ""):
        with pytest.raises(ValueError, match="size"):
            allreduce.parse_size(bad)


def test_default_gpu_sizes_are_powers_of_two_up_to_1GiB():
    sizes = [allreduce.parse_size(s) for s in allreduce.DEFAULTS["cuda"]["sizes"].split(",")]
    assert all(n & (n - 1) == 0 for n in sizes) and min(sizes) == 2**20 and max(sizes) == 2**30
    assert [t["size"] for t in allreduce.trials(["all_reduce"], sizes, 5, 50)] == [
        "1MiB", "8MiB", "64MiB", "128MiB", "512MiB", "1GiB"]


def test_parse_nccl_env():
    assert allreduce.parse_nccl_env("default") == allreduce.parse_nccl_env("") == {}
    env = allreduce.parse_nccl_env("NCCL_MAX_NCHANNELS=32, NCCL_MIN_NCHANNELS=32")
    assert env == {"NCCL_MAX_NCHANNELS": "32", "NCCL_MIN_NCHANNELS": "32"}
    assert allreduce.nccl_env_label(env) == "NCCL_MAX_NCHANNELS=32,NCCL_MIN_NCHANNELS=32"
    assert allreduce.parse_nccl_env("NCCL_NVLS_ENABLE=0") == {"NCCL_NVLS_ENABLE": "0"}  # what is set anyway
    with pytest.raises(ValueError, match="multicast must stay off"):
        allreduce.parse_nccl_env("NCCL_ALGO=Ring,NCCL_NVLS_ENABLE=1")
    for bad in ("ALGO=Ring", "NCCL_ALGO", "NCCL_ALGO=", "nccl_algo=Ring"):
        with pytest.raises(ValueError, match="NCCL_NAME=value"):
            allreduce.parse_nccl_env(bad)
    with pytest.raises(ValueError, match="twice"):
        allreduce.parse_nccl_env("NCCL_ALGO=Ring,NCCL_ALGO=Tree")


def _row(op, size_bytes, world_size, launcher, visibility, busbw, nccl_env="", run_id="run1"):
    return dict(op=op, size=allreduce.size_label(size_bytes), size_bytes=size_bytes, num_bytes=size_bytes,
                world_size=world_size, launcher=launcher, gpu_visibility=visibility, nccl_env=nccl_env,
                status="ok", error="", busbw_GBps=busbw, time_mean_s=1e-3, device_name="H200", run_id=run_id)


def test_target_check_and_nccl_setting_table():
    gib, mib = 2**30, 2**20
    rows = [_row("all_reduce", gib, 2, "mp", "shared", 360.0), _row("all_reduce", gib, 2, "ray", "shared", 340.0),
            _row("all_gather", gib, 2, "mp", "shared", 300.0), _row("all_gather", gib, 2, "ray", "shared", 294.0),
            _row("all_reduce", mib, 2, "mp", "shared", 10.0), _row("all_reduce", mib, 2, "ray", "shared", 9.0),
            _row("all_reduce", gib, 2, "mp", "shared", 340.0, "NCCL_PROTO=Simple")]
    lines = allreduce.target_lines(pd.DataFrame(rows))
    assert ("all_reduce busbw at 1GiB >= 350 GB/s, 2 ranks, default: PASS (best 360.0 GB/s; mp 360.0, "
            "ray shared 340.0)") in lines
    assert any(line.startswith("all_reduce busbw at 1GiB >= 350 GB/s, 2 ranks, NCCL_PROTO=Simple: FAIL")
               for line in lines)
    # ray / mp at 1 GiB: all_reduce 340/360 = 0.944 fails, all_gather 0.98 would pass; the worst decides
    assert any(line.startswith("ray shared / mp busbw at the largest size (1GiB) >= 0.97, 2 ranks, default: FAIL "
                               "(run run1; worst 0.944, all_reduce") for line in lines), lines
    # "in the same run": a ray row is compared only with the mp rows of its own run
    split = [_row("all_reduce", gib, 2, "mp", "shared", 355.0, run_id="scan"),
             _row("all_reduce", gib, 2, "ray", "shared", 355.0, run_id="grid"),
             _row("all_gather", gib, 2, "mp", "shared", 300.0, run_id="grid"),
             _row("all_gather", gib, 2, "ray", "shared", 300.0, run_id="grid")]
    (line,) = [t for t in allreduce.target_lines(pd.DataFrame(split)) if "/ mp" in t]
    assert ("INCOMPLETE (run grid; worst 1.000, all_gather; all_gather 1.000; not measured by both in that run: "
            "all_reduce)") in line
    (line,) = [t for t in allreduce.target_lines(pd.DataFrame(split[:2])) if "/ mp" in t]
    assert "not measured in one run" in line
    md = allreduce.markdown(pd.DataFrame(rows))
    table = md.split("Bus bandwidth by NCCL setting")[1].split("Targets:")[0]
    # one line per measured setting of a cell that has more than one, the fastest first, against the default
    assert re.search(r"\| all_reduce +\| 1GiB +\| +2 \| mp +\| default +\| +360 \| +1 +\|\n"
                     r"\| all_reduce +\| 1GiB +\| +2 \| mp +\| NCCL_PROTO=Simple +\| +340 \| +0.9444 \|", table), table
    assert "| ray shared" not in table and "all_gather" not in table  # cells with one setting only
    assert md.index("2 ranks, default: PASS") < md.index("2 ranks, NCCL_PROTO=Simple: FAIL")  # default first

    old = [_row("all_reduce", 10**9, 2, "mp", "shared", 327.7)]  # a file from before 1 GiB and --nccl-env
    for row in old:
        del row["nccl_env"]
    (line,) = [t for t in allreduce.target_lines(pd.DataFrame(old)) if "350" in t]
    assert ("not measured at 1GiB (1,073,741,824 B); the largest all_reduce, 1GB (1,000,000,000 B), "
            "reached 327.7") in line


def test_the_report_puts_the_planner_with_the_measured_bandwidth_under_the_gpu_grid(tmp_path):
    """allreduce.md carries the parallelism planner at the measured bus bandwidth (GPU rows of the grid only), and
    `python -m raysys report` shows it as the study wrote it."""
    from raysys.results.report import report
    from raysys.results.records import ResultWriter, make_row

    rows = [make_row("allreduce", {"op": "all_reduce", "world_size": 2, "num_bytes": n, "size_bytes": n,
                                   "size": allreduce.size_label(n), "launcher": "mp", "gpu_visibility": "shared",
                                   "nccl_env": ""}, {"busbw_GBps": bw, "time_mean_s": 1e-3}, backend="nccl")
            for n, bw in ((2**20, 100.0), (2**30, 300.0))]
    with ResultWriter(tmp_path, "allreduce") as writer:
        writer.write(rows)
    md, _ = allreduce.write_report(pd.DataFrame(rows), tmp_path)
    text = md.read_text()
    assert "### Parallelism planner (xl FFN" in text and "all_reduce 1,073,741,824 B, 2 ranks" in text
    assert "W = 300 GB/s" in text and "#### Largest device count" in text
    assert "### Parallelism planner" in report(tmp_path)
    md, _ = allreduce.write_report(pd.DataFrame(rows).assign(backend="gloo"), tmp_path)  # CPU rows: no planner
    assert "Parallelism planner" not in md.read_text()


def test_bad_arguments_fail_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"--ops: \['allreduce'\]"):
        allreduce.main(["--ops", "allreduce", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--launchers"):
        allreduce.main(["--launchers", "torchrun", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="sweep name"):
        allreduce.main(["--sweep-name", "../x", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--report-only"):
        allreduce.main(["--report-only", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="multicast"):
        allreduce.main(["--nccl-env", "NCCL_NVLS_ENABLE=1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="names one setting twice"):
        allreduce.main(["--nccl-env", "NCCL_ALGO=Ring", "--nccl-env", "NCCL_ALGO=Ring", "--out", str(tmp_path)])
    assert not (tmp_path / "allreduce.parquet").exists()


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


@pytest.mark.slow
@pytest.mark.ray
def test_nccl_env_reaches_every_rank_of_both_launchers(ray_cluster, tmp_path):  # noqa: F811
    df = allreduce.main(["--device", "cpu", "--sizes", "4KiB", "--ops", "all_reduce", "--iters", "2",
                         "--world-sizes", "2", "--launchers", "ray,mp", "--out", str(tmp_path),
                         "--nccl-env", "NCCL_ALGO=Ring,NCCL_PROTO=Simple"])
    assert len(df) == 2 and (df["status"] == "ok").all() and set(df["launcher"]) == {"ray", "mp"}
    assert (df["nccl_env"] == "NCCL_ALGO=Ring,NCCL_PROTO=Simple").all() and (df["size"] == "4KiB").all()
    for seen in df["nccl_vars"]:  # rank 0's environment: the setting, and multicast still off
        assert {"NCCL_ALGO=Ring", "NCCL_PROTO=Simple", "NCCL_NVLS_ENABLE=0"} <= set(seen.split(","))
    md = (tmp_path / "allreduce.md").read_text()
    assert "NCCL variables in the ranks (NCCL_ALGO=Ring,NCCL_PROTO=Simple)" in md and "Targets:" in md
