"""sweeps/ddp.py and sweeps/sharded_optimizer.py on the CPU: grid parsing, the overlap arithmetic and the profile
checks (raysys.measure.profiling), the trial functions on 2 gloo ranks with a stand-in RankContext (back to back, so a
trial that leaks its model into the next one fails), and the whole script (plain processes and Ray). The step
timer is tested in tests/raysys/measure/test_timing.py."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import weakref
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from torch.autograd import DeviceType

import raysys.training.step as step_module
from raysys.measure.profiling import StepProfile, kernel_intervals, overlap, profile_steps
from raysys.cluster.rank import RankContext
from raysys.results.records import trial_id
from raysys.measure.timing import PHASES
from sweeps import common
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
    capped = ddp_sweep.parse_variant("bucketed:100@8")
    assert capped == {"variant": "bucketed", "bucket_size_mb": 100.0, "bucket_view": True, "nccl_max_ctas": 8,
                      "sm_carveout": None, "label": "bucketed 100MB @8 CTAs"}
    carved = ddp_sweep.parse_variant("overlapped@8+carve")
    assert (carved["nccl_max_ctas"], carved["sm_carveout"], carved["label"]) == (8, 8, "overlapped @8 CTAs + carve-out")
    each = ddp_sweep.parse_variant("overlapped_each")
    assert (each["variant"], each["group_compiled"], each["label"]) == ("overlapped", False, "overlapped (each)")
    for bad, match in (("ring", "not one of"), ("naive:10", "only bucketed"), ("bucketed:x", "not a number"),
                       ("bucketed:0", "positive"), ("overlapped@0", "int >= 1"), ("overlapped@x", "int >= 1"),
                       ("single@8", "does not communicate"), ("bucketed:100@8+fast", "only suffix"),
                       ("torch@8+carve", "overlapped or bucketed")):
        with pytest.raises(ValueError, match=match):
            ddp_sweep.parse_variant(bad)


def test_trials_grid_and_validation():
    trials = ddp_sweep.ddp_trials(dtypes=["fp32", "bf16"], variants=["single", "naive", "bucketed:10"],
                                  profile=["naive"], **TINY)
    assert [(t["dtype"], t["label"], t["profile"]) for t in trials] == [
        ("fp32", "single", False), ("fp32", "naive", True), ("fp32", "bucketed 10MB", False),
        ("fp32", "single (rerun)", False),
        ("bf16", "single", False), ("bf16", "naive", True), ("bf16", "bucketed 10MB", False),
        ("bf16", "single (rerun)", False)]
    assert trials[3]["variant"] == "single" and all(t["max_steps"] == TINY["steps"] for t in trials)
    assert len({trial_id(t) for t in trials}) == len(trials)       # the rerun is its own trial
    # A capped variant is its own trial next to the uncapped one; the global cap applies to the others.
    capped = ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["single", "overlapped", "overlapped@8"], profile=[],
                                  rerun_single=False, nccl_max_ctas=16, **TINY)
    assert [(t["label"], t["nccl_max_ctas"]) for t in capped] == [
        ("single", 16), ("overlapped", 16), ("overlapped @8 CTAs", 8)]
    assert len({trial_id(t) for t in capped}) == 3
    # `overlapped_each` is its own trial, with a column only it has (the other rows' ids stay).
    pair = ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["overlapped", "overlapped_each"], profile=[], **TINY)
    assert ["group_compiled" in t for t in pair] == [False, True] and pair[1]["group_compiled"] is False
    for bad in (dict(variant="bucketed", bucket_size_mb=1.0, bucket_view=True), dict(variant="overlapped", group=1)):
        kwargs = {**pair[1].config(), "group_compiled": bad.pop("group", False), **bad}
        with pytest.raises(ValueError, match="group_compiled"):
            ddp_sweep.DDPTrial(**kwargs)
    # No rerun without other variants, or when asked not to.
    assert len(ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["single"], profile=[], **TINY)) == 1
    assert len(ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["single", "flat"], profile=[], rerun_single=False,
                                    **TINY)) == 2
    for kwargs, match in ((dict(dtypes=["fp8"]), "fp8"), (dict(size="huge"), "size 'huge'"),
                          (dict(max_steps=1), "max_steps"), (dict(nccl_max_ctas=0), "nccl_max_ctas"),
                          (dict(variants=["flat", "flat"]), "twice")):
        with pytest.raises(ValueError, match=match):
            ddp_sweep.ddp_trials(**{**dict(dtypes=["fp32"], variants=["naive"], profile=[], **TINY), **kwargs})
    with pytest.raises(ValueError, match="warmup"):
        sharded_sweep.trials(dtypes=["fp32"], **{**TINY, "warmup": 0})


def test_overlap_of_intervals():
    # comm [0,10) and [20,30); compute [5,25): overlapped 5 + 5 of 20.
    assert overlap([(0, 10), (20, 30)], [(5, 12), (11, 25)]) == (20, 10)
    assert overlap([(0, 10)], []) == (10, 0)
    assert overlap([(0, 10)], [(0, 3), (2, 4), (8, 20)]) == (10, 6)     # overlapping compute counts once
    assert overlap([], [(0, 1)]) == (0, 0)


def _event(name, start, end, device=DeviceType.CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def test_kernel_intervals_split_nccl_from_compute():
    events = [_event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 10, 20), _event("sm90_xmma_gemm_f32", 0, 15),
              _event("Memcpy DtoD (Device -> Device)", 12, 30), _event("DistributedDataParallel.forward", 0, 40,
                                                                       annotation=True),
              _event("aten::mm", 0, 50, device=DeviceType.CPU)]
    comm, compute = kernel_intervals(events)
    assert comm == [(10, 20)] and compute == [(0, 15)]
    assert overlap(comm, compute) == (10, 5)


def test_profile_status_names_what_is_missing():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    op, gemm, nccl = _event("aten::mm", 0, 5, DeviceType.CPU), _event("gemm", 0, 5), _event("ncclDevKernel_x", 1, 2)
    assert StepProfile([], cuda).status(expect_nccl=True) == "empty"
    assert StepProfile([op], cpu).status(expect_nccl=True) == "cpu"
    assert StepProfile([op], cuda).status(expect_nccl=False) == "no_gpu_kernels"
    assert StepProfile([op, gemm], cuda).status(expect_nccl=True) == "no_nccl_kernels"
    assert StepProfile([op, gemm], cuda).status(expect_nccl=False) == "ok"
    assert StepProfile([op, gemm, nccl], cuda).status(expect_nccl=True) == "ok"


def test_trial_functions_serialise_as_under_a_script():
    """`python sweeps/ddp.py` (what `ray job submit` runs) defines the trial functions in `__main__`, which Ray's
    cloudpickle serialises by value together with the globals they use (a function from an imported module
    goes by reference, so the other tests cannot see this); simulated here with register_pickle_by_value."""
    from ray import cloudpickle

    from sweeps import fsdp as fsdp_sweep

    modules = (ddp_sweep, sharded_sweep, fsdp_sweep, common)
    trials = [*ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["overlapped"], profile=[], **TINY),
              *sharded_sweep.trials(dtypes=["fp32"], **TINY),
              *fsdp_sweep.trials(dtypes=["fp32"], variants=["fsdp"], profile=[], **TINY)]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        for fn in (functools.partial(ddp_sweep.ddp_trial, out_dir="out"), ddp_sweep.reduce_ranks,
                   sharded_sweep.sharded_trial, sharded_sweep.reduce_ranks, fsdp_sweep.fsdp_trial):
            assert callable(cloudpickle.loads(cloudpickle.dumps(fn)))
        for trial in trials:    # a frozen trial travels to the rank by value and is still the same trial there
            back = cloudpickle.loads(cloudpickle.dumps(trial))
            assert dataclasses.asdict(back) == dataclasses.asdict(trial) and dict(back) == dict(trial)
            assert back.model_config() == trial.model_config()
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.multiproc
@pytest.mark.slow
def test_script_with_compiled_blocks(tmp_path):
    argv = [*ARGS, "--launcher", "mp", "--compile", "--variants", "single,bucketed:0.05", "--no-single-rerun",
            "--out", str(tmp_path)]
    ddp = ddp_sweep.main(argv)                             # --compile: rows in a file of their own
    assert (ddp["status"] == "ok").all() and ddp["compile"].all(), ddp[["label", "status", "error"]]
    assert (ddp["graphs_compiled_timed"] == 0).all()
    assert ddp.loc[ddp["label"] == "single", "graphs_compiled_warmup"].iloc[0] >= 1
    text = (tmp_path / "ddp_compiled.md").read_text()
    assert "TransformerBlocks compiled" in text and "| graphs" in text and not (tmp_path / "ddp.parquet").exists()
    (tmp_path / "ddp_compiled.md").unlink()
    redrawn = ddp_sweep.main(["--report-only", "--compile", "--out", str(tmp_path)])
    assert redrawn["trial_id"].tolist() == ddp["trial_id"].tolist() and (tmp_path / "ddp_compiled.md").exists()
    with pytest.raises(ValueError, match="sharded"):
        ddp_sweep.main([*argv, "--studies", "ddp,sharded"])
    with pytest.raises(ValueError, match="warmup"):
        ddp_sweep.main([*ARGS, "--compile", "--warmup", "0", "--launcher", "mp", "--out", str(tmp_path)])


def test_profiling_releases_cupti_when_it_stops(monkeypatch):
    """Kineto detaches CUPTI at the end of a profile only under TEARDOWN_CUPTI=1; a user's own setting is kept."""
    calls = []
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    prof = profile_steps(lambda: calls.append(torch.ones(4).sum()), torch.device("cpu"))
    assert len(calls) == 2 and prof.status(expect_nccl=False) == "cpu"
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    profile_steps(lambda: calls.append(torch.ones(4).sum()), torch.device("cpu"))
    assert os.environ["TEARDOWN_CUPTI"] == "0"


def test_ratios_and_targets():
    df = pd.DataFrame({"status": "ok", "dtype": "bf16", "variant": ["single", "overlapped", "bucketed", "torch"],
                       "label": ["single", "overlapped", "bucketed 100MB", "torch DDP 25MB"],
                       "step_mean_s": [0.100, 0.103, 0.101, 0.102]})
    ratios = ddp_sweep.with_ratios(df)
    assert ratios["vs_single"].tolist() == pytest.approx([1.0, 1.03, 1.01, 1.02])
    assert ratios["vs_torch"].tolist() == pytest.approx([100 / 102, 103 / 102, 101 / 102, 1.0])
    (line,) = ddp_sweep.targets(ratios)
    assert "`bucketed 100MB`" in line and "1.010x single (met" in line and "0.990x torch DDP (met" in line


def test_targets_use_paired_ratios_when_every_variant_has_one():
    df = pd.DataFrame({"status": "ok", "dtype": "bf16", "variant": ["single", "overlapped", "bucketed", "torch"],
                       "label": ["single", "overlapped", "bucketed 100MB", "torch DDP 25MB"],
                       "step_mean_s": [0.100, 0.103, 0.101, 0.102], "paired_rounds": 6,
                       "paired_ratio": [math.nan, 1.015, 1.05, 1.02], "paired_ratio_min": [math.nan, 1.0, 1.0, 1.0],
                       "paired_ratio_max": [math.nan, 1.03, 1.1, 1.04],
                       "paired_ratio_ci_rel": [math.nan, 0.012, 0.03, 0.02]})
    ratios = ddp_sweep.with_ratios(df)
    assert ratios["vs_torch_paired"].tolist()[1:] == pytest.approx([1.015 / 1.02, 1.05 / 1.02, 1.0])
    (line,) = ddp_sweep.targets(ratios)     # overlapped: slower by the clock of its trial, faster paired
    assert "`overlapped`" in line and "1.015x single (met" in line and "0.995x torch DDP (met" in line
    assert "median of 6 rounds" in line and "1.000-1.030" in line and "median +-1.2% (95% confidence)" in line
    df.loc[2, "paired_ratio"] = math.nan    # one variant without: the clock's ratios, as before
    (line,) = ddp_sweep.targets(ddp_sweep.with_ratios(df))
    assert "`bucketed 100MB`" in line and "paired" not in line


def test_ratios_use_the_median_and_both_single_runs():
    df = pd.DataFrame({"status": "ok", "dtype": "fp32", "variant": ["single", "bucketed", "torch", "single"],
                       "label": ["single", "bucketed 100MB", "torch DDP 25MB", "single (rerun)"],
                       "step_mean_s": [0.150, 0.090, 0.105, 0.150], "step_median_s": [0.100, 0.104, 0.105, 0.102]})
    ratios = ddp_sweep.with_ratios(df)
    assert ratios["vs_single"].tolist() == pytest.approx([100 / 101, 104 / 101, 105 / 101, 102 / 101])
    assert ddp_sweep.single_drift(df) == {"fp32": pytest.approx(0.02)}
    (line,) = ddp_sweep.targets(ratios)
    assert "1.030x single (missed" in line and "drifted 2.0%" in line


# ---------------------------------------------------------------------------------------------------- trials on 2 ranks
def _run_trials(rank: int, world_size: int, configs: list[dict], out_dir: str) -> tuple[list[dict], list[bool]]:
    """The trials back to back in this process, as in a gang's actor; whether each trial's model is still alive
    once the trial returned (weak references to every TransformerLM the sweeps build)."""
    ctx = _ctx(rank, world_size)
    models: list[weakref.ref] = []

    class Recorded(step_module.TransformerLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            models.append(weakref.ref(self))

    step_module.TransformerLM = Recorded     # every study builds its models in raysys.training.step.build_model
    out, alive = [], []
    for config in configs:
        if "sharded" in config:
            out.append(sharded_sweep.sharded_trial(ctx, config))
        else:
            out.append(ddp_sweep.ddp_trial(ctx, config, out_dir=out_dir))
        alive.append(models[-1]() is not None)
    return out, alive


@pytest.mark.multiproc
def test_trial_functions_on_gloo_ranks(tmp_path):
    configs = ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["single", "naive", "overlapped", "bucketed:0.05"],
                                   profile=["overlapped"], **TINY)
    configs += sharded_sweep.trials(dtypes=["fp32"], **TINY)
    per_rank = run_ranks(_run_trials, 2, configs, str(tmp_path))
    (single, naive, overlapped, bucketed, rerun, unsharded, sharded), _ = per_rank[0]
    for m in (single, naive, overlapped, bucketed, rerun):
        assert m["step_mean_s"] > 0 and m["step_std_s"] >= 0 and m["timed_steps"] == TINY["steps"]
        assert m["step_min_s"] <= m["step_median_s"] <= m["step_max_s"]
        assert all(m[f"{phase}_mean_s"] >= 0 for phase in PHASES)
        # The phases are parts of the step.
        assert sum(m[f"{phase}_mean_s"] for phase in PHASES) <= m["step_mean_s"] * 1.05 + 0.5e-3
    num_tensors = 2 * 9 + 3                 # tiny: 2 blocks of 9 tensors, embedding, final norm, LM head
    assert naive["collectives_per_step"] == overlapped["collectives_per_step"] == num_tensors
    assert 1 < bucketed["collectives_per_step"] < num_tensors
    assert single["collectives_per_step"] != single["collectives_per_step"]      # NaN: no communication
    # Profiled on rank 0: a trace of the recorded step (not of an empty profiler cycle); gloo runs no NCCL
    # kernels, so there is no overlap figure on the CPU, and the row says why.
    assert overlapped["profile_status"] == "cpu" and overlapped["profiled_cpu_ops"] > 100
    assert overlapped["host_allreduce_calls"] == num_tensors           # exactly one step was recorded
    assert 0 < overlapped["host_allreduce_s"] < overlapped["host_accumulate_grad_s"]   # issued from the hooks
    assert math.isnan(overlapped["overlap_fraction"])
    assert overlapped["trace_path"].endswith("ddp_overlapped_fp32.json.gz")
    assert (tmp_path / "traces" / "ddp_overlapped_fp32.json.gz").stat().st_size > 2000
    assert "trace_path" not in per_rank[1][0][2]

    # Every trial released its model before the next one began: no hooks, buckets or closures kept it alive.
    for rows, models_alive in per_rank:
        assert models_alive == [False] * len(configs), models_alive
        for row in rows:
            assert row["live_parameters_after"] == row["live_parameters_before"] == rows[0]["live_parameters_before"]
    assert math.isnan(single["memory_allocated_before_bytes"])      # no allocator statistics on the CPU

    # Sharding halves (roughly) each rank's AdamW state and leaves parameters and gradients alone.
    for point in ("before_step", "after_step"):
        assert sharded[f"params_{point}_bytes"] == unsharded[f"params_{point}_bytes"]
        assert sharded[f"grads_{point}_bytes"] == unsharded[f"grads_{point}_bytes"]
    full = unsharded["optimizer_state_after_step_bytes"]
    shards = [rows[-1]["optimizer_state_after_step_bytes"] for rows, _ in per_rank]
    assert sum(shards) == pytest.approx(full, rel=0.01)
    assert max(shards) < 0.75 * full
    assert unsharded["optimizer_state_init_bytes"] == 0          # AdamW allocates its state at the first step

    reduced = ddp_sweep.reduce_ranks(configs[2], [rows[2] for rows, _ in per_rank])
    assert reduced["rank_spread_rel"] >= 0 and reduced["leaked_parameters_max_rank"] == 0
    assert reduced["step_median_min_rank_s"] <= reduced["step_median_max_rank_s"]


# ---------------------------------------------------------------------------------------------------- the script
ARGS = ["--device", "cpu", "--size", "tiny", "--context-length", "16", "--warmup", "1", "--steps", "2",
        "--variants", "single,flat,bucketed:0.05,torch", "--profile", "flat"]


@pytest.mark.ray
@pytest.mark.slow
def test_script_on_ray(tmp_path, ray_cluster):  # noqa: F811
    """The product's commands, `python sweeps/ddp.py` and `sweeps/sharded_optimizer.py`, on the session's Ray
    (gloo ranks)."""
    ddp = ddp_sweep.main([*ARGS, "--out", str(tmp_path)])
    sharded = sharded_sweep.main([*ARGS[:10], "--out", str(tmp_path)])
    assert (ddp["status"] == "ok").all(), ddp[["label", "dtype", "status", "error"]]
    assert (sharded["status"] == "ok").all(), sharded[["dtype", "sharded", "status", "error"]]
    assert len(ddp) == 5 and len(sharded) == 2           # fp32 only on the CPU by default; single runs twice
    assert ddp["label"].tolist()[-1] == "single (rerun)" and ddp["timed_steps"].between(2, 5).all()
    assert set(ddp["launcher"]) == {"ray"} and set(ddp["backend"]) == {"gloo"} and set(ddp["world_size"]) == {2}
    for name in ("ddp.parquet", "ddp.md", "ddp.png", "sharded_optimizer.parquet", "sharded_optimizer.md",
                 "sharded_optimizer.png", "traces/ddp_flat_fp32.json.gz"):
        assert (tmp_path / name).stat().st_size > 0, name
    text = (tmp_path / "ddp.md").read_text()
    assert "bucketed 0.05MB" in text and "Targets (same run)" in text
    # --resume runs nothing new; --report-only redraws from the files.
    again = ddp_sweep.main([*ARGS, "--out", str(tmp_path), "--resume"])
    assert again["trial_id"].tolist() == ddp["trial_id"].tolist()
    assert again["utc"].tolist() == ddp["utc"].tolist()
    for study in (ddp_sweep, sharded_sweep):
        assert len(study.main(["--report-only", "--out", str(tmp_path)])) > 0
    # The README's pandas snippets work on this file, fp32 only like the quickstart's (they raised KeyError: 'bf16').
    fastest = _readme_ddp_snippets(tmp_path / "ddp.parquet")
    assert list(fastest.index.get_level_values("dtype")) == ["fp32"] * 3 and fastest.is_monotonic_increasing


def _readme_ddp_snippets(path):
    """Run the README's snippets that read results/ddp.parquet on `path` instead; the value of the last line."""
    text = (common.ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    snippets = [b.replace('"results/ddp.parquet"', repr(str(path))) for b in blocks if "results/ddp.parquet" in b]
    assert len(snippets) == 2, snippets
    namespace = {"pd": pd}
    for snippet in snippets[:-1]:
        exec(snippet, namespace)
    *body, last = snippets[-1].strip().splitlines()
    exec("\n".join(body), namespace)
    return eval(last.split("#", 1)[0], namespace)


@pytest.mark.multiproc
def test_group_of_one_measures_the_wrappers_alone(tmp_path):
    """--world-size 1 (a one-GPU machine): every wrapper runs with a group of one, which is the identity: its hooks
    and bookkeeping run, no collective is issued (torch DDP still issues its own)."""
    ddp = ddp_sweep.main([*ARGS, "--world-size", "1", "--launcher", "mp", "--studies", "ddp", "--out",
                          str(tmp_path), "--variants", "single,naive,overlapped,bucketed:0.05,torch",
                          "--paired-rounds", "2"])
    assert (ddp["status"] == "ok").all(), ddp[["label", "status", "error"]]
    assert set(ddp["world_size"]) == {1}
    paired = ddp.set_index("label")["paired_ratio"]    # every variant timed against single, single itself not
    assert (paired.drop(["single", "single (rerun)"]) > 0).all() and paired[["single", "single (rerun)"]].isna().all()
    assert "paired vs single" in (tmp_path / "ddp.md").read_text()
    ours = ddp[ddp["variant"].isin(["naive", "overlapped", "bucketed"])]
    assert len(ours) == 3 and (ours["collectives_per_step"] == 0).all(), ours[["label", "collectives_per_step"]]
    assert "1 rank (gloo" in (tmp_path / "ddp.md").read_text()
    # The defaults add no column: ids of earlier rows stay.
    assert "collectives_alone" not in ddp.columns and "nccl_trace_buffer" not in ddp.columns
    # --collectives-alone: the same wrappers through a larger group's path, one collective per bucket;
    # --nccl-trace-buffer reaches every rank before its process group starts, and is a column.
    alone = ddp_sweep.main([*ARGS, "--world-size", "1", "--launcher", "mp", "--studies", "ddp", "--out",
                            str(tmp_path / "alone"), "--variants", "single,overlapped,bucketed:0.05",
                            "--no-single-rerun", "--collectives-alone", "--nccl-trace-buffer", "0"])
    assert (alone["status"] == "ok").all() and alone["collectives_alone"].all(), alone[["label", "status", "error"]]
    assert (alone["nccl_trace_buffer"] == 0).all() and (alone["nccl_trace_buffer_env"] == "0").all()
    assert "NCCL flight recorder off" in (tmp_path / "alone" / "ddp.md").read_text()
    ours = alone.set_index("label").drop("single")
    assert (ours["collectives_per_step"] > 0).all(), ours["collectives_per_step"]
    assert "--collectives-alone" in (tmp_path / "alone" / "ddp.md").read_text()
    with pytest.raises(ValueError, match=r"--collectives-alone needs --world-sizes 1 \(got 2\)"):
        ddp_sweep.main([*ARGS, "--world-size", "2", "--collectives-alone", "--out", str(tmp_path / "never")])
    with pytest.raises(ValueError, match=r"--nccl-trace-buffer \(-1\) must be >= 0"):
        ddp_sweep.main([*ARGS, "--world-size", "1", "--nccl-trace-buffer", "-1", "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()
    assert not (tmp_path / "never").exists()


def test_bad_flags_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="nccl-max-ctas"):
        ddp_sweep.main(["--device", "cpu", "--launcher", "mp", "--nccl-max-ctas", "8", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="world-size"):
        ddp_sweep.main(["--world-size", "0", "--out", str(tmp_path)])
    too_many = str(torch.cuda.device_count() + 1)   # more GPU ranks than this machine has: fails before any rank
    with pytest.raises(ValueError, match=f"asked for {too_many} GPUs on this machine"):
        ddp_sweep.main(["--launcher", "mp", "--device", "cuda", "--world-size", too_many, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="studies"):
        ddp_sweep.main(["--studies", "fsdp", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="report-only"):
        ddp_sweep.main(["--report-only", "--out", str(tmp_path)])
