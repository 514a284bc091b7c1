"""Activation checkpointing policies: exact gradients, recomputed FLOPs, offload really moves tensors, reversibility.

References are the same model without any policy (a deep copy), run on the CPU in fp32.
"""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel.checkpointing import (FfnCheckpoint, FullCheckpoint, NestedCheckpoint, NoCheckpoint, Offload, PerLayer,
                                    SelectiveCheckpoint, apply_activation_checkpointing, parse_policy,
                                    remove_activation_checkpointing)
from raysys.model.config import ModelConfig
from raysys.measure.memory import SavedTensorAccount
from raysys.model.transformer import TransformerLM, cross_entropy

B, S = 2, 16
POLICIES = {
    "none": NoCheckpoint(),
    "full": FullCheckpoint(),
    "full:2": FullCheckpoint(2),
    "full:3": FullCheckpoint(3),  # a 3 + 1 split: the last segment is shorter
    "sqrt": FullCheckpoint.sqrt(4),
    "nested": NestedCheckpoint(),
    "selective": SelectiveCheckpoint(),
    "offload": Offload(min_bytes=0),
    "ffn": FfnCheckpoint(),
    "mixed": PerLayer((FullCheckpoint(), SelectiveCheckpoint(), Offload(min_bytes=0), NoCheckpoint())),
    "mixed_ffn": PerLayer((FfnCheckpoint(), FullCheckpoint(), FfnCheckpoint(), NoCheckpoint())),
}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny shapes: intra-op threads only add synchronisation (10x slower on a busy 2-core runner)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(num_layers=4, attention="naive", d_model=32, num_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=37, context_length=S, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
                      d_ff=48, attention=attention)
    return TransformerLM(cfg)


def batch(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    v = model.config.vocab_size
    return torch.randint(0, v, (B, S), generator=g), torch.randint(0, v, (B, S), generator=g)


def loss_and_grads(model, x, y, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def counted_flops(model, x, y):
    """(forward, total) matmul FLOPs of one forward + backward."""
    with FlopCounterMode(display=False) as counter:
        loss = cross_entropy(model(x), y)
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops()


@pytest.mark.parametrize("name", list(POLICIES))
def test_gradients_equal_uncheckpointed_exactly(name):
    base = make_model()
    x, y = batch(base)
    ref_loss, ref_grads = loss_and_grads(base, x, y)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, POLICIES[name])
    for _ in range(2):  # a second step reuses the installed forwards (and the offload store)
        loss, grads = loss_and_grads(model, x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for key, g in ref_grads.items():
            torch.testing.assert_close(grads[key], g, rtol=0, atol=0, msg=f"{name}: grad of {key}")


@pytest.mark.parametrize("name", ["full:2", "selective", "nested", "ffn"])
def test_gradients_equal_under_autocast(name):
    base = make_model()
    x, y = batch(base)
    ref_loss, ref_grads = loss_and_grads(base, x, y, autocast=True)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, POLICIES[name])
    loss, grads = loss_and_grads(model, x, y, autocast=True)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for key, g in ref_grads.items():
        torch.testing.assert_close(grads[key], g, rtol=0, atol=0, msg=f"{name}: grad of {key}")


def test_recomputed_flops_full_selective_nested():
    """Full: one extra forward of every wrapped block, except each segment's last matmul (w2): the
    non-reentrant checkpoint stops recomputing once the last saved tensor is back. Selective: QK^T and PV only.
    Ffn: w1 and w3 of every block (ln2 and the gating are not matmuls; w2 is skipped by the same early stop).
    Nested over 4 blocks (halves of 2, leaves of 1): each leaf reruns once, each half reruns its left leaf."""
    base = make_model(num_layers=4)
    x, y = batch(base)
    fwd0, total0 = counted_flops(base, x, y)
    c = base.config
    tokens = B * S
    head = 2 * tokens * c.d_model * c.vocab_size
    block = (fwd0 - head) // c.num_layers
    core = 4 * B * S * S * c.d_model
    w2 = 2 * tokens * c.d_ff * c.d_model
    assert block == 2 * tokens * (4 * c.d_model ** 2 + 3 * c.d_model * c.d_ff) + core
    expected = {
        "full": 4 * block - 4 * w2,
        "full:2": 4 * block - 2 * w2,
        "selective": 4 * core,
        "nested": 4 * (block - w2) + 2 * block,
        "ffn": 4 * 2 * w2,
        "mixed_ffn": 2 * 2 * w2 + block - w2,
    }
    for name, extra in expected.items():
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, POLICIES[name])
        fwd, total = counted_flops(model, x, y)
        assert fwd == fwd0, name  # checkpointing never changes the forward pass
        assert total - total0 == extra, name


@pytest.mark.parametrize("attention", ["sdpa", "flash_pytorch"])
def test_selective_is_noop_with_fused_attention(attention):
    base = make_model(attention=attention)
    x, y = batch(base)
    _, total0 = counted_flops(base, x, y)
    model = copy.deepcopy(base)
    handle = apply_activation_checkpointing(model, SelectiveCheckpoint())
    assert len(handle.notes) == model.config.num_layers and "no-op" in handle.notes[0]
    assert all("forward" not in block.attn.__dict__ for block in model.layers)
    assert counted_flops(model, x, y)[1] == total0


def test_full_checkpoint_keeps_only_segment_inputs():
    model = make_model(num_layers=4)
    x, y = batch(model)
    plain = SavedTensorAccount(model)
    with plain.track():
        cross_entropy(model(x), y)
    apply_activation_checkpointing(model, FullCheckpoint(2))
    account = SavedTensorAccount(model)
    with account.track():
        out = cross_entropy(model(x), y)
    stream = B * S * model.config.d_model * 4
    blocks = sum(account.per_prefix(f"layers.{i}") for i in range(4))
    assert blocks == 2 * stream  # one (B, S, d) fp32 input per segment
    assert plain.per_prefix("layers.1") > 10 * stream
    del out
    # nested over 8 blocks: only the two top-level halves' inputs survive the forward (O(log N) in backward)
    deep = make_model(num_layers=8)
    apply_activation_checkpointing(deep, NestedCheckpoint())
    account = SavedTensorAccount(deep)
    with account.track():
        cross_entropy(deep(x), y)
    assert sum(account.per_prefix(f"layers.{i}") for i in range(8)) == 2 * stream


def test_offload_moves_saved_tensors_to_the_cpu_store():
    base = make_model(num_layers=3)
    x, y = batch(base)
    plain = SavedTensorAccount(base)
    with plain.track():
        cross_entropy(base(x), y)
    model = copy.deepcopy(base)
    handle = apply_activation_checkpointing(model, PerLayer((NoCheckpoint(), Offload(min_bytes=0), NoCheckpoint())))
    store = handle.stores[0]
    account = SavedTensorAccount(model)
    with account.track():
        loss = cross_entropy(model(x), y)
    # autograd's own saved tensors of block 1 are gone: the offload hooks replaced them by handles.
    # (The RoPE module is shared, so every block's cos / sin rows are attributed to layers.0.)
    rope = 4 * S * (model.config.d_head // 2) * 4
    assert account.per_prefix("layers.1") == 0
    assert account.per_prefix("layers.0") == plain.per_prefix("layers.0") - rope > 0
    host = store.host_copies(1)
    assert store.stats.packed_tensors > 0 and store.stats.unpacked_tensors == 0
    # every storage block 1 saved lands in the store exactly once
    assert sum(t.numel() for t in host) == store.stats.offloaded_bytes == plain.per_prefix("layers.1") + rope
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.device.type == "cpu" and t.untyped_storage().data_ptr() not in live for t in host)
    loss.backward()
    assert store.stats.unpacked_tensors == store.stats.packed_tensors
    assert store.host_copies(1) == []  # the graph owned the copies; backward released them


def test_remove_restores_the_model_and_apply_twice_is_refused():
    base = make_model()
    x, y = batch(base)
    model = copy.deepcopy(base)
    keys = list(model.state_dict())
    handle = apply_activation_checkpointing(model, PerLayer((FullCheckpoint(2),) * 2 + (SelectiveCheckpoint(),) * 2))
    assert list(model.state_dict()) == keys
    assert len(handle.describe()) == 4 and "segment 0-1" in handle.describe()[0]
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_checkpointing(model, NoCheckpoint())
    remove_activation_checkpointing(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    _, total0 = counted_flops(base, x, y)
    assert counted_flops(model, x, y)[1] == total0
    apply_activation_checkpointing(model, FullCheckpoint())  # applicable again after removal


def test_segment_tail_block_used_on_its_own_runs_normally():
    base = make_model(num_layers=2)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, FullCheckpoint(2))
    h = torch.randn(B, S, base.config.d_model)
    torch.testing.assert_close(model.layers[1](h), base.layers[1](h), rtol=0, atol=0)


def test_no_grad_forward_matches():
    base = make_model()
    x, _ = batch(base)
    for name in ("full:2", "nested", "selective", "offload"):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, POLICIES[name])
        with torch.no_grad():
            torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)


def test_parse_policy_round_trip_and_errors():
    for spec in ("none", "selective", "ffn", "offload", "full", "full:4", "nested", "nested:2", "full*2+none*2",
                 "full:2*2+selective*1+offload*1", "ffn*3+none*1"):
        policy = parse_policy(spec, 4)
        assert parse_policy(policy.spec, 4) == policy
    assert [r.kind for r in parse_policy("ffn*2+full*1+none*1", 4).regions(4)] == ["ffn", "ffn", "full", "none"]
    assert parse_policy("sqrt", 16) == FullCheckpoint(4)
    assert parse_policy("full*2+none*2", 4).regions(4)[0].kind == "full"
    for bad in ("everything", "full:x", "full*0", "full*3"):
        with pytest.raises(ValueError):
            parse_policy(bad, 4).regions(4)
    with pytest.raises(ValueError, match="every_k"):
        FullCheckpoint(0)
    with pytest.raises(ValueError, match="3 entries"):
        PerLayer((NoCheckpoint(),) * 3).regions(4)
    with pytest.raises(ValueError, match="layers"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), NoCheckpoint())
    plain = torch.nn.Module()
    plain.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="ffn_branch"):
        apply_activation_checkpointing(plain, FfnCheckpoint())


def test_ffn_checkpoint_keeps_the_branch_input_only():
    """Per block: everything a plain block saves minus ln2's and SwiGLU's tensors, plus the branch input h; and
    removing the policy gives the plain block back."""
    model = make_model(num_layers=2)
    x, y = batch(model)
    plain = SavedTensorAccount(model)
    with plain.track():
        cross_entropy(model(x), y)
    handle = apply_activation_checkpointing(model, FfnCheckpoint())
    account = SavedTensorAccount(model)
    with account.track():
        out = cross_entropy(model(x), y)
    c = model.config
    stream, hidden = B * S * c.d_model * 4, B * S * c.d_ff * 4
    ln2 = 2 * stream + B * S * 4 + stream  # fp32: h (its own upcast), x * rsqrt, rsqrt, the output
    assert account.per_prefix("layers.1") == plain.per_prefix("layers.1") - ln2 - 5 * hidden + stream
    del out
    handle.remove()
    assert "ffn_branch" not in model.layers[0].__dict__


def test_per_layer_runs_form_segments():
    policy = PerLayer((FullCheckpoint(2),) * 3 + (NoCheckpoint(),) + (NestedCheckpoint(),) * 4)
    kinds = [(r.kind, r.start, r.stop) for r in policy.regions(8)]
    assert kinds == [("full", 0, 2), ("full", 2, 3), ("none", 3, 4), ("nested", 4, 8)]


@pytest.mark.gpu
def test_offload_lowers_device_memory_on_gpu():
    device = torch.device("cuda")
    base = make_model(num_layers=4, d_model=256, num_heads=4).to(device)
    x, y = (t.to(device) for t in batch(base))

    def after_forward(model):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        loss = cross_entropy(model(x), y)
        torch.cuda.synchronize()
        return loss, torch.cuda.memory_allocated() - start

    ref_loss, plain = after_forward(base)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in base.named_parameters()}
    model = copy.deepcopy(base)
    model.zero_grad(set_to_none=True)
    handle = apply_activation_checkpointing(model, Offload(min_bytes=0))
    loss, offloaded = after_forward(model)
    assert all(t.is_pinned() for t in handle.stores[0].host_copies())
    # only the last block's storages (still referenced, used in place by backward) stay on the device
    assert offloaded < 0.5 * plain
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0)
