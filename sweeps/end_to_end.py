"""End-to-end model benchmarks of handout section 2 (one GPU): timings, warm-up, kernels, memory, saved bytes.

Studies (`--study`, default all):
- timing:  forward / backward / optimizer per Table-1 size at context 512, fp32 and bf16, eager and compiled.
- warmup:  the same step with 0, 1, 2 and 5 warm-up steps, each in a fresh process (cold start included).
- kernels: profiler kernel summary for two sizes x three context lengths (train step).
- memory:  peak memory of xl at contexts 128 and 2048, forward-only and full step, fp32 and bf16, with
           allocator snapshots and timeline pictures.
- saved:   bytes saved for backward per xl block, and per module of one block.

Each study writes `<out>/e2e_<study>.parquet` (kernels also `e2e_kernel_table.parquet`, saved also
`e2e_saved_detail.parquet`). `--quick` shrinks every grid to tiny models (a CPU smoke run).

    python sweeps/end_to_end.py --device cuda --out results
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from raysys import memory  # noqa: E402
from raysys.bench import BenchConfig, run_benchmark  # noqa: E402
from raysys.config import TABLE1_SIZES, ModelConfig  # noqa: E402
from raysys.device import resolve_device  # noqa: E402
from raysys.model import TransformerLM, cross_entropy  # noqa: E402
from raysys.results import ResultWriter, error_row, make_row, write_parquet  # noqa: E402

STUDIES = ("timing", "warmup", "kernels", "memory", "saved")


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

    def __init__(self, name: str, out: Path, resume: bool):
        self.out, self.resume = out, resume
        self.writer = ResultWriter(out, f"e2e_{name}", resume=resume)

    def run(self, cfg: BenchConfig, **extra) -> dict | None:
        config = {**cfg.as_dict(), **extra}
        tid = make_row(self.writer.sweep, config)["trial_id"]
        if self.resume and self.writer.done(tid):
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


def timing(g: dict, device: str, out: Path, resume: bool) -> None:
    study = Study("timing", out, resume)
    for compiled in g["compile"]:
        for dtype in ("fp32", "bf16"):
            for size in g["sizes"]:
                study.run(BenchConfig(size=size, context_length=g["ctx"], dtype=dtype, compile=compiled,
                                      device=device, warmup=g["warmup"], steps=g["steps"]))


def warmup(g: dict, device: str, out: Path, resume: bool) -> None:
    """Each warm-up count in a fresh interpreter, so CUDA context, cuBLAS and allocator start cold."""
    writer = ResultWriter(out, "e2e_warmup", resume=resume)
    for size in g["warmup_sizes"]:
        for w in g["warmups"]:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "raysys", "bench", "--size", size, "--context-length", str(g["ctx"]),
                       "--warmup", str(w), "--steps", str(g["steps"]), "--device", device, "--out", tmp]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                config = {"size": size, "warmup": w, "context_length": g["ctx"], "steps": g["steps"]}
                if proc.returncode != 0:
                    row = make_row("e2e_warmup", config, status="error", error=proc.stderr[-2000:])
                else:
                    row = pd.read_parquet(Path(tmp) / "bench.parquet").iloc[0].to_dict()
                    row.update(sweep="e2e_warmup", trial_id=make_row("e2e_warmup", config)["trial_id"])
                writer.write([row])
                print(f"  {size} warmup={w} -> {row['status']} step {row.get('step_mean_s', float('nan')) * 1e3:.2f}"
                      f" ± {row.get('step_std_s', float('nan')) * 1e3:.2f} ms, first timed step "
                      f"{row.get('first_step_s', float('nan')) * 1e3:.2f} ms", flush=True)


def kernels(g: dict, device: str, out: Path, resume: bool) -> None:
    study = Study("kernels", out, resume)
    tables = []
    for size in g["kernel_sizes"]:
        for ctx in g["kernel_ctx"]:
            for mode in ("forward", "train-step"):
                row = study.run(BenchConfig(size=size, context_length=ctx, mode=mode, device=device, warmup=2,
                                            steps=3, profile=True))
                if row and "_kernels" in row:
                    tables.append(row["_kernels"].assign(trial_id=row["trial_id"]))
    if tables:
        path = out / "e2e_kernel_table.parquet"
        old = [pd.read_parquet(path)] if resume and path.exists() else []
        write_parquet(pd.concat(old + tables, ignore_index=True), path)


def memory_study(g: dict, device: str, out: Path, resume: bool) -> None:
    study = Study("memory", out, resume)
    for dtype in ("fp32", "bf16"):
        for ctx in g["memory_ctx"]:
            for mode in ("forward", "train-step"):
                study.run(BenchConfig(size=g["memory_size"], context_length=ctx, dtype=dtype, mode=mode, device=device,
                                      warmup=1, steps=1, memory_profile=True))


def saved(g: dict, device: str, out: Path, resume: bool) -> None:
    dev = resolve_device(device)
    config = {"size": g["saved_size"], "context_length": g["saved_ctx"], "batch_size": 4, "dtype": "fp32"}
    try:
        cfg = ModelConfig.from_name(g["saved_size"], context_length=g["saved_ctx"])
        model = TransformerLM(cfg, device=dev)
        x = torch.randint(0, cfg.vocab_size, (4, cfg.context_length), device=dev)
        per_block, detail = memory.saved_bytes_per_block(model, lambda: cross_entropy(model(x), x))
        rows = [make_row("e2e_saved", {**config, "module": r.module}, {"saved_bytes": int(r.saved_bytes)}, device=dev)
                for r in per_block.itertuples()]
        write_parquet(detail.assign(**config), out / "e2e_saved_detail.parquet")
        block0 = per_block.loc[per_block.module == "layers.0", "saved_bytes"].iloc[0]
        print(f"  {g['saved_size']} ctx={cfg.context_length}: {block0 / 2**20:.1f} MiB saved per block; top savers:")
        print(detail.head(8).to_markdown(index=False))
        del model, x
    except torch.OutOfMemoryError as exc:
        rows = [error_row("e2e_saved", config, exc)]
    ResultWriter(out, "e2e_saved").write(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", nargs="+", default=list(STUDIES), choices=STUDIES, help="which studies to run")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--out", default=str(ROOT / "results"), help="results directory (made absolute)")
    parser.add_argument("--quick", action="store_true", help="tiny grids (CPU smoke run)")
    parser.add_argument("--resume", action="store_true", help="skip trials already in the output files")
    args = parser.parse_args(argv)
    resolve_device(args.device)  # fail before any work on a bad device
    out = Path(args.out).expanduser().resolve()
    g = grids(args.quick or resolve_device(args.device).type == "cpu")
    runners = {"timing": timing, "warmup": warmup, "kernels": kernels, "memory": memory_study, "saved": saved}
    for name in args.study:
        print(f"== {name}", flush=True)
        runners[name](g, args.device, out, args.resume)
    snapshots = out / "snapshots"
    if snapshots.exists():  # keep the small timeline pictures next to the results, leave the pickles behind
        (out / "plots").mkdir(exist_ok=True)
        for png in snapshots.glob("*.png"):
            shutil.copy(png, out / "plots" / f"memory_{png.name}")
    return 0


if __name__ == "__main__":
    from raysys.cli import run_script

    sys.exit(run_script(main))
