"""Issue 19: host microseconds per torch process-group call on an NCCL group of one (one GPU), the unit cost under
every DDP / FSDP wrapper's collectives. 291 float32 tensors of 4096 elements (xl's parameter count); each case is
timed from its first call to its last call's return (the waits and a synchronisation come after, untimed), 30 times
after 3 warm-up passes; `per call` is the median divided by the calls. Run once per environment, as
`nccl_call_cost_h200.txt` records (its first lines say how):

    LABEL=default python results/runs/nccl_call_cost.py
    LABEL=TRACE_BUFFER_SIZE=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0 MASTER_PORT=29545 python results/runs/nccl_call_cost.py
    LABEL=TRACE0+NOMON TORCH_NCCL_TRACE_BUFFER_SIZE=0 TORCH_NCCL_ENABLE_MONITORING=0 \
        TORCH_NCCL_ASYNC_ERROR_HANDLING=0 MASTER_PORT=29546 python results/runs/nccl_call_cost.py
    SPIN=25 python results/runs/nccl_call_cost.py &  py-spy record --native -p $! ...  # the per-parameter loop alone
"""
import os, time, statistics
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, AllreduceCoalescedOptions
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29544")
dev = torch.device("cuda:0"); torch.cuda.set_device(dev)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
pg = dist.group.WORLD
N = 291
ts = [torch.zeros(4096, device=dev, dtype=torch.float32) for _ in range(N)]
flat = torch.zeros(4096 * N, device=dev)
o = AllreduceOptions(); o.reduceOp = dist.ReduceOp.SUM
if hasattr(o, "asyncOp"): o.asyncOp = True
co = AllreduceCoalescedOptions(); co.reduceOp = dist.ReduceOp.SUM
if hasattr(co, "asyncOp"): co.asyncOp = True
stream = torch.cuda.current_stream()
def t_of(fn, reps=30):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); r = fn(); t1 = time.perf_counter()
        if isinstance(r, list):
            for w in r: w.wait()
        elif r is not None: r.wait()
        torch.cuda.synchronize(); out.append((t1 - t0) * 1e6)
    return min(out), statistics.median(out)
ag_in = [torch.zeros(4096, device=dev) for _ in range(N)]; ag_out = [torch.zeros(4096, device=dev) for _ in range(N)]
cases = {
    "pg.allreduce x291 (async opts)": lambda: [pg.allreduce([t], o) for t in ts],
    "dist.all_reduce x291 async": lambda: [dist.all_reduce(t, async_op=True) for t in ts],
    "pg.allreduce_coalesced(291)": lambda: pg.allreduce_coalesced(ts, co),
    "pg.allreduce(flat)": lambda: pg.allreduce([flat], o),
    "all_gather_into_tensor x291": lambda: [dist.all_gather_into_tensor(b, a, async_op=True) for a, b in zip(ag_in, ag_out)],
    "reduce_scatter_tensor x291": lambda: [dist.reduce_scatter_tensor(b, a, async_op=True) for a, b in zip(ag_in, ag_out)],
    "event record+wait x291 (baseline)": lambda: [torch.cuda.current_stream().wait_event(torch.cuda.Event().record() or torch.cuda.Event()) for _ in ts] and None,
    "t.add_(1) x291 (kernel launch baseline)": lambda: [t.add_(1) for t in ts] and None,
    "torch._foreach_add_(291)": lambda: torch._foreach_add_(ts, 1) and None,
}
if os.environ.get("SPIN"): cases = {}
for _ in range(3):
    for f in cases.values(): t_of(f, 3)
res = {}
for name, f in cases.items():
    mn, md = t_of(f)
    per = N if "x291" in name else 1
    res[name] = (mn, md)
    print(f"{os.environ.get('LABEL','default'):28s} {name:42s} total min {mn:9.1f} us median {md:9.1f} us  per call {md/per:7.2f} us", flush=True)
if os.environ.get("SPIN"):
    # a long loop for py-spy: per-parameter async all-reduce, the overlapped variant's call
    end = time.time() + float(os.environ["SPIN"])
    while time.time() < end:
        ws = [pg.allreduce([t], o) for t in ts]
        for w in ws: w.wait()
        torch.cuda.synchronize()
dist.destroy_process_group()
