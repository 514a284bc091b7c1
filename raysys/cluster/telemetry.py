"""A running study in the Ray dashboard: each rank's memory and utilisation, and the study's progress.

Ray's metrics API records three gauges, exported in Prometheus format by every node's metrics agent beside Ray's
own tags: `ray_raysys_rank_memory_bytes{sweep, rank, device}` (the caching allocator's bytes, or the process RSS
on CPU), `ray_raysys_rank_utilization_percent{sweep, rank, device}` (GPU utilisation, or CPU time / wall time) and
`ray_raysys_sweep_trials{sweep, state}` (total | done | failed). A `RankMonitor` samples in a daemon thread of each
rank actor; `SweepProgress` is set by `run_sweep` after every trial. Rank tasks are named
`<sweep>.rank<r>:[<i>/<n>] <trial config>`. Outside a Ray worker the gauges are not created and `sample()` works.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from typing import Any

import torch

RANK_TAGS = ("sweep", "rank", "device")


def _ray_ready() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:
        return False


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        return None


def _gpu_utilization(device: torch.device) -> float | None:
    """The utilisation (%) of the GPU `device`: torch's NVML query, else nvidia-smi by the GPU's UUID, else None."""
    with contextlib.suppress(Exception):  # pynvml missing, or NVML unavailable
        return float(torch.cuda.utilization(device))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        out = subprocess.run([smi, f"--id=GPU-{uuid.removeprefix('GPU-')}", "--query-gpu=utilization.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
        return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
    except Exception:  # no UUID in this torch, a driver hiccup: no sample this time
        return None


class RankMonitor:
    """Samples one rank's memory and utilisation every `interval_s` seconds into Ray gauges (see module doc)."""

    def __init__(self, sweep: str, rank: int, device: torch.device | str, *, interval_s: float = 2.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s ({interval_s}) must be > 0")
        self.device, self.interval_s = torch.device(device), interval_s
        self.tags = {"sweep": sweep, "rank": str(rank), "device": str(self.device)}
        self._gauges = None
        if _ray_ready():
            from ray.util.metrics import Gauge

            self._gauges = (
                Gauge("raysys_rank_memory_bytes", "CUDA: bytes the rank's caching allocator holds; CPU: the rank "
                      "process's resident set", tag_keys=RANK_TAGS).set_default_tags(self.tags),
                Gauge("raysys_rank_utilization_percent", "CUDA: the GPU's utilisation; CPU: the rank process's CPU "
                      "time over wall time", tag_keys=RANK_TAGS).set_default_tags(self.tags))
        self._last = (time.monotonic(), sum(os.times()[:2]))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, float | None]:
        """`memory_bytes` and `utilization_percent` now (CPU: since the previous sample)."""
        if self.device.type == "cuda":
            return {"memory_bytes": float(torch.cuda.memory_reserved(self.device)),
                    "utilization_percent": _gpu_utilization(self.device)}
        now, cpu = time.monotonic(), sum(os.times()[:2])
        (then, cpu_then), self._last = self._last, (now, cpu)
        rss = _rss_bytes()
        return {"memory_bytes": None if rss is None else float(rss),
                "utilization_percent": 100.0 * (cpu - cpu_then) / (now - then) if now > then else None}

    def _loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # telemetry must never disturb the rank's work
                values = self.sample()
                if self._gauges is not None:
                    self._gauges[0].set(values["memory_bytes"])
                    self._gauges[1].set(values["utilization_percent"])
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> "RankMonitor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"raysys-monitor-rank{self.tags['rank']}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class SweepProgress:
    """The study's progress as the gauge `raysys_sweep_trials{sweep, state}` (total, done, failed), from the
    driver; a no-op when Ray is not running."""

    def __init__(self, sweep: str, total: int):
        self.sweep, self.total = sweep, total
        self._gauge: Any = None
        if _ray_ready():
            from ray.util.metrics import Gauge

            self._gauge = Gauge("raysys_sweep_trials", "trials of a running study, by state (total, done, failed)",
                                tag_keys=("sweep", "state"))
        self.update(0, 0)

    def update(self, done: int, failed: int) -> None:
        if self._gauge is None:
            return
        for state, value in (("total", self.total), ("done", done), ("failed", failed)):
            self._gauge.set(value, tags={"sweep": self.sweep, "state": state})
