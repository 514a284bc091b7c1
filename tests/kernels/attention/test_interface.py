"""`flash_attention` and the tl kernels under the CPU interpreter (TRITON_INTERPRET=1), plus launcher logic.

Small fp32 / fp16 shapes (the interpreter is slow and has no bf16): forward O and L, and dQ, dK, dV with a
random upstream gradient, against fp64 `flash_attention_reference`; lengths that are not tile multiples,
n_q != n_k, padded head dims (24, 40, 80 -> BLOCK_D 32, 64, 128), strided inputs; outputs allocated
NaN-poisoned with guard elements, so an element the kernels forget to write or a write out of bounds fails.
Triton decides interpreter vs GPU when a kernel is decorated: `tests/kernels/interp.py` says how the tests arrange it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.attention.interface as fa
import kernels.attention.triton.launch as tl_launch
import kernels.attention.triton.tuning as ft
from kernels import device
from kernels.attention import dispatch
from kernels.attention.reference import flash_attention_reference
from tests.kernels.interp import on_interpreter

# (q shape, k shape, causal, dtype). Interpreter tiles: fwd 32x16, dK/dV 16x32, dQ 32x16.
CASES = [
    ((2, 37, 16), (2, 37, 16), True, torch.float32),     # partial tiles, causal diagonal in several steps
    ((1, 2, 45, 24), (1, 2, 70, 24), False, torch.float32),  # n_q < n_k, padded head dim
    ((1, 3, 70, 40), (1, 3, 45, 40), False, torch.float32),  # n_q > n_k
    ((2, 64, 32), (2, 64, 32), True, torch.float32),     # every tile full: the unmasked fast path
    ((1, 50, 80), (1, 50, 80), True, torch.float16),     # fp16, head dim 80
]
REPO = Path(__file__).resolve().parents[3]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _inputs(q_shape, k_shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=gen).to(dtype)
    k = torch.randn(k_shape, generator=gen).to(dtype)
    v = torch.randn(k_shape, generator=gen).to(dtype)
    do = torch.randn(q_shape, generator=gen).to(dtype)
    return q, k, v, do


def _reference(q, k, v, do, causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_reference(q64, k64, v64, causal, return_lse=True)
    out.backward(do.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


class PoisonedAllocator:
    """Stands in for `tl_launch._empty`: NaN-filled buffers with NaN guard elements after each one."""

    GUARD = 64 * 128  # more than one tile of rows: an unmasked tail-tile store lands here, not on the heap

    def __init__(self):
        self.buffers = []

    def __call__(self, shape, *, dtype, device):
        numel = int(torch.Size(shape).numel())
        flat = torch.full((numel + self.GUARD,), float("nan"), dtype=dtype, device=device)
        self.buffers.append((flat, numel))
        return flat[:numel].view(shape)

    def check(self):
        assert self.buffers, "the launcher allocated nothing through tl_launch._empty"
        for flat, numel in self.buffers:
            assert not torch.isnan(flat[:numel]).any(), "an output element was never written"
            assert torch.isnan(flat[numel:]).all(), "a kernel wrote past the end of its output"


@pytest.fixture
def poisoned(monkeypatch):
    alloc = PoisonedAllocator()
    monkeypatch.setattr(tl_launch, "_empty", alloc)
    return alloc


@on_interpreter
@pytest.mark.parametrize("q_shape,k_shape,causal,dtype", CASES)
def test_forward_and_backward_match_fp64_reference(q_shape, k_shape, causal, dtype, poisoned):
    q, k, v, do = _inputs(q_shape, k_shape, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa.flash_attention(q, k, v, causal)
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(saved) == 1 and saved[0].dtype == torch.float32
    out.backward(do)
    poisoned.check()
    ref_out, ref_lse, dq, dk, dv = _reference(q, k, v, do, causal)
    tol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(saved[0].double(), ref_lse, atol=2e-5, rtol=1e-5)
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, n=name: f"{n}: {m}")


# The tma path's kernels (tensor descriptors; persistent grid; warp specialisation, a no-op here) under the
# interpreter, which emulates descriptors: loads past a matrix's edge read 0, stores past it are dropped.
TMA_CONFIGS = [
    (None, None, None),
    (ft.FlashConfig(32, 16, 1, 1, persistent=True), ft.FlashConfig(16, 32, 1, 1, persistent=True),
     ft.FlashConfig(32, 16, 1, 1, persistent=True)),
    (ft.FlashConfig(32, 16, 1, 1, warp_specialize=True), ft.FlashConfig(16, 32, 1, 1, warp_specialize=True),
     ft.FlashConfig(32, 16, 1, 1, warp_specialize=True)),
    # the register cap and the unrolling are compiler options (no-ops here); the lazy rescale is code
    (ft.FlashConfig(32, 16, 1, 1, maxnreg=128, lazy_rescale=True, unroll=2), ft.FlashConfig(16, 32, 1, 1, unroll=2),
     ft.FlashConfig(32, 16, 1, 1, maxnreg=128, unroll=2)),
]


@on_interpreter
@pytest.mark.parametrize("configs", TMA_CONFIGS, ids=["autotuned", "persistent", "warp_specialize", "knobs"])
@pytest.mark.parametrize("q_shape,k_shape,causal,dtype", CASES[:3] + CASES[4:])
def test_tma_path_matches_fp64_reference(q_shape, k_shape, causal, dtype, configs, poisoned):
    q, k, v, do = _inputs(q_shape, k_shape, dtype, seed=5)
    fwd_cfg, dkdv_cfg, dq_cfg = configs
    out, lse = fa.flash_attention_fwd(q, k, v, causal, config=fwd_cfg, path="tma")
    dq, dk, dv = fa.flash_attention_bwd(q, k, v, out, lse, do, causal, dkdv_config=dkdv_cfg, dq_config=dq_cfg,
                                        path="tma")
    assert [dispatch.LAST_PATH[k] for k in ("fwd", "dkdv", "dq", "bwd")] == ["tma", "tma", "tma", "two_pass"]
    poisoned.check()
    tol = TOL[dtype]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                               _reference(q, k, v, do, causal)):
        torch.testing.assert_close(got.double(), want, **(tol if name != "lse" else dict(atol=2e-5, rtol=1e-5)),
                                   msg=lambda m, n=name: f"{n}: {m}")


@on_interpreter
@pytest.mark.parametrize("path", ["portable", "tma"])
@pytest.mark.parametrize("q_shape,k_shape,causal,dtype", CASES[:3] + CASES[4:])
def test_one_pass_backward_matches_fp64_reference(q_shape, k_shape, causal, dtype, path, poisoned):
    """The dK/dV kernel that also sums dS K into an fp32 dQ (atomics here; the TMA unit's reduce on a GPU)."""
    q, k, v, do = _inputs(q_shape, k_shape, dtype, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa.flash_attention(q, k, v, causal, path=path, bwd="one_pass")
    out.backward(do)
    assert (dispatch.LAST_PATH["dkdvq"], dispatch.LAST_PATH["bwd"]) == (path, "one_pass")
    poisoned.check()
    tol = TOL[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                               [r for i, r in enumerate(_reference(q, k, v, do, causal)) if i != 1]):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, n=name: f"{n}: {m}")


@on_interpreter
@pytest.mark.parametrize("q_shape,k_shape,causal,dtype", CASES[:2] + CASES[4:])
def test_lazy_rescale_forward_matches_fp64_reference(q_shape, k_shape, causal, dtype, poisoned):
    """Rescaling O only in key tiles where some row's running max grew leaves O and L exact; the rows' maxima
    are drawn to grow in some tiles and not in others (a large score early in each row, then small ones)."""
    q, k, v, _ = _inputs(q_shape, k_shape, dtype, seed=7)
    k = k * torch.linspace(3.0, 0.5, k.shape[-2], dtype=dtype)[:, None]
    out, lse = fa.flash_attention_fwd(q, k, v, causal, config=ft.FlashConfig(32, 16, 1, 1, lazy_rescale=True),
                                      path="portable")
    poisoned.check()
    ref_out, ref_lse = flash_attention_reference(q.double(), k.double(), v.double(), causal, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_one_pass_autotuner_zeroes_the_dq_accumulator():
    """Autotuning times the one-pass kernel on the real dQ accumulator; its autotuner must zero DQ between runs
    (the interpreter cannot time kernels, so the GPU test test_one_pass_dq_survives_autotuning runs it)."""
    assert tl_launch._TUNED["dkdvq"].reset_to_zero == ["DQ"]
    assert all(not tl_launch._TUNED[k].reset_to_zero for k in ("fwd", "dkdv", "dq"))


@on_interpreter
def test_strided_inputs_and_broadcast_upstream_gradient():
    """The model's layout: (B, S, H, D) transposed to (B, H, S, D); `.sum().backward()` gives dO of stride 0."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 33, 2, 16, generator=gen).transpose(1, 2).requires_grad_() for _ in range(3))
    fa.flash_attention(q, k, v, True).sum().backward()
    _, _, dq, dk, dv = _reference(q, k, v, torch.ones(1, 2, 33, 16), True)
    for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@on_interpreter
def test_backward_under_a_non_reentrant_checkpoint_matches_the_reference():
    """The backward unpacks its saved tensors once: a non-reentrant checkpoint (the leaderboard's ffn and full
    blocks) refuses a second unpack."""
    q, k, v, do = _inputs((1, 24, 16), (1, 24, 16), torch.float32, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.utils.checkpoint.checkpoint(fa.flash_attention, q, k, v, True, use_reentrant=False).backward(do)
    _, _, dq, dk, dv = _reference(q, k, v, do, True)
    for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@on_interpreter
def test_only_requested_gradients_are_computed(poisoned):
    q, k, v, do = _inputs((1, 20, 16), (1, 20, 16), torch.float32)
    k.requires_grad_()
    fa.flash_attention(q, k, v, True).backward(do)
    assert q.grad is None and v.grad is None
    torch.testing.assert_close(k.grad.double(), _reference(q, k, v, do, True)[3], atol=2e-5, rtol=1e-5)
    assert len(poisoned.buffers) == 5  # O, L, D, dK, dV: no dQ


@on_interpreter
def test_explicit_configs_match_autotuned_path():
    q, k, v, do = _inputs((1, 40, 16), (1, 40, 16), torch.float32, seed=2)
    out, lse = fa.flash_attention_fwd(q, k, v, True, config=ft.FlashConfig(16, 16, 1, 1))
    ref_out, ref_lse = fa.flash_attention_fwd(q, k, v, True)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    grads = fa.flash_attention_bwd(q, k, v, out, lse, do, True, dkdv_config=ft.FlashConfig(16, 16, 1, 1),
                                   dq_config=ft.FlashConfig(16, 16, 1, 1))
    for got, want in zip(grads, _reference(q, k, v, do, True)[2:]):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_m \\(16\\) must be a multiple of block_n \\(32\\)"):
        fa.flash_attention_fwd(q, k, v, True, config=ft.FlashConfig(16, 32, 1, 1))


@on_interpreter
def test_matches_pytorch_tiled_implementation():
    from kernels.attention.reference import flash_forward_pytorch

    q, k, v, _ = _inputs((2, 2, 29, 32), (2, 2, 29, 32), torch.float32, seed=3)
    out, lse = fa.flash_attention_fwd(q, k, v, True)
    want_out, want_lse = flash_forward_pytorch(q, k, v, True)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@on_interpreter
def test_compiled_model_matches_eager():
    """torch.compile(model) with attention="flash_triton", one graph (aot_eager: the interpreter's kernels run
    as opaque custom ops), gives the eager logits and every parameter gradient."""
    from raysys.model.config import ModelConfig
    from raysys.model.transformer import TransformerLM, cross_entropy

    cfg = ModelConfig(vocab_size=64, context_length=24, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                      attention="flash_triton")
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 21))
    results = []
    for fn in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        model.zero_grad(set_to_none=True)
        logits = fn(x)
        cross_entropy(logits, x).backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_logits, eager_grads), (logits, grads) = results
    torch.testing.assert_close(logits, eager_logits, atol=1e-6, rtol=1e-6)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@on_interpreter
def test_eager_calls_skip_the_custom_ops(monkeypatch):
    """Eager calls on real tensors launch the kernels from an autograd.Function, not through the custom ops (whose
    dispatch costs ~100 us of host time per call), with the ops' results; stand-ins (fake, meta) go to the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, do = _inputs((1, 2, 37, 16), (1, 2, 37, 16), torch.float32, seed=5)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(do)
        return [out.detach()] + [t.grad for t in leaves]

    via_ops = run(lambda *a: fa.flash_attn_fwd_op(*a, True, "portable", "two_pass")[0])

    def refuse(*args):
        raise AssertionError("an eager call went through a custom op")

    monkeypatch.setattr(fa, "flash_attn_fwd_op", refuse)
    monkeypatch.setattr(fa, "flash_attn_bwd_op", refuse)
    for fn in (lambda *a: fa.flash_attention(*a, True, path="portable", bwd="two_pass"),
               lambda *a: fa.FlashAttentionTriton.apply(*a, True)):
        for got, want in zip(run(fn), via_ops):
            assert torch.equal(got, want)
    assert fa._eager(q)
    assert not fa._eager(torch.empty(2, device="meta"))
    with FakeTensorMode():
        assert not fa._eager(torch.empty(2))


@on_interpreter
def test_autotuned_config_is_launched_directly_once_chosen(monkeypatch):
    """The autotuner runs once per key (kernel, dtype, sequence bucket, head dim, causal, precision, path); later
    calls launch its choice directly, with the same result."""
    monkeypatch.setenv("RAYSYS_FLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tl_launch, "_CHOSEN", {})
    tuner, asked = tl_launch._TUNED["fwd"], []

    class Counting:
        best_config = property(lambda self: tuner.best_config)

        def __getitem__(self, grid):
            asked.append(grid)
            return tuner[grid]

    monkeypatch.setitem(tl_launch._TUNED, "fwd", Counting())
    q, k, v, _ = _inputs((1, 2, 37, 16), (1, 2, 37, 16), torch.float32, seed=6)
    first = fa.flash_attention_fwd(q, k, v, True, path="portable")
    second = fa.flash_attention_fwd(q, k, v, True, path="portable")
    assert len(asked) == 1 and all(torch.equal(a, b) for a, b in zip(first, second))
    assert list(tl_launch._CHOSEN.values()) == [dispatch.LAST_CONFIG["fwd"]]
    fa.flash_attention_fwd(q, k, v, False, path="portable")  # another key: tuned again
    fa.flash_attention_fwd(q[..., :30, :], k, v, False, path="portable")  # same bucket (64): not
    assert len(asked) == 2 and len(tl_launch._CHOSEN) == 2


@on_interpreter
@pytest.mark.parametrize("causal,path", [(False, "portable"), (True, "portable"), (True, "tma")])
def test_custom_ops_pass_opcheck(causal, path):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of both custom ops."""
    q, k, v, do = _inputs((1, 2, 19, 16), (1, 2, 19 if causal else 23, 16), torch.float32, seed=4)
    torch.library.opcheck(fa.flash_attn_fwd_op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), causal,
                                                 path, "one_pass"))
    out, lse = fa.flash_attention_fwd(q.detach(), k.detach(), v.detach(), causal, path=path)
    for flags in ((True, True), (False, True), (True, False)):
        for bwd in dispatch.BWD_MODES:
            torch.library.opcheck(fa.flash_attn_bwd_op, (q.detach(), k.detach(), v.detach(), out, lse, do, causal,
                                                         *flags, path, bwd))


@on_interpreter
def test_traced_launches_write_only_their_outputs(monkeypatch, tmp_path):
    """Every kernel launched through `wrap_triton` under torch.compile writes only its outputs as torch's mutation
    analysis reads it (tests/kernels/attention/triton/ttir_writes.py, in a process of its own). A store address
    derived from a helper's result that took O and dO once made the analysis take O and dO for written, and AOT
    autograd then failed to partition the gluon path's graph (opcheck's test_aot_dispatch_dynamic on the GPU)."""
    import kernels.attention.triton.kernels as fk
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append((self.kernel.fn.__name__, args, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setenv("RAYSYS_FLASH_AUTOTUNE", "0")  # as traced: the plain kernels with the first valid config
    for name, kernel in list(tl_launch._KERNELS.items()):
        monkeypatch.setitem(tl_launch._KERNELS, name, Recorder(kernel))
    monkeypatch.setattr(tl_launch, "_flash_bwd_preprocess_kernel", Recorder(fk._flash_bwd_preprocess_kernel))
    q, k, v, do = _inputs((1, 2, 19, 16), (1, 2, 23, 16), torch.float32, seed=5)
    for bwd in dispatch.BWD_MODES:
        out, lse = fa.flash_attention_fwd(q, k, v, False, path="portable")
        fa.flash_attention_bwd(q, k, v, out, lse, do, False, path="portable", bwd=bwd)
    torch.save(launches, tmp_path / "launches.pt")
    done = subprocess.run([sys.executable, "-m", "tests.kernels.attention.triton.ttir_writes",
                           str(tmp_path / "launches.pt")],
                          env=dict(os.environ, TRITON_INTERPRET="0"), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    written = [set(json.loads(line)) for line in done.stdout.splitlines()]
    expected = {"_flash_fwd_kernel": {"O", "L"}, "_flash_bwd_preprocess_kernel": {"Delta"},
                "_flash_bwd_dq_kernel": {"DQ"}}
    seen = set()
    assert len(written) == len(launches)
    for (name, _, kwargs), names in zip(launches, written):
        if name == "_flash_bwd_dkdv_kernel":  # one pass (DQ_ATOMIC) also adds into the fp32 dQ
            want = {"DK", "DV", "DQ"} if kwargs["DQ_ATOMIC"] else {"DK", "DV"}
        else:
            want = expected[name]
        assert names == want, name
        seen.add((name, bool(kwargs.get("DQ_ATOMIC"))))
    assert seen == {("_flash_fwd_kernel", False), ("_flash_bwd_preprocess_kernel", False),
                    ("_flash_bwd_dkdv_kernel", False), ("_flash_bwd_dkdv_kernel", True),
                    ("_flash_bwd_dq_kernel", False)}


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.setattr(device, "INTERPRET", False)
    q = torch.zeros(1, 16, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fa.flash_attention(q, q, q)


@pytest.mark.parametrize("shapes,causal,match", [
    (((1, 16, 16), (1, 16, 16, 1), (1, 16, 16)), False, "same rank"),
    (((1, 16, 8), (1, 16, 8), (1, 16, 8)), False, "head dim 8"),
    (((1, 16, 16), (1, 20, 16), (1, 20, 16)), True, "n_queries == n_keys"),
])
def test_invalid_inputs_raise_before_any_launch(shapes, causal, match, monkeypatch):
    monkeypatch.setattr(tl_launch, "_empty", lambda *a, **k: pytest.fail("allocated before validating"))
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        fa.flash_attention(q, k, v, causal)


@on_interpreter
def test_checks_run_once_per_geometry_and_bad_input_still_raises(monkeypatch):
    """An eager call of a geometry already checked (shapes, strides, dtypes, devices, alignment, is_causal) skips
    the checks; any other runs them, so bad input raises whatever came before."""
    calls = []
    real = fa.check_attention_inputs
    monkeypatch.setattr(fa, "check_attention_inputs", lambda *a: (calls.append(a[-1]), real(*a))[1])
    monkeypatch.setattr(fa, "_VALIDATED", {})
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 16, 16) for _ in range(4))
    out, lse = fa.flash_attention_fwd(q, k, v, True)
    fa.flash_attention_fwd(q.clone(), k.clone(), v.clone(), True)           # the same geometry
    assert calls == [True]
    fa.flash_attention_fwd(q, k, v, False)                                  # another is_causal
    fa.flash_attention_fwd(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], False)    # another shape and alignment
    assert calls == [True, False, False]
    grads = fa.flash_attention_bwd(q, k, v, out, lse, do, True)
    assert [torch.equal(a, b) for a, b in zip(grads, fa.flash_attention_bwd(q, k, v, out, lse, do, True))] == [True] * 3
    assert calls == [True, False, False, True]
    for args, match in (((q, k, v, 1), "is_causal must be a bool"), ((q, k.half(), v, True), "share one dtype"),
                        ((q, k[:, :, :8], v[:, :, :8], True), "n_queries == n_keys")):
        with pytest.raises(ValueError, match=match):
            fa.flash_attention_fwd(*args)
    with pytest.raises(ValueError, match="lse must be float32"):
        fa.flash_attention_bwd(q, k, v, out, lse[..., :8], do, True)


def test_backward_launcher_validates_lse_and_grad_shapes():
    q = torch.zeros(1, 16, 16)
    with pytest.raises(ValueError, match="lse must be float32 of shape \\(1, 16\\)"):
        fa.flash_attention_bwd(q, q, q, q, torch.zeros(1, 16, 1), q)
    with pytest.raises(ValueError, match="grad_out"):
        fa.flash_attention_bwd(q, q, q, q, torch.zeros(1, 16), torch.zeros(1, 8, 16))


@on_interpreter
@pytest.mark.parametrize("path", ["portable", "tma"])
@pytest.mark.parametrize("one_pass", [False, True])
def test_outputs_and_gradients_come_out_in_the_inputs_layout(path, one_pass):
    """O and dQ, dK, dV lie in memory like q, k, v (the model's (B, S, H, D) projections viewed as (B, H, S, D)), so
    merging O's heads and handing the gradients to the projections are views, not copies; eager and traced calls
    (the custom ops' fakes) agree, and the values are the contiguous call's."""
    q, k, v, do = (t.transpose(1, 2) for t in _inputs((1, 37, 3, 16), (1, 37, 3, 16), torch.float32, seed=7))
    assert not q.is_contiguous()
    bwd = "one_pass" if one_pass else "two_pass"
    out, lse = fa.flash_attention_fwd(q, k, v, True, path=path)
    dq, dk, dv = fa.flash_attention_bwd(q, k, v, out, lse, do, True, path=path, bwd=bwd)
    for result, like in ((out, q), (dq, q), (dk, k), (dv, v)):
        assert result.stride() == like.stride()
    # one sequence, one head: the lengths-1 dimensions' strides address nothing, the others are still q's
    q1, k1, v1, do1 = (t[:1, :1].clone().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    out1, lse1 = fa.flash_attention_fwd(q1, k1, v1, True, path=path)
    grads = fa.flash_attention_bwd(q1, k1, v1, out1, lse1, do1, True, path=path, bwd=bwd)
    for result in (out1, *grads):
        assert result.shape == q1.shape and result.stride()[2:] == q1.stride()[2:]
    assert out.transpose(1, 2).flatten(-2).data_ptr() == out.data_ptr()  # the merged heads: a view
    want = fa.flash_attention_fwd(*(t.contiguous() for t in (q, k, v)), True, path=path)[0]
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.library.opcheck(fa.flash_attn_fwd_op, (q, k, v, True, path, bwd), test_utils=("test_faketensor",))
    torch.library.opcheck(fa.flash_attn_bwd_op, (q, k, v, out, lse, do, True, True, True, path, bwd),
                          test_utils=("test_faketensor",))


@on_interpreter
def test_a_gluon_kernel_that_does_not_build_falls_back_to_the_tl_kernels(monkeypatch):
    """Where the auto-chosen Gluon forward or backward does not build (its build probe's `BuildFailed`), the call runs
    the tl kernels with one warning per kernel and config, never tries that build again, and the kernel paths say
    what ran; the gluon path asked for by name is refused in one line instead."""
    from kernels.attention.gluon.runtime import BuildFailed

    tries = []

    def broken(*args, **kwargs):
        tries.append(len(args))
        raise BuildFailed("_gluon_attn_fwd_kernel does not build on Triton 9.9: RuntimeError: renamed")

    monkeypatch.setattr(fa, "gluon_unsupported_reason", lambda q, k, v: "")
    monkeypatch.setattr(dispatch, "GLUON_AUTO_MIN_WORK", {16: 0})
    monkeypatch.setattr(dispatch, "GLUON_BWD_AUTO_MIN_WORK", {16: 0})
    monkeypatch.setattr(dispatch, "_GLUON_BROKEN", {})
    monkeypatch.setattr(fa, "gluon_fwd_config", lambda q, k: dispatch.DEFAULT_FWD_CONFIGS[64])
    monkeypatch.setattr(fa, "gluon_bwd_config", lambda q: "bwd-config")
    monkeypatch.setattr(fa.gluon_fwd, "launch_fwd", broken)
    monkeypatch.setattr(fa.gluon_bwd, "launch_bwd", broken)
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    monkeypatch.delenv(dispatch.BWD_ENV, raising=False)
    q, k, v, do = _inputs((1, 2, 33, 16), (1, 2, 33, 16), torch.float16, seed=3)
    want_out, _, want_dq, want_dk, want_dv = _reference(q, k, v, do, True)
    for call in range(2):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with pytest.warns(RuntimeWarning) if call == 0 else _no_warning() as record:
            out = fa.flash_attention(qg, kg, vg, True)
            out.backward(do)
        if call == 0:
            messages = [str(w.message) for w in record]
            assert len(messages) == 2 and all("\n" not in m and "the tl kernels run instead" in m for m in messages)
            assert "attention fwd" in messages[0] and "attention bwd" in messages[1]
        for got, want in ((out, want_out), (qg.grad, want_dq), (kg.grad, want_dk), (vg.grad, want_dv)):
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
        assert dispatch.last_paths() == "portable, two_pass"
    assert len(tries) == 2  # one build probe each of the forward and the backward, in the first call only
    with pytest.raises(ValueError, match=r"^the gluon path cannot run here: .*does not build on Triton 9.9"):
        fa.flash_attention(q, k, v, True, path="gluon")


def _no_warning():
    import warnings
    from contextlib import contextmanager

    @contextmanager
    def guard():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            yield

    return guard()
