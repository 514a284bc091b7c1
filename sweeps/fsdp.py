"""Fully sharded data parallel on a gang of ranks (handout 7, fsdp_accounting): time per step, peak memory and
all-gather overlap of `parallel.fsdp.FSDP` against DDP, DDP + optimizer-state sharding and torch's FSDP2, in one
run; one row per dtype x variant in `<out>/fsdp.parquet`. Every rank runs `--batch-per-rank` sequences per step.

Variants: `single`, `single_cast` (FSDP's compute policy, no sharding), `ddp`, `ddp_sharded`, `fsdp` (one unit per
block), `fsdp_flat`, `fsdp_flat_rs`, `fsdp_hp`, `fsdp@8` (NCCL-only), `fsdp_layer` (one unit per Linear / Embedding)
and `fsdp2`; AdamW everywhere. Targets (bf16, GPU): each per-block FSDP variant's step <= 1.10x single's, its peak
memory <= fsdp2's. Without GPUs: gloo ranks, `tiny`. Each variant, flag and column: docs/studies.md.

    python sweeps/fsdp.py --out /tmp/fsdp                         # embedded Ray; CPU/gloo without a GPU
    ray job submit --working-dir . -- python sweeps/fsdp.py --out "$PWD/results" --overwrite
    python sweeps/fsdp.py --variants single,fsdp,fsdp2 --dtypes bf16 --out /tmp/fsdp
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from parallel.ddp import make_ddp
from parallel.fsdp import FSDP, is_sharded_module, make_fsdp
from parallel.mixed_precision import CastForCompute
from parallel.sharded_optimizer import ShardedOptimizer
from raysys.model.config import ModelConfig
from raysys.measure.device import low_precision, synchronize
from raysys.measure.memory import peak_bytes, release, reset_peak
from raysys.model.transformer import TransformerBlock, TransformerLM
from raysys.measure.profiling import device_kernels, is_nccl, kernel_intervals, overlap
from raysys.cluster.rank import nccl_group
from raysys.measure.timing import paired_steps, time_steps
from raysys.training.step import TrainStep, build_model
from sweeps.common import (GANG_DTYPES, NOT_ON_CPU, VariantTrial, adamw_kwargs, add_model_flags,
                           add_variant_flags, check_fits, check_variant_flags, gang_study_main,
                           grid_values, in_trial_scope, list_flag, main_entry, markdown_report, on_cpu, paired_summary,
                           parse_list, profile_one_step, setup_sentence, step_column, study_parser,
                           training_state_bytes, write_markdown)

SWEEP = "fsdp"
COMPILED = "fsdp_compiled"  # the same study with compiled blocks (--compile): its own file, tables and baselines
VARIANTS = ("single", "single_cast", "ddp", "ddp_sharded", "fsdp", "fsdp_flat", "fsdp_flat_rs", "fsdp_hp", "fsdp@8",
            "fsdp_layer", "fsdp2")
# Per-block FSDP over a group of its own (NCCL only): variant -> nccl_group options; and the SM carve-outs.
OWN_GROUP = {"fsdp_hp": dict(high_priority=True), "fsdp@8": dict(max_ctas=8)}
SM_CARVEOUT = {"fsdp@8": 8}
OURS = ("fsdp", "fsdp_flat", "fsdp_flat_rs", "fsdp_hp", "fsdp@8")  # per-block FSDP variants, checked against targets
AUTOCAST_VARIANTS = ("single", "ddp", "ddp_sharded")  # the others cast weights to the compute dtype themselves
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
DDP_BUCKET_MB = 100.0
STALL_US = 5.0
TARGET_VS_SINGLE = 1.10
DEFAULTS = {"cuda": dict(size="xl", context_length=512, batch_per_rank=4, warmup=2, steps=12, variants=VARIANTS),
            "cpu": dict(size="tiny", context_length=64, batch_per_rank=2, warmup=1, steps=3,
                        variants=tuple(v for v in VARIANTS if v not in OWN_GROUP))}


# ---------------------------------------------------------------------------------------------------- grid
@dataclass(frozen=True, kw_only=True)
class FSDPTrial(VariantTrial):
    """One variant of VARIANTS in one dtype."""

    VARIANTS = VARIANTS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compile and self.variant == "fsdp_layer":
            raise ValueError("variant fsdp_layer: its gather hooks sit on the Linear modules inside each block, "
                             "which --compile traces into the block's graph; compiled blocks need per-block units")


def trials(*, dtypes: list[str], variants: list[str], profile: list[str], **fields) -> list[FSDPTrial]:
    """One trial per dtype x variant (`fields`: the other `FSDPTrial` fields), validated before any rank starts."""
    for what, items, allowed in (("dtypes", dtypes, GANG_DTYPES), ("variants", variants, VARIANTS),
                                 ("profile", profile, VARIANTS)):
        bad = [x for x in items if x not in allowed]
        if bad:
            raise ValueError(f"{what} {bad} not in {allowed}")
    return [FSDPTrial(dtype=dtype, variant=variant, profile=variant in profile, **fields)
            for dtype in dtypes for variant in variants]


# ---------------------------------------------------------------------------------------------------- build
def build(trial: FSDPTrial, device: torch.device, process_group) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapped model and its optimizer for `trial.variant` (same initial weights on every rank); for an
    OWN_GROUP variant, `process_group` is that variant's own group."""
    variant, low = trial.variant, low_precision(trial.dtype)
    alone = {"collectives_alone": True} if trial.collectives_alone else {}
    model = build_model(trial.model_config(), device, seed=trial.seed, compile=trial.compile)
    if variant == "single_cast" and low is not None:
        model = CastForCompute(model, low)
    elif variant in ("ddp", "ddp_sharded"):
        model = make_ddp("bucketed", model, bucket_size_mb=DDP_BUCKET_MB, process_group=process_group, **alone)
    elif variant in ("fsdp", "fsdp_flat", "fsdp_flat_rs", "fsdp_layer") or variant in OWN_GROUP:  # layer: per Linear
        model = make_fsdp("fsdp", model, compute_dtype=low, process_group=process_group,
                          units=None if variant == "fsdp_layer" else (TransformerBlock,),
                          sm_carveout=SM_CARVEOUT.get(variant), flat_collectives=variant == "fsdp_flat",
                          flat_reduce_scatter=variant == "fsdp_flat_rs", **alone)
    elif variant == "fsdp2":
        model = make_fsdp("fsdp2", model, compute_dtype=low, process_group=process_group, units=(TransformerBlock,))
    if variant == "ddp_sharded":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=process_group,
                                       **adamw_kwargs(device))
    return model, torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))


# ---------------------------------------------------------------------------------------------------- memory
def expected_state(mc: ModelConfig, variant: str, world_size: int) -> dict[str, float]:
    """Predicted per-rank bytes of fp32 params, grads and AdamW moments (see the module docstring)."""
    model = TransformerLM(mc, device="meta")
    padded = lambda p: math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0])  # noqa: E731
    sharded = {id(m.weight) for m in model.modules() if is_sharded_module(m)}
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    ours = sum(padded(p) if id(p) in sharded else p.numel() for p in params)
    per_rank = (sum(padded(p) for p in params) if variant == "fsdp2" else ours if variant.startswith("fsdp")
                else total)
    moments = 2 * (total / world_size if variant == "ddp_sharded" else per_rank)
    return {"expected_params_bytes": 4.0 * per_rank, "expected_grads_bytes": 4.0 * per_rank,
            "expected_optimizer_state_bytes": 4.0 * moments,
            "expected_state_bytes": 4.0 * (2 * per_rank + moments)}


# ---------------------------------------------------------------------------------------------------- overlap
def nccl_kernels(events) -> tuple[dict[str, list], list]:
    """({all_gather|reduce_scatter|all_reduce|other: [(start, end)]}, compute kernel intervals), microseconds:
    `raysys.measure.profiling.kernel_intervals`, with the NCCL kernels sorted by the collective they run."""
    _, compute = kernel_intervals(events)
    comm: dict[str, list] = {kind: [] for kind in (*COLLECTIVES, "other")}
    for name, start, end in device_kernels(events):
        if is_nccl(name):
            kind = next((k for k in COLLECTIVES if k.replace("_", "") in name.lower()), "other")
            comm[kind].append((start, end))
    return comm, compute


def exposed(interval: tuple[float, float], compute: list[tuple[float, float]]) -> float:
    """Length of `interval` during which no compute interval runs."""
    return (interval[1] - interval[0]) - overlap([interval], compute)[1]


def overlap_metrics(events) -> dict[str, float]:
    comm, compute = nccl_kernels(events)
    out: dict[str, float] = {}
    for kind in COLLECTIVES:
        key = kind.replace("_", "")
        total, shared = overlap(comm[kind], compute)
        out[f"{key}_kernels"] = len(comm[kind])
        out[f"{key}_s"] = total / 1e6
        out[f"{key}_exposed_s"] = (total - shared) / 1e6
    out["stalled_allgathers"] = sum(exposed(iv, compute) > STALL_US for iv in comm["all_gather"])
    return out


def profile_step(step: TrainStep, trace_path: Path | None, expect_nccl: bool = True) -> dict[str, float | str]:
    """Profile one step; overlap metrics from its GPU kernels (none on the CPU, `profile_status` says why)."""
    prof, out = profile_one_step(step, trace_path, expect_nccl)
    out["profiled_kernels"] = prof.num_kernels
    if out["profile_status"] == "ok":
        out.update(overlap_metrics(prof.events))
    return out


# ---------------------------------------------------------------------------------------------------- trial
def fsdp_trial(ctx, trial: FSDPTrial, out_dir: str | None = None) -> dict:
    """On every rank: build `trial.variant`, time it, count its memory, profile it if asked (plus the memory
    before and after the trial)."""
    return in_trial_scope(_fsdp_trial, ctx, FSDPTrial.of(trial), out_dir)


def _fsdp_trial(ctx, trial: FSDPTrial, out_dir: str | None) -> dict:
    options = OWN_GROUP.get(trial.variant)
    group = nccl_group(ctx.world_size, **options) if options is not None else ctx.process_group
    metrics = _timed_trial(ctx, trial, out_dir, group)
    if group is not ctx.process_group:  # not after a failure: the gang is torn down then anyway
        dist.destroy_process_group(group)
    return metrics


def _timed_trial(ctx, trial: FSDPTrial, out_dir: str | None, group) -> dict:
    device = ctx.device
    model, optimizer = build(trial, device, group)
    autocast_dtype = trial.dtype if trial.variant in AUTOCAST_VARIANTS else "fp32"
    step = TrainStep(model, optimizer, trial.batch(device, ctx.rank), autocast_dtype, device)
    reset_peak(device)
    metrics = time_steps(step, trial.warmup, trial.steps)
    metrics["peak_memory_bytes"] = peak_bytes(device)
    state = training_state_bytes(model, optimizer, scalars=False)
    metrics.update({f"{part}_bytes": nbytes for part, nbytes in state.items()}, state_bytes=sum(state.values()))
    metrics.update(expected_state(trial.model_config(), trial.variant, ctx.world_size))
    if isinstance(model, FSDP):
        model.stats.reset()
        step()
        synchronize(device)
        metrics["gather_wait_s"] = model.stats.forward_wait_s + model.stats.backward_wait_s
        metrics["all_gathers_per_step"] = model.stats.all_gathers
        metrics["peak_gathered_bytes"] = model.stats.peak_gathered_bytes
    if trial.paired_rounds and trial.variant != "single":
        reference, ref_optimizer = build(dataclasses.replace(trial, variant="single"), device, group)
        ref_step = TrainStep(reference, ref_optimizer, step.batch, trial.dtype, device)   # single: autocast
        metrics.update(paired_steps(step, ref_step, trial.paired_rounds))
        del reference, ref_optimizer, ref_step
    if trial.profile:
        trace = None
        if out_dir is not None and ctx.rank == 0:
            trace = Path(out_dir) / "traces" / f"fsdp_{trial.variant}_{trial.dtype}.json"
        metrics.update(profile_step(step, trace, expect_nccl=trial.variant not in ("single", "single_cast")))
    release(model)
    return metrics


def reduce_ranks(trial: FSDPTrial, per_rank: list[dict]) -> dict:
    """Rank 0's metrics, the slowest rank's step and the largest peak memory."""
    out = dict(per_rank[0])
    out["step_mean_max_rank_s"] = max(r["step_mean_s"] for r in per_rank)
    out["step_median_max_rank_s"] = max(r["step_median_s"] for r in per_rank)
    out["peak_memory_max_rank_bytes"] = max(r["peak_memory_bytes"] for r in per_rank)
    return out


# ---------------------------------------------------------------------------------------------------- report
def with_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Step time relative to single, single_cast and fsdp2 of the same dtype."""
    df = df.copy()
    col = step_column(df)
    ok = df[df["status"] == "ok"]
    for ref in ("single", "single_cast", "fsdp2"):
        if col not in ok:
            df[f"vs_{ref}"] = math.nan
            continue
        base = ok[ok["variant"] == ref].groupby("dtype")[col].first()
        df[f"vs_{ref}"] = df[col] / df["dtype"].map(base)
    return df


def targets(df: pd.DataFrame) -> list[str]:
    """Each per-block FSDP variant in bf16: step (median) <= 1.10x single's and peak memory <= fsdp2's, same run
    (rows of one `run_id`; a dtype's rows from several runs are not compared). GPU targets: rows measured on the
    CPU show their ratios without a verdict."""
    df = with_ratios(df)
    col, cpu = step_column(df), on_cpu(df)
    verdict = lambda met, rule: f"({NOT_ON_CPU if cpu else 'met' if met else 'missed'}: {rule})"  # noqa: E731
    ok = df[(df["status"] == "ok") & (df["dtype"] == "bf16")]
    theirs = ok[ok["variant"] == "fsdp2"]
    lines = []
    if "run_id" in ok and ok["run_id"].nunique() > 1:
        return [f"- bf16 rows come from {ok['run_id'].nunique()} runs ({', '.join(map(str, ok['run_id'].unique()))}): "
                "not measured in one run, no target is checked"]
    if "graphs_compiled_timed" in ok and (ok["graphs_compiled_timed"].fillna(0) > 0).any():
        return ["- bf16 rows compiled graphs during their timed steps (a recompilation was timed): no target is "
                "checked"]
    for variant in OURS:
        ours = ok[ok["variant"] == variant]
        if ours.empty:
            continue
        row = ours.iloc[0]
        paired = pd.notna(row.get("paired_ratio", math.nan))
        ratio = row["paired_ratio"] if paired else row.get("vs_single")
        if pd.notna(ratio):
            theirs_ratio = (theirs.iloc[0].get("paired_ratio", math.nan) if paired else theirs.iloc[0]["vs_single"]
                            ) if not theirs.empty else math.nan
            lines.append(f"- bf16 `{variant}` step: {1e3 * row[col]:.1f} ms = {ratio:.3f}x single "
                         f"{verdict(ratio <= TARGET_VS_SINGLE, f'<= {TARGET_VS_SINGLE:.2f}x')}"
                         + (f"; fsdp2 {theirs_ratio:.3f}x" if pd.notna(theirs_ratio) else "")
                         + (f" ({paired_summary(row)})" if paired else ""))
        if not theirs.empty and pd.notna(row["peak_memory_max_rank_bytes"]):
            mine = row["peak_memory_max_rank_bytes"] / 2**30
            ref = theirs.iloc[0]["peak_memory_max_rank_bytes"] / 2**30
            lines.append(f"- bf16 `{variant}` peak memory: {mine:.2f} GiB vs fsdp2 {ref:.2f} GiB "
                         f"{verdict(mine <= ref, '<= fsdp2')}")
    return lines


def _unit(ok: pd.DataFrame) -> tuple[str, int]:
    """GiB, or MiB for models with less than 1 GiB of state (the CPU fallback)."""
    return ("GiB", 2**30) if ok["state_bytes"].max() >= 2**30 else ("MiB", 2**20)


def memory_savings(df: pd.DataFrame) -> pd.DataFrame:
    """Per dtype: what ddp_sharded, fsdp and fsdp2 save against ddp and ddp_sharded, expected from the sharding and
    measured (counted state, allocator peak)."""
    ok = df[df["status"] == "ok"]
    unit, scale = _unit(ok)
    pairs = [("ddp_sharded", "ddp"), ("fsdp", "ddp"), ("fsdp", "ddp_sharded"), ("fsdp_hp", "ddp"), ("fsdp@8", "ddp"),
             ("fsdp_layer", "ddp"),
             ("fsdp2", "ddp"), ("fsdp2", "ddp_sharded")]
    rows = []
    for dtype, part in ok.groupby("dtype", sort=False):
        by = part.set_index("variant")
        for variant, ref in pairs:
            if variant in by.index and ref in by.index:
                a, b = by.loc[ref], by.loc[variant]
                rows.append({"dtype": dtype, "variant": variant, "against": ref,
                             f"expected ({unit})": (a["expected_state_bytes"] - b["expected_state_bytes"]) / scale,
                             f"counted ({unit})": (a["state_bytes"] - b["state_bytes"]) / scale,
                             f"peak ({unit})": (a["peak_memory_max_rank_bytes"] - b["peak_memory_max_rank_bytes"])
                             / scale})
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    df = with_ratios(df)
    paired = "paired_ratio" in df and df["paired_ratio"].notna().any()

    def intro(first: pd.Series) -> str:
        return (f"{setup_sentence(first)}, AdamW; {int(first['warmup'])} warm-up + {int(first['steps'])} timed steps; "
                "`step`: median (mean ± std), ratios use the median. "
                "`state`: params + grads + optimizer state per rank, counted (expected). `AG exposed`: all-gather "
                "kernel time with no compute kernel running; `stalled AG`: all-gathers with > 5 us of it. "
                "`host/step`: time the host took to issue a step over the step (near 1: the host never got far ahead "
                "of the GPU, either because it is the bottleneck or because it waited on the device)."
                + (" `paired vs single`: median over rounds of the variant's step / a single step timed in "
                   "alternating blocks in the same process (`--paired-rounds`); the targets use it." if paired else ""))

    def body(ok: pd.DataFrame) -> list[str]:
        nan = pd.Series(math.nan, index=ok.index)
        unit, scale = _unit(ok)
        ms = 1e3  # columns are seconds; the table shows milliseconds
        view = pd.DataFrame({
            "dtype": ok["dtype"], "variant": ok["variant"],
            "step (ms)": [f"{ms * med:.1f} ({ms * m:.1f} ± {ms * s:.1f})" for med, m, s in
                          zip(ok[step_column(ok)], ok["step_mean_s"], ok["step_std_s"])],
            "vs single": ok["vs_single"], "vs single_cast": ok["vs_single_cast"], "vs fsdp2": ok["vs_fsdp2"],
            **({"paired vs single": ok["paired_ratio"]} if ok.get("paired_ratio", nan).notna().any() else {}),
            "peak (GiB)": ok["peak_memory_max_rank_bytes"] / 2**30,
            f"state ({unit})": [f"{s / scale:.3g} ({e / scale:.3g})" for s, e in zip(ok["state_bytes"],
                                                                                     ok["expected_state_bytes"])],
            "AG (ms)": ms * ok.get("allgather_s", nan), "AG exposed (ms)": ms * ok.get("allgather_exposed_s", nan),
            "stalled AG": ok.get("stalled_allgathers", nan),
            "RS exposed (ms)": ms * ok.get("reducescatter_exposed_s", nan),
            "gather wait (ms)": ms * ok.get("gather_wait_s", nan),
            "host/step": ok.get("host_step_median_s", nan) / ok[step_column(ok)]})
        savings, lines = memory_savings(df), targets(df)
        return [view.to_markdown(index=False, floatfmt=".3g"),
                "Memory saved per rank (expected from the sharding; counted tensors; allocator peak):\n\n"
                + savings.to_markdown(index=False, floatfmt=".3g") if not savings.empty else "",
                "Targets (same run):\n\n" + "\n".join(lines) if lines else ""]

    return markdown_report(df, ["dtype", "variant"], intro, body)


def write_report(df: pd.DataFrame, out: Path, sweep: str = SWEEP) -> Path:
    title = "Fully sharded data parallel, compiled blocks" if sweep == COMPILED else "Fully sharded data parallel"
    return write_markdown(out, sweep, title, markdown(df))


# ---------------------------------------------------------------------------------------------------- main
def build_parser():
    p = study_parser(__doc__, SWEEP, gang=True, timeout_s=600.0,
                     device_help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the cluster has GPUs")
    add_model_flags(p, DEFAULTS)
    list_flag(p, "--dtypes", default="fp32,bf16", aliases=("--dtype",),
              help=f"comma list of {', '.join(GANG_DTYPES)} (bf16: the compute dtype)")
    list_flag(p, "--variants", default=None, help=f"comma list of {','.join(VARIANTS)} (default: all on cuda; on "
                                                  f"cpu all but {','.join(OWN_GROUP)}, which need NCCL)")
    list_flag(p, "--profile", default="fsdp,fsdp2", help="variants to profile for all-gather overlap ('' for none)")
    add_variant_flags(p, COMPILED, " (not fsdp_layer)")
    return p


def _variants(text: str | None, device: str, defaults: dict, compiled: bool = False) -> list[str]:
    variants = parse_list(text, "variants", VARIANTS) if text is not None else list(defaults["variants"])
    if compiled and text is None:
        variants.remove("fsdp_layer")  # per-Linear units cannot wrap compiled blocks (see FSDPTrial)
    return variants


def grid(args, device: str, world_size: int, check_device: bool = True) -> list[FSDPTrial]:
    """The trials the flags ask for on `device` (its defaults fill the flags left out); every value checked, and
    with `check_device` what `device` cannot run."""
    out = trials(**grid_values(args, DEFAULTS, device), **check_variant_flags(args, world_size),
                 dtypes=parse_list(args.dtypes, "dtypes", GANG_DTYPES),
                 variants=_variants(args.variants, device, DEFAULTS[device], args.compile),
                 profile=[v.strip() for v in (args.profile or "").split(",") if v.strip()])
    if check_device:
        capped = [t.variant for t in out if t.variant in OWN_GROUP]
        if capped and device != "cuda":
            raise ValueError(f"variants {sorted(set(capped))}: their NCCL group options apply on GPUs; this run "
                             f"uses {device} (gloo)")
        check_fits(out[0].model_config(), out[0].batch_per_rank, world_size, device)
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    sweep = COMPILED if args.compile else SWEEP
    return gang_study_main(args, sweep, grid, lambda out: functools.partial(fsdp_trial, out_dir=str(out)),
                           reduce_ranks, lambda df, out: [write_report(df, out, sweep)])


if __name__ == "__main__":
    sys.exit(main_entry(main))
