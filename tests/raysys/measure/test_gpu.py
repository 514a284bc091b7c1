"""GPU checks of the model and harness (run on a GPU host: `python -m pytest -m gpu`)."""

import pytest
import torch

from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerLM
from raysys.training.bench import BenchConfig, run_benchmark

pytestmark = pytest.mark.gpu


def test_model_cuda_matches_cpu_fp32():
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny", context_length=32)
    cpu = TransformerLM(cfg)
    gpu = TransformerLM(cfg, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), atol=1e-4, rtol=1e-4)


def test_sdpa_matches_naive_under_bf16_autocast():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_name("small", context_length=128, num_layers=2), device="cuda")
    x = torch.randint(0, 10_000, (2, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model(x).float()
        out = model.set_attention("sdpa")(x).float()
    assert (out - ref).norm() / ref.norm() < 2e-2


def test_bench_on_cuda_reports_memory_and_phases():
    row, _ = run_benchmark(BenchConfig(size="small", context_length=128, dtype="bf16", device="cuda", warmup=1, steps=3))
    assert row["status"] == "ok" and row["device"] == "cuda"
    assert row["peak_memory_bytes"] > row["memory_after_init_bytes"] > 0
    assert row["forward_mean_s"] > 0 and row["backward_mean_s"] > 0 and row["optimizer_mean_s"] > 0


def test_oom_on_cuda_is_a_row():
    free, _ = torch.cuda.mem_get_info()
    vocab = int(free / (4 * 64) * 1.5)  # a tiny-model embedding (d_model 64, fp32) 1.5x larger than free memory
    row, _ = run_benchmark(BenchConfig(size="tiny", vocab_size=vocab, device="cuda", warmup=0, steps=1))
    assert row["status"] == "oom"
