"""Small steps of `tools.gpu` run in the studies' environment (their PYTHONPATH, where pandas or Ray may come
from carried wheels): `python -m tools.gpu_helpers COMMAND ARGS`, printing one answer.

    versions [--signatures]   torch, triton, CUDA, cuDNN and the GPUs (and tl.range / triton.Config signatures)
    best-nccl RESULTS         the NCCL setting of the scan's fastest 1 GiB all-reduce (mp launch), else `default`
    ncu-picks PARQUET SHAPE   `fwd,dkdv,dq` configs of the base tma candidate and of the fastest ones at SHAPE
    candidates                the names of sweeps.flash_bench.CANDIDATES
    has-xdist                 `yes` when pytest-xdist is installed
    first-call MODE           one fwd+bwd at 1x32x32768x128 bf16 (set TRITON_CACHE_DIR to an empty folder first)
"""

from __future__ import annotations

import sys
import time


def versions(signatures: bool) -> str:
    import torch
    import triton

    text = (f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}, cudnn "
            f"{torch.backends.cudnn.version()}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    if signatures:
        import inspect

        import triton.language as tl

        text += (f"\ntl.range {inspect.signature(tl.range.__init__)}"
                 f"\nConfig {inspect.signature(triton.Config.__init__)}")
    return text


def best_nccl(results: str) -> str:
    import pandas as pd

    d = pd.read_parquet(f"{results}/allreduce_scan.parquet")
    d = d[(d.status == "ok") & (d.op == "all_reduce") & (d.size_bytes == 2**30) & (d.launcher == "mp")]
    return (d.loc[d.busbw_GBps.idxmax(), "nccl_env"] or "default") if len(d) else "default"


def ncu_picks(parquet: str, shape: str) -> str:
    import pandas as pd

    df = pd.read_parquet(parquet)
    b, h, n, d = map(int, shape.split("x"))
    ok = df[(df.status == "ok") & (df.provider == "triton_candidate") & (df.seq == n) & (df.heads == h)
            & (df.batch == b)]
    base = ok[ok.candidate == f"base_tma_d{d}"].iloc[0]
    fwd, bwd = ok.loc[ok.fwd_median_s.idxmin()], ok.loc[ok.bwd_median_s.idxmin()]
    return f"{base.fwd_config},{base.dkdv_config},{base.dq_config} {fwd.fwd_config},{bwd.dkdv_config},{bwd.dq_config}"


def first_call(mode: str) -> str:
    start = time.perf_counter()
    import torch

    from kernels.attention import flash_attention

    q, k, v = (torch.randn(1, 32, 32768, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flash_attention(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    return f"first call ({mode}, empty Triton cache): {time.perf_counter() - start:.1f} s"


def main(argv: list[str]) -> str:
    command, args = argv[0], argv[1:]
    if command == "versions":
        return versions("--signatures" in args)
    if command == "best-nccl":
        return best_nccl(*args)
    if command == "ncu-picks":
        return ncu_picks(*args)
    if command == "candidates":
        from sweeps.flash_bench import CANDIDATES

        return " ".join(CANDIDATES)
    if command == "has-xdist":
        import importlib.util

        return "yes" if importlib.util.find_spec("xdist") else "no"
    if command == "first-call":
        return first_call(*args)
    raise SystemExit(f"tools.gpu_helpers: unknown command {command!r} (see the module's docstring)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(main(sys.argv[1:]))
