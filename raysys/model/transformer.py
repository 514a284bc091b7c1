"""The model under test: the basics pre-norm decoder-only Transformer LM (CS336 assignment 1).

Behaviour, parameter names and initialisation follow the course's reference model (`cs336_basics`), so state dicts
move both ways. Attention is pluggable per instance: `CausalMultiHeadSelfAttention` calls the backend named by
`attention` from a registry of `fn(q_BHSD, k_BHSD, v_BHSD, is_causal) -> out_BHSD` (`naive`, `sdpa`, `cudnn`,
`annotated`, and from `kernels/` `flash_triton`, `flash_pytorch`; `attention_backends()` lists them). Shape legend:
B batch, H heads, S sequence, D head dim, M d_model. `model(x)` returns logits; `model.loss(x, y)` is
`cross_entropy(model(x), y)` through the fused LM head + loss (`fused=False`: the reference path). `AdamW` is the
reference optimizer; `TransformerBlock.ffn_branch` is what `FfnCheckpoint` reruns.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from raysys.model.config import ModelConfig

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
_ATTENTION: dict[str, AttentionFn] = {}


def register_attention(name: str, fn: AttentionFn) -> None:
    """Make `fn(q, k, v, is_causal)` available as `ModelConfig(attention=name)`."""
    _ATTENTION[name] = fn


def attention_backends() -> list[str]:
    _load_kernel_backends()
    return sorted(_ATTENTION)


def get_attention(name: str) -> AttentionFn:
    if name not in _ATTENTION:
        _load_kernel_backends()
    if name not in _ATTENTION:
        raise ValueError(f"attention backend {name!r} is not one of {sorted(_ATTENTION)}")
    return _ATTENTION[name]


def _load_kernel_backends() -> None:
    """Register the flash kernels lazily: importing Triton is slow and optional for the model itself."""
    try:
        from kernels.attention import attention_backend, reference
    except ImportError:
        return
    _ATTENTION.setdefault("flash_triton", attention_backend)
    _ATTENTION.setdefault("flash_pytorch", reference.attention_backend)


@contextlib.contextmanager
def nvtx_range(name: str):
    """A range visible both to torch.profiler (record_function) and to nsys (NVTX, when CUDA is present)."""
    use_nvtx = torch.cuda.is_available()
    if use_nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if use_nvtx:
            torch.cuda.nvtx.range_pop()


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """True where query i may attend to key j (i >= j)."""
    q = torch.arange(n_queries, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return q >= k


def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Q K^T / sqrt(d), -inf where a query may not see a key (`is_causal`)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return scores


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + mask) V with the softmax written out (max subtraction), as in the reference."""
    return softmax(_scores(q, k, is_causal), dim=-1) @ v


def annotated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    """`naive_attention` with its three stages in named NVTX / profiler ranges."""
    with nvtx_range("attention scores"):
        scores = _scores(q, k, is_causal)
    with nvtx_range("attention softmax"):
        probs = softmax(scores, dim=-1)
    with nvtx_range("attention final matmul"):
        return probs @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    """`scaled_dot_product_attention` pinned to cuDNN's fused kernel (it keeps O and the log-sum-exp, as flash
    does). `sdpa_kernel` is a context manager Dynamo traces, so a compiled model keeps the pin. ValueError where
    cuDNN attention cannot run these inputs (no CUDA tensors, no cuDNN, an unsupported shape or dtype)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.compiler.is_compiling():
        _check_cudnn_attention(q, k, v, is_causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _check_cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    if q.device.type != "cuda":
        raise ValueError(f"attention 'cudnn' needs CUDA tensors (cuDNN's fused attention), got {q.device}; use "
                         f"'sdpa' or 'flash_triton' elsewhere")
    if not torch.backends.cudnn.is_available() or not torch.backends.cuda.cudnn_sdp_enabled():
        raise ValueError("attention 'cudnn': cuDNN is not available or its SDPA backend is disabled in this torch")
    can_use = getattr(torch.backends.cuda, "can_use_cudnn_attention", None)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, is_causal, False)
    if can_use is not None and not can_use(params, True):
        raise ValueError(f"attention 'cudnn' cannot run q {tuple(q.shape)} {q.dtype} on "
                         f"{torch.cuda.get_device_name(q.device)} (cuDNN's constraints; see the warning above)")


register_attention("naive", naive_attention)
register_attention("annotated", annotated_attention)
register_attention("sdpa", sdpa_attention)
register_attention("cudnn", cudnn_attention)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x - x.amax(dim=dim, keepdim=True)
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class Linear(nn.Module):
    """y = x W^T, no bias; W ~ truncated normal with std sqrt(2 / (d_in + d_out)), cut at +-3 std."""

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in, device=device, dtype=dtype),
                                                         std=std, a=-3 * std, b=3 * std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """W[token_ids]; W ~ truncated normal with std 1, cut at +-3."""

    def __init__(self, vocab_size: int, d_model: int, device=None, dtype=None):
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab_size, d_model, device=device, dtype=dtype),
                                                         std=1.0, a=-3.0, b=3.0))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, d_model={self.d_model}"


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back to the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on adjacent pairs (x[0::2], x[1::2]); the output puts the rotated evens first, then the odds."""

    def __init__(self, context_length: int, d_head: int, theta: float = 10_000.0, device=None):
        super().__init__()
        if d_head % 2:
            raise ValueError(f"d_head ({d_head}) must be even for RoPE")
        freqs = theta ** -(torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
        angles = torch.arange(context_length, device=device, dtype=torch.float32)[:, None] * freqs[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (..., S, D); positions: (S,) or broadcastable (..., S)
        cos, sin = self.cos[positions], self.sin[positions]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1).to(x.dtype)


class CausalMultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, positional_encoder: RotaryEmbedding | None = None,
                 attention: str = "naive", device=None, dtype=None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
        self.d_model, self.num_heads, self.d_head = d_model, num_heads, d_model // num_heads
        self.q_proj = Linear(d_model, d_model, device, dtype)
        self.k_proj = Linear(d_model, d_model, device, dtype)
        self.v_proj = Linear(d_model, d_model, device, dtype)
        self.output_proj = Linear(d_model, d_model, device, dtype)
        self.positional_encoder = positional_encoder
        self.attention = attention
        get_attention(attention)  # validate the name now, not at the first forward

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H*D) -> (B, H, S, D)
        return x.unflatten(-1, (self.num_heads, self.d_head)).transpose(-3, -2)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.positional_encoder is not None:
            if token_positions is None:
                token_positions = torch.arange(x.shape[-2], device=x.device)
            q = self.positional_encoder(q, token_positions)
            k = self.positional_encoder(k, token_positions)
        out = get_attention(self.attention)(q, k, v, True)
        return self.output_proj(out.transpose(-3, -2).flatten(-2))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device, dtype)
        self.w2 = Linear(d_ff, d_model, device, dtype)
        self.w3 = Linear(d_model, d_ff, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(ln1(x)); out = h + ffn(ln2(h))."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, positional_encoder: RotaryEmbedding | None,
                 attention: str = "naive", device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder, attention, device, dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device, dtype)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attn(self.ln1(x), token_positions)
        return h + self.ffn_branch(h)

    def ffn_branch(self, h: torch.Tensor) -> torch.Tensor:
        """ffn(ln2(h)): the feed-forward branch, one method so `parallel.checkpointing.FfnCheckpoint` can rerun it."""
        return self.ffn(self.ln2(h))


class TransformerLM(nn.Module):
    """token_embeddings -> blocks -> ln_final -> lm_head; returns logits (B, S, vocab).

    Build from a `ModelConfig` (`TransformerLM(ModelConfig.from_name("xl"))`) or from the reference
    keyword arguments (`TransformerLM(vocab_size=..., context_length=..., d_model=..., ...)`).
    """

    def __init__(self, config: ModelConfig | None = None, *, device=None, dtype=None, **kwargs):
        super().__init__()
        if config is None:
            config = ModelConfig(**kwargs)
        elif not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, not {type(config).__name__}")
        elif kwargs:
            config = config.replace(**kwargs)
        self.config = c = config
        self.token_embeddings = Embedding(c.vocab_size, c.d_model, device, dtype)
        rope = RotaryEmbedding(c.context_length, c.d_head, c.rope_theta, device)
        self.layers = nn.ModuleList(
            TransformerBlock(c.d_model, c.num_heads, c.d_ff, rope, c.attention, device, dtype) for _ in range(c.num_layers))
        self.ln_final = RMSNorm(c.d_model, device=device, dtype=dtype)
        self.lm_head = Linear(c.d_model, c.vocab_size, device, dtype)

    def set_attention(self, name: str) -> "TransformerLM":
        get_attention(name)
        for block in self.layers:
            block.attn.attention = name
        self.config = self.config.replace(attention=name)
        return self

    def hidden_states(self, token_ids: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final normalised hidden states (B, S, d_model): the forward pass without the LM head."""
        if token_ids.shape[-1] > self.config.context_length:
            raise ValueError(f"sequence length ({token_ids.shape[-1]}) exceeds context_length ({self.config.context_length})")
        x = self.token_embeddings(token_ids)
        for block in self.layers:
            x = block(x, token_positions)
        return self.ln_final(x)

    def forward(self, token_ids: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(token_ids, token_positions))

    def loss(self, token_ids: torch.Tensor, targets: torch.Tensor, token_positions: torch.Tensor | None = None, *,
             fused: bool = True, impl: str = "auto") -> torch.Tensor:
        """`cross_entropy(self(token_ids), targets)`; with `fused` the LM head and the loss run as one
        `linear_cross_entropy` (`impl`), so the (B, S, vocab) logits never exist. The LM head's module is not
        called on the fused path (its weight is read directly), so hooks on `lm_head` do not fire there."""
        hidden = self.hidden_states(token_ids, token_positions)
        if not fused:
            return cross_entropy(self.lm_head(hidden), targets)
        return linear_cross_entropy(hidden, self.lm_head.weight, targets, impl=impl)


BasicsTransformerLM = TransformerLM


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over all positions of -log_softmax(logits)[target], with max subtraction."""
    logits = logits - logits.amax(dim=-1, keepdim=True)
    log_z = torch.log(torch.exp(logits).sum(dim=-1))
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_z - target_logit).mean()


LOSS_IMPLS = ("auto", "triton", "torch")
"""`linear_cross_entropy` implementations: the Triton kernel of `kernels/fused_linear_ce.py`, its chunked
plain-torch counterpart `ChunkedLinearCrossEntropy` beside it, or `auto` (the kernel for CUDA tensors, else torch)."""
CHUNK_LOGIT_BYTES = 256 * 2**20
"""fp32 logits one chunk of `ChunkedLinearCrossEntropy` holds (its tokens = this / (4 * vocab))."""


def fused_loss_kernel() -> Callable | None:
    """`kernels.fused_linear_ce.linear_cross_entropy`, or None where that module does not import."""
    try:
        from kernels.fused_linear_ce import linear_cross_entropy as kernel
    except ImportError:
        return None
    return kernel


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         impl: str = "auto") -> torch.Tensor:
    """`cross_entropy(hidden @ weight.T, targets)` without materialising the (tokens, vocab) logits.

    hidden (..., d), weight (vocab, d), targets (...) int64 -> the mean loss (fp32), differentiable in `hidden`
    and `weight`. Both implementations compute the gradients during the forward pass (chunk by chunk) and keep
    only them for backward (hidden's and weight's shapes and dtypes) instead of the logits and their softmax.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"linear_cross_entropy impl {impl!r} must be one of {LOSS_IMPLS}")
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} must be (..., d), (vocab, d) and (...)")
    kernel = fused_loss_kernel()
    if kernel is None:
        raise ValueError("linear_cross_entropy needs kernels/fused_linear_ce.py (the Triton kernel and its chunked "
                         "torch counterpart), which does not import")
    if impl == "triton" or (impl == "auto" and hidden.is_cuda):
        return kernel(hidden, weight, targets)
    from kernels.fused_linear_ce import ChunkedLinearCrossEntropy

    chunk = max(1, CHUNK_LOGIT_BYTES // (4 * weight.shape[0]))
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)


class AdamW(torch.optim.Optimizer):
    """AdamW with the reference semantics: decoupled decay first, then the bias-corrected Adam update.

    Per parameter: p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    alpha_t = lr sqrt(1-b2^t) / (1-b1^t); p -= alpha_t m / (sqrt(v) + eps); t starts at 1.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        if lr < 0:
            raise ValueError(f"lr ({lr}) must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas ({betas}) must lie in [0, 1)")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["t"] = 1
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                t, m, v = state["t"], state["m"], state["v"]
                p.add_(p, alpha=-lr * wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                alpha_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-alpha_t)
                state["t"] = t + 1
        return loss
