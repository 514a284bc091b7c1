"""Issue 19: where a compiled FSDP step's extra device time goes, against `single`, on an NCCL group of one issuing a
larger group's collectives (`collectives_alone`). The `fsdp_alone_compiled` study's setting: bf16, xl at context
512, 4 sequences, blocks compiled. Per variant, 3 steps under torch's profiler (CUDA activity) after 3 warm-up
steps; every kernel's device time is summed by kernel name and divided by the steps. One row per (variant, kernel)
in OUT (Parquet: `variant`, `kernel` (its name, cut to 160 characters), `calls_per_step`, `device_s_per_step`, and
`step_device_s` the variant's whole kernel time per step); printed per variant are the kernels with the most time,
then the kernels whose time differs most between the variants. An existing OUT is refused before any work:

    PYTHONPATH=$PWD python3 results/runs/fsdp_device_profile.py /tmp/fsdp_device_profile.parquet [single,fsdp]

The 6421fc2 run built its trials with this code inline; they are `fsdp_host_profile.xl_step`'s since 66ff994, and
its NCCL group is `group_of_one`'s since d99fcdf.
"""
import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")  # the flight recorder off, as the `alone` phase runs it
os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from raysys.device import synchronize  # noqa: E402
from raysys.results import provenance, write_parquet  # noqa: E402
from results.runs.fsdp_host_profile import group_of_one, xl_step  # noqa: E402  (the same group and trial)

STEPS = 3
NAME_CHARS = 160


def kernel_times(prof, steps: int) -> dict[str, tuple[float, float]]:
    """Kernel name -> (calls per step, device seconds per step) of the profiled steps."""
    calls: dict[str, int] = collections.Counter()
    total: dict[str, float] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            name = event.name[:NAME_CHARS]
            calls[name] += 1
            total[name] += event.device_time_total * 1e-6
    return {name: (calls[name] / steps, total[name] / steps) for name in total}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: fsdp_device_profile.py OUT.parquet [variants, comma-separated]")
    out_path = Path(sys.argv[1])
    if out_path.exists():
        raise SystemExit(f"fsdp_device_profile.py: {out_path} exists; give a new path")
    variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["single", "fsdp"]
    device = group_of_one("fsdp_device_profile.py", variants, 29562)
    rows, per_variant = [], {}
    for variant in variants:
        model, optimizer, step = xl_step(variant, device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            synchronize(device)
        times = kernel_times(prof, STEPS)
        per_variant[variant] = times
        step_s = sum(t for _, t in times.values())
        print(f"\n=== {variant}: {step_s * 1e3:.2f} ms of kernels per step, {len(times)} kernel names")
        for name, (n, t) in sorted(times.items(), key=lambda kv: -kv[1][1])[:15]:
            print(f"  {t * 1e3:8.3f} ms  {n:6.1f}/step  {name[:110]}")
        rows += [{"variant": variant, "kernel": name, "calls_per_step": n, "device_s_per_step": t,
                  "step_device_s": step_s, **provenance(device)} for name, (n, t) in times.items()]
        del model, optimizer, step
        torch.cuda.empty_cache()
    if len(variants) >= 2:
        a, b = variants[0], variants[1]
        names = set(per_variant[a]) | set(per_variant[b])
        diff = sorted(names, key=lambda k: -abs(per_variant[b].get(k, (0, 0))[1] - per_variant[a].get(k, (0, 0))[1]))
        print(f"\n=== kernels by |{b} - {a}| device time per step")
        for name in diff[:20]:
            (na, ta), (nb, tb) = per_variant[a].get(name, (0, 0)), per_variant[b].get(name, (0, 0))
            print(f"  {(tb - ta) * 1e3:+8.3f} ms  ({ta * 1e3:7.3f} -> {tb * 1e3:7.3f}; calls {na:.0f} -> {nb:.0f})  "
                  f"{name[:100]}")
    write_parquet(pd.DataFrame(rows), out_path)
    print(f"wrote {out_path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
