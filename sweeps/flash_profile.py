"""Launch each FlashAttention kernel once per path, for a profiler (`ncu`) to measure; nothing is timed here.

Runs the forward and the backward (D, dK/dV, dQ kernels) on one shape, per path, after one warm-up call that
compiles them; `--marker` prints the launch order so that `ncu --launch-skip` can skip the warm-up launches.
The launch configs are those autotuning off takes (the tuned file's), so the profile is of the benchmarked
kernels. Needs a CUDA GPU.

    ncu --clock-control none -k regex:_flash_ --launch-skip 8 --section SpeedOfLight \\
        python3 sweeps/flash_profile.py --shape 1x16x16384x128 --paths portable,tma
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1x16x16384x128", help="BxHxNxd (bf16, causal)")
    parser.add_argument("--paths", default="portable,tma", help="comma-separated paths to launch, in order")
    parser.add_argument("--warmup", type=int, default=1, help="untraced calls per path before the profiled one")
    args = parser.parse_args(argv)
    parts = args.shape.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape {args.shape!r} must be BxHxNxd with positive integers, e.g. 1x16x16384x128")
    if args.warmup < 0:
        raise ValueError(f"--warmup ({args.warmup}) must be >= 0")
    os.environ["RAYSYS_FLASH_AUTOTUNE"] = "0"
    import torch

    from kernels.flash_attention import PATHS, flash_attention_bwd, flash_attention_fwd

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if set(paths) - set(PATHS):
        raise ValueError(f"--paths {args.paths!r} must name some of {PATHS}")
    if not torch.cuda.is_available():
        raise ValueError("flash_profile needs a CUDA GPU")
    b, h, n, d = map(int, parts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for path in paths:
        for _ in range(args.warmup + 1):  # the last call is the one to profile: 4 launches (fwd, D, dK/dV, dQ)
            out, lse = flash_attention_fwd(q, k, v, True, path=path)
            flash_attention_bwd(q, k, v, out, lse, do, True, path=path)
        torch.cuda.synchronize()
        print(f"{path}: {args.warmup} warm-up call(s) then one profiled call, 4 launches each", flush=True)


if __name__ == "__main__":
    main()
