"""What the studies in `sweeps/` share, so that a study imports this module and the libraries, never another study:
the command line (`study_parser`, `add_model_flags`), checks that run before Ray starts (each a one-line ValueError
naming the value and the rule), the gang studies' trials and driver (`GangTrial`, `run_gang_study`), output
(`output_dir`, `open_writer`, `main_entry`) and the report skeleton. The full list: docs/studies.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Sequence

import pandas as pd
import torch

from raysys.results import files
from raysys.model.config import SIZES, ModelConfig
from raysys.measure.device import check_fits  # noqa: F401  (the studies' memory bound, shared with raysys's CLIs)
from raysys.results.files import write_text
from raysys.measure.memory import TrialScope, unique_storage_bytes
from raysys.measure.profiling import profile_steps
from raysys.results.records import ResultWriter, check_sweep_name
from raysys.measure.timing import MAX_STEPS
from raysys.cluster.studies import JoinList

ROOT = Path(__file__).resolve().parents[1]

GANG_DTYPES = ("fp32", "bf16")
"""Precisions of the gang studies: fp32, or bf16 autocast with fp32 master weights."""
LAUNCHERS = ("ray", "mp")
NOT_ON_CPU = "not applicable on CPU (a GPU target; these rows ran on gloo ranks on the CPU)"


# ---------------------------------------------------------------------------------------------------- command line
class HelpFormatter(argparse.RawTextHelpFormatter):
    """Keeps the layout of the help texts and appends each option's default unless its help already names it; a
    list flag shows as `--flag A,B,..`."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, JoinList) and action.metavar:
            return action.metavar
        return super()._format_args(action, default_metavar)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or not action.option_strings or action.nargs == 0
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def list_flag(p: argparse.ArgumentParser, name: str, *, default: str | None, help: str, aliases: Sequence[str] = ()):
    """A list flag: one comma list or several words, stored as 'a,b' (`JoinList`), with hidden older spellings."""
    p.add_argument(name, default=default, metavar="A,B,..", action=JoinList, help=help)
    for old in aliases:
        alias(p, old, name, action=JoinList)


def alias(p: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    """`old` as a hidden spelling of `new` (absent from --help, same destination)."""
    p.add_argument(old, dest=new.lstrip("-").replace("-", "_"), default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                   **kwargs)


def study_parser(doc: str | None, sweep: str, *, device_help: str = "auto: cuda when present",
                 devices: Sequence[str] = ("auto", "cuda", "cpu"), gang: bool = False, ray: bool = False,
                 timeout_s: float | None = None) -> argparse.ArgumentParser:
    """The flags every study takes (`raysys.cluster.studies.sweep_parser`) with `doc` as description; `gang=True` adds
    --launcher, `gang` or `ray` --address and --dashboard; `timeout_s` adds --timeout-s with that default."""
    from raysys.cluster.studies import sweep_parser

    p = sweep_parser(doc, sweep, device_help=device_help)
    p.description, p.formatter_class = doc, HelpFormatter
    next(a for a in p._actions if a.dest == "device").choices = tuple(devices)
    if gang:
        p.add_argument("--launcher", choices=LAUNCHERS, default="ray", help="ray: a gang of Ray actors; mp: plain "
                                                                           "processes on this machine")
    if gang or ray:
        p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else an embedded Ray "
                                                       "of this run's own; 'auto': Ray's guess)")
        p.add_argument("--dashboard", action="store_true", help="start the embedded Ray with its dashboard")
    if timeout_s is not None:
        p.add_argument("--timeout-s", type=float, default=timeout_s, help="per-trial and process-group timeout (s)")
    return p


def by_device(defaults: dict[str, dict], key: str) -> str:
    """'xl on cuda, tiny on cpu' (or the one value both devices use), for a help text."""
    values = {device: d[key] for device, d in defaults.items()}
    if len(set(map(str, values.values()))) == 1:
        return str(next(iter(values.values())))
    return ", ".join(f"{v} on {device}" for device, v in values.items())


def add_model_flags(p: argparse.ArgumentParser, defaults: dict[str, dict]) -> None:
    """The grid flags of a gang training study; one left out takes its device's default from `defaults`
    (`{"cuda": {...}, "cpu": {...}}`)."""
    for key, kind, what in (("size", str, f"model size, one of {', '.join(SIZES)}"),
                            ("context_length", int, "sequence length"),
                            ("batch_per_rank", int, "sequences per rank per step"),
                            ("warmup", int, "untimed steps per trial"),
                            ("steps", int, "timed steps per trial, at least")):
        p.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None,
                       help=f"{what} (default: {by_device(defaults, key)})")
    list_flag(p, "--world-sizes", default="2", aliases=("--world-size",),
              help="ranks, one value (1: every wrapper with a group of one, what its machinery costs the host "
                   "with no peer)")


def grid_values(args: argparse.Namespace, defaults: dict[str, dict], device: str) -> dict[str, Any]:
    """The model flags, checked, with `device`'s defaults where a flag was left out (`--steps 0` is an error)."""
    d = defaults[device]
    pick = lambda key: d[key] if getattr(args, key) is None else getattr(args, key)  # noqa: E731
    size = pick("size")
    if size not in SIZES:
        raise ValueError(f"--size {size!r} is not one of {sorted(SIZES)}")
    context = (min(d["context_length"], SIZES[size].get("context_length", d["context_length"]))
               if args.context_length is None else check_int("--context-length", args.context_length, 1))
    return dict(size=size, context_length=context,
                batch_per_rank=check_int("--batch-per-rank", pick("batch_per_rank"), 1),
                warmup=check_int("--warmup", pick("warmup"), 0, MAX_STEPS),
                steps=check_int("--steps", pick("steps"), 2, MAX_STEPS))


def one_world_size(args: argparse.Namespace) -> int:
    """The gang size of a study that compares variants on one gang (`--world-sizes` with one value)."""
    sizes = parse_ints(args.world_sizes, "world-sizes", 1)
    if len(sizes) != 1:
        raise ValueError(f"--world-sizes {args.world_sizes}: this study compares its variants on one gang; give "
                         "one world size per run")
    return sizes[0]


def parse_list(text: str | None, what: str, allowed: Sequence[str] | None = None) -> list[str]:
    """'a, b' -> ['a', 'b']; an empty list or an item outside `allowed` is a ValueError naming `--what`."""
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    if allowed is not None and (bad := [t for t in items if t not in allowed]):
        raise ValueError(f"--{what}: {bad} not in {tuple(allowed)}")
    return items


def parse_ints(text: str, what: str, minimum: int) -> list[int]:
    """'2,4' -> [2, 4], each an int >= minimum."""
    out = []
    for item in parse_list(text, what):
        if not re.fullmatch(r"[+-]?\d+", item) or int(item) < minimum:
            raise ValueError(f"--{what}: {item!r} must be an integer >= {minimum}")
        out.append(int(item))
    return out


# ---------------------------------------------------------------------------------------------------- checks
def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """`value` if it is an int in [minimum, maximum], else a ValueError naming `name` and the range."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or maximum is not None and value > maximum):
        rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} ({value!r}) must be an integer {rule}")
    return value


def check_timeout(name: str, value: float) -> float:
    """A finite number of seconds in (0, a week] (`raysys.cluster.rank.check_seconds`)."""
    from raysys.cluster.rank import check_seconds

    return check_seconds(name, value)


def model_config(size: str, context_length: int, **overrides) -> ModelConfig:
    """The named size at `context_length`, checked: a size from the table, a context of at least one token."""
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {sorted(SIZES)}")
    check_int("context_length", context_length, 1)
    return ModelConfig.from_name(size, context_length=context_length, **overrides)


def add_variant_flags(p: argparse.ArgumentParser, compiled_sweep: str, compile_note: str = "") -> None:
    """The flags of a study that compares wrappers on one gang (DDP, FSDP), checked by `check_variant_flags`."""
    p.add_argument("--paired-rounds", type=int, default=0, help="after its timed steps, time each variant against a "
                   "single step in alternating blocks for N rounds (0: off)")
    p.add_argument("--compile", action="store_true", help=f"compile every TransformerBlock (torch.compile) in every "
                   f"variant{compile_note}; rows go to {compiled_sweep}.parquet")
    p.add_argument("--collectives-alone", action="store_true", help="with --world-sizes 1: the project's wrappers "
                   "issue every collective a larger group does (over no peer) instead of being the identity, so the "
                   "whole machinery is timed on one GPU (torch's wrappers always do)")
    p.add_argument("--nccl-trace-buffer", type=int, default=None, metavar="N",
                   help="entries of torch's NCCL flight recorder in every rank (TORCH_FR_BUFFER_SIZE, and its old name "
                   "TORCH_NCCL_TRACE_BUFFER_SIZE), whose bookkeeping is part of every NCCL call's host cost; 0 turns "
                   "it off (default: torch's setting, no column)")


def check_variant_flags(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """What `add_variant_flags` added, checked before any rank starts, as the `VariantTrial` fields they set."""
    check_int("--paired-rounds", args.paired_rounds, 0, MAX_STEPS)
    if args.collectives_alone and world_size != 1:
        raise ValueError(f"--collectives-alone needs --world-sizes 1 (got {world_size}): a larger group always "
                         "communicates")
    if args.nccl_trace_buffer is not None and args.nccl_trace_buffer < 0:
        raise ValueError(f"--nccl-trace-buffer ({args.nccl_trace_buffer}) must be >= 0 (0: flight recorder off)")
    return dict(compile=args.compile, paired_rounds=args.paired_rounds, collectives_alone=args.collectives_alone,
                nccl_trace_buffer=args.nccl_trace_buffer)


def paired_summary(row: Mapping) -> str:
    """What `raysys.measure.timing.paired_steps` found for a result row, in one clause: rounds, range and 95% half-width
    of the median ratio, then the host CPU time ratio (`paired_host_cpu_ratio`)."""
    text = (f"paired: median of {int(row['paired_rounds'])} rounds, range {row['paired_ratio_min']:.3f}-"
            f"{row['paired_ratio_max']:.3f}")
    ci_rel = row.get("paired_ratio_ci_rel", math.nan)
    if pd.notna(ci_rel) and math.isfinite(ci_rel):
        text += f", median +-{100 * ci_rel:.1f}% (95% confidence)"
    cpu = row.get("paired_host_cpu_ratio", math.nan)
    if pd.notna(cpu):
        cpu_ci = row.get("paired_host_cpu_ratio_ci_rel", math.nan)
        text += f"; host CPU time per step {cpu:.3f}x" + (
            f" +-{100 * cpu_ci:.1f}%" if pd.notna(cpu_ci) and math.isfinite(cpu_ci) else "")
    return text


# ---------------------------------------------------------------------------------------------------- trials
@dataclass(frozen=True, kw_only=True)
class GangTrial(Mapping):
    """What every training trial on a gang shares; a study's trial class adds its own fields. The trial is its row's
    configuration: `dict(trial)` gives the config columns (`run_sweep` uses the mapping), the trial id hashes them."""

    size: str
    """Named model size (`raysys.model.config.SIZES`)."""
    context_length: int
    """Sequence length of every batch (and the model's RoPE length)."""
    batch_per_rank: int
    """Sequences each rank runs per step."""
    dtype: str
    """fp32, or bf16 autocast with fp32 master weights."""
    warmup: int
    """Untimed steps before timing."""
    steps: int
    """Timed steps (at least)."""
    seed: int = 0
    """Seed of the weights and of each rank's batch."""

    KEY: ClassVar[tuple[str, ...]] = ("dtype",)
    """The config columns that name a trial within a run: a resumed row with these values must be that very trial."""
    PER_TRIAL: ClassVar[tuple[str, ...]] = ("dtype",)
    """The config columns that may differ between the trials of one run; every other one is a setting of the run,
    which the rows of a resumed file must share (`check_resumed`)."""

    def __post_init__(self) -> None:
        self.model_config()
        check_int("batch_per_rank", self.batch_per_rank, 1)
        check_int("warmup", self.warmup, 0, MAX_STEPS)
        check_int("steps", self.steps, 2, MAX_STEPS)
        check_int("seed", self.seed, 0)
        if self.dtype not in GANG_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {GANG_DTYPES}")

    @classmethod
    def of(cls, trial: Mapping[str, Any]):
        """`trial` as this class (a rank may receive it as its row's configuration)."""
        return trial if isinstance(trial, cls) else cls(**trial)

    def model_config(self) -> ModelConfig:
        return model_config(self.size, self.context_length)

    def batch(self, device: torch.device, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s inputs and targets: random tokens from its own seed, the same in every trial."""
        mc = self.model_config()
        gen = torch.Generator(device="cpu").manual_seed(self.seed + 1000 * (rank + 1))
        tokens = torch.randint(0, mc.vocab_size, (self.batch_per_rank, mc.context_length + 1), generator=gen)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def config(self) -> dict[str, Any]:
        """The row's configuration columns (a subclass drops what older rows did not have, so ids stay)."""
        return dataclasses.asdict(self)

    def rank_env(self) -> dict[str, str]:
        """What the gang's ranks set in their environment before the process group starts (none by default)."""
        return {}

    def __getitem__(self, key: str) -> Any:
        return self.config()[key]

    def __iter__(self):
        return iter(self.config())

    def __len__(self) -> int:
        return len(self.config())


@dataclass(frozen=True, kw_only=True)
class VariantTrial(GangTrial):
    """A trial of one variant of a study that compares variants (a subclass names them in `VARIANTS`)."""

    VARIANTS: ClassVar[tuple[str, ...]] = ()
    KEY = ("dtype", "variant")
    PER_TRIAL = ("dtype", "variant", "profile")
    variant: str
    """What runs: one of the class's VARIANTS."""
    profile: bool = False
    """Profile two more steps (overlap of communication and compute)."""
    compile: bool = False
    """Every TransformerBlock compiled with torch.compile."""
    paired_rounds: int = 0
    """Rounds of the variant against a single step in alternating blocks (0: none)."""
    collectives_alone: bool = False
    """On a group of one the project's wrappers issue a larger group's collectives (not the identity)."""
    nccl_trace_buffer: int | None = None
    """Entries of torch's NCCL flight recorder in the gang's ranks (TORCH_FR_BUFFER_SIZE; 0: off); None: torch's own."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in self.VARIANTS:
            raise ValueError(f"variant {self.variant!r} must be one of {self.VARIANTS}")
        check_int("paired_rounds", self.paired_rounds, 0, MAX_STEPS)
        if self.compile and self.warmup < 1:
            raise ValueError(f"warmup ({self.warmup}) must be >= 1 with compiled blocks: the first step compiles them")
        if self.nccl_trace_buffer is not None:
            check_int("nccl_trace_buffer", self.nccl_trace_buffer, 0)

    def config(self) -> dict[str, Any]:
        out = super().config()
        # Rows from before these settings never had their columns: ids stay.
        if not self.collectives_alone:
            del out["collectives_alone"]
        if self.nccl_trace_buffer is None:
            del out["nccl_trace_buffer"]
        return out

    def rank_env(self) -> dict[str, str]:
        """`TORCH_FR_BUFFER_SIZE` and its old name, when `nccl_trace_buffer` is set."""
        if self.nccl_trace_buffer is None:
            return {}
        # Newer torch reads TORCH_FR_BUFFER_SIZE (the old name still works there, with a deprecation warning)
        return {name: str(self.nccl_trace_buffer) for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}


def in_trial_scope(trial_fn: Callable[..., dict], ctx, *args, **kwargs) -> dict:
    """`trial_fn(ctx, ...)`'s metrics plus the memory and live parameters before and after it (`TrialScope`)."""
    with TrialScope(ctx.device) as scope:
        metrics = trial_fn(ctx, *args, **kwargs)
    return {**metrics, **scope.metrics}


def profile_one_step(step, trace_path: Path | None, expect_nccl: bool):
    """Profile one step after a warm-up step (`profile_steps`): the profile, and the row's `profile_status` (`ok`,
    `cpu`, or what a broken GPU profile lacked, with a warning) and `trace_path` (when asked)."""
    prof = profile_steps(step, step.device, trace_path=trace_path)
    status = prof.status(expect_nccl)
    if status not in ("ok", "cpu"):
        warnings.warn(f"profile of a {step.device.type} step is unusable: {status} ({prof.num_cpu_ops} CPU events, "
                      f"{prof.num_kernels} GPU kernels)", stacklevel=2)
    return prof, {"profile_status": status, **({"trace_path": str(prof.trace_path)} if prof.trace_path else {})}


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scalars: bool = True
                         ) -> dict[str, int]:
    """Bytes of this rank's `params`, `grads` (with DDP bucket buffers) and `optimizer_state` (a ShardedOptimizer's
    local shard; 0-dim tensors such as AdamW's step only with `scalars`): each storage once, in the first part."""
    seen: set[int] = set()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None] + [b.buffer for b in getattr(model, "buckets", [])
                                                              if b.buffer is not None]
    inner = getattr(optimizer, "local_optimizer", optimizer)
    state = (v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and (scalars or v.dim() > 0))
    return {"params": unique_storage_bytes(params, seen), "grads": unique_storage_bytes(grads, seen),
            "optimizer_state": unique_storage_bytes(state, seen)}


def adamw_kwargs(device: torch.device) -> dict:
    """Hyper-parameters of the optimizer every trial uses: torch AdamW, fused on CUDA (few kernels per step)."""
    return dict(lr=1e-4, weight_decay=0.01, **({"fused": True} if device.type == "cuda" else {}))


# ---------------------------------------------------------------------------------------------------- devices
def start_ray(args: argparse.Namespace) -> None:
    """Connect to (or start) Ray as the flags say: `--address`, `--dashboard`."""
    from raysys.cluster.sweep import init_ray

    init_ray(getattr(args, "address", None), dashboard=getattr(args, "dashboard", False))


def _remote(args: argparse.Namespace) -> bool:
    """Whether the gang's ranks may run on other machines: Ray, at an address named by --address or RAY_ADDRESS."""
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")
    return args.launcher == "ray" and bool(address) and address != "local"


def local_gang_device(args: argparse.Namespace) -> tuple[str, bool]:
    """The device a gang will use as far as it is known without Ray, and whether that is certain (a Ray cluster
    named by --address or RAY_ADDRESS may have GPUs this machine lacks)."""
    from raysys.cluster.mp_gang import local_device

    return local_device(args.device), args.device != "auto" or not _remote(args)


def ranks_device_name(args: argparse.Namespace, device: str) -> str | None:
    """The `device_name` of a gang's rows on `device`: `cpu`, or this machine's one GPU model when the ranks run
    here; else None."""
    from raysys.results.records import nvidia_gpu_models

    if _remote(args):
        return None
    models = set(nvidia_gpu_models())
    return "cpu" if device == "cpu" else models.pop() if len(models) == 1 else None


def check_resumed(writer: ResultWriter, trials: Sequence[GangTrial], gang: Mapping[str, Any],
                  device_name: str | None = None) -> None:
    """Refuse (unless --allow-mixed) to continue a file whose rows ran other settings than `trials` on a gang of
    `gang`'s columns: the columns outside `PER_TRIAL`, and with the device known each trial by its `KEY` and the
    device's name (`ResultWriter.check_resume`)."""
    cls = type(trials[0])
    configs = [{**t, **gang} for t in trials]
    settings = {k: v for k, v in configs[0].items()
                if k not in cls.PER_TRIAL and all(k in c and c[k] == v for c in configs)}
    writer.check_resume(settings, trials=configs if "device" in gang else (), key=cls.KEY, device_name=device_name)


def gang_device(args: argparse.Namespace, world_size: int) -> str:
    """The device the gang of `world_size` ranks will use; a ValueError at once when it could never be placed."""
    from raysys.cluster.sweep import check_gang

    if args.launcher == "ray":
        start_ray(args)
    return check_gang(world_size, device=args.device, launcher=args.launcher)


def run_gang_study(args: argparse.Namespace, sweep: str, grid: Callable[..., list],
                   trial_fn: Callable[[Path], Callable], reduce: Callable) -> tuple[pd.DataFrame, Path]:
    """A study on one gang: the trials (`grid(args, device, world_size, check_device)`) and the result file checked
    before Ray starts, then the device resolved, checked again, and the trials run (`trial_fn(out)` on every rank),
    one row each. Returns the rows and the results directory."""
    from raysys.cluster.sweep import check_gang, gang_columns, run_sweep

    world_size = one_world_size(args)
    check_timeout("--timeout-s", args.timeout_s)
    local, certain = local_gang_device(args)
    if args.launcher == "mp":
        check_gang(world_size, device=local, launcher="mp")  # this machine's GPUs, CPUs and memory
    trials = grid(args, local, world_size, check_device=certain)
    out = output_dir(args, sweep)
    with open_writer(out, sweep, args) as writer:
        gang = (gang_columns(world_size, args.launcher, local) if certain
                else {"world_size": world_size, "launcher": args.launcher})
        check_resumed(writer, trials, gang, ranks_device_name(args, local) if certain else None)  # before Ray
        device = gang_device(args, world_size)
        trials = grid(args, device, world_size)
        check_resumed(writer, trials, gang_columns(world_size, args.launcher, device))
        env = trials[0].rank_env()  # the flags set it for the whole grid: one gang serves every trial
        return run_sweep(sweep, trials, trial_fn(out), world_size, device=device, launcher=args.launcher,
                         timeout_s=args.timeout_s, reduce=reduce, env=env, writer=writer, show=False), out


def gang_study_main(args: argparse.Namespace, sweep: str, grid: Callable[..., list],
                    trial_fn: Callable[[Path], Callable], reduce: Callable,
                    write_report: Callable[[pd.DataFrame, Path], Iterable[Path | None]]) -> pd.DataFrame:
    """A gang study's `main` after parsing: the rows (--report-only: those in --out, else `run_gang_study`), then
    `write_report(df, out)`, printed."""
    if args.report_only:
        df, out = read_rows(args, sweep), output_dir(args, sweep)
    else:
        df, out = run_gang_study(args, sweep, grid, trial_fn, reduce)
    print_written(out, sweep, *write_report(df, out))
    return df


def print_written(out: Path, sweep: str, *paths: Path | None) -> None:
    """Print the study's markdown and the files it wrote."""
    md = next((p for p in paths if p is not None and p.suffix == ".md"), None)
    if md is not None:
        print(md.read_text())
    print("wrote " + ", ".join(str(p) for p in (out / f"{sweep}.parquet", *paths) if p is not None))


# ---------------------------------------------------------------------------------------------------- output
def output_dir(args: argparse.Namespace, sweep: str) -> Path:
    """The absolute results directory (`resolve_out_dir`): `--out`, made if missing, else a fresh run directory;
    --resume and --report-only need `--out`."""
    from raysys.cluster.studies import resolve_out_dir

    check_sweep_name(sweep)
    for flag in ("resume", "report_only"):
        if getattr(args, flag, False) and not args.out:
            raise ValueError(f"--{flag.replace('_', '-')} needs --out: the directory of the run to "
                             f"{'continue' if flag == 'resume' else 'redraw'}")
    return resolve_out_dir(args.out, sweep)


def read_rows(args: argparse.Namespace, sweep: str) -> pd.DataFrame:
    """The rows of `<out>/<sweep>.parquet` for --report-only (a one-line error if it is missing or unreadable)."""
    from raysys.results.records import read_results

    path = output_dir(args, sweep) / f"{sweep}.parquet"
    if not path.is_file():
        raise ValueError(f"--report-only: {path} does not exist")
    return read_results(path)


def redraw_report(args: argparse.Namespace, sweep: str, write_report) -> pd.DataFrame:
    """--report-only for a study with one table: redraw it from `<out>/<sweep>.parquet` and return the rows."""
    df, out = read_rows(args, sweep), output_dir(args, sweep)
    print(f"wrote {write_report(df, out)}")
    return df


@dataclass
class Progress:
    """Trials this run planned and finished (written, or found done by --resume), for the message on Ctrl-C in a
    study that runs its trials itself (`run_sweep` and `tune_run` say it for theirs)."""

    planned: int = 0
    finished: int = 0

    def plan(self, num_trials: int) -> None:
        self.planned += num_trials


PROGRESS = Progress()


class TrackedWriter(ResultWriter):
    """A `ResultWriter` that counts finished trials into `PROGRESS` (rows of a trial not seen yet, or `done`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._counted: set[str] = set()

    def _count(self, tids: set[str]) -> None:
        if tids - self._counted:
            self._counted |= tids
            PROGRESS.finished += 1

    def done(self, tid: str) -> bool:
        finished = super().done(tid)
        if finished:
            self._count({tid})
        return finished

    def write(self, rows):
        rows = [dict(r) for r in rows]
        path = super().write(rows)
        self._count({r["trial_id"] for r in rows})
        return path


def open_writer(out: Path, sweep: str, args: argparse.Namespace, expect: Mapping[str, Any] | None = None
                ) -> ResultWriter:
    """The result file of `sweep` in `out` as the flags say (`writer_options`): new, --resume (refusing rows of
    another commit, device or `expect`'s values unless --allow-mixed) or --overwrite; locked. Open it before Ray."""
    from raysys.cluster.studies import writer_options

    return TrackedWriter(out, sweep, expect=expect, **writer_options(args))


def main_entry(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a study's `main` (`run_script`): bad input is one line on stderr and exit code 2; Ctrl-C (or SIGTERM)
    is one line, "interrupted after N of M trials; rerun with --resume", and exit code 130."""
    from raysys.cluster.studies import interrupted_message, run_script

    def guarded(argv: list[str] | None):
        try:
            return main(argv)
        except KeyboardInterrupt as exc:
            if not getattr(exc, "__notes__", None) and PROGRESS.planned:
                message = interrupted_message(Path(sys.argv[0]).stem, PROGRESS.finished, PROGRESS.planned, None)
                print(message, file=sys.stderr, flush=True)
                exc.add_note(message)
            raise

    return run_script(guarded, argv)


# ---------------------------------------------------------------------------------------------------- report
def column(df: pd.DataFrame, name: str) -> pd.Series:
    """`df[name]`, or NaN where the rows predate that column."""
    return df[name] if name in df else pd.Series(math.nan, index=df.index)


def step_column(df: pd.DataFrame) -> str:
    """The step statistic ratios and targets use: the median (rows written before it existed: the mean)."""
    return "step_median_s" if "step_median_s" in df and df["step_median_s"].notna().any() else "step_mean_s"


def on_cpu(df: pd.DataFrame) -> bool:
    """Whether the rows were measured on the CPU (gloo ranks or the CPU device): GPU targets do not apply."""
    for col, cpu in (("backend", "gloo"), ("device", "cpu")):
        if col in df and df[col].notna().any():
            return bool((df[col] == cpu).all())
    return False


def setup_sentence(first: pd.Series) -> str:
    """What a gang sweep's rows ran: model, context, ranks (backend, device), sequences per rank."""
    world = int(first["world_size"])
    flag = first.get("compile", False)
    compiled = ", TransformerBlocks compiled (torch.compile)" if pd.notna(flag) and bool(flag) else ""
    alone = first.get("collectives_alone", False)
    alone = (", the project's wrappers issuing a larger group's collectives (--collectives-alone)"
             if pd.notna(alone) and bool(alone) else "")
    trace = first.get("nccl_trace_buffer", math.nan)
    trace = "" if pd.isna(trace) else (", NCCL flight recorder off" if trace == 0 else
                                       f", NCCL flight recorder of {int(trace)} entries")
    return (f"{first['size']} model, context {int(first['context_length'])}, {world} rank{'s' * (world != 1)} "
            f"({first.get('backend', '')}, {first.get('device_name', '')}), {int(first['batch_per_rank'])} sequences "
            f"per rank{compiled}{alone}{trace}")


def not_measured(df: pd.DataFrame, keys: Sequence[str]) -> str:
    """The rows that did not finish (`status` other than ok) with the first line of their error, or ''."""
    failed = df[df["status"] != "ok"]
    if failed.empty:
        return ""
    error = failed["error"].astype(str).str.split("\n").str[0].str[:120]
    return "Not measured:\n\n" + failed[[*keys, "status"]].assign(error=error).to_markdown(index=False)


def join_parts(parts: Iterable[str]) -> str:
    return "\n\n".join(p for p in parts if p) + "\n"


def markdown_report(df: pd.DataFrame, keys: Sequence[str], intro: Callable[[pd.Series], str],
                    body: Callable[[pd.DataFrame], list[str]]) -> str:
    """A study's markdown: `intro(first ok row)`, the parts `body(ok rows)` returns, then the rows not measured
    (named by `keys`); only the last when no row is ok."""
    ok = df[df["status"] == "ok"]
    parts = [intro(ok.iloc[0]), *body(ok)] if not ok.empty else []
    return join_parts([*parts, not_measured(df, keys)])


def write_markdown(out: Path, sweep: str, title: str, body: str) -> Path:
    """`<out>/<sweep>.md` (atomically): a `## title (sweep)` heading and the body (BENCHMARKS.md shows it)."""
    return write_text(out / f"{sweep}.md", f"## {title} ({sweep})\n\n{body}")


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120, **layout) -> Path:
    """Lay `fig` out, write it atomically (`raysys.results.files.save_figure`) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(**layout)
    try:
        return files.save_figure(fig, path, dpi=dpi)
    finally:
        plt.close(fig)
