"""Hooks that hold their wrapper weakly (a hook holding it would leak the model: docs/parallel.md), for wrappers
(DDP, FSDP, CastForCompute) that hook the model they wrap; `weakref.finalize(wrapper, remove_handles, handles)`
removes the hooks when the wrapper is freed.
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
