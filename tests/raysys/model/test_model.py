"""The model under test against hand-written math and hand-made values (basics-model.md)."""

import math

import pytest
import torch

from raysys.model.config import ModelConfig
from raysys.model.transformer import (AdamW, RMSNorm, RotaryEmbedding, TransformerLM, causal_mask, cross_entropy,
                                      get_attention, naive_attention)

EXPECTED_KEYS = ["token_embeddings.weight"] + [
    f"layers.{i}.{k}" for i in range(2) for k in (
        "ln1.weight", "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.output_proj.weight",
        "ln2.weight", "ffn.w1.weight", "ffn.w2.weight", "ffn.w3.weight")
] + ["ln_final.weight", "lm_head.weight"]


def reference_forward(sd: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The same math written out with einsum and explicit loops over heads, from the state dict alone."""
    d_head, eps = cfg.d_head, 1e-5
    seq = x.shape[1]

    def rms(h, w):
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * w

    def rope(v):  # v: (B, S, D)
        out = torch.empty_like(v)
        for t in range(seq):
            for p in range(d_head // 2):
                freq = cfg.rope_theta ** (-(2 * p) / d_head)
                c, s = math.cos(t * freq), math.sin(t * freq)
                a, b = v[:, t, 2 * p], v[:, t, 2 * p + 1]
                out[:, t, p] = c * a - s * b
                out[:, t, d_head // 2 + p] = s * a + c * b
        return out

    h = sd["token_embeddings.weight"][x]
    for i in range(cfg.num_layers):
        L = lambda k: sd[f"layers.{i}.{k}"]
        a = rms(h, L("ln1.weight"))
        q = torch.einsum("bsi,oi->bso", a, L("attn.q_proj.weight"))
        k = torch.einsum("bsi,oi->bso", a, L("attn.k_proj.weight"))
        v = torch.einsum("bsi,oi->bso", a, L("attn.v_proj.weight"))
        heads = []
        for hd in range(cfg.num_heads):
            sl = slice(hd * d_head, (hd + 1) * d_head)
            qh, kh, vh = rope(q[..., sl]), rope(k[..., sl]), v[..., sl]
            scores = torch.einsum("bqd,bkd->bqk", qh, kh) / math.sqrt(d_head)
            mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
            scores = scores.masked_fill(~mask, float("-inf"))
            heads.append(torch.einsum("bqk,bkd->bqd", torch.softmax(scores, -1), vh))
        attn = torch.einsum("bsi,oi->bso", torch.cat(heads, -1), L("attn.output_proj.weight"))
        h = h + attn
        f = rms(h, L("ln2.weight"))
        w1 = torch.einsum("bsi,oi->bso", f, L("ffn.w1.weight"))
        w3 = torch.einsum("bsi,oi->bso", f, L("ffn.w3.weight"))
        h = h + torch.einsum("bsi,oi->bso", w1 * torch.sigmoid(w1) * w3, L("ffn.w2.weight"))
    return torch.einsum("bsi,oi->bso", rms(h, sd["ln_final.weight"]), sd["lm_head.weight"])


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny", context_length=16)
    return cfg, TransformerLM(cfg)


def test_state_dict_keys_and_shapes(tiny):
    cfg, model = tiny
    sd = model.state_dict()
    assert list(sd) == EXPECTED_KEYS
    assert sd["layers.0.ffn.w1.weight"].shape == (cfg.d_ff, cfg.d_model)
    assert sd["layers.0.ffn.w2.weight"].shape == (cfg.d_model, cfg.d_ff)
    assert sd["lm_head.weight"].shape == (cfg.vocab_size, cfg.d_model)
    assert all(torch.equal(sd[f"layers.{i}.ln{j}.weight"], torch.ones(cfg.d_model)) for i in range(2) for j in (1, 2))


def test_logits_match_hand_written_reference(tiny):
    cfg, model = tiny
    x = torch.randint(0, cfg.vocab_size, (2, 11))
    expected = reference_forward(model.state_dict(), x, cfg)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "annotated"])
def test_attention_backends_match_naive(tiny, backend):
    cfg, model = tiny
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    ref = model(x)
    torch.testing.assert_close(model.set_attention(backend)(x), ref, atol=1e-5, rtol=1e-5)


def test_init_statistics():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=4000, d_model=256, num_layers=1, num_heads=4, d_ff=512))
    w = model.layers[0].ffn.w1.weight
    std = math.sqrt(2 / (256 + 512))
    assert abs(w.std().item() - std) / std < 0.05 and w.abs().max() <= 3 * std + 1e-6
    emb = model.token_embeddings.weight
    assert abs(emb.std().item() - 0.9866) < 0.01  # std of N(0,1) truncated at +-3
    assert emb.abs().max() <= 3.0


def test_rope_layout_hand_values():
    rope = RotaryEmbedding(context_length=4, d_head=4, theta=10_000.0)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).expand(4, 4).clone()  # (S=4, D=4)
    out = rope(x, torch.arange(4))
    t = 1
    f0, f1 = 1.0, 10_000 ** (-2 / 4)
    # pairs (x0, x1) = (1, 2) at freq f0 and (x2, x3) = (3, 4) at freq f1; evens first, then odds
    expected = torch.tensor([
        math.cos(t * f0) * 1 - math.sin(t * f0) * 2, math.cos(t * f1) * 3 - math.sin(t * f1) * 4,
        math.sin(t * f0) * 1 + math.cos(t * f0) * 2, math.sin(t * f1) * 3 + math.cos(t * f1) * 4])
    torch.testing.assert_close(out[1], expected)
    torch.testing.assert_close(out[0], torch.tensor([1.0, 3.0, 2.0, 4.0]))  # position 0: no rotation, de-interleaved


def test_rmsnorm_upcasts_and_returns_input_dtype():
    norm = RMSNorm(4)
    x = torch.tensor([[60000.0, 60000.0, 60000.0, 60000.0]], dtype=torch.float16)  # x^2 overflows in fp16
    out = norm(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch.ones(1, 4, dtype=torch.float16), atol=1e-3, rtol=1e-3)


def test_causal_mask_and_naive_attention():
    assert causal_mask(3, 3, torch.device("cpu")).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    q = torch.zeros(1, 1, 3, 2)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]]])
    out = naive_attention(q, q, v, is_causal=True)  # uniform weights over the visible prefix
    torch.testing.assert_close(out[0, 0], torch.tensor([[1.0, 0.0], [0.5, 0.5], [1.0, 1.0]]))


def test_cross_entropy_hand_values():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1000.0, 0.0]]])
    targets = torch.tensor([[1, 0]])
    # -log(3/4) and -log(1) (max subtraction keeps 1000 finite)
    torch.testing.assert_close(cross_entropy(logits, targets), torch.tensor(-math.log(0.75) / 2))


def test_adamw_first_steps_hand_values():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = AdamW([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    expected = p.detach().clone().double()
    m = torch.zeros(2, dtype=torch.float64)
    v = torch.zeros(2, dtype=torch.float64)
    for t, g in enumerate([torch.tensor([0.5, 1.0]), torch.tensor([-0.25, 2.0])], start=1):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        expected -= 0.1 * 0.01 * expected
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        alpha = 0.1 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        expected -= alpha * m / (v.sqrt() + 1e-8)
        torch.testing.assert_close(p.detach().double(), expected, atol=1e-6, rtol=1e-6)
        if t == 1:  # by hand: decay 1 -> 0.999, -2 -> -1.998; bias-corrected m/sqrt(v) = sign(g) = +1
            torch.testing.assert_close(p.detach(), torch.tensor([0.899, -2.098]), atol=1e-6, rtol=0)
    assert opt.state[p]["t"] == 3


def test_adamw_matches_torch_adamw_trajectory():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(a.detach().clone())
    ours, theirs = AdamW([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.01)
    for _ in range(5):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=100, num_heads=3), "num_heads (3) must divide d_model (100)"),
    (dict(num_layers=0), "num_layers (0) must be a positive integer"),
    (dict(d_model=12, num_heads=4), "must be even for RoPE"),
])
def test_bad_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**kwargs)


def test_from_name_validates():
    assert ModelConfig.from_name("xl", context_length=2048).d_model == 2560
    with pytest.raises(ValueError, match="not one of"):
        ModelConfig.from_name("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_name("small", batch=3)
    with pytest.raises(ValueError, match="attention backend 'nope'"):
        TransformerLM(ModelConfig.from_name("tiny", attention="nope"))
    assert get_attention("naive") is naive_attention


def test_num_params_matches_model():
    cfg = ModelConfig.from_name("tiny")
    assert cfg.num_params() == sum(p.numel() for p in TransformerLM(cfg).parameters())


def test_sequence_longer_than_context_raises(tiny):
    cfg, model = tiny
    with pytest.raises(ValueError, match="exceeds context_length"):
        model(torch.zeros(1, cfg.context_length + 1, dtype=torch.long))


def test_cudnn_backend_refuses_cpu_tensors_and_its_pin_compiles():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="cudnn.*CUDA"):
        get_attention("cudnn")(q, q, q, True)
    # the backend pins sdpa through `sdpa_kernel`, a context manager Dynamo traces (here pinned to MATH on the CPU)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def pinned(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(pinned, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, q * 2, q + 1), naive_attention(q, q * 2, q + 1), atol=1e-5, rtol=1e-5)


def _aten_ops(fn) -> set[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 3, 257, 64), (2, 4, 1000, 128)])
def test_cudnn_backend_matches_reference_on_gpu(shape):
    """Forward and every gradient against fp64 math attention (bf16 inputs: within 2e-2 relative norm), cuDNN's own
    aten op running, and the same result inside torch.compile (fullgraph: the pin survives Dynamo)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    fn = get_attention("cudnn")
    ops = _aten_ops(lambda: fn(q, k, v, True).backward(grad_out))
    assert "aten._scaled_dot_product_cudnn_attention" in ops, sorted(o for o in ops if "attention" in o)
    q.grad = k.grad = v.grad = None
    out = fn(q, k, v, True)
    out.backward(grad_out)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_inputs, is_causal=True)
    ref.backward(grad_out.double())
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())
    assert rel(out, ref) < 2e-2
    for got, want in zip((q.grad, k.grad, v.grad), ref_inputs):
        assert rel(got, want.grad) < 2e-2
    compiled = torch.compile(lambda a, b, c: fn(a, b, c, True), fullgraph=True)
    assert rel(compiled(q, k, v), out.double()) < 1e-3
