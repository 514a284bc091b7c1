"""Model configurations: the named sizes of the handout's Table 1 plus the leaderboard model.

`ModelConfig.from_name("xl", context_length=2048)` is the one way to build a config; every field is validated
in `__post_init__` so an impossible model fails with a `ValueError` before any tensor is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# name -> (d_model, d_ff, num_layers, num_heads); vocab 10,000 and context 512 unless the row overrides them.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=256, context_length=64),
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
    "leaderboard": dict(d_model=4096, d_ff=11008, num_layers=34, num_heads=32, vocab_size=151_936, context_length=32_768),
}
# The sizes the handout's Table 1 lists (benchmarks iterate over these).
TABLE1_SIZES = ("small", "medium", "large", "xl", "10B")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of the basics Transformer LM (the course's `cs336_basics` model)."""

    vocab_size: int = 10_000
    """Number of token ids; the embedding and LM-head rows."""
    context_length: int = 512
    """Longest sequence the model accepts (RoPE cache length)."""
    d_model: int = 768
    """Residual-stream width."""
    num_layers: int = 12
    """Number of Transformer blocks."""
    num_heads: int = 12
    """Attention heads; must divide d_model."""
    d_ff: int = 3072
    """Hidden width of the SwiGLU feed-forward."""
    rope_theta: float = 10_000.0
    """RoPE base frequency."""
    attention: str = "naive"
    """Attention backend name registered in `raysys.model.transformer` (naive, sdpa, annotated, flash_triton,
    flash_pytorch)."""
    name: str = "custom"
    """Size name this config came from (informational)."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} ({value!r}) must be a positive integer")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide d_model ({self.d_model})")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"d_head = d_model / num_heads ({self.d_model // self.num_heads}) must be even for RoPE")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta ({self.rope_theta}) must be positive")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        """The named size with any field overridden (`context_length=`, `vocab_size=`, `attention=`, ...)."""
        if name not in SIZES:
            raise ValueError(f"model size {name!r} is not one of {sorted(SIZES)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**{"name": name, **SIZES[name], **overrides})

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count of `TransformerLM(self)` without instantiating it."""
        d, f = self.d_model, self.d_ff
        per_block = 4 * d * d + 3 * d * f + 2 * d
        emb = 2 * self.vocab_size * d if include_embeddings else 0
        return self.num_layers * per_block + d + emb

    def forward_flops(self, batch_size: int, seq_len: int | None = None) -> int:
        """Matmul FLOPs of one forward pass (2 per multiply-add), attention scores and P@V included, causal not discounted."""
        s = seq_len or self.context_length
        d, f, tokens = self.d_model, self.d_ff, batch_size * s
        per_block = 2 * tokens * (4 * d * d + 3 * d * f) + 2 * 2 * batch_size * s * s * d
        return self.num_layers * per_block + 2 * tokens * d * self.vocab_size
