"""Fully sharded data parallel (FSDP, ZeRO stage 3) for a whole model: just-in-time weight all-gathers with
prefetch, compute-dtype communication, asynchronous fp32 gradient reduce-scatters (handout section 7).

What is sharded. The `weight` of every Linear and Embedding module (torch's `nn.Linear` / `nn.Embedding`, or any
module class named `Linear` / `Embedding`, which covers `raysys.model` and `cs336_basics`; `parallel/` never
imports raysys). A weight of shape (R, *rest) is zero-padded to N * ceil(R / N) rows and split along dim 0: rank r
keeps rows [r * ceil(R/N), (r+1) * ceil(R/N)) as an fp32 `nn.Parameter` that replaces the module's `weight`, so
`fsdp.parameters()` hands the optimizer the shards (master weights and updates stay fp32; padding rows have zero
gradient and stay zero under SGD / AdamW). Every other parameter (norm weights, biases) is replicated.

Unit of gathering: one wrapped module ("layer") = one all-gather in forward, one in backward (skipped for
embeddings, whose backward is a scatter-add of the output gradient that never reads the weight) and one
reduce-scatter. The gathered weight lives in a per-layer buffer whose storage is allocated (`resize_`) just
before the all-gather and released (`resize_(0)`) right after use; autograd keeps referring to the same tensor,
so the backward's re-gather refills what the saved graph reads.

Forward, per layer i in execution order:
    pre-hook   wait for (or issue) all-gather(i); swap the full weight into the module
    post-hook  swap the shard back; free the full weight; issue all-gather(i + 2)      <- prefetch
so the all-gather of layer i starts only once layer i - 2 has finished its forward pass (layers 0 and 1 start
with the forward itself), at most three full weights are alive, and each gather overlaps the compute of the
layer before it. The order is the one the previous forward executed (the first forward gathers on demand).
Backward, per layer (the pre-hook is a hook on the layer's output gradient, the post-hook a post-accumulate-grad
hook on the full weight):
    pre-hook   issue all-gather(i) if not prefetched; issue all-gather of the next layer backward needs
               (reverse forward order); wait for all-gather(i)
    post-hook  cast the gradient to fp32, issue reduce-scatter(SUM) into this rank's shard; free the weight
Replicated parameters (norm weights, biases: a few KB per block) are all-reduced (SUM) as one flattened tensor
in `finish_gradient_synchronization()`: one small collective after backward instead of one per parameter queued
between the weights' all-gathers and reduce-scatters.

With `compute_dtype`, each shard is cast before the all-gather (half the bytes of fp32), the full weight,
biases and floating inputs of wrapped modules are in that dtype, and so is compute; gradients are cast back to
fp32 before the reduce-scatter. Other modules (norms) see the dtype their inputs arrive in.

Invariant: after `finish_gradient_synchronization()`, every shard's `.grad` (fp32, shard shape) equals its
rows of (sum over ranks of the local full-weight gradients) / N, and every replicated parameter's `.grad` is
(sum over ranks) / N, bit-identical on all ranks. The sum over two ranks is a single fp32 add (commutative)
and / 2 is exact, so with N = 2 and fp32 compute one step equals, bit for bit, a single process that computes
the two per-slice gradients and averages them as (g0 + g1) / 2.

Gradient accumulation: several forward/backward passes may run before one `finish_gradient_synchronization()`;
their gradients add up (each pass's reduce-scatters are summed), and finish averages over the ranks, so the
result is the sum over passes of the rank-averaged gradients, as without FSDP.

Requirements (as torch's FSDP): every rank runs the same wrapped layers in the same order and produces gradients
for the same parameters (collectives are matched by issue order); no weight tying between wrapped modules;
wrapped layers are not recomputed by activation checkpointing.

Lifetime: a full weight's post-accumulate-grad hooks live in a dict held from C++ (the tensor's autograd
metadata), out of sight of Python's cycle collector, so a hook holding the wrapper would make full weight -> hook
-> wrapper -> layer -> full weight a cycle that is never freed, leaking the model and its optimizer state with
every dropped wrapper (and the module hooks would make wrapper -> model -> hooks -> wrapper a cycle only the
collector frees). So every hook, module or tensor, holds the wrapper weakly and names its layer by index, and a
layer holds no reference to its wrapper: a wrapper nobody references is freed at once by reference counting, and
its hooks are removed with it; `remove_hooks()` does the same explicitly. The model's sharded modules keep their
shards as `weight` either way (`gather_full_params()` first to get the full weights back).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.ddp import broadcast_module_state

__all__ = ["FSDP", "CastForCompute", "CommStats", "is_sharded_module"]

# torch 2.13 renames the single-tensor collectives and deprecates the old names (a FutureWarning per call).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FREE, _GATHERING, _READY = "free", "gathering", "ready"


def is_sharded_module(module: nn.Module) -> bool:
    """Whether FSDP shards this module's weight: Linear / Embedding (torch's or any class with that name)."""
    named = type(module).__name__ in ("Linear", "Embedding") or isinstance(module, (nn.Linear, nn.Embedding))
    return named and isinstance(getattr(module, "weight", None), nn.Parameter)


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or type(module).__name__ == "Embedding"


def _cast_params(module: nn.Module, dtype: torch.dtype, skip: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
    """Put differentiable `dtype` casts of `module`'s own floating parameters in their place; return the originals
    (gradients flow through the casts back to them)."""
    saved = {}
    for name, p in module._parameters.items():
        if name not in skip and p is not None and p.is_floating_point() and p.dtype != dtype:
            saved[name] = p
            module._parameters[name] = p.to(dtype)
    return saved


def _cast_inputs(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


@dataclass
class CommStats:
    """Collectives issued and bytes moved since the last `reset()`; bytes count the full tensor (S of handout 8.1)."""

    all_gathers: int = 0
    all_gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    all_reduces: int = 0
    all_reduce_bytes: int = 0
    forward_wait_s: float = 0.0
    """Host time blocked on all-gathers in forward: the compute stall on gloo; ~0 on NCCL (waits are stream-ordered)."""
    backward_wait_s: float = 0.0
    """The same in backward."""
    peak_gathered_bytes: int = 0
    """Largest total size of gathered (full) weights alive at once."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


class _ShardedLayer:
    """One wrapped module: its fp32 shard (the optimizer's parameter) and its full compute-dtype weight buffer.

    Holds no reference to its wrapper (see Lifetime in the module docstring): the wrapper passes itself to the
    methods that communicate or count."""

    def __init__(self, fsdp: "FSDP", index: int, name: str, module: nn.Module):
        weight = module.weight
        n, rank = fsdp.world_size, fsdp.rank
        self.index, self.name, self.module = index, name, module
        self.shape, self.numel = weight.shape, weight.numel()
        self.rows_per_rank = math.ceil(self.shape[0] / n)
        self.shard_numel = self.rows_per_rank * (self.numel // max(self.shape[0], 1))
        with torch.no_grad():
            padded = weight.new_zeros((n * self.rows_per_rank, *self.shape[1:]))
            padded[: self.shape[0]] = weight
            shard = padded[rank * self.rows_per_rank:(rank + 1) * self.rows_per_rank].clone()
        self.shard = nn.Parameter(shard, requires_grad=weight.requires_grad)
        dtype = fsdp.compute_dtype or weight.dtype
        # The full weight is a leaf of its own (autograd accumulates its gradient); `_flat` is a second tensor on
        # the same storage, padded to N shards, that the all-gather writes. A separate tensor, so the collective's
        # in-place write does not bump the version counter of the weight the autograd graph has saved.
        self.full = nn.Parameter(torch.empty(n * self.shard_numel, dtype=dtype, device=weight.device)[: self.numel]
                                 .view(self.shape), requires_grad=weight.requires_grad)
        self._flat = torch.empty(0, dtype=dtype, device=weight.device).set_(
            self.full.untyped_storage(), 0, (n * self.shard_numel,), (1,))
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.needs_weight_in_backward = not _is_embedding(module)
        self.state = _FREE
        self._work: dist.Work | None = None
        self._send: torch.Tensor | None = None
        self.reduced_grad: torch.Tensor | None = None  # this rank's summed shard gradient, until finish
        self.backward_done = False
        self.fwd_pos = -1
        self.saved_params: dict[str, Any] = {}

    def start_gather(self, fsdp: "FSDP", phase: str) -> None:
        if self.state != _FREE:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        # Cast before communicating: in compute_dtype the all-gather moves half the bytes of fp32.
        self._send = self.shard.detach().to(self._flat.dtype).reshape(-1)
        self._work = _all_gather(self._flat, self._send, group=fsdp.process_group, async_op=True)
        self.state = _GATHERING
        fsdp.stats.all_gathers += 1
        fsdp.stats.all_gather_bytes += self.nbytes
        fsdp._gathered_bytes += self.nbytes
        fsdp.stats.peak_gathered_bytes = max(fsdp.stats.peak_gathered_bytes, fsdp._gathered_bytes)
        fsdp._log("all_gather", self.name, phase)

    def wait_gather(self, stats: CommStats | None = None, phase: str | None = None) -> None:
        """Wait for the issued all-gather; with `stats`, add the blocked time to `stats.<phase>_wait_s`."""
        if self.state == _GATHERING:
            start = time.perf_counter()
            self._work.wait()
            if stats is not None:
                setattr(stats, f"{phase}_wait_s", getattr(stats, f"{phase}_wait_s") + time.perf_counter() - start)
            self._work, self._send, self.state = None, None, _READY

    def free(self, fsdp: "FSDP") -> None:
        if self.state == _FREE:
            return
        self.wait_gather()  # never release memory a collective may still write
        self.full.untyped_storage().resize_(0)
        self.state = _FREE
        fsdp._gathered_bytes -= self.nbytes


class _WeakHook:
    """A module or tensor hook that calls `method(wrapper, *hook_args)` (with `index`: `method(wrapper,
    wrapper._layers[index], *hook_args)`) while the wrapper is alive, and does nothing once it is gone. Holds nothing
    else (see Lifetime in the module docstring)."""

    __slots__ = ("owner", "method", "index")

    def __init__(self, owner: weakref.ref, method: Callable[..., Any], index: int | None = None):
        self.owner, self.method, self.index = owner, method, index

    def __call__(self, *args: Any) -> Any:
        wrapper = self.owner()
        if wrapper is None:
            return None
        if self.index is None:
            return self.method(wrapper, *args)
        return self.method(wrapper, wrapper._layers[self.index], *args)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class _PendingOp:
    """An issued async gradient collective and what to do once it has completed; holds its buffers until then."""

    __slots__ = ("work", "on_done", "buffers")

    def __init__(self, work: dist.Work, on_done: Callable[[], None], *buffers: torch.Tensor):
        self.work, self.on_done, self.buffers = work, on_done, buffers

    def complete(self) -> None:
        self.work.wait()
        self.on_done()
        self.buffers = ()


class FSDP(nn.Module):
    """Shard every Linear / Embedding weight of `module` over `process_group`; see the module docstring.

    Args:
        module: the whole model, identical on every rank (rank 0's values are broadcast at construction).
        compute_dtype: dtype of communicated weights and of compute (e.g. torch.bfloat16); None keeps fp32.
        process_group: the data-parallel group (default: the whole world).
        max_inflight_reductions: gradient reduce-scatters allowed in flight before the oldest is waited for;
            bounds the fp32 full-size gradient buffers alive during backward.
        event_log: if a list, ("all_gather" | "reduce_scatter", layer name, "forward" | "backward") tuples are
            appended as collectives are issued (for tests of the prefetch rule).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 process_group: dist.ProcessGroup | None = None, *, max_inflight_reductions: int = 2,
                 event_log: list | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype ({compute_dtype!r}) must be a floating-point torch.dtype or None")
        if max_inflight_reductions < 1:
            raise ValueError(f"max_inflight_reductions ({max_inflight_reductions}) must be >= 1")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("FSDP needs an initialised torch.distributed process group (init_process_group first)")
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.max_inflight_reductions = max_inflight_reductions
        self.stats = CommStats()
        self._event_log = event_log
        self._gathered_bytes = 0
        broadcast_module_state(module, process_group)

        self._layers: list[_ShardedLayer] = []
        self._owner = weakref.ref(self)  # what hooks hold (see Lifetime in the module docstring)
        self._hooks_removed = False
        sharded = [(mod_name, mod) for mod_name, mod in module.named_modules() if is_sharded_module(mod)]
        sharded_ids = set()
        for mod_name, mod in sharded:  # all checked before the model is touched
            if id(mod.weight) in sharded_ids:
                raise ValueError(f"{mod_name}.weight is shared with another Linear/Embedding (tied weights are not "
                                 "supported by FSDP)")
            sharded_ids.add(id(mod.weight))
        handles = []
        for mod_name, mod in sharded:
            layer = _ShardedLayer(self, len(self._layers), f"{mod_name}.weight" if mod_name else "weight", mod)
            mod._parameters["weight"] = layer.shard
            self._layers.append(layer)
            handles.append(mod.register_forward_pre_hook(_WeakHook(self._owner, FSDP._pre_forward, layer.index)))
            handles.append(mod.register_forward_hook(_WeakHook(self._owner, FSDP._post_forward, layer.index)))
            if layer.full.requires_grad:
                handles.append(layer.full.register_post_accumulate_grad_hook(
                    _WeakHook(self._owner, FSDP._post_backward, layer.index)))
        # Runs remove_hooks' work when the wrapper is collected (or when remove_hooks() calls it).
        self._remove_handles = weakref.finalize(self, _remove_handles, handles)
        self._layer_of_shard = {id(layer.shard): layer for layer in self._layers}
        self._replicated = [p for p in module.parameters() if id(p) not in self._layer_of_shard and p.requires_grad]
        self._pending: deque[_PendingOp] = deque()
        self._fwd_calls: list[_ShardedLayer] = []
        self._last_order: list[_ShardedLayer] = []
        self._reduce_scatter_ok = self._probe_reduce_scatter()

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks_removed:
            raise RuntimeError("this FSDP wrapper's hooks were removed (remove_hooks()): its modules hold only this "
                               "rank's weight shards; gather_full_params() returns the full weights")
        self._fwd_calls = []
        for layer in self._layers:
            layer.backward_done = False
        for layer in self._last_order[:2]:  # no layer runs two before these
            layer.start_gather(self, "forward")
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            for layer in self._layers:
                self._restore(layer)
            self._free_all()
            raise
        self._free_all()  # prefetched but not used by this forward (control flow changed)
        self._last_order = self._fwd_calls
        for pos, layer in enumerate(self._fwd_calls):
            layer.fwd_pos = pos
        return out

    def _pre_forward(self, layer: _ShardedLayer, module: nn.Module, args: tuple) -> tuple | None:
        self._fwd_calls.append(layer)
        layer.start_gather(self, "forward")
        layer.wait_gather(self.stats, "forward")
        module._parameters["weight"] = layer.full
        if self.compute_dtype is None:
            return None
        layer.saved_params = _cast_params(module, self.compute_dtype, skip=("weight",))
        return _cast_inputs(args, self.compute_dtype)

    def _post_forward(self, layer: _ShardedLayer, module: nn.Module, args: tuple, output: Any) -> None:
        self._restore(layer)
        layer.free(self)
        if (layer.needs_weight_in_backward and torch.is_grad_enabled() and isinstance(output, torch.Tensor)
                and output.requires_grad):
            output.register_hook(_WeakHook(self._owner, FSDP._pre_backward, layer.index))
        pos = len(self._fwd_calls) - 1
        if pos + 2 < len(self._last_order):
            self._last_order[pos + 2].start_gather(self, "forward")

    def _restore(self, layer: _ShardedLayer) -> None:
        module = layer.module
        module._parameters["weight"] = layer.shard
        module._parameters.update(layer.saved_params)
        layer.saved_params = {}

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, layer: _ShardedLayer, grad: torch.Tensor) -> None:
        layer.start_gather(self, "backward")
        nxt = self._next_backward_layer(layer)
        if nxt is not None:
            nxt.start_gather(self, "backward")
        layer.wait_gather(self.stats, "backward")

    def _next_backward_layer(self, layer: _ShardedLayer) -> _ShardedLayer | None:
        """The closest layer before `layer` in forward order that backward has yet to run and that needs its weight."""
        for pos in range(layer.fwd_pos - 1, -1, -1):
            cand = self._last_order[pos]
            if cand.needs_weight_in_backward and not cand.backward_done and cand.full.requires_grad:
                return cand if cand.state == _FREE else None
        return None

    def _post_backward(self, layer: _ShardedLayer, full: torch.Tensor) -> None:
        grad, full.grad = full.grad, None
        layer.backward_done = True
        layer.free(self)
        n = self.world_size
        padded = n * layer.shard_numel
        if grad.dtype == torch.float32 and padded == layer.numel and grad.is_contiguous():
            send = grad.view(-1)
        else:  # fp32 for the reduction, zero padding rows
            send = torch.empty(padded, dtype=torch.float32, device=grad.device)
            send[: layer.numel].copy_(grad.reshape(-1))
            send[layer.numel:].zero_()
        del grad
        if self._reduce_scatter_ok:
            out = torch.empty(layer.shard_numel, dtype=torch.float32, device=send.device)
            work = _reduce_scatter(out, send, group=self.process_group, async_op=True)
        else:  # gloo without reduce-scatter: all-reduce the whole gradient, keep this rank's slice
            out = send.narrow(0, self.rank * layer.shard_numel, layer.shard_numel)
            work = dist.all_reduce(send, group=self.process_group, async_op=True)
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += send.numel() * send.element_size()
        self._log("reduce_scatter", layer.name, "backward")
        self._pending.append(_PendingOp(work, partial(self._store_shard_grad, layer, out), send, out))
        while len(self._pending) > self.max_inflight_reductions:  # frees the oldest full-size gradient buffer
            self._pending.popleft().complete()

    @staticmethod
    def _store_shard_grad(layer: _ShardedLayer, summed: torch.Tensor) -> None:
        layer.reduced_grad = summed if layer.reduced_grad is None else layer.reduced_grad.add_(summed)

    def _all_reduce_replicated(self) -> None:
        """Average the replicated gradients: one flattened all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._replicated:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(self.world_size)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
            self.stats.all_reduces += 1
            self.stats.all_reduce_bytes += flat.numel() * flat.element_size()

    # ------------------------------------------------------------------ public API
    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters, all-reduce the replicated gradients; write each shard's fp32 `.grad`
        (added to an existing one)."""
        while self._pending:
            self._pending.popleft().complete()
        self._free_all()  # weights prefetched for a backward step that never came
        self._all_reduce_replicated()
        for layer in self._layers:
            if layer.reduced_grad is None:
                continue
            grad = layer.reduced_grad.div_(self.world_size).view_as(layer.shard).to(layer.shard.dtype)
            layer.shard.grad = grad if layer.shard.grad is None else layer.shard.grad.add_(grad)
            layer.reduced_grad = None

    def remove_hooks(self) -> None:
        """Unregister every hook the wrapper put on the model and drop its gradient state: the wrapper no longer
        trains (a later forward raises); its modules keep their shards (see Lifetime in the module docstring).
        Happens by itself when the wrapper is garbage-collected; idempotent. Never waits on a collective (a rank
        whose peers failed must not block here): an in-flight one keeps its buffers alive until it completes."""
        self._remove_handles()
        self._hooks_removed = True
        self._pending.clear()
        for layer in self._layers:
            layer.reduced_grad = None
            if layer.state == _READY:
                layer.free(self)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor} for every parameter, named as in the unwrapped model.

        A collective: every rank must call it."""
        out = {}
        for name, p in self.module.named_parameters():
            layer = self._layer_of_shard.get(id(p))
            if layer is None:
                out[name] = p.detach().clone()
                continue
            flat = torch.empty(self.world_size * layer.shard_numel, dtype=p.dtype, device=p.device)
            _all_gather(flat, p.detach().reshape(-1), group=self.process_group)
            out[name] = flat[: layer.numel].view(layer.shape)
        return out

    @property
    def sharded_layer_names(self) -> list[str]:
        """Names of the sharded weights, in module order."""
        return [layer.name for layer in self._layers]

    def gathered_storage_bytes(self) -> int:
        """Bytes of full weights currently materialised (0 outside a forward / backward)."""
        return sum(layer.full.untyped_storage().nbytes() for layer in self._layers)

    # ------------------------------------------------------------------ helpers
    def _free_all(self) -> None:
        for layer in self._layers:
            layer.free(self)

    def _log(self, event: str, name: str, phase: str) -> None:
        if self._event_log is not None:
            self._event_log.append((event, name, phase))

    def _probe_reduce_scatter(self) -> bool:
        """NCCL always has reduce-scatter; some gloo builds do not (then all-reduce + narrow is the fallback)."""
        if dist.get_backend(self.process_group) != "gloo":
            return True
        probe = torch.zeros(self.world_size)
        try:
            _reduce_scatter(torch.zeros(1), probe, group=self.process_group)
        except (RuntimeError, NotImplementedError):
            return False
        return True


class CastForCompute(nn.Module):
    """FSDP's compute-dtype policy without sharding or communication: the single-process reference of
    `FSDP(module, compute_dtype)`. For each forward of a Linear / Embedding, its parameters and floating inputs
    are cast to `compute_dtype` (the casts are differentiable, so fp32 gradients reach the fp32 masters) and the
    originals are put back after the module's forward. Other modules run on what they receive."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype):
        super().__init__()
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype ({compute_dtype!r}) must be a floating-point torch.dtype")
        self.module, self.compute_dtype = module, compute_dtype
        self._saved: dict[nn.Module, dict[str, nn.Parameter]] = {}
        owner = weakref.ref(self)  # hooks hold the wrapper weakly, as FSDP's (Lifetime in the module docstring)
        handles = []
        for mod in module.modules():
            if is_sharded_module(mod):
                handles.append(mod.register_forward_pre_hook(_WeakHook(owner, CastForCompute._pre_forward)))
                handles.append(mod.register_forward_hook(_WeakHook(owner, CastForCompute._post_forward)))
        self._remove_handles = weakref.finalize(self, _remove_handles, handles)
        self._hooks_removed = False

    def remove_hooks(self) -> None:
        """Unregister the casting hooks (a later forward raises; the model itself is unchanged). Happens by itself
        when the wrapper is garbage-collected; idempotent."""
        self._remove_handles()
        self._hooks_removed = True

    def _pre_forward(self, module: nn.Module, args: tuple) -> tuple:
        self._saved[module] = _cast_params(module, self.compute_dtype)
        return _cast_inputs(args, self.compute_dtype)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        module._parameters.update(self._saved.pop(module))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks_removed:
            raise RuntimeError("this CastForCompute wrapper's hooks were removed (remove_hooks()): wrap the module "
                               "again")
        try:
            return self.module(*args, **kwargs)
        finally:
            for module, params in self._saved.items():  # only non-empty if a forward raised
                module._parameters.update(params)
            self._saved.clear()
