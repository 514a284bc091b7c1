"""Device and precision helpers, defined once for raysys and the sweeps.

A precision is a key of `DTYPES`: `fp32`, or `bf16` / `fp16` autocast mixed precision over fp32 master weights;
`DTYPES[name]` is the compute dtype and `low_precision(name)` the dtype to cast to (None for `fp32`). A device is
`auto | cpu | cuda | cuda:N`: `resolve_device` returns a `torch.device` or raises a one-line ValueError before any
work starts (the GPU count defaults to this machine's; a Ray gang passes the cluster's).

    device = resolve_device("auto")
    with autocast(device, "bf16"):
        loss = model(x).sum()
    synchronize(device)
    free_memory(device)
"""

from __future__ import annotations

import contextlib
import gc
import os
import re

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")


def check_dtype(name: str) -> str:
    """`name` if it is a key of DTYPES, else a ValueError naming the allowed ones."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} must be one of {sorted(DTYPES)}")
    return name


def low_precision(name: str) -> torch.dtype | None:
    """The low-precision dtype `name` casts to (autocast, FSDP's compute cast); None for fp32 (no cast)."""
    dtype = DTYPES[check_dtype(name)]
    return None if dtype == torch.float32 else dtype


def autocast(device: torch.device | str, dtype: str):
    """`torch.autocast` to `dtype`'s compute dtype on `device`'s type; a null context for fp32."""
    low = low_precision(dtype)
    if low is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=low)


def resolve_device(name: str = "auto", *, num_gpus: int | None = None, where: str = "this machine") -> torch.device:
    """`auto` -> `cuda` when there is a GPU, else `cpu`; `cpu`, `cuda`, `cuda:N` as named.

    `num_gpus` is how many GPUs the work can use (default: this machine's); `where` names them in the error.
    A bad name, `cuda` without a GPU and `cuda:N` with N >= `num_gpus` are ValueErrors.
    """
    if not isinstance(name, str) or not (name in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", name)):
        raise ValueError(f"device {name!r} must be one of {', '.join(DEVICE_NAMES)}")
    if num_gpus is None:
        num_gpus = torch.cuda.device_count()
    if name == "auto":
        return torch.device("cuda" if num_gpus > 0 else "cpu")
    if name.startswith("cuda"):
        if num_gpus == 0:
            raise ValueError(f"device {name!r} requested but {where} has no CUDA GPU")
        index = torch.device(name).index
        if index is not None and index >= num_gpus:
            raise ValueError(f"device {name!r} requested but {where} has {num_gpus} GPU(s)")
    return torch.device(name)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, whose work is done when the call returns)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device | str | None = None) -> None:
    """Collect garbage, then return the CUDA allocator's cached blocks to the driver (`device` None: if CUDA
    was started in this process)."""
    gc.collect()
    cuda = torch.cuda.is_initialized() if device is None else torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()


def machine_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(mc, batch: int, world_size: int, device: str) -> None:
    """Before any work on the CPU: a one-line ValueError when a model's fp32 state (weights, gradients, AdamW
    moments: 16 bytes per parameter) and one layer's attention scores (4 * batch * heads * context^2 bytes) on every
    rank exceed this machine's memory. On a GPU nothing is checked: a trial that does not fit is an `oom` row."""
    if str(device).startswith("cuda"):
        return
    per_rank = 16 * mc.num_params() + 4 * batch * mc.num_heads * mc.context_length ** 2
    total = machine_memory_bytes()
    if total is not None and world_size * per_rank > total:
        raise ValueError(f"size {mc.name} at context {mc.context_length} with {batch} sequences per rank needs at "
                         f"least {per_rank / 2**30:.3g} GiB per rank (fp32 state + one layer's attention scores); "
                         f"{world_size} rank(s) exceed this machine's {total / 2**30:.3g} GiB")
