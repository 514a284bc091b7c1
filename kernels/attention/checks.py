"""What the attention kernels accept: input checks (ValueErrors naming the rule broken) and layout rules.

- `check_attention_inputs(q, k, v, is_causal)`: the contract every implementation shares: 3-D (B, N, d) or 4-D
  (B, H, N, d) tensors of one dtype (fp16 / bf16 / fp32) and device, head dim in [16, 128], causal with n_q == n_k;
  `check_backward_inputs(q, out, lse, grad_out)` adds the backward's O, L (fp32, q's shape less d) and dO.
- `tma_layout_ok(*tensors)`: what the tl kernels' tma path needs of each tensor's strides and start.
- `unsupported_reason(q, k, v)`: '' when the Gluon kernels run on these 4-D tensors (sm_90, Gluon's Hopper API,
  bf16 / fp16, head dim 64 or 128, TMA-able strides), else the first rule broken.
`traced(t)`: whether `t` is a tracing stand-in (torch.compile's fake or functional tensor: shapes, no memory).
"""

from __future__ import annotations

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from kernels.device import capability

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
GLUON_HEAD_DIMS = (64, 128)
GLUON_DTYPES = (torch.bfloat16, torch.float16)


def traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracing stand-in (fake or functional tensor inside torch.compile / export)."""
    return is_fake(t) or isinstance(t, FunctionalTensor)


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(B, N, d) as (B, 1, N, d); 4-D tensors as they are."""
    return t if t.dim() == 4 else t.unsqueeze(1)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                           dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """Raise `ValueError` naming the offending value and the rule it breaks; shared by every implementation."""
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
        if not traced(t) and t.data_ptr() % 16:
            return False
    return True


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """'' when the Gluon kernels run on these 4-D (B, H, N, D) tensors, else why not (the first rule broken)."""
    if not HAS_GLUON_HOPPER:
        return f"Triton {triton.__version__} has no Gluon Hopper API"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.device.type != "cuda":
            return f"{name} is on {t.device}, not a CUDA device"
        if t.dtype not in GLUON_DTYPES:
            return f"{name} has dtype {t.dtype}; needs bfloat16 or float16"
        if t.dim() != 4:
            return f"{name} has shape {tuple(t.shape)}; needs 4-D (B, H, N, D)"
        if t.shape[-1] not in GLUON_HEAD_DIMS:
            return f"{name} has head dim {t.shape[-1]}; needs one of {GLUON_HEAD_DIMS}"
        if 0 in t.shape:
            return f"{name} has shape {tuple(t.shape)}; needs at least one row of at least one head"
        # The 4-D descriptors encode every stride (length-1 dimensions' too) and the start; a tracing stand-in
        # (torch.compile's fake tensors) has no pointer, its storage offset stands for it.
        elem = t.element_size()
        start = t.storage_offset() * elem if traced(t) else t.data_ptr()
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
