"""Leaderboard study (handout 9; docs/studies.md): the 8B model's training step at context 32768, three studies.

- ablation:   `raysys.training.leaderboard_bench`'s variants on one GPU (`<out>/leaderboard.parquet`), plus `--check` (the fast
              step's loss, gradients and update against the reference path, `<out>/leaderboard_check.parquet`).
- neighbours: the advisor's recompute plan for the fast step and its neighbours (`--offsets`), each measured, one Ray
              Tune trial per plan (`--no-ray`: in this process): `<out>/leaderboard_tune.parquet`.
- ddp:        the data-parallel step through the Ray gang (`--launcher mp` without Ray), each rank holding the whole
              bf16 state and all-reducing each gradient as backward makes it (`parallel.ddp.OverlappedDDP`); timed
              by the course's harness, exposed NCCL time profiled: `<out>/leaderboard_ddp.parquet`.

    python sweeps/leaderboard.py --size leaderboard --device cuda --studies ablation,neighbours --no-ray \\
        --timer do_bench --do-bench-only best,today --rep-ms 1 --warmup-ms 1 --steps 2 --out "$PWD/results"
    python sweeps/leaderboard.py --studies ddp --world-sizes 2 --device cuda --size leaderboard --out "$PWD/results"
    python sweeps/leaderboard.py --size tiny --device cpu --studies ablation,neighbours,ddp --no-ray --out /tmp/lb
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import pandas as pd
import torch

from parallel.checkpointing import parse_policy
from raysys.cluster.studies import JoinList, split_list
from raysys.measure.device import DTYPES, check_fits, resolve_device
from raysys.model.config import ModelConfig
from raysys.training.leaderboard import LeaderboardStep, StepConfig, plan_on_device
from raysys.training.leaderboard_bench import (COURSE_REP_MS, COURSE_WARMUP_MS, SWEEP, Session, Variant,
                                               attention_text, build_leaderboard_parser, check_options, for_device,
                                               make_batch, model_config_of, predicted_peak, release_cached_memory, run_ablation,
                                               run_check, run_variants, start_session, time_step, variant_row)
from raysys.results.records import ROW_COLUMNS, read_results
from raysys.training.step import build_model
from sweeps.common import output_dir

STUDIES = ("ablation", "neighbours", "ddp")
TUNE_SWEEP, DDP_SWEEP = f"{SWEEP}_tune", f"{SWEEP}_ddp"


# ---------------------------------------------------------------------------------------------------- neighbours
def neighbour_specs(plan_layers: tuple[str, ...], offsets: list[int], grow: str = "full") -> list[tuple[int, str]]:
    """(offset, policy spec) for the advisor's plan with `offset` more (negative: fewer) recomputed blocks, in the
    plan's own order (recomputed blocks first, or last): the blocks at the border of the kept (none) run change,
    to the kind of their recomputed neighbour (full or ffn; `grow` when the plan recomputes nothing) or to none.
    Offsets past either end are dropped."""
    from raysys.planning.advisor import policy_for

    layers = list(plan_layers)
    none_last = layers[-1] == "none" or set(layers) == {"none"}
    if not none_last:  # work with the kept run at the end
        layers.reverse()
    m = sum(kind != "none" for kind in layers)  # the recomputed prefix
    edge = layers[m - 1] if m else grow
    out = []
    for off in offsets:
        if not 0 <= m + off <= len(layers):
            continue
        moved = layers[:m + off] + ["none"] * (len(layers) - m - off) if off <= 0 else \
            layers[:m] + [edge] * off + layers[m + off:]
        if not none_last:
            moved.reverse()
        out.append((off, policy_for(tuple(moved)).spec))
    return out


def fast_plan(config: ModelConfig, device: torch.device, args, attention: str = "flash_triton") -> tuple:
    """The advisor's plan of the fast step (batch --batch-size) on `device`, and that step."""
    step = for_device(StepConfig(attention=attention), device, args.compile_backend)
    return plan_on_device(config, args.batch_size, config.context_length, step, dtype=args.dtype, device=device), step


def run_neighbours_local(args, session: Session) -> pd.DataFrame:
    """The plan and its neighbours on the session's model, one after another (no Ray)."""
    plan, step = fast_plan(session.config, session.device, args, session.attention)
    items = ((Variant(name=f"plan{off:+d}", step=step.replace(recompute=spec), batch_size=args.batch_size),
              {"offset": off, "advisor_policy": plan.spec, "launcher": "local"},
              {"advisor_predicted_peak_bytes": plan.predicted_peak_bytes})
             for off, spec in neighbour_specs(plan.layers, args.offsets))
    return run_variants(args, session, TUNE_SWEEP, items, neighbours_summary)


TUNE_ARGS = ("size", "context_length", "vocab_size", "batch_size", "dtype", "device", "timer", "do_bench_only",
             "rep_ms", "warmup_ms", "steps", "warmup_steps", "compile_backend", "warm_cache", "seed")
"""The command-line fields a Tune trial needs (the rest of its configuration: offset and the advisor's plan)."""


def tune_trial(config: dict) -> dict:
    """Ray Tune trainable: the advisor's plan moved by `config["offset"]`, in a fresh process (its own model on
    its own GPU). Returns the row's metrics."""
    parser = build_parser()
    args = parser.parse_args(["--out", "."])
    for key in TUNE_ARGS:
        setattr(args, key, config[key])
    args.variants, args.no_batch2 = "best", True
    session = start_session(args)
    n = session.config.num_layers
    plan_layers = tuple(r.kind for r in parse_policy(config["advisor_policy"], n).regions(n)
                        for _ in range(r.start, r.stop))
    (off, spec), = neighbour_specs(plan_layers, [config["offset"]])
    step = for_device(StepConfig(), session.device, args.compile_backend).replace(recompute=spec)
    variant = Variant(name=f"plan{off:+d}", step=step, batch_size=args.batch_size)
    row = variant_row(args, session, variant, sweep=TUNE_SWEEP)
    if row["status"] != "ok":
        raise RuntimeError(row["error"])
    return {k: v for k, v in row.items() if k not in config and k not in ROW_COLUMNS}


def run_neighbours_tune(args) -> pd.DataFrame:
    """The plan and its neighbours as Ray Tune trials (one GPU each; one CPU each on a CPU-only cluster)."""
    from ray import tune

    from raysys.cluster.sweep import tune_run

    device = resolve_device(args.device)
    plan, _ = fast_plan(model_config_of(args), device, args)
    offsets = [off for off, _ in neighbour_specs(plan.layers, args.offsets)]
    space = {**{k: getattr(args, k) for k in TUNE_ARGS}, "launcher": "tune", "advisor_policy": plan.spec,
             "offset": tune.grid_search(offsets)}
    df = tune_run(tune_trial, space, sweep=TUNE_SWEEP, out_dir=args.out, resume=args.resume,
                  resources={"gpu": 1} if device.type == "cuda" else {"cpu": 1})
    print(neighbours_summary(df))
    return df


def neighbours_summary(df: pd.DataFrame, ablation: pd.DataFrame | None = None) -> str:
    """The measured neighbours, and the advisor's plan against the fastest that fit (target: within 5%) and its
    predicted peak against the measured (target: within 10%). With the ablation's rows (`leaderboard.parquet`
    beside it): a line when the fast step of its latest run ran another plan than these neighbours surround."""
    if df.empty or "step_median_s" not in df:
        return "no neighbour rows"
    stale = _stale_neighbours(df, ablation)
    cols = [c for c in ("offset", "policy", "status", "step_median_s", "peak_bytes", "predicted_peak_bytes")
            if c in df]
    lines = [df[cols].sort_values("offset").to_markdown(index=False, floatfmt=".4g"), ""]
    ok = df[df.status == "ok"]
    plan = ok[ok.offset == 0]
    if not plan.empty and not ok.empty:
        best = ok.loc[ok.step_median_s.idxmin()]
        p = plan.iloc[0]
        mine, theirs = p.step_median_s, best.step_median_s
        lines.append(f"- advisor plan {p.policy}: {mine:.3f} s; fastest measured neighbour that fits "
                     f"{best.policy}: {theirs:.3f} s; plan / best = {mine / theirs:.3f} "
                     f"(target <= 1.05)")
        if p.peak_bytes == p.peak_bytes:
            lines.append(f"- plan's predicted peak {p.predicted_peak_bytes / 2**30:.2f} GiB vs measured "
                         f"{p.peak_bytes / 2**30:.2f} GiB: {100 * (p.predicted_peak_bytes / p.peak_bytes - 1):+.1f}% "
                         f"(target within 10%)")
    return "\n".join(lines + ([stale] if stale else []))


def _stale_neighbours(df: pd.DataFrame, ablation: pd.DataFrame | None) -> str | None:
    """A warning line when the latest ablation run's fast step (`best` at batch 1) ran a plan other than the
    advisor's plan these neighbours surround (the two files come from different commits)."""
    if ablation is None or ablation.empty or "advisor_policy" not in df:
        return None
    fast = ablation[(ablation.variant == "best") & (ablation.batch_size == 1) & (ablation.status == "ok")]
    if fast.empty:
        return None
    latest, plans = fast.sort_values("utc").iloc[-1], sorted(set(df.advisor_policy.dropna()))
    if plans == [latest.policy]:
        return None
    return (f"- **not the fast step's plan now**: these neighbours surround {', '.join(plans)} (commit "
            f"{', '.join(sorted(set(df.git_sha.dropna())))}); the ablation's latest fast step (run {latest.run_id}, "
            f"commit {latest.git_sha}) ran {latest.policy}, not yet measured against its neighbours")


# ---------------------------------------------------------------------------------------------------- ddp
@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPTrial:
    """The fast step on every rank of a gang, gradients averaged by `parallel.ddp.OverlappedDDP`."""

    size: str = "tiny"
    context_length: int | None = None
    vocab_size: int | None = None
    batch_size: int = 1
    """Sequences per rank."""
    dtype: str = "bf16"
    step: tuple = ()
    """`StepConfig` fields as (name, value) pairs."""
    steps: int = 3
    """Timed steps (after one untimed first step), with the events timer."""
    timer: str = "events"
    """`events`: `steps` steps between synchronisations; `do_bench`: the course's harness, its call counts agreed
    across the ranks (`do_bench_agreed`)."""
    rep_ms: float = COURSE_REP_MS
    warmup_ms: float = COURSE_WARMUP_MS
    profile: bool = False
    """Profile one more step: the NCCL kernels' time and the part of it no other kernel overlaps (exposed)."""
    seed: int = 0
    return_params: bool = False
    """Return every parameter after the steps (the tests compare them with one process)."""

    def model_config(self) -> ModelConfig:
        return model_config_of(self)


def _agree_max(ctx, value: float) -> float:
    """The largest `value` over the gang's ranks (a collective: every rank calls it)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.process_group)
    return float(t.item())


def exposed_communication(prof) -> dict:
    """From one profiled step: the NCCL kernels' seconds and the seconds of them no other kernel overlaps (NaN
    without GPU kernels to read, as on the CPU: `profile_status` says why)."""
    from raysys.measure.profiling import kernel_intervals, overlap

    status = prof.status(expect_nccl=True)
    if status != "ok":
        return {"profile_status": status, "comm_s": float("nan"), "comm_exposed_s": float("nan")}
    total_us, shared_us = overlap(*kernel_intervals(prof.events))
    return {"profile_status": status, "comm_s": total_us * 1e-6, "comm_exposed_s": (total_us - shared_us) * 1e-6}


def ddp_trial(ctx, config: dict) -> dict:
    """On every rank: the model (same seed everywhere; the wrapper broadcasts rank 0's anyway), OverlappedDDP over
    the gang's group, the fast step on this rank's own sequences, timed by `timer`; with `profile`, one more step
    under the profiler for the communication it leaves exposed."""
    from parallel.ddp import OverlappedDDP
    from raysys.measure.profiling import profile_steps

    t = DDPTrial(**config)
    mc = t.model_config()
    model = build_model(mc, ctx.device, DTYPES[t.dtype], t.seed)
    ddp = OverlappedDDP(model, process_group=ctx.process_group)
    step = LeaderboardStep(model, StepConfig(**dict(t.step)), batch_size=t.batch_size,
                           sync=ddp.finish_gradient_synchronization)
    try:
        x, y = make_batch(mc, t.batch_size, mc.context_length, ctx.device, t.seed, rank=ctx.rank)
        losses = [float(step(x, y))]
        fn = (lambda: step(x, y)) if t.timer == "do_bench" else (lambda: losses.append(float(step(x, y))))
        timing = time_step(fn, ctx.device, timer=t.timer, rep_ms=t.rep_ms, warmup_ms=t.warmup_ms, steps=t.steps,
                           warmup_steps=0, agree=lambda v: _agree_max(ctx, v))
        median, timed = timing["step_median_s"], timing["timed_steps"]
        peak = float(torch.cuda.max_memory_allocated(ctx.device)) if ctx.device.type == "cuda" else float("nan")
        out = {"step_median_s": median, "timed_steps": timed, "losses": losses, "peak_bytes": peak,
               "tokens_per_s": ctx.world_size * t.batch_size * mc.context_length / median,
               **{k: v for k, v in step.describe().items() if k != "plan_fits"}}
        if t.profile:
            out.update(exposed_communication(profile_steps(lambda: step(x, y), ctx.device, warmup=1, active=1)))
        if t.return_params:
            out["params"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        return out
    finally:
        step.close()
        ddp.remove_hooks()


def run_ddp(args) -> pd.DataFrame:
    """The fast step on a gang of --world-size ranks (Ray actors, or processes with --launcher mp)."""
    from raysys.cluster.sweep import run_sweep

    device = resolve_device(args.device)
    step = for_device(StepConfig(), device, args.compile_backend)
    timer = args.timer or ("do_bench" if device.type == "cuda" else "events")
    trial = DDPTrial(size=args.size, context_length=args.context_length, vocab_size=args.vocab_size,
                     batch_size=args.batch_size, dtype=args.dtype, step=tuple(sorted(step.as_dict().items())),
                     steps=args.steps, timer=timer, rep_ms=args.rep_ms, warmup_ms=args.warmup_ms,
                     profile=device.type == "cuda", seed=args.seed)
    cfg = {k: v for k, v in dataclasses.asdict(trial).items() if k != "return_params"}
    return run_sweep(DDP_SWEEP, [cfg], ddp_trial, args.world_size, args.out, device=str(device), resume=args.resume,
                     reduce=reduce_ddp_ranks, launcher=args.launcher)


def reduce_ddp_ranks(config: dict, per_rank: list[dict]) -> dict:
    """The row of a data-parallel trial: the slowest rank's step, every rank's losses, the largest peak and the most
    communication any rank left exposed (NaN where no rank could measure it)."""
    slow = max(per_rank, key=lambda m: m["step_median_s"])
    row = {**{k: v for k, v in slow.items() if k != "losses"}, "losses": [m["losses"] for m in per_rank],
           "peak_bytes_max": max(m["peak_bytes"] for m in per_rank)}
    if "comm_exposed_s" in slow:
        measured = [m["comm_exposed_s"] for m in per_rank if not math.isnan(m["comm_exposed_s"])]
        row["comm_exposed_s"] = max(measured, default=float("nan"))
    return row


# ---------------------------------------------------------------------------------------------------- report
TARGET_STEP_S, MILESTONE_STEP_S, TARGET_SPEEDUP, COLD_LIMIT_S = 4.5, 5.5, 1.6, 600.0
"""The targets: step <= 4.5 s (5.5 s first milestone), 1.6x today's composition, the whole benchmark from empty
caches under 10 minutes."""


def ablation_markdown(df: pd.DataFrame) -> str:
    """The ablation table per run, and the targets: the fast step's time (course harness where measured) against
    4.5 s / 5.5 s and against today's composition of the same run, its peak against the prediction, the cold start."""
    from raysys.training.leaderboard_bench import summary

    lines = ["## Leaderboard step (`sweeps/leaderboard.py`, `python -m raysys leaderboard`)", ""]
    if df.empty:
        return "\n".join(lines + ["no rows"])
    for run_id, run in df.groupby("run_id", sort=False):
        first = run.iloc[0]
        timers = ", ".join(f"{r.variant} b{r.batch_size}: {r.timer}"
                           + (f" rep {r.rep_ms:g} ms / warmup {r.warmup_ms:g} ms" if r.timer == "do_bench" else
                              f" median of {r.steps:g} steps") for r in run.itertuples())
        lines += [f"Run {run_id} ({first.git_sha}, {first.utc}): {first['size']}, context {first.seq_len}, "
                  f"{first['dtype']} weights; timers: {timers}.", "", summary(run), ""]
    ok = df[df.status == "ok"]
    best = ok[(ok.variant == "best") & (ok.batch_size == ok.batch_size.min())]
    if not best.empty:
        harness = best[best.timer == "do_bench"].sort_values("rep_ms")
        head = (harness if not harness.empty else best).iloc[-1]
        how = f"do_bench rep {head.rep_ms:g} ms / warmup {head.warmup_ms:g} ms" if head.timer == "do_bench" else "events"
        step = head.step_median_s
        verdict = lambda limit: "met" if step <= limit else f"missed by {step - limit:.2f} s"
        lines.append(f"- fast step, batch {head.batch_size} x {head.seq_len} ({how}): {head.step_median_s:.3f} s, "
                     f"{head.model_tflops:.0f} model TFLOP/s, MFU {head.mfu:.2f} of a {head.matmul_tflops:.0f} TFLOP/s "
                     f"matmul measured in the run; target <= {TARGET_STEP_S} s: {verdict(TARGET_STEP_S)}; first "
                     f"milestone <= {MILESTONE_STEP_S} s: {verdict(MILESTONE_STEP_S)}")
        for r in best.itertuples():
            today = ok[(ok.run_id == r.run_id) & (ok.variant == "today") & (ok.batch_size == r.batch_size)]
            if not today.empty:
                t = today.iloc[0]
                fast, slow = r.step_median_s, t.step_median_s
                lines.append(f"- same run {r.run_id}: fast {fast:.3f} s vs today's composition {slow:.3f} s "
                             f"(peak {t.peak_bytes / 2**30:.1f} GiB): {slow / fast:.2f}x (target "
                             f"{TARGET_SPEEDUP}x: {'met' if slow / fast >= TARGET_SPEEDUP else 'missed'})")
            for name, what in (("best-ffn", "ffn blocks"), ("best-offload", "offloaded blocks"),
                               ("best-lean", "lean blocks")):
                other = ok[(ok.run_id == r.run_id) & (ok.variant == name) & (ok.batch_size == r.batch_size)]
                if not other.empty and other.iloc[0].policy == r.policy:
                    o = other.iloc[0]
                    lines.append(f"- same run {r.run_id}: the fast step's plan ({r.policy}) has no {what}; without "
                                 f"them the advisor chose it again: {o.step_median_s:.3f} s against "
                                 f"{r.step_median_s:.3f} s (the same step measured twice)")
                elif not other.empty:
                    o = other.iloc[0]
                    lines.append(f"- same run {r.run_id}: fast step ({r.policy}, peak {r.peak_bytes / 2**30:.1f} GiB) "
                                 f"{r.step_median_s:.3f} s vs without {what} ({o.policy}, peak "
                                 f"{o.peak_bytes / 2**30:.1f} GiB) {o.step_median_s:.3f} s: "
                                 f"{o.step_median_s - r.step_median_s:.3f} s saved by {what}")
            for other in ok[(ok.run_id == r.run_id) & (ok.variant.str.startswith("best/"))
                            & (ok.batch_size == r.batch_size)].itertuples():
                lines.append(f"- same run {r.run_id}: the fast step with {attention_text(r)} {r.step_median_s:.3f} s "
                             f"vs with {attention_text(other)} {other.step_median_s:.3f} s: "
                             f"{r.step_median_s / other.step_median_s:.3f}x ({r.timer} and {other.timer})")
            times = {c.removeprefix("attention_").removesuffix("_s"): getattr(r, c) for c in ok.columns
                     if c.startswith("attention_") and c.endswith("_s") and getattr(r, c) == getattr(r, c)}
            if times:
                mc = ModelConfig.from_name(r.size, context_length=int(r.seq_len))
                flops = 7 * r.batch_size * mc.num_heads * r.seq_len ** 2 * mc.d_head  # causal fwd + bwd (2.5x fwd)
                lines.append(f"- attention forward + backward at the step's shape (batch {r.batch_size}, {mc.num_heads} "
                             f"heads x {r.seq_len} x {mc.d_head}, causal), measured when run {r.run_id} started: "
                             + ", ".join(f"{k} {1e3 * v:.1f} ms ({flops / v / 1e12:.0f} TFLOP/s)"
                                         for k, v in times.items()) + f"; the fast step ran {r.attention}")
        cold = best[best.cold_start_s.notna()]
        for r in cold.itertuples():
            run_s = getattr(r, "cold_run_s", float("nan"))
            what = (f"; the whole benchmark ({r.timer} rep {r.rep_ms:g} / warmup {r.warmup_ms:g} ms) ended "
                    f"{run_s:.1f} s after the process started (target < {COLD_LIMIT_S:.0f} s: "
                    f"{'met' if run_s < COLD_LIMIT_S else 'missed'})" if run_s == run_s else "")
            lines.append(f"- empty Triton / Inductor caches (run {r.run_id}): first step done {r.cold_start_s:.1f} s "
                         f"after the process started (first step {r.first_step_s:.1f} s){what}")
    scored = ok[ok.peak_bytes.notna() & ok.predicted_peak_bytes.notna()]
    if not scored.empty:
        for label, predicted in (("as recorded", scored.predicted_peak_bytes), (
                "by the current model (its CUDA materialised-loss term was fitted to an earlier H200 run, "
                "results/runs/leaderboard_258880d_294b0e3.parquet)",
                repredict(scored))):
            err = (predicted / scored.peak_bytes - 1).abs()
            worst = err.idxmax()
            lines.append(f"- predicted peak ({label}) within 10% of measured on {int((err <= 0.10).sum())} of "
                         f"{len(scored)} rows (largest |error| {100 * err.max():.1f}%: {scored.loc[worst, 'variant']} "
                         f"b{scored.loc[worst, 'batch_size']} of {scored.loc[worst, 'git_sha']})")
    bad = df[df.status != "ok"]
    for r in bad.itertuples():
        lines.append(f"- {r.variant} b{r.batch_size} ({r.git_sha}): {r.status}: {str(r.error).splitlines()[0][:160]}")
    return "\n".join(lines) + "\n"


def repredict(rows: pd.DataFrame) -> pd.Series:
    """The peak `raysys.planning.recompute_model` predicts now for each measured row (its policy, composition,
    batch)."""
    out = []
    for r in rows.itertuples():
        mc = ModelConfig.from_name(r.size, context_length=int(r.seq_len), vocab_size=int(r.vocab_size),
                                   attention=r.attention)
        lean = getattr(r, "lean", False)  # rows from before lean blocks: no column, or NaN beside newer rows
        kernels = getattr(r, "attention_kernels", "")  # (rows from before the column: the tl two-pass backward)
        out.append(predicted_peak(mc, int(r.batch_size), None, r.dtype, loss=r.loss, compiled=bool(r.compile),
                                  lean=bool(pd.notna(lean) and lean), optimizer=r.optimizer, device_type=r.device,
                                  regions=parse_policy(r.policy, mc.num_layers).regions(mc.num_layers),
                                  attention_kernels=kernels if isinstance(kernels, str) else ""))
    return pd.Series(out, index=rows.index, dtype=float)


DDP_TARGET_STEP_S, DDP_TARGET_RATIO = 4.6, 1.02
"""The data-parallel targets: the 2-GPU step (batch 2) <= 4.6 s, and <= 1.02x the one-GPU per-rank step of the
commit."""


def ddp_markdown(df: pd.DataFrame, ablation: pd.DataFrame | None = None) -> str:
    """The data-parallel rows, and for each the one-GPU fast step at its per-rank batch measured by the same
    commit (the ablation's latest `best` row of that commit and batch): the ratio, and the exposed communication."""
    lines = ["## Leaderboard step, data parallel (`--studies ddp`)", ""]
    if df.empty:
        return "\n".join(lines + ["no rows"])
    cols = [c for c in ("world_size", "batch_size", "timer", "status", "step_median_s", "timed_steps",
                        "peak_bytes_max", "comm_s", "comm_exposed_s", "profile_status", "policy", "attention",
                        "git_sha", "error") if c in df]
    lines += [df[cols].to_markdown(index=False, floatfmt=".4g"), ""]
    for r in df[df.status == "ok"].itertuples():
        world, batch = int(getattr(r, "world_size", 0) or 0), int(r.batch_size)
        line = (f"- {r.size}, {world} ranks x batch {batch} (global batch {world * batch}): {r.step_median_s:.3f} s "
                f"({getattr(r, 'timer', 'events')})")
        if r.size == "leaderboard":
            line += (f"; goal <= {DDP_TARGET_STEP_S} s: "
                     f"{'met' if r.step_median_s <= DDP_TARGET_STEP_S else 'missed'}")
        exposed = getattr(r, "comm_exposed_s", float("nan"))
        if exposed == exposed:
            line += f"; communication {1e3 * r.comm_s:.1f} ms, of it exposed {1e3 * exposed:.1f} ms"
        one = None if ablation is None or ablation.empty else ablation[
            (ablation.variant == "best") & (ablation.batch_size == batch) & (ablation.status == "ok")
            & (ablation.git_sha == r.git_sha)]
        if one is not None and not one.empty:
            ref = one.sort_values("utc").iloc[-1]
            ratio = r.step_median_s / ref.step_median_s
            verdict = "met" if ratio <= DDP_TARGET_RATIO else "missed"
            line += (f"; one GPU, batch {batch}, same commit (run {ref.run_id}, {ref.timer}): {ref.step_median_s:.3f} "
                     f"s, ratio {ratio:.3f} (goal <= {DDP_TARGET_RATIO}: {verdict})")
            if ref.size != r.size:
                line += f" [sizes differ: {ref.size}]"
        else:
            line += f"; no one-GPU fast step at batch {batch} of commit {r.git_sha} to compare with"
        lines.append(line)
    return "\n".join(lines) + "\n"


def check_markdown(df: pd.DataFrame) -> str:
    cols = ["size", "seq_len", "dtype", "loss", "reference_loss", "loss_abs_diff", "grad_max_rel_error",
            "grad_worst_param", "update_max_abs_diff", "attention", "loss_path", "optimizer_class", "compiled"]
    return ("## Leaderboard step against the reference path (`--check`)\n\nThe fast step's loss and every gradient "
            "against `cross_entropy(model(x), y)` with naive attention on the same bf16 weights and batch, and one "
            "FusedAdamW update against the reference AdamW's from identical weights and gradients.\n\n"
            + df[[c for c in cols if c in df]].to_markdown(index=False, floatfmt=".4g") + "\n")


def write_reports(out: Path) -> list[Path]:
    """`<sweep>.md` beside each of this study's Parquet files in `out` (what `python -m raysys report` shows)."""
    made = []
    ablation_path = Path(out) / f"{SWEEP}.parquet"
    ablation = read_results(ablation_path) if ablation_path.exists() else None
    for sweep, draw in ((SWEEP, ablation_markdown), (TUNE_SWEEP, lambda d: "## Leaderboard recompute plan and its "
                        "neighbours\n\n" + neighbours_summary(d, ablation) + "\n"), (f"{SWEEP}_check", check_markdown),
                        (DDP_SWEEP, lambda d: ddp_markdown(d, ablation))):
        path = Path(out) / f"{sweep}.parquet"
        if path.exists():
            md = path.with_suffix(".md")
            md.write_text(draw(read_results(path)))  # older files' columns in the convention
            made.append(md)
    return made


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = build_leaderboard_parser(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                         formatter_class=argparse.RawTextHelpFormatter))
    p.add_argument("--studies", dest="study", action=JoinList, default="ablation", metavar="A,B,..",
                   help=f"which studies, in order, a comma list of {', '.join(STUDIES)}")
    p.add_argument("--study", dest="study", action=JoinList, help=argparse.SUPPRESS)
    p.add_argument("--no-ray", action="store_true", help="neighbours: loop in this process instead of Ray Tune")
    p.add_argument("--offsets", type=int, nargs="+", default=[-2, -1, 0, 1, 2],
                   help="neighbours: moves of the plan's number of fully checkpointed blocks (0: the plan)")
    p.add_argument("--world-sizes", dest="world_size", default="2", metavar="N", help="ddp: ranks (one value)")
    p.add_argument("--world-size", dest="world_size", help=argparse.SUPPRESS)
    p.add_argument("--launcher", default="ray", choices=("ray", "mp"), help="ddp: Ray actors or plain processes")
    p.add_argument("--report-only", action="store_true", help="only rewrite the .md reports of the files in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    studies = split_list(args.study)
    unknown = [name for name in studies if name not in STUDIES]
    if unknown or not studies:
        raise ValueError(f"--studies {args.study!r} must name studies among {', '.join(STUDIES)}")
    try:
        args.world_size = int(args.world_size)
    except ValueError:
        raise ValueError(f"--world-sizes {args.world_size!r} must be one integer (the ddp study's ranks)") from None
    if args.world_size < 1:
        raise ValueError(f"--world-sizes ({args.world_size}) must be >= 1")
    if 0 not in args.offsets:
        raise ValueError(f"--offsets {args.offsets} must contain 0 (the advisor's plan itself)")
    if args.context_length is not None and args.context_length < 1:
        raise ValueError(f"--context-length ({args.context_length}) must be >= 1")
    if not args.report_only:  # a CPU run bounded by this machine's memory, before any model, gang or Tune trial
        check_options(args)  # the options every study shares (timer, rep / warm-up, device), whichever runs
        cpu = args.device == "cpu" or args.device == "auto" and not torch.cuda.is_available()
        check_fits(model_config_of(args), args.batch_size,
                   args.world_size if "ddp" in studies else 1, "cpu" if cpu else "cuda")
    args.out = str(output_dir(args, SWEEP))  # --out, else a fresh ./runs/<UTC time>-leaderboard/
    if args.report_only:
        for path in write_reports(Path(args.out)):
            print(path.read_text())
        return 0
    session = None
    for study in studies:
        if study in ("ablation",) or (study == "neighbours" and args.no_ray):
            session = session or start_session(args)
        print(f"== {study}", flush=True)
        if study == "ablation":
            run_ablation(args, session)
        elif study == "neighbours":
            run_neighbours_local(args, session) if args.no_ray else run_neighbours_tune(args)
        else:
            if session is not None:  # the ranks need the memory
                session.model = None
                release_cached_memory(session.device)
            run_ddp(args)
    if args.check:
        if session is not None:
            session.model = None
        run_check(args, session or start_session(args))
    write_reports(Path(args.out))
    return 0


if __name__ == "__main__":
    from raysys.cluster.studies import run_script

    sys.exit(run_script(main))
