"""Turn result Parquet files into markdown tables (and `BENCHMARKS.md`).

`python -m raysys report results/` prints one table per sweep file: the configuration columns that vary,
the metric columns, and the status; provenance is summarised once per file. Sweeps that need a custom view
register a formatter with `register_section`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from raysys.results import read_results

PROVENANCE = ("git_sha", "torch_version", "triton_version", "ray_version", "device_name", "host", "utc", "sweep",
              "trial_id", "source", "error")
_SECTIONS: dict[str, Callable[[pd.DataFrame], str]] = {}


def register_section(sweep: str, formatter: Callable[[pd.DataFrame], str]) -> None:
    """Use `formatter(df) -> markdown` for the `<sweep>.parquet` file instead of the generic table."""
    _SECTIONS[sweep] = formatter


def varying_columns(df: pd.DataFrame) -> list[str]:
    keep = []
    for col in df.columns:
        if col in PROVENANCE or col.endswith("_path") or col.endswith("_png"):
            continue
        values = df[col].astype(str)
        if col == "status" or values.nunique(dropna=False) > 1:
            keep.append(col)
    return keep


def generic_table(df: pd.DataFrame, max_rows: int = 200) -> str:
    cols = varying_columns(df)
    view = df[cols].head(max_rows)
    for col in view.columns:
        if col.endswith("_bytes"):
            view = view.assign(**{col: view[col] / 2**30}).rename(columns={col: col[: -len("_bytes")] + "_GiB"})
    return view.to_markdown(index=False, floatfmt=".4g")


def provenance_line(df: pd.DataFrame) -> str:
    parts = []
    for col in ("device_name", "torch_version", "triton_version", "ray_version", "git_sha"):
        if col in df:
            parts.append(f"{col.replace('_', ' ')}: {', '.join(sorted(map(str, df[col].dropna().unique())))}")
    if "utc" in df:
        parts.append(f"measured {df['utc'].min()} .. {df['utc'].max()}")
    return "; ".join(parts)


def section(path: Path) -> str:
    df = read_results(path)
    body = _SECTIONS.get(path.stem, generic_table)(df)
    prov = provenance_line(df)
    return f"## {path.stem}\n\n" + (f"_{prov}_\n\n" if prov else "") + f"{body}\n"


def report(results_dir: str | Path, only: list[str] | None = None) -> str:
    results_dir = Path(results_dir)
    if not results_dir.exists():
        raise ValueError(f"results directory {results_dir} does not exist")
    files = sorted(results_dir.glob("*.parquet")) if results_dir.is_dir() else [results_dir]
    if only:
        files = [f for f in files if f.stem in only]
    if not files:
        raise ValueError(f"no .parquet files in {results_dir}")
    return "\n".join(section(f) for f in files)
