"""Dynamo's cache lookup per call of a compiled block, with and without FSDP around the model: a tiny 4-block
TransformerLM, blocks compiled (eager on CPU, inductor on CUDA), a group of one; per case (`single`, `single-autocast`,
`fsdp-fp32`, `fsdp-bf16`, `fsdp-bf16-alone`: through a larger group's collectives) the mean host time of "TorchDynamo
Cache Lookup" over 20 profiled steps and the guards Dynamo installed by kind. One row per case in OUT (Parquet, refused
if it exists), printed too; `parallel_from` names the `parallel` package that ran (another commit's: docs/runs.md).

    python -m tools.dynamo_guard_check_fsdp --out /tmp/guards.parquet
    python -m tools.dynamo_guard_check_fsdp --device cuda --out ...  # NCCL, inductor
"""
import argparse
import json
import os
import sys

import pandas as pd
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from parallel.fsdp import FSDP
from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerBlock, TransformerLM, cross_entropy
from raysys.measure.profiling import dynamo_guard_log, guard_kinds
from raysys.results.records import provenance, write_parquet
from raysys.training.step import compile_blocks

CASES = ("single", "single-autocast", "fsdp-fp32", "fsdp-bf16", "fsdp-bf16-alone", "single", "fsdp-bf16")
MC = ModelConfig(vocab_size=64, context_length=8, d_model=32, num_layers=4, num_heads=2, d_ff=64, name="t")


def parse_args() -> argparse.Namespace:
    """The flags, checked before any work (one line and exit 2 on bad ones)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", required=True, help="Parquet file to write (refused if it exists)")
    args = p.parse_args()
    if os.path.exists(args.out):
        p.error(f"--out {args.out} already exists; name a new file")
    if not args.out.endswith(".parquet"):
        p.error(f"--out {args.out} must end in .parquet")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA GPU")
    return args


def lookup(kind: str, device: torch.device) -> tuple[float, dict[str, int]]:
    """(mean seconds of one cache lookup of the compiled block, {guard kind: count}) for one case."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(MC, device=device)
    compile_blocks(model, backend="inductor" if device.type == "cuda" else "eager")
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=kind == "single-autocast")
    if kind.startswith("fsdp"):
        model = FSDP(model, compute_dtype=torch.bfloat16 if "bf16" in kind else None, units=(TransformerBlock,),
                     collectives_alone="alone" in kind)
    x, y = torch.randint(0, 64, (1, 8), device=device), torch.randint(0, 64, (1, 8), device=device)

    def step():
        with autocast:
            loss = cross_entropy(model(x).float(), y)
        loss.backward()
        getattr(model, "finish_gradient_synchronization", lambda: None)()

    with dynamo_guard_log() as log:
        step()  # compiles the block: its guards are logged
    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    [event] = [e for e in prof.key_averages() if "Cache Lookup" in e.key]
    return event.cpu_time_total / event.count / 1e6, guard_kinds(log.getvalue())


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    source = os.path.relpath(sys.modules["parallel.fsdp"].__file__)
    print(f"torch {torch.__version__}, {device}, parallel from {source}")
    rows = []
    for repeat, kind in enumerate(CASES):
        seconds, kinds = lookup(kind, device)
        rows.append({"case": kind, "order": repeat, "lookup_mean_s": seconds, "guards": sum(kinds.values()),
                     "guard_kinds": json.dumps(kinds), "parallel_from": source, **provenance(device)})
        print(f"{kind:16s} cache lookup {seconds * 1e6:6.1f} us per call; {sum(kinds.values())} guards: "
              + ", ".join(f"{k} {n}" for k, n in kinds.items()), flush=True)
    write_parquet(pd.DataFrame(rows), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
