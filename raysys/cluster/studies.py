"""What every study script shares that needs no Ray: its parser's common options, its results directory, the
result writer's mode, the one line an interrupt prints, --report-only reading, the summary table and the scripts'
entry point (`run_script`). A study whose
trials run in its own process (no gang, no Ray Tune) imports nothing of Ray through these; `raysys.cluster.sweep`
re-exports them beside the Ray machinery."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from raysys.cluster.signals import interrupt_on_sigterm
from raysys.results.files import DiskFull
from raysys.results.records import discard_empty_run_dirs, resolve_out

__all__ = ["ClusterLost", "JoinList", "interrupted_message", "read_sweep", "resolve_out_dir", "run_guarded",
           "run_script", "silence_stdout", "split_list", "summary_table", "sweep_parser", "writer_options"]


class JoinList(argparse.Action):
    """A list flag's action: one comma list or several words, `--dtypes fp32,bf16` = `--dtypes fp32 bf16` ->
    'fp32,bf16' (every list flag of the studies and of `python -m raysys bench` takes both; `split_list` reads it)."""

    def __init__(self, option_strings, dest, nargs="+", **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, ",".join(values))


def split_list(text: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c'] (a `JoinList` flag's value)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def resolve_out_dir(out: str | os.PathLike | None = None, sweep: str | None = None) -> Path:
    """The absolute results directory of a sweep, created if missing (`ResultsError`, a ValueError, if it cannot be).

    `out` if given (a relative path resolves against the current directory), else `$RAYSYS_RESULTS_DIR`, else a
    fresh run directory `./runs/<UTC time>-<sweep>/` (`$RAYSYS_RUNS_DIR` instead of `./runs`; `sweep` defaults to
    the script's name): the committed `results/` is written only when named. A Ray job whose driver runs in an
    uploaded copy of the working directory (`--working-dir`) without an absolute `--out` gets a warning (`python -m
    raysys submit` sets `RAYSYS_RUNS_DIR` to the submitter's `./runs`).
    """
    if sweep is None:
        stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
        sweep = stem if stem and stem[0].isalnum() and all(c.isalnum() or c in "_.-" for c in stem) else "run"
    path = resolve_out(out, sweep)
    if job_runs_in_a_temporary_copy() and path.is_relative_to(Path.cwd()):
        warnings.warn(f"results go to {path}, inside this Ray job's temporary working directory; submit with "
                      f"`python -m raysys submit` or pass an absolute --out (e.g. --out \"$PWD/runs/x\" at submit "
                      f"time) to keep them", stacklevel=2)
    return path


class ClusterLost(RuntimeError):
    """The Ray cluster a sweep ran on is gone (its head stopped answering); the rows written so far stay."""


def job_runs_in_a_temporary_copy() -> bool:
    """Whether this process is a Ray job's driver running in the copy of a working directory that Ray uploaded (and
    deletes with the job's runtime env): the job's runtime env names a `working_dir`. Ray passes the job's config to
    its driver in `RAY_JOB_CONFIG_JSON_ENV_VAR`."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if text is None:
        return False
    try:
        runtime_env = json.loads(text).get("runtime_env") or {}
    except (ValueError, AttributeError):  # not Ray's JSON: judge by where the driver runs
        return "runtime_resources" in Path.cwd().parts
    return bool(runtime_env.get("working_dir"))


def interrupted_message(sweep: str, done: int, total: int | None, path: Path | None, lost: str = "") -> str:
    """What a sweep stopped by Ctrl-C or SIGTERM (or by losing its Ray cluster, `lost` saying why) prints, in one
    line, before the interrupt propagates. It names `path` only if that file exists (a run stopped before its first
    row wrote none)."""
    path = path if path is not None and Path(path).is_file() else None
    of = f" of {total}" if total is not None else ""
    what = f"lost its Ray cluster ({lost})" if lost else "interrupted"
    if done == 0 and path is None:
        return f"{sweep}: {what} before any{of} trials finished; no rows were written"
    where = f"; its rows are in {path}" if path is not None else ""
    again = " once the cluster is back" if lost else " to continue"
    return f"{sweep}: {what} after {done}{of} trials{where}; rerun with --resume{again}"


def writer_options(args: argparse.Namespace) -> dict:
    """`ResultWriter` keyword arguments (`mode`, `allow_mixed`) from `sweep_parser`'s --resume / --overwrite /
    --allow-mixed; a ValueError when both --resume and --overwrite are given."""
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        raise ValueError("--resume and --overwrite contradict each other")
    mode = "resume" if getattr(args, "resume", False) else "overwrite" if getattr(args, "overwrite", False) else "new"
    return {"mode": mode, "allow_mixed": bool(getattr(args, "allow_mixed", False))}


def sweep_parser(doc: str | None, sweep: str, *, device_help: str) -> argparse.ArgumentParser:
    """An argument parser with the options every gang sweep shares: --device, --out, --resume, --report-only."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help=device_help)
    p.add_argument("--out", default=None, help="results directory (default: a fresh ./runs/<UTC time>-<sweep>/; "
                                               "the committed results/ only when named)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help=f"skip trials already in <out>/{sweep}.parquet (refuses "
                                                            "rows of another commit or device)")
    mode.add_argument("--overwrite", action="store_true", help=f"replace an existing <out>/{sweep}.parquet")
    p.add_argument("--allow-mixed", action="store_true", help="with --resume: keep rows of another commit, device "
                                                              "or configuration in the file")
    p.add_argument("--report-only", action="store_true", help=f"only redraw the {sweep} tables and plots from the "
                                                              "Parquet file")
    return p


def read_sweep(out: Path, sweep: str) -> pd.DataFrame:
    """The rows of `<out>/<sweep>.parquet` (for --report-only) in the column convention (`read_results`: a file of
    older code reads like a new one), or a ValueError naming the missing file."""
    from raysys.results.records import read_results

    path = out / f"{sweep}.parquet"
    if not path.exists():
        raise ValueError(f"--report-only: {path} does not exist")
    return read_results(path)


def summary_table(df: pd.DataFrame) -> str:
    """The varying configuration, metric and status columns of `df`, as text."""
    hide = {"sweep", "trial_id", "git_sha", "torch_version", "triton_version", "ray_version", "host", "utc",
            "error", "device_name"}
    cols = [c for c in df.columns if c not in hide and (c == "status" or df[c].astype(str).nunique() > 1)]
    view = df[cols].copy()
    if "error" in df and (df["status"] != "ok").any():
        view["error"] = df["error"].astype(str).str.split("\n").str[0].str[:60]
    return view.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def run_script(main_fn, argv: list[str] | None = None) -> int:
    """Entry point of a `sweeps/` script: `main_fn(argv)` under `run_guarded`, named after the script."""
    return run_guarded(Path(sys.argv[0]).name, lambda: main_fn(argv))


def run_guarded(prog: str, fn: Callable[[], Any]) -> int:
    """The exit code of `fn()` run as the command `prog` (its int result, else 0), never a traceback: bad input
    (ValueError) is one line on stderr and 2, a full disk one line and 1, a closed stdout 141, Ctrl-C / SIGTERM
    one line ("interrupted after N of M trials; rerun with --resume" from run_sweep and tune_run) and 130, a lost
    Ray cluster 1. A fresh run directory left empty is removed."""
    try:
        with interrupt_on_sigterm():  # `timeout`, a scheduler: the rows written stay, the writer's lock goes
            result = fn()
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
    except (ValueError, DiskFull) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except BrokenPipeError:  # `... | head`: the reader left; stop quietly, as other Unix tools do
        silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it
    except KeyboardInterrupt as exc:
        if not getattr(exc, "__notes__", None):  # run_sweep / tune_run already said where the rows are
            print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ClusterLost:  # run_sweep / tune_run said it, where the rows are included
        return 1
    finally:
        discard_empty_run_dirs()  # a run that failed before its first row leaves no empty ./runs/<UTC>-<sweep>/
    return result if isinstance(result, int) else 0


def silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
