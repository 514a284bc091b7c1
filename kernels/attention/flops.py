"""FLOPs of attention's matmuls: what every benchmark row's TFLOP/s divides by.

`flash_attention_flops(batch, heads, n_q, n_k, d, is_causal, mode)`: 2 matmuls forward (Q K^T, P V) and 5 backward (S
recomputed, dV, dP, dQ, dK), each 2 * batch * heads * pairs * d. Causal counts the (query, key) pairs the mask
leaves, n (n + 1) / 2 per head for n_q == n_k (not n^2 / 2; a caller reporting that convention takes half of the
unmasked count).
"""

from __future__ import annotations


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
