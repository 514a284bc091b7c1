"""Issue 19: do the project's hook-driven DDP wrappers run under compiled autograd (`torch._dynamo.compiled_autograd`),
the lever the issue lists for the communication-free parts of a step? CPU, gloo, a group of one issuing a larger
group's collectives (`collectives_alone=True`), a toy MLP of 17 parameters; the gradients of each run are compared
bitwise with those of the plain module, eager and under compiled autograd (Dynamo's `eager` backend):

    PYTHONPATH=$PWD python3 results/runs/compiled_autograd_ddp_check.py > compiled_autograd_ddp_check.txt
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo import compiled_autograd

from parallel.ddp import make_ddp

STEPS = 3


def toy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)], nn.Linear(64, 1))


def grads(kind: str | None, compiled: bool, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients after STEPS steps of `kind` (None: the plain module), each from zero."""
    module = toy()
    wrapper = make_ddp(kind, module, collectives_alone=True) if kind else module
    torch._dynamo.reset()
    for _ in range(STEPS):
        for p in module.parameters():
            p.grad = None
        loss = wrapper(x).square().mean()
        if compiled:
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
        else:
            loss.backward()
        if kind:
            wrapper.finish_gradient_synchronization()
    return [p.grad for p in module.parameters()]


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29777")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torch {torch.__version__}, gloo, a group of one through the collectives")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    reference = grads(None, False, x)
    print(f"plain module under compiled autograd: bitwise {all(map(torch.equal, reference, grads(None, True, x)))}")
    for kind in ("overlapped", "bucketed"):
        for compiled in (False, True):
            label = f"{kind:10s} {'compiled autograd' if compiled else 'eager autograd':18s}"
            try:
                same = all(map(torch.equal, reference, grads(kind, compiled, x)))
                print(f"{label} ran; gradients bitwise equal to the plain module's: {same}")
            except Exception as e:  # noqa: BLE001 - the finding is the error itself
                first = str(e).strip().splitlines()
                print(f"{label} failed: {type(e).__name__}: {' / '.join(line.strip() for line in first[:3])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
