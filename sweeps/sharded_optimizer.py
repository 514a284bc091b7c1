"""Optimizer-state sharding on a gang of ranks (handout 6, optimizer_state_sharding_accounting): peak memory
and time per step with and without `parallel.sharded_optimizer.ShardedOptimizer`; one row per dtype x arm in
`<out>/sharded_optimizer.parquet`.

Both arms train the same model under `BucketedDDP` (100 MiB buckets) with torch's AdamW; the sharded arm wraps it in
`ShardedOptimizer`. Memory (rank 0) at `init`, `before_step` and `after_step`, and time per step. Without GPUs: gloo
ranks, `tiny`, fp32 (peaks NaN). Each column: docs/studies.md.

    python sweeps/sharded_optimizer.py --out /tmp/sharded          # embedded Ray; CPU/gloo without a GPU
    python sweeps/sharded_optimizer.py --device cuda --dtypes fp32,bf16 --out "$PWD/results" --overwrite
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from parallel.ddp import BucketedDDP
from parallel.sharded_optimizer import ShardedOptimizer
from raysys.measure.memory import peak_bytes, release, reset_peak
from raysys.measure.timing import Marks, time_steps
from raysys.training.step import TrainStep, build_model
from sweeps.common import (GANG_DTYPES, GangTrial, adamw_kwargs, add_model_flags,
                           check_fits, gang_study_main, grid_values, in_trial_scope, list_flag, main_entry,
                           markdown_report, parse_list, pyplot, save_figure, setup_sentence, study_parser,
                           training_state_bytes, write_markdown)

SWEEP = "sharded_optimizer"
POINTS = ("init", "before_step", "after_step")
PARTS = ("params", "grads", "optimizer_state", "other")
DDP_BUCKET_MB = 100.0
DEFAULTS = {"cuda": dict(size="xl", context_length=512, dtypes="fp32", batch_per_rank=2, warmup=3, steps=10),
            "cpu": dict(size="tiny", context_length=64, dtypes="fp32", batch_per_rank=2, warmup=3, steps=10)}


@dataclass(frozen=True, kw_only=True)
class ShardedTrial(GangTrial):
    """One arm (optimizer state sharded or not) in one dtype."""

    KEY = PER_TRIAL = ("dtype", "sharded")
    sharded: bool
    """AdamW wrapped in ShardedOptimizer (each rank keeps the state of ~1/N of the parameters)."""
    ddp_bucket_mb: float = DDP_BUCKET_MB
    """Bucket size of the BucketedDDP wrapper both arms train under, MiB."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup < 1:
            raise ValueError(f"warmup ({self.warmup}) must be >= 1: the optimizer state must exist before memory is "
                             "measured")


def trials(*, dtypes: list[str], **fields) -> list[ShardedTrial]:
    """Both arms per dtype, unsharded first (`fields`: the other `ShardedTrial` fields)."""
    return [ShardedTrial(dtype=dtype, sharded=sharded, **fields) for dtype in dtypes for sharded in (False, True)]


# ---------------------------------------------------------------------------------------------------- memory
def memory_breakdown(model: BucketedDDP, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """Bytes allocated now, split into PARTS; every storage is counted once, in the first part that holds it."""
    out: dict[str, float] = training_state_bytes(model, optimizer)
    # The CPU has no allocator statistics.
    out["other"] = torch.cuda.memory_allocated(device) - sum(out.values()) if device.type == "cuda" else float("nan")
    return out


def _peak(device: torch.device) -> float:
    """Peak allocated bytes since the last reset (NaN on the CPU), then reset."""
    peak = peak_bytes(device)
    reset_peak(device)
    return peak


# ---------------------------------------------------------------------------------------------------- trial
def sharded_trial(ctx, trial: ShardedTrial) -> dict:
    """On every rank: memory at POINTS and time per step, with or without optimizer-state sharding (plus the
    memory before and after the trial)."""
    return in_trial_scope(_sharded_trial, ctx, ShardedTrial.of(trial))


def _sharded_trial(ctx, trial: ShardedTrial) -> dict:
    device = ctx.device
    reset_peak(device)
    model = BucketedDDP(build_model(trial.model_config(), device, seed=trial.seed), trial.ddp_bucket_mb,
                        process_group=ctx.process_group)
    if trial.sharded:
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=ctx.process_group,
                                     **adamw_kwargs(device))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))
    step = TrainStep(model, optimizer, trial.batch(device, ctx.rank), trial.dtype, device)
    metrics: dict[str, float] = {}

    def record(point: str) -> None:
        metrics[f"peak_{point}_bytes"] = _peak(device)
        for part, nbytes in memory_breakdown(model, optimizer, device).items():
            metrics[f"{part}_{point}_bytes"] = nbytes

    try:
        record("init")
        for _ in range(trial.warmup):
            step()
        # One steady-state step, opened up at the optimizer step.
        _peak(device)
        step.gradients(Marks(device))
        record("before_step")
        optimizer.step()
        record("after_step")
        metrics.update(time_steps(step, 0, trial.steps))
        inner = optimizer.local_optimizer if trial.sharded else optimizer
        metrics["owned_params"] = sum(len(g["params"]) for g in inner.param_groups)
    finally:
        release(model)
    return metrics


def reduce_ranks(trial: ShardedTrial, per_rank: list[dict]) -> dict:
    """Rank 0's metrics, the slowest rank's step, and the spread of optimizer state over ranks."""
    out = dict(per_rank[0])
    out["step_mean_max_rank_s"] = max(r["step_mean_s"] for r in per_rank)
    state = [r["optimizer_state_after_step_bytes"] for r in per_rank]
    out["optimizer_state_max_rank_bytes"] = max(state)
    out["optimizer_state_total_bytes"] = sum(state)
    return out


# ---------------------------------------------------------------------------------------------------- report
def long_memory(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """One row per (dtype, sharded, point): peak and the breakdown; in GiB, or MiB for small models."""
    ok = df[df["status"] == "ok"]
    byte_cols = [f"{key}_{point}_bytes" for point in POINTS for key in ("peak", *PARTS)]
    largest = ok[[c for c in byte_cols if c in ok]].max().max() if not ok.empty else 0
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    rows = []
    for _, r in ok.iterrows():
        for point in POINTS:
            row = {"dtype": r["dtype"], "sharded": bool(r["sharded"]), "point": point,
                   "peak": r[f"peak_{point}_bytes"] / scale}
            row.update({part: r[f"{part}_{point}_bytes"] / scale for part in PARTS})
            rows.append(row)
    return pd.DataFrame(rows), unit


def markdown(df: pd.DataFrame) -> str:
    def intro(first: pd.Series) -> str:
        return (f"{setup_sentence(first)}, BucketedDDP ({first['ddp_bucket_mb']:g} MiB) + AdamW. "
                "Rank 0's memory: `peak` since the previous point; the other columns split what is allocated at the "
                "point (no allocator statistics on the CPU: peak and other are NaN there).")

    def body(ok: pd.DataFrame) -> list[str]:
        mem, unit = long_memory(df)
        timing = pd.DataFrame({
            "dtype": ok["dtype"], "sharded": ok["sharded"].astype(bool),
            "step (ms)": [f"{1e3 * m:.1f} ± {1e3 * s:.1f}" for m, s in zip(ok["step_mean_s"], ok["step_std_s"])],
            "optimizer (ms)": 1e3 * ok["optimizer_mean_s"],
            "forward+backward (ms)": 1e3 * (ok["forward_mean_s"] + ok["backward_mean_s"]),
            "optimizer state, max rank (MiB)": ok["optimizer_state_max_rank_bytes"] / 2**20})
        return [f"Memory ({unit}):\n\n" + mem.to_markdown(index=False, floatfmt=".2f"),
                "Time per step (the sharded optimizer phase includes the parameter broadcasts):\n\n"
                + timing.to_markdown(index=False, floatfmt=".3g")]

    return markdown_report(df, ["dtype", "sharded"], intro, body)


def plot(df: pd.DataFrame, path: Path) -> Path | None:
    """Stacked memory breakdown per point, unsharded next to sharded, one panel per dtype."""
    mem, unit = long_memory(df)
    if mem.empty:
        return None
    plt = pyplot()
    dtypes = list(dict.fromkeys(mem["dtype"]))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 3.8), squeeze=False)
    colors = {"params": "tab:blue", "grads": "tab:green", "optimizer_state": "tab:red", "other": "tab:gray"}
    for ax, dtype in zip(axes[0], dtypes):
        part = mem[mem["dtype"] == dtype]
        labels = [f"{p}\n{'sharded' if s else 'full'}" for p, s in zip(part["point"], part["sharded"])]
        bottom = pd.Series(0.0, index=part.index)
        for name in PARTS:   # "other" and "peak" are NaN on the CPU (no allocator statistics): drawn as nothing
            ax.bar(labels, part[name].fillna(0), bottom=bottom, color=colors[name], label=name)
            bottom = bottom + part[name].fillna(0)
        if part["peak"].notna().any():
            ax.scatter(labels, part["peak"], marker="_", s=400, color="k", label="peak since previous point", zorder=3)
        ax.set_ylabel(f"{unit} (rank 0)")
        ax.set_title(dtype)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Optimizer-state sharding: memory by point", fontsize=10)
    return save_figure(fig, path)


def write_report(df: pd.DataFrame, out: Path) -> tuple[Path, Path | None]:
    return write_markdown(out, SWEEP, "Optimizer-state sharding", markdown(df)), plot(df, out / f"{SWEEP}.png")


# ---------------------------------------------------------------------------------------------------- main
def build_parser():
    p = study_parser(__doc__, SWEEP, gang=True, timeout_s=600.0,
                     device_help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the cluster has GPUs")
    add_model_flags(p, DEFAULTS)
    list_flag(p, "--dtypes", default="fp32", aliases=("--dtype", "--sharded-dtypes"),
              help=f"comma list of {', '.join(GANG_DTYPES)} (bf16: autocast)")
    return p


def grid(args, device: str, world_size: int, check_device: bool = True) -> list[ShardedTrial]:
    """The trials the flags ask for on `device` (its defaults fill the flags left out); every value checked."""
    out = trials(**grid_values(args, DEFAULTS, device), dtypes=parse_list(args.dtypes, "dtypes", GANG_DTYPES))
    if check_device:
        check_fits(out[0].model_config(), out[0].batch_per_rank, world_size, device)
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    return gang_study_main(args, SWEEP, grid, lambda out: sharded_trial, reduce_ranks, write_report)


if __name__ == "__main__":
    sys.exit(main_entry(main))
