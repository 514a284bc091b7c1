"""Result records and Parquet I/O.

One tidy record type: one row per trial with explicit metric columns. Every row carries the sweep name, a
trial id (hash of the trial's config), the config columns, a status (`ok|oom|error|timeout|skipped`), the
error text and the provenance of the run (git sha, library versions, device, host, UTC time).

A sweep writes `<out_dir>/<sweep>.parquet`; the file is rewritten atomically (temp file + `os.replace`)
after every trial, so an interrupted sweep leaves a complete file and `--resume` skips what is in it.
Analysis is `pd.read_parquet("results/<sweep>.parquet")`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

STATUSES = ("ok", "oom", "error", "timeout", "skipped")


@functools.cache
def _git_sha() -> str:
    here = Path(__file__).resolve().parent
    env_sha = os.environ.get("RAYSYS_GIT_SHA")
    if env_sha:
        return env_sha
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken install: provenance must never fail a run
        return "absent"


def _nvidia_gpu_name() -> str | None:
    """The first NVIDIA GPU's model from the driver's /proc files: no CUDA context needed."""
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text().splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    return None


def device_name(device: Any = None) -> str:
    """Name of `device`, or of the machine's accelerator when none is given.

    Without an explicit device, a process that has not initialised CUDA (a sweep driver whose ranks run
    elsewhere) does not create a CUDA context just to name the GPU: that would pin ~500 MB on GPU 0.
    """
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" or dev is None and torch.cuda.is_initialized():
        return torch.cuda.get_device_name(dev if dev is not None and dev.index is not None else None)
    if dev is None and (name := _nvidia_gpu_name()):
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


def trial_id(config: Mapping[str, Any]) -> str:
    """Stable 12-hex-digit id of a trial's configuration (key order does not matter)."""
    blob = json.dumps({k: config[k] for k in sorted(config)}, default=str, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def status_of(exc: BaseException) -> str:
    """Map an exception raised by a trial to a row status."""
    import torch

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower() or "OutOfMemory" in text:
        return "oom"
    if isinstance(exc, TimeoutError) or "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
        return "timeout"
    return "error"


def make_row(sweep: str, config: Mapping[str, Any], metrics: Mapping[str, Any] | None = None, *,
             status: str = "ok", error: str = "", device: Any = None, **extra: Any) -> dict[str, Any]:
    """A result row: sweep, trial id, config columns, metrics, status and provenance."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} must be one of {STATUSES}")
    row: dict[str, Any] = {"sweep": sweep, "trial_id": trial_id(config), **config, **(metrics or {}),
                           "status": status, "error": error[-2000:], **extra}
    for key, value in provenance(device).items():
        row.setdefault(key, value)
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


def write_parquet(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write `df` to `path` atomically: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _normalise(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows))
    # Parquet needs one type per column: mixed-object columns (e.g. None next to str) become strings.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and pd.isna(v))}
            if len(kinds) > 1 or (kinds and not kinds <= {str, bool}):
                df[col] = df[col].map(lambda v: None if v is None else (v if isinstance(v, str) else json.dumps(v, default=str)))
    return df


class ResultWriter:
    """Accumulates the rows of one sweep in `<out_dir>/<sweep>.parquet`, rewritten atomically on every write.

    With `resume=True` the rows already in the file are kept and `done(trial_id)` reports which trials they
    cover (rows with status `ok`, `oom` or `skipped` count as done; `error`/`timeout` trials are retried).
    Without it, an existing file is replaced by this run's rows.
    """

    FINAL = ("ok", "oom", "skipped")

    def __init__(self, out_dir: str | os.PathLike, sweep: str, *, resume: bool = False):
        if not sweep or "/" in sweep:
            raise ValueError(f"sweep name {sweep!r} must be a non-empty file stem")
        self.path = Path(out_dir).expanduser().resolve() / f"{sweep}.parquet"
        self.sweep = sweep
        self.rows: list[dict[str, Any]] = []
        if resume and self.path.exists():
            old = pd.read_parquet(self.path)
            self.rows = old.to_dict("records")

    def done(self, tid: str) -> bool:
        return any(r.get("trial_id") == tid and r.get("status") in self.FINAL for r in self.rows)

    def write(self, rows: Iterable[Mapping[str, Any]]) -> Path:
        new = [dict(r) for r in rows]
        replaced = {r["trial_id"] for r in new if "trial_id" in r}
        self.rows = [r for r in self.rows if r.get("trial_id") not in replaced] + new
        return write_parquet(_normalise(self.rows), self.path)

    def frame(self) -> pd.DataFrame:
        return _normalise(self.rows)


def read_results(path: str | os.PathLike) -> pd.DataFrame:
    """Load one `<sweep>.parquet` file, or every Parquet file of a directory (with a `source` column)."""
    path = Path(path)
    if path.is_dir():
        frames = [pd.read_parquet(p).assign(source=p.stem) for p in sorted(path.glob("*.parquet"))]
        if not frames:
            raise ValueError(f"no .parquet files in {path}")
        return pd.concat(frames, ignore_index=True)
    if not path.exists():
        raise ValueError(f"results path {path} does not exist")
    return pd.read_parquet(path)
