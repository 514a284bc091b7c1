"""Collective-communication benchmark (handout 5.1, distributed_communication_single_node), launched on Ray
and, in the same run, without Ray (torch.multiprocessing), to show what the Ray layer costs; one row per trial
in `<out>/allreduce.parquet` (`--sweep-name` for another stem).

Grid: all-reduce, all-gather, reduce-scatter, broadcast x float32 messages x world sizes x NCCL settings
(`--nccl-env`) x launch (`ray` shared, `ray` isolated (CUDA only), `mp`); sizes, timing and bandwidths as
`parallel.collectives` defines them. Targets and grid: docs/studies.md.

    python sweeps/allreduce.py --out /tmp/coll                   # embedded Ray; CPU/gloo without a GPU
    python sweeps/allreduce.py --device cuda --world-sizes 2 --launchers mp --sizes 64MiB,1GiB \
        --nccl-env default --nccl-env NCCL_ALGO=Ring --out /tmp/coll    # compare NCCL settings
    ray job submit --working-dir . -- python sweeps/allreduce.py --out "$PWD/results" --overwrite
    python sweeps/allreduce.py --report-only --out results       # redraw tables and plot from the Parquet file
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pandas as pd

from parallel.collectives import OPS, aggregate, benchmark_collective
from raysys.cluster.rank import check_rank_env
from raysys.measure.timing import MAX_STEPS
from sweeps.common import (NOT_ON_CPU, check_int, check_timeout, list_flag, main_entry, on_cpu,
                           open_writer, output_dir, parse_ints, parse_list, print_written, pyplot, read_rows,
                           save_figure, start_ray, study_parser, write_markdown)

SWEEP = "allreduce"
DEFAULTS = {"cuda": {"sizes": "1MiB,8MiB,64MiB,128MiB,512MiB,1GiB", "world_sizes": "2,4,6", "iters": 50},
            "cpu": {"sizes": "1KiB,8KiB,64KiB,1MiB", "world_sizes": "2,4", "iters": 10}}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_LABELS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
# The GPU targets (2x H200, NVLink): 1 GiB all-reduce bus bandwidth, and what Ray may cost at large messages.
TARGET_ALL_REDUCE_BYTES, TARGET_BUSBW_GBPS, TARGET_RAY_OVER_MP = 2**30, 350.0, 0.97


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
    """The shortest exact label: 1073741824 -> '1GiB', 10**9 -> '1GB', 8192 -> '8KiB', 1500 -> '1500B'."""
    exact = [f"{num_bytes // scale}{unit}" for unit, scale in _LABELS if num_bytes >= scale and num_bytes % scale == 0]
    return min(exact, key=len, default=f"{num_bytes}B")  # min keeps the first (binary) of equally short labels


def parse_nccl_env(text: str) -> dict[str, str]:
    """'NCCL_ALGO=Ring,NCCL_PROTO=Simple' -> {...}; '' or 'default' -> {} (NCCL's own choices)."""
    if text.strip() in ("", "default"):
        return {}
    env: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not re.fullmatch(r"NCCL_[A-Z0-9_]+", key) or not value:
            raise ValueError(f"--nccl-env {text!r}: {item.strip()!r} must look like NCCL_NAME=value "
                             f"(comma-separated; 'default' for none)")
        if key in env:
            raise ValueError(f"--nccl-env {text!r} sets {key} twice")
        env[key] = value
    check_rank_env(env)  # e.g. NCCL_NVLS_ENABLE=1 is refused: multicast stays off
    return env


def nccl_env_label(env: dict[str, str]) -> str:
    """The `nccl_env` column: sorted KEY=VAL pairs, '' for the default."""
    return ",".join(f"{k}={env[k]}" for k in sorted(env))


def trials(ops: list[str], sizes: list[int], warmup: int, iters: int, nccl_env: str = "") -> list[dict]:
    return [{"op": op, "size": size_label(n), "size_bytes": n, "warmup": warmup, "iters": iters, "nccl_env": nccl_env}
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
    import torch

    out = benchmark_collective(config["op"], config["size_bytes"], ctx.process_group, ctx.device,
                               warmup=config["warmup"], iters=config["iters"])
    # What NCCL actually ran with: the rank's NCCL_* variables (the asked-for setting plus the host's own).
    out["nccl_vars"] = ",".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_"))
    out["nccl_version"] = (".".join(map(str, torch.cuda.nccl.version())) if ctx.backend == "nccl" else "")
    return out


def reduce_trial(config: dict, per_rank: list[dict]) -> dict:
    return {**aggregate(per_rank), "nccl_vars": per_rank[0]["nccl_vars"], "nccl_version": per_rank[0]["nccl_version"]}


# ---------------------------------------------------------------------------------------------------- report
def _launch(row) -> str:
    return row.launcher + (f" {row.gpu_visibility}" if row.launcher == "ray" and row.gpu_visibility != "none" else "")


def _measured(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows with `launch` and `variant` (NCCL setting, 'default' when none; files without the column
    predate `--nccl-env` and ran NCCL's defaults)."""
    ok = df[df["status"] == "ok"].copy()
    ok["launch"] = [_launch(r) for r in ok.itertuples()]
    env = ok["nccl_env"].fillna("") if "nccl_env" in ok else pd.Series("", index=ok.index)
    ok["variant"] = env.replace("", "default")
    return ok


def _variant_order(ok: pd.DataFrame) -> list[str]:
    return sorted(ok["variant"].unique(), key=lambda v: (v != "default", v))


def _same_run_ratio(launch: pd.DataFrame, mp: pd.DataFrame) -> tuple[pd.Series | None, str]:
    """busbw of `launch` / busbw of `mp` per op, from rows of one run (`run_id`): the latest run that measured
    both launches, and every op it measured both ways. (None, "") if no run did (rows without a run id never
    pair: they cannot show they come from one run)."""
    if "run_id" not in launch or "run_id" not in mp:
        return None, ""
    pairs = launch.merge(mp, on=["op", "run_id"], suffixes=("", "_mp")).dropna(subset=["run_id"])
    if pairs.empty:
        return None, ""
    run = pairs.sort_values("utc" if "utc" in pairs else "run_id")["run_id"].iloc[-1]
    pairs = pairs[pairs["run_id"] == run]
    return pairs.set_index("op")["busbw_GBps"] / pairs.set_index("op")["busbw_GBps_mp"], run


def target_lines(df: pd.DataFrame) -> list[str]:
    """The targets against the measured rows, one line per (world size, NCCL setting) that has data; GPU
    targets, so rows measured on the CPU get no verdict."""
    ok = _measured(df)
    cpu = on_cpu(df)
    judge = lambda passed: NOT_ON_CPU if cpu else "PASS" if passed else "FAIL"  # noqa: E731
    ok["variant"] = pd.Categorical(ok["variant"], _variant_order(ok), ordered=True)  # default first
    multi = ok["variant"].nunique() > 1
    where = lambda ws, variant: f"{ws} ranks" + (f", {variant}" if multi else "")  # noqa: E731
    lines = []
    goal = f"all_reduce busbw at {size_label(TARGET_ALL_REDUCE_BYTES)} >= {TARGET_BUSBW_GBPS:g} GB/s"
    ar = ok[ok["op"] == "all_reduce"]
    at = ar[ar["size_bytes"] == TARGET_ALL_REDUCE_BYTES]
    if at.empty:
        if cpu:
            lines.append(f"{goal}: {NOT_ON_CPU}")
        elif ar.empty:
            lines.append(f"{goal}: not measured (no all_reduce rows)")
        else:
            big = ar[ar["size_bytes"] == ar["size_bytes"].max()]
            best = big.loc[big["busbw_GBps"].idxmax()]
            lines.append(f"{goal}: not measured at {size_label(TARGET_ALL_REDUCE_BYTES)} "
                         f"({TARGET_ALL_REDUCE_BYTES:,} B); the largest all_reduce, {best['size']} "
                         f"({int(best['size_bytes']):,} B), reached {best['busbw_GBps']:.1f} GB/s "
                         f"({where(best['world_size'], best['variant'])}, {best['launch']})")
    for (ws, variant), part in at.groupby(["world_size", "variant"], observed=True):
        best = part["busbw_GBps"].max()
        each = ", ".join(f"{r.launch} {r.busbw_GBps:.1f}" for r in part.sort_values("launch").itertuples())
        lines.append(f"{goal}, {where(ws, variant)}: {judge(best >= TARGET_BUSBW_GBPS)} "
                     f"(best {best:.1f} GB/s; {each})")
    for (ws, variant), part in ok.groupby(["world_size", "variant"], observed=True):
        big = part[part["size_bytes"] == part["size_bytes"].max()]
        label = big["size"].iloc[0]
        goal = f"busbw at the largest size ({label}) >= {TARGET_RAY_OVER_MP:g}, {where(ws, variant)}"
        for launch in sorted(set(big["launch"]) - {"mp"}):
            ratio, run = _same_run_ratio(big[big["launch"] == launch], big[big["launch"] == "mp"])
            if ratio is None:
                if (big["launch"] == "mp").any():
                    lines.append(f"{launch} / mp {goal}: not measured in one run (no run has both launches; "
                                 "run the grid without --resume)")
                continue
            worst = ratio.idxmin()
            unpaired = sorted(set(big.loc[big["launch"] == launch, "op"]) - set(ratio.index))
            verdict = (NOT_ON_CPU if cpu else "FAIL" if ratio.min() < TARGET_RAY_OVER_MP
                       else "INCOMPLETE" if unpaired else "PASS")
            lines.append(f"{launch} / mp {goal}: {verdict} (run {run}; worst {ratio.min():.3f}, {worst}; "
                         + ", ".join(f"{op} {r:.3f}" for op, r in ratio.items())
                         + (f"; not measured by both in that run: {', '.join(unpaired)}" if unpaired else "") + ")")
    if not ok.empty and (ok["launch"] == "mp").sum() == 0:
        lines.append(f"ray / mp busbw >= {TARGET_RAY_OVER_MP:g}: not measured (no mp launch)")
    return lines


def markdown(df: pd.DataFrame) -> str:
    """How to read the numbers; bus bandwidth and time per (op, size[, NCCL setting]) x (world size, launch);
    Ray/mp and isolated/shared ratios; NCCL settings side by side; the targets; what did not run and why."""
    ok = _measured(df)
    parts = ["Message size as nccl-tests counts it: the full tensor on each rank (all_reduce, broadcast: the "
             "buffer; all_gather: the gathered output, each rank sends size/n; reduce_scatter: the input, each "
             "rank keeps size/n), so one size is the same per-rank buffer in every op. 1GiB = 2^30 B, 1GB = 10^9 B. "
             "algbw = size / time (slowest rank's mean); busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n "
             "(all_gather, reduce_scatter), 1 (broadcast); GB/s = 10^9 B/s."]
    if not ok.empty:
        ok["op"] = pd.Categorical(ok["op"], [op for op in OPS if op in set(ok["op"])], ordered=True)
        ok["variant"] = pd.Categorical(ok["variant"], _variant_order(ok), ordered=True)
        multi = len(ok["variant"].cat.categories) > 1
        keys = ["op", "size_bytes", "size"] + (["variant"] if multi else [])
        ok["column"] = [f"{r.world_size}x {r.launch}" for r in ok.itertuples()]
        order = sorted(ok["column"].unique(), key=lambda s: (int(s.split("x")[0]), s))
        ok["time_mean_ms"] = 1e3 * ok["time_mean_s"]  # the table shows milliseconds
        for value, title in (("busbw_GBps", "Bus bandwidth (GB/s)"),
                             ("time_mean_ms", "Time per call (ms, slowest rank)")):
            table = ok.pivot_table(index=keys, columns="column", values=value, observed=True)
            table = table[order].reset_index().drop(columns="size_bytes")
            parts.append(f"{title}:\n\n" + table.to_markdown(index=False, floatfmt=".4g"))
        bw = ok.pivot_table(index=keys + ["world_size"], columns="launch", values="busbw_GBps", observed=True)
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
        if multi:
            # Long format: one line per measured (op, size, ranks, launch, setting), next to that cell's default.
            keys = ["op", "size_bytes", "size", "world_size", "launch"]
            cells = ok.groupby(keys + ["variant"], observed=True)["busbw_GBps"].mean().reset_index()
            default = cells[cells["variant"] == "default"].set_index(keys)["busbw_GBps"]
            cells = cells[cells.groupby(keys, observed=True)["variant"].transform("nunique") > 1]
            cells["vs default"] = cells["busbw_GBps"] / cells.set_index(keys).index.map(default)
            cells = cells.sort_values(keys[:1] + ["size_bytes", "world_size", "launch", "busbw_GBps"],
                                      ascending=[True, True, True, True, False])
            parts.append("Bus bandwidth by NCCL setting (GB/s; `--nccl-env`), where more than one was measured:\n\n"
                         + cells.drop(columns="size_bytes").rename(columns={"busbw_GBps": "busbw (GB/s)"})
                         .to_markdown(index=False, floatfmt=".4g"))
        info = []
        if "nccl_version" in ok and (versions := sorted(v for v in ok["nccl_version"].dropna().unique() if v)):
            info.append(f"NCCL {', '.join(versions)}")
        if "nccl_vars" in ok:
            for variant, part in ok.groupby("variant", observed=True):
                seen = sorted({v for v in part["nccl_vars"].dropna()})
                listed = "; ".join(f"`{v}`" for v in seen) or "none"
                info.append(f"NCCL variables in the ranks ({variant}): {listed}")
        if info:
            parts.append("\n".join(f"- {line}" for line in info))
    failed = df[df["status"] != "ok"]
    if not failed.empty:
        keys = ["world_size", "launcher", "gpu_visibility", "status"]
        view = failed[keys].copy()
        view["trials"] = failed.groupby(keys)["op"].transform("size")
        view["error"] = failed["error"].astype(str).str.split("\n").str[0].str[:120]
        view = view.drop_duplicates(subset=keys)
        parts.append("Not measured:\n\n" + view.to_markdown(index=False))
    parts.append("Targets:\n\n" + "\n".join(f"- {line}" for line in target_lines(df)))
    return "\n\n".join(parts) + "\n"


def plot(df: pd.DataFrame, path: Path) -> Path | None:
    """busbw vs message size, one panel per op, one line per world size x launch [x NCCL setting]; None if
    nothing ran."""
    ok = _measured(df)
    if ok.empty:
        return None
    plt = pyplot()
    ops = [op for op in OPS if op in set(ok["op"])]
    multi = ok["variant"].nunique() > 1
    cols = min(2, len(ops))
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    sizes = ok.drop_duplicates("size_bytes").sort_values("size_bytes")
    for ax, op in zip(axes.flat, ops):
        sub = ok[ok["op"] == op]
        for (ws, launch, variant), line in sorted(sub.groupby(["world_size", "launch", "variant"])):
            line = line.sort_values("size_bytes")
            label = f"{ws} ranks, {launch}" + (f", {variant}" if multi else "")
            ax.plot(line["size_bytes"], line["busbw_GBps"], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xticks(sizes["size_bytes"], sizes["size"])
        ax.minorticks_off()
        ax.set_title(op)
        ax.set_xlabel("message size (per-rank tensor)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    device = ", ".join(sorted(map(str, ok["device_name"].unique()))) if "device_name" in ok else ""
    fig.suptitle(f"Collectives, bus bandwidth ({device})", fontsize=10)
    return save_figure(fig, path)


PLANNER_SIZE, PLANNER_BATCH, PLANNER_DEVICES = "xl", 8192, [2, 4, 8, 16, 32, 64, 128]


def planner_tables(path: Path) -> str:
    """`python -m raysys plan --size xl --batch 8192` (handout 8) with W = the best measured all-reduce bus
    bandwidth per world size in the Parquet file at `path`."""
    from parallel.planner import H200_BF16_FLOPS, FFNProblem, bandwidth_from_results, plan_tables
    from raysys.model.config import SIZES

    size, parts = SIZES[PLANNER_SIZE], []
    for src in bandwidth_from_results(path):
        problem = FFNProblem(batch=PLANNER_BATCH, d_model=size["d_model"], d_ff=size["d_ff"], flops=H200_BF16_FLOPS,
                             bandwidth=src["busbw_GBps"] * 1e9, bytes_per_element=2)
        tables = plan_tables(problem, PLANNER_DEVICES).replace("\n### ", "\n#### ")
        parts.append(f"### Parallelism planner ({PLANNER_SIZE} FFN, `python -m raysys plan --size {PLANNER_SIZE} "
                     f"--batch {PLANNER_BATCH}`), W from {src['source']}\n\n{tables}")
    return "\n\n".join(parts)


def write_report(df: pd.DataFrame, out: Path, name: str = SWEEP) -> tuple[Path, Path | None]:
    """`<name>.md` (with the planner at the measured bandwidth, for the GPU grid) and `<name>.png`."""
    text = markdown(df)
    if name == SWEEP and not on_cpu(df) and (planner := planner_tables(out / f"{name}.parquet")):
        text = f"{text.rstrip()}\n\n{planner}\n"
    return write_markdown(out, name, "Collectives", text), plot(df, out / f"{name}.png")


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = study_parser(__doc__, SWEEP, ray=True, timeout_s=120.0,
                     device_help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda if the Ray cluster has GPUs")
    list_flag(p, "--world-sizes", default=None, aliases=("--world-size",),
              help=f"comma list (default: {DEFAULTS['cuda']['world_sizes']} on cuda, "
                   f"{DEFAULTS['cpu']['world_sizes']} on cpu)")
    list_flag(p, "--sizes", default=None, help="comma list of message sizes, e.g. 1MiB,1GiB or 1MB,1GB\n"
                                               f"(default: {DEFAULTS['cuda']['sizes']} on cuda, "
                                               f"{DEFAULTS['cpu']['sizes']} on cpu)")
    list_flag(p, "--ops", default=",".join(OPS), help="comma list of collectives")
    list_flag(p, "--launchers", default="ray,mp", aliases=("--launcher",), help="comma list of ray, mp")
    list_flag(p, "--visibility", default="shared,isolated",
              help="GPU visibility of Ray actors, comma list of shared, isolated (cuda only)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    p.add_argument("--iters", type=int, default=None, help=f"timed calls per trial (default: "
                                                           f"{DEFAULTS['cuda']['iters']} on cuda, "
                                                           f"{DEFAULTS['cpu']['iters']} on cpu)")
    p.add_argument("--nccl-env", action="append", default=None, metavar="KEY=VAL,...",
                   help="NCCL variables set in every rank (both launchers), e.g. NCCL_ALGO=Ring or\n"
                        "NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32; repeat to compare settings in one run,\n"
                        "'default' for NCCL's own choices (default: only that). Multicast stays off.")
    p.add_argument("--sweep-name", default=SWEEP, help="file stem of the rows and report; e.g.\n"
                                                        "allreduce_scan for a settings scan kept apart from the grid")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    # Here, not at the top: the ranks import this module for `collective_trial` and need no Ray (a second a rank).
    from raysys.cluster.gang import gang_device
    from raysys.cluster.mp_gang import local_device
    from raysys.cluster.rank import local_cpus
    from raysys.cluster.sweep import check_gang, cluster_nodes, run_sweep

    args = build_parser().parse_args(argv)
    name = args.sweep_name
    if args.report_only:
        df, out = read_rows(args, name), output_dir(args, name)
        print_written(out, name, *write_report(df, out, name))
        return df
    ops = parse_list(args.ops, "ops", OPS)
    launchers = parse_list(args.launchers, "launchers", ("ray", "mp"))
    visibilities = parse_list(args.visibility, "visibility", ("shared", "isolated"))
    check_int("--warmup", args.warmup, 0, MAX_STEPS)
    if args.iters is not None:
        check_int("--iters", args.iters, 1, MAX_STEPS)
    check_timeout("--timeout-s", args.timeout_s)
    variants = [parse_nccl_env(text) for text in (args.nccl_env or ["default"])]
    labels = [nccl_env_label(env) for env in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--nccl-env: {args.nccl_env} names one setting twice")
    explicit_sizes = [parse_size(s) for s in parse_list(args.sizes, "sizes")] if args.sizes else None
    world_sizes = parse_ints(args.world_sizes, "world-sizes", 2) if args.world_sizes else None
    if "mp" in launchers and world_sizes:  # this machine must hold every plain-process gang
        for world_size in world_sizes:
            check_gang(world_size, device=args.device, launcher="mp")
    out = output_dir(args, name)
    settings = {"warmup": args.warmup, **({"iters": args.iters} if args.iters is not None else {})}
    with open_writer(out, name, args, expect=settings) as writer:  # a file to resume: these settings (before Ray)
        on_ray = "ray" in launchers  # plain-process gangs only: no Ray started, this machine's device and CPUs
        if on_ray:
            start_ray(args)
        device = gang_device(args.device) if on_ray else local_device(args.device)
        defaults = DEFAULTS[device]
        writer.check_resume({"iters": args.iters or defaults["iters"]})
        sizes = explicit_sizes or [parse_size(s) for s in parse_list(defaults["sizes"], "sizes")]
        world_sizes = world_sizes or parse_ints(defaults["world_sizes"], "world-sizes", 2)
        max_node_cpus = max(n.num_cpus for n in cluster_nodes()) if on_ray else local_cpus()
        for world_size in world_sizes:
            # gloo ranks mostly wait on sockets: on CPU up to two ranks may share a core (4 ranks on 2 cores).
            cpus_per_rank = 1.0 if device == "cuda" else max(0.5, min(1.0, max_node_cpus / world_size))
            for env, label in zip(variants, labels):  # each setting in fresh rank processes: a gang per call
                grid = trials(ops, sizes, args.warmup, args.iters or defaults["iters"], label)
                for launcher, visibility in launches(device, launchers, visibilities):
                    run_sweep(name, grid, collective_trial, world_size, device=device, launcher=launcher,
                              gpu_visibility=visibility, cpus_per_rank=cpus_per_rank, reduce=reduce_trial,
                              timeout_s=args.timeout_s, env=env, writer=writer, show=False)
        df = writer.frame()
    print_written(out, name, *write_report(df, out, name))
    return df


if __name__ == "__main__":
    sys.exit(main_entry(main))
