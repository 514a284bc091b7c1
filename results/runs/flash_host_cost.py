"""Host time per call of the FlashAttention forward entry points (issue 16), one H200.

Run on the GPU host from the repository root: `PYTHONPATH=$PWD python3 results/runs/flash_host_cost.py`. For each
entry point, 200 calls at 4x32x2048x128 bf16 causal: `host` is the time to issue them (microseconds per call),
`wall` the time until the GPU finished them; host close to wall means host-bound calls. Output of the e7dd8cb run:
`flash_host_cost_e7dd8cb.txt`.
"""

import time

import torch

import kernels.flash_attention as fa
import kernels.flash_attention_gluon as g


def host_and_wall(fn, n: int = 200) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / n * 1e6, (done - start) / n * 1e6


def main() -> None:
    q = torch.randn(4, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k, v = q.clone(), q.clone()
    cases = [("direct", lambda: g.gluon_attention_fwd(q, k, v, True)),      # the Gluon launcher alone
             ("fwd_api", lambda: fa.flash_attention_fwd(q, k, v, True)),    # + path choice (then: auto -> gluon)
             ("op", lambda: fa.flash_attention(q, k, v, True)),             # + the custom op and autograd
             ("desc x4", lambda: [g._descriptor(t, 64) for t in (q, k, v, q)]),
             ("unsupported", lambda: fa.gluon_unsupported(q, k, v)),
             ("tl", lambda: fa.flash_attention_fwd(q, k, v, True, path="tma"))]
    for name, fn in cases:
        print(name, "host us/call %.1f  wall us/call %.1f" % host_and_wall(fn))


if __name__ == "__main__":
    main()
