"""The training step under test: one step of a (wrapped) model in timed phases, and its compiled blocks.

`TrainStep` runs zero_grad -> forward + loss (autocast for bf16 / fp16, `raysys.measure.device.autocast`) -> backward ->
the wrapper's `finish_gradient_synchronization()` (DDP, FSDP; nothing for a plain model) -> optimizer step, and
marks each boundary, so `raysys.measure.timing.time_steps` splits its time into forward, backward, comm_wait and
optimizer. `compile_blocks` compiles every TransformerBlock's forward in place (the sweeps' `--compile`).

Invariants: after `TrainStep.gradients()` every rank holds the averaged gradients; `compile_blocks` runs before a
wrapper (DDP, FSDP) sees the model and after any `copy.deepcopy` of it.

    compile_blocks(model)                                  # optional, before wrapping
    step = TrainStep(make_ddp("bucketed", model), optimizer, (x, y), "bf16", device)
    metrics = time_steps(step, warmup=2, steps=10)         # raysys.measure.timing
"""

from __future__ import annotations

import torch
from torch import nn

from raysys.measure.device import autocast
from raysys.model.transformer import TransformerBlock, cross_entropy
from raysys.measure.timing import Marks


class TrainStep:
    """zero_grad -> forward + loss -> backward -> finish_gradient_synchronization -> optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch, dtype: str, device: torch.device):
        self.model, self.optimizer, self.batch, self.dtype, self.device = model, optimizer, batch, dtype, device
        self.finish = getattr(model, "finish_gradient_synchronization", lambda: None)

    def gradients(self, marks: Marks) -> None:
        """Everything before the optimizer step: afterwards every rank holds the averaged gradients."""
        x, y = self.batch
        self.optimizer.zero_grad(set_to_none=True)
        marks.mark()
        with autocast(self.device, self.dtype):
            loss = cross_entropy(self.model(x), y)
        marks.mark()
        loss.backward()
        marks.mark()
        self.finish()
        marks.mark()

    def __call__(self) -> Marks:
        """One step; the marks bound PHASES (read their durations after the device is synchronised)."""
        marks = Marks(self.device)
        self.gradients(marks)
        self.optimizer.step()
        marks.mark()
        return marks


def compile_blocks(model: nn.Module, block_type: type[nn.Module] = TransformerBlock, *,
                   backend: str = "inductor") -> int:
    """Compile the `forward` of every `block_type` module of `model` in place (`torch.compile` with `backend`);
    returns how many. Before wrapping the model, so DDP / FSDP see the same modules and parameters, and after any
    `copy.deepcopy` of it (a copy's `forward` would still be the original block's).

    `forward`, not `Module.compile()` (which compiles `_call_impl`, hooks included): the module hooks a wrapper
    puts on a block (FSDP's and FSDP2's gathers around it, parallel/fsdp.py) stay eager, outside the graph; hooks
    on modules inside a block (FSDP's compute-dtype casts) are traced into it. The blocks share one code object,
    so Dynamo compiles once per distinct setting (autocast dtype, grad mode, hooks) and every block reuses it;
    `time_steps`' warm-up steps absorb the compilation. Gradient hooks on parameters (DDP's) fire after the
    block's compiled backward, i.e. per block instead of per parameter (torch's DDP hooks alike).
    """
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    if not blocks:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no {block_type.__name__} module to compile")
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)
