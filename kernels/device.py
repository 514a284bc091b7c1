"""Device helpers the kernel launchers share (one home): run a launch on the device its tensors live on, and read
the current device and stream with little host time (a launch pays it on every call)."""

from __future__ import annotations

import torch


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
