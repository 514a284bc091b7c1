"""Optimizer state sharding: each rank keeps optimizer state for ~1/N of the parameters (handout section 6).

`ShardedOptimizer(params, optimizer_cls, process_group=None, **kwargs)` assigns every parameter to one owner rank
(largest first onto the least-loaded rank) and steps a local `optimizer_cls(**kwargs)` over the ones this rank owns,
then broadcasts each updated parameter from its owner (async, per owner in buckets of <= `bucket_size_mb` MiB).
Invariant: after `step()` every rank holds identical parameters, equal to what one unsharded `optimizer_cls` would
produce. `state_dict()` is a collective returning the consolidated state on the CPU in one unsharded optimizer's
layout; `load_state_dict()` takes such a dict on every rank, whatever world size saved it (docs/parallel.md).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel.ddp import assign_buckets, global_rank

__all__ = ["ShardedOptimizer", "local_state_bytes"]


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps any `torch.optim.Optimizer` class; see the module docstring for what is sharded and sent."""

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer],
                 process_group: dist.ProcessGroup | None = None, *, bucket_size_mb: float = 25.0, **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls ({optimizer_cls!r}) must be a torch.optim.Optimizer subclass")
        if not isinstance(bucket_size_mb, (int, float)) or not math.isfinite(bucket_size_mb) or bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb ({bucket_size_mb!r}) must be a finite number >= 0")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ShardedOptimizer needs an initialised torch.distributed process group")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = kwargs
        self.bucket_size_mb = float(bucket_size_mb)
        self._owner: dict[torch.Tensor, int] = {}
        self._load = [0] * self.world_size          # elements owned by each rank
        self.local_optimizer: torch.optim.Optimizer | None = None
        # Calls self.add_param_group for every group, which shards it and builds the local optimizer.
        super().__init__(params, dict(kwargs))

    # ---- sharding -------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (at construction or later, e.g. when unfreezing layers) and shard its parameters."""
        super().add_param_group(param_group)      # validates, fills defaults, appends to self.param_groups
        group = self.param_groups[-1]
        # Largest first onto the least-loaded rank (lowest rank on ties): identical on every rank because
        # every rank sees the same parameters in the same order.
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            owner = min(range(self.world_size), key=self._load.__getitem__)
            self._owner[p] = owner
            self._load[owner] += p.numel()
        local_group = {k: v for k, v in group.items() if k != "params"}
        local_group["params"] = [p for p in group["params"] if self._owner[p] == self.rank]
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)
        # The local optimizer filled in its own defaults (betas, eps, ...): show them on the wrapper's group
        # too, so that state_dict() has the layout of an unsharded optimizer.
        group.update({k: v for k, v in self.local_optimizer.param_groups[-1].items() if k != "params"})

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank of the process group that keeps `param`'s optimizer state and broadcasts its updates."""
        return self._owner[param]

    @property
    def owned_numel(self) -> list[int]:
        """Parameter elements owned by each rank (the balance the greedy assignment achieved)."""
        return list(self._load)

    # ---- the step ---------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Step the local shard (hyper-parameters such as a scheduled lr are taken from this wrapper's
        groups), then broadcast every updated parameter from its owner."""
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})
        loss = self.local_optimizer.step(closure, **kwargs)
        self._broadcast_parameters()
        return loss

    def _buckets(self) -> list[tuple[int, list[torch.Tensor]]]:
        """(owner, params) groups to broadcast: each owner's trainable parameters in `assign_buckets`, in an order
        every rank computes identically."""
        by_owner: dict[int, list[torch.Tensor]] = {}
        for p in self._all_params():
            if p.requires_grad:
                by_owner.setdefault(self._owner[p], []).append(p)
        return [(owner, bucket) for owner, params in sorted(by_owner.items())
                for bucket in assign_buckets(params, self.bucket_size_mb)]

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        pending = []
        for owner, params in self._buckets():
            src = global_rank(self.process_group, owner)
            if len(params) == 1:
                flat = params[0].detach()
            elif owner == self.rank:
                flat = _flatten_dense_tensors([p.detach() for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            work = dist.broadcast(flat, src=src, group=self.process_group, async_op=True)
            pending.append((work, owner, params, flat))
        for work, owner, params, flat in pending:
            work.wait()
            if len(params) > 1 and owner != self.rank:
                for p, synced in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.copy_(synced)

    # ---- checkpoints ------------------------------------------------------------------------------------

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The consolidated (unsharded) state on every rank, tensors on the CPU. Collective: all ranks call it."""
        consolidated = super().state_dict()       # param_groups with indices; the wrapper's own state is empty
        params = self._all_params()
        index = {p: i for i, p in enumerate(params)}
        local = {index[p]: s for p, s in self.local_optimizer.state.items()}
        # Each owner describes its state (tensor shapes/dtypes, plain values); then the tensors are broadcast.
        skeleton = {i: {k: ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", v)
                        for k, v in s.items()} for i, s in local.items()}
        skeletons: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(skeletons, skeleton, group=self.process_group)
        state: dict[int, dict[str, Any]] = {}
        for owner, owned in enumerate(skeletons):
            src = global_rank(self.process_group, owner)
            for i, entries in owned.items():
                device = params[i].device             # NCCL sends device tensors; gloo CPU ones
                out = {}
                for key, (kind, *meta) in entries.items():
                    if kind == "value":
                        out[key] = meta[0]
                        continue
                    shape, dtype = meta
                    if owner == self.rank:
                        buf = local[i][key].to(device)
                    else:
                        buf = torch.empty(shape, dtype=dtype, device=device)
                    dist.broadcast(buf, src=src, group=self.process_group)
                    out[key] = buf.detach().to("cpu", copy=True)   # never alias the live state
                state[i] = out
        consolidated["state"] = dict(sorted(state.items()))
        return consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated (or plain `optimizer_cls`) state dict; every rank passes the same dict."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        saved_index: dict[torch.Tensor, int] = {}
        for g, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"parameter group {g} has {len(saved['params'])} parameters in the state dict, "
                                 f"{len(group['params'])} here")
            saved_index.update(zip(group["params"], saved["params"]))
            group.update({k: v for k, v in saved.items() if k != "params"})
        # The local optimizer numbers its own parameters 0, 1, ... through its groups.
        local_state, local_groups, n = {}, [], 0
        for local, saved in zip(self.local_optimizer.param_groups, saved_groups):
            indices = []
            for p in local["params"]:
                if saved_index[p] in state_dict["state"]:
                    # Cloned: torch's load keeps same-device tensors as they are, and the caller's dict (often
                    # loaded by several optimizers, or saved again) must not change as this one steps.
                    local_state[n] = {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                      for k, v in state_dict["state"][saved_index[p]].items()}
                indices.append(n)
                n += 1
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    def __repr__(self) -> str:
        return (f"ShardedOptimizer({self.optimizer_cls.__name__}, rank {self.rank}/{self.world_size}, "
                f"owned elements per rank {self._load})")


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors held in an optimizer's state on this rank (a ShardedOptimizer's local shard)."""
    inner = optimizer.local_optimizer if isinstance(optimizer, ShardedOptimizer) else optimizer
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
