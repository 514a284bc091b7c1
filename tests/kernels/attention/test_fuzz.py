"""A seeded fuzz of `flash_attention` on the gluon path and on `auto` above its Gluon thresholds against fp64
attention per head (GPU), and the fuzz's own check on the tl kernels under the interpreter (CPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import kernels.attention.interface as fa
from kernels.attention import dispatch
from tests.kernels.attention.gluon.support import needs_sm90

FUZZ_EDGES = [  # (B, H, n_q, n_k, d, dtype, causal, layout): the shapes an earlier fuzz found wrong, and the edges
    (2, 1, 1, 1, 128, torch.float16, True, "bhnd"), (2, 4, 1, 1, 64, torch.bfloat16, True, "bshd"),
    (3, 4, 4097, 1, 64, torch.bfloat16, False, "bhnd"), (2, 4, 1, 1, 64, torch.float16, True, "bhnd"),
    (1, 1, 1, 1, 64, torch.bfloat16, False, "bshd"), (1, 3, 1, 300, 128, torch.bfloat16, False, "bhnd"),
    (1, 2, 300, 1, 128, torch.float16, False, "bshd"), (1, 1, 17, 17, 64, torch.bfloat16, True, "bhnd"),
    (1, 2, 127, 127, 128, torch.bfloat16, True, "bshd"), (1, 2, 129, 129, 64, torch.float16, True, "bhnd"),
    (2, 3, 300, 300, 128, torch.bfloat16, False, "bshd"), (1, 2, 4097, 4097, 64, torch.bfloat16, True, "bshd"),
    (1, 2, 1000, 777, 128, torch.bfloat16, False, "bhnd"), (1, 2, 777, 1000, 64, torch.float16, False, "bshd"),
    (1, 1, 2, 2, 128, torch.bfloat16, True, "bhnd"), (1, 1, 65, 65, 128, torch.float16, True, "bshd"),
]


def _fuzz_cases(count: int = 18, seed: int = 2026) -> list[tuple]:
    """FUZZ_EDGES and `count` seeded draws: 1-3 sequences of 1-5 heads, lengths log-uniform in [1, 3000]."""
    import random

    rng = random.Random(seed)
    cases = list(FUZZ_EDGES)
    for _ in range(count):
        n_q = int(round(math.exp(rng.uniform(0, math.log(3000)))))
        causal = rng.random() < 0.5
        n_k = n_q if causal else int(round(math.exp(rng.uniform(0, math.log(3000)))))
        cases.append((rng.randint(1, 3), rng.randint(1, 5), n_q, n_k, rng.choice([64, 128]),
                      rng.choice([torch.bfloat16, torch.float16]), causal, rng.choice(["bhnd", "bshd"])))
    return cases


FUZZ_AUTO = [  # above `auto`'s thresholds (GLUON_AUTO_MIN_WORK / GLUON_BWD_AUTO_MIN_WORK): what the model meets
    (2, 4, 8197, 8197, 128, torch.bfloat16, True, "bshd"), (1, 2, 16385, 16385, 128, torch.bfloat16, True, "bshd"),
    (1, 8, 16385, 16385, 64, torch.bfloat16, True, "bhnd"),
]


def _fuzz_inputs(case, gen):
    batch, heads, n_q, n_k, d, dtype, causal, layout = case

    def make(n):
        if layout == "bshd":  # the model's projections, viewed as (B, H, N, d)
            return torch.randn(batch, n, heads, d, generator=gen, device=gen.device).to(dtype).transpose(1, 2)
        return torch.randn(batch, heads, n, d, generator=gen, device=gen.device).to(dtype)

    return make(n_q), make(n_k), make(n_k), make(n_q)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b lie in memory alike: the same shape and strides, a length-1 dimension's stride aside (it addresses
    nothing; `view` and autograd may set it to anything)."""
    return a.shape == b.shape and all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _fuzz_head(q, k, v, do, causal):
    """fp64 attention of one head: O, dQ, dK, dV and, for each, its first-order error scale (the same sums over
    absolute values: what rounding of every term can move it by, which cancellation can make far larger than the
    value itself, e.g. dQ = dK = 0 exactly when there is one key)."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.T * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v
    dp = do @ v.T
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    ds_scale = p * (do.abs() @ v.abs().T + (do * o).abs().sum(-1, keepdim=True))
    values = {"o": o, "dq": ds @ k * scale, "dk": ds.T @ q * scale, "dv": p.T @ do}
    scales = {"o": p @ v.abs(), "dq": ds_scale @ k.abs() * scale, "dk": ds_scale.T @ q.abs() * scale,
              "dv": p.T @ do.abs()}
    return values, scales


def _fuzz_check(case, path: str, gen, corrupt=None) -> dict[str, float]:
    """Run `flash_attention` on the case through autograd; per tensor, ||got - fp64|| / max(||fp64||, eps * ||scale||)
    over all heads (a relative error, floored where cancellation leaves the value far below its error scale).
    `corrupt(got)` may alter the results first (the CPU test of the check itself)."""
    batch, heads, n_q, n_k, d, dtype, causal, layout = case
    q, k, v, do = _fuzz_inputs(case, gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa.flash_attention(*leaves, causal, path=path)
    out.backward(do)
    got = {"o": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if corrupt is not None:
        corrupt(got)
    assert all(_same_layout(g, t) for g, t in zip(got.values(), (q, q, k, v))), [g.stride() for g in got.values()]
    sums = {name: [0.0, 0.0, 0.0] for name in got}  # ||err||^2, ||ref||^2, ||scale||^2
    for b in range(batch):
        for h in range(heads):
            values, scales = _fuzz_head(q[b, h], k[b, h], v[b, h], do[b, h], causal)
            for name, ref in values.items():
                assert torch.isfinite(got[name][b, h]).all(), (case, name)
                sums[name][0] += (got[name][b, h].double() - ref).square().sum().item()
                sums[name][1] += ref.square().sum().item()
                sums[name][2] += scales[name].square().sum().item()
    eps = torch.finfo(dtype).eps
    return {name: math.sqrt(err) / max(math.sqrt(ref), eps * math.sqrt(scale))
            for name, (err, ref, scale) in sums.items()}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _fuzz_cases(), ids=lambda c: "x".join(map(str, c[:5])) + f"-{str(c[5])[6:]}"
                         f"-{'causal' if c[6] else 'full'}-{c[7]}")
def test_gluon_path_fuzz_matches_fp64_attention(case):
    """Forced `path="gluon"` (its forward and one-pass backward), n_q = 1, n_k = 1, one head, one sequence, lengths that
    are no multiple of any tile, both layouts: O, dQ, dK, dV within bf16's / fp16's tolerance of fp64 attention per
    head (`_fuzz_check`), outputs in the inputs' layouts."""
    errors = _fuzz_check(case, "gluon", torch.Generator(device="cuda").manual_seed(hash(case[:5]) % 2**31))
    tol = 2e-2 if case[5] == torch.bfloat16 else 4e-3
    assert max(errors.values()) <= tol, (case, errors)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", FUZZ_AUTO, ids=lambda c: "x".join(map(str, c[:5])))
def test_auto_path_fuzz_matches_fp64_attention(case):
    """`auto` above its Gluon thresholds (what the leaderboard's model runs): the same check."""
    errors = _fuzz_check(case, "auto", torch.Generator(device="cuda").manual_seed(7))
    paths = dispatch.last_paths()
    assert paths == "gluon, one_pass" and max(errors.values()) <= 2e-2, (case, errors, paths)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tl kernels on the CPU need the interpreter")
def test_fuzz_check_passes_the_tl_kernels_and_fails_a_wrong_gradient():
    """The fuzz's check itself, on the tl kernels under the interpreter (fp16): the one-key shapes (dQ = dK = 0 in
    exact arithmetic, so a plain relative error divides rounding noise by about zero) and an odd causal shape pass;
    a gradient 2% off, or one entry's dQ wrong, fails."""
    cases = [(2, 1, 1, 1, 128, torch.float16, True, "bhnd"), (3, 2, 97, 1, 64, torch.float16, False, "bshd"),
             (1, 2, 67, 67, 64, torch.float16, True, "bshd")]
    gen = torch.Generator().manual_seed(0)
    for case in cases:
        assert max(_fuzz_check(case, "portable", gen).values()) <= 4e-3, case

    def scaled(got):
        got["dk"].mul_(1.02)

    def one_entry(got):
        got["dq"][0, 0, 5, 3] += 0.5 * got["dq"].abs().max()

    assert _fuzz_check(cases[2], "portable", gen, scaled)["dk"] > 4e-3
    assert _fuzz_check(cases[2], "portable", gen, one_entry)["dq"] > 4e-3
