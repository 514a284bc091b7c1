"""The fused LM head + cross-entropy under the CPU interpreter (TRITON_INTERPRET=1), against fp64 torch.

Odd token counts, vocab sizes and model dims (none a tile multiple), chunks that do not divide the tokens, 3-D
hidden states, non-unit upstream gradients, every gradient; buffers allocated NaN-poisoned so an element the op
forgets to write fails; a dispatch mode that sees every tensor the op makes, so a (tokens x vocab) one fails; the
custom op under `torch.compile` (aot_eager); bad inputs. Tolerances: fp32 within 1e-5 of fp64 (the kernel's
fp32 arithmetic lands near 1e-7); fp16 within 3e-3: the logits, the softmax gradient and each output are rounded
to fp16 once (2^-11 = 4.9e-4 relative each, three in a row), doubled for the accumulation order.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.fused_linear_ce as flce
from tests.kernels.interp import on_interpreter

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

# (hidden shape, vocab, dtype, chunk_size)
CASES = [
    ((1, 16), 257, torch.float32, None),       # one token
    ((37, 48), 1, torch.float32, None),        # vocab 1: loss and gradients exactly 0
    ((37, 16), 257, torch.float32, 10),        # 4 chunks, the last of 7 rows
    ((65, 48), 600, torch.float32, 32),        # 65 = 2 x 32 + 1; 600 = 9 x 64 + 24, the interpreter's vocab tile
    ((2, 19, 16), 257, torch.float32, 8),      # 3-D hidden, chunks across the batch boundary
    ((65, 16), 600, torch.float16, 25),
    ((37, 48), 257, torch.float16, None),
]


def _inputs(shape, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(shape, generator=gen).to(dtype)
    weight = (torch.randn(vocab, shape[-1], generator=gen) / shape[-1] ** 0.5).to(dtype)
    targets = torch.randint(0, vocab, shape[:-1], generator=gen)
    return hidden, weight, targets


def _reference(hidden, weight, targets, upstream):
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    loss = flce.linear_cross_entropy_reference(h64, w64, targets)
    (loss * upstream).backward()
    return loss.detach(), h64.grad, w64.grad


def _check(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    scale = expected.abs().max().item()
    if scale == 0:
        assert (actual == 0).all(), f"{what}: expected exact zeros"
        return
    err = (actual.double() - expected).abs().max().item()
    rel = ((actual.double() - expected).norm() / expected.norm()).item()
    assert err <= tol * scale and rel <= tol, f"{what}: max err {err:.3g} (scale {scale:.3g}), rel {rel:.3g} > {tol}"


class PoisonedAllocator:
    """Stands in for `flce._empty`: NaN-filled buffers, so an output element the op never writes stays NaN."""

    def __init__(self):
        self.shapes = []

    def __call__(self, shape, *, dtype, device):
        self.shapes.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)


@on_interpreter
@pytest.mark.parametrize("shape,vocab,dtype,chunk", CASES)
def test_loss_and_gradients_match_fp64(shape, vocab, dtype, chunk, monkeypatch):
    monkeypatch.setattr(flce, "_empty", PoisonedAllocator())
    hidden, weight, targets = _inputs(shape, vocab, dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    upstream = -1.7
    loss = flce.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
    (loss * upstream).backward()
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets, upstream)
    assert loss.dtype == torch.float32 and loss.shape == ()
    tol = TOL[dtype]
    assert abs(loss.item() - ref_loss.item()) <= tol * max(abs(ref_loss.item()), 1e-3), (loss.item(), ref_loss.item())
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    _check(hidden.grad, ref_dh, tol, "d hidden")
    _check(weight.grad, ref_dw, tol, "d weight")


@on_interpreter
def test_matches_materialised_fp32_reference_in_fp32():
    """Against the plain-torch fp32 path a user would otherwise run (not only the fp64 oracle)."""
    hidden, weight, targets = _inputs((45, 24), 300, torch.float32, seed=3)
    hidden.requires_grad_()
    weight.requires_grad_()
    flce.linear_cross_entropy(hidden, weight, targets, chunk_size=16).backward()
    h32, w32 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = flce.linear_cross_entropy_reference(h32, w32, targets)
    ref.backward()
    loss = flce.linear_cross_entropy(hidden.detach(), weight.detach(), targets)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(hidden.grad, h32.grad, rtol=1e-5, atol=1e-5 * h32.grad.abs().max().item())
    torch.testing.assert_close(weight.grad, w32.grad, rtol=1e-5, atol=1e-5 * w32.grad.abs().max().item())


@on_interpreter
@pytest.mark.parametrize("needs", [(True, False), (False, True), (False, False)])
def test_only_requested_gradients(needs, monkeypatch):
    allocator = PoisonedAllocator()
    monkeypatch.setattr(flce, "_empty", allocator)
    hidden, weight, targets = _inputs((21, 16), 70, torch.float32)
    hidden.requires_grad_(needs[0])
    weight.requires_grad_(needs[1])
    loss = flce.linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets, 1.0)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert ((21, 16) in allocator.shapes) == needs[0] and ((70, 16) in allocator.shapes) == needs[1]
    if any(needs):
        loss.backward()
        if needs[0]:
            _check(hidden.grad, ref_dh, 1e-5, "d hidden")
        if needs[1]:
            _check(weight.grad, ref_dw, 1e-5, "d weight")
    else:
        assert not loss.requires_grad
    with torch.no_grad():
        loss = flce.linear_cross_entropy(hidden, weight, targets)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@on_interpreter
def test_no_tokens_by_vocab_tensor_exists():
    num_tokens, vocab, dim, chunk = 65, 257, 48, 16
    hidden, weight, targets = _inputs((num_tokens, dim), vocab, torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    # The launcher itself: a dispatch mode sees a custom op as one op, not the aten ops inside it.
    recorder = ShapeRecorder()
    with recorder:
        flce.linear_cross_entropy_fwd(hidden.detach(), weight.detach(), targets, chunk_size=chunk)
    assert len(recorder.shapes) > 10, "the dispatch mode saw too few ops"
    largest = max(torch.Size(s).numel() for s in recorder.shapes)
    assert largest < num_tokens * vocab, f"a tensor of {largest} elements >= tokens x vocab was made"
    for shape in recorder.shapes:
        if vocab in shape and shape not in ((vocab, dim), (dim, vocab)):  # W and its transpose are inputs
            assert torch.Size(shape).numel() <= chunk * vocab, f"{shape} holds more than one chunk of logits"
    # Through the custom op and autograd, every buffer comes from `_empty`.
    allocator = PoisonedAllocator()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flce, "_empty", allocator)
        flce.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk).backward()
    assert (chunk, vocab) in allocator.shapes
    assert all(torch.Size(s).numel() <= max(chunk * vocab, vocab * dim) for s in allocator.shapes), allocator.shapes
    # The same run through the fp32 reference does make one, so the check can fail.
    recorder = ShapeRecorder()
    with recorder:
        flce.linear_cross_entropy_reference(hidden, weight, targets)
    assert (num_tokens, vocab) in recorder.shapes


def test_chunk_rows_keeps_the_logits_chunk_in_budget():
    rows = flce.chunk_rows(32768, 151936, torch.bfloat16)
    assert rows % 256 == 0 and rows * 151936 * 2 <= flce.MAX_CHUNK_BYTES < (rows + 256) * 151936 * 2
    assert rows * 151936 * 2 + 32768 * 4 < 2**30  # the chunk plus the fp32 loss rows: the 1 GiB
    assert flce.chunk_rows(5, 10, torch.float32) == 5  # never more rows than tokens
    assert flce.chunk_rows(10, 10**9, torch.float32) == 1  # one row even when it alone is over budget
    assert flce.chunk_rows(1000, 1000, torch.float32, max_bytes=4000 * 300) == 256  # rounded to full tiles
    assert flce.chunk_rows(1000, 1000, torch.float32, max_bytes=4000 * 200) == 200  # under 256: as is


@on_interpreter
def test_compiles_with_aot_eager():
    hidden, weight, targets = _inputs((2, 17, 16), 90, torch.float32, seed=5)

    def step(h, w, y):
        return flce.linear_cross_entropy(torch.tanh(h), w, y, chunk_size=8) * 2.5

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (compiled, step):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, targets)
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@on_interpreter
def test_backward_scales_in_place_and_autograd_adopts_the_buffers(monkeypatch):
    """No second (V, D) buffer in backward: .grad is the very buffer the forward wrote."""
    allocator = PoisonedAllocator()
    buffers = []
    monkeypatch.setattr(flce, "_empty", lambda shape, **kw: buffers.append(allocator(shape, **kw)) or buffers[-1])
    hidden, weight, targets = _inputs((2, 9, 16), 20, torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    (flce.linear_cross_entropy(hidden, weight, targets) * 3.0).backward()
    written = {b.data_ptr() for b in buffers}
    assert hidden.grad.data_ptr() in written and weight.grad.data_ptr() in written
    _check(weight.grad, _reference(hidden, weight, targets, 3.0)[2], 1e-5, "d weight")


@on_interpreter
def test_backward_gets_no_zero_filled_gradients_for_dh_and_dw(monkeypatch):
    """dh and dw are outputs nobody differentiates: autograd must not materialise a zero gradient for each (on the
    H200 that was one more (N + V) x D buffer, 1.41 GiB, at the backward's peak)."""
    seen = []
    backward = flce._backward

    def spy(ctx, grad_loss, grad_dh, grad_dw):
        seen.append((grad_dh, grad_dw))
        return backward(ctx, grad_loss, grad_dh, grad_dw)

    flce._linear_cross_entropy_op.register_autograd(spy, setup_context=flce._setup_context)
    try:
        hidden, weight, targets = _inputs((2, 9, 16), 20, torch.float32)
        hidden.requires_grad_()
        weight.requires_grad_()
        flce.linear_cross_entropy(hidden, weight, targets).backward()
    finally:
        flce._linear_cross_entropy_op.register_autograd(backward, setup_context=flce._setup_context)
    assert seen == [(None, None)]
    _check(weight.grad, _reference(hidden, weight, targets, 1.0)[2], 1e-5, "d weight")


@on_interpreter
def test_second_backward_through_one_graph_raises():
    """Backward scales the saved gradients in place; a retained graph must not scale them twice."""
    hidden, weight, targets = _inputs((9, 16), 20, torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    loss = flce.linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@on_interpreter
@pytest.mark.parametrize("make,match", [
    (lambda h, w, y: (h[:, :8], w, y), "last dim"),
    (lambda h, w, y: (h, w, y[:-1]), "leading shape"),
    (lambda h, w, y: (h, w.double(), y), "one dtype"),
    (lambda h, w, y: (h.double(), w.double(), y), "one dtype"),
    (lambda h, w, y: (h, w, y.int()), "int64"),
    (lambda h, w, y: (h, w.unsqueeze(0), y), "2-D"),
    (lambda h, w, y: (h[:0], w, y[:0]), "at least one token"),
    (lambda h, w, y: (h, w[:0], y), "at least one token"),
    (lambda h, w, y: (h, w.to("meta"), y), "one device"),
    (lambda h, w, y: (h, w, y.clone().fill_(20)), r"\[0, 20\)"),
    (lambda h, w, y: (h, w, y.clone().fill_(-1)), r"\[0, 20\)"),
    (lambda h, w, y: (h.bfloat16(), w.bfloat16(), y), "bfloat16"),
    (lambda h, w, y: (h, w, [1, 2]), "torch.Tensor"),
])
def test_bad_inputs_raise_value_error(make, match):
    hidden, weight, targets = _inputs((6, 16), 20, torch.float32)
    with pytest.raises(ValueError, match=match):
        flce.linear_cross_entropy(*make(hidden, weight, targets))


@on_interpreter
@pytest.mark.parametrize("chunk", [0, -3, 2.5])
def test_bad_chunk_size_raises(chunk):
    hidden, weight, targets = _inputs((6, 16), 20, torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        flce.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)


def test_flops():
    assert flce.linear_cross_entropy_flops(3, 5, 7) == 3 * 2 * 3 * 5 * 7
    with pytest.raises(ValueError, match="mode"):
        flce.linear_cross_entropy_flops(3, 5, 7, mode="both")


# ----------------------------------------------------------------------------------------------------------
# GPU: mid-size numerics and inductor (skipped without CUDA)
# ----------------------------------------------------------------------------------------------------------
def _rel(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mid_size_against_fp64_and_the_materialised_reference(dtype):
    """4093 tokens in 512-row chunks (8 passes over dW), vocab 32003, d 1024. fp32 within 1e-5 of fp64; bf16 no
    worse than 1e-2 (bf16 operands) and than 1.5x the error of the bf16 path it replaces (cross_entropy on
    materialised bf16 logits, all in bf16)."""
    hidden, weight, targets = (t.cuda() for t in _inputs((4093, 1024), 32003, dtype, seed=11))
    upstream = 0.75
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = flce.linear_cross_entropy(h, w, targets, chunk_size=512)
    (loss * upstream).backward()
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets, upstream)
    errors = dict(loss=abs(loss.item() - ref_loss.item()) / ref_loss.item(), dh=_rel(h.grad, ref_dh),
                  dw=_rel(w.grad, ref_dw))
    if dtype == torch.float32:
        print(f"GPUCHECK linear_cross_entropy fp32 rel errors vs fp64: {errors}")
        assert max(errors.values()) <= 1e-5, errors
        return
    hb, wb = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    base = flce.linear_cross_entropy_reference(hb, wb, targets)
    (base * upstream).backward()
    base_errors = dict(loss=abs(base.item() - ref_loss.item()) / ref_loss.item(), dh=_rel(hb.grad, ref_dh),
                       dw=_rel(wb.grad, ref_dw))
    print(f"GPUCHECK linear_cross_entropy bf16 rel errors vs fp64: fused {errors}, materialised bf16 {base_errors}")
    for key in errors:
        assert errors[key] <= 1e-2 and errors[key] <= 1.5 * base_errors[key] + 1e-4, (key, errors, base_errors)


@pytest.mark.gpu
def test_gpu_inductor_compiles_a_function_calling_the_op():
    hidden, weight, targets = (t.cuda() for t in _inputs((3, 341, 256), 5003, torch.bfloat16, seed=12))

    def step(h, w, y):
        h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(h.dtype)
        return flce.linear_cross_entropy(h, w, y) * 3.0

    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, targets)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (lc, dhc, dwc), (le, dhe, dwe) = results
    print(f"GPUCHECK inductor linear_cross_entropy: loss {lc.item():.6f} vs eager {le.item():.6f}, "
          f"dh rel {_rel(dhc, dhe.double()):.2e}, dw rel {_rel(dwc, dwe.double()):.2e}")
    torch.testing.assert_close(lc, le, rtol=1e-3, atol=0)
    assert _rel(dhc, dhe.double()) < 1e-2 and _rel(dwc, dwe.double()) < 1e-2
