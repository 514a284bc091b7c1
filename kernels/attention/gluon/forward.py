"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialised, FlashAttention-3 style.

Computes O = softmax(Q K^T / sqrt(d) + mask) V and L = logsumexp(Q K^T / sqrt(d) + mask) (natural log, fp32: the tl
kernels' units) for q (B, H, N_Q, D), k and v (B, H, N_K, D), bf16 or fp16, D 64 or 128, unit stride on D and 16-byte
aligned strides (4-D TMA descriptors: tiles never cross a head, rows past N read 0, stores past N drop). Causal is the
top-left mask (query i sees keys j <= i, also when n_q != n_k). [J. Shah et al., FlashAttention-3, 2024, 3.1-3.2.]

A program owns NUM_CONSUMERS * BLOCK_M query rows: a loader warp TMA-loads Q once and K/V through a NUM_STAGES ring
(`*_ready` / `*_empty` mbarriers), and each consumer warp group runs S(j) = Q K(j)^T and O += P(j-1) V(j-1) as async
wgmma, softmax(j) under P V (P stays in registers). `GluonConfig.persistent`: one program per SM walks the items a
host table deals it (`schedule.work_schedule`), the ring running on across items.

Usage: `out, lse = gluon_attention_fwd(q, k, v, is_causal, config)` (checked) or `launch_fwd` (inputs checked
already); `dispatch.gluon_fwd_config(q, k)` is the config the gluon path launches.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from kernels.attention.checks import unsupported_reason
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from kernels.attention.gluon.runtime import (
    LOADER_REGS,
    descriptor,
    launch,
    register_split,
)
from kernels.attention.gluon.schedule import schedule_table
from kernels.attention.triton.kernels import LOG2E
from kernels.device import device_of, empty_like_layout, num_sms

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.compat import (
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        tma_load,
        tma_store,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from kernels.attention.gluon.fast_math import exp2_mixed
    from kernels.attention.gluon.schedule import item_at, item_range, work_item


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------
if HAS_GLUON_HOPPER:

    @gluon.jit
    def _load_q(q_desc, q_bufs, q_bar, off_b, off_h, start_m, NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr):
        """The consumers' Q tiles, behind one barrier."""
        mbarrier.expect(q_bar, NUM_CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(NUM_CONSUMERS):
            tma_load(q_desc, [off_b, off_h, start_m + c * BLOCK_M, 0], q_bar, q_bufs.index(c))

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, off_b, off_h, num_kv, it0,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """K(j), V(j) for j < num_kv into ring slot (it0 + j) % NUM_STAGES: `it0` counts the tiles the ring took
        before (earlier work items of a persistent program). Empty barriers start "phase 1 complete", so the first
        pass through the ring does not wait."""
        for j in range(num_kv):
            it = it0 + j
            stage = it % NUM_STAGES
            phase = (it // NUM_STAGES) & 1
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [off_b, off_h, j * BLOCK_N, 0], k_ready.index(stage),
                                            k_bufs.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [off_b, off_h, j * BLOCK_N, 0], v_ready.index(stage),
                                            v_bufs.index(stage))

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                off_b, off_h, start_m, num_kv,
                NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_STAGES: gl.constexpr):
        """Producer warp: Q tiles once, then K(j), V(j) into ring slot j % NUM_STAGES."""
        _load_q(q_desc, q_bufs, q_bar, off_b, off_h, start_m, NUM_CONSUMERS, BLOCK_M)
        _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, off_b, off_h, num_kv, 0,
                 BLOCK_N, NUM_STAGES)

    @gluon.jit
    def _persistent_loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, k_empty,
                           v_ready, v_empty, H, BH, SCHEDULE, GROUP: gl.constexpr, N_Q, N_K,
                           NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, BALANCED: gl.constexpr):
        """Producer warp of a persistent program: per work item, its Q tiles once the consumers released the
        previous ones (`q_empty`, after their last S), then its K/V through the ring, which runs on across items."""
        TILE_M: gl.constexpr = NUM_CONSUMERS * BLOCK_M
        it0 = 0
        n = 0
        first, stop, step = item_range(SCHEDULE, gl.cdiv(N_Q, TILE_M) * BH, BALANCED)
        for i in range(first, stop, step):
            t = item_at(i, SCHEDULE, BALANCED)
            pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = work_item(t, BH, H, GROUP, N_Q, N_K, TILE_M,
                                                                          BLOCK_N, IS_CAUSAL)
            mbarrier.wait(q_empty, (n & 1) ^ 1)
            _load_q(q_desc, q_bufs, q_bar, off_b, off_h, start_m, NUM_CONSUMERS, BLOCK_M)
            _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, off_b, off_h, num_kv, it0,
                     BLOCK_N, NUM_STAGES)
            it0 += num_kv
            n += 1

    @gluon.jit
    def _softmax_tile(s, m_i, j, n_unmasked, rows, N_K, qk_scale, s_layout: gl.constexpr,
                      IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, EXP2_EMULATED: gl.constexpr):
        """Scores S(j) (raw Q K^T, fp32) -> (P~ in base 2 units, new row max, alpha = exp2(m_old - m_new))."""
        if j >= n_unmasked:  # the diagonal and key-tail tiles only (a uniform branch)
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(cols < N_K, 0)
            if IS_CAUSAL:
                keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # One FMA + exp2 per score: scale and max subtraction folded (base-2 units).
        p = exp2_mixed(s * qk_scale - gl.expand_dims(m_new, 1), EXP2_EMULATED)
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, alpha

    @gluon.jit
    def _rescale_in_place(acc, alpha):
        """acc * alpha as inline asm with side effects: LLVM keeps it where the program has it, between the S wgmma
        issued before it and the P V one after (pure multiplies move to the end of the loop's previous iteration)."""
        return gl.inline_asm_elementwise("mul.f32 $0, $1, $2;", "=r,r,r", [acc, alpha], dtype=gl.float32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _consumer(q_smem, o_smem, k_bufs, v_bufs, q_bar, q_phase, q_empty, k_ready, k_empty, v_ready, v_empty,
                  o_desc, L, off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, it0, qk_scale,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                  EXP2_EMULATED: gl.constexpr, RESCALE_UNDER_S: gl.constexpr):
        """One warp group's BLOCK_M query rows [start_m, start_m + BLOCK_M): Algorithm 1 of FA3 (pipelined). The
        ring slots continue from `it0` (the key tiles of the program's earlier work items) and Q's barrier is in
        phase `q_phase`. O goes out through `o_smem`: Q's own buffer in a one-item program; in a PERSISTENT one a
        buffer of its own, and Q's is released (`q_empty`) after the last S, so that the next item's Q loads under
        this one's last P V and epilogue."""
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q = q_smem.reshape([BLOCK_M, HEAD_DIM])
        rows = start_m + gl.arange(0, BLOCK_M, layout=row_s)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        # 1. Tile 0: S(0), softmax(0); no P V in flight yet.
        mbarrier.wait(q_bar, q_phase)
        first = it0 % NUM_STAGES
        mbarrier.wait(k_ready.index(first), (it0 // NUM_STAGES) & 1)
        k = k_bufs.index(first).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(first), count=1)
        p32, m_i, alpha = _softmax_tile(s, m_i, 0, n_unmasked, rows, N_K, qk_scale, s_layout, IS_CAUSAL, BLOCK_N,
                                        EXP2_EMULATED)
        l_i = gl.sum(p32, 1)
        p = gl.convert_layout(p32.to(dtype), p_layout)

        # 2. Steady state, iteration j: S(j) and P(j-1) V(j-1) go to the tensor cores back to back; softmax(j)
        #    is meant to run under P(j-1) V(j-1) (the K release below says what ptxas makes of that).
        for j in range(1, num_kv):
            it = it0 + j
            stage = it % NUM_STAGES
            prev = (it - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(stage), (it // NUM_STAGES) & 1)
            k = k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
            s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
            if RESCALE_UNDER_S:  # O's rescale for P(j-1) V(j-1), while S(j) runs on the tensor cores (FA3's order)
                acc = _rescale_in_place(acc, gl.expand_dims(gl.convert_layout(alpha, row_o), 1))
            mbarrier.wait(v_ready.index(prev), ((it - 1) // NUM_STAGES) & 1)
            v = v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
            acc = warpgroup_mma(p, v, acc, is_async=True)
            # wgmma groups retire in order: one outstanding left means S(j) is done, P V may still run.
            s = warpgroup_mma_wait(1, deps=(s,))
            p32, m_i, alpha = _softmax_tile(s, m_i, j, n_unmasked, rows, N_K, qk_scale, s_layout, IS_CAUSAL,
                                            BLOCK_N, EXP2_EMULATED)
            l_i = l_i * alpha + gl.sum(p32, 1)
            # K(j) is released here, under a branch the compiler cannot fold, so that the wait below starts a
            # new basic block: within one block ptxas hoists a wgmma wait above the exp2s.
            if N_K > 0:
                mbarrier.arrive(k_empty.index(stage), count=1)
            # P(j) goes into the registers P(j-1) V(j-1) still reads (the loop carries P): pack it only after
            # that wgmma retires; p32 passes through the wait so that the packing cannot move above it.
            acc, p32 = warpgroup_mma_wait(0, deps=(acc, p32))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p = gl.convert_layout(p32.to(dtype), p_layout)
            if not RESCALE_UNDER_S:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if PERSISTENT:  # every S has retired: Q's buffer may take the next item's Q
            mbarrier.arrive(q_empty, count=1)

        # 3. The last P V.
        last_it = it0 + num_kv - 1
        last = last_it % NUM_STAGES
        mbarrier.wait(v_ready.index(last), (last_it // NUM_STAGES) & 1)
        v = v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM])
        if RESCALE_UNDER_S:  # alpha of the last tile (of tile 0, 0 against an O of zeros, when it is the only one)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)

        # 4. Epilogue: O = acc / l through `o_smem` and a TMA store (rows past N_Q dropped); L = ln(l) + m ln 2
        #    (natural log, like the tl kernels). A persistent program waits for its previous O store to leave the
        #    buffer first, and for its last one at the end of the program.
        acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
        if PERSISTENT:
            tma.store_wait(0)
        o_smem.reshape([BLOCK_M, HEAD_DIM]).store(acc.to(dtype))
        fence_async_shared()
        tma_store(o_desc, [off_b, off_h, start_m, 0], o_smem)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        gl.store(L + pid_bh.to(gl.int64) * N_Q + rows, lse, mask=rows < N_Q)
        if not PERSISTENT:
            tma.store_wait(0)

    @gluon.jit
    def _consumer_partition(C: gl.constexpr, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                            o_desc, L, off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, EXP2_EMULATED: gl.constexpr,
                            RESCALE_UNDER_S: gl.constexpr):
        """Partition entry of consumer C: its Q buffer (also O's) and rows."""
        _consumer(q_bufs.index(C), q_bufs.index(C), k_bufs, v_bufs, q_bar, 0, q_bar, k_ready, k_empty, v_ready,
                  v_empty, o_desc, L, off_b, off_h, pid_bh, start_m + C * BLOCK_M, N_Q, N_K, num_kv, n_unmasked, 0,
                  qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, False, EXP2_EMULATED, RESCALE_UNDER_S)

    @gluon.jit
    def _persistent_consumer(C: gl.constexpr, q_bufs, o_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, k_empty,
                             v_ready, v_empty, o_desc, L, H, BH, SCHEDULE, GROUP: gl.constexpr, N_Q, N_K, qk_scale,
                             HEAD_DIM: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                             NUM_CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr, EXP2_EMULATED: gl.constexpr,
                             RESCALE_UNDER_S: gl.constexpr, BALANCED: gl.constexpr):
        """Consumer C of a persistent program: its work items (`item_range`) in `work_item` numbering."""
        TILE_M: gl.constexpr = NUM_CONSUMERS * BLOCK_M
        it0 = 0
        n = 0
        first, stop, step = item_range(SCHEDULE, gl.cdiv(N_Q, TILE_M) * BH, BALANCED)
        for i in range(first, stop, step):
            t = item_at(i, SCHEDULE, BALANCED)
            pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = work_item(t, BH, H, GROUP, N_Q, N_K, TILE_M,
                                                                          BLOCK_N, IS_CAUSAL)
            _consumer(q_bufs.index(C), o_bufs.index(C), k_bufs, v_bufs, q_bar, n & 1, q_empty, k_ready, k_empty,
                      v_ready, v_empty, o_desc, L, off_b, off_h, pid_bh, start_m + C * BLOCK_M, N_Q, N_K, num_kv,
                      n_unmasked, it0, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, True,
                      EXP2_EMULATED, RESCALE_UNDER_S)
            it0 += num_kv
            n += 1
        tma.store_wait(0)

    @gluon.jit
    def forward_shared(q_desc, k_desc, v_desc, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
        """Shared memory of a forward program: Q (one tile per consumer), the K/V ring and their barriers."""
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
            mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
        return q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty

    @gluon.jit
    def _gluon_attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, L, H, N_Q, N_K, qk_scale, GROUP: gl.constexpr,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                               IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                               EXP2_EMULATED: gl.constexpr, RESCALE_UNDER_S: gl.constexpr):
        """Grid (cdiv(N_Q, NUM_CONSUMERS * BLOCK_M) * B * H,): program -> (query tile, batch*head), heavy first."""
        TILE_M: gl.constexpr = NUM_CONSUMERS * BLOCK_M
        # 1. Work item: this program's (`work_item`, heaviest first).
        num_bh = gl.num_programs(0) // gl.cdiv(N_Q, TILE_M)
        pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = work_item(gl.program_id(0), num_bh, H, GROUP, N_Q,
                                                                      N_K, TILE_M, BLOCK_N, IS_CAUSAL)
        # 2. Shared memory: Q (one tile per consumer, reused for O), the K/V ring, barriers.
        q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty = forward_shared(q_desc, k_desc, v_desc,
                                                                                           NUM_STAGES, NUM_CONSUMERS)

        # 3. Partitions: consumer 0 is the default (num_warps = 4); the others and the loader are workers. The
        #    argument tuples are written inline: a tuple assigned to a variable turns its constexprs into values.
        if NUM_CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer_partition, (0, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, L,
                                       off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, EXP2_EMULATED,
                                       RESCALE_UNDER_S)),
                (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                           off_b, off_h, start_m, num_kv, NUM_CONSUMERS, BLOCK_M, BLOCK_N, NUM_STAGES)),
            ], [1], [LOADER_REGS])
        elif NUM_CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer_partition, (0, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, L,
                                       off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, EXP2_EMULATED,
                                       RESCALE_UNDER_S)),
                (_consumer_partition, (1, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, L,
                                       off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, EXP2_EMULATED,
                                       RESCALE_UNDER_S)),
                (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                           off_b, off_h, start_m, num_kv, NUM_CONSUMERS, BLOCK_M, BLOCK_N, NUM_STAGES)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.static_assert(NUM_CONSUMERS == 3, "NUM_CONSUMERS must be 1, 2 or 3")
            gl.warp_specialize([
                (_consumer_partition, (0, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, L,
                                       off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, EXP2_EMULATED,
                                       RESCALE_UNDER_S)),
                (_consumer_partition, (1, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, L,
                                       off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, EXP2_EMULATED,
                                       RESCALE_UNDER_S)),
                (_consumer_partition, (2, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, L,
                                       off_b, off_h, pid_bh, start_m, N_Q, N_K, num_kv, n_unmasked, qk_scale,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, EXP2_EMULATED,
                                       RESCALE_UNDER_S)),
                (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                           off_b, off_h, start_m, num_kv, NUM_CONSUMERS, BLOCK_M, BLOCK_N, NUM_STAGES)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


    @gluon.jit
    def _gluon_attn_fwd_persistent_kernel(q_desc, k_desc, v_desc, o_desc, L, H, BH, N_Q, N_K, qk_scale, SCHEDULE,
                                          GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                          BLOCK_N: gl.constexpr,
                                          NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                                          IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                          LOADER_REGS: gl.constexpr, EXP2_EMULATED: gl.constexpr,
                                          RESCALE_UNDER_S: gl.constexpr, BALANCED: gl.constexpr):
        """Grid (at most one program per SM,): program p takes its list of work items in SCHEDULE
        (`work_schedule`; `work_item` numbering, the heaviest first in each head group) with BALANCED, else items
        p, p + #programs, ...; its K/V ring runs on from one item to the next, and the next item's Q loads under the
        last P V and epilogue of the current one (O has buffers of its own)."""
        gl.static_assert(NUM_CONSUMERS == 2, "the persistent forward has two consumer groups")
        q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty = forward_shared(q_desc, k_desc, v_desc,
                                                                                           NUM_STAGES, NUM_CONSUMERS)
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [NUM_CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_empty, count=NUM_CONSUMERS)
        gl.warp_specialize([
            (_persistent_consumer, (0, q_bufs, o_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, k_empty, v_ready,
                                    v_empty, o_desc, L, H, BH, SCHEDULE, GROUP, N_Q, N_K, qk_scale, HEAD_DIM, BLOCK_M,
                                    BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, EXP2_EMULATED, RESCALE_UNDER_S,
                                    BALANCED)),
            (_persistent_consumer, (1, q_bufs, o_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, k_empty, v_ready,
                                    v_empty, o_desc, L, H, BH, SCHEDULE, GROUP, N_Q, N_K, qk_scale, HEAD_DIM, BLOCK_M,
                                    BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, EXP2_EMULATED, RESCALE_UNDER_S,
                                    BALANCED)),
            (_persistent_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, q_empty, k_ready, k_empty,
                                  v_ready, v_empty, H, BH, SCHEDULE, GROUP, N_Q, N_K, NUM_CONSUMERS, BLOCK_M, BLOCK_N,
                                  NUM_STAGES, IS_CAUSAL, BALANCED)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------------------
# Configs and launcher
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class GluonConfig:
    """Launch knobs of `_gluon_attn_fwd_kernel` (one program = num_consumers * block_m query rows)."""

    block_m: int = 64
    """Query rows per consumer warp group (64: one wgmma row block per warp group)."""
    block_n: int = 128
    """Keys per K/V tile."""
    num_stages: int = 2
    """Depth of the K/V shared-memory ring."""
    num_consumers: int = 2
    """Consumer warp groups (1-3), each on its own block_m query rows."""
    persistent: bool = False
    """One program per SM walking the work items (`_gluon_attn_fwd_persistent_kernel`; two consumer groups):
    the next item's loads overlap the current one's tail, which short sequences pay per item. Each program runs the
    items `work_schedule` deals it."""
    head_group: int = 0
    """Heads whose work items run together (`work_item`; a compile-time constant): 0 for all B * H, heaviest first
    across them; fewer keeps the programs in flight on fewer heads' K/V, more of them in L2 at long sequences."""
    exp2_emulated: int = 0
    """One in this many (2, 4, 8 or 16) of the softmax's exp2s computed by a polynomial on the FMA pipe instead of the
    MUFU unit (`fast_math.exp2_mixed`, FlashAttention-4's split); 0: none."""

    rescale_under_s: bool = False
    """O's rescale by alpha(j-1) issued after S(j), so that it runs while S(j) is on the tensor cores, and before
    P(j-1) V(j-1) (FlashAttention-3's order); False: at the end of iteration j-1, before S(j) is issued."""

    round_robin: bool = False
    """Persistent grid only: program p takes work items p, p + #programs, ... instead of its list in `work_schedule`'s
    table."""

    def __post_init__(self):
        for name in ("rescale_under_s", "round_robin", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be a bool")
        if self.round_robin and not self.persistent:
            raise ValueError("round_robin needs persistent: it orders the work items of a persistent grid")
        if type(self.exp2_emulated) is not int or self.exp2_emulated not in (0, 2, 4, 8, 16):
            raise ValueError(f"exp2_emulated ({self.exp2_emulated!r}) must be 0, 2, 4, 8 or 16")
        if isinstance(self.head_group, bool) or not isinstance(self.head_group, int) or self.head_group < 0:
            raise ValueError(f"head_group ({self.head_group!r}) must be an int >= 0 (0: all heads)")
        if self.persistent and self.num_consumers != 2:
            raise ValueError(f"persistent needs num_consumers 2, not {self.num_consumers}")
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m ({self.block_m}) must be 64 or 128")
        if self.block_n not in (32, 64, 128):
            raise ValueError(f"block_n ({self.block_n}) must be 32, 64 or 128 (a power of two: a TMA box)")
        if self.num_stages < 1 or self.num_consumers not in (1, 2, 3):
            raise ValueError(f"num_stages ({self.num_stages}) must be >= 1 and num_consumers "
                             f"({self.num_consumers}) 1, 2 or 3")

    @property
    def name(self) -> str:
        return (f"{self.num_consumers}x{self.block_m}x{self.block_n}/s{self.num_stages}"
                + ("/p" if self.persistent else "") + (f"/g{self.head_group}" if self.head_group else "")
                + (f"/e{self.exp2_emulated}" if self.exp2_emulated else "") + ("/ru" if self.rescale_under_s else "")
                + ("/rr" if self.round_robin else ""))

    def registers(self) -> tuple[int, int]:
        return register_split(self.num_consumers)

    def shared_bytes(self, head_dim: int, elem: int = 2) -> int:
        """Q (and O's own buffers when persistent) and the K/V ring."""
        q_tiles = self.num_consumers * self.block_m * (2 if self.persistent else 1)
        return elem * head_dim * (q_tiles + 2 * self.num_stages * self.block_n)

    @property
    def kernel(self):
        return _gluon_attn_fwd_persistent_kernel if self.persistent else _gluon_attn_fwd_kernel


def launch_args(q, k, v, out, lse, is_causal: bool, config: GluonConfig):
    """(grid, positional args, keyword args) of one launch: shared by the launcher and the CPU compile check."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    maxnreg, consumer_regs = config.registers()
    num_items = triton.cdiv(n_q, config.num_consumers * config.block_m) * batch * heads
    descriptors = (descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
                   descriptor(out, config.block_m), lse, heads)
    if config.persistent:
        grid = (min(num_items, num_sms(q.device)),)
        schedule = None
        if not config.round_robin:
            schedule = schedule_table(batch * heads, n_q, n_k, config.num_consumers * config.block_m,
                                      config.block_n, config.head_group, is_causal, grid[0], q.device)
        args = (*descriptors, batch * heads, n_q, n_k, LOG2E / math.sqrt(head_dim), schedule)
    else:
        grid = (num_items,)
        args = (*descriptors, n_q, n_k, LOG2E / math.sqrt(head_dim))
    meta = dict(GROUP=config.head_group, HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                NUM_STAGES=config.num_stages,
                NUM_CONSUMERS=config.num_consumers, IS_CAUSAL=is_causal, CONSUMER_REGS=consumer_regs,
                LOADER_REGS=LOADER_REGS, EXP2_EMULATED=config.exp2_emulated, RESCALE_UNDER_S=config.rescale_under_s,
                num_warps=4, maxnreg=maxnreg)
    if config.persistent:
        meta["BALANCED"] = not config.round_robin
    return grid, args, meta


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config: GluonConfig
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O like q, L fp32 (B, H, N_Q), natural log) of softmax(Q K^T / sqrt(d) [+ causal mask]) V, inputs checked
    (`checks.unsupported_reason`: a ValueError names the rule they break)."""
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"gluon_attention_fwd: {reason}")
    return launch_fwd(q, k, v, is_causal, config)


def launch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config: GluonConfig
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gluon_attention_fwd` without the input checks, for callers whose inputs `unsupported_reason` accepted."""
    out = empty_like_layout(q)  # q's layout (unit stride on D, 16-byte strides: a valid TMA target)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    grid, args, meta = launch_args(q, k, v, out, lse, is_causal, config)
    # What every argument's key reads (out and lse are new and aligned, out in q's layout, lse contiguous; q, k, v
    # aligned: checked).
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, is_causal, config)
    with device_of(q):
        launch(config.kernel, grid, args, meta, key)
    return out, lse
