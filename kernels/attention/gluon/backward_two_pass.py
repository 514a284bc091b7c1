"""FlashAttention backward for Hopper (sm_90) in Gluon, two passes: deterministic (dQ bitwise equal run to run).

FlashAttention-2's two passes with P recomputed, on `backward.py`'s key-stationary pieces and the forward's work items:
- `_gluon_attn_bwd_dkdv_kernel`: one program per 2 * BWD_BLOCK_N keys, each consumer warp group holding dK, dV of its
  keys in fp32 registers while the loader streams Q(i), dO(i); S^T and dP^T in flight together, P^T under dP^T,
  dS^T under dV += P^T dO, then dK += dS^T Q.
- `_gluon_attn_bwd_dq_kernel`: one program per 2 * DQ_BLOCK_M query rows, each group holding Q, dO in shared memory
  and dQ in fp32 registers while the loader streams K(j), V(j); dQ += dS K with dS from registers.
D = rowsum(dO O) comes from the tl preprocess kernel. No path runs it (the gluon path's backward is the one-pass);
the Gluon study (`sweeps/flash_gluon_check.py`) checks and times it beside the one-pass.

Usage: `dq, dk, dv = gluon_attention_bwd2(q, k, v, out, lse, grad_out, is_causal[, config])`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from kernels.attention.gluon.backward import (
    BWD_BLOCK_N,
    bwd_launch_inputs,
    check_bwd_inputs,
)
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from kernels.attention.gluon.runtime import (
    LOADER_REGS,
    descriptor,
    launch,
    register_split,
)
from kernels.attention.triton.kernels import LOG2E, _flash_bwd_preprocess_kernel
from kernels.device import device_of, empty_like_layout

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.backward import (
        key_stationary_shared,
        load_kv_tiles,
        load_q_do_tile,
        sdp_transposed,
    )
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
    from kernels.attention.gluon.forward import forward_shared
    from kernels.attention.gluon.schedule import work_item


if HAS_GLUON_HOPPER:

    @gluon.jit
    def _bwd_loader(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, q_ready, do_ready,
                    empty, off_b, off_h, start_n, m_start, num_m,
                    NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr):
        """Producer warp: each consumer's K and V rows once, then Q(i), dO(i) into ring slot i % NUM_STAGES."""
        load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, kv_bar, off_b, off_h, start_n, NUM_CONSUMERS, BLOCK_N)
        for it in range(num_m):
            load_q_do_tile(q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, empty, off_b, off_h,
                           (m_start + it) * BLOCK_M, it, NUM_STAGES)


    @gluon.jit
    def _dkdv_consumer(k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc, dv_desc, L,
                       Delta, off_b, off_h, pid_bh, start_n, m_start, num_m, N_Q, N_K, qk_scale, sm_scale,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """One warp group's BLOCK_N keys: `_bwd_consumer_item` without dQ (dS stays in registers); P^T is kept only as
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
            p, dp = sdp_transposed(k, v, q, do, l2, keys, cols, start_m, start_n, N_K, qk_scale, s_layout, BLOCK_N,
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
        k_bufs, v_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty = key_stationary_shared(
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
            #    wait above the exp2s.
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
        pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = work_item(gl.program_id(0), num_bh, H, 0, N_Q, N_K,
                                                                      2 * BLOCK_M, BLOCK_N, IS_CAUSAL)
        q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty = forward_shared(q_desc, k_desc, v_desc,
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
"""Per head dim, tiles that build without register spills."""


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
            (descriptor(q, bm), descriptor(k, bn), descriptor(v, bn), descriptor(grad_out, bm),
             descriptor(dk, bn), descriptor(dv, bn), lse, delta, heads, n_q, n_k, *scales),
            dict(common, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=config.dkdv_stages))
    bm, bn = DQ_BLOCK_M, config.dq_block_n
    dq_launch = ((triton.cdiv(n_q, 2 * bm) * batch * heads,),
                 (descriptor(q, bm), descriptor(k, bn), descriptor(v, bn), descriptor(grad_out, bm),
                  descriptor(dq, bm), lse, delta, heads, n_q, n_k, *scales),
                 dict(common, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=config.dq_stages))
    return dkdv, dq_launch


def gluon_attention_bwd2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         grad_out: torch.Tensor, is_causal: bool, config: GluonBwd2Config | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the inputs' dtype from O and the natural-log L of the forward, inputs checked; dQ summed per
    query tile in a fixed order (bitwise equal run to run). `config` None: DEFAULT_BWD2_CONFIGS' for the head dim."""
    config = config or DEFAULT_BWD2_CONFIGS.get(q.shape[-1])
    check_bwd_inputs("gluon_attention_bwd2", q, k, v, out, lse, grad_out, config, GluonBwd2Config)
    return launch_bwd2(q, k, v, out, lse, grad_out, is_causal, config)


def launch_bwd2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                grad_out: torch.Tensor, is_causal: bool, config: GluonBwd2Config
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gluon_attention_bwd2` on inputs it accepts: for callers that checked them already."""
    batch, heads, n_q, head_dim = q.shape
    grad_out, lse, key = bwd_launch_inputs(q, k, v, out, lse, grad_out, is_causal, config)
    with device_of(q):
        dk, dv = empty_like_layout(k), empty_like_layout(v)  # the inputs' layouts: valid TMA targets
        # D = rowsum(dO * O), fp32 (B, H, N_Q) like L (FA2 Algorithm 2, line 2).
        delta = torch.empty_like(lse)
        launch(_flash_bwd_preprocess_kernel, (triton.cdiv(n_q, 64), batch * heads),
               (out, grad_out, delta, *out.stride(), *grad_out.stride(), heads, n_q),
               dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=64, num_warps=4), key)
        dq = empty_like_layout(q)
        (grid, args, meta), (dq_grid, dq_args, dq_meta) = bwd2_launch_args(q, k, v, grad_out, dq, dk, dv, lse, delta,
                                                                           is_causal, config)
        launch(_gluon_attn_bwd_dkdv_kernel, grid, args, meta, key)
        launch(_gluon_attn_bwd_dq_kernel, dq_grid, dq_args, dq_meta, key)
    return dq, dk, dv
