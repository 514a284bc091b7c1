"""Print the FlashAttention result tables of a results directory: launch configs and benchmark rows.

Reads `<dir>/flash_tiles.parquet` (best five configs per kernel and shape, and the failed ones) and
`<dir>/flash_bench.parquet` (latency, TFLOP/s and speedups against SDPA's flash and cuDNN backends).

    python sweeps/flash_summary.py results
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def tiles_table(df: pd.DataFrame, top: int = 5) -> str:
    lines = [f"launch configs: {dict(df['status'].value_counts())}"]
    df = df.assign(variant=df["variant"].fillna("portable") if "variant" in df else "portable")
    ok = df[df["status"] == "ok"]
    for (kernel, shape), group in ok.groupby(["kernel", "shape"]):
        lines.append(f"-- {kernel} @ {shape}")
        lines.append(group.nsmallest(top, "median_ms")[["variant", "tile", "num_warps", "num_stages", "median_ms",
                                                         "tflops"]].to_string(index=False, float_format=_fmt))
    bad = df[df["status"] != "ok"]
    if len(bad):
        lines.append(bad[["kernel", "variant", "tile", "num_warps", "num_stages", "status"]]
                     .assign(error=bad["error"].astype(str).str[:90]).to_string(index=False))
    return "\n".join(lines)


def bench_table(df: pd.DataFrame) -> str:
    cols = ["study", "provider", "path", "batch", "seq", "head_dim", "dtype", "heads", "status", "fwd_ms", "fwd_tflops",
            "bwd_ms",
            "bwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops", "speedup_fwd_vs_sdpa_flash", "speedup_fwd_vs_sdpa_cudnn",
            "speedup_fwd_bwd_vs_sdpa_flash", "speedup_fwd_bwd_vs_sdpa_cudnn", "max_abs_err"]
    lines = [df[[c for c in cols if c in df]].to_string(index=False, float_format=_fmt)]
    if "triton_configs" in df:
        lines += [f"triton picks: {p}" for p in df["triton_configs"].dropna().unique() if p]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="directory holding flash_tiles.parquet and/or flash_bench.parquet")
    args = parser.parse_args(argv)
    pd.set_option("display.width", 250)
    root = Path(args.results)
    for name, table in (("flash_tiles", tiles_table), ("flash_bench", bench_table)):
        path = root / f"{name}.parquet"
        if path.exists():
            print(f"===== {name}")
            print(table(pd.read_parquet(path)))


if __name__ == "__main__":
    main()
