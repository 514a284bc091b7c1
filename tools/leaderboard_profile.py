"""Where the leaderboard step's time goes on one GPU, and how fast the host link is (for offload).

One fast step (`raysys.training.leaderboard.StepConfig`, cuDNN attention, the advisor's plan unless POLICY is set) of the 8B
model at batch 1 x 32768 in bf16: two warm-up steps (the first compiles), then one step under the CUDA profiler.
Kernel time is grouped by what ran (cuBLAS / CUTLASS matmuls, cuDNN attention, the project's Triton kernels,
Inductor's kernels, other) and offload's host link copies, which run on a side stream beside them; `gaps` is the
step's wall time (CUDA events) minus the kernels' summed time, copies aside (the GPU waiting on the host, a copy
or nothing). First the host link, as the step measures it (`host_link_gbps`, 1 GiB copies). Writes
`$OUT/leaderboard_profile_<label>.txt` and `.parquet` (one `raysys.results.records` row per kernel name: calls, total_s,
the profiled step's step_s and peak_bytes). Run on the GPU host:

    LABEL=lean python -m tools.leaderboard_profile
    LABEL=pieces LEAN=0 python -m tools.leaderboard_profile
"""
import os
import re
import sys
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from raysys.model.config import ModelConfig
from raysys.results.records import make_row
from raysys.training.leaderboard import ALLOC_CONF, LeaderboardStep, StepConfig, host_link_gbps
from raysys.training.leaderboard_bench import make_batch, set_allocator_config
from raysys.training.step import build_model

LABEL = os.environ.get("LABEL", "lean")
OUT = Path(os.environ.get("OUT", "/tmp")) / f"leaderboard_profile_{LABEL}"
LINK = "host link copies"
"""Offload's pinned copies: on a side stream, beside the kernels (not part of the kernels' sum)."""
CATEGORIES = [  # first match wins
    (LINK, r"^Memcpy [DH]to[DH] \((Device -> Pinned|Pinned -> Device)\)"),
    ("attention (cuDNN)", r"sdpa|fmha|flash|cudnn"),
    ("fused loss (Triton)", r"_ce_loss_grad_kernel"),
    ("AdamW (Triton)", r"_adamw_kernel"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|sm90_|Kernel2"),
    ("Inductor", r"^triton_"),
    ("other", r"."),
]


def category(name: str) -> str:
    return next(c for c, pattern in CATEGORIES if re.search(pattern, name))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("leaderboard_profile.py: needs a CUDA GPU (it profiles the 8B step on one); this machine has none")
    if os.environ.get("LEAN", "1") not in ("0", "1"):
        sys.exit(f"leaderboard_profile.py: LEAN ({os.environ['LEAN']!r}) must be 0 or 1")
    try:  # a bad POLICY is one line before any GPU work
        step_config = StepConfig(attention="cudnn", lean=os.environ.get("LEAN", "1") == "1",
                                 recompute=os.environ.get("POLICY", "advisor"))
    except ValueError as exc:
        sys.exit(f"leaderboard_profile.py: {exc}")
    set_allocator_config(ALLOC_CONF)  # before CUDA starts, unless the environment chose
    device = torch.device("cuda")
    lines = [f"# leaderboard step profile ({LABEL}): {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    lines.append(f"pinned copies of 1 GiB, the slower direction: {host_link_gbps(device, 2**30):.1f} GB/s")
    config = ModelConfig.from_name("leaderboard")
    model = build_model(config, device, torch.bfloat16)
    step = LeaderboardStep(model, step_config, batch_size=1)
    x, y = make_batch(config, 1, config.context_length, device)
    lines.append(f"policy {step.policy_spec}; {step.describe()}")
    for _ in range(2):
        step(x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        step(x, y)
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end)
    peak = torch.cuda.max_memory_allocated() / 2**30
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            config = {"label": LABEL, "policy": step.policy_spec, "kernel": e.key, "category": category(e.key)}
            rows.append(make_row("leaderboard_profile", config, {"calls": e.count, "total_s": t / 1e6,
                                 "step_s": wall_ms / 1e3, "peak_bytes": torch.cuda.max_memory_allocated()},
                                 device=device))
    df = pd.DataFrame(rows).sort_values("total_s", ascending=False)
    df["total_ms"] = df["total_s"] * 1e3
    by_cat = df.groupby("category")["total_ms"].sum().sort_values(ascending=False)
    lines.append(f"step {wall_ms:.1f} ms (CUDA events, under the profiler), peak {peak:.2f} GiB")
    for cat, ms in by_cat.items():
        lines.append(f"  {cat:<22} {ms:9.1f} ms  {100 * ms / wall_ms:5.1f}%")
    kernels = by_cat.drop(LINK, errors="ignore").sum()
    lines.append(f"  {'gaps':<22} {wall_ms - kernels:9.1f} ms  {100 * (1 - kernels / wall_ms):5.1f}%  (the step less "
                 f"the kernels, {LINK} aside)")
    lines.append("top kernels:")
    for r in df.head(30).itertuples():
        lines.append(f"  {r.total_ms:9.1f} ms {r.calls:5d}x  {r.category:<20} {r.kernel[:110]}")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    OUT.with_suffix(".txt").write_text(text)
    df.drop(columns="total_ms").to_parquet(OUT.with_suffix(".parquet"), index=False)


if __name__ == "__main__":
    main()
