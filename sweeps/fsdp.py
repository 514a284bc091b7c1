"""Fully sharded data parallel on a gang of ranks (handout 7, fsdp_accounting): time per step, peak memory and
all-gather overlap of `parallel.fsdp.FSDP` against DDP, DDP + optimizer-state sharding and torch's FSDP2, in one run.

Variants (one row per dtype x variant, `fsdp.parquet`); every rank runs `--batch-per-rank` sequences per step:

    single        each rank trains its own replica, no communication (the reference step; bf16 = autocast, as in
                  sweeps/ddp.py)
    single_cast   the same with FSDP's compute policy (`CastForCompute`: Linear/Embedding weights cast to bf16 per
                  forward): FSDP's arithmetic without sharding or communication
    ddp           BucketedDDP (100 MiB buckets) + AdamW; bf16 = autocast
    ddp_sharded   BucketedDDP + ShardedOptimizer(AdamW) (ZeRO-1 style); bf16 = autocast
    fsdp          parallel.fsdp.FSDP(compute_dtype=bf16 for bf16, units=(TransformerBlock,)) + AdamW over the
                  shards: one all-gather / reduce-scatter per block, as fsdp2
    fsdp_hp       fsdp over an NCCL group whose collectives run on a high-priority stream (their CTAs are scheduled
                  ahead of queued compute CTAs, as FSDP1's gathers; CUDA only)
    fsdp@8        fsdp over an NCCL group capped at 8 CTAs per collective, with cuBLAS kept off 8 SMs from forward to
                  the end of the reductions (`sm_carveout=8`, parallel/carveout.py), so that collectives do not push
                  matmuls into a second wave (CUDA only)
    fsdp_layer    the same with one unit per Linear / Embedding (the handout's per-layer granularity: 7x the
                  collectives, each a seventh of the size)
    fsdp2         torch.distributed.fsdp.fully_shard per TransformerBlock and on the root, with
                  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for bf16

AdamW is torch's (fused on CUDA) everywhere. Timing: `--warmup` untimed steps, then `--steps` steps with a device
synchronisation around each (median, and mean ± std; forward / backward / exposed-communication / optimizer split
by CUDA events, as sweeps/ddp.py); ratios and targets use the median, as sweeps/ddp.py (a host-bound bf16 step
has the odd slow step). Memory (rank 0 and the maximum over ranks): the CUDA allocator's peak over warm-up and
timed steps, and the bytes of parameters, gradients and optimizer state counted tensor by tensor after a step,
against what the sharding predicts (`expected_state`): per rank, fp32 params P_r, grads P_r and AdamW moments
2 P_r, with P_r = P (single, ddp; ddp_sharded's moments ~P/N), Linear/Embedding weights padded to ceil(rows/N)
rows plus replicated norms (fsdp, fsdp_layer), every parameter padded that way (fsdp2).

Overlap (variants in `--profile`, default fsdp and fsdp2): two more steps under torch.profiler; from the second
one's GPU kernels, all-gather and reduce-scatter kernel time and the part of it during which no compute kernel
runs (`*_exposed_ms`: the compute stream waiting for communication), and `stalled_allgathers`, the all-gather
kernels with more than 5 us exposed (an all-gather that finished after its layer needed it). Rank 0's Chrome trace
goes to `<out>/traces/fsdp_<variant>_<dtype>.json`. For `fsdp`, `gather_wait_ms` is the host time spent waiting for
all-gathers per step: the stall itself on gloo, ~0 on NCCL (waits are stream-ordered).

`--compile` compiles every TransformerBlock's forward (torch.compile, `raysys.train_step.compile_blocks`) before any
wrapper is applied, in every variant but fsdp_layer, and writes `fsdp_compiled.parquet` / `.md` (own baselines):
the wrappers' hooks around each block stay eager, and the host no longer sets the pace of the bf16 step.

`--paired-rounds N`: after its timed steps, each variant is timed against a `single` step built beside it, in
alternating blocks of steps for N rounds (ABBA, `raysys.train_step.paired_steps`, as sweeps/ddp.py): a ratio of steps
seconds apart, which a host whose speed drifts between trials does not bias; the targets use it.

Defaults: CUDA - xl, context 512, 4 sequences per rank, 2 ranks, fp32 and bf16 (budget: under 5 minutes on 2
H200). Four sequences, not sweeps/ddp.py's two: by the planner (parallel/planner.py, H200 peak BF16 and NVLink
spec), an xl FFN's weight all-gathers on 2 ranks take 1.07x its matmul time at 2 x 2 x 512 tokens and 0.54x at
2 x 4 x 512, and the fp32 reduce-scatter adds twice the bf16 gather's bytes to the backward. CPU (gloo) - the
tiny model at context 64, 2 sequences per rank (about a minute). Outputs in `--out`: `fsdp.parquet`, `fsdp.md`
(tables and the targets: bf16 fsdp <= 1.10x single, peak <= fsdp2's).

    python sweeps/fsdp.py                                         # embedded Ray; CPU/gloo without a GPU
    ray job submit --working-dir . -- python sweeps/fsdp.py --out "$PWD/results"
    python sweeps/fsdp.py --variants single,fsdp,fsdp2 --dtypes bf16
    python sweeps/fsdp.py --report-only --out results
"""

from __future__ import annotations

import argparse
import functools
import math
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
from parallel.fsdp import FSDP, is_sharded_module  # noqa: E402
from parallel.mixed_precision import CastForCompute  # noqa: E402
from parallel.sharded_optimizer import ShardedOptimizer  # noqa: E402
from raysys.config import SIZES, ModelConfig  # noqa: E402
from raysys.device import DTYPES, low_precision, synchronize  # noqa: E402
from raysys.memory import unique_storage_bytes  # noqa: E402
from raysys.model import TransformerBlock, TransformerLM  # noqa: E402
from raysys.profiling import device_kernels, overlap, profile_steps  # noqa: E402
from raysys.train_step import (TrainStep, TrialScope, compile_blocks, nccl_group, paired_steps,  # noqa: E402
                               release, time_steps)
from sweeps.ddp import (adamw_kwargs, check_timing_options, make_batch, model_config, parse_list,  # noqa: E402
                        resolve_device, setup_sentence, step_column)

SWEEP = "fsdp"
COMPILED = "fsdp_compiled"  # the same study with compiled blocks (--compile): its own file, tables and baselines
VARIANTS = ("single", "single_cast", "ddp", "ddp_sharded", "fsdp", "fsdp_hp", "fsdp@8", "fsdp_layer", "fsdp2")
# Per-block FSDP over a group of its own (NCCL only): variant -> nccl_group options; and the SM carve-outs.
OWN_GROUP = {"fsdp_hp": dict(high_priority=True), "fsdp@8": dict(max_ctas=8)}
SM_CARVEOUT = {"fsdp@8": 8}
OURS = ("fsdp", "fsdp_hp", "fsdp@8")  # per-block FSDP variants, checked against the targets
AUTOCAST_VARIANTS = ("single", "ddp", "ddp_sharded")  # the others cast weights to the compute dtype themselves
DDP_BUCKET_MB = 100.0
STALL_US = 5.0
DEFAULTS = {"cuda": dict(size="xl", context_length=512, batch_per_rank=4, warmup=2, steps=12, variants=VARIANTS),
            "cpu": dict(size="tiny", context_length=64, batch_per_rank=2, warmup=1, steps=3,
                        variants=tuple(v for v in VARIANTS if v not in OWN_GROUP))}


# ---------------------------------------------------------------------------------------------------- grid
def trials(*, size: str, context_length: int, batch_per_rank: int, dtypes: list[str], variants: list[str],
           profile: list[str], warmup: int, steps: int, compile: bool = False, paired_rounds: int = 0,
           seed: int = 0) -> list[dict]:
    """One config per dtype x variant, validated before any rank starts."""
    model_config(size, context_length)
    if batch_per_rank < 1 or warmup < 0 or steps < 2:
        raise ValueError(f"batch_per_rank ({batch_per_rank}) must be >= 1, warmup ({warmup}) >= 0, "
                         f"steps ({steps}) >= 2")
    check_timing_options(warmup, compile, paired_rounds)
    if compile and "fsdp_layer" in variants:
        raise ValueError("variant fsdp_layer: its gather hooks sit on the Linear modules inside each block, which "
                         "--compile traces into the block's graph; compiled blocks need per-block units")
    for what, items, allowed in (("dtypes", dtypes, tuple(DTYPES)), ("variants", variants, VARIANTS),
                                 ("profile", profile, VARIANTS)):
        bad = [x for x in items if x not in allowed]
        if bad:
            raise ValueError(f"{what} {bad} not in {allowed}")
    return [{"size": size, "context_length": context_length, "batch_per_rank": batch_per_rank, "dtype": dtype,
             "variant": variant, "profile": variant in profile, "warmup": warmup, "steps": steps, "compile": compile,
             "paired_rounds": paired_rounds, "seed": seed}
            for dtype in dtypes for variant in variants]


# ---------------------------------------------------------------------------------------------------- build
def build(config: dict, device: torch.device, process_group) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapped model and its optimizer for `config['variant']` (same initial weights on every rank); for a
    OWN_GROUP variant, `process_group` is that variant's own group."""
    variant, compute_dtype = config["variant"], low_precision(config["dtype"])
    torch.manual_seed(config["seed"])
    model = TransformerLM(model_config(config["size"], config["context_length"]), device=device)
    if config.get("compile"):
        compile_blocks(model)  # before wrapping: the wrappers' hooks around each block stay eager
    if variant == "single_cast" and compute_dtype is not None:
        model = CastForCompute(model, compute_dtype)
    elif variant in ("ddp", "ddp_sharded"):
        model = make_ddp("bucketed", model, bucket_size_mb=DDP_BUCKET_MB, process_group=process_group)
    elif variant in ("fsdp", "fsdp_layer") or variant in OWN_GROUP:
        units = None if variant == "fsdp_layer" else (TransformerBlock,)
        model = FSDP(model, compute_dtype=compute_dtype, process_group=process_group, units=units,
                     sm_carveout=SM_CARVEOUT.get(variant))
    elif variant == "fsdp2":
        model = _fully_shard(model, compute_dtype, device, process_group)
    if variant == "ddp_sharded":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=process_group,
                                       **adamw_kwargs(device))
    return model, torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))


def _fully_shard(model: TransformerLM, compute_dtype, device: torch.device, process_group) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(process_group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


# ---------------------------------------------------------------------------------------------------- memory
def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank; each storage counted once."""
    seen: set[int] = set()

    def count(tensors) -> int:
        return unique_storage_bytes(tensors, seen)

    params = list(model.parameters())
    inner = optimizer.local_optimizer if isinstance(optimizer, ShardedOptimizer) else optimizer
    grads = [p.grad for p in params if p.grad is not None] + [b.buffer for b in getattr(model, "buckets", [])
                                                              if getattr(b, "buffer", None) is not None]
    return {"params_bytes": count(params), "grads_bytes": count(grads),
            "optimizer_state_bytes": count(v for s in inner.state.values() for v in s.values()
                                           if torch.is_tensor(v) and v.dim() > 0)}


def expected_state(config: dict, world_size: int) -> dict[str, float]:
    """Predicted per-rank bytes of fp32 params, grads and AdamW moments (see the module docstring)."""
    model = TransformerLM(model_config(config["size"], config["context_length"]), device="meta")
    padded = lambda p: math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0])  # noqa: E731
    sharded = {id(m.weight) for m in model.modules() if is_sharded_module(m)}
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    ours = sum(padded(p) if id(p) in sharded else p.numel() for p in params)
    per_rank = {"single": total, "single_cast": total, "ddp": total, "ddp_sharded": total, "fsdp": ours,
                "fsdp_hp": ours, "fsdp@8": ours, "fsdp_layer": ours,
                "fsdp2": sum(padded(p) for p in params)}[config["variant"]]
    moments = 2 * (total / world_size if config["variant"] == "ddp_sharded" else per_rank)
    return {"expected_params_bytes": 4.0 * per_rank, "expected_grads_bytes": 4.0 * per_rank,
            "expected_optimizer_state_bytes": 4.0 * moments,
            "expected_state_bytes": 4.0 * (2 * per_rank + moments)}


# ---------------------------------------------------------------------------------------------------- overlap
def nccl_kernels(events) -> tuple[dict[str, list], list]:
    """({all_gather|reduce_scatter|all_reduce|other: [(start, end)]}, compute kernel intervals), microseconds."""
    comm: dict[str, list] = {"all_gather": [], "reduce_scatter": [], "all_reduce": [], "other": []}
    compute = []
    for name, start, end in device_kernels(events):
        name = name.lower()
        if "nccl" not in name:
            compute.append((start, end))
        else:
            kind = next((k for k in ("all_gather", "reduce_scatter", "all_reduce") if k.replace("_", "") in name),
                        "other")
            comm[kind].append((start, end))
    return comm, compute


def exposed(interval: tuple[float, float], compute: list[tuple[float, float]]) -> float:
    """Length of `interval` during which no compute interval runs."""
    return (interval[1] - interval[0]) - overlap([interval], compute)[1]


def overlap_metrics(events) -> dict[str, float]:
    comm, compute = nccl_kernels(events)
    out: dict[str, float] = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        key = kind.replace("_", "")
        total, shared = overlap(comm[kind], compute)
        out[f"{key}_kernels"] = len(comm[kind])
        out[f"{key}_ms"] = total / 1e3
        out[f"{key}_exposed_ms"] = (total - shared) / 1e3
    out["stalled_allgathers"] = sum(exposed(iv, compute) > STALL_US for iv in comm["all_gather"])
    return out


def profile_step(step: TrainStep, trace_path: Path | None, expect_nccl: bool = True) -> dict[str, float | str]:
    """Profile one step after one profiler warm-up step; overlap metrics from its GPU kernels (none on the CPU).
    `profile_status` says whether they were measured (`raysys.profiling.StepProfile.status`)."""
    prof = profile_steps(step, step.device, trace_path=trace_path)
    status = prof.status(expect_nccl)
    out: dict[str, float | str] = {"profile_status": status, "profiled_kernels": prof.num_kernels}
    if status == "ok":
        out.update(overlap_metrics(prof.events))
    elif status != "cpu":
        warnings.warn(f"profile of a {step.device.type} step is unusable: {status}", stacklevel=2)
    if prof.trace_path is not None:
        out["trace_path"] = str(prof.trace_path)
    return out


# ---------------------------------------------------------------------------------------------------- trial
def fsdp_trial(ctx, config: dict, out_dir: str | None = None) -> dict:
    """On every rank: build `config['variant']`, time it, count its memory, profile it if asked (plus the memory
    before and after the trial, `raysys.train_step.TrialScope`)."""
    with TrialScope(ctx.device) as scope:
        metrics = _fsdp_trial(ctx, config, out_dir)
    return {**metrics, **scope.metrics}


def _fsdp_trial(ctx, config: dict, out_dir: str | None) -> dict:
    options = OWN_GROUP.get(config["variant"])
    group = nccl_group(ctx.world_size, **options) if options is not None else ctx.process_group
    metrics = _timed_trial(ctx, config, out_dir, group)
    if group is not ctx.process_group:  # not after a failure: the gang is torn down then anyway
        dist.destroy_process_group(group)
    return metrics


def _timed_trial(ctx, config: dict, out_dir: str | None, group) -> dict:
    device = ctx.device
    model, optimizer = build(config, device, group)
    mc = model_config(config["size"], config["context_length"])
    batch = make_batch(mc, config["batch_per_rank"], device, seed=config["seed"] + 1000 * (ctx.rank + 1))
    autocast_dtype = config["dtype"] if config["variant"] in AUTOCAST_VARIANTS else "fp32"
    step = TrainStep(model, optimizer, batch, autocast_dtype, device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    metrics = time_steps(step, config["warmup"], config["steps"])
    metrics["peak_memory_bytes"] = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else math.nan
    metrics.update(state_bytes(model, optimizer))
    metrics["state_bytes"] = metrics["params_bytes"] + metrics["grads_bytes"] + metrics["optimizer_state_bytes"]
    metrics.update(expected_state(config, ctx.world_size))
    if isinstance(model, FSDP):
        model.stats.reset()
        step()
        synchronize(device)
        metrics["gather_wait_ms"] = (model.stats.forward_wait_s + model.stats.backward_wait_s) * 1e3
        metrics["all_gathers_per_step"] = model.stats.all_gathers
        metrics["peak_gathered_bytes"] = model.stats.peak_gathered_bytes
    if config.get("paired_rounds") and config["variant"] != "single":
        single = {**config, "variant": "single"}
        reference, ref_optimizer = build(single, device, group)
        ref_step = TrainStep(reference, ref_optimizer, batch, config["dtype"], device)   # single: autocast
        metrics.update(paired_steps(step, ref_step, config["paired_rounds"]))
        del reference, ref_optimizer, ref_step
    if config["profile"]:
        trace = None
        if out_dir is not None and ctx.rank == 0:
            trace = Path(out_dir) / "traces" / f"fsdp_{config['variant']}_{config['dtype']}.json"
        metrics.update(profile_step(step, trace, expect_nccl=config["variant"] not in ("single", "single_cast")))
    release(model)
    return metrics


def reduce_ranks(config: dict, per_rank: list[dict]) -> dict:
    """Rank 0's metrics, the slowest rank's step and the largest peak memory."""
    out = dict(per_rank[0])
    out["step_ms_max_rank"] = max(r["step_ms"] for r in per_rank)
    out["step_ms_median_max_rank"] = max(r["step_ms_median"] for r in per_rank)
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
    (rows of one `run_id`; a dtype's rows from several runs are not compared)."""
    df = with_ratios(df)
    col = step_column(df)
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
            lines.append(f"- bf16 `{variant}` step: {row[col]:.1f} ms = {ratio:.3f}x single "
                         f"({'met' if ratio <= 1.10 else 'missed'}: <= 1.10x)"
                         + (f"; fsdp2 {theirs_ratio:.3f}x" if pd.notna(theirs_ratio) else "")
                         + (f" (paired: median of {int(row['paired_rounds'])} rounds, range "
                            f"{row['paired_ratio_min']:.3f}-{row['paired_ratio_max']:.3f})" if paired else ""))
        if not theirs.empty and pd.notna(row["peak_memory_max_rank_bytes"]):
            mine = row["peak_memory_max_rank_bytes"] / 2**30
            ref = theirs.iloc[0]["peak_memory_max_rank_bytes"] / 2**30
            lines.append(f"- bf16 `{variant}` peak memory: {mine:.2f} GiB vs fsdp2 {ref:.2f} GiB "
                         f"({'met' if mine <= ref else 'missed'}: <= fsdp2)")
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
    ok = df[df["status"] == "ok"]
    parts = []
    if not ok.empty:
        first = ok.iloc[0]
        parts.append(
            f"{setup_sentence(first)}, AdamW; {int(first['warmup'])} warm-up + {int(first['steps'])} timed steps; "
            "`step`: median (mean ± std), ratios use the median. "
            "`state`: params + grads + optimizer state per rank, counted (expected). `AG exposed`: all-gather kernel "
            "time with no compute kernel running; `stalled AG`: all-gathers with > 5 us of it. `host/step`: time the "
            "host took to issue a step over the step (near 1: the host never got far ahead of the GPU, either "
            "because it is the bottleneck or because it waited on the device)."
            + (" `paired vs single`: median over rounds of the variant's step / a single step timed in alternating "
               "blocks in the same process (`--paired-rounds`); the targets use it." if "paired_ratio" in ok
               and ok["paired_ratio"].notna().any() else ""))
        nan = pd.Series(math.nan, index=ok.index)
        unit, scale = _unit(ok)
        view = pd.DataFrame({
            "dtype": ok["dtype"], "variant": ok["variant"],
            "step (ms)": [f"{med:.1f} ({m:.1f} ± {s:.1f})" for med, m, s in
                          zip(ok[step_column(ok)], ok["step_ms"], ok["step_ms_std"])],
            "vs single": ok["vs_single"], "vs single_cast": ok["vs_single_cast"], "vs fsdp2": ok["vs_fsdp2"],
            **({"paired vs single": ok["paired_ratio"]} if ok.get("paired_ratio", nan).notna().any() else {}),
            "peak (GiB)": ok["peak_memory_max_rank_bytes"] / 2**30,
            f"state ({unit})": [f"{s / scale:.3g} ({e / scale:.3g})" for s, e in zip(ok["state_bytes"],
                                                                                     ok["expected_state_bytes"])],
            "AG (ms)": ok.get("allgather_ms", nan), "AG exposed (ms)": ok.get("allgather_exposed_ms", nan),
            "stalled AG": ok.get("stalled_allgathers", nan), "RS exposed (ms)": ok.get("reducescatter_exposed_ms", nan),
            "gather wait (ms)": ok.get("gather_wait_ms", nan),
            "host/step": ok.get("host_step_ms", nan) / ok[step_column(ok)]})
        parts.append(view.to_markdown(index=False, floatfmt=".3g"))
        savings = memory_savings(df)
        if not savings.empty:
            parts.append("Memory saved per rank (expected from the sharding; counted tensors; allocator peak):\n\n"
                         + savings.to_markdown(index=False, floatfmt=".3g"))
        lines = targets(df)
        if lines:
            parts.append("Targets (same run):\n\n" + "\n".join(lines))
    failed = df[df["status"] != "ok"]
    if not failed.empty:
        view = failed[["dtype", "variant", "status"]].assign(
            error=failed["error"].astype(str).str.split("\n").str[0].str[:120])
        parts.append("Not measured:\n\n" + view.to_markdown(index=False))
    return "\n\n".join(parts) + "\n"


def write_report(df: pd.DataFrame, out: Path, sweep: str = SWEEP) -> Path:
    path = out / f"{sweep}.md"
    title = "Fully sharded data parallel, compiled blocks" if sweep == COMPILED else "Fully sharded data parallel"
    path.write_text(f"## {title} ({sweep})\n\n{markdown(df)}")
    return path


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from raysys.cluster import sweep_parser

    p = sweep_parser(__doc__, SWEEP,
                     device_help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the cluster has GPUs")
    p.add_argument("--size", default=None, help="model size (default: xl on cuda, tiny on cpu)")
    p.add_argument("--context-length", type=int, default=None, help="sequence length (default: 512 on cuda, 64 on cpu)")
    p.add_argument("--batch-per-rank", type=int, default=None, help="sequences per rank per step (default: 4 on "
                                                                    "cuda, 2 on cpu)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16 (default: both)")
    p.add_argument("--variants", default=None, help=f"comma list of {','.join(VARIANTS)} (default: all on cuda; "
                                                    f"on cpu all but {','.join(OWN_GROUP)}, which need NCCL)")
    p.add_argument("--profile", default="fsdp,fsdp2", help="variants to profile for all-gather overlap "
                                                           "(default: fsdp,fsdp2; '' for none)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2; 1: every wrapper with a group of "
                   "one, what its machinery costs the host with no peer)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per trial (default: 2 on cuda, 1 on cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per trial (default: 8 on cuda, 3 on cpu)")
    p.add_argument("--paired-rounds", type=int, default=0, help="after its timed steps, time each variant against "
                   "a single step in alternating blocks for N rounds (raysys.train_step.paired_steps; the targets "
                   "then use these ratios). Default 0: off")
    p.add_argument("--compile", action="store_true", help="compile every TransformerBlock (torch.compile) in every "
                   f"variant (not fsdp_layer); rows go to {COMPILED}.parquet")
    p.add_argument("--launcher", choices=("ray", "mp"), default="ray", help="ray gang (default) or plain processes")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, a local cluster, else embedded)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-trial and process-group timeout (s)")
    return p


def _variants(text: str | None, device: str, defaults: dict, compiled: bool = False) -> list[str]:
    variants = parse_list(text, "variants", VARIANTS) if text is not None else list(defaults["variants"])
    if compiled and text is None:
        variants.remove("fsdp_layer")  # per-Linear units cannot wrap compiled blocks (see `trials`)
    capped = [v for v in variants if v in OWN_GROUP]
    if capped and device != "cuda":
        raise ValueError(f"variants {capped}: their NCCL group options apply on GPUs; this run uses {device} "
                         "(gloo)")
    return variants


def main(argv: list[str] | None = None) -> pd.DataFrame:
    from raysys.cluster import read_sweep, resolve_out_dir, run_sweep

    args = build_parser().parse_args(argv)
    out = resolve_out_dir(args.out)
    sweep = COMPILED if args.compile else SWEEP
    if args.report_only:
        df = read_sweep(out, sweep)
    else:
        if args.world_size < 1:
            raise ValueError(f"--world-size ({args.world_size}) must be >= 1")
        device = resolve_device(args)
        d = DEFAULTS[device]
        size = args.size or d["size"]
        if size not in SIZES:
            raise ValueError(f"--size {size!r} is not one of {sorted(SIZES)}")
        context = args.context_length or min(d["context_length"], ModelConfig.from_name(size).context_length)
        grid = trials(size=size, context_length=context, batch_per_rank=args.batch_per_rank or d["batch_per_rank"],
                      dtypes=parse_list(args.dtypes, "dtypes", tuple(DTYPES)),
                      variants=_variants(args.variants, device, d, args.compile),
                      profile=[v.strip() for v in args.profile.split(",") if v.strip()],
                      warmup=d["warmup"] if args.warmup is None else args.warmup, steps=args.steps or d["steps"],
                      compile=args.compile, paired_rounds=args.paired_rounds)
        df = run_sweep(sweep, grid, functools.partial(fsdp_trial, out_dir=str(out)), args.world_size, out_dir=out,
                       device=device, resume=args.resume, reduce=reduce_ranks, launcher=args.launcher,
                       timeout_s=args.timeout_s, show=False)
    md = write_report(df, out, sweep)
    print(md.read_text())
    print(f"wrote {out / f'{sweep}.parquet'}, {md}")
    return df


if __name__ == "__main__":
    from raysys.cli import run_script

    sys.exit(run_script(main))
