"""The leaderboard step at its own shape on a GPU (`python -m pytest -m gpu
tests/raysys/training/test_leaderboard_gpu.py`): each attention backend's backward allocates what the memory model says,
and the default step (`StepConfig()` with each backend, no allocator setting of the user's) runs its own plan within the
plan's memory and within 5% of the predicted peak. Needs a GPU with the memory the plan is made for (an H200; an 80 GB
card skips)."""

import os

import pytest
import torch

from raysys.model.config import ModelConfig
from raysys.planning.recompute_model import Workload, attention_backward_bytes
from raysys.training.leaderboard import ALLOC_ENV, LeaderboardStep, StepConfig
from raysys.training.leaderboard_bench import build_model, make_batch, release_cached_memory

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LB = ModelConfig.from_name("leaderboard")
B, S = 1, 32768


def _needs_memory(gib: float) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < gib * 2**30:
        pytest.skip(f"needs a GPU with {gib:g} GiB")


@pytest.mark.parametrize("attention", ["flash_triton", "cudnn"])
def test_attention_backward_allocates_what_the_model_says(attention):
    """One attention backward at the step's (1, 32, 32768, 128) bf16 shape in the model's layout: the bytes it
    allocates above its inputs, plus dO, are `attention_backward_bytes` (flash_triton's kernels as they ran)."""
    from raysys.model.transformer import get_attention

    _needs_memory(40)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, LB.num_heads, LB.d_head, generator=g, device="cuda", dtype=torch.bfloat16)
                   .transpose(1, 2) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    for _ in range(2):  # the first builds the kernels
        out = get_attention(attention)(*leaves, True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = torch.autograd.grad(out, leaves, do)  # no accumulation into .grad (no copies of its own)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        del grads
    kernels = ""
    if attention == "flash_triton":
        from kernels.attention import last_paths

        kernels = last_paths()
    w = Workload(config=LB.replace(attention=attention), batch_size=B, precision="bf16", param_dtype="bf16",
                 attention_kernels=kernels)
    print(f"\n{attention} ({kernels}): backward allocated {measured} B + dO; model {attention_backward_bytes(w)} B")
    assert measured + do.numel() * 2 == pytest.approx(attention_backward_bytes(w), rel=0.02), (kernels, measured)


@pytest.fixture(scope="module")
def model():
    _needs_memory(130)
    if any(name in os.environ for name in ALLOC_ENV):
        pytest.skip("the allocator is configured by the environment: this test is of the step's own setting")
    torch.cuda.empty_cache()
    model = build_model(LB, torch.device("cuda"), torch.bfloat16)
    yield model
    del model
    release_cached_memory(torch.device("cuda"))


@pytest.mark.parametrize("attention", ["flash_triton", "cudnn"])
def test_default_step_runs_its_plan_at_the_leaderboard_shape(model, attention):
    """`LeaderboardStep(model, StepConfig(attention=...))` at 1 x 32768: the plan fits, two steps run, the peak is
    under the plan's usable memory and within 5% of its prediction, flash_triton ran the kernels it was planned for,
    and the step turned on expandable segments itself."""
    device = torch.device("cuda")
    step = LeaderboardStep(model, StepConfig(attention=attention), batch_size=B, seq_len=S)
    try:
        x, y = make_batch(LB, B, S, device)
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            loss = step(x, y)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        info = step.describe()
        print(f"\n{attention}: plan {step.policy_spec}, predicted {step.plan.predicted_peak_bytes / 2**30:.2f} GiB, "
              f"measured {peak / 2**30:.2f} GiB, usable {step.plan.usable_bytes / 2**30:.2f} GiB, reserved "
              f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB; {info}")
        assert torch.isfinite(loss) and step.plan.fits
        assert info["alloc_conf"] == "expandable_segments:True"
        assert any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot())
        assert peak <= step.plan.usable_bytes, (peak, step.plan.usable_bytes, info)
        assert step.plan.predicted_peak_bytes == pytest.approx(peak, rel=0.05), (peak, info)
        if attention == "flash_triton":
            assert info["attention_kernels"] == info["planned_attention_kernels"] != ""
    finally:
        step.close()
        step.reset_optimizer_state()
        model.zero_grad(set_to_none=True)
        release_cached_memory(device)
