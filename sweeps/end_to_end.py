"""End-to-end model benchmarks of handout section 2 (one GPU): timings, warm-up, kernels, memory, saved bytes.

Studies (`--studies`, default all): `timing` (forward / backward / optimizer per Table-1 size, fp32 and bf16, eager
and compiled), `warmup` (0, 1, 2 and 5 warm-up steps, each in a fresh process), `kernels` (profiler kernel summary),
`memory` (peak memory of xl with allocator snapshots and timelines) and `saved` (bytes saved for backward per block
and module). Each writes `<out>/e2e_<study>.parquet` and `e2e_<study>.md`; `--quick`, or no GPU, shrinks every grid to
tiny models; `--report-only` redraws from the Parquet files. Grids and extra files: docs/studies.md.

    python sweeps/end_to_end.py --device cuda --out "$PWD/results" --overwrite
    python sweeps/end_to_end.py --quick --studies timing,saved --out /tmp/e2e
    python sweeps/end_to_end.py --report-only --out results
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch


from raysys.measure import memory
from raysys.training.bench import BenchConfig, run_benchmark
from raysys.model.config import TABLE1_SIZES, ModelConfig
from raysys.measure.device import resolve_device
from raysys.model.transformer import TransformerLM, cross_entropy
from raysys.results.records import (ResultWriter, error_row, make_row, provenance, read_results, trial_id,
                            write_parquet)
from sweeps.common import (PROGRESS, list_flag, main_entry, open_writer, output_dir, parse_list, pyplot,
                           save_figure, study_parser, write_markdown)

ROOT = Path(__file__).resolve().parents[1]

STUDIES = ("timing", "warmup", "kernels", "memory", "saved")
FILES = {"timing": ("e2e_timing",), "warmup": ("e2e_warmup",), "kernels": ("e2e_kernels", "e2e_kernel_table"),
         "memory": ("e2e_memory",), "saved": ("e2e_saved", "e2e_saved_detail")}
TABLES = ("e2e_kernel_table", "e2e_saved_detail")  # written whole, not trial by trial
SIZE_ORDER = ("small", "medium", "large", "xl", "10B")


def grids(quick: bool) -> dict:
    if quick:
        return dict(sizes=("tiny",), ctx=64, warmup_sizes=("tiny",), warmups=(0, 1), kernel_sizes=("tiny",),
                    kernel_ctx=(16, 32, 64), memory_size="tiny", memory_ctx=(16, 64), saved_size="tiny",
                    saved_ctx=64, steps=2, warmup=1, compile=(False,))
    return dict(sizes=TABLE1_SIZES, ctx=512, warmup_sizes=("small", "xl"), warmups=(0, 1, 2, 5),
                kernel_sizes=("small", "large"), kernel_ctx=(256, 1024, 2048), memory_size="xl",
                memory_ctx=(128, 2048), saved_size="xl", saved_ctx=512, steps=10, warmup=5, compile=(False, True))


class Study:
    """Runs BenchConfigs into one sweep file, skipping finished trials with --resume."""

    def __init__(self, writer: ResultWriter, out: Path):
        self.writer, self.out = writer, out

    def run(self, cfg: BenchConfig, **extra) -> dict | None:
        config = {**cfg.as_dict(), **extra}
        tid = trial_id(config)
        if self.writer.done(tid):
            return None
        row, kernels = run_benchmark(cfg, self.out)
        row.update(sweep=self.writer.sweep, trial_id=tid, **extra)
        self.writer.write([row])
        _log(cfg, row)
        return row if kernels is None else {**row, "_kernels": kernels}


def _log(cfg: BenchConfig, row: dict) -> None:
    step = row.get("step_mean_s", float("nan"))
    timing = f" step {step * 1e3:9.2f} ms" if row["status"] == "ok" and step == step else ""
    print(f"  {cfg.size:>6} ctx={cfg.model_config().context_length:<5} {cfg.dtype} {cfg.mode:<16} "
          f"compile={cfg.compile!s:<5} warmup={cfg.warmup} -> {row['status']}{timing}", flush=True)


# ---------------------------------------------------------------------------------------------------- studies
def timing(g: dict, device: str, out: Path, writers: dict) -> None:
    study = Study(writers["e2e_timing"], out)
    for compiled in g["compile"]:
        for dtype in ("fp32", "bf16"):
            for size in g["sizes"]:
                study.run(BenchConfig(size=size, context_length=g["ctx"], dtype=dtype, compile=compiled,
                                      device=device, warmup=g["warmup"], steps=g["steps"]))


def warmup(g: dict, device: str, out: Path, writers: dict) -> None:
    """Each warm-up count in a fresh interpreter, so CUDA context, cuBLAS and allocator start cold."""
    writer = writers["e2e_warmup"]
    for size in g["warmup_sizes"]:
        for w in g["warmups"]:
            config = {"size": size, "warmup": w, "context_length": g["ctx"], "steps": g["steps"]}
            tid = trial_id(config)
            if writer.done(tid):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "raysys", "bench", "--size", size, "--context-length", str(g["ctx"]),
                       "--warmup", str(w), "--steps", str(g["steps"]), "--device", device, "--out", tmp]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    row = make_row("e2e_warmup", config, status="error", error=proc.stderr[-2000:])
                else:
                    row = pd.read_parquet(Path(tmp) / "bench.parquet").iloc[0].to_dict()
                    row.update(sweep="e2e_warmup", trial_id=tid)
                writer.write([row])
                print(f"  {size} warmup={w} -> {row['status']} step {row.get('step_mean_s', float('nan')) * 1e3:.2f}"
                      f" ± {row.get('step_std_s', float('nan')) * 1e3:.2f} ms, first timed step "
                      f"{row.get('first_step_s', float('nan')) * 1e3:.2f} ms", flush=True)


def kernels(g: dict, device: str, out: Path, writers: dict) -> None:
    study = Study(writers["e2e_kernels"], out)
    tables = []
    for size in g["kernel_sizes"]:
        for ctx in g["kernel_ctx"]:
            for mode in ("forward", "train-step"):
                row = study.run(BenchConfig(size=size, context_length=ctx, mode=mode, device=device, warmup=2,
                                            steps=3, profile=True))
                if row and "_kernels" in row:  # each kernel row with its run's trial id and provenance
                    tables.append(row["_kernels"].assign(sweep="e2e_kernel_table", trial_id=row["trial_id"],
                                                         **provenance(resolve_device(device))))
    if tables:
        path = out / "e2e_kernel_table.parquet"
        old = [read_results(path)] if writers["e2e_kernels"].mode == "resume" and path.exists() else []
        write_parquet(pd.concat(old + tables, ignore_index=True), path)


def memory_study(g: dict, device: str, out: Path, writers: dict) -> None:
    study = Study(writers["e2e_memory"], out)
    for dtype in ("fp32", "bf16"):
        for ctx in g["memory_ctx"]:
            for mode in ("forward", "train-step"):
                study.run(BenchConfig(size=g["memory_size"], context_length=ctx, dtype=dtype, mode=mode, device=device,
                                      warmup=1, steps=1, memory_profile=True))


def saved(g: dict, device: str, out: Path, writers: dict) -> None:
    dev = resolve_device(device)
    config = {"size": g["saved_size"], "context_length": g["saved_ctx"], "batch_size": 4, "dtype": "fp32"}
    try:
        cfg = ModelConfig.from_name(g["saved_size"], context_length=g["saved_ctx"])
        model = TransformerLM(cfg, device=dev)
        x = torch.randint(0, cfg.vocab_size, (4, cfg.context_length), device=dev)
        per_block, detail = memory.saved_bytes_per_block(model, lambda: cross_entropy(model(x), x))
        rows = [make_row("e2e_saved", {**config, "module": r.module}, {"saved_bytes": int(r.saved_bytes)}, device=dev)
                for r in per_block.itertuples()]
        write_parquet(detail.assign(sweep="e2e_saved_detail", trial_id=trial_id(config), **config,
                                    **provenance(dev)), out / "e2e_saved_detail.parquet")
        block0 = per_block.loc[per_block.module == "layers.0", "saved_bytes"].iloc[0]
        print(f"  {g['saved_size']} ctx={cfg.context_length}: {block0 / 2**20:.1f} MiB saved per block; top savers:")
        print(detail.head(8).to_markdown(index=False))
        del model, x
    except torch.OutOfMemoryError as exc:
        rows = [error_row("e2e_saved", config, exc)]
    writers["e2e_saved"].write(rows)


def num_trials(g: dict) -> dict[str, int]:
    """Trials per study in grid `g` (the saved study is one trial, one row per module)."""
    return {"timing": len(g["compile"]) * 2 * len(g["sizes"]), "warmup": len(g["warmup_sizes"]) * len(g["warmups"]),
            "kernels": len(g["kernel_sizes"]) * len(g["kernel_ctx"]) * 2, "memory": 2 * len(g["memory_ctx"]) * 2,
            "saved": 1}


RUNNERS = {"timing": timing, "warmup": warmup, "kernels": kernels, "memory": memory_study, "saved": saved}


# ---------------------------------------------------------------------------------------------------- report
def _ms(mean: pd.Series, std: pd.Series) -> list[str]:
    return [f"{m * 1e3:.1f} ± {s * 1e3:.1f}" if pd.notna(m) else "-" for m, s in zip(mean, std)]


def timing_table(df: pd.DataFrame) -> str:
    df = df.copy()
    for phase in ("forward", "backward", "optimizer", "step"):
        df[f"{phase} (ms)"] = _ms(df[f"{phase}_mean_s"], df[f"{phase}_std_s"])
    df["peak (GiB)"] = df["peak_memory_bytes"] / 2**30
    df["TFLOP/s"] = df["tflops_per_s"]
    cols = ["size", "dtype", "compile", "status", "forward (ms)", "backward (ms)", "optimizer (ms)", "step (ms)",
            "TFLOP/s", "peak (GiB)"]
    order = {s: i for i, s in enumerate(SIZE_ORDER)}
    df = df.sort_values(["compile", "dtype", "size"], key=lambda c: c.map(order) if c.name == "size" else c)
    note = (f"Context {int(df.context_length.iloc[0])}, batch {int(df.batch_size.iloc[0])}, train step with AdamW, "
            f"{int(df.warmup.iloc[0])} warm-up and {int(df.steps.iloc[0])} timed steps, mean ± std. fp32 runs use "
            "PyTorch's default (no TF32); bf16 is autocast with fp32 master weights; `compile` compiles each block.")
    return note + "\n\n" + df[cols].to_markdown(index=False, floatfmt=".3g")


def warmup_table(df: pd.DataFrame) -> str:
    df = df.copy()
    df["step (ms)"] = _ms(df["step_mean_s"], df["step_std_s"])
    df["first timed step (ms)"] = df["first_step_s"] * 1e3
    note = "Each warm-up count runs in a fresh process (CUDA context, cuBLAS handles and allocator start cold)."
    return note + "\n\n" + df[["size", "warmup", "steps", "status", "step (ms)", "first timed step (ms)"]].to_markdown(
        index=False, floatfmt=".1f")


def kernels_table(df: pd.DataFrame) -> str:
    df = df.copy()
    share = [c for c in df.columns if c.startswith("matmul_share_")]
    df["step (ms)"] = _ms(df["step_mean_s"], df["step_std_s"])
    note = ("Share of GPU kernel time spent in matrix multiplies (fp32, batch 4), per phase; the top kernels of each "
            "run are in `e2e_kernel_table.parquet`.")
    return note + "\n\n" + df[["size", "context_length", "mode", "status", "step (ms)"] + share].to_markdown(
        index=False, floatfmt=".3f")


def memory_table(df: pd.DataFrame) -> str:
    df = df.copy()
    for col in ("memory_after_init_bytes", "peak_forward_only_bytes", "peak_full_step_bytes"):
        df[col.replace("_bytes", " (GiB)")] = df[col] / 2**30 if col in df else float("nan")
    cols = ["size", "context_length", "dtype", "mode", "status", "memory_after_init (GiB)", "peak_forward_only (GiB)",
            "peak_full_step (GiB)"]
    note = ("Peak allocated memory, batch 4; `forward` rows run the forward pass under no_grad, `train-step` rows a "
            "full step with AdamW (its peak includes optimizer state). Timelines: `results/plots/memory_*.png`.")
    return note + "\n\n" + df[cols].to_markdown(index=False, floatfmt=".2f")


def saved_table(df: pd.DataFrame) -> str:
    df = df.copy()
    df["saved (MiB)"] = df["saved_bytes"] / 2**20
    blocks = df[df.module.str.startswith("layers.")]
    rest = df[~df.module.str.startswith("layers.")]
    summary = pd.concat([blocks.head(1), rest])[["size", "context_length", "batch_size", "module", "saved (MiB)"]]
    return (f"Bytes autograd saves for backward (fp32); all {len(blocks)} blocks save the same as `layers.0` "
            f"(total over blocks {blocks['saved (MiB)'].sum() / 1024:.1f} GiB). Per-module detail of one block: "
            "`e2e_saved_detail.parquet`.\n\n" + summary.to_markdown(index=False, floatfmt=".1f"))


def kernel_table_top(df: pd.DataFrame) -> str:
    ctx = 1024 if (df.context_length == 1024).any() else int(df.context_length.max())
    part = df[(df["mode"] == "train-step") & (df.context_length == ctx) & df.phase.isin(["forward", "backward"])]
    rows = part.sort_values("total_s", ascending=False).groupby(["size", "phase"], sort=False).head(5)
    rows = rows.sort_values(["size", "phase", "total_s"], ascending=[True, False, False]).assign(
        kernel=lambda d: d.kernel.str.slice(0, 80), total_ms=lambda d: 1e3 * d.total_s)
    return (f"Top five GPU kernels per phase of a train step at context {ctx} (fp32); every run's full table is in "
            "`e2e_kernel_table.parquet`.\n\n" + rows[["size", "phase", "kernel", "calls_per_step", "total_ms",
                                                      "share_of_phase", "is_matmul"]].to_markdown(index=False,
                                                                                                  floatfmt=".3g"))


def saved_detail_table(df: pd.DataFrame) -> str:
    view = df.head(12).assign(MiB=lambda d: d["bytes"] / 2**20)
    return ("The largest tensors one block saves for backward (first block of the model; `module` is the innermost "
            "module running when autograd saved it).\n\n" + view[["module", "shape", "dtype", "MiB"]].to_markdown(
                index=False, floatfmt=".1f"))


SECTIONS = {"e2e_timing": ("End-to-end step time by phase", timing_table),
            "e2e_warmup": ("Warm-up steps and the first timed step", warmup_table),
            "e2e_kernels": ("Matmul share of kernel time", kernels_table),
            "e2e_memory": ("Peak memory", memory_table), "e2e_saved": ("Bytes saved for backward", saved_table),
            "e2e_kernel_table": ("Top kernels per phase", kernel_table_top),
            "e2e_saved_detail": ("Largest saved tensors of one block", saved_detail_table)}


def plot_timing(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """`<out_dir>/e2e_timing.png`: stacked forward / backward / optimizer bars, one panel per model size."""
    ok = df[df.status == "ok"]
    sizes = [s for s in SIZE_ORDER if s in set(ok["size"])] or sorted(set(ok["size"]))
    if not sizes:
        return []
    plt = pyplot()
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
    first = ok.iloc[0]
    fig.suptitle(f"Train step by phase (context {int(first['context_length'])}, batch {int(first['batch_size'])})",
                 fontsize=10)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [save_figure(fig, out_dir / "e2e_timing.png", dpi=110)]


def write_reports(out: Path, stems) -> list[Path]:
    """The `.md` of every file of `stems` in `out` (and the timing plot); returns what was written."""
    written = []
    for stem in stems:
        path = out / f"{stem}.parquet"
        if not path.exists():
            continue
        df = read_results(path)
        title, table = SECTIONS[stem]
        written.append(write_markdown(out, stem, title, table(df) + "\n"))
        if stem == "e2e_timing":
            written += plot_timing(df, out / "plots")
    return written


# ---------------------------------------------------------------------------------------------------- main
def build_parser():
    p = study_parser(__doc__, "e2e_<study>", device_help="auto: cuda when present")
    list_flag(p, "--studies", default=",".join(STUDIES), aliases=("--study",), help=f"comma list of "
                                                                                   f"{', '.join(STUDIES)}")
    p.add_argument("--quick", action="store_true", help="tiny grids (CPU smoke run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    studies = parse_list(args.studies, "studies", STUDIES)
    stems = [stem for study in studies for stem in FILES[study]]
    out = output_dir(args, "e2e")
    if args.report_only:
        missing = [s for s in stems if not (out / f"{s}.parquet").exists()]
        if len(missing) == len(stems):
            raise ValueError(f"--report-only: none of {', '.join(f'{s}.parquet' for s in stems)} in {out}")
        for path in write_reports(out, stems):
            print(f"wrote {path}")
        return 0
    device = resolve_device(args.device)  # a bad device fails before any work
    g = grids(args.quick or device.type == "cpu")
    writers = {stem: open_writer(out, stem, args) for stem in stems if stem not in TABLES}
    for stem in set(stems) & set(TABLES):  # whole tables follow the same rule as the trial files
        if (out / f"{stem}.parquet").exists() and not (args.resume or args.overwrite):
            raise ValueError(f"{out / f'{stem}.parquet'} exists: pass --resume to continue it or --overwrite to "
                             f"replace it")
    try:
        PROGRESS.plan(sum(num_trials(g)[name] for name in studies))
        for name in studies:
            print(f"== {name}", flush=True)
            RUNNERS[name](g, args.device, out, writers)
            for path in write_reports(out, FILES[name]):
                print(f"wrote {path}")
    finally:
        for writer in writers.values():
            writer.close()
    snapshots = out / "snapshots"
    if snapshots.exists():  # keep the small timeline pictures next to the results, leave the pickles behind
        (out / "plots").mkdir(exist_ok=True)
        for png in snapshots.glob("*.png"):
            shutil.copy(png, out / "plots" / f"memory_{png.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main_entry(main))
