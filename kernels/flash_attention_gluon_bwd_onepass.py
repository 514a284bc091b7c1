"""The one-pass Gluon backward (sm_90): dK/dV per key tile as the two-pass dK/dV kernel, plus dQ(i) += dS K through
a shared dS^T tile and fp32 atomics, so dQ's last bits can vary run to run. Kept for comparison: slower than the
two-pass backward and the tl kernels (results/flash_hopper_notes.md, section 6: spills at d 128, scalar atomics).

Usage: `gluon_attention_bwd(..., mode="one_pass")` of `kernels/flash_attention_gluon_bwd.py` launches it.
"""

from __future__ import annotations

import dataclasses
import math

import triton

from kernels.flash_attention_gluon import HAS_GLUON_HOPPER, LOADER_REGS, LOG2E, _descriptor, register_split
from kernels.flash_attention_gluon_bwd import BWD_BLOCK_N, _bwd_loader

if HAS_GLUON_HOPPER:  # the forward's imports of Triton 3.6's Gluon API
    from kernels.flash_attention_gluon import (fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma,
                                               warpgroup_mma_wait)

if HAS_GLUON_HOPPER:

    @gluon.jit
    def _dq_atomic_add(dq_base, dq, start_m, col0, N_Q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                       DQ_N: gl.constexpr):
        """dQ[start_m:, col0:col0 + DQ_N] += dq (fp32 atomics), rows past N_Q dropped. Four contiguous floats a
        thread (one 16-byte vector atomic where the compiler makes one) and 32-bit offsets from one base."""
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // (DQ_N // 4), DQ_N // 4],
                                                warps_per_cta=[4, 1], order=[1, 0])
        dq = gl.convert_layout(dq, layout)
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, DQ_N, layout=gl.SliceLayout(0, layout))
        offs = gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
        gl.atomic_add(dq_base + offs, dq, mask=gl.expand_dims(rows < N_Q, 1), sem="relaxed")

    @gluon.jit
    def _bwd_consumer(k_smem, v_smem, ds_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty, dk_desc, dv_desc,
                      L, Delta, DQ, off_b, off_h, pid_bh, start_n, m_start, num_m, N_Q, N_K, qk_scale, sm_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """One warp group's BLOCK_N keys [start_n, start_n + BLOCK_N): FA2 Algorithm 2 transposed (S^T, dP^T with
        the keys as wgmma rows, so P^T and dS^T are register A operands of dV += P^T dO and dK += dS^T Q)."""
        dtype: gl.constexpr = k_smem.dtype
        # S^T, dP^T: BLOCK_N keys x BLOCK_M queries. dK, dV: BLOCK_N x HEAD_DIM; dQ: BLOCK_M x 64 pieces.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        DQ_N: gl.constexpr = 64
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_N, 16])

        k = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.reshape([BLOCK_N, HEAD_DIM])
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        lse_base = L + pid_bh.to(gl.int64) * N_Q
        delta_base = Delta + pid_bh.to(gl.int64) * N_Q
        dq_base = DQ + pid_bh.to(gl.int64) * N_Q * HEAD_DIM
        mbarrier.wait(kv_bar, 0)

        for it in range(num_m):
            stage = it % NUM_STAGES
            phase = (it // NUM_STAGES) & 1
            start_m = (m_start + it) * BLOCK_M
            cols = start_m + gl.arange(0, BLOCK_M, layout=col_s)
            # Rows past N_Q: Q and dO read as 0 (TMA), L and D as 0, so P = 1 and dS = 0 there: no mask needed.
            l2 = gl.load(lse_base + cols, mask=cols < N_Q, other=0.0) * 1.4426950408889634
            mbarrier.wait(q_ready.index(stage), phase)
            mbarrier.wait(do_ready.index(stage), phase)
            # A causal query tile entirely above this warp group's keys contributes nothing: skip its products.
            if (not IS_CAUSAL) or start_m + BLOCK_M > start_n:
                q = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
                do = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
                # 1. S^T = K Q^T and dP^T = V dO^T in flight together; P^T = exp(S^T / sqrt(d) - L) under dP^T.
                # (Accumulators of use_acc=False products are made inside the branch: carried through the loop,
                #  they would hold registers across the whole iteration.)
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
                p16 = p.to(dtype)
                # 2. dV += P^T dO (FA2 eq. 16) under dS^T = P^T (dP^T - D) / sqrt(d) (eq. 17 with the scale of
                #    eqs. 18-19 folded in: one FFMA per element).
                dv = warpgroup_mma(gl.convert_layout(p16, a_layout), do, dv, is_async=True)
                delta = gl.load(delta_base + cols, mask=cols < N_Q, other=0.0) * sm_scale
                dp = warpgroup_mma_wait(1, deps=(dp,))
                ds16 = (p * (dp * sm_scale - gl.expand_dims(delta, 0))).to(dtype)
                # 3. dK += dS^T Q from registers; dQ(i) share = dS K needs dS as the row operand: via shared memory,
                #    in 64-column pieces of K (a 64 x d fp32 piece beside dK and dV would not fit 240 registers).
                dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
                ds_smem.store(ds16)
                fence_async_shared()
                dst = ds_smem.permute((1, 0))
                dq0 = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
                dq0 = warpgroup_mma(dst, k.slice(0, DQ_N, dim=1), dq0, use_acc=False, is_async=True)
                dv, dk, dq0 = warpgroup_mma_wait(0, deps=(dv, dk, dq0))
                mbarrier.arrive(empty.index(stage), count=1)  # Q(i) and dO(i) are no longer read
                # 4. This key block's share of dQ(i), summed in fp32 in global memory (order not fixed); the atomics
                #    of one piece go out while the tensor cores compute the next.
                if HEAD_DIM == 2 * DQ_N:
                    _dq_atomic_add(dq_base, dq0, start_m, 0, N_Q, HEAD_DIM, BLOCK_M, DQ_N)
                    dq1 = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
                    dq1 = warpgroup_mma(dst, k.slice(DQ_N, DQ_N, dim=1), dq1, use_acc=False, is_async=True)
                    dq1 = warpgroup_mma_wait(0, deps=(dq1,))
                    _dq_atomic_add(dq_base, dq1, start_m, DQ_N, N_Q, HEAD_DIM, BLOCK_M, DQ_N)
                else:
                    _dq_atomic_add(dq_base, dq0, start_m, 0, N_Q, HEAD_DIM, BLOCK_M, DQ_N)
            else:
                mbarrier.arrive(empty.index(stage), count=1)

        # 5. Epilogue: dK (already scaled) and dV through the K and V buffers; rows past N_K are dropped.
        k.store(dk.to(dtype))
        v.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [off_b, off_h, start_n, 0], k_smem)
        tma.async_copy_shared_to_global(dv_desc, [off_b, off_h, start_n, 0], v_smem)
        tma.store_wait(0)

    @gluon.jit
    def _bwd_consumer_partition(C: gl.constexpr, k_bufs, v_bufs, ds_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready,
                                empty, dk_desc, dv_desc, L, Delta, DQ, off_b, off_h, pid_bh, start_n, m_start, num_m,
                                N_Q, N_K, qk_scale, sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """Partition entry of consumer C: its K, V and dS buffers and keys."""
        _bwd_consumer(k_bufs.index(C), v_bufs.index(C), ds_bufs.index(C), q_bufs, do_bufs, kv_bar, q_ready, do_ready,
                      empty, dk_desc, dv_desc, L, Delta, DQ, off_b, off_h, pid_bh, start_n + C * BLOCK_N, m_start,
                      num_m, N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL)

    @gluon.jit
    def _gluon_attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L, Delta, DQ, H, N_Q, N_K,
                               qk_scale, sm_scale,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Grid (cdiv(N_K, NUM_CONSUMERS * BLOCK_N) * B * H,): program -> (key tile, batch*head), heavy first."""
        TILE_N: gl.constexpr = NUM_CONSUMERS * BLOCK_N
        # 1. Work item: causal key tiles numbered by increasing key-tile index (the first see the most queries).
        num_bh = gl.num_programs(0) // gl.cdiv(N_K, TILE_N)
        pid = gl.program_id(0)
        pid_bh = pid % num_bh
        start_n = (pid // num_bh) * TILE_N
        off_b = pid_bh // H
        off_h = pid_bh % H
        # 2. Query tiles [m_start, cdiv(N_Q, BLOCK_M)): causal ones start at the first query that sees key start_n
        #    (none when start_n >= N_Q: dK = dV = 0 are still written).
        if IS_CAUSAL:
            m_start = start_n // BLOCK_M
        else:
            m_start = 0
        num_m = gl.maximum(gl.cdiv(N_Q, BLOCK_M) - m_start, 0)

        # 3. Shared memory: each consumer's K, V (reused for dK, dV) and dS^T; the Q/dO ring; barriers.
        dtype: gl.constexpr = q_desc.dtype
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        k_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
        ds_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_N, BLOCK_M], ds_layout)
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
            mbarrier.init(empty.index(i), count=NUM_CONSUMERS)

        # 4. Partitions (argument tuples inline, as in the forward).
        if NUM_CONSUMERS == 1:
            gl.warp_specialize([
                (_bwd_consumer_partition, (0, k_bufs, v_bufs, ds_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty,
                                           dk_desc, dv_desc, L, Delta, DQ, off_b, off_h, pid_bh, start_n, m_start, num_m,
                                           N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                           IS_CAUSAL)),
                (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, q_ready,
                               do_ready, empty, off_b, off_h, start_n, m_start, num_m, NUM_CONSUMERS, BLOCK_M, BLOCK_N,
                               NUM_STAGES)),
            ], [1], [LOADER_REGS])
        else:
            gl.static_assert(NUM_CONSUMERS == 2, "the backward takes NUM_CONSUMERS 1 or 2")
            gl.warp_specialize([
                (_bwd_consumer_partition, (0, k_bufs, v_bufs, ds_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty,
                                           dk_desc, dv_desc, L, Delta, DQ, off_b, off_h, pid_bh, start_n, m_start, num_m,
                                           N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                           IS_CAUSAL)),
                (_bwd_consumer_partition, (1, k_bufs, v_bufs, ds_bufs, q_bufs, do_bufs, kv_bar, q_ready, do_ready, empty,
                                           dk_desc, dv_desc, L, Delta, DQ, off_b, off_h, pid_bh, start_n, m_start, num_m,
                                           N_Q, N_K, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                           IS_CAUSAL)),
                (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, q_ready,
                               do_ready, empty, off_b, off_h, start_n, m_start, num_m, NUM_CONSUMERS, BLOCK_M, BLOCK_N,
                               NUM_STAGES)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@dataclasses.dataclass(frozen=True, kw_only=True)
class GluonBwdConfig:
    """Launch knobs of `_gluon_attn_bwd_kernel` (one program = num_consumers * BWD_BLOCK_N keys)."""

    block_m: int = 64
    """Query rows per streamed Q/dO tile (the N of S^T = K Q^T, the K of dV += P^T dO)."""
    num_stages: int = 2
    """Depth of the Q/dO shared-memory ring."""
    num_consumers: int = 2
    """Consumer warp groups (1 or 2), each on its own BWD_BLOCK_N keys with its own dK, dV accumulators."""

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m ({self.block_m}) must be 64 or 128")
        if self.num_stages < 1 or self.num_consumers not in (1, 2):
            raise ValueError(f"num_stages ({self.num_stages}) must be >= 1 and num_consumers "
                             f"({self.num_consumers}) 1 or 2")

    @property
    def name(self) -> str:
        return f"bwd{self.num_consumers}x{BWD_BLOCK_N}xq{self.block_m}/s{self.num_stages}"

    def registers(self) -> tuple[int, int]:
        return register_split(self.num_consumers)

    def shared_bytes(self, head_dim: int, elem: int = 2) -> int:
        """K, V per consumer, the Q/dO ring, one dS^T tile per consumer."""
        return elem * (head_dim * (2 * self.num_consumers * BWD_BLOCK_N + 2 * self.num_stages * self.block_m)
                       + self.num_consumers * BWD_BLOCK_N * self.block_m)


DEFAULT_BWD_CONFIGS = {64: GluonBwdConfig(block_m=64, num_stages=2, num_consumers=2),
                       128: GluonBwdConfig(block_m=64, num_stages=2, num_consumers=2)}


def bwd_launch_args(q, k, v, grad_out, dk, dv, lse, delta, dq_acc, is_causal: bool, config: GluonBwdConfig):
    """(grid, positional args, keyword args) of one backward launch (the launcher's and the CPU compile check's)."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    maxnreg, consumer_regs = config.registers()
    grid = (triton.cdiv(n_k, config.num_consumers * BWD_BLOCK_N) * batch * heads,)
    args = (_descriptor(q, config.block_m), _descriptor(k, BWD_BLOCK_N), _descriptor(v, BWD_BLOCK_N),
            _descriptor(grad_out, config.block_m), _descriptor(dk, BWD_BLOCK_N), _descriptor(dv, BWD_BLOCK_N),
            lse, delta, dq_acc, heads, n_q, n_k, LOG2E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim))
    meta = dict(HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=BWD_BLOCK_N, NUM_STAGES=config.num_stages,
                NUM_CONSUMERS=config.num_consumers, IS_CAUSAL=is_causal, CONSUMER_REGS=consumer_regs,
                LOADER_REGS=LOADER_REGS, num_warps=4, maxnreg=maxnreg)
    return grid, args, meta
