"""Result records and Parquet I/O: a run never replaces or mixes results silently.

One row per trial with explicit metric columns; every row carries the sweep, `trial_id` (hash of the config), the
config columns, a status (`ok|oom|error|timeout|skipped`), the error text and the run's provenance (`ROW_COLUMNS`),
which no config key or metric may overwrite. A `ResultWriter` (mode `new`, `resume` or `overwrite`) locks
`<out>/<sweep>.parquet`, takes only rows with a known status and full provenance, and rewrites the file atomically
after every `write`. `read_results` reads a file in one go (safe while a sweep writes it) and through
`raysys.results.migrate`. Column convention (`make_row` refuses other units): seconds `_s`, bytes `_bytes`, the
statistic before the unit (`step_median_s`), rates name theirs (`busbw_GBps`), ratios say what they divide.

    out = resolve_out(args.out, "ddp")          # --out if given, else a fresh ./runs/<UTC time>-ddp/
    with ResultWriter(out, "ddp", mode="new") as writer:
        if not writer.done(trial_id(config)):
            writer.write([make_row("ddp", config, metrics)])
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import functools
import io
import json
import math
import numbers
import os
import platform
import re
import socket
import subprocess
import sys
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from raysys.results.files import (DiskFull, FileBusy, FileLock, ResultsError, remove_stale_tmp, save_figure, trial_id,
                                  write_parquet, write_text)
from raysys.results.migrate import PROVENANCE_COLUMNS, canonical, full_sha

__all__ = ["DiskFull", "FileBusy", "MODES", "NOT_RUN", "ROW_COLUMNS", "ResultWriter", "ResultsError",
           "check_provenance", "check_row_keys", "check_status", "check_sweep_name", "clip_error", "default_out_dir",
           "discard_empty_run_dirs", "error_row", "make_row", "prepare_out_dir", "provenance", "read_results",
           "resolve_out", "save_figure", "status_of", "trial_id", "unit_violations", "write_parquet", "write_text"]

STATUSES = ("ok", "oom", "error", "timeout", "skipped")


def git_sha_of(directory: str | os.PathLike) -> str | None:
    """The commit checked out in the git repository holding `directory` (12 hex digits, `-dirty` when tracked
    files differ from it), or None outside a repository or without git."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=directory, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    return None


@functools.cache
def _git_sha() -> str:
    """This run's commit: `$RAYSYS_GIT_SHA` (which `python -m raysys submit` sets for a job, whose uploaded working
    directory has no .git; a short or full sha becomes 12 digits), else the repository this package was imported
    from, else `unknown`."""
    given = os.environ.get("RAYSYS_GIT_SHA")
    return full_sha(given) if given else git_sha_of(Path(__file__).resolve().parent) or "unknown"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken install: provenance must never fail a run
        return "absent"


def nvidia_gpu_models() -> list[str]:
    """This machine's NVIDIA GPU models, by bus id, from the driver's /proc files: no CUDA context needed."""
    return [line.split(":", 1)[1].strip() for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
            for line in info.read_text().splitlines() if line.startswith("Model:")]


def device_name(device: Any = None) -> str:
    """Name of `device`, or of the machine's accelerator when none is given (then no CUDA context is created
    in a process that has not initialised CUDA)."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" or dev is None and torch.cuda.is_initialized():
        return torch.cuda.get_device_name(dev if dev is not None and dev.index is not None else None)
    if dev is None and (name := next(iter(nvidia_gpu_models()), None)):
        return name
    return f"cpu ({platform.processor() or platform.machine()})"


RUN_ID = uuid.uuid4().hex[:12]
"""This process's id, in every row it writes: rows with equal `run_id` were measured in one run (one invocation
of a sweep script), which a comparison "in the same run" can check; resumed trials carry their own run's id."""


def provenance(device: Any = None) -> dict[str, str]:
    """Where and with what a row was produced, and in which run (`RUN_ID`)."""
    return {
        "run_id": RUN_ID,
        "git_sha": _git_sha(),
        "torch_version": _version("torch"),
        "triton_version": _version("triton"),
        "ray_version": _version("ray"),
        "device_name": device_name(device),
        "host": socket.gethostname(),
        "utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def status_of(exc: BaseException) -> str:
    """Map an exception raised by a trial to a row status: a refused allocation is `oom` on the GPU and on the
    CPU (`MemoryError`, torch's "DefaultCPUAllocator: can't allocate memory") alike."""
    import torch

    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in low or "OutOfMemory" in text
            or "can't allocate memory" in low or "cannot allocate memory" in low):
        return "oom"
    if isinstance(exc, TimeoutError) or "timed out" in low or "timeout" in type(exc).__name__.lower():
        return "timeout"
    return "error"


ROW_COLUMNS = ("sweep", "trial_id", "status", "error", *PROVENANCE_COLUMNS)
"""The columns every row has of its own: no config key, metric or extra column may replace them (`extra` may set
the provenance ones, e.g. `device_name` of the ranks rather than of the driver)."""


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays, tensors: compare what a Parquet cell would hold
        return str(a) == str(b)


def check_row_keys(config: Mapping[str, Any], metrics: Mapping[str, Any] | None = None,
                   extra: Mapping[str, Any] | None = None) -> None:
    """Raise ValueError naming the first key that would overwrite a row column (`ROW_COLUMNS`), or a config
    column with another value. Sweeps call it on every trial config before running any (`run_sweep` does)."""
    for what, names in (("config key", config), ("metric", metrics or {}), ("extra column", extra or {})):
        for key in names:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{what} {key!r} must be a non-empty str (it names a Parquet column)")
            if key in ROW_COLUMNS and not (what == "extra column" and key in PROVENANCE_COLUMNS):
                raise ValueError(f"{what} {key!r} would overwrite the row's own {key!r} column; rename it "
                                 f"(reserved: {', '.join(ROW_COLUMNS)})")
            if names is not config and key in config and not _same(names[key], config[key]):
                raise ValueError(f"{what} {key!r}={names[key]!r} would overwrite the trial's config column "
                                 f"{key}={config[key]!r}; rename it")
    for key in set(metrics or {}) & set(extra or {}):
        if not _same(metrics[key], extra[key]):
            raise ValueError(f"metric {key!r}={metrics[key]!r} and the extra column {key}={extra[key]!r} collide")


ERROR_CHARS = 2000
"""The longest `error` text a row keeps (a remote traceback can be megabytes)."""


def clip_error(text: str, limit: int = ERROR_CHARS) -> str:
    """`text` if it fits `limit` characters, else its head and its tail around a note of what was cut: the first
    line (the exception, which tables show) always stays, and so does the end of a traceback."""
    if len(text) <= limit:
        return text
    first, _, _ = text.partition("\n")
    head = first[:limit // 2]
    tail_chars = max(0, limit - len(head) - 40)
    note = f"\n[... {len(text) - len(head) - tail_chars} characters cut ...]\n"
    return head + note + (text[-tail_chars:] if tail_chars else "")


def make_row(sweep: str, config: Mapping[str, Any], metrics: Mapping[str, Any] | None = None, *,
             status: str = "ok", error: str = "", device: Any = None, **extra: Any) -> dict[str, Any]:
    """A result row: sweep, trial id, config columns, metrics, status and provenance (`extra` may override the
    provenance columns); a key that would overwrite another's column raises ValueError (`check_row_keys`), and so
    does a metric named in another unit than seconds or bytes (`unit_violations`)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} must be one of {STATUSES}")
    check_row_keys(config, metrics, extra)
    if bad := unit_violations([*(metrics or {}), *extra]):
        raise ValueError(f"metric {bad[0]!r} is not in seconds or bytes; columns hold `_s` and `_bytes` (the "
                         f"convention in raysys.results.records), tables show ms and GiB")
    row: dict[str, Any] = {"sweep": sweep, "trial_id": trial_id(config), **config, **(metrics or {}),
                           "status": status, "error": clip_error(error)}
    row.update(provenance(device))
    row.update(extra)
    return row


def root_exception(exc: BaseException) -> BaseException:
    """What a wrapper raised by Ray (`RayTaskError`, whose text is the remote traceback) carries as its `cause`:
    the trial's own exception, so a row's `error` starts with it. Other exceptions come back unchanged."""
    seen = {id(exc)}
    while isinstance(getattr(exc, "cause", None), BaseException) and id(exc.cause) not in seen:
        exc = exc.cause
        seen.add(id(exc))
    return exc


def error_row(sweep: str, config: Mapping[str, Any], exc: BaseException, **extra: Any) -> dict[str, Any]:
    """The row of a trial that failed with `exc` (OOM, timeout, dead actor, ...): its status and, as `error`, the
    root exception's type and message, then the notes added on the way (`(raised on rank 1 during ...)`)."""
    root = root_exception(exc)
    notes = [*getattr(root, "__notes__", ()), *(getattr(exc, "__notes__", ()) if exc is not root else ())]
    error = "\n".join([f"{type(root).__name__}: {root}", *notes])
    return make_row(sweep, config, status=status_of(root), error=error, **extra)


def _normalise(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows))
    # Parquet needs one type per column: mixed-object columns (e.g. None next to str) become strings.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and pd.isna(v))}
            if len(kinds) > 1 or (kinds and not kinds <= {str, bool}):
                df[col] = df[col].map(lambda v: None if v is None else (v if isinstance(v, str) else json.dumps(v, default=str)))
    return df


# ---------------------------------------------------------------------------------------------------- where
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def check_sweep_name(sweep: str) -> str:
    """`sweep` if it can name `<sweep>.parquet` (letters, digits, `_.-`, at most 100 characters), else ValueError."""
    if not isinstance(sweep, str) or not _NAME.fullmatch(sweep) or ".." in sweep:
        raise ValueError(f"sweep name {str(sweep)[:120]!r} must be 1-100 letters, digits, '_', '.' or '-' (a file "
                         f"stem) starting with a letter or digit")
    return sweep


def runs_root() -> Path:
    """Where fresh run directories go: `$RAYSYS_RUNS_DIR`, else `./runs` (git-ignored)."""
    return Path(os.environ.get("RAYSYS_RUNS_DIR") or "runs").expanduser().resolve()


def default_out_dir(sweep: str) -> Path:
    """A fresh run directory, created now: `<runs_root()>/<UTC YYYYmmddTHHMMSSZ>-<sweep>` (`-2`, `-3`, ... if two
    runs start in the same second). A run's results land here unless `--out` names a directory."""
    check_sweep_name(sweep)
    root = prepare_out_dir(runs_root())
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1, 1000):
        path = root / (f"{stamp}-{sweep}" if n == 1 else f"{stamp}-{sweep}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        _FRESH_DIRS.append(path)
        return path
    raise ResultsError(f"{root}: could not create a fresh run directory for {sweep!r}")


_FRESH_DIRS: list[Path] = []  # directories this process created, removed again while they hold nothing


@atexit.register
def discard_empty_run_dirs() -> list[Path]:
    """Remove the directories this process created for results that are still empty, so a failed run leaves no
    trace; a directory that existed before is never removed. Runs at exit and when `run_script` ends a script.
    Returns the directories removed."""
    removed = []
    for path in sorted(_FRESH_DIRS, key=lambda p: len(p.parts), reverse=True):  # a directory before its parent
        try:
            path.rmdir()  # only ever removes an empty directory
        except FileNotFoundError:
            pass
        except OSError:
            continue
        _FRESH_DIRS.remove(path)
        removed.append(path)
    return removed


def prepare_out_dir(out: str | os.PathLike) -> Path:
    """The absolute results directory `out`, created if missing (and then removed again at the end if the run
    leaves it empty, `discard_empty_run_dirs`); `ResultsError` (a one-line ValueError) if it is a file, cannot be
    created or is not writable."""
    path = Path(out).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ResultsError(f"results directory {path} is a file, not a directory")
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ResultsError(f"cannot create results directory {path}: {exc.strerror or exc}") from None
    _FRESH_DIRS.extend(p for p in missing if p not in _FRESH_DIRS)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ResultsError(f"results directory {path} is not writable")
    return path


def resolve_out(out: str | os.PathLike | None, sweep: str) -> Path:
    """`out` (created if missing) when given, else `$RAYSYS_RESULTS_DIR`, else a fresh `default_out_dir(sweep)`."""
    chosen = out if out is not None else os.environ.get("RAYSYS_RESULTS_DIR")
    return prepare_out_dir(chosen) if chosen else default_out_dir(sweep)


# ---------------------------------------------------------------------------------------------------- read
def _read_parquet(path: Path) -> pd.DataFrame:
    """The rows of `path` in the column convention (`raysys.results.migrate.canonical`: a file written before it reads
    like a new one). The bytes are read in one go: a writer's atomic replace cannot land between footer and data."""
    try:
        df = pd.read_parquet(io.BytesIO(path.read_bytes()))
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise ResultsError(f"{path} is not a readable Parquet file ({first[:200]})") from None
    return canonical(df, None if "sweep" in df else path.stem, siblings=path.parent)


_NOT_BASE_UNITS = {"ms", "us", "ns", "gib", "mib", "kib", "gb", "mb", "kb"}


def unit_violations(columns: Iterable[str], config: Iterable[str] = ()) -> list[str]:
    """The measured columns of `columns` named in a unit other than seconds or bytes (`step_ms`, `peak_gib`; the
    convention in the module docstring); `config` columns are exempt (they spell their flag)."""
    exempt = set(config)
    return [c for c in columns if c not in exempt and _NOT_BASE_UNITS & set(str(c).lower().split("_"))]


def read_results(path: str | os.PathLike) -> pd.DataFrame:
    """Load one `<sweep>.parquet` file, or every Parquet file of a directory (with a `source` column). In a
    directory an unreadable file is skipped with one line on stderr; a single unreadable file raises
    `ResultsError` (a ValueError) in one line."""
    path = Path(path)
    if path.is_dir():
        frames = []
        for p in sorted(path.glob("*.parquet")):
            try:
                frames.append(_read_parquet(p).assign(source=p.stem))
            except ResultsError as exc:
                print(f"skipped: {exc}", file=sys.stderr)
        if not frames:
            raise ResultsError(f"no readable .parquet files in {path}")
        return pd.concat(frames, ignore_index=True)
    if not path.exists():
        raise ResultsError(f"results path {path} does not exist")
    return _read_parquet(path)


# ---------------------------------------------------------------------------------------------------- write
MODES = ("new", "resume", "overwrite")
_OPEN: dict[Path, "weakref.ref[ResultWriter]"] = {}  # this process's live writer of each file
_MIX_HINT = "choose another --out, pass --overwrite, or allow mixing (--allow-mixed)"
NOT_RUN = "not run:"
"""How the `error` of a `skipped` row starts when the infrastructure, not the trial, kept it from running (a gang
the cluster could not hold, a lost node, a spent time budget): `--resume` runs such a trial again. Other `skipped`
rows (a provider that cannot run the shape) are final."""
_FORMATS = {"run_id": (re.compile(r"[0-9a-f]{12}"), "12 hex digits"),
            "git_sha": (re.compile(r"[0-9a-f]{12}(-dirty)?|unknown"), "12 hex digits (+ -dirty) or unknown"),
            "utc": (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), "YYYY-mm-ddTHH:MM:SSZ")}


def _values(df: pd.DataFrame, col: str) -> list[str]:
    return sorted(map(str, df[col].dropna().unique())) if col in df else []


def _missing(value: Any) -> bool:
    return value is None or isinstance(value, (float, np.floating)) and math.isnan(value)


def _equal(a: Any, b: Any) -> bool:
    """Whether two config values are the same once through Parquet (ints may come back as floats, None as NaN)."""
    if _missing(a) or _missing(b):
        return _missing(a) and _missing(b)
    numbers_ = [isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) for v in (a, b)]
    return float(a) == float(b) if all(numbers_) else str(a) == str(b)


def check_status(row: Mapping[str, Any]) -> None:
    """Raise ValueError unless `row`'s status is one of `STATUSES`."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"row {row.get('trial_id')!r} has status {row.get('status')!r}; a status is one of "
                         f"{', '.join(STATUSES)}")


def check_provenance(row: Mapping[str, Any]) -> None:
    """Raise ValueError unless `row` has every provenance column (`PROVENANCE_COLUMNS`) as a non-empty string, the
    run id, commit and time in their formats (what `make_row` writes)."""
    for col in PROVENANCE_COLUMNS:
        value = row.get(col)
        if not isinstance(value, str) or not value:
            raise ValueError(f"row {row.get('trial_id')!r} lacks its provenance: {col} is {value!r} (make_row "
                             f"fills {', '.join(PROVENANCE_COLUMNS)})")
        if col in _FORMATS and not _FORMATS[col][0].fullmatch(value):
            raise ValueError(f"row {row.get('trial_id')!r} has {col} {value[:60]!r}; it must be {_FORMATS[col][1]}")


class ResultWriter:
    """The rows of one sweep in `<out_dir>/<sweep>.parquet`, rewritten atomically on every `write`.

        writer = ResultWriter(out, "ddp", mode="resume", expect={"steps": 10, "device": "cuda"})
        writer.check_resume(trials=configs, key=("dtype", "label"))   # before anything runs

    `mode`: `new` (default) refuses an existing file; `resume` (= `resume=True`) keeps its rows, and `done(trial_id)`
    says which trials they cover (`ok`, `oom`, `skipped` but for `NOT_RUN` rows); `overwrite` replaces the file at the
    first write. Resuming refuses (`ResultsError`, one line) a file of another schema or sweep and, unless
    `allow_mixed=True`, rows without provenance, of another commit, or of another configuration (`check_resume`).
    `write` takes rows as `make_row` makes them (`check_provenance`), of this run's commit (or one the file holds)
    and, for `ok` rows, a `device_name` the file's `ok` rows have (`allow_mixed` lifts these two). The writer holds an
    exclusive lock on the file (`FileLock`: a second run gets `FileBusy`; a second writer in this process takes the
    lock over and the first refuses to write) until `close()`, the `with` block's end or the process's.
    """

    FINAL = ("ok", "oom", "skipped")

    def __init__(self, out_dir: str | os.PathLike, sweep: str, *, mode: str | None = None,
                 resume: bool | None = None, allow_mixed: bool = False, expect: Mapping[str, Any] | None = None):
        if resume is not None and mode is not None and (mode == "resume") != bool(resume):
            raise ValueError(f"mode={mode!r} contradicts resume={resume!r}")
        mode = mode or ("resume" if resume else "new")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} must be one of {MODES}")
        self.sweep, self.mode, self.allow_mixed = check_sweep_name(sweep), mode, allow_mixed
        self.path = prepare_out_dir(out_dir) / f"{sweep}.parquet"
        if self.path.is_dir():
            raise ResultsError(f"{self.path} is a directory, not a Parquet file")
        self.rows: list[dict[str, Any]] = []
        self._devices: set[str] = set()
        self._superseded = False
        self._lock: FileLock | None = None
        previous = _OPEN.get(self.path)
        holder = previous() if previous is not None else None
        holder = holder if holder is not None and holder._lock is not None else None
        lock = None if holder is not None else FileLock(self.path)
        try:
            if holder is None:
                remove_stale_tmp(self.path)  # dead writers' temp files of this file, nothing else
            self._open_existing()
            self.check_resume(expect)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if holder is not None:
            lock, holder._lock, holder._superseded = holder._lock, None, True
        self._lock = lock
        _OPEN[self.path] = weakref.ref(self)

    def _open_existing(self) -> None:
        if not self.path.exists():
            return
        if self.mode == "new":
            raise ResultsError(f"{self.path} already exists; pass --resume to continue it, --overwrite to replace "
                               f"it, or choose another --out")
        if self.mode == "overwrite":
            return
        try:
            old = _read_parquet(self.path)
        except ResultsError as exc:
            raise ResultsError(f"{exc}; --overwrite replaces it") from None
        if len(old):
            self._check_schema(old)
        if not self.allow_mixed and len(old):
            if missing := [c for c in PROVENANCE_COLUMNS if c not in old or old[c].isna().any()]:
                raise ResultsError(f"{self.path} holds rows without provenance ({', '.join(missing)}); resuming "
                                   f"would mix rows of unknown origin with this run's ({_MIX_HINT})")
            shas = _values(old, "git_sha")
            if shas != [here := _git_sha()]:
                raise ResultsError(f"{self.path} holds rows of commit {', '.join(shas)}, this run is commit {here}; "
                                   f"resuming would mix them ({_MIX_HINT})")
            self._devices = set(_values(old[old["status"] == "ok"], "device_name"))
        self.rows = old.to_dict("records")

    def _check_schema(self, old: pd.DataFrame) -> None:
        """A file to continue must be a results file of this sweep: `sweep`, `trial_id` and `status` columns, this
        sweep's name, known statuses."""
        what = ""
        if missing := [c for c in ("sweep", "trial_id", "status") if c not in old or old[c].isna().any()]:
            what = f"rows without {', '.join(missing)} (not a raysys results file)"
        elif sweeps := [v for v in _values(old, "sweep") if v != self.sweep]:
            what = f"rows of sweep {', '.join(sweeps)}"
        elif bad := [v for v in _values(old, "status") if v not in STATUSES]:
            what = f"rows of status {', '.join(bad)} (known: {', '.join(STATUSES)})"
        if what:
            raise ResultsError(f"{self.path} holds {what}, not rows of sweep {self.sweep!r}; --overwrite replaces "
                               f"it, or choose another --out")

    def check_resume(self, expect: Mapping[str, Any] | None = None, *, trials: Iterable[Mapping[str, Any]] = (),
                     key: Sequence[str] = (), device_name: str | None = None) -> None:
        """Refuse (`ResultsError`, one line) to continue rows measured under another configuration than this
        run's, unless `allow_mixed` (nothing to check outside `resume` or without rows). Call it before anything
        runs, once more when more is known (the device a Ray cluster resolves).

        - `expect`: column -> this run's value (its settings: steps, warm-up, world size, launcher, device, ...);
          every row must hold that value (a row without the column holds None).
        - `trials` with `key`: a row whose `key` columns name one of this run's trials must be that very trial
          (the same trial id); the error names the columns that differ.
        - `device_name`: what this run's `ok` rows will say they were measured on, where known beforehand.
        """
        if self.mode != "resume" or self.allow_mixed or not self.rows:
            return
        for col, value in (expect or {}).items():
            seen = {str(r.get(col)): r.get(col) for r in self.rows if not _equal(r.get(col), value)}
            if seen:
                shown = ", ".join(sorted("none" if _missing(v) else str(v) for v in seen.values()))
                raise ResultsError(f"{self.path} holds rows with {col} = {shown}, this run has {col} = "
                                   f"{'none' if _missing(value) else value}; resuming would mix them ({_MIX_HINT})")
        if key:
            by_key = {tuple(str(t.get(k)) for k in key): t for t in trials}
            for row in self.rows:
                trial = by_key.get(tuple(str(row.get(k)) for k in key))
                if trial is None or row.get("trial_id") == trial_id(trial):
                    continue
                named = ", ".join(f"{k} {row.get(k)}" for k in key)
                differ = [f"{c} = {row.get(c)!r} there, {v!r} here" for c, v in trial.items()
                          if not _equal(row.get(c), v)] or ["columns this run's trial does not have"]
                raise ResultsError(f"{self.path} holds the trial {named} with {'; '.join(differ[:3])}; resuming "
                                   f"would mix them ({_MIX_HINT})")
        if device_name is not None and self._devices and self._devices != {device_name}:
            raise ResultsError(f"{self.path} holds rows measured on {', '.join(sorted(self._devices))}, this run "
                               f"measures on {device_name}; resuming would mix them ({_MIX_HINT})")

    def done(self, tid: str) -> bool:
        """Whether `--resume` may skip trial `tid`: it has a final row, not one the infrastructure left `NOT_RUN`."""
        return any(r.get("trial_id") == tid and r.get("status") in self.FINAL
                   and not (r.get("status") == "skipped" and str(r.get("error", "")).startswith(NOT_RUN))
                   for r in self.rows)

    def write(self, rows: Iterable[Mapping[str, Any]]) -> Path:
        """Add `rows` (replacing earlier rows of the same trial ids) and rewrite the file atomically."""
        if self._lock is None:
            why = "another ResultWriter of this file was opened in this process" if self._superseded else "closed"
            raise ResultsError(f"{self.path}: this writer can no longer write ({why})")
        new = [dict(r) for r in rows]
        held = {(r.get("trial_id"), r.get("run_id"), r.get("git_sha")) for r in self.rows}
        shas = {_git_sha(), *(r.get("git_sha") for r in self.rows)}
        for r in new:
            if r.get("sweep") != self.sweep or not r.get("trial_id"):
                raise ValueError(f"row {str(r)[:120]} is not a row of sweep {self.sweep!r} with a trial_id "
                                 f"(use make_row)")
            check_status(r)
            if (r.get("trial_id"), r.get("run_id"), r.get("git_sha")) in held:  # a row of the file, rewritten
                continue
            check_provenance(r)
            if r["git_sha"] not in shas and not self.allow_mixed:
                raise ResultsError(f"row {r['trial_id']} is of commit {r['git_sha']}, this run is commit "
                                   f"{_git_sha()}; writing it would mix them ({_MIX_HINT})")
            device = r.get("device_name")
            if (self._devices and not self.allow_mixed and r.get("status") == "ok" and device is not None
                    and str(device) not in self._devices):
                raise ResultsError(f"{self.path} holds rows measured on {', '.join(sorted(self._devices))}, this "
                                   f"row on {device}; resuming would mix them ({_MIX_HINT})")
        replaced = {r["trial_id"] for r in new}
        after = [r for r in self.rows if r.get("trial_id") not in replaced] + new
        path = write_parquet(_normalise(after), self.path)
        self.rows = after  # only once on disk: a failed write leaves the writer as the file is
        return path

    def frame(self) -> pd.DataFrame:
        return _normalise(self.rows)

    def close(self) -> None:
        """Release the file's lock (idempotent); the rows stay readable through `rows` and `frame()`."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            if (ref := _OPEN.get(self.path)) is not None and ref() is self:
                del _OPEN[self.path]

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
