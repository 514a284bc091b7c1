"""One rank of a gang: the process-group bootstrap shared by Ray actors (`raysys.cluster.gang`) and plain processes
(`raysys.cluster.mp_gang`).

A launcher decides each rank's `RankSpec` (ranks, rendezvous address, backend, visible and used GPUs, `env`);
`init_rank(spec)` runs in the rank's process, sets the torchrun-style environment and `env`, selects the device,
initialises the default process group (NCCL on CUDA, gloo on CPU) and returns the `RankContext` trials receive.
`nccl_group` builds a further NCCL group with its own options; `BaseGang` is the interface both launchers
implement. Invariants: CUDA_VISIBLE_DEVICES is set before CUDA starts; NVLink multicast stays off; NCCL errors are
handled asynchronously, so a dead peer fails collectives after the timeout instead of hanging.
"""

from __future__ import annotations

import abc
import datetime as _dt
import math
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Self

import torch
import torch.distributed as dist

from raysys.measure.device import machine_memory_bytes, synchronize

# The GPU hosts require NVLink multicast off; set in every rank's environment (Ray runtime env and in-process).
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A dead or stuck peer must surface as an error after the process-group timeout, not as a hang.
RANK_ENV = {**MULTICAST_OFF_ENV, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
DEVICES = ("auto", "cuda", "cpu")
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest timeout a gang (and its process group) takes, a week (longer ones overflow timers)."""


def check_seconds(name: str, value: Any, maximum: float = MAX_TIMEOUT_S) -> float:
    """`value` as a float if it is a finite number of seconds in (0, maximum], else a one-line ValueError naming
    `name` (a flag or an argument) and the rule."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0
            or value > maximum):
        raise ValueError(f"{name} ({value!r}) must be a finite number of seconds in (0, {maximum:g}]")
    return float(value)


class PlacementInfeasible(ValueError):
    """The cluster (or this machine) can never hold the requested gang - not: it is busy now."""


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything one rank needs to join its gang; built by the launcher, sent to the rank's process."""

    rank: int
    """Global rank: ranks are ordered by node, then by GPU."""
    world_size: int
    """Number of ranks in the gang."""
    local_rank: int
    """Index of this rank among the ranks of its node."""
    local_world_size: int
    """Number of ranks on this rank's node."""
    node_rank: int
    """Index of this rank's node among the gang's nodes."""
    master_addr: str
    """Address of rank 0's node (the TCPStore rendezvous)."""
    master_port: int
    """A free port on rank 0's node."""
    device_type: str
    """`cuda` or `cpu`."""
    device_index: int | None = None
    """CUDA device index within the process's CUDA_VISIBLE_DEVICES (None on CPU)."""
    visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES to set before CUDA starts (None keeps what the launcher gave the process)."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective that waits longer than this fails."""
    num_threads: int = 1
    """torch intra-op threads of this rank (the CPUs reserved for it)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables, set before the process group starts (they override the process's own)."""

    def __post_init__(self) -> None:
        check_rank_env(self.env)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank ({self.rank}) must be in [0, world_size={self.world_size})")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type {self.device_type!r} must be 'cuda' or 'cpu'")
        if self.device_type == "cuda" and self.device_index is None:
            raise ValueError("a cuda rank needs a device_index")
        check_seconds("timeout_s", self.timeout_s)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


@dataclass
class RankContext:
    """What a trial function receives on every rank: its place in the gang and the initialised group."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    device: torch.device
    """cuda:<local index> or cpu."""
    backend: str
    """"nccl" or "gloo"."""
    process_group: dist.ProcessGroup
    """The gang's default group (already initialised)."""
    local_world_size: int = 1

    def barrier(self) -> None:
        if self.backend == "nccl":  # without device_ids NCCL guesses the device and warns
            dist.barrier(group=self.process_group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.process_group)

    def synchronize(self) -> None:
        """Wait for this rank's queued device work (a no-op on CPU)."""
        synchronize(self.device)


class BaseGang(abc.ABC):
    """What every gang launcher implements: `world_size` rank processes joined in one process group, each holding
    a `RankContext` between calls. `raysys.cluster.gang.Gang` (Ray actors) and `raysys.cluster.mp_gang.ProcessGang`
    (local processes) are the two; a caller (`raysys.cluster.sweep.run_sweep`) needs only this interface:

        with launcher(2, device="cpu", name="demo") as gang:   # start(): resolve the device, place, join
            per_rank = gang.run(fn, 1024)                      # fn(ctx, 1024) on every rank, ordered by rank

    Invariants: `device` is "cuda" or "cpu" once started (`backend` "nccl" or "gloo"); `ranks` holds one dict per
    rank (at least `rank` and `device_name`); a call that fails, or a start that fails, marks the gang `broken`
    (survivors may be stuck in a collective): `call` then refuses, and the caller shuts it down and builds a new
    one; `shutdown` leaves no rank behind, whatever happened.
    """

    gpu_visibility: str = "shared"
    """How a node's gang GPUs are visible to its ranks (`raysys.cluster.gang.GPU_VISIBILITY`)."""

    def __init__(self, world_size: int, *, device: str, name: str, timeout_s: float,
                 env: Mapping[str, str] | None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size ({world_size!r}) must be an int >= 1")
        if device not in DEVICES:
            raise ValueError(f"device {device!r} must be one of {DEVICES}")
        check_seconds("timeout_s", timeout_s)
        self.env = dict(env or {})
        check_rank_env(self.env)
        self.world_size, self.name, self.timeout_s, self.requested_device = world_size, name, timeout_s, device
        self.device = ""                     # resolved in start(): "cuda" or "cpu"
        self.backend = ""
        self.ranks: list[dict] = []          # per rank: rank, device name, and what the launcher knows
        self.broken = False

    # -- what a launcher provides
    @abc.abstractmethod
    def _resolve_device(self) -> str:
        """The device type ("cuda" or "cpu") `requested_device` means to this launcher."""

    @abc.abstractmethod
    def _check_placement(self) -> None:
        """Raise `PlacementInfeasible` when the gang can never be placed."""

    @abc.abstractmethod
    def _start(self) -> None:
        """Start the rank processes, join them in one process group and fill `ranks`."""

    @property
    @abc.abstractmethod
    def running(self) -> bool:
        """Whether rank processes are up (between `start` and `shutdown`)."""

    @abc.abstractmethod
    def _submit(self, fn: Callable[..., Any], args: tuple, kwargs: dict, label: str) -> Any:
        """Serialise the call (and, where the launcher queues it, queue it); a failure here leaves the gang
        healthy (no rank has started it)."""

    @abc.abstractmethod
    def _collect(self, request: Any, label: str, timeout_s: float) -> list:
        """Run or await the submitted call on every rank; the results ordered by rank; the first failing rank,
        a dead one or the deadline raises at once."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the process group (if healthy) and end every rank process; idempotent."""

    # -- lifecycle and calls, the same for every launcher
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> Self:
        self.device = self._resolve_device()
        self.backend = "nccl" if self.device == "cuda" else "gloo"
        self._check_placement()
        try:
            self._start()
        except BaseException:
            self.broken = True
            self.shutdown()
            raise
        return self

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list:
        """`fn(ctx, *args, **kwargs)` on every rank; the results ordered by rank."""
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
             label: str | None = None, timeout_s: float | None = None) -> list:
        """`run` with a task label (`<name>:<label>` in errors; Ray shows it in the dashboard) and a timeout
        (default `timeout_s`)."""
        if not self.running:
            raise RuntimeError(f"gang {self.name!r} is not running (use it in a `with` block)")
        if self.broken:
            raise RuntimeError(f"gang {self.name!r} is broken by an earlier failure; build a new one")
        label = label or getattr(fn, "__name__", "fn")
        if timeout_s is not None:
            check_seconds("timeout_s", timeout_s)
        request = self._submit(fn, tuple(args), dict(kwargs or {}), label)
        try:
            return self._collect(request, label, self.timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.broken = True
            raise


def check_rank_env(env: Mapping[str, str]) -> None:
    """Raise ValueError unless `env` maps variable names to strings and keeps NVLink multicast off."""
    for key, value in env.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"environment variable name {key!r} must match [A-Za-z_][A-Za-z0-9_]*")
        if not isinstance(value, str):
            raise ValueError(f"environment variable {key}={value!r} must have a str value")
        if key in MULTICAST_OFF_ENV and value != MULTICAST_OFF_ENV[key]:
            raise ValueError(f"{key}={value} is not allowed: NVLink multicast must stay off on these GPU hosts "
                             f"({key}={MULTICAST_OFF_ENV[key]})")


CPU_RANKS_PER_CORE = 4
"""gloo ranks mostly wait on sockets: up to this many may share one core."""
MIN_CPU_RANKS = 8
"""Any machine may run this many CPU ranks, so a laptop can rehearse the world sizes of an 8-GPU host."""
RANK_PROCESS_BYTES = 256 * 2**20
"""Memory one rank process needs at least: the interpreter with torch imported and a joined gloo group."""


def max_cpu_ranks(num_cpus: float, memory_bytes: int | None = None) -> int:
    """The most CPU (gloo) ranks a machine with `num_cpus` CPUs and `memory_bytes` of RAM may run at once:
    `CPU_RANKS_PER_CORE` per CPU but at least `MIN_CPU_RANKS`, and no more than fit in its memory at
    `RANK_PROCESS_BYTES` each (memory unknown: no memory bound)."""
    by_cpu = max(MIN_CPU_RANKS, int(num_cpus * CPU_RANKS_PER_CORE))
    return by_cpu if memory_bytes is None else max(1, min(by_cpu, memory_bytes // RANK_PROCESS_BYTES))


def local_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def check_local_cpu_ranks(world_size: int) -> None:
    """Raise `PlacementInfeasible` (a ValueError) before anything is spawned when this machine cannot run
    `world_size` CPU rank processes (`max_cpu_ranks` of its CPUs and memory)."""
    cpus, memory = local_cpus(), machine_memory_bytes()
    limit = max_cpu_ranks(cpus, memory)
    if world_size > limit:
        mem = f" and {memory / 2**30:.0f} GiB" if memory else ""
        raise PlacementInfeasible(f"asked for {world_size} CPU ranks on this machine (multiprocessing launch); its "
                                  f"{cpus} CPUs{mem} allow at most {limit} (max({MIN_CPU_RANKS}, "
                                  f"{CPU_RANKS_PER_CORE} per CPU), {RANK_PROCESS_BYTES // 2**20} MiB each)")


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pandas")
"""What the forkserver imports once, so that each rank process it forks starts with it (pandas: every study's trial
module imports it, half a second a rank). Only installed packages: the server imports them with its own sys.path
(Python 3.11's forkserver does not take the driver's)."""


def rank_process_context(device_type: str = "cpu"):
    """The multiprocessing context that starts local rank processes of `device_type`: for CPU ranks `forkserver`
    (with `PRELOAD` imported in the server) where the platform has one; else, and for CUDA ranks, `spawn` (a CUDA
    rank must not descend from a process whose CUDA driver may be initialised). A forked rank calls `adopt_environ`
    with the driver's `os.environ` of that moment (the server's is the driver's when the server started)."""
    import multiprocessing as std_mp

    import torch.multiprocessing as mp

    if device_type == "cuda" or "forkserver" not in std_mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def adopt_environ(environ: Mapping[str, str]) -> None:
    """Make this process's environment `environ` (the driver's, as a spawned process would have inherited it)."""
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when the one that started it dies, however it dies (SIGKILL
    included), so no rank waits out a collective's timeout as an orphan. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call: nobody is left to notice
        os._exit(1)
    # Forked by a forkserver (`rank_process_context`), the parent is the server, which exits once no process holds
    # the write end of its "alive" pipe: the driver, and every process it forked, this one included. Let go of it, so
    # that the server, hence this process, ends with the driver.
    forkserver = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if forkserver is not None and forkserver._forkserver_pid is None and forkserver._forkserver_alive_fd is not None:
        os.close(forkserver._forkserver_alive_fd)
        forkserver._forkserver_alive_fd = None


def free_port() -> int:
    """A TCP port that is free on this host right now (the OS picks it; never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_rank(spec: RankSpec) -> RankContext:
    """Join the gang described by `spec` from inside the rank's process; returns its `RankContext`."""
    if spec.visible_devices is not None:
        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA is already initialised in this process; CUDA_VISIBLE_DEVICES would be ignored")
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.update(spec.env)
    os.environ.update({
        "RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size), "NODE_RANK": str(spec.node_rank),
        "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
    })
    torch.set_num_threads(max(1, spec.num_threads))
    if spec.device_type == "cuda":
        if spec.device_index >= torch.cuda.device_count():
            raise RuntimeError(f"rank {spec.rank} wants cuda:{spec.device_index} but sees {torch.cuda.device_count()} "
                               f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        device = torch.device("cuda", spec.device_index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        spec.backend, init_method="env://", rank=spec.rank, world_size=spec.world_size,
        timeout=_dt.timedelta(seconds=spec.timeout_s),
        # Binding the device makes NCCL create its communicator now, not inside the first timed collective.
        device_id=device if spec.device_type == "cuda" else None,
    )
    return RankContext(rank=spec.rank, world_size=spec.world_size, local_rank=spec.local_rank,
                       node_rank=spec.node_rank, device=device, backend=spec.backend,
                       process_group=dist.group.WORLD, local_world_size=spec.local_world_size)


def destroy_rank() -> None:
    """Leave the gang: destroy the default process group if this process has one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def nccl_group(world_size: int, max_ctas: int | None = None, *, high_priority: bool = False) -> dist.ProcessGroup:
    """A new NCCL group of ranks 0..world_size-1 whose communicator runs each collective on at most `max_ctas`
    CTAs (one SM each; None: NCCL's choice). `high_priority`: its collectives run on a high-priority CUDA stream,
    scheduled ahead of queued compute. A collective: every rank calls it; destroy the group with
    `dist.destroy_process_group`."""
    if max_ctas is not None and (not isinstance(max_ctas, int) or max_ctas < 1):
        raise ValueError(f"max_ctas ({max_ctas!r}) must be None or an int >= 1")
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        raise ValueError(f"an NCCL group (max_ctas {max_ctas}, high_priority {high_priority}) needs an initialised "
                         f"NCCL default group, not {dist.get_backend() if dist.is_initialized() else 'none'}")
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas is not None:
        options.config.max_ctas = max_ctas
    return dist.new_group(ranks=list(range(world_size)), backend="nccl", pg_options=options)


def device_description(ctx: RankContext) -> str:
    """Human-readable device of a rank (`NVIDIA H200` or `cpu`), for result rows."""
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_name(ctx.device)
    return "cpu"
