"""`python -m raysys <command>`: bench, report, migrate, advise, plan, submit, doctor, metrics, leaderboard.

Defaults run on a laptop CPU: `python -m raysys bench --size tiny` finishes in seconds. Each command imports what it
needs when it runs, so `doctor`, `submit`, `metrics` and `report` start without torch or the kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from pathlib import Path

from raysys.cluster.studies import JoinList, run_guarded, split_list, writer_options
from raysys.model.config import SIZES
from raysys.results.records import ResultWriter, resolve_out, trial_id


def _add_bench(p: argparse.ArgumentParser) -> None:
    from raysys.training.bench import DTYPES, MODES

    # List flags take several words or one comma list, as the studies' do (`raysys.cluster.studies.JoinList`).
    p.add_argument("--size", action=JoinList, default="small", metavar="SIZE",
                   help=f"named model size(s), several or a comma list, of {', '.join(SIZES)} (default: small)")
    p.add_argument("--context-length", action=JoinList, default=None, metavar="N",
                   help="sequence length(s) (default: the size's)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary override")
    p.add_argument("--mode", action=JoinList, default="train-step", metavar="MODE",
                   help=f"what one step runs, of {', '.join(MODES)} (default: train-step)")
    p.add_argument("--dtype", action=JoinList, default="fp32", metavar="DTYPE",
                   help=f"of {', '.join(DTYPES)}: fp32, or autocast mixed precision (default: fp32)")
    p.add_argument("--compile", action="store_true", help="torch.compile every Transformer block")
    p.add_argument("--attention", default="naive", help="attention backend (naive, sdpa, annotated, flash_triton, ...)")
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile", action="store_true", help="torch.profiler kernel summary per phase + Chrome trace")
    p.add_argument("--memory-profile", action="store_true", help="peak memory, CUDA snapshot and timeline picture "
                                                                  "(CUDA only)")
    p.add_argument("--out", default=None, help="directory for bench.parquet (+ traces/, snapshots/); default: a "
                                               "fresh ./runs/<UTC time>-bench/")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="add to <out>/bench.parquet, skipping configurations "
                                                            "already in it")
    mode.add_argument("--overwrite", action="store_true", help="replace an existing <out>/bench.parquet")
    p.add_argument("--allow-mixed", action="store_true", help="with --resume: keep rows of another commit or device")


def _int(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be an integer") from None


def _label(cfg: BenchConfig) -> str:
    """What tells one configuration of a bench run from the others, for its progress bar."""
    ctx = cfg.model_config().context_length
    return f"{cfg.size} ctx {ctx} {cfg.mode} {cfg.dtype}" + (" compiled" if cfg.compile else "")


def bench_configs(args: argparse.Namespace) -> list[BenchConfig]:
    """Every combination of the list flags (--size, --context-length, --mode, --dtype), each checked."""
    from raysys.training.bench import BenchConfig

    contexts = [None] if args.context_length is None else [_int("--context-length", c)
                                                           for c in split_list(args.context_length)]
    return [BenchConfig(size=s, context_length=c, batch_size=args.batch_size, vocab_size=args.vocab_size, mode=m,
                        dtype=d, compile=args.compile, attention=args.attention, device=args.device,
                        warmup=args.warmup, steps=args.steps, profile=args.profile, memory_profile=args.memory_profile)
            for s, c, m, d in itertools.product(split_list(args.size), contexts, split_list(args.mode),
                                                split_list(args.dtype))]


def _bench(args) -> int:
    from tqdm.auto import tqdm

    from raysys.measure.device import check_fits
    from raysys.training.bench import check_device, num_steps, row_config, run_benchmark

    configs = bench_configs(args)
    for cfg in configs:  # before any model is built: a CPU run is bounded by this machine's memory
        check_fits(cfg.model_config(), cfg.batch_size, 1, check_device(cfg).type)
    out = resolve_out(args.out, "bench")
    options = writer_options(args)
    rows = []
    with contextlib.ExitStack() as stack:  # an interrupt or error releases the writers' locks
        rows_writer = stack.enter_context(ResultWriter(out, "bench", **options))
        kernels_writer = (stack.enter_context(ResultWriter(out, "bench_kernels", mode=options["mode"],
                                                           allow_mixed=True))
                          if args.profile else None)
        # One bar over the configurations, one over the current configuration's steps (its phase and estimate).
        runs = stack.enter_context(tqdm(total=len(configs), desc="bench", unit="config", position=0))
        for i, cfg in enumerate(configs, 1):
            if rows_writer.done(trial_id(row_config(cfg))):
                runs.set_postfix_str("resumed")
                runs.update()
                continue
            with tqdm(total=num_steps(cfg), desc=f"[{i}/{len(configs)}] {_label(cfg)}", unit="step", position=1,
                      leave=False) as steps:
                row, kernels = run_benchmark(cfg, out, progress=steps)
            rows.append(row)
            rows_writer.write([row])
            runs.set_postfix_str(row["status"])
            runs.update()
            if kernels is not None and not kernels.empty:
                kernels_writer.rows = [r for r in kernels_writer.rows if r.get("trial_id") != row["trial_id"]]
                kernels_writer.rows += kernels.to_dict("records")
                kernels_writer.write([])
                from raysys.measure.profiling import KERNEL_TABLE_COLUMNS, format_top
                tqdm.write(format_top(kernels[list(KERNEL_TABLE_COLUMNS)]))
    _print_bench(rows)
    print(f"\nwrote {rows_writer.path}")
    return 0


def _print_bench(rows: list[dict]) -> None:
    import pandas as pd

    df = pd.DataFrame(rows)
    cols = ["size", "context_length", "mode", "dtype", "compile", "status"]
    for phase in ("forward", "backward", "optimizer", "step"):
        if f"{phase}_mean_s" in df:
            df[f"{phase} (ms)"] = [f"{m * 1e3:.2f} ± {s * 1e3:.2f}" if m == m else "-"
                                   for m, s in zip(df[f"{phase}_mean_s"], df[f"{phase}_std_s"])]
            cols.append(f"{phase} (ms)")
    if "peak_memory_bytes" in df:
        df["peak (GiB)"] = df["peak_memory_bytes"] / 2**30
        cols.append("peak (GiB)")
    print(df[[c for c in cols if c in df]].to_markdown(index=False, floatfmt=".3g"))


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="results directory or a <sweep>.parquet file")
    p.add_argument("--only", action=JoinList, default=None, metavar="SWEEP",
                   help="sweep names (file stems) to include, several or a comma list")
    p.add_argument("--markdown", help="also write the tables to this file (atomically; its directory must exist)")
    p.add_argument("--plots", help="also draw PNG plots of the sweeps that have one into this directory")


def _markdown_path(text: str) -> Path:
    """`--markdown`'s file, checked before anything is printed: its directory exists and can be written."""
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"--markdown {path} is a directory; it takes a file")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--markdown {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--markdown {path}: directory {parent} is not writable")
    return path


def _study_drawer(stem: str):
    """The function of its study that draws `<stem>.parquet` (`sweeps.PLOTS`), or None. The CLI is the top of the
    house: it imports the study only when its plot is asked for, and no study imports the CLI."""
    import importlib

    entry = getattr(importlib.import_module("sweeps"), "PLOTS", {}).get(stem)
    if entry is None:
        return None
    module, name, takes = entry
    fn = getattr(importlib.import_module(module), name)
    if takes == "dir":
        return lambda df, out_dir: list(fn(df, out_dir))
    if takes == "plots":
        return lambda df, out_dir: list(fn(df, out_dir / "plots"))
    return lambda df, out_dir: [p for p in [fn(df, out_dir / f"{stem}.png")] if p is not None]


def _report(args) -> int:
    """Exit 0 when every file was reported (and drawn), 1 when one could not be read or drawn, 2 on bad input."""
    from raysys.results.files import write_text
    from raysys.results.report import HEADER, check_plots_dir, plots, sections, sweep_files

    only = split_list(args.only) if args.only is not None else None
    sweep_files(args.path, only)  # every input checked before anything is printed or written
    markdown = _markdown_path(args.markdown) if args.markdown else None
    if args.plots:
        check_plots_dir(args.plots)
    text, unreadable = sections(args.path, only)
    print(text)
    if markdown is not None:
        try:
            write_text(markdown, HEADER + "\n" + text)  # a full disk (DiskFull) keeps the previous file
        except PermissionError as exc:
            raise ValueError(f"cannot write --markdown {markdown}: {exc.strerror}") from None
    failed = []
    if args.plots:
        made, failed = plots(args.path, args.plots, _study_drawer, only)
        for path in made:
            print(f"wrote {path}")
    return 1 if unreadable or failed else 0


def _add_migrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help="Parquet files or directories of them")
    p.add_argument("--check", action="store_true", help="only list the files that would change; exit 1 if any")


def _migrate(args) -> int:
    from raysys.results.migrate import migrate_file

    files = []
    for path in map(Path, args.paths):
        if not path.exists():
            raise ValueError(f"{path} does not exist")
        files += sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    changed = [f for f in files if migrate_file(f, check=args.check)]
    for f in changed:
        print(f"{'would rewrite' if args.check else 'rewrote'} {f}")
    print(f"{len(changed)} of {len(files)} file(s) {'not yet' if args.check else 'brought'} in the convention")
    return 1 if args.check and changed else 0


def _lazy(module: str, name: str, **kwargs):
    """`module.name(arg, **kwargs)`, imported only when the command runs (so the other commands' imports wait)."""
    import importlib

    return lambda arg: getattr(importlib.import_module(module), name)(arg, **kwargs)


def _leaderboard(args) -> int:
    from raysys.training.leaderboard_bench import run_leaderboard

    df = run_leaderboard(args)
    return 0 if (df["status"] == "ok").any() else 1


COMMANDS = {  # name: (help, add its arguments, run it)
    "bench": ("end-to-end benchmark of the model (forward / backward / optimizer times)", _add_bench, _bench),
    "report": ("markdown tables from a results directory or Parquet file", _add_report, _report),
    "migrate": ("bring result files to the one column convention (ms -> s, GiB -> bytes, full commits)", _add_migrate,
                _migrate),
    "advise": ("per-layer activation-checkpointing plan that fits a GPU",  # run_advise: 0 a plan fits, 1 none
               _lazy("raysys.cli.planning", "build_advise_parser"), _lazy("raysys.cli.planning", "run_advise")),
    "plan": ("parallelism planner: DP / FSDP / TP / FSDP+TP limits (handout 8)",
             _lazy("raysys.cli.planning", "build_plan_parser"), _lazy("raysys.cli.planning", "run_plan")),
    "submit": ("submit a sweep to a Ray cluster as a named job that carries its commit, and follow its logs",
               _lazy("raysys.cli.cluster", "build_submit_parser"), _lazy("raysys.cluster.submit", "run_submit")),
    "doctor": ("before `ray start --head`: are the ports it binds free here?",
               _lazy("raysys.cli.cluster", "build_doctor_parser"), _lazy("raysys.cluster.submit", "run_doctor")),
    "metrics": ("after `ray start --head`: do the Prometheus and Grafana of the dashboard's Metrics tab answer? "
                "(else how to start them)",
                _lazy("raysys.cli.cluster", "build_metrics_parser"), _lazy("raysys.cluster.submit", "run_metrics")),
    "leaderboard": ("the leaderboard training step: ablation from today's composition to the fastest (handout 9)",
                    _lazy("raysys.training.leaderboard_bench", "build_leaderboard_parser"), _leaderboard),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: every command, each with its arguments, or with `command` only that one's (the others'
    modules, torch and the kernels among them, stay unimported; '' adds none: `raysys --help` lists the commands)."""
    parser = argparse.ArgumentParser(prog="raysys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add, _) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if command in (None, name):
            add(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    return run_guarded(f"raysys {args.command}", lambda: COMMANDS[args.command][2](args))


if __name__ == "__main__":
    sys.exit(main())
