"""FlashAttention-2 in plain PyTorch: the tiled forward of Algorithm 1 and the backward of eqs. 13-19.

This is the debugging twin of the Triton kernel in `kernels/flash_attention.py` (handout 4.2.2 (a) and
`flash_backward`): same online softmax, same log-sum-exp, same masking rule, no Triton.

Computed: O = softmax(Q K^T / sqrt(d) + mask) V and L = logsumexp(Q K^T / sqrt(d) + mask) row by row, where
the causal mask adds -1e6 to the score of key j for query i when j > i.

Shapes: (batch, seq, d) or (batch, heads, seq, d); M = n_queries, N = n_keys, d = head dim (16..128).

Forward (Algorithm 1): for each query tile of `q_tile` rows, walk the key tiles of `k_tile` rows keeping the
running row max m, the running denominator l and the unnormalised output in float32 (float64 for float64
input), then O = O~ / l and L = m + log(l). Causal: key tiles that lie entirely above the diagonal are skipped,
and only the tiles that cross the diagonal compare indices. The autograd context keeps Q, K, V, O and L
(exactly one extra tensor, of shape (batch, M) or (batch, heads, M)); never P.

Backward (eqs. 13-19): D = rowsum(O * dO); S = Q K^T / sqrt(d); P = exp(S - L); dV = P^T dO;
dP = dO V^T; dS = P * (dP - D); dQ = dS K / sqrt(d); dK = dS^T Q / sqrt(d). This recomputation materialises
one (M, N) score matrix per (batch, head), like the handout asks; it runs through `torch.compile`, which
fuses the element-wise work between the matmuls. `RAYSYS_FLASH_COMPILE` picks the policy: `auto` (default)
compiles on CUDA and runs eagerly on CPU, where Inductor needs a C++ compiler and a cold compile costs ~40 s on
a 2-core machine, far more than the backward it speeds up; `1` compiles on every device; `0` never compiles.
When compilation fails the same function runs eagerly from then on and a `RuntimeWarning` says why; the
numbers do not change.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
MASK_VALUE = -1.0e6  # added to masked scores (handout 4.2.2 (c)); exp(-1e6 - m) is exactly 0 in fp32
DEFAULT_TILE = 64
MIN_TILE = 16


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                           dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """Raise `ValueError` naming the offending value and the rule it breaks; shared by both implementations."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be 3-D (batch, seq, d) or 4-D (batch, heads, seq, d), got shape {tuple(q.shape)}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must have the same rank, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must agree on the leading (batch[, heads]) dims, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} must lie in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if q.shape[-2] < 1 or k.shape[-2] < 1 or q.numel() == 0:
        raise ValueError(f"q and k need at least one row each and non-empty batch dims, got shapes "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in dtypes:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {[str(t) for t in dtypes]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs n_queries == n_keys, got {q.shape[-2]} and {k.shape[-2]}")


def check_backward_inputs(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                          where: str = "") -> None:
    """Raise `ValueError` unless O and dO have q's shape and L is fp32 of q's shape less d (a backward's inputs beside
    q, k, v); `where` prefixes the message (the caller's name)."""
    if out.shape != q.shape or grad_out.shape != q.shape:
        raise ValueError(f"{where}out {tuple(out.shape)} and grad_out {tuple(grad_out.shape)} must have q's shape "
                         f"{tuple(q.shape)}")
    if lse.shape != q.shape[:-1] or lse.dtype != torch.float32:
        raise ValueError(f"{where}lse must be float32 of shape {tuple(q.shape[:-1])}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")


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


def _compile_enabled(device: torch.device) -> bool:
    policy = os.environ.get("RAYSYS_FLASH_COMPILE", "auto").strip().lower()
    if policy == "auto":
        return device.type == "cuda"
    if policy in ("1", "0"):
        return policy == "1"
    raise ValueError(f"RAYSYS_FLASH_COMPILE={policy!r} must be one of auto, 1, 0")


def flash_backward_pytorch(q, k, v, o, do, lse, is_causal: bool):
    """`flash_backward_reference` through `torch.compile` (see the module docstring for the policy)."""
    global _compiled_backward, _compile_disabled_reason
    if _compile_enabled(q.device) and _compile_disabled_reason is None:
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
