"""Turn result Parquet files into markdown tables (and `BENCHMARKS.md`).

`python -m raysys report results/` prints one table per sweep file: the configuration columns that vary,
the metric columns, and the status; provenance is summarised once per file. Sweeps that need a custom view
register a formatter with `register_section`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from raysys.results import ResultsError, read_results, save_figure

PROVENANCE = ("run_id", "git_sha", "torch_version", "triton_version", "ray_version", "device_name", "host", "utc",
              "sweep", "trial_id", "source", "error")
_SECTIONS: dict[str, Callable[[pd.DataFrame], str]] = {}
_EXTRAS: dict[str, Callable[[Path], str]] = {}
_PLOTS: dict[str, Callable[[pd.DataFrame, Path], list[Path]]] = {}


def register_section(sweep: str, formatter: Callable[[pd.DataFrame], str]) -> None:
    """Use `formatter(df) -> markdown` for the `<sweep>.parquet` file instead of the generic table."""
    _SECTIONS[sweep] = formatter


def register_extra(sweep: str, extra: Callable[[Path], str]) -> None:
    """Append `extra(parquet path) -> markdown` to the `<sweep>` section (what other code derives from its rows)."""
    _EXTRAS[sweep] = extra


def register_plot(sweep: str, plotter: Callable[[pd.DataFrame, Path], list[Path]]) -> None:
    """Use `plotter(df, out_dir) -> [png paths]` to draw the `<sweep>.parquet` file."""
    _PLOTS[sweep] = plotter


# The studies draw their own plots beside them in sweeps/ (imports flow sweeps -> raysys), so they are named here
# and imported only when a file of theirs is drawn: file stem -> (module, function, what it takes: the PNG path
# of (df, path) -> path | None, or the directory of (df, out_dir) -> [paths]).
_STUDY_PLOTS = {
    "allreduce": ("sweeps.allreduce", "plot", "png"), "allreduce_scan": ("sweeps.allreduce", "plot", "png"),
    "ddp": ("sweeps.ddp", "plot", "png"), "ddp_compiled": ("sweeps.ddp", "plot", "png"),
    "sharded_optimizer": ("sweeps.sharded_optimizer", "plot", "png"),
    "checkpointing": ("sweeps.checkpointing", "plot", "dir"),
}


def _plotter(stem: str) -> Callable[[pd.DataFrame, Path], list[Path]] | None:
    if stem in _PLOTS:
        return _PLOTS[stem]
    if stem not in _STUDY_PLOTS:
        return None
    import importlib

    module, name, takes = _STUDY_PLOTS[stem]
    fn = getattr(importlib.import_module(module), name)
    if takes == "dir":
        return lambda df, out_dir: list(fn(df, out_dir))
    return lambda df, out_dir: [p for p in [fn(df, out_dir / f"{stem}.png")] if p is not None]


def plots(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw every plot that a sweep file in `results_dir` has (registered here or in its study's script); a file
    that cannot be read or drawn is one line on stderr, and the others are still drawn."""
    import sys

    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    results_dir = Path(results_dir)
    for path in sorted(results_dir.glob("*.parquet")) if results_dir.is_dir() else [results_dir]:
        try:
            if (draw := _plotter(path.stem)) is not None:
                made += draw(read_results(path), out_dir)
        except Exception as exc:  # one study's plot must not cost the others theirs
            print(f"raysys report: no plot of {path.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                  if str(exc) else f"raysys report: no plot of {path.name}: {type(exc).__name__}", file=sys.stderr)
    return made


def varying_columns(df: pd.DataFrame) -> list[str]:
    keep = []
    for col in df.columns:
        if col in PROVENANCE or col.endswith("_path") or col.endswith("_png"):
            continue
        values = df[col].astype(str)
        if col == "status" or values.nunique(dropna=False) > 1:
            keep.append(col)
    return keep


def generic_table(df: pd.DataFrame, max_rows: int = 200) -> str:
    cols = varying_columns(df)
    view = df[cols].head(max_rows)
    for col in view.columns:
        if col.endswith("_bytes"):
            view = view.assign(**{col: view[col] / 2**30}).rename(columns={col: col[: -len("_bytes")] + "_GiB"})
    return view.to_markdown(index=False, floatfmt=".4g")


def provenance_line(df: pd.DataFrame) -> str:
    parts = []
    for col in ("device_name", "torch_version", "triton_version", "ray_version", "git_sha"):
        if col in df:
            parts.append(f"{col.replace('_', ' ')}: {', '.join(sorted(map(str, df[col].dropna().unique())))}")
    if "utc" in df:
        parts.append(f"measured {df['utc'].min()} .. {df['utc'].max()}")
    return "; ".join(parts)


def section(path: Path) -> str:
    """A sweep's markdown: its registered formatter, else the `<sweep>.md` its script wrote, else a generic table."""
    df = read_results(path)
    own_md = path.with_suffix(".md")
    if path.stem in _SECTIONS:
        body = _SECTIONS[path.stem](df)
    elif own_md.exists():
        lines = own_md.read_text().strip().splitlines()
        body = "\n".join(lines[1:] if lines and lines[0].startswith("#") else lines).strip()
    else:
        body = generic_table(df)
    if path.stem in _EXTRAS:
        body = f"{body}\n\n{_EXTRAS[path.stem](path).strip()}"
    prov = provenance_line(df)
    return f"## {path.stem}\n\n" + (f"_{prov}_\n\n" if prov else "") + f"{body}\n"


HEADER = """# Benchmarks

Generated by `python -m raysys report results --markdown BENCHMARKS.md` from the Parquet files in `results/`;
every number below is a row there (`pd.read_parquet("results/<sweep>.parquet")`). Each section names the
device, library versions and git commit its rows were measured with. Sweeps that have not been run on a GPU
yet have no section.
"""


def report(results_dir: str | Path, only: list[str] | None = None) -> str:
    results_dir = Path(results_dir)
    if not results_dir.exists():
        raise ValueError(f"results directory {results_dir} does not exist")
    files = sorted(results_dir.glob("*.parquet")) if results_dir.is_dir() else [results_dir]
    if only:
        files = [f for f in files if f.stem in only]
    if not files:
        raise ValueError(f"no .parquet files in {results_dir}")
    return "\n".join(_section_or_line(f) for f in files)


def _section_or_line(path: Path) -> str:
    """`section(path)`, or one line naming the file when it cannot be read (the other files still report)."""
    try:
        return section(path)
    except ResultsError as exc:
        return f"## {path.stem}\n\n_skipped: {exc}_\n"


# --- sections of the end-to-end study (sweeps/end_to_end.py) ----------------------------------------------

def _ms(mean: pd.Series, std: pd.Series) -> pd.Series:
    return [f"{m * 1e3:.1f} ± {s * 1e3:.1f}" if pd.notna(m) else "-" for m, s in zip(mean, std)]


def _e2e_timing(df: pd.DataFrame) -> str:
    df = df.copy()
    for phase in ("forward", "backward", "optimizer", "step"):
        df[f"{phase} (ms)"] = _ms(df[f"{phase}_mean_s"], df[f"{phase}_std_s"])
    df["peak (GiB)"] = df["peak_memory_bytes"] / 2**30
    df["TFLOP/s"] = df["tflops_per_s"]
    cols = ["size", "dtype", "compile", "status", "forward (ms)", "backward (ms)", "optimizer (ms)", "step (ms)",
            "TFLOP/s", "peak (GiB)"]
    order = {s: i for i, s in enumerate(("small", "medium", "large", "xl", "10B"))}
    df = df.sort_values(["compile", "dtype", "size"], key=lambda c: c.map(order) if c.name == "size" else c)
    note = (f"Context {int(df.context_length.iloc[0])}, batch {int(df.batch_size.iloc[0])}, train step with AdamW, "
            f"{int(df.warmup.iloc[0])} warm-up and {int(df.steps.iloc[0])} timed steps, mean ± std. fp32 runs use "
            "PyTorch's default (no TF32); bf16 is autocast with fp32 master weights; `compile` compiles each block.")
    return note + "\n\n" + df[cols].to_markdown(index=False, floatfmt=".3g")


def _e2e_warmup(df: pd.DataFrame) -> str:
    df = df.copy()
    df["step (ms)"] = _ms(df["step_mean_s"], df["step_std_s"])
    df["first timed step (ms)"] = df["first_step_s"] * 1e3
    note = "Each warm-up count runs in a fresh process (CUDA context, cuBLAS handles and allocator start cold)."
    return note + "\n\n" + df[["size", "warmup", "steps", "status", "step (ms)", "first timed step (ms)"]].to_markdown(
        index=False, floatfmt=".1f")


def _e2e_kernels(df: pd.DataFrame) -> str:
    df = df.copy()
    share = [c for c in df.columns if c.startswith("matmul_share_")]
    df["step (ms)"] = _ms(df["step_mean_s"], df["step_std_s"])
    note = ("Share of GPU kernel time spent in matrix multiplies (fp32, batch 4), per phase; the top kernels of each "
            "run are in `e2e_kernel_table.parquet`.")
    return note + "\n\n" + df[["size", "context_length", "mode", "status", "step (ms)"] + share].to_markdown(
        index=False, floatfmt=".3f")


def _e2e_memory(df: pd.DataFrame) -> str:
    df = df.copy()
    for col in ("memory_after_init_bytes", "peak_forward_only_bytes", "peak_full_step_bytes"):
        df[col.replace("_bytes", " (GiB)")] = df[col] / 2**30 if col in df else float("nan")
    cols = ["size", "context_length", "dtype", "mode", "status", "memory_after_init (GiB)", "peak_forward_only (GiB)",
            "peak_full_step (GiB)"]
    note = ("Peak allocated memory, batch 4; `forward` rows run the forward pass under no_grad, `train-step` rows a "
            "full step with AdamW (its peak includes optimizer state). Timelines: `results/plots/memory_*.png`.")
    return note + "\n\n" + df[cols].to_markdown(index=False, floatfmt=".2f")


def _e2e_saved(df: pd.DataFrame) -> str:
    df = df.copy()
    df["saved (MiB)"] = df["saved_bytes"] / 2**20
    blocks = df[df.module.str.startswith("layers.")]
    rest = df[~df.module.str.startswith("layers.")]
    summary = pd.concat([blocks.head(1), rest])[["size", "context_length", "batch_size", "module", "saved (MiB)"]]
    return (f"Bytes autograd saves for backward (fp32); all {len(blocks)} blocks save the same as `layers.0` "
            f"(total over blocks {blocks['saved (MiB)'].sum() / 1024:.1f} GiB). Per-module detail of one block: "
            "`e2e_saved_detail.parquet`.\n\n" + summary.to_markdown(index=False, floatfmt=".1f"))


register_section("e2e_timing", _e2e_timing)
register_section("e2e_warmup", _e2e_warmup)
register_section("e2e_kernels", _e2e_kernels)
register_section("e2e_memory", _e2e_memory)
register_section("e2e_saved", _e2e_saved)


def _plot_e2e_timing(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Stacked forward / backward / optimizer bars, one panel per model size (linear time axis)."""
    import matplotlib.pyplot as plt

    ok = df[df.status == "ok"]
    sizes = [s for s in ("small", "medium", "large", "xl", "10B") if s in set(ok["size"])]
    variants = [(d, c) for d in ("fp32", "bf16") for c in (False, True) if ((ok.dtype == d) & (ok.compile == c)).any()]
    labels = [f"{d}{' comp.' if c else ''}" for d, c in variants]
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868"}
    fig, axes = plt.subplots(1, len(sizes), figsize=(2.6 * len(sizes), 3.4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        part = ok[ok["size"] == size]
        bottom = [0.0] * len(variants)
        for phase, color in colors.items():
            values = [float(part.loc[(part.dtype == d) & (part.compile == c), f"{phase}_mean_s"].mean() * 1e3)
                      if ((part.dtype == d) & (part.compile == c)).any() else 0.0 for d, c in variants]
            ax.bar(range(len(variants)), values, bottom=bottom, color=color, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(variants)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(size)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("ms per train step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Train step by phase (context 512, batch 4)", fontsize=10)
    fig.tight_layout()
    path = save_figure(fig, out_dir / "e2e_timing.png", dpi=110)  # atomic: a full disk keeps the old picture
    plt.close(fig)
    return [path]


register_plot("e2e_timing", _plot_e2e_timing)


# --- attention studies (sweeps/attention.py, sweeps/flash_bench.py) -----------------------------------------

def _attention(df: pd.DataFrame) -> str:
    df = df.copy()
    df["mode"] = df["compiled"].map({True: "compiled", False: "eager"})
    df["fwd (ms)"] = df["forward_mean_s"] * 1e3
    df["bwd (ms)"] = df["backward_mean_s"] * 1e3
    df["mem before bwd (GiB)"] = df["memory_before_backward_bytes"] / 2**30
    table = df.pivot_table(index=["head_dim", "seq"], columns="mode",
                           values=["fwd (ms)", "bwd (ms)", "mem before bwd (GiB)"], aggfunc="first")
    table.columns = [f"{v} {m}" for v, m in table.columns]
    failed = df[df.status != "ok"][["head_dim", "seq", "mode", "status"]]
    memo = Path(__file__).resolve().parents[1] / "results" / "attention_memory.md"
    parts = [f"PyTorch attention (naive, causal), batch {int(df.batch.iloc[0])}, no heads, {df.dtype.iloc[0]}: mean "
             "time of one forward / one backward pass (100 each), memory in use before the backward.",
             table.reset_index().to_markdown(index=False, floatfmt=".3g")]
    if not failed.empty:
        parts.append("Not run to completion:\n\n" + failed.to_markdown(index=False))
    if memo.exists():
        parts.append(memo.read_text().strip())
    return "\n\n".join(parts)


def _flash_bench(df: pd.DataFrame) -> str:
    ok = df[df.status == "ok"]
    target = ok[ok.study == "target"].copy()
    cols = ["provider", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "speedup_fwd_vs_sdpa_flash",
            "speedup_fwd_bwd_vs_sdpa_flash", "speedup_fwd_vs_sdpa_cudnn", "speedup_fwd_bwd_vs_sdpa_cudnn", "max_abs_err"]
    parts = []
    if not target.empty:
        t = target.iloc[0]
        parts.append(f"Target: batch {t['batch']}, {t['heads']} heads, seq {t['seq']}, d {t['head_dim']}, {t['dtype']}, causal; "
                     "`triton.testing.do_bench` medians; speedups are raysys Triton over each baseline in the same run.")
        parts.append(target[[c for c in cols if c in target]].to_markdown(index=False, floatfmt=".3g"))
    grid = ok[ok.study == "grid"]
    if not grid.empty:
        pivot = grid.pivot_table(index=["dtype", "head_dim", "seq"], columns="provider", values="fwd_bwd_tflops")
        parts.append("Grid (batch 1, causal): forward+backward TFLOP/s per provider.")
        parts.append(pivot.reset_index().to_markdown(index=False, floatfmt=".3g"))
    skipped = df[(df.status != "ok")]
    if not skipped.empty:
        counts = skipped.groupby(["status"]).size().to_dict()
        parts.append(f"Rows not measured: {counts} (time budget of the run, sizes a provider cannot handle, OOM); "
                     "`error` says which.")
    return "\n\n".join(parts)


register_section("attention", _attention)
register_section("flash_bench", _flash_bench)


def _e2e_kernel_table(df: pd.DataFrame) -> str:
    ctx = 1024 if (df.context_length == 1024).any() else int(df.context_length.max())
    part = df[(df["mode"] == "train-step") & (df.context_length == ctx) & df.phase.isin(["forward", "backward"])]
    rows = part.sort_values("total_ms", ascending=False).groupby(["size", "phase"], sort=False).head(5)
    rows = rows.sort_values(["size", "phase", "total_ms"], ascending=[True, False, False]).assign(
        kernel=lambda d: d.kernel.str.slice(0, 80))
    return (f"Top five GPU kernels per phase of a train step at context {ctx} (fp32); every run's full table is in "
            "`e2e_kernel_table.parquet`.\n\n" + rows[["size", "phase", "kernel", "calls_per_step", "total_ms",
                                                      "share_of_phase", "is_matmul"]].to_markdown(index=False, floatfmt=".3g"))


def _e2e_saved_detail(df: pd.DataFrame) -> str:
    view = df.head(12).assign(MiB=lambda d: d["bytes"] / 2**20)
    return ("The largest tensors one block saves for backward (first block of the model; `module` is the innermost "
            "module running when autograd saved it).\n\n" + view[["module", "shape", "dtype", "MiB"]].to_markdown(
                index=False, floatfmt=".1f"))


def _flash_tiles(df: pd.DataFrame) -> str:
    ok = df[df.status == "ok"]
    best = ok.sort_values("median_ms").groupby(["shape", "kernel"], as_index=False).head(3)
    best = best.sort_values(["shape", "kernel", "median_ms"])
    failed = df[df.status != "ok"].groupby("status").size().to_dict()
    return (f"{len(df)} launch configurations timed ({failed or 'none'} failed); the three fastest per kernel and shape "
            "(these feed `kernels/flash_attention_tuned.json`, which the autotuner tries first).\n\n"
            + best[["shape", "kernel", "tile", "num_warps", "num_stages", "median_ms", "tflops"]].to_markdown(
                index=False, floatfmt=".3g"))


register_section("e2e_kernel_table", _e2e_kernel_table)
register_section("e2e_saved_detail", _e2e_saved_detail)
register_section("flash_tiles", _flash_tiles)


# --- the parallelism planner with the measured bandwidth (parallel/planner.py, handout 8) -------------------

PLANNER_SIZE, PLANNER_BATCH, PLANNER_DEVICES = "xl", 8192, [2, 4, 8, 16, 32, 64, 128]


def _planner_tables(path: Path) -> str:
    """`python -m raysys plan --size xl --batch 8192` with W = the best measured all-reduce bus bandwidth."""
    from parallel.planner import H200_BF16_FLOPS, FFNProblem, bandwidth_from_results, plan_tables
    from raysys.config import SIZES

    size, parts = SIZES[PLANNER_SIZE], []
    for src in bandwidth_from_results(path):
        p = FFNProblem(batch=PLANNER_BATCH, d_model=size["d_model"], d_ff=size["d_ff"], flops=H200_BF16_FLOPS,
                       bandwidth=src["busbw_GBps"] * 1e9, bytes_per_element=2)
        tables = plan_tables(p, PLANNER_DEVICES).replace("\n### ", "\n#### ")
        parts.append(f"### Parallelism planner ({PLANNER_SIZE} FFN, `python -m raysys plan --size {PLANNER_SIZE} "
                     f"--batch {PLANNER_BATCH}`), W from {src['source']}\n\n{tables}")
    return "\n\n".join(parts)


register_extra("allreduce", _planner_tables)
