"""Launch each FlashAttention kernel a set number of times per path, for a profiler (`ncu`), and report what
the first call cost (compilation plus autotuning, in seconds). Nothing else is timed here.

Per path: `--warmup` calls of forward and backward, then one more, the one to profile (`ncu --launch-skip` skips the
warm-up launches); the first call's wall time and the autotuners' seconds are printed. `--autotune` off (default)
takes the first valid config. Needs a CUDA GPU.

    ncu --clock-control none -k regex:_flash_ --launch-skip 3 --launch-count 3 --section SpeedOfLight \\
        python3 sweeps/flash_profile.py --shape 1x16x16384x128 --paths tma
    python3 sweeps/flash_profile.py --autotune --shape 1x16x1024x128   # first-call cost on a fresh cache
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1x16x16384x128", help="BxHxNxd (bf16, causal)")
    parser.add_argument("--paths", default="portable,tma", help="comma-separated paths to launch, in order")
    parser.add_argument("--bwd", default="two_pass", help="backward: two_pass or one_pass")
    parser.add_argument("--warmup", type=int, default=1, help="calls per path before the profiled one")
    parser.add_argument("--autotune", action="store_true", help="autotune (among the tuned file's entries)")
    for kernel in ("fwd", "dkdv", "dq"):
        parser.add_argument(f"--{kernel}-config", default=None,
                            help=f"pin the {kernel} launch config (a FlashConfig label, e.g. 128x64/w8/s2/r128)")
    args = parser.parse_args(argv)
    parts = args.shape.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape {args.shape!r} must be BxHxNxd with positive integers, e.g. 1x16x16384x128")
    if args.warmup < 0:
        raise ValueError(f"--warmup ({args.warmup}) must be >= 0")
    os.environ["RAYSYS_FLASH_AUTOTUNE"] = "1" if args.autotune else "0"
    start = time.perf_counter()
    import torch

    import kernels.attention.triton.launch as tl_launch
    from kernels.attention import flash_attention_bwd, flash_attention_fwd
    from kernels.attention.dispatch import BWD_MODES, PATHS
    from kernels.attention.triton.tuning import FlashConfig

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if set(paths) - set(PATHS):
        raise ValueError(f"--paths {args.paths!r} must name some of {PATHS}")
    if args.bwd not in BWD_MODES:
        raise ValueError(f"--bwd {args.bwd!r} must be one of {BWD_MODES}")
    if not torch.cuda.is_available():
        raise ValueError("flash_profile needs a CUDA GPU")
    pinned = {k: FlashConfig.from_label(getattr(args, f"{k}_config")) if getattr(args, f"{k}_config") else None
              for k in ("fwd", "dkdv", "dq")}
    b, h, n, d = map(int, parts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    print(f"imports and inputs: {time.perf_counter() - start:.1f} s", flush=True)
    for path in paths:
        for call in range(args.warmup + 1):
            start = time.perf_counter()
            out, lse = flash_attention_fwd(q, k, v, True, config=pinned["fwd"], path=path)
            flash_attention_bwd(q, k, v, out, lse, do, True, dkdv_config=pinned["dkdv"], dq_config=pinned["dq"],
                                path=path, bwd=args.bwd)
            torch.cuda.synchronize()
            if call == 0:
                tuning = sum(getattr(t, "bench_time", 0.0) for t in tl_launch._TUNED.values())
                print(f"{path} {args.bwd} {args.shape}: first call {time.perf_counter() - start:.1f} s (autotuning "
                      f"{'on' if args.autotune else 'off'}: {tuning:.1f} s of benchmarking so far)", flush=True)
    print(f"{args.warmup} warm-up call(s) then one more per path, 4 launches each (3 with one_pass)", flush=True)


if __name__ == "__main__":
    main()
