"""Issue 19: Dynamo's cache lookup per call of a compiled block, with and without FSDP around the model. A tiny
4-block TransformerLM, blocks compiled with backend="eager" (as `compile_blocks`), on a gloo group of one; per case
the mean host time of "TorchDynamo Cache Lookup" over 20 profiled training steps (80 calls), and how many guards of
each kind Dynamo installed for the block (its guard log):

    PYTHONPATH=$PWD python3 results/runs/dynamo_guard_check_fsdp.py > dynamo_guard_check_fsdp.txt
    git archive <commit> parallel | tar -x -C /tmp/before          # another commit's wrappers, same host:
    PARALLEL_ROOT=/tmp/before PYTHONPATH=$PWD python3 results/runs/dynamo_guard_check_fsdp.py
    PYTHONPATH=$PWD python3 results/runs/dynamo_guard_check_fsdp.py cuda   # a GPU: NCCL, inductor, bf16 autocast

On the H200 a compiled xl block's lookup took 85-89 us under FSDP against 23 us in single
(`fsdp_host_profile_ab_66bb84e.txt`, `fsdp_host_profile_80b28c5.txt`), far more than on this CPU: the `cuda` run
is the same comparison on a GPU, to tell which guards make the difference there.

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
from raysys.profiling import dynamo_guard_log, guard_kinds  # noqa: E402
from raysys.train_step import compile_blocks  # noqa: E402

DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
if DEVICE.type not in ("cpu", "cuda") or (DEVICE.type == "cuda" and not torch.cuda.is_available()):
    raise SystemExit(f"dynamo_guard_check_fsdp.py: device {DEVICE} must be cpu or cuda (with a GPU)")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", rank=0, world_size=1)
MC = ModelConfig(vocab_size=64, context_length=8, d_model=32, num_layers=4, num_heads=2, d_ff=64, name="t")
X, Y = torch.randint(0, 64, (1, 8), device=DEVICE), torch.randint(0, 64, (1, 8), device=DEVICE)
BACKEND = "inductor" if DEVICE.type == "cuda" else "eager"


def lookup_us(kind: str) -> tuple[float, str]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(MC, device=DEVICE)
    compile_blocks(model, backend=BACKEND)
    autocast = torch.autocast(DEVICE.type, torch.bfloat16, enabled=kind == "single-autocast")
    if kind.startswith("fsdp"):
        model = FSDP(model, compute_dtype=torch.bfloat16 if "bf16" in kind else None, units=(TransformerBlock,),
                     collectives_alone="alone" in kind)

    def step():
        with autocast:
            loss = cross_entropy(model(X).float(), Y)
        loss.backward()
        getattr(model, "finish_gradient_synchronization", lambda: None)()

    with dynamo_guard_log() as log:
        step()  # compiles the block: its guards are logged
    kinds = guard_kinds(log.getvalue())
    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    [event] = [e for e in prof.key_averages() if "Cache Lookup" in e.key]
    guards = f"{sum(kinds.values())} guards: " + ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    return event.cpu_time_total / event.count, guards


print(f"torch {torch.__version__}, {DEVICE}, backend {BACKEND}, "
      f"parallel from {os.path.relpath(sys.modules['parallel.fsdp'].__file__)}")
for kind in ("single", "single-autocast", "fsdp-fp32", "fsdp-bf16", "fsdp-bf16-alone", "single", "fsdp-bf16"):
    us, guards = lookup_us(kind)
    print(f"{kind:16s} cache lookup {us:6.1f} us per call; {guards}", flush=True)
