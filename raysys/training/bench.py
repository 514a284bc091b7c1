"""End-to-end benchmark of the model under test (handout 2.1.3-2.1.6).

One `BenchConfig` -> one result row: mean and std of each phase (forward, backward, optimizer) over the timed steps,
optionally a profiler kernel summary, peak memory and a memory snapshot; an OOM is a row, never a crash. Modes:
`forward` (no grad), `forward-backward`, `train-step` (adds zero_grad and the AdamW step); `bf16` / `fp16` are
autocast over fp32 master weights. `progress` is told the phase and advanced after every step.

    row, kernels = run_benchmark(BenchConfig(size="small", dtype="bf16", steps=10), out_dir="runs/demo")
    row["forward_mean_s"], row["step_mean_s"], row["peak_memory_bytes"]   # `python -m raysys bench` writes rows
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from raysys.measure import memory, profiling
from raysys.measure.device import DTYPES, autocast, free_memory, resolve_device
from raysys.measure.timing import MAX_STEPS, PhaseTimer, tflops
from raysys.model.config import SIZES, ModelConfig
from raysys.model.transformer import AdamW, attention_backends, cross_entropy, nvtx_range
from raysys.results.records import PROVENANCE_COLUMNS, make_row, status_of
from raysys.training.step import build_model

MODES = ("forward", "forward-backward", "train-step")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One end-to-end benchmark run."""

    size: str = "small"
    """Named model size (tiny, small, medium, large, xl, 10B, leaderboard)."""
    context_length: int | None = None
    """Sequence length (default: the size's context length, 512 for Table 1)."""
    batch_size: int = 4
    """Sequences per step."""
    vocab_size: int | None = None
    """Vocabulary override (default: the size's)."""
    mode: str = "train-step"
    """forward | forward-backward | train-step."""
    dtype: str = "fp32"
    """fp32, or bf16 / fp16 autocast mixed precision (fp32 master weights)."""
    compile: bool = False
    """torch.compile every Transformer block."""
    attention: str = "naive"
    """Attention backend name."""
    device: str = "auto"
    """auto | cuda | cuda:N | cpu."""
    warmup: int = 5
    """Untimed steps before timing."""
    steps: int = 10
    """Timed steps."""
    profile: bool = False
    """Run torch.profiler over the timed steps and summarise kernels per phase."""
    memory_profile: bool = False
    """Peak memory of a forward and of a full step, a CUDA memory snapshot of one step and its timeline (CUDA only)."""
    seed: int = 0
    """Seed for weights and data."""

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"size {self.size!r} is not one of {sorted(SIZES)}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if not 0 <= self.warmup <= MAX_STEPS:
            raise ValueError(f"warmup ({self.warmup}) must be in [0, {MAX_STEPS}]")
        if not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"steps ({self.steps}) must be in [1, {MAX_STEPS}]")
        if self.batch_size < 1:
            raise ValueError(f"batch_size ({self.batch_size}) must be >= 1")
        if self.attention not in attention_backends():
            raise ValueError(f"attention {self.attention!r} is not one of {attention_backends()}")
        self.model_config()  # validates the size/override combination

    def model_config(self) -> ModelConfig:
        overrides = {"attention": self.attention}
        if self.context_length is not None:
            overrides["context_length"] = self.context_length
        if self.vocab_size is not None:
            overrides["vocab_size"] = self.vocab_size
        return ModelConfig.from_name(self.size, **overrides)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        mc = self.model_config()
        d.update(context_length=mc.context_length, vocab_size=mc.vocab_size)
        return d


class _Run:
    """Model, optimizer and batch of one benchmark, and the step function that times its phases."""

    def __init__(self, cfg: BenchConfig, device: torch.device):
        mc = cfg.model_config()
        self.cfg, self.device = cfg, device
        if cfg.compile:  # a new model size must not count against Dynamo's recompile limit of earlier runs' graphs
            torch._dynamo.reset()
        # compiled per block, as torchtitan does: the blocks share one graph, so compile time does not grow with depth
        self.model = build_model(mc, device, seed=cfg.seed, compile=cfg.compile)
        self.optimizer = AdamW(self.model.parameters()) if cfg.mode == "train-step" else None
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        shape = (cfg.batch_size, mc.context_length)
        self.x = torch.randint(0, mc.vocab_size, shape, device=device, generator=gen)
        self.y = torch.randint(0, mc.vocab_size, shape, device=device, generator=gen)

    def forward_loss(self) -> torch.Tensor:
        with autocast(self.device, self.cfg.dtype):
            return cross_entropy(self.model(self.x), self.y)

    def step(self, timer: PhaseTimer) -> None:
        mode = self.cfg.mode
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        with nvtx_range("forward"):
            if mode == "forward":
                with torch.no_grad():
                    timer.time("forward", self.forward_loss)
                return
            loss = timer.time("forward", self.forward_loss)
        with nvtx_range("backward"):
            timer.time("backward", loss.backward)
        if self.optimizer is not None:
            with nvtx_range("optimizer"):
                timer.time("optimizer", self.optimizer.step)


def check_device(cfg: BenchConfig) -> torch.device:
    """The device `cfg` runs on; a ValueError when it cannot run `cfg` at all (no CUDA for `cuda`; a memory profile
    off CUDA, where there is no allocator to read a peak or a snapshot from)."""
    device = resolve_device(cfg.device)
    if cfg.memory_profile and device.type != "cuda":
        raise ValueError(f"--memory-profile needs a CUDA device (peak memory and the allocator snapshot come from "
                         f"CUDA's caching allocator); --device {cfg.device} runs on {device.type} here")
    return device


def row_config(cfg: BenchConfig) -> dict:
    """The configuration columns of `cfg`'s row, which its trial id hashes: the fields, the model's context length
    and vocabulary, and the resolved device type (so `--resume` can skip it before running)."""
    return {**cfg.as_dict(), "device": resolve_device(cfg.device).type}


def num_steps(cfg: BenchConfig) -> int:
    """Steps one run of `cfg` takes: warm-up, timed, and the memory profile's one step and one forward."""
    return cfg.warmup + cfg.steps + (2 if cfg.memory_profile else 0)


def run_benchmark(cfg: BenchConfig, out_dir: str | Path | None = None, progress=None
                  ) -> tuple[dict, pd.DataFrame | None]:
    """Run one benchmark; return (result row, kernel table or None). Artifacts (traces, snapshots) go to out_dir.
    `progress` (a tqdm bar of `num_steps(cfg)`) is told each phase and advanced after each step."""
    if progress is None:
        from tqdm.auto import tqdm

        progress = tqdm(disable=True)  # set_postfix_str and update do nothing
    device = check_device(cfg)
    config = row_config(cfg)
    mc = cfg.model_config()
    run = None
    try:
        memory.reset_peak(device)
        progress.set_postfix_str("build" + (" + compile" if cfg.compile else ""))
        run = _Run(cfg, device)
        metrics: dict = {"num_params": sum(p.numel() for p in run.model.parameters()),
                         "memory_after_init_bytes": memory.allocated_bytes(device)}
        timer = PhaseTimer(device, recording=False)

        def steps(n: int) -> None:
            for _ in range(n):
                run.step(timer)
                progress.update()

        progress.set_postfix_str("warm-up")
        steps(cfg.warmup)
        timer.recording = True
        memory.reset_peak(device)
        kernels = None
        progress.set_postfix_str("profile" if cfg.profile else "timed")
        if cfg.profile:
            prof = profiling.make_profiler(device)
            with profiling.without_kineto_noise(), prof:
                steps(cfg.steps)
            kernels = profiling.kernel_table(prof, device, cfg.steps)
            metrics.update(profiling.matmul_share(kernels))
            if out_dir is not None:
                trace = Path(out_dir) / "traces" / f"{_stem(cfg)}.json"
                metrics["trace_path"] = str(profiling.export_trace(prof, trace))
        else:
            steps(cfg.steps)
        metrics["peak_memory_bytes"] = memory.peak_bytes(device)
        metrics.update(timer.summary())
        flops_per_step = mc.forward_flops(cfg.batch_size) * {"forward": 1, "forward-backward": 3, "train-step": 3}[cfg.mode]
        metrics["tflops_per_s"] = tflops(flops_per_step, metrics["step_mean_s"])
        metrics["tokens_per_s"] = cfg.batch_size * mc.context_length / metrics["step_mean_s"]
        if cfg.memory_profile:
            progress.set_postfix_str("memory")
            metrics.update(_memory_profile(run, out_dir, progress))
        row = make_row("bench", config, metrics, device=device)
        if kernels is not None:
            kernels = kernels.assign(sweep="bench_kernels", trial_id=row["trial_id"], size=cfg.size,
                                     context_length=mc.context_length, dtype=cfg.dtype, mode=cfg.mode,
                                     **{k: row[k] for k in PROVENANCE_COLUMNS})  # each table carries its run
        return row, kernels
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as exc:  # CPU allocation failures are oom too
        if status_of(exc) != "oom":
            raise
        return make_row("bench", config, status="oom", error=f"{type(exc).__name__}: {str(exc)[:400]}", device=device), None
    finally:
        del run
        free_memory(device)


def _stem(cfg: BenchConfig) -> str:
    ctx = cfg.model_config().context_length
    return f"{cfg.size}_ctx{ctx}_{cfg.dtype}_{cfg.mode}{'_compiled' if cfg.compile else ''}"


def _memory_profile(run: _Run, out_dir: str | Path | None, progress) -> dict:
    """Peak memory of a forward-only pass and of a full step, plus a snapshot of one full step on CUDA."""
    device, out = run.device, {}
    timer = PhaseTimer(device, recording=False)
    memory.reset_peak(device)
    with torch.no_grad():
        run.forward_loss()
    progress.update()
    out["peak_forward_only_bytes"] = memory.peak_bytes(device)
    memory.reset_peak(device)
    with memory.record_memory_history(device):
        run.step(timer)
        progress.update()
        out["peak_full_step_bytes"] = memory.peak_bytes(device)
        if out_dir is not None and device.type == "cuda":
            snap = memory.dump_snapshot(device, Path(out_dir) / "snapshots" / f"{_stem(run.cfg)}.pickle")
            png = memory.render_timeline(snap, snap.with_suffix(".png"), title=_stem(run.cfg), html=False)
            out["snapshot_path"], out["timeline_png"] = str(snap), str(png)
    return out
