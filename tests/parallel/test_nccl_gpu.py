"""Every parallel strategy on 2 GPUs over NCCL against single-process training on one GPU (`pytest -m gpu`), and on a
group of one (one GPU: the sweeps' `--world-size 1`, where the wrappers reduce in place and NCCL moves nothing).

The CPU tests (gloo) prove the algorithms; these prove the CUDA paths: NCCL's ReduceOp.AVG, async work on
NCCL's streams, the FSDP storage swaps and frees while kernels are in flight. The reference on each rank trains
the same model on the same device with the two halves of the batch and grad = (g_0 + g_1) / 2, which is what
a two-rank reduction computes bit for bit in fp32 (a + b is commutative, / 2 and * 0.5 are exact), so with
deterministic kernels fp32 training must be bitwise equal; bf16 FSDP compute is compared with a tolerance to a
reference that casts its weights to bf16 for forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel.ddp import make_ddp
from parallel.fsdp import FSDP
from parallel.sharded_optimizer import ShardedOptimizer
from raysys.model.config import ModelConfig
from raysys.model.transformer import AdamW, TransformerBlock, TransformerLM, cross_entropy
from tests.parallel.dist_utils import run_ranks
from tests.parallel.test_fsdp import _cast_weights

pytestmark = pytest.mark.gpu
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

WORLD, BATCH, SEQ, STEPS = 2, 6, 24, 3
DDP_VARIANTS = [("naive", {}), ("flat", {}), ("overlapped", {}), ("bucketed", {"bucket_size_mb": 1e-4}),
                ("bucketed", {"bucket_size_mb": 0.5}), ("bucketed", {"bucket_size_mb": 1000.0})]


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _model(device: torch.device) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig.from_name("tiny", context_length=SEQ, num_layers=2), device=device)


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, ModelConfig.from_name("tiny").vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _reference_step(ref: torch.nn.Module, opt: torch.optim.Optimizer, x, y, world_size: int) -> None:
    """One step on the two halves of the batch, gradients averaged as the two-rank reduction does."""
    local = BATCH // world_size
    grads = []
    for r in range(world_size):
        ref.zero_grad(set_to_none=True)
        cross_entropy(ref(x[r * local:(r + 1) * local]), y[r * local:(r + 1) * local]).backward()
        grads.append([p.grad for p in ref.parameters()])
    for p, *per_rank in zip(ref.parameters(), *grads):
        p.grad = sum(per_rank[1:], per_rank[0]) / world_size  # (g0 + g1) / 2 on two ranks
    opt.step()


def _max_diff(a: dict[str, torch.Tensor], ref: torch.nn.Module) -> tuple[float, list[str]]:
    diffs = {n: (a[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()}
    return max(diffs.values()), [n for n, d in diffs.items() if d != 0]


def _train(rank: int, world_size: int, kind: str, kwargs: dict, alone: dict | None = None
           ) -> list[tuple[float, list[str]]]:
    """`alone`: what every wrapper also takes ({"collectives_alone": True} on a group of one)."""
    device = _device(rank)
    alone = alone or {}
    compute_dtype = kwargs.get("compute_dtype") if kind == "fsdp" else None
    # AdamW's update is ~lr whatever the gradient's size, so tiny bf16 differences could flip it: SGD for bf16.
    optimizer = (lambda params: torch.optim.SGD(params, lr=0.05)) if compute_dtype else \
        (lambda params: AdamW(params, lr=1e-2, weight_decay=0.1))
    ref = _model(device)
    ref_opt = optimizer(ref.parameters())
    if kind == "fsdp":
        wrapped = FSDP(_model(device), **kwargs, **alone)
        opt = optimizer(wrapped.parameters())
    elif kind == "sharded":
        wrapped = make_ddp("bucketed", _model(device), bucket_size_mb=0.5, **alone)
        opt = ShardedOptimizer(wrapped.parameters(), AdamW, lr=1e-2, weight_decay=0.1)
    else:
        wrapped = make_ddp(kind, _model(device), **kwargs, **alone)
        opt = optimizer(wrapped.parameters())
    local = BATCH // world_size
    out = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        if compute_dtype is None:
            _reference_step(ref, ref_opt, x, y, world_size)
        else:
            ref.zero_grad(set_to_none=True)
            with _cast_weights(ref, compute_dtype):
                cross_entropy(ref(x).float(), y).backward()
            ref_opt.step()
        opt.zero_grad(set_to_none=True)
        cross_entropy(wrapped(x[rank * local:(rank + 1) * local]).float(),
                      y[rank * local:(rank + 1) * local]).backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        full = (wrapped.gather_full_params() if kind == "fsdp"
                else {n: p.detach() for n, p in wrapped.module.named_parameters()})
        out.append(_max_diff(full, ref))
    if hasattr(wrapped, "remove_hooks"):
        wrapped.remove_hooks()
    return out


def _all(rank: int, world_size: int, alone: dict | None = None) -> dict:
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {f"ddp:{kind}{sorted(kw.items())}": _train(rank, world_size, kind, kw, alone)
               for kind, kw in DDP_VARIANTS}
    results["sharded"] = _train(rank, world_size, "sharded", {}, alone)
    results["fsdp:fp32"] = _train(rank, world_size, "fsdp", {}, alone)
    results["fsdp:bf16"] = _train(rank, world_size, "fsdp", {"compute_dtype": torch.bfloat16}, alone)
    blocks = {"units": (TransformerBlock,)}  # one all-gather per block: the copy-in / copy-out path
    results["fsdp_block:fp32"] = _train(rank, world_size, "fsdp", blocks, alone)
    results["fsdp_block:bf16"] = _train(rank, world_size, "fsdp", {**blocks, "compute_dtype": torch.bfloat16}, alone)
    flat = {**blocks, "flat_collectives": True}  # one flat all-gather and reduce-scatter per block, copied out
    results["fsdp_flat:fp32"] = _train(rank, world_size, "fsdp", flat, alone)
    results["fsdp_flat:bf16"] = _train(rank, world_size, "fsdp", {**flat, "compute_dtype": torch.bfloat16}, alone)
    flat_rs = {**blocks, "flat_reduce_scatter": True}  # per-weight all-gathers, one flat reduce-scatter per block
    results["fsdp_flat_rs:fp32"] = _train(rank, world_size, "fsdp", flat_rs, alone)
    results["fsdp_flat_rs:bf16"] = _train(rank, world_size, "fsdp", {**flat_rs, "compute_dtype": torch.bfloat16},
                                          alone)
    # The same process group must still work: no collective was left pending by any wrapper.
    t = torch.ones(1, device=_device(rank))
    dist.all_reduce(t)
    results["all_reduce_after"] = t.item()
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_all, WORLD, backend="nccl", timeout_s=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("alone", [None, {"collectives_alone": True}], ids=["identity", "collectives_alone"])
def test_group_of_one_on_nccl_trains_like_one_process(alone):
    """Both ways a group of one runs: the identity, and a larger group's path (NCCL collectives over no peer)."""
    [res] = run_ranks(_all, 1, alone, backend="nccl", timeout_s=300)
    for name in FP32_RUNS:
        assert [mismatched for _, mismatched in res[name]] == [[]] * STEPS, f"{name}: max |diff| per step {res[name]}"
    for name in ("fsdp:bf16", "fsdp_block:bf16", "fsdp_flat:bf16", "fsdp_flat_rs:bf16"):
        assert max(d for d, _ in res[name]) < 1e-3, res[name]
    assert res["all_reduce_after"] == 1


FP32_RUNS = [f"ddp:{k}{sorted(kw.items())}" for k, kw in DDP_VARIANTS] + ["sharded", "fsdp:fp32", "fsdp_block:fp32",
                                                                        "fsdp_flat:fp32", "fsdp_flat_rs:fp32"]


@needs_two
@pytest.mark.parametrize("name", FP32_RUNS)
def test_fp32_bitwise_equal_to_single_process_on_nccl(per_rank, name):
    for res in per_rank:
        steps = res[name]
        assert [mismatched for _, mismatched in steps] == [[]] * STEPS, f"max |diff| per step {steps}"


@needs_two
@pytest.mark.parametrize("name", ["fsdp:bf16", "fsdp_block:bf16", "fsdp_flat:bf16", "fsdp_flat_rs:bf16"])
def test_fsdp_bf16_compute_matches_cast_reference_on_nccl(per_rank, name):
    for res in per_rank:
        diffs = [d for d, _ in res[name]]
        assert 0 < max(diffs) < 1e-3, diffs  # > 0: bf16 is really in use
    assert per_rank[0]["all_reduce_after"] == WORLD
