"""The tl (Triton) FlashAttention-2 kernels: `kernels` (the `@triton.jit` kernels), `launch` (their launchers and
autotuners on the portable and tma paths), `tuning` (launch configs, pruning, the tuned file's tl part)."""
