"""Distributed data parallel (DDP): four gradient-averaging strategies side by side, naive to bucketed.

Every wrapper holds a full replica of `module` on each rank of `process_group` (default: the whole world).
At construction it broadcasts every parameter and buffer from the group's rank 0, so all replicas start
equal. Each rank then runs forward and backward on its own slice of the batch; the wrapper averages the
parameter gradients over the group:

| class          | what is communicated, and when                                                          |
| -------------- | --------------------------------------------------------------------------------------- |
| `NaiveDDP`     | after backward, in `finish_gradient_synchronization()`: one blocking all-reduce per     |
|                | parameter                                                                               |
| `FlatDDP`      | after backward: one all-reduce of all gradients flattened into one tensor (per dtype)   |
| `OverlappedDDP`| during backward: an async all-reduce per parameter, issued from its post-accumulate-grad|
|                | hook as soon as its gradient is ready; `finish_gradient_synchronization()` waits        |
| `BucketedDDP`  | during backward: gradients packed into buckets of at most `bucket_size_mb` (filled in   |
|                | reverse parameter order, roughly the order backward produces them); one async           |
|                | all-reduce per bucket once all of its gradients are ready                               |
| `TorchDDP`     | `torch.nn.parallel.DistributedDataParallel` behind the same interface (the baseline)    |

Invariant: after `finish_gradient_synchronization()` returns, every parameter that required a gradient
when the wrapper was built has `.grad` equal to the mean over the group of the ranks' local gradients,
a rank that produced no gradient for it contributing zeros (so it never hangs: see below). Parameters
with `requires_grad=False` are never communicated; a parameter shared by several modules (tied weights)
is reduced once.

Ordering: collectives are matched across ranks by the order they are issued, so the overlapped variants
launch reductions strictly in a fixed order (bucket 0, 1, ...), never in the order gradients happen to
arrive: a bucket that is ready early waits for its predecessors. At `finish_gradient_synchronization()`
every bucket not yet launched (one of its parameters got no gradient on this rank, because it was unused
in this step) is launched with zeros in place of the missing gradients. Every rank therefore issues the
same collectives in the same order whatever its control flow did.

Averaging: NCCL divides during the reduction (`ReduceOp.AVG`); gloo has no AVG, so each rank divides its
gradient by the world size before a SUM (exact for power-of-two world sizes).

SM carve-out (`OverlappedDDP` and `BucketedDDP`, `sm_carveout=N`; see parallel/carveout.py, which also says
what it measured): from the first all-reduce a backward issues until `finish_gradient_synchronization()`,
cuBLAS matmuls target all SMs but N, to leave room for a collective of at most N CTAs (an NCCL group capped
with `max_ctas=N`).

Gradient accumulation: a forward pass run inside `with ddp.no_sync():` skips the synchronisation of its
backward; gradients accumulate locally in `.grad`, and the first backward of a forward outside the
context reduces the accumulated sum (the semantics of torch's DDP).

Lifetime: a parameter's post-accumulate-grad hooks live in a dict that is also held from C++ (the tensor's
autograd metadata), out of sight of Python's cycle collector; a hook holding the wrapper (a bound method)
would make parameter -> hooks -> wrapper -> module -> parameter a cycle the collector never frees, leaking
the model, its gradients and the buckets every time a wrapper is dropped. So the hooks hold the wrapper
weakly and name their bucket slot by index: a wrapper nobody references is freed at once (by reference
counting) and its hooks are removed with it; `remove_hooks()` does the same explicitly.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.carveout import SMCarveout
from parallel.hooks import remove_handles

__all__ = ["NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP", "TorchDDP", "DDP_KINDS", "make_ddp", "assign_buckets",
           "broadcast_module_state"]


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def _module_device(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


@torch.no_grad()
def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy every parameter and buffer of the group's rank 0 into `module` on all ranks (in place).

    First checks that all ranks hold modules of the same structure (tensor counts and total size), which
    would otherwise make the broadcasts below hang or mix tensors up.
    """
    tensors = [*module.parameters(), *module.buffers()]
    signature = torch.tensor([len(tensors), sum(t.numel() for t in tensors)], device=_module_device(module))
    gathered = [torch.empty_like(signature) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, signature, group=group)
    for rank, theirs in enumerate(gathered):
        if not torch.equal(theirs, signature):
            raise ValueError(f"module structure differs across ranks: rank {rank} has (num tensors, num elements) "
                             f"= {tuple(theirs.tolist())}, this rank {tuple(signature.tolist())}")
    src = _global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t.detach(), src=src, group=group)


class _DataParallel(nn.Module):
    """What every variant shares: the replica, the rank-0 broadcast, forward, `no_sync` and averaging."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("DDP needs an initialised torch.distributed process group (init_process_group first)")
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # gloo (and MPI) have no ReduceOp.AVG: divide before summing instead.
        self._native_avg = dist.get_backend(process_group) == "nccl"
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

    def _all_reduce_mean(self, tensor: torch.Tensor, async_op: bool) -> dist.Work | None:
        if self._native_avg:
            return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.process_group, async_op=async_op)
        tensor.div_(self.world_size)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=async_op)

    def _local_grad(self, p: nn.Parameter) -> torch.Tensor:
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
        return len(self._params)

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        for p in self._params:
            self._all_reduce_mean(self._local_grad(p), async_op=False)


class FlatDDP(_DataParallel):
    """All gradients copied into one flat tensor (one per dtype/device) and all-reduced in a single call."""

    @property
    def num_collectives(self) -> int:
        return len({(p.dtype, p.device) for p in self._params})

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_step:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in self._params:
            grad = self._local_grad(p)
            groups.setdefault((grad.dtype, grad.device), []).append(grad)
        for grads in groups.values():
            flat = _flatten_dense_tensors(grads)
            self._all_reduce_mean(flat, async_op=False)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)


@dataclass(eq=False)
class _Bucket:
    """Parameters reduced by one collective. One parameter: its `.grad` is reduced in place (no buffer).
    Several: their gradients live in `buffer` (as views of it, or copied in and out)."""

    params: list[nn.Parameter]
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)   # views[i] is params[i]'s slot in `buffer`
    ready: list[bool] = field(default_factory=list)
    num_ready: int = 0
    work: dist.Work | None = None

    def __post_init__(self) -> None:
        self.ready = [False] * len(self.params)
        if len(self.params) > 1:
            p0 = self.params[0]
            self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device)
            offsets = [0, *itertools.accumulate(p.numel() for p in self.params)]
            self.views = [self.buffer[lo:hi].view_as(p) for p, lo, hi in zip(self.params, offsets, offsets[1:])]

    @property
    def full(self) -> bool:
        return self.num_ready == len(self.params)

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.work = None


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Split `params` into buckets in reverse order, each of at most `bucket_size_mb` MiB and one dtype/device.

    A parameter larger than the cap gets a bucket of its own; `bucket_size_mb=0` gives one bucket per
    parameter. Reverse order because backward produces the last layers' gradients first.
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


class _SyncState:
    """What the hooks update during backward, kept off the module: an attribute write on an `nn.Module` goes
    through `Module.__setattr__` and its checks, once per parameter per step when it is the wrapper's."""

    __slots__ = ("next_bucket", "pending", "all_reduces")

    def __init__(self) -> None:
        self.next_bucket = 0      # the next bucket to launch
        self.pending = False      # a synchronised step has started and not been finished
        self.all_reduces = 0      # collectives issued since construction


class _GradReadyHook:
    """Post-accumulate-grad hook of the parameter in slot `slot` of bucket `bucket`: tells the wrapper, if it
    is still alive. Holds nothing else (see Lifetime in the module docstring)."""

    __slots__ = ("owner", "bucket", "slot")

    def __init__(self, owner: "weakref.ref[_OverlappedDataParallel]", bucket: int, slot: int):
        self.owner, self.bucket, self.slot = owner, bucket, slot

    def __call__(self, param: nn.Parameter) -> None:
        wrapper = self.owner()
        if wrapper is not None:
            wrapper._on_grad_ready(self.bucket, self.slot)


class _OverlappedDataParallel(_DataParallel):
    """Hook-driven, in-order, asynchronous bucket reduction shared by `OverlappedDDP` and `BucketedDDP`.

    Each parameter's hook calls `_on_grad_ready(bucket, slot)` after backward accumulated its `.grad`; when a
    bucket's last gradient arrives, it and every ready bucket after it are launched, in bucket order (the
    cross-rank matching rule in the module docstring). `finish_gradient_synchronization()` launches what is
    left and waits.
    """

    def __init__(self, module: nn.Module, buckets: list[list[nn.Parameter]], grad_as_bucket_view: bool,
                 process_group: dist.ProcessGroup | None, sm_carveout: int | None = None):
        carveout = SMCarveout(sm_carveout)  # validated before the broadcast (a collective)
        _DataParallel.__init__(self, module, process_group)
        self.carveout = carveout
        self.grad_as_bucket_view = grad_as_bucket_view
        self.buckets = [_Bucket(params) for params in buckets]
        self._sync = _SyncState()
        self._hooks_removed = False
        owner = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(_GradReadyHook(owner, b, i))
                   for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)]
        # Runs remove_hooks' work when the wrapper is collected (or when remove_hooks() calls it).
        self._remove_handles = weakref.finalize(self, remove_handles, handles)

    @property
    def num_all_reduces(self) -> int:
        """Collectives issued since construction (tests count them)."""
        return self._sync.all_reduces

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def num_collectives(self) -> int:
        return len(self.buckets)

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks and drop in-flight work: the wrapper no longer synchronises (a later
        forward raises). Happens by itself when the wrapper is garbage-collected; idempotent."""
        self._remove_handles()
        self._hooks_removed = True
        self.carveout.exit()
        for bucket in self.buckets:
            bucket.reset()
        self._sync.next_bucket, self._sync.pending = 0, False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks_removed:
            raise RuntimeError("this DDP wrapper's hooks were removed (remove_hooks()): wrap the module again")
        if self._sync.pending and self._sync.next_bucket > 0:
            raise RuntimeError("forward called while gradients of the previous backward are still being reduced: "
                               "call finish_gradient_synchronization() after every synchronised backward")
        out = super().forward(*args, **kwargs)
        # A synchronised training forward obliges finish_gradient_synchronization() to reduce every bucket,
        # even on a rank whose backward produced no gradient at all (the other ranks wait for it).
        self._sync.pending = self._sync.pending or (self._sync_this_step and torch.is_grad_enabled())
        return out

    def _stage(self, bucket: _Bucket, i: int) -> None:
        """Put params[i]'s local gradient (zeros if it has none) where the bucket's collective will read it."""
        p = bucket.params[i]
        if bucket.buffer is None:
            self._local_grad(p)
            return
        view, grad = bucket.views[i], p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            return           # accumulated straight into the bucket: nothing to move
        if self.grad_as_bucket_view:
            p.grad = view    # later steps accumulate straight into the bucket (until zero_grad sets None)

    def _on_grad_ready(self, b: int, i: int) -> None:
        """Backward accumulated the gradient of buckets[b].params[i]. Runs once per parameter per step, on
        autograd's thread, so it stays lean: no lookups by parameter, and no grad-mode switch unless needed
        (backward runs hooks with grad mode off, except under `create_graph=True`)."""
        if not self._sync_this_step:
            return
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._on_grad_ready(b, i)
        bucket = self.buckets[b]
        if bucket.ready[i]:
            raise RuntimeError("a parameter's gradient was accumulated twice in one synchronised step (two "
                               "backward passes without finish_gradient_synchronization(), or retain_graph reuse); "
                               "use no_sync() for gradient accumulation")
        sync = self._sync
        sync.pending = True
        self._stage(bucket, i)
        bucket.ready[i] = True
        bucket.num_ready += 1
        if b == sync.next_bucket and bucket.full:
            while sync.next_bucket < len(self.buckets) and self.buckets[sync.next_bucket].full:
                self._launch(self.buckets[sync.next_bucket])

    def _launch(self, bucket: _Bucket) -> None:
        self.carveout.enter()  # the rest of backward's matmuls leave the collectives' SMs alone
        tensor = bucket.buffer if bucket.buffer is not None else bucket.params[0].grad
        bucket.work = self._all_reduce_mean(tensor, async_op=True)
        self._sync.all_reduces += 1
        self._sync.next_bucket += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not (self._sync_this_step and self._sync.pending):
            return
        # Buckets that never filled hold parameters unused in this step on this rank: launch them anyway,
        # in order, with zeros for the missing gradients, so all ranks issue the same collectives.
        for bucket in self.buckets[self._sync.next_bucket:]:
            for i, ready in enumerate(bucket.ready):
                if not ready:
                    self._stage(bucket, i)
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.buffer is not None and not self.grad_as_bucket_view:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
            bucket.reset()
        self.carveout.exit()
        self._sync.next_bucket = 0
        self._sync.pending = False


class OverlappedDDP(_OverlappedDataParallel):
    """An async all-reduce of each parameter's gradient, in place, issued as soon as backward produces it
    (in reverse parameter order; see the ordering note in the module docstring)."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 sm_carveout: int | None = None):
        params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, [[p] for p in reversed(params)], grad_as_bucket_view=False,
                         process_group=process_group, sm_carveout=sm_carveout)


class BucketedDDP(_OverlappedDataParallel):
    """Gradients packed into buckets of at most `bucket_size_mb` MiB, one async all-reduce per bucket.

    `grad_as_bucket_view=True`: each multi-parameter bucket is a preallocated flat buffer and `.grad` of its
    parameters become views of it, so accumulation writes into the buffer (a gradient created fresh after
    `zero_grad(set_to_none=True)` is copied in once, then `.grad` is re-pointed at the view). `False`:
    gradients are copied into the buffer when ready and copied back after the reduction. A bucket holding a
    single (large) parameter needs no buffer: its `.grad` is reduced in place.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, *, grad_as_bucket_view: bool = True,
                 process_group: dist.ProcessGroup | None = None, sm_carveout: int | None = None):
        if not isinstance(bucket_size_mb, (int, float)) or not math.isfinite(bucket_size_mb) or bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb ({bucket_size_mb!r}) must be a finite number >= 0")
        params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, assign_buckets(params, bucket_size_mb), grad_as_bucket_view, process_group,
                         sm_carveout)
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
