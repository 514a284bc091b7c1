"""Device helpers the kernel launchers share (one home): run a launch on the device its tensors live on."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def device_of(t: torch.Tensor):
    """Make `t`'s CUDA device current while a kernel launches (Triton launches on the current device); a no-op
    for CPU tensors (the interpreter)."""
    if t.device.type == "cuda":
        with torch.cuda.device(t.device):
            yield
    else:
        yield
