"""The leaderboard step API against the reference path (CPU; Triton kernels under TRITON_INTERPRET=1).

The composed step (attention backend, fused loss, AdamW implementation, recompute policy, compiled pieces) must
compute what `cross_entropy(model(x), y)` followed by the reference `AdamW.step()` computes: in fp32 the loss of
every step and every parameter after 3 steps within 1e-5.
"""

import copy

import pytest
import torch

import kernels.adamw as adamw_kernels
from kernels.adamw import ForeachAdamW
from kernels.fused_linear_ce import ChunkedLinearCrossEntropy
from raysys.model.config import ModelConfig
from raysys.model.transformer import AdamW, RMSNorm, SwiGLU, TransformerLM, cross_entropy, linear_cross_entropy
from raysys.planning.advisor import CONTEXT_RESERVE_BYTES
from raysys.training.leaderboard import TODAY, LeaderboardStep, StepConfig, compile_pieces, make_optimizer, plan_step
from raysys.training.step import train_step


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

CPU_BACKEND = "aot_eager_decomp_partition"  # Inductor's partitioner (what is saved), no C++ build


def config(N=3, V=61, S=24, d=32, H=2, f=48):
    return ModelConfig(vocab_size=V, context_length=S, d_model=d, num_layers=N, num_heads=H, d_ff=f)


def batches(cfg, n, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (B, cfg.context_length), generator=g),
             torch.randint(0, cfg.vocab_size, (B, cfg.context_length), generator=g)) for _ in range(n)]


# The Triton kernels (flash attention, fused loss, fused AdamW) run under the interpreter: minutes on a busy
# 2-core machine, hence `slow` and the smaller model.
SLOW = (pytest.mark.slow,)
STEPS = [
    pytest.param("sdpa+chunked+foreach+compiled", StepConfig(
        attention="sdpa", loss_impl="torch", optimizer="foreach", recompute="full*1+ffn*1+none*1",
        compile_backend=CPU_BACKEND), id="sdpa+chunked+foreach+compiled"),
    # lean blocks in every role: offloaded (the lean forward inside the store's hooks), ffn (lean forward,
    # checkpointed branch), kept
    pytest.param("sdpa+lean+offload", StepConfig(
        attention="sdpa", loss_impl="torch", optimizer="foreach", recompute="offload*1+ffn*1+none*1",
        compile_backend=CPU_BACKEND), id="sdpa+lean+offload"),
    pytest.param("today", TODAY.replace(attention="sdpa"), id="today"),
    # One interpreted case (a minute on CI's 2 cores): all three kernels, compiled pieces around them, a plan
    # that mixes kept and recomputed blocks.
    pytest.param("flash+kernel+fused+compiled", StepConfig(
        attention="flash_triton", loss_impl="triton", optimizer="fused", recompute="none*1+full*1",
        compile_backend=CPU_BACKEND), marks=SLOW, id="flash+kernel+fused+compiled"),
]


@pytest.mark.interpret
@pytest.mark.parametrize("name,step_config", STEPS)
def test_fast_step_matches_reference_fp32(name, step_config, monkeypatch):
    # The fused AdamW kernel's chunk and block edges are test_adamw's (64 / 16 under the interpreter); an element's
    # update does not depend on its chunk, so here 512 / 128 (tensors of several chunks, masked last blocks still)
    # keep the interpreted programs 20x fewer.
    monkeypatch.setattr(adamw_kernels, "_launch_config", lambda device: dict(CHUNK=512, BLOCK=128, num_warps=1))
    cfg = config(N=3) if name in ("today", "sdpa+chunked+foreach+compiled", "sdpa+lean+offload") else config(N=2, S=16)
    torch.manual_seed(0)
    ref = TransformerLM(cfg)  # naive attention: the reference model
    fast = copy.deepcopy(ref)
    opt = AdamW(ref.parameters())
    step = LeaderboardStep(fast, step_config, batch_size=2)
    for x, y in batches(cfg, 3):
        expected = train_step(ref, opt, x, y, loss="materialized")
        assert step(x, y).item() == pytest.approx(expected.item(), abs=1e-5)
    for (n, p), q in zip(ref.named_parameters(), fast.parameters()):
        assert (p - q).abs().max().item() <= 1e-5, n
    if step_config.lean:
        assert any(type(b.__dict__.get("forward")).__name__ == "_LeanBlockForward" for b in fast.layers)
    step.close()
    assert "forward" not in fast.layers[0].__dict__ and "forward" not in fast.ln_final.__dict__
    assert not any({"forward", "ffn_branch"} & set(b.__dict__) for b in fast.layers)


@pytest.mark.interpret
def test_step_is_not_a_noop_when_broken():
    """The comparison above can fail: a step with the wrong learning rate drifts past 1e-5 at once."""
    cfg = config(N=2)
    torch.manual_seed(0)
    ref = TransformerLM(cfg)
    fast = copy.deepcopy(ref)
    opt, wrong = AdamW(ref.parameters()), ForeachAdamW(fast.parameters(), lr=1.1e-3)
    (x, y), = batches(cfg, 1)
    train_step(ref, opt, x, y, loss="materialized")
    train_step(fast, wrong, x, y, loss="fused", loss_impl="torch")
    assert max((p - q).abs().max().item() for p, q in zip(ref.parameters(), fast.parameters())) > 1e-5


def test_model_loss_equals_reference_loss_and_gradients():
    cfg = config(N=2)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    (x, y), = batches(cfg, 1)
    logits = model(x)
    assert logits.shape == (2, cfg.context_length, cfg.vocab_size)  # model(x) still returns logits
    ref = cross_entropy(logits, y)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = model.loss(x, y, impl="torch")
    fused.backward()
    assert fused.item() == pytest.approx(ref.item(), abs=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-6, rtol=1e-5, msg=n)
    assert model.loss(x, y, fused=False).item() == ref.item()


@pytest.mark.parametrize("tokens,vocab,d,chunk", [(37, 53, 24, 5), (16, 7, 8, 16), (9, 101, 12, 1), (50, 33, 6, 64)])
def test_chunked_loss_odd_shapes(tokens, vocab, d, chunk):
    torch.manual_seed(tokens)
    h = torch.randn(tokens, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    upstream = torch.tensor(1.7, dtype=torch.float64)  # a non-unit upstream gradient
    loss = ChunkedLinearCrossEntropy.apply(h, w, t, chunk)
    (loss * upstream).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = cross_entropy(h2 @ w2.t(), t)
    (ref * upstream).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_linear_cross_entropy_bf16_and_bad_input():
    torch.manual_seed(0)
    h, w = torch.randn(2, 9, 16), torch.randn(40, 16)
    t = torch.randint(0, 40, (2, 9))
    ref = cross_entropy(h @ w.t(), t).item()
    # bf16 inputs: logits rounded to bf16 (8 bits of mantissa) move the loss by ~1e-2 at these magnitudes
    assert linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, impl="torch").item() == pytest.approx(ref, abs=3e-2)
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(h, w, t, impl="cuda")
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:, :4])


def test_foreach_adamw_is_bitwise_the_reference_in_fp32():
    torch.manual_seed(0)
    params = [torch.randn(7, 5), torch.randn(3), torch.randn(11, 2), torch.randn(4, 4)]
    a = [p.clone().requires_grad_() for p in params]
    b = [p.clone().requires_grad_() for p in params]
    ref, fe = AdamW(a, weight_decay=0.1), ForeachAdamW(b, weight_decay=0.1, chunk_bytes=60)
    for step in range(4):
        for i, (p, q) in enumerate(zip(a, b)):
            g = torch.randn_like(p)
            p.grad, q.grad = (g.clone(), g.clone()) if not (step == 1 and i == 2) else (None, None)  # a skipped param
        ref.step()
        fe.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert [s["t"] for s in fe.state.values()] == [s["t"] for s in ref.state.values()]
    with pytest.raises(ValueError, match="chunk_bytes"):
        ForeachAdamW(b, chunk_bytes=0)


def test_compile_pieces_share_one_graph_per_piece_and_remove():
    cfg = config(N=6)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    before = dynamo_graphs()
    pieces = compile_pieces(model, CPU_BACKEND)
    assert sum(isinstance(m, RMSNorm) for m in pieces.modules) == 2 * 6 + 1
    assert sum(isinstance(m, SwiGLU) for m in pieces.modules) == 6
    (x, y), = batches(cfg, 1)
    model.loss(x, y, impl="torch").backward()
    assert dynamo_graphs() - before <= 4  # norm (block / final), RoPE, SwiGLU: not one per layer
    with pytest.raises(ValueError, match="instance-level forward"):
        compile_pieces(model, CPU_BACKEND)
    pieces.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_default_step_applies_the_advisor_plan():
    cfg = config(N=4, S=64, d=64, f=128, V=200)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    base = StepConfig(attention="sdpa", loss_impl="torch", optimizer="foreach", compile=False)
    none = plan_step(cfg, 4, 64, base, dtype="fp32", device_type="cpu", gpu_memory=2**34)
    assert set(none.layers) == {"none"}
    # usable memory (the advisor's: (memory - the CUDA context's reserve) x 0.95) for three quarters of the step's
    # peak above 2^19 bytes: the plan mixes recomputed and kept blocks, and the step applies exactly it
    usable = none.predicted_peak_bytes - (none.predicted_peak_bytes - 2**19) // 4
    memory = int(usable / 0.95) + CONTEXT_RESERVE_BYTES
    tight = plan_step(cfg, 4, 64, base.replace(gpu_memory=memory), dtype="fp32", device_type="cpu", gpu_memory=memory)
    assert tight.fits and "none" in tight.layers and len(set(tight.layers)) > 1, tight.layers
    step = LeaderboardStep(model, base.replace(gpu_memory=memory), batch_size=4)
    assert step.plan.layers == tight.layers and step.policy_spec == tight.spec
    assert [r.kind for r in step.checkpointing.regions] == [r.kind for r in tight.policy.regions(4)]
    info = step.describe()
    assert info["policy"] == tight.spec and info["optimizer_class"] == "ForeachAdamW" and info["loss_path"] == "torch"
    assert info["attention_kernels"] == ""  # sdpa: no kernel paths of its own


def test_step_config_validation():
    for bad, match in ((dict(loss="chunked"), "loss"), (dict(optimizer="sgd"), "optimizer"),
                       (dict(attention="nope"), "attention"), (dict(recompute="full*x"), "recompute|COUNT"),
                       (dict(gpu_memory=0), "gpu_memory"), (dict(recompute_kinds=("full",)), "recompute_kinds"),
                       (dict(recompute_kinds=("none", "sometimes")), "recompute_kinds")):
        with pytest.raises(ValueError, match=match):
            StepConfig(**bad)
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(1))])
    model = TransformerLM(config(N=2))
    with pytest.raises(ValueError, match="seq_len"):
        LeaderboardStep(model, StepConfig(attention="sdpa", compile=False), batch_size=1, seq_len=1000)
    with pytest.raises(ValueError, match="batch_size"):
        LeaderboardStep(model, StepConfig(attention="sdpa", compile=False), batch_size=0)


@pytest.mark.parametrize("optimizer", ["reference", "foreach"])
def test_optimizer_in_backward_equals_step_after_backward_bitwise(optimizer):
    """fp32: every parameter after 3 steps bitwise equal to the same step with AdamW after backward (AdamW is per
    parameter, nothing clips), gradients freed inside backward, and hooks gone after close()."""
    from raysys.training.leaderboard import OptimizerInBackward

    cfg = config(N=3)
    torch.manual_seed(0)
    after = TransformerLM(cfg)
    inside = copy.deepcopy(after)
    base = StepConfig(attention="sdpa", loss_impl="torch", optimizer=optimizer, recompute="full*1+ffn*1+none*1",
                      compile=False)
    plain, fused = (LeaderboardStep(after, base, batch_size=2),
                    LeaderboardStep(inside, base.replace(optimizer_in_backward=True), batch_size=2))
    assert isinstance(fused.optimizer, OptimizerInBackward) and fused.describe()["optimizer_class"].endswith("in backward")
    for x, y in batches(cfg, 3):
        assert torch.equal(plain(x, y), fused(x, y))
        assert all(p.grad is None for p in inside.parameters())
    for (n, p), q in zip(after.named_parameters(), inside.parameters()):
        assert torch.equal(p, q), n
    assert all(s["t"] == 4 for s in fused.optimizer.state.values()) and len(fused.optimizer.state) == len(list(inside.parameters()))
    fused.close()
    x, y = batches(cfg, 1)[0]
    inside.loss(x, y, impl="torch").backward()  # no hook left: the gradients stay
    assert all(p.grad is not None for p in inside.parameters())
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        LeaderboardStep(inside, base.replace(optimizer_in_backward=True), batch_size=2, sync=lambda: None)


def test_optimizer_in_backward_refuses_a_second_gradient():
    from raysys.training.leaderboard import OptimizerInBackward

    w = torch.nn.Parameter(torch.randn(3, 3))
    opt = OptimizerInBackward(lambda ps: AdamW(ps), [w])
    x = torch.randn(2, 3)
    before = w.detach().clone()
    (x @ w @ w).sum().backward()  # used twice in one forward: one summed gradient, one update
    assert opt.state[w]["t"] == 2 and not torch.equal(w, before) and w.grad is None
    with pytest.raises(RuntimeError, match="second gradient"):
        (x @ w).sum().backward()  # a second backward before zero_grad
    opt.zero_grad()
    (x @ w).sum().backward()
    assert opt.state[w]["t"] == 3
    opt.remove()


def test_plan_on_device_offloads_over_the_measured_link(monkeypatch):
    """On CUDA the advisor may offload blocks, planned with the host link as measured (`host_link_gbps`) and this
    GPU's share of the host's memory; without a link figure, or on a slow one, it recomputes instead."""
    import os

    import raysys.training.leaderboard as lb

    host_bytes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 256 * 2**30 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: host_bytes[name])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(lb, "host_link_gbps", lambda device: 55.0)
    cfg = ModelConfig.from_name("leaderboard", attention="cudnn")
    step = StepConfig(attention="cudnn", gpu_memory=143771 * 2**20)
    plan = lb.plan_on_device(cfg, 1, 32768, step, dtype="bf16", device=torch.device("cuda"))
    assert plan.fits and plan.spec == "offload*6+none*28"
    # 256 GiB / 2 GPUs x 0.5 = 64 GiB of pinned copies at most: at batch 2 (5.7 GiB a block) that caps offload
    wide = lb.plan_on_device(cfg, 2, 32768, step, dtype="bf16", device=torch.device("cuda"))
    assert wide.fits and 0 < wide.layers.count("offload") <= 64 // 5.7
    for link in (None, 5.0):
        other = lb.plan_step(cfg, 1, 32768, step, dtype="bf16", device_type="cuda", gpu_memory=step.gpu_memory,
                             link_gbps=link)
        assert other.fits and "offload" not in other.layers and "ffn" in other.layers
    assert "offload" not in lb.plan_on_device(cfg, 1, 32768, step, dtype="bf16", device=torch.device("cpu")).layers


def test_lean_blocks_refuse_hooked_submodules():
    """A hook on a block's submodule (FSDP's per-Linear all-gather) would be skipped by the lean graphs: refused
    with one line before anything is installed; hooks on the block itself still run."""
    from raysys.training.leaderboard import lean_blocks

    model = TransformerLM(config(N=2))
    model.layers[0].register_forward_pre_hook(lambda module, args: None)
    lean_blocks(model, CPU_BACKEND).remove()
    model.layers[1].ffn.w1.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match=r"layers\.1\.ffn\.w1's code inside a compiled graph"):
        lean_blocks(model, CPU_BACKEND)
    assert not any({"forward", "ffn_branch"} & set(b.__dict__) for b in model.layers)


def test_a_refused_step_leaves_the_model_as_it_was():
    model = TransformerLM(config(N=2))
    model.layers[1].attn.q_proj.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="lean=False"):
        LeaderboardStep(model, StepConfig(attention="sdpa", loss_impl="torch", optimizer="foreach",
                                          recompute="ffn*1+none*1", compile_backend=CPU_BACKEND), batch_size=1)
    assert all("forward" not in m.__dict__ and "ffn_branch" not in m.__dict__ for m in model.modules())
    assert getattr(model, "_activation_checkpointing", None) is None
    step = LeaderboardStep(model, StepConfig(attention="sdpa", loss_impl="torch", optimizer="foreach",
                                             recompute="ffn*1+none*1", lean=False, compile_backend=CPU_BACKEND),
                           batch_size=1)
    step.close()


def test_rows_name_the_flash_kernels_that_ran(monkeypatch):
    """flash_triton's kernels depend on the GPU, the Triton and the shape (the auto dispatch): a row says which
    forward and backward ran, and the table shows them beside the backend."""
    import pandas as pd

    from kernels.attention import dispatch
    from raysys.training.leaderboard_bench import _attention_label

    model = TransformerLM(config(N=2, S=32, d=32, f=64, V=50))
    step = LeaderboardStep(model, StepConfig(attention="flash_triton", loss_impl="torch", optimizer="foreach",
                                             compile=False, recompute="none"), batch_size=1)
    monkeypatch.setitem(dispatch.LAST_PATH, "fwd", "gluon")
    monkeypatch.setitem(dispatch.LAST_PATH, "dkdv", "tma")
    monkeypatch.setitem(dispatch.LAST_PATH, "bwd", "two_pass")
    assert step.describe()["attention_kernels"] == "gluon fwd / tma bwd, two_pass"
    monkeypatch.setitem(dispatch.LAST_PATH, "fwd", "tma")
    assert step.describe()["attention_kernels"] == "tma, two_pass"
    step.close()
    rows = pd.DataFrame({"attention": ["flash_triton", "cudnn"], "attention_kernels": ["tma, two_pass", ""]})
    assert list(_attention_label(rows)) == ["flash_triton (tma, two_pass)", "cudnn"]
    assert list(_attention_label(rows.drop(columns="attention_kernels"))) == ["flash_triton", "cudnn"]


def test_the_step_turns_on_expandable_segments_unless_the_process_chose(monkeypatch, caplog):
    """On CUDA the step sets the caching allocator's expandable segments itself (once per process, one logged line)
    when neither PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF is set; a setting of the process's own, an empty one
    included, is left alone; off CUDA nothing happens."""
    import raysys.training.leaderboard as lb

    applied = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: applied.append("empty_cache"))
    monkeypatch.setattr(lb, "_ALLOCATOR_SET", [])
    for name in lb.ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    cuda = torch.device("cuda")
    assert lb.allocator_settings(torch.device("cpu")) == "" and applied == []
    with caplog.at_level("WARNING", logger="raysys"):
        assert lb.allocator_settings(cuda) == lb.ALLOC_CONF == "expandable_segments:True"
        assert lb.allocator_settings(cuda) == lb.ALLOC_CONF
    assert applied == [lb.ALLOC_CONF, "empty_cache"]  # once per process
    assert len(caplog.records) == 1 and "expandable_segments:True" in caplog.records[0].getMessage()
    monkeypatch.setattr(lb, "_ALLOCATOR_SET", [])
    for value in ("", "backend:native"):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
        assert lb.allocator_settings(cuda) == value and applied == [lb.ALLOC_CONF, "empty_cache"]


def test_planned_attention_kernels_follow_the_dispatch(monkeypatch):
    """`planned_paths` applies the dispatch's rules to fake tensors of the step's shape: the tl kernels where the Gluon
    ones cannot run, the Gluon forward and one-pass backward where they can and the call is large enough, the tl
    backward once the Gluon backward failed to build; the plan takes them (`planned_attention_kernels`)."""
    from kernels.attention import dispatch
    from raysys.training.leaderboard import planned_attention_kernels

    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    monkeypatch.delenv(dispatch.BWD_ENV, raising=False)
    cfg = ModelConfig.from_name("leaderboard")
    cpu = torch.device("cpu")
    assert planned_attention_kernels(cfg, 1, 32768, "cudnn", "bf16", cpu) == ""
    assert dispatch.planned_paths(1, 32, 32768, 32768, 128, torch.float32, cpu) == "portable, two_pass"
    monkeypatch.setattr(dispatch, "gluon_unsupported_reason", lambda q, k, v: "")
    monkeypatch.setattr(dispatch, "_GLUON_BROKEN", {})
    assert planned_attention_kernels(cfg, 1, 32768, "flash_triton", "bf16", cpu) == "gluon, one_pass"
    assert dispatch.planned_paths(1, 32, 1024, 1024, 128, torch.bfloat16, cpu) == "portable, two_pass"  # below auto's bound
    q = torch.empty(1, 32, 32768, 128, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="Gluon attention bwd"):
        dispatch.gluon_broken("bwd", dispatch.gluon_bwd_config(q), q, True, RuntimeError("no build"))
    assert dispatch.planned_paths(1, 32, 32768, 32768, 128, torch.bfloat16, cpu) == "gluon fwd / portable bwd, two_pass"


def test_optimizer_labels_say_what_ran_when_the_kernel_cannot(monkeypatch):
    """Without the interpreter a CPU parameter takes FusedAdamW's reference update: the row's optimizer class says
    so, stepped after backward (its `label`) or inside it (`OptimizerInBackward.kind`)."""
    import kernels.adamw
    from kernels.adamw import FusedAdamW
    from raysys.training.leaderboard import OptimizerInBackward

    monkeypatch.setattr(kernels.adamw, "INTERPRET", False)
    w = torch.nn.Parameter(torch.randn(3, 4))
    plain = FusedAdamW([w])
    assert getattr(plain, "label", type(plain).__name__) == "FusedAdamW[reference]"
    in_backward = OptimizerInBackward(lambda ps: FusedAdamW(ps), [w])
    try:
        assert in_backward.kind == "FusedAdamW[reference]"
    finally:
        in_backward.remove()
    assert OptimizerInBackward(lambda ps: AdamW(ps), []).kind == ""
    base = StepConfig(attention="sdpa", loss_impl="torch", optimizer="fused", recompute="none", compile=False)
    for in_backward, said in ((False, "FusedAdamW[reference]"), (True, "FusedAdamW[reference] in backward")):
        step = LeaderboardStep(TransformerLM(config(N=1)), base.replace(optimizer_in_backward=in_backward), batch_size=1)
        assert step.describe()["optimizer_class"] == said  # what the row records
