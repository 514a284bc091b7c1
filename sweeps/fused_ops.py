"""The fused loss and fused AdamW against their baselines: time, memory, memory-traffic floor.

One row per (op, impl, shape) in `<out>/fused_ops.parquet`: `linear_cross_entropy` (`fused_triton`, `reference` on
materialised logits, `compiled`; forward + backward by `do_bench`, `extra_peak_bytes` (target <= 1 GiB) and
`time_vs_compiled` (target <= 1.0)) and `adamw` over the leaderboard model's parameter shapes (`fused_triton`,
`reference`, `torch_foreach`, `torch_fused`; one step against `floor_s`, the bytes a step must move over this run's
copy bandwidth: `time_vs_floor`, target <= 1.3). `--device cpu` runs tiny rows under TRITON_INTERPRET=1: a smoke
test, not a measurement. Details: docs/studies.md.

    python sweeps/fused_ops.py --device cuda --out results
    python sweeps/fused_ops.py --device cpu --compile-backend aot_eager --out /tmp/fused_ops
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


from raysys.model.config import ModelConfig
from raysys.measure.device import free_memory, resolve_device
from raysys.measure.memory import peak_above
from raysys.measure.timing import kernel_time
from raysys.results.records import ResultWriter, error_row, make_row, resolve_out

SWEEP = "fused_ops"
GiB = 2**30
CUDA_LOSS_SHAPE = (32768, 151936, 4096)
CPU_LOSS_SHAPE = (37, 65, 16)
CPU_MODEL = ModelConfig(vocab_size=33, d_model=16, d_ff=24, num_layers=1, num_heads=2, name="cpu-smoke")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (cpu: tiny shapes, interpreter)")
    p.add_argument("--out", default=None, help="results directory (default: a fresh ./runs/<time>-fused_ops)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing fused_ops.parquet in --out")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the `compiled` loss")
    p.add_argument("--warmup-ms", type=float, default=200.0, help="do_bench warm-up per implementation")
    p.add_argument("--rep-ms", type=float, default=1500.0, help="do_bench measuring time per implementation")
    args = p.parse_args(argv)
    if args.warmup_ms < 0 or args.rep_ms <= 0:
        p.error(f"--warmup-ms ({args.warmup_ms}) must be >= 0 and --rep-ms ({args.rep_ms}) > 0")
    return args


def loss_rows(device, dtype, args) -> list[dict]:
    from kernels.fused_linear_ce import chunk_rows, linear_cross_entropy
    from raysys.model.transformer import cross_entropy

    n, v, d = CUDA_LOSS_SHAPE if device.type == "cuda" else CPU_LOSS_SHAPE
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(n, d, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=gen, device=device) * d**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()

    def unfused(h, w, y):
        return cross_entropy(h @ w.t(), y)

    impls = {"fused_triton": (linear_cross_entropy, f"kernels.fused_linear_ce, {chunk_rows(n, v, dtype)}-row chunks"),
             "reference": (unfused, "raysys.model.transformer.cross_entropy on materialised logits, eager"),
             "compiled": (torch.compile(unfused, backend=args.compile_backend),
                          f"torch.compile({args.compile_backend}) of the reference")}
    rows = []
    for impl, (fn, path) in impls.items():
        config = dict(op="linear_cross_entropy", impl=impl, dtype=str(dtype).removeprefix("torch."),
                      num_tokens=n, vocab=v, d_model=d)

        def fwd_bwd(fn=fn):
            hidden.grad = weight.grad = None
            fn(hidden, weight, targets).backward()

        try:
            fwd_bwd()  # compile, autotune, allocator warm-up
            hidden.grad = weight.grad = None
            peak = peak_above(fwd_bwd, device)
            timing = kernel_time(fwd_bwd, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            rows.append(make_row(SWEEP, config, dict(**timing, peak_above_inputs_bytes=peak,
                                                     extra_peak_bytes=peak - grad_bytes, code_path=path),
                                 device=device))
        except Exception as exc:  # an OOM or a failure is a row, not the end of the sweep
            rows.append(error_row(SWEEP, config, exc, code_path=path))
        hidden.grad = weight.grad = None
        free_memory(device)
    compiled = next((r["time_median_s"] for r in rows if r["impl"] == "compiled" and r["status"] == "ok"), None)
    for r in rows:
        r["time_vs_compiled"] = r["time_median_s"] / compiled if compiled and r["status"] == "ok" else float("nan")
    return rows


def copy_bandwidth(device, args) -> float:
    """Bytes per second of a device-to-device copy (read + write), the floor's unit."""
    numel = 2 * GiB // 4 if device.type == "cuda" else 2**20
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = kernel_time(lambda: dst.copy_(src), device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)["time_median_s"]
    return 2 * numel * 4 / seconds


def adamw_rows(device, dtype, args) -> list[dict]:
    from kernels.adamw import FusedAdamW, adamw_bytes
    from raysys.model.transformer import AdamW, TransformerLM

    cfg = ModelConfig.from_name("leaderboard") if device.type == "cuda" else CPU_MODEL
    shapes = [tuple(p.shape) for p in TransformerLM(cfg, device="meta").parameters()]
    gen = torch.Generator(device).manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, device=device) * 1e-3).to(dtype)
    numel = sum(p.numel() for p in params)
    floor_s = adamw_bytes(numel, params[0].element_size()) / copy_bandwidth(device, args)
    impls = {"fused_triton": (FusedAdamW, "kernels.adamw, one multi-tensor Triton launch"),
             "reference": (AdamW, "raysys.model.transformer.AdamW, per-parameter torch ops"),
             "torch_foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
                               "torch.optim.AdamW(foreach=True), other rounding"),
             "torch_fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
                             "torch.optim.AdamW(fused=True), other rounding")}
    rows = []
    for impl, (make, path) in impls.items():
        config = dict(op="adamw", impl=impl, dtype=str(dtype).removeprefix("torch."), model=cfg.name,
                      num_params=numel, num_tensors=len(params))
        opt = None
        try:
            opt = make(params)
            opt.step()  # state allocation and kernel compilation
            timing = kernel_time(opt.step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            rows.append(make_row(SWEEP, config, dict(**timing, floor_s=floor_s,
                                                     time_vs_floor=timing["time_median_s"] / floor_s, code_path=path),
                                 device=device))
        except Exception as exc:
            rows.append(error_row(SWEEP, config, exc, code_path=path, floor_s=floor_s))
        del opt
        free_memory(device)
    return rows


def main(argv=None) -> Path:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ is imported
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16
    out = resolve_out(args.out, SWEEP)
    with ResultWriter(out, SWEEP, mode="overwrite" if args.overwrite else "new") as writer:
        for rows_of in (loss_rows, adamw_rows):
            rows = rows_of(device, dtype, args)
            writer.write(rows)
            for r in rows:
                shown = {"time_median_s": ("median_ms", 1e3), "extra_peak_bytes": ("extra_peak_gib", 1 / GiB),
                         "time_vs_compiled": ("time_vs_compiled", 1), "floor_s": ("floor_ms", 1e3),
                         "time_vs_floor": ("time_vs_floor", 1)}
                figures = {name: round(r[k] * scale, 3) for k, (name, scale) in shown.items() if k in r and r[k] == r[k]}
                print(f"{r['op']:>22} {r['impl']:>13} {r['status']:>6} {figures} {r['error'][:200]}", flush=True)
    return writer.path


if __name__ == "__main__":
    print(main())
