"""Turn result Parquet files into markdown tables (and `BENCHMARKS.md`).

`python -m raysys report results/` prints one table per sweep file: the configuration columns that vary,
the metric columns, and the status; provenance is summarised once per file. Sweeps that need a custom view
register a formatter with `register_section`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from raysys.results import read_results

PROVENANCE = ("git_sha", "torch_version", "triton_version", "ray_version", "device_name", "host", "utc", "sweep",
              "trial_id", "source", "error")
_SECTIONS: dict[str, Callable[[pd.DataFrame], str]] = {}
_PLOTS: dict[str, Callable[[pd.DataFrame, Path], list[Path]]] = {}


def register_section(sweep: str, formatter: Callable[[pd.DataFrame], str]) -> None:
    """Use `formatter(df) -> markdown` for the `<sweep>.parquet` file instead of the generic table."""
    _SECTIONS[sweep] = formatter


def register_plot(sweep: str, plotter: Callable[[pd.DataFrame, Path], list[Path]]) -> None:
    """Use `plotter(df, out_dir) -> [png paths]` to draw the `<sweep>.parquet` file."""
    _PLOTS[sweep] = plotter


def plots(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw every registered plot whose sweep file exists in `results_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for path in sorted(Path(results_dir).glob("*.parquet")):
        if path.stem in _PLOTS:
            made += _PLOTS[path.stem](read_results(path), out_dir)
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
        body = own_md.read_text().strip()
    else:
        body = generic_table(df)
    prov = provenance_line(df)
    return f"## {path.stem}\n\n" + (f"_{prov}_\n\n" if prov else "") + f"{body}\n"


def report(results_dir: str | Path, only: list[str] | None = None) -> str:
    results_dir = Path(results_dir)
    if not results_dir.exists():
        raise ValueError(f"results directory {results_dir} does not exist")
    files = sorted(results_dir.glob("*.parquet")) if results_dir.is_dir() else [results_dir]
    if only:
        files = [f for f in files if f.stem in only]
    if not files:
        raise ValueError(f"no .parquet files in {results_dir}")
    return "\n".join(section(f) for f in files)


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
    path = out_dir / "e2e_timing.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


register_plot("e2e_timing", _plot_e2e_timing)
