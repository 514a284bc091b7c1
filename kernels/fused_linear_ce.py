"""Fused LM head + cross-entropy: the mean loss and its gradients without the (tokens x vocab) logits.

loss = mean_i [ logsumexp_j(z_ij) - z_i,y_i ] with z = H W^T, the semantics of
`raysys.model.transformer.cross_entropy(H @ W.T, y)` (max-subtracted log-sum-exp, fp32 arithmetic, mean over
positions). Shape legend: N tokens (all leading dims of `hidden` flattened), D model dim, V vocab, C rows per chunk. hidden (..., D), weight (V, D), targets (...) int64.
The gradients are computed during the forward, C tokens at a time (C = `chunk_rows(...)`, keeping the (C, V) buffer
under `MAX_CHUNK_BYTES`); backward only scales them. z and dZ are in the inputs' dtype, loss and softmax fp32, dW
accumulates in its own dtype. On CUDA a target outside [0, V) makes its row's loss NaN; on the CPU it raises
ValueError. `linear_cross_entropy` is the custom op `raysys::linear_cross_entropy` (fake kernel and autograd);
under `TRITON_INTERPRET=1` it runs on CPU tensors (fp32 / fp16). `ChunkedLinearCrossEntropy` is the same in plain
torch, for the CPU. The algorithm and its precision choices: docs/kernels.md.

    loss = linear_cross_entropy(hidden, lm_head.weight, targets)   # fp32 scalar, differentiable
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kernels.device import INTERPRET, check_runs_here, device_of

MAX_CHUNK_BYTES = 768 * 2**20
"""Budget of the one (C, V) logits buffer; with the loss rows and cuBLAS workspaces the extra memory of the op stays
under 1 GiB at N 32768, V 151936, D 4096 in bf16 (C = 2560)."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _ce_loss_grad_kernel(logits_ptr, targets_ptr, loss_ptr, stride_zc, vocab,
                         BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """One program per row of the chunk: loss_i = logsumexp(z_i) - z_i,y and, in place, z_i <- softmax(z_i) - onehot."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_zc
    target = tl.load(targets_ptr + row)
    cols = tl.arange(0, BLOCK_V)

    # 1. Online max m and sum s of exp(z - m), fp32, one read of the row; z_y picked up on the way, so the row is
    #    only written (step 2) after every read of it in this program.
    m = -float("inf")
    s = 0.0
    z_target = 0.0
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        z = tl.load(row_ptr + idx, mask=idx < vocab, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        z_target += tl.sum(tl.where(idx == target, z, 0.0), axis=0)
    log_s = tl.log(s)
    # As the reference: log(sum exp(z - max)) - (z_y - max).
    loss = log_s - (z_target - m)
    loss = tl.where((target >= 0) & (target < vocab), loss, float("nan"))
    tl.store(loss_ptr + row, loss)

    # 2. d loss_i / d z_i = softmax(z_i) - onehot(y_i); the 1/N of the mean is applied by the matmuls' alpha.
    if WRITE_GRAD:
        lse = m + log_s
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            mask = idx < vocab
            z = tl.load(row_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            grad = tl.where(idx == target, p - 1.0, p)
            tl.store(row_ptr + idx, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _kernel_config(vocab: int) -> dict:
    """Block and warps of the row kernel. Fixed, not autotuned: the kernel overwrites its input, so a tuner would
    have to clone the whole (C, V) chunk (`restore_value`) on every trial, doubling the op's memory once."""
    if INTERPRET:
        return dict(BLOCK_V=min(64, triton.next_power_of_2(vocab)), num_warps=1)
    return dict(BLOCK_V=min(4096, triton.next_power_of_2(vocab)), num_warps=8)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------
# Every buffer of the op is allocated here; the tests wrap it to prove that no (N, V) tensor is ever made.
_empty = torch.empty


def chunk_rows(num_tokens: int, vocab: int, dtype: torch.dtype, max_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Rows C of the logits buffer: as many as `max_bytes` allows (a multiple of 256 when that is >= 256, for
    full matmul tiles), at least 1, at most `num_tokens`."""
    rows = max(1, max_bytes // (vocab * dtype.itemsize))
    if rows >= 256:
        rows -= rows % 256
    return max(1, min(rows, num_tokens))


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, check_values: bool = True
                 ) -> None:
    """ValueError naming the offending shape, dtype or device, before any work; with `check_values`, CPU targets
    outside the vocab too (a data-dependent check, which a traced caller leaves to the op itself)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"hidden (..., d) {tuple(hidden.shape)} and weight (vocab, d) {tuple(weight.shape)} must be "
                         "at least 1-D and 2-D")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dim ({hidden.shape[-1]}) must equal weight's d ({weight.shape[1]}); "
                         f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if hidden.dtype not in SUPPORTED_DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one dtype of "
                         f"{', '.join(map(str, SUPPORTED_DTYPES))}")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets dtype {targets.dtype} must be torch.int64")
    if hidden.numel() == 0 or weight.shape[0] == 0:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} need at least one token, one "
                         "vocab entry and d >= 1 (the mean over zero tokens is undefined)")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and targets ({targets.device}) must be "
                         "on one device")
    check_runs_here(hidden, "kernels.fused_linear_ce")
    if hidden.device.type != "cuda":
        if check_values:
            bad = (targets < 0) | (targets >= weight.shape[0])
            if bool(bad.any()):
                raise ValueError(f"targets must lie in [0, {weight.shape[0]}) (the vocab), got "
                                 f"{targets[bad].flatten()[0].item()}")


def linear_cross_entropy_fwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             chunk_size: int | None = None, grad_hidden: bool = True, grad_weight: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss fp32 0-dim, dL/dhidden shaped like hidden or None, dL/dweight like weight or None).

    `chunk_size` rows per logits chunk (default `chunk_rows`); the gradients asked for are computed here."""
    check_inputs(hidden, weight, targets)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size ({chunk_size!r}) must be a positive int")
    vocab, dim = weight.shape
    h2 = hidden.reshape(-1, dim)
    y = targets.reshape(-1).contiguous()
    num_tokens = h2.shape[0]
    rows = min(chunk_size or chunk_rows(num_tokens, vocab, hidden.dtype), num_tokens)
    need_grad = grad_hidden or grad_weight
    inv_n = 1.0 / num_tokens
    cfg = _kernel_config(vocab)

    loss_rows = _empty((num_tokens,), dtype=torch.float32, device=hidden.device)
    logits = _empty((rows, vocab), dtype=hidden.dtype, device=hidden.device)
    dh = _empty((num_tokens, dim), dtype=hidden.dtype, device=hidden.device) if grad_hidden else None
    dw = _empty((vocab, dim), dtype=weight.dtype, device=weight.device) if grad_weight else None
    with device_of(hidden):
        for start in range(0, num_tokens, rows):
            stop = min(start + rows, num_tokens)
            h_c = h2[start:stop]
            z = logits[: stop - start]
            torch.mm(h_c, weight.t(), out=z)
            _ce_loss_grad_kernel[(stop - start,)](z, y[start:stop], loss_rows[start:stop], z.stride(0), vocab,
                                                  WRITE_GRAD=need_grad, **cfg)
            if grad_hidden:
                dh_c = dh[start:stop]
                torch.addmm(dh_c, z, weight, beta=0, alpha=inv_n, out=dh_c)
            if grad_weight:
                dw.addmm_(z.t(), h_c, beta=0 if start == 0 else 1, alpha=inv_n)
    loss = loss_rows.mean()
    return loss, (dh.view(hidden.shape) if grad_hidden else None), dw


# ----------------------------------------------------------------------------------------------------------
# Custom op (what torch.compile sees) with its fake kernel and autograd
# ----------------------------------------------------------------------------------------------------------
@torch.library.custom_op("raysys::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                             grad_hidden: bool, grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, dh, dw = linear_cross_entropy_fwd(hidden, weight, targets, chunk_size=chunk_size or None,
                                            grad_hidden=grad_hidden, grad_weight=grad_weight)
    # An op returns tensors: an empty one stands for a gradient nobody asked for.
    return loss, (dh if dh is not None else hidden.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, targets, chunk_size, grad_hidden, grad_weight):
    loss = hidden.new_empty((), dtype=torch.float32)
    return (loss, torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if grad_weight else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    _, _, _, _, grad_hidden, grad_weight = inputs
    _, dh, dw = output
    ctx.grad_hidden, ctx.grad_weight = grad_hidden, grad_weight
    # dh and dw are outputs nobody differentiates: without this autograd would hand backward a zero-filled
    # gradient for each, one more (N + V) x D buffer at the backward's peak.
    ctx.set_materialize_grads(False)
    # Eager (plain tensors): keep the gradients as the only references to their buffers, so that backward can
    # scale them in place and autograd can adopt them as .grad without a copy (a saved tensor kept alive a
    # second (V, D) buffer in backward). A traced graph (fake / functional tensors) saves them functionally.
    ctx.eager = type(dh) is torch.Tensor and type(dw) is torch.Tensor
    if ctx.eager:
        ctx.grads = [dh.detach(), dw.detach()]
    else:
        ctx.save_for_backward(dh, dw)


def _backward(ctx, grad_loss, _grad_dh, _grad_dw):
    if not ctx.eager:
        # Traced: stay functional; the compiler may reuse the saved buffers for the products.
        dh, dw = ctx.saved_tensors
        scale = grad_loss.to(dh.dtype)
        return (dh * scale if ctx.grad_hidden else None, dw * scale if ctx.grad_weight else None,
                None, None, None, None)
    if ctx.grads is None:
        raise RuntimeError("linear_cross_entropy: backward ran twice through one graph (retain_graph=True); its "
                           "gradients were computed in the forward pass and the first backward consumed them")
    (dh, dw), ctx.grads = ctx.grads, None
    scale = grad_loss.to(dh.dtype)
    # In place: backward allocates nothing.
    return (dh.mul_(scale) if ctx.grad_hidden else None, dw.mul_(scale) if ctx.grad_weight else None,
            None, None, None, None)


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (fp32 0-dim), differentiable in hidden and weight.

    hidden (..., d), weight (vocab, d), targets (...) int64; `chunk_size` overrides the rows per logits chunk."""
    check_inputs(hidden, weight, targets, check_values=False)  # the op checks the values when it runs
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size ({chunk_size!r}) must be a positive int")
    grad_on = torch.is_grad_enabled()
    loss, _, _ = _linear_cross_entropy_op(hidden, weight, targets, chunk_size or 0,
                                          grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return loss


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain torch on materialised logits, `raysys.model.transformer.cross_entropy` semantics: the test oracle (in
    fp64) and the unfused baseline. Returns the loss in the inputs' dtype, as the reference does."""
    logits = hidden @ weight.t()
    logits = logits - logits.amax(dim=-1, keepdim=True)
    log_z = torch.log(torch.exp(logits).sum(dim=-1))
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_z - target_logit).mean()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Plain-torch fused LM head + cross-entropy (the CPU's path,
    `raysys.model.transformer.linear_cross_entropy(impl="torch")`):
    `chunk` tokens at a time, logits upcast to fp32 (fp64 for fp64 inputs; max-subtracted log-sum-exp as in
    `cross_entropy`), the gradients written during forward, the weight's accumulated in its own dtype (one rounding
    per chunk in bf16, exact in fp32), as the kernel above does. Backward scales them by the upstream gradient in
    place."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        h_Nd, t_N = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        n = h_Nd.shape[0]
        grad_h = torch.empty_like(h_Nd) if hidden.requires_grad else None
        grad_w = torch.empty_like(weight) if weight.requires_grad else None
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for lo in range(0, n, chunk):
            h_cd, t_c = h_Nd[lo:lo + chunk], t_N[lo:lo + chunk]
            logits = (h_cd @ weight.t()).to(acc)
            logits -= logits.amax(dim=-1, keepdim=True)
            probs = torch.exp(logits)
            row_sum = probs.sum(dim=-1)
            total += (torch.log(row_sum) - logits.gather(-1, t_c[:, None]).squeeze(-1)).sum()
            del logits
            # d(mean loss) / d logits = (softmax - onehot(target)) / n
            probs /= row_sum[:, None]
            probs[torch.arange(len(t_c), device=probs.device), t_c] -= 1.0
            probs /= n
            g_cv = probs.to(hidden.dtype)
            del probs
            if grad_h is not None:
                torch.matmul(g_cv, weight, out=grad_h[lo:lo + chunk])
            if grad_w is not None:
                grad_w.addmm_(g_cv.t(), h_cd, beta=0 if lo == 0 else 1)
        ctx.save_for_backward(None if grad_h is None else grad_h.view_as(hidden), grad_w)
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        if torch.compiler.is_compiling():
            scale = lambda g: None if g is None else g * grad_out.to(g.dtype)
        else:  # in place: backward needs no second (vocab, d) buffer (retain_graph fails the version check)
            scale = lambda g: None if g is None else g.mul_(grad_out.to(g.dtype))
        return scale(grad_h), scale(grad_w), None, None


def linear_cross_entropy_flops(num_tokens: int, vocab: int, dim: int, mode: str = "fwd_bwd") -> float:
    """Matmul FLOPs: logits (2 N V D) forward; dH and dW (2 N V D each) backward, here done in the forward pass."""
    if mode not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"mode {mode!r} must be one of fwd, bwd, fwd_bwd")
    per_matmul = 2.0 * num_tokens * vocab * dim
    return per_matmul * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode]
