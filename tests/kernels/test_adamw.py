"""FusedAdamW under the CPU interpreter (TRITON_INTERPRET=1) against the reference `raysys.model.transformer.AdamW`.

Odd sizes (numel 1, 7, 1025 over 64-element chunks and 16-element blocks, a 2-D and a 0-dim parameter), two
groups with their own lr and weight decay, parameters whose grad is None on some or all steps, several steps.
fp32: bitwise equal once the reference's sqrt is an IEEE one (ATen's vectorised CPU sqrt is not correctly
rounded; the kernel's is, as CUDA's is), and within a few ulps of the update without that. fp16: mostly bitwise
(the vectorised bulk); ATen's scalar tail loop (numel mod 32) rounds in another order: at most 2 ulps apart.
Bitwise needs `tl.fma` rounded once, as on a GPU; the interpreters of Triton 3.6-3.8 compute a * b + c with two
roundings (`INTERPRETER_FMA_FUSED`), and there the fp32 results are checked to within 2 ulps instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.adamw as fa
from kernels.device import INTERPRET
from raysys.model.transformer import AdamW
from tests.kernels.interp import on_interpreter


def _interpreter_fma_fused() -> bool:
    """Whether `tl.fma` rounds once here: (1 + 2^-23)(1 - 2^-23) - 1 is -2^-46 fused and 0 with two roundings."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, b_ptr, c_ptr, out_ptr):
        tl.store(out_ptr, tl.fma(tl.load(a_ptr), tl.load(b_ptr), tl.load(c_ptr)))

    a, b, c = torch.tensor([1 + 2**-23]), torch.tensor([1 - 2**-23]), torch.tensor([-1.0])
    out = torch.empty(1)
    probe[(1,)](a, b, c, out)
    return out.item() == -(2.0**-46)


INTERPRETER_FMA_FUSED = _interpreter_fma_fused() if INTERPRET else True


def _assert_fp32_match(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise where the interpreter's fma is fused, else within 2 ulps of the tensor's largest element (a product
    rounded twice can be off by an ulp of the terms, not of a result they cancel to; see the module docstring)."""
    if INTERPRETER_FMA_FUSED:
        assert torch.equal(a, b), f"{what}: {(a - b).abs().max().item()}"
    elif b.numel():
        worst, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert worst <= 2**-22 * scale, f"{what}: {worst} > 2 ulps of {scale}"

SHAPES = [(1,), (7,), (1025,), (33, 17), ()]
GROUPS = [dict(), dict(lr=3e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)]


def _ieee_sqrt(self):
    """Correctly rounded sqrt (NumPy's), in place of ATen's vectorised CPU one."""
    return torch.from_numpy(np.asarray(np.sqrt(self.detach().numpy()))).reshape(self.shape)


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _grad(shape, dtype, gen):
    # |g| in [0.5, 1.5]: fp16's v = (1 - b2) g^2 stays a normal number, so neither side divides 0 by 0.
    return ((torch.rand(shape, generator=gen) + 0.5) * torch.randn(shape, generator=gen).sign()).to(dtype)


def _pair(dtype, opt_cls=fa.FusedAdamW, ref_cls=AdamW):
    base = _params(dtype)
    fused = [torch.nn.Parameter(p.clone()) for p in base]
    ref = [torch.nn.Parameter(p.clone()) for p in base]

    def groups(ps):
        return [dict(params=ps[:3], **GROUPS[0]), dict(params=ps[3:], **GROUPS[1])]

    return fused, ref, opt_cls(groups(fused), lr=1e-2), ref_cls(groups(ref), lr=1e-2)


def _run(fused, ref, opt, opt_ref, steps, dtype, monkeypatch=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for i, (a, b) in enumerate(zip(fused, ref)):
            # param 1 never has a grad, param 0 skips every other step
            g = None if i == 1 or (i == 0 and step % 2) else _grad(a.shape, dtype, gen)
            a.grad, b.grad = (None, None) if g is None else (g.clone(), g.clone())
        opt.step()
        if monkeypatch is not None:
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "sqrt", _ieee_sqrt)
                opt_ref.step()
        else:
            opt_ref.step()


def _states(opt, params):
    return [opt.state[p] for p in params]


@on_interpreter
def test_fp32_bitwise_equal_to_reference_with_ieee_sqrt(monkeypatch):
    dtype = torch.float32
    fused, ref, opt, opt_ref = _pair(dtype)
    _run(fused, ref, opt, opt_ref, steps=5, dtype=dtype, monkeypatch=monkeypatch)
    assert not opt.state[fused[1]] and not opt_ref.state[ref[1]], "a param without grad must get no state"
    for i, (a, b) in enumerate(zip(fused, ref)):
        _assert_fp32_match(a, b, f"param {i} {tuple(a.shape)}")
    for i, (s, r) in enumerate(zip(_states(opt, fused), _states(opt_ref, ref))):
        assert s.keys() == r.keys() and s.get("t") == r.get("t"), (i, s.keys(), r.keys())
        if s:
            _assert_fp32_match(s["m"], r["m"], f"param {i} m")
            _assert_fp32_match(s["v"], r["v"], f"param {i} v")
            assert s["m"].dtype == s["v"].dtype == dtype
    assert opt.state[fused[0]]["t"] == 4 and opt.state[fused[2]]["t"] == 6  # per-parameter step counts


@on_interpreter
def test_fp32_within_ulps_of_reference_with_its_own_sqrt():
    fused, ref, opt, opt_ref = _pair(torch.float32)
    _run(fused, ref, opt, opt_ref, steps=5, dtype=torch.float32)
    for a, b in zip(fused, ref):
        # the denominators differ by <= 1 ulp: the update (<= ~lr) by a few ulps of itself, p by 1 ulp more
        torch.testing.assert_close(a, b, rtol=2**-22, atol=3e-2 * 2**-21)
    for s, r in zip(_states(opt, fused), _states(opt_ref, ref)):
        if s:
            _assert_fp32_match(s["m"], r["m"], "m")
            _assert_fp32_match(s["v"], r["v"], "v")


@on_interpreter
def test_fp16_within_two_ulps_of_reference():
    fused, ref, opt, opt_ref = _pair(torch.float16)
    _run(fused, ref, opt, opt_ref, steps=5, dtype=torch.float16)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=2**-9, atol=2**-14)
    equal = sum((a == b).sum().item() for a, b in zip(fused, ref)) / sum(a.numel() for a in fused)
    assert equal > 0.95, f"only {equal:.3f} of the fp16 elements are bitwise equal"


@on_interpreter
def test_one_launch_per_device_and_dtype(monkeypatch):
    calls = []
    real = fa.fused_adamw_step
    monkeypatch.setattr(fa, "fused_adamw_step", lambda *a: (calls.append(len(a[0])), real(*a)))
    params = [torch.nn.Parameter(p) for p in _params(torch.float32)] + [torch.nn.Parameter(torch.randn(5).half())]
    for p in params:
        p.grad = torch.randn_like(p)
    fa.FusedAdamW([dict(params=params[:2]), dict(params=params[2:], lr=0.1)]).step()
    assert sorted(calls) == [1, 5], calls


@on_interpreter
def test_state_dict_round_trip_with_the_reference(monkeypatch):
    fused, ref, opt, opt_ref = _pair(torch.float32)
    _run(fused, ref, opt, opt_ref, steps=3, dtype=torch.float32, monkeypatch=monkeypatch)
    # Swap states: each optimizer continues from the other's state_dict.
    fused_sd, ref_sd = opt.state_dict(), opt_ref.state_dict()
    assert set(fused_sd["state"][0]) == {"t", "m", "v"} and fused_sd["param_groups"] == ref_sd["param_groups"]
    opt2 = fa.FusedAdamW([dict(params=[torch.nn.Parameter(p.detach().clone()) for p in ref[:3]]),
                          dict(params=[torch.nn.Parameter(p.detach().clone()) for p in ref[3:]])], lr=1e-2)
    opt2.load_state_dict(ref_sd)
    ref2 = AdamW([dict(params=[torch.nn.Parameter(p.detach().clone()) for p in fused[:3]]),
                  dict(params=[torch.nn.Parameter(p.detach().clone()) for p in fused[3:]])], lr=1e-2)
    ref2.load_state_dict(fused_sd)
    p_fused = [p for g in opt2.param_groups for p in g["params"]]
    p_ref = [p for g in ref2.param_groups for p in g["params"]]
    _run(p_fused, p_ref, opt2, ref2, steps=2, dtype=torch.float32, monkeypatch=monkeypatch, seed=7)
    for i, (a, b) in enumerate(zip(p_fused, p_ref)):
        _assert_fp32_match(a, b, f"param {i}")
    assert opt2.state[p_fused[2]]["t"] == ref2.state[p_ref[2]]["t"] == 6


@on_interpreter
def test_parameters_the_kernel_cannot_take_run_the_reference_ops():
    """Non-contiguous and fp64 parameters take the reference's own ops: bitwise equal even with ATen's sqrt."""
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(7, 5, generator=gen).t(), torch.randn(9, generator=gen).double()]
    fused = [torch.nn.Parameter(b.clone() if b.is_contiguous() else b.clone().t().contiguous().t()) for b in base]
    ref = [torch.nn.Parameter(b.clone()) for b in base]
    assert not fused[0].is_contiguous()
    opt, opt_ref = fa.FusedAdamW(fused, lr=0.05), AdamW(ref, lr=0.05)
    for _ in range(3):
        for a, b in zip(fused, ref):
            g = torch.randn(a.shape, generator=gen, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    for a, b in zip(fused, ref):
        assert torch.equal(a, b)


@on_interpreter
def test_compiled_step_matches_eager():
    """A compiled optimizer step (aot_eager) runs the custom op and gives the eager result."""
    params = _params(torch.float32)
    compiled_p = [torch.nn.Parameter(p.clone()) for p in params]
    eager_p = [torch.nn.Parameter(p.clone()) for p in params]
    opt_c, opt_e = fa.FusedAdamW(compiled_p, lr=1e-2), fa.FusedAdamW(eager_p, lr=1e-2)
    step = torch.compile(opt_c.step, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for a, b in zip(compiled_p, eager_p):
            g = _grad(a.shape, torch.float32, gen)
            a.grad, b.grad = g.clone(), g.clone()
        step()
        opt_e.step()
    for a, b in zip(compiled_p, eager_p):
        assert torch.equal(a, b)


@on_interpreter
def test_compiled_step_records_what_ran():
    """Under torch.compile the step still records its paths (a dict it mutates: torch 2.11's dynamo refuses an
    attribute set on the optimizer): a gradient the kernel cannot take (not contiguous) makes the label say
    `kernel+reference`, where the guess before any step says `kernel`."""
    params = [torch.nn.Parameter(p) for p in _params(torch.float32)]
    opt = fa.FusedAdamW(params, lr=1e-2)
    assert opt.label == "FusedAdamW"
    step = torch.compile(opt.step, backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    for p in params:
        p.grad = _grad(p.shape, torch.float32, gen)
    matrix = params[SHAPES.index((33, 17))]
    matrix.grad = _grad((17, 33), torch.float32, gen).t()  # its shape, not contiguous
    step()
    assert opt.paths == {"kernel", "reference"} and opt.label == "FusedAdamW[kernel+reference]"


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1e-3), "lr"),
    (dict(lr="0.1"), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(betas=(1.0, 0.9)), "betas"),
    (dict(betas=(0.9, -0.1)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyper_parameters_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fa.FusedAdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


@on_interpreter
def test_sparse_gradient_raises():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        fa.FusedAdamW([p]).step()


@on_interpreter
def test_launcher_checks_its_lists():
    p, g, m, v = (torch.zeros(5) for _ in range(4))
    with pytest.raises(ValueError, match="one length"):
        fa.fused_adamw_step([p], [g], [m], [], torch.zeros(1, fa.NUM_SCALARS))
    with pytest.raises(ValueError, match="one dtype"):
        fa.fused_adamw_step([p, p.half()], [g, g.half()], [m, m.half()], [v, v.half()],
                            torch.zeros(2, fa.NUM_SCALARS))
    with pytest.raises(ValueError, match="contiguous"):
        fa.fused_adamw_step([p], [g], [m], [torch.zeros(10)[::2]], torch.zeros(1, fa.NUM_SCALARS))


# ----------------------------------------------------------------------------------------------------------
# GPU: bitwise against the reference on CUDA, inductor (skipped without CUDA)
# ----------------------------------------------------------------------------------------------------------
GPU_SHAPES = [(1,), (7,), (1025,), (333, 177), (), (4096,), (2_000_003,), (65536 * 3,)]


def _gpu_params(dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(s, generator=gen, device="cuda").to(dtype) for s in GPU_SHAPES]
    # a contiguous parameter whose storage starts 2 elements in: not 16-byte aligned, the kernel's ALIGN=1 path
    params.append(torch.randn(10_001, generator=gen, device="cuda").to(dtype)[2:])
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_equal_to_reference(dtype):
    base = _gpu_params(dtype)
    fused = [torch.nn.Parameter(p.clone()) for p in base]
    ref = [torch.nn.Parameter(p.clone()) for p in base]
    fused[-1] = torch.nn.Parameter(base[-1])  # keep the misaligned storage
    assert fused[-1].data_ptr() % 16 != 0
    groups = lambda ps: [dict(params=ps[:4]), dict(params=ps[4:], lr=3e-3, weight_decay=0.1)]
    opt, opt_ref = fa.FusedAdamW(groups(fused), lr=1e-2), AdamW(groups(ref), lr=1e-2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        for i, (a, b) in enumerate(zip(fused, ref)):
            g = None if i == 1 and step % 2 else (torch.randn(a.shape, generator=gen, device="cuda") * 0.1).to(dtype)
            a.grad, b.grad = (None, None) if g is None else (g.clone(), g.clone())
        opt.step()
        opt_ref.step()
    tensors = [(a, b) for a, b in zip(fused, ref)]
    tensors += [(opt.state[a][k], opt_ref.state[b][k]) for a, b in zip(fused, ref) for k in ("m", "v")]
    equal = sum((a == b).sum().item() for a, b in tensors) / sum(a.numel() for a, _ in tensors)
    ulp = torch.finfo(dtype).eps
    worst = max(((a.float() - b.float()).abs() / b.float().abs().clamp_min(torch.finfo(dtype).tiny)).max().item()
                for a, b in tensors)
    print(f"GPUCHECK FusedAdamW {dtype} vs raysys.model.transformer.AdamW on CUDA: {equal:.6f} of elements bitwise equal, "
          f"worst relative difference {worst:.3g} ({worst / ulp:.2f} ulp)")
    if dtype == torch.float32:
        assert equal == 1.0
    else:
        assert equal > 0.999 and worst <= ulp, (equal, worst)


@pytest.mark.gpu
def test_gpu_inductor_compiled_step_matches_eager():
    base = _gpu_params(torch.bfloat16)
    compiled_p = [torch.nn.Parameter(p.clone()) for p in base]
    eager_p = [torch.nn.Parameter(p.clone()) for p in base]
    opt_c, opt_e = fa.FusedAdamW(compiled_p, lr=1e-2), fa.FusedAdamW(eager_p, lr=1e-2)
    step = torch.compile(opt_c.step)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(3):
        for a, b in zip(compiled_p, eager_p):
            g = torch.randn(a.shape, generator=gen, device="cuda").to(a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        step()
        opt_e.step()
    same = all(torch.equal(a, b) for a, b in zip(compiled_p, eager_p))
    print(f"GPUCHECK FusedAdamW step under torch.compile (inductor) equals eager: {same}")
    assert same


def _model_params(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in ((33, 17), (7,))]


def _grads(params):
    for p in params:
        p.grad = torch.randn_like(p)


def test_label_says_the_reference_ran_on_a_cpu_without_the_interpreter(monkeypatch):
    """On a CPU without TRITON_INTERPRET=1 every parameter takes the reference's ops: the label says so (it said
    `FusedAdamW`), before the first step and after it, and the update is the reference's."""
    monkeypatch.setattr(fa, "INTERPRET", False)
    params, ref_params = _model_params(), _model_params()
    opt, ref = fa.FusedAdamW(params, lr=1e-2), AdamW(ref_params, lr=1e-2)
    assert opt.paths == {"reference"} and opt.label == "FusedAdamW[reference]"
    for _ in range(2):
        _grads(params)
        for p, q in zip(params, ref_params):
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert opt.label == fa.optimizer_label(opt) == "FusedAdamW[reference]"
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert fa.optimizer_label(ref) == "AdamW" and fa.optimizer_label(fa.ForeachAdamW(ref_params)) == "ForeachAdamW"


@on_interpreter
def test_label_names_each_path_that_ran():
    params = _model_params()
    opt = fa.FusedAdamW(params)
    assert opt.label == "FusedAdamW" and opt.paths == {"kernel"}
    strided = torch.nn.Parameter(torch.randn(17, 33).t())   # not contiguous: the kernel cannot take it
    mixed = fa.FusedAdamW([*params, strided])
    assert mixed.label == "FusedAdamW[kernel+reference]"
    _grads(params)
    mixed.step()                                             # `strided` has no gradient: only the kernel ran
    assert mixed.label == "FusedAdamW" and mixed.paths == {"kernel"}
    strided.grad = torch.randn(17, 33).t()
    mixed.step()
    assert mixed.label == "FusedAdamW[kernel+reference]"
    per_param = [fa.FusedAdamW([p]) for p in (*params, strided)]   # as an optimizer stepped in backward holds them
    assert fa.optimizer_label(*per_param) == "FusedAdamW[kernel+reference]"
    assert fa.optimizer_label(*per_param[:2]) == "FusedAdamW"
    with pytest.raises(ValueError, match="one class"):
        fa.optimizer_label(opt, AdamW(params))
