"""Gluon's Hopper API as the kernels call it, on every Triton the project allows (3.6 through 3.9).

The kernels import Gluon from here and nowhere else. Where a release renamed an op, this module binds the name the
kernels use to whichever the installed Triton has:

| kernels call      | Triton 3.6, 3.7                      | Triton 3.8, 3.9                       |
|-------------------|--------------------------------------|---------------------------------------|
| `tma_load`        | `tma.async_copy_global_to_shared`    | `tma.async_load`                      |
| `tma_store`       | `tma.async_copy_shared_to_global`    | `tma.async_store`                     |
| `tma_reduce_add`  | the builder's `create_async_tma_reduce` (ADD), wrapped here | `tma.async_atomic_add` |

`HAS_GLUON_HOPPER` says whether the imports succeed; whether a kernel builds is a separate question, which the
launchers answer with a build probe (`runtime.BuildFailed`).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON_HOPPER = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON_HOPPER = False

if HAS_GLUON_HOPPER:
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

    if hasattr(tma, "async_atomic_add"):
        tma_reduce_add = tma.async_atomic_add
    else:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """global[coord: coord + block] += src (a shared tile) by the TMA unit (`cp.reduce.async.bulk.tensor`
            add), completed like a TMA store (`tma.store_wait`): the builder has the op, the `tma` module of these
            releases does not wrap it."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

__all__ = ["HAS_GLUON_HOPPER", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier",
           "tma", "tma_load", "tma_reduce_add", "tma_store", "warpgroup_mma", "warpgroup_mma_wait"]
