"""One forward and one backward of the project's kernels (auto dispatch) and of SDPA's cuDNN backend, for `ncu`
(issue 16): what bounds each kernel against cuDNN's on the same input.

Run on the GPU host from the repository root, e.g.

    PYTHONPATH=$PWD ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section SchedulerStats \
        python3 results/runs/flash_ncu_pair.py 1,32,32768,128

Both sides run once unprofiled first (compilation, autotuning, cuDNN's plan), then once between
`cudaProfilerStart` / `cudaProfilerStop`: the project's forward, its backward, then cuDNN's forward and backward
(bf16, causal). Each kernel's name says whose it is.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import flash_attention


def main() -> None:
    text = sys.argv[1] if len(sys.argv) > 1 else "1,16,16384,128"
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"shape {text!r} must be four positive integers B,H,N,d")
    if not torch.cuda.is_available():
        raise SystemExit("flash_ncu_pair.py: needs a CUDA GPU (it times the kernels on one); this machine has none")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(tuple(map(int, parts)), generator=gen, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ours():
        flash_attention(q, k, v, True).backward(do)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    for fn in (ours, cudnn):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in (ours, cudnn):
        fn()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
