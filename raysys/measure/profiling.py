"""Compute profiling without nsys: torch.profiler over the timed steps, a kernel summary split by phase.

Each phase of a benchmark step runs in an NVTX + `record_function` range (`forward`, `backward`, `optimizer`) and
ends with a device synchronisation, so a kernel belongs to the phase whose host interval contains it. On CUDA the
summary lists GPU kernels, on the CPU leaf operators (self time). For the data-parallel sweeps `profile_steps`
records whole steps (its schedule keeps the recorded cycle current when the events are read), `kernel_intervals`
splits NCCL from compute kernels and `overlap` measures how much NCCL time no compute kernel hides.

    prof = profile_steps(step, device, warmup=1, active=1, trace_path="trace.json.gz")
    busy, exposed = overlap(*kernel_intervals(prof.events))   # NCCL time, and the part no compute kernel hides
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import logging
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch
from torch.autograd import DeviceType

from raysys.measure.device import synchronize

PHASES = ("forward", "backward", "optimizer")
_MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas|^aten::(mm|bmm|addmm|matmul|baddbmm|linear|_scaled_mm)$",
                     re.IGNORECASE)


def is_matmul(kernel_name: str) -> bool:
    return bool(_MATMUL.search(kernel_name))


_USDT, _ERROR = b"USDT:", b"ERROR:"
_NO_DEVICE = b"] gpuGetDeviceCount failed"


def _split_noise(data: bytes, no_gpu: Callable[[], bool] = lambda: False) -> tuple[bytes, bytes]:
    """(what of `data` to write now, what to hold for the next read): every `USDT:` span up to its newline dropped,
    wherever it starts (a progress bar's line need not end before Kineto writes), and where `no_gpu()` (asked only
    when such a line comes) Kineto's `ERROR:... gpuGetDeviceCount failed` line (a CUDA build of torch on a machine
    without a GPU); any other `ERROR:` line passes whole. A tail that is or may become such a span is held."""
    out = bytearray()
    while (start := min((i for i in (data.find(_USDT), data.find(_ERROR)) if i >= 0), default=-1)) >= 0:
        out += data[:start]
        end = data.find(b"\n", start)
        if end < 0:
            return bytes(out), data[start:]
        if not _is_noise(data[start:end + 1], no_gpu):
            out += data[start:end + 1]
        data = data[end + 1:]
    held = max((k for mark in (_USDT, _ERROR) for k in range(len(mark) - 1, 0, -1) if data.endswith(mark[:k])),
               default=0)
    return bytes(out) + data[:len(data) - held], data[len(data) - held:]


def _is_noise(span: bytes, no_gpu: Callable[[], bool]) -> bool:
    return span.startswith(_USDT) or (span.startswith(_ERROR) and _NO_DEVICE in span and no_gpu())


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def without_kineto_noise() -> Iterator[None]:
    """Drop the `USDT:` lines Kineto writes to stderr at every profiler start and stop (its highest log level, above
    errors, so KINETO_LOG_LEVEL cannot hide them alone) and, where torch sees no GPU, the `gpuGetDeviceCount failed`
    error a CUDA build's Kineto logs once per process. Everything else written to file descriptor 2 meanwhile, by any
    thread or library, passes through as it is written (a progress bar's carriage returns included)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter (a daemon closed it): profile as is
        yield
        return
    # Asked only when Kineto could not count the devices (no CUDA call otherwise, so nothing here can poison a fork).
    no_gpu = functools.cache(lambda: not torch.cuda.is_available())
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        held = b""
        while chunk := os.read(read, 1 << 16):
            now, held = _split_noise(held + chunk, no_gpu)
            _write_all(saved, now)
        os.close(read)
        if not _is_noise(held, no_gpu):
            _write_all(saved, held)

    thread = threading.Thread(target=pump, name="without-kineto-noise", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's write end: the pump reads to its end and stops
        thread.join(timeout=5)
        if not thread.is_alive():  # else a child started meanwhile holds the pipe: the pump goes on writing to saved
            os.close(saved)


def _activities(device: torch.device) -> list:
    """What torch.profiler records on `device`: CPU operators, and GPU kernels on CUDA."""
    cuda = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    return [torch.profiler.ProfilerActivity.CPU, *cuda]


def make_profiler(device: torch.device) -> torch.profiler.profile:
    return torch.profiler.profile(activities=_activities(device), record_shapes=False, with_stack=False)


def _intervals(events, names) -> list[tuple[str, float, float]]:
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.name in names and e.device_type == DeviceType.CPU]


KERNEL_TABLE_COLUMNS = ("phase", "kernel", "calls_per_step", "total_s", "call_mean_s", "share_of_phase",
                        "share_of_step", "is_matmul")


def kernel_table(prof: torch.profiler.profile, device: torch.device, num_steps: int) -> pd.DataFrame:
    """One row per (phase, kernel): calls per step, total time over the profiled steps (`total_s`) and per call
    (`call_mean_s`), share of the phase's and step's time."""
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
    rows = [(next((name for name, s, t in phases if s <= e.time_range.start <= t), "other"), e.name, dur(e))
            for e in work]
    df = pd.DataFrame(rows, columns=["phase", "kernel", "time_us"])
    if df.empty:
        return pd.DataFrame(columns=list(KERNEL_TABLE_COLUMNS))
    agg = df.groupby(["phase", "kernel"], as_index=False).agg(calls=("time_us", "size"), total_us=("time_us", "sum"))
    phase_total = agg.groupby("phase")["total_us"].transform("sum")
    agg["calls_per_step"] = agg["calls"] / max(num_steps, 1)
    agg["total_s"] = agg["total_us"] / 1e6
    agg["call_mean_s"] = agg["total_us"] / agg["calls"] / 1e6
    agg["share_of_phase"] = agg["total_us"] / phase_total
    agg["share_of_step"] = agg["total_us"] / agg["total_us"].sum()
    agg["is_matmul"] = agg["kernel"].map(is_matmul)
    agg = agg.sort_values(["phase", "total_us"], ascending=[True, False]).reset_index(drop=True)
    return agg[list(KERNEL_TABLE_COLUMNS)]


def matmul_share(table: pd.DataFrame) -> dict[str, float]:
    """Share of kernel time spent in matrix multiplies, per phase and for the whole step."""
    out = {}
    for phase, part in table.groupby("phase"):
        out[f"matmul_share_{phase}"] = float(part.loc[part.is_matmul, "total_s"].sum() / part["total_s"].sum())
    if not table.empty:
        out["matmul_share_step"] = float(table.loc[table.is_matmul, "total_s"].sum() / table["total_s"].sum())
    return out


def export_trace(prof: torch.profiler.profile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def format_top(table: pd.DataFrame, top: int = 8) -> str:
    """Markdown: the top kernels of each phase (the table's seconds shown as ms per step and us per call)."""
    if {"total_s", "call_mean_s"} <= set(table.columns):
        table = table.assign(total_ms=1e3 * table["total_s"], call_mean_us=1e6 * table["call_mean_s"]).drop(
            columns=["total_s", "call_mean_s"])
    parts = []
    for phase, part in table.groupby("phase", sort=False):
        head = part.head(top).assign(kernel=lambda d: d.kernel.str.slice(0, 70))
        parts.append(f"**{phase}**\n\n" + head.drop(columns="phase").to_markdown(index=False, floatfmt=".3g"))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------- overlap
def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `intervals` as sorted, disjoint (start, end) pairs."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def overlap(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> tuple[float, float]:
    """(total communication time, part of it during which some compute interval also runs), same units.
    Overlapping intervals of either kind count once."""
    comm, compute = merge_intervals(comm), merge_intervals(compute)
    total = sum(e - s for s, e in comm)
    shared, j = 0.0, 0
    for s, e in comm:
        while j < len(compute) and compute[j][1] <= s:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < e:
            shared += min(e, compute[k][1]) - max(s, compute[k][0])
            k += 1
    return total, shared


def device_kernels(events) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every GPU kernel in `events` (`profiler.events()`): device-side events,
    without memory copies/sets and without the `gpu_user_annotation` ranges that mirror CPU annotations."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("Memcpy", "Memset"))]


def is_nccl(kernel_name: str) -> bool:
    return "nccl" in kernel_name.lower()


def kernel_intervals(events) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(NCCL kernel intervals, other GPU kernel intervals) in microseconds, from `profiler.events()`."""
    comm, compute = [], []
    for name, start, end in device_kernels(events):
        (comm if is_nccl(name) else compute).append((start, end))
    return comm, compute


@contextlib.contextmanager
def dynamo_guard_log() -> Iterator[io.StringIO]:
    """Collect the guards Dynamo installs for what compiles inside the block (torch's "guards" log, as
    `TORCH_LOGS=guards` prints it): every one is checked at each call of the compiled code, the call's cache lookup.
    Turns torch's other logs back to their defaults on exit."""
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    torch._logging.set_logs(guards=True)
    logger = logging.getLogger("torch._dynamo.guards.__guards")  # the "guards" artifact's logger
    logger.addHandler(handler)
    try:
        yield text
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)


def guard_kinds(log: str) -> dict[str, int]:
    """{guard kind: count} in a `dynamo_guard_log` text (TYPE_MATCH, TENSOR_MATCH, ...), most frequent first."""
    return dict(collections.Counter(re.findall(r"\+- ([A-Z_]+):", log)).most_common())


def cpu_op_time(events, name: str) -> tuple[int, float]:
    """(calls, total inclusive host time in microseconds) of the CPU events called `name`, e.g.
    `c10d::allreduce_` (issuing one all-reduce, whatever the backend) or `torch::autograd::AccumulateGrad`
    (accumulating one gradient, post-accumulate-grad hooks included)."""
    spans = [e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CPU and e.name == name]
    return len(spans), float(sum(spans))


@dataclass
class StepProfile:
    """What `profile_steps` recorded: the events of the active steps and what they contain."""

    events: list
    """`FunctionEvent`s of the active steps (CPU operators and, on CUDA, GPU kernels)."""
    device: torch.device
    trace_path: Path | None = None

    @property
    def num_cpu_ops(self) -> int:
        return sum(1 for e in self.events if e.device_type == DeviceType.CPU)

    @property
    def num_kernels(self) -> int:
        return len(device_kernels(self.events))

    @property
    def num_nccl_kernels(self) -> int:
        return sum(1 for name, _, _ in device_kernels(self.events) if is_nccl(name))

    def status(self, expect_nccl: bool) -> str:
        """`ok`; `cpu` (no GPU: no kernels to measure, by design); or what is missing: `empty` (no events at
        all), `no_gpu_kernels` (CPU events only on a CUDA device: the CUDA activity was not recorded),
        `no_nccl_kernels` (GPU kernels but no NCCL kernel where communication was expected)."""
        if not self.events:
            return "empty"
        if self.device.type != "cuda":
            return "cpu"
        if self.num_kernels == 0:
            return "no_gpu_kernels"
        if expect_nccl and self.num_nccl_kernels == 0:
            return "no_nccl_kernels"
        return "ok"


def profile_steps(step: Callable[[], object], device: torch.device, *, warmup: int = 1, active: int = 1,
                  trace_path: str | Path | None = None) -> StepProfile:
    """Run `warmup + active` calls of `step` under torch.profiler (a device synchronisation after each) and
    return the events of the `active` ones; write their Chrome trace to `trace_path` (gzipped if it ends in
    `.gz`). The warm-up steps absorb the profiler's own start-up cost (CUPTI initialisation)."""
    if warmup < 1 or active < 1:
        raise ValueError(f"warmup ({warmup}) and active ({active}) must be >= 1")
    if device.type == "cuda" and not torch.profiler.kineto_available():
        raise RuntimeError("torch.profiler cannot record GPU kernels in this process: kineto is not available")
    path = Path(trace_path) if trace_path is not None else None
    recorded: dict[str, object] = {}
    # Kineto leaves CUPTI attached after the profiler stops unless TEARDOWN_CUPTI=1 (read when it stops), and an
    # attached CUPTI taxes every later CUDA call of the process: the trials a sweep times after a profiled one
    # would pay for it (pytorch/pytorch#144455). No CUDA graphs here, so the teardown is safe.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")

    def ready(prof: torch.profiler.profile) -> None:
        recorded["events"] = list(prof.events())
        if path is not None:
            export_trace(prof, path)

    schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1)
    with warnings.catch_warnings():
        # Emitted by some torch versions on every profiler start, whatever the schedule; `repeat=1` makes
        # the recorded cycle the last one, and `ready` reads it before anything could clear it.
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        with without_kineto_noise(), torch.profiler.profile(activities=_activities(device), schedule=schedule,
                                                            on_trace_ready=ready) as prof:
            for _ in range(warmup + active):
                step()
                synchronize(device)
                prof.step()
    if "events" not in recorded:
        raise RuntimeError(f"the profiler finished without completing its recording cycle ({warmup} warm-up + "
                           f"{active} active steps)")
    return StepProfile(events=recorded["events"], device=device, trace_path=path)
