"""Data-parallel training on a gang of ranks (handout 5.2-5.3 and 6): every DDP variant of `parallel/ddp.py`
against torch's DDP and a step with no communication, in one run; then optimizer-state sharding.

Study `ddp` (one row per dtype x variant, `ddp.parquet`): the default on GPUs is the xl model, context 512,
2 ranks, fp32 and bf16 autocast (fp32 master weights), AdamW (torch's, fused on CUDA) for

    single        each rank trains its own replica, no communication at all (the reference step)
    naive, flat   gradients all-reduced after backward (per parameter / one flattened tensor)
    overlapped    an async all-reduce per parameter, issued from backward hooks
    bucketed:MB   async all-reduce per bucket of MB MiB (1, 10, 100, 1000); grads are views of the buckets
    bucketed_copy:MB   the same with copy-in / copy-out bucket buffers instead of views
    torch         torch.nn.parallel.DistributedDataParallel (its defaults: 25 MiB buckets, gradients copied into
                  them; `broadcast_buffers=False` since the model's only buffers are constant RoPE tables)

Batch: every rank runs the same per-rank batch (`--batch-per-rank`, default 2: a global batch of 4 on 2 GPUs),
including `single`, so each row is a step of the same per-GPU work with and without communication; the
difference is what data parallelism costs. Each trial: `--warmup` untimed steps, then `--steps` steps timed
with a device synchronisation around each (mean and std). Inside a step CUDA events split the time into
forward, backward, `comm_wait` (from the end of backward's kernels to the end of
`finish_gradient_synchronization()`: the communication left exposed after backward; all of it for naive and
flat; torch DDP waits inside backward, so its wait is part of its backward) and the optimizer step.

The variants listed in `--profile` (default naive, overlapped) get two more steps under `torch.profiler`;
from the second one's GPU kernel intervals, `overlap_fraction` = time an NCCL kernel runs while a compute
kernel also runs / total NCCL kernel time. Within a step NCCL kernels can only meet backward kernels (the
optimizer waits for them; the next step starts after a synchronisation), so this is the share of gradient
communication hidden behind backward. Rank 0's Chrome trace goes to `<out>/traces/ddp_<variant>_<dtype>.json.gz`
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
    python sweeps/ddp.py --report-only --out results                 # redraw tables and plots
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from parallel.ddp import make_ddp  # noqa: E402
from raysys.config import SIZES, ModelConfig  # noqa: E402
from raysys.model import TransformerLM, cross_entropy  # noqa: E402

SWEEP = "ddp"
STUDIES = ("ddp", "sharded")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
DEFAULT_VARIANTS = ("single,naive,flat,overlapped,bucketed:1,bucketed:10,bucketed:100,bucketed:1000,bucketed_copy:100,"
                    "torch")
# bf16 autocast on the CPU is emulated (slow, and says nothing about GPUs): the CPU run is fp32 only.
DEFAULTS = {"cuda": dict(size="xl", context_length=512, dtypes="fp32,bf16"),
            "cpu": dict(size="tiny", context_length=64, dtypes="fp32")}


# ---------------------------------------------------------------------------------------------------- grid
def parse_variant(spec: str) -> dict:
    """'bucketed:100' -> {'variant': 'bucketed', 'bucket_size_mb': 100.0, 'bucket_view': True, 'label': ...}."""
    name, _, size = spec.strip().partition(":")
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
               profile: list[str], warmup: int, steps: int, seed: int = 0) -> list[dict]:
    """One config per dtype x variant (validated here, before any rank starts)."""
    model_config(size, context_length)
    if batch_per_rank < 1 or warmup < 0 or steps < 2:
        raise ValueError(f"batch_per_rank ({batch_per_rank}) must be >= 1, warmup ({warmup}) >= 0, "
                         f"steps ({steps}) >= 2")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"dtypes {bad} not in {tuple(DTYPES)}")
    parsed = [parse_variant(v) for v in variants]
    profiled = {parse_variant(v)["label"] for v in profile}
    return [{"size": size, "context_length": context_length, "batch_per_rank": batch_per_rank, "dtype": dtype,
             **v, "profile": v["label"] in profiled, "warmup": warmup, "steps": steps, "seed": seed}
            for dtype in dtypes for v in parsed]


def model_config(size: str, context_length: int) -> ModelConfig:
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {sorted(SIZES)}")
    return ModelConfig.from_name(size, context_length=context_length)


# ---------------------------------------------------------------------------------------------------- one step
def autocast(device: torch.device, dtype: str):
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def make_batch(mc: ModelConfig, batch: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, mc.vocab_size, (batch, mc.context_length + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def adamw_kwargs(device: torch.device) -> dict:
    """Hyper-parameters of the optimizer every trial uses: torch AdamW, fused on CUDA (few kernels per step)."""
    return dict(lr=1e-4, weight_decay=0.01, **({"fused": True} if device.type == "cuda" else {}))


class Marks:
    """Phase boundaries inside one step: CUDA events on a GPU (no synchronisation inside the step), the
    wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def durations_ms(self) -> list[float]:
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(self.points, self.points[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.points, self.points[1:])]


PHASES = ("forward", "backward", "comm_wait", "optimizer")


class TrainStep:
    """zero_grad -> forward + loss -> backward -> finish_gradient_synchronization -> optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch, dtype: str, device: torch.device):
        self.model, self.optimizer, self.batch, self.dtype, self.device = model, optimizer, batch, dtype, device
        self.finish = getattr(model, "finish_gradient_synchronization", lambda: None)

    def gradients(self, marks: Marks) -> None:
        """Everything before the optimizer step: afterwards every rank holds the averaged gradients."""
        x, y = self.batch
        self.optimizer.zero_grad(set_to_none=True)
        marks.mark()
        with autocast(self.device, self.dtype):
            loss = cross_entropy(self.model(x), y)
        marks.mark()
        loss.backward()
        marks.mark()
        self.finish()
        marks.mark()

    def __call__(self) -> Marks:
        """One step; the marks bound PHASES (read their durations after the device is synchronised)."""
        marks = Marks(self.device)
        self.gradients(marks)
        self.optimizer.step()
        marks.mark()
        return marks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: TrainStep, warmup: int, steps: int) -> dict[str, float]:
    """Mean/std of the synchronised step time and the mean of each phase over `steps` steps after warm-up."""
    for _ in range(warmup):
        step()
    sync(step.device)
    totals, phases = [], []
    for _ in range(steps):
        start = time.perf_counter()
        marks = step()
        sync(step.device)
        totals.append((time.perf_counter() - start) * 1e3)
        phases.append(marks.durations_ms())
    out = {"step_ms": statistics.fmean(totals), "step_ms_std": statistics.stdev(totals)}
    for i, name in enumerate(PHASES):
        out[f"{name}_ms"] = statistics.fmean(p[i] for p in phases)
    return out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- overlap
def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def overlap(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> tuple[float, float]:
    """(total communication time, part of it during which some compute interval also runs), same units."""
    comm, compute = _merge(comm), _merge(compute)
    total = sum(e - s for s, e in comm)
    shared, j = 0.0, 0
    for s, e in comm:
        while j < len(compute) and compute[j][1] <= s:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < e:
            shared += min(e, compute[k][1]) - max(s, compute[k][0])
            k += 1
    return total, shared


def kernel_intervals(events) -> tuple[list, list]:
    """(NCCL kernel intervals, other GPU kernel intervals) in microseconds, from `profiler.events()`."""
    from torch.autograd import DeviceType

    comm, compute = [], []
    for e in events:
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            continue
        (comm if "nccl" in e.name.lower() else compute).append((e.time_range.start, e.time_range.end))
    return comm, compute


def profile_overlap(step: TrainStep, trace_path: Path | None) -> dict[str, float]:
    """Profile one step (after one profiler warm-up step): NCCL kernel time and the share overlapped with compute."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if step.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Profiler clears events at the end of each cycle")
        with torch.profiler.profile(activities=activities,
                                    schedule=torch.profiler.schedule(wait=0, warmup=1, active=1)) as prof:
            for _ in range(2):
                step()
                sync(step.device)
                prof.step()
    comm, compute = kernel_intervals(prof.events())
    total_us, shared_us = overlap(comm, compute)
    out = {"nccl_kernel_ms": total_us / 1e3 if comm else float("nan"),
           "overlap_fraction": shared_us / total_us if total_us > 0 else float("nan")}
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        out["trace_path"] = str(trace_path)
    return out


# ---------------------------------------------------------------------------------------------------- trial
def wrap(config: dict, model: nn.Module, process_group) -> nn.Module:
    variant = config["variant"]
    if variant == "single":
        return model
    if variant == "bucketed":
        return make_ddp("bucketed", model, bucket_size_mb=config["bucket_size_mb"],
                        grad_as_bucket_view=config["bucket_view"], process_group=process_group)
    if variant == "torch":
        # The model's only buffers are constant RoPE tables: like ours, don't re-broadcast them every forward.
        return make_ddp("torch", model, bucket_size_mb=config["bucket_size_mb"], process_group=process_group,
                        broadcast_buffers=False)
    return make_ddp(variant, model, process_group=process_group)


def ddp_trial(ctx, config: dict, out_dir: str | None = None) -> dict:
    """On every rank: build, wrap and time the model of `config`; profile it if `config['profile']`."""
    try:
        return _ddp_trial(ctx, config, out_dir)
    finally:
        free_memory(ctx.device)     # the trial's tensors died with its frame: give the next trial the memory


def _ddp_trial(ctx, config: dict, out_dir: str | None) -> dict:
    device = ctx.device
    mc = model_config(config["size"], config["context_length"])
    torch.manual_seed(config["seed"] + ctx.rank)          # replicas differ until the wrapper broadcasts rank 0's
    model = wrap(config, TransformerLM(mc, device=device), ctx.process_group)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))
    batch = make_batch(mc, config["batch_per_rank"], device, seed=config["seed"] + 1000 * (ctx.rank + 1))
    step = TrainStep(model, optimizer, batch, config["dtype"], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    metrics = time_steps(step, config["warmup"], config["steps"])
    params = [p for p in model.parameters() if p.requires_grad]
    metrics["grad_mib"] = sum(p.numel() * p.element_size() for p in params) / 2**20
    metrics["collectives_per_step"] = getattr(model, "num_collectives", float("nan"))
    cuda = device.type == "cuda"
    metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    if config["profile"]:
        trace = None
        if out_dir is not None and ctx.rank == 0:
            stem = re.sub(r"[^A-Za-z0-9.-]+", "_", f"ddp_{config['label']}_{config['dtype']}")
            trace = Path(out_dir) / "traces" / f"{stem}.json.gz"
        metrics.update(profile_overlap(step, trace))
    return metrics


def reduce_ranks(config: dict, per_rank: list[dict]) -> dict:
    """Rank 0's metrics, plus the slowest rank's mean step (DDP ranks move in lockstep; `single` ones need not)."""
    out = dict(per_rank[0])
    out["step_ms_max_rank"] = max(r["step_ms"] for r in per_rank)
    return out


# ---------------------------------------------------------------------------------------------------- report
def with_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Add step time relative to `single` and to torch DDP of the same dtype."""
    df = df.copy()
    ok = df[df["status"] == "ok"]
    for ref, col in (("single", "vs_single"), ("torch", "vs_torch")):
        base = ok[ok["variant"] == ref].groupby("dtype")["step_ms"].first()
        df[col] = df["step_ms"] / df["dtype"].map(base)
    return df


def targets(df: pd.DataFrame) -> list[str]:
    """The fastest of our variants per dtype against the targets (<= 1.02x single, <= 1.0x torch DDP)."""
    lines = []
    ours = df[(df["status"] == "ok") & ~df["variant"].isin(["single", "torch"])]
    for dtype, part in ours.groupby("dtype", sort=False):
        best = part.loc[part["step_ms"].idxmin()]
        checks = []
        for col, name, limit in (("vs_single", "single", 1.02), ("vs_torch", "torch DDP", 1.0)):
            if pd.notna(best.get(col)):
                checks.append(f"{best[col]:.3f}x {name} ({'met' if best[col] <= limit else 'missed'}: <= {limit:g}x)")
        lines.append(f"- {dtype}: fastest variant `{best['label']}` at {best['step_ms']:.1f} ms: " + ", ".join(checks))
    return lines


def markdown(df: pd.DataFrame) -> str:
    df = with_ratios(df)
    ok = df[df["status"] == "ok"]
    parts = []
    if not ok.empty:
        first = ok.iloc[0]
        parts.append(
            f"{first['size']} model, context {int(first['context_length'])}, {int(first['world_size'])} ranks "
            f"({first.get('backend', '')}, {first.get('device_name', '')}), {int(first['batch_per_rank'])} sequences "
            f"per rank, AdamW; {int(first['warmup'])} warm-up + {int(first['steps'])} timed steps, mean ± std. "
            "`comm wait`: exposed communication after backward (torch DDP's is inside its backward). `overlap`: "
            "share of NCCL kernel time concurrent with compute kernels (profiled variants only).")
        view = pd.DataFrame({
            "dtype": ok["dtype"], "variant": ok["label"],
            "step (ms)": [f"{m:.1f} ± {s:.1f}" for m, s in zip(ok["step_ms"], ok["step_ms_std"])],
            "vs single": ok["vs_single"], "vs torch": ok["vs_torch"],
            "forward": ok["forward_ms"], "backward": ok["backward_ms"], "comm wait": ok["comm_wait_ms"],
            "optimizer": ok["optimizer_ms"], "collectives/step": ok["collectives_per_step"],
            "overlap": ok.get("overlap_fraction", pd.Series(float("nan"), index=ok.index)),
            "peak (GiB)": ok["peak_memory_gib"]})
        parts.append(view.to_markdown(index=False, floatfmt=".3g"))
        lines = targets(df)
        if lines:
            parts.append("Targets (same run):\n\n" + "\n".join(lines))
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
    for ax, dtype in zip(axes[0], dtypes):
        part = ok[ok["dtype"] == dtype].iloc[::-1]
        wait = part["comm_wait_ms"].fillna(0).clip(lower=0)
        ax.barh(part["label"], part["step_ms"] - wait, color="tab:blue", label="step without exposed comm")
        ax.barh(part["label"], wait, left=part["step_ms"] - wait, color="tab:orange", label="comm wait after backward")
        single = part.loc[part["variant"] == "single", "step_ms"]
        if not single.empty:
            ax.axvline(single.iloc[0], color="k", ls="--", lw=1, label="single (no comm)")
        ax.set_xlabel("time per step (ms)")
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


def write_report(df: pd.DataFrame, out: Path) -> tuple[Path, Path | None]:
    md_path = out / f"{SWEEP}.md"
    md_path.write_text(f"## Data-parallel training ({SWEEP})\n\n{markdown(df)}")
    return md_path, plot(df, out / f"{SWEEP}.png")


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the cluster has GPUs")
    p.add_argument("--out", default=None, help="results directory (default: the repository's results/; give an "
                                               "absolute path under `ray job submit`)")
    p.add_argument("--resume", action="store_true", help="skip trials already in the Parquet files")
    p.add_argument("--studies", default=",".join(STUDIES), help="comma list of ddp, sharded (default: both)")
    p.add_argument("--size", default=None, help="model size (default: xl on cuda, tiny on cpu)")
    p.add_argument("--context-length", type=int, default=None, help="sequence length (default: 512 on cuda, 64 on cpu)")
    p.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per step (default 2)")
    p.add_argument("--dtypes", default=None, help="ddp study: comma list of fp32, bf16 (autocast) (default: both "
                                                   "on cuda, fp32 on cpu)")
    p.add_argument("--sharded-dtypes", default="fp32", help="sharded study: comma list of fp32, bf16 (default fp32)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list (default: {DEFAULT_VARIANTS})")
    p.add_argument("--profile", default="naive,overlapped", help="variants to profile for the overlap fraction "
                                                                 "(default: naive,overlapped; '' for none)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial (default 10)")
    p.add_argument("--launcher", choices=("ray", "mp"), default="ray", help="ray gang (default) or plain processes")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, a local cluster, else embedded)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-trial and process-group timeout (s)")
    p.add_argument("--report-only", action="store_true", help="only redraw the tables and plots from the Parquet files")
    return p


def resolve(args) -> tuple[str, dict]:
    """The device the gang will use and the grid defaults for it (validated, before any rank starts)."""
    from raysys.cluster import init_ray
    from raysys.mp_gang import local_device

    if args.launcher == "ray":
        from raysys.gang import resolve_device

        init_ray(args.address)
        device = resolve_device(args.device)
    else:
        device = local_device(args.device)
    d = DEFAULTS[device]
    size = args.size or d["size"]
    context = args.context_length or min(d["context_length"], SIZES[size].get("context_length", 10**9))
    return device, dict(size=size, context_length=context, dtypes=parse_list(args.dtypes or d["dtypes"], "dtypes",
                                                                             tuple(DTYPES)))


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    from raysys.cluster import resolve_out_dir, run_sweep

    from sweeps import sharded_optimizer

    args = build_parser().parse_args(argv)
    out = resolve_out_dir(args.out)
    studies = parse_list(args.studies, "studies", STUDIES)
    frames: dict[str, pd.DataFrame] = {}
    if args.report_only:
        for study, sweep in (("ddp", SWEEP), ("sharded", sharded_optimizer.SWEEP)):
            if study in studies and (out / f"{sweep}.parquet").exists():
                frames[sweep] = pd.read_parquet(out / f"{sweep}.parquet")
        if not frames:
            raise ValueError(f"--report-only: no ddp / sharded_optimizer Parquet files in {out}")
    else:
        if args.world_size < 2:
            raise ValueError(f"--world-size ({args.world_size}) must be >= 2 for data parallelism")
        variants = parse_list(args.variants, "variants")
        profile = [v for v in args.profile.split(",") if v.strip()]
        device, grid = resolve(args)
        common = dict(world_size=args.world_size, out_dir=out, device=device, resume=args.resume,
                      launcher=args.launcher, timeout_s=args.timeout_s, show=False)
        trials = ddp_trials(variants=variants, profile=profile, batch_per_rank=args.batch_per_rank,
                            warmup=args.warmup, steps=args.steps, **grid)
        sharded_trials = sharded_optimizer.trials(
            batch_per_rank=args.batch_per_rank, warmup=args.warmup, steps=args.steps,
            **{**grid, "dtypes": parse_list(args.sharded_dtypes, "sharded-dtypes", tuple(DTYPES))})
        if "ddp" in studies:
            frames[SWEEP] = run_sweep(SWEEP, trials, functools.partial(ddp_trial, out_dir=str(out)),
                                      reduce=reduce_ranks, **common)
        if "sharded" in studies:
            frames[sharded_optimizer.SWEEP] = run_sweep(sharded_optimizer.SWEEP, sharded_trials,
                                                        sharded_optimizer.sharded_trial,
                                                        reduce=sharded_optimizer.reduce_ranks, **common)
    written = []
    if SWEEP in frames:
        written += [p for p in write_report(frames[SWEEP], out) if p is not None]
    if sharded_optimizer.SWEEP in frames:
        written += [p for p in sharded_optimizer.write_report(frames[sharded_optimizer.SWEEP], out) if p is not None]
    for path in written:
        if path.suffix == ".md":
            print(path.read_text())
    print("wrote " + ", ".join(str(p) for p in [*(out / f"{s}.parquet" for s in frames), *written]))
    return frames


if __name__ == "__main__":
    main()
