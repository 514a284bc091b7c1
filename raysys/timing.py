"""Timing helpers: synchronised phase timers and `triton.testing.do_bench` wrappers.

Training steps are timed with `timeit.default_timer` around each phase, with a device synchronisation at the
end of every phase, after warm-up steps that are not recorded (handout 2.1.3). Kernels are timed with
`do_bench` (CUDA events, median of many repetitions).
"""

from __future__ import annotations

import statistics
import timeit
from dataclasses import dataclass, field
from typing import Callable

import torch

from raysys.device import synchronize


@dataclass
class PhaseTimer:
    """Collects per-step wall times of named phases (forward, backward, optimizer, ...)."""

    device: torch.device
    times: dict[str, list[float]] = field(default_factory=dict)
    recording: bool = True

    def time(self, phase: str, fn: Callable[[], object]):
        synchronize(self.device)
        start = timeit.default_timer()
        out = fn()
        synchronize(self.device)
        if self.recording:
            self.times.setdefault(phase, []).append(timeit.default_timer() - start)
        return out

    def summary(self) -> dict[str, float]:
        """`<phase>_mean_s`, `<phase>_std_s` per phase and the same for the whole `step`."""
        out: dict[str, float] = {}
        if not self.times:
            return out
        steps = [sum(ts) for ts in zip(*self.times.values())]
        for name, ts in {**self.times, "step": steps}.items():
            out[f"{name}_mean_s"] = statistics.fmean(ts)
            out[f"{name}_std_s"] = statistics.stdev(ts) if len(ts) > 1 else 0.0
        out["first_step_s"] = steps[0]
        return out


def do_bench(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> dict[str, float]:
    """Median and 20/80% quantiles (milliseconds) of `fn` with `triton.testing.do_bench` (CUDA events)."""
    import triton.testing

    q20, median, q80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    return {"median_ms": median, "p20_ms": q20, "p80_ms": q80}


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else float("nan")
