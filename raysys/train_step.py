"""One training step on a gang rank, split into phases and timed robustly; and the memory hygiene between trials.

Shared by the data-parallel sweeps (`sweeps/ddp.py`, `sweeps/sharded_optimizer.py`, `sweeps/fsdp.py`), whose
trials run one after another in the same rank processes (one Ray actor per rank for the whole sweep).

Timing (`time_steps`): warm-up steps, then timed steps with a device synchronisation around each (mean,
std, median, min). Inside a step CUDA events split the device time into PHASES, and host clock readings
give the time the Python thread spent issuing each phase: a phase whose host time is close to its device
time is host-bound (launch overhead, autocast casts, Python hooks), so its time depends on how fast the CPU
runs, not on the GPU work. Noise control:
  * Python's cyclic garbage collector is paused over warm-up and timed steps: a full collection in a rank
    process that imported torch, Ray and pandas walks some 2-4 x 10^5 objects (0.13-0.4 s on the 2-core CI
    machine), a stall a host-bound step absorbs whole; training frameworks disable automatic collection
    for the same reason. `gc_objects_per_step` counts what the steps left for the collector.
  * Adaptive length: after `steps` timed steps, while the 95% confidence half-width of the median
    (from the median absolute deviation) exceeds `rel_tol` of the median, a few more steps are timed, up
    to `max_steps`. The ranks agree on the decision (an all-reduce) so their collectives stay matched.
  * Diagnostics per trial: CUDA allocator retries and cudaMalloc calls during the timed steps (an
    allocator near the memory limit frees its cache and synchronises the device inside the step), CPU time
    of the process and involuntary context switches of the main thread per step (CPU contention), torch
    threads and the CPUs the process may run on.

`paired_steps` times a step against a reference step interleaved in blocks (ABBA), for ratios that a drifting
host speed does not bias.

`compile_blocks` compiles every TransformerBlock's forward (the sweeps' `--compile`), and `time_steps` counts
the graphs Dynamo compiled during warm-up and during the timed steps (which must be none).

`nccl_group` builds the NCCL group with a capped number of CTAs per collective that `sweeps/ddp.py
--nccl-max-ctas` reduces gradients over.

Memory hygiene (`TrialScope`): the allocated CUDA memory and the number of live `nn.Parameter`s are
recorded when a trial starts and after it ended and its objects were released (`gc.collect()`,
`torch.cuda.empty_cache()`); `*_after - *_before` is what the trial leaked into the next one. A failing
trial's traceback frames are cleared so the exception does not keep the trial's model alive.
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
import traceback
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from raysys.device import autocast, free_memory, synchronize
from raysys.model import TransformerBlock, cross_entropy

PHASES = ("forward", "backward", "comm_wait", "optimizer")
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


class TrainStep:
    """zero_grad -> forward + loss -> backward -> finish_gradient_synchronization -> optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch, dtype: str, device: torch.device):
        self.model, self.optimizer, self.batch, self.dtype, self.device = model, optimizer, batch, dtype, device
        self.finish = getattr(model, "finish_gradient_synchronization", lambda: None)

    def gradients(self, marks: Marks) -> None:
        """Everything before the optimizer step: afterwards every rank holds the averaged gradients."""
        x, y = self.batch
        self.optimizer.zero_grad(set_to_none=True)
        marks.mark()
        with autocast(self.device, self.dtype):
            loss = cross_entropy(self.model(x), y)
        marks.mark()
        loss.backward()
        marks.mark()
        self.finish()
        marks.mark()

    def __call__(self) -> Marks:
        """One step; the marks bound PHASES (read their durations after the device is synchronised)."""
        marks = Marks(self.device)
        self.gradients(marks)
        self.optimizer.step()
        marks.mark()
        return marks


# ---------------------------------------------------------------------------------------------------- timing
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


def host_info() -> dict[str, float | str]:
    """Where this rank's process runs: torch threads, CPUs it may use, OMP_NUM_THREADS, load average."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    return {"torch_threads": torch.get_num_threads(), "cpu_affinity_count": len(affinity) or math.nan,
            "host_cpu_count": os.cpu_count() or math.nan, "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan}


def time_steps(step: TrainStep, warmup: int, steps: int, *, max_steps: int | None = None,
               rel_tol: float = DEFAULT_REL_TOL, process_group=None) -> dict[str, float]:
    """Time `steps` to `max_steps` synchronised steps after `warmup` untimed ones (see the module docstring).

    Returns `step_ms` (mean), `step_ms_std`, `step_ms_median`, `step_ms_min`, `step_ms_max`, `timed_steps`,
    `step_ms_ci_rel` (the median's relative 95% half-width), per phase `<phase>_ms` (mean) and
    `<phase>_ms_median` (device time) and `host_<phase>_ms` (median host time), `host_step_ms` (median
    time for `step()` to return, before the synchronisation), and the diagnostics. With `max_steps >
    steps` every rank of `process_group` must call this together (they agree on when to stop).
    """
    max_steps = steps if max_steps is None else max_steps
    if warmup < 0 or steps < 2 or max_steps < steps:
        raise ValueError(f"warmup ({warmup}) must be >= 0, steps ({steps}) >= 2 and max_steps ({max_steps}) "
                         f">= steps")
    device = step.device
    totals, host_totals, phases, host_phases = [], [], [], []
    graphs0 = dynamo_graphs()
    with paused_gc() as collected:
        for _ in range(warmup):
            step()
        synchronize(device)
        graphs1 = dynamo_graphs()
        alloc0, cpu0, csw0 = _allocator_counts(device), time.process_time(), _thread_ctx_switches()
        target = steps
        while True:
            while len(totals) < target:
                start = time.perf_counter()
                marks = step()
                issued = time.perf_counter()
                synchronize(device)
                totals.append((time.perf_counter() - start) * 1e3)
                host_totals.append((issued - start) * 1e3)
                phases.append(marks.durations_ms())
                host_phases.append(marks.host_ms())
            if len(totals) >= max_steps or not _any_rank(median_ci_rel(totals) > rel_tol, device, process_group):
                break
            target = min(max_steps, len(totals) + max(2, steps // 2))
        cpu_s, csw = time.process_time() - cpu0, _thread_ctx_switches() - csw0
        alloc1 = _allocator_counts(device)
    n = len(totals)
    out = {"step_ms": statistics.fmean(totals), "step_ms_std": statistics.stdev(totals),
           "step_ms_median": statistics.median(totals), "step_ms_min": min(totals), "step_ms_max": max(totals),
           "step_ms_ci_rel": median_ci_rel(totals), "timed_steps": n, "host_step_ms": statistics.median(host_totals)}
    for i, name in enumerate(PHASES):
        out[f"{name}_ms"] = statistics.fmean(p[i] for p in phases)
        out[f"{name}_ms_median"] = statistics.median(p[i] for p in phases)
        out[f"host_{name}_ms"] = statistics.median(p[i] for p in host_phases)
    out["cpu_ms_per_step"] = cpu_s * 1e3 / n
    out["ctx_switches_per_step"] = csw / n
    out["gc_objects_per_step"] = collected["collected"] / (warmup + n)
    # Compiled blocks (compile_blocks): graphs compiled while warming up, and during the timed steps, which must
    # be 0 (else a guard failed: the steps timed a recompilation, or blocks that fell back to eager).
    out["graphs_compiled_warmup"], out["graphs_compiled_timed"] = graphs1 - graphs0, dynamo_graphs() - graphs1
    for key, value in alloc1.items():
        out[f"{key}_timed"] = value - alloc0[key]
    out.update(host_info())
    return out


def paired_steps(step: TrainStep, reference: TrainStep, rounds: int, block: int = 3) -> dict[str, float]:
    """Time `step` against `reference` interleaved in this process: `rounds` rounds, each one block of `block`
    timed steps of each (after one untimed step that re-warms caches after the switch), in ABBA order (`step`
    first in even rounds, second in odd ones), so that a host whose speed drifts over seconds, as a shared VM's
    does, slows both alike. Per round, the ratio of the two blocks' median steps; the result is their median.

    Returns `paired_rounds`, `paired_ratio` (median over rounds of step / reference), `paired_ratio_min`,
    `paired_ratio_max`, `paired_step_ms` and `paired_reference_ms` (medians over rounds of the block medians).
    Every rank of a gang must call this with the same arguments (the steps' collectives stay matched).
    """
    if not isinstance(rounds, int) or rounds < 1 or not isinstance(block, int) or block < 2:
        raise ValueError(f"rounds ({rounds!r}) must be an int >= 1 and block ({block!r}) an int >= 2")
    ratios, mine, theirs = [], [], []
    for r in range(rounds):
        order = (step, reference) if r % 2 == 0 else (reference, step)
        medians = {id(s): time_steps(s, 1, block)["step_ms_median"] for s in order}
        mine.append(medians[id(step)])
        theirs.append(medians[id(reference)])
        ratios.append(mine[-1] / theirs[-1])
    return {"paired_rounds": rounds, "paired_ratio": statistics.median(ratios), "paired_ratio_min": min(ratios),
            "paired_ratio_max": max(ratios), "paired_step_ms": statistics.median(mine),
            "paired_reference_ms": statistics.median(theirs)}


# ---------------------------------------------------------------------------------------------------- compile
def compile_blocks(model: nn.Module, block_type: type[nn.Module] = TransformerBlock, *,
                   backend: str = "inductor") -> int:
    """Compile the `forward` of every `block_type` module of `model` in place (`torch.compile` with `backend`);
    returns how many. Before wrapping the model, so DDP / FSDP see the same modules and parameters, and after any
    `copy.deepcopy` of it (a copy's `forward` would still be the original block's).

    `forward`, not `Module.compile()` (which compiles `_call_impl`, hooks included): the module hooks a wrapper
    puts on a block (FSDP's and FSDP2's gathers around it, parallel/fsdp.py) stay eager, outside the graph; hooks
    on modules inside a block (FSDP's compute-dtype casts) are traced into it. The blocks share one code object,
    so Dynamo compiles once per distinct setting (autocast dtype, grad mode, hooks) and every block reuses it;
    `time_steps`' warm-up steps absorb the compilation. Gradient hooks on parameters (DDP's) fire after the
    block's compiled backward, i.e. per block instead of per parameter (torch's DDP hooks alike).
    """
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    if not blocks:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no {block_type.__name__} module to compile")
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (0 if nothing was ever compiled)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------------- groups
def nccl_group(world_size: int, max_ctas: int | None = None, *, high_priority: bool = False) -> dist.ProcessGroup:
    """A new NCCL group of ranks 0..world_size-1 whose communicator runs each collective on at most `max_ctas`
    CTAs (thread blocks, one SM each; None: NCCL's choice): collectives overlapping compute take fewer SMs from
    it, and run slower. `high_priority`: the group's collectives run on a high-priority CUDA stream, so the GPU
    schedules their CTAs ahead of queued compute CTAs (torch's FSDP1 gathers on such streams for the same reason:
    a prefetch stuck behind a long matmul is late for the layer that needs it).
    Every rank must call this (it is a collective); destroy the group with `dist.destroy_process_group`."""
    if max_ctas is not None and (not isinstance(max_ctas, int) or max_ctas < 1):
        raise ValueError(f"max_ctas ({max_ctas!r}) must be None or an int >= 1")
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        raise ValueError(f"an NCCL group (max_ctas {max_ctas}, high_priority {high_priority}) needs an initialised "
                         f"NCCL default group, not {dist.get_backend() if dist.is_initialized() else 'none'}")
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas is not None:
        options.config.max_ctas = max_ctas
    return dist.new_group(ranks=list(range(world_size)), backend="nccl", pg_options=options)


# ---------------------------------------------------------------------------------------------------- memory
def live_parameters() -> int:
    """`nn.Parameter` objects alive in this process (a model a finished trial leaked shows up here)."""
    # issubclass(type(...)), not isinstance: Parameter's metaclass makes isinstance probe attributes of every
    # object (slow, and it trips deprecation warnings of objects like torch.distributed.reduce_op).
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), nn.Parameter))


def release(model: nn.Module) -> None:
    """Unregister a wrapper's gradient hooks (`remove_hooks()`, where it has one) before it is dropped."""
    remove = getattr(model, "remove_hooks", None)
    if callable(remove):
        remove()


class TrialScope:
    """`with TrialScope(device) as scope: metrics = run_trial()`, then `metrics.update(scope.metrics)`.

    Records `memory_allocated_before_bytes`, `memory_reserved_before_bytes` and `live_parameters_before` on
    entry (after a collection), the same `*_after` on exit once everything the trial made is released; on
    the CPU the memory figures are NaN (no allocator statistics) and the parameter count tells. On an
    exception the traceback's finished frames are cleared (their locals would keep the trial's tensors
    alive as long as the exception object lives) before the memory is freed, and any SM carve-out is reset.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.metrics: dict[str, float] = {}

    def _record(self, when: str) -> None:
        free_memory(self.device)
        cuda = self.device.type == "cuda"
        self.metrics[f"memory_allocated_{when}_bytes"] = (float(torch.cuda.memory_allocated(self.device))
                                                          if cuda else math.nan)
        self.metrics[f"memory_reserved_{when}_bytes"] = (float(torch.cuda.memory_reserved(self.device))
                                                         if cuda else math.nan)
        self.metrics[f"live_parameters_{when}"] = live_parameters()

    def __enter__(self) -> "TrialScope":
        self._record("before")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            traceback.clear_frames(tb)
            # A trial that failed mid-step may have left a matmul SM carve-out set (parallel/carveout.py): it is
            # process-wide, and the next trial in this rank process must not inherit it.
            torch._C._set_sm_carveout_experimental(None)
        self._record("after")
