"""Compute profiling without nsys: torch.profiler over the timed steps, a kernel summary split by phase.

The benchmark wraps each phase of a step in an NVTX + `record_function` range (`forward`, `backward`,
`optimizer`), so nsys users see the same phases. Because the benchmark synchronises the device at the end of
every phase, every kernel of a phase runs inside that phase's host-side interval; kernels are attributed to
phases by that containment (backward kernels are launched from autograd's thread, so the CPU parent chain
cannot be used for them).

On a CUDA device the summary lists GPU kernels; on the CPU it lists leaf operators (self time), so the same
code path is exercised and tested without a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType

PHASES = ("forward", "backward", "optimizer")
_MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas|^aten::(mm|bmm|addmm|matmul|baddbmm|linear|_scaled_mm)$",
                     re.IGNORECASE)


def is_matmul(kernel_name: str) -> bool:
    return bool(_MATMUL.search(kernel_name))


def make_profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)


def _intervals(events, names) -> list[tuple[str, float, float]]:
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.name in names and e.device_type == DeviceType.CPU]


def kernel_table(prof: torch.profiler.profile, device: torch.device, num_steps: int) -> pd.DataFrame:
    """One row per (phase, kernel): calls per step, total and mean time, share of the phase's and step's time."""
    events = prof.events()
    phases = _intervals(events, PHASES)
    if device.type == "cuda":
        work = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in PHASES
                and not e.name.startswith(("Memcpy", "Memset", "gpu_user_annotation"))]
        dur = lambda e: e.time_range.elapsed_us()
    else:
        # Self time is exclusive, so summing it over every operator counts each microsecond once.
        work = [e for e in events if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0
                and e.name not in PHASES and not e.name.startswith(("ProfilerStep", "cuda", "Optimizer."))]
        dur = lambda e: e.self_cpu_time_total
    rows = []
    for e in work:
        start = e.time_range.start
        phase = next((name for name, s, t in phases if s <= start <= t), "other")
        rows.append((phase, e.name, dur(e)))
    df = pd.DataFrame(rows, columns=["phase", "kernel", "time_us"])
    if df.empty:
        return pd.DataFrame(columns=["phase", "kernel", "calls_per_step", "total_ms", "mean_us", "share_of_phase",
                                     "share_of_step", "is_matmul"])
    agg = df.groupby(["phase", "kernel"], as_index=False).agg(calls=("time_us", "size"), total_us=("time_us", "sum"))
    phase_total = agg.groupby("phase")["total_us"].transform("sum")
    agg["calls_per_step"] = agg["calls"] / max(num_steps, 1)
    agg["total_ms"] = agg["total_us"] / 1e3
    agg["mean_us"] = agg["total_us"] / agg["calls"]
    agg["share_of_phase"] = agg["total_us"] / phase_total
    agg["share_of_step"] = agg["total_us"] / agg["total_us"].sum()
    agg["is_matmul"] = agg["kernel"].map(is_matmul)
    agg = agg.sort_values(["phase", "total_us"], ascending=[True, False]).reset_index(drop=True)
    return agg[["phase", "kernel", "calls_per_step", "total_ms", "mean_us", "share_of_phase", "share_of_step", "is_matmul"]]


def matmul_share(table: pd.DataFrame) -> dict[str, float]:
    """Share of kernel time spent in matrix multiplies, per phase and for the whole step."""
    out = {}
    for phase, part in table.groupby("phase"):
        out[f"matmul_share_{phase}"] = float(part.loc[part.is_matmul, "total_ms"].sum() / part["total_ms"].sum())
    if not table.empty:
        out["matmul_share_step"] = float(table.loc[table.is_matmul, "total_ms"].sum() / table["total_ms"].sum())
    return out


def export_trace(prof: torch.profiler.profile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def format_top(table: pd.DataFrame, top: int = 8) -> str:
    """Markdown: the top kernels of each phase."""
    parts = []
    for phase, part in table.groupby("phase", sort=False):
        head = part.head(top).assign(kernel=lambda d: d.kernel.str.slice(0, 70))
        parts.append(f"**{phase}**\n\n" + head.drop(columns="phase").to_markdown(index=False, floatfmt=".3g"))
    return "\n\n".join(parts)
