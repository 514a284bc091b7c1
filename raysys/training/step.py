"""The training step under test: one step of a (wrapped) model in timed phases, and its compiled blocks.

`TrainStep` runs zero_grad -> forward + loss (autocast for bf16 / fp16) -> backward -> the wrapper's
`finish_gradient_synchronization()` (DDP, FSDP) -> optimizer step, and marks each boundary for
`raysys.measure.timing.time_steps`. `compile_blocks` compiles every TransformerBlock's forward in place. Invariants:
after `gradients()` every rank holds the averaged gradients; `compile_blocks` runs before a wrapper sees the model.

    compile_blocks(model)                                  # optional, before wrapping
    step = TrainStep(make_ddp("bucketed", model), optimizer, (x, y), "bf16", device)
    metrics = time_steps(step, warmup=2, steps=10)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from raysys.measure.device import autocast
from raysys.measure.timing import Marks
from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerBlock, TransformerLM, cross_entropy

LOSSES = ("fused", "materialized")


def gradients(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
              loss: str = "materialized", loss_impl: str = "auto", sync: Callable[[], None] | None = None,
              dtype: str = "fp32", marks: Marks | None = None) -> torch.Tensor:
    """The one training step up to the optimizer: zero_grad(set_to_none=True) -> the loss -> backward -> `sync()` (a
    data-parallel wrapper's gradient average); afterwards every parameter's `.grad` is set (and synced). `loss`:
    `materialized` (`cross_entropy(model(x), y)`) or `fused` (`model.loss`: LM head + loss in one op, `loss_impl`),
    under autocast for `dtype` bf16 / fp16. `marks` bound the phases (forward, backward, comm_wait). Returns the
    loss (detached)."""
    mark = marks.mark if marks is not None else lambda: None
    optimizer.zero_grad(set_to_none=True)
    mark()
    with autocast(x.device, dtype):
        if loss == "fused":
            value = model.loss(x, y, fused=True, impl=loss_impl)
        elif loss == "materialized":
            value = cross_entropy(model(x), y)
        else:
            raise ValueError(f"loss {loss!r} must be one of {LOSSES}")
    mark()
    value.backward()
    mark()
    if sync is not None:
        sync()
    mark()
    return value.detach()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               **kwargs) -> torch.Tensor:
    """`gradients(model, optimizer, x, y, **kwargs)`, then `optimizer.step()`; returns the loss (detached)."""
    value = gradients(model, optimizer, x, y, **kwargs)
    optimizer.step()
    return value


class TrainStep:
    """zero_grad -> forward + loss -> backward -> finish_gradient_synchronization -> optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch, dtype: str, device: torch.device):
        self.model, self.optimizer, self.batch, self.dtype, self.device = model, optimizer, batch, dtype, device
        self.finish = getattr(model, "finish_gradient_synchronization", lambda: None)

    def gradients(self, marks: Marks) -> None:
        """Everything before the optimizer step: afterwards every rank holds the averaged gradients."""
        x, y = self.batch
        gradients(self.model, self.optimizer, x, y, sync=self.finish, dtype=self.dtype, marks=marks)

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

    `forward` is compiled, not `_call_impl`: hooks a wrapper puts on a block (FSDP's gathers) stay eager, hooks on
    modules inside it (FSDP's casts) are traced into it. One graph per distinct setting (autocast dtype, grad mode,
    hooks) serves every block. Gradient hooks on parameters (DDP's) fire after the block's compiled backward.
    """
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    if not blocks:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no {block_type.__name__} module to compile")
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0, *,
                compile: bool = False) -> TransformerLM:
    """A fresh `TransformerLM` from `seed`, initialised directly on `device` in `dtype` (None: fp32; no copy on the
    host), its blocks compiled under `compile` (before any wrapper, so every variant runs the same blocks and the
    wrappers' hooks stay eager). Every study and the leaderboard build their models here."""
    torch.manual_seed(seed)
    model = TransformerLM(config, device=device, dtype=dtype)
    if compile:
        compile_blocks(model)
    return model
