"""The planner's formulas (parallel/planner.py) against values derived by hand in the comments."""

from __future__ import annotations

import pandas as pd
import pytest

from parallel.planner import (FFNProblem, alternate_all_reduce_time, bandwidth_from_results, best_fsdp_tp, dp_cost,
                              fsdp_cost, fsdp_tp_continuous, fsdp_tp_cost, max_devices,
                              ring_all_gather_time, ring_all_reduce_time, ring_reduce_scatter_time, tp_cost)


def test_ring_collective_times():
    # S = 8e9 bytes, N = 4, W = 2e9 B/s: S/W = 4 s.
    # all-gather, reduce-scatter: (N-1)/N * 4 = 3 s; all-reduce: 2 * 3 = 6 s; alternate all-reduce: (N-1) * 4 = 12 s.
    assert ring_all_gather_time(8e9, 4, 2e9) == pytest.approx(3.0)
    assert ring_reduce_scatter_time(8e9, 4, 2e9) == pytest.approx(3.0)
    assert ring_all_reduce_time(8e9, 4, 2e9) == pytest.approx(6.0)
    assert alternate_all_reduce_time(8e9, 4, 2e9) == pytest.approx(12.0)
    assert ring_all_reduce_time(8e9, 1, 2e9) == 0.0  # one device: nothing to send
    with pytest.raises(ValueError, match="bandwidth"):
        ring_all_gather_time(1.0, 2, 0.0)


# B = 1024, D = 512, D_FF = 2048, b = 2, C = 1e12 FLOP/s, W = 1e9 B/s.
# One FFN matmul on the whole batch: 2 B D D_FF = 2 * 2^10 * 2^9 * 2^11 = 2^31 FLOPs.
# Weights 3 b D D_FF = 6 * 2^20 = 6291456 bytes; activations (B, D): b B D = 2^20 = 1048576 bytes.
P = FFNProblem(batch=1024, d_model=512, d_ff=2048, flops=1e12, bandwidth=1e9, bytes_per_element=2)


def test_dp_fsdp_tp_costs():
    # DP, N = 4: forward 3 matmuls on B/4 rows = 3 * 2^31 / 4; backward 6 matmuls (dz, dx via W1 and W2, dW1..dW3).
    # Backward all-reduce of the weight gradients: 2 * 3/4 * 6291456 / 1e9 = 9.437184e-3 s.
    dp = dp_cost(P, 4)
    assert dp.forward.flops == 3 * 2**31 / 4 and dp.backward.flops == 6 * 2**31 / 4
    assert dp.forward.comm_s == 0.0
    assert dp.backward.comm_s == pytest.approx(9.437184e-3)
    assert dp.backward.compute_s == pytest.approx(6 * 2**31 / 4 / 1e12)  # 3.221225472e-3 s
    assert not dp.backward.compute_bound  # 9.4 ms of all-reduce > 3.2 ms of matmuls
    # FSDP, N = 4: same FLOPs; forward all-gathers the weights, 3/4 * 6291456 / 1e9 = 4.718592e-3 s,
    # backward all-gathers again and reduce-scatters the gradients: twice that.
    fsdp = fsdp_cost(P, 4)
    assert fsdp.forward.flops == dp.forward.flops and fsdp.backward.flops == dp.backward.flops
    assert fsdp.forward.comm_s == pytest.approx(4.718592e-3)
    assert fsdp.backward.comm_s == pytest.approx(9.437184e-3)
    # TP, N = 4: W1, W2 column- and W3 row-parallel, so each device does 1/4 of every matmul on all B rows;
    # one all-reduce of y (forward) / dx (backward): 2 * 3/4 * 1048576 / 1e9 = 1.572864e-3 s each.
    tp = tp_cost(P, 4)
    assert tp.forward.flops == 3 * 2**31 / 4 and tp.backward.flops == 6 * 2**31 / 4
    assert tp.forward.comm_s == pytest.approx(1.572864e-3) and tp.backward.comm_s == pytest.approx(1.572864e-3)


def test_fsdp_tp_costs_overlapped_and_shared():
    # N_TP = 2, N_FSDP = 4, N = 8: forward FLOPs 3 * 2^31 / 8.
    # FSDP axis: all-gather of the TP shards, S = 6291456 / 2 = 3145728 bytes over 4: 3/4 * 3145728e-9 = 2.359296e-3 s.
    # TP axis: all-reduce of y on B/4 rows, S = 1048576 / 4 = 262144 bytes over 2: 2 * 1/2 * 262144e-9 = 2.62144e-4 s.
    # Overlapped axes: max = 2.359296e-3 s; shared links: sum = 2.62144e-3 s.
    over = fsdp_tp_cost(P, 2, 4, overlap=True)
    shared = fsdp_tp_cost(P, 2, 4, overlap=False)
    assert over.num_devices == 8 and over.forward.flops == 3 * 2**31 / 8
    assert over.forward.comm_s == pytest.approx(2.359296e-3)
    assert shared.forward.comm_s == pytest.approx(2.62144e-3)
    # Backward: the FSDP axis all-gathers and reduce-scatters (2 * 2.359296e-3), the TP axis all-reduces dx.
    assert over.backward.comm_s == pytest.approx(4.718592e-3)
    assert shared.backward.comm_s == pytest.approx(4.718592e-3 + 2.62144e-4)
    # N_TP = 1 is FSDP and N_FSDP = 1 is TP.
    assert fsdp_tp_cost(P, 1, 4).forward.comm_s == pytest.approx(fsdp_cost(P, 4).forward.comm_s)
    assert fsdp_tp_cost(P, 4, 1).forward.comm_s == pytest.approx(tp_cost(P, 4).forward.comm_s)


# B = 600, D = 64, D_FF = 200, b = 2, C = 1e12, W = 1e10: BW/C = 6, D_FF W / C = 2.
Q = FFNProblem(batch=600, d_model=64, d_ff=200, flops=1e12, bandwidth=1e10, bytes_per_element=2)


def test_largest_device_counts():
    # DP backward: 12 B D D_FF / (N C) >= 2 (N-1)/N * 3 b D D_FF / W  <=>  N - 1 <= 2 B W / (b C) = 6  ->  N_DP = 7,
    # exactly at the boundary (communication == compute).
    # FSDP: forward 6 B D F/(N C) >= (N-1)/N 3bDF/W and backward 12 B D F/(N C) >= 2 (N-1)/N 3bDF/W: the same, 7.
    # TP forward: 6 B D F/(N C) >= 2 (N-1)/N b B D/W  <=>  N - 1 <= 3 D_FF W/(b C) = 3  ->  4; backward: 6 -> 7.
    assert dp_cost(Q, 7).backward.comm_ratio == pytest.approx(1.0)
    assert max_devices(lambda n: dp_cost(Q, n).backward.compute_bound) == 7
    assert max_devices(lambda n: fsdp_cost(Q, n).forward.compute_bound) == 7
    assert max_devices(lambda n: fsdp_cost(Q, n).backward.compute_bound) == 7
    assert max_devices(lambda n: tp_cost(Q, n).forward.compute_bound) == 4
    assert max_devices(lambda n: tp_cost(Q, n).backward.compute_bound) == 7
    assert max_devices(lambda n: n <= 37) == 37 and max_devices(lambda n: True, limit=100) == 100


def test_best_fsdp_tp_split():
    # Overlapped axes, forward, exact ring factors: the FSDP condition (N_FSDP - 1) 3b D_FF <= 6 B D_FF W/C gives
    # N_FSDP <= 1 + 2BW/(bC) = 7 whatever N_TP; the TP condition 2b (N_TP - 1) <= 6 D_FF W / C gives N_TP <= 4.
    # So N = 28 at (N_TP, N_FSDP) = (4, 7).
    over = best_fsdp_tp(Q, overlap=True)
    assert (over.n_tp, over.n_fsdp) == (4, 7) and over.forward.compute_bound
    # Shared links: 3b D_FF (N_FSDP - 1) + 2b B (N_TP - 1) <= 6 B D_FF W / C, i.e. 1200 u + 2400 v <= 7200 with
    # u = N_FSDP - 1, v = N_TP - 1. Products: v=0 -> 1*7 = 7, v=1 -> 2*5 = 10, v=2 -> 3*3 = 9, v=3 -> 4*1 = 4.
    shared = best_fsdp_tp(Q, overlap=False)
    assert (shared.n_tp, shared.n_fsdp) == (2, 5)
    assert not fsdp_tp_cost(Q, 2, 6, overlap=False).forward.compute_bound
    # The handout's closed forms ((N-1)/N ~ 1): N_FSDP = 2BW/(bC) = 6, N_TP = 3 D_FF W/(bC) = 3, N = 18
    # = 6 B D_FF W^2 / (b^2 C^2) = 6 * 600 * 200 * 1e-4 / 4. Shared links: each axis halved, N = 4.5.
    assert fsdp_tp_continuous(Q, overlap=True) == pytest.approx({"n_fsdp": 6, "n_tp": 3, "n": 18})
    assert fsdp_tp_continuous(Q, overlap=False) == pytest.approx({"n_fsdp": 3, "n_tp": 1.5, "n": 4.5})


def test_problem_validation():
    with pytest.raises(ValueError, match="batch"):
        FFNProblem(batch=0, d_model=1, d_ff=1)
    with pytest.raises(ValueError, match="bandwidth"):
        FFNProblem(batch=1, d_model=1, d_ff=1, bandwidth=-1.0)
    with pytest.raises(ValueError, match="n_tp"):
        fsdp_tp_cost(Q, 0, 2)


def test_bandwidth_from_collectives_results(tmp_path):
    assert bandwidth_from_results(tmp_path) == []
    rows = [  # the largest all-reduce per world size, best launch, status ok only
        dict(op="all_reduce", world_size=2, num_bytes=10**9, busbw_GBps=350.0, status="ok", launcher="ray"),
        dict(op="all_reduce", world_size=2, num_bytes=10**9, busbw_GBps=380.0, status="ok", launcher="mp"),
        dict(op="all_reduce", world_size=2, num_bytes=10**8, busbw_GBps=500.0, status="ok", launcher="mp"),
        dict(op="all_gather", world_size=2, num_bytes=10**9, busbw_GBps=900.0, status="ok", launcher="mp"),
        dict(op="all_reduce", world_size=4, num_bytes=10**9, busbw_GBps=999.0, status="error", launcher="mp"),
        dict(op="all_reduce", world_size=4, num_bytes=10**8, busbw_GBps=300.0, status="ok", launcher="mp"),
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "allreduce.parquet")
    got = {r["world_size"]: (r["num_bytes"], r["busbw_GBps"]) for r in bandwidth_from_results(tmp_path)}
    assert got == {2: (10**9, 380.0), 4: (10**8, 300.0)}
