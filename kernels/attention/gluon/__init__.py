"""The Gluon FlashAttention kernels for Hopper (sm_90), FlashAttention-3 style: `forward`, `backward` (one pass, what
the gluon path runs), on `runtime` (build probe, direct launch, TMA
descriptors), `schedule` (work-item order) and `fast_math` (exp2); `compat` binds Gluon's API across Triton 3.6-3.9."""
