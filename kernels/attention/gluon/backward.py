"""FlashAttention backward for Hopper (sm_90) in Gluon, one pass: dK, dV and dQ from one key-stationary loop.

Consumes the forward's O and natural-log L and returns (dQ, dK, dV) in the inputs' dtype, the tl backward's semantics
(top-left causal mask, scale 1/sqrt(d), any N, n_q != n_k, d 64 or 128, bf16 / fp16). One program takes 2 *
BWD_BLOCK_N keys: two consumer warp groups keep their keys' dK, dV in fp32 registers while a loader warp streams Q(i),
dO(i) (and L, D rows) through an mbarrier ring; S^T and dP^T run in flight together, P^T and dS^T are register
operands, and both groups' dS^T meet in a shared tile from which each program's share of dQ(i) = dS(i) K is summed
into an fp32 dQ by the TMA unit (`cp.reduce.async.bulk.tensor`): 5 matmuls per tile pair, dQ's last bits can vary run
to run. `GluonBwdConfig.persistent` walks the same work items on one program per SM.

The key-stationary pieces (`load_kv_tiles`, `load_q_do_tile`, `key_stationary_shared`, `sdp_transposed`) are the dK/dV
loop's first half. The deterministic backward is the tl kernels' two-pass one (`dispatch.gluon_bwd_chosen`).
Usage: `dq, dk, dv = gluon_attention_bwd(q, k, v, out, lse, grad_out, is_causal, config)` (checked) or `launch_bwd`;
`dispatch.gluon_bwd_config(q)` is the config the gluon path launches.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from kernels.attention.checks import check_backward_inputs, unsupported_reason
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from kernels.attention.gluon.runtime import (
    LOADER_REGS,
    SharedMemoryExceeded,
    descriptor,
    launch,
    register_split,
    shared_layout,
    tensor_descriptor,
)
from kernels.attention.triton.kernels import LOG2E, _onepass_bwd_preprocess_kernel
from kernels.device import device_of, empty_like_layout, num_sms, shared_memory_limit

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.compat import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        tma_load,
        tma_reduce_add,
        tma_store,
        warpgroup_mma,
        warpgroup_mma_wait,
    )


# ----------------------------------------------------------------------------------------------------------
# The key-stationary pieces both backwards share: K, V once, Q/dO tiles streamed; S^T, dP^T, P^T
# ----------------------------------------------------------------------------------------------------------
if HAS_GLUON_HOPPER:

    @gluon.jit
    def load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, kv_bar, off_b, off_h, start_n,
                      NUM_CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Each consumer's K and V rows [start_n + c * BLOCK_N, ...) into its buffers, all on `kv_bar`."""
        mbarrier.expect(kv_bar, NUM_CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for c in gl.static_range(NUM_CONSUMERS):
            tma_load(k_desc, [off_b, off_h, start_n + c * BLOCK_N, 0], kv_bar, k_bufs.index(c))
            tma_load(v_desc, [off_b, off_h, start_n + c * BLOCK_N, 0], kv_bar, v_bufs.index(c))

    @gluon.jit
    def load_q_do_tile(q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, empty, off_b, off_h, row, it,
                       NUM_STAGES: gl.constexpr):
        """Q and dO rows [row, row + BLOCK_M) into ring slot it % NUM_STAGES, once the consumers freed it: one
        `empty` barrier per slot (one arrival per consumer) frees Q and dO together; it starts "phase 1 complete",
        so the first pass through the ring does not wait. `it` counts the program's ring uses (across work items in
        a persistent program)."""
        stage = it % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        tma_load(q_desc, [off_b, off_h, row, 0], q_ready.index(stage), q_bufs.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma_load(do_desc, [off_b, off_h, row, 0], do_ready.index(stage), do_bufs.index(stage))

    @gluon.jit
    def key_stationary_shared(q_desc, k_desc, v_desc, do_desc, NUM_STAGES: gl.constexpr):
        """Shared memory of a program over 2 groups' keys (the dK/dV kernel's, the one-pass kernel's): both groups'
        K and V, the Q/dO ring, and the barriers `_bwd_loader` and the consumers use: `kv_bar` (K, V landed),
        `q_ready` / `do_ready` per slot (one TMA arrival) and `empty` per slot (one arrival per group)."""
        dtype: gl.constexpr = q_desc.dtype
        k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        return k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty

    @gluon.jit
    def sdp_transposed(k, v, q, do, l2, keys, cols, start_m, start_n, N_K, qk_scale, s_layout: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """S^T = K Q^T and dP^T = V dO^T issued together (keys as wgmma rows), then P^T = exp(S^T / sqrt(d) - L)
        under dP^T, diagonal and tail tiles masked: (P^T fp32, dP^T still in flight). The dK/dV loop's first
        half."""
        s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        s = warpgroup_mma(k, q.permute((1, 0)), s, use_acc=False, is_async=True)
        dp = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        dp = warpgroup_mma(v, do.permute((1, 0)), dp, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        p = gl.exp2(s * qk_scale - gl.expand_dims(l2, 0))
        if (IS_CAUSAL and start_m < start_n + BLOCK_N) or start_n + BLOCK_N > N_K:
            keep = gl.expand_dims(keys < N_K, 1)
            if IS_CAUSAL:  # top-left: query i sees keys j <= i
                keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(cols, 0))
            p = gl.where(keep, p, 0.0)
        return p, dp


# ----------------------------------------------------------------------------------------------------------
# The one-pass kernels
# ----------------------------------------------------------------------------------------------------------
if HAS_GLUON_HOPPER:

    @gluon.jit
    def _dq_product(ds_tile, k0, k1, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DQ_N: gl.constexpr):
        """This group's dQ share of a query tile, in flight: dS (both groups' keys, from the slot's shared dS^T
        tile) times the DQ_N head-dim columns `k0`, `k1` of each group's K."""
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_N, 16])
        dq = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
        dq = warpgroup_mma(ds_tile.slice(0, BLOCK_N, dim=0).permute((1, 0)), k0, dq, use_acc=False, is_async=True)
        return warpgroup_mma(ds_tile.slice(BLOCK_N, BLOCK_N, dim=0).permute((1, 0)), k1, dq, is_async=True)

    @gluon.jit
    def _dq_to_global(dq, dq_bufs, C: gl.constexpr, k, dq_desc, off_b, off_h, start_m, col, BLOCK_M: gl.constexpr,
                      DQ_N: gl.constexpr):
        """5. Summed in fp32 in global memory at (start_m, col) by the TMA unit (order not fixed), from the k-th dQ
        tile of group C (`dq_bufs`: each group's `GluonBwdConfig.dq_buffers` tiles, used in turn) once the reduction
        that last read that tile has finished reading it."""
        DQ_BUFS: gl.constexpr = dq_bufs.shape[0] // 2
        if DQ_BUFS == 1:
            dq_smem = dq_bufs.index(C)
        else:
            dq_smem = dq_bufs.index(C * DQ_BUFS + k % DQ_BUFS)
        tma.store_wait(DQ_BUFS - 1)
        dq_smem.reshape([BLOCK_M, DQ_N]).store(dq)
        fence_async_shared()
        tma_reduce_add(dq_desc, [off_b, off_h, start_m, col], dq_smem)

    @gluon.jit
    def _bwd_consumer_item(C: gl.constexpr, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, kv_phase,
                           q_ready, do_ready, ds_ready, empty, kv_empty, rows_bufs, dk_desc, dv_desc, dq_desc, L,
                           Delta, off_b, off_h, pid_bh, tile_n, m_start, num_m, it0, N_Q, N_K, qk_scale, sm_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                           DK_LATE: gl.constexpr, ROWS_TMA: gl.constexpr):
        """Consumer C of one work item's 2 * BLOCK_N keys: its BLOCK_N keys' dK, dV (S^T and dP^T
        with the keys as wgmma rows), and columns [C * HEAD_DIM / 2, ...) of the program's share of dQ(i)
        = dS(i) K over all 2 * BLOCK_N keys: both groups' dS^T meet in shared memory (barrier `ds_ready`), so each
        dQ element is reduced once per program, by the TMA unit's bulk fp32 reduction. The ring slots continue from
        ring use `it0` (the query tiles of the program's earlier items) and `kv_bar` is in phase `kv_phase`; a
        PERSISTENT program's consumer releases its K and V buffers (`kv_empty`) once its dK and dV left them.
        ROWS_TMA: the query tile's L and D rows come from the ring slot (`rows_bufs`, landed with Q and dO), else
        from global memory (`L`, `Delta`: pointers then)."""
        dtype: gl.constexpr = k_bufs.dtype
        # dQ tiles as wide as the head dim (`GluonBwdConfig.dq_whole`, the launcher's dQ descriptor): each query
        # tile's dQ whole, by one group, the groups taking alternate tiles; else half of the head dim per group.
        DQ_WHOLE: gl.constexpr = dq_desc.block_type.shape[3] == HEAD_DIM
        DQ_N: gl.constexpr = dq_desc.block_type.shape[3]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        start_n = tile_n + C * BLOCK_N
        k = k_bufs.index(C).reshape([BLOCK_N, HEAD_DIM])
        v = v_bufs.index(C).reshape([BLOCK_N, HEAD_DIM])
        # dQ's operands: each group's keys, this group's half of the head dim (or all of it).
        k0_half = k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).slice((1 - DQ_WHOLE) * C * DQ_N, DQ_N, dim=1)
        k1_half = k_bufs.index(1).reshape([BLOCK_N, HEAD_DIM]).slice((1 - DQ_WHOLE) * C * DQ_N, DQ_N, dim=1)
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        # L and D rows padded with zeros to whole BLOCK_M tiles (`bwd_launch_args`): unmasked loads, which
        # keep the per-column registers of a mask out of the loop.
        if not ROWS_TMA:
            n_pad = gl.cdiv(N_Q, BLOCK_M) * BLOCK_M
            lse_base = L + pid_bh.to(gl.int64) * n_pad
            delta_base = Delta + pid_bh.to(gl.int64) * n_pad
        # A one-item program's ring uses and barrier phases start at 0 (constants).
        if PERSISTENT:
            mbarrier.wait(kv_bar, kv_phase)
        else:
            mbarrier.wait(kv_bar, 0)
        for it in range(num_m):
            if PERSISTENT:
                use = it0 + it
            else:
                use = it
            stage = use % NUM_STAGES
            phase = (use // NUM_STAGES) & 1
            start_m = (m_start + it) * BLOCK_M
            cols = start_m + gl.arange(0, BLOCK_M, layout=col_s)
            # Rows past N_Q: Q and dO read as 0 (TMA), L and D are 0, so P = 1 and dS = 0 there. A causal query tile
            # wholly above this group's keys (the first of the second group) is computed, masked to P = dS = 0:
            # both groups take part in every tile's dQ.
            if ROWS_TMA:
                mbarrier.wait(q_ready.index(stage), phase)
                l2 = rows_bufs.index(stage).load(col_s) * 1.4426950408889634
                mbarrier.wait(do_ready.index(stage), phase)
            else:
                l2 = gl.load(lse_base + cols) * 1.4426950408889634
                mbarrier.wait(q_ready.index(stage), phase)
                mbarrier.wait(do_ready.index(stage), phase)
            q = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
            do = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
            # 1. S^T and dP^T in flight together; P^T under dP^T, masked.
            p, dp = sdp_transposed(k, v, q, do, l2, keys, cols, start_m, start_n, N_K, qk_scale, s_layout, BLOCK_N,
                                   BLOCK_M, IS_CAUSAL)
            # 2. dV += P^T dO under dS^T = P^T (dP^T - D) / sqrt(d) (FA2 eqs. 16-17, the scale folded in).
            p16 = p.to(dtype)
            dv = warpgroup_mma(gl.convert_layout(p16, a_layout), do, dv, is_async=True)
            if ROWS_TMA:
                delta = rows_bufs.index(NUM_STAGES + stage).load(col_s) * sm_scale
            else:
                delta = gl.load(delta_base + cols) * sm_scale
            dp = warpgroup_mma_wait(1, deps=(dp,))
            ds16 = (p16.to(gl.float32) * (dp * sm_scale - gl.expand_dims(delta, 0))).to(dtype)
            # 3. dK += dS^T Q from registers (DK_LATE: after the dS^T store, in each branch below); dS^T to this
            #    group's rows of the slot's shared tile.
            if DQ_WHOLE and DK_LATE:
                dv = warpgroup_mma_wait(0, deps=(dv,))
            else:
                dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
                dv = warpgroup_mma_wait(1, deps=(dv,))  # frees P^T's registers before dQ's accumulator is live
            ds_tile = ds_bufs.index(stage)
            ds_tile.slice(C * BLOCK_N, BLOCK_N, dim=0).store(ds16)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(stage), count=1)
            if DQ_WHOLE and DK_LATE:
                # dK issued in each branch: it runs under the wait for the other group's dS^T and beside dQ.
                if use % 2 == C:
                    dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
                    mbarrier.wait(ds_ready.index(stage), phase)
                    dk, dq = warpgroup_mma_wait(0, deps=(dk, _dq_product(ds_tile, k0_half, k1_half, BLOCK_M,
                                                                         BLOCK_N, DQ_N)))
                    mbarrier.arrive(empty.index(stage), count=1)
                    _dq_to_global(dq, dq_bufs, C, use // 2, dq_desc, off_b, off_h, start_m, 0, BLOCK_M, DQ_N)
                else:
                    dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
                    dk = warpgroup_mma_wait(0, deps=(dk,))
                    mbarrier.arrive(empty.index(stage), count=1)
            elif DQ_WHOLE:
                # The groups take alternate tiles' dQ: dK completes here (an async accumulator cannot cross the
                # branch), under the dS^T store and the other group's arrival.
                dk = warpgroup_mma_wait(0, deps=(dk,))
                if use % 2 == C:
                    mbarrier.wait(ds_ready.index(stage), phase)
                    dq = warpgroup_mma_wait(0, deps=(_dq_product(ds_tile, k0_half, k1_half, BLOCK_M, BLOCK_N, DQ_N),))
                    mbarrier.arrive(empty.index(stage), count=1)
                    _dq_to_global(dq, dq_bufs, C, use // 2, dq_desc, off_b, off_h, start_m, 0, BLOCK_M, DQ_N)
                else:
                    mbarrier.arrive(empty.index(stage), count=1)
            else:
                # 4. Once both halves landed: dQ(i)[:, this half] share = dS(i) K over the program's keys.
                mbarrier.wait(ds_ready.index(stage), phase)
                dk, dq = warpgroup_mma_wait(0, deps=(dk, _dq_product(ds_tile, k0_half, k1_half, BLOCK_M, BLOCK_N,
                                                                     DQ_N)))
                # Q(i), dO(i) and the dS slot are no longer read by this group (the loader refills the slot, and
                # the other group rewrites its dS rows, only after both groups arrive).
                mbarrier.arrive(empty.index(stage), count=1)
                _dq_to_global(dq, dq_bufs, C, use, dq_desc, off_b, off_h, start_m, C * DQ_N, BLOCK_M, DQ_N)

        # 6. Epilogue: dK (already scaled) and dV through the K and V buffers, once the other group's last dQ
        #    product has read K (the last slot's `empty` phase completes when both groups arrived); rows past N_K
        #    are dropped.
        if num_m > 0:
            if PERSISTENT:
                last = it0 + num_m - 1
            else:
                last = num_m - 1
            mbarrier.wait(empty.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        k.store(dk.to(dtype))
        v.store(dv.to(dtype))
        fence_async_shared()
        tma_store(dk_desc, [off_b, off_h, start_n, 0], k_bufs.index(C))
        tma_store(dv_desc, [off_b, off_h, start_n, 0], v_bufs.index(C))
        tma.store_wait(0)  # (and the last dQ reduction)
        if PERSISTENT:  # dK and dV have left this group's K and V buffers: the next item's K and V may land there
            mbarrier.arrive(kv_empty, count=1)

    @gluon.jit
    def _bwd_item(t, num_t, BH, H, GROUP: gl.constexpr, N_Q, TILE_N: gl.constexpr, BLOCK_M: gl.constexpr,
                  IS_CAUSAL: gl.constexpr):
        """Work item t -> (pid_bh, off_b, off_h, tile_n, m_start, num_m): causal key tiles numbered by increasing
        key-tile index (the first see the most queries), across all BH heads or, GROUP > 0, GROUP heads at a time
        (the last group may be smaller), so the programs in flight share fewer heads' Q, dO and dQ in L2 (as the
        forward's `work_item`); query tiles [m_start, m_start + num_m): causal ones from the first query that sees
        key tile_n (none when tile_n >= N_Q: dK = dV = 0 are still written)."""
        if GROUP == 0:
            pid_bh = t % BH
            tile_n = (t // BH) * TILE_N
        else:
            g = t // (num_t * GROUP)
            r = t - g * (num_t * GROUP)
            heads = gl.minimum(BH - g * GROUP, GROUP)
            pid_bh = g * GROUP + r % heads
            tile_n = (r // heads) * TILE_N
        off_b = pid_bh // H
        off_h = pid_bh % H
        if IS_CAUSAL:
            m_start = tile_n // BLOCK_M
        else:
            m_start = 0
        num_m = gl.maximum(gl.cdiv(N_Q, BLOCK_M) - m_start, 0)
        return pid_bh, off_b, off_h, tile_n, m_start, num_m

    @gluon.jit
    def _bwd_persistent_consumer(C: gl.constexpr, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, q_ready,
                                 do_ready, ds_ready, empty, kv_empty, rows_bufs, dk_desc, dv_desc, dq_desc, L, Delta,
                                 H, BH, GROUP: gl.constexpr, N_Q, N_K, qk_scale, sm_scale, HEAD_DIM: gl.constexpr,
                                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                                 IS_CAUSAL: gl.constexpr, DK_LATE: gl.constexpr, ROWS_TMA: gl.constexpr):
        """Consumer C of a persistent program: work items pid, pid + #programs, ... (`_bwd_item` order)."""
        num_t = gl.cdiv(N_K, 2 * BLOCK_N)
        it0 = 0
        n = 0
        for t in range(gl.program_id(0), num_t * BH, gl.num_programs(0)):
            pid_bh, off_b, off_h, tile_n, m_start, num_m = _bwd_item(t, num_t, BH, H, GROUP, N_Q, 2 * BLOCK_N,
                                                                     BLOCK_M, IS_CAUSAL)
            _bwd_consumer_item(C, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, n & 1, q_ready,
                               do_ready, ds_ready, empty, kv_empty, rows_bufs, dk_desc, dv_desc, dq_desc, L, Delta,
                               off_b, off_h, pid_bh, tile_n, m_start, num_m, it0, N_Q, N_K, qk_scale, sm_scale,
                               HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, True, DK_LATE, ROWS_TMA)
            it0 += num_m
            n += 1

    @gluon.jit
    def _bwd_persistent_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, rows_bufs, kv_bar,
                               q_ready, do_ready, empty, kv_empty, L, Delta, H, BH, GROUP: gl.constexpr, N_Q, N_K,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                               IS_CAUSAL: gl.constexpr, ROWS_TMA: gl.constexpr):
        """Producer warp of a persistent program, per work item: its first Q/dO tiles into the ring as soon as the
        previous item's last ones are released (under that item's dK/dV epilogue), then its K and V once both groups
        released theirs (`kv_empty`), then the rest of its Q/dO tiles."""
        num_t = gl.cdiv(N_K, 2 * BLOCK_N)
        it0 = 0
        n = 0
        for t in range(gl.program_id(0), num_t * BH, gl.num_programs(0)):
            pid_bh, off_b, off_h, tile_n, m_start, num_m = _bwd_item(t, num_t, BH, H, GROUP, N_Q, 2 * BLOCK_N,
                                                                     BLOCK_M, IS_CAUSAL)
            ahead = gl.minimum(num_m, NUM_STAGES)
            for it in range(ahead):
                _load_query_tile(q_desc, do_desc, q_bufs, do_bufs, rows_bufs, q_ready, do_ready, empty, L, Delta,
                                 off_b, off_h, pid_bh, N_Q, (m_start + it) * BLOCK_M, it0 + it, NUM_STAGES, ROWS_TMA)
            mbarrier.wait(kv_empty, (n & 1) ^ 1)  # starts "phase 1 complete": the first item does not wait
            load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, kv_bar, off_b, off_h, tile_n, 2, BLOCK_N)
            for it in range(ahead, num_m):
                _load_query_tile(q_desc, do_desc, q_bufs, do_bufs, rows_bufs, q_ready, do_ready, empty, L, Delta,
                                 off_b, off_h, pid_bh, N_Q, (m_start + it) * BLOCK_M, it0 + it, NUM_STAGES, ROWS_TMA)
            it0 += num_m
            n += 1

    @gluon.jit
    def _load_query_tile(q_desc, do_desc, q_bufs, do_bufs, rows_bufs, q_ready, do_ready, empty, L, Delta, off_b, off_h,
                         pid_bh, N_Q, row, it, NUM_STAGES: gl.constexpr, ROWS_TMA: gl.constexpr):
        """Query rows [row, row + BLOCK_M) into ring slot it % NUM_STAGES (`load_q_do_tile`); ROWS_TMA: their L
        and D rows too (descriptors over the flat zero-padded rows), on Q's and dO's barriers."""
        if ROWS_TMA:
            stage = it % NUM_STAGES
            block_m: gl.constexpr = q_desc.block_type.shape[2]
            flat = pid_bh * (gl.cdiv(N_Q, block_m) * block_m) + row
            mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + L.block_type.nbytes)
            tma_load(q_desc, [off_b, off_h, row, 0], q_ready.index(stage), q_bufs.index(stage))
            tma_load(L, [flat], q_ready.index(stage), rows_bufs.index(stage))
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + Delta.block_type.nbytes)
            tma_load(do_desc, [off_b, off_h, row, 0], do_ready.index(stage),
                                            do_bufs.index(stage))
            tma_load(Delta, [flat], do_ready.index(stage), rows_bufs.index(NUM_STAGES + stage))
        else:
            load_q_do_tile(q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, empty, off_b, off_h, row, it,
                           NUM_STAGES)

    @gluon.jit
    def _one_pass_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, rows_bufs, kv_bar, q_ready,
                         do_ready, empty, L, Delta, off_b, off_h, pid_bh, tile_n, m_start, num_m, N_Q,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                         ROWS_TMA: gl.constexpr):
        """Producer warp of a one-item program: both groups' K and V once, then the query tiles
        (`_load_query_tile`)."""
        load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, kv_bar, off_b, off_h, tile_n, 2, BLOCK_N)
        for it in range(num_m):
            _load_query_tile(q_desc, do_desc, q_bufs, do_bufs, rows_bufs, q_ready, do_ready, empty, L, Delta, off_b,
                             off_h, pid_bh, N_Q, (m_start + it) * BLOCK_M, it, NUM_STAGES, ROWS_TMA)

    @gluon.jit
    def _one_pass_shared(q_desc, k_desc, v_desc, do_desc, dq_desc, L, NUM_STAGES: gl.constexpr, TILE_N: gl.constexpr,
                         BLOCK_M: gl.constexpr, ROWS_TMA: gl.constexpr, DQ_BUFFERS: gl.constexpr):
        """Each group's K, V (reused for dK, dV); the Q/dO ring; per slot a dS^T tile of both groups' keys; each
        group's DQ_BUFFERS fp32 dQ tiles; barriers (`key_stationary_shared`'s, and `ds_ready`: one arrival per group);
        ROWS_TMA: per slot the L row, then per slot the D row (`rows_bufs`, fp32), else a placeholder."""
        k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty = key_stationary_shared(
            q_desc, k_desc, v_desc, do_desc, NUM_STAGES)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES, TILE_N, BLOCK_M], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS] + dq_desc.block_type.shape, dq_desc.layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ds_ready.index(i), count=2)
        if ROWS_TMA:
            rows_bufs = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, BLOCK_M], L.layout)
        else:
            rows_bufs = ds_ready
        return k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, ds_bufs, dq_bufs, ds_ready, rows_bufs

    @gluon.jit
    def _gluon_attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, L, Delta, H, N_Q,
                               N_K, qk_scale, sm_scale,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, GROUP: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, DK_LATE: gl.constexpr,
                               ROWS_TMA: gl.constexpr, DQ_BUFFERS: gl.constexpr):
        """Grid (cdiv(N_K, 2 * BLOCK_N) * B * H,): program -> (key tile, batch*head), heavy first; two consumer
        warp groups of BLOCK_N keys and a loader warp."""
        TILE_N: gl.constexpr = 2 * BLOCK_N
        # 1.-2. Work item (`_bwd_item`: key tile, heavy first, head groups) and its query tiles.
        num_t = gl.cdiv(N_K, TILE_N)
        num_bh = gl.num_programs(0) // num_t
        pid_bh, off_b, off_h, tile_n, m_start, num_m = _bwd_item(gl.program_id(0), num_t, num_bh, H, GROUP, N_Q,
                                                                 TILE_N, BLOCK_M, IS_CAUSAL)

        # 3. Shared memory (`_one_pass_shared`).
        k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, ds_bufs, dq_bufs, ds_ready, rows_bufs = \
            _one_pass_shared(q_desc, k_desc, v_desc, do_desc, dq_desc, L, NUM_STAGES, TILE_N, BLOCK_M, ROWS_TMA,
                             DQ_BUFFERS)

        # 4. Partitions (argument tuples inline, as in the forward): the consumers from ring use 0 with `kv_bar` in
        #    phase 0 (their `kv_empty`, never arrived on outside a PERSISTENT program, is `kv_bar`).
        gl.warp_specialize([
            (_bwd_consumer_item, (0, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, 0, q_ready, do_ready,
                                  ds_ready, empty, kv_bar, rows_bufs, dk_desc, dv_desc, dq_desc, L, Delta, off_b, off_h,
                                  pid_bh, tile_n, m_start, num_m, 0, N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M,
                                  BLOCK_N, NUM_STAGES, IS_CAUSAL, False, DK_LATE, ROWS_TMA)),
            (_bwd_consumer_item, (1, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, 0, q_ready, do_ready,
                                  ds_ready, empty, kv_bar, rows_bufs, dk_desc, dv_desc, dq_desc, L, Delta, off_b, off_h,
                                  pid_bh, tile_n, m_start, num_m, 0, N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M,
                                  BLOCK_N, NUM_STAGES, IS_CAUSAL, False, DK_LATE, ROWS_TMA)),
            (_one_pass_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, rows_bufs, kv_bar,
                                q_ready, do_ready, empty, L, Delta, off_b, off_h, pid_bh, tile_n, m_start, num_m, N_Q,
                                BLOCK_M, BLOCK_N, NUM_STAGES, ROWS_TMA)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _gluon_attn_bwd_persistent_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, L, Delta, H,
                                          BH, N_Q, N_K, qk_scale, sm_scale,
                                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                          NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, GROUP: gl.constexpr,
                                          CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                                          DK_LATE: gl.constexpr, ROWS_TMA: gl.constexpr, DQ_BUFFERS: gl.constexpr):
        """Grid (min(#work items, #SMs),): each program walks the work items p, p + #programs, ... of the one-item
        kernel (`_bwd_item`, heavy first). The Q/dO ring runs on across items (the next item's first tiles load
        under this one's dK/dV epilogue); K and V are reloaded once both groups released them (`kv_empty`: one
        arrival per group, after its dK and dV stores left the buffers)."""
        k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, ds_bufs, dq_bufs, ds_ready, rows_bufs = \
            _one_pass_shared(q_desc, k_desc, v_desc, do_desc, dq_desc, L, NUM_STAGES, 2 * BLOCK_N, BLOCK_M,
                             ROWS_TMA, DQ_BUFFERS)
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=2)
        gl.warp_specialize([
            (_bwd_persistent_consumer, (0, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, q_ready,
                                        do_ready, ds_ready, empty, kv_empty, rows_bufs, dk_desc, dv_desc, dq_desc, L,
                                        Delta, H, BH, GROUP, N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                                        NUM_STAGES, IS_CAUSAL, DK_LATE, ROWS_TMA)),
            (_bwd_persistent_consumer, (1, k_bufs, v_bufs, ds_bufs, dq_bufs, q_bufs, do_bufs, kv_bar, q_ready,
                                        do_ready, ds_ready, empty, kv_empty, rows_bufs, dk_desc, dv_desc, dq_desc, L,
                                        Delta, H, BH, GROUP, N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                                        NUM_STAGES, IS_CAUSAL, DK_LATE, ROWS_TMA)),
            (_bwd_persistent_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, rows_bufs,
                                      kv_bar, q_ready, do_ready, empty, kv_empty, L, Delta, H, BH, GROUP, N_Q, N_K,
                                      BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, ROWS_TMA)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


BWD_BLOCK_N = 64
"""Keys per consumer warp group: the M of one wgmma, so dK and dV take 2 * 64 * d / 128 fp32 registers a thread."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GluonBwdConfig:
    """Launch knobs of `_gluon_attn_bwd_kernel` (one program = two consumer groups of BWD_BLOCK_N keys each)."""

    block_m: int = 64
    """Query rows per streamed Q/dO tile (the N of S^T = K Q^T, the K of dV += P^T dO); 64 (S^T and dP^T of 128
    query columns beside dK and dV would not fit a group's registers)."""
    num_stages: int = 2
    """Depth of the Q/dO (and dS^T) shared-memory ring."""
    head_group: int = 0
    """Heads whose key tiles run together (a compile-time constant): 0 for all B * H; fewer keeps the programs in
    flight on fewer heads' Q, dO and dQ accumulators, more of them in L2 at long sequences."""
    dq_whole: bool = True
    """Each query tile's dQ computed whole (every head-dim column, over both groups' keys) by one group, the groups
    taking alternate tiles: wgmmas as wide as the head dim (64x128 at d 128, as cuDNN's backward issues), a dQ
    accumulator live every other tile, twice the shared dQ tile; else each group computes half of the head dim's
    columns of every tile."""
    dk_late: bool = False
    """With `dq_whole`: each tile's dK wgmma issued after the dS^T store, in both branches, so that it runs under the
    wait for the other group's dS^T and beside dQ's wgmmas (else before the store, completed before the branch)."""
    rows_tma: bool = True
    """Each query tile's L and D rows brought into its ring slot by the loader's TMA unit, with Q and dO (as FA3's
    producer brings LSE and dPsum), and read by the consumers from shared memory; else each consumer loads them
    from global memory."""
    dq_buffers: int = 1
    """Shared fp32 dQ tiles per group, used in turn: with 2, a group writes a tile's dQ while the TMA unit may still
    be reading its previous one into global memory (`tma.store_wait(1)`); with 1 it waits for that reduction first."""
    persistent: bool = False
    """One program per SM walking the work items (`_gluon_attn_bwd_persistent_kernel`), as cuDNN's backward runs: no
    program start per key tile, the next item's Q/dO under this one's epilogue."""

    def __post_init__(self):
        if self.block_m != 64:
            raise ValueError(f"block_m ({self.block_m}) must be 64")
        if self.num_stages < 1:
            raise ValueError(f"num_stages ({self.num_stages}) must be >= 1")
        if isinstance(self.head_group, bool) or not isinstance(self.head_group, int) or self.head_group < 0:
            raise ValueError(f"head_group ({self.head_group!r}) must be an int >= 0 (0: all heads)")
        for name in ("persistent", "dq_whole", "rows_tma"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be a bool")
        if type(self.dq_buffers) is not int or self.dq_buffers not in (1, 2):
            raise ValueError(f"dq_buffers ({self.dq_buffers!r}) must be 1 or 2")
        if not isinstance(self.dk_late, bool) or (self.dk_late and not self.dq_whole):
            raise ValueError(f"dk_late ({self.dk_late!r}) must be a bool, and True only with dq_whole")

    @property
    def name(self) -> str:
        return (f"bwd2x{BWD_BLOCK_N}xq{self.block_m}/s{self.num_stages}" + ("/dqw" if self.dq_whole else "")
                + ("/dkl" if self.dk_late else "") + ("/rt" if self.rows_tma else "")
                + (f"/q{self.dq_buffers}" if self.dq_buffers != 1 else "") + ("/p" if self.persistent else "")
                + (f"/g{self.head_group}" if self.head_group else ""))

    @property
    def kernel(self):
        return _gluon_attn_bwd_persistent_kernel if self.persistent else _gluon_attn_bwd_kernel

    def registers(self) -> tuple[int, int]:
        return register_split(2)

    def shared_bytes(self, head_dim: int, elem: int = 2) -> int:
        """K, V of both groups, the Q/dO ring, a dS^T tile of both groups' keys per ring slot (and each group's
        `dq_buffers` fp32 dQ tiles: half of the head dim, or all of it with `dq_whole`; with `rows_tma` the L and D
        rows per slot)."""
        return (elem * (head_dim * (4 * BWD_BLOCK_N + 2 * self.num_stages * self.block_m)
                        + self.num_stages * 2 * BWD_BLOCK_N * self.block_m)
                + 4 * self.block_m * head_dim * (2 if self.dq_whole else 1) * self.dq_buffers
                + (4 * 2 * self.num_stages * self.block_m if self.rows_tma else 0))


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself when a TMA descriptor can read it (unit stride on D, 16-byte strides and pointer), else a copy."""
    elem = t.element_size()
    if t.stride(-1) == 1 and not any((s * elem) % 16 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _rows_descriptor(t: torch.Tensor, block_m: int) -> "TensorDescriptor":
    """A TMA descriptor over zero-padded rows (`bwd_launch_args`' `lse`, `delta`) flattened to one dimension,
    block_m at a time."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return tensor_descriptor(t, [block_m], layout, shape=[t.numel()], strides=[1])


def bwd_launch_args(q, k, v, grad_out, dk, dv, lse, delta, dq_acc, is_causal: bool, config: GluonBwdConfig):
    """(grid, positional args, keyword args) of one backward launch (the launcher's and the CPU compile check's);
    `dq_acc`: fp32 zeros of q's shape, contiguous (a TMA target; the unit drops rows past N_Q); `lse`, `delta`:
    (B, H, N_Q rounded up to whole block_m tiles) fp32, zeros past N_Q, which the kernel reads without a mask (the
    zeros make P = 1 and dS = 0 on the rows past N_Q, whose Q and dO the TMA unit reads as zeros);
    `_onepass_bwd_preprocess_kernel` writes all three."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    need, limit = config.shared_bytes(head_dim, q.element_size()), shared_memory_limit(q.device)
    if need > limit:
        raise SharedMemoryExceeded(f"{config.name} needs {need} bytes of shared memory at head_dim {head_dim}, more "
                                   f"than the {limit} a block may use on {q.device} (fewer dq_buffers or "
                                   f"num_stages, or dq_whole=False)")
    maxnreg, consumer_regs = config.registers()
    num_items = triton.cdiv(n_k, 2 * BWD_BLOCK_N) * batch * heads
    dq_block = [1, 1, config.block_m, head_dim if config.dq_whole else head_dim // 2]
    dq_desc = tensor_descriptor(dq_acc, dq_block, shared_layout(tuple(dq_block), torch.float32))
    rows = tuple(_rows_descriptor(t, config.block_m) for t in (lse, delta)) if config.rows_tma else (lse, delta)
    args = (descriptor(q, config.block_m), descriptor(k, BWD_BLOCK_N), descriptor(v, BWD_BLOCK_N),
            descriptor(grad_out, config.block_m), descriptor(dk, BWD_BLOCK_N), descriptor(dv, BWD_BLOCK_N),
            dq_desc, *rows, heads)
    if config.persistent:
        grid = (min(num_items, num_sms(q.device)),)
        args += (batch * heads,)
    else:
        grid = (num_items,)
    args += (n_q, n_k, LOG2E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim))
    meta = dict(HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=BWD_BLOCK_N, NUM_STAGES=config.num_stages,
                IS_CAUSAL=is_causal, GROUP=config.head_group, CONSUMER_REGS=consumer_regs, LOADER_REGS=LOADER_REGS,
                DK_LATE=config.dk_late, ROWS_TMA=config.rows_tma, DQ_BUFFERS=config.dq_buffers,
                num_warps=4,
                maxnreg=maxnreg)
    return grid, args, meta


def check_bwd_inputs(where: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, grad_out: torch.Tensor, config, kind: type) -> None:
    """Raise a ValueError prefixed by `where` unless a Gluon backward runs on these inputs with `config` (a `kind`)."""
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"{where}: {reason}")
    if not isinstance(config, kind):
        raise ValueError(f"{where}: config {config!r} is not a {kind.__name__}")
    check_backward_inputs(q, out, lse, grad_out, where=f"{where}: ")


def bwd_launch_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      grad_out: torch.Tensor, is_causal: bool, config) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(dO in q's dtype and TMA-readable, L contiguous, the launches' problem key) of a Gluon backward."""
    grad_out = tma_ready(grad_out if grad_out.dtype == q.dtype else grad_out.to(q.dtype))
    lse = lse.contiguous()
    # What every launch's argument keys read (the new buffers are contiguous and aligned; q, k, v aligned: checked;
    # dO made so; L's and O's pointers, which the preprocess reads, by their alignment).
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), grad_out.stride(), q.dtype,
           out.dtype, is_causal, config, lse.data_ptr() & 15, out.data_ptr() & 15)
    return grad_out, lse, key


def gluon_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor, is_causal: bool, config: GluonBwdConfig
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the inputs' dtype from O and the natural-log L of the forward, inputs checked. dK, dV are
    written once per key; dQ is summed in fp32 by the TMA unit, its last bits can vary run to run."""
    check_bwd_inputs("gluon_attention_bwd", q, k, v, out, lse, grad_out, config, GluonBwdConfig)
    return launch_bwd(q, k, v, out, lse, grad_out, is_causal, config)


def launch_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               grad_out: torch.Tensor, is_causal: bool, config: GluonBwdConfig
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gluon_attention_bwd` without the input checks, for callers that checked them already."""
    batch, heads, n_q, head_dim = q.shape
    grad_out, lse, key = bwd_launch_inputs(q, k, v, out, lse, grad_out, is_causal, config)
    with device_of(q):
        dk, dv = empty_like_layout(k), empty_like_layout(v)  # the inputs' layouts: valid TMA targets
        # D and L zero-padded to whole query tiles (as `bwd_launch_args` takes them) and the fp32 dQ accumulator
        # zeroed, in one launch.
        n_pad = triton.cdiv(n_q, config.block_m) * config.block_m
        lse_pad, delta_pad = (torch.empty((batch, heads, n_pad), dtype=torch.float32, device=q.device)
                              for _ in range(2))
        dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        launch(_onepass_bwd_preprocess_kernel, (n_pad // config.block_m, batch * heads),
               (out, grad_out, lse, dq_acc, delta_pad, lse_pad, *out.stride(), *grad_out.stride(), heads, n_q, n_pad),
               dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=config.block_m, num_warps=4), key)
        grid, args, meta = bwd_launch_args(q, k, v, grad_out, dk, dv, lse_pad, delta_pad, dq_acc, is_causal, config)
        launch(config.kernel, grid, args, meta, key)
        dq = empty_like_layout(q)
        dq.copy_(dq_acc)
    return dq, dk, dv
