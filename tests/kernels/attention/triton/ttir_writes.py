"""What torch's mutation analysis of a `wrap_triton` launch takes a kernel of `kernels/attention/triton/kernels.py`
to write: what Inductor and AOT autograd then believe the launch mutates.

    python -m tests.kernels.attention.triton.ttir_writes LAUNCHES   # a torch.save'd list of (kernel name, args, kwargs)

prints one JSON list per launch, the written argument names, sorted. It runs in a process of its own with
TRITON_INTERPRET=0, so that the kernels are JIT functions and Triton's language is not the interpreter's (Triton
3.9's interpreter leaves `triton.language.core` patched after a kernel that calls a library `@jit` function, which
then breaks code generation in the same process). The analysis reads TTIR generated for sm_90, no GPU needed; when
it cannot analyse a kernel it takes every input for written.
"""

from __future__ import annotations

import json
import sys


class _Sm90Driver:
    """Triton's active driver as torch's TTIR generation asks it on a machine without a GPU."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


def written(kernel, kwargs: dict) -> list[str]:
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
        names = {dep.name for dep in wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes}
    else:
        names = set(wrap.identify_mutated_tensors(kernel, kwargs, {}))
    return sorted(names)


def main(path: str) -> None:
    import torch
    import triton

    import kernels.attention.triton.kernels as fk
    if not isinstance(fk._flash_fwd_kernel, triton.runtime.jit.JITFunction):
        sys.exit("ttir_writes: run with TRITON_INTERPRET=0 (the kernels were built for the interpreter)")
    triton.runtime.driver.set_active(_Sm90Driver())
    for name, args, kwargs in torch.load(path):
        kernel = getattr(fk, name)
        print(json.dumps(written(kernel, dict(zip(kernel.arg_names, args), **kwargs))))


if __name__ == "__main__":
    main(sys.argv[1])
