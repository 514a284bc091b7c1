"""The Gluon kernels' host runtime (`kernels/attention/gluon/runtime.py`): a launch builds each specialisation once and
names a failed build, descriptors are checked once per layout, the launchers' keys cover their arguments and their
outputs come in the inputs' layouts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton

import kernels.attention.gluon.backward as fgo
import kernels.attention.gluon.forward as fg
from kernels.attention import dispatch
from kernels.attention.gluon import runtime
from tests.kernels.attention.gluon.support import cpu, needs_gluon


def test_launch_builds_once_per_specialisation(monkeypatch):
    """`launch`: the first call of a specialisation builds it (Triton's warmup, then loading it), every call runs the
    compiled kernel with every parameter in order (constexprs from the keyword arguments, not the options) and the
    grid padded to 3-D; a new int value, a misaligned tensor or other keywords build again."""
    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def _init_handles(self):
            calls.append(("load",))

        def launch_metadata(self, grid, stream, *args):
            return ("md", grid)

        def run(self, *args):
            calls.append(("run", args))

    class Kernel:
        params = [type("P", (), {"name": n})() for n in ("x", "n", "scale", "BLOCK", "CAUSAL")]

        def warmup(self, *args, grid, **meta):
            calls.append(("build", grid, args, meta))
            return Compiled()

    monkeypatch.setattr(runtime, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "raw_stream", lambda device: 7)
    monkeypatch.setattr(runtime, "_COMPILED", {})
    kernel, x = Kernel(), torch.zeros(64)
    meta = dict(BLOCK=64, CAUSAL=True, num_warps=4)
    runtime.launch(kernel, (3,), (x, 100, 0.5), meta)
    runtime.launch(kernel, (5, 2), (x, 100, 0.25), meta)
    assert [c[0] for c in calls] == ["build", "load", "run", "run"]
    assert calls[0][1:] == ((3,), (x, 100, 0.5), meta)
    hooks = triton.knobs.runtime
    assert calls[2][1][:3] == (3, 1, 1)
    assert calls[3][1] == (5, 2, 1, 7, "fn", "meta", ("md", (5, 2, 1)), hooks.launch_enter_hook,
                           hooks.launch_exit_hook, x, 100, 0.25, 64, True)
    built = lambda: sum(c[0] == "build" for c in calls)  # noqa: E731
    runtime.launch(kernel, (3,), (x, 101, 0.5), meta)             # another int value
    runtime.launch(kernel, (3,), (x[1:], 100, 0.5), meta)         # 4 bytes off 16-byte alignment
    runtime.launch(kernel, (3,), (x, 100, 0.5), dict(meta, num_warps=8))
    assert built() == 4
    runtime.launch(kernel, (3,), (x.clone(), 100, 0.5), meta)     # another aligned tensor: the compiled kernel
    assert built() == 4 and calls[-1][0] == "run"
    monkeypatch.setattr(runtime, "_CACHE_MAX", len(runtime._COMPILED))  # full: a new specialisation starts it afresh
    runtime.launch(kernel, (3,), (x, 102, 0.5), meta)
    assert built() == 5 and len(runtime._COMPILED) == 1
    # The caller's key stands for the arguments' keys: the same key runs the compiled kernel whatever the values.
    monkeypatch.setattr(runtime, "_CACHE_MAX", 4096)
    runtime.launch(kernel, (3,), (x, 100, 0.5), meta, ("problem", 1))
    runtime.launch(kernel, (4,), (x, 103, 0.5), meta, ("problem", 1))
    runtime.launch(kernel, (3,), (x, 100, 0.5), meta, ("problem", 2))
    runs = [c for c in calls if c[0] == "run"]
    assert built() == 7 and runs[-2][1][:3] == (4, 1, 1)


def test_launch_probe_names_a_build_failure_once(monkeypatch):
    """A specialisation whose build fails (compile or load) is a `BuildFailed` naming the kernel, the Triton and the
    innermost error's first line, at its first call and, without building again, at every later one; nothing runs."""
    tries = []

    def gluon_error():
        try:
            raise RuntimeError("async_copy_shared_to_global has been removed; call async_store instead")
        except RuntimeError as inner:
            raise triton.CompilationError("    tma.async_copy_shared_to_global(o_desc, ...)\n    ^", None) from inner

    class Kernel:
        __name__ = "_gluon_attn_fwd_kernel"
        params = []

        def warmup(self, *args, grid, **meta):
            tries.append(grid)
            gluon_error()

    monkeypatch.setattr(runtime, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "_COMPILED", {})
    monkeypatch.setattr(runtime, "_FAILED", {})
    kernel = Kernel()
    for _ in range(2):
        with pytest.raises(runtime.BuildFailed, match=r"_gluon_attn_fwd_kernel does not build on Triton .*: "
                                                      r"RuntimeError: async_copy_shared_to_global has been removed"):
            runtime.launch(kernel, (3,), (), {}, ("problem", 1))
    assert tries == [(3,)]


@needs_gluon
def test_tensor_descriptor_checks_once_per_layout_and_always_the_base(monkeypatch):
    """`tensor_descriptor`: the first descriptor of a (shape, strides, dtype, block, layout) is Triton's own, checked;
    later ones carry the same fields over their own base (no field shared with another's base); a misaligned base
    is refused on every call; other strides make a new checked descriptor."""
    monkeypatch.setattr(runtime, "_DESCRIPTOR_FIELDS", {})
    checked = []
    real = runtime.TensorDescriptor.__post_init__
    monkeypatch.setattr(runtime.TensorDescriptor, "__post_init__",
                        lambda self: (checked.append(self.shape), real(self)))
    a, b = cpu((2, 3, 200, 128)), cpu((2, 3, 200, 128))
    first, second = runtime.descriptor(a, 64), runtime.descriptor(b, 64)
    layout = runtime.shared_layout((1, 1, 64, 128), torch.bfloat16)
    want = runtime.TensorDescriptor.from_tensor(b, [1, 1, 64, 128], layout)
    fields = lambda d: {k: list(v) if isinstance(v, tuple) else v for k, v in vars(d).items()  # noqa: E731
                        if k != "base"}
    assert fields(second) == fields(want) and second.base is b and first.base is a
    assert len(checked) == 2  # the first descriptor and `want`; not the second
    with pytest.raises(ValueError, match="16-byte aligned"):
        runtime.tensor_descriptor(cpu((2 * 3 * 200 * 128 + 8,)).narrow(0, 1, 2 * 3 * 200 * 128).view(2, 3, 200, 128),
                             [1, 1, 64, 128], runtime.shared_layout((1, 1, 64, 128), torch.bfloat16))
    strided = cpu((2, 200, 3, 128)).transpose(1, 2)
    assert tuple(runtime.descriptor(strided, 64).strides) == strided.stride() and len(checked) == 3


@needs_gluon
def test_launch_keys_cover_what_the_arguments_specialise_on(monkeypatch):
    """The launchers' problem keys (`launch(..., key)`) stand for every argument's specialisation: equal for fresh
    tensors of one geometry, different for another stride, is_causal, config, or an L / O pointer off 16 bytes."""
    keys = []
    record = lambda kernel, grid, args, meta, key=None: keys.append((kernel, key))  # noqa: E731
    for module in (fg, fgo):
        monkeypatch.setattr(module, "launch", record)

    def misaligned(shape, dtype=torch.float32):  # contiguous, one element past a 16-byte boundary
        return torch.zeros(math.prod(shape) + 1, dtype=dtype)[1:].view(shape)

    q, lse = cpu((1, 2, 64, 128)), torch.zeros(1, 2, 64)
    config = dispatch.gluon_bwd_default(128, torch.bfloat16)
    other = dataclasses.replace(config, num_stages=config.num_stages % 3 + 1)
    calls = [(q, q, lse, True, config), (q.clone(), q.clone(), lse.clone(), True, config),
             (q, q, misaligned((1, 2, 64)), True, config), (q, misaligned((1, 2, 64, 128), q.dtype), lse, True, config),
             (q, q, lse, False, config), (q, q, lse, True, other),
             (q, q.transpose(1, 2).contiguous().transpose(1, 2), lse, True, config)]
    per_call = []
    for k, out, lse_t, causal, config in calls:
        keys.clear()
        fgo.launch_bwd(q, k, k, out, lse_t, q, causal, config)
        per_call.append(list(keys))
    assert per_call[0] == per_call[1]
    assert all(per_call[0] != other for other in per_call[2:]), per_call
    keys.clear()
    fg.launch_fwd(q, q, q, True, dispatch.gluon_fwd_default(128, torch.bfloat16))
    fg.launch_fwd(q.clone(), q.clone(), q.clone(), True, dispatch.gluon_fwd_default(128, torch.bfloat16))
    fg.launch_fwd(q, q, q, False, dispatch.gluon_fwd_default(128, torch.bfloat16))
    assert keys[0] == keys[1] != keys[2]


@needs_gluon
def test_gluon_outputs_come_out_in_the_inputs_layout(monkeypatch):
    """The Gluon launchers allocate O like q and dQ, dK, dV like q, k, v (the model's (B, S, H, D) projections viewed
    as (B, H, S, D)): merging O's heads and the projections' backward read views, not copies. L stays contiguous."""
    for module in (fg, fgo):
        monkeypatch.setattr(module, "launch", lambda *args, **kwargs: None)
    q, k = cpu((1, 200, 2, 128)).transpose(1, 2), cpu((1, 150, 2, 128)).transpose(1, 2)
    for config in (dispatch.gluon_fwd_default(128, torch.bfloat16),
                   dataclasses.replace(dispatch.DEFAULT_FWD_CONFIGS[128], persistent=True)):
        out, lse = fg.launch_fwd(q, k, k, True, config)
        assert out.stride() == q.stride() and lse.is_contiguous() and lse.shape == q.shape[:-1]
    for config in (dispatch.gluon_bwd_default(128, torch.bfloat16),
                   dataclasses.replace(dispatch.gluon_bwd_default(128, torch.bfloat16), persistent=True)):
        dq, dk, dv = fgo.launch_bwd(q, k, k, out, lse, q, True, config)
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), k.stride())
