"""The leaderboard benchmark (handout section 9): the course's harness over an ablation of the training step.

`ablation()` lists the variants: the fast step (`StepConfig()`, first, with the faster attention `pick_attention`
measures), today's composition (`TODAY`), today's with each optimisation alone, and the fast step at twice the
batch. `run_variant` applies one, runs its first step and times it (`raysys.measure.timing`: Triton's do_bench
procedure or synchronised calls); the row has step time, peak and predicted peak memory, tokens/s, TFLOP/s, MFU,
first-step and cold-start seconds and the code path (`LeaderboardStep.describe`). An OOM is a row.

    python -m raysys leaderboard --size tiny --device cpu --out /tmp/lb       # seconds, on a laptop

`compare_with_reference` checks the composed step against the reference path (loss, every gradient, one update).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from raysys.cluster.studies import JoinList, resolve_out_dir, split_list, writer_options
from raysys.measure.device import DTYPES, check_fits, free_memory, resolve_device, synchronize
from raysys.measure.memory import peak_bytes, reset_peak
from raysys.measure.timing import do_bench, do_bench_agreed, time_calls
from raysys.model.config import ModelConfig
from raysys.model.transformer import AdamW, TransformerLM, cross_entropy
from raysys.results.records import ResultWriter
from raysys.training.leaderboard import ALLOC_CONF, ALLOC_ENV, TODAY, LeaderboardStep, StepConfig
from raysys.training.step import build_model

# ------------------------------------------------------------------------------------------------------------
# Variants, timing, FLOPs.

SWEEP = "leaderboard"
TIMERS = ("do_bench", "events")
COURSE_REP_MS, COURSE_WARMUP_MS = 30_000, 10_000
"""`triton.testing.do_bench(train_step, rep=30_000, warmup=10_000)`: the handout's timing test."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One row of the ablation: a step composition at a batch size (sequences on this GPU)."""

    name: str
    """`today`, `today+<one optimisation>`, `best`."""
    step: StepConfig
    batch_size: int = 1


ATTENTION_CANDIDATES = ("flash_triton", "cudnn")
"""Fused attention backends `best` chooses from: the faster one measured in the same run (`pick_attention`)."""


def ablation(batch_size: int = 1, *, batch2: bool = True, attention: str = "flash_triton") -> list[Variant]:
    """The fast step first (it meets the empty compile caches: its first step is the cold start), then the fast step
    with each attention candidate (`best/<name>`; the session drops the one `best` runs), today's composition and
    today's with each optimisation added alone, then the fast step at twice the batch. `best` runs `attention`;
    `best-ffn` and `best-offload` are the fast step whose advisor may not choose ffn (offloaded) blocks, `best-lean`
    the fast step with compiled pieces instead of lean blocks (`today+lean` adds both to today's, a no-op under its
    full checkpointing); `today+advisor_plan` lets the advisor mix none and full blocks, `today+ffn_recompute` none,
    ffn and full."""
    best = StepConfig(attention=attention)
    without = lambda kind: best.replace(recompute_kinds=tuple(k for k in best.recompute_kinds if k != kind))
    steps = {"best": best, **{f"best/{name}": best.replace(attention=name) for name in ATTENTION_CANDIDATES},
             "best-ffn": without("ffn"), "best-offload": without("offload"), "best-lean": best.replace(lean=False),
             "today": TODAY,
             **{f"today+{name}": TODAY.replace(**change) for name, change in (
                 ("fused_loss", dict(loss="fused")), ("fused_adamw", dict(optimizer="fused")),
                 ("compile", dict(compile=True, lean=False)), ("lean", dict(compile=True, lean=True)),
                 ("cudnn", dict(attention="cudnn")),
                 ("advisor_plan", dict(recompute="advisor", recompute_kinds=("none", "full"))),
                 ("ffn_recompute", dict(recompute="advisor", recompute_kinds=("none", "ffn", "full"))))}}
    variants = [Variant(name=name, step=step, batch_size=batch_size) for name, step in steps.items()]
    return variants + ([Variant(name="best", step=best, batch_size=2 * batch_size)] if batch2 else [])


def attention_ms(name: str, config: ModelConfig, batch_size: int, seq_len: int, device: torch.device,
                 dtype: torch.dtype, *, rep_ms: float = 300, warmup_ms: float = 100) -> float:
    """Median ms of one causal forward + backward of attention backend `name` at the step's (B, H, S, D) shape, the
    inputs in the layout the lean blocks give it (the (B, S, H, D) projections viewed as (B, H, S, D))
    (`triton.testing.do_bench`, CUDA)."""
    import triton.testing

    from raysys.model.transformer import get_attention

    fn = get_attention(name)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(batch_size, seq_len, config.num_heads, config.d_head, device=device, dtype=dtype,
                                     generator=g).transpose(1, 2) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    run = lambda: fn(q, k, v, True).backward(grad_out)
    return triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, grad_to_none=[q, k, v], return_mode="median")


def pick_attention(config: ModelConfig, batch_size: int, seq_len: int, device: torch.device, dtype: torch.dtype,
                   candidates=ATTENTION_CANDIDATES) -> tuple[str, dict[str, float]]:
    """The fastest of `candidates` at the step's shape on `device` (a backend that cannot run counts as inf), and
    every candidate's ms. On the CPU nothing is timed: `for_device` maps both to `sdpa` there."""
    if device.type != "cuda":
        return candidates[0], {}
    times = {}
    for name in candidates:
        try:
            times[name] = attention_ms(name, config, batch_size, seq_len, device, dtype)
        except (ValueError, RuntimeError) as exc:
            print(f"attention {name}: cannot run ({str(exc).splitlines()[0][:160]})", flush=True)
            times[name] = float("inf")
        release_cached_memory(device)
    return min(candidates, key=lambda name: times[name]), times


def model_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one training step: 3 x the forward's matmuls, causal attention on its lower triangle (half
    the S x S square), recomputation not counted (the usual MFU convention)."""
    causal_half = config.num_layers * 2 * batch_size * seq_len * seq_len * config.d_model
    return 3.0 * (config.forward_flops(batch_size, seq_len) - causal_half)


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Achieved TFLOP/s of one large (n x n x n) matmul on random data in `dtype`: the ceiling MFU is against."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    if device.type == "cuda":
        seconds = do_bench(lambda: a @ b, warmup_ms=100, rep_ms=500)["time_median_s"]
    else:
        seconds = time_calls(lambda: a @ b, device, warmup=1, steps=3)["time_median_s"]
    return 2 * n**3 / seconds / 1e12


def time_step(fn: Callable[[], object], device: torch.device, *, timer: str, rep_ms: float, warmup_ms: float,
              steps: int, warmup_steps: int, agree: Callable[[float], float] | None = None) -> dict:
    """Time `fn` (one training step, already run once): `do_bench` (the course's harness: median of the timed
    calls after its own warm-up; needs CUDA, unless `agree` is given: then `do_bench_agreed` on every rank of a gang,
    `agree` making their call counts the slowest rank's) or `events` (`warmup_steps`, then the median of `steps`,
    `time_calls`). Returns `step_median_s`, `step_low_s` / `step_high_s` (do_bench: the 20 / 80% quantiles; events:
    min / max) and `timed_steps`."""
    if timer == "do_bench":
        if agree is not None:
            t = do_bench_agreed(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms, agree=agree)
        elif device.type != "cuda":
            raise ValueError("timer 'do_bench' needs a CUDA device (triton.testing.do_bench times with CUDA events)")
        else:
            t = {**do_bench(fn, warmup_ms=warmup_ms, rep_ms=rep_ms), "timed_steps": float("nan")}
        return {"step_median_s": t["time_median_s"], "step_low_s": t["time_p20_s"], "step_high_s": t["time_p80_s"],
                "timed_steps": t["timed_steps"]}
    t = time_calls(fn, device, warmup=warmup_steps, steps=steps)
    return {"step_median_s": t["time_median_s"], "step_low_s": t["time_min_s"], "step_high_s": t["time_max_s"],
            "timed_steps": t["timed_steps"]}


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; else since this module was imported)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
        return float(open("/proc/uptime").read().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def set_allocator_config(conf: str) -> str:
    """`PYTORCH_CUDA_ALLOC_CONF` for this process before CUDA starts, so that every segment follows it (a value the
    user already set wins; '' keeps torch's default, and `LeaderboardStep` then leaves the allocator alone too);
    ValueError once CUDA is initialised. Returns the setting in force."""
    if torch.cuda.is_initialized() and os.environ.get("PYTORCH_CUDA_ALLOC_CONF") != conf:
        raise ValueError(f"alloc conf {conf!r} must be set before CUDA is initialised in this process")
    if not any(name in os.environ for name in ALLOC_ENV):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return next(os.environ[name] for name in ALLOC_ENV if name in os.environ)


def fresh_compile_caches() -> dict[str, str]:
    """Point Triton's and Inductor's on-disk caches at new empty directories (before anything compiles), so the
    first step of this process pays every compilation and autotuning: the course's empty-cache condition."""
    import tempfile

    dirs = {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="raysys_triton_"),
            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="raysys_inductor_")}
    os.environ.update(dirs)
    return dirs


def make_batch(config: ModelConfig, batch_size: int, seq_len: int, device: torch.device, seed: int = 0,
               rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of one step, random as in the course's harness (rank `rank`'s own draw)."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    ids = torch.randint(0, config.vocab_size, (2, batch_size, seq_len), device=device, generator=g)
    return ids[0], ids[1]


def run_variant(model: TransformerLM, variant: Variant, *, seq_len: int, timer: str = "events",
                rep_ms: float = COURSE_REP_MS, warmup_ms: float = COURSE_WARMUP_MS, steps: int = 3,
                warmup_steps: int = 1, seed: int = 0, cold: bool = False) -> dict:
    """Apply `variant` to `model`, run its first step (compilation, autotuning, AdamW state), then time it.
    Returns the row's metrics; raises on failure (OOM included) after undoing what it applied."""
    device = next(model.parameters()).device
    mc = model.config
    step = None
    try:
        release_cached_memory(device)
        t0 = time.perf_counter()
        step = LeaderboardStep(model, variant.step, batch_size=variant.batch_size, seq_len=seq_len)
        x, y = make_batch(mc, variant.batch_size, seq_len, device, seed)
        loss = step(x, y)
        synchronize(device)
        first_step_s = time.perf_counter() - t0
        cold_start_s = process_age_s() if cold else float("nan")
        reset_peak(device)
        timing = time_step(lambda: step(x, y), device, timer=timer, rep_ms=rep_ms, warmup_ms=warmup_ms,
                           steps=steps, warmup_steps=warmup_steps)
        step_s = timing["step_median_s"]
        age_end_s = process_age_s()  # cold: the whole benchmark of this variant from an empty cache
        peak = peak_bytes(device)
        reserved = float(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else float("nan")
        tokens = variant.batch_size * seq_len
        flops = model_flops(mc, variant.batch_size, seq_len)
        path = step.describe()
        predicted = path.pop("predicted_peak_bytes")
        if step.plan is None:  # a fixed policy: the model's prediction for it all the same
            s = variant.step
            predicted = predicted_peak(mc.replace(attention=s.attention), variant.batch_size, seq_len, step.dtype,
                                       loss=s.loss, compiled=s.compile, lean=s.lean, optimizer=s.optimizer,
                                       device_type=device.type, regions=step.checkpointing.regions,
                                       attention_kernels=path["attention_kernels"])
        return {**path, "first_loss": float(loss), **timing,
                "tokens_per_s": tokens / step_s, "model_flops": flops, "model_tflops": flops / step_s / 1e12,
                "peak_bytes": peak, "reserved_peak_bytes": reserved, "predicted_peak_bytes": float(predicted),
                "predicted_rel_error": (predicted - peak) / peak if peak == peak else float("nan"),
                "first_step_s": first_step_s, "cold_start_s": cold_start_s,
                "cold_run_s": age_end_s if cold else float("nan")}
    finally:
        if step is not None:
            step.close()
            step.reset_optimizer_state()
            del step
        model.zero_grad(set_to_none=True)
        release_cached_memory(device)


def predicted_peak(config: ModelConfig, batch_size: int, seq_len: int, dtype: str, *, loss: str, compiled: bool,
                   lean: bool, optimizer: str, device_type: str, regions, attention_kernels: str = "") -> int:
    """`raysys.planning.recompute_model.predict_peak` of a step of `config` (its attention backend, and for
    flash_triton the `attention_kernels` that ran) in pure `dtype` weights, with the policy's `regions`."""
    from raysys.planning.recompute_model import Workload, predict_peak

    w = Workload(config=config, batch_size=batch_size, seq_len=seq_len, precision=dtype, param_dtype=dtype, loss=loss,
                 compiled=compiled, lean=lean, optimizer=optimizer, device_type=device_type,
                 attention_kernels=attention_kernels if config.attention == "flash_triton" else "")
    return predict_peak(w, regions).peak_bytes


def release_cached_memory(device: torch.device) -> None:
    """Between variants: drop the caching allocators' free blocks, the device's and the pinned host memory's."""
    free_memory(device)
    if device.type == "cuda":
        empty_host_cache = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                            or getattr(torch._C, "_host_emptyCache", None))  # the CUDA builds' older name
        if empty_host_cache is not None and torch.cuda.is_initialized():
            empty_host_cache()


def for_device(step: StepConfig, device: torch.device, compile_backend: str | None = None) -> StepConfig:
    """`step` as it runs on `device`. On the CPU the Triton kernels give way to their torch counterparts (the
    interpreter is a test tool, without bf16): `flash_triton` and `cudnn` become `sdpa` (the same saved O /
    log-sum-exp semantics), the `fused` AdamW `foreach` (multi-tensor torch ops); the fused loss already picks its
    chunked torch version there. The compile backend defaults to `aot_eager_decomp_partition` on the CPU (Inductor's
    partitioner, hence its saved tensors, without its C++ build) and `inductor` on a GPU."""
    changes = {}
    if device.type == "cpu" and step.attention in ("flash_triton", "cudnn"):
        changes["attention"] = "sdpa"
    if device.type == "cpu" and step.optimizer == "fused":
        changes["optimizer"] = "foreach"
    changes["compile_backend"] = compile_backend or ("inductor" if device.type == "cuda" else "aot_eager_decomp_partition")
    return step.replace(**changes)


def compare_with_reference(config: ModelConfig, device: torch.device, dtype: torch.dtype, step: StepConfig, *,
                           batch_size: int = 1, seq_len: int | None = None, seed: int = 0) -> dict:
    """The composed step's loss and gradients against the reference path's on the same weights and batch, and
    its optimizer's update against the reference AdamW's on the same gradients. Returns the loss difference,
    the largest per-parameter relative gradient error ||g - g_ref|| / ||g_ref||, and the largest parameter
    difference after one update from identical weights and gradients."""
    seq_len = seq_len or config.context_length
    reference = build_model(config.replace(attention="naive"), device, dtype, seed)
    fast = build_model(config, device, dtype, seed)
    composed = LeaderboardStep(fast, step, batch_size=batch_size, seq_len=seq_len)
    try:
        x, y = make_batch(config, batch_size, seq_len, device, seed)
        loss = composed.gradients(x, y)
        ref_loss = cross_entropy(reference(x), y)
        ref_loss.backward()
        grads = dict(fast.named_parameters())
        worst, worst_name = 0.0, ""
        for name, p in reference.named_parameters():
            g, g_ref = grads[name].grad.float(), p.grad.float()
            err = float((g - g_ref).norm() / g_ref.norm().clamp_min(1e-30))
            if err > worst:
                worst, worst_name = err, name
        # one update each from the reference's weights and gradients: the optimizers alone
        with torch.no_grad():
            for name, p in reference.named_parameters():
                grads[name].copy_(p)
                grads[name].grad.copy_(p.grad)
        composed.optimizer.step()
        AdamW(reference.parameters()).step()
        with torch.no_grad():
            update = max(float((grads[n] - p).abs().max()) for n, p in reference.named_parameters())
        return {"loss": float(loss), "reference_loss": float(ref_loss), "loss_abs_diff": abs(float(loss) - float(ref_loss)),
                "grad_max_rel_error": worst, "grad_worst_param": worst_name, "update_max_abs_diff": update,
                **{k: v for k, v in composed.describe().items() if k not in ("predicted_peak_bytes", "plan_fits")}}
    finally:
        composed.close()
        del reference, fast, composed
        release_cached_memory(device)


# ------------------------------------------------------------------------------------------------------------
# `python -m raysys leaderboard`.

def build_leaderboard_parser(parser=None):
    """The flags of `python -m raysys leaderboard` (and of `sweeps/leaderboard.py`'s ablation): the names and
    meanings of the other studies' flags where they share one (`--dtypes`, comma lists)."""
    from raysys.model.config import SIZES

    p = parser or argparse.ArgumentParser(prog="raysys leaderboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="named model size (leaderboard: the 8B)")
    p.add_argument("--context-length", type=int, default=None, help="sequence length (default: the size's)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary override")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step on this device (the per-rank batch)")
    p.add_argument("--no-batch2", action="store_true", help="skip the fast step at twice the batch")
    p.add_argument("--variants", action=JoinList, default=None, metavar="A,B,..",
                   help="variant names to run, a comma list (default all: best, best-ffn, best-offload, best-lean, "
                        "today, today+fused_loss, today+fused_adamw, today+compile, today+lean, today+cudnn, "
                        "today+advisor_plan, today+ffn_recompute)")
    p.add_argument("--best-attention", default="auto", choices=("auto",) + ATTENTION_CANDIDATES,
                   help="attention of the fast step: auto times each candidate's forward + backward at the step's "
                        "shape first and takes the faster (CUDA; the CPU runs sdpa)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtypes", dest="dtype", default="bf16", metavar="DTYPE",
                   help=f"parameter (and compute) dtype, one of {sorted(DTYPES)} (one per run; the "
                        "course's harness builds the model in bf16)")
    p.add_argument("--dtype", dest="dtype", help=argparse.SUPPRESS)
    p.add_argument("--timer", default=None, choices=TIMERS,
                   help="do_bench: the course's harness (CUDA); events: warm-up steps then the median of --steps "
                        "(default: do_bench on CUDA, events on the CPU)")
    p.add_argument("--do-bench-only", action=JoinList, default=None, metavar="A,B,..",
                   help="with --timer do_bench: only these variants (NAME, or NAME:bBATCH for one batch size) by "
                        "do_bench, the others by the events timer")
    p.add_argument("--rep-ms", type=float, default=COURSE_REP_MS, help="do_bench rep (the course: 30000)")
    p.add_argument("--warmup-ms", type=float, default=COURSE_WARMUP_MS, help="do_bench warmup (the course: 10000)")
    p.add_argument("--steps", type=int, default=3, help="events timer: timed steps")
    p.add_argument("--warmup-steps", type=int, default=1, help="events timer: untimed steps after the first")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the pieces (default: inductor on CUDA, aot_eager_decomp_partition "
                        "on the CPU)")
    p.add_argument("--alloc-conf", default=ALLOC_CONF,
                   help="PYTORCH_CUDA_ALLOC_CONF of the run unless already set ('' keeps torch's default)")
    p.add_argument("--warm-cache", action="store_true",
                   help="keep Triton's and Inductor's caches (default: fresh empty ones, so cold_start_s is cold)")
    p.add_argument("--check", action="store_true",
                   help="first compare the fast step with the reference path (--check-size, bf16 tolerances)")
    p.add_argument("--check-size", default="small", choices=sorted(SIZES), help="model size of --check")
    p.add_argument("--check-context-length", type=int, default=1024, help="sequence length of --check")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--out", default=None, help="results directory (default: a fresh ./runs/<UTC time>-leaderboard/)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in <out>/leaderboard.parquet")
    p.add_argument("--overwrite", action="store_true", help="replace an existing <out>/leaderboard.parquet")
    return p


def check_options(args) -> torch.device:
    """Validate the options every leaderboard study shares (counts, do_bench's times, device, timer; ValueError) and
    resolve `args.timer`; returns the device. Before any model is built or rank started."""
    for name in ("batch_size", "steps", "check_context_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if args.warmup_steps < 0 or args.rep_ms <= 0 or args.warmup_ms < 0:
        raise ValueError(f"--warmup-steps ({args.warmup_steps}) and --warmup-ms ({args.warmup_ms}) must be >= 0, "
                         f"--rep-ms ({args.rep_ms}) > 0")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtypes {args.dtype!r} must be one of {sorted(DTYPES)} (the leaderboard runs one dtype "
                         "per run)")
    device = resolve_device(args.device)
    timer = args.timer or ("do_bench" if device.type == "cuda" else "events")
    if timer == "do_bench" and device.type != "cuda":
        raise ValueError("--timer do_bench needs a CUDA device (triton.testing.do_bench times with CUDA events)")
    args.timer = timer
    return device


def model_config_of(args) -> ModelConfig:
    """The model `args` name: its `size`, with its `context_length` and `vocab_size` where not None."""
    return ModelConfig.from_name(args.size, **{k: getattr(args, k) for k in ("context_length", "vocab_size")
                                               if getattr(args, k) is not None})


def check_args(args) -> tuple[torch.device, ModelConfig, list[Variant]]:
    """Validate the command line of the ablation (ValueError) before any model is built: `check_options`, then
    that its largest batch fits this machine; returns device, model config, variants."""
    device = check_options(args)
    config = model_config_of(args)
    variants = ablation(args.batch_size, batch2=not args.no_batch2)
    check_fits(config, max(v.batch_size for v in variants), 1, device.type)  # before any model is built
    if args.variants:
        names = split_list(args.variants)
        unknown = set(names) - {v.name for v in variants}
        if unknown:
            raise ValueError(f"--variants {sorted(unknown)} are not among {sorted({v.name for v in variants})}")
        variants = [v for v in variants if v.name in names]
    return device, config, variants


@dataclass
class Session:
    """What one benchmark process shares between its studies: device, dtype, the model and the matmul peak."""

    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    variants: list[Variant]
    model: TransformerLM | None = None
    attention: str = "flash_triton"
    """The fast step's attention backend (`--best-attention`, or the faster one `pick_attention` measured)."""
    attention_ms: dict = dataclasses.field(default_factory=dict)
    """Each candidate backend's forward + backward ms at the step's shape, when measured."""
    matmul_tflops: float = float("nan")
    build_s: float = float("nan")
    cold: bool = True
    """The next step run is the process's first (its compile caches were emptied)."""


def start_session(args) -> Session:
    """Check the arguments, empty the compile caches (unless --warm-cache), measure the matmul peak and build the
    model. On the CPU torch runs one thread: tiny models on a shared machine are slower with more."""
    device, config, variants = check_args(args)
    args.out = str(resolve_out_dir(args.out, SWEEP))  # --out, else a fresh ./runs/<UTC time>-leaderboard/
    if device.type == "cuda":
        set_allocator_config(args.alloc_conf)
    if not args.warm_cache:
        fresh_compile_caches()
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    session = Session(device, dtype, config, variants, cold=not args.warm_cache)
    session.matmul_tflops = matmul_peak_tflops(device, dtype, n=8192 if device.type == "cuda" else 512)
    if args.best_attention == "auto":
        session.attention, session.attention_ms = pick_attention(config, args.batch_size, config.context_length,
                                                                 device, dtype)
    else:
        session.attention = args.best_attention
    session.variants = session_variants(variants, session.attention, device, args.compile_backend)
    runs = for_device(StepConfig(attention=session.attention), device).attention  # what the rows will say
    if args.best_attention == "auto":
        timed = f"attention forward + backward (ms): {session.attention_ms}; " if session.attention_ms else ""
        print(f"{timed}best runs {runs}" + (f" (standing in for {session.attention} on the {device.type})"
                                            if runs != session.attention
                                            else ""), flush=True)
    t0 = time.perf_counter()
    session.model = build_model(config, device, dtype, args.seed)
    session.build_s = time.perf_counter() - t0
    return session


def session_variants(variants: list[Variant], attention: str, device: torch.device,
                     compile_backend: str | None = None) -> list[Variant]:
    """`variants` as the session runs them: `best` and its ablations with `attention`, `best/<name>` with its own
    (dropped where the device runs the same one as `best`: on the CPU every candidate is its stand-in), each as it
    runs on `device` (`for_device`)."""
    runs = for_device(StepConfig(attention=attention), device).attention
    out = []
    for v in variants:
        fast = v.name.startswith("best") and not v.name.startswith("best/")
        step = for_device(v.step.replace(attention=attention) if fast else v.step, device, compile_backend)
        if not v.name.startswith("best/") or step.attention != runs:
            out.append(dataclasses.replace(v, step=step))
    return out


def run_check(args, session: Session) -> dict:
    """`compare_with_reference` at --check-size, written to `<out>/leaderboard_check.parquet`."""
    from raysys.results.records import make_row

    check_config = ModelConfig.from_name(args.check_size, vocab_size=session.config.vocab_size,
                                         context_length=args.check_context_length)
    step = for_device(StepConfig(attention=session.attention), session.device, args.compile_backend)
    check = compare_with_reference(check_config, session.device, session.dtype, step, seed=args.seed)
    print("check against the reference path:", {k: v for k, v in check.items() if isinstance(v, float)}, flush=True)
    with ResultWriter(args.out, f"{SWEEP}_check", mode="overwrite") as writer:
        writer.write([make_row(f"{SWEEP}_check", {"size": args.check_size, "seq_len": args.check_context_length,
                                                  "dtype": args.dtype, "device": session.device.type}, check,
                               device=session.device)])
    return check


def variant_config(args, session: Session, variant: Variant, **extra) -> dict:
    """The configuration columns of `variant`'s row (its trial id hashes them)."""
    chosen = not args.do_bench_only or {variant.name, f"{variant.name}:b{variant.batch_size}"} & set(split_list(args.do_bench_only))
    timer = "do_bench" if args.timer == "do_bench" and chosen else "events"
    c = session.config
    return {"variant": variant.name, "size": c.name, "batch_size": variant.batch_size, "seq_len": c.context_length,
            "vocab_size": c.vocab_size, "dtype": args.dtype, "device": session.device.type,
            **{k: getattr(variant.step, k) for k in ("attention", "loss", "loss_impl", "optimizer", "recompute",
                                                     "compile", "lean", "compile_backend")},
            "timer": timer, "rep_ms": args.rep_ms if timer == "do_bench" else float("nan"),
            "warmup_ms": args.warmup_ms if timer == "do_bench" else float("nan"),
            "steps": args.steps if timer == "events" else float("nan"), **extra}


def variant_row(args, session: Session, variant: Variant, sweep: str = SWEEP, **extra) -> dict:
    """Run `variant` on the session's model and return its row (status `oom` / `error` rows too)."""
    from raysys.results.records import error_row, make_row, status_of

    row_config = variant_config(args, session, variant, **extra)
    timer, c = row_config["timer"], session.config
    try:
        metrics = run_variant(session.model, variant, seq_len=c.context_length, timer=timer, rep_ms=args.rep_ms,
                              warmup_ms=args.warmup_ms, steps=args.steps, warmup_steps=args.warmup_steps,
                              seed=args.seed, cold=session.cold)
        metrics.update(matmul_tflops=session.matmul_tflops, mfu=metrics["model_tflops"] / session.matmul_tflops,
                       build_s=session.build_s, cold_caches=session.cold,

                       **{f"attention_{name}_s": session.attention_ms.get(name, float("nan")) / 1e3
                          for name in ATTENTION_CANDIDATES})
        row = make_row(sweep, row_config, metrics, device=session.device)
    except Exception as exc:  # an OOM (or any failure) is a row; the study goes on
        if status_of(exc) != "oom":
            import traceback

            traceback.print_exc()
        row = error_row(sweep, row_config, exc)
    session.cold = False
    _print_row(row)
    return row


def run_variants(args, session: Session, sweep: str, items, summarize: Callable[["pd.DataFrame"], str]
                 ) -> "pd.DataFrame":
    """One row per `(variant, extra config, extra metrics)` of `items` in `<out>/<sweep>.parquet`, written as it
    is measured (`--resume` skips the done ones); `summarize(rows)` is printed at the end."""
    import pandas as pd

    from raysys.results.records import trial_id

    rows = []
    with ResultWriter(args.out, sweep, **writer_options(args)) as writer:
        for variant, extra, metrics in items:
            if writer.done(trial_id(variant_config(args, session, variant, **extra))):
                continue
            row = {**variant_row(args, session, variant, sweep=sweep, **extra), **metrics}
            rows.append(row)
            writer.write([row])
        path = writer.path
    df = pd.DataFrame(rows)
    print(summarize(df))
    print(f"wrote {path}")
    return df


def run_ablation(args, session: Session) -> "pd.DataFrame":
    """Every variant of the session, one row each in `<out>/leaderboard.parquet` (`--resume` skips done ones)."""
    return run_variants(args, session, SWEEP, ((v, {}, {}) for v in session.variants), summary)


def run_leaderboard(args) -> "pd.DataFrame":
    """`python -m raysys leaderboard`: the ablation, then `--check` (after it, so the ablation's first step is the
    cold one), on this device."""
    session = start_session(args)
    df = run_ablation(args, session)
    if args.check:
        session.model = None
        release_cached_memory(session.device)
        run_check(args, session)
    return df


def _print_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"{row['variant']:>22} b{row['batch_size']}: {row['status']} {row['error'][:160]}", flush=True)
        return
    print(f"{row['variant']:>22} b{row['batch_size']}: step {row['step_median_s']:.3f} s, "
          f"peak {row['peak_bytes'] / 2**30:.1f} "
          f"GiB (predicted {row['predicted_peak_bytes'] / 2**30:.1f}), {row['model_tflops']:.0f} TFLOP/s, "
          f"MFU {row['mfu']:.2f}, first step {row['first_step_s']:.1f} s, {row['policy']}, {row['loss_path']}, "
          f"{row['optimizer_class']}", flush=True)


def attention_text(row) -> str:
    """`flash_triton (gluon, one_pass)`: a row's backend and, where recorded, the kernels that ran."""
    kernels = getattr(row, "attention_kernels", "")
    return f"{row.attention} ({kernels})" if isinstance(kernels, str) and kernels else str(row.attention)


def _attention_label(df: "pd.DataFrame") -> "pd.Series | None":
    """The attention column of a table (`attention_text` of each row)."""
    import pandas as pd

    return pd.Series([attention_text(r) for r in df.itertuples()], index=df.index) if "attention" in df else None


def summary(df: "pd.DataFrame") -> str:
    """Markdown: the ablation table with the speed-up of every row over today's composition of the same run and
    batch, and what ran."""
    import pandas as pd

    if df.empty:
        return "no rows"
    df = df.copy()
    if "step_median_s" not in df:
        df["step_median_s"] = float("nan")
    today = {(r.run_id, r.batch_size): r.step_median_s for r in df.itertuples()
             if r.variant == "today" and r.status == "ok"}
    df["speedup_vs_today"] = [today.get((r.run_id, r.batch_size), float("nan")) / r.step_median_s if r.status == "ok"
                              else float("nan") for r in df.itertuples()]
    gib = lambda col: df[col] / 2**30 if col in df else float("nan")
    view = pd.DataFrame({"variant": df["variant"], "batch": df["batch_size"], "status": df["status"],
                         "step (s)": df["step_median_s"], "vs today": df["speedup_vs_today"],
                         "peak (GiB)": gib("peak_bytes"), "predicted (GiB)": gib("predicted_peak_bytes"),
                         "TFLOP/s": df.get("model_tflops"), "MFU": df.get("mfu"), "tokens/s": df.get("tokens_per_s"),
                         "cold start (s)": df.get("cold_start_s"), "attention": _attention_label(df),
                         "policy": df.get("policy"),
                         "loss": df.get("loss_path"), "optimizer": df.get("optimizer_class"),
                         "compiled": df.get("compiled")})
    return view.to_markdown(index=False, floatfmt=".3g")
