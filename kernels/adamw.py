"""Fused AdamW: the reference `raysys.model.transformer.AdamW` update of every parameter in one launch per
(device, dtype).

Per parameter, step t from 1 (state `t`, `m`, `v` as the reference keeps them, in the parameter's dtype):
p <- p - lr wd p; m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; p <- p - alpha_t m / (sqrt(v) + eps),
alpha_t = lr sqrt(1 - b2^t) / (1 - b1^t); t <- t + 1. Shape legend: T tensors in a launch, K chunks.
Exactness: the kernel repeats the reference's operations in its order, rounding to the parameter dtype after each
and fusing where the device's ATen kernels fuse (`ATEN_CUDA`): fp32 results are bitwise the reference's on CUDA.
Parameters the kernel cannot take (CPU without `TRITON_INTERPRET=1`, non-contiguous, dtype other than fp32 / bf16 /
fp16, grad of another dtype) run the reference's torch ops; `FusedAdamW.label` / `optimizer_label` say which ran.
The launch is the custom op `raysys::fused_adamw_`, so a compiled step keeps it whole. `ForeachAdamW` is the same
update through torch's `_foreach_` ops, for the CPU. Multi-tensor apply and exactness in full: docs/kernels.md.

    opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1); loss.backward(); opt.step()
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl

from kernels.device import INTERPRET, device_of

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_SCALARS = 7  # decay, b1, 1-b1, b2, 1-b2, eps, -alpha_t (fp32, per tensor)


# ----------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _rnd(x, DTYPE: tl.constexpr, ROUND: tl.constexpr):
    """x rounded to the parameter dtype (what an in-place op on a 16-bit tensor stores), back in fp32."""
    if ROUND:
        x = x.to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _adamw_math(p, g, m, v, decay, b1, omb1, b2, omb2, eps, neg_alpha,
                DTYPE: tl.constexpr, ROUND: tl.constexpr, ATEN_CUDA: tl.constexpr):
    # 1. p.add_(p, alpha=-lr*wd): both ATen kernels compute fma(other, alpha, self).
    p = _rnd(tl.fma(p, decay, p), DTYPE, ROUND)
    # 2. m.mul_(b1).add_(g, alpha=1-b1)
    m = _rnd(m * b1, DTYPE, ROUND)
    m = _rnd(tl.fma(g, omb1, m), DTYPE, ROUND)
    # 3. v.mul_(b2).addcmul_(g, g, value=1-b2)
    v = _rnd(v * b2, DTYPE, ROUND)
    if ATEN_CUDA:
        v = _rnd(tl.fma(omb2, g * g, v), DTYPE, ROUND)
    else:
        v = _rnd(tl.fma(omb2 * g, g, v), DTYPE, ROUND)
    # 4. denom = v.sqrt().add_(eps)
    d = _rnd(tl.sqrt_rn(v), DTYPE, ROUND)
    d = _rnd(d + eps, DTYPE, ROUND)
    # 5. p.addcdiv_(m, denom, value=-alpha_t)
    if ATEN_CUDA:
        p = _rnd(tl.fma(neg_alpha, tl.div_rn(m, d), p), DTYPE, ROUND)
    else:
        p = _rnd(p + tl.div_rn(neg_alpha * m, d), DTYPE, ROUND)
    return p, m, v


@triton.jit
def _adamw_block(base_ptr, off_p, off_g, off_m, off_v, idx, numel, decay, b1, omb1, b2, omb2, eps, neg_alpha,
                 MASKED: tl.constexpr, ROUND: tl.constexpr, ATEN_CUDA: tl.constexpr):
    dtype = base_ptr.dtype.element_ty
    mask = idx < numel
    if MASKED:
        p = tl.load(base_ptr + off_p + idx, mask=mask).to(tl.float32)
        g = tl.load(base_ptr + off_g + idx, mask=mask).to(tl.float32)
        m = tl.load(base_ptr + off_m + idx, mask=mask).to(tl.float32)
        v = tl.load(base_ptr + off_v + idx, mask=mask, other=1.0).to(tl.float32)  # no 0/0 in dead lanes
    else:
        p = tl.load(base_ptr + off_p + idx).to(tl.float32)
        g = tl.load(base_ptr + off_g + idx).to(tl.float32)
        m = tl.load(base_ptr + off_m + idx).to(tl.float32)
        v = tl.load(base_ptr + off_v + idx).to(tl.float32)
    p, m, v = _adamw_math(p, g, m, v, decay, b1, omb1, b2, omb2, eps, neg_alpha, dtype, ROUND, ATEN_CUDA)
    if MASKED:
        tl.store(base_ptr + off_p + idx, p.to(dtype), mask=mask)
        tl.store(base_ptr + off_m + idx, m.to(dtype), mask=mask)
        tl.store(base_ptr + off_v + idx, v.to(dtype), mask=mask)
    else:
        tl.store(base_ptr + off_p + idx, p.to(dtype))
        tl.store(base_ptr + off_m + idx, m.to(dtype))
        tl.store(base_ptr + off_v + idx, v.to(dtype))


@triton.jit
def _adamw_kernel(base_ptr, offsets_ptr, scalars_ptr, numels_ptr, chunk_tensor_ptr, chunk_index_ptr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, ROUND: tl.constexpr,
                  ATEN_CUDA: tl.constexpr):
    """Program k updates chunk k of the table: elements [c * CHUNK, (c + 1) * CHUNK) of tensor i."""
    pid = tl.program_id(0)
    i = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
    c = tl.load(chunk_index_ptr + pid).to(tl.int64)
    numel = tl.load(numels_ptr + i)
    # 1. Where tensor i's p, g, m, v lie (elements from base_ptr; ALIGN-element aligned when the host says so).
    off_p = tl.multiple_of(tl.load(offsets_ptr + 4 * i), ALIGN)
    off_g = tl.multiple_of(tl.load(offsets_ptr + 4 * i + 1), ALIGN)
    off_m = tl.multiple_of(tl.load(offsets_ptr + 4 * i + 2), ALIGN)
    off_v = tl.multiple_of(tl.load(offsets_ptr + 4 * i + 3), ALIGN)
    # 2. Its hyper-parameters, already in the form the reference's ops use them.
    decay = tl.load(scalars_ptr + 7 * i)
    b1 = tl.load(scalars_ptr + 7 * i + 1)
    omb1 = tl.load(scalars_ptr + 7 * i + 2)
    b2 = tl.load(scalars_ptr + 7 * i + 3)
    omb2 = tl.load(scalars_ptr + 7 * i + 4)
    eps = tl.load(scalars_ptr + 7 * i + 5)
    neg_alpha = tl.load(scalars_ptr + 7 * i + 6)
    # 3. The chunk, BLOCK elements at a time; only a tensor's last block is masked.
    for step in range(0, CHUNK, BLOCK):
        start = c * CHUNK + step
        idx = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            _adamw_block(base_ptr, off_p, off_g, off_m, off_v, idx, numel, decay, b1, omb1, b2, omb2, eps,
                         neg_alpha, False, ROUND, ATEN_CUDA)
        elif start < numel:
            _adamw_block(base_ptr, off_p, off_g, off_m, off_v, idx, numel, decay, b1, omb1, b2, omb2, eps,
                         neg_alpha, True, ROUND, ATEN_CUDA)


def _launch_config(device: torch.device) -> dict:
    """CHUNK elements per program and BLOCK per step: 2048 bf16 elements over 8 warps are one 16-byte vector per
    thread per tensor; tiny ones under the interpreter, so that tests cross chunk and block edges."""
    if device.type != "cuda":
        return dict(CHUNK=64, BLOCK=16, num_warps=1)
    return dict(CHUNK=65536, BLOCK=2048, num_warps=8)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------
_CHUNK_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_MAX_CACHED_TABLES = 8


def _chunk_tables(numels: tuple[int, ...], chunk: int, device: torch.device):
    """(numels int64 [T], tensor of each chunk int32 [K], chunk index within it int32 [K]) on `device`, cached: they
    depend only on the parameters' sizes, which a training run keeps."""
    key = (numels, chunk, str(device))
    if key not in _CHUNK_TABLES:
        if len(_CHUNK_TABLES) >= _MAX_CACHED_TABLES:
            _CHUNK_TABLES.pop(next(iter(_CHUNK_TABLES)))
        counts = torch.tensor([triton.cdiv(n, chunk) for n in numels], dtype=torch.int64)
        tensor_of = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        index_in = (torch.arange(int(counts.sum()), dtype=torch.int64) - first).to(torch.int32)
        _CHUNK_TABLES[key] = (torch.tensor(numels, dtype=torch.int64).to(device), tensor_of.to(device),
                              index_in.to(device))
    return _CHUNK_TABLES[key]


class _HostStaging:
    """Pinned host buffers for the per-step tables of one device, reused once their last copy has finished."""

    def __init__(self):
        self.offsets = self.scalars = None
        self.done = None

    def upload(self, offsets: torch.Tensor, scalars: torch.Tensor, device: torch.device):
        if self.done is not None:
            self.done.synchronize()  # the previous step's copy out of these buffers has finished
        if self.offsets is None or self.offsets.numel() < offsets.numel():
            self.offsets = torch.empty(offsets.numel(), dtype=torch.int64, pin_memory=True)
            self.scalars = torch.empty(scalars.numel(), dtype=torch.float32, pin_memory=True)
            self.done = torch.cuda.Event()
        host_off, host_sc = self.offsets[: offsets.numel()], self.scalars[: scalars.numel()]
        host_off.copy_(offsets.flatten())
        host_sc.copy_(scalars.flatten())
        dev = host_off.to(device, non_blocking=True), host_sc.to(device, non_blocking=True)
        self.done.record()
        return dev


_STAGING: dict[str, _HostStaging] = {}


def kernel_can_take(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether `_adamw_kernel` can update p (else the reference's ops do): contiguous, a kernel dtype, grad of the
    same dtype, and a device it runs on (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    return (p.dtype in KERNEL_DTYPES and g.dtype == p.dtype and p.is_contiguous() and g.is_contiguous()
            and (p.device.type == "cuda" or (p.device.type == "cpu" and INTERPRET)))


def fused_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], scalars: torch.Tensor) -> None:
    """Update params, exp_avgs, exp_avg_sqs in place with one `_adamw_kernel` launch; `scalars` (T, 7) fp32 CPU holds
    each tensor's decay, b1, 1-b1, b2, 1-b2, eps, -alpha_t. All tensors contiguous, of one dtype and device."""
    if not params:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(x) for x in lists}) != 1 or scalars.shape != (len(params), NUM_SCALARS):
        raise ValueError(f"params, grads, exp_avgs, exp_avg_sqs ({[len(x) for x in lists]}) must have one length T "
                         f"and scalars {tuple(scalars.shape)} the shape (T, {NUM_SCALARS})")
    base = params[0]
    for p, g, m, v in zip(*lists):
        if not kernel_can_take(p, g) or {t.dtype for t in (m, v)} != {p.dtype} or not (m.is_contiguous() and
                                                                                       v.is_contiguous()):
            raise ValueError(f"fused_adamw_step takes contiguous tensors of one dtype in {KERNEL_DTYPES} on CUDA (or the "
                             f"CPU under TRITON_INTERPRET=1); got param {p.dtype} {tuple(p.shape)} on {p.device}, "
                             f"grad {g.dtype}, m {m.dtype}, v {v.dtype}")
        if p.dtype != base.dtype or p.device != base.device or any(t.numel() != p.numel() for t in (g, m, v)):
            raise ValueError(f"one launch needs one dtype and device and matching sizes: param {p.dtype} "
                             f"{tuple(p.shape)} on {p.device} vs {base.dtype} on {base.device}, grad "
                             f"{tuple(g.shape)}, m {tuple(m.shape)}, v {tuple(v.shape)}")
    itemsize = base.element_size()
    base_addr = base.data_ptr()
    addrs = [t.data_ptr() for p, g, m, v in zip(*lists) for t in (p, g, m, v)]
    offsets = torch.tensor([(a - base_addr) // itemsize for a in addrs], dtype=torch.int64)
    align = 16 // itemsize if all(a % 16 == 0 for a in addrs) else 1
    cfg = _launch_config(base.device)
    numels, tensor_of, index_in = _chunk_tables(tuple(p.numel() for p in params), cfg["CHUNK"], base.device)
    scalars = scalars.to(torch.float32)
    if base.device.type == "cuda":
        offsets, scalars = _STAGING.setdefault(str(base.device), _HostStaging()).upload(offsets, scalars, base.device)
    with device_of(base):
        _adamw_kernel[(tensor_of.numel(),)](base, offsets, scalars, numels, tensor_of, index_in, ALIGN=align,
                                            ROUND=base.dtype != torch.float32, ATEN_CUDA=base.device.type == "cuda",
                                            enable_fp_fusion=False, **cfg)


# The op the compiler sees: it mutates the parameters and both moments, returns nothing.
@torch.library.custom_op("raysys::fused_adamw_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _fused_adamw_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], scalars: torch.Tensor) -> None:
    fused_adamw_step(params, grads, exp_avgs, exp_avg_sqs, scalars)


@_fused_adamw_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, scalars):
    return None


def _reference_update(p, g, m, v, t, lr, b1, b2, eps, wd) -> None:
    """The reference's own ops, for a parameter the kernel cannot take."""
    p.add_(p, alpha=-lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    alpha_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    p.addcdiv_(m, v.sqrt().add_(eps), value=-alpha_t)


def _as_dtype(x: float, dtype: torch.dtype) -> float:
    return torch.tensor(x, dtype=torch.float64).to(dtype).item()


def step_scalars(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, t: int,
                 dtype: torch.dtype, device: torch.device) -> list[float]:
    """A tensor's seven kernel scalars, computed in double as the reference's Python does; ATen's CPU add casts its
    alpha to a 16-bit tensor's dtype, its CUDA add keeps it fp32 (the kernel's rounding of each to fp32 is C++'s)."""
    b1, b2 = betas
    decay, omb1 = -lr * weight_decay, 1 - b1
    if device.type != "cuda" and dtype != torch.float32:
        decay, omb1 = _as_dtype(decay, dtype), _as_dtype(omb1, dtype)
    alpha_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return [decay, b1, omb1, b2, 1 - b2, eps, -alpha_t]


# ----------------------------------------------------------------------------------------------------------
# Optimizer
# ----------------------------------------------------------------------------------------------------------
class _AdamWBase(torch.optim.Optimizer):
    """`raysys.model.transformer.AdamW`'s hyper-parameters, defaults, input checks and state (`t`, `m`, `v`)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        if not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(f"lr ({lr!r}) must be a number >= 0")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas ({betas!r}) must be two numbers in [0, 1)")
        if not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps ({eps!r}) must be a number >= 0")
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ValueError(f"weight_decay ({weight_decay!r}) must be a number >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["t"] = 1
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


class FusedAdamW(_AdamWBase):
    """AdamW with `raysys.model.transformer.AdamW`'s semantics, defaults and state (`t`, `m`, `v`), one launch per
    device/dtype.
    `paths` is what updated the parameters in the last step ({'kernel', 'reference'}; before the first step, what
    will for parameters whose gradient matches them); `label` names it for a result row."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        # The paths the last step with gradients took, as a dict that `step` updates in place: torch.compile
        # traces a dict's mutation but not (torch 2.11) an attribute set on the optimizer.
        self._ran: dict[str, bool] = {}

    @property
    def paths(self) -> set[str]:
        if self._ran:
            return set(self._ran)
        return {"kernel" if kernel_can_take(p, p) else "reference"
                for group in self.param_groups for p in group["params"] if p.requires_grad}

    @property
    def label(self) -> str:
        """`FusedAdamW` when the kernel updates every parameter, else `FusedAdamW[reference]` or
        `FusedAdamW[kernel+reference]`: what ran, not only what was asked for."""
        paths = self.paths
        return "FusedAdamW" if paths <= {"kernel"} else f"FusedAdamW[{'+'.join(sorted(paths))}]"

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        launches: dict[tuple, tuple[list, list, list, list, list]] = {}
        ran: dict[str, bool] = {}
        for group in self.param_groups:
            lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise ValueError(f"FusedAdamW does not take sparse gradients (param {tuple(p.shape)})")
                state = self._state(p)
                t, m, v = state["t"], state["m"], state["v"]
                if kernel_can_take(p, g) and m.is_contiguous() and v.is_contiguous() and m.dtype == v.dtype == p.dtype:
                    lists = launches.setdefault((p.device, p.dtype), ([], [], [], [], []))
                    for lst, x in zip(lists, (p, g, m, v, step_scalars(lr, betas, eps, wd, t, p.dtype, p.device))):
                        lst.append(x)
                    ran["kernel"] = True
                else:
                    _reference_update(p, g, m, v, t, lr, betas[0], betas[1], eps, wd)
                    ran["reference"] = True
                state["t"] = t + 1
        for ps, gs, ms, vs, scalars in launches.values():
            _fused_adamw_op(ps, gs, ms, vs, torch.tensor(scalars, dtype=torch.float64).to(torch.float32))
        if ran:  # a step without gradients changes nothing, nor what the last one ran
            self._ran.clear()
            self._ran.update(ran)
        return loss


def optimizer_label(*optimizers: torch.optim.Optimizer) -> str:
    """What a row's `optimizer_class` says: the class name, for `FusedAdamW` with what updated the parameters (its
    `label`). Several optimizers (one per parameter, as an optimizer stepped in backward holds them) give one label
    when they share a class."""
    names = {type(o).__name__ for o in optimizers}
    if len(names) != 1:
        raise ValueError(f"optimizer_label takes optimizers of one class, got {sorted(names)}")
    if not isinstance(optimizers[0], FusedAdamW):
        return names.pop()
    paths = set().union(*(o.paths for o in optimizers))
    return "FusedAdamW" if paths <= {"kernel"} else f"FusedAdamW[{'+'.join(sorted(paths))}]"


class ForeachAdamW(_AdamWBase):
    """`raysys.model.transformer.AdamW` (same semantics, defaults and state) with torch's multi-tensor `_foreach_`
    ops: the kernel's plain-torch counterpart (the CPU's fast optimizer). One launch per operation over a chunk of
    parameters (at most `chunk_bytes` of them, so the sqrt(v) temporaries stay bounded) instead of one per operation
    per parameter. Parameters with the same step count, device and dtype
    are updated together; each element sees exactly the reference's arithmetic."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, chunk_bytes: int = 2**30):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes ({chunk_bytes}) must be >= 1")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.chunk_bytes = chunk_bytes

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            same: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                same.setdefault((state["t"], p.device, p.dtype), []).append(p)
            for (t, _, _), params in same.items():
                alpha_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                for chunk in _byte_chunks(params, self.chunk_bytes):
                    ps, gs = chunk, [p.grad for p in chunk]
                    ms, vs = [self.state[p]["m"] for p in chunk], [self.state[p]["v"] for p in chunk]
                    torch._foreach_add_(ps, ps, alpha=-lr * wd)
                    torch._foreach_mul_(ms, b1)
                    torch._foreach_add_(ms, gs, alpha=1 - b1)
                    torch._foreach_mul_(vs, b2)
                    torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
                    denom = torch._foreach_sqrt(vs)
                    torch._foreach_add_(denom, eps)
                    torch._foreach_addcdiv_(ps, ms, denom, value=-alpha_t)
                    del denom
                for p in params:
                    self.state[p]["t"] = t + 1
        return loss


def _byte_chunks(params: list[torch.Tensor], chunk_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive runs of `params` of at most `chunk_bytes` each (a larger tensor is a run of its own)."""
    run, size = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if run and size + nbytes > chunk_bytes:
            yield run
            run, size = [], 0
        run.append(p)
        size += nbytes
    if run:
        yield run


def adamw_bytes(numel: int, itemsize: int) -> int:
    """Fewest bytes one step moves: read p, g, m, v and write p, m, v."""
    return 7 * numel * itemsize
