"""parallel/collectives.py on gloo ranks (no Ray): values against plain-torch references, timing records,
bandwidth arithmetic; and the `run_ranks` harness itself (errors and dead ranks surface, nothing hangs)."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch
import torch.distributed as dist

from parallel import collectives
from parallel.collectives import (OPS, aggregate, benchmark_collective, bus_factor, make_buffers,
                                  run_collective, verify_collective)
from tests.parallel.dist_utils import RankError, run_ranks


def _inputs(world_size: int, numel: int) -> list[torch.Tensor]:
    """Every rank's input, reproducible in the parent for the reference (non-integer values, odd size)."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(numel, generator=gen) for _ in range(world_size)]


def _collectives(rank: int, world_size: int, numel: int) -> dict:
    x = _inputs(world_size, numel)[rank]
    out = {}
    for op in OPS:
        buffers = make_buffers(op, numel * 4, world_size, "cpu")
        buffers.input.copy_(x[: buffers.input.numel()])  # all_gather sends the first 1/n of it
        run_collective(buffers, dist.group.WORLD)
        out[op] = buffers.output.clone()
    out["bench"] = [benchmark_collective(op, 4096, dist.group.WORLD, "cpu", warmup=1, iters=3) for op in OPS]
    # verify_collective must notice a "collective" that communicates nothing.
    real, collectives.run_collective = collectives.run_collective, lambda buffers, group: None
    try:
        verify_collective(make_buffers("all_reduce", 64, world_size, "cpu"), dist.group.WORLD)
        out["verify_broken"] = "no error"
    except RuntimeError as exc:
        out["verify_broken"] = str(exc)
    finally:
        collectives.run_collective = real
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_torch_reference(world_size):
    numel = 222  # not a multiple of 4: make_buffers rounds the message down to 220 elements for 4 ranks
    results = run_ranks(_collectives, world_size, numel)
    xs = _inputs(world_size, numel)
    full = numel // world_size * world_size
    chunk = full // world_size
    total = torch.stack([x[:full] for x in xs]).sum(0)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["all_reduce"], total, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out["all_gather"], torch.cat([x[:chunk] for x in xs]), rtol=0, atol=0)
        torch.testing.assert_close(out["reduce_scatter"], total[rank * chunk:(rank + 1) * chunk], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out["broadcast"], xs[0][:full], rtol=0, atol=0)
        assert "breaks the invariant" in out["verify_broken"], out["verify_broken"]

    for i, op in enumerate(OPS):  # timing records of every rank, and their aggregation
        records = [out["bench"][i] for out in results]
        assert all(r["op"] == op and r["num_bytes"] == 4096 and r["iters"] == 3 and r["verified"] for r in records)
        assert all(0 < r["time_min_s"] <= r["time_mean_s"] for r in records)
        metrics = aggregate(records)
        slowest = max(r["time_mean_s"] for r in records)
        assert metrics["time_mean_s"] == pytest.approx(slowest)
        assert metrics["algbw_GBps"] == pytest.approx(4096 / slowest / 1e9)
        assert metrics["busbw_GBps"] == pytest.approx(metrics["algbw_GBps"] * bus_factor(op, world_size))


def test_bus_factor_nccl_tests_conventions():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("broadcast", 6) == 1.0
    with pytest.raises(ValueError, match="'gather'"):
        bus_factor("gather", 2)


def test_make_buffers_sizes():
    b = make_buffers("all_gather", 1000, 6, "cpu")  # 250 floats -> 246 (multiple of 6); each rank sends 41
    assert (b.input.numel(), b.output.numel(), b.num_bytes) == (41, 246, 984)
    b = make_buffers("reduce_scatter", 1000, 4, "cpu")
    assert (b.input.numel(), b.output.numel(), b.num_bytes) == (248, 62, 992)
    b = make_buffers("all_reduce", 4000, 2, "cpu")
    assert b.input is b.output and b.num_bytes == 4000
    with pytest.raises(ValueError, match="at least one float32 per rank"):
        make_buffers("all_reduce", 4, 2, "cpu")
    # nccl-tests' size: the full per-rank tensor, so one size is the same buffer in every op
    for op in OPS:
        b = make_buffers(op, 2**16, 4, "cpu")
        assert b.num_bytes == 2**16 and max(b.input.numel(), b.output.numel()) * 4 == 2**16
        assert min(b.input.numel(), b.output.numel()) * 4 == (2**16 if op in ("all_reduce", "broadcast") else 2**14)


def test_aggregate_rejects_mixed_records():
    a = {"op": "all_reduce", "num_bytes": 8, "world_size": 2, "time_mean_s": 1.0, "time_std_s": 0.0,
         "time_min_s": 1.0, "verified": True}
    with pytest.raises(ValueError, match="different collectives"):
        aggregate([a, {**a, "num_bytes": 16}])
    with pytest.raises(ValueError, match="at least one"):
        aggregate([])


# ---- the harness (tests/parallel/dist_utils.py) that every distributed test here relies on
def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
    return rank


def _exit_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def _segfault_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        faulthandler._sigsegv()
    dist.barrier()
    return rank


@pytest.mark.multiproc
def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(RankError, match="boom on rank 1"):
        run_ranks(_raise_on_rank1, 2)


@pytest.mark.multiproc
def test_run_ranks_reports_a_dead_rank():
    with pytest.raises(RankError, match="exited with code 3"):
        run_ranks(_exit_on_rank1, 2, timeout_s=60)


@pytest.mark.multiproc
def test_run_ranks_reports_where_a_rank_crashed():
    with pytest.raises(RankError, match=r"(?s)exited with code -11.*Segmentation fault.*_segfault_on_rank1"):
        run_ranks(_segfault_on_rank1, 2, timeout_s=60)
