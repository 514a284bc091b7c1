"""The recompute cost / memory model against measurements on the CPU.

Saved bytes: `raysys.measure.memory.SavedTensorAccount` (saved_tensors_hooks, storages counted once, parameters
excluded) must equal the formula exactly, without checkpointing and under ffn checkpointing. FLOPs: `FlopCounterMode` must equal `step_flops` exactly. Step peak:
the CPU allocator trace of a whole training step must be within a few percent of `predict_peak`.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel.checkpointing import apply_activation_checkpointing, parse_policy
from raysys.measure.memory import SavedTensorAccount
from raysys.model.config import ModelConfig
from raysys.model.transformer import AdamW, TransformerLM, cross_entropy
from raysys.planning.recompute_model import (Workload, block_saved, cpu_allocation_trace, head_saved, predict_peak,
                                             saved_per_block, static_bytes, step_flops)

# Allocations measured on the CPU, the same on every host (see the fixture).
pytestmark = pytest.mark.usefixtures("host_independent_gemm")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(attention="naive", B=2, S=24, d=32, H=2, f=48, V=50, N=2):
    return ModelConfig(vocab_size=V, context_length=S, d_model=d, num_layers=N, num_heads=H, d_ff=f,
                       attention=attention)


def autocast(precision):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [dict(B=2, S=24, d=32, H=2, f=48), dict(B=1, S=40, d=48, H=3, f=80)])
def test_saved_bytes_match_saved_tensor_hooks(attention, precision, shape):
    cfg = config(attention, **shape, N=2)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    B, S = shape["B"], shape["S"]
    x, y = torch.randint(0, cfg.vocab_size, (B, S)), torch.randint(0, cfg.vocab_size, (B, S))
    account = SavedTensorAccount(model)
    with autocast(precision), account.track():
        loss = cross_entropy(model(x), y)
    w = Workload(config=cfg, batch_size=B, precision=precision, device_type="cpu")
    ids = 2 * B * S * 8  # the embedding keeps the token ids, the loss's gather keeps the targets (inputs)
    assert account.total_bytes == cfg.num_layers * sum(block_saved(w).values()) + head_saved(w) + ids
    # per block (the shared RoPE module's saves are all attributed to layers.0)
    assert account.per_prefix("layers.1") == saved_per_block(w, "none") - block_saved(w)["rope"]
    del loss


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ffn_saved_bytes_match_saved_tensor_hooks(attention, precision):
    """Under ffn checkpointing a block keeps all but ln2's and SwiGLU's tensors, plus the branch input h."""
    cfg = config(attention, B=1, S=40, d=48, H=3, f=80, N=2)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    apply_activation_checkpointing(model, parse_policy("ffn", cfg.num_layers))
    x, y = torch.randint(0, cfg.vocab_size, (1, 40)), torch.randint(0, cfg.vocab_size, (1, 40))
    account = SavedTensorAccount(model)
    with autocast(precision), account.track():
        loss = cross_entropy(model(x), y)
    w = Workload(config=cfg, batch_size=1, precision=precision, device_type="cpu")
    assert account.per_prefix("layers.1") == saved_per_block(w, "ffn") - block_saved(w)["rope"]
    assert saved_per_block(w, "full") < saved_per_block(w, "ffn") < saved_per_block(w, "none")
    del loss


@pytest.mark.parametrize("spec", ["none", "full", "full:2", "nested", "selective", "ffn", "full*1+ffn*1+none*1"])
def test_step_flops_match_flop_counter(spec):
    # naive attention: FlopCounterMode has no formula for the CPU flash kernel behind sdpa
    cfg = config("naive", N=3)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    handle = apply_activation_checkpointing(model, parse_policy(spec, cfg.num_layers))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.context_length))
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(x), x).backward()
    predicted = step_flops(Workload(config=cfg, batch_size=2, device_type="cpu"), handle.regions)
    assert counter.get_total_flops() == predicted["total"]


def measured_step_peak(cfg, B, precision, spec):
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    handle = apply_activation_checkpointing(model, parse_policy(spec, cfg.num_layers))
    optimizer = AdamW(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (B, cfg.context_length))
    y = torch.randint(0, cfg.vocab_size, (B, cfg.context_length))

    def step():
        with autocast(precision):
            loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    step()  # AdamW state exists from now on, as in a measured step on the GPU
    optimizer.zero_grad(set_to_none=True)
    w = Workload(config=cfg, batch_size=B, precision=precision, device_type="cpu")
    measured = sum(static_bytes(w).values()) + max(cpu_allocation_trace(step))
    return measured, predict_peak(w, handle.regions)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["none", "full", "full:2", "nested", "selective", "full*1+selective*1+none*1",
                                  "ffn", "full*1+ffn*1+none*1"])
def test_step_peak_within_five_percent(spec, precision):
    # attention-heavy shape (S = 96 > d), so the peak lands inside a block's backward, not in the loss
    cfg = config("naive", S=96, d=32, H=2, f=64, V=40, N=3)
    measured, estimate = measured_step_peak(cfg, 2, precision, spec)
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.05), estimate.where
    activations = measured - sum(estimate.static.values())
    assert estimate.activation_peak_bytes == pytest.approx(activations, rel=0.06), estimate.where


def test_model_orders_policies_by_memory():
    w = Workload(config=ModelConfig.from_name("xl", context_length=2048), batch_size=4)
    per_block = {k: saved_per_block(w, k) for k in ("none", "selective", "full", "offload")}
    assert per_block["none"] > 3 * per_block["selective"] > per_block["full"] > per_block["offload"] == 0
    peaks = {spec: predict_peak(w, parse_policy(spec, 32).regions(32)).peak_bytes
             for spec in ("none", "selective", "full:8", "full:2", "full", "nested")}
    assert peaks["none"] > peaks["selective"] > peaks["full:8"] > peaks["full:2"] > peaks["full"] >= peaks["nested"]
    with pytest.raises(ValueError, match="precision"):
        Workload(config=w.config, batch_size=4, precision="int8")
    with pytest.raises(ValueError, match="seq_len"):
        Workload(config=w.config, batch_size=4, seq_len=4096)
