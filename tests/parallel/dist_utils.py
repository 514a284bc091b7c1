"""Run a function on N gloo (or NCCL, one GPU each) ranks in fresh processes: the test harness for `parallel/`.

    from tests.parallel.dist_utils import run_ranks

    def _check(rank, world_size, n):                 # module-level, so the spawned children can unpickle it
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)                            # the default group is initialised (gloo, CPU)
        return t.tolist()

    results = run_ranks(_check, 2, 3)                 # [rank0's return, rank1's return]

Each gloo rank is a process forked from a forkserver that imported torch once
(`raysys.cluster.rank.rank_process_context`; never forked from the test process itself, which may hold Ray or OpenMP
threads; an NCCL rank is spawned), with the caller's environment. The ranks rendezvous through a `FileStore` in a fresh
temporary directory, so no port is ever chosen and parallel test runs cannot collide. `fn(rank, world_size, *args)` runs
with the group as the default process group (`torch.distributed.group.WORLD`); its return value must be picklable
(tensors are fine: they are pickled by value, not shared).

An exception on any rank is re-raised in the caller as `RankError` carrying every failing rank's
traceback; a rank that dies without reporting (os._exit, segfault) is reported with its exit code as soon
as it is noticed; ranks still running after `timeout_s` are reported as hung. In every case all ranks are
killed: nothing is left running when `run_ranks` returns or raises.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raysys.cluster.rank import adopt_environ, die_with_parent, rank_process_context

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds each failing rank's traceback."""


def _crash_path(store_path: str, rank: int) -> str:
    return f"{store_path}.rank{rank}.crash"


def _worker(rank: int, world_size: int, store_path: str, fn: Callable[..., Any], args: tuple,
            results: "mp.Queue", num_threads: int, backend: str, environ: dict[str, str]) -> None:
    die_with_parent()  # a killed test run (CI timeout, Ctrl-C twice) leaves no rank blocked in a collective
    adopt_environ(environ)
    torch.set_num_threads(num_threads)
    # A segfault or abort reports nothing through the queue: faulthandler leaves every thread's Python stack here.
    crash_log = open(_crash_path(store_path, rank), "w")
    faulthandler.enable(file=crash_log, all_threads=True)
    try:
        store = dist.FileStore(store_path, world_size)
        if backend == "nccl":  # one GPU per rank; deterministic cuBLAS needs its workspace set before CUDA starts
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                    device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle, not torch's shared-memory reduction: the tensors must outlive this process.
        payload = pickle.dumps(out)
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, payload))


def _died(proc: "mp.Process", crash_path: str) -> str:
    """The failure of a rank that exited without a result: its exit code and, after a crash, its stacks."""
    message = f"process exited with code {proc.exitcode} without a result"
    try:
        with open(crash_path) as f:
            stacks = f.read().strip()
    except OSError:
        stacks = ""
    return f"{message}\n{stacks}" if stacks else message


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results ordered by rank.

    `backend="nccl"`: rank r runs on GPU r (its current device) in an NCCL group.

    `fn` must be a module-level function. Raises `RankError` if any rank raises, exits without a result,
    or if the ranks have not all finished after `timeout_s` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} must be gloo or nccl")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl with {world_size} ranks needs {world_size} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    ctx = rank_process_context("cuda" if backend == "nccl" else "cpu")
    results = ctx.Queue()
    num_threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world_size))  # as ProcessGang
    with tempfile.TemporaryDirectory(prefix="dist_utils_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker,
                             args=(rank, world_size, store_path, fn, args, results, num_threads, backend,
                                   dict(os.environ)),
                             name=f"rank{rank}", daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        failures: dict[int, str] = {}

        def pending() -> list[int]:
            return [r for r in range(world_size) if r not in outputs and r not in failures]

        def collect(wait_s: float) -> bool:
            try:
                rank, ok, payload = results.get(timeout=wait_s)
            except queue_mod.Empty:
                return False
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
            return True

        deadline = time.monotonic() + timeout_s
        try:
            while pending() and not failures and time.monotonic() < deadline:
                if not collect(0.2):
                    # A rank that died without reporting (os._exit, segfault, OOM kill) leaves the others
                    # blocked in a collective: record it and stop waiting.
                    for r in pending():
                        if not procs[r].is_alive() and not collect(0.5) and r in pending():
                            failures[r] = f"process exited with code {procs[r].exitcode} without a result"
            if failures:
                # Give the survivors a moment to report their own errors (often the more telling ones).
                grace = time.monotonic() + 2.0
                while pending() and time.monotonic() < grace:
                    collect(0.1)
            timed_out = not failures
            for r in pending():
                procs[r].join(timeout=0.1)
                failures[r] = (_died(procs[r], _crash_path(store_path, r)) if not procs[r].is_alive() else
                               f"no result after {timeout_s:.0f} s (hung?)" if timed_out else
                               "killed after another rank failed")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            results.close()
    if failures:
        detail = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        name = getattr(fn, "__name__", fn)
        raise RankError(f"{len(failures)} of {world_size} ranks failed running {name}:\n{detail}")
    return [outputs[r] for r in range(world_size)]
