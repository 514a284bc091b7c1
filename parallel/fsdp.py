"""Fully sharded data parallel (FSDP, ZeRO stage 3) for a whole model: just-in-time weight all-gathers with
prefetch, compute-dtype communication, asynchronous fp32 gradient reduce-scatters (handout section 7).

What is sharded. The `weight` of every Linear and Embedding module (torch's `nn.Linear` / `nn.Embedding`, or any
module class named `Linear` / `Embedding`, which covers `raysys.model` and `cs336_basics`; `parallel/` never
imports raysys). A weight of shape (R, *rest) is zero-padded to N * ceil(R / N) rows and split along dim 0: rank r
keeps rows [r * ceil(R/N), (r+1) * ceil(R/N)) as an fp32 `nn.Parameter` that replaces the module's `weight`, so
`fsdp.parameters()` hands the optimizer the shards (master weights and updates stay fp32; padding rows have zero
gradient and stay zero under SGD / AdamW). Every other parameter (norm weights, biases) is replicated.

Unit of gathering. By default every sharded module is its own unit (the handout's "layer"). With
`units=(TransformerBlock,)` (classes or class names) every outermost module of those classes is one unit holding
all the sharded weights below it, as torch's FSDP2 is applied per block; sharded modules outside any such module
stay units of their own. A unit costs one all-gather in forward, one in backward (skipped when all its weights are
embeddings, whose backward is a scatter-add of the output gradient that never reads the weight) and one
reduce-scatter, whatever its number of weights: per block instead of per Linear, the host issues a seventh of the
collectives, which matters when a step is bound by the host's launch rate.

Layout of a unit (N ranks, weights w_1..w_k with padded shard sizes s_1..s_k, S = sum s_i):
    shard storage   fp32 (S,): this rank's shards back to back; each weight's shard is an `nn.Parameter` viewing
                    its slice (the optimizer updates them in place, so the storage always holds the masters)
    all-gather      in: the weights' shards, cast to the compute dtype straight into rank r's rows of their full
                    tensors (one `_foreach_copy_`; the all-gathers then run in place, as FSDP2's, with no
                    send buffer); fp32 sends the shard storage's slices as they are
    full storage    compute dtype, N * s_1 | N * s_2 | ...: each weight's padded full tensor in one piece, the
                    output of its own all-gather (rank r's rows in place); the k all-gathers are issued as one
                    coalesced group (on NCCL one launch). A backend without coalesced all-gathers gets one flat
                    all-gather into (N, S) (rank r's shards in row r) and one `split_with_sizes_copy` into the
                    pieces. Each full weight is a leaf `nn.Parameter` viewing its piece
    reduce-scatter  in fp32, N * s_1 | N * s_2 | ...: each weight's full gradient cast into its padded (N * rows,
                    ...) piece (one `_foreach_copy_`), which is rank-major already; one reduce-scatter per weight,
                    issued as one coalesced group, each into its shard's slot of out (S,) fp32, the summed gradient
                    of this rank's shards. A backend without coalesced reduce-scatters gets one `_chunk_cat` into
                    (N, S) (row r: the rows rank r owns, padded, cast in the same kernel) and one reduce-scatter;
                    the coalesced path skips that gather of rows, a kernel several times slower than a cast
The full storage is allocated (`resize_`) just before it is written (its all-gather, or the copy-out, so a flat
prefetch in flight holds one buffer) and released (`resize_(0)`) right after use;
autograd keeps referring to the same full weights, so the backward's re-gather refills what the saved graph reads.
The all-gathers and the copy-out write through separate tensors on the same storage, so the full weights' version
counters, which the saved graph checks, never move.

Forward, per unit i in execution order:
    pre-hook   wait for (or issue) all-gather(i); copy out; swap the full weights into their modules
    post-hook  swap the shards back; free the full weights; issue all-gather(i + 2)      <- prefetch
so the all-gather of unit i starts only once unit i - 2 has finished its forward pass (units 0 and 1 start with
the forward itself), at most three units' full weights are alive, and each gather overlaps the compute of the
unit before it. The order is the one the previous forward executed (the first forward gathers on demand).
Backward, per unit (the pre-hook is a hook on the unit's output gradient, the post-hook a post-accumulate-grad
hook on each full weight):
    pre-hook   issue all-gather(i) if not prefetched; issue all-gather of the next unit backward needs
               (reverse forward order); wait for all-gather(i)
    post-hook  once every trainable weight of the unit has its gradient: free the full weights, issue
               reduce-scatter(SUM) of the fp32 gradients into this rank's shards
A unit whose weights are all frozen (`requires_grad=False`) is gathered for backward all the same (its input's
gradient reads them) and freed by a hook on its inputs' gradients, which are complete only once its backward ran.
Replicated parameters (norm weights, biases: a few KB per block) are all-reduced (SUM) as one flattened tensor
in `finish_gradient_synchronization()`: one small collective after backward instead of one per parameter queued
between the weights' all-gathers and reduce-scatters.

With `compute_dtype`, shards are cast before the all-gather (half the bytes of fp32), the full weights, the other
parameters (biases) and floating inputs of sharded modules are in that dtype (a pre-hook on each sharded module
casts them), and so is compute; gradients are cast back to fp32 for the reduce-scatter. Other modules (norms) see
the dtype their inputs arrive in. `parallel.mixed_precision.CastForCompute` is the same policy on one process,
without sharding.

Invariant: after `finish_gradient_synchronization()`, every shard's `.grad` (fp32, shard shape) equals its
rows of (sum over ranks of the local full-weight gradients) / N, and every replicated parameter's `.grad` is
(sum over ranks) / N, bit-identical on all ranks. The sum over two ranks is a single fp32 add (commutative)
and / 2 is exact, so with N = 2 and fp32 compute one step equals, bit for bit, a single process that computes
the two per-slice gradients and averages them as (g0 + g1) / 2. The units change when collectives run, never
what they compute.

Gradient accumulation: several forward/backward passes may run before one `finish_gradient_synchronization()`;
their gradients add up (each pass's reduce-scatters are summed), and finish averages over the ranks, so the
result is the sum over passes of the rank-averaged gradients, as without FSDP. A unit some of whose weights got
no gradient in a backward pass is reduced (the missing ones as zeros) by finish or by the next forward.

Requirements (as torch's FSDP): every rank runs the same units in the same order, each at most once per forward,
and produces gradients for the same parameters (collectives are matched by issue order); no weight tying between
sharded modules; sharded modules are not recomputed by activation checkpointing; a unit's weights share one
dtype; optimizers update the shards in place (as torch's do), never by assigning `.data`.

Lifetime (parallel/hooks.py): every hook, module or tensor, holds the wrapper weakly and names its unit by index,
and a unit holds no reference to its wrapper, so a wrapper nobody references is freed at once by reference
counting and its hooks are removed with it; `remove_hooks()` does the same explicitly. The model's sharded modules
keep their shards as `weight` either way (`gather_full_params()` first to get the full weights back).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

from parallel.carveout import SMCarveout
from parallel.ddp import broadcast_module_state
from parallel.hooks import WeakHook, remove_handles
from parallel.mixed_precision import (cast_inputs, cast_params, has_other_floating_params, is_embedding,
                                      is_sharded_module)

__all__ = ["FSDP", "CommStats", "is_sharded_module"]

# torch 2.13 renames the single-tensor collectives and deprecates the old names (a FutureWarning per call).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FREE, _GATHERING, _READY = "free", "gathering", "ready"


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or a tuple / list of them) that need a gradient."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def _on_gradients(tensors: list[torch.Tensor], hook: Callable[[Any], None], mode: str) -> None:
    """Call `hook` once in backward: when the gradient of the first of `tensors` ("any") or of all of them ("all")
    has been computed. Nothing for no tensors."""
    if len(tensors) == 1:
        tensors[0].register_hook(hook)
    elif tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode=mode)


def _unit_spec(units: Iterable[type | str] | None) -> tuple:
    if units is None:
        return ()
    spec = (units,) if isinstance(units, (str, type)) else tuple(units)
    if not spec or not all(isinstance(u, str) or (isinstance(u, type) and issubclass(u, nn.Module)) for u in spec):
        raise ValueError(f"units ({units!r}) must be None or nn.Module classes / class names, e.g. "
                         "(TransformerBlock,) or ('TransformerBlock',)")
    return spec


def _group_units(module: nn.Module, spec: tuple) -> list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]]:
    """[(unit name, root module, [(name, sharded module), ...])] in module order: every outermost module matching
    `spec` with its sharded modules, and every sharded module outside those on its own."""

    def matches(mod: nn.Module) -> bool:
        return any(isinstance(mod, u) if isinstance(u, type) else type(mod).__name__ == u for u in spec)

    groups: list[tuple[str, nn.Module, list]] = []
    owner: dict[int, int] = {}  # id(module) -> index of the unit whose root is above it
    matched = False
    for name, mod in module.named_modules():
        group = owner.get(id(mod))
        if group is None and spec and matches(mod):
            matched, group = True, len(groups)
            groups.append((name or type(mod).__name__, mod, []))
            for sub in mod.modules():
                owner.setdefault(id(sub), group)
        if is_sharded_module(mod):
            if group is None:
                groups.append((f"{name}.weight" if name else "weight", mod, [(name, mod)]))
            else:
                groups[group][2].append((name, mod))
    if spec and not matched:
        raise ValueError(f"units {spec!r}: the model has no module of those classes")
    return [g for g in groups if g[2]]


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
    """Largest total size of gathered weights alive at once: full weights, and all-gather outputs not yet copied
    out (units of several weights)."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


class _Weight:
    """One sharded weight of a unit: its shard (the optimizer's parameter, a view of the unit's shard storage) and
    its full compute-dtype weight (a leaf viewing the unit's full storage)."""

    __slots__ = ("name", "module", "shape", "numel", "offset", "shard_numel", "shard", "full", "padded")

    def __init__(self, name: str, module: nn.Module, offset: int, shard: nn.Parameter, full: nn.Parameter,
                 padded: torch.Tensor):
        self.name, self.module, self.offset = name, module, offset
        self.shape, self.numel = full.shape, full.numel()
        self.shard, self.full, self.padded = shard, full, padded
        self.shard_numel = shard.numel()


class _Unit:
    """The sharded weights gathered together (see Layout in the module docstring) and their communication state.

    Holds no reference to its wrapper (see Lifetime in the module docstring): the wrapper passes itself to the
    methods that communicate or count."""

    def __init__(self, fsdp: "FSDP", index: int, name: str, root: nn.Module, members: list[tuple[str, nn.Module]]):
        n, rank = fsdp.world_size, fsdp.rank
        originals = [mod.weight for _, mod in members]
        rows = [math.ceil(w.shape[0] / n) for w in originals]
        sizes = [r * (w.numel() // max(w.shape[0], 1)) for r, w in zip(rows, originals)]
        self.index, self.name, self.root = index, name, root
        self.sizes, self.shard_numel = sizes, sum(sizes)
        device, self.dtype = originals[0].device, fsdp.compute_dtype or originals[0].dtype
        with torch.no_grad():
            self.shard_flat = torch.zeros(self.shard_numel, dtype=originals[0].dtype, device=device)
            full_flat = torch.empty(n * self.shard_numel, dtype=self.dtype, device=device)
        self.storage = full_flat.untyped_storage()
        self.weights: list[_Weight] = []
        offset = 0
        for (mod_name, mod), w, r, size in zip(members, originals, rows, sizes):
            view = self.shard_flat[offset:offset + size].view(r, *w.shape[1:])
            with torch.no_grad():
                mine = w.detach()[rank * r:(rank + 1) * r]  # the last ranks may own padding rows only
                view[: mine.shape[0]].copy_(mine)
            shard = nn.Parameter(view, requires_grad=w.requires_grad)
            full = nn.Parameter(full_flat[n * offset:n * offset + w.numel()].view(w.shape),
                                requires_grad=w.requires_grad)
            # What the all-gather / copy-out writes: a second tensor on the full weight's storage, so that write
            # does not bump the version counter of the weight the autograd graph has saved.
            padded = torch.empty(0, dtype=self.dtype, device=device).set_(self.storage, n * offset, (n, size),
                                                                          (size, 1))
            self.weights.append(_Weight(f"{mod_name}.weight" if mod_name else "weight", mod, offset, shard, full,
                                        padded))
            offset += size
        self.nbytes = self.storage.nbytes()
        self.storage.resize_(0)
        # A frozen Linear still reads its weight in backward (for its input's gradient); an embedding never does.
        self.needs_weight_in_backward = any(not is_embedding(w.module) for w in self.weights)
        self.num_trainable = sum(w.full.requires_grad for w in self.weights)
        self.state = _FREE
        self._work: dist.Work | None = None
        self._send: torch.Tensor | list[torch.Tensor] | None = None  # what the all-gather reads, until it is waited
        self._recv: torch.Tensor | None = None  # all-gather output awaiting its copy-out (units of several weights)
        self.grads: list[torch.Tensor | None] = [None] * len(self.weights)  # this backward's full gradients
        self.grads_left = self.num_trainable
        self.had_grad = [False] * len(self.weights)  # since the last finish: weights without one get no .grad
        self.reduced_grad: torch.Tensor | None = None  # this rank's summed shard gradients, until finish
        self.backward_done = False
        self.fwd_pos = -1

    def start_gather(self, fsdp: "FSDP", phase: str) -> None:
        if self.state != _FREE:
            return
        cast = self.shard_flat.dtype != self.dtype  # cast before communicating: bf16 moves half the bytes of fp32
        if len(self.weights) == 1 or fsdp._coalesced_gather:
            # One all-gather per weight into its padded full tensor (rank-major is each weight's own layout),
            # issued as one group. A cast writes this rank's shards straight into their slots of the outputs, and
            # the all-gathers run in place there (as FSDP2's): no separate send buffer.
            self.storage.resize_(self.nbytes)
            outputs = [w.padded for w in self.weights]
            shards = list(self.shard_flat.split(self.sizes))
            if cast:
                self._send = [out[fsdp.rank] for out in outputs]
                torch._foreach_copy_(self._send, shards)
            else:
                self._send = shards
            if len(self.weights) == 1:
                self._work = _all_gather(outputs[0].view(-1), self._send[0], group=fsdp.process_group, async_op=True)
            else:
                self._work = fsdp._all_gather_coalesced([out.view(-1) for out in outputs], self._send)
        else:  # one flat all-gather, copied out at wait; the full storage is allocated then (one buffer in flight)
            self._send = self.shard_flat.to(self.dtype) if cast else self.shard_flat
            self._recv = torch.empty(fsdp.world_size * self.shard_numel, dtype=self.dtype,
                                     device=self.shard_flat.device)
            self._work = _all_gather(self._recv, self._send, group=fsdp.process_group, async_op=True)
        fsdp._count_gathered(self.nbytes)
        self.state = _GATHERING
        fsdp.stats.all_gathers += 1
        fsdp.stats.all_gather_bytes += self.nbytes
        fsdp._log("all_gather", self.name, phase)

    def wait_gather(self, fsdp: "FSDP", phase: str | None = None, copy_out: bool = True) -> None:
        """Wait for the issued all-gather and copy its output into the full weights; with `phase`, add the blocked
        host time to `stats.<phase>_wait_s`."""
        if self.state != _GATHERING:
            return
        start = time.perf_counter()
        self._work.wait()
        if phase is not None:
            attr = f"{phase}_wait_s"
            setattr(fsdp.stats, attr, getattr(fsdp.stats, attr) + time.perf_counter() - start)
        if self._recv is not None:
            if copy_out:
                self.storage.resize_(self.nbytes)
                fsdp._count_gathered(self.nbytes)
                torch.split_with_sizes_copy(self._recv.view(fsdp.world_size, -1), self.sizes, dim=1,
                                            out=[w.padded for w in self.weights])
            fsdp._count_gathered(-self.nbytes)
        self._work = self._send = self._recv = None
        self.state = _READY

    def free(self, fsdp: "FSDP") -> None:
        if self.state == _FREE:
            return
        self.wait_gather(fsdp, copy_out=False)  # never release memory a collective may still write
        fsdp._count_gathered(-self.storage.nbytes())
        self.storage.resize_(0)
        self.state = _FREE

    def swap_in(self) -> None:
        for w in self.weights:
            w.module._parameters["weight"] = w.full

    def swap_out(self) -> None:
        for w in self.weights:
            w.module._parameters["weight"] = w.shard


def _cast_into(pieces: list[torch.Tensor], grads: list[torch.Tensor | None], weights: list[_Weight]) -> None:
    """Write each weight's gradient (zeros if None) into its flat fp32 `piece` of N * padded rows, padding rows zero:
    one `_foreach_copy_` casts them all. A function of its own so that no local outlives the call: the caller drops
    the compute-dtype gradients right after, before it allocates the reduce-scatter's output."""
    dsts, srcs = [], []
    for grad, w, piece in zip(grads, weights, pieces):
        rows = piece.view(-1, *w.shape[1:])
        if grad is None:
            rows.zero_()
            continue
        dsts.append(rows[:w.shape[0]])
        srcs.append(grad)
        if rows.shape[0] > w.shape[0]:
            rows[w.shape[0]:].zero_()  # padding rows
    torch._foreach_copy_(dsts, srcs)


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
        units: module classes (or class names) whose outermost instances are gathered as one unit, e.g.
            `(TransformerBlock,)`; None (default): every sharded module is its own unit.
        max_inflight_reductions: gradient reduce-scatters allowed in flight before the oldest is waited for;
            bounds the fp32 full-size gradient buffers alive during backward (1, as FSDP2: a unit's
            reduce-scatter has the next unit's backward to finish in; on NCCL the wait is stream-ordered).
        sm_carveout: keep cuBLAS matmuls off this many SMs from each forward until
            `finish_gradient_synchronization()` (parallel/carveout.py), for a process group whose NCCL
            collectives are capped at as many CTAs: gathers and reductions then run beside the matmuls, not in
            their way. None (default): no carve-out.
        event_log: if a list, ("all_gather" | "reduce_scatter", unit name, "forward" | "backward") tuples are
            appended as collectives are issued (for tests of the prefetch rule). A unit of one module is named
            after its weight (`layers.0.attn.q_proj.weight`), a larger one after its root (`layers.0`).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 process_group: dist.ProcessGroup | None = None, *, units: Iterable[type | str] | None = None,
                 max_inflight_reductions: int = 1, sm_carveout: int | None = None, event_log: list | None = None):
        super().__init__()
        carveout = SMCarveout(sm_carveout)
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype ({compute_dtype!r}) must be a floating-point torch.dtype or None")
        if max_inflight_reductions < 1:
            raise ValueError(f"max_inflight_reductions ({max_inflight_reductions}) must be >= 1")
        spec = _unit_spec(units)
        groups = _group_units(module, spec)  # all checked before the model is touched
        seen: set[int] = set()
        for unit_name, _, members in groups:
            for mod_name, mod in members:
                if id(mod.weight) in seen:
                    raise ValueError(f"{mod_name}.weight is shared with another Linear/Embedding (tied weights are "
                                     "not supported by FSDP)")
                seen.add(id(mod.weight))
            dtypes = sorted({str(mod.weight.dtype) for _, mod in members})
            if len(dtypes) > 1:
                raise ValueError(f"unit {unit_name}: its sharded weights have dtypes {dtypes}; a unit's weights must "
                                 "share one")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("FSDP needs an initialised torch.distributed process group (init_process_group first)")
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.max_inflight_reductions = max_inflight_reductions
        self.carveout = carveout
        self.stats = CommStats()
        self._event_log = event_log
        self._gathered_bytes = [0]  # mutated in place: hooks skip Module.__setattr__'s checks
        broadcast_module_state(module, process_group)

        self._units: list[_Unit] = []
        self._owner = weakref.ref(self)  # what hooks hold (see Lifetime in the module docstring)
        self._hooks_removed = False
        self._cast_saved: dict[nn.Module, dict[str, nn.Parameter]] = {}
        handles = []
        for unit_name, root, members in groups:
            unit = _Unit(self, len(self._units), unit_name, root, members)
            self._units.append(unit)
            handles.append(root.register_forward_pre_hook(WeakHook(self._owner, FSDP._pre_forward, unit.index)))
            handles.append(root.register_forward_hook(WeakHook(self._owner, FSDP._post_forward, unit.index)))
            for pos, w in enumerate(unit.weights):
                w.module._parameters["weight"] = w.shard
                if w.full.requires_grad:
                    handles.append(w.full.register_post_accumulate_grad_hook(
                        WeakHook(self._owner, FSDP._post_backward, unit.index, pos)))
                if compute_dtype is not None:
                    handles.append(w.module.register_forward_pre_hook(WeakHook(self._owner, FSDP._cast_pre)))
                    if has_other_floating_params(w.module):
                        handles.append(w.module.register_forward_hook(WeakHook(self._owner, FSDP._cast_post)))
        # Runs remove_hooks' work when the wrapper is collected (or when remove_hooks() calls it).
        self._remove_handles = weakref.finalize(self, remove_handles, handles)
        self._weight_of_shard = {id(w.shard): w for unit in self._units for w in unit.weights}
        self._replicated = [p for p in module.parameters() if id(p) not in self._weight_of_shard and p.requires_grad]
        self._pending: deque[_PendingOp] = deque()
        self._fwd_calls: list[_Unit] = []
        self._last_order: list[_Unit] = []
        self._reduce_scatter_ok = self._probe_reduce_scatter()
        # Coalesced all-gathers and reduce-scatters: NCCL has both, gloo in recent torch; else the flat fallbacks.
        self._coalesced_gather = self._has_coalesced(
            "allgather_into_tensor_coalesced",
            lambda: self._all_gather_coalesced([torch.zeros(self.world_size)], [torch.zeros(1)]))
        self._coalesced_reduce_scatter = self._reduce_scatter_ok and self._has_coalesced(
            "reduce_scatter_tensor_coalesced",
            lambda: self._reduce_scatter_coalesced([torch.zeros(1)], [torch.zeros(self.world_size)]))

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks_removed:
            raise RuntimeError("this FSDP wrapper's hooks were removed (remove_hooks()): its modules hold only this "
                               "rank's weight shards; gather_full_params() returns the full weights")
        self._reduce_partial_units()
        self.carveout.enter()
        self._fwd_calls = []
        for unit in self._units:
            unit.backward_done = False
        for unit in self._last_order[:2]:  # no unit runs two before these
            unit.start_gather(self, "forward")
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            for unit in self._units:
                unit.swap_out()
            for module, saved in self._cast_saved.items():
                module._parameters.update(saved)
            self._cast_saved.clear()
            self._free_all()
            self.carveout.exit()
            raise
        self._free_all()  # prefetched but not used by this forward (control flow changed)
        self._last_order = self._fwd_calls
        for pos, unit in enumerate(self._fwd_calls):
            unit.fwd_pos = pos
        return out

    def _pre_forward(self, index: int, module: nn.Module, args: tuple) -> None:
        unit = self._units[index]
        self._fwd_calls.append(unit)
        unit.start_gather(self, "forward")
        unit.wait_gather(self, "forward")
        unit.swap_in()
        if unit.num_trainable == 0 and unit.needs_weight_in_backward and torch.is_grad_enabled():
            # No gradient of its own tells when its backward is over: its inputs' gradients do (they are complete
            # only after it ran). Without such an input it stays gathered until finish.
            _on_gradients(_output_tensors(args), WeakHook(self._owner, FSDP._post_backward_frozen, unit.index), "all")

    def _post_forward(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        unit = self._units[index]
        unit.swap_out()
        unit.free(self)
        if unit.needs_weight_in_backward and torch.is_grad_enabled():
            _on_gradients(_output_tensors(output), WeakHook(self._owner, FSDP._pre_backward, unit.index), "any")
        pos = len(self._fwd_calls) - 1
        if pos + 2 < len(self._last_order):
            self._last_order[pos + 2].start_gather(self, "forward")

    def _cast_pre(self, module: nn.Module, args: tuple) -> tuple | None:
        saved = cast_params(module, self.compute_dtype, skip=("weight",))
        if saved:
            self._cast_saved[module] = saved
        return cast_inputs(args, self.compute_dtype)

    def _cast_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        module._parameters.update(self._cast_saved.pop(module, {}))

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, index: int, grad: torch.Tensor) -> None:
        unit = self._units[index]
        unit.start_gather(self, "backward")
        nxt = self._next_backward_unit(unit)
        if nxt is not None:
            nxt.start_gather(self, "backward")
        unit.wait_gather(self, "backward")

    def _next_backward_unit(self, unit: _Unit) -> _Unit | None:
        """The closest unit before `unit` in forward order that backward has yet to run and that needs its weights."""
        for pos in range(unit.fwd_pos - 1, -1, -1):
            cand = self._last_order[pos]
            if cand.needs_weight_in_backward and not cand.backward_done:
                return cand if cand.state == _FREE else None
        return None

    def _post_backward(self, index: int, pos: int, full: torch.Tensor) -> None:
        unit = self._units[index]
        grad, full.grad = full.grad, None
        if unit.grads[pos] is None:
            unit.grads[pos] = grad
            unit.grads_left -= 1
            unit.had_grad[pos] = True
        else:  # accumulated twice in one backward
            unit.grads[pos] = unit.grads[pos] + grad
        if unit.grads_left == 0:
            self._reduce_unit(unit)

    def _post_backward_frozen(self, index: int, grad: Any) -> None:
        unit = self._units[index]
        unit.backward_done = True
        unit.free(self)

    def _reduce_unit(self, unit: _Unit) -> None:
        """Free the unit's full weights; issue the reduce-scatter of its fp32 gradients (zeros where none came)."""
        grads, unit.grads, unit.grads_left = unit.grads, [None] * len(unit.weights), unit.num_trainable
        unit.backward_done = True
        unit.free(self)
        n, device = self.world_size, unit.shard_flat.device
        first = grads[0]
        coalesced = len(grads) > 1 and self._coalesced_reduce_scatter
        if (len(grads) == 1 and first is not None and first.dtype == torch.float32 and first.is_contiguous()
                and first.numel() == n * unit.shard_numel):
            send = first.view(-1)
        elif coalesced:  # fp32, weight after weight, each its own padded (N * rows, ...) tensor: rank-major already
            send = torch.empty(n * unit.shard_numel, dtype=torch.float32, device=device)
            pieces = [send[n * w.offset:n * (w.offset + size)] for w, size in zip(unit.weights, unit.sizes)]
            _cast_into(pieces, grads, unit.weights)
        else:  # fp32, each weight's rows laid out by owning rank, padding rows zero
            full_grads = [g if g is not None else torch.zeros(w.shape, dtype=w.full.dtype, device=device)
                          for g, w in zip(grads, unit.weights)]
            send = torch.empty(n * unit.shard_numel, dtype=torch.float32, device=device)
            torch._chunk_cat(full_grads, dim=0, num_chunks=n, out=send.view(n, -1))
            del full_grads
        del grads, first
        if coalesced:  # one reduce-scatter per weight, issued as one group: each shard lands in its slot of `out`
            out = torch.empty(unit.shard_numel, dtype=torch.float32, device=device)
            work = self._reduce_scatter_coalesced(list(out.split(unit.sizes)), pieces)
        elif self._reduce_scatter_ok:
            out = torch.empty(unit.shard_numel, dtype=torch.float32, device=device)
            work = _reduce_scatter(out, send, group=self.process_group, async_op=True)
        else:  # gloo without reduce-scatter: all-reduce the whole gradient, keep this rank's slice
            out = send.narrow(0, self.rank * unit.shard_numel, unit.shard_numel)
            work = dist.all_reduce(send, group=self.process_group, async_op=True)
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += send.numel() * send.element_size()
        self._log("reduce_scatter", unit.name, "backward")
        self._pending.append(_PendingOp(work, partial(self._store_shard_grad, unit, out), send, out))
        while len(self._pending) > self.max_inflight_reductions:  # frees the oldest full-size gradient buffer
            self._pending.popleft().complete()

    def _reduce_partial_units(self) -> None:
        """Reduce the units some of whose weights got no gradient in the last backward pass."""
        for unit in self._units:
            if unit.grads_left != unit.num_trainable:
                self._reduce_unit(unit)

    @staticmethod
    def _store_shard_grad(unit: _Unit, summed: torch.Tensor) -> None:
        unit.reduced_grad = summed if unit.reduced_grad is None else unit.reduced_grad.add_(summed)

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
        (added to an existing one; the shards of a unit get views of one buffer)."""
        self._reduce_partial_units()
        while self._pending:
            self._pending.popleft().complete()
        self._free_all()  # weights prefetched for a backward step that never came
        self._all_reduce_replicated()
        self.carveout.exit()
        for unit in self._units:
            if unit.reduced_grad is None:
                continue
            summed, unit.reduced_grad = unit.reduced_grad.div_(self.world_size), None
            had_grad, unit.had_grad = unit.had_grad, [False] * len(unit.weights)
            for w, got in zip(unit.weights, had_grad):
                if not got:  # no gradient reached it (unused this step): none, as without FSDP
                    continue
                grad = summed[w.offset:w.offset + w.shard_numel].view(w.shard.shape).to(w.shard.dtype)
                w.shard.grad = grad if w.shard.grad is None else w.shard.grad.add_(grad)

    def remove_hooks(self) -> None:
        """Unregister every hook the wrapper put on the model and drop its gradient state: the wrapper no longer
        trains (a later forward raises); its modules keep their shards (see Lifetime in the module docstring).
        Happens by itself when the wrapper is garbage-collected; idempotent. Never waits on a collective (a rank
        whose peers failed must not block here): an in-flight one keeps its buffers alive until it completes."""
        self._remove_handles()
        self._hooks_removed = True
        self.carveout.exit()
        self._pending.clear()
        for unit in self._units:
            unit.reduced_grad = None
            unit.grads, unit.grads_left = [None] * len(unit.weights), unit.num_trainable
            unit.had_grad = [False] * len(unit.weights)
            if unit.state == _READY:
                unit.free(self)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor} for every parameter, named as in the unwrapped model.

        A collective: every rank must call it."""
        out = {}
        for name, p in self.module.named_parameters():
            w = self._weight_of_shard.get(id(p))
            if w is None:
                out[name] = p.detach().clone()
                continue
            flat = torch.empty(self.world_size * w.shard_numel, dtype=p.dtype, device=p.device)
            _all_gather(flat, p.detach().reshape(-1), group=self.process_group)
            out[name] = flat[: w.numel].view(w.shape)
        return out

    @property
    def sharded_layer_names(self) -> list[str]:
        """Names of the sharded weights, in module order."""
        return [w.name for unit in self._units for w in unit.weights]

    @property
    def unit_names(self) -> list[str]:
        """Names of the units, in module order (what the event log names)."""
        return [unit.name for unit in self._units]

    def gathered_storage_bytes(self) -> int:
        """Bytes of full weights currently materialised (0 outside a forward / backward)."""
        return sum(unit.storage.nbytes() for unit in self._units)

    # ------------------------------------------------------------------ helpers
    def _free_all(self) -> None:
        for unit in self._units:
            unit.free(self)

    def _count_gathered(self, delta: int) -> None:
        self._gathered_bytes[0] += delta
        self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, self._gathered_bytes[0])

    def _log(self, event: str, name: str, phase: str) -> None:
        if self._event_log is not None:
            self._event_log.append((event, name, phase))

    def _all_gather_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> dist.Work:
        """all_gather_into_tensor(outputs[i], inputs[i]) for every i as one group of collectives (one NCCL launch),
        asynchronous: on NCCL's stream, as `async_op=True` collectives."""
        opts = AllgatherOptions()
        if hasattr(opts, "asyncOp"):  # torch >= 2.7: without it the group would run on the current stream
            opts.asyncOp = True
        return (self.process_group or dist.group.WORLD).allgather_into_tensor_coalesced(outputs, inputs, opts)

    def _reduce_scatter_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> dist.Work:
        """reduce_scatter_tensor(outputs[i], inputs[i], SUM) for every i as one group, asynchronous (as above)."""
        opts = ReduceScatterOptions()
        if hasattr(opts, "asyncOp"):
            opts.asyncOp = True
        return (self.process_group or dist.group.WORLD).reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def _has_coalesced(self, method: str, probe: Callable[[], dist.Work]) -> bool:
        """Whether the group's backend runs the coalesced collective `method`: NCCL does; gloo is asked with a
        tiny `probe()` (a collective: every rank constructs the wrapper, so every rank asks)."""
        if not hasattr(self.process_group or dist.group.WORLD, method):
            return False
        if dist.get_backend(self.process_group) != "gloo":
            return True
        try:
            probe().wait()
        except (RuntimeError, NotImplementedError):
            return False
        return True

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
