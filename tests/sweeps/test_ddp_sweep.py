"""sweeps/ddp.py and sweeps/sharded_optimizer.py on the CPU: grid parsing, the overlap arithmetic, the trial
functions on 2 gloo ranks with a stand-in RankContext, and the whole script (plain processes and Ray)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from raysys.rank import RankContext
from sweeps import ddp as ddp_sweep
from sweeps import sharded_optimizer as sharded_sweep
from tests.parallel.dist_utils import run_ranks
from tests.raysys.ray_fixtures import ray_cluster  # noqa: F401  (the session's one Ray)

TINY = dict(size="tiny", context_length=16, batch_per_rank=2, warmup=1, steps=2)


def _ctx(rank: int, world_size: int) -> RankContext:
    return RankContext(rank=rank, world_size=world_size, local_rank=rank, node_rank=0, device=torch.device("cpu"),
                       backend="gloo", process_group=dist.group.WORLD)


# ---------------------------------------------------------------------------------------------------- pure logic
def test_parse_variant():
    assert ddp_sweep.parse_variant("bucketed:100") == {"variant": "bucketed", "bucket_size_mb": 100.0,
                                                       "bucket_view": True, "label": "bucketed 100MB"}
    assert ddp_sweep.parse_variant("bucketed_copy:1")["bucket_view"] is False
    assert ddp_sweep.parse_variant("torch")["bucket_size_mb"] == 25.0
    assert ddp_sweep.parse_variant("naive")["bucket_size_mb"] is None
    for bad, match in (("ring", "not one of"), ("naive:10", "only bucketed"), ("bucketed:x", "not a number"),
                       ("bucketed:0", "positive")):
        with pytest.raises(ValueError, match=match):
            ddp_sweep.parse_variant(bad)


def test_trials_grid_and_validation():
    trials = ddp_sweep.ddp_trials(dtypes=["fp32", "bf16"], variants=["single", "naive", "bucketed:10"],
                                  profile=["naive"], **TINY)
    assert [(t["dtype"], t["label"], t["profile"]) for t in trials] == [
        ("fp32", "single", False), ("fp32", "naive", True), ("fp32", "bucketed 10MB", False),
        ("bf16", "single", False), ("bf16", "naive", True), ("bf16", "bucketed 10MB", False)]
    with pytest.raises(ValueError, match="fp8"):
        ddp_sweep.ddp_trials(dtypes=["fp8"], variants=["naive"], profile=[], **TINY)
    with pytest.raises(ValueError, match="size 'huge'"):
        ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["naive"], profile=[], **{**TINY, "size": "huge"})
    with pytest.raises(ValueError, match="warmup"):
        sharded_sweep.trials(dtypes=["fp32"], **{**TINY, "warmup": 0})


def test_overlap_of_intervals():
    # comm [0,10) and [20,30); compute [5,25): overlapped 5 + 5 of 20.
    assert ddp_sweep.overlap([(0, 10), (20, 30)], [(5, 12), (11, 25)]) == (20, 10)
    assert ddp_sweep.overlap([(0, 10)], []) == (10, 0)
    assert ddp_sweep.overlap([(0, 10)], [(0, 3), (2, 4), (8, 20)]) == (10, 6)     # overlapping compute counts once
    assert ddp_sweep.overlap([], [(0, 1)]) == (0, 0)


def test_kernel_intervals_split_nccl_from_compute():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 10, 20), event("sm90_xmma_gemm_f32", 0, 15),
              event("Memcpy DtoD (Device -> Device)", 12, 30), event("DistributedDataParallel.forward", 0, 40,
                                                                      annotation=True),
              event("aten::mm", 0, 50, device=DeviceType.CPU)]
    comm, compute = ddp_sweep.kernel_intervals(events)
    assert comm == [(10, 20)] and compute == [(0, 15)]
    assert ddp_sweep.overlap(comm, compute) == (10, 5)


def test_ratios_and_targets():
    df = pd.DataFrame({"status": "ok", "dtype": "bf16", "variant": ["single", "overlapped", "bucketed", "torch"],
                       "label": ["single", "overlapped", "bucketed 100MB", "torch DDP 25MB"],
                       "step_ms": [100.0, 103.0, 101.0, 102.0]})
    ratios = ddp_sweep.with_ratios(df)
    assert ratios["vs_single"].tolist() == pytest.approx([1.0, 1.03, 1.01, 1.02])
    assert ratios["vs_torch"].tolist() == pytest.approx([100 / 102, 103 / 102, 101 / 102, 1.0])
    (line,) = ddp_sweep.targets(ratios)
    assert "`bucketed 100MB`" in line and "1.010x single (met" in line and "0.990x torch DDP (met" in line


# ---------------------------------------------------------------------------------------------------- trials on 2 ranks
def _run_trials(rank: int, world_size: int, configs: list[dict], out_dir: str) -> list[dict]:
    ctx = _ctx(rank, world_size)
    out = [ddp_sweep.ddp_trial(ctx, c, out_dir=out_dir) for c in configs[:-2]]
    out += [sharded_sweep.sharded_trial(ctx, c) for c in configs[-2:]]
    return out


@pytest.mark.multiproc
def test_trial_functions_on_gloo_ranks(tmp_path):
    configs = ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["single", "naive", "overlapped", "bucketed:0.05"],
                                   profile=["overlapped"], **TINY)
    configs += sharded_sweep.trials(dtypes=["fp32"], **TINY)
    per_rank = run_ranks(_run_trials, 2, configs, str(tmp_path))
    single, naive, overlapped, bucketed, unsharded, sharded = per_rank[0]
    for m in (single, naive, overlapped, bucketed):
        assert m["step_ms"] > 0 and m["step_ms_std"] >= 0
        assert all(m[f"{phase}_ms"] >= 0 for phase in ddp_sweep.PHASES)
        # The phases are parts of the step.
        assert sum(m[f"{phase}_ms"] for phase in ddp_sweep.PHASES) <= m["step_ms"] * 1.05 + 0.5
    num_tensors = 2 * 9 + 3                 # tiny: 2 blocks of 9 tensors, embedding, final norm, LM head
    assert naive["collectives_per_step"] == overlapped["collectives_per_step"] == num_tensors
    assert 1 < bucketed["collectives_per_step"] < num_tensors
    assert single["collectives_per_step"] != single["collectives_per_step"]      # NaN: no communication
    # Profiled on rank 0: a trace file; gloo has no NCCL kernels, so no overlap figure on the CPU.
    assert overlapped["trace_path"].endswith("ddp_overlapped_fp32.json.gz")
    assert (tmp_path / "traces" / "ddp_overlapped_fp32.json.gz").stat().st_size > 0
    assert "trace_path" not in per_rank[1][2]

    # Sharding halves (roughly) each rank's AdamW state and leaves parameters and gradients alone.
    for point in ("before_step", "after_step"):
        assert sharded[f"params_{point}_bytes"] == unsharded[f"params_{point}_bytes"]
        assert sharded[f"grads_{point}_bytes"] == unsharded[f"grads_{point}_bytes"]
    full = unsharded["optimizer_state_after_step_bytes"]
    shards = [r[-1]["optimizer_state_after_step_bytes"] for r in per_rank]
    assert sum(shards) == pytest.approx(full, rel=0.01)
    assert max(shards) < 0.75 * full
    assert unsharded["optimizer_state_init_bytes"] == 0          # AdamW allocates its state at the first step


# ---------------------------------------------------------------------------------------------------- the script
ARGS = ["--device", "cpu", "--size", "tiny", "--context-length", "16", "--warmup", "1", "--steps", "2",
        "--variants", "single,flat,bucketed:0.05,torch", "--profile", "flat"]


@pytest.mark.ray
@pytest.mark.slow
def test_script_on_ray(tmp_path, ray_cluster):  # noqa: F811
    """The product's command, `python sweeps/ddp.py`, on the session's Ray (gloo ranks), both studies."""
    frames = ddp_sweep.main([*ARGS, "--out", str(tmp_path)])
    ddp, sharded = frames["ddp"], frames["sharded_optimizer"]
    assert (ddp["status"] == "ok").all(), ddp[["label", "dtype", "status", "error"]]
    assert (sharded["status"] == "ok").all(), sharded[["dtype", "sharded", "status", "error"]]
    assert len(ddp) == 4 and len(sharded) == 2           # fp32 only on the CPU by default
    assert set(ddp["launcher"]) == {"ray"} and set(ddp["backend"]) == {"gloo"} and set(ddp["world_size"]) == {2}
    for name in ("ddp.parquet", "ddp.md", "ddp.png", "sharded_optimizer.parquet", "sharded_optimizer.md",
                 "sharded_optimizer.png", "traces/ddp_flat_fp32.json.gz"):
        assert (tmp_path / name).stat().st_size > 0, name
    text = (tmp_path / "ddp.md").read_text()
    assert "bucketed 0.05MB" in text and "Targets (same run)" in text
    # --resume runs nothing new; --report-only redraws from the files.
    again = ddp_sweep.main([*ARGS, "--out", str(tmp_path), "--resume", "--studies", "ddp"])
    assert again["ddp"]["trial_id"].tolist() == ddp["trial_id"].tolist()
    assert again["ddp"]["utc"].tolist() == ddp["utc"].tolist()
    assert set(ddp_sweep.main(["--report-only", "--out", str(tmp_path)])) == {"ddp", "sharded_optimizer"}


def test_bad_flags_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="world-size"):
        ddp_sweep.main(["--world-size", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="studies"):
        ddp_sweep.main(["--studies", "fsdp", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="report-only"):
        ddp_sweep.main(["--report-only", "--out", str(tmp_path)])
