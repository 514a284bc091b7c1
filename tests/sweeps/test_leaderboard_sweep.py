"""The leaderboard study end to end on the CPU: the ablation's Parquet rows (an OOM is a row), the plan's
neighbours with and without Ray Tune, and the 2-rank data-parallel step against one process, bitwise in fp32."""

import dataclasses
import math

import pandas as pd
import pytest
import torch

import raysys.training.leaderboard_bench as bench
from raysys.measure.timing import do_bench_agreed
from raysys.cli import main as raysys_main
from raysys.training.leaderboard import LeaderboardStep, StepConfig
from raysys.cluster.mp_gang import ProcessGang
from sweeps import leaderboard as sweep
from tests.raysys.ray_fixtures import ray_cluster  # noqa: F401  (the session's one Ray)


def test_tiny_cpu_run_writes_leaderboard_parquet(tmp_path, capsys):
    out = tmp_path / "lb"
    assert raysys_main(["leaderboard", "--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--out", str(out),
                        "--variants", "best", "today", "today+fused_loss"]) == 0
    df = pd.read_parquet(out / "leaderboard.parquet")
    assert list(df.variant) == ["best", "today", "today+fused_loss", "best"]
    assert list(df.batch_size) == [1, 1, 1, 2] and set(df.status) == {"ok"}
    assert (df.step_median_s > 0).all() and (df.tokens_per_s > 0).all() and (df.mfu > 0).all()
    first, today = df.iloc[0], df.iloc[1]
    assert first.cold_start_s >= first.first_step_s > 0 and pd.isna(today.cold_start_s)  # only the first is cold
    assert first.loss_path == "torch" and first.optimizer_class == "ForeachAdamW" and "SwiGLU" in first.compiled
    assert today.loss_path == "materialized" and today.optimizer_class == "AdamW" and today.policy == "full"
    assert first.attention == "sdpa" and first.optimizer == "foreach"  # the CPU's stand-ins; the row says what ran
    assert first.model_flops == pytest.approx(bench.model_flops(bench.ModelConfig.from_name("tiny"), 1, 64))
    assert "vs today" in capsys.readouterr().out


def test_without_out_both_entry_points_write_a_fresh_run_directory(tmp_path, monkeypatch):
    """README: `--out DIR` (default: a fresh `./runs/<UTC time>-<sweep>/`) in every script that takes it."""
    monkeypatch.setenv("RAYSYS_RUNS_DIR", str(tmp_path))
    monkeypatch.delenv("RAYSYS_RESULTS_DIR", raising=False)
    argv = ["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--variants", "today", "--no-batch2", "--warm-cache"]
    assert sweep.main(["--studies", "ablation", *argv]) == 0
    assert raysys_main(["leaderboard", *argv]) == 0
    runs = sorted(tmp_path.glob("*-leaderboard*/leaderboard.parquet"))
    assert len(runs) == 2 and all(len(pd.read_parquet(path)) == 1 for path in runs), runs


def test_an_oom_is_a_row_and_the_ablation_goes_on(tmp_path, monkeypatch):
    real = bench.run_variant

    def run_variant(model, variant, **kw):
        if variant.name == "today":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.09 GiB")
        return real(model, variant, **kw)

    monkeypatch.setattr(bench, "run_variant", run_variant)
    sweep.main(["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--variants", "today", "today+fused_adamw",
                "--no-batch2", "--warm-cache", "--out", str(tmp_path)])
    rows = pd.read_parquet(tmp_path / "leaderboard.parquet")
    assert list(rows.status) == ["oom", "ok"] and "37.09 GiB" in rows.error.iloc[0]
    assert "today b1" in (tmp_path / "leaderboard.md").read_text() and "oom" in (tmp_path / "leaderboard.md").read_text()


def test_ablation_variants_and_the_measured_attention_choice(monkeypatch):
    assert [v.name for v in bench.ablation()] == [
        "best", "best/flash_triton", "best/cudnn", "best-ffn", "best-offload", "best-lean", "today", "today+fused_loss",
        "today+fused_adamw", "today+compile", "today+lean", "today+cudnn", "today+advisor_plan", "today+ffn_recompute",
        "best"]
    v = {v.name: v.step for v in bench.ablation(attention="cudnn", batch2=False)}
    assert v["best"].attention == v["best-ffn"].attention == "cudnn"
    assert v["best-ffn"] == v["best"].replace(recompute_kinds=("none", "full", "offload"))
    assert v["best-offload"] == v["best"].replace(recompute_kinds=("none", "ffn", "full"))
    assert v["best"].lean and not v["best-lean"].lean and v["best-lean"].compile
    assert v["today+compile"].compile and not v["today+compile"].lean and v["today+lean"].lean
    assert not v["today"].lean
    assert v["today+cudnn"] == bench.TODAY.replace(attention="cudnn")
    assert "ffn" in v["today+ffn_recompute"].recompute_kinds and "ffn" not in v["today+advisor_plan"].recompute_kinds
    assert bench.for_device(v["best"], torch.device("cpu")).attention == "sdpa"  # the CPU's stand-in
    # the session: `best` with the chosen attention, `best/<the other>` beside it; on the CPU no `best/` at all
    chosen = bench.session_variants(bench.ablation(batch2=False), "cudnn", torch.device("cuda"))
    assert [(c.name, c.step.attention) for c in chosen[:2]] == [("best", "cudnn"), ("best/flash_triton", "flash_triton")]
    assert not any(c.name == "best/cudnn" for c in chosen) and chosen[2].name == "best-ffn"
    assert chosen[2].step.attention == "cudnn"
    assert not any(c.name.startswith("best/") for c in bench.session_variants(bench.ablation(), "flash_triton",
                                                                              torch.device("cpu")))
    # the faster candidate wins; one that cannot run counts as infinitely slow
    cfg, cuda = bench.ModelConfig.from_name("tiny"), torch.device("cuda")
    times = {"flash_triton": 5.0, "cudnn": 3.0}
    monkeypatch.setattr(bench, "attention_ms", lambda name, *a, **k: times[name])
    assert bench.pick_attention(cfg, 1, 64, cuda, torch.bfloat16) == ("cudnn", times)
    times["cudnn"] = 7.0
    assert bench.pick_attention(cfg, 1, 64, cuda, torch.bfloat16)[0] == "flash_triton"

    def unavailable(name, *a, **k):
        if name == "cudnn":
            raise ValueError("attention 'cudnn' needs CUDA tensors")
        return 9.0

    monkeypatch.setattr(bench, "attention_ms", unavailable)
    assert bench.pick_attention(cfg, 1, 64, cuda, torch.bfloat16) == ("flash_triton",
                                                                       {"flash_triton": 9.0, "cudnn": float("inf")})
    assert bench.pick_attention(cfg, 1, 64, torch.device("cpu"), torch.float32) == ("flash_triton", {})


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    for argv, message in ((["--batch-size", "0"], "batch-size"), (["--timer", "do_bench", "--device", "cpu"], "CUDA"),
                          (["--variants", "fastest"], "variants")):
        assert raysys_main(["leaderboard", "--size", "tiny", "--out", str(tmp_path), *argv]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "leaderboard.parquet").exists()
    # every study checks the shared options before its first model or rank, the data-parallel one too
    for argv, message in ((["--rep-ms", "-1"], r"--rep-ms \(-1.0\) > 0"), (["--timer", "do_bench"], "CUDA")):
        with pytest.raises(ValueError, match=message):
            sweep.main(["--study", "ddp", "--device", "cpu", "--launcher", "mp", "--out", str(tmp_path), *argv])
    assert not list(tmp_path.iterdir())


def test_neighbour_specs():
    plan = ("full",) * 3 + ("none",) * 5
    assert sweep.neighbour_specs(plan, [-4, -1, 0, 2, 6]) == [(-1, "full*2+none*6"), (0, "full*3+none*5"),
                                                               (2, "full*5+none*3")]
    assert sweep.neighbour_specs(("none",) * 4, [0, 1, 4]) == [(0, "none"), (1, "full*1+none*3"), (4, "full")]
    assert sweep.neighbour_specs(("none", "none", "full"), [1]) == [(1, "none*1+full*2")]  # the plan's own order
    # ffn plans move their ffn blocks; mixed plans the kind next to the kept run
    assert sweep.neighbour_specs(("ffn",) * 5 + ("none",) * 2, [-2, 1, 2, 3]) == [
        (-2, "ffn*3+none*4"), (1, "ffn*6+none*1"), (2, "ffn")]
    assert sweep.neighbour_specs(("full", "full", "ffn", "ffn", "none"), [-3, 1]) == [
        (-3, "full*1+none*4"), (1, "full*2+ffn*3")]


def test_neighbours_without_ray(tmp_path):
    sweep.main(["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--study", "neighbours", "--no-ray",
                "--offsets", "0", "2",
                "--steps", "2", "--warm-cache", "--out", str(tmp_path)])
    df = pd.read_parquet(tmp_path / "leaderboard_tune.parquet")
    assert list(df.offset) == [0, 2] and set(df.status) == {"ok"} and set(df.launcher) == {"local"}
    assert list(df.policy) == ["none", "full"] and set(df.advisor_policy) == {"none"}
    assert "plan / best" in (tmp_path / "leaderboard_tune.md").read_text()


@pytest.mark.ray
@pytest.mark.slow
def test_neighbours_report_says_when_the_fast_step_ran_another_plan(tmp_path, monkeypatch):
    tune = pd.DataFrame({"offset": [-1, 0, 1], "policy": ["ffn*1+none*3", "ffn*2+none*2", "ffn*3+none*1"],
                         "status": "ok", "step_median_s": [1.01, 1.0, 1.02], "peak_bytes": 2.0**30,
                         "predicted_peak_bytes": 2.0**30, "advisor_policy": "ffn*2+none*2", "git_sha": "aaaaaaaaaaaa"})
    ablation = pd.DataFrame({"variant": ["best", "best", "best", "today"], "batch_size": [1, 1, 2, 1],
                             "status": "ok", "policy": ["ffn*2+none*2", "offload*1+none*3", "ffn*4", "full"],
                             "utc": ["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z",
                                     "2026-01-04T00:00:00Z"], "run_id": ["r1", "r2", "r2", "r2"],
                             "git_sha": ["aaaaaaaaaaaa", "bbbbbbbbbbbb", "bbbbbbbbbbbb", "bbbbbbbbbbbb"]})
    text = sweep.neighbours_summary(tune, ablation)
    assert "plan / best = 1.000" in text
    assert ("these neighbours surround ffn*2+none*2 (commit aaaaaaaaaaaa); the ablation's latest fast step (run r2, "
            "commit bbbbbbbbbbbb) ran offload*1+none*3") in text
    assert "not the fast step's plan" not in sweep.neighbours_summary(tune, ablation.iloc[[0, 2, 3]])
    assert "not the fast step's plan" not in sweep.neighbours_summary(tune)
    # --report-only reads the ablation file beside the neighbours file (whose own report is not the point here)
    monkeypatch.setattr(sweep, "ablation_markdown", lambda df: "## ablation\n")
    tune.to_parquet(tmp_path / "leaderboard_tune.parquet")
    ablation.to_parquet(tmp_path / "leaderboard.parquet")
    sweep.write_reports(tmp_path)
    assert "ran offload*1+none*3" in (tmp_path / "leaderboard_tune.md").read_text()


def test_neighbours_as_ray_tune_trials(tmp_path, ray_cluster):  # noqa: F811
    df = sweep.run_neighbours_tune(sweep.build_parser().parse_args(
        ["--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--study", "neighbours", "--offsets", "0", "1",
         "--steps", "2",
         "--warm-cache", "--out", str(tmp_path)]))
    rows = pd.read_parquet(tmp_path / "leaderboard_tune.parquet")
    assert len(df) == 2 and set(rows.status) == {"ok"} and sorted(rows.offset) == [0, 1]
    assert set(rows.launcher) == {"tune"} and (rows.step_median_s > 0).all()


def one_process(trial: sweep.DDPTrial, world_size: int) -> dict:
    """The ranks' computation in one process: each rank's gradients, averaged as gloo does it (each divided by
    the world size, then summed), then the optimizer step."""
    mc = trial.model_config()
    model = bench.build_model(mc, torch.device("cpu"), torch.float32, trial.seed)
    step = LeaderboardStep(model, StepConfig(**dict(trial.step)), batch_size=trial.batch_size)
    data = [bench.make_batch(mc, trial.batch_size, mc.context_length, torch.device("cpu"), trial.seed, rank=r)
            for r in range(world_size)]
    for _ in range(1 + trial.steps):
        grads = []
        for x, y in data:
            step.gradients(x, y)
            grads.append({n: p.grad / world_size for n, p in model.named_parameters()})
        for n, p in model.named_parameters():
            p.grad = grads[0][n] + grads[1][n]
        step.optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multiproc
def test_two_rank_ddp_step_equals_one_process_bitwise():
    step = bench.for_device(StepConfig(), torch.device("cpu"))
    trial = sweep.DDPTrial(size="tiny", context_length=16, batch_size=1, dtype="fp32", steps=2,
                           step=tuple(sorted(dataclasses.asdict(step).items())), return_params=True)
    with ProcessGang(2, device="cpu", name="leaderboard_ddp") as gang:
        per_rank = gang.run(sweep.ddp_trial, dataclasses.asdict(trial))
    expected = one_process(trial, 2)
    for rank in per_rank:
        assert rank["loss_path"] == "torch" and rank["optimizer_class"] == "ForeachAdamW"
        for name, value in expected.items():
            assert torch.equal(rank["params"][name], value), name
    assert per_rank[0]["losses"] != per_rank[1]["losses"]  # each rank trained on its own sequences


def _bench_unequal_ranks(ctx, config: dict) -> dict:
    """do_bench_agreed on ranks of different speeds (rank 1 five times slower), no collective inside the call."""
    import time

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002 * (1 + 4 * ctx.rank))

    timing = do_bench_agreed(fn, torch.device("cpu"), warmup_ms=20, rep_ms=60,
                             agree=lambda v: sweep._agree_max(ctx, v))
    return {"calls": len(calls), **timing}


@pytest.mark.multiproc
def test_do_bench_agreed_makes_the_same_calls_on_every_rank():
    """Triton's do_bench sizes its loops by each rank's own estimate: ranks of a gang would disagree on the number
    of steps (and a step's collectives would wait forever). The agreed version sizes them by the slowest rank's."""
    with ProcessGang(2, device="cpu", name="agreed") as gang:
        fast, slow = gang.run(_bench_unequal_ranks, {})
    assert fast["calls"] == slow["calls"]
    # 60 ms of repeats at the slow rank's ~10 ms a call (the fast rank's own ~2 ms would give it about 30)
    assert fast["timed_steps"] == slow["timed_steps"] <= 7
    assert fast["time_median_s"] < slow["time_median_s"] / 2


@pytest.mark.multiproc
def test_ddp_trial_by_the_course_harness_with_a_profiled_step():
    step = bench.for_device(StepConfig(), torch.device("cpu"))
    trial = sweep.DDPTrial(size="tiny", context_length=16, dtype="fp32", step=tuple(sorted(step.as_dict().items())),
                           timer="do_bench", rep_ms=30, warmup_ms=10, profile=True)
    with ProcessGang(2, device="cpu", name="leaderboard_ddp") as gang:
        per_rank = gang.run(sweep.ddp_trial, dataclasses.asdict(trial))
    for rank in per_rank:
        assert rank["timed_steps"] >= 1 and rank["step_median_s"] > 0
        assert rank["profile_status"] == "cpu" and rank["comm_exposed_s"] != rank["comm_exposed_s"]  # NaN on the CPU
    assert per_rank[0]["timed_steps"] == per_rank[1]["timed_steps"]


def test_ddp_row_takes_the_slowest_rank_and_the_most_exposed_communication():
    rank = lambda step, peak, exposed: {"step_median_s": step, "peak_bytes": peak, "losses": [step],  # noqa: E731
                                        "comm_s": 0.5, "comm_exposed_s": exposed}
    row = sweep.reduce_ddp_ranks({}, [rank(4.0, 2.0, 0.2), rank(4.2, 1.0, float("nan")), rank(4.1, 3.0, 0.1)])
    assert row["step_median_s"] == 4.2 and row["peak_bytes_max"] == 3.0 and row["comm_exposed_s"] == 0.2
    assert row["losses"] == [[4.0], [4.2], [4.1]]
    nothing = sweep.reduce_ddp_ranks({}, [rank(1.0, 1.0, float("nan"))] * 2)
    assert math.isnan(nothing["comm_exposed_s"])
    assert "comm_exposed_s" not in sweep.reduce_ddp_ranks({}, [{"step_median_s": 1.0, "peak_bytes": 1.0,
                                                                "losses": []}])


def test_ddp_report_compares_with_the_one_gpu_step_of_the_same_commit():
    ddp = pd.DataFrame({"size": "leaderboard", "world_size": [2], "batch_size": [1], "timer": "do_bench",
                        "status": "ok", "step_median_s": [4.5], "comm_s": [0.2], "comm_exposed_s": [0.05],
                        "git_sha": "bbbbbbbbbbbb"})
    ablation = pd.DataFrame({"size": "leaderboard", "variant": "best", "batch_size": [1, 1, 2], "status": "ok",
                             "step_median_s": [4.0, 4.4, 9.0],
                             "git_sha": ["aaaaaaaaaaaa", "bbbbbbbbbbbb", "bbbbbbbbbbbb"],
                             "run_id": ["r1", "r2", "r2"], "timer": "do_bench", "utc": ["1", "2", "3"]})
    text = sweep.ddp_markdown(ddp, ablation)
    assert "4.500 s (do_bench); goal <= 4.6 s: met; communication 200.0 ms, of it exposed 50.0 ms" in text
    assert "same commit (run r2, do_bench): 4.400 s, ratio 1.023 (goal <= 1.02: missed)" in text
    assert "no one-GPU fast step at batch 1 of commit bbbbbbbbbbbb" in sweep.ddp_markdown(ddp, ablation.iloc[[0]])


def test_variants_release_pinned_host_memory(monkeypatch):
    """Between variants the pinned host cache is emptied too (offloaded copies of one variant's sizes would stay
    pinned beside the next one's)."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("host"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    bench.release_cached_memory(torch.device("cuda"))
    assert calls == ["device", "host"]
    bench.release_cached_memory(torch.device("cpu"))
    assert calls == ["device", "host"]


def test_flags_mean_what_they_mean_in_every_study(tmp_path, capsys, monkeypatch):
    """`--studies`, `--dtypes`, `--world-sizes` and comma lists as in the other studies (the older spellings and
    space-separated names still work); a second dtype or world size, or an unknown study, is one line."""
    parser = sweep.build_parser()
    args = parser.parse_args(["--out", "x", "--studies", "ablation,neighbours", "--dtypes", "fp32", "--world-sizes",
                              "4", "--variants", "best,today", "--do-bench-only", "best", "today:b1"])
    assert (args.study, args.dtype, args.world_size, args.variants, args.do_bench_only) == (
        "ablation,neighbours", "fp32", "4", "best,today", "best,today:b1")
    old = parser.parse_args(["--out", "x", "--study", "ablation", "ddp", "--dtype", "bf16", "--world-size", "2",
                             "--variants", "best", "today"])
    assert (old.study, old.dtype, old.world_size, old.variants) == ("ablation,ddp", "bf16", "2", "best,today")
    for argv, message in ((["--dtypes", "fp32,bf16"], r"--dtypes 'fp32,bf16' must be one of"),
                          (["--world-sizes", "1,2", "--studies", "ddp"], r"--world-sizes '1,2' must be one integer"),
                          (["--studies", "ablation,fastest"], r"--studies 'ablation,fastest' must name studies")):
        with pytest.raises(ValueError, match=message):
            sweep.main(["--size", "tiny", "--device", "cpu", "--out", str(tmp_path), *argv])
    assert raysys_main(["leaderboard", "--size", "tiny", "--dtypes", "fp32,bf16", "--out", str(tmp_path)]) == 2
    assert "--dtypes 'fp32,bf16'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_cpu_run_says_what_the_fast_step_runs(tmp_path, capsys, monkeypatch):
    """On the CPU the fast step's attention is the CPU's stand-in, and the run says so (every row says sdpa)."""
    monkeypatch.setattr(bench, "run_ablation", lambda args, session: None)
    bench.run_leaderboard(bench.build_leaderboard_parser().parse_args(
        ["--size", "tiny", "--device", "cpu", "--dtypes", "fp32", "--out", str(tmp_path)]))
    assert "best runs sdpa (standing in for flash_triton on the cpu)" in capsys.readouterr().out
