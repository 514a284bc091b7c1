"""Collective-communication benchmark (handout 5.1, distributed_communication_single_node), launched on Ray
and, in the same run, without Ray (torch.multiprocessing), to show what the Ray layer costs.

Grid: all-reduce, all-gather, reduce-scatter, broadcast x float32 messages x world sizes, for each launch:
  * `ray`, gpu_visibility `shared`   (actors of a node see all its gang GPUs: NCCL peer-to-peer)
  * `ray`, gpu_visibility `isolated` (Ray's default: one visible GPU per actor)      - CUDA only
  * `mp`                             (one spawned process per GPU, no Ray)
Defaults: CUDA - 1 MB, 10 MB, 100 MB, 1 GB on 2, 4, 6 GPUs (world sizes the cluster cannot hold become
`skipped` rows); CPU (gloo) - 1 KB .. 1 MB on 2 and 4 ranks. Sizes are decimal (1 MB = 10^6 bytes).
Each trial: 5 warm-up calls, then `--iters` timed calls (CUDA events on GPU); the time is the max over ranks
of the per-rank mean; algbw = bytes / time, busbw = algbw x 2(n-1)/n (all-reduce), (n-1)/n (all-gather,
reduce-scatter), 1 (broadcast), as nccl-tests reports them. Every trial checks its result values afterwards.

Outputs, in `--out` (default: the repository's `results/`, see `raysys.cluster.resolve_out_dir`):
`allreduce.parquet` (one row per trial), `allreduce.md` (tables, for BENCHMARKS.md), `allreduce.png`
(busbw vs message size per op, one line per world size x launch).

    python sweeps/allreduce.py                                   # embedded Ray; CPU/gloo without a GPU
    python sweeps/allreduce.py --device cuda --out results       # on a GPU host
    ray job submit --working-dir . -- python sweeps/allreduce.py --out "$PWD/results"   # on a running cluster
    python sweeps/allreduce.py --report-only --out results       # redraw tables and plot from the Parquet file
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402

from parallel.collectives import OPS, aggregate, benchmark_collective  # noqa: E402
from raysys.cluster import cluster_nodes, init_ray, resolve_out_dir, run_sweep  # noqa: E402
from raysys.gang import resolve_device  # noqa: E402
from raysys.results import ResultWriter  # noqa: E402

SWEEP = "allreduce"
DEFAULTS = {"cuda": {"sizes": "1MB,10MB,100MB,1GB", "world_sizes": "2,4,6", "iters": 50},
            "cpu": {"sizes": "1KB,10KB,100KB,1MB", "world_sizes": "2,4", "iters": 10}}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


# ---------------------------------------------------------------------------------------------------- grid
def parse_size(text: str) -> int:
    """'10MB' -> 10_000_000 (decimal KB/MB/GB, binary KiB/MiB/GiB, or plain bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r} must look like 1KB, 10MB, 1GB, 64MiB or a byte count")
    num_bytes = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if num_bytes <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return num_bytes


def size_label(num_bytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


def parse_list(text: str, what: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    if allowed is not None and (bad := [t for t in items if t not in allowed]):
        raise ValueError(f"--{what}: {bad} not in {allowed}")
    return items


def trials(ops: list[str], sizes: list[int], warmup: int, iters: int) -> list[dict]:
    return [{"op": op, "size": size_label(n), "size_bytes": n, "warmup": warmup, "iters": iters}
            for op in ops for n in sizes]


def launches(device: str, launchers: list[str], visibilities: list[str]) -> list[tuple[str, str]]:
    """(launcher, gpu_visibility) pairs; visibility only distinguishes Ray launches on CUDA."""
    out = []
    for launcher in launchers:
        if launcher == "ray" and device == "cuda":
            out += [("ray", v) for v in visibilities]
        else:
            out.append((launcher, "shared"))
    return out


# ---------------------------------------------------------------------------------------------------- trial
def collective_trial(ctx, config: dict) -> dict:
    """On every rank: time `config['op']` on a `config['size_bytes']` message over the gang's group."""
    return benchmark_collective(config["op"], config["size_bytes"], ctx.process_group, ctx.device,
                                warmup=config["warmup"], iters=config["iters"])


def reduce_trial(config: dict, per_rank: list[dict]) -> dict:
    return aggregate(per_rank)


# ---------------------------------------------------------------------------------------------------- report
def _launch(row) -> str:
    return row.launcher + (f" {row.gpu_visibility}" if row.launcher == "ray" and row.gpu_visibility != "none" else "")


def markdown(df: pd.DataFrame) -> str:
    """Bus bandwidth and time per (op, size) x (world size, launch); Ray/mp and isolated/shared ratios;
    what did not run and why."""
    ok = df[df["status"] == "ok"].copy()
    parts = []
    if not ok.empty:
        ok["launch"] = [f"{r.world_size}x {_launch(r)}" for r in ok.itertuples()]
        ok["op"] = pd.Categorical(ok["op"], [op for op in OPS if op in set(ok["op"])], ordered=True)
        order = sorted(ok["launch"].unique(), key=lambda s: (int(s.split("x")[0]), s))
        for value, title in (("busbw_GBps", "Bus bandwidth (GB/s)"), ("time_ms", "Time per call (ms, slowest rank)")):
            table = ok.pivot_table(index=["op", "size_bytes", "size"], columns="launch", values=value, observed=True)
            table = table[order].reset_index().drop(columns="size_bytes")
            parts.append(f"{title}:\n\n" + table.to_markdown(index=False, floatfmt=".4g"))
        ok["launch"] = [_launch(r) for r in ok.itertuples()]
        bw = ok.pivot_table(index=["op", "size_bytes", "size", "world_size"], columns="launch", values="busbw_GBps",
                            observed=True)
        ray = "ray shared" if "ray shared" in bw else "ray"
        ratios = pd.DataFrame(index=bw.index)
        if {ray, "mp"} <= set(bw.columns):
            ratios[f"{ray} / mp"] = bw[ray] / bw["mp"]
        if {"ray shared", "ray isolated"} <= set(bw.columns):
            ratios["ray isolated / ray shared"] = bw["ray isolated"] / bw["ray shared"]
        if not ratios.empty:
            ratios = ratios.reset_index().drop(columns="size_bytes")
            parts.append("Bus-bandwidth ratios (1.0 = same speed):\n\n"
                         + ratios.to_markdown(index=False, floatfmt=".3f"))
    failed = df[df["status"] != "ok"]
    if not failed.empty:
        view = failed[["world_size", "launcher", "gpu_visibility", "status"]].copy()
        view["trials"] = failed.groupby(["world_size", "launcher", "gpu_visibility", "status"])["op"].transform("size")
        view["error"] = failed["error"].astype(str).str.split("\n").str[0].str[:120]
        view = view.drop_duplicates(subset=["world_size", "launcher", "gpu_visibility", "status"])
        parts.append("Not measured:\n\n" + view.to_markdown(index=False))
    return "\n\n".join(parts) + "\n"


def plot(df: pd.DataFrame, path: Path) -> Path | None:
    """busbw vs message size, one panel per op, one line per world size x launch; None if nothing ran."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if op in set(ok["op"])]
    cols = min(2, len(ops))
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    sizes = ok.drop_duplicates("num_bytes").sort_values("num_bytes")
    for ax, op in zip(axes.flat, ops):
        sub = ok[ok["op"] == op]
        for (ws, launch), line in sorted(sub.assign(launch=[_launch(r) for r in sub.itertuples()])
                                         .groupby(["world_size", "launch"])):
            line = line.sort_values("num_bytes")
            ax.plot(line["num_bytes"], line["busbw_GBps"], marker="o", label=f"{ws} ranks, {launch}")
        ax.set_xscale("log")
        ax.set_xticks(sizes["num_bytes"], sizes["size"])
        ax.minorticks_off()
        ax.set_title(op)
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    device = ", ".join(sorted(map(str, ok["device_name"].unique()))) if "device_name" in ok else ""
    fig.suptitle(f"Collectives, bus bandwidth ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(df: pd.DataFrame, out: Path) -> tuple[Path, Path | None]:
    md_path = out / f"{SWEEP}.md"
    md_path.write_text(f"## Collectives ({SWEEP})\n\n{markdown(df)}")
    return md_path, plot(df, out / f"{SWEEP}.png")


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the Ray cluster has GPUs")
    p.add_argument("--out", default=None, help="results directory (default: the repository's results/; give an "
                                               "absolute path under `ray job submit`)")
    p.add_argument("--resume", action="store_true", help="skip trials already in <out>/allreduce.parquet")
    p.add_argument("--world-sizes", default=None, help="comma list (default: 2,4,6 on cuda, 2,4 on cpu)")
    p.add_argument("--sizes", default=None, help="comma list of message sizes (default: 1MB,10MB,100MB,1GB on cuda, "
                                                 "1KB,10KB,100KB,1MB on cpu)")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of collectives (default: all four)")
    p.add_argument("--launchers", default="ray,mp", help="comma list of ray, mp (default: both)")
    p.add_argument("--visibility", default="shared,isolated",
                   help="GPU visibility of Ray actors, comma list of shared, isolated (cuda only; default: both)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing (default 5)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per trial (default 50 on cuda, 10 on cpu)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-trial and process-group timeout (s)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, a local `ray start` "
                                                   "cluster, else an embedded Ray)")
    p.add_argument("--dashboard", action="store_true", help="start the Ray dashboard with the embedded Ray")
    p.add_argument("--report-only", action="store_true", help="only redraw allreduce.md/png from the Parquet file")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    out = resolve_out_dir(args.out)
    if args.report_only:
        path = out / f"{SWEEP}.parquet"
        if not path.exists():
            raise ValueError(f"--report-only: {path} does not exist")
        df = pd.read_parquet(path)
    else:
        ops = parse_list(args.ops, "ops", OPS)
        launchers = parse_list(args.launchers, "launchers", ("ray", "mp"))
        visibilities = parse_list(args.visibility, "visibility", ("shared", "isolated"))
        if args.warmup < 0 or (args.iters is not None and args.iters < 1):
            raise ValueError(f"--warmup ({args.warmup}) must be >= 0 and --iters ({args.iters}) >= 1")
        init_ray(args.address, dashboard=args.dashboard)
        device = resolve_device(args.device)
        defaults = DEFAULTS[device]
        sizes = [parse_size(s) for s in parse_list(args.sizes or defaults["sizes"], "sizes")]
        world_sizes = [int(w) for w in parse_list(args.world_sizes or defaults["world_sizes"], "world-sizes")]
        if any(w < 2 for w in world_sizes):
            raise ValueError(f"--world-sizes {world_sizes}: a collective needs at least 2 ranks")
        grid = trials(ops, sizes, args.warmup, args.iters or defaults["iters"])
        writer = ResultWriter(out, SWEEP, resume=args.resume)
        max_node_cpus = max(n.num_cpus for n in cluster_nodes())
        for world_size in world_sizes:
            # gloo ranks mostly wait on sockets: on CPU up to two ranks may share a core (4 ranks on 2 cores).
            cpus_per_rank = 1.0 if device == "cuda" else max(0.5, min(1.0, max_node_cpus / world_size))
            for launcher, visibility in launches(device, launchers, visibilities):
                run_sweep(SWEEP, grid, collective_trial, world_size, device=device, launcher=launcher,
                          gpu_visibility=visibility, cpus_per_rank=cpus_per_rank, reduce=reduce_trial,
                          timeout_s=args.timeout_s, writer=writer, show=False)
        df = writer.frame()
    md_path, png_path = write_report(df, out)
    print(md_path.read_text())
    print(f"wrote {out / f'{SWEEP}.parquet'}, {md_path}" + (f", {png_path}" if png_path else ""))
    return df


if __name__ == "__main__":
    main()
