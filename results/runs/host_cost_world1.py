"""Host cost per step of the DDP / FSDP wrappers on a group of one (gloo, CPU), issue 19's measurement before changing
anything: a model with xl's 291 parameters (32 blocks) but tiny dims, so compute is negligible and what is timed is
Python, dispatch and the wrappers' collectives. Process CPU time per phase: the median of each block of steps, blocks
of the variants interleaved, the fastest block kept (a shared, loaded host disturbs the others); `delta` is the
variant minus `single` (`single_bf16`: autocast, for `fsdp_bf16`).
`--hooks`: backward of 291 leaves, each used once, with each kind of gradient hook, per parameter.

    python results/runs/host_cost_world1.py                    # the wrappers in this checkout
    git archive 25ed37f parallel | tar -x -C /tmp/before
    HOST_COST_ROOT=/tmp/before python results/runs/host_cost_world1.py  # the wrappers before issue 19's change
    python results/runs/host_cost_world1.py --hooks
    python results/runs/host_cost_world1.py --collectives-alone --profile  # the collective path on a group of one
"""
import argparse, gc, os, statistics, sys, tempfile, time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.environ.get("HOST_COST_ROOT", str(ROOT)))  # where `parallel` comes from

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.ddp import make_ddp  # noqa: E402
from parallel.fsdp import make_fsdp  # noqa: E402
from raysys.config import ModelConfig  # noqa: E402
from raysys.model import TransformerBlock, TransformerLM, cross_entropy  # noqa: E402

MC = ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=32, num_heads=2, d_ff=32, name="xl-shaped")
PHASES = ("forward", "backward", "finish", "optimizer", "step")


ALONE: dict = {}  # {"collectives_alone": True} with --collectives-alone (the wrappers of this checkout only)


def build(variant: str):
    torch.manual_seed(0)
    model = TransformerLM(MC)
    if variant.startswith("single"):
        return model
    if variant.startswith("fsdp"):
        dtype = torch.bfloat16 if variant.endswith("bf16") else None
        return make_fsdp("fsdp", model, compute_dtype=dtype, units=(TransformerBlock,), **ALONE)
    kind, _, mb = variant.partition(":")
    if kind == "torch":
        return make_ddp("torch", model, broadcast_buffers=False)
    return make_ddp(kind, model, **({"bucket_size_mb": float(mb)} if mb else {}), **ALONE)


class Step:
    def __init__(self, variant: str):
        self.model = build(variant)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.finish = getattr(self.model, "finish_gradient_synchronization", lambda: None)
        self.autocast = variant == "single_bf16"
        tokens = torch.randint(0, MC.vocab_size, (1, MC.context_length + 1), generator=torch.Generator().manual_seed(0))
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

    def __call__(self) -> list[float]:
        t = [time.process_time()]
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = cross_entropy(self.model(self.x), self.y)
        t.append(time.process_time())
        loss.backward()
        t.append(time.process_time())
        self.finish()
        t.append(time.process_time())
        self.opt.step()
        t.append(time.process_time())
        return [b - a for a, b in zip(t, t[1:])] + [t[-1] - t[0]]


def wrappers(variants: list[str], steps: int, rounds: int, profile: bool = False) -> None:
    built = {v: Step(v) for v in variants}
    for step in built.values():
        for _ in range(5):
            step()
    blocks: dict[str, list] = {v: [] for v in variants}  # per round, the block's median per phase
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            built[v]()
            block = [built[v]() for _ in range(steps)]
            blocks[v].append([statistics.median(s[i] for s in block) for i in range(len(PHASES))])
    # The fastest round per phase: the one least disturbed by other work on a shared host.
    med = {v: [min(b[i] for b in blocks[v]) * 1e6 for i in range(len(PHASES))] for v in variants}
    print(f"{'us per step':16s}" + "".join(f"{p:>10s}" for p in PHASES))
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        for v in variants:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    built[v]()
            for e in prof.key_averages():
                if e.key.startswith("c10d::"):
                    per_call = e.cpu_time_total / e.count
                    print(f"{v:16s} {e.key:48s} {e.count / 5:6.1f} calls/step {per_call:8.1f} us/call")
    for v in variants:
        ref = med["single_bf16" if v.endswith("bf16") and "single_bf16" in med else "single"]
        print(f"{v:16s}" + "".join(f"{m:10.0f}" for m in med[v]))
        if not v.startswith("single"):
            print(f"{'  delta':16s}" + "".join(f"{m - r:10.0f}" for m, r in zip(med[v], ref)))


def hooks(num_params: int = 291, reps: int = 100, rounds: int = 9) -> None:
    from parallel.carveout import SMCarveout
    from parallel.ddp import _Bucket, _Reducer

    def backward_us(params, after=lambda: None) -> float:
        x, times = torch.ones(4), []
        for _ in range(reps):
            for p in params:
                p.grad = None
            loss = torch.stack([(p * x).sum() for p in params]).sum()
            t0 = time.process_time()
            loss.backward()
            times.append(time.process_time() - t0)
            after()
        return statistics.median(times) * 1e6

    def leaves():
        return [torch.zeros(4, requires_grad=True) for _ in range(num_params)]

    def grad_ready(bucket_per_param: bool):
        ps = leaves()
        buckets = [[p] for p in ps] if bucket_per_param else [ps]
        red = _Reducer(None, [_Bucket(b, copy=False) for b in buckets], SMCarveout(None), True)  # a group of one
        for i, p in enumerate(ps):
            p.register_post_accumulate_grad_hook(partial(red.grad_ready, i, 0) if bucket_per_param
                                                 else partial(red.grad_ready, 0, i))
        return ps, red.reset

    def multi(per: int):
        ps = leaves()
        for i in range(0, num_params, per):
            torch.autograd.graph.register_multi_grad_hook(ps[i:i + per], lambda grads: None)
        return ps, lambda: None

    def empty():
        ps = leaves()
        for p in ps:
            p.register_post_accumulate_grad_hook(lambda p: None)
        return ps, lambda: None

    cases = {"no hook": lambda: (leaves(), lambda: None), "post-accumulate hook, empty": empty,
             "post-accumulate, DDP grad_ready, 1 bucket": lambda: grad_ready(False),
             "post-accumulate, DDP grad_ready, bucket/param": lambda: grad_ready(True),
             f"register_multi_grad_hook, 1 over all {num_params}": lambda: multi(num_params),
             "register_multi_grad_hook, 1 per 9 (a block)": lambda: multi(9)}
    backward_us(leaves())
    res: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, make in cases.items():
            res[name].append(backward_us(*make()))
    base = min(res["no hook"])  # the fastest round: the least disturbed by other work on a shared host
    for name, values in res.items():
        m = min(values)
        print(f"{name:48s} backward {m:7.0f} us  {(m - base) / num_params:+6.2f} us/parameter "
              f"(rounds {min(values):.0f}-{max(values):.0f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="single,overlapped,bucketed:1000,torch,fsdp,single_bf16,fsdp_bf16",
                   help="comma list: single, single_bf16, overlapped, bucketed:MB, naive, flat, torch, fsdp, fsdp_bf16")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=6, help="blocks per variant, in alternating order")
    p.add_argument("--hooks", action="store_true", help="time the gradient hooks alone instead")
    p.add_argument("--collectives-alone", action="store_true", help="the project's wrappers issue a larger group's "
                   "collectives on the group of one (collectives_alone=True) instead of being the identity")
    p.add_argument("--profile", action="store_true", help="also profile 5 steps of each variant (torch.profiler, CPU): "
                   "calls per step and mean CPU time per call of the process-group ops")
    args = p.parse_args()
    if args.collectives_alone:
        ALONE["collectives_alone"] = True
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    gc.disable()
    try:
        hooks() if args.hooks else wrappers(args.variants.split(","), args.steps, args.rounds, args.profile)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
