"""The leaderboard training step (handout section 9): one step of the basics LM composed from the project's parts.

A step is `zero_grad(set_to_none=True)`, the loss, `backward()`, (a data-parallel gradient sync), `optimizer.step()`.
`StepConfig` chooses each part (attention backend, fused or materialised loss, fused / foreach / reference AdamW,
optimizer in backward, recompute plan, compiled pieces, lean blocks) and `LeaderboardStep` applies them in one
place, in torchtitan's order (checkpointing, then compile and lean blocks, then the optimizer). Invariant: loss and
gradients are the reference step's (`cross_entropy(model(x), y)`, `AdamW.step()`) up to floating-point
reassociation. `TODAY` is the composition before this module existed; `StepConfig()` is the fast one.

    step = LeaderboardStep(model, StepConfig(), batch_size=1, seq_len=32768)
    loss = step(x, y)                                   # one full training step
    step.close()                                        # the model is as it was (the optimizer state stays)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.checkpointing import (CheckpointHandle, OffloadForward, apply_activation_checkpointing, class_forward,
                                    parse_policy)
from raysys.measure.device import DTYPES, machine_memory_bytes
from raysys.model.config import ModelConfig
from raysys.model.transformer import (AdamW, RMSNorm, RotaryEmbedding, SwiGLU, TransformerBlock, TransformerLM,
                                      fused_loss_kernel, get_attention, silu)
from raysys.planning.advisor import KINDS
from raysys.training.step import LOSSES, gradients

LOSS_IMPLS = ("auto", "triton", "torch")
OPTIMIZERS = ("fused", "foreach", "reference")
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
COMPILED_MODULES = (RMSNorm, RotaryEmbedding, SwiGLU)
"""Module types `compile_pieces` compiles: their elementwise work fuses; their matmuls stay cuBLAS calls."""
RECOMPILE_LIMIT = 64
"""Graphs Dynamo may keep per compiled piece (one per input shape / grad mode)."""


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How one training step is composed (see the module docstring)."""

    attention: str = "flash_triton"
    """Attention backend registered in `raysys.model.transformer`."""
    loss: str = "fused"
    """fused: `model.loss(x, y)` (no logits); materialized: `cross_entropy(model(x), y)`."""
    loss_impl: str = "auto"
    """Fused loss implementation: triton (`kernels/fused_linear_ce.py`), torch (chunked), auto (triton on CUDA)."""
    optimizer: str = "fused"
    """fused (`kernels.adamw.FusedAdamW`), foreach (`kernels.adamw.ForeachAdamW`) or reference
    (`raysys.model.transformer.AdamW`)."""
    recompute: str = "advisor"
    """`advisor` (the advisor's per-layer plan for this step) or a `parallel.checkpointing.parse_policy` spec."""
    recompute_kinds: tuple = ("none", "ffn", "full", "offload")
    """Per-block kinds the advisor may choose from (`raysys.planning.advisor.KINDS`, with `none`); offload on CUDA only,
    planned with the host link measured (`plan_on_device`)."""
    optimizer_in_backward: bool = False
    """Step each parameter's AdamW as soon as backward has written its gradient, then free the gradient
    (`OptimizerInBackward`): no step after backward, and about one block's gradients alive instead of all."""
    compile: bool = True
    """Compile RMSNorm, RoPE and SwiGLU (`compile_pieces`)."""
    lean: bool | None = None
    """Blocks keep only what elementwise recomputation cannot give back (`lean_blocks`; compiled graphs, so it
    needs `compile`); None: lean exactly when compiled."""
    compile_backend: str = "inductor"
    """`torch.compile` backend of the pieces (the CPU tests use `aot_eager_decomp_partition`: same partitioner)."""
    gpu_memory: int | None = None
    """Device bytes the advisor plans for (default: the device's total memory)."""

    def __post_init__(self):
        for name, allowed in (("loss", LOSSES), ("loss_impl", LOSS_IMPLS), ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} must be one of {allowed}")
        get_attention(self.attention)
        object.__setattr__(self, "recompute_kinds", tuple(self.recompute_kinds))
        if not set(self.recompute_kinds) <= set(KINDS) or "none" not in self.recompute_kinds:
            raise ValueError(f"recompute_kinds {self.recompute_kinds} must be a subset of {KINDS} containing 'none'")
        if self.recompute != "advisor":
            parse_policy(self.recompute, 1 if "*" not in self.recompute else _count_layers(self.recompute))
        if self.gpu_memory is not None and self.gpu_memory <= 0:
            raise ValueError(f"gpu_memory ({self.gpu_memory}) must be positive")
        if self.lean is None:
            object.__setattr__(self, "lean", self.compile)
        if self.lean and not self.compile:
            raise ValueError("lean blocks are compiled graphs: lean=True needs compile=True")

    def replace(self, **changes) -> "StepConfig":
        """A copy with `changes`; changing `compile` alone makes `lean` follow it again."""
        if "compile" in changes and "lean" not in changes:
            changes["lean"] = None
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _count_layers(spec: str) -> int:
    """Blocks a per-layer spec (`full*8+none*26`) covers (its own validation happens in parse_policy)."""
    try:
        return sum(int(part.partition("*")[2]) for part in spec.split("+"))
    except ValueError:
        raise ValueError(f"recompute spec {spec!r} must be NAME*COUNT+... with integer counts") from None


TODAY = StepConfig(attention="flash_triton", loss="materialized", optimizer="reference", recompute="full",
                   compile=False)
"""The baseline composition: flash_triton, full checkpointing, materialised logits, per-parameter AdamW, nothing
compiled."""


# ------------------------------------------------------------------------------------------------------------
# The parts.

def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    """AdamW with the reference defaults, implemented as `kind` (fused | foreach | reference)."""
    if kind == "fused":
        try:
            from kernels.adamw import FusedAdamW
        except ImportError as exc:
            raise ValueError(f"optimizer 'fused' needs kernels/adamw.py, which does not import ({exc})") from None
        return FusedAdamW(params)
    if kind == "foreach":
        from kernels.adamw import ForeachAdamW

        return ForeachAdamW(params)
    if kind == "reference":
        return AdamW(params)
    raise ValueError(f"optimizer {kind!r} must be one of {OPTIMIZERS}")


def resolved_loss_impl(config: StepConfig, device: torch.device) -> str:
    """What computes the loss on `device`: materialized, triton or torch (the `auto` choice made explicit)."""
    if config.loss == "materialized":
        return "materialized"
    if config.loss_impl != "auto":
        return config.loss_impl
    return "triton" if device.type == "cuda" and fused_loss_kernel() is not None else "torch"


def _compile(fn, backend: str):
    """`fn` compiled whole (fullgraph, static shapes), Dynamo allowed `RECOMPILE_LIMIT` graphs per compiled piece."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


@dataclass
class CompiledPieces:
    """The modules whose `forward` `compile_pieces` replaced; `remove()` restores them."""

    modules: list[nn.Module]
    backend: str

    def remove(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []


def compile_pieces(model: nn.Module, backend: str = "inductor") -> CompiledPieces:
    """Compile the `forward` of every RMSNorm, RotaryEmbedding and SwiGLU of `model` (fullgraph, static shapes):
    one graph per class, input shape and grad mode, shared by every layer (Dynamo's recompile limit raised to
    `RECOMPILE_LIMIT`). Blocks and attention keep their own forward, so activation checkpointing composes."""
    modules = [m for m in model.modules() if isinstance(m, COMPILED_MODULES)]
    for m in modules:
        if "forward" in m.__dict__:
            raise ValueError(f"{type(m).__name__} already has an instance-level forward; refusing to compile over it")
    for m in modules:
        m.forward = _compile(m.forward, backend)
    return CompiledPieces(modules, backend)


def _gate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gated product silu(w1 x) * w3 x."""
    return silu(a) * b


def lean_attention_inputs(attn: nn.Module, ln1: RMSNorm, x: torch.Tensor, positions: torch.Tensor):
    """q, k, v of `attn(ln1(x))` (RoPE applied) as contiguous (B, S, H, D) tensors, so the caller's transpose to
    (B, H, S, D), attention's O in that layout and the merge of its heads are views; ln1's output is recomputed in
    backward (only x is kept)."""
    n = checkpoint(class_forward, ln1, x, use_reentrant=False)
    rope, heads = attn.positional_encoder, (attn.num_heads, attn.d_head)
    q, k, v = (class_forward(proj, n).unflatten(-1, heads) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = (class_forward(rope, t.transpose(-3, -2), positions).transpose(-3, -2).contiguous() for t in (q, k))
    return q, k, v


def lean_ffn_branch(ln2: RMSNorm, ffn: SwiGLU, h: torch.Tensor) -> torch.Tensor:
    """ffn(ln2(h)) keeping h, w1 x and w3 x: ln2's output and the gated product are recomputed in backward."""
    n = checkpoint(class_forward, ln2, h, use_reentrant=False)
    a, b = class_forward(ffn.w1, n), class_forward(ffn.w3, n)
    return class_forward(ffn.w2, checkpoint(_gate, a, b, use_reentrant=False))


class _LeanBlockForward:
    """`TransformerBlock.forward` with the attention inputs from the compiled `lean_attention_inputs`; the block's
    (possibly checkpointed) `ffn_branch` after it. Inputs the lean graph does not cover (no RoPE, positions other
    than one (S,) row, not (B, S, d)) take the class forward."""

    def __init__(self, block: nn.Module, compiled):
        self.block, self.compiled = block, compiled

    def __call__(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        block = self.block
        attn = block.attn
        if attn.positional_encoder is None or x.dim() != 3 or (token_positions is not None
                                                                and token_positions.dim() != 1):
            return class_forward(block, x, token_positions)
        if token_positions is None:
            token_positions = torch.arange(x.shape[-2], device=x.device)
        q, k, v = (t.transpose(-3, -2) for t in self.compiled(attn, block.ln1, x, token_positions))
        out = get_attention(attn.attention)(q, k, v, True)
        h = x + attn.output_proj(out.transpose(-3, -2).flatten(-2))
        return h + block.ffn_branch(h)


@dataclass
class LeanBlocks:
    """The instance attributes `lean_blocks` installed; `remove()` restores the blocks."""

    patched: list[tuple[nn.Module, str]]
    offloaded: list = dataclasses.field(default_factory=list)
    """Offloaded blocks' forwards (`parallel.checkpointing`) whose inner forward is the lean one."""

    def remove(self) -> None:
        for module, attr in self.patched:
            module.__dict__.pop(attr, None)
        for forward in self.offloaded:
            forward.inner = None
        self.patched, self.offloaded = [], []


def lean_blocks(model: nn.Module, backend: str = "inductor") -> LeanBlocks:
    """Give every `TransformerBlock` of `model` the lean forward and feed-forward branch (module docstring),
    where activation checkpointing has not installed its own: a fully checkpointed block keeps its segment
    forward (its lean savings would not outlive the recomputation) but gets the lean branch, an ffn block keeps its
    checkpointed branch but gets the lean forward, an offloaded block runs the lean forward inside the store's
    hooks (less to copy). Two compiled graphs, shared by every block (the modules are graph inputs)."""
    attention_inputs, ffn_branch = _compile(lean_attention_inputs, backend), _compile(lean_ffn_branch, backend)
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, TransformerBlock)]
    hooked = [f"{name}.{sub}" for name, block in blocks for sub, m in block.named_modules()
              if sub and (m._forward_pre_hooks or m._forward_hooks)]
    if hooked:  # e.g. FSDP's per-Linear all-gathers: the lean graphs call the submodules' code, not the modules
        raise ValueError(f"lean blocks run {hooked[0]}'s code inside a compiled graph, so its module hooks would "
                         f"not run ({len(hooked)} hooked submodule(s)); use StepConfig(lean=False) with them")
    patched, offloaded = [], []
    for _, block in blocks:
        if "ffn_branch" not in block.__dict__:
            block.ffn_branch = functools.partial(ffn_branch, block.ln2, block.ffn)
            patched.append((block, "ffn_branch"))
        forward = block.__dict__.get("forward")
        if forward is None:
            block.forward = _LeanBlockForward(block, attention_inputs)
            patched.append((block, "forward"))
        elif isinstance(forward, OffloadForward) and forward.inner is None:  # the lean forward under its hooks
            forward.inner = _LeanBlockForward(block, attention_inputs)
            offloaded.append(forward)
    return LeanBlocks(patched, offloaded)


def model_dtype_name(model: nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"parameter dtype {dtype} must be one of {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dtype]


ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's setting for the step (expandable segments: the plan fills the device to within the
advisor's margin, which fixed-size segments fragment)."""
ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The environment variables through which a process configures the allocator itself (then the step leaves it)."""
_log = logging.getLogger("raysys")


def allocator_settings(device: torch.device) -> str:
    """The caching allocator's settings the step runs under on `device`: the process's own (`ALLOC_ENV`, also when
    empty), else `ALLOC_CONF`, applied to what is allocated from the first call on (the segments that hold the model
    already stay as they are) with one logged line. '' off CUDA."""
    if device.type != "cuda":
        return ""
    for name in ALLOC_ENV:
        if name in os.environ:
            return os.environ[name]
    if not _ALLOCATOR_SET:
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        with warnings.catch_warnings():  # torch >= 2.13 deprecates the cuda-specific name for the one above
            warnings.simplefilter("ignore", FutureWarning)
            (setter or torch.cuda.memory._set_allocator_settings)(ALLOC_CONF)
        torch.cuda.empty_cache()  # the fixed segments' cached free blocks go back to the device
        _ALLOCATOR_SET.append(ALLOC_CONF)
        _log.warning("raysys: the CUDA caching allocator now uses %s for the leaderboard step (no PYTORCH_ALLOC_CONF "
                     "set; set it to choose otherwise)", ALLOC_CONF)
    return ALLOC_CONF


_ALLOCATOR_SET: list[str] = []
"""What `allocator_settings` applied in this process (once)."""


HOST_MEMORY_SHARE = 0.5
"""Share of the host's physical memory offloaded activations may pin (the rest is the host's), split evenly
between the host's GPUs (one process each, as the data-parallel step runs)."""


@functools.lru_cache(maxsize=None)
def host_link_gbps(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """GB/s of a pinned host <-> `device` copy, the slower direction (what offload's copies get), measured once
    per device and process."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates.append(3 * nbytes / (time.perf_counter() - start) / 1e9)
    return min(rates)


def plan_step(model_config: ModelConfig, batch_size: int, seq_len: int, config: StepConfig, *, dtype: str,
              device_type: str, gpu_memory: int, shards: int = 1, link_gbps: float | None = None,
              host_memory: int | None = None, attention_kernels: str = ""):
    """The advisor's per-layer recompute plan for this step: pure `dtype` weights (or fp32 masters sharded over
    `shards` ranks), the step's loss, optimizer, attention (and for flash_triton the `attention_kernels` its dispatch
    runs) and compiled pieces, `gpu_memory` device bytes. Offloaded blocks are considered on CUDA when the host
    link's speed (`link_gbps`) is given, with at most `host_memory` bytes of them on the host."""
    from raysys.planning.advisor import advise

    kinds = config.recompute_kinds
    if device_type != "cuda" or link_gbps is None:
        kinds = tuple(k for k in kinds if k != "offload")
    param_dtype = "fp32" if shards > 1 else dtype
    return advise(model_config, batch_size, gpu_memory, dtype, seq_len=seq_len, attention=config.attention,
                  param_dtype=param_dtype, loss="fused" if config.loss == "fused" else "materialized",
                  compiled=config.compile, optimizer=config.optimizer, shards=shards, device_type=device_type,
                  kinds=kinds, optimizer_in_backward=config.optimizer_in_backward, lean=config.lean,
                  **({"pcie_gbps": link_gbps} if link_gbps else {}), host_memory_bytes=host_memory,
                  attention_kernels=attention_kernels)


def plan_on_device(model_config: ModelConfig, batch_size: int, seq_len: int, config: StepConfig, *, dtype: str,
                   device: torch.device, shards: int = 1):
    """`plan_step` for `device` as it is: its memory (the host's for the CPU; or `config.gpu_memory`), and on CUDA,
    when the kinds allow offload, the host link measured (`host_link_gbps`) and this GPU's part of
    `HOST_MEMORY_SHARE` of the host's memory."""
    link, host, memory = None, None, config.gpu_memory
    if memory is None:
        memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                  else machine_memory_bytes())
    if device.type == "cuda" and "offload" in config.recompute_kinds:
        link = host_link_gbps(device)
        host = int(HOST_MEMORY_SHARE * machine_memory_bytes() / max(1, torch.cuda.device_count()))
    return plan_step(model_config, batch_size, seq_len, config, dtype=dtype, device_type=device.type,
                     gpu_memory=memory, shards=shards, link_gbps=link,
                     host_memory=host, attention_kernels=planned_attention_kernels(model_config, batch_size, seq_len,
                                                                                   config.attention, dtype, device))


def planned_attention_kernels(model_config: ModelConfig, batch_size: int, seq_len: int, attention: str, dtype: str,
                              device: torch.device) -> str:
    """For flash_triton, the kernels its dispatch will run at the step's shape on `device`
    (`kernels.attention.planned_paths`); '' for another backend."""
    if attention != "flash_triton":
        return ""
    from kernels.attention import planned_paths

    return planned_paths(batch_size, model_config.num_heads, seq_len, seq_len, model_config.d_head, DTYPES[dtype],
                         device)


class OptimizerInBackward:
    """AdamW fused into backward: one optimizer per parameter (`make([p])`), stepped by a post-accumulate-grad hook
    as soon as autograd has written that parameter's gradient, which is then freed. Invariant: the same result as
    `step()` after backward (AdamW has no cross-parameter term, and backward never reads a weight once its
    gradient is written). A second backward before `zero_grad` raises. Optimizer-like: `zero_grad`, a no-op
    `step`, `state` (per parameter), `remove()` the hooks."""

    def __init__(self, make: Callable[[list], torch.optim.Optimizer], params):
        self.optimizers = {p: make([p]) for p in params if p.requires_grad}
        self._stepped: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.optimizers]

    @property
    def kind(self) -> str:
        """The inner optimizers' label (`kernels.adamw.optimizer_label`: for FusedAdamW, what ran), '' if none."""
        from kernels.adamw import optimizer_label

        return optimizer_label(*self.optimizers.values()) if self.optimizers else ""

    def _hook(self, p: torch.Tensor) -> None:
        if id(p) in self._stepped:
            raise RuntimeError(f"parameter {tuple(p.shape)} got a second gradient before zero_grad (gradient "
                               "accumulation?): its update already ran; optimizer_in_backward needs one backward "
                               "per step")
        self._stepped.add(id(p))
        self.optimizers[p].step()
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stepped.clear()
        for p in self.optimizers:
            p.grad = None

    def step(self, closure: Callable | None = None) -> None:
        """Nothing left to do: every parameter with a gradient was updated during backward."""

    @property
    def state(self) -> dict:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    def clear_state(self) -> None:
        for opt in self.optimizers.values():
            opt.state.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------------------------
# The step.

class LeaderboardStep:
    """`config` applied to `model` (attention backend, checkpoint policy, compiled pieces, optimizer); calling it
    runs one training step on a batch. `close()` removes the policy and the compiled forwards again.

    `batch_size` and `seq_len` are what the advisor plans for; `shards` > 1 plans for FSDP's sharded state,
    `sync` is called between backward and the optimizer step (a data-parallel wrapper's
    `finish_gradient_synchronization`)."""

    def __init__(self, model: TransformerLM, config: StepConfig = StepConfig(), *, batch_size: int,
                 seq_len: int | None = None, optimizer: torch.optim.Optimizer | None = None,
                 sync: Callable[[], None] | None = None, shards: int = 1):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size ({batch_size!r}) must be a positive integer")
        mc = model.config
        seq_len = seq_len or mc.context_length
        if not 1 <= seq_len <= mc.context_length:
            raise ValueError(f"seq_len ({seq_len}) must lie in [1, context_length {mc.context_length}]")
        self.model, self.config, self.sync = model, config, sync
        self.device = next(model.parameters()).device
        self.dtype = model_dtype_name(model)
        self.allocator = allocator_settings(self.device)
        model.set_attention(config.attention)
        self.plan = None
        if config.recompute == "advisor":
            self.plan = plan_on_device(model.config, batch_size, seq_len, config, dtype=self.dtype,
                                       device=self.device, shards=shards)
            policy = self.plan.policy
        else:
            policy = parse_policy(config.recompute, mc.num_layers)
        if config.optimizer_in_backward and (optimizer is not None or sync is not None):
            raise ValueError("optimizer_in_backward builds its own per-parameter optimizers and steps them inside "
                             "backward: it takes no optimizer and no gradient sync")
        self.checkpointing: CheckpointHandle | None = apply_activation_checkpointing(model, policy)
        self.compiled, self.lean, self.optimizer = None, None, None
        try:  # a part that refuses this model leaves it as it was
            self.compiled = compile_pieces(model, config.compile_backend) if config.compile else None
            self.lean = lean_blocks(model, config.compile_backend) if config.lean else None
        except ValueError:
            self.close()
            raise
        if config.optimizer_in_backward:
            self.optimizer = OptimizerInBackward(lambda ps: make_optimizer(config.optimizer, ps), model.parameters())
        else:
            self.optimizer = optimizer if optimizer is not None else make_optimizer(config.optimizer,
                                                                                    model.parameters())
        self.loss_impl = resolved_loss_impl(config, self.device)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on (x, y); returns the loss (detached)."""
        value = self.gradients(x, y)
        self.optimizer.step()
        return value

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step up to the optimizer: zero_grad, loss, backward, sync."""
        return gradients(self.model, self.optimizer, x, y, loss=self.config.loss,
                         loss_impl=self.loss_impl if self.loss_impl != "materialized" else "auto", sync=self.sync)

    @property
    def policy_spec(self) -> str:
        return self.checkpointing.policy.spec if self.checkpointing is not None else "none"

    def describe(self) -> dict:
        """Which code path runs: the columns a benchmark row records. For `flash_triton`, `attention_kernels` are the
        paths its last forward and backward took (the auto dispatch depends on the GPU, the Triton and the shape), so
        rows of one name but other kernels never mix."""
        kernels, plan = "", self.plan
        if self.config.attention == "flash_triton":
            from kernels.attention import last_paths

            kernels = last_paths()
        return {"attention": self.config.attention, "attention_kernels": kernels,
                "loss_path": self.loss_impl,
                "num_ffn": sum(r.stop - r.start for r in self.checkpointing.regions if r.kind == "ffn"),
                "optimizer_class": (f"{self.optimizer.kind} in backward" if isinstance(self.optimizer,
                                    OptimizerInBackward)
                                    else getattr(self.optimizer, "label", type(self.optimizer).__name__)),
                "policy": self.policy_spec,
                "num_full": sum(r.stop - r.start for r in self.checkpointing.regions if r.kind == "full"),
                "compiled": ",".join(sorted({type(m).__name__ for m in self.compiled.modules}))
                if self.compiled else "", "lean": self.lean is not None, "param_dtype": self.dtype,
                "predicted_peak_bytes": plan.predicted_peak_bytes if plan is not None else float("nan"),
                "plan_fits": plan.fits if plan is not None else None,
                "planned_attention_kernels": plan.workload.attention_kernels if plan is not None else "",
                "alloc_conf": self.allocator}

    def reset_optimizer_state(self) -> None:
        """Drop the AdamW state (moments and step counts), as a fresh optimizer would have it."""
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.clear_state()
        else:
            self.optimizer.state.clear()

    def close(self) -> None:
        """Undo what the constructor applied to the model (checkpoint policy, compiled forwards, backward hooks)."""
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.remove()
        for part in ("lean", "compiled", "checkpointing"):  # the reverse of the order they were applied in
            if getattr(self, part) is not None:
                getattr(self, part).remove()
                setattr(self, part, None)
