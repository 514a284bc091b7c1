"""FlashAttention for the model and the studies: one public entry, the tl (Triton) and Gluon (sm_90) kernels behind it.

    from kernels.attention import flash_attention
    out = flash_attention(q, k, v, is_causal=True)   # (B[, H], N, d) in, O out; differentiable, torch.compile-able

`interface` holds the entry, its autograd Function and custom ops; `dispatch` decides which kernels run with which
config (every threshold and environment variable); `checks` what the kernels accept; `reference` the plain-torch
oracle and the course's PyTorch FlashAttention-2; `flops` the FLOP count; `triton/` the tl kernels, their launchers
and tuning; `gluon/` the Hopper kernels and their runtime. docs/attention.md has the design and the measurements.
"""

# First, before anything imports torch: a RAYSYS_FLASH_TUNED that names no file fails at once.
from kernels.attention import tuned_file  # noqa: F401
from kernels.attention.dispatch import last_paths, planned_paths
from kernels.attention.flops import flash_attention_flops
from kernels.attention.interface import (
    FlashAttentionTriton,
    attention_backend,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
)
from kernels.attention.reference import FlashAttentionPytorch, flash_attention_reference

__all__ = ["FlashAttentionPytorch", "FlashAttentionTriton", "attention_backend", "flash_attention",
           "flash_attention_bwd", "flash_attention_flops", "flash_attention_fwd", "flash_attention_reference",
           "last_paths", "planned_paths"]
