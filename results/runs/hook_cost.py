"""Issue 19: what one gradient hook costs in a backward, on the CPU and on a GPU (where autograd runs the backward of
CUDA tensors, hooks included, on a device thread of its own while the caller waits). 291 leaves of 4096 float32
elements (xl's parameter count), each used once; the backward of their weighted sum, timed on the host (the backward
call to its return, then a synchronisation, untimed), median of 30 after 5 warm-up passes, per kind of hook:

- none;
- `register_post_accumulate_grad_hook` (what the DDP and FSDP wrappers use), a hook that returns at once;
- `register_hook` on the tensor (runs before accumulation);
- a post hook on each leaf's AccumulateGrad node;
- `torch.autograd.graph.register_multi_grad_hook` over all leaves (one call, per-tensor hooks inside);
- on a GPU, `post_accumulate+allreduce`: the post-accumulate hook issues an async all-reduce of its gradient on an
  NCCL group of one (`ProcessGroup.allreduce`, the call `OverlappedDDP` makes), the works waited for after the
  backward, inside the timing: what a per-parameter collective costs from the autograd thread in a light backward.

`us/hook` is the case minus `none`, over 291. Cases alternate (5 rounds) so that drift spreads over all of them.

    python results/runs/hook_cost.py [cpu|cuda ...] > hook_cost_<host>.txt
"""
import statistics
import sys
import time

import torch

N, NUMEL, REPS, ROUNDS = 291, 4096, 30, 5


def accumulate_grad_node(p: torch.Tensor):
    return p.view_as(p).grad_fn.next_functions[0][0]


def case(kind: str, device: torch.device):
    params = [torch.zeros(NUMEL, device=device, requires_grad=True) for _ in range(N)]
    weights = [torch.full((NUMEL,), float(i + 1), device=device) for i in range(N)]
    keep = []  # hook handles and nodes, alive for the case's life
    noop = lambda *a: None  # noqa: E731
    if kind == "post_accumulate":
        keep = [p.register_post_accumulate_grad_hook(noop) for p in params]
    elif kind == "tensor_pre":
        keep = [p.register_hook(noop) for p in params]
    elif kind == "node_post":
        nodes = [accumulate_grad_node(p) for p in params]
        keep = nodes + [n.register_hook(noop) for n in nodes]
    elif kind == "multi_grad":
        keep = [torch.autograd.graph.register_multi_grad_hook(params, noop)]
    works: list = []
    if kind == "post_accumulate+allreduce":
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import AllreduceOptions

        opts = AllreduceOptions()
        opts.asyncOp = True
        group = dist.group.WORLD
        keep = [p.register_post_accumulate_grad_hook(lambda p: works.append(group.allreduce([p.grad], opts)))
                for p in params]

    def run() -> float:
        for p in params:
            p.grad = None
        loss = torch.stack([(p * w).sum() for p, w in zip(params, weights)]).sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss.backward()
        for work in works:
            work.wait()
        works.clear()
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (t1 - t0) * 1e6

    run.keep = keep
    return run


def main(devices: list[str]) -> None:
    kinds = ("none", "post_accumulate", "tensor_pre", "node_post", "multi_grad")
    for name in devices:  # every device checked before any is timed
        if name not in ("cpu", "cuda"):
            raise SystemExit(f"hook_cost.py: device {name!r} is not cpu or cuda")
        if name == "cuda" and not torch.cuda.is_available():
            raise SystemExit("hook_cost.py: cuda asked for, and this machine has no CUDA GPU")
    print(f"torch {torch.__version__}; {N} leaves of {NUMEL} fp32; backward host us, median of {REPS * ROUNDS}")
    for name in devices:
        device = torch.device(name, 0) if name == "cuda" else torch.device(name)
        names = kinds
        if name == "cuda":
            import os

            import torch.distributed as dist

            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")  # the flight recorder off, as the `alone` phase runs
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29571", rank=0, world_size=1,
                                    device_id=device)
            names = kinds + ("post_accumulate+allreduce",)
        runs = {k: case(k, device) for k in names}
        for run in runs.values():
            for _ in range(5):
                run()
        times = {k: [] for k in names}
        for _ in range(ROUNDS):
            for k, run in runs.items():
                times[k].extend(run() for _ in range(REPS))
        base = statistics.median(times["none"])
        print(f"\n{name}" + (f" ({torch.cuda.get_device_name(device)})" if name == "cuda" else ""))
        for k in names:
            med = statistics.median(times[k])
            print(f"  {k:<26} backward {med:9.1f} us   +{med - base:8.1f} us   {(med - base) / N:6.2f} us/hook")


if __name__ == "__main__":
    main(sys.argv[1:] or ["cpu"])
