"""Attention in plain PyTorch: the test oracle, and the course's tiled FlashAttention-2 (`FlashAttentionPytorch`).

`flash_attention_reference(q, k, v, is_causal, return_lse)`: O = softmax(Q K^T / sqrt(d) + mask) V (and L =
logsumexp, natural log) in q's dtype, masked scores replaced by MASK_VALUE (-1e6) as in the course's reference;
the tests run it in fp64. `FlashAttentionPytorch` (handout 4.2.2 (a)) is the same algorithm as the Triton kernels in
Python tiles: Algorithm 1 forward (running max, denominator and output in fp32, fp64 for fp64 input; causal key tiles
above the diagonal skipped), saving Q, K, V, O and L, never P; backward by recomputation (eqs. 13-19), compiled
where `dispatch.reference_compiles` says. Shapes (B, N, d) or (B, H, N, d), head dim 16..128.
"""

from __future__ import annotations

import math
import warnings

import torch

from kernels.attention.checks import SUPPORTED_DTYPES, check_attention_inputs
from kernels.attention.dispatch import reference_compiles

MASK_VALUE = -1.0e6  # added to masked scores (handout 4.2.2 (c)); exp(-1e6 - m) is exactly 0 in fp32
DEFAULT_TILE = 64
MIN_TILE = 16


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def flash_forward_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                          q_tile: int = DEFAULT_TILE, k_tile: int = DEFAULT_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 over tiles of `q_tile` queries and `k_tile` keys; returns (O in q's dtype, L in fp32/fp64)."""
    acc_dtype = _accumulator_dtype(q.dtype)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for i0 in range(0, n_q, q_tile):
        i1 = min(i0 + q_tile, n_q)
        q_i = q[..., i0:i1, :].to(acc_dtype)
        m_i = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        l_i = torch.zeros(q_i.shape[:-1], dtype=acc_dtype, device=q.device)
        o_i = torch.zeros(q_i.shape, dtype=acc_dtype, device=q.device)
        # Causal: keys past the last query of this tile are masked for every row, so their tiles are skipped.
        k_end = min(n_k, i1) if is_causal else n_k
        for j0 in range(0, k_end, k_tile):
            j1 = min(j0 + k_tile, n_k)
            k_j = k[..., j0:j1, :].to(acc_dtype)
            v_j = v[..., j0:j1, :].to(acc_dtype)
            s_ij = q_i @ k_j.transpose(-2, -1) * scale                                 # (.., Bq, Bk)
            if is_causal and j1 - 1 > i0:  # the tile crosses the diagonal: compare indices
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s_ij = s_ij + torch.where(cols > rows, MASK_VALUE, 0.0).to(acc_dtype)
            m_new = torch.maximum(m_i, s_ij.amax(dim=-1))
            p_ij = torch.exp(s_ij - m_new[..., None])                                  # P~ (line 11)
            alpha = torch.exp(m_i - m_new)
            l_i = alpha * l_i + p_ij.sum(dim=-1)                                       # line 12
            o_i = alpha[..., None] * o_i + p_ij @ v_j                                  # line 13
            m_i = m_new
        out[..., i0:i1, :] = (o_i / l_i[..., None]).to(q.dtype)                        # line 15
        lse[..., i0:i1] = m_i + torch.log(l_i)                                         # line 16
    return out, lse


def flash_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             do: torch.Tensor, lse: torch.Tensor, is_causal: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations 13-19 with D = rowsum(O * dO), in fp32 (fp64 for fp64 input); grads in the inputs' dtypes."""
    acc_dtype = _accumulator_dtype(q.dtype)
    qf, kf, vf, of, dof = (t.to(acc_dtype) for t in (q, k, v, o, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = qf @ kf.transpose(-2, -1) * scale                                              # eq. 13
    if is_causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q.device)[None, :]
        s = s + torch.where(cols > rows, MASK_VALUE, 0.0).to(acc_dtype)
    p = torch.exp(s - lse.to(acc_dtype)[..., None])                                    # eq. 14
    dv = p.transpose(-2, -1) @ dof                                                     # eq. 15
    dp = dof @ vf.transpose(-2, -1)                                                    # eq. 16
    delta = (of * dof).sum(dim=-1, keepdim=True)                                       # D
    ds = p * (dp - delta)                                                              # eq. 17
    dq = ds @ kf * scale                                                               # eq. 18
    dk = ds.transpose(-2, -1) @ qf * scale                                             # eq. 19
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_compiled_backward = None
_compile_disabled_reason: str | None = None


def flash_backward_pytorch(q, k, v, o, do, lse, is_causal: bool):
    """`flash_backward_reference` through `torch.compile` where `dispatch.reference_compiles` says so (on CUDA by
    default); if compiling fails, eagerly from then on, with one RuntimeWarning saying why (the values are the same)."""
    global _compiled_backward, _compile_disabled_reason
    if reference_compiles(q.device) and _compile_disabled_reason is None:
        if _compiled_backward is None:
            _compiled_backward = torch.compile(flash_backward_reference, dynamic=True)
        try:
            return _compiled_backward(q, k, v, o, do, lse, is_causal)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # missing C++ compiler, Inductor/Triton codegen failure, unsupported device
            _compile_disabled_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn("torch.compile of the FlashAttention backward failed "
                          f"({_compile_disabled_reason}); running it eagerly from now on", RuntimeWarning,
                          stacklevel=2)
    return flash_backward_reference(q, k, v, o, do, lse, is_causal)


class FlashAttentionPytorch(torch.autograd.Function):
    """Tiled FlashAttention-2 forward in PyTorch; backward by recomputation (eqs. 13-19), compiled."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, q_tile: int = DEFAULT_TILE, k_tile: int = DEFAULT_TILE):
        check_attention_inputs(q, k, v, is_causal, dtypes=SUPPORTED_DTYPES + (torch.float64,))
        for name, tile in (("q_tile", q_tile), ("k_tile", k_tile)):
            if not isinstance(tile, int) or tile < MIN_TILE:
                raise ValueError(f"{name} ({tile!r}) must be an int >= {MIN_TILE}")
        with torch.autocast(q.device.type, enabled=False):  # tiles are upcast on purpose; keep them fp32
            out, lse = flash_forward_pytorch(q, k, v, is_causal, q_tile, k_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = flash_backward_pytorch(q, k, v, out, grad_out, lse, ctx.is_causal)
        return dq, dk, dv, None, None, None


def flash_attention_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                            q_tile: int = DEFAULT_TILE, k_tile: int = DEFAULT_TILE) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V by the tiled PyTorch FlashAttention-2 (differentiable)."""
    return FlashAttentionPytorch.apply(q, k, v, is_causal, q_tile, k_tile)


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Under autocast, cast q, k, v to the autocast dtype, as autocast does for SDPA (RoPE leaves q, k fp32)."""
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Model backend `flash_pytorch`: (batch, heads, seq, d_head) in and out; follows autocast like SDPA."""
    return FlashAttentionPytorch.apply(*autocast_inputs(q, k, v), is_causal)


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
