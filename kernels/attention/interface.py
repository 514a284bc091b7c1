"""The public entry of the attention kernels: `flash_attention`, its autograd Function and custom ops.

`flash_attention(q, k, v, is_causal, path=None, bwd=None)` is softmax(Q K^T / sqrt(d) + causal mask) V on (B, N, d) or
(B, H, N, d) tensors (fp16 / bf16 / fp32, head dim 16..128, any strides; causal needs n_q == n_k), differentiable and
torch.compile-able; `attention_backend` is the model's `flash_triton` backend (follows autocast like SDPA).
`flash_attention_fwd` / `flash_attention_bwd` are the checked launchers the Function calls: `dispatch` picks the tl
kernels' path or the Gluon kernels (falling back to the tl kernels where a Gluon kernel does not build here), and O
and the gradients come out in their inputs' layouts. The Function saves Q, K, V, O and the fp32 log-sum-exp L, never P.

Under torch.compile the Function's body is the custom op `raysys::flash_attn_fwd` (backward `raysys::flash_attn_bwd`):
`triton_op`s on a GPU, so Inductor launches the tl kernels itself, opaque `custom_op`s with fake implementations under
the interpreter; the Gluon kernels are opaque ops (`raysys::gluon_attn_fwd` / `_bwd`) inside them. Eager calls on real
tensors skip the ops' dispatch (`_eager`), and each geometry's input checks run once (`_validated`).
"""

from __future__ import annotations

import torch

import kernels.attention.gluon.backward as gluon_bwd
import kernels.attention.gluon.forward as gluon_fwd
import kernels.attention.triton.launch as tl_launch
from kernels.attention.checks import (
    as_4d,
    check_attention_inputs,
    check_backward_inputs,
    traced,
)
from kernels.attention.dispatch import (
    GLUON,
    LAST_CONFIG,
    LAST_PATH,
    gluon_broken,
    gluon_bwd_chosen,
    gluon_bwd_config,
    gluon_fwd_config,
    gluon_unsupported_reason,
    requested_bwd,
    requested_path,
    resolve_bwd,
    resolve_path,
    tl_path,
)
from kernels.attention.gluon.runtime import BuildFailed
from kernels.attention.reference import autocast_inputs
from kernels.attention.triton.tuning import FlashConfig
from kernels.device import INTERPRET, check_runs_here, empty_like_layout

_VALIDATED: dict[tuple, str] = {}
"""The geometry of an eager call's tensors (`_validated`) -> `gluon_unsupported_reason`'s answer, for calls whose
checks passed."""


def _validated(check, is_causal, *tensors: torch.Tensor) -> str:
    """Run `check()` (which raises on bad input) and return `gluon_unsupported_reason(q, k, v)` of `tensors` (q, k, v,
    ...), once per geometry (shapes, strides, dtypes, devices, pointer alignment, is_causal: all they read). Anything
    else (not plain tensors, a non-bool is_causal, tracing) is checked every time."""
    if type(is_causal) is not bool or not all(type(t) in _PLAIN for t in tensors) or not _eager(tensors[0]):
        check()
        return gluon_unsupported_reason(*tensors[:3])
    key = (is_causal, *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors])
    reason = _VALIDATED.get(key)
    if reason is None:
        check()
        reason = gluon_unsupported_reason(*tensors[:3])
        if len(_VALIDATED) >= 4096:
            _VALIDATED.clear()
        _VALIDATED[key] = reason
    return reason


def _eager(q: torch.Tensor) -> bool:
    """Whether a call on `q` runs the launchers straight from Python rather than through the custom ops: a real
    tensor (not torch.compile's or export's stand-in, not on the meta device) outside tracing and functorch
    transforms."""
    return (type(q) in _PLAIN and q.device.type != "meta" and not torch.compiler.is_compiling()
            and torch._C._functorch.peek_interpreter_stack() is None)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        config: FlashConfig | None = None, path: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: (O like q, L fp32 of shape q.shape[:-1]). `config` (a tl launch config) skips
    autotuning; `path` (auto, portable, tma, gluon; None reads RAYSYS_FLASH_PATH) picks the kernel variant."""
    def check() -> None:
        check_attention_inputs(q, k, v, is_causal)
        check_runs_here(q, "kernels.attention")

    reason = _validated(check, is_causal, q, k, v)
    requested = requested_path(path)
    if config is not None and requested == GLUON:
        raise ValueError("a FlashConfig is a launch config of the tl kernels, not of the gluon path")
    path = resolve_path(requested, q, k, v, forward=config is None, gluon_reason=reason)  # a config is a tl one
    if path == GLUON:
        q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
        out, lse = (gluon_attn_fwd_op(q4, k4, v4, is_causal) if traced(q4) else
                    _gluon_fwd(q4, k4, v4, is_causal, checked=True, strict=requested == GLUON))
        return (out, lse) if q.dim() == 4 else (out.view(q.shape), lse.view(q.shape[:-1]))
    return tl_launch.launch_fwd(q, k, v, is_causal, config, path)


def flash_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor, is_causal: bool = False, *, dkdv_config: FlashConfig | None = None,
                        dq_config: FlashConfig | None = None, compute_dq: bool = True, compute_dkdv: bool = True,
                        path: str | None = None, bwd: str | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels (D, then dK/dV, then dQ): returns (dQ, dK, dV) in the inputs' dtypes.

    `bwd` (auto, two_pass, one_pass; None reads RAYSYS_FLASH_BWD): one_pass runs the `dkdvq` kernel (with
    `dkdv_config`) when both dQ and dK/dV are wanted, its dQ summed in fp32 by the TMA unit (tma path) or by
    atomics (portable path), so the order of the additions, hence the last bits of dQ, can vary run to run."""
    def check() -> None:
        check_attention_inputs(q, k, v, is_causal)
        check_backward_inputs(q, out, lse, grad_out)
        check_runs_here(q, "kernels.attention")

    reason = _validated(check, is_causal, q, k, v, out, lse, grad_out)
    resolve_bwd(bwd, "portable")  # a bad request raises here, whichever kernels would run
    if compute_dq and compute_dkdv and gluon_bwd_chosen(path, bwd, q, k, v, reason):
        LAST_PATH["bwd"] = "one_pass"
        args = (*(as_4d(t) for t in (q, k, v, out)), lse.reshape(as_4d(q).shape[:-1]),
                as_4d(grad_out if grad_out.dtype == q.dtype else grad_out.to(q.dtype)), is_causal)
        dq, dk, dv = (gluon_attn_bwd_op(*args) if traced(q) else
                      _gluon_bwd(*args, checked=True, strict=requested_path(path) == GLUON))
        return (dq, dk, dv) if q.dim() == 4 else (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape))
    path = resolve_path(path, q, k, v)
    one_pass = compute_dq and compute_dkdv and resolve_bwd(bwd, path) == "one_pass"
    LAST_PATH["bwd"] = "one_pass" if one_pass else "two_pass"
    return tl_launch.launch_bwd(q, k, v, out, lse, grad_out, is_causal, dkdv_config=dkdv_config, dq_config=dq_config,
                                compute_dq=compute_dq, compute_dkdv=compute_dkdv, path=path, one_pass=one_pass)


# On a GPU the ops are `triton_op`s: the compiler traces their bodies (fake tensors, `wrap_triton` launches) and
# Inductor calls the Triton kernels itself. The interpreter's kernels cannot be traced, so under
# TRITON_INTERPRET=1 the same functions become opaque `custom_op`s with fake implementations.
def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, path: str, bwd: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_fwd(q, k, v, is_causal, path=path)  # `bwd` is for the backward (setup_context)


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              grad_out: torch.Tensor, is_causal: bool, compute_dq: bool, compute_dkdv: bool, path: str, bwd: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV); a gradient not asked for is an empty tensor (custom ops return no None)."""
    dq, dk, dv = flash_attention_bwd(q, k, v, out, lse, grad_out, is_causal, compute_dq=compute_dq,
                                     compute_dkdv=compute_dkdv, path=path, bwd=bwd)
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            v.new_empty(0) if dv is None else dv)


# The fakes allocate like the launchers: O and the gradients in their inputs' layout (`empty_like_layout`), L
# contiguous.
def _fwd_fake(q, k, v, is_causal, path=None, bwd=None):  # also the gluon forward op's
    return empty_like_layout(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _bwd_fake(q, k, v, out, lse, grad_out, is_causal, compute_dq, compute_dkdv, path, bwd):
    return (empty_like_layout(q) if compute_dq else q.new_empty(0),
            empty_like_layout(k) if compute_dkdv else k.new_empty(0),
            empty_like_layout(v) if compute_dkdv else v.new_empty(0))


def _define_op(name: str, impl, fake):
    if INTERPRET:
        op = torch.library.custom_op(f"raysys::{name}", impl, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(f"raysys::{name}", impl, mutates_args=())


def _gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, checked: bool = False,
               strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gluon forward of 4-D inputs; `checked`: `gluon_unsupported_reason` accepted them already (its host time
    once). Where the kernel does not build, the tl forward runs (with one warning), or with `strict` (the gluon path
    asked for by name) a ValueError says why."""
    config = gluon_fwd_config(q, k)
    broken = gluon_broken("fwd", config, q, is_causal)
    if broken is None:
        try:
            LAST_PATH["fwd"], LAST_CONFIG["fwd"] = GLUON, config
            return (gluon_fwd.launch_fwd if checked else gluon_fwd.gluon_attention_fwd)(q, k, v, is_causal, config)
        except BuildFailed as exc:
            broken = gluon_broken("fwd", config, q, is_causal, exc)
    if strict:
        raise ValueError(f"the gluon path cannot run here: {broken}")
    return flash_attention_fwd(q, k, v, is_causal, path=tl_path(q, k, v))


def _gluon_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               grad_out: torch.Tensor, is_causal: bool, checked: bool = False, strict: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of 4-D inputs by the Gluon one-pass backward; `checked`: as `_gluon_fwd`'s (and the shapes of
    out, lse and grad_out too). Where the kernel does not build, the tl two-pass backward runs (one warning), or with
    `strict` a ValueError says why."""
    config = gluon_bwd_config(q)
    broken = gluon_broken("bwd", config, q, is_causal)
    if broken is None:
        try:
            LAST_PATH["dkdvq"], LAST_CONFIG["dkdvq"] = GLUON, config
            if checked:
                return gluon_bwd.launch_bwd(q, k, v, out, lse, grad_out, is_causal, config)
            return gluon_bwd.gluon_attention_bwd(q, k, v, out, lse, grad_out, is_causal, config)
        except BuildFailed as exc:
            broken = gluon_broken("bwd", config, q, is_causal, exc)
    if strict:
        raise ValueError(f"the gluon path cannot run here: {broken}")
    return flash_attention_bwd(q, k, v, out, lse, grad_out, is_causal, path=tl_path(q, k, v), bwd="two_pass")


# The Gluon kernels are opaque ops while traced (Inductor calls them; it cannot trace Gluon launches as it does tl
# ones), so the triton_ops that call them stay traceable; eager calls skip the ops (and the checks done before).
@torch.library.custom_op("raysys::gluon_attn_fwd", mutates_args=())
def gluon_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return _gluon_fwd(q, k, v, is_causal)


gluon_attn_fwd_op.register_fake(_fwd_fake)


@torch.library.custom_op("raysys::gluon_attn_bwd", mutates_args=())
def gluon_attn_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      grad_out: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gluon_bwd(q, k, v, out, lse, grad_out, is_causal)


@gluon_attn_bwd_op.register_fake
def _gluon_bwd_fake(q, k, v, out, lse, grad_out, is_causal):
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


flash_attn_fwd_op = _define_op("flash_attn_fwd", _fwd_impl, _fwd_fake)
flash_attn_bwd_op = _define_op("flash_attn_bwd", _bwd_impl, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, path, bwd = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.path, ctx.bwd = is_causal, path, bwd
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse=None, allow_eager: bool = False):
    """The gradients of (q, k, v, is_causal, path, bwd) from the saved tensors, unpacked once (a non-reentrant
    checkpoint refuses a second unpack): by `_bwd_impl` when `allow_eager` and `_eager(q)`, else through the
    backward op."""
    q, k, v, out, lse = ctx.saved_tensors
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    run = _bwd_impl if allow_eager and _eager(q) else flash_attn_bwd_op
    dq, dk, dv = run(q, k, v, out, lse, grad_out, ctx.is_causal, need_q, need_k or need_v, ctx.path, ctx.bwd)
    return dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None, None


flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with Triton forward and backward (the course's interface); saves Q, K, V, O and L only.
    `path` / `bwd` None read RAYSYS_FLASH_PATH / RAYSYS_FLASH_BWD. Eager calls (`_eager`) run the launchers
    directly, traced ones the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, path=None, bwd=None):
        ctx.path, ctx.bwd = requested_path(path), requested_bwd(bwd)
        out, lse = (_fwd_impl if _eager(q) else flash_attn_fwd_op)(q, k, v, is_causal, ctx.path, ctx.bwd)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, allow_eager=True)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    path: str | None = None, bwd: str | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V with the Triton kernels (differentiable, torch.compile-able).
    `path`: auto, portable, tma or gluon (None reads RAYSYS_FLASH_PATH); the backward takes the same
    (`gluon_bwd_chosen` says when the Gluon one-pass backward runs). `bwd`: auto, two_pass or one_pass (None reads
    RAYSYS_FLASH_BWD)."""
    if _eager(q):  # the launchers check the inputs
        return FlashAttentionTriton.apply(q, k, v, is_causal, path, bwd)
    check_attention_inputs(q, k, v, is_causal)
    return flash_attn_fwd_op(q, k, v, is_causal, requested_path(path), requested_bwd(bwd))[0]


def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Model backend `flash_triton`: (batch, heads, seq, d_head) in and out; follows autocast like SDPA."""
    return flash_attention(*autocast_inputs(q, k, v), is_causal)
