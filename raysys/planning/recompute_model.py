"""Cost and memory model of activation checkpointing for `raysys.model.transformer.TransformerLM`.

For a `Workload` and the regions of a `parallel.checkpointing` policy: the bytes each block keeps for backward under
each policy kind (`saved_per_block`), matmul FLOPs of forward, recomputation and backward (`FlopCounterMode`'s
convention; `block_flops`, `step_flops`) and the peak memory of a training step (`predict_peak`). docs/raysys.md has
the per-tensor table and the derivations; the tests hold every formula to the bytes the CPU allocator sees.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel.checkpointing import FUSED_ATTENTION_BACKENDS, Region
from raysys.model.config import ModelConfig

PRECISIONS = ("fp32", "bf16", "fp16")
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSSES = ("materialized", "fused")
OPTIMIZERS = ("reference", "foreach", "fused")
GiB = 1024**3
FOREACH_CHUNK_BYTES = 2**30
"""Parameters `kernels.adamw.ForeachAdamW` updates per launch (its sqrt(v) temporary)."""
TORCH_LOSS_CHUNK_BYTES = 256 * 2**20
"""fp32 logits of one chunk of the plain-torch fused loss (`raysys.model.transformer.CHUNK_LOGIT_BYTES`), the CPU's."""
KERNEL_LOSS_CHUNK_BYTES = 768 * 2**20
"""The Triton fused loss's logits buffer (`kernels.fused_linear_ce.MAX_CHUNK_BYTES`), the one CUDA runs."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training step to model."""

    config: ModelConfig
    """The model (its `attention` field names the backend)."""
    batch_size: int
    """Sequences per step."""
    seq_len: int | None = None
    """Tokens per sequence (default: config.context_length)."""
    precision: str = "fp32"
    """fp32, or bf16 / fp16 autocast with fp32 master weights."""
    device_type: str = "cuda"
    """cuda or cpu: autocast's op lists differ (softmax in fp32 on CUDA only)."""
    param_dtype: str = "fp32"
    """Weights, gradients and AdamW moments: fp32 (master weights; a bf16 / fp16 `precision` is autocast), or
    `precision` itself (pure low precision, as the course's leaderboard harness builds the model: no casts)."""
    loss: str = "materialized"
    """materialized: `cross_entropy(model(x), y)` keeps the (B, S, V) logits; fused: `model.loss(x, y)`, the LM
    head and the loss in one op that keeps only the gradients of the hidden states and of the LM-head weight."""
    compiled: bool = False
    """RMSNorm, RoPE and SwiGLU compiled (`raysys.training.leaderboard.compile_pieces`; pure precision only)."""
    lean: bool = False
    """With `compiled`: lean blocks (`raysys.training.leaderboard.lean_blocks`), which recompute the norms' outputs
    and SwiGLU's gated product and merge attention's heads as a view."""
    optimizer: str = "reference"
    """AdamW's step transient: reference (sqrt(v) of one parameter), foreach (of up to 1 GiB of them), fused (none)."""
    optimizer_in_backward: bool = False
    """Each parameter stepped and its gradient freed as soon as backward writes it
    (`raysys.training.leaderboard.OptimizerInBackward`); no step after backward."""
    shards: int = 1
    """Ranks the fp32 weights, gradients and AdamW state are sharded over (FSDP, `parallel/fsdp.py`); 1: none."""
    attention_kernels: str = ""
    """flash_triton: its dispatch's kernels for this shape, as `kernels.attention.planned_paths` writes them
    (`gluon, one_pass`, `tma, two_pass`, ...); '' for the tl two-pass backward and every other backend."""

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size ({self.batch_size!r}) must be a positive integer")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"seq_len ({self.seq_len!r}) must be a positive integer")
        if self.seq_len is not None and self.seq_len > self.config.context_length:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds context_length ({self.config.context_length})")
        for name, allowed in (("precision", PRECISIONS), ("device_type", ("cuda", "cpu")), ("loss", LOSSES),
                              ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} must be one of {allowed}")
        if self.param_dtype not in ("fp32", self.precision):
            raise ValueError(f"param_dtype {self.param_dtype!r} must be fp32 (master weights) or the precision "
                             f"{self.precision!r} (pure low precision)")
        if not isinstance(self.shards, int) or isinstance(self.shards, bool) or self.shards < 1:
            raise ValueError(f"shards ({self.shards!r}) must be a positive integer")
        if self.shards > 1 and self.param_dtype != "fp32":
            raise ValueError(f"shards ({self.shards}) > 1 needs param_dtype fp32: parallel/fsdp.py keeps fp32 shards")
        if self.optimizer_in_backward and self.shards > 1:
            raise ValueError("optimizer_in_backward is modelled for one rank holding the whole state (no FSDP)")
        if self.lean and not self.compiled:
            raise ValueError("lean blocks are compiled graphs: lean needs compiled")
        if self.compiled and self.amp:
            raise ValueError("compiled pieces are modelled for pure-precision steps (param_dtype == precision), "
                             "not under autocast")

    @property
    def S(self) -> int:
        return self.seq_len or self.config.context_length

    @property
    def amp(self) -> bool:
        """Autocast: low-precision compute over fp32 weights on one rank (FSDP casts its weights instead)."""
        return self.precision != "fp32" and self.param_dtype == "fp32" and self.shards == 1

    @property
    def pb(self) -> int:
        """Bytes per element of weights, gradients and AdamW moments."""
        return ELEMENT_BYTES[self.param_dtype]

    @property
    def a(self) -> int:
        """Bytes per element of the residual stream: fp32 under autocast, else the compute dtype."""
        return 4 if self.amp else self.e

    @property
    def e(self) -> int:
        """Bytes per element of matmul outputs."""
        return ELEMENT_BYTES[self.precision]

    @property
    def fused(self) -> bool:
        return self.config.attention in FUSED_ATTENTION_BACKENDS

    @property
    def e_softmax(self) -> int:
        """Bytes per element of exp / row sums: fp32 under CUDA autocast, else the activation dtype."""
        return 4 if self.amp and self.device_type == "cuda" else self.e

    @property
    def stream_bytes(self) -> int:
        """One residual-stream activation x_i (fp32 under autocast: embeddings and residual adds are fp32)."""
        return self.a * self.batch_size * self.S * self.config.d_model


# ------------------------------------------------------------------------------------------------------------
# Saved bytes.

def block_saved(w: Workload) -> dict[str, int]:
    """Bytes one block saves for backward without checkpointing, by component."""
    return dict(_block_saved(w))


@functools.cache
def _block_saved(w: Workload) -> dict[str, int]:
    c, B, S, e = w.config, w.batch_size, w.S, w.e
    d, f, H, Dh = c.d_model, c.d_ff, c.num_heads, c.d_head
    BSd, BSf, BHS, BHSS = B * S * d, B * S * f, B * H * S, B * H * S * S
    norm = _norm_saved(w)
    if w.amp:  # each consumer keeps its own cast of the norm output; weights are cast per call
        out = {"norms": 2 * norm + (3 + 2) * e * BSd, "weight_casts": (4 * d * d + 3 * d * f) * e}
    elif w.lean:  # the input only: the output is recomputed from it in backward
        out = {"norms": 2 * w.a * BSd, "weight_casts": 0}
    else:  # the output once (its consumers share it)
        out = {"norms": 2 * (norm + e * BSd), "weight_casts": 0}
    # eager: cos / sin rows for q and for k (fp32 buffers); compiled: the int64 positions (the whole buffers,
    # shared by every block, are counted once in head_saved)
    out["rope"] = 8 * S if w.compiled else 4 * S * (Dh // 2) * 4
    if w.fused:  # q, k, v, O, merged heads (a view of O in lean blocks); fp32 log-sum-exp
        out["attention"] = (4 if w.lean else 5) * e * BSd + 4 * BHS
    else:
        out["attention"] = 4 * e * BSd + S * S + 2 * e * BHSS + w.e_softmax * BHSS + (e + w.e_softmax) * BHS
    out["ffn"] = (2 if w.lean else 3 if w.compiled else 5) * e * BSf
    return out


def _norm_saved(w: Workload) -> int:
    """What one RMSNorm keeps, its output aside: eager, the fp32 upcast of the input (the input itself in fp32),
    x * rsqrt and rsqrt; compiled, its input and rsqrt."""
    BS, BSd = w.batch_size * w.S, w.batch_size * w.S * w.config.d_model
    return (w.a * BSd if w.compiled else 2 * 4 * BSd) + 4 * BS


def attention_core_saved(w: Workload) -> int:
    """The part of `block_saved` that selective checkpointing drops (0 for fused backends)."""
    if w.fused:
        return 0
    e, BSd = w.e, w.batch_size * w.S * w.config.d_model
    kept = 4 * e * BSd  # q, k, v and output-projection outputs, cached by the selective policy
    dropped = _block_saved(w)["attention"] + _block_saved(w)["rope"]
    if w.amp:  # the three casts of ln1's output and the four attention weight casts are recomputed,
        d = w.config.d_model  # while ln1's fp32 output is kept as the checkpoint's input
        dropped += 3 * e * BSd + 4 * d * d * e
        kept += 4 * BSd
    return dropped - kept


def ffn_branch_saved(w: Workload) -> int:
    """The part of `block_saved` that ffn checkpointing drops: what ln2 and SwiGLU keep (the norm's saved tensors
    and output, under autocast its two casts and the three FFN weight casts instead, and SwiGLU's tensors)."""
    c, e = w.config, w.e
    BSd = w.batch_size * w.S * c.d_model
    if w.amp:
        ln2 = _norm_saved(w) + 2 * e * BSd + 3 * c.d_model * c.d_ff * e
    elif w.lean:  # the branch's input h, kept by the lean norm
        ln2 = w.a * BSd
    else:
        ln2 = _norm_saved(w) + e * BSd
    return ln2 + _block_saved(w)["ffn"]


@functools.cache
def saved_per_block(w: Workload, kind: str) -> int:
    """Bytes a block keeps on the device between its forward and its backward under `kind`.

    `full` / `nested` count one checkpoint (the segment input) per block; `ffn` keeps everything but the
    feed-forward branch, plus that branch's input h (a residual-stream tensor); `offload` counts 0 (everything
    above the store's size threshold goes to the host).
    """
    none = sum(_block_saved(w).values())
    if kind == "none":
        return none
    if kind == "selective":
        return none - attention_core_saved(w)
    if kind == "ffn":
        return none - ffn_branch_saved(w) + w.stream_bytes
    if kind in ("full", "nested"):
        return w.stream_bytes
    if kind == "offload":
        return 0
    raise ValueError(f"kind {kind!r} must be none, selective, ffn, full, nested or offload")


def head_saved(w: Workload) -> int:
    """ln_final, lm_head and the loss. Materialised: the norm's output, logits, shifted logits, exp, row max /
    sum. Fused: the gradients of the hidden states and of the LM-head weight (computed in forward). Compiled
    RoPE's cos / sin buffers, shared by every block, are counted here once."""
    c, B, S, e = w.config, w.batch_size, w.S, w.e
    BS, BSd, BSV = B * S, B * S * c.d_model, B * S * c.vocab_size
    rope = 2 * c.context_length * (c.d_head // 2) * 4 if w.compiled else 0
    if w.loss == "fused":
        return _norm_saved(w) + rope + w.a * (BSd + c.vocab_size * c.d_model)
    norm = _norm_saved(w) + (e * BSd + c.vocab_size * c.d_model * e if w.amp else e * BSd)
    return norm + rope + 2 * e * BSV + w.e_softmax * BSV + (e + w.e_softmax) * BS


def _shard(w: Workload, nbytes: int) -> int:
    """A rank's part of a sharded state of `nbytes` (rounded up)."""
    return -(-nbytes // w.shards)


CUDA_WORKSPACE_BYTES = 64 * 2**20
"""Allowance for the cuBLAS / cuBLASLt workspaces, which the caching allocator counts as allocated."""


def static_bytes(w: Workload) -> dict[str, int]:
    """Weights and AdamW moments (in `param_dtype`, this rank's shard), the token / target ids and, on CUDA,
    the matmul libraries' workspaces."""
    p = w.config.num_params()
    out = {"weights": _shard(w, w.pb * p), "optimizer": _shard(w, 2 * w.pb * p), "inputs": 2 * 8 * w.batch_size * w.S}
    if w.device_type == "cuda":
        out["workspace"] = CUDA_WORKSPACE_BYTES
    return out


def sharding_transient(w: Workload) -> int:
    """FSDP's full-size buffers on top of the shards (0 unsharded): two neighbouring blocks' gathered weights and
    the largest unit's (prefetch), and one unit's gradient in the compute dtype plus its fp32 copy for the
    reduce-scatter. Units are per weight matrix or per block; the embedding / LM head is the largest."""
    if w.shards == 1:
        return 0
    c = w.config
    block = 4 * c.d_model ** 2 + 3 * c.d_model * c.d_ff
    largest = max(block, c.vocab_size * c.d_model)
    return 2 * w.e * block + w.e * largest + (w.e + 4) * largest


def optimizer_transient(w: Workload) -> int:
    """What AdamW's step allocates on top of weights, gradients and moments."""
    c = w.config
    largest = _shard(w, w.pb * max(c.vocab_size * c.d_model, c.d_model * c.d_ff))
    if w.optimizer == "reference":  # sqrt(v) of one parameter
        return largest
    if w.optimizer == "foreach":  # sqrt(v) of one chunk (a parameter larger than a chunk is one alone)
        return max(largest, min(FOREACH_CHUNK_BYTES, _shard(w, w.pb * c.num_params())))
    return 0


def fused_loss_transient(w: Workload) -> int:
    """The fused loss's forward on top of what it keeps (`linear_cross_entropy`'s `auto` implementation of the
    device): on CUDA the Triton kernel's one (C, V) logits buffer in the activation dtype (C a multiple of 256)
    and the per-token losses; on the CPU the plain-torch chunk's fp32 logits next to their exp."""
    V, N = w.config.vocab_size, w.batch_size * w.S
    if w.device_type == "cuda":
        rows = max(1, KERNEL_LOSS_CHUNK_BYTES // (V * w.a))
        rows = min(rows - rows % 256 if rows >= 256 else rows, N)
        return rows * V * w.a + 4 * N
    rows = min(max(1, TORCH_LOSS_CHUNK_BYTES // (4 * V)), N)
    return 2 * 4 * rows * V


# ------------------------------------------------------------------------------------------------------------
# FLOPs.

def block_flops(w: Workload) -> dict[str, int]:
    """Forward matmul FLOPs of one block: projections + FFN, the attention core (QK^T and PV), w2 (the matmul a
    checkpoint's early stop skips) and w1 + w3 (what ffn checkpointing reruns)."""
    c, B, S = w.config, w.batch_size, w.S
    tokens, d, f = B * S, c.d_model, c.d_ff
    return {"linear": 2 * tokens * (4 * d * d + 3 * d * f), "core": 4 * B * S * S * d,
            "last_matmul": 2 * tokens * d * f, "ffn_recompute": 2 * 2 * tokens * d * f}


def step_flops(w: Workload, regions: list[Region]) -> dict[str, int]:
    """Forward, recompute and backward matmul FLOPs of one step (backward = 2x forward; a fused core's
    backward recomputes QK^T: 2.5x). Full checkpointing reruns each segment once, except the segment's last
    matmul (w2): torch's non-reentrant checkpoint stops as soon as the last saved tensor is regenerated; ffn
    checkpointing reruns w1 and w3 for the same reason."""
    c = w.config
    bf = block_flops(w)
    per_block = bf["linear"] + bf["core"]
    head = 2 * w.batch_size * w.S * c.d_model * c.vocab_size
    forward = c.num_layers * per_block + head
    core_bwd = 5 * bf["core"] // 2 if w.fused else 2 * bf["core"]
    backward = c.num_layers * (2 * bf["linear"] + core_bwd) + 2 * head
    recompute = 0
    for r in regions:
        n = r.stop - r.start
        if r.kind == "full":
            recompute += n * per_block - bf["last_matmul"]
        elif r.kind == "nested":
            recompute += _nested_recompute(n, r.policy.leaf_size, per_block, bf["last_matmul"], top=True)
        elif r.kind == "selective" and not w.fused:
            recompute += n * bf["core"]
        elif r.kind == "ffn":
            recompute += n * bf["ffn_recompute"]
    return {"forward": forward, "recompute": recompute, "backward": backward,
            "total": forward + recompute + backward}


def _nested_recompute(n: int, leaf: int, block: int, last: int, top: bool = False) -> int:
    """Recomputed FLOPs of a recursively halved range of n blocks. A leaf (<= `leaf` blocks) reruns its
    blocks but the last matmul (early stop); an inner range reruns its left half only - recomputation stops
    as soon as the right half's checkpoint has saved its input. The top range is not itself wrapped."""
    if n <= leaf:
        return 0 if top else n * block - last
    left = n // 2
    return (0 if top else left * block) + _nested_recompute(left, leaf, block, last) \
        + _nested_recompute(n - left, leaf, block, last)


# ------------------------------------------------------------------------------------------------------------
# Peak memory of a training step.

@functools.cache
def block_backward_excess(w: Workload, kind: str) -> int:
    """Largest allocation above the block's own residuals while its backward runs (measured moments)."""
    c, B, S, e = w.config, w.batch_size, w.S, w.e
    d, f = c.d_model, c.d_ff
    BSf, BHSS = B * S * f, B * c.num_heads * S * S
    grad_cast = 2 if w.amp else 0  # low-precision weight gradient before its fp32 cast
    gb = w.e if w.shards > 1 else w.pb  # a full weight's gradient as backward makes it (FSDP: the compute dtype)
    ffn = 2 * e * BSf + d * f * (gb + grad_cast)
    if w.lean and kind == "none":  # the recomputed gated product, ln2's output and one more (B, S, d_ff) gradient
        ffn += 2 * e * BSf + e * B * S * d  # (Inductor's CPU backward of a tiny model measures within 1%)
    parts = _block_saved(w)
    ffn_and_ln2 = parts["ffn"] + (parts["norms"] // 2)
    if w.fused:  # the attention's backward runs once the FFN branch's residuals are freed
        return max(ffn, attention_backward_bytes(w) - ffn_and_ln2 + (3 * d * f + d * d) * gb)
    attn = 4 * w.e_softmax * BHSS - ffn_and_ln2 + (3 * d * f + d * d) * gb
    if kind == "selective":
        attn += attention_core_saved(w)  # the core is rematerialised when backward reaches it
    return max(ffn, attn)


def attention_backward_bytes(w: Workload) -> int:
    """What a fused attention's backward holds while its kernels run, besides the block's residuals: dO, dQ, dK, dV
    and the kernels' fp32 workspace (for flash_triton by `Workload.attention_kernels`); docs/raysys.md lists it."""
    c, B, S = w.config, w.batch_size, w.S
    BHS, BSd = B * c.num_heads * S, B * S * c.d_model
    workspace = 4 * BHS  # D = rowsum(dO * O) in fp32 (the tl two-pass backward, sdpa on the CPU, flash_pytorch)
    kernels, triton = w.attention_kernels, c.attention == "flash_triton"
    if triton and ("gluon bwd" in kernels or (kernels.startswith("gluon,") and kernels.endswith("one_pass"))):
        from kernels.attention.dispatch import gluon_bwd_default

        block_m = gluon_bwd_default(c.d_head, TORCH_DTYPES[w.precision]).block_m  # dQ; L and D padded to whole tiles
        workspace = 4 * BSd + 2 * 4 * B * c.num_heads * (-(-S // block_m) * block_m)
    elif triton and kernels.endswith("one_pass"):  # dQ with rows padded to a power of 2 >= 16
        workspace += 4 * BHS * max(16, 1 << (c.d_head - 1).bit_length())
    elif c.attention in ("cudnn", "sdpa") and w.device_type == "cuda":  # FlashAttention-2's dQ accumulator
        workspace += 4 * BSd
    return 4 * w.e * BSd + workspace


def head_backward_excess(w: Workload) -> int:
    """Cross-entropy backward on top of the head's residuals: the gradient of the logits and amax's
    (logits == max) mask (B S V x (e + 1) bytes in fp32); under autocast also the gradients of the low-precision
    logits and shifted logits. With pure low-precision weights on CUDA two more low-precision logit-sized tensors
    are alive. Fused: nothing (the saved gradients are scaled in place)."""
    c = w.config
    if w.loss == "fused":
        return 0
    BSV = w.batch_size * w.S * c.vocab_size
    pure_cuda = 2 * w.e if w.device_type == "cuda" and not w.amp and w.precision != "fp32" else 0
    return BSV * (w.e_softmax + 1 + (2 * w.e if w.amp else 0) + pure_cuda)


@dataclass
class PeakEstimate:
    """Predicted peak of one training step and where it happens."""

    peak_bytes: int
    where: str
    static: dict[str, int]
    activations_end_of_forward: int
    moments: list[tuple[str, int]] = field(default_factory=list)

    @property
    def activation_peak_bytes(self) -> int:
        """Peak minus weights, optimizer state and inputs."""
        return self.peak_bytes - sum(self.static.values())


def predict_peak(w: Workload, regions: list[Region]) -> PeakEstimate:
    """Walk a step: end of forward, loss backward, each block's backward (reverse), optimizer step."""
    c = w.config
    if not regions or regions[-1].stop != c.num_layers:
        raise ValueError(f"regions must cover the model's {c.num_layers} blocks")
    static = static_bytes(w)
    base = sum(static.values()) + sharding_transient(w)
    block_params = _shard(w, w.pb * (4 * c.d_model ** 2 + 3 * c.d_model * c.d_ff + 2 * c.d_model))
    head_params = _shard(w, w.pb * (c.vocab_size * c.d_model + c.d_model))
    none, x, excess = saved_per_block(w, "none"), w.stream_bytes, block_backward_excess(w, "none")

    retained = [_retained(w, r) for r in regions]  # device bytes each region keeps after forward
    last_offload = max((i for i, r in enumerate(regions) if r.kind == "offload"), default=None)
    if last_offload is not None:  # the last offloaded block's storages are still on the device
        retained[last_offload] += none
    act_end = sum(retained) + head_saved(w)
    moments = [("end of forward", base + act_end)]
    if w.loss == "fused":  # its gradients are being written while the weight's fp32 accumulator exists
        moments.append(("fused loss forward", base + act_end + fused_loss_transient(w)))
    grads = head_params
    moments.append(("loss / lm_head backward", base + act_end + head_backward_excess(w)))
    if w.optimizer_in_backward:  # the head's gradient is used and freed before the blocks' backward starts;
        grads, block_params = 0, 0  # a block's own gradients live only inside its backward (its excess covers them)

    def rerun(lo: int, hi: int, below: int, kept: int, label: str) -> None:
        """Backward of blocks hi-1 .. lo, each rematerialised on top of `below` and what blocks lo .. j-1 keep."""
        nonlocal grads
        for j in reversed(range(lo, hi)):
            moments.append((f"block {j} backward{label}", base + grads + below + (j - lo) * kept + none + excess))
            grads += block_params

    def nested(lo: int, hi: int, leaf: int, live: int) -> None:
        """Recursive halves: one retained input per level (`live` includes this range's input), leaves rerun."""
        if hi - lo <= leaf:
            return rerun(lo, hi, live - x, none, " (nested)")
        mid = (lo + hi) // 2
        nested(mid, hi, leaf, live + x)
        nested(lo, mid, leaf, live)

    prefix = [sum(retained[:i]) for i in range(len(regions))]
    for i in reversed(range(len(regions))):
        r, below = regions[i], prefix[i]
        if r.kind == "ffn":  # all of the block, its branch rematerialised, on top of the ffn blocks before it
            rerun(r.start, r.stop, below, saved_per_block(w, "ffn"), " (ffn rerun)")
        elif r.kind == "full":  # the recomputed segment, x_start among it
            rerun(r.start, r.stop, below, none, f" (segment {r.start}-{r.stop - 1})")
        elif r.kind == "nested":
            nested(r.start, r.stop, r.policy.leaf_size, below + x)
        elif r.kind == "offload":  # the block fetched back, and the previous offloaded block prefetched
            earlier = any(q.kind == "offload" for q in regions[:i])
            live = below + none + (none if r.policy.prefetch and earlier else 0)
            moments.append((f"block {r.start} backward", base + grads + live + excess))
            # forward: this block's storages and the previous offloaded block's are both still referenced
            moments.append((f"block {r.start} forward", base + below + none + (none if earlier else 0)))
            grads += block_params * (r.stop - r.start)
        else:  # none, selective
            live = below + saved_per_block(w, r.kind)
            moments.append((f"block {r.start} backward", base + grads + live + block_backward_excess(w, r.kind)))
            grads += block_params * (r.stop - r.start)
    embedding_grad = _shard(w, w.pb * c.vocab_size * c.d_model)
    moments.append(("embedding backward", base + grads + embedding_grad + w.stream_bytes))
    if not w.optimizer_in_backward:
        moments.append(("optimizer step", base + grads + embedding_grad + optimizer_transient(w)))
    where, peak = max(moments, key=lambda m: m[1])
    return PeakEstimate(int(peak), where, static, int(act_end), moments)


def _retained(w: Workload, r: Region) -> int:
    n = r.stop - r.start
    if r.kind == "full":
        return w.stream_bytes
    if r.kind == "nested":  # the top range is not wrapped: a single leaf keeps everything
        return 2 * w.stream_bytes if n > r.policy.leaf_size else n * saved_per_block(w, "none")
    return n * saved_per_block(w, r.kind)


# ------------------------------------------------------------------------------------------------------------
# Measuring on the CPU: the allocator trace of the profiler (exact bytes; CUDA has max_memory_allocated).

def cpu_allocation_trace(fn: Callable[[], object]) -> list[int]:
    """Bytes allocated on the CPU after every allocation / free made while `fn` runs, relative to the start (the
    profiler's allocation events); a free counts only when its allocation was seen inside `fn`."""
    import gc

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from raysys.measure.profiling import without_kineto_noise

    gc.collect()
    with without_kineto_noise(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
            events.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size))
        stack.extend(ev.children)
    events.sort(key=lambda t: t[0])
    out, live, sizes = [], 0, {}
    for _, ptr, size in events:
        if size > 0:
            sizes[ptr] = size
        elif sizes.pop(ptr, None) is None:
            continue
        live += size
        out.append(live)
    return out


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 2**20:.1f} MiB"
