"""The advisor's leaderboard terms: pure bf16 state, the fused loss, compiled pieces, the optimizer's transient and
FSDP shards, against hand-computed byte counts and against what the CPU measures on a tiny model; each attention
path's backward against what its kernels allocate."""

import dataclasses
import json
import os

import pytest
import torch

from kernels.adamw import ForeachAdamW
from parallel.checkpointing import apply_activation_checkpointing, parse_policy
from raysys import cli
from raysys.measure.memory import SavedTensorAccount, saved_bytes_per_block
from raysys.model.config import ModelConfig
from raysys.model.transformer import AdamW, TransformerLM
from raysys.planning.advisor import advise
from raysys.planning.recompute_model import (GiB, Workload, attention_backward_bytes, block_saved, cpu_allocation_trace,
                                             fused_loss_transient, head_saved, optimizer_transient, predict_peak,
                                             saved_per_block, sharding_transient, static_bytes)
from raysys.training.leaderboard import compile_pieces, lean_blocks

# Allocations measured on the CPU, the same on every host (see the fixture).
pytestmark = pytest.mark.usefixtures("host_independent_gemm")

LB = ModelConfig.from_name("leaderboard", attention="flash_triton")
B, S, d, f, V, H, N = 1, 32768, 4096, 11008, 151936, 32, 34
P = N * (4 * d * d + 3 * d * f + 2 * d) + d + 2 * V * d
BS, BSd, BSf, BSV = B * S, B * S * d, B * S * f, B * S * V


def advise_main(argv):
    """`raysys advise ARGV`'s exit status."""
    return cli.main(["advise", *argv])


def pure(**kw):
    return Workload(config=LB, batch_size=1, precision="bf16", param_dtype="bf16", **kw)


def test_hand_counts_of_the_leaderboard_workload():
    assert P == LB.num_params() == 8_125_698_048
    s = static_bytes(pure())
    assert (s["weights"], s["optimizer"]) == (2 * P, 4 * P)  # bf16 weights; bf16 m and v
    fsdp = static_bytes(Workload(config=LB, batch_size=1, precision="bf16", shards=2))
    assert (fsdp["weights"], fsdp["optimizer"]) == (4 * P // 2, 8 * P // 2)  # fp32 shards over two ranks
    # compiled block, bf16: norms keep input + rsqrt and their output, flash keeps q k v O + merged + lse,
    # SwiGLU keeps w1 x, w3 x and the product, RoPE its int64 positions
    blk = block_saved(pure(compiled=True))
    assert blk == {"norms": 2 * (2 * 2 * BSd + 4 * BS), "weight_casts": 0, "rope": 8 * S,
                   "attention": 5 * 2 * BSd + 4 * H * BS, "ffn": 3 * 2 * BSf}
    assert sum(blk.values()) / GiB == pytest.approx(4.27, abs=0.01)
    # lean blocks: norms keep their inputs only, attention q k v O + lse (heads merged as a view), SwiGLU w1 x and
    # w3 x, RoPE its positions (its cos / sin buffers once, in head_saved)
    lean = block_saved(pure(compiled=True, lean=True))
    assert lean == {"norms": 2 * 2 * BSd, "weight_casts": 0, "rope": 8 * S,
                    "attention": 4 * 2 * BSd + 4 * H * BS, "ffn": 2 * 2 * BSf}
    assert sum(lean.values()) / GiB == pytest.approx(2.85, abs=0.01)
    w = pure(compiled=True, lean=True)
    assert saved_per_block(w, "none") - saved_per_block(w, "ffn") == 2 * 2 * BSf  # ffn keeps h, drops w1 x, w3 x
    eager = block_saved(pure())
    assert eager["norms"] == 2 * (8 * BSd + 4 * BS + 2 * BSd) and eager["ffn"] == 5 * 2 * BSf
    # heads: fused keeps the final norm's input + rsqrt, RoPE's buffers, and two gradients; materialised the logits
    rope_buffers = 2 * S * (d // H // 2) * 4
    assert head_saved(pure(compiled=True, loss="fused")) == 2 * BSd + 4 * BS + rope_buffers + 2 * (BSd + V * d)
    assert head_saved(pure()) == 8 * BSd + 4 * BS + 2 * BSd + 3 * 2 * BSV + 2 * 2 * BS
    # the Triton kernel's one logits buffer: 2560 rows (768 MiB / (V x 2 bytes), a multiple of 256)
    assert fused_loss_transient(pure(loss="fused")) == 2560 * V * 2 + 4 * BS
    assert optimizer_transient(pure()) == 2 * V * d  # sqrt(v) of the embedding
    assert optimizer_transient(pure(optimizer="fused")) == 0
    assert optimizer_transient(pure(optimizer="foreach")) == 2 * V * d  # the embedding alone is its own chunk
    block = 4 * d * d + 3 * d * f
    assert sharding_transient(Workload(config=LB, batch_size=1, precision="bf16", shards=2)) == \
        2 * 2 * block + 2 * V * d + (2 + 4) * V * d
    assert sharding_transient(pure()) == 0


def test_kernel_chunk_budget_is_the_kernels():
    from kernels import fused_linear_ce
    from raysys.model import transformer as model
    from raysys.planning.recompute_model import KERNEL_LOSS_CHUNK_BYTES, TORCH_LOSS_CHUNK_BYTES

    assert KERNEL_LOSS_CHUNK_BYTES == fused_linear_ce.MAX_CHUNK_BYTES
    assert fused_linear_ce.chunk_rows(S, V, torch.bfloat16) == 2560
    assert TORCH_LOSS_CHUNK_BYTES == model.CHUNK_LOGIT_BYTES


def test_workload_validation():
    with pytest.raises(ValueError, match="param_dtype"):
        Workload(config=LB, batch_size=1, precision="fp32", param_dtype="bf16")
    with pytest.raises(ValueError, match="shards"):
        Workload(config=LB, batch_size=1, precision="bf16", param_dtype="bf16", shards=2)
    with pytest.raises(ValueError, match="compiled"):
        Workload(config=LB, batch_size=1, precision="bf16", compiled=True)  # autocast
    with pytest.raises(ValueError, match="lean needs compiled"):
        Workload(config=LB, batch_size=1, precision="bf16", param_dtype="bf16", lean=True)
    for bad in (dict(loss="logits"), dict(optimizer="sgd"), dict(shards=0)):
        with pytest.raises(ValueError):
            Workload(config=LB, batch_size=1, **bad)


# ---------------------------------------------------------------------------------------------------- CPU
def tiny(attention="sdpa", N=3, S=96, d=32, H=2, f=64, V=40):
    return ModelConfig(vocab_size=V, context_length=S, d_model=d, num_layers=N, num_heads=H, d_ff=f,
                       attention=attention)


def build(cfg, dtype, compiled, backend="aot_eager_decomp_partition", lean=False):
    torch.manual_seed(0)
    model = TransformerLM(cfg, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    if compiled:  # Inductor's min-cut partitioner decides what is saved; aot_eager_decomp_partition runs it too
        compile_pieces(model, backend)
    if lean:
        lean_blocks(model, backend)
    return model


CASES = [("bf16", "fused", False, False), ("bf16", "materialized", False, False), ("bf16", "fused", True, False),
         ("fp32", "fused", True, False), ("bf16", "materialized", True, False), ("bf16", "fused", True, True),
         ("fp32", "fused", True, True)]


@pytest.mark.parametrize("dtype,loss,compiled,lean", CASES)
def test_saved_bytes_match_saved_tensor_hooks(dtype, loss, compiled, lean):
    cfg = tiny(S=40)
    model = build(cfg, dtype, compiled, lean=lean)
    x, y = torch.randint(0, cfg.vocab_size, (2, 40)), torch.randint(0, cfg.vocab_size, (2, 40))
    account = SavedTensorAccount(model)
    with account.track():
        out = model.loss(x, y, fused=loss == "fused", impl="torch")
    w = Workload(config=cfg, batch_size=2, precision=dtype, param_dtype=dtype, loss=loss, compiled=compiled,
                 lean=lean, device_type="cpu")
    ids = (1 if loss == "fused" else 2) * 2 * 40 * 8  # token ids (embedding), targets (the materialised gather)
    assert account.total_bytes == cfg.num_layers * sum(block_saved(w).values()) + head_saved(w) + ids
    del out
    # per block, as raysys.measure.memory reports it (the shared RoPE module's saves are attributed to layers.0; a lean
    # block saves its positions itself, and layers.0 the cos / sin buffers)
    per_block, _ = saved_bytes_per_block(model, lambda: model.loss(x, y, fused=loss == "fused", impl="torch"))
    saved = dict(zip(per_block.module, per_block.saved_bytes))
    rope = 0 if lean else block_saved(w)["rope"]
    assert saved["layers.1"] == saved["layers.2"] == sum(block_saved(w).values()) - rope


@pytest.mark.parametrize("dtype,compiled,lean", [("bf16", False, False),
                                                 pytest.param("bf16", True, False, marks=pytest.mark.slow),
                                                 pytest.param("fp32", True, False, marks=pytest.mark.slow),
                                                 ("bf16", True, True)])
def test_ffn_saved_bytes_match_saved_tensor_hooks(dtype, compiled, lean):
    """ffn checkpointing over pure-precision blocks, eager and compiled (Inductor's partitioner decides what the
    compiled norm and SwiGLU would keep; the checkpoint keeps only the branch input), and under lean blocks (the
    lean attention inputs, the checkpointed branch)."""
    cfg = tiny(S=40)
    model = build(cfg, dtype, compiled)
    apply_activation_checkpointing(model, parse_policy("ffn", cfg.num_layers))
    if lean:  # after the policy, as LeaderboardStep applies them: ffn blocks keep their checkpointed branch
        lean_blocks(model, "aot_eager_decomp_partition")
    x, y = torch.randint(0, cfg.vocab_size, (2, 40)), torch.randint(0, cfg.vocab_size, (2, 40))
    per_block, _ = saved_bytes_per_block(model, lambda: model.loss(x, y, impl="torch"))
    saved = dict(zip(per_block.module, per_block.saved_bytes))
    w = Workload(config=cfg, batch_size=2, precision=dtype, param_dtype=dtype, loss="fused", compiled=compiled,
                 lean=lean, device_type="cpu")
    rope = 0 if lean else block_saved(w)["rope"]  # a lean block saves its positions itself
    assert saved["layers.1"] == saved["layers.2"] == saved_per_block(w, "ffn") - rope


PEAK_CASES = [("bf16", "fused", False, spec) for spec in ("none", "full", "full*1+none*2", "ffn*2+none*1")] + [
    ("bf16", "materialized", False, "none"), ("fp32", "fused", False, "full*1+none*2"),
    # compiled: Inductor's fused kernels (its backward's temporaries are its own; aot_eager's are not the same)
    pytest.param("bf16", "fused", True, "full*1+none*2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype,loss,compiled,spec", PEAK_CASES)
def test_step_peak_within_five_percent(dtype, loss, compiled, spec):
    cfg = tiny()
    model = build(cfg, dtype, compiled, backend="inductor")
    handle = apply_activation_checkpointing(model, parse_policy(spec, cfg.num_layers))
    opt = ForeachAdamW(model.parameters()) if loss == "fused" else AdamW(model.parameters())
    x, y = torch.randint(0, cfg.vocab_size, (2, 96)), torch.randint(0, cfg.vocab_size, (2, 96))

    def step():
        model.loss(x, y, fused=loss == "fused", impl="torch").backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    w = Workload(config=cfg, batch_size=2, precision=dtype, param_dtype=dtype, loss=loss, compiled=compiled,
                 optimizer="foreach" if loss == "fused" else "reference", device_type="cpu")
    measured = sum(static_bytes(w).values()) + max(cpu_allocation_trace(step))
    estimate = predict_peak(w, handle.regions)
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.05), estimate.where


@pytest.mark.slow
def test_lean_step_peak_within_five_percent(spec="ffn*1+none*2"):
    """Lean blocks under Inductor on a block-heavy shape (the peak is a block's backward, as at the leaderboard's):
    their saved tensors and their backward's recomputed product and norm output against the measured CPU step."""
    cfg = tiny(S=256, d=64, H=2, f=256, V=40)
    model = build(cfg, "bf16", True, backend="inductor")
    handle = apply_activation_checkpointing(model, parse_policy(spec, cfg.num_layers))
    lean_blocks(model, "inductor")
    opt = ForeachAdamW(model.parameters())
    x, y = torch.randint(0, cfg.vocab_size, (2, 256)), torch.randint(0, cfg.vocab_size, (2, 256))

    def step():
        model.loss(x, y, impl="torch").backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    w = Workload(config=cfg, batch_size=2, precision="bf16", param_dtype="bf16", loss="fused", compiled=True,
                 lean=True, optimizer="foreach", device_type="cpu")
    measured = sum(static_bytes(w).values()) + max(cpu_allocation_trace(step))
    estimate = predict_peak(w, handle.regions)
    assert estimate.where.startswith("block 2 backward")
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.05)


def test_optimizer_in_backward_peak_within_five_percent():
    """Gradients freed as backward writes them, on a parameter-heavy shape whose step peaks at the optimizer step
    otherwise: the measured CPU step peaks against the model's, with and without."""
    from raysys.training.leaderboard import LeaderboardStep, StepConfig

    cfg = tiny(S=8, d=64, H=2, f=1024, V=400)
    x, y = torch.randint(0, cfg.vocab_size, (1, 8)), torch.randint(0, cfg.vocab_size, (1, 8))
    peaks = {}
    for in_backward in (True, False):
        model = build(cfg, "bf16", False)
        step = LeaderboardStep(model, StepConfig(attention="sdpa", loss_impl="torch", optimizer="foreach",
                                                 compile=False, recompute="full*1+none*2",
                                                 optimizer_in_backward=in_backward), batch_size=1)
        step(x, y)
        w = Workload(config=cfg, batch_size=1, precision="bf16", param_dtype="bf16", loss="fused",
                     optimizer="foreach", device_type="cpu", optimizer_in_backward=in_backward)
        measured = sum(static_bytes(w).values()) + max(cpu_allocation_trace(lambda: step(x, y)))
        estimate = predict_peak(w, step.checkpointing.regions)
        assert estimate.peak_bytes == pytest.approx(measured, rel=0.05), (in_backward, estimate.where)
        peaks[in_backward] = measured, estimate
        step.close()
    assert "optimizer step" not in dict(peaks[True][1].moments) and peaks[False][1].where == "optimizer step"
    assert peaks[True][0] < 0.9 * peaks[False][0]


# ---------------------------------------------------------------------------------------------------- advisor
def test_the_leaderboard_plans():
    h200 = 143771 * 2**20
    # the starting point: fp32 master weights and materialised logits do not fit one H200
    assert not advise(LB, 1, 141 * 10**9, "bf16").fits
    step = dict(param_dtype="bf16", loss="fused", compiled=True, optimizer="fused")
    plan = advise(LB, 1, h200, "bf16", **step)
    assert plan.fits and plan.predicted_peak_bytes <= plan.usable_bytes and set(plan.layers) <= {"ffn", "full", "none"}
    # ffn checkpointing frees 2 of a block's 4.3 GiB for w1 and w3 (not the whole block): cheaper per byte than full
    w = plan.workload
    assert saved_per_block(w, "none") - saved_per_block(w, "ffn") > 0.45 * saved_per_block(w, "none")
    assert 0 < plan.layers.count("ffn") < N
    full_only = advise(LB, 1, h200, "bf16", kinds=("none", "full"), **step)
    assert full_only.fits and 0 < full_only.layers.count("full") < N and set(full_only.layers) == {"full", "none"}
    assert plan.recompute_flops < full_only.recompute_flops / 2 and plan.overhead < full_only.overhead
    # every kept block costs memory: one more un-checkpointed block no longer fits
    for chosen in (plan, full_only):
        more = list(chosen.layers)
        more[next(i for i, k in enumerate(more) if k != "none")] = "none"
        regions = parse_policy("+".join(f"{k}*1" for k in more), N).regions(N)
        assert predict_peak(w, regions).peak_bytes > chosen.usable_bytes
    # the fused loss frees the logits: without it more is recomputed
    materialized = advise(LB, 1, h200, "bf16", **{**step, "loss": "materialized"})
    assert materialized.recompute_flops > plan.recompute_flops
    # FSDP over two ranks: fp32 shards (16 bytes per parameter / 2) plus gathered units
    fsdp = advise(LB, 1, h200, "bf16", loss="fused", shards=2)
    assert fsdp.fits and fsdp.workload.shards == 2


def test_cli_new_flags(capsys):
    args = ["--size", "leaderboard", "--batch-size", "1", "--attention", "flash_triton", "--gpu-memory", "143771MiB"]
    assert advise_main(args + ["--dtype", "bf16"]) == 1  # fp32 masters, materialised logits: does not fit
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert advise_main(args + ["--param-dtype", "bf16", "--loss", "fused", "--compiled", "--optimizer", "fused",
                               "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and (out["param_dtype"], out["loss"], out["compiled"], out["optimizer"]) == \
        ("bf16", "fused", True, "fused")
    assert advise_main(args + ["--dtype", "bf16", "--loss", "fused", "--shards", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 2
    assert advise_main(args + ["--param-dtype", "bf16", "--shards", "2"]) == 2  # FSDP keeps fp32 shards
    assert "shards" in capsys.readouterr().err
    assert advise_main(args + ["--shards", "0"]) == 2
    assert advise_main(args + ["--param-dtype", "bf16", "--dtype", "fp32"]) == 2


def test_offload_time_model_counts_the_link_across_blocks():
    """Copies to the host queue behind the whole forward from the first offloaded block on; only what the forward
    cannot cover, and each copy back that outlasts the next block's backward, costs time (the last offloaded block
    never leaves the device)."""
    from raysys.planning.advisor import _Cost, _offload_seconds
    from raysys.planning.recompute_model import block_flops

    w = pure(compiled=True, lean=True, loss="fused", optimizer="fused")
    bf = block_flops(w)
    fwd_s = (bf["linear"] + bf["core"]) / 400e12
    per_block = saved_per_block(w, "none")
    cost = _Cost(tflops=400.0, pcie_gbps=per_block / (1.5 * fwd_s) / 1e9)  # one block's copy: 1.5 forwards
    few = ("offload",) * 6 + ("none",) * 28
    many = ("offload",) * 30 + ("none",) * 4
    assert _offload_seconds(w, few, cost) == pytest.approx(0.0)  # 9 forwards of copies under 34 forwards
    assert _offload_seconds(w, many, cost) == pytest.approx((30 * 1.5 - 34) * fwd_s)
    late = ("none",) * 28 + ("offload",) * 6  # the copies start later: only 6 forwards to hide 9
    assert _offload_seconds(w, late, cost) == pytest.approx(3 * fwd_s)


# ---------------------------------------------------------------------------------------------------- attention
def _attention_workload(batch, heads, seq, head_dim, dtype, kernels, attention="flash_triton"):
    cfg = ModelConfig(vocab_size=16, context_length=seq, d_model=heads * head_dim, num_layers=1, num_heads=heads,
                      d_ff=16, attention=attention)
    return Workload(config=cfg, batch_size=batch, precision=dtype, param_dtype=dtype, device_type="cpu",
                    attention_kernels=kernels)


def _model_layout(batch, heads, seq, head_dim, dtype, seed=0):
    """q, k, v, dO as the model's (B, S, H, D) projections viewed as (B, H, S, D)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, heads, head_dim, generator=g).to(dtype).transpose(1, 2) for _ in range(4)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tl kernels on the CPU need the interpreter")
@pytest.mark.parametrize("bwd", ["two_pass", "one_pass"])
def test_attention_backward_bytes_are_what_the_tl_kernels_allocate(bwd):
    """`attention_backward_bytes` of the tl kernels' backward, two-pass and one-pass, exactly: what the backward call
    allocates (D, the one-pass fp32 dQ accumulator, dQ, dK, dV) measured by the CPU allocator, plus dO, its input."""
    import kernels.attention as fa

    batch, heads, seq, head_dim = 2, 3, 77, 32
    q, k, v, do = _model_layout(batch, heads, seq, head_dim, torch.float32)
    out, lse = fa.flash_attention_fwd(q, k, v, True, path="portable")
    measured = max(cpu_allocation_trace(lambda: fa.flash_attention_bwd(q, k, v, out, lse, do, True, path="portable",
                                                                         bwd=bwd)))
    w = _attention_workload(batch, heads, seq, head_dim, "fp32", fa.last_paths())
    assert fa.last_paths() == f"portable, {bwd}"
    assert attention_backward_bytes(w) == measured + do.numel() * 4


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_attention_backward_bytes_are_what_the_gluon_backward_allocates(dtype, head_dim, monkeypatch):
    """The Gluon one-pass backward's `attention_backward_bytes` exactly: what its launcher allocates (dK, dV, L and
    D padded to whole query tiles, the fp32 dQ accumulator, dQ) with its kernels not launched (the CPU), plus dO."""
    import kernels.attention.gluon.backward as gluon_bwd
    import kernels.attention.interface as fa
    from kernels.attention.gluon.compat import HAS_GLUON_HOPPER

    if not HAS_GLUON_HOPPER:
        pytest.skip("this Triton has no Gluon Hopper API")
    monkeypatch.setattr(gluon_bwd, "launch", lambda *args, **kwargs: None)
    batch, heads, seq = 2, 3, 200
    q, k, v, do = _model_layout(batch, heads, seq, head_dim, dtype)
    out, lse = torch.empty_like(q), torch.zeros(batch, heads, seq)
    measured = max(cpu_allocation_trace(lambda: fa._gluon_bwd(q, k, v, out, lse, do, True, checked=True)))
    w = _attention_workload(batch, heads, seq, head_dim, "bf16" if dtype == torch.bfloat16 else "fp16",
                            "gluon, one_pass")
    assert attention_backward_bytes(w) == measured + do.numel() * do.element_size()
    assert attention_backward_bytes(w) > attention_backward_bytes(dataclasses.replace(w, attention_kernels="tma, two_pass"))
