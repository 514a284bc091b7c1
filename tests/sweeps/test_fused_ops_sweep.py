"""sweeps/fused_ops.py at its CPU size (kernels under TRITON_INTERPRET=1): every row written, with its figures."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from raysys.results.records import ResultsError
from sweeps import fused_ops

pytestmark = [pytest.mark.interpret, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke size; the GPU run is the study")]


def test_cpu_run_writes_one_row_per_op_and_implementation(tmp_path):
    argv = ["--device", "cpu", "--compile-backend", "aot_eager", "--out", str(tmp_path)]
    path = fused_ops.main(argv)
    df = pd.read_parquet(path)
    assert sorted(zip(df["op"], df["impl"])) == sorted(
        [("linear_cross_entropy", i) for i in ("fused_triton", "reference", "compiled")]
        + [("adamw", i) for i in ("fused_triton", "reference", "torch_foreach", "torch_fused")])
    assert (df["status"] == "ok").all(), df[["impl", "error"]]
    assert (df["time_median_s"] > 0).all()
    loss = df[df["op"] == "linear_cross_entropy"].set_index("impl")
    assert loss.loc["compiled", "time_vs_compiled"] == 1.0
    assert loss.loc["fused_triton", "time_vs_compiled"] == pytest.approx(
        loss.loc["fused_triton", "time_median_s"] / loss.loc["compiled", "time_median_s"])
    adamw = df[df["op"] == "adamw"]
    assert (adamw["floor_s"] > 0).all() and (adamw["num_tensors"] == 12).all()
    assert (adamw["time_vs_floor"] == adamw["time_median_s"] / adamw["floor_s"]).all()
    with pytest.raises(ResultsError, match="already exists"):
        fused_ops.main(argv)


@pytest.mark.parametrize("argv", [["--rep-ms", "0"], ["--warmup-ms", "-1"]])
def test_bad_timing_flags_exit(argv):
    with pytest.raises(SystemExit):
        fused_ops.parse_args(argv)
