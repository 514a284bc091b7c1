"""The Gluon kernels' host runtime: build probe and direct launch, TMA descriptors, shared layouts, register split.

`launch(kernel, grid, args, meta, key)` builds a specialisation once (`build`, Triton's `warmup` plus loading it on
the device; a failure is a `BuildFailed` the dispatch falls back on, remembered per key) and launches the compiled
kernel directly on the current stream. `tensor_descriptor` / `descriptor` make TMA descriptors, checking each layout
once. `register_split(num_consumers)` is the setmaxnreg split of 64 K registers between the consumer warp groups and
the loader warp (LOADER_REGS).
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from kernels.device import current_device, raw_stream

if HAS_GLUON_HOPPER:
    from kernels.attention.gluon.compat import TensorDescriptor, gl

LOADER_REGS = 24
"""Registers of the loader warp (setmaxnreg.dec)."""


def register_split(num_consumers: int) -> tuple[int, int]:
    """(maxnreg of the launch, consumer warp groups' registers): 64 K registers per SM over all warp groups (the
    loader's rounds up to one), the loader at LOADER_REGS and the consumers sharing the rest."""
    groups = num_consumers + 1
    cap = (65536 // (128 * groups)) // 8 * 8
    consumer = min(240, ((cap * groups - LOADER_REGS) // num_consumers) // 8 * 8)
    maxnreg = min(cap, ((consumer * num_consumers + LOADER_REGS + groups - 1) // groups + 7) // 8 * 8)
    return maxnreg, consumer



@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared layout of a TMA block (an immutable value: built once per block shape and dtype)."""
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _arg_key(arg):
    """What a launch argument's compiled kernel depends on: a descriptor's type, shape, strides and base alignment,
    a tensor's dtype and alignment, an int's value (Triton specialises ints on 1, on 16 | n and on their width), a
    float's type; anything else its value."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, float):
        return float
    if HAS_GLUON_HOPPER and isinstance(arg, TensorDescriptor):
        return (arg.base.dtype, tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape), arg.layout,
                arg.padding, arg.base.data_ptr() % 16 == 0)
    return (type(arg), arg)


_CACHE_MAX = 4096
"""Entries at which `launch`'s and `tensor_descriptor`'s caches start afresh (a run over many sequence lengths adds
one per length, kernel and descriptor)."""
_COMPILED: dict = {}
"""(kernel, device, argument keys, keyword arguments) -> the compiled kernel its build probe returned."""
_FAILED: dict = {}
"""The same keys -> why the build probe failed (a specialisation that does not build is not built again)."""


class BuildFailed(RuntimeError):
    """A kernel that does not build (compile, or load on the device) for these arguments on the installed Triton: the
    dispatch's cue to run the tl kernels instead."""


class SharedMemoryExceeded(ValueError):
    """A kernel config whose shared memory a block of the device cannot hold: raised before the build, where Triton
    would raise `OutOfResources` at the launch (the tile sweeps count both as configs that do not fit)."""


def _first_line(exc: BaseException) -> str:
    """The innermost cause's first line (a CompilationError's own text is the source around the failing call)."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:300]


def build(kernel, grid: tuple[int, ...], args: tuple, meta: dict):
    """The build probe of one specialisation: compile `kernel` for these arguments and load it on the current device,
    launching nothing (Triton's `warmup`). Any failure is a `BuildFailed` naming the kernel, the Triton and the
    error's first line."""
    try:
        compiled = kernel.warmup(*args, grid=grid, **meta)
        compiled._init_handles()  # loading checks the shared memory and registers the device has
    except Exception as exc:  # noqa: BLE001 - whatever stops the build, the kernel cannot run here
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        raise BuildFailed(f"{name} does not build on Triton {triton.__version__}: {_first_line(exc)}") from exc
    return compiled


def launch(kernel, grid: tuple[int, ...], args: tuple, meta: dict, key: tuple | None = None) -> None:
    """`kernel[grid](*args, **meta)` on the current device and stream, for a kernel whose parameters after `args`
    are all named in `meta` (with Triton's options, num_warps, maxnreg). The first launch of a specialisation builds
    it (`build`: `BuildFailed` if it cannot, then and on every later call with these keys); every launch runs the
    compiled kernel directly (`CompiledKernel.run`, as Inductor's launchers do), without Triton's per-call binding
    and cache lookup. `key`: the caller's own key, which must determine every `_arg_key` of `args` and `meta` (the
    launchers' problem keys: shapes, strides, dtypes, config)."""
    device = current_device()
    if key is None:
        key = (kernel, device, tuple(_arg_key(a) for a in args), tuple(meta.items()))
    else:
        key = (kernel, device, key)
    compiled = _COMPILED.get(key)
    if compiled is None:
        if key in _FAILED:
            raise BuildFailed(_FAILED[key])
        try:
            compiled = build(kernel, grid, args, meta)
        except BuildFailed as exc:
            _FAILED[key] = str(exc)
            raise
        if len(_COMPILED) >= _CACHE_MAX:
            _COMPILED.clear()
        _COMPILED[key] = compiled
    bound = (*args, *(meta[p.name] for p in kernel.params[len(args):]))
    stream = raw_stream(device)
    grid = (*grid, 1, 1)
    hooks = triton.knobs.runtime
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid[:3], stream, *bound), hooks.launch_enter_hook, hooks.launch_exit_hook,
                 *bound)


_DESCRIPTOR_FIELDS: dict = {}
"""(shape, strides, dtype, block shape, layout) -> a checked descriptor's fields but its base."""


def tensor_descriptor(t: torch.Tensor, block: list[int], layout, shape: list[int] | None = None,
                      strides: list[int] | None = None) -> "TensorDescriptor":
    """`TensorDescriptor(t, shape, strides, block, layout)` (t's own shape and strides when not given). Its
    dataclass checks (strides' alignment, block shape, layout) run on the first descriptor of each (shape, strides,
    dtype, block, layout); later ones copy its fields and check only the base's 16-byte alignment."""
    shape = tuple(t.shape) if shape is None else tuple(shape)
    strides = tuple(t.stride()) if strides is None else tuple(strides)
    key = (shape, strides, t.dtype, tuple(block), layout)
    fields = _DESCRIPTOR_FIELDS.get(key)
    if fields is None:
        desc = TensorDescriptor(t, list(shape), list(strides), list(block), layout)
        if len(_DESCRIPTOR_FIELDS) >= _CACHE_MAX:
            _DESCRIPTOR_FIELDS.clear()
        _DESCRIPTOR_FIELDS[key] = {name: value for name, value in vars(desc).items() if name != "base"}
        return desc
    if t.data_ptr() % 16:
        raise ValueError(f"a TMA descriptor's base must be 16-byte aligned, got address {t.data_ptr():#x}")
    desc = object.__new__(TensorDescriptor)
    vars(desc).update(fields)
    desc.base = t
    return desc


def descriptor(t: torch.Tensor, block_rows: int) -> "TensorDescriptor":
    """A 4-D descriptor of (B, H, N, D) `t` in (1, 1, block_rows, D) boxes."""
    block = [1, 1, block_rows, t.shape[-1]]
    return tensor_descriptor(t, block, shared_layout(tuple(block), t.dtype))
