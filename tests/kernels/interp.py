"""The Triton interpreter, as the kernel tests use it.

Triton decides interpreter or GPU when a kernel is decorated, i.e. when `kernels/` is imported; `tests/conftest.py`
sets `TRITON_INTERPRET=1` on a machine without a GPU before any test module is collected, so there every kernel
runs on the CPU interpreter (fp32 / fp16, no bf16). On a GPU host the kernels are built for the GPU and the
interpreter tests are skipped (`TRITON_INTERPRET=1 python -m pytest ...` runs them there).

    from tests.kernels.interp import on_interpreter

    @on_interpreter
    def test_forward_matches_reference(): ...
"""

from __future__ import annotations

import pytest

from kernels.device import INTERPRET

interpret = pytest.mark.skipif(not INTERPRET, reason="the kernels were built for the GPU in this process; run with "
                                                     "TRITON_INTERPRET=1 to use the interpreter")


def on_interpreter(fn):
    """A kernel test that runs on the interpreter (marked `interpret`; skipped where the kernels run on the GPU)."""
    return pytest.mark.interpret(interpret(fn))
