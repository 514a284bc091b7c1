"""Hooks that hold their wrapper weakly, for wrappers (DDP, FSDP, CastForCompute) that hook the model they wrap.

Why weakly: a parameter's hooks live in a dict held from C++ (the tensor's autograd metadata), out of sight of
Python's cycle collector, so a hook holding its wrapper would make parameter -> hook -> wrapper -> model ->
parameter a cycle that is never freed, leaking the model (and its optimizer state) with every dropped wrapper;
module hooks would make wrapper -> model -> hooks -> wrapper a cycle only the collector frees. A `WeakHook`
holds the wrapper weakly and names what it acts on by index, so a wrapper nobody references is freed at once by
reference counting, and `weakref.finalize(wrapper, remove_handles, handles)` removes its hooks with it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["WeakHook", "remove_handles"]


class WeakHook:
    """A module or tensor hook calling `method(wrapper, *bound, *hook_args)` while the wrapper is alive; once it is
    gone, a no-op returning None. Holds nothing else: `bound` should be indices, not tensors or modules."""

    __slots__ = ("owner", "method", "bound")

    def __init__(self, owner: weakref.ref, method: Callable[..., Any], *bound: Any):
        self.owner, self.method, self.bound = owner, method, bound

    def __call__(self, *args: Any) -> Any:
        wrapper = self.owner()
        if wrapper is None:
            return None
        return self.method(wrapper, *self.bound, *args)


def remove_handles(handles: list) -> None:
    """Remove every hook handle in `handles` and forget them (idempotent)."""
    for handle in handles:
        handle.remove()
    handles.clear()
