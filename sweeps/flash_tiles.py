"""Ray Tune sweep over the FlashAttention-2 kernels' launch configs: tile sizes, warps, pipeline stages.

A trial is one kernel (`fwd`, `dkdv`, `dq`, `dkdvq`), one variant (`--variants`: portable, tma plain, warp-specialised,
persistent or register-capped, `gluon` / `gluon_persistent`), one launch config and one shape
`[BxH/]seq/head_dim/dtype/{causal,full}`: checked against the kernel's first built-in config, timed by `do_bench`, a
row of `<out>/flash_tiles.parquet` (also when it does not build or fit). The winners go to
`<out>/flash_attention_tuned.json` (`--json kernels/attention/triton/tuned.json` installs them), the three fastest
per kernel and shape to `<out>/flash_tiles.md`. Ranking, budgets and resuming: docs/studies.md.

    python sweeps/flash_tiles.py --out /tmp/tiles                     # Ray Tune, one GPU per trial
    python sweeps/flash_tiles.py --shapes 4096/64/bf16/causal --time-budget-s 240 --resume --out /tmp/tiles
    python sweeps/flash_tiles.py --launcher local --quick --out /tmp/t # no Ray: trials in this process
    TRITON_INTERPRET=1 python sweeps/flash_tiles.py --device cpu --launcher local --quick \
        --shapes 64/16/fp32/causal --no-json --out /tmp/t             # CPU, the Triton interpreter
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import pandas as pd

from kernels.attention.dispatch import TUNED_CONFIGS_PATH
from kernels.attention.triton.tuning import KERNELS
from raysys.measure.device import DTYPES, resolve_device
from raysys.measure.timing import median_s
from raysys.results.files import write_text
from raysys.results.records import ResultWriter, error_row, make_row, trial_id
from sweeps.common import (PROGRESS, list_flag, main_entry, open_writer, output_dir, parse_list,
                           redraw_report, start_ray, study_parser, write_markdown)

SWEEP = "flash_tiles"
# A shape's dtype: raysys's short names (bf16, fp16, fp32) or the torch names rows carry (bfloat16, ...).
TORCH_NAMES = {name: str(DTYPES[name]).removeprefix("torch.") for name in sorted(DTYPES)}
DTYPE_ALIASES = {**TORCH_NAMES, **{torch_name: torch_name for torch_name in TORCH_NAMES.values()}}
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
    "dkdvq": ("64x128", "32x128", "16x128", "64x64", "32x64", "16x64"),
}
WARPS = (4, 8)
STAGES = (1, 2, 3, 4)
# Matmuls per kernel, in units of the forward's 2 * pairs * d (fwd: S, PV; dK/dV: S, dV, dP, dK; dQ: S, dP, dQ;
# the one-pass dK/dV/dQ: S, dV, dP, dK, dQ).
MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3, "dkdvq": 5}
# Kernel variants: path, warp specialisation, persistent grid (kernels/attention/triton/tuning.py), and the
# register cap of REGISTER_CAPS (Triton's maxnreg: 128 lets two 8-warp programs share an SM). A trial without a
# `variant` key is `portable`.
VARIANTS = {"portable": ("portable", False, False), "tma": ("tma", False, False), "tma_ws": ("tma", True, False),
            "tma_persistent": ("tma", False, True), "tma_ws_persistent": ("tma", True, True),
            "tma_r128": ("tma", False, False), "gluon": ("gluon", False, False),
            "gluon_persistent": ("gluon", False, True)}
REGISTER_CAPS = {"tma_r128": 128}
# The Gluon kernels (sm_90; GLUON_VARIANTS, `gluon_persistent` on their persistent grids): the forward's knobs
# (`GluonConfig`) and the one-pass backward's (`GluonBwdConfig`), on shapes of head dim 64 or 128 in bf16 / fp16.
# What each axis is for: docs/studies.md.
GLUON_VARIANTS = ("gluon", "gluon_persistent")
GLUON_KERNELS = {"fwd": "fwd", "dkdvq": "bwd"}
"""Sweep kernel -> the tuned file's `gluon` kind."""
GLUON_TILES = {"fwd": ("64x128", "64x64", "128x64"), "dkdvq": ("64x64",)}
GLUON_STAGES = {"fwd": (2, 3), "dkdvq": (1, 2, 3)}
GLUON_CONSUMERS = (1, 2, 3)
GLUON_GROUPS = {"fwd": (0, 8), "dkdvq": (0, 4, 8)}
"""`head_group`: heads whose work items run together, 0 for all."""
GLUON_EXP2 = (0, 8)
"""`GluonConfig.exp2_emulated`: none, or one exp2 in 8 on the FMA pipe."""
GLUON_RESCALE = (False, True)
"""`GluonConfig.rescale_under_s`: O's rescale after the next S is issued, or at the end of the iteration."""
GLUON_DQ = {"whole": (True, False), "halves": (False, False), "whole_dk_late": (True, True)}
"""The one-pass backward's dQ axis -> its (`GluonBwdConfig.dq_whole`, `dk_late`); rows record the two fields."""
GLUON_DQ_BUFFERS = (1, 2)
"""`GluonBwdConfig.dq_buffers`; two whole tiles per group do not fit at d 128 (`SharedMemoryExceeded`)."""
GLUON_KEYS = ["block_m", "block_n", "num_stages", "num_consumers", "persistent", "head_group"]
GLUON_FWD_KEYS = GLUON_KEYS + ["exp2_emulated", "rescale_under_s"]
GLUON_BWD_KEYS = GLUON_KEYS + ["dq_whole", "dk_late", "rows_tma", "dq_buffers"]
"""The one-pass backward's fields in rows and tuned entries (`rows_tma` is not swept: rows record its default)."""
ROW_DEFAULTS = {"path": "portable", "warp_specialize": False, "persistent": False, "maxnreg": 0, "head_group": 0,
                "exp2_emulated": 0, "rescale_under_s": False, "dq_whole": False, "dk_late": False, "rows_tma": False,
                "dq_buffers": 1}
"""What a row without the column ran (rows of runs before the axis existed); the bool ones are flags."""
SWEPT_SINCE = {"fwd": "rescale_under_s", "dkdvq": "dq_buffers"}
"""The axis each Gluon kernel's grid gained last: the number of its values in the rows of a head dim and dtype (with
the trials that did not fit) multiplies that grid's size (rows without the axis hold one value)."""
UNFIT_ERRORS = ("OutOfResources", "SharedMemoryExceeded")
"""How the `error` of a trial whose config does not fit the device begins: Triton's build or launch, or the launcher's
own check before it (`kernels.attention.gluon.runtime.SharedMemoryExceeded`)."""
QUICK_PER_VARIANT = 4  # --quick: the first built-in candidates of each variant
PAIRED_KEY = "paired_speedup_kernel_vs_reference"
"""--paired-rounds: a gluon trial's median over alternating rounds of (the reference's time / its config's time),
the reference being the config the launcher takes at that shape (row column `reference`)."""
PAIRED_CI_KEY = "paired_speedup_kernel_ci_rel"
"""The relative 95% half-width of PAIRED_KEY's median."""


def variant_of(cfg, path: str) -> str:
    """The VARIANTS name of a FlashConfig on `path`."""
    return next(name for name, spec in VARIANTS.items()
                if spec == (path, cfg.warp_specialize, cfg.persistent) and REGISTER_CAPS.get(name) == cfg.maxnreg)


def parse_shape(shape: str) -> dict:
    """`[BxH/]seq/head_dim/dtype/{causal,full}` -> {batch, heads, seq, head_dim, dtype (torch name), causal}; without
    the `BxH/` prefix batch 1 and HEADS heads (a short grid fills few SMs: `8x16/4096/64/bf16/causal` is the
    hopper study's d-64 shape, 128 heads' work)."""
    parts = shape.split("/")
    rule = f"[BxH/]seq/head_dim/{{{','.join(DTYPE_ALIASES)}}}/{{causal,full}}"
    batch, heads = 1, HEADS
    if len(parts) == 5:
        bh = parts.pop(0).split("x")
        if len(bh) != 2 or not all(x.isdigit() and int(x) > 0 for x in bh):
            raise ValueError(f"shape {shape!r} must be {rule} with positive B and H, e.g. 8x16/4096/64/bf16/causal")
        batch, heads = map(int, bh)
    if (len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in DTYPE_ALIASES
            or parts[3] not in ("causal", "full")):
        raise ValueError(f"shape {shape!r} must be {rule}, e.g. 4096/64/bf16/causal")
    seq, head_dim, dtype, mask = parts
    if int(seq) < 1 or int(head_dim) < 1:
        raise ValueError(f"shape {shape!r}: seq and head_dim must be positive")
    return dict(batch=batch, heads=heads, seq=int(seq), head_dim=int(head_dim), dtype=DTYPE_ALIASES[dtype],
                causal=mask == "causal")


def canonical_shape(shape: str) -> str:
    """The spelling rows and trial ids use: torch dtype names (`4096/64/bf16/causal` -> `.../bfloat16/...`), the
    `BxH/` prefix only when it is not the default 1 x HEADS."""
    p = parse_shape(shape)
    prefix = "" if (p["batch"], p["heads"]) == (1, HEADS) else f"{p['batch']}x{p['heads']}/"
    return f"{prefix}{p['seq']}/{p['head_dim']}/{p['dtype']}/{'causal' if p['causal'] else 'full'}"


def param_spaces(quick: bool, shapes: tuple[str, ...], variants: tuple[str, ...] = ("portable",),
                 paired_rounds: int = 0) -> dict[str, dict]:
    """Grids (`{"grid_search": [...]}` is what `ray.tune.grid_search` builds) keyed `kernel` for the portable
    variant and `kernel/variant` for the others; every combination is a valid config for its kernel.

    Full: TILES x WARPS x STAGES per kernel (4 warps only when warp-specialised, which Triton 3.6 applies to
    4-warp fwd and dK/dV loops); gluon variants: the GLUON_* axes of fwd and the one-pass `dkdvq`, on the shapes
    the Gluon kernels take, quick or not. Quick: portable, the built-in candidates' tiles x 4, 8 warps x 2, 3
    stages; the tma variants, one grid per built-in candidate (the first QUICK_PER_VARIANT of each), over the
    shapes. `paired_rounds` > 0: the gluon trials also time their config against the one the launcher would take,
    in that many alternating rounds (a key only then: earlier trial ids stay)."""
    import torch

    from kernels.attention.triton.tuning import candidates

    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"variants {sorted(unknown)} must be among {list(VARIANTS)}")
    grid = lambda values: {"grid_search": list(values)}  # noqa: E731
    spaces = {}
    for kernel in KERNELS:
        for variant in variants:
            path, ws, persistent = VARIANTS[variant]
            key = kernel if variant == "portable" else f"{kernel}/{variant}"
            head = {"kernel": kernel} if variant == "portable" else {"kernel": kernel, "variant": variant}
            if variant in GLUON_VARIANTS:
                gluon_shapes = [sh for sh in shapes if parse_shape(sh)["head_dim"] in (64, 128)
                                and parse_shape(sh)["dtype"] in ("bfloat16", "float16")]
                if not gluon_shapes:
                    raise ValueError(f"variant {variant} runs shapes of head dim 64 or 128 in bf16 / fp16; none of "
                                     f"{list(shapes)} is one")
                if kernel in GLUON_KERNELS:  # fwd or dkdvq
                    spaces[key] = {
                        **head, "tile": grid(GLUON_TILES[kernel]), "num_warps": 4,
                        "num_stages": grid(GLUON_STAGES[kernel]),
                        **({"num_consumers": grid([2] if persistent else GLUON_CONSUMERS),
                            "exp2_emulated": grid(GLUON_EXP2), "rescale_under_s": grid(GLUON_RESCALE)}
                           if kernel == "fwd" else {}),
                        "head_group": grid(GLUON_GROUPS[kernel]),
                        **({"dq": grid(GLUON_DQ), "dq_buffers": grid(GLUON_DQ_BUFFERS)} if kernel == "dkdvq" else {}),
                        **({"paired_rounds": paired_rounds} if paired_rounds else {}), "shape": grid(gluon_shapes)}
                continue
            if ws and kernel in ("dq", "dkdvq"):
                continue
            if quick and variant == "portable":  # the built-in 16-bit candidates' tiles
                tiles = sorted({f"{c.block_m}x{c.block_n}" for c in candidates(kernel, torch.bfloat16)})
                spaces[key] = {**head, "tile": grid(tiles), "num_warps": grid([4, 8]), "num_stages": grid([2, 3]),
                               "shape": grid(shapes)}
            elif quick:
                cap = REGISTER_CAPS.get(variant)
                cands = [c for c in candidates(kernel, torch.bfloat16, path=path)
                         if (c.warp_specialize, c.persistent, c.maxnreg) == (ws, persistent, cap)][:QUICK_PER_VARIANT]
                for c in cands:
                    spaces[f"{key}/{c.label()}"] = {**head, "tile": f"{c.block_m}x{c.block_n}",
                                                    "num_warps": c.num_warps, "num_stages": c.num_stages,
                                                    "shape": grid(shapes)}
            else:
                spaces[key] = {**head, "tile": grid(TILES[kernel]), "num_warps": grid((4,) if ws else WARPS),
                               "num_stages": grid(STAGES), "shape": grid(shapes)}
    return spaces


def grid_configs(space: dict) -> list[dict]:
    """The configs a param space expands to (what `--launcher local` runs; Tune's own grid expansion)."""
    from raysys.cluster.sweep import expand_grid

    return expand_grid(space)


def trial(config: dict, device: str = "cuda") -> dict:
    """One kernel, one launch config, one shape, on the GPU Ray (or the caller) assigned, or on the CPU under
    the Triton interpreter (`device="cpu"`, TRITON_INTERPRET=1: slow, fp32/fp16 only)."""
    import torch
    import triton

    from kernels.attention import flash_attention_bwd, flash_attention_fwd
    from kernels.attention.triton.tuning import FlashConfig, candidates, config_fits

    kernel = config["kernel"]
    variant = config.get("variant", "portable")
    path, ws, persistent = VARIANTS[variant]
    block_m, block_n = (int(x) for x in config["tile"].split("x"))
    if variant in GLUON_VARIANTS:
        return gluon_trial(config, block_m, block_n)
    cfg = FlashConfig(block_m, block_n, config["num_warps"], config["num_stages"], ws, persistent,
                      REGISTER_CAPS.get(variant)).check(kernel, path)
    shape = parse_shape(config["shape"])
    device = torch.device(device)
    q, k, v, do = _inputs(config, shape, device)
    dtype, causal = q.dtype, shape["causal"]
    baseline = candidates(kernel, dtype, shape["head_dim"])[0]  # known-good reference config (portable)
    block_d = max(16, triton.next_power_of_2(shape["head_dim"]))
    if not config_fits(kernel, cfg, block_d, dtype, device, path):
        raise ValueError(f"{kernel} {cfg.label()} on {path} does not fit {config['shape']} (config_fits)")
    if kernel == "fwd":
        run = lambda c, p=path: flash_attention_fwd(q, k, v, causal, config=c, path=p)[0]  # noqa: E731
    else:
        out, lse = flash_attention_fwd(q, k, v, causal, config=candidates("fwd", dtype, shape["head_dim"])[0],
                                       path="portable")
        if kernel == "dkdv":
            run = lambda c, p=path: flash_attention_bwd(q, k, v, out, lse, do, causal, dkdv_config=c,  # noqa: E731
                                                        compute_dq=False, path=p)[1]
        elif kernel == "dkdvq":  # one pass: dQ is summed by the dK/dV kernel (the row checks that sum)
            run = lambda c, p=path: flash_attention_bwd(q, k, v, out, lse, do, causal, dkdv_config=c,  # noqa: E731
                                                        path=p, bwd="one_pass")[0]
        else:
            run = lambda c, p=path: flash_attention_bwd(q, k, v, out, lse, do, causal, dq_config=c,  # noqa: E731
                                                        compute_dkdv=False, path=p)[0]
    if "_compile_seq" in config:  # compile_only: one launch of each config, nothing measured
        run(cfg)
        run(baseline, "portable")
        return {}
    metrics = _measure(kernel, shape, lambda: run(cfg), run(cfg), run(baseline, "portable"), device,
                       1e-4 if dtype == torch.float32 else 2e-2, "the baseline config")
    return {"block_m": block_m, "block_n": block_n, "path": path, "warp_specialize": ws, "persistent": persistent,
            "maxnreg": cfg.maxnreg or 0, **shape, **metrics}


def _inputs(config: dict, shape: dict, device) -> list:
    """Seeded q, k, v, dO of the trial's shape (of sequence length `_compile_seq` when it only compiles)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    dims = (shape["batch"], shape["heads"], config.get("_compile_seq", shape["seq"]), shape["head_dim"])
    return [torch.randn(dims, generator=gen, device=device, dtype=getattr(torch, shape["dtype"])) for _ in range(4)]


def _measure(kernel: str, shape: dict, run, got, want, device, rel_tol: float, baseline: str) -> dict:
    """`time_median_s`, `tflops` and `max_abs_err` of `run`, whose result `got` must be within `rel_tol` x max|want|
    of `want` (what `baseline` computes) or the trial fails."""
    from kernels.attention import flash_attention_flops

    err = float((got.float() - want.float()).abs().max())
    limit = rel_tol * float(want.float().abs().max())
    if not err <= limit:  # NaN fails too
        raise RuntimeError(f"wrong result: max abs difference {err:.3g} from {baseline} > {limit:.3g}")
    ms = median_s(run, device) * 1e3
    flops = flash_attention_flops(shape["batch"], shape["heads"], shape["seq"], shape["seq"], shape["head_dim"],
                                  shape["causal"], "fwd") * MATMULS[kernel] / 2
    return {"time_median_s": ms / 1e3, "tflops": flops / (ms * 1e-3) / 1e12, "max_abs_err": err}


def gluon_trial(config: dict, block_m: int, block_n: int) -> dict:
    """A `gluon` trial: the Gluon forward (`fwd`) or one-pass backward's dQ (`dkdvq`) under the trial's config,
    checked against the tl kernels' portable path under their first built-in config, then timed."""
    import torch

    import kernels.attention.gluon.backward as one_pass
    import kernels.attention.gluon.forward as gluon_fwd
    from kernels.attention import flash_attention_bwd, flash_attention_fwd
    from kernels.attention.dispatch import DQ_BUFFERS, gluon_bwd_config, gluon_fwd_config
    from kernels.attention.triton.tuning import candidates

    kernel, shape = config["kernel"], parse_shape(config["shape"])
    persistent = VARIANTS[config["variant"]][2]
    causal, head_dim, device = shape["causal"], shape["head_dim"], torch.device("cuda")
    q, k, v, do = _inputs(config, shape, device)
    dtype = q.dtype
    if kernel == "fwd":
        cfg = gluon_fwd.GluonConfig(block_m=block_m, block_n=block_n, num_stages=config["num_stages"],
                                    num_consumers=config["num_consumers"], persistent=persistent,
                                    head_group=config.get("head_group", 0),
                                    exp2_emulated=config.get("exp2_emulated", 0),
                                    rescale_under_s=config.get("rescale_under_s", False))
        run = lambda c=cfg: gluon_fwd.gluon_attention_fwd(q, k, v, causal, config=c)[0]  # noqa: E731
        want = flash_attention_fwd(q, k, v, causal, config=candidates("fwd", dtype, head_dim)[0], path="portable")[0]
    else:
        if (block_m, block_n) != (64, one_pass.BWD_BLOCK_N):
            raise ValueError(f"the one-pass Gluon backward's tile is 64x{one_pass.BWD_BLOCK_N}, "
                             f"not {config['tile']}")
        dq_whole, dk_late = GLUON_DQ[config.get("dq", "halves")]
        cfg = one_pass.GluonBwdConfig(block_m=block_m, num_stages=config["num_stages"], persistent=persistent,
                                      head_group=config.get("head_group", 0), dq_whole=dq_whole, dk_late=dk_late,
                                      dq_buffers=config.get("dq_buffers", DQ_BUFFERS.get(head_dim, 1)))
        out, lse = gluon_fwd.gluon_attention_fwd(q, k, v, causal, gluon_fwd_config(q, k))
        run = lambda c=cfg: one_pass.gluon_attention_bwd(q, k, v, out, lse, do, causal, c)[0]  # noqa: E731
        want = flash_attention_bwd(q, k, v, out, lse, do, causal, path="portable", bwd="two_pass",
                                   dkdv_config=candidates("dkdv", dtype, head_dim)[0],
                                   dq_config=candidates("dq", dtype, head_dim)[0])[0]
    got = run()
    if "_compile_seq" in config:
        return {}
    metrics = _measure(kernel, shape, run, got, want, device, 2e-2, "the tl kernels")
    if config.get("paired_rounds"):  # against what the launcher takes at this shape, alternating (PAIRED_KEY)
        from raysys.measure.timing import paired_speedups

        reference = gluon_fwd_config(q, k) if kernel == "fwd" else gluon_bwd_config(q)
        metrics.update(paired_speedups({"kernel": run}, {"kernel": lambda: run(reference)},
                                       int(config["paired_rounds"]), lambda fn: median_s(fn, device) * 1e3,
                                       "reference"), reference=reference.name)
    return {"block_m": block_m, "block_n": block_n, "num_consumers": config.get("num_consumers", 2), "path": "gluon",
            "warp_specialize": True, "persistent": persistent, "head_group": cfg.head_group, "maxnreg": 0, **shape,
            **({"dq_whole": cfg.dq_whole, "dk_late": cfg.dk_late, "rows_tma": cfg.rows_tma,
                "dq_buffers": cfg.dq_buffers} if kernel != "fwd"
               else {"exp2_emulated": cfg.exp2_emulated, "rescale_under_s": cfg.rescale_under_s}),
            **metrics}


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


def compile_only(config: dict) -> str:
    """Compile (one launch on a short sequence) the kernel a trial will time; '' or the error."""
    try:
        trial({**config, "_compile_seq": 256})
        return ""
    except Exception as exc:  # the trial itself reports it as its row
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(configs: list[dict], workers: int) -> None:
    """Compile the trials' kernels in `workers` processes first: Triton's on-disk cache then serves the timed
    trials, and compilation (CPU-bound, one kernel at a time per process) overlaps."""
    import concurrent.futures
    import multiprocessing

    # Specialisation matches the timed launch: the same heads, dtype, head dim, mask, tile flags and Gluon knobs (head
    # groups and the dQ axis are compile-time constants), and sequence lengths that are multiples of 16 (Triton keys
    # its cache on divisibility by 16, not the value): one trial per config and shape after its first field.
    unique = list({(tuple((k, str(v)) for k, v in sorted(c.items()) if k != "shape"), c["shape"].split("/", 1)[1]): c
                   for c in configs}.values())
    start = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for e in pool.map(compile_only, unique) if e]
    print(f"compiled {len(unique)} kernels in {time.monotonic() - start:.1f} s with {workers} processes"
          + (f"; {len(errors)} failed, first: {errors[0]}" if errors else ""), flush=True)


def wait_for(path: Path, timeout_s: float = 600.0) -> None:
    """Block until `path` exists (another job that shares the GPU is done), at most `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.5)


def run_local(spaces: dict[str, dict], writer: ResultWriter, budget: Budget, compile_workers: int = 0,
              wait_file: Path | None = None, device: str = "cuda") -> None:
    import torch

    if compile_workers > 0:
        precompile([c for space in spaces.values() for c in grid_configs(space) if not writer.done(trial_id(c))],
                   compile_workers)
    if wait_file is not None:
        wait_for(wait_file)
    for kernel, space in spaces.items():
        for config in grid_configs(space):
            if writer.done(trial_id(config)):
                continue
            if budget.spent():
                return
            try:
                row = make_row(SWEEP, config, trial(config, device=device))
            except Exception as exc:  # compile failure, OOM, wrong result: a row, not the end of the sweep
                row = error_row(SWEEP, config, exc)
            finally:
                torch.cuda.empty_cache()
            writer.write([row])
            budget.charge(1)
            print(f"{kernel:4} {config.get('variant', 'portable'):<14} {config['tile']:>7} w{config['num_warps']} "
                  f"s{config['num_stages']} {config['shape']:<26}"
                  f" -> {row['status']}" + (f" {1e3 * row['time_median_s']:.3f} ms {row['tflops']:.0f} TFLOP/s"
                                            if row["status"] == "ok" else f" ({row['error'][:70]})"), flush=True)


def run_tune(spaces: dict[str, dict], writer: ResultWriter, budget: Budget, resume: bool,
             device: str = "cuda") -> None:
    """One Ray Tune run per kernel, one GPU (or CPU) per trial; each row is written when its trial ends."""
    from raysys.cluster.sweep import tune_run

    for space in spaces.values():
        if budget.spent():
            return
        # Trials are seconds long; a reused actor keeps its process, CUDA context and Triton's in-memory state.
        df = tune_run(functools.partial(trial, device=device), space, sweep=SWEEP,
                      resources={"gpu": 1} if device == "cuda" else {"cpu": 1}, resume=resume, writer=writer,
                      show=False, max_trials=budget.trials_left, time_budget_s=budget.seconds_left, reuse_actors=True)
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
    keys = ["block_m", "block_n", "num_warps", "num_stages", "warp_specialize", "persistent", "maxnreg"]
    ok["path"] = _filled(ok, "path")
    for col in keys + ["head_dim"]:
        ok[col] = _filled(ok, col).astype(int)
    out: dict[str, list[dict]] = {}
    for kernel in KERNELS:
        out[kernel] = []
        for path, sel in ok[(ok["kernel"] == kernel) & (ok["path"] != "gluon")].groupby("path"):
            out[kernel] += _best_entries(sel, keys, {"path": path}, min_configs)
    return out


def _filled(df: pd.DataFrame, col: str) -> pd.Series:
    """`df[col]`, with ROW_DEFAULTS[col] (if it has one) where a row lacks it or `df` has no such column."""
    default = ROW_DEFAULTS.get(col)
    if default is None:
        return df[col]
    values = df[col] if col in df else pd.Series(default, index=df.index)
    return (values.astype("boolean") if isinstance(default, bool) else values).fillna(default)


def gluon_best_configs(df: pd.DataFrame, min_configs: int = MIN_CONFIGS) -> dict[str, list[dict]]:
    """The tuned file's `gluon` part from the `gluon` rows, card by card: `_gluon_best_configs` of each card's rows,
    each entry naming its card (`device`, the rows' `device_name`); rows that name no card give entries without."""
    names = df["device_name"] if "device_name" in df else pd.Series(None, index=df.index, dtype=object)
    out: dict[str, list[dict]] = {}
    for name in names.dropna().unique().tolist() + ([None] if names.isna().any() else []):
        rows = df[names.isna()] if name is None else df[names == name]
        for kind, entries in _gluon_best_configs(rows, min_configs).items():
            out.setdefault(kind, []).extend(e if name is None else {**e, "device": name} for e in entries)
    return out


def _gluon_best_configs(df: pd.DataFrame, min_configs: int = MIN_CONFIGS) -> dict[str, list[dict]]:
    """The `gluon` part from one card's `gluon` rows: per kind (GLUON_KERNELS) the winners as `best_configs` picks
    them, over GLUON_FWD_KEYS / GLUON_BWD_KEYS; a shape counts as swept with min(min_configs, the configs of the kind's
    grid that fit) measured configs: a config whose build ran out of shared memory or registers at a head dim and dtype
    (an error row beginning with one of UNFIT_ERRORS) never runs there, so it is not missing from the sweep. Where
    every row of a head dim and dtype was paired against one reference per shape (PAIRED_KEY), the winners are those
    with the highest (geometric-mean) ratio against it, and only where it beats the reference (`_beats_reference`);
    the entries then also carry it (`geomean_vs_reference`, `vs_reference`). The forward's sweep-wide winner is ranked
    over the shapes beyond PERSISTENT_GRID's length (`_tuned_entry_shapes`)."""
    ok = df[(df["status"] == "ok") & (df.get("path", pd.Series(index=df.index, dtype=object)) == "gluon")].copy()
    errors = df[(df["status"] == "error") & df.get("variant", pd.Series(index=df.index, dtype=object)).isin(
        GLUON_VARIANTS) & df.get("error", pd.Series("", index=df.index)).fillna("").str.startswith(UNFIT_ERRORS)]
    errors = errors.assign(**{key: [parse_shape(sh)[key] for sh in errors["shape"]] for key in ("head_dim", "dtype")})
    out: dict[str, list[dict]] = {}
    for kernel, kind in GLUON_KERNELS.items():
        sel = ok[ok["kernel"] == kernel].copy()
        if sel.empty:
            continue
        keys = GLUON_FWD_KEYS if kernel == "fwd" else GLUON_BWD_KEYS
        # (the dQ axis of the runs the rows come from: none, dq_whole's two values, or GLUON_DQ's three)
        dq_axis = 1 if kernel == "fwd" else 1 + sum(c in sel and sel[c].notna().any() for c in ("dq_whole", "dk_late"))
        for col in keys:
            sel[col] = _filled(sel, col).astype(int)
        grid = len(GLUON_TILES[kernel]) * len(GLUON_STAGES[kernel])
        grid *= len(GLUON_CONSUMERS) * len(GLUON_EXP2) if kernel == "fwd" else dq_axis
        grid *= len(GLUON_GROUPS[kernel])
        failed = errors[errors["kernel"] == kernel]
        entries = []
        for (head_dim, dtype), part in sel.groupby(["head_dim", "dtype"]):
            unfit = failed[(failed["head_dim"] == head_dim) & (failed["dtype"] == dtype)]
            unfit = unfit.drop_duplicates([c for c in ("variant", "tile", "num_stages", "num_consumers", "head_group",
                                                       "dq_whole", "dq", "exp2_emulated", "rescale_under_s",
                                                       "dq_buffers") if c in unfit])
            newest = SWEPT_SINCE[kernel]  # its values in these rows: 1 in a run before the axis
            values = pd.concat([part[newest], unfit[newest] if newest in unfit else pd.Series(dtype=object)])
            axis = values.dropna().nunique()
            swept = grid * max(1, axis)
            paired = (PAIRED_KEY in part and part[PAIRED_KEY].notna().all()
                      and part.groupby("shape")["reference"].nunique().max() == 1)
            if paired:
                part = part.assign(log_rel=-part[PAIRED_KEY].map(math.log))
            ranked = _tuned_entry_shapes(part, kernel, int(head_dim))
            found = _best_entries(part, keys, {}, min(min_configs, swept - len(unfit)), paired, ranked)
            if kernel == "fwd" and axis < 2:  # rows before the axis ran False where `auto` may run True
                # (RESCALE_UNDER_S): an entry states the order only where its rows measured both
                found = [{k: v for k, v in e.items() if k != "rescale_under_s"} for e in found]
            entries += found
        if kernel != "fwd":  # GluonBwdConfig has no block_n (BWD_BLOCK_N) or consumer count (two)
            entries = [{k: v for k, v in e.items() if k not in ("block_n", "num_consumers")} for e in entries]
        out[kind] = entries
    return out


def _tuned_entry_shapes(part: pd.DataFrame, kernel: str, head_dim: int) -> set[str] | None:
    """The shapes of `part` (one head dim and dtype) that rank the tuned forward entry: none up to the length where
    the launcher takes `PERSISTENT_GRID`'s grid instead (its ratios there say nothing of the tuned config's use),
    unless that would leave none. None: every shape ranks (the backward)."""
    if kernel != "fwd":
        return None
    from kernels.attention.dispatch import PERSISTENT_GRID

    n_max = PERSISTENT_GRID.get(head_dim, (0, {}))[0]
    long = {shape for shape in part["shape"].unique() if parse_shape(shape)["seq"] > n_max}
    return long or None


def _best_entries(sel: pd.DataFrame, keys: list[str], tags: dict, min_configs: int, paired: bool = False,
                  ranked: set[str] | None = None) -> list[dict]:
    """best_configs for the rows of one (kernel, path), their `keys` ints; ranked by the log of `time_median_s` or,
    `paired`, by `log_rel` (log of time relative to the paired reference); `ranked`: the shapes the sweep-wide winner
    is chosen over (None: all; every shape still gets its own winner)."""
    score = "log_rel" if paired else "log_ms"
    sel = sel.assign(median_ms=1e3 * sel["time_median_s"])  # the tuned file's unit
    sel = sel.assign(log_ms=sel["median_ms"].map(math.log))

    def config_of(values) -> dict:
        config = {k: (bool(v) if isinstance(ROW_DEFAULTS.get(k), bool) else int(v)) for k, v in zip(keys, values)}
        if "maxnreg" in config:
            config["maxnreg"] = config["maxnreg"] or None  # 0: no register cap
        return config

    entries, lost = [], set()
    for (head_dim, dtype), group in sel.groupby(["head_dim", "dtype"]):
        if ranked is not None:
            group = group[group["shape"].isin(ranked)]
        per_shape = {shape: part.groupby(keys).ngroups for shape, part in group.groupby("shape")}
        floor = max(min_configs, max(per_shape.values()) / 2)
        swept = sorted(shape for shape, n in per_shape.items() if n >= floor)
        full = group[group["shape"].isin(swept)].groupby(keys).filter(
            lambda g, n=len(swept): g["shape"].nunique() == n)  # ran on every swept shape
        if full.empty:
            continue
        means = full.groupby(keys)[score].mean()
        best = means.idxmin()
        if paired and not _beats_reference(full, keys, best, means[best]):
            lost.add((head_dim, dtype))
            continue
        entries.append({**config_of(best), **tags, "head_dim": int(head_dim), "dtype": dtype,
                        "shapes": swept, "geomean_ms": round(math.exp(full.groupby(keys)["log_ms"].mean()[best]), 4),
                        **({"geomean_vs_reference": round(math.exp(-means[best]), 4)} if paired else {})})
    for shape, group in sel.groupby("shape"):
        if group.groupby(keys).ngroups < min_configs or (group["head_dim"].iat[0], group["dtype"].iat[0]) in lost:
            continue
        row = group.loc[group[score].idxmin()]
        entries.append({**config_of(row[k] for k in keys), **tags, "head_dim": int(row["head_dim"]),
                        "dtype": row["dtype"], "shape": shape, "median_ms": round(float(row["median_ms"]), 4),
                        "tflops": round(float(row["tflops"]), 1),
                        **({"vs_reference": round(math.exp(-float(row["log_rel"])), 4)} if paired else {})})
    return entries


def _beats_reference(full: pd.DataFrame, keys: list[str], best, log_rel: float) -> bool:
    """Whether the paired winner `best` (its mean `log_rel` over `full`'s shapes) is faster than the reference by
    more than the mean PAIRED_CI_KEY of its rows (0 where the rows have none)."""
    ci = full.groupby(keys)[PAIRED_CI_KEY].mean()[best] if PAIRED_CI_KEY in full else float("nan")
    return -log_rel > math.log1p(0.0 if pd.isna(ci) else float(ci))


def json_note(df: pd.DataFrame) -> str:
    """Where the tuned configs come from: trial counts and the device / versions they were measured with."""
    ok = df[df["status"] == "ok"]
    where = "; ".join(sorted({f"{r.device_name}, torch {r.torch_version}, triton {r.triton_version}"
                              for r in ok[["device_name", "torch_version", "triton_version"]].itertuples()}))
    return (f"written by sweeps/flash_tiles.py from the {len(ok)} measured trials ({len(df)} in all) of "
            f"flash_tiles.parquet ({where or 'no device'})")


def json_provenance(df: pd.DataFrame) -> dict:
    """`device`, `torch`, `triton`: each the sorted list of what the measured trials ran on."""
    ok = df[df["status"] == "ok"]
    return {key: sorted({str(v) for v in ok[col].dropna()}) if col in ok else []
            for key, col in (("device", "device_name"), ("torch", "torch_version"), ("triton", "triton_version"))}


def write_json(data: dict, path: Path) -> None:
    """`data` as indented JSON at `path`, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=1) + "\n")


def write_tuned(df: pd.DataFrame, tuned: dict[str, list[dict]], json_path: Path,
                gluon: dict[str, list[dict]] | None = None) -> dict[str, list[dict]]:
    """Write `tuned` (best_configs of `df`) and `gluon` (gluon_best_configs) to `json_path`, keeping the file's
    entries of the (kernel, path) pairs this run has none for, its Gluon entries of the (kind, card, head dim, dtype)
    groups this run has none for, and its other keys (`auto_path`).
    `note` says where the tl entries come from and `gluon_note` where the Gluon ones do: a run that swept only one
    kind of kernel leaves the other's note as it was. Returns the tl part written."""
    note, provenance = json_note(df), json_provenance(df)
    tuned = dict(tuned)
    old = json.loads(json_path.read_text()) if json_path.exists() else {}
    extra = {key: value for key, value in old.items()
             if key not in ("note", "gluon_note", "device", "torch", "triton", *KERNELS)}
    gluon_note = old.get("gluon_note")
    old_gluon = extra.get("gluon", {})
    gluon = {kind: entries for kind, entries in (gluon or {}).items() if entries}  # (no winner: nothing to say)
    kept_kinds = sorted(set(old_gluon) - set(gluon))
    if gluon:
        # A kind this run swept: its entries replace the previous file's of the same card, head dim and dtype
        # (entries that name no card count as one card); the others stay.
        group = lambda e: (e.get("device"), e.get("head_dim"), e.get("dtype"))  # noqa: E731
        kept_groups = {kind: [e for e in old_gluon.get(kind, []) if group(e) not in set(map(group, entries))]
                       for kind, entries in gluon.items()}
        kept_kinds += sorted(kind for kind, entries in kept_groups.items() if entries and kind not in kept_kinds)
        gluon_note = note + (f"; {', '.join(kept_kinds)} kept from the previous file: {old.get('gluon_note', '')}"
                             if kept_kinds else "")
        extra["gluon"] = {**old_gluon, **{kind: gluon[kind] + kept_groups[kind] for kind in gluon}}
    if json_path.exists():
        from kernels.attention.triton.tuning import load_tuned_configs

        swept = {(k, e["path"]) for k, entries in tuned.items() for e in entries}
        kept = 0
        for kernel, entries in load_tuned_configs(json_path).items():
            keep = [e for e in entries if (kernel, e.get("path", "portable")) not in swept]
            tuned[kernel] = tuned.get(kernel, []) + keep
            kept += len(keep)
        if not swept:  # no tl entries from this run: the tl part and its note stay as they were
            note = old.get("note", note)
        elif kept:
            note += f"; {kept} entries of other paths kept from the previous file: {old.get('note', '')}"
        if kept or kept_kinds:
            provenance = {k: sorted(set(v) | set(old.get(k, []))) for k, v in provenance.items()}
    data = {"note": note, **({"gluon_note": gluon_note} if gluon_note else {}), **provenance, **tuned, **extra}
    write_json(data, json_path)
    return tuned


def markdown(df: pd.DataFrame) -> str:
    """How many launch configs were timed and failed, and the three fastest per kernel and shape."""
    ok = df[df.status == "ok"]
    failed = df[df.status != "ok"].groupby("status").size().to_dict()
    if ok.empty:
        return f"{len(df)} launch configurations tried, none measured ({failed or 'none'} failed).\n"
    ok = ok.assign(median_ms=1e3 * ok["time_median_s"])  # the table shows milliseconds
    best = ok.sort_values("median_ms").groupby(["shape", "kernel"], as_index=False).head(3)
    best = best.sort_values(["shape", "kernel", "median_ms"])
    gluon_knobs = [c for c in ("num_consumers", "head_group", "exp2_emulated", "rescale_under_s", "dq_whole", "dk_late",
                               "rows_tma", "dq_buffers")
                   if c in best and best[c].notna().any()]
    cols = ["shape", "kernel", *(["variant"] if "variant" in best else []), "tile", "num_warps", "num_stages",
            *gluon_knobs, "median_ms", "tflops"]  # the Gluon kernels' own knobs (blank on tl rows)
    return (f"{len(df)} launch configurations timed ({failed or 'none'} failed); the three fastest per kernel and "
            "shape (these feed `kernels/attention/triton/tuned.json`, which the autotuner tries first).\n\n"
            + best[cols].to_markdown(index=False, floatfmt=".3g") + "\n")


def write_report(df: pd.DataFrame, out: Path) -> Path:
    return write_markdown(out, SWEEP, "FlashAttention launch configs", markdown(df))


def build_parser():
    p = study_parser(__doc__, SWEEP, ray=True, device_help="cuda: the GPU Ray (or this process) assigns; cpu: the "
                                                           "Triton interpreter (TRITON_INTERPRET=1, small shapes)")
    p.add_argument("--launcher", choices=("ray", "local"), default="ray",
                   help="ray: Ray Tune, one GPU per trial; local: every trial in this process")
    p.add_argument("--quick", action="store_true", help="one shape, the built-in candidates only")
    list_flag(p, "--shapes", default=None, help="comma list of seq/head_dim/dtype/{causal,full} (default: "
                                                f"{','.join(SHAPES)}; --quick: {','.join(QUICK_SHAPES)})")
    list_flag(p, "--kernels", default=",".join(KERNELS), help=f"comma list of {','.join(KERNELS)}")
    p.add_argument("--json", default=None, help="where to write the tuned configs (default: "
                   "<out>/flash_attention_tuned.json; kernels/attention/triton/tuned.json installs them)")
    p.add_argument("--no-json", action="store_true", help="do not write the tuned-config file")
    p.add_argument("--max-trials", type=int, default=None, help="run at most this many trials, all kernels "
                                                                "(default: no limit)")
    p.add_argument("--time-budget-s", type=float, default=None, help="start no trial after this many seconds "
                                                                     "(ray: Tune also stops the running ones; "
                                                                     "default: no limit)")
    list_flag(p, "--variants", default="portable", help=f"comma list of kernel variants, of {','.join(VARIANTS)}")
    p.add_argument("--paired-rounds", type=int, default=0,
                   help="gluon variants: each trial also times its config against the one the launcher takes at "
                        "that shape in N alternating rounds (>= 3), and the winners are chosen by those ratios")
    p.add_argument("--min-configs", type=int, default=MIN_CONFIGS,
                   help="configs a shape needs measured before it yields a tuned entry")
    p.add_argument("--compile-workers", type=int, default=0,
                   help="local launcher: compile every trial's kernel in this many processes first")
    p.add_argument("--wait-file", default=None,
                   help="local launcher: time nothing before this file exists (a job sharing the GPU ends; "
                        "default: start at once)")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    if args.report_only:
        return redraw_report(args, SWEEP, write_report)
    shapes = tuple(parse_list(args.shapes, "shapes")) if args.shapes else (QUICK_SHAPES if args.quick else SHAPES)
    shapes = tuple(dict.fromkeys(canonical_shape(s.strip()) for s in shapes))
    kernels = parse_list(args.kernels, "kernels", KERNELS)
    budget = Budget(args.max_trials, args.time_budget_s)
    variants = tuple(parse_list(args.variants, "variants", tuple(VARIANTS)))
    if args.paired_rounds and (args.paired_rounds < 3 or not set(variants) & set(GLUON_VARIANTS)):
        raise ValueError(f"--paired-rounds ({args.paired_rounds}) must be 0 (off) or >= 3, and pairs the gluon "
                         f"variants' trials only (--variants {','.join(variants)})")
    if args.min_configs < 1 or args.compile_workers < 0:
        raise ValueError(f"--min-configs ({args.min_configs}) must be >= 1 and --compile-workers "
                         f"({args.compile_workers}) >= 0")
    device = resolve_device(args.device).type
    if device == "cpu" and (os.environ.get("TRITON_INTERPRET") != "1" or args.compile_workers):
        raise ValueError("--device cpu runs the kernels under the Triton interpreter: start with TRITON_INTERPRET=1 "
                         "(and no --compile-workers)")
    spaces = {k: v for k, v in param_spaces(args.quick, shapes, variants, args.paired_rounds).items()
              if v["kernel"] in kernels}
    out = output_dir(args, SWEEP)
    PROGRESS.plan(sum(len(grid_configs(space)) for space in spaces.values()))
    with open_writer(out, SWEEP, args) as writer:
        if args.launcher == "ray":
            start_ray(args)
            run_tune(spaces, writer, budget, args.resume, device)
        else:
            run_local(spaces, writer, budget, args.compile_workers, Path(args.wait_file) if args.wait_file else None,
                      device)
        df = writer.frame()
    have = set(df["trial_id"]) if not df.empty else set()
    not_run = sum(trial_id(c) not in have for space in spaces.values() for c in grid_configs(space))
    if not_run:
        print(f"{not_run} trials of this grid did not run (budget or interrupt); rerun with --resume to run them")
    tuned = best_configs(df, args.min_configs)
    if not args.no_json:
        json_path = Path(args.json) if args.json else out / "flash_attention_tuned.json"
        if not json_path.exists() and TUNED_CONFIGS_PATH.exists():  # start from the file in use: other paths stay
            shutil.copyfile(TUNED_CONFIGS_PATH, json_path)
        tuned = write_tuned(df, tuned, json_path, gluon_best_configs(df, args.min_configs))
        print(f"tuned configs -> {json_path}")
    for kernel, entries in tuned.items():
        for e in entries[:3]:
            print(f"  {kernel:4} {e}")
    print(f"wrote {writer.path}, {write_report(df, out)}")
    return df


if __name__ == "__main__":
    sys.exit(main_entry(main))
