"""Host time per call of the FlashAttention entry points, on one GPU.

    python3 -m tools.flash_host_cost OUT_DIR [--profile] [--pieces] [--by-kernel] [--cases A,B] [--shape B,H,N,d]
        [--overwrite]

An existing OUT_DIR/flash_host_cost.parquet is refused without `--overwrite`, before any work. Per entry point (SDPA
cuDNN the baseline), 200 calls at 4x32x2048x128 bf16 causal (or `--shape`): `host_s` the time to issue one call,
`wall_s` the time per call until the GPU finished, `kernel_s` the GPU time of the call's kernels (profiled over 20
calls). `--profile` prints cProfile's top functions per case; `--pieces` adds rows `piece: ...` (each step of the
gluon forward); `--by-kernel` adds rows `kernel of <case>` (each CUDA kernel, its launches and seconds per call);
`--cases` times only the cases named.

`python3 -m tools.flash_host_cost logs TXT OUT.parquet COMMIT` builds the same rows from a call's printed lines alone
(one block per shape, each ending with its `wrote ...` line): what the lines do not say (host, time, versions) is
`unknown`, `git_sha` is COMMIT.
"""

import cProfile
import io
import pstats
import re
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels.attention.dispatch as dispatch
import kernels.attention.gluon.forward as g
import kernels.attention.gluon.runtime as runtime
import kernels.attention.interface as fa
from raysys.results.records import PROVENANCE_COLUMNS, make_row, write_parquet

LINE = re.compile(r"^(?P<case>\S.*?) host us/call (?P<host>[\d.]+)\s+wall us/call (?P<wall>[\d.]+)\s+"
                  r"kernels us/call (?P<kernel>[\d.]+)$")
"""A case's printed line (`main`)."""
KERNEL_LINE = re.compile(r"^(?P<case>[^:]+):\s+(?P<us>[\d.]+) us/call\s+(?P<launches>[\d.]+) launches/call\s+"
                         r"(?P<kernel>.+)$")
"""A kernel's printed line (`--by-kernel`)."""
WROTE = re.compile(r"^wrote \S*?(?P<shape>\d+,\d+,\d+,\d+)/flash_host_cost\.parquet$")
DEVICE = re.compile(r"^(?P<name>NVIDIA [^,]+), \d+ MHz")
UNKNOWN = {name: "unknown" for name in PROVENANCE_COLUMNS}
"""What printed lines do not say: the run's id, host, time, versions and device."""


def from_logs(text: str, sha: str) -> pd.DataFrame:
    """`main`'s rows (the case lines and the `--by-kernel` lines) from the printed output of one or more runs, each
    run's block ending with its `wrote` line, which names the shape."""
    device = next((m["name"] for line in text.splitlines() if (m := DEVICE.match(line))), "unknown")
    rows, block = [], []
    for line in text.splitlines():
        if m := WROTE.match(line.strip()):
            label = m["shape"].replace(",", "x")
            for line in block:
                if case := LINE.match(line.strip()):
                    config = dict(case=case["case"], shape=label, calls=200)
                    metrics = dict(host_s=float(case["host"]) * 1e-6, wall_s=float(case["wall"]) * 1e-6,
                                   kernel_s=float(case["kernel"]) * 1e-6)
                elif kernel := KERNEL_LINE.match(line.strip()):
                    config = dict(case=f"kernel of {kernel['case']}", shape=label, calls=20, kernel=kernel["kernel"])
                    metrics = dict(kernel_s=float(kernel["us"]) * 1e-6, launches=float(kernel["launches"]))
                else:
                    continue
                rows.append(make_row("flash_host_cost", config, metrics,
                                     **{**UNKNOWN, "git_sha": sha, "device_name": device}))
            block = []
        else:
            block.append(line)
    if not rows:
        raise SystemExit("flash_host_cost.py logs: no block of case lines ending with a `wrote .../B,H,N,d/"
                         "flash_host_cost.parquet` line")
    return pd.DataFrame(rows)


def host_and_wall(fn, n: int = 200, warmup: int = 5) -> tuple[float, float]:
    """(host, wall) microseconds per call of `fn` over `n` calls after `warmup` ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / n * 1e6, (done - start) / n * 1e6


def by_kernel(fn, n: int = 20) -> list[tuple[str, float, float]]:
    """(kernel name, launches per call, seconds per call) of every CUDA kernel (memsets and copies included) the
    profiler saw over `n` calls of `fn`, the longest first (`--by-kernel`; their sum is `kernel_s`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    found = [(e.key, e.count / n, e.device_time_total / n * 1e-6) for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    return sorted(found, key=lambda x: -x[2])


def profile(name: str, fn, n: int = 50) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(18)
        print(f"--- {name}: by {key}, {n} calls\n" + "\n".join(text.getvalue().splitlines()[6:]))


def pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, label: str) -> list[dict]:
    """Host time of each step of the `op` case's forward, alone (`--pieces`; rows `piece: ...`): what the gluon
    forward pays before and around its launch."""
    from kernels.attention.checks import check_attention_inputs

    config = dispatch.gluon_fwd_config(q, k)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    grid, args, meta = g.launch_args(q, k, v, out, lse, True, config)
    qg = q.clone().requires_grad_()

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal, path, bwd):
            ctx.save_for_backward(q, k, v, q, q[..., 0])
            ctx.is_causal = is_causal
            return q.view_as(q)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None, None, None, None

    def eager_check(q):  # kernels.attention.interface's check per call: a real tensor skips the custom ops
        return (type(q) in (torch.Tensor, torch.nn.Parameter) and q.device.type != "meta"
                and not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None)

    def device_ctx():
        with torch.cuda.device(q.device):
            pass

    steps = [("check_attention_inputs", lambda: check_attention_inputs(q, k, v, True), 2000),
             ("_eager", lambda: eager_check(q), 2000),
             ("path and bwd env", lambda: (dispatch.requested_path(None), dispatch.requested_bwd(None)), 2000),
             ("resolve_path", lambda: dispatch.resolve_path(None, q, k, v, forward=True), 2000),
             ("problem_config", lambda: dispatch.gluon_fwd_config(q, k), 2000),
             ("empty out, lse", lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                         torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)), 2000),
             ("launch_args", lambda: g.launch_args(q, k, v, out, lse, True, config), 2000),
             ("cuda.device context", device_ctx, 2000),
             ("autograd.Function, no kernel", lambda: Nothing.apply(qg, k, v, True, None, None), 2000),
             ("launch, args built", lambda: runtime.launch(config.kernel, grid, args, meta), 200)]
    rows = []
    for name, fn, n in steps:
        host_us = host_and_wall(fn, n, warmup=20)[0]
        print(f"piece: {name}", "host us/call %.2f" % host_us)
        rows.append(make_row("flash_host_cost", dict(case=f"piece: {name}", shape=label, calls=n),
                             dict(host_s=host_us * 1e-6)))
    return rows


CASES = ("direct", "fwd_api", "op", "op gluon", "desc x4", "unsupported", "tl", "sdpa cudnn", "fwd+bwd auto",
         "fwd+bwd gluon", "fwd+bwd tma", "fwd+bwd sdpa cudnn")


def main() -> None:
    if sys.argv[1:2] == ["logs"]:
        if len(sys.argv) != 5:
            raise SystemExit("usage: flash_host_cost.py logs TXT OUT.parquet COMMIT")
        source, target = Path(sys.argv[2]), Path(sys.argv[3])
        if target.exists():
            raise SystemExit(f"flash_host_cost.py: {target} already exists")
        print("wrote", write_parquet(from_logs(source.read_text(), sys.argv[4]), target))
        return
    shape = (4, 32, 2048, 128)
    if "--shape" in sys.argv:
        at = sys.argv.index("--shape") + 1
        text = sys.argv[at] if at < len(sys.argv) else ""
        if not (len(parts := text.split(",")) == 4 and all(x.isdigit() and int(x) > 0 for x in parts)):
            raise SystemExit(f"--shape {text!r} must be four positive integers B,H,N,d")
        shape = tuple(map(int, parts))
    label = "x".join(map(str, shape))
    wanted = CASES
    if "--cases" in sys.argv:  # a subset, by name
        at = sys.argv.index("--cases") + 1
        wanted = tuple(sys.argv[at].split(",")) if at < len(sys.argv) else ()
        if not wanted or any(w not in CASES for w in wanted):
            raise SystemExit(f"--cases {','.join(wanted)!r}: each must be one of {', '.join(CASES)}")
    args = [a for i, a in enumerate(sys.argv[1:], 1)
            if not a.startswith("--") and sys.argv[i - 1] not in ("--shape", "--cases")]
    out = Path(args[0] if args else ".") / "flash_host_cost.parquet"
    if out.exists() and "--overwrite" not in sys.argv:
        raise SystemExit(f"flash_host_cost.py: {out} already exists; pass --overwrite to replace it, or another "
                         "OUT_DIR")
    if not torch.cuda.is_available():
        raise SystemExit("flash_host_cost.py: needs a CUDA GPU (it times the kernels on one); this machine has none")
    q = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    k, v, do = q.clone(), q.clone(), torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd_bwd(path):
        return lambda: fa.flash_attention(qg, kg, vg, True, path=path).backward(do)

    def sdpa_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

    cases = [("direct", lambda: g.gluon_attention_fwd(q, k, v, True,                # the Gluon launcher alone
                                                      dispatch.gluon_fwd_config(q, k))),
             ("fwd_api", lambda: fa.flash_attention_fwd(q, k, v, True)),    # + path choice (auto)
             ("op", lambda: fa.flash_attention(q, k, v, True)),             # + the custom op and autograd
             ("op gluon", lambda: fa.flash_attention(q, k, v, True, path="gluon")),
             ("desc x4", lambda: [runtime.descriptor(t, 64) for t in (q, k, v, q)]),
             ("unsupported", lambda: dispatch.gluon_unsupported_reason(q, k, v)),
             ("tl", lambda: fa.flash_attention_fwd(q, k, v, True, path="tma")),
             ("sdpa cudnn", sdpa_fwd),
             ("fwd+bwd auto", fwd_bwd(None)),
             ("fwd+bwd gluon", fwd_bwd("gluon")),
             ("fwd+bwd tma", fwd_bwd("tma")),                               # the tl kernels, two-pass backward
             ("fwd+bwd sdpa cudnn", sdpa_fwd_bwd)]
    rows = []
    assert tuple(name for name, _ in cases) == CASES
    cases = [(name, fn) for name, fn in cases if name in wanted]
    for name, fn in cases:
        host_us, wall_us = host_and_wall(fn)
        gpu_us = sum(seconds for _, _, seconds in by_kernel(fn)) * 1e6
        print(name, "host us/call %.1f  wall us/call %.1f  kernels us/call %.1f" % (host_us, wall_us, gpu_us))
        rows.append(make_row("flash_host_cost", dict(case=name, shape=label, calls=200),
                             dict(host_s=host_us * 1e-6, wall_s=wall_us * 1e-6, kernel_s=gpu_us * 1e-6)))
    if "--by-kernel" in sys.argv:
        for name, fn in cases:
            for kernel, launches, seconds in by_kernel(fn):
                print(f"  {name}: {seconds * 1e6:9.1f} us/call  {launches:4.1f} launches/call  {kernel[:110]}")
                rows.append(make_row("flash_host_cost", dict(case=f"kernel of {name}", shape=label, calls=20,
                                                             kernel=kernel),
                                     dict(kernel_s=seconds, launches=launches)))
    if "--pieces" in sys.argv:
        rows += pieces(q, k, v, label)
    if "--profile" in sys.argv:
        for name, fn in cases:
            if name in ("direct", "fwd_api", "op", "op gluon", "fwd+bwd auto", "fwd+bwd gluon"):
                profile(name, fn)
    print("wrote", write_parquet(pd.DataFrame(rows), out))


if __name__ == "__main__":
    main()
