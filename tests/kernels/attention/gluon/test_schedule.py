"""The Gluon forward's work items: the host's numbering and weights against the kernel's rules, and the persistent
grid's deal (`kernels/attention/gluon/schedule.py`)."""

from __future__ import annotations

import pytest
import torch
import triton

from kernels.attention.gluon import schedule


def _work_items(bh, n_q, n_k, tile_m, block_n, is_causal):
    """Key tiles of every (head, query tile), counted key by key: what `schedule.work_weights` orders. Under the causal
    mask a tile's loop runs to the last key its last row (padded to a whole tile) sees."""
    found = []
    for _ in range(bh):
        for m in range(triton.cdiv(n_q, tile_m)):
            seen = [j for j in range(n_k) if not is_causal or j < (m + 1) * tile_m]
            found.append(triton.cdiv(max(seen) + 1, block_n))
    return found


def _makespan(lists, weights):
    return max(sum(weights[t] + schedule.ITEM_COST for t in items) for items in lists)


@pytest.mark.parametrize("bh, n_q, n_k, group", [(6, 1000, 777, 0), (6, 1000, 777, 4), (5, 513, 1029, 2),
                                                 (3, 777, 777, 8)])
@pytest.mark.parametrize("is_causal", [True, False])
def test_work_weights_follow_the_kernels_item_order(bh, n_q, n_k, group, is_causal):
    """The host's weights are the key tiles each work item's loop runs, in `_work_item`'s numbering: the same
    multiset whatever the head group, and in every group's run of items, the query tiles heaviest first."""
    weights = schedule.work_weights(bh, n_q, n_k, 128, 128, group, is_causal)
    assert sorted(weights) == sorted(_work_items(bh, n_q, n_k, 128, 128, is_causal))
    num_m = triton.cdiv(n_q, 128)
    run = num_m * (group or bh)
    for lo in range(0, len(weights), run):
        assert weights[lo:lo + run] == sorted(weights[lo:lo + run], reverse=True)


def test_work_schedule_deals_every_item_once_and_evens_the_programs():
    """Each item goes to one program, in a list it runs in order. Causal items at 8x16x4096 in groups of 8 heads
    (the d-64 forward's launch) leave round robin's busiest program 3% above the mean by the cost model; the
    schedule brings it within 0.5%. Items of one length (not causal) keep round robin. (Figures of the cost model,
    `schedule.ITEM_COST`, not timings.)"""
    weights = schedule.work_weights(128, 4096, 4096, 128, 128, 8, True)
    lists = schedule.work_schedule(weights, 132)
    assert sorted(t for items in lists for t in items) == list(range(len(weights)))
    mean = sum(w + schedule.ITEM_COST for w in weights) / 132
    robin = [list(range(p, len(weights), 132)) for p in range(132)]
    assert _makespan(robin, weights) > 1.03 * mean
    assert _makespan(lists, weights) < 1.005 * mean
    flat = schedule.work_weights(128, 4096, 4096, 128, 128, 8, False)
    assert schedule.work_schedule(flat, 132) == [list(range(p, len(flat), 132)) for p in range(132)]
    # 4x32x2048 in groups of 4 (the d-128 launch there): round robin 3.1% above the mean, items dealt in their
    # numbering 4.5% (each group starts heavy again after the last one's light items); heaviest first within windows
    # of two rounds, under 2%.
    weights = schedule.work_weights(128, 2048, 2048, 128, 128, 4, True)
    mean = sum(w + schedule.ITEM_COST for w in weights) / 132
    assert schedule._deal(range(len(weights)), weights, 132)[1] > 1.04 * mean
    assert _makespan(schedule.work_schedule(weights, 132), weights) < 1.02 * mean
    for bh, n, group in ((128, 2048, 4), (16, 2048, 4), (3, 1000, 0)):
        weights = schedule.work_weights(bh, n, n, 128, 128, group, True)
        lists = schedule.work_schedule(weights, 132)
        robin = [list(range(p, len(weights), 132)) for p in range(132)]
        assert _makespan(lists, weights) <= _makespan(robin, weights)


def test_work_schedule_needs_a_program():
    with pytest.raises(ValueError, match=r"programs \(0\) must be >= 1"):
        schedule.work_schedule([1, 2], 0)


def test_schedule_table_is_the_offsets_then_the_lists():
    table = schedule.schedule_table(6, 1000, 1000, 128, 128, 4, True, 5, torch.device("cpu")).tolist()
    lists = schedule.work_schedule(schedule.work_weights(6, 1000, 1000, 128, 128, 4, True), 5)
    offsets, items = table[:6], table[6:]
    assert [items[offsets[p]:offsets[p + 1]] for p in range(5)] == lists
    assert offsets[-1] == len(items) == 6 * 8
