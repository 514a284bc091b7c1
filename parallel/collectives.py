"""Collective-communication benchmark: all-reduce, all-gather, reduce-scatter and broadcast of float32 data.

`num_bytes` is the full tensor on each rank in every op (nccl-tests' "size": all-gather's total output,
reduce-scatter's total input), rounded down to a multiple of n float32 elements. Timing: `warmup` untimed calls, then
`iters` calls each timed by CUDA events (GPU) or `perf_counter` (CPU), after a barrier; a trial's time is the max
over ranks of the mean (`aggregate`). Bandwidths in GB/s (1e9 B/s): algbw = num_bytes / time, busbw = algbw * factor
(2(n-1)/n all-reduce, (n-1)/n all-gather and reduce-scatter, 1 broadcast), as nccl-tests compute them.
Invariant (`verify_collective`, on the benchmark's buffers after timing): with rank r's input filled with r + 1,
all-reduce gives n(n+1)/2 everywhere, all-gather slice j = j + 1, reduce-scatter n(n+1)/2, broadcast 1.
See docs/parallel.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_BYTES_PER_ELEMENT = 4  # float32

# torch 2.13 names the tensor-in/tensor-out collectives *_single (the old names warn on every call).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks (nccl-tests)."""
    _check_op(op)
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0}[op]


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"collective {op!r} must be one of {OPS}")


@dataclass
class Buffers:
    """The tensors of one collective: `input` and `output` (the same tensor for in-place ops)."""

    op: str
    input: torch.Tensor
    output: torch.Tensor

    @property
    def num_bytes(self) -> int:
        """The message size as nccl-tests counts it: the larger of the two buffers."""
        return max(self.input.numel(), self.output.numel()) * _BYTES_PER_ELEMENT


def make_buffers(op: str, num_bytes: int, world_size: int, device: torch.device | str) -> Buffers:
    """Float32 zero buffers for a `num_bytes` message, rounded down to a multiple of `world_size` elements."""
    _check_op(op)
    if num_bytes < _BYTES_PER_ELEMENT * world_size:
        raise ValueError(f"num_bytes ({num_bytes}) must hold at least one float32 per rank ({world_size} ranks)")
    numel = num_bytes // _BYTES_PER_ELEMENT // world_size * world_size
    full = torch.zeros(numel, dtype=torch.float32, device=device)
    if op == "all_gather":
        return Buffers(op, torch.zeros(numel // world_size, dtype=torch.float32, device=device), full)
    if op == "reduce_scatter":
        return Buffers(op, full, torch.zeros(numel // world_size, dtype=torch.float32, device=device))
    return Buffers(op, full, full)


def run_collective(buffers: Buffers, group: dist.ProcessGroup) -> None:
    """Issue one collective on `buffers` over `group` (synchronous from the host's point of view)."""
    op = buffers.op
    if op == "all_reduce":
        dist.all_reduce(buffers.input, group=group)
    elif op == "all_gather":
        all_gather_single(buffers.output, buffers.input, group=group)
    elif op == "reduce_scatter":
        reduce_scatter_single(buffers.output, buffers.input, group=group)
    elif op == "broadcast":
        dist.broadcast(buffers.input, src=dist.get_global_rank(group, 0), group=group)
    else:
        _check_op(op)


def verify_collective(buffers: Buffers, group: dist.ProcessGroup) -> None:
    """Fill rank r's input with r + 1, run the collective once, check the closed-form result (invariant above)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    buffers.input.fill_(r + 1.0)
    run_collective(buffers, group)
    out = buffers.output
    # Compare without materialising an expected tensor as large as the message (1 GB on the GPU).
    if buffers.op in ("all_reduce", "reduce_scatter"):
        expected = torch.tensor([n * (n + 1) / 2], device=out.device)
    elif buffers.op == "all_gather":
        expected = (torch.arange(n, device=out.device, dtype=out.dtype) + 1)[:, None]
    else:
        expected = torch.ones(1, device=out.device)
    view = out.view(n, -1) if buffers.op == "all_gather" else out
    if not bool(view.eq(expected).all()):
        bad = int((view != expected).flatten().nonzero()[0])
        raise RuntimeError(f"{buffers.op} on rank {r}/{n}: element {bad} is {out[bad].item()}, which breaks the "
                           f"invariant (inputs filled with rank + 1)")
    buffers.input.zero_()
    buffers.output.zero_()


def benchmark_collective(op: str, num_bytes: int, group: dist.ProcessGroup, device: torch.device | str, *,
                         warmup: int = 5, iters: int = 20, verify: bool = True) -> dict:
    """This rank's timing of `iters` calls of `op` on a `num_bytes` message (after `warmup` untimed calls)."""
    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and iters ({iters}) >= 1")
    device = torch.device(device)
    n = dist.get_world_size(group)
    buffers = make_buffers(op, num_bytes, n, device)
    for _ in range(warmup):
        run_collective(buffers, group)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends):
            start.record()
            run_collective(buffers, group)
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    else:
        dist.barrier(group=group)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run_collective(buffers, group)
            times.append(time.perf_counter() - t0)
    if verify:
        verify_collective(buffers, group)
    return {"op": op, "num_bytes": buffers.num_bytes, "world_size": n, "time_mean_s": statistics.fmean(times),
            "time_std_s": statistics.stdev(times) if len(times) > 1 else 0.0, "time_min_s": min(times),
            "iters": iters, "verified": verify}


def aggregate(per_rank: Sequence[dict]) -> dict:
    """One trial's metrics from every rank's `benchmark_collective` result: slowest rank's mean, bandwidths."""
    if not per_rank:
        raise ValueError("aggregate needs at least one rank's result")
    first = per_rank[0]
    if any((r["op"], r["num_bytes"], r["world_size"]) != (first["op"], first["num_bytes"], first["world_size"])
           for r in per_rank):
        raise ValueError("per-rank results describe different collectives")
    slowest = max(per_rank, key=lambda r: r["time_mean_s"])
    t = slowest["time_mean_s"]
    algbw = first["num_bytes"] / t / 1e9
    return {"num_bytes": first["num_bytes"], "time_mean_s": t, "time_std_s": slowest["time_std_s"],
            "time_min_s": min(r["time_min_s"] for r in per_rank),
            "rank_spread_ratio": t / min(r["time_mean_s"] for r in per_rank),
            "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(first["op"], first["world_size"]),
            "verified": all(r["verified"] for r in per_rank)}
