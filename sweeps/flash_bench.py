"""FlashAttention-2 benchmark (handout 4.2.2 flash_benchmarking): raysys kernels against PyTorch baselines.

Studies (`--studies`): `grid` (the handout's table), `target` (bf16, causal, 1x16x16384x128), `hopper` (four bf16
causal shapes, each Triton path against both SDPA backends), `candidates` (pinned launch configs, checked then timed).
Providers: `triton` (auto; `triton_<path>[_1pass]` pin one), `pytorch_tiled`, `naive`, `sdpa_flash`, `sdpa_cudnn`.
One row per (study, provider, shape) in `<out>/flash_bench.parquet`: forward / backward / both (median, TFLOP/s),
error against fp32, peak memory, speedups against SDPA; tables in `<out>/flash_bench.md`. Columns: docs/studies.md.

    python sweeps/flash_bench.py --out /tmp/fb                                 # target and grid on the GPU
    python sweeps/flash_bench.py --studies grid --time-budget-s 160 --resume --out /tmp/fb   # again: continues
    python sweeps/flash_bench.py --studies grid --dtypes bf16 --head-dims 64,128 --seqs 1024,16384 --no-autotune
    python sweeps/flash_bench.py --quick --device cpu --out /tmp/x             # CPU smoke run (no Triton)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F


from raysys.measure.device import DTYPES, resolve_device
from raysys.measure.memory import peak_above
from raysys.results.records import ResultWriter, make_row, status_of, trial_id
from raysys.measure.timing import MAX_STEPS, PAIRED_REP_MS, median_s, paired_speedups
from sweeps.common import (PROGRESS, alias, check_int, check_timeout, list_flag, main_entry, open_writer,
                           output_dir, parse_ints, parse_list, read_rows, redraw_report, study_parser,
                           write_markdown)

ROOT = Path(__file__).resolve().parents[1]

SWEEP = "flash_bench"
PROVIDERS = ("triton", "pytorch_tiled", "naive", "sdpa_flash", "sdpa_cudnn")
SDPA_PROVIDERS = ("sdpa_flash", "sdpa_cudnn")
# The Triton kernels with the path and the backward pinned (None: the auto dispatch).
TRITON_PATHS = {"triton": (None, None), "triton_portable": ("portable", "two_pass"), "triton_tma": ("tma", "two_pass"),
                "triton_portable_1pass": ("portable", "one_pass"), "triton_tma_1pass": ("tma", "one_pass"),
                "triton_gluon": ("gluon", "two_pass"), "triton_gluon_1pass": ("gluon", "one_pass")}
PATH_PROVIDERS = tuple(TRITON_PATHS)[1:]
MODES = ("fwd", "bwd", "fwd_bwd")
TARGET = dict(batch=1, heads=16, seq=16384, head_dim=128, dtype="bf16", causal=True)
# The hopper study's shapes (bf16, causal), each Triton path against both SDPA backends in one run.
HOPPER_SHAPES = ((1, 16, 16384, 128), (1, 32, 32768, 128), (8, 16, 4096, 64), (4, 32, 2048, 128))
HOPPER_PROVIDERS = ("triton", "triton_gluon", "triton_gluon_1pass", "triton_tma", "triton_tma_1pass",
                    "triton_portable", "triton_portable_1pass", "sdpa_cudnn", "sdpa_flash")
DTYPE_ORDER = ("bf16", "fp16", "fp32")  # grid order: the dtype the kernels are for first
STUDIES = ("target", "grid", "hopper", "candidates")
# The candidates study: launch configs pinned per kernel, one lever changed at a time from the tuned
# tma configs (`base_*`), on the hopper shapes of their head dim. Labels as FlashConfig.label() writes them:
# /r128 caps registers at 128 (two 8-warp programs per SM where shared memory allows), /lazy skips the output
# rescale in tiles where no row max grew, /u2 unrolls the tile loop twice.
_BASE = {"tma": {128: {"fwd": "128x64/w8/s3", "dkdv": "64x128/w8/s3", "dq": "128x64/w8/s3"},
                 64: {"fwd": "64x64/w4/s3", "dkdv": "32x128/w8/s3", "dq": "128x64/w8/s3"}},
         "portable": {128: {"fwd": "128x64/w8/s3", "dkdv": "64x128/w8/s3", "dq": "128x32/w8/s3"},
                      64: {"fwd": "128x128/w4/s3", "dkdv": "32x64/w4/s4", "dq": "128x32/w8/s4"}}}
"""Each path's tl configs from which the candidates study changes one lever at a time (the `base_*` candidates)."""
_LEVERS = {
    128: {"fwd_128x64_s2_r128": {"fwd": "128x64/w8/s2/r128"}, "fwd_128x128_s2": {"fwd": "128x128/w8/s2"},
          "fwd_128x128_s2_lazy": {"fwd": "128x128/w8/s2/lazy"}, "fwd_64x64_w4": {"fwd": "64x64/w4/s3"},
          "fwd_lazy": {"fwd": "128x64/w8/s3/lazy"}, "fwd_u2": {"fwd": "128x64/w8/s2/u2"},
          "fwd_s4": {"fwd": "128x64/w8/s4"},
          "bwd_32x128_128x32": {"dkdv": "32x128/w8/s3", "dq": "128x32/w8/s3"},
          "bwd_64x128s2_128x32": {"dkdv": "64x128/w8/s2", "dq": "128x32/w8/s3"},
          "bwd_s4": {"dkdv": "32x128/w8/s4", "dq": "128x32/w8/s4"},
          "bwd_dq_u2": {"dq": "128x32/w8/s2/u2"},
          "bwd_w4": {"dkdv": "32x64/w4/s3", "dq": "64x64/w4/s2"},  # one warp group each, two programs per SM
          "bwd_w4_128x32": {"dkdv": "32x64/w4/s3", "dq": "128x32/w8/s3"}},
    64: {"fwd_128x64_s2_r128": {"fwd": "128x64/w8/s2/r128"}, "fwd_128x128_s3_r128": {"fwd": "128x128/w8/s3/r128"},
         "fwd_128x64_w4": {"fwd": "128x64/w4/s3"}, "fwd_lazy": {"fwd": "64x64/w4/s3/lazy"},
         "bwd_dkdv_r128": {"dkdv": "32x128/w8/s3/r128"},
         "bwd_tutorial": {"dkdv": "32x128/w4/s5", "dq": "128x32/w4/s5"},  # Triton tutorial 06's backward tiles
         "bwd_w4": {"dkdv": "32x64/w4/s3", "dq": "64x64/w4/s2"}},
}
CANDIDATES = {f"base_{path}_d{d}": dict(path=path, head_dim=d, **_BASE[path][d]) for d in (128, 64)
              for path in ("tma", "portable")}
CANDIDATES.update({f"{name}_d{d}": dict(path="tma", head_dim=d, **{**_BASE["tma"][d], **lever})
                   for d, levers in _LEVERS.items() for name, lever in levers.items()})
"""name -> path, head dim and the fwd / dkdv / dq config labels of one candidate (two-pass backward)."""
BUDGET_SKIP = "not run: --time-budget-s"  # the error of a trial the time budget left out (resume runs it)


class Unsupported(Exception):
    """The provider cannot run this shape/dtype/device (a `skipped` row)."""


def candidate_configs(name: str) -> dict:
    """The config columns of candidate `name` (a ValueError names the known ones)."""
    if name not in CANDIDATES:
        raise ValueError(f"candidate {name!r} must be one of {', '.join(CANDIDATES)}")
    return {f"{k}_config": CANDIDATES[name][k] for k in ("fwd", "dkdv", "dq")}


def grid(study: str, quick: bool, seqs=None, head_dims=None, dtypes=None, candidates=None,
         check_only: bool = False) -> list[dict]:
    """The trials of one study; `seqs`, `head_dims`, `dtypes` narrow the grid study, `candidates` (names) the
    candidates study; `check_only` leaves its SDPA rows out."""
    if study == "target":
        shape = dict(TARGET, heads=2, seq=128, head_dim=32, dtype="fp32") if quick else TARGET
        return [dict(study="target", provider=p, **shape) for p in PROVIDERS]
    if study == "hopper":
        shapes = ((1, 2, 128, 32),) if quick else HOPPER_SHAPES
        return [dict(study="hopper", provider=p, batch=b, heads=h, seq=n, head_dim=d, dtype="bf16", causal=True)
                for b, h, n, d in shapes for p in HOPPER_PROVIDERS]
    if study == "candidates":
        names = candidates or tuple(CANDIDATES)
        trials = []
        for b, h, n, d in sorted(HOPPER_SHAPES, key=lambda shape: -shape[2] * shape[1] * shape[0]):  # largest first
            shape = dict(study="candidates", batch=b, heads=h, seq=n, head_dim=d, dtype="bf16", causal=True)
            mine = [dict(shape, provider="triton_candidate", candidate=c, **candidate_configs(c)) for c in names
                    if CANDIDATES[c]["head_dim"] == d]
            trials += mine + [dict(shape, provider=p, candidate="", fwd_config="", dkdv_config="", dq_config="")
                              for p in SDPA_PROVIDERS if mine and not check_only]
        return trials
    seqs = sorted(set(seqs or ((64, 128) if quick else tuple(2**i for i in range(7, 17)))))  # 128 .. 65536
    head_dims = sorted(set(head_dims or ((16,) if quick else (16, 32, 64, 128))), reverse=True)
    dtypes = sorted(set(dtypes or (("fp32",) if quick else ("bf16", "fp32"))), key=DTYPE_ORDER.index)
    return [dict(study="grid", provider=p, batch=1, heads=1, seq=s, head_dim=d, dtype=dt, causal=True)
            for dt in dtypes for d in head_dims for s in seqs for p in PROVIDERS]


def finished(writer: ResultWriter, tid: str) -> bool:
    """Whether `--resume` may skip the trial: a final row that is not a time-budget skip."""
    return any(r.get("trial_id") == tid and r.get("status") in ResultWriter.FINAL
               and not (r.get("status") == "skipped" and _budget_skip(str(r.get("error", ""))))
               for r in writer.rows)


def _budget_skip(error: str) -> bool:
    # the older wordings of rows written before: "not run: --max-seconds ..." and "--max-seconds ..."
    return error.startswith((BUDGET_SKIP, "not run: --max-seconds", "--max-seconds"))


def _sdpa(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


class _CandidateAttention(torch.autograd.Function):
    """The Triton kernels with each launch config pinned (the candidates study): what `flash_attention` runs,
    minus autotuning."""

    @staticmethod
    def forward(ctx, q, k, v, causal, path, configs):
        from kernels.attention import flash_attention_fwd

        out, lse = flash_attention_fwd(q, k, v, causal, config=configs["fwd"], path=path)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.path, ctx.configs = causal, path, configs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from kernels.attention import flash_attention_bwd

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_bwd(q, k, v, out, lse, grad_out, ctx.causal, dkdv_config=ctx.configs["dkdv"],
                                         dq_config=ctx.configs["dq"], path=ctx.path, bwd="two_pass")
        return dq, dk, dv, None, None, None


def _check_path(path: str | None, device: torch.device) -> None:
    """Raise Unsupported where the Triton kernels of `path` (None: auto) cannot run on `device`."""
    if device.type != "cuda":
        raise Unsupported("the Triton kernels need a CUDA device (or TRITON_INTERPRET=1, far too slow here)")
    from kernels.attention.dispatch import tma_supported

    if path == "tma" and not tma_supported(device):
        raise Unsupported(f"the tma path needs an sm_90 GPU and Triton >= 3.4, not "
                          f"{torch.cuda.get_device_name(device)}")


def candidate_fn(name: str, device: torch.device) -> Callable:
    """Attention with candidate `name`'s path and configs (each checked against its kernel and path)."""
    from kernels.attention.triton.tuning import FlashConfig

    spec = CANDIDATES[name]
    _check_path(spec["path"], device)
    configs = {k: FlashConfig.from_label(spec[k]).check(k, spec["path"]) for k in ("fwd", "dkdv", "dq")}
    return lambda q, k, v, causal: _CandidateAttention.apply(q, k, v, causal, spec["path"], configs)


# Correctness of a candidate before it is timed: odd lengths, causal and not, n_q != n_k, bf16 and fp16, every
# gradient, against fp32 attention on the same inputs (relative Frobenius error, tolerance per dtype).
CHECK_TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}


@functools.lru_cache(maxsize=None)
def check_candidate(name: str, device_str: str) -> dict:
    """`check_<dtype>_err`: the largest relative error of O, dQ, dK, dV over the check shapes; raises
    AssertionError past the dtype's tolerance. Also compiles the even-length kernels the timing uses."""
    from kernels.attention import flash_attention_reference

    device = torch.device(device_str)
    fn = candidate_fn(name, device)
    d = CANDIDATES[name]["head_dim"]
    gen = torch.Generator(device=device).manual_seed(1)
    metrics = {}
    for dtype_name, tol in CHECK_TOLERANCE.items():
        worst = 0.0
        shapes = (((1, 3, 1000, 1000), True), ((2, 2, 333, 517), False))
        for (b, h, n_q, n_k), causal in shapes[: 2 if dtype_name == "bf16" else 1]:  # fewer compiles for fp16
            q = torch.randn(b, h, n_q, d, generator=gen, device=device, dtype=DTYPES[dtype_name])
            k, v = (torch.randn(b, h, n_k, d, generator=gen, device=device, dtype=q.dtype) for _ in range(2))
            do = torch.randn_like(q)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, causal)
            out.backward(do)
            ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
            ref = flash_attention_reference(*ref_leaves, is_causal=causal)
            ref.backward(do.float())
            for got, want in zip([out] + [t.grad for t in leaves], [ref] + [t.grad for t in ref_leaves]):
                err = float((got.float() - want).norm() / want.norm())
                if not math.isfinite(err) or err > tol:
                    raise AssertionError(f"candidate {name}: relative error {err:.3g} > {tol:g} ({dtype_name}, "
                                         f"{(b, h, n_q, n_k, d)}, causal={causal})")
                worst = max(worst, err)
        metrics[f"check_{dtype_name}_err"] = worst
    warm = torch.randn(1, 2, 1024, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    fn(warm, warm, warm, True).sum().backward()
    torch.cuda.synchronize(device)
    return metrics


def provider_fn(name: str, device: torch.device) -> Callable:
    if name in TRITON_PATHS:
        from kernels.attention import flash_attention
        from kernels.attention.dispatch import gluon_unsupported_reason

        path, bwd = TRITON_PATHS[name]
        _check_path(path, device)
        probe = torch.empty(1, 1, 16, 64, dtype=torch.bfloat16, device=device)
        if path == "gluon" and (reason := gluon_unsupported_reason(probe, probe, probe)):
            raise Unsupported(f"the gluon path: {reason}")
        return functools.partial(flash_attention, path=path, bwd=bwd)
    if name == "pytorch_tiled":
        from kernels.attention.reference import flash_attention_pytorch

        return flash_attention_pytorch
    if name == "naive":
        from kernels.attention import flash_attention_reference

        return flash_attention_reference
    if device.type != "cuda":
        raise Unsupported(f"{name} is a CUDA backend")
    return _sdpa({"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}[name])


PAIRED_PROVIDERS = ("triton",)
"""Providers `--paired-rounds` times against SDPA cuDNN in alternating rounds (the auto dispatch, which the targets
judge)."""
PAIRED_MODES = ("fwd", "fwd_bwd")


def _flops(cfg: dict, mode: str) -> float:
    from kernels.attention import flash_attention_flops

    return flash_attention_flops(cfg["batch"], cfg["heads"], cfg["seq"], cfg["seq"], cfg["head_dim"],
                                 cfg["causal"], mode)


def run_trial(cfg: dict, device: torch.device, caps: dict, check_only: bool = False, paired_rounds: int = 0
              ) -> dict:
    """Time one provider on one shape; raises Unsupported for a skipped row. A candidate is checked first
    (`check_candidate`); `check_only` stops there. `paired_rounds` > 0: a PAIRED_PROVIDERS row on CUDA is also
    timed against SDPA cuDNN in that many alternating rounds (`paired_speedups`)."""
    cap = caps.get(cfg["provider"])
    if cap is not None and cfg["seq"] > cap:
        raise Unsupported(f"seq {cfg['seq']} above the cap {cap} for {cfg['provider']}")
    metrics: dict = {}
    if cfg["provider"] == "triton_candidate":
        fn = candidate_fn(cfg["candidate"], device)
        metrics.update(check_candidate(cfg["candidate"], str(device)))
        metrics["path"] = f"{CANDIDATES[cfg['candidate']]['path']}, two_pass"
        if check_only:
            return metrics
    else:
        fn = provider_fn(cfg["provider"], device)
    dtype = DTYPES[cfg["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"])
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    do = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    causal = cfg["causal"]
    try:
        out = fn(q, k, v, causal)
    except RuntimeError as exc:  # SDPA: "No available kernel" when the pinned backend cannot run this input
        if cfg["provider"] in SDPA_PROVIDERS and "kernel" in str(exc).lower():
            raise Unsupported(str(exc).splitlines()[0]) from exc
        raise
    with torch.no_grad():
        metrics["max_abs_err"] = _max_error(out, q, k, v, causal, device)
    fwd = lambda: fn(q, k, v, causal)  # noqa: E731
    metrics["fwd_median_s"] = median_s(fwd, device)
    metrics["bwd_median_s"] = median_s(functools.partial(out.backward, do, retain_graph=True), device)
    out = None  # release the retained graph before the next measurement
    metrics["fwd_bwd_median_s"] = median_s(lambda: fn(q, k, v, causal).backward(do), device)
    if device.type == "cuda":
        metrics["peak_mem_fwd_bwd_bytes"] = peak_above(lambda: fn(q, k, v, causal).backward(do), device)
    for mode in MODES:
        metrics[f"{mode}_tflops"] = _flops(cfg, mode) / metrics[f"{mode}_median_s"] / 1e12
    if paired_rounds and cfg["provider"] in PAIRED_PROVIDERS and device.type == "cuda":
        cudnn = provider_fn("sdpa_cudnn", device)
        metrics.update(paired_speedups(
            {"fwd": fwd, "fwd_bwd": lambda: fn(q, k, v, causal).backward(do)},
            {"fwd": lambda: cudnn(q, k, v, causal), "fwd_bwd": lambda: cudnn(q, k, v, causal).backward(do)},
            paired_rounds, lambda f: median_s(f, device, warmup_ms=25, rep_ms=PAIRED_REP_MS), "sdpa_cudnn"))
    if cfg["provider"] in TRITON_PATHS:
        from kernels.attention.dispatch import LAST_PATH, last_paths

        metrics["path"] = last_paths()
        metrics["triton_configs"] = triton_picks(LAST_PATH["bwd"])
    return metrics


def triton_picks(bwd: str = "two_pass") -> str:
    """The launch configs of the last forward and backward, e.g. `fwd=128x64/w8/s3; dkdv=...; dq=...`."""
    from kernels.attention.dispatch import LAST_CONFIG
    from kernels.attention.triton.tuning import FlashConfig

    kernels = ("fwd", "dkdvq") if bwd == "one_pass" else ("fwd", "dkdv", "dq")
    return "; ".join(f"{k}={c.label() if isinstance(c, FlashConfig) else 'gluon ' + c.name}"
                     for k in kernels if (c := LAST_CONFIG.get(k)) is not None)


def _max_error(out, q, k, v, causal, device) -> float:
    """Max abs error of `out` against fp32 SDPA (memory-efficient backend on CUDA: no n^2 buffer)."""
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    else:
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    return float((out.float() - ref).abs().max())


def add_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """speedup_<mode>_vs_{sdpa_flash,sdpa_cudnn,best_sdpa} = baseline time / this row's time, per shape."""
    keys = ["study", "batch", "heads", "seq", "head_dim", "dtype", "causal"]
    df = df.copy()
    ok = df[df["status"] == "ok"]
    for mode in MODES:
        col = f"{mode}_median_s"
        if col not in df:
            continue
        base = {prov: ok[ok["provider"] == prov].set_index(keys)[col] for prov in SDPA_PROVIDERS}
        base["best_sdpa"] = pd.concat(base.values(), axis=1).min(axis=1)
        index = pd.MultiIndex.from_frame(df[keys])
        for name, series in base.items():
            df[f"speedup_{mode}_vs_{name}"] = (math.nan if series.empty
                                               else series.reindex(index).to_numpy() / df[col].to_numpy())
    return df


def summary(df: pd.DataFrame) -> str:
    cols = ["provider", "candidate", "path", "batch", "heads", "seq", "head_dim", "dtype", "status", "fwd_ms",
            "fwd_tflops", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_tflops", "speedup_fwd_vs_sdpa_cudnn",
            "speedup_fwd_bwd_vs_sdpa_cudnn", "speedup_fwd_vs_best_sdpa", "speedup_fwd_bwd_vs_best_sdpa", "max_abs_err"]
    shown = with_ms(df)
    view = shown[[c for c in cols if c in shown]]
    return view.to_string(index=False, float_format=lambda x: f"{x:.4g}")


def with_ms(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with `fwd_ms`, `bwd_ms`, `fwd_bwd_ms`: the tables show milliseconds, the rows hold seconds."""
    return df.assign(**{f"{mode}_ms": 1e3 * df[f"{mode}_median_s"] for mode in MODES if f"{mode}_median_s" in df})


def markdown(df: pd.DataFrame) -> str:
    """The target (and hopper) shapes provider by provider with speedups, the grid's TFLOP/s per provider, and
    how many rows were not measured."""
    df = with_ms(df)
    ok = df[df.status == "ok"]
    cols = ["provider", "path", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
            "speedup_fwd_vs_sdpa_flash", "speedup_fwd_bwd_vs_sdpa_flash", "speedup_fwd_vs_sdpa_cudnn",
            "speedup_fwd_bwd_vs_sdpa_cudnn", "paired_speedup_fwd_vs_sdpa_cudnn", "paired_speedup_fwd_ci_rel",
            "paired_speedup_fwd_bwd_vs_sdpa_cudnn", "paired_speedup_fwd_bwd_ci_rel", "max_abs_err"]
    parts = []
    target = ok[ok.study == "target"]
    if not target.empty:
        t = target.iloc[0]
        parts.append(f"Target: batch {t['batch']}, {t['heads']} heads, seq {t['seq']}, d {t['head_dim']}, "
                     f"{t['dtype']}, causal; `triton.testing.do_bench` medians; speedups are raysys Triton over each "
                     "baseline in the same run.")
        parts.append(target[[c for c in cols if c in target]].to_markdown(index=False, floatfmt=".3g"))
    hopper = ok[ok.study == "hopper"]
    if not hopper.empty:
        parts.append("Hopper shapes (bf16, causal; B x H x N x d): each Triton path against both SDPA backends, same "
                     "run. `paired_*` (when the run had --paired-rounds): the auto dispatch against cuDNN timed in "
                     "alternating rounds, the median ratio and its 95% confidence half-width (relative).")
        shape_cols = ["batch", "heads", "seq", "head_dim"]
        parts.append(hopper[shape_cols + [c for c in cols if c in hopper]].to_markdown(index=False, floatfmt=".3g"))
    cand = ok[(ok.study == "candidates") & ok.get("fwd_ms", pd.Series(index=ok.index, dtype=float)).notna()]
    if not cand.empty:
        parts.append("Candidates (issue 16; bf16, causal): launch configs pinned per kernel, one lever at a time from "
                     "the tuned tma configs (`base_tma_*`); `check_*_err` is the largest relative error of O, dQ, dK, "
                     "dV against fp32 attention at odd lengths (causal and not, n_q != n_k); same run as the SDPA "
                     "rows.")
        ccols = ["batch", "heads", "seq", "head_dim", "provider", "candidate", "path", "fwd_config", "dkdv_config",
                 "dq_config", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
                 "speedup_fwd_vs_sdpa_cudnn", "speedup_fwd_bwd_vs_sdpa_cudnn", "check_bf16_err", "check_fp16_err"]
        parts.append(cand[[c for c in ccols if c in cand]].to_markdown(index=False, floatfmt=".3g"))
    grid_rows = ok[ok.study == "grid"]
    if not grid_rows.empty:
        pivot = grid_rows.pivot_table(index=["dtype", "head_dim", "seq"], columns="provider", values="fwd_bwd_tflops")
        parts.append("Grid (batch 1, causal): forward+backward TFLOP/s per provider.")
        parts.append(pivot.reset_index().to_markdown(index=False, floatfmt=".3g"))
    skipped = df[(df.status != "ok")]
    if not skipped.empty:
        counts = skipped.groupby(["status"]).size().to_dict()
        parts.append(f"Rows not measured: {counts} (time budget of the run, sizes a provider cannot handle, OOM); "
                     "`error` says which.")
    return "\n\n".join(parts) + "\n"


def candidate_winners(df: pd.DataFrame) -> dict[str, list[dict]]:
    """Per head dim, the tma fwd config and the (dK/dV, dQ) pair with the lowest geometric-mean forward
    (backward) time over the shapes every compared candidate was measured on, as tuned-file entries."""
    from kernels.attention.triton.tuning import FlashConfig

    out: dict[str, list[dict]] = {"fwd": [], "dkdv": [], "dq": []}
    if "fwd_median_s" not in df:  # nothing was timed
        return out
    ok = df[(df.study == "candidates") & (df.status == "ok") & (df.provider == "triton_candidate")]
    ok = ok[ok["path"].astype(str).str.startswith("tma") & ok["fwd_median_s"].notna()]
    for head_dim, rows in ok.groupby("head_dim"):
        shapes = sorted(set(zip(rows.batch, rows.heads, rows.seq)))
        rows = rows.groupby("candidate").filter(lambda g: len(set(zip(g.batch, g.heads, g.seq))) == len(shapes))
        for kernels, col in ((("fwd",), "fwd_median_s"), (("dkdv", "dq"), "bwd_median_s")):
            geo = rows.groupby([f"{k}_config" for k in kernels])[col].apply(lambda t: math.exp(t.map(math.log).mean()))
            if geo.empty:
                continue
            best = geo.idxmin()
            for kernel, label in zip(kernels, best if isinstance(best, tuple) else (best,)):
                out[kernel].append({
                    **dataclasses.asdict(FlashConfig.from_label(label)), "path": "tma", "head_dim": int(head_dim),
                    "dtype": "bfloat16",
                    "shapes": [f"{b}x{h}x{n}x{head_dim}/bfloat16/causal" for b, h, n in shapes],
                    f"geomean_{col.removesuffix('_median_s')}_ms": round(1e3 * float(geo.min()), 4),
                    "source": "sweeps/flash_bench.py candidates"})
    return out


def auto_path(df: pd.DataFrame) -> str:
    """`tma` when, on every shape of the candidates study, the fastest tma forward plus the fastest tma backward
    (any candidates) take no longer than the portable baseline's forward plus backward; else `portable`."""
    if "fwd_median_s" not in df:
        return "portable"
    ok = df[(df.study == "candidates") & (df.status == "ok") & (df.provider == "triton_candidate")]
    ok = ok[ok["fwd_median_s"].notna()]
    if ok.empty:
        return "portable"
    for _, rows in ok.groupby(["batch", "heads", "seq", "head_dim"]):
        tma = rows[rows["path"].astype(str).str.startswith("tma")]
        portable = rows[rows["candidate"].astype(str).str.startswith("base_portable")]
        if tma.empty or portable.empty:
            return "portable"
        fastest_tma = tma["fwd_median_s"].min() + tma["bwd_median_s"].min()
        if fastest_tma > (portable["fwd_median_s"] + portable["bwd_median_s"]).min():
            return "portable"
    return "tma"


def write_tuned(df: pd.DataFrame, json_path: Path) -> dict[str, list[dict]]:
    """Put `candidate_winners(df)` first among the tuned file's entries of their (kernel, path, head dim, dtype),
    keeping every other entry (the autotuner still times the earlier winners against them), and set the file's
    `auto_path` (`auto_path(df)`: the path `auto` takes on sm_90)."""
    import json

    from kernels.attention.triton.tuning import load_tuned_configs
    from raysys.results.files import write_text

    winners = candidate_winners(df)
    if not any(winners.values()):
        raise ValueError("no candidate was timed (no row of the candidates study with status ok): nothing to write "
                         f"into {json_path}")
    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    load_tuned_configs(json_path)  # the file as it is must be valid
    for kernel, entries in winners.items():
        data[kernel] = entries + data.get(kernel, [])
    data["auto_path"] = auto_path(df)
    ok = df[(df.study == "candidates") & (df.status == "ok")]
    where = ", ".join(f"{col.split('_')[0]} {', '.join(sorted(map(str, ok[col].dropna().unique())))}"
                      for col in ("device_name", "torch_version", "triton_version") if col in ok)
    data["note"] = (f"{data.get('note', '')}; first tma entries per head dim: the candidates study of "
                    f"sweeps/flash_bench.py ({where})").lstrip("; ")
    write_text(json_path, json.dumps(data, indent=1) + "\n")
    load_tuned_configs(json_path)  # what was written reads back
    return winners


NOTES = "docs/hopper-notes.md"
"""Hand-written findings (profiles, what did not help): the report of the repository's `results/` links them."""


def write_report(df: pd.DataFrame, out: Path) -> Path:
    body = markdown(df)
    if out.resolve() == (ROOT / "results").resolve() and (ROOT / NOTES).exists():
        body += f"\nWhat bounds each kernel (profiles, builds) and the levers of issue 16: [{NOTES}]({NOTES}).\n"
    return write_markdown(out, SWEEP, "FlashAttention-2 against PyTorch attention", body)


def build_parser():
    p = study_parser(__doc__, SWEEP, devices=("auto", "cuda", "cpu"), device_help="auto: cuda when present")
    list_flag(p, "--studies", default="target,grid", aliases=("--study",),
              help=f"comma list of {', '.join(STUDIES)}")
    p.add_argument("--quick", action="store_true", help="tiny grid (CPU smoke test)")
    list_flag(p, "--providers", default=None, help=f"comma list of {','.join(PROVIDERS + PATH_PROVIDERS)} (default: "
                                                   "every provider; the hopper study's own)")
    p.add_argument("--max-seq-pytorch", type=int, default=4096, help="largest seq for pytorch_tiled")
    p.add_argument("--max-seq-naive", type=int, default=32768, help="largest seq for naive attention")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget of the run; trials after it become skipped rows (default: none)")
    alias(p, "--max-seconds", "--time-budget-s", type=float)
    list_flag(p, "--seqs", default=None, help="grid study: comma list of sequence lengths (default: 128..65536)")
    list_flag(p, "--head-dims", default=None, help="grid study: comma list of head dims (default: 16,32,64,128)")
    list_flag(p, "--dtypes", default=None, help=f"grid study: comma list of {', '.join(DTYPES)} (default: bf16,fp32)")
    p.add_argument("--no-autotune", action="store_true",
                   help="Triton: first valid / tuned config instead of benchmarking every candidate per shape")
    list_flag(p, "--candidates", default=None, help="candidates study: comma list of CANDIDATES names (default: all)")
    p.add_argument("--check-only", action="store_true",
                   help="candidates study: only the correctness check of each candidate (compiles its kernels)")
    p.add_argument("--paired-rounds", type=int, default=0,
                   help=f"also time {', '.join(PAIRED_PROVIDERS)} against SDPA cuDNN in this many alternating rounds "
                        "(median ratio and its confidence; default 0: not)")
    p.add_argument("--write-tuned", default=None, metavar="JSON",
                   help="candidates study: put the fastest tma configs first in this tuned-config file (default: none, write no file)")
    return p


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = build_parser().parse_args(argv)
    if args.write_tuned and args.report_only:
        df = read_rows(args, SWEEP)
        print(f"tuned configs -> {args.write_tuned}: {write_tuned(df, Path(args.write_tuned))}")
        return df
    if args.report_only:
        return redraw_report(args, SWEEP, write_report)
    studies = ["target", "grid"] if args.studies == "all" else parse_list(args.studies, "studies", STUDIES)
    seqs = tuple(parse_ints(args.seqs, "seqs", 1)) if args.seqs else None
    head_dims = tuple(parse_ints(args.head_dims, "head-dims", 1)) if args.head_dims else None
    dtypes = tuple(parse_list(args.dtypes, "dtypes", tuple(DTYPES))) if args.dtypes else None
    providers = parse_list(args.providers or ",".join(PROVIDERS + PATH_PROVIDERS), "providers",
                           PROVIDERS + PATH_PROVIDERS)
    budget = check_timeout("--time-budget-s", args.time_budget_s) if args.time_budget_s is not None else math.inf
    paired_rounds = check_int("--paired-rounds", args.paired_rounds, 0, MAX_STEPS)
    if paired_rounds in (1, 2):
        raise ValueError(f"--paired-rounds ({paired_rounds}) must be 0 (off) or >= 3 (a median and its confidence)")
    caps = {"pytorch_tiled": check_int("--max-seq-pytorch", args.max_seq_pytorch, 1),
            "naive": check_int("--max-seq-naive", args.max_seq_naive, 1)}
    device = resolve_device(args.device)
    if args.no_autotune:
        os.environ["RAYSYS_FLASH_AUTOTUNE"] = "0"
    candidates = tuple(parse_list(args.candidates, "candidates", tuple(CANDIDATES))) if args.candidates else None
    if (candidates or args.check_only) and "candidates" not in studies:
        raise ValueError("--candidates and --check-only need --studies candidates")
    trials = [t for s in studies for t in grid(s, args.quick, seqs, head_dims, dtypes, candidates, args.check_only)
              if t["provider"] in [*providers, "triton_candidate"]]
    out = output_dir(args, SWEEP)
    PROGRESS.plan(len(trials))
    with open_writer(out, SWEEP, args) as writer:
        start = time.monotonic()
        for cfg in trials:
            if finished(writer, trial_id(cfg)):
                continue
            if time.monotonic() - start > budget:
                row = make_row(SWEEP, cfg, status="skipped", device=device,
                               error=f"{BUDGET_SKIP} {budget:g} spent (--resume runs it)")
            else:
                row = measure(cfg, device, caps, args.check_only, paired_rounds)
            writer.write([row])
            print(f"{cfg['study']:6} {cfg['provider']:13} seq={cfg['seq']:<6} d={cfg['head_dim']:<3} {cfg['dtype']:4} "
                  f"{cfg.get('candidate', '')} -> {row['status']}"
                  + (f" fwd {1e3 * row['fwd_median_s']:.3f} ms, fwd+bwd {1e3 * row['fwd_bwd_median_s']:.3f} ms"
                     if "fwd_median_s" in row
                     else "" if row["status"] == "ok" else f" ({row['error'][:200]})"), flush=True)
        df = add_speedups(writer.frame())
        writer.write(df.to_dict("records"))
    print(summary(df[df["study"].isin(studies)]))
    print(f"wrote {writer.path}, {write_report(df, out)}")
    return df


def measure(cfg: dict, device: torch.device, caps: dict, check_only: bool = False, paired_rounds: int = 0) -> dict:
    """The row of one trial: its metrics, `skipped` for a provider that cannot run it, or its failure (an OOM
    or a failed trial is a row, never the end of the sweep)."""
    try:
        return make_row(SWEEP, cfg, run_trial(cfg, device, caps, check_only, paired_rounds), device=device)
    except Unsupported as exc:
        return make_row(SWEEP, cfg, status="skipped", error=f"unsupported: {exc}", device=device)
    except Exception as exc:
        return make_row(SWEEP, cfg, status=status_of(exc), error=f"{type(exc).__name__}: {exc}", device=device)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main_entry(main))
