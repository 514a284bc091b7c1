"""FlashAttention-2 in Triton: fused forward (Algorithm 1) and a two-pass backward (Algorithm 2), no atomics.

Computes O = softmax(Q K^T / sqrt(d) + mask) V and the row log-sum-exp L = logsumexp(Q K^T / sqrt(d) + mask)
(natural log), where the causal mask adds -1e6 to the score of key j for query i when j > i
[T. Dao, FlashAttention-2, 2023; CS336 assignment 2, section 4.2].

Shape legend: B batch, H heads (absent for 3-D input), M n_queries, N n_keys, D head dim in [16, 128],
BLOCK_D = next power of two >= D (the padded columns are masked on load and store). Inputs are
(B, M, D) / (B, N, D) or (B, H, M, D) / (B, H, N, D), any strides, fp32 / fp16 / bf16; causal needs M == N.

Forward (`_flash_fwd_kernel`, grid (cdiv(M, BLOCK_M), B*H)): a program keeps one query tile in registers and
walks the key tiles once with fp32 running max m, denominator l and output accumulator. Scores live in base-2
units (s2 = q.k * scale * log2 e, so exp2(s2 - m2) == exp(s - m) and the exponent is one FMA + MUFU.EX2).
Causal: key tiles above the diagonal are never visited; the tiles strictly below it run without any index
comparison; only the BLOCK_M / BLOCK_N diagonal tiles build the mask. Programs are handed out longest-row
first, so the heaviest query tiles do not start last and leave a tail on the SMs. Writes O and L.

Backward (Algorithm 2): `_flash_bwd_preprocess_kernel` writes D = rowsum(O * dO); `_flash_bwd_dkdv_kernel`
keeps one (K, V) tile in registers and walks the query tiles (dV += P^T dO, dK += dS^T Q); `_flash_bwd_dq_kernel`
keeps one (Q, dO) tile and walks the key tiles (dQ += dS K). P = exp(S - L) is recomputed in both passes,
so no program writes another's output and there are no atomics. The same causal split (skip, unmasked,
diagonal) and heavy-first ordering apply. Accumulators are fp32; P and dS are cast to the input dtype
before their matmuls. fp32 inputs use exact fp32 products unless `torch.set_float32_matmul_precision`
allows TF32.

Tile sizes, warps and stages are autotuned per (sequence bucket, head dim, causal, dtype) over the candidates
of `kernels/flash_attention_tuning.py` that its pruning predicate keeps (tile divisibility, shared memory,
registers), the Ray Tune sweep's best configs first. `RAYSYS_FLASH_AUTOTUNE=0` skips the benchmark and takes
the first valid config. Under `TRITON_INTERPRET=1` (read when this module is imported) there is one small
config per kernel and CPU tensors are accepted; the interpreter has no bf16.

torch.compile: `flash_attention` calls the custom op `raysys::flash_attn_fwd` (autograd registered, backward
`raysys::flash_attn_bwd`). On a GPU both are `torch.library.triton_op`s, so the compiler traces their bodies and
Inductor launches the kernels itself; while tracing nothing is benchmarked, and each kernel takes the config
autotuning off would take. Under the interpreter they are opaque `custom_op`s with fake implementations.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from kernels.flash_attention_pytorch import MASK_VALUE, autocast_inputs, check_attention_inputs
from kernels.flash_attention_tuning import (
    AUTOTUNE_KEY,
    INTERPRET,
    PATHS,
    FlashConfig,
    config_list,
    even_heuristics,
    first_valid_config,
    make_pruner,
)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptrs, rows, cols, n_rows, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a (rows, cols) tile; masked-off elements read as 0. Masks exist only where asked for."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_tile(ptrs, x, rows, cols, n_rows, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    if MASK_ROWS:
        if MASK_COLS:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        if MASK_COLS:
            tl.store(ptrs, x, mask=cols[None, :] < n_cols)
        else:
            tl.store(ptrs, x)


@triton.jit
def _load_rowvec(ptrs, rows, n_rows, other, MASK_ROWS: tl.constexpr):
    if MASK_ROWS:
        x = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _tile_ids(tile, num_t, num_bh, IS_CAUSAL: tl.constexpr, HEAVY_LAST_TILE: tl.constexpr):
    """(tile index along the sequence, batch*head index) of work item `tile` (launch order, or a persistent
    program's loop order).

    With a causal mask the work of a tile grows with its distance from the first key (forward, dQ: the last
    query tiles) or shrinks with it (dK/dV: the first key tiles are heaviest), so work items are numbered
    heaviest first across all heads: the hardware scheduler (or the persistent loop) starts the long tiles
    first and the short ones fill the tail.
    """
    if IS_CAUSAL:
        pid_bh = tile % num_bh
        if HEAVY_LAST_TILE:
            pid_t = num_t - 1 - tile // num_bh
        else:
            pid_t = tile // num_bh
    else:
        pid_t = tile % num_t
        pid_bh = tile // num_t
    return pid_t, pid_bh


@triton.jit
def _tma_desc(base, n_rows, stride_row, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor descriptor (TMA on sm_90+) of one (batch, head)'s (n_rows, HEAD_DIM) matrix, in (BLOCK_ROWS, BLOCK_D)
    tiles: loads past its edges read 0 and stores past them are dropped, so no tile needs a mask."""
    return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


@triton.jit
def _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                     offs_m, offs_d, lo, hi, N_K, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                     MASK_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Algorithm 1, lines 7-14, over key tiles [lo, hi) (lo a multiple of BLOCK_N). `k_src`, `v_src` are
    tensor descriptors (USE_TMA) or the (batch, head) base pointers."""
    offs_n = tl.arange(0, BLOCK_N)
    if not USE_TMA:
        k_ptrs = k_src + (lo + offs_n)[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_src + (lo + offs_n)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # 1. S = Q K^T, in base-2 units once scaled.
        if USE_TMA:
            k = k_src.load([start_n, 0])
        else:
            k = _load_tile(k_ptrs, cols, offs_d, N_K, HEAD_DIM, MASK_N, not EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        # 2. Running max. Masked scores get -1e6 (times log2 e, as all scores here); the unmasked tiles fold
        #    the scale into one FMA per score.
        if CAUSAL_MASK:
            qk = qk * qk_scale + tl.where(offs_m[:, None] >= cols[None, :], 0.0, -1.4426950408889634e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        elif MASK_N:
            qk = qk * qk_scale + tl.where(cols[None, :] < N_K, 0.0, -1.4426950408889634e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        # 3. P~ = exp(S - m), rescale the old l and O by exp(m_old - m_new), accumulate P~ V in fp32.
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = v_src.load([start_n, 0])
        else:
            v = _load_tile(v_ptrs, cols, offs_d, N_K, HEAD_DIM, MASK_N, not EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=INPUT_PRECISION)
        m_i = m_new
        if not USE_TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_tile(pid_m, pid_bh, Q, K, V, O, L,
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_om, stride_od,
                    H, N_Q, N_K, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """One query tile of one (batch, head): Algorithm 1."""
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    o_base = O + off_b * stride_ob + off_h * stride_oh
    l_base = L + pid_bh.to(tl.int64) * N_Q

    # 1. Load the query tile once (Algorithm 1, line 5); init m = -inf, l = 0, O = 0 in fp32 (line 6).
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        k_src = _tma_desc(k_base, N_K, stride_kn, BLOCK_N, HEAD_DIM, BLOCK_D)
        v_src = _tma_desc(v_base, N_K, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D)
        q = _tma_desc(q_base, N_Q, stride_qm, BLOCK_M, HEAD_DIM, BLOCK_D).load([start_m, 0])
    else:
        k_src = k_base
        v_src = v_base
        q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, offs_d,
                       N_Q, HEAD_DIM, not EVEN_M, not EVEN_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 2. Key loop (lines 7-14).
    if WARP_SPECIALIZE:
        # One loop, masks on every tile where any tile needs one: Triton 3.6's Hopper warp specialisation
        # handles a single loop per kernel (a second loop after it fails to compile).
        hi = tl.minimum(start_m + BLOCK_M, N_K) if IS_CAUSAL else N_K
        acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                         stride_vd, offs_m, offs_d, 0, hi, N_K, qk_scale, HEAD_DIM, BLOCK_N,
                                         IS_CAUSAL, not EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, True)
    elif IS_CAUSAL:
        # Off-diagonal tiles: every key < start_m, so no comparison (BLOCK_M % BLOCK_N == 0 aligns them).
        acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                         stride_vd, offs_m, offs_d, 0, start_m, N_K, qk_scale, HEAD_DIM,
                                         BLOCK_N, False, False, EVEN_D, INPUT_PRECISION, USE_TMA, False)
        # Diagonal tiles: keys [start_m, start_m + BLOCK_M); the later ones are masked for every row.
        acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                         stride_vd, offs_m, offs_d, start_m, tl.minimum(start_m + BLOCK_M, N_K),
                                         N_K, qk_scale, HEAD_DIM, BLOCK_N, True, not EVEN_N, EVEN_D,
                                         INPUT_PRECISION, USE_TMA, False)
    else:
        n_full = (N_K // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                         stride_vd, offs_m, offs_d, 0, n_full, N_K, qk_scale, HEAD_DIM,
                                         BLOCK_N, False, False, EVEN_D, INPUT_PRECISION, USE_TMA, False)
        if not EVEN_N:  # the one partial key tile: out-of-range keys are masked like causal ones
            acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                             stride_vd, offs_m, offs_d, n_full, N_K, N_K, qk_scale, HEAD_DIM,
                                             BLOCK_N, False, True, EVEN_D, INPUT_PRECISION, USE_TMA, False)

    # 3. O = O~ / l (line 15), L = m + log l (line 16; back from base 2 to natural log), write both.
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    if USE_TMA:
        _tma_desc(o_base, N_Q, stride_om, BLOCK_M, HEAD_DIM, BLOCK_D).store([start_m, 0], acc.to(O.dtype.element_ty))
    else:
        _store_tile(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                    acc.to(O.dtype.element_ty), offs_m, offs_d, N_Q, HEAD_DIM, not EVEN_M, not EVEN_D)
    if EVEN_M:
        tl.store(l_base + offs_m, lse)
    else:
        tl.store(l_base + offs_m, lse, mask=offs_m < N_Q)


@triton.jit
def _flash_fwd_kernel(Q, K, V, O, L,
                      stride_qb, stride_qh, stride_qm, stride_qd,
                      stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd,
                      stride_ob, stride_oh, stride_om, stride_od,
                      H, NUM_BH, N_Q, N_K, qk_scale, SEQ_BUCKET,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                      EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr):
    # SEQ_BUCKET (next power of two of max(M, N)) is only an autotuning key. Inductor passes Python floats as
    # fp64 scalars (Triton's launcher as fp32): fp32 here, or the scores would be promoted to fp64.
    qk_scale = tl.cast(qk_scale, tl.float32)
    num_m = tl.cdiv(N_Q, BLOCK_M)
    if PERSISTENT:  # one program per SM walks the work items, heaviest first
        for tile in tl.range(tl.program_id(0), num_m * NUM_BH, tl.num_programs(0)):
            pid_m, pid_bh = _tile_ids(tile, num_m, NUM_BH, IS_CAUSAL, True)
            _flash_fwd_tile(pid_m, pid_bh, Q, K, V, O, L, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb,
                            stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob,
                            stride_oh, stride_om, stride_od, H, N_Q, N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                            BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE)
    else:
        pid_m, pid_bh = _tile_ids(tl.program_id(1) * num_m + tl.program_id(0), num_m, NUM_BH, IS_CAUSAL, True)
        _flash_fwd_tile(pid_m, pid_bh, Q, K, V, O, L, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb,
                        stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob,
                        stride_oh, stride_om, stride_od, H, N_Q, N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                        BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE)


@triton.jit
def _flash_bwd_preprocess_kernel(O, DO, Delta,
                                 stride_ob, stride_oh, stride_om, stride_od,
                                 stride_dob, stride_doh, stride_dom, stride_dod,
                                 H, N_Q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Algorithm 2, line 2: D = rowsum(O * dO) in fp32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = _load_tile(O + off_b * stride_ob + off_h * stride_oh + rows[:, None] * stride_om + cols[None, :] * stride_od,
                   rows, cols, N_Q, HEAD_DIM, True, True)
    do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None] * stride_dom
                    + cols[None, :] * stride_dod, rows, cols, N_Q, HEAD_DIM, True, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + pid_bh.to(tl.int64) * N_Q + rows, delta, mask=rows < N_Q)


@triton.jit
def _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                          stride_qm, stride_qd, stride_dom, stride_dod,
                          offs_n, offs_d, lo, hi, N_Q, qk_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                          MASK_M: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                          USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """Algorithm 2, lines 9-17, over query tiles [lo, hi), in the transposed (keys x queries) orientation;
    with DQ_ATOMIC also lines 20-21 (dQ += dS K) into an fp32 accumulator shared by all key tiles."""
    offs_mb = tl.arange(0, BLOCK_M)
    if not USE_TMA:
        q_ptrs = q_src + (lo + offs_mb)[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_src + (lo + offs_mb)[:, None] * stride_dom + offs_d[None, :] * stride_dod
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WARP_SPECIALIZE):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_mb
        if USE_TMA:
            q = q_src.load([start_m, 0])
        else:
            q = _load_tile(q_ptrs, rows, offs_d, N_Q, HEAD_DIM, MASK_M, not EVEN_D)
        # Out-of-range queries get L = +inf, hence P = 0, and contribute nothing.
        lse2 = _load_rowvec(l_base + rows, rows, N_Q, float("inf"), MASK_M) * 1.4426950408889634
        # 1. P^T = exp(S^T - L) (eqs. 13-14), recomputed from Q, K and L.
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        # 2. dV += P^T dO (eq. 15).
        if USE_TMA:
            do = do_src.load([start_m, 0])
        else:
            do = _load_tile(do_ptrs, rows, offs_d, N_Q, HEAD_DIM, MASK_M, not EVEN_D)
        dv = tl.dot(p_t.to(do.dtype), do, acc=dv, input_precision=INPUT_PRECISION)
        # 3. dS^T = P^T * (dP^T - D) with dP^T = V dO^T (eqs. 16-17); dK += dS^T Q (eq. 19, scaled later).
        delta = _load_rowvec(delta_base + rows, rows, N_Q, 0.0, MASK_M)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, acc=dk, input_precision=INPUT_PRECISION)
        # 4. DQ_ATOMIC: this key tile's share of dQ = dS K (eq. 18, with its 1/sqrt(d)), added to the fp32
        #    accumulator by the TMA unit's reduce (2) or by atomics (1): five matmuls per tile pair, not seven.
        if DQ_ATOMIC > 0:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=INPUT_PRECISION) * scale
            if DQ_ATOMIC == 2:
                dq_src.atomic_add([start_m, 0], dq)
            else:
                tl.atomic_add(dq_src + rows[:, None] * stride_dqm + offs_d[None, :], dq, mask=rows[:, None] < N_Q,
                              sem="relaxed")
        if not USE_TMA:
            q_ptrs += BLOCK_M * stride_qm
            do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_tile(pid_n, pid_bh, Q, K, V, DO, L, Delta, DK, DV, DQ,
                         stride_qb, stride_qh, stride_qm, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                         stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                         H, N_Q, N_K, scale, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """One key tile of one (batch, head): dK and dV (Algorithm 2, lines 6-19), and with DQ_ATOMIC its share of
    dQ, added into DQ: fp32, (batch * heads, N_Q, BLOCK_D) contiguous, zero on entry."""
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    dk_base = DK + off_b * stride_dkb + off_h * stride_dkh
    dv_base = DV + off_b * stride_dvb + off_h * stride_dvh
    l_base = L + pid_bh.to(tl.int64) * N_Q
    delta_base = Delta + pid_bh.to(tl.int64) * N_Q
    stride_dqm = BLOCK_D
    if DQ_ATOMIC == 2:
        dq_src = _tma_desc(DQ + pid_bh.to(tl.int64) * N_Q * BLOCK_D, N_Q, BLOCK_D, BLOCK_M, BLOCK_D, BLOCK_D)
    else:
        dq_src = DQ + pid_bh.to(tl.int64) * N_Q * BLOCK_D

    # 1. K, V tiles stay in registers for the whole query loop (Algorithm 2, lines 7-8).
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        q_src = _tma_desc(q_base, N_Q, stride_qm, BLOCK_M, HEAD_DIM, BLOCK_D)
        do_src = _tma_desc(do_base, N_Q, stride_dom, BLOCK_M, HEAD_DIM, BLOCK_D)
        k = _tma_desc(k_base, N_K, stride_kn, BLOCK_N, HEAD_DIM, BLOCK_D).load([start_n, 0])
        v = _tma_desc(v_base, N_K, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D).load([start_n, 0])
    else:
        q_src = q_base
        do_src = do_base
        k = _load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, offs_d, N_K,
                       HEAD_DIM, not EVEN_N, not EVEN_D)
        v = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, offs_d, N_K,
                       HEAD_DIM, not EVEN_N, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # 2. Query loop. Causal: queries before start_n see none of these keys (skipped); the BLOCK_N / BLOCK_M
    #    diagonal query tiles compare indices; every later query sees all of them.
    m_full = (N_Q // BLOCK_M) * BLOCK_M
    if WARP_SPECIALIZE:  # one loop (see the forward)
        dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                                       stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d,
                                       start_n if IS_CAUSAL else 0, N_Q, N_Q, qk_scale, HEAD_DIM, BLOCK_M, IS_CAUSAL,
                                       not EVEN_M, EVEN_D, INPUT_PRECISION, USE_TMA, True, DQ_ATOMIC)
    elif IS_CAUSAL:
        dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                                       stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, start_n,
                                       tl.minimum(start_n + BLOCK_N, N_Q), N_Q, qk_scale, HEAD_DIM, BLOCK_M,
                                       True, not EVEN_M, EVEN_D, INPUT_PRECISION, USE_TMA, False, DQ_ATOMIC)
        lo = start_n + BLOCK_N
        dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                                       stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, lo, m_full,
                                       N_Q, qk_scale, HEAD_DIM, BLOCK_M, False, False, EVEN_D, INPUT_PRECISION,
                                       USE_TMA, False, DQ_ATOMIC)
        if not EVEN_M:
            dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale,
                                           stride_dqm, stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d,
                                           tl.maximum(lo, m_full), N_Q, N_Q, qk_scale, HEAD_DIM, BLOCK_M,
                                           False, True, EVEN_D, INPUT_PRECISION, USE_TMA, False, DQ_ATOMIC)
    else:
        dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                                       stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, 0, m_full, N_Q,
                                       qk_scale, HEAD_DIM, BLOCK_M, False, False, EVEN_D, INPUT_PRECISION, USE_TMA,
                                       False, DQ_ATOMIC)
        if not EVEN_M:
            dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale,
                                           stride_dqm, stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d,
                                           m_full, N_Q, N_Q, qk_scale, HEAD_DIM, BLOCK_M, False, True, EVEN_D,
                                           INPUT_PRECISION, USE_TMA, False, DQ_ATOMIC)

    # 3. Write dK (with the 1/sqrt(d) of eq. 19) and dV (line 18).
    dk = dk * scale
    if USE_TMA:
        _tma_desc(dk_base, N_K, stride_dkn, BLOCK_N, HEAD_DIM, BLOCK_D).store([start_n, 0], dk.to(DK.dtype.element_ty))
        _tma_desc(dv_base, N_K, stride_dvn, BLOCK_N, HEAD_DIM, BLOCK_D).store([start_n, 0], dv.to(DV.dtype.element_ty))
    else:
        _store_tile(dk_base + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
                    offs_n, offs_d, N_K, HEAD_DIM, not EVEN_N, not EVEN_D)
        _store_tile(dv_base + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
                    offs_n, offs_d, N_K, HEAD_DIM, not EVEN_N, not EVEN_D)


@triton.jit
def _flash_bwd_dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV, DQ,
                           stride_qb, stride_qh, stride_qm, stride_qd,
                           stride_kb, stride_kh, stride_kn, stride_kd,
                           stride_vb, stride_vh, stride_vn, stride_vd,
                           stride_dob, stride_doh, stride_dom, stride_dod,
                           stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                           stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                           H, NUM_BH, N_Q, N_K, scale, qk_scale, SEQ_BUCKET,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                           EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                           USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr,
                           DQ_ATOMIC: tl.constexpr):
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)  # see _flash_fwd_kernel
    num_n = tl.cdiv(N_K, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_n * NUM_BH, tl.num_programs(0)):
            pid_n, pid_bh = _tile_ids(tile, num_n, NUM_BH, IS_CAUSAL, False)
            _flash_bwd_dkdv_tile(pid_n, pid_bh, Q, K, V, DO, L, Delta, DK, DV, DQ, stride_qb, stride_qh, stride_qm,
                                 stride_qd, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
                                 stride_vd, stride_dob, stride_doh, stride_dom, stride_dod, stride_dkb, stride_dkh,
                                 stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, H, N_Q, N_K,
                                 scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N,
                                 EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE, DQ_ATOMIC)
    else:
        pid_n, pid_bh = _tile_ids(tl.program_id(1) * num_n + tl.program_id(0), num_n, NUM_BH, IS_CAUSAL, False)
        _flash_bwd_dkdv_tile(pid_n, pid_bh, Q, K, V, DO, L, Delta, DK, DV, DQ, stride_qb, stride_qh, stride_qm,
                             stride_qd, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
                             stride_vd, stride_dob, stride_doh, stride_dom, stride_dod, stride_dkb, stride_dkh,
                             stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, H, N_Q, N_K,
                             scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N,
                             EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE, DQ_ATOMIC)


@triton.jit
def _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_m, offs_d, lo, hi, N_K, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                        MASK_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Algorithm 2, lines 23-30, over key tiles [lo, hi)."""
    offs_nb = tl.arange(0, BLOCK_N)
    if not USE_TMA:
        k_ptrs = k_src + (lo + offs_nb)[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_src + (lo + offs_nb)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_nb
        # Out-of-range keys load as zero rows of K and V, so they add nothing to dQ = dS K.
        if USE_TMA:
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, 0])
        else:
            k = _load_tile(k_ptrs, cols, offs_d, N_K, HEAD_DIM, MASK_N, not EVEN_D)
            v = _load_tile(v_ptrs, cols, offs_d, N_K, HEAD_DIM, MASK_N, not EVEN_D)
        # 1. P = exp(S - L) (eqs. 13-14).
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if CAUSAL_MASK:
            p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
        # 2. dS = P * (dO V^T - D) (eqs. 16-17); dQ += dS K (eq. 18, scaled later).
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, acc=dq, input_precision=INPUT_PRECISION)
        if not USE_TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _flash_bwd_dq_tile(pid_m, pid_bh, Q, K, V, DO, L, Delta, DQ,
                       stride_qb, stride_qh, stride_qm, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_dob, stride_doh, stride_dom, stride_dod,
                       stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                       H, N_Q, N_K, scale, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """One query tile of one (batch, head): dQ (Algorithm 2, lines 20-31)."""
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    dq_base = DQ + off_b * stride_dqb + off_h * stride_dqh

    # 1. Q, dO, L, D of this query tile stay on chip (Algorithm 2, lines 21-22).
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        k_src = _tma_desc(k_base, N_K, stride_kn, BLOCK_N, HEAD_DIM, BLOCK_D)
        v_src = _tma_desc(v_base, N_K, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D)
        q = _tma_desc(q_base, N_Q, stride_qm, BLOCK_M, HEAD_DIM, BLOCK_D).load([start_m, 0])
        do = _tma_desc(do_base, N_Q, stride_dom, BLOCK_M, HEAD_DIM, BLOCK_D).load([start_m, 0])
    else:
        k_src = k_base
        v_src = v_base
        q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, offs_d, N_Q,
                       HEAD_DIM, not EVEN_M, not EVEN_D)
        do = _load_tile(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, offs_m, offs_d, N_Q,
                        HEAD_DIM, not EVEN_M, not EVEN_D)
    lse2 = _load_rowvec(L + pid_bh.to(tl.int64) * N_Q + offs_m, offs_m, N_Q, float("inf"),
                        not EVEN_M) * 1.4426950408889634
    delta = _load_rowvec(Delta + pid_bh.to(tl.int64) * N_Q + offs_m, offs_m, N_Q, 0.0, not EVEN_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 2. Key loop: unmasked tiles below the diagonal, then the masked diagonal tiles.
    if WARP_SPECIALIZE:  # one loop (see the forward)
        hi = tl.minimum(start_m + BLOCK_M, N_K) if IS_CAUSAL else N_K
        dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                 stride_vd, offs_m, offs_d, 0, hi, N_K, qk_scale, HEAD_DIM, BLOCK_N,
                                 IS_CAUSAL, not EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, True)
    elif IS_CAUSAL:
        dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                 stride_vd, offs_m, offs_d, 0, start_m, N_K, qk_scale, HEAD_DIM, BLOCK_N,
                                 False, False, EVEN_D, INPUT_PRECISION, USE_TMA, False)
        dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                 stride_vd, offs_m, offs_d, start_m, tl.minimum(start_m + BLOCK_M, N_K), N_K,
                                 qk_scale, HEAD_DIM, BLOCK_N, True, not EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA,
                                 False)
    else:
        n_full = (N_K // BLOCK_N) * BLOCK_N
        dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                 stride_vd, offs_m, offs_d, 0, n_full, N_K, qk_scale, HEAD_DIM, BLOCK_N,
                                 False, False, EVEN_D, INPUT_PRECISION, USE_TMA, False)
        if not EVEN_N:
            dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                     stride_vd, offs_m, offs_d, n_full, N_K, N_K, qk_scale, HEAD_DIM, BLOCK_N,
                                     False, True, EVEN_D, INPUT_PRECISION, USE_TMA, False)

    # 3. Write dQ with the 1/sqrt(d) of eq. 18 (line 31).
    dq = dq * scale
    if USE_TMA:
        _tma_desc(dq_base, N_Q, stride_dqm, BLOCK_M, HEAD_DIM, BLOCK_D).store([start_m, 0], dq.to(DQ.dtype.element_ty))
    else:
        _store_tile(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
                    offs_m, offs_d, N_Q, HEAD_DIM, not EVEN_M, not EVEN_D)


@triton.jit
def _flash_bwd_dq_kernel(Q, K, V, DO, L, Delta, DQ,
                         stride_qb, stride_qh, stride_qm, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                         H, NUM_BH, N_Q, N_K, scale, qk_scale, SEQ_BUCKET,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr):
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)  # see _flash_fwd_kernel
    num_m = tl.cdiv(N_Q, BLOCK_M)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_m * NUM_BH, tl.num_programs(0)):
            pid_m, pid_bh = _tile_ids(tile, num_m, NUM_BH, IS_CAUSAL, True)
            _flash_bwd_dq_tile(pid_m, pid_bh, Q, K, V, DO, L, Delta, DQ, stride_qb, stride_qh, stride_qm, stride_qd,
                               stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                               stride_dob, stride_doh, stride_dom, stride_dod, stride_dqb, stride_dqh, stride_dqm,
                               stride_dqd, H, N_Q, N_K, scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                               IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE)
    else:
        pid_m, pid_bh = _tile_ids(tl.program_id(1) * num_m + tl.program_id(0), num_m, NUM_BH, IS_CAUSAL, True)
        _flash_bwd_dq_tile(pid_m, pid_bh, Q, K, V, DO, L, Delta, DQ, stride_qb, stride_qh, stride_qm, stride_qd,
                           stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                           stride_dob, stride_doh, stride_dom, stride_dod, stride_dqb, stride_dqh, stride_dqm,
                           stride_dqd, H, N_Q, N_K, scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                           IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE)


# ----------------------------------------------------------------------------------------------------------
# Autotuning (configs and the pruning predicate live in kernels/flash_attention_tuning.py)
# ----------------------------------------------------------------------------------------------------------
_KERNELS = {"fwd": _flash_fwd_kernel, "dkdv": _flash_bwd_dkdv_kernel, "dq": _flash_bwd_dq_kernel,
            "dkdvq": _flash_bwd_dkdv_kernel}
# The one-pass kernel adds into DQ: the autotuner zeroes it before each timed run and before the real one.
_TUNED = {name: triton.autotune(configs=[c.to_triton() for c in config_list(name)], key=AUTOTUNE_KEY,
                                prune_configs_by={"early_config_prune": make_pruner(name)},
                                reset_to_zero=["DQ"] if name == "dkdvq" else None)(
              triton.heuristics(even_heuristics())(fn))
          for name, fn in _KERNELS.items()}
LAST_PATH: dict[str, str] = {}
"""kernel -> the path its last launch in this process took, and `bwd` -> the last backward's mode (benchmark
rows report them)."""


def best_configs() -> dict[str, dict[tuple, FlashConfig]]:
    """What the autotuners picked so far in this process: kernel -> {autotune key: config}."""
    return {name: {key: FlashConfig.from_triton(cfg) for key, cfg in tuner.cache.items()}
            for name, tuner in _TUNED.items()}


def _traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracing stand-in (fake or functional tensor inside torch.compile / export)."""
    return is_fake(t) or isinstance(t, FunctionalTensor)


def _tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator for the global scratch that device-side tensor descriptors live in."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that each walks several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def _grid(num_tiles: int, num_bh: int, persistent: bool, device: torch.device) -> tuple[int, ...]:
    if persistent:
        return (min(num_tiles * num_bh, _num_sms(device)),)
    return (num_tiles, num_bh)


def _launch(kernel: str, num_tiles, args: tuple, meta: dict, n_q: int, n_k: int, config: FlashConfig | None,
            path: str) -> None:
    """Launch `kernel` on `path` with `config`, or the autotuned launcher on real tensors.

    `num_tiles(block_m, block_n)` is the tile count along the sequence. While torch.compile traces the custom
    ops below (fake tensors) nothing can be benchmarked: the launch config is the one autotuning off would take
    (tuned file first, then the built-in order), and the plain kernel goes through `wrap_triton` so that the
    compiler sees it.
    """
    q = args[0]
    traced = _traced(q)
    num_bh = q.shape[0] * q.shape[1]
    meta = dict(meta, USE_TMA=path == "tma")
    LAST_PATH[kernel] = path
    if meta["USE_TMA"] and not (traced or INTERPRET):
        triton.set_allocator(_tma_scratch)  # a context variable: set on the thread that launches
    if config is None and traced:
        config = first_valid_config(kernel, q.dtype, meta["HEAD_DIM"], meta["BLOCK_D"], q.device, path)
    if config is None:
        _TUNED[kernel][lambda m: _grid(num_tiles(m["BLOCK_M"], m["BLOCK_N"]), num_bh, m["PERSISTENT"], q.device)](
            *args, **meta)
        return
    config.check(kernel, path)
    fn = torch.library.wrap_triton(_KERNELS[kernel]) if traced else _KERNELS[kernel]
    fn[_grid(num_tiles(config.block_m, config.block_n), num_bh, config.persistent, q.device)](
        *args, **meta, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        EVEN_M=n_q % config.block_m == 0, EVEN_N=n_k % config.block_n == 0, WARP_SPECIALIZE=config.warp_specialize,
        PERSISTENT=config.persistent, num_warps=config.num_warps, num_stages=config.num_stages)


# ----------------------------------------------------------------------------------------------------------
# Path choice and launchers
# ----------------------------------------------------------------------------------------------------------
PATH_ENV = "RAYSYS_FLASH_PATH"
"""auto (default), portable or tma: the path `flash_attention` and the custom ops take."""
AUTO_TMA = False
"""Whether `auto` takes the tma path where it can (off until measured on the GPU host)."""
BWD_ENV = "RAYSYS_FLASH_BWD"
"""auto (default), two_pass or one_pass: the backward `flash_attention` and the custom ops take."""
BWD_MODES = ("two_pass", "one_pass")
AUTO_BWD = {"portable": "two_pass", "tma": "two_pass"}
"""What `auto` takes per path (two_pass until the one-pass backward is measured on the GPU host)."""


def tma_supported(device: torch.device) -> bool:
    """The `auto` rule: a Hopper GPU (sm_90) and a Triton with device-side tensor descriptors (3.4+, hence
    3.6 on the GPU host). The interpreter emulates descriptors but keeps the portable path unless asked."""
    if INTERPRET or device.type != "cuda" or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """What TMA needs of each (batch[, heads], seq, d) tensor: unit stride along d, and every other stride
    (of a dimension longer than 1, and the sequence dimension's) and the start a multiple of 16 bytes."""
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or (t.storage_offset() * elem) % 16:
            return False
        if any((stride * elem) % 16 for i, (size, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1]))
               if size > 1 or i == t.dim() - 2):
            return False
        if not _traced(t) and t.data_ptr() % 16:
            return False
    return True


def resolve_path(requested: str | None, *tensors: torch.Tensor) -> str:
    """`portable` or `tma` for a call on `tensors`; `requested` None reads RAYSYS_FLASH_PATH (default auto)."""
    requested = _requested_path(requested)
    if requested not in ("auto",) + PATHS:
        raise ValueError(f"flash path {requested!r} must be one of auto, {', '.join(PATHS)}")
    if requested == "portable":
        return "portable"
    device = tensors[0].device
    if requested == "tma":
        if not (INTERPRET or tma_supported(device)):
            raise ValueError(f"the tma path needs an sm_90 GPU and Triton >= 3.4 (or TRITON_INTERPRET=1), not {device}")
        if not tma_layout_ok(*tensors):
            raise ValueError("the tma path needs tensors with unit stride along d and 16-byte aligned strides and "
                             f"offsets, got strides {[tuple(t.stride()) for t in tensors]}")
        return "tma"
    return "tma" if AUTO_TMA and tma_supported(device) and tma_layout_ok(*tensors) else "portable"


@contextlib.contextmanager
def _device_of(t: torch.Tensor):
    if t.device.type == "cuda":
        with torch.cuda.device(t.device):
            yield
    else:
        yield


# Every buffer the kernels write is allocated here, uninitialised; the tests swap in a NaN-filled allocator with
# guard elements to prove each element is written exactly within bounds.
_empty = torch.empty


def _check_device(q: torch.Tensor) -> None:
    if q.device.type == "cuda":
        return
    if not INTERPRET:
        raise ValueError(f"tensors on {q.device} need a CUDA device, or TRITON_INTERPRET=1 set before "
                         "kernels.flash_attention is imported (CPU interpreter)")
    if q.dtype == torch.bfloat16:
        raise ValueError("dtype torch.bfloat16 is not supported by the Triton CPU interpreter (NumPy has no "
                         "bfloat16); use float16 or float32 under TRITON_INTERPRET=1")


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit inputs


def _launch_meta(q: torch.Tensor, is_causal: bool) -> dict:
    """Constexprs shared by the kernels: the head dim padded to a power of two, masks, dot precision."""
    head_dim = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, IS_CAUSAL=is_causal, EVEN_D=head_dim == block_d,
                INPUT_PRECISION=_input_precision(q.dtype))


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        config: FlashConfig | None = None, path: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: (O like q, L fp32 of shape q.shape[:-1]). `config` skips autotuning; `path`
    (auto, portable, tma; None reads RAYSYS_FLASH_PATH) picks the kernel variant."""
    check_attention_inputs(q, k, v, is_causal)
    _check_device(q)
    path = resolve_path(path, q, k, v)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    heads, n_q = q4.shape[1], q4.shape[2]
    n_k = k4.shape[2]
    out = _empty(q.shape, dtype=q.dtype, device=q.device)
    lse = _empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    o4 = _as_4d(out)
    args = (q4, k4, v4, o4, lse, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4), heads,
            q4.shape[0] * heads, n_q, n_k, LOG2E / math.sqrt(q.shape[-1]), triton.next_power_of_2(max(n_q, n_k)))
    with _device_of(q):
        _launch("fwd", lambda bm, bn: triton.cdiv(n_q, bm), args, _launch_meta(q, is_causal), n_q, n_k, config,
                path)
    return out, lse


def flash_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor, is_causal: bool = False, *, dkdv_config: FlashConfig | None = None,
                        dq_config: FlashConfig | None = None, compute_dq: bool = True, compute_dkdv: bool = True,
                        path: str | None = None, bwd: str | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels (D, then dK/dV, then dQ): returns (dQ, dK, dV) in the inputs' dtypes.

    `bwd` (auto, two_pass, one_pass; None reads RAYSYS_FLASH_BWD): one_pass runs the `dkdvq` kernel (with
    `dkdv_config`) when both dQ and dK/dV are wanted, its dQ summed in fp32 by the TMA unit (tma path) or by
    atomics (portable path), so the order of the additions, hence the last bits of dQ, can vary run to run."""
    check_attention_inputs(q, k, v, is_causal)
    if out.shape != q.shape or grad_out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} and grad_out {tuple(grad_out.shape)} must have q's shape "
                         f"{tuple(q.shape)}")
    if lse.shape != q.shape[:-1] or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 of shape {tuple(q.shape[:-1])}, got {lse.dtype} {tuple(lse.shape)}")
    _check_device(q)
    path = resolve_path(path, q, k, v)
    one_pass = compute_dq and compute_dkdv and resolve_bwd(bwd, path) == "one_pass"
    LAST_PATH["bwd"] = "one_pass" if one_pass else "two_pass"
    grad_out = grad_out.to(q.dtype)
    if path == "tma" and not tma_layout_ok(grad_out):  # e.g. the stride-0 dO of `.sum().backward()`
        grad_out = grad_out.contiguous()
    lse = lse.contiguous()
    q4, k4, v4, o4, do4 = (_as_4d(t) for t in (q, k, v, out, grad_out))
    batch, heads, n_q, head_dim = q4.shape
    n_k = k4.shape[2]
    meta = _launch_meta(q, is_causal)
    scale = 1.0 / math.sqrt(head_dim)
    bucket = triton.next_power_of_2(max(n_q, n_k))
    dq = dk = dv = None
    with _device_of(q):
        delta = _empty(lse.shape, dtype=torch.float32, device=lse.device)
        pre_block = 64
        pre = torch.library.wrap_triton(_flash_bwd_preprocess_kernel) if _traced(q) else _flash_bwd_preprocess_kernel
        pre[(triton.cdiv(n_q, pre_block), batch * heads)](
            o4, do4, delta, *_strides(o4), *_strides(do4), heads, n_q,
            HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], BLOCK_M=pre_block, num_warps=4 if not INTERPRET else 1)
        if compute_dkdv:
            dk = _empty(k.shape, dtype=k.dtype, device=k.device)
            dv = _empty(v.shape, dtype=v.dtype, device=v.device)
            dk4, dv4 = _as_4d(dk), _as_4d(dv)
            # one_pass: dQ accumulates in fp32 rows padded to BLOCK_D (16-byte aligned for the TMA unit)
            dq_acc = (torch.zeros((batch * heads, n_q, meta["BLOCK_D"]), dtype=torch.float32, device=q.device)
                      if one_pass else delta)
            args = (q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc, *_strides(q4), *_strides(k4), *_strides(v4),
                    *_strides(do4), *_strides(dk4), *_strides(dv4), heads, batch * heads, n_q, n_k, scale,
                    scale * LOG2E, bucket)
            dq_atomic = (2 if path == "tma" and not INTERPRET else 1) if one_pass else 0
            _launch("dkdvq" if one_pass else "dkdv", lambda bm, bn: triton.cdiv(n_k, bn), args,
                    dict(meta, DQ_ATOMIC=dq_atomic), n_q, n_k, dkdv_config, path)
        if one_pass:
            dq = _empty(q.shape, dtype=q.dtype, device=q.device)
            _as_4d(dq).copy_(dq_acc.view(batch, heads, n_q, -1)[..., :head_dim])
        elif compute_dq:
            dq = _empty(q.shape, dtype=q.dtype, device=q.device)
            dq4 = _as_4d(dq)
            args = (q4, k4, v4, do4, lse, delta, dq4, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4),
                    *_strides(dq4), heads, batch * heads, n_q, n_k, scale, scale * LOG2E, bucket)
            _launch("dq", lambda bm, bn: triton.cdiv(n_q, bm), args, meta, n_q, n_k, dq_config, path)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# Custom ops (what torch.compile sees), autograd, public API
# ----------------------------------------------------------------------------------------------------------
# On a GPU the ops are `triton_op`s: the compiler traces their bodies (fake tensors, `wrap_triton` launches) and
# Inductor calls the Triton kernels itself. The interpreter's kernels cannot be traced, so under
# TRITON_INTERPRET=1 the same functions become opaque `custom_op`s with fake implementations.
def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, path: str, bwd: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_fwd(q, k, v, is_causal, path=path)  # `bwd` is for the backward (setup_context)


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              grad_out: torch.Tensor, is_causal: bool, compute_dq: bool, compute_dkdv: bool, path: str, bwd: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV); a gradient not asked for is an empty tensor (custom ops return no None)."""
    dq, dk, dv = flash_attention_bwd(q, k, v, out, lse, grad_out, is_causal, compute_dq=compute_dq,
                                     compute_dkdv=compute_dkdv, path=path, bwd=bwd)
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            v.new_empty(0) if dv is None else dv)


# The fakes allocate like the launchers: contiguous, whatever the inputs' strides.
def _fwd_fake(q, k, v, is_causal, path, bwd):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _bwd_fake(q, k, v, out, lse, grad_out, is_causal, compute_dq, compute_dkdv, path, bwd):
    return (q.new_empty(q.shape if compute_dq else 0), k.new_empty(k.shape if compute_dkdv else 0),
            v.new_empty(v.shape if compute_dkdv else 0))


def _define_op(name: str, impl, fake):
    if INTERPRET:
        op = torch.library.custom_op(f"raysys::{name}", impl, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(f"raysys::{name}", impl, mutates_args=())


flash_attn_fwd_op = _define_op("flash_attn_fwd", _fwd_impl, _fwd_fake)
flash_attn_bwd_op = _define_op("flash_attn_bwd", _bwd_impl, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, path, bwd = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.path, ctx.bwd = is_causal, path, bwd
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    dq, dk, dv = flash_attn_bwd_op(q, k, v, out, lse, grad_out, ctx.is_causal, need_q, need_k or need_v, ctx.path,
                                   ctx.bwd)
    return dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None, None


flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with Triton forward and backward (the course's interface); saves Q, K, V, O and L only."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        ctx.path, ctx.bwd = _requested_path(None), _requested_bwd(None)
        out, lse = flash_attn_fwd_op(q, k, v, is_causal, ctx.path, ctx.bwd)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = flash_attn_bwd_op(q, k, v, out, lse, grad_out, ctx.is_causal, need_q, need_k or need_v,
                                       ctx.path, ctx.bwd)
        return dq if need_q else None, dk if need_k else None, dv if need_v else None, None


def _requested_path(path: str | None) -> str:
    return path or os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"


def _requested_bwd(bwd: str | None) -> str:
    return bwd or os.environ.get(BWD_ENV, "auto").strip().lower() or "auto"


def resolve_bwd(requested: str | None, path: str) -> str:
    """`two_pass` (dK/dV kernel, then dQ kernel; no atomics) or `one_pass` (dK/dV kernel adds dS K into an fp32
    dQ: 5 matmuls per tile pair instead of 7); `requested` None reads RAYSYS_FLASH_BWD (default auto)."""
    requested = _requested_bwd(requested)
    if requested not in ("auto",) + BWD_MODES:
        raise ValueError(f"flash backward {requested!r} must be one of auto, {', '.join(BWD_MODES)}")
    return AUTO_BWD[path] if requested == "auto" else requested


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    path: str | None = None, bwd: str | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V with the Triton kernels (differentiable, torch.compile-able).
    `path`: auto, portable or tma (None reads RAYSYS_FLASH_PATH); the backward takes the same. `bwd`: auto,
    two_pass or one_pass (None reads RAYSYS_FLASH_BWD)."""
    check_attention_inputs(q, k, v, is_causal)
    return flash_attn_fwd_op(q, k, v, is_causal, _requested_path(path), _requested_bwd(bwd))[0]


def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Model backend `flash_triton`: (batch, heads, seq, d_head) in and out; follows autocast like SDPA."""
    return flash_attention(*autocast_inputs(q, k, v), is_causal)


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                              return_lse: bool = False):
    """Plain-torch attention (eqs. 4-6 and 12) in q's dtype: the test oracle (in fp64) and the naive baseline.

    Masked scores are replaced by -1e6, as in the course's reference, so L matches the kernels' L.
    Returns O, or (O, L) with `return_lse=True`.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, MASK_VALUE)
    out = torch.softmax(scores, dim=-1) @ v
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out


def flash_attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, is_causal: bool,
                          mode: str = "fwd") -> float:
    """Matmul FLOPs of attention: 2 matmuls forward (QK^T, PV) and 5 backward (S recompute, dV, dP, dQ, dK).

    Causal counts only the unmasked (query, key) pairs, n (n + 1) / 2 per head. `mode` is fwd, bwd or fwd_bwd.
    """
    if mode not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"mode {mode!r} must be one of fwd, bwd, fwd_bwd")
    if is_causal:
        pairs = sum(min(i + 1, n_k) for i in range(n_q)) if n_q != n_k else n_q * (n_q + 1) // 2
    else:
        pairs = n_q * n_k
    per_matmul = 2.0 * batch * heads * pairs * d
    return per_matmul * {"fwd": 2, "bwd": 5, "fwd_bwd": 7}[mode]
