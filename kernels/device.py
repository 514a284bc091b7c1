"""Device helpers the kernel launchers share (one home): run a launch on the device its tensors live on, read the
current device and stream with little host time (a launch pays it on every call), and the device properties the
launchers size their grids and tiles by (each asked once per device).

`INTERPRET` says whether Triton builds the kernels for its CPU interpreter (`TRITON_INTERPRET=1`, read when a kernel
module is imported): the launchers then take CPU tensors and small configs.
"""

from __future__ import annotations

import functools
import os

import torch


def _interpret_mode() -> bool:
    """Whether `@triton.jit` builds interpreted kernels: Triton decides this at decoration time."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older Triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


INTERPRET = _interpret_mode()


def check_runs_here(t: torch.Tensor, module: str) -> None:
    """Raise ValueError unless `module`'s kernels run on `t`: a CUDA tensor, or (TRITON_INTERPRET=1 set before the
    import) a CPU tensor of a dtype the interpreter has (no bf16)."""
    if t.device.type == "cuda":
        return
    if not INTERPRET:
        raise ValueError(f"tensors on {t.device} need a CUDA device, or TRITON_INTERPRET=1 set before {module} is "
                         "imported (CPU interpreter)")
    if t.dtype == torch.bfloat16:
        raise ValueError("dtype torch.bfloat16 is not supported by the Triton CPU interpreter (NumPy has no "
                         "bfloat16); use float16 or float32 under TRITON_INTERPRET=1")


def current_device() -> int:
    """The current CUDA device's index (`torch.cuda.current_device()` less its Python)."""
    return torch._C._cuda_getDevice()


def raw_stream(device: int) -> int:
    """The current stream of CUDA device `device` as the driver's handle (what Inductor's launchers pass)."""
    return torch._C._cuda_getCurrentRawStream(device)


class device_of:
    """`with device_of(t):` makes `t`'s CUDA device current while a kernel launches (Triton launches on the current
    device). It switches only when another device is current (the common case then costs one lookup instead of two
    device switches), and is a no-op for tensors off CUDA (the interpreter's CPU tensors, meta tensors)."""

    __slots__ = ("index", "switch")

    def __init__(self, t: torch.Tensor):
        device = t.device
        self.index = device.index if device.type == "cuda" else None
        self.switch = None

    def __enter__(self) -> None:
        if self.index is not None and self.index != current_device():
            self.switch = torch.cuda.device(self.index)
            self.switch.__enter__()

    def __exit__(self, *exc) -> None:
        if self.switch is not None:
            self.switch.__exit__(*exc)
            self.switch = None


def empty_like_layout(t: torch.Tensor, dtype: torch.dtype | None = None, empty=torch.empty) -> torch.Tensor:
    """An uninitialised dense tensor of `t`'s shape whose leading dimensions lie in memory in `t`'s order (outermost
    first by stride; ties, such as length-1 dimensions, keep their order) and whose last dimension is contiguous:
    attention's O and gradients come out in their inputs' layout, so the model's (B, S, H, D) projections feed a view
    of them, not a copy. `empty(shape, dtype=, device=)` allocates (the kernel tests swap in a poisoned allocator);
    tracing stand-ins get the same strides."""
    order = sorted(range(t.dim() - 1), key=lambda i: -t.stride(i)) + [t.dim() - 1]
    buffer = empty([t.shape[i] for i in order], dtype=dtype or t.dtype, device=t.device)
    inverse = [0] * t.dim()
    for position, dim in enumerate(order):
        inverse[dim] = position
    return buffer.permute(inverse)


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """`torch.cuda.get_device_capability`, asked once per device."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a persistent grid's size); 4 for another device (the interpreter:
    a few programs, so that each walks several tiles; the sm_90 build check builds one kernel whatever the grid)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(device: torch.device) -> int | None:
    """The L2 cache of a CUDA device in bytes; None for another device."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str | None:
    """`torch.cuda.get_device_name` (what result rows and tuned entries record), asked once per device; None for
    another device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one block may use on `device` (opt-in maximum); no limit for a CPU device."""
    if device.type != "cuda":
        return 1 << 30
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 49152)
