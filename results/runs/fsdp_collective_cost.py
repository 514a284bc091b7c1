"""Issue 19: host microseconds per FSDP collective on an NCCL group of one (one GPU), per xl block: the coalesced group
of one collective per weight that `parallel/fsdp.py` issues, against one flat collective over the block's weights
back to back (what a flat-parameter layout, as FSDP1's, would issue: no copy-out, the output is the weights). The
seven xl block weights (q, k, v, o: 2560 x 2560; w1, w3: 10240 x 2560; w2: 2560 x 10240), bf16 all-gathers and fp32
reduce-scatters; beside them the casts around them: the fp32 shards into the bf16 gather slots by one
`_foreach_copy_` or by `parallel.fsdp._cast_runs`' strided copies (the layouts of a group of one and of two ranks),
and the bf16 gradients into the fp32 reduce-scatter input by one `_foreach_copy_` or a `copy_` per weight. 32 calls
of each in a row (one per block) timed from the first call to the last call's return, 30 times after 3 warm-up passes
(the waits and a synchronisation come after, untimed); the flight recorder off, as the `alone` phase runs. One row
per case in OUT (Parquet: `case`, `calls`, `min_s` and `median_s` of the 32 calls, `per_call_s` the median over 32),
printed in microseconds too; an existing OUT is refused:

    PYTHONPATH=$PWD python3 results/runs/fsdp_collective_cost.py /tmp/fsdp_collective_cost.parquet
"""
import os
import statistics
import sys
import time

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions  # noqa: E402

from parallel.fsdp import _cast_runs  # noqa: E402
from raysys.results import provenance, write_parquet  # noqa: E402

SHAPES = [(2560, 2560)] * 4 + [(10240, 2560), (2560, 10240), (10240, 2560)]
UNITS = 32


def main() -> None:
    if len(sys.argv) != 2 or not sys.argv[1].endswith(".parquet"):
        raise SystemExit("usage: fsdp_collective_cost.py OUT.parquet")
    out_path = sys.argv[1]
    if os.path.exists(out_path):
        raise SystemExit(f"fsdp_collective_cost.py: {out_path} already exists; name a new file")
    if not torch.cuda.is_available():
        raise SystemExit("fsdp_collective_cost.py: needs a CUDA GPU (an NCCL group of one); this machine has none")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    pg = dist.group.WORLD
    ag, rs = AllgatherOptions(), ReduceScatterOptions()
    for o in (ag, rs):
        if hasattr(o, "asyncOp"):
            o.asyncOp = True
    rs.reduceOp = dist.ReduceOp.AVG
    sizes = [a * b for a, b in SHAPES]
    full16 = [torch.zeros(sum(sizes), dtype=torch.bfloat16, device=dev) for _ in range(2)]
    full32 = [torch.zeros(sum(sizes), dtype=torch.float32, device=dev) for _ in range(2)]
    pieces16 = [list(f.split(sizes)) for f in full16]
    pieces32 = [list(f.split(sizes)) for f in full32]
    shard32 = torch.randn(sum(sizes), device=dev)
    slots = list(full16[0].split(sizes))
    shards = list(shard32.split(sizes))
    runs1 = _cast_runs(full16[0].untyped_storage(), shard32, sizes, 1, 0, torch.bfloat16)
    half = [s // 2 for s in sizes]  # rank 0 of two: the same storage laid out for N = 2
    runs2 = _cast_runs(full16[0].untyped_storage(), shard32[:sum(half)], half, 2, 0, torch.bfloat16)
    grads = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for shape in SHAPES]
    grad_dst = [p.view(shape) for p, shape in zip(pieces32[0], SHAPES)]

    def copies(pairs):
        for dst, src in pairs:
            dst.copy_(src)

    cases = {
        "cast foreach (7 weights, fp32 -> bf16 slots)": lambda i: torch._foreach_copy_(slots, shards) and None,
        "cast runs, group of one (1 copy)": lambda i: copies(runs1),
        "cast runs, two ranks' layout (2 copies)": lambda i: copies(runs2),
        "grads foreach (7 weights, bf16 -> fp32)": lambda i: torch._foreach_copy_(grad_dst, grads) and None,
        "grads copy_ per weight (7)": lambda i: copies(zip(grad_dst, grads)),
        "all_gather coalesced (7 weights, bf16)":
            lambda i: pg.allgather_into_tensor_coalesced(pieces16[i % 2], pieces16[i % 2], ag),
        "all_gather flat (one tensor, bf16)": lambda i: pg._allgather_base(full16[i % 2], full16[i % 2], ag),
        "reduce_scatter coalesced (7 weights, fp32)":
            lambda i: pg.reduce_scatter_tensor_coalesced(pieces32[i % 2], pieces32[i % 2], rs),
        "reduce_scatter flat (one tensor, fp32)": lambda i: pg._reduce_scatter_base(full32[i % 2], full32[i % 2], rs),
        "record+wait event (baseline)": lambda i: torch.cuda.current_stream().wait_event(torch.cuda.Event().record()
                                                                                      or torch.cuda.Event()),
    }

    def timed(fn, reps):
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            works = [fn(i) for i in range(UNITS)]
            t1 = time.perf_counter()
            for w in works:
                if w is not None:
                    w.wait()
            torch.cuda.synchronize()
            out.append((t1 - t0) * 1e6)
        return out

    for _ in range(3):
        for fn in cases.values():
            timed(fn, 3)
    rows = []
    for name, fn in cases.items():
        t = timed(fn, 30)
        med = statistics.median(t)
        rows.append({"case": name, "calls": UNITS, "min_s": min(t) / 1e6, "median_s": med / 1e6,
                     "per_call_s": med / UNITS / 1e6, **provenance(dev)})
        print(f"{name:44s} {UNITS} calls: min {min(t):8.1f} us, median {med:8.1f} us, per call {med / UNITS:6.1f} us",
              flush=True)
    write_parquet(pd.DataFrame(rows), out_path)
    print(f"wrote {out_path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
