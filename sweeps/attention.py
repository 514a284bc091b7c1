"""PyTorch attention at scale (handout 4.1.1 pytorch_attention and 4.2 torch_compile): time and memory.

Grid: batch 8, no heads, d in {16, 32, 64, 128} x seq in {256, ..., 16384}, fp32, causal
(`raysys.model.transformer.naive_attention`), eager and compiled: forward and backward times, the memory before backward and the
bytes autograd saved, beside the analytic accounting (`expected_saved_bytes`: O(B N^2)). An OOM is a row; the
smallest that ran out of memory is accounted for in `<out>/attention_memory.md`. `--memory-fraction` emulates a
smaller GPU. Writes `<out>/attention.parquet` and `<out>/attention.md`; the accounting in full: docs/studies.md.

    python sweeps/attention.py --out "$PWD/results" --overwrite
    python sweeps/attention.py --memory-fraction 0.17 --out /tmp/a     # behave like a 24 GB card
    python sweeps/attention.py --quick --device cpu --out /tmp/a      # CPU smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import torch
from torch import nn


from raysys.measure import memory
from raysys.measure.device import resolve_device
from raysys.model.transformer import naive_attention
from raysys.results.files import write_text
from raysys.results.records import make_row, status_of, trial_id
from raysys.measure.timing import MAX_STEPS, PhaseTimer
from sweeps.common import (PROGRESS, check_int, list_flag, main_entry, open_writer, output_dir,
                           parse_list, read_rows, study_parser, write_markdown)

SWEEP = "attention"
BATCH = 8
HEAD_DIMS = (16, 32, 64, 128)
SEQS = (256, 1024, 4096, 8192, 16384)
FP32 = 4


def accounting(batch: int, seq: int, head_dim: int) -> dict:
    """Analytic bytes (fp32): inputs, one score matrix, and what the naive forward keeps for backward."""
    score = batch * seq * seq * FP32
    inputs = 3 * batch * seq * head_dim * FP32
    return {"input_bytes": float(inputs), "score_matrix_bytes": float(score),
            # the masked scores (amax's backward), exp(S - max) and P (the P V matmul); the bool mask; Q, K, V
            "expected_saved_bytes": float(3 * score + seq * seq + inputs)}


def run_trial(cfg: dict, device: torch.device, steps: int, warmup: int) -> dict:
    batch, seq, head_dim = cfg["batch"], cfg["seq"], cfg["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, seq, head_dim, generator=gen, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, seq, head_dim, generator=gen, device=device)
    attn = torch.compile(naive_attention) if cfg["compiled"] else naive_attention
    timer = PhaseTimer(device, recording=False)
    for _ in range(warmup):
        timer.time("forward", lambda: attn(q, k, v, True)).backward(grad)
    timer.recording = True
    for _ in range(steps):
        timer.time("forward", lambda: attn(q, k, v, True))
    metrics = {}
    saved = None
    for i in range(steps):
        if i == 0 and not cfg["compiled"]:  # what autograd keeps alive for this backward
            account = memory.SavedTensorAccount(nn.Module())
            with account.track():
                out = attn(q, k, v, True)
            saved = account.total_bytes
        else:
            out = attn(q, k, v, True)
        if i == 0:
            metrics["memory_before_backward_bytes"] = memory.allocated_bytes(device)
        timer.time("backward", lambda out=out: out.backward(grad))
        del out
    stats = timer.summary()
    metrics.update({k: stats[k] for k in ("forward_mean_s", "forward_std_s", "backward_mean_s", "backward_std_s")})
    metrics["saved_for_backward_bytes"] = float("nan") if saved is None else float(saved)
    return metrics


def memory_report(df: pd.DataFrame) -> str:
    """Markdown accounting of the smallest OOM configuration, or of the largest one when none ran out."""
    oom = df[df["status"] == "oom"]
    pick = oom if len(oom) else df[df["status"] == "ok"]
    if pick.empty:
        return "No finished trials.\n"
    row = (pick.sort_values(["seq", "head_dim"]).iloc[0] if len(oom)
           else pick.sort_values(["seq", "head_dim"]).iloc[-1])
    b, n, d = int(row["batch"]), int(row["seq"]), int(row["head_dim"])
    gib = 2**30
    what = ("Smallest configuration that ran out of memory" if len(oom)
            else "No configuration ran out of memory; largest")
    lines = [f"## Attention memory accounting ({row.get('device_name', '')})", "",
             f"{what}: batch {b}, seq {n}, d {d}, {'compiled' if row['compiled'] else 'eager'}.", "",
             f"- Q, K, V: 3 x {b} x {n} x {d} x 4 B = {row['input_bytes'] / gib:.3f} GiB",
             f"- one score matrix S = Q K^T / sqrt(d): {b} x {n} x {n} x 4 B = "
             f"{row['score_matrix_bytes'] / gib:.2f} GiB",
             (f"- kept for backward (masked S, exp(S - max), P, bool mask, Q, K, V): "
              f"{row['expected_saved_bytes'] / gib:.2f} GiB"),
             ("- transient in the forward: S before masking and S - max, two more score matrices; the backward "
              "allocates dP and dS (two more) while the saved ones are alive"),
             ""]
    if pd.notna(row.get("memory_before_backward_bytes")):
        lines.append(f"Measured before backward: {row['memory_before_backward_bytes'] / gib:.2f} GiB.")
    lines.append("The saved bytes grow with seq^2 (x4 per doubling) and not with d; FlashAttention keeps only O and "
                 "the row log-sum-exp (B x N x (d + 1) values) and recomputes P in the backward.")
    return "\n".join(lines) + "\n"


def markdown(df: pd.DataFrame) -> str:
    """Time of a forward and a backward pass and the memory before the backward, per (head dim, seq) and mode;
    what did not finish; the memory accounting (`memory_report`)."""
    df = df.copy()
    df["mode"] = df["compiled"].map({True: "compiled", False: "eager"})
    df["fwd (ms)"] = df["forward_mean_s"] * 1e3
    df["bwd (ms)"] = df["backward_mean_s"] * 1e3
    df["mem before bwd (GiB)"] = df["memory_before_backward_bytes"] / 2**30
    table = df.pivot_table(index=["head_dim", "seq"], columns="mode",
                           values=["fwd (ms)", "bwd (ms)", "mem before bwd (GiB)"], aggfunc="first")
    table.columns = [f"{v} {m}" for v, m in table.columns]
    failed = df[df.status != "ok"][["head_dim", "seq", "mode", "status"]]
    steps = f" ({int(df['steps'].iloc[0])} each)" if "steps" in df else " (100 each)"
    parts = [f"PyTorch attention (naive, causal), batch {int(df.batch.iloc[0])}, no heads, {df.dtype.iloc[0]}: mean "
             f"time of one forward / one backward pass{steps}, memory in use before the backward.",
             table.reset_index().to_markdown(index=False, floatfmt=".3g")]
    if not failed.empty:
        parts.append("Not run to completion:\n\n" + failed.to_markdown(index=False))
    parts.append(memory_report(df).strip())
    return "\n\n".join(parts) + "\n"


def write_report(df: pd.DataFrame, out: Path) -> list[Path]:
    """`attention.md` (tables and accounting) and `attention_memory.md` (the accounting alone)."""
    return [write_markdown(out, SWEEP, "PyTorch attention at scale", markdown(df)),
            write_text(out / "attention_memory.md", memory_report(df))]


def build_parser():
    p = study_parser(__doc__, SWEEP, device_help="auto: cuda when present")
    p.add_argument("--quick", action="store_true", help="tiny grid, few steps, eager only (CPU smoke test)")
    p.add_argument("--steps", type=int, default=100, help="timed forward and backward passes per trial")
    p.add_argument("--warmup", type=int, default=5, help="untimed forward+backward passes first")
    list_flag(p, "--modes", default="eager,compiled", help="comma list of eager, compiled")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="cap the CUDA allocator at this fraction of the GPU, in (0, 1] (default: no cap)")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    if args.report_only:
        df, out = read_rows(args, SWEEP), output_dir(args, SWEEP)
        for path in write_report(df, out):
            print(f"wrote {path}")
        return df
    device = resolve_device(args.device)
    modes = parse_list(args.modes, "modes", ("eager", "compiled"))
    check_int("--steps", args.steps, 1, MAX_STEPS)
    check_int("--warmup", args.warmup, 0, MAX_STEPS)
    if args.memory_fraction is not None and (not 0 < args.memory_fraction <= 1 or device.type != "cuda"):
        raise ValueError(f"--memory-fraction {args.memory_fraction} needs a CUDA device and a value in (0, 1]")
    head_dims, seqs, steps, warmup = HEAD_DIMS, SEQS, args.steps, args.warmup
    if args.quick:
        head_dims, seqs, steps, warmup, modes = (16,), (64, 128), 3, 1, ["eager"]
    out = output_dir(args, SWEEP)
    if args.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
    PROGRESS.plan(len(modes) * len(head_dims) * len(seqs))
    with open_writer(out, SWEEP, args) as writer:
        for mode in modes:
            for head_dim in head_dims:
                for seq in seqs:
                    cfg = {"batch": BATCH, "seq": seq, "head_dim": head_dim, "dtype": "fp32", "causal": True,
                           "compiled": mode == "compiled", "device": device.type}
                    if writer.done(trial_id(cfg)):
                        continue
                    writer.write([row := measure(cfg, device, steps, warmup)])
                    timing = (f" fwd {row['forward_mean_s'] * 1e3:.3f} ms, bwd {row['backward_mean_s'] * 1e3:.3f} ms"
                              if row["status"] == "ok" else "")
                    print(f"{mode:8} d={head_dim:<3} seq={seq:<5} -> {row['status']}{timing}", flush=True)
        df = writer.frame()
    paths = write_report(df, out)
    cols = ["compiled", "head_dim", "seq", "status", "forward_mean_s", "backward_mean_s",
            "memory_before_backward_bytes", "saved_for_backward_bytes", "expected_saved_bytes"]
    print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(paths[1].read_text())
    print("wrote " + ", ".join(map(str, [out / f"{SWEEP}.parquet", *paths])))
    return df


def measure(cfg: dict, device: torch.device, steps: int, warmup: int) -> dict:
    """The row of one trial: its metrics, or its status (an OOM is expected at long sequences) and error."""
    extra = accounting(BATCH, cfg["seq"], cfg["head_dim"])
    try:
        return make_row(SWEEP, cfg, {**extra, **run_trial(cfg, device, steps, warmup)}, device=device)
    except Exception as exc:  # OOM (expected at long sequences) or a failed trial: a row
        return make_row(SWEEP, cfg, extra, status=status_of(exc), error=f"{type(exc).__name__}: {exc}", device=device)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main_entry(main))
