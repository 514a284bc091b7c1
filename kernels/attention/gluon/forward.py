"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialised, FlashAttention-3 style.

Computes O = softmax(Q K^T / sqrt(d) + mask) V and L = logsumexp(Q K^T / sqrt(d) + mask) (natural log, fp32, the
units `kernels.attention.interface.flash_attention_fwd` returns and its backward consumes). Causal is the top-left
aligned mask of the tl kernels: query i sees keys j <= i (also when n_q != n_k). Masked scores are -inf here
(every row sees key 0, so no row's max is ever -inf). [J. Shah et al., FlashAttention-3, 2024, sections 3.1-3.2.]

Shape legend: B batch, H heads, N n_queries / n_keys, D head dim (64 or 128). Inputs (B, H, N, D), bf16 or fp16,
unit stride along D and 16-byte aligned strides (the TMA unit reads them through 4-D descriptors, so any
B/H/N strides work and tiles never cross a head: rows past N read as 0 and stores past N are dropped).

One program owns NUM_CONSUMERS * BLOCK_M query rows of one (batch, head) and runs three kinds of warps:
- a loader (1 warp, 24 registers): TMA-loads the Q tiles once, then K and V tiles into a NUM_STAGES-deep ring of
  shared-memory buffers; `*_ready` mbarriers say a buffer is full, `*_empty` ones (one arrival per consumer)
  that every consumer is done with it.
- NUM_CONSUMERS consumer warp groups (4 warps each, up to 240 registers), each with its own BLOCK_M query rows
  and the same K/V tiles. Intra-warp-group pipelining: iteration j issues S(j) = Q K(j)^T and O += P(j-1) V(j-1)
  as async wgmma, waits for S(j) only, computes softmax(j) while P(j-1) V(j-1) runs on the tensor cores, then
  waits for it and rescales O. Across consumers, the warp scheduler runs one group's softmax under another's
  matrix products (no explicit ping-pong barrier).
P stays in registers (wgmma A operand). Work items are numbered heaviest causal tile first (`_work_item`). With
`GluonConfig.persistent` one program per SM walks the items a host-built table deals it (`work_schedule`: each
item to the program least loaded so far, where round robin leaves some programs behind): the K/V ring runs on from
item to item, O has buffers of its own and Q's is released after the last S, so the next item's loads overlap this
one's last P V and epilogue, the per-item start and drain that short sequences pay (two consumer groups). ptxas
hoists a wgmma wait above independent ALU work of its basic block, so the wait for P V sits behind a branch the
compiler cannot fold (the K release); the SASS then reads HGMMA(S) HGMMA(PV) DEPBAR<=1 EX2... DEPBAR<=0.

Usage: `out, lse = gluon_attention_fwd(q, k, v, is_causal)` when `supported(q, k, v)`; knobs in `GluonConfig`.
`kernels.attention.interface` calls it for its `gluon` path; the Gluon backward is `kernels/flash_attention_gluon_bwd.py`
(and `_bwd_onepass.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from kernels.device import current_device, device_of, empty_like_layout, raw_stream
from kernels.attention.triton.tuning import gluon_tuned_fields

from kernels.attention.gluon.compat import HAS_GLUON_HOPPER

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.compat import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma, tma_load,
                                      tma_store, warpgroup_mma, warpgroup_mma_wait)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
LOADER_REGS = 24


EXP2_POLY = (0x3F7FFB49, 0x3F31798D, 0x3E786F0E, 0x3D61FBB0)
"""fp32 bits of c0..c3, 2^f ~ c0 + f (c1 + f (c2 + f c3)) on f in [-1/2, 1/2]: a least-squares fit of the relative
error refined toward minimax (Lawson), at most 7.5e-5 of 2^f in fp32, against bf16's 2^-9 and fp16's 2^-11 steps."""


def exp2_mixed_asm(every: int) -> str:
    """PTX for `every` consecutive fp32 scores x <= 0 (inline asm, `pack=every`): exp2 of the first every - 1 on the
    MUFU unit (`ex2.approx`), of the last by FlashAttention-4's emulation on the FMA and integer pipes: x clamped to
    -126, split as n + f with n = round(x) (the 1.5 * 2^23 shifter, no conversion instruction: ncu's XU pipe runs
    int-float conversions beside the MUFU's exp2), 2^f by `EXP2_POLY`, and 2^n added to the result's exponent bits
    (n << 23; exact, as the result stays normal). A masked score (-inf) comes out 2^-126 times about 1 instead of 0:
    below every 16-bit output's resolution next to the row's largest term, exp2(0) = 1."""
    if every < 2:
        raise ValueError(f"every ({every}) must be >= 2")
    c0, c1, c2, c3 = (f"0f{c:08X}" for c in EXP2_POLY)
    native = "".join(f"ex2.approx.ftz.f32 ${i}, ${i + every};\n" for i in range(every - 1))
    out, arg = f"${every - 1}", f"${2 * every - 1}"
    return ("{\n.reg .b32 t, j, n, f, p, e;\n" + native
            + f"max.ftz.f32 t, {arg}, 0fC2FC0000;\n"       # -126
            + "add.rn.f32 j, t, 0f4B400000;\n"              # 1.5 * 2^23 + round(t) in the low bits
            + "sub.rn.f32 n, j, 0f4B400000;\n"
            + "sub.rn.f32 f, t, n;\n"
            + f"fma.rn.f32 p, f, {c3}, {c2};\n"
            + f"fma.rn.f32 p, p, f, {c1};\n"
            + f"fma.rn.f32 p, p, f, {c0};\n"
            + "shl.b32 e, j, 23;\n"
            + f"add.s32 {out}, p, e;\n}}")


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------
if HAS_GLUON_HOPPER:
    _EXP2_ASM_2: gl.constexpr = gl.constexpr(exp2_mixed_asm(2))
    _EXP2_ASM_4: gl.constexpr = gl.constexpr(exp2_mixed_asm(4))
    _EXP2_ASM_8: gl.constexpr = gl.constexpr(exp2_mixed_asm(8))
    _EXP2_ASM_16: gl.constexpr = gl.constexpr(exp2_mixed_asm(16))
    _EXP2_REGS_2: gl.constexpr = gl.constexpr(",".join(["=r"] * 2 + ["r"] * 2))
    _EXP2_REGS_4: gl.constexpr = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 4))
    _EXP2_REGS_8: gl.constexpr = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))
    _EXP2_REGS_16: gl.constexpr = gl.constexpr(",".join(["=r"] * 16 + ["r"] * 16))

    @gluon.jit
    def _exp2(x, EXP2_EMULATED: gl.constexpr):
        """exp2(x) for x <= 0: all on the MUFU unit (EXP2_EMULATED 0), or one in EXP2_EMULATED (2, 4, 8 or 16) of
        them emulated on the FMA pipe (`exp2_mixed_asm`)."""
        if EXP2_EMULATED == 0:
            return gl.exp2(x)
        elif EXP2_EMULATED == 2:
            return gl.inline_asm_elementwise(_EXP2_ASM_2, _EXP2_REGS_2, [x], dtype=gl.float32, is_pure=True, pack=2)
        elif EXP2_EMULATED == 4:
            return gl.inline_asm_elementwise(_EXP2_ASM_4, _EXP2_REGS_4, [x], dtype=gl.float32, is_pure=True, pack=4)
        elif EXP2_EMULATED == 8:
            return gl.inline_asm_elementwise(_EXP2_ASM_8, _EXP2_REGS_8, [x], dtype=gl.float32, is_pure=True, pack=8)
        else:
            gl.static_assert(EXP2_EMULATED == 16, "EXP2_EMULATED must be 0, 2, 4, 8 or 16")
            return gl.inline_asm_elementwise(_EXP2_ASM_16, _EXP2_REGS_16, [x], dtype=gl.float32, is_pure=True,
                                             pack=16)

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
    def _work_item(t, BH, H, GROUP: gl.constexpr, N_Q, N_K, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   IS_CAUSAL: gl.constexpr):
        """Work item t -> (pid_bh, off_b, off_h, start_m, num_kv, n_unmasked): causal query tiles numbered by
        decreasing tile index across the BH heads (heaviest first), or, with GROUP > 0, the heads taken GROUP at a
        time (the last group may be smaller) and so within each group, so the programs running at once share the
        K/V of at most GROUP heads in L2; key tiles [0, num_kv) in all, [n_unmasked, num_kv) needing the causal
        and/or key-tail mask. (GROUP is a constexpr: a runtime one costs the persistent consumers a spill.)"""
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
    def _item_range(SCHEDULE, num_items, BALANCED: gl.constexpr):
        """(first, stop, step) of a persistent program's loop over its work items: with BALANCED, its slice of
        `work_schedule`'s table (SCHEDULE: the offsets of the programs' item lists, then the lists); else items
        program_id, program_id + #programs, ... (round robin)."""
        if BALANCED:
            return gl.load(SCHEDULE + gl.program_id(0)), gl.load(SCHEDULE + gl.program_id(0) + 1), 1
        else:
            return gl.program_id(0), num_items, gl.num_programs(0)

    @gluon.jit
    def _item_at(i, SCHEDULE, BALANCED: gl.constexpr):
        """The work item at step i of `_item_range`'s loop."""
        if BALANCED:
            return gl.load(SCHEDULE + gl.num_programs(0) + 1 + i)
        else:
            return i

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
        first, stop, step = _item_range(SCHEDULE, gl.cdiv(N_Q, TILE_M) * BH, BALANCED)
        for i in range(first, stop, step):
            t = _item_at(i, SCHEDULE, BALANCED)
            pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = _work_item(t, BH, H, GROUP, N_Q, N_K, TILE_M,
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
        p = _exp2(s * qk_scale - gl.expand_dims(m_new, 1), EXP2_EMULATED)
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
        #    is meant to run under P(j-1) V(j-1) (see the module docstring for what ptxas makes of that).
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
        """Consumer C of a persistent program: its work items (`_item_range`) in `_work_item` numbering."""
        TILE_M: gl.constexpr = NUM_CONSUMERS * BLOCK_M
        it0 = 0
        n = 0
        first, stop, step = _item_range(SCHEDULE, gl.cdiv(N_Q, TILE_M) * BH, BALANCED)
        for i in range(first, stop, step):
            t = _item_at(i, SCHEDULE, BALANCED)
            pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = _work_item(t, BH, H, GROUP, N_Q, N_K, TILE_M,
                                                                           BLOCK_N, IS_CAUSAL)
            _consumer(q_bufs.index(C), o_bufs.index(C), k_bufs, v_bufs, q_bar, n & 1, q_empty, k_ready, k_empty,
                      v_ready, v_empty, o_desc, L, off_b, off_h, pid_bh, start_m + C * BLOCK_M, N_Q, N_K, num_kv,
                      n_unmasked, it0, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, IS_CAUSAL, True,
                      EXP2_EMULATED, RESCALE_UNDER_S)
            it0 += num_kv
            n += 1
        tma.store_wait(0)

    @gluon.jit
    def _fwd_shared(q_desc, k_desc, v_desc, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
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
        # 1. Work item: this program's (`_work_item`, heaviest first).
        num_bh = gl.num_programs(0) // gl.cdiv(N_Q, TILE_M)
        pid_bh, off_b, off_h, start_m, num_kv, n_unmasked = _work_item(gl.program_id(0), num_bh, H, GROUP, N_Q,
                                                                       N_K, TILE_M, BLOCK_N, IS_CAUSAL)
        # 2. Shared memory: Q (one tile per consumer, reused for O), the K/V ring, barriers.
        q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty = _fwd_shared(q_desc, k_desc, v_desc,
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
        (`work_schedule`; `_work_item` numbering, the heaviest first in each head group) with BALANCED, else items
        p, p + #programs, ...; its K/V ring runs on from one item to the next, and the next item's Q loads under the
        last P V and epilogue of the current one (O has buffers of its own)."""
        gl.static_assert(NUM_CONSUMERS == 2, "the persistent forward has two consumer groups")
        q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty = _fwd_shared(q_desc, k_desc, v_desc,
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
def register_split(num_consumers: int) -> tuple[int, int]:
    """(maxnreg of the launch, consumer warp groups' registers): 64 K registers per SM over all warp groups (the
    loader's rounds up to one), the loader at LOADER_REGS and the consumers sharing the rest."""
    groups = num_consumers + 1
    cap = (65536 // (128 * groups)) // 8 * 8
    consumer = min(240, ((cap * groups - LOADER_REGS) // num_consumers) // 8 * 8)
    maxnreg = min(cap, ((consumer * num_consumers + LOADER_REGS + groups - 1) // groups + 7) // 8 * 8)
    return maxnreg, consumer


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
    """Heads whose work items run together (`_work_item`; a compile-time constant): 0 for all B * H, heaviest first
    across them; fewer keeps the programs in flight on fewer heads' K/V, more of them in L2 at long sequences."""
    exp2_emulated: int = 0
    """One in this many (2, 4, 8 or 16) of the softmax's exp2s computed by a polynomial on the FMA pipe instead of the
    MUFU unit (`exp2_mixed_asm`, FlashAttention-4's split); 0: none. At d 64 a consumer iteration keeps the MUFU unit
    about as busy as the tensor cores (results/flash_hopper_notes.md, section 13)."""

    rescale_under_s: bool = False
    """O's rescale by alpha(j-1) issued after S(j), so that it runs while S(j) is on the tensor cores, and before
    P(j-1) V(j-1) (FlashAttention-3's order); False: at the end of iteration j-1, before S(j) is issued."""

    round_robin: bool = False
    """Persistent grid only: program p takes work items p, p + #programs, ... instead of its list in `work_schedule`'s
    table (kept to compare the two: causal items differ in length, and round robin left the busiest program 3% above
    the mean work at the d-64 forward's launch; results/flash_hopper_notes.md, section 21)."""

    def __post_init__(self):
        if not isinstance(self.rescale_under_s, bool):
            raise ValueError(f"rescale_under_s ({self.rescale_under_s!r}) must be a bool")
        if not isinstance(self.round_robin, bool):
            raise ValueError(f"round_robin ({self.round_robin!r}) must be a bool")
        if self.round_robin and not self.persistent:
            raise ValueError("round_robin needs persistent: it orders the work items of a persistent grid")
        if type(self.exp2_emulated) is not int or self.exp2_emulated not in (0, 2, 4, 8, 16):
            raise ValueError(f"exp2_emulated ({self.exp2_emulated!r}) must be 0, 2, 4, 8 or 16")
        if not isinstance(self.persistent, bool):
            raise ValueError(f"persistent ({self.persistent!r}) must be a bool")
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


DEFAULT_CONFIGS = {64: GluonConfig(block_m=64, block_n=128, num_stages=3, num_consumers=2),
                   128: GluonConfig(block_m=64, block_n=128, num_stages=2, num_consumers=2)}
"""Per head dim: FA3's hdim-128 shape (two 64-row consumer groups, 128-key tiles)."""


EXP2_EMULATED = {64: 8}
"""Head dim -> `GluonConfig.exp2_emulated` where the tuned file does not set it. At d 64 each consumer iteration
issues as much MUFU work as tensor-core work (results/flash_hopper_notes.md, section 13); one exp2 in 8 on the FMA
pipe moves it below (section 15)."""


RESCALE_UNDER_S = {64: True}
"""Head dim -> `GluonConfig.rescale_under_s` of `default_config` unless the tuned file sets it. Paired against the
launched configs, it was faster at d 64 and slower at d 128, where O's multiplies per thread are twice as many and
delay S's issue (results/runs/flash_gluon_fwd_ru_75221a4.parquet; results/flash_hopper_notes.md, section 17)."""


def default_config(head_dim: int, dtype: torch.dtype) -> GluonConfig:
    """The tuned file's forward config for this head dim and dtype (`sweeps/flash_tiles.py --variants gluon`),
    else DEFAULT_CONFIGS'; its `exp2_emulated` and `rescale_under_s` from EXP2_EMULATED and RESCALE_UNDER_S unless
    the file sets them (files written before the sweep's axis for the second hold none)."""
    fields = dict(gluon_tuned_fields("fwd", head_dim, dtype) or {})
    config = GluonConfig(**fields) if fields else DEFAULT_CONFIGS[head_dim]
    if "exp2_emulated" not in fields and head_dim in EXP2_EMULATED:
        config = dataclasses.replace(config, exp2_emulated=EXP2_EMULATED[head_dim])
    if "rescale_under_s" not in fields and head_dim in RESCALE_UNDER_S:
        config = dataclasses.replace(config, rescale_under_s=RESCALE_UNDER_S[head_dim])
    return config


PERSISTENT_GRID = {128: (32768, {"persistent": True, "head_group": 4})}
"""Head dim -> (n_q up to which, the fields that replace the tuned config's). A persistent program hides an item's
start and drain behind the next item's loads, and with `work_schedule`'s lists its programs end together; paired
against the tuned config (one-item programs; head groups capped by `l2_head_group`, the persistent grid's too), it
was faster at every length measured, 2048 to 32768 (results/flash_hopper_notes.md, section 21). In round robin it
had been faster up to 2048 only (section 13). The tuned file gives one config per head dim, from sweeps whose
persistent trials ran round robin."""


def problem_config(q: torch.Tensor, k: torch.Tensor) -> GluonConfig:
    """The forward config for q (B, H, N_Q, d) and k (B, H, N_K, d) when none is given: `default_config`, with
    PERSISTENT_GRID's fields up to its length when the tuned config has two consumer groups (what the persistent grid
    takes), and its head group fit to the L2 cache of q's device (`l2_head_group`: every query tile of a head reads
    that head's K and V again, 2 * N_K * d elements); one lookup per problem shape."""
    batch, heads, n_q, head_dim = q.shape
    return _problem_config(head_dim, q.dtype, n_q, k.shape[2], batch * heads, q.device)


@functools.lru_cache(maxsize=64)
def _problem_config(head_dim: int, dtype: torch.dtype, n_q: int, n_k: int, heads: int,
                    device: torch.device) -> GluonConfig:
    config = default_config(head_dim, dtype)
    n_max, fields = PERSISTENT_GRID.get(head_dim, (0, {}))
    if n_q <= n_max and config.num_consumers == 2:
        config = dataclasses.replace(config, **fields)
    head_bytes = 2 * n_k * head_dim * dtype.itemsize
    group = l2_head_group(config.head_group, head_bytes, heads, l2_cache_bytes(device))
    return config if group == config.head_group else dataclasses.replace(config, head_group=group)


L2_SHARE = 4
"""`l2_head_group` keeps a group's re-read rows within 1 / L2_SHARE of the L2 cache. Measured, not derived: paired
against the neighbouring groups on the H200 (60 MiB), one head at a time was fastest in both directions at 16384 and
32768 (d 128; results/runs/flash_gluon_fwd_groups_c70d41a.parquet, flash_gluon_bwd_groups_c7d98d2.parquet), which
the whole cache (7 and 3 forward heads, 3 backward at 16384) missed; the cache is two partitions, and the outputs
and single-use tiles pass through it too. Short sequences keep their tuned groups under it."""


def l2_head_group(head_group: int, head_bytes: int, heads: int | None, l2_bytes: int | None) -> int:
    """`head_group` (0: all `heads`) lowered to the heads whose re-read rows fit their share of the L2 cache
    (L2_SHARE) together, `head_bytes` a head (what every program of the head streams again: K and V in the forward;
    Q, dO and the fp32 dQ in the one-pass backward). The tuned group was measured at the swept shapes; at longer
    sequences fewer heads fit, and fewer heads were faster there (results/flash_hopper_notes.md, sections 11 and 14).
    Unchanged without `l2_bytes` or where the tuned group fits."""
    if l2_bytes is None or l2_bytes <= 0:
        return head_group
    fit = max(1, l2_bytes // (L2_SHARE * head_bytes))
    current = head_group or heads
    if current is None or current <= fit:
        return head_group
    return fit


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(device: torch.device) -> int | None:
    """The L2 cache of a CUDA device in bytes (asked once per device); None for another device."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else None


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `gluon_attention_fwd` runs on these tensors: CUDA sm_90, Triton with Gluon's Hopper API, bf16/fp16,
    4-D (B, H, N, D) with D in {64, 128}, unit stride along D, 16-byte aligned strides and pointers."""
    return not unsupported_reason(q, k, v)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """'' when supported, else why not (the first rule broken)."""
    if not HAS_GLUON_HOPPER:
        return f"Triton {triton.__version__} has no Gluon Hopper API"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.device.type != "cuda":
            return f"{name} is on {t.device}, not a CUDA device"
        if t.dtype not in DTYPES:
            return f"{name} has dtype {t.dtype}; needs bfloat16 or float16"
        if t.dim() != 4:
            return f"{name} has shape {tuple(t.shape)}; needs 4-D (B, H, N, D)"
        if t.shape[-1] not in HEAD_DIMS:
            return f"{name} has head dim {t.shape[-1]}; needs one of {HEAD_DIMS}"
        if 0 in t.shape:
            return f"{name} has shape {tuple(t.shape)}; needs at least one row of at least one head"
        # The 4-D descriptors encode every stride (length-1 dimensions' too) and the start; a tracing stand-in
        # (torch.compile's fake tensors) has no pointer, its storage offset stands for it.
        elem = t.element_size()
        start = t.storage_offset() * elem if is_fake(t) or isinstance(t, FunctionalTensor) else t.data_ptr()
        if t.stride(-1) != 1 or any((s * elem) % 16 for s in t.stride()[:-1]) or start % 16:
            return (f"{name} strides {tuple(t.stride())} (or its start) are not 16-byte aligned with unit stride "
                    "on D")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        return "q, k, v must share dtype and device"
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    if capability(q.device) != (9, 0):
        return f"device capability {capability(q.device)} is not sm_90"
    return ""


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid); an H100 / H200's 132 for a CPU tensor
    (the sm_90 build check on a host without a GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """`torch.cuda.get_device_capability`, asked once per device (it costs microseconds per call)."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared layout of a TMA block (an immutable value: built once per block shape and dtype)."""
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _arg_key(arg):
    """What a launch argument's compiled kernel depends on: a descriptor's type, shape, strides and base alignment,
    a tensor's dtype and alignment, an int's value (Triton specialises ints on 1, on 16 | n and on their width), a
    float's type; anything else its value."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, float):
        return float
    if HAS_GLUON_HOPPER and isinstance(arg, TensorDescriptor):
        return (arg.base.dtype, tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape), arg.layout,
                arg.padding, arg.base.data_ptr() % 16 == 0)
    return (type(arg), arg)


_CACHE_MAX = 4096
"""Entries at which `launch`'s and `tensor_descriptor`'s caches start afresh (a run over many sequence lengths adds
one per length, kernel and descriptor)."""
_COMPILED: dict = {}
"""(kernel, device, argument keys, keyword arguments) -> the compiled kernel its build probe returned."""
_FAILED: dict = {}
"""The same keys -> why the build probe failed (a specialisation that does not build is not built again)."""


class BuildFailed(RuntimeError):
    """A kernel that does not build (compile, or load on the device) for these arguments on the installed Triton: the
    dispatch's cue to run the tl kernels instead (`kernels.attention.interface`)."""


def _first_line(exc: BaseException) -> str:
    """The innermost cause's first line (a CompilationError's own text is the source around the failing call)."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:300]


def build(kernel, grid: tuple[int, ...], args: tuple, meta: dict):
    """The build probe of one specialisation: compile `kernel` for these arguments and load it on the current device,
    launching nothing (Triton's `warmup`). Any failure is a `BuildFailed` naming the kernel, the Triton and the
    error's first line."""
    try:
        compiled = kernel.warmup(*args, grid=grid, **meta)
        compiled._init_handles()  # loading checks the shared memory and registers the device has
    except Exception as exc:  # noqa: BLE001 - whatever stops the build, the kernel cannot run here
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        raise BuildFailed(f"{name} does not build on Triton {triton.__version__}: {_first_line(exc)}") from exc
    return compiled


def launch(kernel, grid: tuple[int, ...], args: tuple, meta: dict, key: tuple | None = None) -> None:
    """`kernel[grid](*args, **meta)` on the current device and stream, for a kernel whose parameters after `args`
    are all named in `meta` (with Triton's options, num_warps, maxnreg). The first launch of a specialisation builds
    it (`build`: `BuildFailed` if it cannot, then and on every later call with these keys) and keeps the compiled
    kernel; every launch runs it directly (`CompiledKernel.run`, as Inductor's launchers do), without Triton's
    per-call argument binding, specialisation and cache lookup: host time on every call, which small attention calls
    are bound by. `key`: the caller's own key, which must determine every `_arg_key` of `args` and `meta` (the
    launchers' problem keys: shapes, strides, dtypes, config), so that the arguments need not be keyed one by one."""
    device = current_device()
    if key is None:
        key = (kernel, device, tuple(_arg_key(a) for a in args), tuple(meta.items()))
    else:
        key = (kernel, device, key)
    compiled = _COMPILED.get(key)
    if compiled is None:
        if key in _FAILED:
            raise BuildFailed(_FAILED[key])
        try:
            compiled = build(kernel, grid, args, meta)
        except BuildFailed as exc:
            _FAILED[key] = str(exc)
            raise
        if len(_COMPILED) >= _CACHE_MAX:
            _COMPILED.clear()
        _COMPILED[key] = compiled
    bound = (*args, *(meta[p.name] for p in kernel.params[len(args):]))
    stream = raw_stream(device)
    grid = (*grid, 1, 1)
    hooks = triton.knobs.runtime
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid[:3], stream, *bound), hooks.launch_enter_hook, hooks.launch_exit_hook,
                 *bound)


_DESCRIPTOR_FIELDS: dict = {}
"""(shape, strides, dtype, block shape, layout) -> a checked descriptor's fields but its base."""


def tensor_descriptor(t: torch.Tensor, block: list[int], layout, shape: list[int] | None = None,
                      strides: list[int] | None = None) -> "TensorDescriptor":
    """`TensorDescriptor(t, shape, strides, block, layout)` (t's own shape and strides when not given). Its
    dataclass checks (strides' alignment, block shape, layout) run on the first descriptor of each (shape, strides,
    dtype, block, layout); later ones copy its fields and check only the base's 16-byte alignment, which is all that
    differs: host time on every launch, nine descriptors per backward."""
    shape = tuple(t.shape) if shape is None else tuple(shape)
    strides = tuple(t.stride()) if strides is None else tuple(strides)
    key = (shape, strides, t.dtype, tuple(block), layout)
    fields = _DESCRIPTOR_FIELDS.get(key)
    if fields is None:
        desc = TensorDescriptor(t, list(shape), list(strides), list(block), layout)
        if len(_DESCRIPTOR_FIELDS) >= _CACHE_MAX:
            _DESCRIPTOR_FIELDS.clear()
        _DESCRIPTOR_FIELDS[key] = {name: value for name, value in vars(desc).items() if name != "base"}
        return desc
    if t.data_ptr() % 16:
        raise ValueError(f"a TMA descriptor's base must be 16-byte aligned, got address {t.data_ptr():#x}")
    desc = object.__new__(TensorDescriptor)
    vars(desc).update(fields)
    desc.base = t
    return desc


def _descriptor(t: torch.Tensor, block_rows: int) -> "TensorDescriptor":
    block = [1, 1, block_rows, t.shape[-1]]
    return tensor_descriptor(t, block, shared_layout(tuple(block), t.dtype))


ITEM_COST = 1
"""`work_schedule`'s cost model: a work item costs its key tiles plus ITEM_COST more for its start and epilogue (Q's
wait, O's store): an assumption, not a measurement."""


def work_weights(bh: int, n_q: int, n_k: int, tile_m: int, block_n: int, group: int, is_causal: bool) -> list[int]:
    """Key tiles of each work item of the forward, in `_work_item`'s numbering (the kernel's rules, on the host)."""
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
    numbering keeps the programs running at once on the same few heads (`_work_item`'s head groups), and the last
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


def launch_args(q, k, v, out, lse, is_causal: bool, config: GluonConfig):
    """(grid, positional args, keyword args) of one launch: shared by the launcher and the CPU compile check."""
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    maxnreg, consumer_regs = config.registers()
    num_items = triton.cdiv(n_q, config.num_consumers * config.block_m) * batch * heads
    descriptors = (_descriptor(q, config.block_m), _descriptor(k, config.block_n), _descriptor(v, config.block_n),
                   _descriptor(out, config.block_m), lse, heads)
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


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        config: GluonConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O like q, L fp32 (B, H, N_Q), natural log) of softmax(Q K^T / sqrt(d) [+ causal mask]) V."""
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"gluon_attention_fwd: {reason}")
    return launch_fwd(q, k, v, is_causal, config or problem_config(q, k))


def launch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config: GluonConfig
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gluon_attention_fwd` on inputs `unsupported_reason` accepted: for callers that checked them already (the
    check costs host time on every call)."""
    out = empty_like_layout(q)  # q's layout (unit stride on D, 16-byte strides: a valid TMA target)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    grid, args, meta = launch_args(q, k, v, out, lse, is_causal, config)
    # What every argument's key reads (out and lse are new and aligned, out in q's layout, lse contiguous; q, k, v
    # aligned: checked).
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, is_causal, config)
    with device_of(q):
        launch(config.kernel, grid, args, meta, key)
    return out, lse


def gluon_attention_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, is_causal: bool) -> float:
    """Forward FLOPs: 4 B H N_q N_k D, halved under a causal mask (the convention of results/flash_bench)."""
    flops = 4.0 * batch * heads * n_q * n_k * head_dim
    return flops / 2 if is_causal else flops
