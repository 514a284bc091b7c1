"""Issue 19: host microseconds per FSDP collective on an NCCL group of one (one GPU), per xl block: the coalesced
group of one collective per weight that `parallel/fsdp.py` issues, against one flat collective over the block's
weights back to back (what a flat-parameter layout, as FSDP1's, would issue: no copy-out, the output is the
weights). The seven xl block weights (q, k, v, o: 2560 x 2560; w1, w3: 10240 x 2560; w2: 2560 x 10240), bf16
all-gathers and fp32 reduce-scatters, 32 calls in a row (one per block) timed from the first call to the last
call's return, 30 times after 3 warm-up passes (the waits and a synchronisation come after, untimed); the flight
recorder off, as the `alone` phase runs. One row per case in OUT (Parquet: `case`, `calls`, `min_us`,
`median_us`, `per_call_us`), printed too; an existing OUT is refused:

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
    cases = {
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
        rows.append({"case": name, "calls": UNITS, "min_us": min(t), "median_us": med, "per_call_us": med / UNITS,
                     **provenance(dev)})
        print(f"{name:44s} {UNITS} calls: min {min(t):8.1f} us, median {med:8.1f} us, per call {med / UNITS:6.1f} us",
              flush=True)
    write_parquet(pd.DataFrame(rows), out_path)
    print(f"wrote {out_path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
