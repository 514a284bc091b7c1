"""Issue 19: where a DDP wrapper's extra host time goes in an eager (or `--compile`: compiled-block) bf16 step, on an
NCCL group of one issuing a larger group's collectives (`collectives_alone`): xl at context 512, 2 sequences, the
`ddp_alone` study's setting. `single` and the wrapped model live side by side in one process, so every comparison is
paired in time:

1. host ms per phase (forward, backward, finish, optimizer) and the process's CPU ms per step, median over
   `--rounds` alternating blocks of 3 steps: single, the wrapper, the wrapper inside `no_sync()` (its hooks run and
   return at once: no collective, no wait);
2. torch.profiler's CPU ops over 3 steps of each, and the ops whose self CPU time per step differs most between the
   wrapper and single (with their calls per step);
3. the same with Python's functions recorded (`with_stack`: every thread, the autograd thread that runs the hooks
   included, which cProfile would not see), the functions and ops whose self time differs most;
4. the Python threads alive (another thread that wants the GIL makes every GIL release of the hooks' collective
   calls a possible switch).

    PYTHONPATH=$PWD python3 results/runs/ddp_host_profile.py overlapped,bucketed:1000 > ddp_host_profile.txt
    PYTHONPATH=$PWD python3 results/runs/ddp_host_profile.py overlapped --compile --rounds 12 --no-profile
"""
import argparse
import os
import re
import shutil
import statistics
import sys
import threading
import time

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")  # the flight recorder off, as the `alone` phase runs it
os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from raysys.device import synchronize  # noqa: E402
from raysys.train_step import TrainStep  # noqa: E402
from sweeps.common import adamw_kwargs, build_model  # noqa: E402
from sweeps.ddp import DDPTrial, parse_variant, wrap  # noqa: E402

PHASES = ("forward", "backward", "finish", "optimizer")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="?", default="overlapped,bucketed:1000",
                   help="comma list of sweeps/ddp.py variants other than single")
    p.add_argument("--compile", action="store_true", help="compiled blocks (the ddp_alone_compiled setting)")
    p.add_argument("--rounds", type=int, default=10, help="alternating blocks of 3 steps per case (>= 2)")
    p.add_argument("--no-profile", action="store_true", help="phases only: no profiles")
    args = p.parse_args(argv)
    specs = [v for v in args.variants.split(",") if v.strip()]
    if not specs:
        p.error("variants: name at least one variant")
    args.parsed = []
    for spec in specs:
        try:
            parsed = parse_variant(spec)
        except ValueError as e:
            p.error(str(e))
        if parsed["variant"] == "single":
            p.error(f"variants: {spec!r} is the reference, always run; name wrappers only")
        args.parsed.append(parsed)
    if args.rounds < 2:
        p.error(f"--rounds ({args.rounds}) must be >= 2")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (an NCCL group of one); this machine has none")
    return args


def trial_of(parsed: dict, compile: bool) -> DDPTrial:
    return DDPTrial(size="xl", context_length=512, batch_per_rank=2, dtype="bf16", profile=False, warmup=2, steps=4,
                    max_steps=4, compile=compile, collectives_alone=True, **{"nccl_max_ctas": None, **parsed})


def make_step(trial: DDPTrial, device: torch.device) -> TrainStep:
    model = wrap(trial, build_model(trial.model_config(), device, seed=0, compile=trial.compile), dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(device))
    step = TrainStep(model, optimizer, trial.batch(device, 0), trial.dtype, device)
    for _ in range(3):  # compiled, allocated, AdamW state built
        step()
    synchronize(device)
    return step


def unsynced(step: TrainStep):
    """A step of the wrapped model inside `no_sync()`: the hooks run and return; no collective, no wait."""
    def run():
        with step.model.no_sync():
            return step()
    return run


def block(run, device: torch.device, n: int = 3) -> list[list[float]]:
    """`n` steps; per step the host ms of each phase and the process CPU ms of the whole step."""
    rows = []
    for _ in range(n):
        cpu0 = time.process_time()
        marks = run()
        cpu = (time.process_time() - cpu0) * 1e3
        synchronize(device)
        rows.append([*marks.host_ms(), cpu])
    return rows


def phases_table(cases: dict, device: torch.device, rounds: int) -> None:
    samples: dict[str, list[list[float]]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            samples[name].extend(block(run, device))
    base = None
    print(f"host ms per phase, median of {3 * rounds} steps in {rounds} alternating blocks; cpu: process CPU ms "
          f"per step (all threads)")
    print(f"{'case':<34}" + "".join(f"{p:>11}" for p in (*PHASES, "host sum", "cpu")) + f"{'sum - single':>14}")
    for name, rows in samples.items():
        med = [statistics.median(r[i] for r in rows) for i in range(len(PHASES))]
        host = statistics.median(sum(r[:len(PHASES)]) for r in rows)
        cpu = statistics.median(r[len(PHASES)] for r in rows)
        base = host if base is None else base
        print(f"{name:<34}" + "".join(f"{v:>11.2f}" for v in (*med, host, cpu)) + f"{host - base:>+14.2f}")


def op_times(run, device: torch.device, steps: int = 3, with_stack: bool = False) -> tuple[dict, str]:
    with profile(activities=[ProfilerActivity.CPU], with_stack=with_stack) as prof:
        for _ in range(steps):
            run()
        synchronize(device)
    averages = prof.key_averages()
    ops: dict[str, tuple[float, float]] = {}
    for e in averages:  # Python frames name their object's address: merge those across objects
        key = re.sub(r" object at 0x[0-9a-f]+", "", e.key)
        us, calls = ops.get(key, (0.0, 0.0))
        ops[key] = (us + e.self_cpu_time_total / steps, calls + e.count / steps)
    return ops, averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)


def diff_table(single: dict, other: dict, name: str, rows: int = 20) -> None:
    keys = set(single) | set(other)
    delta = {k: other.get(k, (0.0, 0.0))[0] - single.get(k, (0.0, 0.0))[0] for k in keys}
    total = sum(delta.values())
    print(f"\nself CPU us per step, {name} minus single (sum of all ops {total:+.0f} us; profiler overhead included)")
    print(f"{'op':<62}{'single us':>11}{'calls':>8}{name[:10]:>11}{'calls':>8}{'delta us':>11}")
    for k in sorted(keys, key=lambda k: -abs(delta[k]))[:rows]:
        s, o = single.get(k, (0.0, 0.0)), other.get(k, (0.0, 0.0))
        print(f"{k[:61]:<62}{s[0]:>11.0f}{s[1]:>8.0f}{o[0]:>11.0f}{o[1]:>8.0f}{delta[k]:>+11.0f}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29563", rank=0, world_size=1, device_id=device)
    env = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_"))}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, group of one, collectives_alone, "
          f"{'compiled blocks' if args.compile else 'eager'}, bf16 xl context 512, 2 sequences; env {env}")
    single = make_step(trial_of(parse_variant("single"), args.compile), device)
    print("Python threads:", ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate()),
          f"; OS threads of the process: {len(os.listdir('/proc/self/task'))}; py-spy: {shutil.which('py-spy')}")
    for parsed in args.parsed:
        trial = trial_of(parsed, args.compile)
        wrapped = make_step(trial, device)
        print(f"\n=== {trial.label} ({type(wrapped.model).__name__}, "
              f"{getattr(wrapped.model, 'num_collectives', '?')} collectives a step)")
        cases = {"single": single, trial.label: wrapped}
        if hasattr(wrapped.model, "no_sync") and trial.variant != "torch":
            cases[f"{trial.label}, no_sync (hooks only)"] = unsynced(wrapped)
        phases_table(cases, device, args.rounds)
        if not args.no_profile:
            single_ops, _ = op_times(single, device)
            ops, table = op_times(wrapped, device)
            print(f"\ntorch.profiler, {trial.label}, self CPU over 3 steps:\n{table}")
            diff_table(single_ops, ops, trial.label)
            single_ops, _ = op_times(single, device, with_stack=True)
            ops, _ = op_times(wrapped, device, with_stack=True)
            print("\nwith Python functions (with_stack; the tracer's own cost inflates every Python frame):")
            diff_table(single_ops, ops, trial.label, rows=30)
        del wrapped, cases
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
