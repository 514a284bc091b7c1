"""FlashAttention backward for Hopper (sm_90) in Gluon, FlashAttention-3 style (section 3.3).

Consumes the forward's O and natural-log L (`kernels/flash_attention_gluon.py`) and returns (dQ, dK, dV) in the
inputs' dtype, same semantics as `kernels.attention.interface.flash_attention_bwd` (top-left causal mask, scale
1/sqrt(d), any N, n_q != n_k, d 64 or 128, bf16 / fp16). D = rowsum(dO O) comes from the tl preprocess kernel. Every
kernel runs a 1-warp TMA loader and two consumer warp groups (register split of the forward) and numbers its
causal work items heaviest first. The gluon path of `kernels.attention.interface` runs the one-pass backward
(`gluon_bwd_chosen` there); the two-pass one is the deterministic alternative, no faster than the tl kernels'
(results/flash_hopper_notes.md, section 7).

two_pass (the default here; deterministic: dQ is bitwise equal run to run), FA2's two passes with P recomputed:
- `_gluon_attn_bwd_dkdv_kernel`: one program per 2 * 64 keys, each consumer holding dK, dV of its 64 keys in fp32
  registers; the loader streams Q(i), dO(i) through an mbarrier ring. S^T = K Q^T and dP^T = V dO^T are in flight
  together, P^T is computed under dP^T, dS^T under dV += P^T dO, then dK += dS^T Q (P^T, dS^T register operands).
- `_gluon_attn_bwd_dq_kernel`: one program per 2 * 64 query rows, each consumer holding Q, dO in shared memory and
  dQ in fp32 registers; the loader streams K(j), V(j). S = Q K^T and dP = dO V^T in flight together, P under dP
  (a branch keeps ptxas from hoisting the dP wait above the exp2s), dQ += dS K with dS from registers.
one_pass (`kernels/flash_attention_gluon_bwd_onepass.py`): the dK/dV kernel's loop plus each program's share of
dQ(i) = dS K through a shared dS^T tile, summed into an fp32 dQ by the TMA unit (so dQ's last bits can vary run to
run): 5 matmuls per tile pair instead of 7.
Wgmma accumulators are waited on within their iteration: carried in flight across the loop, ptxas serialises every
wgmma of the kernel (C7512).

Usage: `dq, dk, dv = gluon_attention_bwd(q, k, v, out, lse, grad_out, is_causal, mode="one_pass")`;
`gluon_attention(q, k, v, is_causal)` differentiates through the Gluon forward and the two-pass backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import triton

from kernels.device import device_of, empty_like_layout
from kernels.attention.gluon.forward import (
    HAS_GLUON_HOPPER,
    LOADER_REGS,
    LOG2E,
    _descriptor,
    gluon_attention_fwd,
    launch,
    register_split,
    unsupported_reason,
)
from kernels.attention.reference import check_backward_inputs

if TYPE_CHECKING:
    from kernels.attention.gluon.backward import GluonBwdConfig

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.forward import _fwd_shared, _work_item
    from kernels.attention.gluon.compat import (fence_async_shared, gl, gluon, mbarrier, tma, tma_load, tma_store,
                                      warpgroup_mma, warpgroup_mma_wait)

# ----------------------------------------------------------------------------------------------------------
# The loader of the key-tile-stationary kernels (two-pass dK/dV, one-pass): K, V once, Q/dO tiles streamed
# ----------------------------------------------------------------------------------------------------------
if HAS_GLUON_HOPPER:

    @gluon.jit
    def _load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, kv_bar, off_b, off_h, start_n,
                       NUM_CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Each consumer's K and V rows [start_n + c * BLOCK_N, ...) into its buffers, all on `kv_bar`."""
        mbarrier.expect(kv_bar, NUM_CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for c in gl.static_range(NUM_CONSUMERS):
            tma_load(k_desc, [off_b, off_h, start_n + c * BLOCK_N, 0], kv_bar, k_bufs.index(c))
            tma_load(v_desc, [off_b, off_h, start_n + c * BLOCK_N, 0], kv_bar, v_bufs.index(c))

    @gluon.jit
    def _load_q_do_tile(q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, empty, off_b, off_h, row, it,
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
    def _bwd_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, q_ready, do_ready,
                    empty, off_b, off_h, start_n, m_start, num_m,
                    NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr):
        """Producer warp: each consumer's K and V rows once, then Q(i), dO(i) into ring slot i % NUM_STAGES."""
        _load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, kv_bar, off_b, off_h, start_n, NUM_CONSUMERS, BLOCK_N)
        for it in range(num_m):
            _load_q_do_tile(q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, empty, off_b, off_h,
                            (m_start + it) * BLOCK_M, it, NUM_STAGES)


# ----------------------------------------------------------------------------------------------------------
# Two-pass backward: a dK/dV kernel (key tile stationary, no dQ) and a dQ kernel (query tile stationary)
# ----------------------------------------------------------------------------------------------------------
if HAS_GLUON_HOPPER:

    @gluon.jit
    def _key_stationary_shared(q_desc, k_desc, v_desc, do_desc, NUM_STAGES: gl.constexpr):
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
    def _sdp_transposed(k, v, q, do, l2, keys, cols, start_m, start_n, N_K, qk_scale, s_layout: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """S^T = K Q^T and dP^T = V dO^T issued together (keys as wgmma rows), then P^T = exp(S^T / sqrt(d) - L)
        under dP^T, diagonal and tail tiles masked: (P^T fp32, dP^T still in flight). The dK/dV loops' shared
        first half (the two-pass one here, the one-pass one in flash_attention_gluon_bwd_onepass.py)."""
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

    @gluon.jit
    def _dkdv_consumer(k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc, dv_desc, L,
                       Delta, off_b, off_h, pid_bh, start_n, m_start, num_m, N_Q, N_K, qk_scale, sm_scale,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """One warp group's BLOCK_N keys: `_bwd_consumer` without dQ (dS stays in registers); P^T is kept only as
        the 16-bit dV operand, and dS^T is computed from it (fp32 P^T beside dK, dV, dP^T spills at d 128)."""
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        k = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.reshape([BLOCK_N, HEAD_DIM])
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        lse_base = L + pid_bh.to(gl.int64) * N_Q
        delta_base = Delta + pid_bh.to(gl.int64) * N_Q
        # 1. Causal: query tiles wholly above these keys are released unread (after their load landed, so that an
        #    early arrival cannot complete the other consumer's phase of the same slot).
        it0 = 0
        if IS_CAUSAL:
            it0 = gl.minimum(start_n // BLOCK_M - m_start, num_m)
        for it in range(0, it0):
            mbarrier.wait(q_ready.index(it % NUM_STAGES), (it // NUM_STAGES) & 1)
            mbarrier.wait(do_ready.index(it % NUM_STAGES), (it // NUM_STAGES) & 1)
            mbarrier.arrive(empty.index(it % NUM_STAGES), count=1)
        mbarrier.wait(kv_bar, 0)
        for it in range(it0, num_m):
            stage = it % NUM_STAGES
            phase = (it // NUM_STAGES) & 1
            start_m = (m_start + it) * BLOCK_M
            cols = start_m + gl.arange(0, BLOCK_M, layout=col_s)
            # Rows past N_Q: Q and dO read as 0 (TMA), L and D as 0, so P = 1 and dS = 0 there.
            l2 = gl.load(lse_base + cols, mask=cols < N_Q, other=0.0) * 1.4426950408889634
            mbarrier.wait(q_ready.index(stage), phase)
            mbarrier.wait(do_ready.index(stage), phase)
            q = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
            do = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
            # 2.-3. S^T and dP^T in flight together; P^T under dP^T, masked.
            p, dp = _sdp_transposed(k, v, q, do, l2, keys, cols, start_m, start_n, N_K, qk_scale, s_layout, BLOCK_N,
                                    BLOCK_M, IS_CAUSAL)
            # 4. dV += P^T dO (FA2 eq. 16) runs under dS^T = P^T (dP^T - D) / sqrt(d) (eq. 17, scale folded).
            p16 = p.to(dtype)
            dv = warpgroup_mma(gl.convert_layout(p16, a_layout), do, dv, is_async=True)
            delta = gl.load(delta_base + cols, mask=cols < N_Q, other=0.0) * sm_scale
            dp = warpgroup_mma_wait(1, deps=(dp,))
            ds16 = (p16.to(gl.float32) * (dp * sm_scale - gl.expand_dims(delta, 0))).to(dtype)
            dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(empty.index(stage), count=1)
        # 5. Epilogue: dK (already scaled), dV through the K and V buffers; rows past N_K dropped.
        k.store(dk.to(dtype))
        v.store(dv.to(dtype))
        fence_async_shared()
        tma_store(dk_desc, [off_b, off_h, start_n, 0], k_smem)
        tma_store(dv_desc, [off_b, off_h, start_n, 0], v_smem)
        tma.store_wait(0)

    @gluon.jit
    def _dkdv_partition(C: gl.constexpr, k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc,
                        dv_desc, L, Delta, off_b, off_h, pid_bh, start_n, m_start, num_m, N_Q, N_K, qk_scale,
                        sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        _dkdv_consumer(k_bufs.index(C), v_bufs.index(C), q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc,
                       dv_desc, L, Delta, off_b, off_h, pid_bh, start_n + C * BLOCK_N, m_start, num_m, N_Q, N_K,
                       qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)

    @gluon.jit
    def _gluon_attn_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L, Delta, H, N_Q, N_K,
                                    qk_scale, sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (cdiv(N_K, 2 * BLOCK_N) * B * H,): two consumer warp groups of BLOCK_N keys and a loader warp."""
        num_bh = gl.num_programs(0) // gl.cdiv(N_K, 2 * BLOCK_N)
        pid = gl.program_id(0)
        pid_bh = pid % num_bh
        start_n = (pid // num_bh) * (2 * BLOCK_N)  # low key tiles (the most causal queries) first
        if IS_CAUSAL:
            m_start = start_n // BLOCK_M
        else:
            m_start = 0
        num_m = gl.maximum(gl.cdiv(N_Q, BLOCK_M) - m_start, 0)
        k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty = _key_stationary_shared(
            q_desc, k_desc, v_desc, do_desc, NUM_STAGES)
        gl.warp_specialize([
            (_dkdv_partition, (0, k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc, dv_desc,
                               L, Delta, pid_bh // H, pid_bh % H, pid_bh, start_n, m_start, num_m, N_Q, N_K, qk_scale,
                               sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)),
            (_dkdv_partition, (1, k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc, dv_desc,
                               L, Delta, pid_bh // H, pid_bh % H, pid_bh, start_n, m_start, num_m, N_Q, N_K, qk_scale,
                               sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)),
            (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, q_ready,
                           do_ready, empty, pid_bh // H, pid_bh % H, start_n, m_start, num_m, 2, BLOCK_M, BLOCK_N,
                           NUM_STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty,
                   v_ready, v_empty, off_b, off_h, start_m, num_kv, NUM_CONSUMERS: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Producer warp: each consumer's Q and dO rows once, then K(j), V(j) into ring slot j % NUM_STAGES."""
        mbarrier.expect(q_bar, NUM_CONSUMERS * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
        for c in gl.static_range(NUM_CONSUMERS):
            tma_load(q_desc, [off_b, off_h, start_m + c * BLOCK_M, 0], q_bar, q_bufs.index(c))
            tma_load(do_desc, [off_b, off_h, start_m + c * BLOCK_M, 0], q_bar,
                                            do_bufs.index(c))
        for j in range(num_kv):
            stage = j % NUM_STAGES
            phase = ((j // NUM_STAGES) & 1) ^ 1  # empty barriers start "phase 1 complete"
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [off_b, off_h, j * BLOCK_N, 0], k_ready.index(stage),
                                            k_bufs.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [off_b, off_h, j * BLOCK_N, 0], v_ready.index(stage),
                                            v_bufs.index(stage))

    @gluon.jit
    def _dq_consumer(q_smem, do_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, dq_desc, L, Delta,
                     off_b, off_h, pid_bh, start_m, num_kv, N_Q, N_K, qk_scale, sm_scale,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """One warp group's BLOCK_M query rows: FA2 Algorithm 2's dQ loop, dQ in fp32 registers, no atomics."""
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        q = q_smem.reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.reshape([BLOCK_M, HEAD_DIM])
        rows = start_m + gl.arange(0, BLOCK_M, layout=row_s)
        # Rows past N_Q: Q, dO read as 0, L and D as 0, so dS = 0 there (and their stores are dropped).
        l2 = gl.load(L + pid_bh.to(gl.int64) * N_Q + rows, mask=rows < N_Q, other=0.0) * 1.4426950408889634
        delta = gl.load(Delta + pid_bh.to(gl.int64) * N_Q + rows, mask=rows < N_Q, other=0.0)
        # 1. Key tiles [0, my_kv) for these rows ([n_unmasked, my_kv) masked); the loader streams the program's
        #    [0, num_kv), and tiles past my_kv are released unread (after they landed: see `_dkdv_consumer`).
        if IS_CAUSAL:
            my_kv = gl.minimum(gl.cdiv(gl.minimum(start_m + BLOCK_M, N_K), BLOCK_N), num_kv)
            n_unmasked = gl.minimum(start_m // BLOCK_N, N_K // BLOCK_N)
        else:
            my_kv = num_kv
            n_unmasked = N_K // BLOCK_N
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(q_bar, 0)
        for j in range(my_kv):
            stage = j % NUM_STAGES
            phase = (j // NUM_STAGES) & 1
            # 2. S = Q K^T and dP = dO V^T in flight together.
            mbarrier.wait(k_ready.index(stage), phase)
            k = k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
            s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(stage), phase)
            v = v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
            dp = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            dp = warpgroup_mma(do, v.permute((1, 0)), dp, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            # 3. P = exp(S / sqrt(d) - L) under dP; diagonal and key-tail tiles masked. The mask is a branch the
            #    compiler cannot fold between the exp2s and the dP wait: within one basic block ptxas would hoist the
            #    wait above the exp2s (the forward's finding); SASS: HGMMA(S) HGMMA(dP) DEPBAR<=1 EX2.. DEPBAR<=0.
            p = gl.exp2(s * qk_scale - gl.expand_dims(l2, 1))
            if j >= n_unmasked:
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                keep = gl.expand_dims(cols < N_K, 0)
                if IS_CAUSAL:
                    keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
                p = gl.where(keep, p, 0.0)
            dp, p = warpgroup_mma_wait(0, deps=(dp, p))
            mbarrier.arrive(v_empty.index(stage), count=1)
            # 4. dS = P (dP - D) (FA2 eq. 17); dQ += dS K with dS from registers; 1/sqrt(d) applied once at the end.
            ds16 = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
            dq = warpgroup_mma(gl.convert_layout(ds16, a_layout), k, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            mbarrier.arrive(k_empty.index(stage), count=1)
        for j in range(my_kv, num_kv):
            mbarrier.wait(k_ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
            mbarrier.arrive(k_empty.index(j % NUM_STAGES), count=1)
            mbarrier.wait(v_ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
            mbarrier.arrive(v_empty.index(j % NUM_STAGES), count=1)
        # 5. Epilogue: dQ = dS K / sqrt(d) through the Q buffer (rows past N_Q dropped). Deterministic: one program
        #    owns these rows and sums its key tiles in a fixed order.
        q.store((dq * sm_scale).to(dtype))
        fence_async_shared()
        tma_store(dq_desc, [off_b, off_h, start_m, 0], q_smem)
        tma.store_wait(0)

    @gluon.jit
    def _dq_partition(C: gl.constexpr, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      dq_desc, L, Delta, off_b, off_h, pid_bh, start_m, num_kv, N_Q, N_K, qk_scale, sm_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        _dq_consumer(q_bufs.index(C), do_bufs.index(C), k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                     dq_desc, L, Delta, off_b, off_h, pid_bh, start_m + C * BLOCK_M, num_kv, N_Q, N_K, qk_scale,
                     sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)

    @gluon.jit
    def _gluon_attn_bwd_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, L, Delta, H, N_Q, N_K, qk_scale,
                                  sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                  NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                  LOADER_REGS: gl.constexpr):
        """Grid (cdiv(N_Q, 2 * BLOCK_M) * B * H,): two consumer warp groups of BLOCK_M query rows, a loader warp;
        causal query tiles numbered from the last (the most keys) down."""
        # The forward's work items (heaviest first) and shared memory (Q per group, the K/V ring), with dO beside Q.
        num_bh = gl.num_programs(0) // gl.cdiv(N_Q, 2 * BLOCK_M)
        pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = _work_item(gl.program_id(0), num_bh, H, 0, N_Q, N_K,
                                                                       2 * BLOCK_M, BLOCK_N, IS_CAUSAL)
        q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty = _fwd_shared(q_desc, k_desc, v_desc,
                                                                                        NUM_STAGES, 2)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        gl.warp_specialize([
            (_dq_partition, (0, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, dq_desc, L,
                             Delta, off_b, off_h, pid_bh, start_m, num_kv, N_Q, N_K, qk_scale, sm_scale,
                             HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)),
            (_dq_partition, (1, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, dq_desc, L,
                             Delta, off_b, off_h, pid_bh, start_m, num_kv, N_Q, N_K, qk_scale, sm_scale,
                             HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)),
            (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty,
                          v_ready, v_empty, off_b, off_h, start_m, num_kv, 2, BLOCK_M, BLOCK_N,
                          NUM_STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

BWD_BLOCK_N = 64
"""Keys per consumer warp group: the M of one wgmma, so dK and dV take 2 * 64 * d / 128 fp32 registers a thread."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GluonBwd2Config:
    """Launch knobs of the two-pass backward: `_gluon_attn_bwd_dkdv_kernel` (one program = 2 * BWD_BLOCK_N keys)
    and `_gluon_attn_bwd_dq_kernel` (one program = 2 * DQ_BLOCK_M query rows); both run two consumer warp groups."""

    dkdv_block_m: int = 64
    """Query rows per streamed Q/dO tile of the dK/dV kernel (the N of S^T = K Q^T)."""
    dkdv_stages: int = 2
    """Depth of the dK/dV kernel's Q/dO ring."""
    dq_block_n: int = 64
    """Keys per streamed K/V tile of the dQ kernel (the N of S = Q K^T, the K of dQ += dS K)."""
    dq_stages: int = 2
    """Depth of the dQ kernel's K/V ring."""

    def __post_init__(self):
        if self.dkdv_block_m not in (32, 64) or self.dq_block_n not in (32, 64, 128):
            raise ValueError(f"dkdv_block_m ({self.dkdv_block_m}) must be 32 or 64 and dq_block_n "
                             f"({self.dq_block_n}) 32, 64 or 128")
        if self.dkdv_stages < 1 or self.dq_stages < 1:
            raise ValueError(f"dkdv_stages ({self.dkdv_stages}) and dq_stages ({self.dq_stages}) must be >= 1")

    @property
    def name(self) -> str:
        return (f"2pass:dkdv2x{BWD_BLOCK_N}xq{self.dkdv_block_m}/s{self.dkdv_stages},"
                f"dq2x{DQ_BLOCK_M}xk{self.dq_block_n}/s{self.dq_stages}")

    def registers(self) -> tuple[int, int]:
        return register_split(2)

    def shared_bytes(self, head_dim: int, elem: int = 2) -> tuple[int, int]:
        """(dK/dV kernel: K, V per consumer and the Q/dO ring; dQ kernel: Q, dO per consumer and the K/V ring)."""
        return (elem * head_dim * (4 * BWD_BLOCK_N + 2 * self.dkdv_stages * self.dkdv_block_m),
                elem * head_dim * (4 * DQ_BLOCK_M + 2 * self.dq_stages * self.dq_block_n))


DQ_BLOCK_M = 64
"""Query rows per consumer warp group of the dQ kernel: one wgmma row block, dQ in 64 * d / 128 fp32 registers."""
DEFAULT_BWD2_CONFIGS = {64: GluonBwd2Config(dkdv_block_m=64, dkdv_stages=2, dq_block_n=128, dq_stages=2),
                        128: GluonBwd2Config(dkdv_block_m=32, dkdv_stages=3, dq_block_n=64, dq_stages=2)}
"""Per head dim, tiles that build without spills (d 128: 64-query dK/dV tiles spill 28 bytes outside the loop)."""


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself when a TMA descriptor can read it (unit stride on D, 16-byte strides and pointer), else a copy."""
    elem = t.element_size()
    if t.stride(-1) == 1 and not any((s * elem) % 16 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def bwd2_launch_args(q, k, v, grad_out, dq, dk, dv, lse, delta, is_causal: bool, config: GluonBwd2Config):
    """((grid, args, meta) of the dK/dV launch, (grid, args, meta) of the dQ launch) of the two-pass backward."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    maxnreg, consumer_regs = config.registers()
    scales = (LOG2E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim))
    common = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, CONSUMER_REGS=consumer_regs, LOADER_REGS=LOADER_REGS,
                  num_warps=4, maxnreg=maxnreg)
    bm, bn = config.dkdv_block_m, BWD_BLOCK_N
    dkdv = ((triton.cdiv(n_k, 2 * bn) * batch * heads,),
            (_descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(grad_out, bm),
             _descriptor(dk, bn), _descriptor(dv, bn), lse, delta, heads, n_q, n_k, *scales),
            dict(common, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=config.dkdv_stages))
    bm, bn = DQ_BLOCK_M, config.dq_block_n
    dq_launch = ((triton.cdiv(n_q, 2 * bm) * batch * heads,),
                 (_descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(grad_out, bm),
                  _descriptor(dq, bm), lse, delta, heads, n_q, n_k, *scales),
                 dict(common, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=config.dq_stages))
    return dkdv, dq_launch


def gluon_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor, is_causal: bool = False,
                        config: GluonBwd2Config | GluonBwdConfig | None = None, mode: str = "two_pass"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the inputs' dtype from O and the natural-log L of the forward. dK, dV are written once per
    key. mode "two_pass" (config a `GluonBwd2Config`): dQ is summed per query tile in a fixed order, bitwise equal
    run to run; "one_pass" (a `GluonBwdConfig`): dQ is summed in fp32 by the TMA unit, its last bits can vary.
    `config` None: the mode's default (one_pass: `problem_config`, the tuned file's with its head group fit to the
    L2 cache)."""
    if mode not in ("two_pass", "one_pass"):
        raise ValueError(f"gluon_attention_bwd: mode {mode!r} must be 'two_pass' or 'one_pass'")
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"gluon_attention_bwd: {reason}")
    import kernels.attention.gluon.backward as one_pass

    config = config or (DEFAULT_BWD2_CONFIGS[q.shape[-1]] if mode == "two_pass"
                        else one_pass.problem_config(q))
    if not isinstance(config, GluonBwd2Config if mode == "two_pass" else one_pass.GluonBwdConfig):
        raise ValueError(f"gluon_attention_bwd: config {config!r} does not fit mode {mode!r}")
    check_backward_inputs(q, out, lse, grad_out, where="gluon_attention_bwd: ")
    return launch_bwd(q, k, v, out, lse, grad_out, is_causal, config)


def launch_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               grad_out: torch.Tensor, is_causal: bool, config: GluonBwd2Config | GluonBwdConfig
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gluon_attention_bwd` on inputs it accepts, its mode the config's: for callers that checked them already
    (the checks cost host time on every call)."""
    import kernels.attention.gluon.backward as one_pass
    from kernels.attention.triton.kernels import _flash_bwd_preprocess_kernel, _onepass_bwd_preprocess_kernel

    batch, heads, n_q, head_dim = q.shape
    grad_out = _tma_ready(grad_out if grad_out.dtype == q.dtype else grad_out.to(q.dtype))
    lse = lse.contiguous()
    # What every launch's argument keys read (the new buffers are contiguous and aligned; q, k, v aligned: checked;
    # dO made so; L's pointer, which the two-pass kernels read, by its alignment, as O's for the preprocess).
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), grad_out.stride(), q.dtype,
           out.dtype, is_causal, config, lse.data_ptr() & 15, out.data_ptr() & 15)
    with device_of(q):
        dk, dv = empty_like_layout(k), empty_like_layout(v)  # the inputs' layouts: valid TMA targets
        if isinstance(config, GluonBwd2Config):
            # D = rowsum(dO * O), fp32 (B, H, N_Q) like L (FA2 Algorithm 2, line 2).
            delta = torch.empty_like(lse)
            launch(_flash_bwd_preprocess_kernel, (triton.cdiv(n_q, 64), batch * heads),
                   (out, grad_out, delta, *out.stride(), *grad_out.stride(), heads, n_q),
                   dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=64, num_warps=4), key)
            dq = empty_like_layout(q)
            (grid, args, meta), (dq_grid, dq_args, dq_meta) = bwd2_launch_args(q, k, v, grad_out, dq, dk, dv, lse,
                                                                               delta, is_causal, config)
            launch(_gluon_attn_bwd_dkdv_kernel, grid, args, meta, key)
            launch(_gluon_attn_bwd_dq_kernel, dq_grid, dq_args, dq_meta, key)
            return dq, dk, dv
        # D and L zero-padded to whole query tiles (as `bwd_launch_args` takes them) and the fp32 dQ accumulator
        # zeroed, in one launch.
        n_pad = triton.cdiv(n_q, config.block_m) * config.block_m
        lse_pad, delta_pad = (torch.empty((batch, heads, n_pad), dtype=torch.float32, device=q.device)
                              for _ in range(2))
        dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        launch(_onepass_bwd_preprocess_kernel, (n_pad // config.block_m, batch * heads),
               (out, grad_out, lse, dq_acc, delta_pad, lse_pad, *out.stride(), *grad_out.stride(), heads, n_q, n_pad),
               dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=config.block_m, num_warps=4), key)
        grid, args, meta = one_pass.bwd_launch_args(q, k, v, grad_out, dk, dv, lse_pad, delta_pad, dq_acc, is_causal,
                                                    config)
        launch(config.kernel, grid, args, meta, key)
        dq = empty_like_layout(q)
        dq.copy_(dq_acc)
    return dq, dk, dv


class GluonAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves Q, K, V, O and L (never P)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        out, lse = gluon_attention_fwd(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = gluon_attention_bwd(q, k, v, out, lse, grad_out, ctx.is_causal)
        return dq, dk, dv, None


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) [+ causal mask]) V with the Gluon forward and backward (see `supported`)."""
    return GluonAttentionFunction.apply(q, k, v, is_causal)
