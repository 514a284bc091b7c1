"""sweeps/fsdp.py on the CPU: the grid, the memory prediction, the trace arithmetic and the report (pure logic),
the trial function on 2 gloo ranks with a stand-in RankContext, and the whole script on plain processes."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from raysys.model.config import ModelConfig
from raysys.cluster.rank import RankContext
from sweeps import fsdp as fsdp_sweep
from tests.parallel.dist_utils import run_ranks

TINY = dict(size="tiny", context_length=16, batch_per_rank=2, warmup=1, steps=2)


def test_trials_grid_and_validation():
    trials = fsdp_sweep.trials(dtypes=["fp32", "bf16"], variants=["single", "fsdp"], profile=["fsdp"], **TINY)
    assert [(t["dtype"], t["variant"], t["profile"]) for t in trials] == [
        ("fp32", "single", False), ("fp32", "fsdp", True), ("bf16", "single", False), ("bf16", "fsdp", True)]
    for bad, match in ((dict(dtypes=["fp8"]), "fp8"), (dict(variants=["zero3"]), "zero3"),
                       (dict(profile=["x"]), "profile"), (dict(steps=1), "steps"), (dict(size="huge"), "huge")):
        kwargs = dict(dtypes=["fp32"], variants=["fsdp"], profile=[], **TINY)
        kwargs.update(bad)
        with pytest.raises(ValueError, match=match):
            fsdp_sweep.trials(**kwargs)


def test_expected_state_by_hand():
    # tiny: vocab 256, d 64, d_ff 128, 2 blocks. Embedding and LM head 256*64 = 16384 each; a block has
    # 4*64*64 + 3*64*128 = 40960 Linear weights and 2*64 = 128 norm weights; final norm 64.
    # P = 2*16384 + 2*(40960 + 128) + 64 = 115008. fp32 params + grads + AdamW's 2 moments = 16 bytes per element.
    mc = ModelConfig.from_name("tiny", context_length=16)
    per_rank = lambda variant: fsdp_sweep.expected_state(mc, variant, 2)  # noqa: E731
    assert per_rank("single")["expected_state_bytes"] == 16 * 115008
    assert per_rank("ddp")["expected_state_bytes"] == 16 * 115008
    # ddp_sharded: params and grads whole (8P), moments split over 2 ranks (8P / 2).
    assert per_rank("ddp_sharded")["expected_state_bytes"] == 8 * 115008 + 4 * 115008
    # fsdp: every Linear/Embedding weight has an even row count, so halves: (2*16384 + 2*40960) / 2 = 57344,
    # plus the 2*128 + 64 = 320 replicated norm weights = 57664 per rank.
    assert per_rank("fsdp")["expected_params_bytes"] == 4 * 57664
    assert per_rank("fsdp")["expected_state_bytes"] == 16 * 57664
    # fsdp2 shards the norms as well: 115008 / 2 = 57504.
    assert per_rank("fsdp2")["expected_state_bytes"] == 16 * 57504


def _event(name: str, start: float, end: float, device=DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=False)


def test_overlap_metrics_from_kernel_intervals():
    events = [_event("ampere_sgemm", 0, 10), _event("elementwise_kernel", 12, 20), _event("sm90_xmma_gemm", 30, 40),
              _event("ncclDevKernel_AllGather_RING_LL", 5, 11),      # 1 us with no compute: hidden enough
              _event("ncclDevKernel_AllGather_RING_LL", 20, 28),     # 8 us exposed: compute waited, a stall
              _event("ncclDevKernel_ReduceScatter_Sum_f32", 35, 45),  # 5 us exposed after the last kernel
              _event("Memcpy HtoD", 50, 60), _event("aten::mm", 0, 100, DeviceType.CPU)]
    m = fsdp_sweep.overlap_metrics(events)
    assert m["allgather_kernels"] == 2 and m["allgather_s"] == pytest.approx(14e-6)
    assert m["allgather_exposed_s"] == pytest.approx(9e-6)
    assert m["stalled_allgathers"] == 1
    assert m["reducescatter_s"] == pytest.approx(10e-6) and m["reducescatter_exposed_s"] == pytest.approx(5e-6)
    assert m["allreduce_kernels"] == 0


def _row(variant: str, step_ms: float, peak: float, state: float, expected: float) -> dict:
    return dict(status="ok", dtype="bf16", variant=variant, size="xl", context_length=512, world_size=2,
                batch_per_rank=4, warmup=2, steps=8, step_mean_s=step_ms / 1e3, step_std_s=1e-3,
                peak_memory_max_rank_bytes=peak * 2**30, state_bytes=state * 2**30,
                expected_state_bytes=expected * 2**30, error="")


def test_report_ratios_savings_and_targets():
    df = pd.DataFrame([_row("single", 100.0, 60, 54, 54), _row("ddp_sharded", 104.0, 50, 41, 41),
                       _row("fsdp", 108.0, 30, 27.5, 27.3), _row("fsdp2", 137.0, 32, 27.4, 27.3)])
    ratios = fsdp_sweep.with_ratios(df)
    assert ratios["vs_single"].tolist() == pytest.approx([1.0, 1.04, 1.08, 1.37])
    assert ratios["vs_fsdp2"].tolist() == pytest.approx([100 / 137, 104 / 137, 108 / 137, 1.0])
    savings = fsdp_sweep.memory_savings(df)
    fsdp_row = savings[(savings["variant"] == "fsdp") & (savings["against"] == "ddp_sharded")].iloc[0]
    assert fsdp_row["expected (GiB)"] == pytest.approx(41 - 27.3) and fsdp_row["peak (GiB)"] == pytest.approx(20)
    lines = fsdp_sweep.targets(df)
    assert "1.080x single (met" in lines[0] and "fsdp2 1.370x" in lines[0]
    assert "30.00 GiB vs fsdp2 32.00 GiB (met" in lines[1]
    text = fsdp_sweep.markdown(df)
    assert "| bf16    | fsdp " in text and "Targets (same run)" in text


def test_targets_use_the_median_check_every_block_variant_and_only_one_run():
    rows = [_row("single", 100.0, 60, 54, 54), _row("fsdp", 130.0, 30, 27.5, 27.3),
            _row("fsdp_hp", 112.0, 33, 27.5, 27.3), _row("fsdp2", 137.0, 32, 27.4, 27.3)]
    medians = {"single": 100.0, "fsdp": 109.0, "fsdp_hp": 111.0, "fsdp2": 140.0}  # fsdp's mean had a slow step
    df = pd.DataFrame([{**r, "step_median_s": medians[r["variant"]] / 1e3, "run_id": "a"} for r in rows])
    lines = fsdp_sweep.targets(df)
    assert "`fsdp` step: 109.0 ms = 1.090x single (met" in lines[0] and "fsdp2 1.400x" in lines[0]
    assert "`fsdp` peak memory: 30.00 GiB vs fsdp2 32.00 GiB (met" in lines[1]
    assert "`fsdp_hp` step: 111.0 ms = 1.110x single (missed" in lines[2]
    assert "`fsdp_hp` peak memory: 33.00 GiB vs fsdp2 32.00 GiB (missed" in lines[3]
    df.loc[df["variant"] == "fsdp2", "run_id"] = "b"
    assert fsdp_sweep.targets(df) == ["- bf16 rows come from 2 runs (a, b): not measured in one run, no target is "
                                      "checked"]


def _ctx(rank: int, world_size: int) -> RankContext:
    return RankContext(rank=rank, world_size=world_size, local_rank=rank, node_rank=0, device=torch.device("cpu"),
                       backend="gloo", process_group=dist.group.WORLD)


def _run_trials(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    return [fsdp_sweep.fsdp_trial(_ctx(rank, world_size), c) for c in configs]


@pytest.mark.multiproc
def test_trial_function_on_gloo_ranks():
    cpu_variants = [v for v in fsdp_sweep.VARIANTS if v not in fsdp_sweep.OWN_GROUP]  # those need NCCL
    configs = fsdp_sweep.trials(dtypes=["fp32"], variants=cpu_variants, profile=["fsdp"], **TINY)
    configs += fsdp_sweep.trials(dtypes=["bf16"], variants=["single_cast", "fsdp"], profile=[], **TINY)
    per_rank = run_ranks(_run_trials, 2, configs, timeout_s=300)
    for i, config in enumerate(configs):
        ranks = [r[i] for r in per_rank]
        m = fsdp_sweep.reduce_ranks(config, ranks)
        assert m["step_mean_s"] > 0 and m["step_mean_max_rank_s"] >= m["step_mean_s"]
        for r in ranks:  # a trial leaves no model behind (a leaked one would take the next trial's GPU memory)
            assert r["live_parameters_after"] == r["live_parameters_before"], config["variant"]
        if config["variant"] == "ddp_sharded":  # moments split over the ranks: their sum is the whole
            assert sum(r["optimizer_state_bytes"] for r in ranks) == sum(r["expected_optimizer_state_bytes"]
                                                                         for r in ranks)
            assert m["params_bytes"] + m["grads_bytes"] == m["expected_params_bytes"] + m["expected_grads_bytes"]
        else:  # what the tensors hold is what the sharding predicts, to the byte
            assert m["state_bytes"] == m["expected_state_bytes"], config["variant"]
        # the embedding is not re-gathered in backward
        if config["variant"] in ("fsdp", "fsdp_flat", "fsdp_flat_rs", "fsdp_layer"):
            units = 16 if config["variant"] == "fsdp_layer" else 2 + 2  # embedding, 2 blocks (of 7 layers), lm_head
            assert m["all_gathers_per_step"] == 2 * units - 1, config["variant"]
            assert m["gather_wait_s"] >= 0 and m["peak_gathered_bytes"] > 0


@pytest.mark.multiproc
def test_script_without_ray_writes_table_and_resumes(tmp_path):
    argv = ["--device", "cpu", "--launcher", "mp", "--out", str(tmp_path), "--variants", "single,fsdp",
            "--dtypes", "bf16", "--context-length", "16", "--warmup", "1", "--steps", "2", "--profile", "fsdp"]
    df = fsdp_sweep.main(argv)
    assert df["status"].tolist() == ["ok", "ok"]
    assert (tmp_path / "fsdp.parquet").exists() and (tmp_path / "traces" / "fsdp_fsdp_bf16.json").exists()
    assert "| bf16    | fsdp " in (tmp_path / "fsdp.md").read_text()
    again = fsdp_sweep.main([*argv, "--resume"])  # everything done: no gang starts, same rows
    assert again["trial_id"].tolist() == df["trial_id"].tolist()


@pytest.mark.multiproc
def test_script_with_a_group_of_one(tmp_path):
    """--world-size 1: shards are whole tensors, gathers and reduce-scatters copies; the wrappers still run."""
    df = fsdp_sweep.main(["--device", "cpu", "--launcher", "mp", "--out", str(tmp_path), "--world-size", "1",
                          "--variants", "single,ddp_sharded,fsdp", "--dtypes", "bf16", "--context-length", "16",
                          "--warmup", "1", "--steps", "2", "--profile", "", "--paired-rounds", "2"])
    assert df["status"].tolist() == ["ok", "ok", "ok"] and set(df["world_size"]) == {1}
    paired = df.set_index("variant")["paired_ratio"]   # each variant against a single step built beside it
    assert pd.isna(paired["single"]) and (paired[["ddp_sharded", "fsdp"]] > 0).all()
    text = (tmp_path / "fsdp.md").read_text()
    assert "paired vs single" in text and "(paired: median of 2 rounds" in text
    assert df.set_index("variant").loc["fsdp", "all_gathers_per_step"] == 0  # a group of one is the identity
    alone = fsdp_sweep.main(["--device", "cpu", "--launcher", "mp", "--out", str(tmp_path / "alone"), "--world-size",
                             "1", "--variants", "fsdp", "--dtypes", "bf16", "--context-length", "16", "--warmup", "1",
                             "--steps", "2", "--profile", "", "--collectives-alone", "--nccl-trace-buffer", "100"])
    assert alone["status"].tolist() == ["ok"] and alone["collectives_alone"].all()
    assert alone["nccl_trace_buffer"].tolist() == [100] and alone["nccl_trace_buffer_env"].tolist() == ["100"]
    assert "nccl_trace_buffer" not in df.columns
    assert alone["all_gathers_per_step"].iloc[0] > 0  # every block gathered for forward and again for backward
    with pytest.raises(ValueError, match="world-size"):
        fsdp_sweep.main(["--device", "cpu", "--world-size", "0", "--out", str(tmp_path)])
    too_many = str(torch.cuda.device_count() + 1)
    with pytest.raises(ValueError, match=f"asked for {too_many} GPUs on this machine"):
        fsdp_sweep.main(["--launcher", "mp", "--device", "cuda", "--world-size", too_many, "--out",
                         str(tmp_path / "never")])
    assert not (tmp_path / "never" / "fsdp.parquet").exists()


def test_compiled_blocks_need_per_block_units(tmp_path):
    with pytest.raises(ValueError, match="fsdp_layer"):
        fsdp_sweep.trials(size="tiny", context_length=16, batch_per_rank=2, dtypes=["fp32"],
                          variants=["single", "fsdp_layer"], profile=[], warmup=1, steps=2, compile=True)
    with pytest.raises(ValueError, match="warmup"):
        fsdp_sweep.trials(size="tiny", context_length=16, batch_per_rank=2, dtypes=["fp32"], variants=["fsdp"],
                          profile=[], warmup=0, steps=2, compile=True)
    assert "fsdp_layer" not in fsdp_sweep._variants(None, "cpu", fsdp_sweep.DEFAULTS["cpu"], compiled=True)


def _flat_flags(rank: int, world_size: int) -> dict:
    out = {}
    for variant in ("fsdp", "fsdp_flat", "fsdp_flat_rs"):
        [trial] = fsdp_sweep.trials(dtypes=["fp32"], variants=[variant], profile=[], **TINY)
        model, _ = fsdp_sweep.build(trial, torch.device("cpu"), dist.group.WORLD)
        out[variant] = (model.flat_collectives, model.flat_reduce_scatter)
    return out


@pytest.mark.multiproc
def test_flat_variants_build_their_collectives():
    """On gloo every variant reduces through the flat path anyway, so the rows differ only by what build() asks."""
    [flags] = run_ranks(_flat_flags, 1, timeout_s=120)
    assert flags == {"fsdp": (False, False), "fsdp_flat": (True, True), "fsdp_flat_rs": (False, True)}, flags
