"""Issue 19: Dynamo's cache lookup per call of a compiled block, with and without FSDP around the model. A tiny
4-block TransformerLM, blocks compiled with backend="eager" (as `compile_blocks`), on a gloo group of one; per case
the mean host time of "TorchDynamo Cache Lookup" over 20 profiled training steps (80 calls). CPU only:

    PYTHONPATH=$PWD python3 results/runs/dynamo_guard_check_fsdp.py > dynamo_guard_check_fsdp.txt
    git archive <commit> parallel | tar -x -C /tmp/before          # another commit's wrappers, same host:
    PARALLEL_ROOT=/tmp/before PYTHONPATH=$PWD python3 results/runs/dynamo_guard_check_fsdp.py

Cases: `single` (fp32), `single-autocast` (bf16 autocast, as the sweeps' single), `fsdp-fp32` (no casts),
`fsdp-bf16` (compute dtype bf16: per-Linear input casts traced into the block; a group of one, the identity) and
`fsdp-bf16-alone` (the same through a larger group's collectives).
"""
import os
import sys

if os.environ.get("PARALLEL_ROOT"):
    sys.path.insert(0, os.environ["PARALLEL_ROOT"])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from parallel.fsdp import FSDP  # noqa: E402
from raysys.config import ModelConfig  # noqa: E402
from raysys.model import TransformerBlock, TransformerLM, cross_entropy  # noqa: E402
from raysys.train_step import compile_blocks  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("gloo", rank=0, world_size=1)
MC = ModelConfig(vocab_size=64, context_length=8, d_model=32, num_layers=4, num_heads=2, d_ff=64, name="t")
X, Y = torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))


def lookup_us(kind: str) -> float:
    torch.manual_seed(0)
    model = TransformerLM(MC)
    compile_blocks(model, backend="eager")
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=kind == "single-autocast")
    if kind.startswith("fsdp"):
        model = FSDP(model, compute_dtype=torch.bfloat16 if "bf16" in kind else None, units=(TransformerBlock,),
                     collectives_alone="alone" in kind)

    def step():
        with autocast:
            loss = cross_entropy(model(X).float(), Y)
        loss.backward()
        getattr(model, "finish_gradient_synchronization", lambda: None)()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    [event] = [e for e in prof.key_averages() if "Cache Lookup" in e.key]
    return event.cpu_time_total / event.count


print(f"torch {torch.__version__}, parallel from {os.path.relpath(sys.modules['parallel.fsdp'].__file__)}")
for kind in ("single", "single-autocast", "fsdp-fp32", "fsdp-bf16", "fsdp-bf16-alone", "single", "fsdp-bf16"):
    print(f"{kind:16s} cache lookup {lookup_us(kind):6.1f} us per call", flush=True)
