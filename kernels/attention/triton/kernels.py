"""The Triton (tl) kernels of FlashAttention-2: forward (Algorithm 1) and backward (Algorithm 2).

Shape legend: B batch, H heads, M n_queries, N n_keys, D head dim in [16, 128], BLOCK_D = next power of two >= D.
`_flash_fwd_kernel` (grid (cdiv(M, BLOCK_M), B*H), or one program per SM when PERSISTENT) keeps a query tile on chip
and walks the key tiles once (fp32 running max, denominator and output; scores in base-2 units), writing O and the
natural-log L. The backward: `_flash_bwd_preprocess_kernel` (D = rowsum(O * dO)), `_flash_bwd_dkdv_kernel` (one key
tile per program; with DQ_ATOMIC it also adds dS K into an fp32 dQ), `_flash_bwd_dq_kernel` (one query tile per
program), and `_onepass_bwd_preprocess_kernel` (D and L padded, dQ zeroed, for the Gluon one-pass backward). Each
main kernel walks its work items through `_tile_ids` (heaviest causal tiles first); causal key tiles above the
diagonal are skipped and only the diagonal ones build a mask (-1e6, as the course's reference). USE_TMA switches every
tile access from masked pointer loads to tensor descriptors. `triton/launch.py` launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""log2(e): the launchers scale scores by it so that the kernels work in base-2 units (one FMA + exp2 a score)."""


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
                     USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                     UNROLL: tl.constexpr):
    """Algorithm 1, lines 7-14, over key tiles [lo, hi) (lo a multiple of BLOCK_N). `k_src`, `v_src` are
    tensor descriptors (USE_TMA) or the (batch, head) base pointers."""
    offs_n = tl.arange(0, BLOCK_N)
    if not USE_TMA:
        k_ptrs = k_src + (lo + offs_n)[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_src + (lo + offs_n)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in tl.range(lo, hi, BLOCK_N, loop_unroll_factor=UNROLL if UNROLL > 1 else None,
                            warp_specialize=WARP_SPECIALIZE):
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
        #    LAZY_RESCALE: alpha is 1 in every row whose max did not grow; skip the multiply when no row's did.
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_ij = tl.sum(p, 1)
        if LAZY_RESCALE:
            if tl.max(m_new - m_i, 0) > 0.0:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        if USE_TMA:
            v = v_src.load([start_n, 0])
        else:
            v = _load_tile(v_ptrs, cols, offs_d, N_K, HEAD_DIM, MASK_N, not EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=INPUT_PRECISION)
        l_i = l_i * alpha + l_ij  # after the dot, as Triton's tutorial 06: fewer live registers across it
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
                    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                    UNROLL: tl.constexpr):
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
        acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                                         offs_m, offs_d, 0, tl.minimum(start_m + BLOCK_M, N_K) if IS_CAUSAL else N_K,
                                         N_K, qk_scale, HEAD_DIM, BLOCK_N, IS_CAUSAL, not EVEN_N, EVEN_D,
                                         INPUT_PRECISION, USE_TMA, True, LAZY_RESCALE, UNROLL)
    else:
        # Unmasked: causal, the keys < start_m (BLOCK_M % BLOCK_N == 0 aligns them), else the full key tiles. Then
        # masked: the diagonal tiles (keys [start_m, start_m + BLOCK_M)), else the one partial key tile.
        mid = start_m if IS_CAUSAL else (N_K // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                                         offs_m, offs_d, 0, mid, N_K, qk_scale, HEAD_DIM, BLOCK_N, False, False,
                                         EVEN_D, INPUT_PRECISION, USE_TMA, False, LAZY_RESCALE, UNROLL)
        if IS_CAUSAL or not EVEN_N:
            acc, l_i, m_i = _flash_fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                             stride_vd, offs_m, offs_d, mid,
                                             tl.minimum(start_m + BLOCK_M, N_K) if IS_CAUSAL else N_K, N_K, qk_scale,
                                             HEAD_DIM, BLOCK_N, IS_CAUSAL, not EVEN_N, EVEN_D, INPUT_PRECISION,
                                             USE_TMA, False, LAZY_RESCALE, UNROLL)

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
                      USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr,
                      LAZY_RESCALE: tl.constexpr, UNROLL: tl.constexpr):
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
                            BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE,
                            LAZY_RESCALE, UNROLL)
    else:
        pid_m, pid_bh = _tile_ids(tl.program_id(1) * num_m + tl.program_id(0), num_m, NUM_BH, IS_CAUSAL, True)
        _flash_fwd_tile(pid_m, pid_bh, Q, K, V, O, L, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb,
                        stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob,
                        stride_oh, stride_om, stride_od, H, N_Q, N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                        BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE,
                        LAZY_RESCALE, UNROLL)


@triton.jit
def _row_tile(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(pid_bh, rows, cols) of this program's BLOCK_M query rows (grid (row tiles, B * H))."""
    pid_bh = tl.program_id(1)
    return pid_bh, tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)


@triton.jit
def _rowsum_o_do(O, DO, stride_ob, stride_oh, stride_om, stride_od, stride_dob, stride_doh, stride_dom, stride_dod,
                 pid_bh, rows, cols, H, N_Q, HEAD_DIM: tl.constexpr):
    """D = rowsum(O * dO) in fp32 of `rows` of head `pid_bh`; rows past N_Q read O and dO as 0, so their D is 0.
    It returns D only: the callers' store addresses must not derive from a call that takes O and dO, or torch's
    mutation analysis of a `wrap_triton` launch (which follows addresses back through calls) takes O and dO for
    written tensors."""
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    o = _load_tile(O + off_b * stride_ob + off_h * stride_oh + rows[:, None] * stride_om + cols[None, :] * stride_od,
                   rows, cols, N_Q, HEAD_DIM, True, True)
    do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None] * stride_dom
                    + cols[None, :] * stride_dod, rows, cols, N_Q, HEAD_DIM, True, True)
    return tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)


@triton.jit
def _flash_bwd_preprocess_kernel(O, DO, Delta,
                                 stride_ob, stride_oh, stride_om, stride_od,
                                 stride_dob, stride_doh, stride_dom, stride_dod,
                                 H, N_Q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Algorithm 2, line 2: D = rowsum(O * dO) in fp32."""
    pid_bh, rows, cols = _row_tile(BLOCK_M, BLOCK_D)
    delta = _rowsum_o_do(O, DO, stride_ob, stride_oh, stride_om, stride_od, stride_dob, stride_doh, stride_dom,
                         stride_dod, pid_bh, rows, cols, H, N_Q, HEAD_DIM)
    tl.store(Delta + pid_bh.to(tl.int64) * N_Q + rows, delta, mask=rows < N_Q)


@triton.jit
def _onepass_bwd_preprocess_kernel(O, DO, L, DQ, Delta_pad, L_pad,
                                   stride_ob, stride_oh, stride_om, stride_od,
                                   stride_dob, stride_doh, stride_dom, stride_dod,
                                   H, N_Q, N_PAD, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                   BLOCK_M: tl.constexpr):
    """The Gluon one-pass backward's inputs in one launch (grid (N_PAD / BLOCK_M, B * H)): D = rowsum(O * dO) and
    the natural-log L, both zero-padded to N_PAD rows (whole query tiles; (B * H, N_PAD) fp32), and the fp32 dQ
    accumulator (contiguous, q's shape) zeroed: one launch for what took six (D, two zero-filled copies, a
    memset)."""
    pid_bh, rows, cols = _row_tile(BLOCK_M, BLOCK_D)
    delta = _rowsum_o_do(O, DO, stride_ob, stride_oh, stride_om, stride_od, stride_dob, stride_doh, stride_dom,
                         stride_dod, pid_bh, rows, cols, H, N_Q, HEAD_DIM)
    lse = tl.load(L + pid_bh.to(tl.int64) * N_Q + rows, mask=rows < N_Q, other=0.0)
    tl.store(Delta_pad + pid_bh.to(tl.int64) * N_PAD + rows, delta)
    tl.store(L_pad + pid_bh.to(tl.int64) * N_PAD + rows, lse)
    dq = DQ + pid_bh.to(tl.int64) * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    tl.store(dq, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
             mask=(rows[:, None] < N_Q) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                          stride_qm, stride_qd, stride_dom, stride_dod,
                          offs_n, offs_d, lo, hi, N_Q, qk_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                          MASK_M: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                          USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                          UNROLL: tl.constexpr):
    """Algorithm 2, lines 9-17, over query tiles [lo, hi), in the transposed (keys x queries) orientation;
    with DQ_ATOMIC also lines 20-21 (dQ += dS K) into an fp32 accumulator shared by all key tiles."""
    offs_mb = tl.arange(0, BLOCK_M)
    if not USE_TMA:
        q_ptrs = q_src + (lo + offs_mb)[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_src + (lo + offs_mb)[:, None] * stride_dom + offs_d[None, :] * stride_dod
    for start_m in tl.range(lo, hi, BLOCK_M, loop_unroll_factor=UNROLL if UNROLL > 1 else None,
                            warp_specialize=WARP_SPECIALIZE):
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
        #    Computed as dQ^T = K^T dS^T: its rows are the head dim, so a short query tile (BLOCK_M < 64) still
        #    makes a wgmma on sm_90 (dS K with 32 rows compiled to mma.sync).
        if DQ_ATOMIC > 0:
            dq_t = tl.dot(tl.trans(k), ds_t.to(k.dtype), input_precision=INPUT_PRECISION) * scale
            if DQ_ATOMIC == 2:
                dq_src.atomic_add([start_m, 0], tl.trans(dq_t))
            else:
                tl.atomic_add(dq_src + rows[None, :] * stride_dqm + offs_d[:, None], dq_t, mask=rows[None, :] < N_Q,
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
                         USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                         UNROLL: tl.constexpr):
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
    #    diagonal query tiles compare indices; every later query sees all of them. Then the full query tiles
    #    unmasked, then the partial one.
    m_full = (N_Q // BLOCK_M) * BLOCK_M
    if WARP_SPECIALIZE:  # one loop (see the forward)
        dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                                       stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d,
                                       start_n if IS_CAUSAL else 0, N_Q, N_Q, qk_scale, HEAD_DIM, BLOCK_M, IS_CAUSAL,
                                       not EVEN_M, EVEN_D, INPUT_PRECISION, USE_TMA, True, DQ_ATOMIC, UNROLL)
    else:
        lo = 0
        if IS_CAUSAL:
            dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale,
                                           stride_dqm, stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d,
                                           start_n, tl.minimum(start_n + BLOCK_N, N_Q), N_Q, qk_scale, HEAD_DIM,
                                           BLOCK_M, True, not EVEN_M, EVEN_D, INPUT_PRECISION, USE_TMA, False,
                                           DQ_ATOMIC, UNROLL)
            lo = start_n + BLOCK_N
        dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale, stride_dqm,
                                       stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, lo, m_full,
                                       N_Q, qk_scale, HEAD_DIM, BLOCK_M, False, False, EVEN_D, INPUT_PRECISION,
                                       USE_TMA, False, DQ_ATOMIC, UNROLL)
        if not EVEN_M:
            dk, dv = _flash_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, l_base, delta_base, dq_src, scale,
                                           stride_dqm, stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d,
                                           tl.maximum(lo, m_full) if IS_CAUSAL else m_full, N_Q, N_Q, qk_scale,
                                           HEAD_DIM, BLOCK_M, False, True, EVEN_D, INPUT_PRECISION, USE_TMA, False,
                                           DQ_ATOMIC, UNROLL)

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
                           DQ_ATOMIC: tl.constexpr, UNROLL: tl.constexpr):
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
                                 EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE, DQ_ATOMIC, UNROLL)
    else:
        pid_n, pid_bh = _tile_ids(tl.program_id(1) * num_n + tl.program_id(0), num_n, NUM_BH, IS_CAUSAL, False)
        _flash_bwd_dkdv_tile(pid_n, pid_bh, Q, K, V, DO, L, Delta, DK, DV, DQ, stride_qb, stride_qh, stride_qm,
                             stride_qd, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
                             stride_vd, stride_dob, stride_doh, stride_dom, stride_dod, stride_dkb, stride_dkh,
                             stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, H, N_Q, N_K,
                             scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, EVEN_M, EVEN_N,
                             EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE, DQ_ATOMIC, UNROLL)


@triton.jit
def _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_m, offs_d, lo, hi, N_K, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                        MASK_N: tl.constexpr, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UNROLL: tl.constexpr):
    """Algorithm 2, lines 23-30, over key tiles [lo, hi)."""
    offs_nb = tl.arange(0, BLOCK_N)
    if not USE_TMA:
        k_ptrs = k_src + (lo + offs_nb)[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_src + (lo + offs_nb)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in tl.range(lo, hi, BLOCK_N, loop_unroll_factor=UNROLL if UNROLL > 1 else None,
                            warp_specialize=WARP_SPECIALIZE):
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
                       USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UNROLL: tl.constexpr):
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

    # 2. Key loop (as the forward's): unmasked tiles below the diagonal (or the full ones), then the masked diagonal
    #    tiles (or the partial one).
    if WARP_SPECIALIZE:  # one loop (see the forward)
        dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                                 offs_m, offs_d, 0, tl.minimum(start_m + BLOCK_M, N_K) if IS_CAUSAL else N_K, N_K,
                                 qk_scale, HEAD_DIM, BLOCK_N, IS_CAUSAL, not EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA,
                                 True, UNROLL)
    else:
        mid = start_m if IS_CAUSAL else (N_K // BLOCK_N) * BLOCK_N
        dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
                                 offs_m, offs_d, 0, mid, N_K, qk_scale, HEAD_DIM, BLOCK_N, False, False, EVEN_D,
                                 INPUT_PRECISION, USE_TMA, False, UNROLL)
        if IS_CAUSAL or not EVEN_N:
            dq = _flash_bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_kd, stride_vn,
                                     stride_vd, offs_m, offs_d, mid,
                                     tl.minimum(start_m + BLOCK_M, N_K) if IS_CAUSAL else N_K, N_K, qk_scale,
                                     HEAD_DIM, BLOCK_N, IS_CAUSAL, not EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA,
                                     False, UNROLL)

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
                         USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr,
                         UNROLL: tl.constexpr):
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)  # see _flash_fwd_kernel
    num_m = tl.cdiv(N_Q, BLOCK_M)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_m * NUM_BH, tl.num_programs(0)):
            pid_m, pid_bh = _tile_ids(tile, num_m, NUM_BH, IS_CAUSAL, True)
            _flash_bwd_dq_tile(pid_m, pid_bh, Q, K, V, DO, L, Delta, DQ, stride_qb, stride_qh, stride_qm, stride_qd,
                               stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                               stride_dob, stride_doh, stride_dom, stride_dod, stride_dqb, stride_dqh, stride_dqm,
                               stride_dqd, H, N_Q, N_K, scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                               IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE, UNROLL)
    else:
        pid_m, pid_bh = _tile_ids(tl.program_id(1) * num_m + tl.program_id(0), num_m, NUM_BH, IS_CAUSAL, True)
        _flash_bwd_dq_tile(pid_m, pid_bh, Q, K, V, DO, L, Delta, DQ, stride_qb, stride_qh, stride_qm, stride_qd,
                           stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                           stride_dob, stride_doh, stride_dom, stride_dod, stride_dqb, stride_dqh, stride_dqm,
                           stride_dqd, H, N_Q, N_K, scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                           IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, INPUT_PRECISION, USE_TMA, WARP_SPECIALIZE, UNROLL)
