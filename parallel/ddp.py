"""Distributed data parallel (DDP): gradient averaging over a process group, from naive to bucketed, side by side.

Each wrapper replicates `module` on every rank of `process_group` (default: the world), broadcasts rank 0's
parameters and buffers at construction and averages gradients: `NaiveDDP` (a blocking all-reduce per parameter after
backward), `FlatDDP` (one all-reduce of a flat copy per dtype), `OverlappedDDP` (an async all-reduce per parameter as
its gradient is ready), `BucketedDDP` (an async coalesced all-reduce per bucket of <= `bucket_size_mb`, in reverse
parameter order), `TorchDDP` (torch's DistributedDataParallel, the baseline).
Invariant: after `finish_gradient_synchronization()` every parameter that required a gradient has `.grad` equal to the
mean over the group (zeros standing for a rank that produced none); frozen parameters are never sent, a tied one once.
Buckets launch in bucket order; a group of one is the identity unless `collectives_alone=True`; `no_sync()`
accumulates locally. Hooks hold a `_Reducer`, never the wrapper: a dropped wrapper is freed at once (docs/parallel.md).
    ddp = make_ddp("bucketed", model, bucket_size_mb=100)
    loss_fn(ddp(x), y).backward(); ddp.finish_gradient_synchronization(); optimizer.step()
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import weakref
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.distributed_c10d import AllreduceCoalescedOptions, AllreduceOptions

from parallel.carveout import SMCarveout
from parallel.hooks import remove_handles

__all__ = ["NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP", "TorchDDP", "DDP_KINDS", "make_ddp", "assign_buckets",
           "broadcast_module_state", "mean_reduction", "async_options", "global_rank", "compiled_regions",
           "ready_together"]


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank` (what `src=` of a collective takes)."""
    return group_rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def _module_device(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


@torch.no_grad()
def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy every parameter and buffer of the group's rank 0 into `module` on all ranks (in place), after checking
    that all ranks hold modules of the same structure."""
    tensors = [*module.parameters(), *module.buffers()]
    signature = torch.tensor([len(tensors), sum(t.numel() for t in tensors)], device=_module_device(module))
    gathered = [torch.empty_like(signature) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, signature, group=group)
    for rank, theirs in enumerate(gathered):
        if not torch.equal(theirs, signature):
            raise ValueError(f"module structure differs across ranks: rank {rank} has (num tensors, num elements) "
                             f"= {tuple(theirs.tolist())}, this rank {tuple(signature.tolist())}")
    src = global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t.detach(), src=src, group=group)


def async_options(cls: type, op: dist.ReduceOp | None = None) -> Any:
    """`cls()` (a c10d options class) that runs asynchronously on the backend's stream, with `reduceOp = op` if
    given: what `ProcessGroup.allreduce(...)` and friends take."""
    opts = cls()
    if op is not None:
        opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # torch >= 2.7: as async_op=True (else a group would run on the current stream)
        opts.asyncOp = True
    return opts


def mean_reduction(group: dist.ProcessGroup | None) -> tuple[dist.ReduceOp, int]:
    """(op, divisor): a collective with `op` over tensors each rank divided by `divisor` averages over `group`:
    AVG on NCCL, SUM alone for a group of one, SUM after dividing elsewhere (gloo has no AVG)."""
    size = dist.get_world_size(group)
    if size == 1:
        return dist.ReduceOp.SUM, 1
    if dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, size


class _DataParallel(nn.Module):
    """What every variant shares: the replica, the rank-0 broadcast, forward, `no_sync` and averaging."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 collectives_alone: bool = False):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("DDP needs an initialised torch.distributed process group (init_process_group first)")
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # A group of one: its mean is the local gradient, nothing to do (unless told to run the collectives anyway).
        self._identity = self.world_size == 1 and not collectives_alone
        self._mean_op, self._divisor = mean_reduction(process_group)
        broadcast_module_state(module, process_group)
        # Deduplicated by `parameters()`: a tied weight appears (and is reduced) once.
        self._params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self._require_sync = True      # False inside no_sync()
        self._sync_this_step = True    # what the last forward decided for its backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_step = self._require_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this context accumulate gradients locally, unreduced."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def _all_reduce_mean(self, tensor: torch.Tensor) -> None:
        if self._identity:
            return
        if self._divisor != 1:
            tensor.div_(self._divisor)
        dist.all_reduce(tensor, op=self._mean_op, group=self.process_group)

    @staticmethod
    def _local_grad(p: nn.Parameter) -> torch.Tensor:
        """The gradient this rank contributes: `.grad`, or zeros (set as `.grad`) if backward produced none."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    @property
    def num_collectives(self) -> int:
        """All-reduces one synchronised step issues."""
        raise NotImplementedError

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per parameter, all issued after backward (no overlap, many small calls)."""

    @property
    def num_collectives(self) -> int:
        return 0 if self._identity else len(self._params)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step or self._identity:
            return
        for p in self._params:
            self._all_reduce_mean(self._local_grad(p))


class FlatDDP(_DataParallel):
    """All gradients copied into one flat tensor (one per dtype/device) and all-reduced in a single call."""

    @property
    def num_collectives(self) -> int:
        return 0 if self._identity else len({(p.dtype, p.device) for p in self._params})

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step or self._identity:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in self._params:
            grad = self._local_grad(p)
            groups.setdefault((grad.dtype, grad.device), []).append(grad)
        for grads in groups.values():
            flat = _flatten_dense_tensors(grads)
            self._all_reduce_mean(flat)
            torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))


class _Bucket:
    """Parameters reduced by one collective; `buffer` (with `views[i]` params[i]'s slot) is the textbook copy-in/out
    bucket (`grad_as_bucket_view=False`, several parameters), else None: gradients are reduced where they lie."""

    __slots__ = ("params", "buffer", "views")

    def __init__(self, params: list[nn.Parameter], copy: bool):
        self.params = params
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if copy and len(params) > 1:
            p0 = params[0]
            self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
            offsets = [0, *itertools.accumulate(p.numel() for p in params)]
            self.views = [self.buffer[lo:hi].view_as(p) for p, lo, hi in zip(params, offsets, offsets[1:])]


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Split `params` into buckets in reverse order, each of at most `bucket_size_mb` MiB and one dtype/device.

    A parameter larger than the cap gets a bucket of its own; `bucket_size_mb=0` gives one bucket per parameter.
    """
    cap_bytes = bucket_size_mb * 2**20
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > cap_bytes or (p.dtype, p.device) != (last[0].dtype, last[0].device):
            buckets.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return buckets


class _Reducer:
    """What the gradient hooks update during backward, and the collectives they issue (one per wrapper).

    `grads[b][i]`: the gradient of parameter i of bucket b once accumulated (None until then); `left[b]`: how many of
    bucket b's are still to come. Holds no parameter, module or wrapper, so hooks may hold it."""

    def __init__(self, group: dist.ProcessGroup | None, buckets: list[_Bucket], carveout: SMCarveout, identity: bool):
        self.group = group if group is not None else dist.group.WORLD
        self.identity = identity  # a group of one: a launch only advances `next` (module docstring)
        op, self.divisor = mean_reduction(group)
        self.opts = async_options(AllreduceOptions, op)
        self.coalesced_opts = async_options(AllreduceCoalescedOptions, op)
        self.sizes = [len(b.params) for b in buckets]
        self.buffers = [b.buffer for b in buckets]
        self.views = [b.views for b in buckets]
        self.carveout = carveout
        self.sync = True            # whether the backward under way is synchronised (no_sync: False)
        self.pending = False        # a synchronised step has started and not been finished
        # Per-step state, built once and cleared in place by reset().
        self.grads: list[list[torch.Tensor | None]] = [[None] * n for n in self.sizes]
        self._nones = [[None] * n for n in self.sizes]
        self.left = list(self.sizes)
        self.works: list[dist.Work] = []
        self.reset()

    def reset(self) -> None:
        for grads, nones in zip(self.grads, self._nones):
            grads[:] = nones
        self.left[:] = self.sizes
        self.works.clear()
        self.next = 0               # the next bucket to launch
        self.pending = False

    def grad_ready(self, b: int, i: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter i of bucket b: records the gradient, launches what is full."""
        if not self.sync:
            return
        grads = self.grads[b]
        if grads[i] is not None:
            raise RuntimeError("a parameter's gradient was accumulated twice in one synchronised step (two backward "
                               "passes without finish_gradient_synchronization(), or retain_graph reuse); use "
                               "no_sync() for gradient accumulation")
        grads[i] = param.grad
        self.pending = True
        left = self.left
        left[b] -= 1
        if b == self.next and left[b] == 0:
            while self.next < len(left) and left[self.next] == 0:
                self.launch(self.next)

    def launch(self, b: int) -> None:
        """Issue bucket b's all-reduce (every gradient in `grads[b]` set); buckets must be launched in order."""
        assert b == self.next, (b, self.next)
        if self.identity:
            self.next += 1
            return
        if torch.is_grad_enabled():  # backward(create_graph=True) runs hooks with grad mode on
            with torch.no_grad():
                return self.launch(b)
        self.carveout.enter()  # the rest of backward's matmuls leave the collectives' SMs alone
        tensors = self.grads[b]
        if self.buffers[b] is not None:
            torch._foreach_copy_(self.views[b], tensors)
            tensors = [self.buffers[b]]
        if self.divisor != 1:
            torch._foreach_div_(tensors, self.divisor)
        if len(tensors) == 1:
            work = self.group.allreduce(tensors, self.opts)
        else:  # NCCL: one grouped launch of an all-reduce per tensor
            work = self.group.allreduce_coalesced(tensors, self.coalesced_opts)
        self.works.append(work)
        self.next += 1


class _OverlappedDataParallel(_DataParallel):
    """Hook-driven, in-order, asynchronous bucket reduction (`OverlappedDDP`, `BucketedDDP`): a bucket (and every full
    one after it) launches when its last gradient arrives; `finish_gradient_synchronization()` launches the rest and
    waits."""

    def __init__(self, module: nn.Module, buckets: list[list[nn.Parameter]], grad_as_bucket_view: bool,
                 process_group: dist.ProcessGroup | None, sm_carveout: int | None = None,
                 collectives_alone: bool = False):
        carveout = SMCarveout(sm_carveout)  # validated before the broadcast (a collective)
        _DataParallel.__init__(self, module, process_group, collectives_alone=collectives_alone)
        self.carveout = carveout
        self.grad_as_bucket_view = grad_as_bucket_view
        copy = not (grad_as_bucket_view or self._identity)
        self.buckets = [_Bucket(params, copy=copy) for params in buckets]
        self._reducer = _Reducer(process_group, self.buckets, carveout, self._identity)
        self._hooks_removed = False
        handles = [p.register_post_accumulate_grad_hook(partial(self._reducer.grad_ready, b, i))
                   for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)]
        # Runs remove_hooks' work when the wrapper is collected (or when remove_hooks() calls it).
        self._remove_handles = weakref.finalize(self, remove_handles, handles)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def num_collectives(self) -> int:
        return 0 if self._identity else len(self.buckets)

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks and drop in-flight work: the wrapper no longer synchronises (a later
        forward raises). Happens by itself when the wrapper is garbage-collected; idempotent."""
        self._remove_handles()
        self._hooks_removed = True
        self.carveout.exit()
        self._reducer.reset()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks_removed:
            raise RuntimeError("this DDP wrapper's hooks were removed (remove_hooks()): wrap the module again")
        reducer = self._reducer
        if reducer.pending and reducer.next > 0:
            raise RuntimeError("forward called while gradients of the previous backward are still being reduced: "
                               "call finish_gradient_synchronization() after every synchronised backward")
        reducer.sync = self._require_sync
        out = self.module(*args, **kwargs)
        # A synchronised training forward obliges finish_gradient_synchronization() to reduce every bucket,
        # even on a rank whose backward produced no gradient at all (the other ranks wait for it).
        reducer.pending = reducer.pending or (reducer.sync and torch.is_grad_enabled())
        return out

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        reducer = self._reducer
        if not (reducer.sync and reducer.pending):
            return
        # Buckets that never filled hold parameters unused in this step on this rank: launch them anyway, in order,
        # with their accumulated gradient or zeros, so all ranks issue the same collectives (a group of one has no
        # peer waiting: its unused parameters keep no gradient, as without a wrapper).
        for b in range(reducer.next, len(self.buckets)):
            grads = reducer.grads[b]
            if not self._identity:
                for i, grad in enumerate(grads):
                    if grad is None:
                        grads[i] = self._local_grad(self.buckets[b].params[i])
            reducer.launch(b)
        # Every work is waited for, also on NCCL: a work keeps its tensors alive until waited for (docs/parallel.md).
        for work in reducer.works:
            work.wait()
        for grads, bucket in zip(reducer.grads, self.buckets):
            if bucket.buffer is not None:
                torch._foreach_copy_(grads, bucket.views)
        reducer.reset()
        self.carveout.exit()


def _compiled(module: nn.Module) -> bool:
    """Whether `module` runs compiled: `torch.compile(module)`, `module.compile()`, or its `forward` replaced by
    `torch.compile(module.forward)` (raysys.training.step.compile_blocks)."""
    return (getattr(module, "_compiled_call_impl", None) is not None
            or hasattr(getattr(module, "forward", None), "_torchdynamo_orig_callable"))


def compiled_regions(module: nn.Module) -> list[nn.Module]:
    """The outermost modules in `module` (itself included) that run compiled (`_compiled`), in module order."""
    regions: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if any(r == "" or name.startswith(r + ".") for r, _ in regions):  # inside a region already
            continue
        if _compiled(m):
            regions.append((name, m))
    return [m for _, m in regions]


def ready_together(module: nn.Module, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` in reverse order, split where gradients become ready at different moments: one parameter per group,
    except the parameters of one compiled region (`compiled_regions`), whose backward node returns all their
    gradients at once (their hooks fire back to back). A parameter also registered outside its region (tied) stays
    alone; groups also split on dtype/device."""
    owner: dict[int, int | None] = {}
    regions = compiled_regions(module)
    inside = {id(m) for r in regions for m in r.modules()}
    for i, region in enumerate(regions):
        for p in region.parameters():
            owner[id(p)] = i if id(p) not in owner else None  # in two regions: alone
    for m in module.modules():
        if id(m) not in inside:
            for p in m.parameters(recurse=False):
                owner[id(p)] = None
    groups: list[list[nn.Parameter]] = []
    for p in reversed(params):
        region = owner.get(id(p))
        last = groups[-1] if groups else None
        if (region is None or last is None or owner.get(id(last[0])) != region
                or (p.dtype, p.device) != (last[0].dtype, last[0].device)):
            groups.append([p])
        else:
            last.append(p)
    return groups


class OverlappedDDP(_OverlappedDataParallel):
    """An async all-reduce of each parameter's gradient, in place, issued as soon as backward produces it.

    `group_compiled=True` (default): the gradients of one compiled region (`ready_together`) are issued together by
    one coalesced call once the last is accumulated (a region split at graph breaks waits for its last node).
    `False`: one call per parameter always."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 group_compiled: bool = True, sm_carveout: int | None = None, collectives_alone: bool = False):
        if not isinstance(group_compiled, bool):
            raise ValueError(f"group_compiled ({group_compiled!r}) must be a bool")
        params = [p for p in module.parameters() if p.requires_grad]
        groups = ready_together(module, params) if group_compiled else [[p] for p in reversed(params)]
        super().__init__(module, groups, grad_as_bucket_view=True, process_group=process_group,
                         sm_carveout=sm_carveout, collectives_alone=collectives_alone)
        self.group_compiled = group_compiled


class BucketedDDP(_OverlappedDataParallel):
    """Gradients grouped into buckets of at most `bucket_size_mb` MiB, one async all-reduce per bucket.

    `grad_as_bucket_view=True` (default): the bucket's `.grad` tensors, reduced in place by one coalesced collective.
    `False`: the textbook bucket, a flat buffer gradients are copied into before the all-reduce and back after."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, *, grad_as_bucket_view: bool = True,
                 process_group: dist.ProcessGroup | None = None, sm_carveout: int | None = None,
                 collectives_alone: bool = False):
        if not isinstance(bucket_size_mb, (int, float)) or not math.isfinite(bucket_size_mb) or bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb ({bucket_size_mb!r}) must be a finite number >= 0")
        params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, assign_buckets(params, bucket_size_mb), grad_as_bucket_view, process_group,
                         sm_carveout, collectives_alone)
        self.bucket_size_mb = float(bucket_size_mb)


class TorchDDP(nn.Module):
    """`torch.nn.parallel.DistributedDataParallel` with the common interface: its reducer buckets
    (`bucket_size_mb`, torch's default 25) and overlaps inside backward, so there is nothing left to finish."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_size_mb: float = 25.0, **ddp_kwargs: Any):
        super().__init__()
        device = _module_device(module)
        ddp_params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
        if "broadcast_buffers" in ddp_kwargs and "forward_sync_buffers" in ddp_params:
            # Newer torch renamed it (and deprecated the old name); both still sync buffers at construction.
            ddp_kwargs["forward_sync_buffers"] = ddp_kwargs.pop("broadcast_buffers")
        self.ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=[device] if device.type == "cuda" else None, process_group=process_group,
            bucket_cap_mb=bucket_size_mb, **ddp_kwargs)

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: torch's reducer has queued the waits on the compute stream before backward returned."""


DDP_KINDS: dict[str, type[nn.Module]] = {
    "naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP, "bucketed": BucketedDDP, "torch": TorchDDP,
}


def make_ddp(kind: str, module: nn.Module, **kwargs: Any) -> nn.Module:
    """`DDP_KINDS[kind](module, **kwargs)`, e.g. `make_ddp("bucketed", model, bucket_size_mb=100)`."""
    if kind not in DDP_KINDS:
        raise ValueError(f"DDP kind {kind!r} is not one of {sorted(DDP_KINDS)}")
    return DDP_KINDS[kind](module, **kwargs)
