"""Data-parallel training on a gang of ranks (handout 5.2-5.3 and 6): every DDP variant of `parallel/ddp.py`
against torch's DDP and a step with no communication, in one run; then optimizer-state sharding.

Study `ddp` (one row per dtype x variant, `ddp.parquet`): the default on GPUs is the xl model, context 512,
2 ranks, fp32 and bf16 autocast (fp32 master weights), AdamW (torch's, fused on CUDA) for

    single        each rank trains its own replica, no communication at all (the reference step); run
                  first and again last in each dtype (`single (rerun)`): the two bound the drift of the run
    naive, flat   gradients all-reduced after backward (per parameter / one flattened tensor)
    overlapped    an async all-reduce per parameter, issued from backward hooks
    bucketed:MB   async all-reduce per bucket of MB MiB (1, 10, 100, 1000); grads are views of the buckets
    bucketed_copy:MB   the same with copy-in / copy-out bucket buffers instead of views
    torch         torch.nn.parallel.DistributedDataParallel (its defaults: 25 MiB buckets, gradients copied into
                  them; `broadcast_buffers=False` since the model's only buffers are constant RoPE tables)

Batch: every rank runs the same per-rank batch (`--batch-per-rank`, default 2: the handout's global batch of 4 on 2
GPUs), including `single`, so each row is a step of the same per-GPU work with and without communication; the
difference is what data parallelism costs. At 2 sequences per rank the bf16 xl step is bound by the host's launch
rate (the `host/step` column of the run-health table), so its bf16 rows move with the host's speed from trial to
trial; `--batch-per-rank 4` (sweeps/fsdp.py's setting) gives the GPU more work per launch. Timing
(`raysys.train_step.time_steps`): `--warmup` untimed steps, then `--steps` to `--max-steps` steps (more while the
median is uncertain) with a device synchronisation around each, with Python's garbage collector paused; rows carry
mean, std, median and min, and ratios and targets use the median. Inside a step CUDA events split the time into
forward, backward, `comm_wait` (from the end of backward's kernels to the end of
`finish_gradient_synchronization()`: the communication left exposed after backward; all of it for naive and flat;
torch DDP waits inside backward, so its wait is part of its backward) and the optimizer step; `host_<phase>_ms` is
the time the Python thread took to issue each phase (close to the device time: that phase is host-bound). Per-rank
spread: the median step of the fastest and slowest rank. Memory hygiene: `memory_allocated_before_bytes` /
`_after_bytes` (and `live_parameters_*`) at the start of the trial and after it released everything; after > before
means the trial leaked into the next one.

`--nccl-max-ctas N` (CUDA only, default: NCCL's choice) runs every communicating variant on a process group
whose NCCL communicator uses at most N CTAs (SMs) per collective: fewer SMs taken from backward's kernels
while the all-reduces overlap them, at the price of slower collectives; a variant suffix `@N`
(`overlapped@8`) caps that variant alone, so capped and uncapped variants are compared in one run. `@N+carve`
(overlapped and bucketed) also carves N SMs out of cuBLAS's matmuls while the all-reduces run
(parallel/carveout.py), so that a GEMM need not spill into a second wave beside the collective's N CTAs.

`--compile` (ddp study) compiles every TransformerBlock's forward with torch.compile before any wrapper is applied
(`raysys.train_step.compile_blocks`), in every variant, `single` and torch DDP included, and writes
`ddp_compiled.parquet` / `.md` / `.png`: its own baselines, never mixed with eager rows. Eager, the bf16 xl step at two
sequences per rank is bound by the host's launch rate, so every variant's extra host work (hooks, collective
calls) and any CPU contention between the rank processes adds to the step; compiled, the host issues a few fused
kernels per block and the GPU sets the pace, as in a production training loop. Rows count the graphs compiled in
warm-up and during the timed steps (`graphs_compiled_timed` must be 0).

`--paired-rounds N` (ddp study): after its timed steps, each trial builds a `single` model beside its variant (same
blocks, batch and optimizer) and times the two in alternating blocks of steps, N rounds in ABBA order
(`raysys.train_step.paired_steps`); `paired vs single` is the median over rounds of the variant's block median over
the single block's. Trials run one after another, tens of seconds apart, and a shared host's speed drifts on that
scale (compare a study's two `single` runs): the paired ratio compares steps seconds apart, and the targets use it
when every variant has it. Needs memory for both models.

The variants listed in `--profile` (default naive, overlapped) get two more steps under `torch.profiler`;
from the second one's GPU kernel intervals, `overlap_fraction` = time an NCCL kernel runs while a compute
kernel also runs / total NCCL kernel time. Within a step NCCL kernels can only meet backward kernels (the
optimizer waits for them; the next step starts after a synchronisation), so this is the share of gradient
communication hidden behind backward. `profile_status` says whether that could be measured (`ok`, `cpu`: no
GPU, or what the profile lacked); rank 0's Chrome trace goes to `<out>/traces/ddp_<variant>_<dtype>.json.gz`
(gzipped; Perfetto and chrome://tracing open it as is).

Study `sharded` (`sharded_optimizer.parquet`, dtypes `--sharded-dtypes`, default fp32): memory at init,
before and after the optimizer step, and time per step, with and without `ShardedOptimizer`; see
`sweeps/sharded_optimizer.py`.

Outputs in `--out`: the Parquet files, `ddp.md` and `sharded_optimizer.md` (tables for BENCHMARKS.md),
`ddp.png` and `sharded_optimizer.png`, the traces. Without GPUs the same run uses gloo ranks on the CPU, the
`tiny` model at context 64 and fp32 only (CPU bf16 autocast is emulated and says nothing about GPUs): about
a minute.

    python sweeps/ddp.py                                             # embedded Ray; CPU/gloo without a GPU
    ray job submit --working-dir . -- python sweeps/ddp.py --out "$PWD/results"
    python sweeps/ddp.py --variants single,overlapped,bucketed:100,torch --dtypes bf16 --studies ddp
    python sweeps/ddp.py --variants single,overlapped,bucketed:100,torch --nccl-max-ctas 8 --studies ddp
    python sweeps/ddp.py --variants single,overlapped,overlapped@8,bucketed:100@8,torch --studies ddp
    python sweeps/ddp.py --compile --dtypes bf16 --variants single,overlapped,bucketed:100,torch
    python sweeps/ddp.py --studies ddp --dtypes bf16 --paired-rounds 6 --variants single,overlapped,bucketed:100,torch
    python sweeps/ddp.py --report-only --out results                 # redraw tables and plots
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from parallel.ddp import make_ddp  # noqa: E402
from raysys.config import SIZES, ModelConfig  # noqa: E402
from raysys.device import DTYPES  # noqa: E402
from raysys.model import TransformerLM  # noqa: E402
from raysys.profiling import cpu_op_time, kernel_intervals, overlap, profile_steps  # noqa: E402
from raysys.train_step import (TrainStep, TrialScope, compile_blocks, nccl_group, paired_steps,  # noqa: E402
                               release, time_steps)

SWEEP = "ddp"
COMPILED = "ddp_compiled"   # the same study with compiled blocks (--compile): its own file, tables and baselines
STUDIES = ("ddp", "sharded")
DEFAULT_VARIANTS = ("single,naive,flat,overlapped,bucketed:1,bucketed:10,bucketed:100,bucketed:1000,bucketed_copy:100,"
                    "torch")
# bf16 autocast on the CPU is emulated (slow, and says nothing about GPUs): the CPU run is fp32 only.
DEFAULTS = {"cuda": dict(size="xl", context_length=512, dtypes="fp32,bf16", batch_per_rank=2),
            "cpu": dict(size="tiny", context_length=64, dtypes="fp32", batch_per_rank=2)}
RERUN = "single (rerun)"


# ---------------------------------------------------------------------------------------------------- grid
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
    kinds = ("single", "naive", "flat", "overlapped", "bucketed", "bucketed_copy", "torch")
    if name not in kinds:
        raise ValueError(f"variant {spec!r}: {name!r} is not one of {kinds}")
    if size and name not in ("bucketed", "bucketed_copy", "torch"):
        raise ValueError(f"variant {spec!r}: only bucketed, bucketed_copy and torch take a bucket size")
    try:
        mb = float(size) if size else 25.0
    except ValueError:
        raise ValueError(f"variant {spec!r}: bucket size {size!r} is not a number of MiB") from None
    if not math.isfinite(mb) or mb <= 0:
        raise ValueError(f"variant {spec!r}: bucket size must be a positive number of MiB")
    if name in ("single", "naive", "flat", "overlapped"):
        return {"variant": name, "bucket_size_mb": None, "bucket_view": None, "label": name}
    if name == "torch":
        return {"variant": "torch", "bucket_size_mb": mb, "bucket_view": None, "label": f"torch DDP {mb:g}MB"}
    view = name == "bucketed"
    return {"variant": "bucketed", "bucket_size_mb": mb, "bucket_view": view,
            "label": f"bucketed {mb:g}MB" + ("" if view else " (copy)")}


def parse_list(text: str, what: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    if allowed is not None and (bad := [t for t in items if t not in allowed]):
        raise ValueError(f"--{what}: {bad} not in {allowed}")
    return items


def ddp_trials(*, size: str, context_length: int, batch_per_rank: int, dtypes: list[str], variants: list[str],
               profile: list[str], warmup: int, steps: int, max_steps: int | None = None,
               nccl_max_ctas: int | None = None, rerun_single: bool = True, compile: bool = False,
               paired_rounds: int = 0, seed: int = 0) -> list[dict]:
    """One config per dtype x variant, plus `single (rerun)` last in each dtype when `single` is in the grid
    with other variants and `rerun_single` (validated here, before any rank starts)."""
    model_config(size, context_length)
    max_steps = steps if max_steps is None else max_steps
    if batch_per_rank < 1 or warmup < 0 or steps < 2 or max_steps < steps:
        raise ValueError(f"batch_per_rank ({batch_per_rank}) must be >= 1, warmup ({warmup}) >= 0, "
                         f"steps ({steps}) >= 2, max_steps ({max_steps}) >= steps")
    check_timing_options(warmup, compile, paired_rounds)
    if nccl_max_ctas is not None and (not isinstance(nccl_max_ctas, int) or nccl_max_ctas < 1):
        raise ValueError(f"nccl_max_ctas ({nccl_max_ctas!r}) must be an int >= 1 (or None for NCCL's choice)")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"dtypes {bad} not in {tuple(DTYPES)}")
    parsed = [parse_variant(v) for v in variants]
    labels = [v["label"] for v in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variants {variants} name the same variant twice")
    profiled = {parse_variant(v)["label"] for v in profile}
    if rerun_single and "single" in labels and len(labels) > 1:
        parsed.append({**parse_variant("single"), "label": RERUN})
    common = {"warmup": warmup, "steps": steps, "max_steps": max_steps, "compile": compile,
              "paired_rounds": paired_rounds, "seed": seed}
    return [{"size": size, "context_length": context_length, "batch_per_rank": batch_per_rank, "dtype": dtype,
             "nccl_max_ctas": nccl_max_ctas, **v, "profile": v["label"] in profiled, **common}
            for dtype in dtypes for v in parsed]


def check_timing_options(warmup: int, compile: bool, paired_rounds: int) -> None:
    """--compile and --paired-rounds, as the DDP and FSDP sweeps take them."""
    if not isinstance(paired_rounds, int) or paired_rounds < 0:
        raise ValueError(f"paired_rounds ({paired_rounds!r}) must be an int >= 0 (0: no paired timing)")
    if compile and warmup < 1:
        raise ValueError(f"warmup ({warmup}) must be >= 1 with compiled blocks: the first step compiles them")


def model_config(size: str, context_length: int) -> ModelConfig:
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {sorted(SIZES)}")
    return ModelConfig.from_name(size, context_length=context_length)


# ---------------------------------------------------------------------------------------------------- one step
def make_batch(mc: ModelConfig, batch: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, mc.vocab_size, (batch, mc.context_length + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def adamw_kwargs(device: torch.device) -> dict:
    """Hyper-parameters of the optimizer every trial uses: torch AdamW, fused on CUDA (few kernels per step)."""
    return dict(lr=1e-4, weight_decay=0.01, **({"fused": True} if device.type == "cuda" else {}))


def profile_overlap(step: TrainStep, trace_path: Path | None, expect_nccl: bool) -> dict[str, float | str]:
    """Profile one step (after one profiler warm-up step): NCCL kernel time and the share overlapped with compute.

    `profile_status` is `ok` when the numbers are measured; otherwise they are NaN and the status says why
    (`cpu`: no GPU kernels to measure; anything else is a broken profile and also raises a warning)."""
    prof = profile_steps(step, step.device, trace_path=trace_path)
    status = prof.status(expect_nccl)
    comm, compute = kernel_intervals(prof.events)
    total_us, shared_us = overlap(comm, compute)
    allreduce_calls, allreduce_us = cpu_op_time(prof.events, "c10d::allreduce_")
    out: dict[str, float | str] = {
        "profile_status": status, "profiled_cpu_ops": prof.num_cpu_ops, "profiled_kernels": prof.num_kernels,
        "profiled_nccl_kernels": len(comm),
        "nccl_kernel_ms": total_us / 1e3 if comm else math.nan,
        "overlap_fraction": shared_us / total_us if total_us > 0 else math.nan,
        # Host cost of issuing the collectives, and of accumulating gradients with their hooks.
        "host_allreduce_calls": allreduce_calls, "host_allreduce_ms": allreduce_us / 1e3,
        "host_accumulate_grad_ms": cpu_op_time(prof.events, "torch::autograd::AccumulateGrad")[1] / 1e3}
    if status not in ("ok", "cpu"):
        warnings.warn(f"profile of a {step.device.type} step is unusable: {status} ({prof.num_cpu_ops} CPU events, "
                      f"{prof.num_kernels} GPU kernels, {len(comm)} NCCL kernels)", stacklevel=2)
    if prof.trace_path is not None:
        out["trace_path"] = str(prof.trace_path)
    return out


# ---------------------------------------------------------------------------------------------------- trial
def wrap(config: dict, model: nn.Module, process_group) -> nn.Module:
    variant = config["variant"]
    if variant == "single":
        return model
    carve = {"sm_carveout": config["sm_carveout"]} if config.get("sm_carveout") is not None else {}
    if variant == "bucketed":
        return make_ddp("bucketed", model, bucket_size_mb=config["bucket_size_mb"],
                        grad_as_bucket_view=config["bucket_view"], process_group=process_group, **carve)
    if variant == "torch":
        # The model's only buffers are constant RoPE tables: like ours, don't re-broadcast them every forward.
        return make_ddp("torch", model, bucket_size_mb=config["bucket_size_mb"], process_group=process_group,
                        broadcast_buffers=False)
    return make_ddp(variant, model, process_group=process_group, **carve)


def comm_group(ctx, config: dict):
    """The group the gradients are reduced over: the gang's, or (`nccl_max_ctas`) a new NCCL group of the same
    ranks whose communicator is capped at that many CTAs per collective. Every rank must call this."""
    ctas = config.get("nccl_max_ctas")
    if ctas is None or config["variant"] == "single":
        return ctx.process_group
    return nccl_group(ctx.world_size, ctas)


def ddp_trial(ctx, config: dict, out_dir: str | None = None) -> dict:
    """On every rank: build, wrap and time the model of `config`; profile it if `config['profile']`. Memory
    and live parameters are recorded before and after (see `raysys.train_step.TrialScope`)."""
    with TrialScope(ctx.device) as scope:
        metrics = _ddp_trial(ctx, config, out_dir)
    return {**metrics, **scope.metrics}


def _ddp_trial(ctx, config: dict, out_dir: str | None) -> dict:
    device = ctx.device
    mc = model_config(config["size"], config["context_length"])
    group = comm_group(ctx, config)
    model = wrap(config, unwrapped_model(ctx, config, mc), group)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))
        batch = make_batch(mc, config["batch_per_rank"], device, seed=config["seed"] + 1000 * (ctx.rank + 1))
        step = TrainStep(model, optimizer, batch, config["dtype"], device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        metrics = time_steps(step, config["warmup"], config["steps"], max_steps=config["max_steps"],
                             process_group=ctx.process_group)
        params = [p for p in model.parameters() if p.requires_grad]
        metrics["grad_mib"] = sum(p.numel() * p.element_size() for p in params) / 2**20
        metrics["collectives_per_step"] = getattr(model, "num_collectives", math.nan)
        cuda = device.type == "cuda"
        metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else math.nan
        if config.get("paired_rounds") and config["variant"] != "single":
            metrics.update(_paired_with_single(ctx, config, mc, step))
        if config["profile"]:
            trace = None
            if out_dir is not None and ctx.rank == 0:
                stem = re.sub(r"[^A-Za-z0-9.-]+", "_", f"ddp_{config['label']}_{config['dtype']}")
                trace = Path(out_dir) / "traces" / f"{stem}.json.gz"
            metrics.update(profile_overlap(step, trace, expect_nccl=config["variant"] != "single"))
    finally:
        release(model)
    if group is not ctx.process_group:      # not after a failure: the gang is torn down then anyway
        dist.destroy_process_group(group)
    return metrics


def unwrapped_model(ctx, config: dict, mc: ModelConfig) -> nn.Module:
    """The rank's model before any wrapper, its blocks compiled under `compile` (before wrapping: every variant
    runs the same blocks). Seeded by rank: replicas differ until a wrapper broadcasts rank 0's."""
    torch.manual_seed(config["seed"] + ctx.rank)
    model = TransformerLM(mc, device=ctx.device)
    if config.get("compile"):
        compile_blocks(model)
    return model


def _paired_with_single(ctx, config: dict, mc: ModelConfig, step: TrainStep) -> dict:
    """The variant's step against a `single` step built here (same blocks, batch and optimizer, no wrapper),
    interleaved (`raysys.train_step.paired_steps`); after the variant's peak memory was read, so the reference's
    memory does not count."""
    reference = unwrapped_model(ctx, config, mc)
    optimizer = torch.optim.AdamW(reference.parameters(), **adamw_kwargs(ctx.device))
    ref_step = TrainStep(reference, optimizer, step.batch, config["dtype"], ctx.device)
    return paired_steps(step, ref_step, config["paired_rounds"])


def reduce_ranks(config: dict, per_rank: list[dict]) -> dict:
    """Rank 0's metrics, plus the slowest rank's mean step and the spread of the ranks' median steps (DDP ranks
    move in lockstep; `single` ones need not), and the largest leak of any rank."""
    out = dict(per_rank[0])
    out["step_ms_max_rank"] = max(r["step_ms"] for r in per_rank)
    medians = [r["step_ms_median"] for r in per_rank]
    out["step_ms_median_min_rank"], out["step_ms_median_max_rank"] = min(medians), max(medians)
    out["rank_spread"] = max(medians) / min(medians) - 1
    leaks = [r["live_parameters_after"] - r["live_parameters_before"] for r in per_rank]
    out["leaked_parameters_max_rank"] = max(leaks)
    return out


# ---------------------------------------------------------------------------------------------------- report
def step_column(df: pd.DataFrame) -> str:
    """The step statistic ratios and targets use: the median (rows written before it existed: the mean)."""
    return "step_ms_median" if "step_ms_median" in df and df["step_ms_median"].notna().any() else "step_ms"


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df else pd.Series(math.nan, index=df.index)


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
    paired = _column(df, "paired_ratio")
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
    """The fastest of our variants per dtype against the targets (<= 1.02x single, <= 1.0x torch DDP)."""
    col, drift = step_column(df), single_drift(df)
    lines = []
    ours = df[(df["status"] == "ok") & ~df["variant"].isin(["single", "torch"])]
    for dtype, part in ours.groupby("dtype", sort=False):
        paired = "vs_single_paired" in part and part["vs_single_paired"].notna().all()
        suffix = "_paired" if paired else ""
        best = part.loc[part[f"vs_single{suffix}"].idxmin()] if paired else part.loc[part[col].idxmin()]
        checks = []
        for ratio, name, limit in (("vs_single", "single", 1.02), ("vs_torch", "torch DDP", 1.0)):
            value = best.get(ratio + suffix)
            if pd.notna(value):
                checks.append(f"{value:.3f}x {name} ({'met' if value <= limit else 'missed'}: <= {limit:g}x)")
        if paired:
            checks.append(f"paired: median of {int(best['paired_rounds'])} rounds, single-ratio range "
                          f"{best['paired_ratio_min']:.3f}-{best['paired_ratio_max']:.3f}")
        line = f"- {dtype}: fastest variant `{best['label']}` at {best[col]:.1f} ms: " + ", ".join(checks)
        same = df[(df["status"] == "ok") & (df["dtype"] == dtype)]
        if "graphs_compiled_timed" in same and (same["graphs_compiled_timed"].fillna(0) > 0).any():
            line += " (INVALID: graphs were compiled during timed steps of this dtype)"
        if dtype in drift:
            line += f"; `single` drifted {100 * drift[dtype]:.1f}% between its two runs"
        lines.append(line)
    return lines


def health(df: pd.DataFrame) -> pd.DataFrame:
    """Per trial: how trustworthy its numbers are (see the module docstring of raysys.train_step)."""
    gib = 2**30
    leak = _column(df, "memory_allocated_after_bytes") - _column(df, "memory_allocated_before_bytes")
    compiled = {}
    if "compile" in df and df["compile"].fillna(False).astype(bool).any():   # graphs compiled in warm-up / timed
        compiled["graphs"] = [f"{w:g}/{t:g}" for w, t in zip(_column(df, "graphs_compiled_warmup"),
                                                              _column(df, "graphs_compiled_timed"))]
    return pd.DataFrame({
        "dtype": df["dtype"], "variant": df["label"], "steps": _column(df, "timed_steps"),
        "median ±95% (%)": 100 * _column(df, "step_ms_ci_rel"), "rank spread (%)": 100 * _column(df, "rank_spread"),
        "host/step": _column(df, "host_step_ms") / _column(df, "step_ms_median"),
        "alloc retries": _column(df, "allocator_retries_timed"), "cudaMalloc": _column(df, "cuda_mallocs_timed"),
        "ctx sw/step": _column(df, "ctx_switches_per_step"),
        "issue (us/all-reduce)": 1e3 * _column(df, "host_allreduce_ms") / _column(df, "host_allreduce_calls"),
        "mem before (GiB)": _column(df, "memory_allocated_before_bytes") / gib, "leaked (GiB)": leak / gib,
        "leaked params": _column(df, "leaked_parameters_max_rank"),
        "profile": df["profile_status"].fillna("") if "profile_status" in df else "",
        "threads/CPUs": [f"{t:g}/{c:g}" if pd.notna(t) else "" for t, c in zip(_column(df, "torch_threads"),
                                                                                _column(df, "cpu_affinity_count"))],
        **compiled})


def setup_sentence(first: pd.Series) -> str:
    """What a gang sweep's rows ran: model, context, ranks (backend, device), sequences per rank."""
    world = int(first["world_size"])
    flag = first.get("compile", False)
    compiled = ", TransformerBlocks compiled (torch.compile)" if pd.notna(flag) and bool(flag) else ""
    return (f"{first['size']} model, context {int(first['context_length'])}, {world} rank{'s' * (world != 1)} "
            f"({first.get('backend', '')}, {first.get('device_name', '')}), {int(first['batch_per_rank'])} sequences "
            f"per rank{compiled}")


def markdown(df: pd.DataFrame) -> str:
    df = with_ratios(df)
    ok = df[df["status"] == "ok"]
    col = step_column(df)
    parts = []
    if not ok.empty:
        first = ok.iloc[0]
        parts.append(
            f"{setup_sentence(first)}, AdamW; {int(first['warmup'])} warm-up + at least {int(first['steps'])} timed "
            "steps. "
            f"`step`: {'median' if col == 'step_ms_median' else 'mean'} (mean ± std); ratios use it, and `single` is "
            "the mean of its runs. Phases: mean device time; `comm wait`: exposed communication after backward "
            "(torch DDP's is inside its backward); `host bwd`: time Python took to issue backward. `overlap`: "
            "share of NCCL kernel time concurrent with compute kernels (profiled variants only)."
            + (f" `paired vs single`: median over {int(_column(ok, 'paired_rounds').max())} rounds of the variant's "
               "step / a single step timed in alternating blocks in the same process (ABBA); `paired vs torch`: "
               "that ratio over torch DDP's. The targets use these when every variant has them."
               if ok["vs_single_paired"].notna().any() else ""))
        view = pd.DataFrame({
            "dtype": ok["dtype"], "variant": ok["label"], "step (ms)": ok[col],
            "mean ± std": [f"{m:.1f} ± {s:.1f}" for m, s in zip(ok["step_ms"], ok["step_ms_std"])],
            "vs single": ok["vs_single"], "vs torch": ok["vs_torch"],
            **({"paired vs single": ok["vs_single_paired"], "paired vs torch": ok["vs_torch_paired"]}
               if ok["vs_single_paired"].notna().any() else {}),
            "forward": ok["forward_ms"], "backward": ok["backward_ms"], "host bwd": _column(ok, "host_backward_ms"),
            "comm wait": ok["comm_wait_ms"], "optimizer": ok["optimizer_ms"],
            "collectives/step": ok["collectives_per_step"], "overlap": _column(ok, "overlap_fraction"),
            "peak (GiB)": ok["peak_memory_gib"]})
        parts.append(view.to_markdown(index=False, floatfmt=".4g"))
        lines = targets(df)
        if lines:
            parts.append("Targets (same run):\n\n" + "\n".join(lines))
        parts.append("Run health (`leaked`: allocated after the trial released everything minus before it; "
                     "`host/step`: ~1 means host-bound steps; `profile`: whether the overlap was measured):\n\n"
                     + health(ok).to_markdown(index=False, floatfmt=".3g"))
    failed = df[df["status"] != "ok"]
    if not failed.empty:
        error = failed["error"].astype(str).str.split("\n").str[0].str[:120]
        view = failed[["dtype", "label", "status"]].assign(error=error)
        parts.append("Not measured:\n\n" + view.to_markdown(index=False))
    return "\n\n".join(parts) + "\n"


def plot(df: pd.DataFrame, path: Path) -> Path | None:
    """Step time per variant (compute + exposed communication), one panel per dtype."""
    df = with_ratios(df)
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(ok["dtype"]))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 0.45 * ok["label"].nunique() + 1.6),
                             squeeze=False)
    col = step_column(ok)
    for ax, dtype in zip(axes[0], dtypes):
        part = ok[ok["dtype"] == dtype].iloc[::-1]
        wait = part["comm_wait_ms"].fillna(0).clip(lower=0)
        ax.barh(part["label"], part[col] - wait, color="tab:blue", label="step without exposed comm")
        ax.barh(part["label"], wait, left=part[col] - wait, color="tab:orange", label="comm wait after backward")
        single = part.loc[part["variant"] == "single", col]
        if not single.empty:
            ax.axvline(single.mean(), color="k", ls="--", lw=1, label="single (no comm)")
        ax.set_xlabel(f"time per step (ms, {'median' if col == 'step_ms_median' else 'mean'})")
        ax.set_title(f"{dtype}")
        ax.grid(axis="x", alpha=0.3)
    first = ok.iloc[0]
    fig.suptitle(f"DDP variants, {first['size']} ctx {int(first['context_length'])}, {int(first['world_size'])} ranks "
                 f"({first.get('device_name', '')})", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(df: pd.DataFrame, out: Path, sweep: str = SWEEP) -> tuple[Path, Path | None]:
    md_path = out / f"{sweep}.md"
    title = "Data-parallel training, compiled blocks" if sweep == COMPILED else "Data-parallel training"
    md_path.write_text(f"## {title} ({sweep})\n\n{markdown(df)}")
    return md_path, plot(df, out / f"{sweep}.png")


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from raysys.cluster import sweep_parser

    p = sweep_parser(__doc__, SWEEP,
                     device_help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the cluster has GPUs")
    p.add_argument("--studies", default=None, help="comma list of ddp, sharded (default: both; ddp with --compile)")
    p.add_argument("--size", default=None, help="model size (default: xl on cuda, tiny on cpu)")
    p.add_argument("--context-length", type=int, default=None, help="sequence length (default: 512 on cuda, 64 on cpu)")
    p.add_argument("--batch-per-rank", type=int, default=None, help="sequences per rank per step (default 2)")
    p.add_argument("--dtypes", default=None, help="ddp study: comma list of fp32, bf16 (autocast) (default: both "
                                                   "on cuda, fp32 on cpu)")
    p.add_argument("--sharded-dtypes", default="fp32", help="sharded study: comma list of fp32, bf16 (default fp32)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list (default: {DEFAULT_VARIANTS})")
    p.add_argument("--profile", default="naive,overlapped", help="variants to profile for the overlap fraction "
                                                                 "(default: naive,overlapped; '' for none)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2; 1: each wrapper with a group of "
                   "one, what its machinery costs the host with no peer)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial, at least (default 10)")
    p.add_argument("--max-steps", type=int, default=None, help="ddp study: timed steps at most, taken while the "
                                                               "median is uncertain (default: 2.5 x --steps)")
    p.add_argument("--no-single-rerun", action="store_true", help="ddp study: do not run `single` again at the end "
                                                                  "of each dtype")
    p.add_argument("--nccl-max-ctas", type=int, default=None, help="ddp study, CUDA: cap every communicating "
                                                                   "variant's NCCL communicator at N CTAs "
                                                                   "(default: NCCL's choice)")
    p.add_argument("--paired-rounds", type=int, default=0, help="ddp study: after its timed steps, time each "
                   "variant against a single step in alternating blocks for N rounds (ratios a drifting host speed "
                   "does not bias; the targets then use them). Default 0: off")
    p.add_argument("--compile", action="store_true", help=f"ddp study: compile every TransformerBlock (torch.compile) "
                   f"in every variant; rows go to {COMPILED}.parquet")
    p.add_argument("--launcher", choices=("ray", "mp"), default="ray", help="ray gang (default) or plain processes")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, a local cluster, else embedded)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-trial and process-group timeout (s)")
    return p


def resolve_device(args) -> str:
    """The device the gang of `--world-size` ranks will use; a ValueError at once if it could never be placed
    (`raysys.cluster.check_gang`: no GPU, or fewer than the ranks), before any rank starts."""
    from raysys.cluster import check_gang, init_ray

    if args.launcher == "ray":
        init_ray(args.address)
    return check_gang(args.world_size, device=args.device, launcher=args.launcher)


def resolve(args) -> tuple[str, dict]:
    """The device the gang will use and the grid defaults for it (validated, before any rank starts)."""
    device = resolve_device(args)
    d = DEFAULTS[device]
    size = args.size or d["size"]
    context = args.context_length or min(d["context_length"], SIZES[size].get("context_length", 10**9))
    return device, dict(size=size, context_length=context, batch_per_rank=args.batch_per_rank or d["batch_per_rank"],
                        dtypes=parse_list(args.dtypes or d["dtypes"], "dtypes", tuple(DTYPES)))


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    from raysys.cluster import resolve_out_dir, run_sweep

    from sweeps import sharded_optimizer

    args = build_parser().parse_args(argv)
    out = resolve_out_dir(args.out)
    studies = parse_list(args.studies or ("ddp" if args.compile else ",".join(STUDIES)), "studies", STUDIES)
    if args.compile and "sharded" in studies:
        raise ValueError("--compile applies to the ddp study; the sharded study measures eager memory (--studies ddp)")
    ddp_sweep = COMPILED if args.compile else SWEEP
    frames: dict[str, pd.DataFrame] = {}
    if args.report_only:
        for study, sweep in (("ddp", ddp_sweep), ("sharded", sharded_optimizer.SWEEP)):
            if study in studies and (out / f"{sweep}.parquet").exists():
                frames[sweep] = pd.read_parquet(out / f"{sweep}.parquet")
        if not frames:
            raise ValueError(f"--report-only: no ddp / sharded_optimizer Parquet files in {out}")
    else:
        if args.world_size < 1:
            raise ValueError(f"--world-size ({args.world_size}) must be >= 1")
        variants = parse_list(args.variants, "variants")
        profile = [v for v in args.profile.split(",") if v.strip()]
        device, grid = resolve(args)
        capped = [v for v in variants if "@" in v]
        if (args.nccl_max_ctas is not None or capped) and device != "cuda":
            what = f"--nccl-max-ctas ({args.nccl_max_ctas})" if args.nccl_max_ctas is not None else f"variants {capped}"
            raise ValueError(f"{what}: a CTA cap applies to NCCL, i.e. --device cuda; this run uses {device} (gloo)")
        common = dict(world_size=args.world_size, out_dir=out, device=device, resume=args.resume,
                      launcher=args.launcher, timeout_s=args.timeout_s, show=False)
        max_steps = args.max_steps if args.max_steps is not None else math.ceil(2.5 * args.steps)
        trials = ddp_trials(variants=variants, profile=profile,
                            warmup=args.warmup, steps=args.steps, max_steps=max_steps,
                            nccl_max_ctas=args.nccl_max_ctas, rerun_single=not args.no_single_rerun,
                            compile=args.compile, paired_rounds=args.paired_rounds, **grid)
        sharded_trials = sharded_optimizer.trials(
            warmup=args.warmup, steps=args.steps,
            **{**grid, "dtypes": parse_list(args.sharded_dtypes, "sharded-dtypes", tuple(DTYPES))})
        if "ddp" in studies:
            frames[ddp_sweep] = run_sweep(ddp_sweep, trials, functools.partial(ddp_trial, out_dir=str(out)),
                                      reduce=reduce_ranks, **common)
        if "sharded" in studies:
            frames[sharded_optimizer.SWEEP] = run_sweep(sharded_optimizer.SWEEP, sharded_trials,
                                                        sharded_optimizer.sharded_trial,
                                                        reduce=sharded_optimizer.reduce_ranks, **common)
    written = []
    if ddp_sweep in frames:
        written += [p for p in write_report(frames[ddp_sweep], out, ddp_sweep) if p is not None]
    if sharded_optimizer.SWEEP in frames:
        written += [p for p in sharded_optimizer.write_report(frames[sharded_optimizer.SWEEP], out) if p is not None]
    for path in written:
        if path.suffix == ".md":
            print(path.read_text())
    print("wrote " + ", ".join(str(p) for p in [*(out / f"{s}.parquet" for s in frames), *written]))
    return frames


if __name__ == "__main__":
    from raysys.cli import run_script

    sys.exit(run_script(main))
