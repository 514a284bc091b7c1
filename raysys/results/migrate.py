"""Bring result files to the one column convention (stated in `raysys.results.records`) without measuring anything
again.

`canonical(df, sweep)` renames and converts older columns (ms, us -> s; GiB, MiB -> bytes; `RENAMES`,
`SWEEP_RENAMES`), expands short commits to 12 digits, fills the provenance of the e2e per-kernel / per-tensor
tables from their run's rows and sets `run_id = "unknown"` where a run predates it. Idempotent: a canonical frame
comes back unchanged (the same object); `read_results` applies it. Configuration columns keep their flag's
spelling (the trial id hashes them). `python -m raysys migrate [--check] PATHS` rewrites (or lists) the files.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pandas as pd

from raysys.results.files import trial_id, write_parquet

MS, US, GIB, MIB = 1e-3, 1e-6, 2**30, 2**20
_PHASES = ("forward", "backward", "comm_wait", "optimizer")

RENAMES: dict[str, tuple[str, float]] = {
    # raysys.measure.timing.time_steps (ddp, fsdp, sharded_optimizer): per-rank step statistics
    "step_ms": ("step_mean_s", MS), "step_ms_std": ("step_std_s", MS), "step_ms_median": ("step_median_s", MS),
    "step_ms_min": ("step_min_s", MS), "step_ms_max": ("step_max_s", MS), "step_ms_ci_rel": ("step_median_ci_rel", 1),
    "host_step_ms": ("host_step_median_s", MS), "cpu_ms_per_step": ("cpu_time_per_step_s", MS),
    **{f"{p}_ms": (f"{p}_mean_s", MS) for p in _PHASES},
    **{f"{p}_ms_median": (f"{p}_median_s", MS) for p in _PHASES},
    **{f"host_{p}_ms": (f"host_{p}_median_s", MS) for p in _PHASES},
    "paired_step_ms": ("paired_step_median_s", MS), "paired_reference_ms": ("paired_reference_median_s", MS),
    # gang reductions over ranks
    "step_ms_max_rank": ("step_mean_max_rank_s", MS), "step_ms_median_min_rank": ("step_median_min_rank_s", MS),
    "step_ms_median_max_rank": ("step_median_max_rank_s", MS),
    # ddp
    "grad_mib": ("grad_bytes", MIB), "peak_memory_gib": ("peak_memory_bytes", GIB),
    "nccl_kernel_ms": ("nccl_kernel_s", MS), "host_allreduce_ms": ("host_allreduce_s", MS),
    "host_accumulate_grad_ms": ("host_accumulate_grad_s", MS),
    # fsdp
    "gather_wait_ms": ("gather_wait_s", MS),
    **{f"{c}{e}_ms": (f"{c}{e}_s", MS) for c in ("allgather", "reducescatter", "allreduce") for e in ("", "_exposed")},
    # allreduce (the slowest rank's mean per call)
    "time_ms": ("time_mean_s", MS), "time_std_ms": ("time_std_s", MS), "time_min_ms": ("time_min_s", MS),
}
"""old column -> (canonical column, factor to its unit), whatever the study."""

_DO_BENCH = {"median_ms": ("time_median_s", MS), "p20_ms": ("time_p20_s", MS), "p80_ms": ("time_p80_s", MS)}
SWEEP_RENAMES: dict[str, dict[str, tuple[str, float]]] = {
    "fused_ops": {**_DO_BENCH, "floor_ms": ("floor_s", MS), "extra_peak_gib": ("extra_peak_bytes", GIB),
                  "peak_above_inputs_gib": ("peak_above_inputs_bytes", GIB)},
    "flash_tiles": {"median_ms": ("time_median_s", MS)},
    "checkpointing": {"h2d_gbps": ("h2d_GBps", 1), "d2h_gbps": ("d2h_GBps", 1)},  # 1e9 B/s, as busbw_GBps
    "flash_bench": {f"{m}_ms": (f"{m}_median_s", MS) for m in ("fwd", "bwd", "fwd_bwd")},
    **{name: {"step_s": ("step_median_s", 1), "step_s_low": ("step_low_s", 1), "step_s_high": ("step_high_s", 1)}
       for name in ("leaderboard", "leaderboard_tune", "leaderboard_ddp")},
    # the per-kernel table of the end-to-end study: time over the profiled steps, and per call
    "e2e_kernel_table": {"total_ms": ("total_s", MS), "mean_us": ("call_mean_s", US)},
    # the slowest rank's mean over the fastest's (>= 1) in the collectives benchmark ...
    "allreduce": {"rank_spread": ("rank_spread_ratio", 1)},
    "allreduce_scan": {"rank_spread": ("rank_spread_ratio", 1)},
    # ... the slowest rank's median step over the fastest's, minus 1, in the DDP study
    "ddp": {"rank_spread": ("rank_spread_rel", 1)}, "ddp_compiled": {"rank_spread": ("rank_spread_rel", 1)},
}

PROVENANCE_COLUMNS = ("run_id", "git_sha", "torch_version", "triton_version", "ray_version", "device_name", "host",
                      "utc")
"""The provenance every row carries (`raysys.results.records.make_row` fills them)."""
UNKNOWN_RUN = "unknown"


@functools.cache
def full_sha(sha: str) -> str:
    """`sha` (optionally `-dirty`) as the 12-digit abbreviation `raysys.results.records` writes, when this repository
    knows the commit; otherwise unchanged."""
    base, dirty = (sha[:-6], "-dirty") if sha.endswith("-dirty") else (sha, "")
    if len(base) == 12 or not (4 <= len(base) <= 40) or any(c not in "0123456789abcdef" for c in base):
        return sha
    if len(base) > 12:
        return base[:12] + dirty
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", f"{base}^{{commit}}"], capture_output=True, text=True,
                             timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return sha
    return out.stdout.strip() + dirty if out.returncode == 0 and out.stdout.strip() else sha


def canonical(df: pd.DataFrame, sweep: str | None = None, siblings: Path | None = None) -> pd.DataFrame:
    """`df` with the columns of the convention (see the module docstring); `sweep` defaults to the `sweep` column's
    value. `siblings`: the directory whose other files give the provenance of the e2e per-kernel/per-tensor
    tables. A canonical frame is returned unchanged (the same object)."""
    if sweep is None and "sweep" in df and len(df):
        sweep = str(df["sweep"].iloc[0])
    table = {**RENAMES, **SWEEP_RENAMES.get(sweep or "", {})}
    for col in df.columns:  # the leaderboard's per-candidate attention times
        if isinstance(col, str) and col.startswith("attention_ms_"):
            table[col] = (f"attention_{col.removeprefix('attention_ms_')}_s", MS)
    out = df
    for old, (new, factor) in table.items():
        if old not in out:
            continue
        if out is df:
            out = df.copy()
        values = pd.to_numeric(out[old], errors="coerce") * factor if factor != 1 else out[old]
        out[new] = out[new].where(out[new].notna(), values) if new in out else values
        out = out.drop(columns=old)
    if sweep in ("e2e_kernel_table", "e2e_saved_detail") and (siblings is not None or "git_sha" in out):
        out = _table_provenance(out, sweep, siblings)
    if len(out) and ("git_sha" in out or "sweep" in out):
        if "run_id" not in out or out["run_id"].isna().any():
            out = out.copy() if out is df else out
            out["run_id"] = out["run_id"].fillna(UNKNOWN_RUN) if "run_id" in out else UNKNOWN_RUN
    if "git_sha" in out and (shas := out["git_sha"].dropna().astype(str)).map(full_sha).ne(shas).any():
        out = out.copy() if out is df else out
        out["git_sha"] = out["git_sha"].map(lambda s: full_sha(s) if isinstance(s, str) else s)
    return out


def _table_provenance(df: pd.DataFrame, sweep: str, siblings: Path | None) -> pd.DataFrame:
    """The e2e tables written whole (one row per kernel or saved tensor) get the provenance of the trial rows they
    come from: `e2e_kernels` by trial id, `e2e_saved` by (size, context length, batch size)."""
    if "git_sha" in df and df["git_sha"].notna().all() or siblings is None:
        return df
    source = siblings / ("e2e_kernels.parquet" if sweep == "e2e_kernel_table" else "e2e_saved.parquet")
    if not source.exists():
        return df
    trials = pd.read_parquet(source)
    out = df.copy()
    if sweep == "e2e_saved_detail":
        keys = ["size", "context_length", "batch_size"]
        first = trials.drop_duplicates(keys)[keys + ["dtype"]]
        out = out.merge(first, on=keys, how="left") if "dtype" not in out else out
        out["trial_id"] = [trial_id({"size": r.size, "context_length": int(r.context_length),
                                     "batch_size": int(r.batch_size), "dtype": r.dtype}) for r in out.itertuples()]
        trials = trials.drop_duplicates(keys).drop(columns=["trial_id"]).merge(
            out[keys + ["trial_id"]].drop_duplicates(), on=keys)
    cols = [c for c in PROVENANCE_COLUMNS if c in trials]
    prov = trials.drop_duplicates("trial_id").set_index("trial_id")[cols]
    for col in cols:
        filled = out["trial_id"].map(prov[col])
        out[col] = out[col].where(out[col].notna(), filled) if col in out else filled
    out["sweep"] = sweep
    return out


def migrate_file(path: Path, check: bool = False) -> bool:
    """Rewrite `path` in the convention (atomically); whether it changed (with `check`: would change)."""
    df = pd.read_parquet(path)
    new = canonical(df, None if "sweep" in df else path.stem, siblings=path.parent)
    if new is df:
        return False
    if not check:
        write_parquet(new, path)
    return True
