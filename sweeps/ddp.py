"""Data-parallel training on a gang of ranks (handout 5.2-5.3): every DDP variant of `parallel/ddp.py` against
torch's DDP and a step with no communication, in one run; one row per dtype x variant in `<out>/ddp.parquet`.

Variants: `single` (no communication, the reference), `naive`, `flat`, `overlapped`, `overlapped_each`, `bucketed:MB`,
`bucketed_copy:MB`, `torch`; a suffix `@N` caps the variant's NCCL communicator at N CTAs (`@N+carve`: cuBLAS kept
off N SMs too). Without GPUs: gloo ranks on `tiny`, fp32. Timing, flags and columns: docs/studies.md.

    python sweeps/ddp.py --out /tmp/ddp                              # embedded Ray; CPU/gloo without a GPU
    ray job submit --working-dir . -- python sweeps/ddp.py --out "$PWD/results" --overwrite
    python sweeps/ddp.py --variants single,overlapped,overlapped@8,bucketed:100@8,torch --dtypes bf16
    python sweeps/ddp.py --compile --dtypes bf16 --paired-rounds 6 --variants single,overlapped,bucketed:100,torch
    python sweeps/ddp.py --report-only --out results                 # redraw tables and plots
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from parallel.ddp import make_ddp
from raysys.measure.memory import release
from raysys.measure.profiling import cpu_op_time, kernel_intervals, overlap
from raysys.cluster.rank import nccl_group
from raysys.measure.timing import MAX_STEPS, paired_steps, time_steps
from raysys.training.step import TrainStep, build_model
from sweeps.common import (GANG_DTYPES, NOT_ON_CPU, VariantTrial, adamw_kwargs, add_model_flags,
                           add_variant_flags, check_fits, check_int, check_variant_flags, column, gang_study_main,
                           grid_values, in_trial_scope, list_flag, main_entry, markdown_report, on_cpu, paired_summary,
                           parse_list, profile_one_step, pyplot, save_figure, setup_sentence, step_column,
                           study_parser, write_markdown)

SWEEP = "ddp"
COMPILED = "ddp_compiled"   # the same study with compiled blocks (--compile): its own file, tables and baselines
KINDS = ("single", "naive", "flat", "overlapped", "bucketed", "torch")  # a trial's variant (bucketed_copy: no views)
SPECS = ("single", "naive", "flat", "overlapped", "overlapped_each", "bucketed", "bucketed_copy", "torch")  # --variants
DEFAULT_VARIANTS = ("single,naive,flat,overlapped,bucketed:1,bucketed:10,bucketed:100,bucketed:1000,bucketed_copy:100,"
                    "torch")
# bf16 autocast on the CPU is emulated (slow, and says nothing about GPUs): the CPU run is fp32 only.
DEFAULTS = {"cuda": dict(size="xl", context_length=512, dtypes="fp32,bf16", batch_per_rank=2, warmup=3, steps=10),
            "cpu": dict(size="tiny", context_length=64, dtypes="fp32", batch_per_rank=2, warmup=3, steps=10)}
RERUN = "single (rerun)"
TARGET_VS_SINGLE, TARGET_VS_TORCH = 1.02, 1.0


# ---------------------------------------------------------------------------------------------------- grid
@dataclass(frozen=True, kw_only=True)
class DDPTrial(VariantTrial):
    """One DDP variant (single, naive, flat, overlapped, bucketed (bucket_view False: bucketed_copy) or torch)
    in one dtype."""

    VARIANTS = KINDS
    KEY = ("dtype", "label")
    PER_TRIAL = (*VariantTrial.PER_TRIAL, "label", "bucket_size_mb", "bucket_view", "group_compiled", "nccl_max_ctas",
                 "sm_carveout")
    label: str
    """Unique name of the variant in the run (`bucketed 100MB @8 CTAs`, `single (rerun)`)."""
    bucket_size_mb: float | None = None
    """Bucket size of bucketed and torch variants, MiB."""
    bucket_view: bool | None = None
    """Bucketed: gradients are views of the buckets (else copied in and out)."""
    group_compiled: bool | None = None
    """Overlapped: False for one call per parameter also in compiled blocks (`OverlappedDDP(group_compiled=False)`,
    the `overlapped_each` variant); None: the wrapper's default."""
    nccl_max_ctas: int | None = None
    """CTAs per collective of the variant's NCCL communicator (None: NCCL's choice)."""
    sm_carveout: int | None = None
    """SMs kept from cuBLAS while the variant's all-reduces overlap backward."""
    max_steps: int
    """Timed steps at most (more than `steps` while the median is uncertain)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_steps < self.steps:
            raise ValueError(f"max_steps ({self.max_steps}) must be >= steps ({self.steps})")
        if self.group_compiled is not None and (not isinstance(self.group_compiled, bool)
                                                or self.variant != "overlapped"):
            raise ValueError(f"group_compiled ({self.group_compiled!r}) must be None, or a bool for an overlapped "
                             f"variant (not {self.variant})")
        if self.nccl_max_ctas is not None and (not isinstance(self.nccl_max_ctas, int) or self.nccl_max_ctas < 1):
            raise ValueError(f"nccl_max_ctas ({self.nccl_max_ctas!r}) must be an int >= 1 (or None for NCCL's choice)")

    def config(self) -> dict:
        out = super().config()
        if self.sm_carveout is None and " CTAs" not in self.label:
            del out["sm_carveout"]  # rows of variants without a cap of their own never had the column: ids stay
        if self.group_compiled is None:
            del out["group_compiled"]  # likewise: only `overlapped_each` rows have the column
        return out


def parse_variant(spec: str) -> dict:
    """'bucketed:100' -> {'variant': 'bucketed', 'bucket_size_mb': 100.0, 'bucket_view': True, 'label': ...}.
    A suffix `@N` (`overlapped@8`, `torch:25@8`) caps that variant's NCCL communicator at N CTAs
    (`nccl_max_ctas`; CUDA only), so capped and uncapped variants share one run's baselines; `@N+carve` also
    keeps cuBLAS off N SMs while the all-reduces overlap backward (`sm_carveout`)."""
    spec, at, ctas_text = spec.strip().partition("@")
    if at:
        ctas_text, plus, flag = ctas_text.partition("+")
        full = f"{spec}@{ctas_text}{plus}{flag}"
        if not ctas_text.isdigit() or int(ctas_text) < 1:
            raise ValueError(f"variant {full}: the CTA cap after '@' must be an int >= 1")
        if plus and flag != "carve":
            raise ValueError(f"variant {full}: the only suffix after the CTA cap is '+carve'")
        parsed = parse_variant(spec)
        if parsed["variant"] == "single":
            raise ValueError(f"variant {full}: single does not communicate; a CTA cap means nothing")
        if plus and parsed["variant"] not in ("overlapped", "bucketed"):
            raise ValueError(f"variant {full}: '+carve' needs an overlapped or bucketed variant (they issue "
                             f"collectives during backward)")
        ctas = int(ctas_text)
        label = f"{parsed['label']} @{ctas} CTAs" + (" + carve-out" if plus else "")
        return {**parsed, "nccl_max_ctas": ctas, "sm_carveout": ctas if plus else None, "label": label}
    name, _, size = spec.partition(":")
    if name not in SPECS:
        raise ValueError(f"variant {spec!r}: {name!r} is not one of {SPECS}")
    if size and name not in ("bucketed", "bucketed_copy", "torch"):
        raise ValueError(f"variant {spec!r}: only bucketed, bucketed_copy and torch take a bucket size")
    try:
        mb = float(size) if size else 25.0
    except ValueError:
        raise ValueError(f"variant {spec!r}: bucket size {size!r} is not a number of MiB") from None
    if not math.isfinite(mb) or mb <= 0:
        raise ValueError(f"variant {spec!r}: bucket size must be a positive number of MiB")
    base = {"variant": name, "bucket_size_mb": None, "bucket_view": None, "label": name}
    if name == "overlapped_each":
        return {**base, "variant": "overlapped", "group_compiled": False, "label": "overlapped (each)"}
    if name == "torch":
        return {**base, "bucket_size_mb": mb, "label": f"torch DDP {mb:g}MB"}
    if name in ("bucketed", "bucketed_copy"):
        view = name == "bucketed"
        return {**base, "variant": "bucketed", "bucket_size_mb": mb, "bucket_view": view,
                "label": f"bucketed {mb:g}MB" + ("" if view else " (copy)")}
    return base


def ddp_trials(*, dtypes: list[str], variants: list[str], profile: list[str], max_steps: int | None = None,
               nccl_max_ctas: int | None = None, rerun_single: bool = True, **fields) -> list[DDPTrial]:
    """One trial per dtype x variant (`fields`: the other `DDPTrial` fields), plus `single (rerun)` last in each
    dtype when `single` is in the grid with other variants and `rerun_single`; validated before any rank starts."""
    bad = [d for d in dtypes if d not in GANG_DTYPES]
    if bad:
        raise ValueError(f"dtypes {bad} not in {GANG_DTYPES}")
    parsed = [parse_variant(v) for v in variants]
    labels = [v["label"] for v in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variants {variants} name the same variant twice")
    profiled = {parse_variant(v)["label"] for v in profile}
    if rerun_single and "single" in labels and len(labels) > 1:
        parsed.append({**parse_variant("single"), "label": RERUN})
    max_steps = fields["steps"] if max_steps is None else max_steps
    return [DDPTrial(dtype=dtype, **fields, max_steps=max_steps, **{"nccl_max_ctas": nccl_max_ctas, **v},
                     profile=v["label"] in profiled) for dtype in dtypes for v in parsed]


# ---------------------------------------------------------------------------------------------------- trial
def profile_overlap(step: TrainStep, trace_path: Path | None, expect_nccl: bool) -> dict[str, float | str]:
    """Profile one step: NCCL kernel time and the share of it overlapped with compute kernels (NaN on the CPU,
    `profile_status` says why), and the host time of issuing all-reduces and accumulating gradients."""
    prof, out = profile_one_step(step, trace_path, expect_nccl)
    comm, compute = kernel_intervals(prof.events)
    total_us, shared_us = overlap(comm, compute)
    allreduce_calls, allreduce_us = cpu_op_time(prof.events, "c10d::allreduce_")
    return {"profile_status": out.pop("profile_status"), "profiled_cpu_ops": prof.num_cpu_ops,
            "profiled_kernels": prof.num_kernels, "profiled_nccl_kernels": len(comm),
            "nccl_kernel_s": total_us / 1e6 if comm else math.nan,
            "overlap_fraction": shared_us / total_us if total_us > 0 else math.nan,
            "host_allreduce_calls": allreduce_calls, "host_allreduce_s": allreduce_us / 1e6,
            "host_accumulate_grad_s": cpu_op_time(prof.events, "torch::autograd::AccumulateGrad")[1] / 1e6, **out}


def wrap(trial: DDPTrial, model: nn.Module, process_group) -> nn.Module:
    """The variant's wrapper around `model` (none for `single`)."""
    if trial.variant == "single":
        return model
    carve = {"sm_carveout": trial.sm_carveout} if trial.sm_carveout is not None else {}
    alone = {"collectives_alone": True} if trial.collectives_alone else {}
    if trial.variant == "bucketed":
        return make_ddp("bucketed", model, bucket_size_mb=trial.bucket_size_mb, grad_as_bucket_view=trial.bucket_view,
                        process_group=process_group, **carve, **alone)
    if trial.variant == "torch":
        # The model's only buffers are constant RoPE tables: like ours, don't re-broadcast them every forward.
        return make_ddp("torch", model, bucket_size_mb=trial.bucket_size_mb, process_group=process_group,
                        broadcast_buffers=False)
    grouped = {"group_compiled": trial.group_compiled} if trial.group_compiled is not None else {}
    return make_ddp(trial.variant, model, process_group=process_group, **carve, **alone, **grouped)


def unwrapped_model(ctx, trial: DDPTrial) -> nn.Module:
    """The rank's model before any wrapper. Seeded by rank: replicas differ until a wrapper broadcasts rank 0's."""
    return build_model(trial.model_config(), ctx.device, seed=trial.seed + ctx.rank, compile=trial.compile)


def ddp_trial(ctx, trial: DDPTrial, out_dir: str | None = None) -> dict:
    """On every rank: build, wrap and time the model of `trial`; profile it if `trial.profile`; the memory and
    live parameters before and after."""
    return in_trial_scope(_ddp_trial, ctx, DDPTrial.of(trial), out_dir)


def _ddp_trial(ctx, trial: DDPTrial, out_dir: str | None) -> dict:
    device = ctx.device
    # The group gradients are reduced over: the gang's, or (`nccl_max_ctas`) a new NCCL group of the same ranks
    # whose communicator is capped at that many CTAs per collective. Every rank makes it.
    capped = trial.nccl_max_ctas is not None and trial.variant != "single"
    group = nccl_group(ctx.world_size, trial.nccl_max_ctas) if capped else ctx.process_group
    model = wrap(trial, unwrapped_model(ctx, trial), group)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))
        step = TrainStep(model, optimizer, trial.batch(device, ctx.rank), trial.dtype, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        metrics = time_steps(step, trial.warmup, trial.steps, max_steps=trial.max_steps,
                             process_group=ctx.process_group)
        params = [p for p in model.parameters() if p.requires_grad]
        metrics["grad_bytes"] = sum(p.numel() * p.element_size() for p in params)
        metrics["collectives_per_step"] = getattr(model, "num_collectives", math.nan)
        cuda = device.type == "cuda"
        metrics["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else math.nan
        if trial.paired_rounds and trial.variant != "single":
            # Against a single step built here (same blocks, batch and optimizer, no wrapper), after the variant's
            # peak memory was read, so the reference's memory does not count.
            reference = unwrapped_model(ctx, trial)
            ref_optimizer = torch.optim.AdamW(reference.parameters(), **adamw_kwargs(device))
            ref_step = TrainStep(reference, ref_optimizer, step.batch, trial.dtype, device)
            metrics.update(paired_steps(step, ref_step, trial.paired_rounds))
        if trial.profile:
            trace = None
            if out_dir is not None and ctx.rank == 0:
                stem = re.sub(r"[^A-Za-z0-9.-]+", "_", f"ddp_{trial.label}_{trial.dtype}")
                trace = Path(out_dir) / "traces" / f"{stem}.json.gz"
            metrics.update(profile_overlap(step, trace, expect_nccl=trial.variant != "single"))
    finally:
        release(model)
    if group is not ctx.process_group:      # not after a failure: the gang is torn down then anyway
        dist.destroy_process_group(group)
    return metrics


def reduce_ranks(trial: DDPTrial, per_rank: list[dict]) -> dict:
    """Rank 0's metrics, plus the slowest rank's mean step and the spread of the ranks' median steps (DDP ranks
    move in lockstep; `single` ones need not), and the largest leak of any rank."""
    out = dict(per_rank[0])
    out["step_mean_max_rank_s"] = max(r["step_mean_s"] for r in per_rank)
    medians = [r["step_median_s"] for r in per_rank]
    out["step_median_min_rank_s"], out["step_median_max_rank_s"] = min(medians), max(medians)
    out["rank_spread_rel"] = max(medians) / min(medians) - 1
    leaks = [r["live_parameters_after"] - r["live_parameters_before"] for r in per_rank]
    out["leaked_parameters_max_rank"] = max(leaks)
    return out


# ---------------------------------------------------------------------------------------------------- report
def with_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Add step time relative to `single` (the mean of its runs, first and rerun) and to torch DDP, per dtype."""
    df = df.copy()
    col = step_column(df)
    ok = df[df["status"] == "ok"]
    for ref, name, agg in (("single", "vs_single", "mean"), ("torch", "vs_torch", "first")):
        if col not in ok:  # no trial finished (all skipped, OOM, ...): nothing to compare
            df[name] = math.nan
            continue
        base = ok[ok["variant"] == ref].groupby("dtype")[col].agg(agg)
        df[name] = df[col] / df["dtype"].map(base)
    # Paired timing (--paired-rounds): each row against the single step it was interleaved with; torch DDP's
    # paired ratio turns it into a ratio to torch.
    paired = column(df, "paired_ratio")
    torch_paired = paired[(df["status"] == "ok") & (df["variant"] == "torch")].groupby(df["dtype"]).first()
    df["vs_single_paired"] = paired
    df["vs_torch_paired"] = paired / df["dtype"].map(torch_paired)
    return df


def single_drift(df: pd.DataFrame) -> dict[str, float]:
    """Per dtype, (slowest - fastest) / fastest over the runs of `single`: how much the same work drifted."""
    col = step_column(df)
    ok = df[(df["status"] == "ok") & (df["variant"] == "single")]
    return {dtype: part[col].max() / part[col].min() - 1 for dtype, part in ok.groupby("dtype", sort=False)
            if len(part) > 1}


def targets(df: pd.DataFrame) -> list[str]:
    """The fastest of our variants per dtype against the targets (<= 1.02x single, <= 1.0x torch DDP); GPU
    targets, so rows measured on the CPU show their ratios without a verdict."""
    col, drift, cpu = step_column(df), single_drift(df), on_cpu(df)
    lines = []
    ours = df[(df["status"] == "ok") & ~df["variant"].isin(["single", "torch"])]
    for dtype, part in ours.groupby("dtype", sort=False):
        paired = "vs_single_paired" in part and part["vs_single_paired"].notna().all()
        suffix = "_paired" if paired else ""
        best = part.loc[part[f"vs_single{suffix}"].idxmin()] if paired else part.loc[part[col].idxmin()]
        checks = []
        for ratio, name, limit in (("vs_single", "single", TARGET_VS_SINGLE),
                                   ("vs_torch", "torch DDP", TARGET_VS_TORCH)):
            value = best.get(ratio + suffix)
            if pd.notna(value):
                verdict = f" ({'met' if value <= limit else 'missed'}: <= {limit:g}x)" if not cpu else ""
                checks.append(f"{value:.3f}x {name}{verdict}")
        if paired:
            checks.append(paired_summary(best))
        line = f"- {dtype}: fastest variant `{best['label']}` at {1e3 * best[col]:.1f} ms: " + ", ".join(checks)
        if cpu:
            line += f"; targets <= {TARGET_VS_SINGLE:g}x single and <= {TARGET_VS_TORCH:g}x torch DDP: {NOT_ON_CPU}"
        same = df[(df["status"] == "ok") & (df["dtype"] == dtype)]
        if "graphs_compiled_timed" in same and (same["graphs_compiled_timed"].fillna(0) > 0).any():
            line += " (INVALID: graphs were compiled during timed steps of this dtype)"
        if dtype in drift:
            line += f"; `single` drifted {100 * drift[dtype]:.1f}% between its two runs"
        lines.append(line)
    return lines


def health(df: pd.DataFrame) -> pd.DataFrame:
    """Per trial: how trustworthy its numbers are (see the module docstring of raysys.measure.timing)."""
    gib = 2**30
    leak = column(df, "memory_allocated_after_bytes") - column(df, "memory_allocated_before_bytes")
    compiled = {}
    if "compile" in df and df["compile"].fillna(False).astype(bool).any():   # graphs compiled in warm-up / timed
        compiled["graphs"] = [f"{w:g}/{t:g}" for w, t in zip(column(df, "graphs_compiled_warmup"),
                                                              column(df, "graphs_compiled_timed"))]
    return pd.DataFrame({
        "dtype": df["dtype"], "variant": df["label"], "steps": column(df, "timed_steps"),
        "median ±95% (%)": 100 * column(df, "step_median_ci_rel"),
        "rank spread (%)": 100 * column(df, "rank_spread_rel"),
        "host/step": column(df, "host_step_median_s") / column(df, "step_median_s"),
        "alloc retries": column(df, "allocator_retries_timed"), "cudaMalloc": column(df, "cuda_mallocs_timed"),
        "ctx sw/step": column(df, "ctx_switches_per_step"),
        "issue (us/all-reduce)": 1e6 * column(df, "host_allreduce_s") / column(df, "host_allreduce_calls"),
        "mem before (GiB)": column(df, "memory_allocated_before_bytes") / gib, "leaked (GiB)": leak / gib,
        "leaked params": column(df, "leaked_parameters_max_rank"),
        "profile": df["profile_status"].fillna("") if "profile_status" in df else "",
        "threads/CPUs": [f"{t:g}/{c:g}" if pd.notna(t) else "" for t, c in zip(column(df, "torch_threads"),
                                                                                column(df, "cpu_affinity_count"))],
        **compiled})


def markdown(df: pd.DataFrame) -> str:
    df = with_ratios(df)
    col = step_column(df)
    paired = df["vs_single_paired"].notna().any()

    def intro(first: pd.Series) -> str:
        return (f"{setup_sentence(first)}, AdamW; {int(first['warmup'])} warm-up + at least {int(first['steps'])} "
                "timed steps. "
                f"`step`: {'median' if col == 'step_median_s' else 'mean'} (mean ± std); ratios use it, and `single` "
                "is the mean of its runs. Phases: mean device time; `comm wait`: exposed communication after backward "
                "(torch DDP's is inside its backward); `host bwd`: time Python took to issue backward. `overlap`: "
                "share of NCCL kernel time concurrent with compute kernels (profiled variants only)."
                + (f" `paired vs single`: median over {int(column(df, 'paired_rounds').max())} rounds of the "
                   "variant's step / a single step timed in alternating blocks in the same process (ABBA); `paired "
                   "vs torch`: that ratio over torch DDP's. The targets use these when every variant has them."
                   if paired else ""))

    def body(ok: pd.DataFrame) -> list[str]:
        ms = 1e3  # columns are seconds; the table shows milliseconds
        view = pd.DataFrame({
            "dtype": ok["dtype"], "variant": ok["label"], "step (ms)": ms * ok[col],
            "mean ± std": [f"{ms * m:.1f} ± {ms * s:.1f}" for m, s in zip(ok["step_mean_s"], ok["step_std_s"])],
            "vs single": ok["vs_single"], "vs torch": ok["vs_torch"],
            **({"paired vs single": ok["vs_single_paired"], "paired vs torch": ok["vs_torch_paired"]}
               if paired else {}),
            "forward": ms * ok["forward_mean_s"], "backward": ms * ok["backward_mean_s"],
            "host bwd": ms * column(ok, "host_backward_median_s"), "comm wait": ms * ok["comm_wait_mean_s"],
            "optimizer": ms * ok["optimizer_mean_s"], "collectives/step": ok["collectives_per_step"],
            "overlap": column(ok, "overlap_fraction"), "peak (GiB)": ok["peak_memory_bytes"] / 2**30})
        lines = targets(df)
        return [view.to_markdown(index=False, floatfmt=".4g"),
                "Targets (same run):\n\n" + "\n".join(lines) if lines else "",
                "Run health (`leaked`: allocated after the trial released everything minus before it; "
                "`host/step`: ~1 means host-bound steps; `profile`: whether the overlap was measured):\n\n"
                + health(ok).to_markdown(index=False, floatfmt=".3g")]

    return markdown_report(df, ["dtype", "label"], intro, body)


def plot(df: pd.DataFrame, path: Path) -> Path | None:
    """Step time per variant (compute + exposed communication), one panel per dtype."""
    df = with_ratios(df)
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return None
    plt = pyplot()
    dtypes = list(dict.fromkeys(ok["dtype"]))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 0.45 * ok["label"].nunique() + 1.6),
                             squeeze=False)
    col = step_column(ok)
    for ax, dtype in zip(axes[0], dtypes):
        part = ok[ok["dtype"] == dtype].iloc[::-1]
        wait = 1e3 * part["comm_wait_mean_s"].fillna(0).clip(lower=0)
        step = 1e3 * part[col]
        ax.barh(part["label"], step - wait, color="tab:blue", label="step without exposed comm")
        ax.barh(part["label"], wait, left=step - wait, color="tab:orange", label="comm wait after backward")
        single = 1e3 * part.loc[part["variant"] == "single", col]
        if not single.empty:
            ax.axvline(single.mean(), color="k", ls="--", lw=1, label="single (no comm)")
        ax.set_xlabel(f"time per step (ms, {'median' if col == 'step_median_s' else 'mean'})")
        ax.set_title(f"{dtype}")
        ax.grid(axis="x", alpha=0.3)
    first = ok.iloc[0]
    fig.suptitle(f"DDP variants, {first['size']} ctx {int(first['context_length'])}, {int(first['world_size'])} ranks "
                 f"({first.get('device_name', '')})", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    return save_figure(fig, path, rect=(0, 0.07, 1, 1))


def write_report(df: pd.DataFrame, out: Path, sweep: str = SWEEP) -> tuple[Path, Path | None]:
    title = "Data-parallel training, compiled blocks" if sweep == COMPILED else "Data-parallel training"
    return write_markdown(out, sweep, title, markdown(df)), plot(df, out / f"{sweep}.png")


# ---------------------------------------------------------------------------------------------------- main
def build_parser():
    p = study_parser(__doc__, SWEEP, gang=True, timeout_s=600.0,
                     device_help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the cluster has GPUs")
    add_model_flags(p, DEFAULTS)
    list_flag(p, "--dtypes", default=None, aliases=("--dtype",),
              help=f"comma list of {', '.join(GANG_DTYPES)} (bf16: autocast) (default: fp32,bf16 on cuda, fp32 on cpu)")
    list_flag(p, "--variants", default=DEFAULT_VARIANTS, help="comma list of variants (see above)")
    list_flag(p, "--profile", default="naive,overlapped", help="variants to profile for the overlap fraction "
                                                               "('' for none)")
    p.add_argument("--max-steps", type=int, default=None, help="timed steps at most, taken while the median is "
                                                               "uncertain (default: 2.5 x --steps)")
    p.add_argument("--no-single-rerun", action="store_true", help="do not run `single` again at the end of each "
                                                                  "dtype")
    p.add_argument("--nccl-max-ctas", type=int, default=None, help="CUDA: cap every communicating variant's NCCL "
                                                                   "communicator at N CTAs (default: NCCL's choice)")
    add_variant_flags(p, COMPILED)
    list_flag(p, "--studies", default="ddp", help="ddp (optimizer-state sharding: sweeps/sharded_optimizer.py)")
    return p


def grid(args, device: str, world_size: int, check_device: bool = True) -> list[DDPTrial]:
    """The trials the flags ask for on `device` (its defaults fill the flags left out); every value checked, and
    with `check_device` what `device` cannot run."""
    d = DEFAULTS[device]
    values = grid_values(args, DEFAULTS, device)
    steps = values["steps"]
    max_steps = args.max_steps if args.max_steps is not None else math.ceil(2.5 * steps)
    if max_steps < steps:
        raise ValueError(f"--max-steps ({max_steps}) must be >= --steps ({steps})")
    check_int("--max-steps", max_steps, steps, MAX_STEPS)
    if args.nccl_max_ctas is not None and args.nccl_max_ctas < 1:
        raise ValueError(f"--nccl-max-ctas ({args.nccl_max_ctas}) must be >= 1")
    trials = ddp_trials(**values, **check_variant_flags(args, world_size),
                        dtypes=parse_list(args.dtypes or d["dtypes"], "dtypes", GANG_DTYPES),
                        variants=parse_list(args.variants, "variants"),
                        profile=[v for v in (args.profile or "").split(",") if v.strip()], max_steps=max_steps,
                        nccl_max_ctas=args.nccl_max_ctas, rerun_single=not args.no_single_rerun)
    if not check_device:
        return trials
    capped = [t.label for t in trials if " CTAs" in t.label]
    if (args.nccl_max_ctas is not None or capped) and device != "cuda":
        what = f"--nccl-max-ctas ({args.nccl_max_ctas})" if args.nccl_max_ctas is not None else f"variants {capped}"
        raise ValueError(f"{what}: a CTA cap applies to NCCL, i.e. --device cuda; this run uses {device} (gloo)")
    check_fits(trials[0].model_config(), trials[0].batch_per_rank, world_size, device)
    return trials


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    if parse_list(args.studies, "studies", ("ddp", "sharded")) != ["ddp"]:
        raise ValueError(f"--studies {args.studies}: this script runs the ddp study; optimizer-state sharding is "
                         "sweeps/sharded_optimizer.py")
    sweep = COMPILED if args.compile else SWEEP
    return gang_study_main(args, sweep, grid, lambda out: functools.partial(ddp_trial, out_dir=str(out)),
                           reduce_ranks, lambda df, out: write_report(df, out, sweep))


if __name__ == "__main__":
    sys.exit(main_entry(main))
