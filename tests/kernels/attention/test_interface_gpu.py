"""GPU numerics of the Triton FlashAttention-2 kernels (`pytest -m gpu` on a CUDA host).

Random shapes (lengths that are not tile multiples, n_q != n_k, 3-D and 4-D input) for every head dim in
{16, 32, 64, 80, 96, 128}, bf16 and fp32, causal and not: O, L, dQ, dK, dV against the fp64 reference run on
the same (rounded) inputs. bf16 must be no worse than naive bf16 attention (twice its error, plus a floor);
fp32 uses exact fp32 products and must agree to ~1e-5. Autotuning is off here (first valid config) to keep
compile time down; the benchmark exercises the autotuner.
"""

from __future__ import annotations

import random

import pytest
import torch

import kernels.attention.interface as fa
from kernels.attention import dispatch
from kernels.attention.reference import flash_attention_reference
from kernels.attention.triton.tuning import FlashConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or fa.INTERPRET, reason="needs a CUDA GPU, not the interpreter"),
]

HEAD_DIMS = (16, 32, 64, 80, 96, 128)
# Every path this GPU runs: the tma path on sm_90 (tensor descriptors), the portable one everywhere.
PATHS = (("portable", "tma") if torch.cuda.is_available() and dispatch.tma_supported(torch.device("cuda"))
         else ("portable",))


@pytest.fixture(autouse=True)
def _first_valid_config(monkeypatch):
    monkeypatch.setenv("RAYSYS_FLASH_AUTOTUNE", "0")


def _shape(head_dim: int, causal: bool, dtype: torch.dtype):
    rng = random.Random(f"{head_dim}-{causal}-{dtype}")
    batch, heads = rng.choice([(1, 3), (2, 2), (3, None)])
    n_q = rng.randrange(65, 700)
    n_k = n_q if causal else rng.randrange(65, 700)
    lead = (batch,) if heads is None else (batch, heads)
    return lead + (n_q, head_dim), lead + (n_k, head_dim)


def _inputs(q_shape, k_shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in (q_shape, k_shape, k_shape))
    do = torch.randn(q_shape, generator=gen, device="cuda").to(dtype)
    return q, k, v, do


def _run(fn, q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    saved = getattr(out.grad_fn, "saved_tensors", ())  # custom autograd.Function nodes only
    lse = [t for t in saved if t.shape == q.shape[:-1]]
    out.backward(do)
    return out.detach(), (lse[0] if lse else None), q.grad, k.grad, v.grad


def _rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def _reference(q, k, v, do, causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_reference(q64, k64, v64, causal, return_lse=True)
    out.backward(do.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_fp64_reference(head_dim, dtype, causal, path):
    _check_against_fp64(head_dim, dtype, causal, path, "two_pass")
    assert [dispatch.LAST_PATH[k] for k in ("fwd", "dkdv", "dq", "bwd")] == [path] * 3 + ["two_pass"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", (16, 80, 128))
def test_one_pass_backward_matches_fp64_reference(head_dim, dtype, causal, path):
    """dQ summed in fp32 by the dK/dV kernel (the TMA unit's reduce on the tma path, atomics on the other)."""
    _check_against_fp64(head_dim, dtype, causal, path, "one_pass")
    assert [dispatch.LAST_PATH[k] for k in ("fwd", "dkdvq", "bwd")] == [path, path, "one_pass"]


@pytest.mark.parametrize("path", PATHS)
def test_one_pass_dq_survives_autotuning(path, monkeypatch):
    """With autotuning on, the one-pass kernel is timed several times on one dQ accumulator before the real run:
    its autotuner must zero it in between (the first H200 run measured dQ ~1000x too large without that)."""
    monkeypatch.setenv("RAYSYS_FLASH_AUTOTUNE", "1")
    q, k, v, do = _inputs((1, 4, 1024, 128), (1, 4, 1024, 128), torch.bfloat16, seed=6)
    out, lse = fa.flash_attention_fwd(q, k, v, True, path=path)
    one = fa.flash_attention_bwd(q, k, v, out, lse, do, True, path=path, bwd="one_pass")
    two = fa.flash_attention_bwd(q, k, v, out, lse, do, True, path=path, bwd="two_pass")
    for a, b in zip(one, two):
        assert _rel_err(a, b.double()) < 1e-2

def _naive(q, k, v, causal):
    """Plain attention in the inputs' dtype: the course's reference (its -1e6 mask overflows fp16, where SDPA's
    math backend, with -inf, stands in)."""
    if q.dtype != torch.float16:
        return flash_attention_reference(q, k, v, causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _check_against_fp64(head_dim, dtype, causal, path, bwd):
    q_shape, k_shape = _shape(head_dim, causal, dtype)
    q, k, v, do = _inputs(q_shape, k_shape, dtype)
    got = _run(lambda *a: fa.flash_attention(*a, path=path, bwd=bwd), q, k, v, do, causal)
    want = _reference(q, k, v, do, causal)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g in zip(names, got):
        assert g is not None and torch.isfinite(g).all(), f"{name} missing or not finite"
    assert got[1].dtype == torch.float32 and got[0].dtype == dtype
    if dtype == torch.float32:
        for name, g, w in zip(names, got, want):
            assert _rel_err(g, w) < 2e-5, f"{name}: relative error {_rel_err(g, w):.2e} ({q_shape}, {k_shape})"
        return
    naive = _run(_naive, q, k, v, do, causal)  # plain attention in the inputs' dtype
    assert (got[1].double() - want[1]).abs().max() < 1e-3, "lse"  # fp32 math on the bf16 inputs
    for i in (0, 2, 3, 4):
        ours, base = _rel_err(got[i], want[i]), _rel_err(naive[i], want[i])
        assert ours < max(2 * base, 1e-2), f"{names[i]}: {ours:.2e} vs naive bf16 {base:.2e} ({q_shape}, {k_shape})"


def test_course_shape_saves_one_lse_and_matches():
    """The course test's inputs: fp32 (4, 128, 64), tolerance 1e-2, exactly one (batch, n_queries) tensor."""
    q, k, v, do = _inputs((4, 128, 64), (4, 128, 64), torch.float32, seed=1)
    for causal in (False, True):
        out, lse, dq, dk, dv = _run(fa.FlashAttentionTriton.apply, q, k, v, do, causal)
        ref = _reference(q, k, v, do, causal)
        for g, w in zip((out, lse, dq, dk, dv), ref):
            torch.testing.assert_close(g.double(), w, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", PATHS)
def test_fp16_and_broadcast_upstream_gradient(path):
    q, k, v, _ = _inputs((2, 4, 300, 64), (2, 4, 300, 64), torch.float16, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fa.flash_attention(q, k, v, True, path=path).sum().backward()  # dO of stride 0 (copied for the tma path)
    _, _, dq, dk, dv = _reference(q, k, v, torch.ones_like(q), True)
    for g, w in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        assert _rel_err(g, w) < 1e-2


def test_tensors_on_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, do = (t.to("cuda:1") for t in _inputs((1, 2, 130, 64), (1, 2, 130, 64), torch.bfloat16, seed=3))
    out, _, dq, _, _ = _run(fa.flash_attention, q, k, v, do, True)
    assert out.device == dq.device == torch.device("cuda:1")
    assert _rel_err(out, _reference(q, k, v, do, True)[0]) < 1e-2


def test_explicit_config_equals_autotuned_choice():
    q, k, v, _ = _inputs((1, 2, 512, 64), (1, 2, 512, 64), torch.bfloat16, seed=4)
    out, lse = fa.flash_attention_fwd(q, k, v, True)
    cfg = FlashConfig(64, 32, 4, 2)
    out2, lse2 = fa.flash_attention_fwd(q, k, v, True, config=cfg)
    assert _rel_err(out2, out.double()) < 1e-2 and (lse2 - lse).abs().max() < 1e-3


def test_model_with_flash_triton_matches_naive_in_bf16():
    from raysys.model.config import ModelConfig
    from raysys.model.transformer import TransformerLM, cross_entropy

    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny", context_length=96)
    model = TransformerLM(cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randint(0, cfg.vocab_size, (2, 96), device="cuda")
    results = {}
    for backend in ("naive", "flash_triton"):
        model.zero_grad(set_to_none=True)
        model.set_attention(backend)
        logits = model(x)
        cross_entropy(logits, x).backward()
        results[backend] = (logits.float(), torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    (ref_logits, ref_grads), (logits, grads) = results["naive"], results["flash_triton"]
    assert (logits - ref_logits).norm() / ref_logits.norm() < 2e-2
    assert (grads - ref_grads).norm() / ref_grads.norm() < 5e-2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiled_model_launches_the_kernels_and_matches_eager(dtype, path, monkeypatch):
    """torch.compile(model, fullgraph) with Inductor: the generated code launches the Triton kernels themselves
    (triton_op, not an opaque call), and logits and every gradient match eager (same launch configs)."""
    from torch._inductor.utils import run_and_get_code

    from raysys.model.config import ModelConfig
    from raysys.model.transformer import TransformerLM, cross_entropy

    monkeypatch.setenv(dispatch.PATH_ENV, path)
    torch._dynamo.reset()
    cfg = ModelConfig.from_name("tiny", context_length=200, attention="flash_triton")
    torch.manual_seed(0)
    model = TransformerLM(cfg, device="cuda", dtype=dtype)
    x = torch.randint(0, cfg.vocab_size, (2, 197), device="cuda")

    def step(fn):
        model.zero_grad(set_to_none=True)
        logits = fn(x)
        cross_entropy(logits, x).backward()
        return logits.float(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    eager_logits, eager_grads = step(model)
    (logits, grads), code = run_and_get_code(step, torch.compile(model, fullgraph=True))
    code = "\n".join(code)
    for kernel in ("_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"):
        assert kernel in code, f"{kernel} not in Inductor's code"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (logits - eager_logits).norm() / eager_logits.norm() < tol
    assert (grads - eager_grads).norm() / eager_grads.norm() < tol * 5


@pytest.mark.parametrize("path", PATHS)
def test_triton_ops_pass_opcheck(path):
    q, k, v, do = _inputs((1, 2, 150, 64), (1, 2, 150, 64), torch.bfloat16, seed=5)
    torch.library.opcheck(fa.flash_attn_fwd_op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), True,
                                                 path, "two_pass"))
    out, lse = fa.flash_attention_fwd(q.detach(), k.detach(), v.detach(), True, path=path)
    for bwd in dispatch.BWD_MODES:
        torch.library.opcheck(fa.flash_attn_bwd_op, (q.detach(), k.detach(), v.detach(), out, lse, do, True, True,
                                                     True, path, bwd))


# ----------------------------------------------------------------------------------------------------------
# The gluon path (sm_90): the Gluon forward, and the Gluon one-pass backward or the tl kernels' on its L
# ----------------------------------------------------------------------------------------------------------
def _gluon_runs() -> bool:
    if not torch.cuda.is_available() or fa.INTERPRET:
        return False
    x = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16, device="cuda")
    return not dispatch.gluon_unsupported_reason(x, x, x)


needs_gluon = pytest.mark.skipif(not _gluon_runs(), reason="needs an sm_90 GPU and Triton's Gluon Hopper API")


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", (64, 128))
def test_gluon_forward_matches_fp64_reference(head_dim, dtype, causal):
    """O, L and every gradient (3-D and 4-D input, odd lengths, n_q != n_k) as the tl paths are held to."""
    _check_against_fp64(head_dim, dtype, causal, "gluon", "two_pass")
    last = dispatch.LAST_PATH
    assert last["fwd"] == "gluon" and last["dkdv"] in PATHS and last["dq"] in PATHS


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", (64, 128))
def test_gluon_backward_matches_fp64_reference(head_dim, dtype, causal):
    """The gluon path's own backward (one-pass, dQ by TMA reductions): every gradient, 3-D and 4-D input, odd
    lengths, n_q != n_k, as the tl paths are held to."""
    _check_against_fp64(head_dim, dtype, causal, "gluon", "auto")
    last = dispatch.LAST_PATH
    assert last["fwd"] == "gluon" and last["dkdvq"] == "gluon" and dispatch.last_paths() == "gluon, one_pass"


@needs_gluon
def test_gluon_backward_yields_to_deterministic_algorithms():
    q, k, v, do = _inputs((1, 2, 300, 128), (1, 2, 300, 128), torch.bfloat16, seed=9)
    torch.use_deterministic_algorithms(True)
    try:
        first = _run(lambda *a: fa.flash_attention(*a, path="gluon"), q, k, v, do, True)
        assert dispatch.last_paths().endswith("two_pass") and "gluon fwd" in dispatch.last_paths()
        again = _run(lambda *a: fa.flash_attention(*a, path="gluon"), q, k, v, do, True)
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), name


@needs_gluon
def test_auto_takes_gluon_forward_where_it_runs():
    q, k, v, _ = _inputs((1, 2, 300, 128), (1, 2, 300, 128), torch.bfloat16, seed=6)
    fa.flash_attention_fwd(q, k, v, True)
    assert dispatch.LAST_PATH["fwd"] in PATHS  # too small to hide the gluon launch
    q, k, v, do = _inputs((1, 16, 16384, 128), (1, 16, 16384, 128), torch.bfloat16, seed=6)
    out, lse = fa.flash_attention_fwd(q, k, v, True)
    assert dispatch.LAST_PATH["fwd"] == "gluon"
    fa.flash_attention_bwd(q, k, v, out, lse, do, True)  # d 128 at this size: the Gluon backward too
    assert dispatch.last_paths() == "gluon, one_pass"
    fa.flash_attention_fwd(q.float(), k.float(), v.float(), True)  # fp32: the tl kernels
    assert dispatch.LAST_PATH["fwd"] in PATHS


@needs_gluon
def test_gluon_forward_composes_with_torch_compile():
    """fullgraph Inductor: the Gluon forward is called as its op, the tl backward kernels (two_pass asked for) are
    launched by Inductor itself; output and gradients equal eager's."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, k, v, do = _inputs((2, 3, 197, 64), (2, 3, 197, 64), torch.bfloat16, seed=7)

    def attn(q, k, v, causal):
        return fa.flash_attention(q, k, v, causal, path="gluon", bwd="two_pass")

    eager = _run(attn, q, k, v, do, True)
    compiled = torch.compile(attn, fullgraph=True)
    got, code = run_and_get_code(lambda: _run(compiled, q, k, v, do, True))
    code = "\n".join(code)
    assert "gluon_attn_fwd" in code and "def _flash_bwd_dkdv_kernel(" in code
    assert "def _flash_fwd_kernel(" not in code  # (other kernels' sources mention it in comments)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (eager[0], *eager[2:])):
        assert torch.equal(g, w), name


@needs_gluon
def test_gluon_backward_composes_with_torch_compile():
    """fullgraph Inductor with the Gluon backward: both Gluon ops called, no tl kernel; output, dK and dV equal
    eager's bitwise (each written once), dQ to its last bits (fp32 reductions in no fixed order)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, k, v, do = _inputs((2, 3, 197, 128), (2, 3, 197, 128), torch.bfloat16, seed=7)

    def attn(q, k, v, causal):
        return fa.flash_attention(q, k, v, causal, path="gluon")

    eager = _run(attn, q, k, v, do, True)
    got, code = run_and_get_code(lambda: _run(torch.compile(attn, fullgraph=True), q, k, v, do, True))
    code = "\n".join(code)
    assert "gluon_attn_fwd" in code and "gluon_attn_bwd" in code and "def _flash_bwd_dkdv_kernel(" not in code
    for name, g, w in zip(("out", "dk", "dv"), (got[0], *got[3:]), (eager[0], *eager[3:])):
        assert torch.equal(g, w), name
    torch.testing.assert_close(got[2], eager[2], rtol=2**-7, atol=1e-3)


@needs_gluon
def test_gluon_op_passes_opcheck():
    q, k, v, _ = _inputs((1, 2, 150, 128), (1, 2, 150, 128), torch.float16, seed=8)
    torch.library.opcheck(fa.gluon_attn_fwd_op, (q, k, v, True))
    torch.library.opcheck(fa.flash_attn_fwd_op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), True,
                                                 "gluon", "two_pass"))
    out, lse = fa.flash_attention_fwd(q.detach(), k.detach(), v.detach(), True, path="gluon")
    # (the schema and fake checks; the Gluon backward's dQ is not bitwise repeatable, which opcheck's
    #  test_aot_dispatch_dynamic would compare)
    torch.library.opcheck(fa.gluon_attn_bwd_op, (q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(out),
                                                 True), test_utils=("test_schema", "test_faketensor"))
