"""Ray Tune sweep over the FlashAttention-2 kernels' launch configs: tile sizes, warps, pipeline stages.

Every trial is one kernel (`fwd`, `dkdv` or `dq`), one launch config (block_m x block_n, num_warps,
num_stages) and one shape (seq, head dim, dtype, causal; batch 1, 16 heads), on one GPU. The trial runs the
kernel with that explicit config, checks its result against the same kernel under the first built-in
config (a config that computes something else fails), and times it with `triton.testing.do_bench`
(median). Metrics: `median_ms`, `tflops` (the kernel's matmuls: fwd 2, dK/dV 4, dQ 3 of the 2*pairs*d
each; the dK/dV and dQ times include the small D = rowsum(O * dO) kernel), `max_abs_err`. A config that does
not compile (shared memory, registers) or runs out of memory is a row too (`error` / `oom`).

Afterwards the best config of each (kernel, head dim, dtype) - lowest geometric-mean time over the swept
shapes - and each shape's winner are written to `kernels/flash_attention_tuned.json` (atomically; `--json`
elsewhere). The kernels' autotuner tries those first and, with `RAYSYS_FLASH_AUTOTUNE=0`, uses the one
tuned for the call's head dim and dtype. Writes `<out>/flash_tiles.parquet`.

Shapes are `seq/head_dim/dtype/{causal,full}` with dtype bf16, fp16, fp32 or the torch names; rows carry the
torch name (`4096/64/bfloat16/causal`), so both spellings resume the same trials. Each row is written when
its trial ends; `--max-trials` and `--time-budget-s` end a run cleanly (leave ~30 s of the budget for stopping
the last trials before an outer `timeout`), and `--resume` runs what is left.

    python sweeps/flash_tiles.py --out results                        # Ray Tune, one GPU per trial
    python sweeps/flash_tiles.py --shapes 4096/64/bf16/causal --time-budget-s 240 --resume --out results
    ray job submit --working-dir . -- python sweeps/flash_tiles.py --out "$PWD/results"
    python sweeps/flash_tiles.py --launcher local --quick --out /tmp/t # no Ray: trials in this process
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402

from kernels.flash_attention_tuning import KERNELS, TUNED_CONFIGS_PATH  # noqa: E402
from raysys.results import ResultWriter, error_row, make_row, trial_id  # noqa: E402

SWEEP = "flash_tiles"
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", **{d: d for d in DTYPES}}
# seq/head_dim/dtype/causal
SHAPES = ("16384/128/bfloat16/causal", "4096/128/bfloat16/causal", "16384/64/bfloat16/causal",
          "4096/128/bfloat16/full")
QUICK_SHAPES = ("4096/128/bfloat16/causal",)
HEADS = 16
# Tile shapes per kernel, written "block_m x block_n"; the causal split needs block_m % block_n == 0 for
# fwd and dq and block_n % block_m == 0 for dK/dV.
TILES = {
    "fwd": ("128x128", "128x64", "128x32", "64x64", "64x32"),
    "dkdv": ("64x128", "32x128", "16x128", "64x64", "32x64", "16x64"),
    "dq": ("128x64", "128x32", "128x16", "64x64", "64x32", "64x16"),
}
WARPS = (4, 8)
STAGES = (1, 2, 3, 4)
# Matmuls per kernel, in units of the forward's 2 * pairs * d (fwd: S, PV; dK/dV: S, dV, dP, dK; dQ: S, dP, dQ).
MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}


def parse_shape(shape: str) -> dict:
    """`seq/head_dim/dtype/{causal,full}` -> {seq, head_dim, dtype (torch name), causal}."""
    parts = shape.split("/")
    rule = f"seq/head_dim/{{{','.join(DTYPE_ALIASES)}}}/{{causal,full}}"
    if (len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in DTYPE_ALIASES
            or parts[3] not in ("causal", "full")):
        raise ValueError(f"shape {shape!r} must be {rule}, e.g. 4096/64/bf16/causal")
    seq, head_dim, dtype, mask = parts
    if int(seq) < 1 or int(head_dim) < 1:
        raise ValueError(f"shape {shape!r}: seq and head_dim must be positive")
    return dict(seq=int(seq), head_dim=int(head_dim), dtype=DTYPE_ALIASES[dtype], causal=mask == "causal")


def canonical_shape(shape: str) -> str:
    """The spelling rows and trial ids use: torch dtype names (`4096/64/bf16/causal` -> `.../bfloat16/...`)."""
    p = parse_shape(shape)
    return f"{p['seq']}/{p['head_dim']}/{p['dtype']}/{'causal' if p['causal'] else 'full'}"


def param_spaces(quick: bool, shapes: tuple[str, ...]) -> dict[str, dict]:
    """One grid per kernel (`{"grid_search": [...]}` is what `ray.tune.grid_search` builds); every
    combination is a valid config for its kernel."""
    import torch

    from kernels.flash_attention_tuning import candidates

    spaces = {}
    for kernel in KERNELS:
        if quick:  # the built-in 16-bit candidates' tiles
            tiles = sorted({f"{c.block_m}x{c.block_n}" for c in candidates(kernel, torch.bfloat16)})
            warps, stages = (4, 8), (2, 3)
        else:
            tiles, warps, stages = TILES[kernel], WARPS, STAGES
        spaces[kernel] = {"kernel": kernel, "tile": {"grid_search": list(tiles)},
                          "num_warps": {"grid_search": list(warps)}, "num_stages": {"grid_search": list(stages)},
                          "shape": {"grid_search": list(shapes)}}
    return spaces


def grid_configs(space: dict) -> list[dict]:
    """The configs a param space expands to (what `--launcher local` runs)."""
    axes = [[(k, x) for x in v["grid_search"]] if isinstance(v, dict) else [(k, v)] for k, v in space.items()]
    return [dict(combo) for combo in itertools.product(*axes)]


def trial(config: dict) -> dict:
    """One kernel, one launch config, one shape, on the GPU Ray (or the caller) assigned."""
    sys.path.insert(0, str(ROOT))
    import torch
    import triton.testing

    from kernels.flash_attention import FlashConfig, flash_attention_bwd, flash_attention_flops, flash_attention_fwd
    from kernels.flash_attention_tuning import candidates

    kernel = config["kernel"]
    block_m, block_n = (int(x) for x in config["tile"].split("x"))
    cfg = FlashConfig(block_m, block_n, config["num_warps"], config["num_stages"]).check(kernel)
    shape = parse_shape(config["shape"])
    dtype = getattr(torch, shape["dtype"])
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    dims = (1, HEADS, shape["seq"], shape["head_dim"])
    q, k, v, do = (torch.randn(dims, generator=gen, device=device, dtype=dtype) for _ in range(4))
    causal = shape["causal"]
    baseline = candidates(kernel, dtype, shape["head_dim"])[0]  # known-good reference config
    if kernel == "fwd":
        run = lambda c: flash_attention_fwd(q, k, v, causal, config=c)[0]  # noqa: E731
    else:
        out, lse = flash_attention_fwd(q, k, v, causal, config=candidates("fwd", dtype, shape["head_dim"])[0])
        if kernel == "dkdv":
            run = lambda c: flash_attention_bwd(q, k, v, out, lse, do, causal, dkdv_config=c,  # noqa: E731
                                                compute_dq=False)[1]
        else:
            run = lambda c: flash_attention_bwd(q, k, v, out, lse, do, causal, dq_config=c,  # noqa: E731
                                                compute_dkdv=False)[0]
    got, want = run(cfg).float(), run(baseline).float()
    err = float((got - want).abs().max())
    limit = (1e-4 if dtype == torch.float32 else 2e-2) * float(want.abs().max())
    if not err <= limit:  # NaN fails too
        raise RuntimeError(f"wrong result: max abs difference {err:.3g} from the baseline config > {limit:.3g}")
    ms = float(triton.testing.do_bench(lambda: run(cfg), warmup=25, rep=100, return_mode="median"))
    flops = flash_attention_flops(1, HEADS, shape["seq"], shape["seq"], shape["head_dim"], causal, "fwd")
    flops *= MATMULS[kernel] / 2
    return {"block_m": block_m, "block_n": block_n, **shape, "median_ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12, "max_abs_err": err}


class Budget:
    """At most `max_trials` trials and `time_budget_s` seconds over the whole run (None: no limit)."""

    def __init__(self, max_trials: int | None, time_budget_s: float | None):
        if max_trials is not None and max_trials < 0:
            raise ValueError(f"--max-trials ({max_trials}) must be >= 0")
        if time_budget_s is not None and not time_budget_s > 0:
            raise ValueError(f"--time-budget-s ({time_budget_s}) must be > 0")
        self.trials_left = max_trials
        self.deadline = None if time_budget_s is None else time.monotonic() + time_budget_s

    @property
    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.trials_left == 0 or (self.deadline is not None and self.seconds_left <= 0)

    def charge(self, num_trials: int) -> None:
        if self.trials_left is not None:
            self.trials_left = max(0, self.trials_left - num_trials)


def run_local(spaces: dict[str, dict], writer: ResultWriter, budget: Budget) -> None:
    import torch

    for kernel, space in spaces.items():
        for config in grid_configs(space):
            if writer.done(trial_id(config)):
                continue
            if budget.spent():
                return
            try:
                row = make_row(SWEEP, config, trial(config))
            except Exception as exc:  # compile failure, OOM, wrong result: a row, not the end of the sweep
                row = error_row(SWEEP, config, exc)
            finally:
                torch.cuda.empty_cache()
            writer.write([row])
            budget.charge(1)
            print(f"{kernel:4} {config['tile']:>7} w{config['num_warps']} s{config['num_stages']} {config['shape']:<26}"
                  f" -> {row['status']}" + (f" {row['median_ms']:.3f} ms {row['tflops']:.0f} TFLOP/s"
                                            if row["status"] == "ok" else f" ({row['error'][:70]})"), flush=True)


def run_tune(spaces: dict[str, dict], writer: ResultWriter, budget: Budget, resume: bool) -> None:
    """One Ray Tune run per kernel, one GPU per trial; each row is written when its trial ends."""
    from raysys.cluster import tune_run

    for space in spaces.values():
        if budget.spent():
            return
        # Trials are seconds long; a reused actor keeps its process, CUDA context and Triton's in-memory state.
        df = tune_run(trial, space, sweep=SWEEP, resources={"gpu": 1}, resume=resume, writer=writer, show=False,
                      max_trials=budget.trials_left, time_budget_s=budget.seconds_left, reuse_actors=True)
        budget.charge(len(df))


MIN_CONFIGS = 8
"""A (kernel, head dim, dtype) gets a tuned entry only once this many launch configs were measured on a shape."""


def best_configs(df: pd.DataFrame, min_configs: int = MIN_CONFIGS) -> dict[str, list[dict]]:
    """Per kernel: the geometric-mean winner of each (head dim, dtype), then each shape's winner.

    Only comparable numbers are compared: the geometric mean runs over the configs measured on every swept
    shape of that (kernel, head dim, dtype), where a shape counts as swept once it has `min_configs` measured
    configs and at least half as many as the most swept one (a shape a cut-short run reached with two configs
    would otherwise narrow the contest to those two); shapes with fewer get no per-shape entry either."""
    ok = df[df["status"] == "ok"].copy()
    if ok.empty:
        return {kernel: [] for kernel in KERNELS}
    for col in ("block_m", "block_n", "num_warps", "num_stages", "head_dim"):
        ok[col] = ok[col].astype(int)
    ok["log_ms"] = ok["median_ms"].map(math.log)
    keys = ["block_m", "block_n", "num_warps", "num_stages"]
    out: dict[str, list[dict]] = {}
    for kernel in KERNELS:
        entries = []
        sel = ok[ok["kernel"] == kernel]
        for (head_dim, dtype), group in sel.groupby(["head_dim", "dtype"]):
            per_shape = {shape: part.groupby(keys).ngroups for shape, part in group.groupby("shape")}
            floor = max(min_configs, max(per_shape.values()) / 2)
            swept = sorted(shape for shape, n in per_shape.items() if n >= floor)
            full = group[group["shape"].isin(swept)].groupby(keys).filter(
                lambda g, n=len(swept): g["shape"].nunique() == n)  # ran on every swept shape
            if full.empty:
                continue
            best = full.groupby(keys)["log_ms"].mean().idxmin()
            entries.append({**dict(zip(keys, map(int, best))), "head_dim": int(head_dim), "dtype": dtype,
                            "shapes": swept, "geomean_ms": round(math.exp(
                                full.groupby(keys)["log_ms"].mean().min()), 4)})
        for shape, group in sel.groupby("shape"):
            if group.groupby(keys).ngroups < min_configs:
                continue
            row = group.loc[group["median_ms"].idxmin()]
            entries.append({**{k: int(row[k]) for k in keys}, "head_dim": int(row["head_dim"]), "dtype": row["dtype"],
                            "shape": shape, "median_ms": round(float(row["median_ms"]), 4),
                            "tflops": round(float(row["tflops"]), 1)})
        out[kernel] = entries
    return out


def json_note(df: pd.DataFrame) -> str:
    """Where the tuned configs come from: trial counts and the device / versions they were measured with."""
    ok = df[df["status"] == "ok"]
    where = "; ".join(sorted({f"{r.device_name}, torch {r.torch_version}, triton {r.triton_version}"
                              for r in ok[["device_name", "torch_version", "triton_version"]].itertuples()}))
    return (f"written by sweeps/flash_tiles.py from the {len(ok)} measured trials ({len(df)} in all) of "
            f"flash_tiles.parquet ({where or 'no device'})")


def write_json(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results directory (default: raysys.cluster.resolve_out_dir)")
    parser.add_argument("--launcher", choices=("ray", "local"), default="ray",
                        help="ray: Ray Tune, one GPU per trial; local: every trial in this process")
    parser.add_argument("--quick", action="store_true", help="one shape, the built-in candidates only")
    parser.add_argument("--shapes", default=None, help="comma-separated seq/head_dim/dtype/{causal,full} list")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of fwd,dkdv,dq")
    parser.add_argument("--json", default=str(TUNED_CONFIGS_PATH), help="where to write the tuned configs")
    parser.add_argument("--no-json", action="store_true", help="do not write the tuned-config file")
    parser.add_argument("--resume", action="store_true", help="skip trials already in the Parquet file")
    parser.add_argument("--max-trials", type=int, default=None, help="run at most this many trials (all kernels)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="start no trial after this many seconds (ray: Tune also stops the running ones)")
    args = parser.parse_args(argv)
    shapes = tuple(args.shapes.split(",")) if args.shapes else (QUICK_SHAPES if args.quick else SHAPES)
    shapes = tuple(dict.fromkeys(canonical_shape(s.strip()) for s in shapes))
    kernels = [k for k in args.kernels.split(",") if k]
    if set(kernels) - set(KERNELS):
        raise ValueError(f"--kernels {args.kernels!r} must name some of {KERNELS}")
    budget = Budget(args.max_trials, args.time_budget_s)

    if args.launcher == "ray":
        from raysys.cluster import resolve_out_dir

        out = resolve_out_dir(args.out)
    else:
        out = Path(args.out or ROOT / "results").expanduser().resolve()
    writer = ResultWriter(out, SWEEP, resume=args.resume)
    spaces = {k: v for k, v in param_spaces(args.quick, shapes).items() if k in kernels}
    if args.launcher == "ray":
        run_tune(spaces, writer, budget, args.resume)
    else:
        run_local(spaces, writer, budget)
    have = {r["trial_id"] for r in writer.rows}
    not_run = sum(trial_id(c) not in have for space in spaces.values() for c in grid_configs(space))
    if not_run:
        print(f"{not_run} trials of this grid did not run (budget or interrupt); rerun with --resume to run them")
    df = writer.frame()
    tuned = best_configs(df)
    if not args.no_json:
        write_json({"note": json_note(df), **tuned}, Path(args.json))
        print(f"tuned configs -> {args.json}")
    for kernel, entries in tuned.items():
        for e in entries[:3]:
            print(f"  {kernel:4} {e}")
    return df


if __name__ == "__main__":
    from raysys.cli import run_script

    try:
        sys.exit(run_script(main))
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM during a Ray Tune run): finished trials are on disk
        sys.exit(130)
