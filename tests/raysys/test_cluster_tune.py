"""raysys.cluster.tune_run: every Ray Tune trial, errored ones included, becomes one Parquet row; resume."""

from __future__ import annotations

import sys

import pytest
import ray
from ray import tune

from raysys.cluster import tune_run
from raysys.results import read_results

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


def test_tune_run_rejects_bad_input(ray_cluster, tmp_path):
    with pytest.raises(ValueError, match="may only name 'cpu' and 'gpu'"):
        tune_run(_square, {"x": 1}, sweep="bad", out_dir=tmp_path, resources={"tpu": 1})
    with pytest.raises(ValueError, match="resume=True needs a grid"):
        tune_run(_square, {"x": tune.choice([1, 2])}, sweep="bad", out_dir=tmp_path, resume=True)
