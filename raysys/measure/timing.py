"""Timing: training steps timed between device synchronisations, their statistics, and kernel timing.

`time_steps(step, warmup, steps, max_steps=...)` runs untimed then timed steps with a synchronisation after each
(mean, std, median, min, in seconds); `Marks` split a step into PHASES (device time from CUDA events, host time
from the clock). The garbage collector is paused while timing; the number of timed steps grows while the median's
95% confidence half-width exceeds `rel_tol` (the ranks of a gang agree); diagnostics (allocator retries, CPU time,
Dynamo recompiles) come with the row. `paired_steps` / `paired_speedups` time against a reference in ABBA blocks.
`PhaseTimer` times named phases of `raysys.training.bench`. A callable: `do_bench` (Triton's, CUDA events),
`do_bench_agreed` (its procedure on every rank of a gang), `time_calls` (synchronised calls), and for the kernel
studies `median_s` / `kernel_time` (do_bench on CUDA, the wall clock elsewhere). Every result is in seconds.

    metrics = time_steps(TrainStep(model, optimizer, (x, y), "bf16", device), warmup=2, steps=10, max_steps=30)
    metrics["step_median_s"], metrics["forward_mean_s"], metrics["host_forward_median_s"]
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import statistics
import sys
import time
import timeit
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from raysys.measure.device import synchronize

PHASES = ("forward", "backward", "comm_wait", "optimizer")
MAX_STEPS = 100_000
"""The most warm-up or timed steps (or calls, or paired rounds) a trial takes; the checks state it, so a typo
(`--steps 1000000000000`) is a one-line error, not a run that never ends."""
DEFAULT_REL_TOL = 0.005


class Marks:
    """Phase boundaries inside one step: the host clock always, and CUDA events on a GPU (recorded on the
    current stream, no synchronisation inside the step)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host: list[float] = []
        self.events: list[torch.cuda.Event] = []

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def host_ms(self) -> list[float]:
        """Time the host spent between consecutive marks."""
        return [(b - a) * 1e3 for a, b in zip(self.host, self.host[1:])]

    def durations_ms(self) -> list[float]:
        """Time between consecutive marks on the device (the host's on the CPU); read after a synchronisation."""
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return self.host_ms()


class TimedStep(Protocol):
    """What `time_steps` times: a step on `device` that returns the `Marks` bounding its PHASES."""

    device: torch.device

    def __call__(self) -> Marks: ...


@contextlib.contextmanager
def paused_gc() -> Iterator[dict]:
    """Keep the cyclic collector off inside the block; afterwards collect the youngest generation, which then
    holds exactly the objects made inside (nothing promoted them), and count the garbage found
    (`out["collected"]`: objects in reference cycles the block created)."""
    out = {"collected": 0}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield out
    finally:
        out["collected"] = gc.collect(0)
        if was_enabled:
            gc.enable()


def median_ci_rel(samples: list[float]) -> float:
    """95% confidence half-width of the median of `samples`, relative to the median (robust: from the
    median absolute deviation, so one slow step does not dominate it). inf for fewer than 3 samples."""
    if len(samples) < 3:
        return math.inf
    median = statistics.median(samples)
    mad = statistics.median(abs(x - median) for x in samples)
    sigma = 1.4826 * mad                                 # the standard deviation, were the samples normal
    return 1.96 * 1.2533 * sigma / math.sqrt(len(samples)) / median if median > 0 else math.inf


def _any_rank(flag: bool, device: torch.device, process_group) -> bool:
    """`flag` or-ed over the ranks of `process_group` (just `flag` without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    return bool(t.item() > 0)


def _allocator_counts(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"allocator_retries": stats.get("num_alloc_retries", 0),
            "cuda_mallocs": stats.get("num_device_alloc", math.nan)}


def _thread_ctx_switches() -> float:
    who = getattr(resource, "RUSAGE_THREAD", None)     # Linux: the calling thread only
    return float(resource.getrusage(who).ru_nivcsw) if who is not None else math.nan


AUTOGRAD_THREAD_PREFIX = "pt_autograd_"
"""The name torch gives the autograd engine's device threads (`pt_autograd_<device>`): a backward of CUDA tensors,
with its gradient hooks (DDP's, FSDP's), runs on one of them while the calling thread waits."""


def _thread_cpu_clocks(prefix: str) -> list[int]:
    """CPU-time clock ids of this process's threads whose name starts with `prefix` (Linux; [] elsewhere)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    clocks = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended
            continue
        if name.startswith(prefix):
            clocks.append((~int(tid) << 3) | 6)  # MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED), as pthread_getcpuclockid
    return clocks


class IssueClock:
    """CPU time spent issuing steps: the calling thread's plus that of the threads named `prefix` (by default the
    autograd device threads, where a GPU backward and its hooks run; `thread_time()` alone would miss them). The
    threads are found once, when made (after a warm-up step has started them); `threads` says how many."""

    def __init__(self, prefix: str = AUTOGRAD_THREAD_PREFIX):
        self._clocks = _thread_cpu_clocks(prefix)
        self.threads = len(self._clocks)

    def __call__(self) -> float:
        total = time.thread_time()
        for clock in self._clocks:
            with contextlib.suppress(OSError):  # the thread ended: what it spent no longer counts on either side
                total += time.clock_gettime(clock)
        return total


def host_info() -> dict[str, float | str]:
    """Where this rank's process runs: torch threads, CPUs it may use, OMP_NUM_THREADS, load average, and the size of
    torch's NCCL flight recorder as the process sees it (`TORCH_FR_BUFFER_SIZE`, else its old name
    `TORCH_NCCL_TRACE_BUFFER_SIZE`; '' for torch's default), which adds host time to every NCCL process-group call."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    return {"torch_threads": torch.get_num_threads(), "cpu_affinity_count": len(affinity) or math.nan,
            "host_cpu_count": os.cpu_count() or math.nan, "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan,
            "nccl_trace_buffer_env": os.environ.get("TORCH_FR_BUFFER_SIZE",
                                                    os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", ""))}


def time_steps(step: TimedStep, warmup: int, steps: int, *, max_steps: int | None = None,
               rel_tol: float = DEFAULT_REL_TOL, process_group=None) -> dict[str, float]:
    """Time `steps` to `max_steps` synchronised steps after `warmup` untimed ones (see the module docstring).

    Returns, in seconds (`raysys.results.records`' column convention), `step_mean_s`, `step_std_s`, `step_median_s`,
    `step_min_s`, `step_max_s`, `timed_steps`, `step_median_ci_rel` (the median's relative 95% half-width), per
    phase `<phase>_mean_s` and `<phase>_median_s` (device time) and `host_<phase>_median_s` (host time),
    `host_step_median_s` (time for `step()` to return, before the synchronisation), `host_cpu_step_median_s` (the
    CPU time spent in `step()` by this thread and by torch's autograd device threads, `IssueClock`, their number
    `host_cpu_threads`: the host's issuing work, not the time it was descheduled or waited), and
    the diagnostics. With `max_steps > steps` every rank of `process_group` must call this together (they agree on
    when to stop).
    """
    max_steps = steps if max_steps is None else max_steps
    if warmup < 0 or steps < 2 or max_steps < steps:
        raise ValueError(f"warmup ({warmup}) must be >= 0, steps ({steps}) >= 2 and max_steps ({max_steps}) "
                         f">= steps")
    device = step.device
    totals, host_totals, host_cpu, phases, host_phases = [], [], [], [], []
    graphs0 = dynamo_graphs()
    with paused_gc() as collected:
        for _ in range(warmup):
            step()
        synchronize(device)
        graphs1 = dynamo_graphs()
        issue_clock = IssueClock()
        alloc0, cpu0, csw0 = _allocator_counts(device), time.process_time(), _thread_ctx_switches()
        target = steps
        while True:
            while len(totals) < target:
                cpu_start = issue_clock()
                start = time.perf_counter()
                marks = step()
                issued = time.perf_counter()
                cpu_issued = issue_clock()
                synchronize(device)
                totals.append((time.perf_counter() - start) * 1e3)
                host_totals.append((issued - start) * 1e3)
                host_cpu.append((cpu_issued - cpu_start) * 1e3)
                phases.append(marks.durations_ms())
                host_phases.append(marks.host_ms())
            if len(totals) >= max_steps or not _any_rank(median_ci_rel(totals) > rel_tol, device, process_group):
                break
            target = min(max_steps, len(totals) + max(2, steps // 2))
        cpu_s, csw = time.process_time() - cpu0, _thread_ctx_switches() - csw0
        alloc1 = _allocator_counts(device)
    n = len(totals)
    # samples are milliseconds (CUDA events' unit); the row's columns are seconds
    out = {"step_mean_s": statistics.fmean(totals) / 1e3, "step_std_s": statistics.stdev(totals) / 1e3,
           "step_median_s": statistics.median(totals) / 1e3, "step_min_s": min(totals) / 1e3,
           "step_max_s": max(totals) / 1e3, "step_median_ci_rel": median_ci_rel(totals), "timed_steps": n,
           "host_step_median_s": statistics.median(host_totals) / 1e3,
           "host_cpu_step_median_s": statistics.median(host_cpu) / 1e3, "host_cpu_threads": 1 + issue_clock.threads}
    for i, name in enumerate(PHASES):
        out[f"{name}_mean_s"] = statistics.fmean(p[i] for p in phases) / 1e3
        out[f"{name}_median_s"] = statistics.median(p[i] for p in phases) / 1e3
        out[f"host_{name}_median_s"] = statistics.median(p[i] for p in host_phases) / 1e3
    out["cpu_time_per_step_s"] = cpu_s / n
    out["ctx_switches_per_step"] = csw / n
    out["gc_objects_per_step"] = collected["collected"] / (warmup + n)
    # Compiled blocks (compile_blocks): graphs compiled while warming up, and during the timed steps, which must
    # be 0 (else a guard failed: the steps timed a recompilation, or blocks that fell back to eager).
    out["graphs_compiled_warmup"], out["graphs_compiled_timed"] = graphs1 - graphs0, dynamo_graphs() - graphs1
    for key, value in alloc1.items():
        out[f"{key}_timed"] = value - alloc0[key]
    out.update(host_info())
    return out


def paired_steps(step: TimedStep, reference: TimedStep, rounds: int, block: int = 3) -> dict[str, float]:
    """Time `step` against `reference` interleaved: `rounds` rounds, each one block of `block` timed steps of each
    (after one untimed re-warming step), in ABBA order, so a drifting host slows both alike.

    Returns `paired_rounds`, `paired_ratio` (median over rounds of the blocks' median step / reference),
    `paired_ratio_min`, `paired_ratio_max`, `paired_ratio_ci_rel` (its relative 95% half-width, `median_ci_rel`;
    inf under 3 rounds), `paired_step_median_s`, `paired_reference_median_s`, `paired_host_cpu_ratio` and its
    `_ci_rel` (the same for `host_cpu_step_median_s`), `paired_allocator_retries` / `paired_cuda_mallocs` (over both
    sides' timed steps; NaN off a GPU). Every rank of a gang calls this with the same arguments.
    """
    if not isinstance(rounds, int) or rounds < 1 or not isinstance(block, int) or block < 2:
        raise ValueError(f"rounds ({rounds!r}) must be an int >= 1 and block ({block!r}) an int >= 2")
    ratios, cpu_ratios, mine, theirs = [], [], [], []
    allocator = {"paired_allocator_retries": 0.0, "paired_cuda_mallocs": 0.0}
    for r in range(rounds):
        order = (step, reference) if r % 2 == 0 else (reference, step)
        timed = {id(s): time_steps(s, 1, block) for s in order}
        for side in timed.values():
            allocator["paired_allocator_retries"] += side.get("allocator_retries_timed", math.nan)
            allocator["paired_cuda_mallocs"] += side.get("cuda_mallocs_timed", math.nan)
        mine.append(timed[id(step)]["step_median_s"])
        theirs.append(timed[id(reference)]["step_median_s"])
        ratios.append(mine[-1] / theirs[-1])
        cpu = [timed[id(s)]["host_cpu_step_median_s"] for s in (step, reference)]
        if cpu[1] > 0:  # (a clock too coarse to see the reference's issue time leaves its round out)
            cpu_ratios.append(cpu[0] / cpu[1])
    return {"paired_rounds": rounds, "paired_ratio": statistics.median(ratios), "paired_ratio_min": min(ratios),
            "paired_ratio_max": max(ratios), "paired_ratio_ci_rel": median_ci_rel(ratios),
            "paired_step_median_s": statistics.median(mine),
            "paired_reference_median_s": statistics.median(theirs),
            "paired_host_cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else math.nan,
            "paired_host_cpu_ratio_ci_rel": median_ci_rel(cpu_ratios), **allocator}


PAIRED_REP_MS = 200
"""Milliseconds of calls per side and round when kernels are paired with `paired_speedups` (`do_bench`'s rep)."""


def paired_speedups(ours: dict[str, Callable[[], object]], base: dict[str, Callable[[], object]], rounds: int,
                    bench: Callable[[Callable[[], object]], float], base_name: str) -> dict[str, float]:
    """Per mode (the dicts' keys), `rounds` rounds of `bench(ours[mode])` and `bench(base[mode])` back to back, the
    order swapped every round: `paired_speedup_<mode>_vs_<base_name>` is the median of the rounds' base / ours
    time ratios and `paired_speedup_<mode>_ci_rel` its 95% confidence half-width (relative): a drift of the GPU's
    speed cancels in the ratio. `paired_steps` is the same for training steps."""
    out: dict[str, float] = {"paired_rounds": float(rounds)}
    for mode in ours:
        ratios = []
        for r in range(rounds):
            if r % 2 == 0:  # a tuple's items are evaluated left to right: this round's order
                t_ours, t_base = bench(ours[mode]), bench(base[mode])
            else:
                t_base, t_ours = bench(base[mode]), bench(ours[mode])
            ratios.append(t_base / t_ours)
        out[f"paired_speedup_{mode}_vs_{base_name}"] = statistics.median(ratios)
        out[f"paired_speedup_{mode}_ci_rel"] = median_ci_rel(ratios)
    return out


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (0 if nothing was ever compiled)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


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
    """Median and 20/80% quantiles (seconds) of `fn` with `triton.testing.do_bench` (CUDA events)."""
    import triton.testing

    q20, median, q80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    return {"time_median_s": median / 1e3, "time_p20_s": q20 / 1e3, "time_p80_s": q80 / 1e3}


def time_calls(fn: Callable[[], object], device: torch.device, *, warmup: int, steps: int) -> dict[str, float]:
    """`warmup` untimed calls, then `steps` timed ones, each between device synchronisations (CUDA events on a GPU,
    the wall clock elsewhere): `time_median_s`, `time_min_s`, `time_max_s` and `timed_steps`."""
    for _ in range(warmup):
        fn()
    times = []  # ms, as CUDA events give them
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"time_median_s": statistics.median(times) / 1e3, "time_min_s": min(times) / 1e3,
            "time_max_s": max(times) / 1e3, "timed_steps": steps}


def do_bench_agreed(fn: Callable[[], object], device: torch.device, *, warmup_ms: float, rep_ms: float,
                    agree: Callable[[float], float]) -> dict:
    """`triton.testing.do_bench`'s procedure on every rank of a gang (the L2 cache cleared before each timed call),
    with the call-count estimate agreed (`agree`: the slowest rank's) so every rank makes the same calls and their
    collectives pair up. CUDA events on a GPU, the wall clock elsewhere. Returns `time_median_s`, `time_p20_s`,
    `time_p80_s` (seconds) and `timed_steps`."""
    cuda = device.type == "cuda"
    cache = torch.empty(int(256e6) if cuda else 2**20, dtype=torch.int8, device=device)  # Triton's 256 MB

    def timed(n: int) -> list[float]:
        if cuda:
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for start, end in pairs:
                cache.zero_()
                start.record()
                fn()
                end.record()
            synchronize(device)
            return [start.elapsed_time(end) for start, end in pairs]
        out = []
        for _ in range(n):
            cache.zero_()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    fn()
    synchronize(device)
    estimate_ms = agree(sum(timed(5)) / 5)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    times = torch.tensor(timed(max(1, int(rep_ms / estimate_ms))), dtype=torch.float64)
    q20, median, q80 = torch.quantile(times, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return {"time_median_s": median / 1e3, "time_p20_s": q20 / 1e3, "time_p80_s": q80 / 1e3, "timed_steps": len(times)}


def median_s(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100,
             cpu_calls: int = 3) -> float:
    """Median seconds of `fn`: `triton.testing.do_bench`'s median on CUDA (CUDA events, the L2 flushed between
    calls), else the wall clock's median of `cpu_calls` calls after one untimed call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) / 1e3
    fn()
    return statistics.median(timeit.timeit(fn, number=1) for _ in range(cpu_calls))


def kernel_time(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100
                ) -> dict[str, float]:
    """`do_bench`'s median and 20/80% quantiles (seconds) on CUDA; elsewhere one wall-clock call (a smoke test)
    gives all three."""
    if device.type == "cuda":
        return do_bench(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return {"time_median_s": seconds, "time_p20_s": seconds, "time_p80_s": seconds}


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else float("nan")
