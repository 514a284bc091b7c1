"""Fully sharded data parallel (FSDP, ZeRO stage 3): just-in-time weight all-gathers with prefetch, compute-dtype
communication and asynchronous fp32 gradient reduce-scatters (handout section 7; design in docs/parallel.md).

Every Linear / Embedding `weight` (by class name) is zero-padded to a multiple of N rows and split along dim 0: rank r
keeps its rows as an fp32 `nn.Parameter` in the module's place (`fsdp.parameters()` are the shards); other parameters
are replicated and all-reduced. A unit (each sharded module, or each outermost `units` instance) is all-gathered
before forward (two units ahead) and backward (one ahead), its gradients reduce-scattered once the last arrives.
Invariant: after `finish_gradient_synchronization()` every shard's `.grad` (fp32) holds its rows of the mean over ranks
of the full-weight gradients, every replicated `.grad` the mean; a group of one is the identity unless
`collectives_alone=True`. Requirements (as torch's FSDP): the same units in the same order on every rank, each at most
once per forward; no tied or recomputed sharded weights; shards updated in place. Hooks hold the wrapper weakly.
    fsdp = make_fsdp("fsdp", model, compute_dtype=torch.bfloat16, units=(TransformerBlock,))
    loss_fn(fsdp(x), y).backward(); fsdp.finish_gradient_synchronization(); optimizer.step()
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
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                                ReduceScatterOptions)

from parallel.carveout import SMCarveout
from parallel.collectives import all_gather_single, reduce_scatter_single
from parallel.ddp import async_options, broadcast_module_state, mean_reduction
from parallel.hooks import WeakHook, remove_handles
from parallel.mixed_precision import (cast_inputs, cast_inputs_by_class, cast_params, has_other_floating_params,
                                      is_embedding, is_sharded_module)

__all__ = ["FSDP", "FSDP_KINDS", "CommStats", "is_sharded_module", "make_fsdp"]

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


def _matches(mod: nn.Module, spec: tuple) -> bool:
    return any(isinstance(mod, u) if isinstance(u, type) else type(mod).__name__ == u for u in spec)


def _group_units(module: nn.Module, spec: tuple) -> list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]]:
    """[(unit name, root module, [(name, sharded module), ...])] in module order: every outermost module matching
    `spec` with its sharded modules, and every sharded module outside those on its own."""
    groups: list[tuple[str, nn.Module, list]] = []
    owner: dict[int, int] = {}  # id(module) -> index of the unit whose root is above it
    matched = False
    for name, mod in module.named_modules():
        group = owner.get(id(mod))
        if group is None and spec and _matches(mod, spec):
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
    """The sharded weights gathered together and their communication state: an fp32 shard storage (this rank's
    padded shards back to back, each shard a view), a compute-dtype full storage (N * s_i per weight, rank-major,
    each full weight a leaf view) allocated only while gathered, and the fp32 reduce-scatter layout (docs/parallel.md,
    `_Unit`). Holds no reference to its wrapper: the wrapper passes itself to the methods that need it."""

    def __init__(self, fsdp: "FSDP", index: int, name: str, root: nn.Module, members: list[tuple[str, nn.Module]]):
        n, rank = fsdp.world_size, fsdp.rank
        originals = [mod.weight for _, mod in members]
        rows = [math.ceil(w.shape[0] / n) for w in originals]
        sizes = [r * (w.numel() // max(w.shape[0], 1)) for r, w in zip(rows, originals)]
        self.index, self.name, self.root = index, name, root
        self.sizes, self.shard_numel = sizes, sum(sizes)
        device, self.dtype = originals[0].device, fsdp.compute_dtype or originals[0].dtype
        # A group of one: the identity. Without a cast the full weights are the shards themselves (`aliased`: no
        # gather, nothing freed); with one, the cast weights stay from the unit's forward to its backward.
        self.identity = n == 1 and not fsdp.collectives_alone
        self.aliased = self.identity and self.dtype == originals[0].dtype
        self.kept = False  # identity with a cast: gathered in forward, kept for backward
        with torch.no_grad():
            self.shard_flat = torch.zeros(self.shard_numel, dtype=originals[0].dtype, device=device)
            full_flat = (self.shard_flat if self.aliased else
                         torch.empty(n * self.shard_numel, dtype=self.dtype, device=device))
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
        self.nbytes = 0 if self.aliased else self.storage.nbytes()
        # Views of the full storage built while it is allocated (they stay valid across resizes, as `padded` does).
        self.gather_outputs = [w.padded.view(-1) for w in self.weights]
        self.send_slots = [w.padded[rank] for w in self.weights]  # the compute-dtype gathers' inputs, in place
        self.cast_runs = _cast_runs(self.storage, self.shard_flat, sizes, n, rank, self.dtype)
        if not self.aliased:
            self.storage.resize_(0)
        self.shard_pieces = list(self.shard_flat.split(sizes))
        self.send_sizes = [n * size for size in sizes]  # each weight's piece of the fp32 reduce-scatter input
        # A frozen Linear still reads its weight in backward (for its input's gradient); an embedding never does.
        self.needs_weight_in_backward = any(not is_embedding(w.module) for w in self.weights)
        self.num_trainable = sum(w.full.requires_grad for w in self.weights)
        self.state = _READY if self.aliased else _FREE
        self._work: dist.Work | None = None
        self._send: torch.Tensor | list[torch.Tensor] | None = None  # what the all-gather reads, until it is waited
        self._recv: torch.Tensor | None = None  # all-gather output awaiting its copy-out (units of several weights)
        self.grads: list[torch.Tensor | None] = [None] * len(self.weights)  # this backward's full gradients
        self.grads_left = self.num_trainable
        self.had_grad = [False] * len(self.weights)  # since the last finish: weights without one get no .grad
        self.reduced_grad: torch.Tensor | list[torch.Tensor] | None = None  # summed shard grads, until finish
        self.backward_done = False
        self.fwd_pos = -1

    def start_gather(self, fsdp: "FSDP", phase: str) -> None:
        if self.state != _FREE:
            return
        cast = self.shard_flat.dtype != self.dtype  # cast before communicating: bf16 moves half the bytes of fp32
        if self.identity:  # the cast is the whole gather (aliased units are never free)
            self.storage.resize_(self.nbytes)
            self.cast_shards()
            fsdp._count_gathered(self.nbytes)
            self.state = _READY
            return
        fsdp._before_collective()
        if len(self.weights) == 1 or fsdp._coalesced_gather:
            # One all-gather per weight into its padded full tensor (rank-major is each weight's own layout),
            # issued as one group. A cast writes this rank's shards straight into their slots of the outputs, and
            # the all-gathers run in place there (as FSDP2's): no separate send buffer.
            self.storage.resize_(self.nbytes)
            if cast:
                self.cast_shards()
                self._send = self.send_slots
            else:
                self._send = self.shard_pieces
            if fsdp._coalesced_gather:
                self._work = fsdp._group.allgather_into_tensor_coalesced(self.gather_outputs, self._send,
                                                                         fsdp._all_gather_opts)
            else:
                self._work = all_gather_single(self.gather_outputs[0], self._send[0], group=fsdp.process_group,
                                               async_op=True)
        else:  # one flat all-gather, copied out at wait; the full storage is allocated then (one buffer in flight)
            self._send = self.shard_flat.to(self.dtype) if cast else self.shard_flat
            self._recv = torch.empty(fsdp.world_size * self.shard_numel, dtype=self.dtype,
                                     device=self.shard_flat.device)
            self._work = all_gather_single(self._recv, self._send, group=fsdp.process_group, async_op=True)
        fsdp._count_gathered(self.nbytes)
        self.state = _GATHERING
        fsdp.stats.all_gathers += 1
        fsdp.stats.all_gather_bytes += self.nbytes
        fsdp._log("all_gather", self.name, phase)

    def cast_shards(self) -> None:
        """Write this rank's shards, cast to the compute dtype, into its slots of the full weights: one strided
        copy per run of same-size shards (`_cast_runs`)."""
        for dst, src in self.cast_runs:
            dst.copy_(src)

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
        self.kept = False
        if self.state == _FREE or self.aliased:
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


def _cast_runs(storage: torch.UntypedStorage, shard_flat: torch.Tensor, sizes: list[int], n: int, rank: int,
               dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs that together cast the shards in `shard_flat` (padded sizes `sizes`, back to
    back) into rank `rank`'s slots of the full storage (weight after weight, each N * size, rank-major). A run of
    consecutive weights of one size is one (k, size) view of each side and one copy kernel (N = 1: one copy in all).
    Views of the storage, built once: they stay valid across its resizes, as each weight's `padded` does."""
    runs, i = [], 0
    while i < len(sizes):
        j = i + 1
        while j < len(sizes) and (n == 1 or sizes[j] == sizes[i]):
            j += 1
        offset, size, total = sum(sizes[:i]), sizes[i], sum(sizes[i:j])
        if n == 1:
            shape, strides = (1, total), (total, 1)
        else:
            shape, strides = (j - i, size), (n * size, 1)
        dst = torch.empty(0, dtype=dtype, device=shard_flat.device).set_(storage, n * offset + rank * size, shape,
                                                                         strides)
        runs.append((dst, shard_flat[offset:offset + total].view(shape)))
        i = j
    return runs


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

    Args (in full: docs/parallel.md):
        module: the whole model, identical on every rank (rank 0's values are broadcast at construction).
        compute_dtype: dtype of communicated weights and of compute (e.g. torch.bfloat16); None keeps fp32.
        process_group: the data-parallel group (default: the whole world).
        units: module classes (or names) whose outermost instances are one unit; None: one unit per sharded module.
        max_inflight_reductions: reduce-scatters in flight before the oldest is waited for (bounds fp32 buffers).
        sm_carveout: keep cuBLAS off this many SMs from each forward until finish (parallel/carveout.py).
        event_log: a list to append ("all_gather" | "reduce_scatter", unit name, "forward" | "backward") to as
            collectives are issued (a unit of one module is named after its weight, a larger one after its root).
        collectives_alone: on a group of one, issue every collective a larger group does instead of the identity.
        flat_collectives: one flat all-gather (copied out) and one rank-major reduce-scatter per unit, instead of
            one collective per weight in a coalesced group.
        flat_reduce_scatter: the reduce-scatter of `flat_collectives` alone.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 process_group: dist.ProcessGroup | None = None, *, units: Iterable[type | str] | None = None,
                 max_inflight_reductions: int = 1, sm_carveout: int | None = None, event_log: list | None = None,
                 collectives_alone: bool = False, flat_collectives: bool = False, flat_reduce_scatter: bool = False):
        super().__init__()
        carveout = SMCarveout(sm_carveout)
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype ({compute_dtype!r}) must be a floating-point torch.dtype or None")
        for name, flag in (("flat_collectives", flat_collectives), ("flat_reduce_scatter", flat_reduce_scatter)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} ({flag!r}) must be a bool")
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
        self.collectives_alone = collectives_alone
        self.carveout = carveout
        self.stats = CommStats()
        self._event_log = event_log
        self._gathered_bytes = [0]  # mutated in place: hooks skip Module.__setattr__'s checks
        broadcast_module_state(module, process_group)
        # Collectives go to the process group directly, with options built once.
        self._group = process_group if process_group is not None else dist.group.WORLD
        self._mean_op, self._divisor = mean_reduction(process_group)
        self._all_gather_opts = async_options(AllgatherOptions)
        self._reduce_scatter_opts = async_options(ReduceScatterOptions, self._mean_op)
        self._all_reduce_opts = async_options(AllreduceOptions, self._mean_op)
        self._all_reduce_coalesced_opts = async_options(AllreduceCoalescedOptions, self._mean_op)

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
                if compute_dtype is not None and has_other_floating_params(w.module):
                    handles.append(w.module.register_forward_pre_hook(WeakHook(self._owner, FSDP._cast_pre)))
                    handles.append(w.module.register_forward_hook(WeakHook(self._owner, FSDP._cast_post)))
                elif compute_dtype is not None:
                    # Only inputs to cast: by the module's class, not a hook (fewer guards in a compiled block;
                    # see `casting_class`).
                    handles.append(cast_inputs_by_class(w.module, compute_dtype))
        # Runs remove_hooks' work when the wrapper is collected (or when remove_hooks() calls it).
        self._remove_handles = weakref.finalize(self, remove_handles, handles)
        self._pre_backward_hooks = [WeakHook(self._owner, FSDP._pre_backward, unit.index) for unit in self._units]
        self._weight_of_shard = {id(w.shard): w for unit in self._units for w in unit.weights}
        self._replicated = [p for p in module.parameters() if id(p) not in self._weight_of_shard and p.requires_grad]
        self._pending: deque[_PendingOp] = deque()
        self._fwd_calls: list[_Unit] = []
        self._last_order: list[_Unit] = []
        # Without reduce-scatter (some gloo builds): all-reduce + narrow.
        self._reduce_scatter_ok = self._backend_runs(lambda: reduce_scatter_single(
            torch.zeros(1), torch.zeros(self.world_size), group=process_group))
        # Coalesced all-gathers where the backend has them, else the flat fallback; on gloo one flat reduce-scatter
        # over the rank-major buffer (its coalesced one runs concurrent all-reduces on worker threads).
        self.flat_collectives = flat_collectives
        self._coalesced_gather = (not flat_collectives and hasattr(self._group, "allgather_into_tensor_coalesced")
                                  and self._backend_runs(lambda: self._group.allgather_into_tensor_coalesced(
                                      [torch.zeros(self.world_size)], [torch.zeros(1)], self._all_gather_opts).wait()))
        self.flat_reduce_scatter = flat_collectives or flat_reduce_scatter
        self._coalesced_reduce_scatter = (not self.flat_reduce_scatter and dist.get_backend(process_group) != "gloo"
                                          and hasattr(self._group, "reduce_scatter_tensor_coalesced"))
        # gloo: one collective in flight at a time (concurrent collectives of one group are unsafe there; NCCL
        # orders a group's collectives on one stream).
        self._one_in_flight = dist.get_backend(process_group) == "gloo"

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
            if unit.kept:  # cast for a backward that never came: cast again (the shards may have changed)
                unit.free(self)
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
        for unit in self._units:  # prefetched but not used by this forward (control flow changed)
            if not unit.kept:
                unit.free(self)
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
        backward = unit.needs_weight_in_backward and torch.is_grad_enabled()
        if backward and unit.identity:
            unit.kept = True  # a group of one: re-gathering would cast the same shards again
        else:
            unit.free(self)
        if backward:
            _on_gradients(_output_tensors(output), self._pre_backward_hooks[index], "any")
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
        if unit.identity:
            self._store_identity(unit, grads)
            return
        first = grads[0]
        coalesced = self._coalesced_reduce_scatter
        if (len(grads) == 1 and first is not None and first.dtype == torch.float32 and first.is_contiguous()
                and first.numel() == n * unit.shard_numel):
            send = first.view(-1)  # already fp32 and laid out as its own padded piece: sent as it is
            pieces = [send]
        elif coalesced:  # fp32, weight after weight, each its own padded (N * rows, ...) tensor: rank-major already
            send = torch.empty(n * unit.shard_numel, dtype=torch.float32, device=device)
            pieces = list(send.split(unit.send_sizes))
            _cast_into(pieces, grads, unit.weights)
        else:  # fp32, each weight's rows laid out by owning rank, padding rows zero
            full_grads = [g if g is not None else torch.zeros(w.shape, dtype=w.full.dtype, device=device)
                          for g, w in zip(grads, unit.weights)]
            send = torch.empty(n * unit.shard_numel, dtype=torch.float32, device=device)
            torch._chunk_cat(full_grads, dim=0, num_chunks=n, out=send.view(n, -1))
            del full_grads
        del grads, first
        self._before_collective()
        # A group of one reduces in place: this rank's slot of the input is the whole input, and nothing moves.
        out = send if n == 1 else torch.empty(unit.shard_numel, dtype=torch.float32, device=device)
        if coalesced:  # one reduce-scatter per weight, issued as one group: each shard lands in its slot of `out`
            work = self._group.reduce_scatter_tensor_coalesced(pieces if n == 1 else list(out.split(unit.sizes)),
                                                               pieces, self._reduce_scatter_opts)
        elif self._reduce_scatter_ok:
            work = reduce_scatter_single(out, send, op=self._mean_op, group=self.process_group, async_op=True)
        else:  # gloo without reduce-scatter: all-reduce the whole gradient, keep this rank's slice
            out = send.narrow(0, self.rank * unit.shard_numel, unit.shard_numel)
            work = dist.all_reduce(send, op=self._mean_op, group=self.process_group, async_op=True)
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

    @staticmethod
    def _store_identity(unit: _Unit, grads: list[torch.Tensor | None]) -> None:
        """A group of one: the local gradients are the mean, kept per weight until finish (fp32 ones as they are,
        compute-dtype ones cast into one flat fp32 buffer); a second backward pass adds into them."""
        if unit.aliased and all(g is not None for g in grads):
            pieces = grads
        else:
            flat = torch.empty(unit.shard_numel, dtype=torch.float32, device=unit.shard_flat.device)
            pieces = list(flat.split(unit.sizes))
            _cast_into(pieces, grads, unit.weights)
        del grads
        if unit.reduced_grad is None:
            unit.reduced_grad = pieces
        else:
            torch._foreach_add_(unit.reduced_grad, [p.view_as(q) for p, q in zip(pieces, unit.reduced_grad)])

    def _all_reduce_replicated(self) -> None:
        """Average the replicated gradients: one coalesced all-reduce per dtype, in place (blocking); nothing on a
        group of one."""
        if self.world_size == 1 and not self.collectives_alone:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._replicated:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        self._before_collective()
        for grads in by_dtype.values():
            if len(grads) == 1:
                self._group.allreduce(grads, self._all_reduce_opts).wait()
            else:
                self._group.allreduce_coalesced(grads, self._all_reduce_coalesced_opts).wait()
            if self._divisor != 1:
                torch._foreach_div_(grads, self._divisor)
            self.stats.all_reduces += 1
            self.stats.all_reduce_bytes += sum(g.numel() for g in grads) * grads[0].element_size()

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
            summed, unit.reduced_grad = unit.reduced_grad, None
            if isinstance(summed, list):  # a group of one (_store_identity): per weight, nothing to divide
                pieces = summed
            else:
                if self._divisor != 1:
                    summed.div_(self._divisor)
                pieces = summed.split(unit.sizes)
            had_grad, unit.had_grad = unit.had_grad, [False] * len(unit.weights)
            for w, got, grad in zip(unit.weights, had_grad, pieces):
                if not got:  # no gradient reached it (unused this step): none, as without FSDP
                    continue
                shard = w.shard
                grad = grad.view(shard.shape)
                if grad.dtype != shard.dtype:
                    grad = grad.to(shard.dtype)
                shard.grad = grad if shard.grad is None else shard.grad.add_(grad)

    def remove_hooks(self) -> None:
        """Unregister the wrapper's hooks and drop its gradient state (a later forward raises; the modules keep their
        shards). Happens when the wrapper is collected; idempotent; never waits on a collective."""
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
        self._before_collective()
        out = {}
        for name, p in self.module.named_parameters():
            w = self._weight_of_shard.get(id(p))
            if w is None:
                out[name] = p.detach().clone()
                continue
            flat = torch.empty(self.world_size * w.shard_numel, dtype=p.dtype, device=p.device)
            all_gather_single(flat, p.detach().reshape(-1), group=self.process_group)
            out[name] = flat[: w.numel].view(w.shape)
        return out

    @property
    def unit_names(self) -> list[str]:
        """Names of the units, in module order (what the event log names)."""
        return [unit.name for unit in self._units]

    def gathered_storage_bytes(self) -> int:
        """Bytes of full weights currently materialised (0 outside a forward / backward)."""
        return sum(unit.storage.nbytes() for unit in self._units if not unit.aliased)

    # ------------------------------------------------------------------ helpers
    def _before_collective(self) -> None:
        """On gloo, complete every gather and reduction in flight before another collective is issued (see
        `_one_in_flight`); nothing on NCCL."""
        if not self._one_in_flight:
            return
        for unit in self._units:
            if unit.state == _GATHERING:
                unit.wait_gather(self)
        while self._pending:
            self._pending.popleft().complete()

    def _free_all(self) -> None:
        for unit in self._units:
            unit.free(self)

    def _count_gathered(self, delta: int) -> None:
        self._gathered_bytes[0] += delta
        self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, self._gathered_bytes[0])

    def _log(self, event: str, name: str, phase: str) -> None:
        if self._event_log is not None:
            self._event_log.append((event, name, phase))

    def _backend_runs(self, probe: Callable[[], Any]) -> bool:
        """Whether the group's backend runs a collective: NCCL does; gloo (some builds lack one) is asked with a
        tiny blocking `probe()` (a collective: every rank constructs the wrapper, so every rank asks)."""
        if dist.get_backend(self.process_group) != "gloo":
            return True
        try:
            probe()
        except (RuntimeError, NotImplementedError):
            return False
        return True


FSDP_KINDS = ("fsdp", "fsdp2")


def make_fsdp(kind: str, module: nn.Module, *, compute_dtype: torch.dtype | None = None,
              process_group: dist.ProcessGroup | None = None, units: Iterable[type | str] | None = None,
              **kwargs: Any) -> nn.Module:
    """Shard `module` in one call, as a trial builds its strategy.

    "fsdp": `FSDP(module, compute_dtype, process_group, units=units, **kwargs)`. "fsdp2": torch's `fully_shard` on
    every outermost module of `units` (classes or class names), then on the root, with
    `MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)` when `compute_dtype` is set; returns
    `module` itself (FSDP2 reduces inside backward, so it has no `finish_gradient_synchronization`). `kwargs` go to
    `FSDP` or to every `fully_shard` call (e.g. `reshard_after_forward`).
    """
    if kind not in FSDP_KINDS:
        raise ValueError(f"FSDP kind {kind!r} is not one of {list(FSDP_KINDS)}")
    if kind == "fsdp":
        return FSDP(module, compute_dtype, process_group, units=units, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype ({compute_dtype!r}) must be a floating-point torch.dtype or None")
    spec = _unit_spec(units)
    roots, inside = [], set()
    for mod in module.modules():
        if spec and id(mod) not in inside and _matches(mod, spec):
            roots.append(mod)
            inside.update(id(sub) for sub in mod.modules())
    if spec and not roots:
        raise ValueError(f"units {spec!r}: the model has no module of those classes")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("FSDP2 needs an initialised torch.distributed process group (init_process_group first)")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    first = next(module.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    mesh = DeviceMesh.from_group(process_group if process_group is not None else dist.group.WORLD, device_type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                  reduce_dtype=torch.float32 if compute_dtype is not None else None)
    for root in roots:
        fully_shard(root, mesh=mesh, mp_policy=policy, **kwargs)
    fully_shard(module, mesh=mesh, mp_policy=policy, **kwargs)
    return module
