"""FSDP's compute-dtype policy (mixed precision) and `CastForCompute`, the same policy on one process without sharding:
for each forward of a Linear / Embedding (by class name) its floating parameters and inputs are cast to the compute
dtype by differentiable casts (fp32 gradients reach the fp32 masters), the originals put back after it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from parallel.hooks import WeakHook, remove_handles

__all__ = ["CastForCompute", "cast_inputs", "cast_inputs_by_class", "cast_params", "casting_class",
           "has_other_floating_params", "is_embedding", "is_sharded_module"]


def is_sharded_module(module: nn.Module) -> bool:
    """Whether the policy casts this module (and FSDP shards its weight): Linear / Embedding (torch's or any class
    with that name) with a `weight` parameter."""
    named = type(module).__name__ in ("Linear", "Embedding") or isinstance(module, (nn.Linear, nn.Embedding))
    return named and isinstance(getattr(module, "weight", None), nn.Parameter)


def is_embedding(module: nn.Module) -> bool:
    """Whether the module is an embedding (its backward never reads its weight)."""
    return isinstance(module, nn.Embedding) or type(module).__name__ == "Embedding"


def cast_params(module: nn.Module, dtype: torch.dtype, skip: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
    """Put differentiable `dtype` casts of `module`'s own floating parameters in their place; return the originals
    (gradients flow through the casts back to them)."""
    saved = {}
    for name, p in module._parameters.items():
        if name not in skip and p is not None and p.is_floating_point() and p.dtype != dtype:
            saved[name] = p
            module._parameters[name] = p.to(dtype)
    return saved


def cast_inputs(args: tuple, dtype: torch.dtype) -> tuple | None:
    """`args` with floating tensors cast to `dtype`; None (a forward pre-hook's "unchanged") if none needs it."""
    if not any(isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype for a in args):
        return None
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


_CASTING_CLASSES: dict[tuple[type, torch.dtype], type] = {}


def casting_class(cls: type, dtype: torch.dtype) -> type:
    """The subclass of module class `cls` (one per class and dtype, same name) whose forward casts its floating
    positional inputs to `dtype` first: a type Dynamo guards on anyway, where a pre-hook adds guards."""
    key = (cls, dtype)
    sub = _CASTING_CLASSES.get(key)
    if sub is None:
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return cls.forward(self, *(cast_inputs(args, dtype) or args), **kwargs)

        sub = type(cls.__name__, (cls,), {"forward": forward, "__qualname__": cls.__qualname__,
                                          "__module__": cls.__module__, "compute_dtype": dtype})
        _CASTING_CLASSES[key] = sub
    return sub


class _ClassSwap:
    """The handle of `cast_inputs_by_class`: `remove()` puts the module's own class back (idempotent)."""

    __slots__ = ("module", "cls", "swapped")

    def __init__(self, module: nn.Module, cls: type, swapped: type):
        self.module, self.cls, self.swapped = weakref.ref(module), cls, swapped

    def remove(self) -> None:
        module = self.module()
        if module is not None and type(module) is self.swapped:
            module.__class__ = self.cls


def cast_inputs_by_class(module: nn.Module, dtype: torch.dtype) -> _ClassSwap:
    """Make `module` cast its floating positional inputs to `dtype` before its forward, by swapping in
    `casting_class(type(module), dtype)`; the returned handle's `remove()` undoes it, as a hook handle's does."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype ({dtype!r}) must be a floating-point torch.dtype")
    cls = type(module)
    module.__class__ = casting_class(cls, dtype)
    return _ClassSwap(module, cls, module.__class__)


def has_other_floating_params(module: nn.Module) -> bool:
    """Whether the module has floating parameters besides `weight` (a bias) that the policy must cast too."""
    return any(name != "weight" and p is not None and p.is_floating_point() for name, p in module._parameters.items())


class CastForCompute(nn.Module):
    """FSDP's compute-dtype policy (module docstring) without sharding or communication: the single-process
    reference of `FSDP(module, compute_dtype)`."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype):
        super().__init__()
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype ({compute_dtype!r}) must be a floating-point torch.dtype")
        self.module, self.compute_dtype = module, compute_dtype
        self._saved: dict[nn.Module, dict[str, nn.Parameter]] = {}
        owner = weakref.ref(self)  # hooks hold the wrapper weakly (parallel/hooks.py)
        handles = []
        for mod in module.modules():
            if is_sharded_module(mod):
                handles.append(mod.register_forward_pre_hook(WeakHook(owner, CastForCompute._pre_forward)))
                handles.append(mod.register_forward_hook(WeakHook(owner, CastForCompute._post_forward)))
        self._remove_handles = weakref.finalize(self, remove_handles, handles)
        self._hooks_removed = False

    def remove_hooks(self) -> None:
        """Unregister the casting hooks (a later forward raises; the model itself is unchanged). Happens by itself
        when the wrapper is garbage-collected; idempotent."""
        self._remove_handles()
        self._hooks_removed = True

    def _pre_forward(self, module: nn.Module, args: tuple) -> tuple:
        self._saved[module] = cast_params(module, self.compute_dtype)
        return cast_inputs(args, self.compute_dtype)

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
