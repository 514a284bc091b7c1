"""raysys.cluster.sweep.tune_run: every Ray Tune trial, errored ones included, becomes one Parquet row the moment it
ends; a run stopped by SIGTERM or its time budget keeps the finished trials, and resume runs the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
from ray import tune

from raysys.cluster.sweep import tune_run
from raysys.results.records import read_results
from tests.subprocess_utils import repo_env, signal_when

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # pytest's module name is not importable by workers


def _square(config: dict) -> None:
    if config["x"] == 2:
        raise ValueError("x == 2 is refused on purpose")
    tune.report({"y": config["x"] ** 2, "x_seen": config["x"]})


def _returns_dict(config: dict) -> dict:
    return {"y": config["x"] ** 2, "x_seen": config["x"]}


def test_tune_run_rows_errors_and_resume(ray_cluster, tmp_path):
    space = {"x": tune.grid_search([1, 2, 3]), "tag": "toy"}
    df = tune_run(_square, space, sweep="tune_toy", out_dir=tmp_path, resources={"cpu": 1})
    by_x = df.set_index("x")
    assert sorted(by_x.index) == [1, 2, 3] and (df["tag"] == "toy").all()
    assert by_x.loc[1, "status"] == "ok" and by_x.loc[1, "y"] == 1 and by_x.loc[1, "x_seen"] == 1
    assert by_x.loc[3, "status"] == "ok" and by_x.loc[3, "y"] == 9
    assert by_x.loc[2, "status"] == "error" and "x == 2 is refused on purpose" in by_x.loc[2, "error"]
    assert not {"training_iteration", "time_this_iter_s", "_raysys_config"} & set(df.columns)  # Tune's bookkeeping
    assert len(read_results(tmp_path / "tune_toy.parquet")) == 3

    # resume: x=1 and x=3 are done; x=2 (error) is retried, x=4 is new; a trainable may also return its metrics.
    space = {"x": tune.grid_search([1, 2, 3, 4]), "tag": "toy"}
    df2 = tune_run(_returns_dict, space, sweep="tune_toy", out_dir=tmp_path, resume=True, show=False)
    assert sorted(df2["x"]) == [2, 4] and (df2["status"] == "ok").all()
    assert dict(zip(df2["x"], df2["y"])) == {2: 4, 4: 16}
    on_disk = read_results(tmp_path / "tune_toy.parquet").set_index("x")
    assert sorted(on_disk.index) == [1, 2, 3, 4] and (on_disk["status"] == "ok").all()


def _pid(config: dict) -> dict:
    return {"worker_pid": os.getpid()}  # not "pid": Tune reports its own


def test_tune_run_reuses_actors_when_asked(ray_cluster, tmp_path):
    reused = tune_run(_pid, {"x": tune.grid_search([1, 2, 3, 4])}, sweep="tune_reuse", out_dir=tmp_path,
                      max_concurrent_trials=1, reuse_actors=True, show=False)
    # Without reuse each trial starts a process of its own (seconds each on 2 cores): two in a row show it.
    fresh = tune_run(_pid, {"x": tune.grid_search([1, 2])}, sweep="tune_fresh", out_dir=tmp_path,
                     max_concurrent_trials=1, show=False)
    assert (reused["status"] == "ok").all() and len(reused) == 4
    assert reused["worker_pid"].nunique() == 1 and fresh["worker_pid"].nunique() == 2


def test_tune_run_rejects_bad_input(ray_cluster, tmp_path):
    with pytest.raises(ValueError, match="may only name 'cpu' and 'gpu'"):
        tune_run(_square, {"x": 1}, sweep="bad", out_dir=tmp_path, resources={"tpu": 1})
    with pytest.raises(ValueError, match="resume=True needs a grid"):
        tune_run(_square, {"x": tune.choice([1, 2])}, sweep="bad", out_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="max_trials needs a grid"):
        tune_run(_square, {"x": tune.choice([1, 2])}, sweep="bad", out_dir=tmp_path, max_trials=1)
    with pytest.raises(ValueError, match=r"max_trials \(-1\)"):
        tune_run(_square, {"x": 1}, sweep="bad", out_dir=tmp_path, max_trials=-1)
    with pytest.raises(ValueError, match=r"time_budget_s \(0\)"):
        tune_run(_square, {"x": 1}, sweep="bad", out_dir=tmp_path, time_budget_s=0)
    assert not (tmp_path / "bad.parquet").exists()


# A driver whose third trial hangs: it is stopped from outside (SIGTERM, as `timeout` sends) while trial 3 runs.
_HANGING_DRIVER = """
import os, sys, time
from pathlib import Path
from ray import tune
from raysys.cluster.sweep import init_ray, tune_run

out, marker, address = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def trainable(config):
    if config["x"] == 3:
        marker.write_text(str(os.getpid()))
        time.sleep(600)
    tune.report({"y": config["x"] ** 2})

init_ray(address)
tune_run(trainable, {"x": tune.grid_search([1, 2, 3, 4])}, sweep="tune_hang", out_dir=out, show=False)
"""


def _rows(path: Path) -> pd.DataFrame:
    # read_results, not pd.read_parquet: the driver replaces the file as each trial ends, while this polls it.
    return read_results(path) if path.exists() else pd.DataFrame(columns=["x", "status"])


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def _hang_forever_on_3(config: dict) -> dict:
    if config["x"] == 3:
        time.sleep(600)
    return {"y": config["x"] ** 2}


def test_sigterm_keeps_finished_trials_and_resume_runs_the_rest(ray_cluster, tmp_path):
    script, marker, parquet = tmp_path / "driver.py", tmp_path / "trial3.pid", tmp_path / "tune_hang.parquet"
    script.write_text(_HANGING_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(marker), ray_cluster["address"]],
                            env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The run cannot end (trial 3 sleeps 600 s), so rows on disk now were written as their trials ended.
    output, _ = signal_when(proc, lambda: marker.exists() and len(_rows(parquet)) == 3, signal.SIGTERM, wait_s=90)
    assert proc.returncode != 0, output
    assert f"tune_hang: interrupted after 3 of 4 trials; its rows are in {parquet}; rerun with --resume" in output, output
    rows = pd.read_parquet(parquet)
    assert sorted(rows["x"]) == [1, 2, 4] and (rows["status"] == "ok").all()
    assert dict(zip(rows["x"], rows["y"])) == {1: 1, 2: 4, 4: 16}
    # Ray was shut down with the driver: the hanging trial's process is gone.
    pid, deadline = int(marker.read_text()), time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"trial 3 (pid {pid}) outlived its driver"
        time.sleep(0.2)

    # resume: only trial 3 runs. It hangs again, so the time budget stops it: no row, and the others stay.
    grid = {"x": tune.grid_search([1, 2, 3, 4])}
    df = tune_run(_hang_forever_on_3, grid, sweep="tune_hang", out_dir=tmp_path, resume=True, time_budget_s=1,
                  show=False)
    assert df.empty and sorted(pd.read_parquet(parquet)["x"]) == [1, 2, 4]
    # resume with max_trials: of the trials not on disk (3 and the new 5), only the first runs.
    df = tune_run(_returns_dict, {"x": tune.grid_search([1, 2, 3, 4, 5])}, sweep="tune_hang", out_dir=tmp_path,
                  resume=True, max_trials=1, show=False)
    assert list(df["x"]) == [3] and list(df["y"]) == [9]
    on_disk = pd.read_parquet(parquet)
    assert sorted(on_disk["x"]) == [1, 2, 3, 4] and (on_disk["status"] == "ok").all()
