"""Activation checkpointing study (handout 3.2, problem gradient_checkpointing; one GPU per trial, Ray Tune).

Studies (`--studies`, default all): `segments` (full checkpointing in segments of k blocks, then the best k's
neighbours, beside none, sqrt(N), nested and selective), `context` (selective vs full vs none over context) and
`offload` (none vs full vs offload at the measured host<->device bandwidth). A trial applies a policy
(`parallel.checkpointing`) and records step time, measured and predicted peak memory and FLOPs: one row in
`<out>/checkpointing.parquet` (an OOM too); the report (`checkpointing.md`, plots) judges the GPU targets. `--quick`,
or no GPU, runs tiny models on the CPU. Grids and targets: docs/studies.md.

    python sweeps/checkpointing.py --out "$PWD/results" --overwrite     # GPU, Ray Tune, all studies
    python sweeps/checkpointing.py --studies segments --out /tmp/ckpt
    python sweeps/checkpointing.py --quick --out /tmp/ckpt              # tiny models on the CPU
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from parallel.checkpointing import apply_activation_checkpointing, parse_policy
from raysys.measure import memory
from raysys.measure.device import DTYPES, autocast, free_memory, resolve_device
from raysys.measure.timing import MAX_STEPS, PhaseTimer
from raysys.model.config import SIZES, ModelConfig
from raysys.model.transformer import AdamW, TransformerLM, cross_entropy, get_attention
from raysys.planning.recompute_model import (GiB, Workload, cpu_allocation_trace, predict_peak, saved_per_block,
                                             static_bytes, step_flops)
from raysys.results.files import write_text
from raysys.results.records import ResultWriter, error_row, make_row, trial_id
from sweeps.common import (NOT_ON_CPU, PROGRESS, check_int, list_flag, main_entry, on_cpu, open_writer,
                           output_dir, parse_ints, parse_list, print_written, pyplot, read_rows, save_figure, start_ray,
                           study_parser)

SWEEP = "checkpointing"
STUDIES = ("segments", "context", "offload")


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One training run under one checkpoint policy."""

    study: str
    """segments | context | offload."""
    policy: str
    """`parallel.checkpointing.parse_policy` spec: none, full:K, sqrt, nested, selective, offload[:MIN_BYTES]."""
    size: str = "xl"
    """Named model size."""
    num_layers: int | None = None
    """Override of the size's block count (the CPU grid uses 8 tiny blocks)."""
    context_length: int = 2048
    """Sequence length (the model is built with this context length)."""
    batch_size: int = 4
    """Sequences per step."""
    dtype: str = "fp32"
    """fp32, or bf16 / fp16 autocast with fp32 master weights."""
    tf32: bool = True
    """Allow TF32 matmuls on the GPU (fp32 memory, faster steps)."""
    attention: str = "naive"
    """Attention backend."""
    warmup: int = 2
    """Untimed steps."""
    steps: int = 5
    """Timed steps."""
    device: str = "auto"
    """auto | cuda | cpu."""
    seed: int = 0

    def __post_init__(self):
        for name, allowed in (("study", STUDIES), ("size", SIZES), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} must be one of {sorted(allowed)}")
        for name, minimum in (("batch_size", 1), ("warmup", 0), ("steps", 1)):
            check_int(name, getattr(self, name), minimum)
        get_attention(self.attention)  # ValueError naming the known backends
        parse_policy(self.policy, self.model_config().num_layers).regions(self.model_config().num_layers)

    def workload(self, device_type: str) -> Workload:
        """What the memory and FLOP model (`raysys.planning.recompute_model`) needs to predict this trial."""
        return Workload(config=self.model_config(), batch_size=self.batch_size, precision=self.dtype,
                        device_type=device_type)

    def model_config(self) -> ModelConfig:
        overrides = dict(context_length=self.context_length, attention=self.attention)
        if self.num_layers is not None:
            overrides["num_layers"] = self.num_layers
        return ModelConfig.from_name(self.size, **overrides)


# ---------------------------------------------------------------------------------------------------- trial
def run_trial(config: dict) -> dict:
    """Measure one `Trial` (given as a dict); returns its metrics. Raises on failure (OOM included)."""
    t = Trial(**config)
    device = resolve_device(t.device)
    mc = t.model_config()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = t.tf32
        torch.backends.cudnn.allow_tf32 = t.tf32
    free_memory(device)
    memory.reset_peak(device)
    torch.manual_seed(t.seed)
    model = TransformerLM(mc, device=device)
    handle = apply_activation_checkpointing(model, parse_policy(t.policy, mc.num_layers))
    optimizer = AdamW(model.parameters())
    gen = torch.Generator(device=device).manual_seed(t.seed)
    x = torch.randint(0, mc.vocab_size, (t.batch_size, mc.context_length), device=device, generator=gen)
    y = torch.randint(0, mc.vocab_size, (t.batch_size, mc.context_length), device=device, generator=gen)
    def forward():
        with autocast(device, t.dtype):
            return cross_entropy(model(x), y)

    def step(timer: PhaseTimer) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = timer.time("forward", forward)
        timer.time("backward", loss.backward)
        timer.time("optimizer", optimizer.step)

    timer = PhaseTimer(device, recording=False)
    for _ in range(t.warmup):
        step(timer)
    optimizer.zero_grad(set_to_none=True)
    between_steps = memory.allocated_bytes(device)  # weights + AdamW state + inputs (+ workspaces)
    memory.reset_peak(device)
    timer.recording = True
    for _ in range(t.steps):
        step(timer)
    w = t.workload(device.type)
    if device.type == "cuda":
        peak = memory.peak_bytes(device)
        method = "cuda max_memory_allocated"
    else:
        optimizer.zero_grad(set_to_none=True)
        peak = float(sum(static_bytes(w).values()) + max(cpu_allocation_trace(lambda: step(PhaseTimer(device)))))
        between_steps = float(sum(static_bytes(w).values()))
        method = "cpu allocation trace + computed static bytes"

    estimate = predict_peak(w, handle.regions)
    flops = step_flops(w, handle.regions)
    summary = timer.summary()
    metrics = {
        "num_layers": mc.num_layers, "segment_k": float(getattr(handle.policy, "every_k", "nan")),  # sqrt resolved
        "policy_kind": handle.policy.kind,
        "step_mean_s": summary["step_mean_s"], "step_std_s": summary["step_std_s"],
        "forward_mean_s": summary["forward_mean_s"], "backward_mean_s": summary["backward_mean_s"],
        "optimizer_mean_s": summary["optimizer_mean_s"],
        "tokens_per_s": t.batch_size * mc.context_length / summary["step_mean_s"],
        "peak_bytes": peak, "between_steps_bytes": between_steps, "activation_peak_bytes": peak - between_steps,
        "memory_method": method,
        "predicted_peak_bytes": estimate.peak_bytes, "predicted_peak_at": estimate.where,
        "predicted_activation_peak_bytes": estimate.activation_peak_bytes,
        "predicted_rel_error": (estimate.peak_bytes - peak) / peak,
        "saved_per_block_none_bytes": saved_per_block(w, "none"),
        "forward_flops": flops["forward"], "recompute_flops": flops["recompute"], "backward_flops": flops["backward"],
        "recompute_fraction": flops["recompute"] / (flops["forward"] + flops["backward"]),
        "notes": "; ".join(handle.notes[:1]),
    }
    if handle.stores:
        if device.type == "cpu":
            metrics["notes"] = "CPU: the offload store is host memory too, so the measured peak is not a device peak"
        offloaded = handle.stores[0].stats.offloaded_bytes
        metrics.update(offloaded_bytes_per_step=offloaded / (t.warmup + t.steps + (device.type == "cpu")),
                       **link_bandwidth(device))
    del model, optimizer, handle
    return metrics


def link_bandwidth(device: torch.device, nbytes: int = 512 * 2**20, reps: int = 3) -> dict:
    """Pinned host->device and device->host copy bandwidth (GB/s, median of `reps`); NaN off CUDA."""
    if device.type != "cuda":
        return {"h2d_GBps": float("nan"), "d2h_GBps": float("nan")}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


# ---------------------------------------------------------------------------------------------------- grids
def grid(study: str, device: torch.device, quick: bool, dtype: str, warmup: int, steps: int,
         ks: list[int] | None = None, policies: list[str] | None = None) -> list[dict]:
    """The trials of one study (`policies` replaces the segments study's list). CPU / --quick: tiny models
    with the same structure."""
    tiny = quick or device.type == "cpu"
    # Selective recomputation of the attention core done inside a fused kernel: FlashAttention keeps O and the
    # log-sum-exp and recomputes P in its backward (the Triton kernel on a GPU, torch's SDPA on the CPU).
    fused_core = "sdpa" if device.type == "cpu" else "flash_triton"
    common = dict(study=study, dtype=dtype, warmup=warmup, steps=steps, device=device.type)
    if tiny:
        common.update(size="tiny", num_layers=8 if study == "segments" else 4, batch_size=2, warmup=1, steps=2)
    if study == "segments":
        base = dict(common, **(dict(context_length=64) if tiny else dict(size="xl", context_length=2048, batch_size=4)))
        n = base.get("num_layers") or SIZES[base["size"]]["num_layers"]
        ks = ks or [2**i for i in range(int(math.log2(n)) + 1)] + ([n] if n & (n - 1) else [])
        specs = policies or ["none", "selective", "nested", "sqrt"] + [f"full:{k}" for k in ks]
        fused = [] if policies else [dict(base, policy="selective", attention=fused_core)]
        return [dict(base, policy=s) for s in specs] + fused
    base = dict(common, **({} if tiny else dict(size="medium", batch_size=1)))
    if study == "context":
        contexts = (32, 64, 128) if tiny else (2048, 4096, 8192)
        return [dict(base, context_length=c, policy=p) for c in contexts for p in ("none", "selective", "full")] + \
            [dict(base, context_length=c, policy="selective", attention=fused_core) for c in contexts]
    contexts = (64,) if tiny else (1024, 2048)  # 24 blocks x ~1 GiB of pinned host memory at 2048
    offload = "offload:0" if tiny else "offload"  # tiny tensors are below the default 64 KiB threshold
    return [dict(base, context_length=c, policy=p) for c in contexts for p in ("none", "full", offload)]


def neighbours_of_best(df: pd.DataFrame, num_layers: int) -> list[int]:
    """Untested k next to the single-level k with the lowest measured peak."""
    ok = df[(df.study == "segments") & (df.status == "ok") & df.segment_k.notna()]
    if ok.empty:
        return []
    best = int(ok.loc[ok.peak_bytes.idxmin(), "segment_k"])
    tested = set(df[df.study == "segments"].segment_k.dropna().astype(int))
    return [k for k in (best - 1, best + 1) if 1 <= k <= num_layers and k not in tested]


# ---------------------------------------------------------------------------------------------------- launch
def run_local(trials: list[dict], writer: ResultWriter) -> None:
    """Run trials one after another in this process (the CPU fallback)."""
    for config in trials:
        if writer.done(trial_id(config)):
            continue
        try:
            row = make_row(SWEEP, config, run_trial(config), device=config["device"])
        except Exception as exc:  # an OOM or a crash is a row, not the end of the sweep
            row = error_row(SWEEP, config, exc)
        writer.write([row])
        _log(row)


def run_tune(trials: list[dict], writer: ResultWriter, gpus: float) -> None:
    """Ray Tune, one trial per GPU: `raysys.cluster.sweep.tune_run` turns each trial into a row. Trials of another
    attention backend (or with other fields) form their own Tune grid, run after the first."""
    from ray import tune

    from raysys.cluster.sweep import tune_run
    # The trainable goes by reference (module sweeps.checkpointing), not by value from __main__.
    from sweeps.checkpointing import run_trial as trainable

    groups: dict[tuple, list[dict]] = {}
    for t in trials:
        groups.setdefault((tuple(sorted(t)), t.get("attention")), []).append(t)
    for group in groups.values():
        values = {k: list(dict.fromkeys(t[k] for t in group)) for k in sorted(group[0])}
        varying = [k for k, v in values.items() if len(v) > 1]
        if len(varying) > 2 or math.prod(len(values[k]) for k in varying) != len(group):
            raise ValueError(f"trials must form a full grid of at most two axes; they vary in {varying}")
        space = {k: tune.grid_search(v) if k in varying else v[0] for k, v in values.items()}
        tune_run(trainable, space, sweep=SWEEP, resources={"cpu": 1, "gpu": gpus} if gpus else {"cpu": 1},
                 writer=writer, show=False)
        for row in writer.rows:
            if any(all(row.get(k) == t[k] for k in t) for t in group):
                _log(row)


def _log(row: dict) -> None:
    peak, pred = row.get("peak_bytes", float("nan")), row.get("predicted_peak_bytes", float("nan"))
    step = row.get("step_mean_s", float("nan"))
    print(f"  {row.get('study'):>8} {row.get('size'):>6} S={row.get('context_length'):<5} {row.get('policy'):<10} "
          f"{row.get('attention') or 'naive':<12} "
          f"-> {row['status']:<5} step {step * 1e3:8.1f} ms  peak {peak / GiB:7.2f} GiB  "
          f"predicted {pred / GiB:7.2f} GiB",
          flush=True)


# ---------------------------------------------------------------------------------------------------- report
def _segment_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of single-level full checkpointing (k known), by k."""
    if "segment_k" not in df:
        return df.iloc[0:0]
    return df[(df.study == "segments") & df.segment_k.notna()].sort_values("segment_k")


def with_predictions(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of trials that did not finish (OOM) get the model's predicted peak too: it needs no device, and an
    OOM is the model's prediction checked from the other side (predicted peak above the device's memory)."""
    if df.empty or "predicted_peak_bytes" not in df or not df["predicted_peak_bytes"].isna().any():
        return df
    df = df.copy()
    fields = {f.name for f in dataclasses.fields(Trial)}
    for i in df.index[df["predicted_peak_bytes"].isna()]:
        config = {k: v.item() if hasattr(v, "item") else v for k, v in df.loc[i].items()
                  if k in fields and v is not None and not (isinstance(v, float) and math.isnan(v))}
        # a column with gaps is float in the frame: whole numbers go back to int (Trial has no float fields)
        config = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in config.items()}
        try:
            t = Trial(**config)
        except (TypeError, ValueError):
            continue
        n = t.model_config().num_layers
        w = t.workload("cuda" if df.loc[i, "device"] == "cuda" else "cpu")
        df.loc[i, "predicted_peak_bytes"] = predict_peak(w, parse_policy(t.policy, n).regions(n)).peak_bytes
    return df


def policy_label(df: pd.DataFrame) -> pd.Series:
    """The policy, with the attention backend when it is not the naive one: `selective (flash_triton)`."""
    attention = df["attention"].fillna("naive") if "attention" in df else pd.Series("naive", index=df.index)
    return df["policy"].astype(str) + attention.map(lambda a: "" if a == "naive" else f" ({a})")


def summarize(df: pd.DataFrame) -> str:
    """Markdown: the tables and the answers the study exists for."""
    lines = ["## Activation checkpointing (`sweeps/checkpointing.py`)", ""]
    if df.empty:
        return "\n".join(lines + ["no rows"])
    view_cols = ["study", "size", "context_length", "batch_size", "policy", "status", "step_mean_s", "peak_bytes",
                 "predicted_peak_bytes", "predicted_rel_error"]
    view = df[[c for c in view_cols if c in df]].copy()
    view["policy"] = policy_label(df)
    for col in ("peak_bytes", "predicted_peak_bytes"):
        if col in view:
            view[col.replace("_bytes", "_GiB")] = view.pop(col) / GiB
    lines += [view.to_markdown(index=False, floatfmt=".4g"), ""]
    ok = df[df.status == "ok"] if "status" in df else df.iloc[0:0]
    cpu = on_cpu(df)  # the targets are the GPU study's: rows measured on the CPU get no verdict

    seg = _segment_rows(ok)
    if not seg.empty:
        best = seg.loc[seg.peak_bytes.idxmin()]
        k = int(best.segment_k)
        near = {int(r.segment_k): r.peak_bytes / GiB for r in seg.itertuples() if abs(int(r.segment_k) - k) == 1}
        lines.append(f"- best single-level segment size: k = {k}, peak {best.peak_bytes / GiB:.2f} GiB; neighbours: "
                     + (", ".join(f"k = {kk}: {v:.2f} GiB" for kk, v in sorted(near.items())) or "none measured"))

    ok = ok.assign(attention=ok["attention"].fillna("naive") if "attention" in ok else "naive",
                   dtype=ok["dtype"].fillna("fp32") if "dtype" in ok else "fp32")
    for (study, size, ctx, batch, dtype), group in ok.groupby(["study", "size", "context_length", "batch_size",
                                                               "dtype"]):
        by = {(r.policy, r.attention): r for r in group.itertuples()}
        none = by.get(("none", "naive"))
        for (policy, attention), sel in by.items():
            if none is None or policy != "selective":
                continue
            ratio = none.activation_peak_bytes / max(sel.activation_peak_bytes, 1)
            overhead = sel.step_mean_s / none.step_mean_s - 1
            verdict = NOT_ON_CPU if cpu else "met" if ratio >= 4 and overhead <= 0.05 else "not met"
            how = ("attention core recomputed by torch's selective checkpointing" if attention == "naive" else
                   f"attention core recomputed inside the fused `{attention}` backward (keeps O and L)")
            lines.append(f"- {study} {size} S={ctx} B={batch} {dtype}: selective ({how}) keeps {ratio:.2f}x less "
                         f"activation memory than none (naive attention) at {100 * overhead:+.1f}% step time "
                         f"(target >= 4x at <= 5%: {verdict})")

    off = ok[ok.policy.astype(str).str.startswith("offload")]
    for row in off.itertuples():
        same = ok[(ok.study == row.study) & (ok.context_length == row.context_length) & (ok["size"] == row.size)]
        by = {r.policy: r for r in same.itertuples()}
        if "none" in by and "full" in by and row.h2d_GBps == row.h2d_GBps:
            n = row.num_layers
            recompute_s = (by["full"].step_mean_s - by["none"].step_mean_s) / n
            offload_s = (row.step_mean_s - by["none"].step_mean_s) / n
            moved = 2 * row.saved_per_block_none_bytes  # out in forward, back in backward
            breakeven = moved / max(recompute_s, 1e-9) / 1e9
            lines.append(f"- offload S={row.context_length}: link {row.h2d_GBps:.1f} GB/s h2d / "
                         f"{row.d2h_GBps:.1f} GB/s d2h; per block: recompute {1e3 * recompute_s:.1f} ms, "
                         f"offload {1e3 * offload_s:.1f} ms extra; moving {moved / GiB:.2f} GiB per block breaks "
                         f"even with recomputation at {breakeven:.0f} GB/s")

    oom = df[(df.status == "oom") & df.predicted_peak_bytes.notna()] if "predicted_peak_bytes" in df else df.iloc[0:0]
    if not oom.empty:
        lines.append("- out of memory, as predicted: " + ", ".join(
            f"{r.study} {r.size} S={r.context_length} {label} ({r.predicted_peak_bytes / GiB:.1f} GiB predicted)"
            for r, label in zip(oom.itertuples(), policy_label(oom))))
    if "predicted_rel_error" in ok:
        # on the CPU an offloaded tensor stays in the same (host) memory: no device peak to predict
        scored = ok[~(ok.policy.astype(str).str.startswith("offload") & (ok.device == "cpu"))]
        within = int((scored.predicted_rel_error.abs() <= 0.10).sum())
        lines.append(f"- predicted peak within 10% of measured on {within} of {len(scored)} configurations "
                     f"(target >= 6: {NOT_ON_CPU if cpu else 'met' if within >= 6 else 'not met'}); median |error| "
                     f"{100 * scored.predicted_rel_error.abs().median():.1f}%")
    return "\n".join(lines) + "\n"


def plot(df: pd.DataFrame, out: Path) -> list[Path]:
    """Peak memory and step time against k, against context per policy, and offload against recompute."""
    plt = pyplot()
    paths = []
    (out / "plots").mkdir(parents=True, exist_ok=True)
    seg = _segment_rows(df)
    if not seg.empty:
        ok = seg[seg.status == "ok"]
        unit, mem_scale = ("MiB", 2**20) if seg.predicted_peak_bytes.max() < GiB else ("GiB", GiB)  # CPU grid: MiB
        first = seg.iloc[0]
        for metric, label, name in (("peak_bytes", f"peak memory ({unit})", "memory"),
                                    ("step_mean_s", "step time (s)", "time")):
            fig, ax = plt.subplots(figsize=(6, 3.6))
            scale = 1 / mem_scale if metric == "peak_bytes" else 1
            ax.plot(ok.segment_k, ok[metric] * scale, "o-", label="measured")
            if metric == "peak_bytes":
                ax.plot(seg.segment_k, seg.predicted_peak_bytes * scale, "x--", label="predicted")
                for r in seg[seg.status == "oom"].itertuples():
                    ax.annotate("OOM", (r.segment_k, r.predicted_peak_bytes * scale), fontsize=8)
            ax.set_xscale("log", base=2)
            ax.set(xlabel="blocks per checkpointed segment (k)", ylabel=label,
                   title=f"{first['size']}, batch {first.batch_size}, context {first.context_length}")
            ax.grid(alpha=0.3)
            ax.legend()
            paths.append(save_figure(fig, out / "plots" / f"checkpointing_k_{name}.png"))
    ctx = df[df.study == "context"]
    if not ctx.empty:
        unit, mem_scale = ("MiB", 2**20) if ctx.predicted_peak_bytes.max() < GiB else ("GiB", GiB)
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for i, (policy, group) in enumerate(ctx.groupby(policy_label(ctx))):
            g = group.sort_values("context_length")
            okg = g[g.status == "ok"]
            color = f"C{i}"
            axes[0].plot(okg.context_length, okg.peak_bytes / mem_scale, "o-", color=color, label=f"{policy} measured")
            axes[0].plot(g.context_length, g.predicted_peak_bytes / mem_scale, "x:", color=color,
                         label=f"{policy} predicted")
            axes[1].plot(okg.context_length, okg.step_mean_s, "o-", color=color, label=policy)
        for ax, label in zip(axes, (f"peak memory ({unit})", "step time (s)")):
            ax.set_xscale("log", base=2)
            ax.set(xlabel="context length", ylabel=label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / "plots" / "checkpointing_context.png"))
    off = df[(df.study == "offload") & (df.status == "ok")]
    if not off.empty:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        table = off.pivot_table(index="context_length", columns="policy", values="step_mean_s")
        table.plot.bar(ax=ax, rot=0)
        link = off.h2d_GBps.dropna()
        ax.set(xlabel="context length", ylabel="step time (s)",
               title="offload vs recompute" + (f" (h2d {link.median():.0f} GB/s)" if len(link) else ""))
        ax.grid(alpha=0.3, axis="y")
        paths.append(save_figure(fig, out / "plots" / "checkpointing_offload.png"))
    return paths


# ---------------------------------------------------------------------------------------------------- main
def build_parser():
    p = study_parser(__doc__, SWEEP, ray=True, device_help="auto: cuda when present")
    list_flag(p, "--studies", default=",".join(STUDIES), aliases=("--study",),
              help=f"comma list of {', '.join(STUDIES)}")
    p.add_argument("--quick", action="store_true", help="tiny models (the CPU grid) on any device")
    list_flag(p, "--dtypes", default="fp32", aliases=("--dtype",),
              help=f"one of {', '.join(DTYPES)}: fp32, or bf16/fp16 autocast (one per run)")
    list_flag(p, "--ks", default=None, help="segments study: comma list of k (default: 1,2,4,..,N)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trial")
    p.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    p.add_argument("--launcher", choices=("auto", "ray", "local"), default="auto",
                   type=lambda v: "ray" if v == "tune" else v,  # `tune`, its old spelling
                   help="ray: Ray Tune, one GPU per trial (as flash_tiles.py's); local: in this process; auto: ray on "
                        "a GPU host")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    if args.report_only:
        return report(with_predictions(read_rows(args, SWEEP)), output_dir(args, SWEEP))
    device = resolve_device(args.device)
    studies = parse_list(args.studies, "studies", STUDIES)
    dtypes = parse_list(args.dtypes, "dtypes", tuple(DTYPES))
    if len(dtypes) != 1:
        raise ValueError(f"--dtypes {args.dtypes}: the checkpointing study runs one dtype per run")
    dtype = dtypes[0]
    ks = parse_ints(args.ks, "ks", 1) if args.ks else None
    check_int("--warmup", args.warmup, 0, MAX_STEPS)
    check_int("--steps", args.steps, 1, MAX_STEPS)
    grids = {study: grid(study, device, args.quick, dtype, args.warmup, args.steps, ks) for study in studies}
    for t in itertools.chain.from_iterable(grids.values()):
        Trial(**t)  # every trial is valid before any GPU time is spent
    launcher = args.launcher if args.launcher != "auto" else ("ray" if device.type == "cuda" else "local")
    out = output_dir(args, SWEEP)
    with open_writer(out, SWEEP, args) as writer:
        if launcher == "ray":
            start_ray(args)
        elif device.type == "cpu":
            torch.set_num_threads(1)  # tiny models: intra-op threads only add synchronisation
        run = (lambda trials: run_local(trials, writer)) if launcher == "local" else \
            (lambda trials: run_tune(trials, writer, gpus=1 if device.type == "cuda" else 0))
        PROGRESS.plan(sum(map(len, grids.values())))
        for study, trials in grids.items():
            print(f"== {study} ({launcher}, {device.type})", flush=True)
            run(trials)
            if study == "segments":
                n = Trial(**trials[0]).model_config().num_layers
                extra = neighbours_of_best(writer.frame(), n)
                if extra:
                    print(f"   neighbours of the best k: {extra}", flush=True)
                    more = grid(study, device, args.quick, dtype, args.warmup, args.steps,
                                policies=[f"full:{k}" for k in extra])
                    PROGRESS.plan(len(more))
                    run(more)
        df = with_predictions(writer.frame())
    return report(df, out)


def report(df: pd.DataFrame, out: Path) -> pd.DataFrame:
    """Write checkpointing.md and the plots; print the tables and what was written."""
    md = write_text(out / f"{SWEEP}.md", summarize(df))
    print_written(out, SWEEP, md, *(plot(df, out) if not df.empty else []))
    return df


if __name__ == "__main__":
    sys.exit(main_entry(main))
