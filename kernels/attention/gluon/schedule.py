"""The order of the Gluon forward's work items: numbering on the device, cost model and persistent deal on the host.

A work item is one query tile (NUM_CONSUMERS * BLOCK_M rows) of one (batch, head). `work_item` numbers them heaviest
causal tile first, optionally GROUP heads at a time (so the programs in flight share few heads' K/V in L2);
`work_weights` is the same numbering on the host. For a persistent grid, `work_schedule` deals the items to programs
(the best of round robin and two greedy deals under `ITEM_COST`'s cost model) and `schedule_table` packs the lists
into the int32 table the kernel reads through `item_range` / `item_at`.
"""

from __future__ import annotations

import functools
import heapq

import torch
import triton

from kernels.attention.gluon.compat import HAS_GLUON_HOPPER

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.compat import gl, gluon

if HAS_GLUON_HOPPER:

    @gluon.jit
    def work_item(t, BH, H, GROUP: gl.constexpr, N_Q, N_K, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr):
        """Work item t -> (pid_bh, off_b, off_h, start_m, num_kv, n_unmasked): causal query tiles numbered by
        decreasing tile index across the BH heads (heaviest first), or, with GROUP > 0, the heads taken GROUP at a
        time (the last group may be smaller) and so within each group, so the programs running at once share the
        K/V of at most GROUP heads in L2; key tiles [0, num_kv) in all, [n_unmasked, num_kv) needing the causal
        and/or key-tail mask. GROUP is a constexpr."""
        num_m = gl.cdiv(N_Q, TILE_M)
        if GROUP == 0:
            pid_bh = t % BH
            start_m = (num_m - 1 - t // BH) * TILE_M
        else:
            g = t // (num_m * GROUP)
            r = t - g * (num_m * GROUP)
            heads = gl.minimum(BH - g * GROUP, GROUP)
            pid_bh = g * GROUP + r % heads
            start_m = (num_m - 1 - r // heads) * TILE_M
        if IS_CAUSAL:
            kv_end = gl.minimum(start_m + TILE_M, N_K)
            n_unmasked = gl.minimum(start_m // BLOCK_N, N_K // BLOCK_N)
        else:
            kv_end = N_K
            n_unmasked = N_K // BLOCK_N
        return pid_bh, pid_bh // H, pid_bh % H, start_m, gl.cdiv(kv_end, BLOCK_N), n_unmasked

    @gluon.jit
    def item_range(SCHEDULE, num_items, BALANCED: gl.constexpr):
        """(first, stop, step) of a persistent program's loop over its work items: with BALANCED, its slice of
        `work_schedule`'s table (SCHEDULE: the offsets of the programs' item lists, then the lists); else items
        program_id, program_id + #programs, ... (round robin)."""
        if BALANCED:
            return gl.load(SCHEDULE + gl.program_id(0)), gl.load(SCHEDULE + gl.program_id(0) + 1), 1
        else:
            return gl.program_id(0), num_items, gl.num_programs(0)

    @gluon.jit
    def item_at(i, SCHEDULE, BALANCED: gl.constexpr):
        """The work item at step i of `item_range`'s loop."""
        if BALANCED:
            return gl.load(SCHEDULE + gl.num_programs(0) + 1 + i)
        else:
            return i


ITEM_COST = 1
"""`work_schedule`'s cost model: a work item costs its key tiles plus ITEM_COST more for its start and epilogue (Q's
wait, O's store): an assumption, not a measurement."""


def work_weights(bh: int, n_q: int, n_k: int, tile_m: int, block_n: int, group: int, is_causal: bool) -> list[int]:
    """Key tiles of each work item of the forward, in `work_item`'s numbering (the kernel's rules, on the host)."""
    num_m = triton.cdiv(n_q, tile_m)
    weights = []
    for t in range(num_m * bh):
        if group == 0:
            start_m = (num_m - 1 - t // bh) * tile_m
        else:
            r = t % (num_m * group)
            start_m = (num_m - 1 - r // min(bh - t // (num_m * group) * group, group)) * tile_m
        kv_end = min(start_m + tile_m, n_k) if is_causal else n_k
        weights.append(triton.cdiv(kv_end, block_n))
    return weights


def _deal(order, weights: list[int], programs: int) -> tuple[list[list[int]], int]:
    """Items in `order`, each to the program with the least modelled work so far (ties: the lower program); the
    lists and the largest program's work."""
    heap = [(0, p) for p in range(programs)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for t in order:
        load, p = heapq.heappop(heap)
        lists[p].append(t)
        heapq.heappush(heap, (load + weights[t] + ITEM_COST, p))
    return lists, max(load for load, _ in heap)


def work_schedule(weights: list[int], programs: int) -> list[list[int]]:
    """Each program's work items, in the order it runs them, for a persistent grid of `programs`: the best by the
    cost model (ITEM_COST) of round robin (`GluonConfig.round_robin`'s order), items dealt in their numbering to
    the least loaded program, and the same over windows of 2 * programs items, each window heaviest first. The
    numbering keeps the programs running at once on the same few heads (`work_item`'s head groups), and the last
    two keep to it, within a window at most."""
    if programs < 1:
        raise ValueError(f"programs ({programs}) must be >= 1")
    n = len(weights)
    robin = [list(range(p, n, programs)) for p in range(programs)]
    best = (max(sum(weights[t] + ITEM_COST for t in items) for items in robin), robin)
    window = 2 * programs
    windowed = [t for lo in range(0, n, window)
                for t in sorted(range(lo, min(n, lo + window)), key=lambda t: -weights[t])]
    for order in (range(n), windowed):
        lists, span = _deal(order, weights, programs)
        if span < best[0]:
            best = (span, lists)
    return best[1]


@functools.lru_cache(maxsize=64)
def schedule_table(bh: int, n_q: int, n_k: int, tile_m: int, block_n: int, group: int, is_causal: bool,
                   programs: int, device: torch.device) -> torch.Tensor:
    """`work_schedule` as the kernel reads it (int32 on `device`): programs + 1 offsets into the lists that follow,
    then every program's list, one after the other."""
    lists = work_schedule(work_weights(bh, n_q, n_k, tile_m, block_n, group, is_causal), programs)
    offsets = [0]
    for items in lists:
        offsets.append(offsets[-1] + len(items))
    return torch.tensor(offsets + [t for items in lists for t in items], dtype=torch.int32, device=device)
