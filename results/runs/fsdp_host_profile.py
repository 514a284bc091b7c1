"""Issue 19: where a compiled FSDP step's extra host time goes, on an NCCL group of one issuing a larger group's
collectives (`collectives_alone`), beside `single` and `single_cast` (FSDP's casts without its sharding). bf16, xl at
context 512, 4 sequences, blocks compiled: the `fsdp_alone_compiled` study's setting. Per variant: the host time of
each phase (median of 6 steps), then the ops with the most host time in 3 profiled steps (torch.profiler, CPU side:
self time and calls per step), then Python's own view of the same steps (cProfile, internal time per step).

    PYTHONPATH=$PWD python3 results/runs/fsdp_host_profile.py > fsdp_host_profile.txt
    git archive <commit> parallel | tar -x -C /tmp/before          # another commit's wrappers, on the same host:
    PARALLEL_ROOT=/tmp/before PYTHONPATH=$PWD python3 results/runs/fsdp_host_profile.py single,fsdp

`PARALLEL_ROOT`: the `parallel` package is imported from there, before `sweeps/` puts this checkout first on the
path (setting PYTHONPATH alone does not do it).
"""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")  # the flight recorder off, as the `alone` phase runs it
os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")

if os.environ.get("PARALLEL_ROOT"):
    sys.path.insert(0, os.environ["PARALLEL_ROOT"])
    import parallel.ddp  # noqa: E402,F401  (cached: sweeps/ then gets these)
    import parallel.fsdp  # noqa: E402,F401
    print(f"parallel from {parallel.fsdp.__file__}")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from raysys.device import synchronize  # noqa: E402
from raysys.train_step import TrainStep  # noqa: E402
from sweeps.fsdp import AUTOCAST_VARIANTS, FSDPTrial, build  # noqa: E402

VARIANTS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["single", "single_cast", "fsdp"]


def xl_step(variant: str, device: torch.device) -> tuple:
    """(model, optimizer, step) of the `fsdp_alone_compiled` study's trial of `variant` on the default group, after
    3 warm-up steps (compiled and allocated)."""
    trial = FSDPTrial(size="xl", context_length=512, batch_per_rank=4, dtype="bf16", variant=variant,
                      profile=False, warmup=2, steps=4, compile=True, collectives_alone=True)
    model, optimizer = build(trial, device, dist.group.WORLD)
    dtype = trial.dtype if variant in AUTOCAST_VARIANTS else "fp32"
    step = TrainStep(model, optimizer, trial.batch(device, 0), dtype, device)
    for _ in range(3):
        step()
    synchronize(device)
    return model, optimizer, step


def host_phases(step: TrainStep, n: int) -> list[float]:
    rows = []
    for _ in range(n):
        marks = step()
        synchronize(step.device)
        rows.append(marks.host_ms())
    return [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]


def group_of_one(script: str, variants: list[str], port: int) -> torch.device:
    """Check `variants` and the GPU (SystemExit naming `script` and the rule), then start an NCCL group of one on GPU 0
    at `port`; returns the device."""
    unknown = [v for v in variants if v not in FSDPTrial.VARIANTS]
    if unknown:
        raise SystemExit(f"{script}: variants {unknown} are not among {list(FSDPTrial.VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (an NCCL group of one); this machine has none")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)
    return device


def main() -> None:
    device = group_of_one("fsdp_host_profile.py", VARIANTS, 29561)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, group of one, collectives_alone")
    for variant in VARIANTS:
        model, optimizer, step = xl_step(variant, device)
        phases = host_phases(step, 6)
        print(f"\n=== {variant}: host ms per phase (forward, backward, finish, optimizer): "
              + ", ".join(f"{p:.1f}" for p in phases) + f"; total {sum(phases):.1f}")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
            synchronize(device)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=28, max_name_column_width=60)
        print(table)
        pr = cProfile.Profile()
        start = time.perf_counter()
        pr.enable()
        for _ in range(3):
            step()
        synchronize(device)
        pr.disable()
        print(f"cProfile: 3 steps in {time.perf_counter() - start:.3f} s")
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        print(buf.getvalue())
        del model, optimizer, step
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
