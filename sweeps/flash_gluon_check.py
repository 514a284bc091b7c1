"""GPU check of the Gluon (Hopper, warp-specialised) FlashAttention forward: correctness, then timing.

For each knob config of `GluonConfig` (a config that fails to build or is wrong prints one line; the script goes on):
(a) O and L against fp32 references on odd shapes, bf16 and fp16, causal and not, n_q != n_k; (b) forward time
(`do_bench`, median) at four causal bf16 shapes beside SDPA cuDNN and flash and the tl kernel. `--part bwd|all` does
the same for the one-pass backward's `GluonBwdConfig`s: (c) dQ, dK, dV against fp32 autograd, (d) forward+backward
and backward-only time. `--paired-rounds N` times each config against the one the gluon path launches in alternating
rounds. Rows go to <out>/flash_gluon.parquet (never over an earlier one without `--overwrite`); FLOP conventions:
docs/studies.md. Run:
`PYTHONPATH=$PWD python3 sweeps/flash_gluon_check.py --out $OUT [--part all]`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels.attention.gluon.backward as fgo
import kernels.attention.gluon.forward as fg
from kernels.attention import flash_attention_bwd, flash_attention_flops, flash_attention_fwd
from kernels.attention.checks import GLUON_HEAD_DIMS
from kernels.attention.dispatch import DEFAULT_BWD_CONFIGS, LAST_PATH, gluon_bwd_config, gluon_fwd_config
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER
from raysys.results.records import make_row, resolve_out, write_parquet
from raysys.measure.timing import PAIRED_REP_MS, paired_speedups

SWEEP = "flash_gluon"
_row = functools.partial(make_row, SWEEP)  # a row in the project's convention (provenance, seconds)

_FWD64 = functools.partial(fg.GluonConfig, block_m=64, block_n=128, num_stages=3, num_consumers=2)
_FWD128 = functools.partial(fg.GluonConfig, block_m=64, block_n=128, num_stages=2, num_consumers=2)
CONFIGS = {
    64: [_FWD64(), _FWD64(block_n=64, num_consumers=3), _FWD64(block_m=128, block_n=64),
         _FWD64(block_m=128, block_n=64, num_stages=2, persistent=True),
         *(_FWD64(block_m=128, block_n=64, head_group=g) for g in (4, 8, 16)),
         *(_FWD64(num_stages=s, num_consumers=3, head_group=g) for s in (2, 3) for g in (0, 8)),
         *(_FWD64(persistent=True, head_group=8, exp2_emulated=e) for e in (0, 2, 4, 8, 16)),
         *(_FWD64(persistent=True, head_group=8, exp2_emulated=e, rescale_under_s=True) for e in (0, 8)),
         _FWD64(persistent=True, head_group=8, exp2_emulated=8, rescale_under_s=True, round_robin=True)],
    128: [_FWD128(), _FWD128(block_n=64, num_stages=3), _FWD128(num_consumers=1), _FWD128(persistent=True),
          *(_FWD128(persistent=p, head_group=g) for p in (False, True) for g in (4, 8, 16)),
          *(_FWD128(head_group=g) for g in (1, 2, 3, 6)),
          *(_FWD128(block_n=64, num_consumers=3, head_group=g) for g in (2, 8)),
          *(_FWD128(head_group=g, exp2_emulated=e) for g in (1, 8) for e in (4, 8)),
          _FWD128(persistent=True, head_group=4, exp2_emulated=8),
          *(_FWD128(head_group=g, rescale_under_s=True) for g in (0, 1, 8)),
          _FWD128(persistent=True, head_group=4, rescale_under_s=True),
          _FWD128(persistent=True, head_group=4, round_robin=True),
          *(_FWD128(persistent=True, head_group=g) for g in (1, 2))],
}
"""Per head dim, the default first (`_FWD64`, `_FWD128`: each config names what it changes); then `head_group` on
the default and the persistent grid, three consumer groups of 64 query rows (FlashAttention-3's 192-row tile), one
exp2 in n emulated on the FMA pipe (`exp2_emulated`, `/e<n>`), O's rescale issued under S(j) (`rescale_under_s`,
`/ru`), and the persistent configs in round robin (`/rr`). Why each: docs/studies.md."""
CHECK_SHAPES = [((1, 3, 1000, 128), 1000, True), ((1, 3, 1000, 128), 1000, False), ((2, 2, 777, 64), 777, True),
                ((2, 2, 777, 64), 777, False), ((1, 2, 513, 128), 1029, False), ((1, 2, 513, 64), 1029, False)]
"""(q shape, n_k, causal)."""
BENCH_SHAPES = [(1, 16, 16384, 128), (1, 32, 32768, 128), (8, 16, 4096, 64), (4, 32, 2048, 128)]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Max |O - O_ref| allowed (inputs ~N(0, 1), outputs |O| < ~1); L gets the same."""
BWD_CONFIGS = {
    64: [DEFAULT_BWD_CONFIGS[64], *(fgo.GluonBwdConfig(num_stages=3, head_group=g) for g in (4, 8, 16)),
         fgo.GluonBwdConfig(num_stages=3, head_group=8, persistent=True),
         *(fgo.GluonBwdConfig(num_stages=3, head_group=g, dq_whole=False) for g in (4, 8)),
         fgo.GluonBwdConfig(num_stages=3, head_group=4, dk_late=True),
         *(fgo.GluonBwdConfig(num_stages=3, head_group=4, rows_tma=False, dk_late=late) for late in (False, True)),
         *(fgo.GluonBwdConfig(num_stages=s, head_group=g, dk_late=True, dq_buffers=2) for s in (2, 3) for g in (4, 8)),
         fgo.GluonBwdConfig(head_group=4, dq_buffers=2),
         fgo.GluonBwdConfig(head_group=4, dq_whole=False, dq_buffers=2)],
    128: [DEFAULT_BWD_CONFIGS[128], *(fgo.GluonBwdConfig(head_group=g) for g in (1, 2, 4, 8)),
          *(fgo.GluonBwdConfig(head_group=g, dk_late=True) for g in (1, 2)),
          *(fgo.GluonBwdConfig(head_group=g, rows_tma=False, dk_late=late) for g in (2, 8) for late in (False, True)),
          fgo.GluonBwdConfig(head_group=2, persistent=True),
          fgo.GluonBwdConfig(persistent=True), fgo.GluonBwdConfig(head_group=4, persistent=True),
          fgo.GluonBwdConfig(head_group=4, dq_whole=False),
          fgo.GluonBwdConfig(head_group=4, dq_whole=False, persistent=True),
          *(fgo.GluonBwdConfig(head_group=g, dq_whole=False, dq_buffers=2) for g in (1, 2, 4))],
}
"""Per head dim: the one-pass default and its knobs: head groups, `persistent`, `dq_whole=False`, `dk_late`,
`rows_tma=False` (name without `/rt`), `dq_buffers=2` (`/q2`). What each knob does: docs/studies.md."""
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3}
"""Max |g - g_ref| / max |g_ref| per gradient: P, dS and the gradients are rounded to the input dtype (relative
2^-9 bf16, 2^-12 fp16) and summed over ~1000 terms with random signs; a wrong row or tail shows up as O(1)."""


def _short(e: BaseException, lines: int = 4) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    return " | ".join(t.strip() for t in text[-lines:])[:600]


def _reference(q, k, v, causal):
    """fp32 O and natural-log L with the top-left causal mask (query i sees keys j <= i)."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        mask = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal) if q.shape[2] == k.shape[2] or not causal \
        else torch.softmax(scores, -1) @ vf
    return out, lse


def _check_cases(head_dim: int):
    """(q shape, n_k, causal, dtype, (q, k, v, dO)) of every check shape of `head_dim`, bf16 and fp16, seeded."""
    for q_shape, n_k, causal in CHECK_SHAPES:
        if q_shape[-1] != head_dim:
            continue
        for dtype in (torch.bfloat16, torch.float16):
            gen = torch.Generator(device="cuda").manual_seed(0)
            k_shape = q_shape[:2] + (n_k, head_dim)
            shapes = (q_shape, k_shape, k_shape, q_shape)
            tensors = [torch.randn(s, generator=gen, device="cuda").to(dtype) for s in shapes]
            yield q_shape, n_k, causal, dtype, tensors


def check(config: fg.GluonConfig, head_dim: int) -> tuple[bool, list[dict]]:
    rows, ok = [], True
    for q_shape, n_k, causal, dtype, (q, k, v, _) in _check_cases(head_dim):
        out, lse = fg.gluon_attention_fwd(q, k, v, causal, config=config)
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q, k, v, causal)
        err_o = (out.float() - ref_out).abs().max().item()
        err_l = (lse - ref_lse).abs().max().item()
        good = err_o <= TOL[dtype] and err_l <= TOL[dtype] and math.isfinite(err_o) and math.isfinite(err_l)
        ok &= good
        print(f"  check {config.name} {tuple(q_shape)} n_k={n_k} causal={causal} {str(dtype)[6:]}: "
              f"max|dO|={err_o:.2e} max|dL|={err_l:.2e} {'ok' if good else 'WRONG'}", flush=True)
        rows.append(_row(dict(kind="check", config=config.name, head_dim=head_dim, shape=str(q_shape), n_k=n_k,
                              causal=causal, dtype=str(dtype)), dict(err_out=err_o, err_lse=err_l, ok=good)))
    return ok, rows


def _causal_flops(batch: int, heads: int, n: int, d: int) -> float:
    """Forward FLOPs of causal attention as this study counts them: half of the unmasked 4 B H N^2 d."""
    return flash_attention_flops(batch, heads, n, n, d, False) / 2


BENCH_KINDS = {"time": (1.0, 10, 50), "time_fwd_bwd": (3.5, 5, 40), "time_bwd": (2.5, 5, 40)}
"""Row kind -> (its FLOPs in causal forwards, do_bench's warm-up ms, its measuring ms)."""


def bench(fn, shape, provider: str, config: str = "", kind: str = "time", grad_to_none=None) -> dict:
    """The row of `fn`'s median time at the causal bf16 `shape` (B, H, N, D): kind `time` (forward), `time_fwd_bwd`
    (forward+backward) or `time_bwd` (backward only)."""
    scale, warmup, rep = BENCH_KINDS[kind]
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none)
    return _row(dict(kind=kind, provider=provider, config=config, shape="x".join(map(str, shape)), head_dim=shape[-1],
                     causal=True, dtype="torch.bfloat16"),
                dict(median_s=ms / 1e3, tflops=scale * _causal_flops(*shape) / ms * 1e-9))


def _grad_reference(q, k, v, do, causal):
    """fp32 autograd of the reference attention: (dQ, dK, dV)."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, _ = _reference(qf, kf, vf, causal)
    out.backward(do.float())
    return qf.grad, kf.grad, vf.grad


def _rel_err(g, ref) -> float:
    return ((g.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def check_bwd(config: fgo.GluonBwdConfig, head_dim: int) -> tuple[bool, list[dict]]:
    rows, ok = [], True
    for q_shape, n_k, causal, dtype, (q, k, v, do) in _check_cases(head_dim):
        out, lse = fg.gluon_attention_fwd(q, k, v, causal, gluon_fwd_config(q, k))
        grads = fgo.gluon_attention_bwd(q, k, v, out, lse, do, causal, config)
        torch.cuda.synchronize()
        refs = _grad_reference(q, k, v, do, causal)
        errs = [_rel_err(g, r) for g, r in zip(grads, refs)]
        try:  # the project's tl backward on the same O and L, for scale
            tl_errs = [_rel_err(g, r) for g, r in zip(flash_attention_bwd(q, k, v, out, lse, do, causal), refs)]
        except Exception as e:
            tl_errs = [float("nan")] * 3
            print(f"  (tl backward: {_short(e, 1)})", flush=True)
        good = all(math.isfinite(e) and e <= GRAD_TOL[dtype] for e in errs) and all(
            g.dtype == dtype and g.shape == t.shape for g, t in zip(grads, (q, k, v)))
        ok &= good
        print(f"  check {config.name} {tuple(q_shape)} n_k={n_k} causal={causal} {str(dtype)[6:]}: rel max err "
              f"dq={errs[0]:.2e} dk={errs[1]:.2e} dv={errs[2]:.2e} (tl {tl_errs[0]:.1e} {tl_errs[1]:.1e} "
              f"{tl_errs[2]:.1e}) {'ok' if good else 'WRONG'}", flush=True)
        rows.append(_row(dict(kind="check_bwd", config=config.name, head_dim=head_dim, shape=str(q_shape),
                              n_k=n_k, causal=causal, dtype=str(dtype)),
                         dict(err_dq=errs[0], err_dk=errs[1], err_dv=errs[2], tl_err_dq=tl_errs[0],
                              tl_err_dk=tl_errs[1], tl_err_dv=tl_errs[2], ok=good)))
    return ok, rows


def check_configs(configs: dict[int, list], check_fn, kind: str, rows: list[dict]) -> dict[int, list]:
    """Run `check_fn(config, head_dim)` for every config (a failure to compile or launch is one line and an error
    row; the script goes on): the configs that passed, per head dim."""
    passed: dict[int, list] = {64: [], 128: []}
    for head_dim, head_configs in configs.items():
        for config in head_configs:
            t0 = time.time()
            try:
                ok, r = check_fn(config, head_dim)
                rows += r
                if ok:
                    passed[head_dim].append(config)
                print(f"{kind} d={head_dim} {config.name}: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)",
                      flush=True)
            except Exception as e:  # compile error, launch failure, ...
                print(f"{kind} d={head_dim} {config.name}: ERROR {_short(e)}", flush=True)
                rows.append(_row(dict(kind=kind, config=config.name, head_dim=head_dim), dict(ok=False),
                                 status="error", error=_short(e)))
    return passed


def _bwd_path() -> str:
    """The path and mode of this process's last `flash_attention_bwd`, e.g. `gluon, one_pass`, `portable, two_pass`."""
    mode = LAST_PATH.get("bwd", "?")
    return f"{LAST_PATH.get('dkdvq' if mode == 'one_pass' else 'dkdv', '?')}, {mode}"


def run_bwd(rows: list[dict], paired_rounds: int = 0) -> None:
    """(c) backward correctness per config, then (d) forward+backward and backward-only timing of those passed;
    with `paired_rounds`, (d') each one-pass config's backward against the one the gluon path launches
    (`gluon_bwd_config`) in alternating rounds."""
    passed = check_configs(BWD_CONFIGS, check_bwd, "check_bwd", rows)
    for shape in BENCH_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        try:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)
            rows.append(bench(cudnn, shape, "sdpa_cudnn", kind="time_fwd_bwd", grad_to_none=[qg, kg, vg]))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out_g = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            rows.append(bench(lambda: out_g.backward(do, retain_graph=True), shape, "sdpa_cudnn", kind="time_bwd",
                              grad_to_none=[qg, kg, vg]))
            qg = kg = vg = out_g = None
        except Exception as e:
            print(f"time sdpa_cudnn fwd+bwd {shape}: ERROR {_short(e, 2)}", flush=True)

        # The backward `flash_attention_bwd` picks (auto: the one-pass Gluon kernel where `gluon_bwd_chosen` takes
        # it, else the tl kernels); its row's `path` says which ran.
        def gluon_auto():
            out, lse = fg.gluon_attention_fwd(q, k, v, True, gluon_fwd_config(q, k))
            return flash_attention_bwd(q, k, v, out, lse, do, True)
        out = lse = None
        try:
            out, lse = fg.gluon_attention_fwd(q, k, v, True, gluon_fwd_config(q, k))
            rows.append(dict(bench(gluon_auto, shape, "gluon_fwd+auto_bwd", kind="time_fwd_bwd"), path=_bwd_path()))
            rows.append(dict(bench(lambda: flash_attention_bwd(q, k, v, out, lse, do, True), shape, "auto_bwd",
                                   kind="time_bwd"), path=_bwd_path()))
        except Exception as e:
            print(f"time gluon_fwd+auto_bwd {shape}: ERROR {_short(e, 2)}", flush=True)
        for config in passed[shape[-1]]:
            def gluon(c=config):
                out, lse = fg.gluon_attention_fwd(q, k, v, True, gluon_fwd_config(q, k))
                return fgo.gluon_attention_bwd(q, k, v, out, lse, do, True, c)
            try:
                rows.append(bench(gluon, shape, "gluon", config.name, kind="time_fwd_bwd"))
                rows.append(bench(lambda c=config: fgo.gluon_attention_bwd(q, k, v, out, lse, do, True, c), shape,
                                  "gluon", config.name, kind="time_bwd"))
            except Exception as e:
                print(f"time gluon {config.name} fwd+bwd {shape}: ERROR {_short(e, 2)}", flush=True)
        if paired_rounds and out is not None:
            rows.extend(paired_against_default(
                shape, passed[shape[-1]], gluon_bwd_config(q),
                lambda c: fgo.gluon_attention_bwd(q, k, v, out, lse, do, True, c),
                paired_rounds, mode="bwd"))
        q = k = v = do = out = lse = None
        torch.cuda.empty_cache()


def _no_gluon_gpu() -> str:
    """'' on an sm_90 GPU with Gluon's Hopper API, else what this machine lacks."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"this machine's GPU is {torch.cuda.get_device_name()} (sm_{major}{minor})"
    if not HAS_GLUON_HOPPER:
        return f"Triton {triton.__version__} has none"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="folder for flash_gluon.parquet (default: a fresh runs/<UTC time>-flash_gluon/)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier flash_gluon.parquet in --out")
    parser.add_argument("--tl-autotune", action="store_true",
                        help="let the tl kernel autotune (slow first call) instead of its tuned/first config")
    parser.add_argument("--part", choices=("fwd", "bwd", "all"), default="fwd",
                        help="forward checks and timing, backward ones, or both (all: under 4 minutes on an H200)")
    parser.add_argument("--paired-rounds", type=int, default=0, metavar="N",
                        help="also time every forward config (--part bwd/all: every one-pass backward config) "
                             "against the one the gluon path launches at each shape in N alternating rounds (>= 3; "
                             "rows of kind 'paired' / 'paired_bwd')")
    parser.add_argument("--shapes", default=None, metavar="BxHxNxD,...",
                        help="causal bf16 shapes to time instead of the four hopper ones, e.g. 8x16x2048x128 "
                             "(head dim 64 or 128)")
    parser.add_argument("--config-match", default=None, metavar="REGEX",
                        help="only the Gluon configs whose name matches REGEX (re.search), e.g. '^bwd' for the "
                             "one-pass backward; the baselines always run")
    args = parser.parse_args()
    if args.paired_rounds and args.paired_rounds < 3:
        parser.exit(2, f"flash_gluon_check.py: --paired-rounds ({args.paired_rounds}) must be 0 (off) or >= 3 (a "
                       "median and its confidence)\n")
    if args.shapes is not None:
        try:
            BENCH_SHAPES[:] = [parse_shape(text) for text in args.shapes.split(",")]
        except ValueError as e:
            parser.exit(2, f"flash_gluon_check.py: --shapes: {e}\n")
    if args.config_match is not None:
        try:
            pattern = re.compile(args.config_match)
        except re.error as e:
            parser.exit(2, f"flash_gluon_check.py: --config-match {args.config_match!r} is not a regular "
                           f"expression ({e})\n")
        for table in (CONFIGS, BWD_CONFIGS):
            for head_dim in table:
                table[head_dim] = [c for c in table[head_dim] if pattern.search(c.name)]
    if args.out is not None and (Path(args.out) / f"{SWEEP}.parquet").exists() and not args.overwrite:
        parser.exit(2, f"flash_gluon_check.py: {Path(args.out) / f'{SWEEP}.parquet'} exists (an earlier run); pass "
                       "--overwrite to replace it or another --out\n")
    if reason := _no_gluon_gpu():
        parser.exit(2, f"flash_gluon_check.py: needs an sm_90 GPU and Triton's Gluon Hopper API; {reason}\n")
    if not args.tl_autotune:
        os.environ["RAYSYS_FLASH_AUTOTUNE"] = "0"
    out = resolve_out(args.out, SWEEP)
    start = time.time()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    rows = []
    if args.part in ("fwd", "all"):
        run_fwd(rows, args.paired_rounds)
    if args.part in ("bwd", "all"):
        run_bwd(rows, args.paired_rounds)
    write(rows, str(out), start)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """'BxHxNxD' -> (B, H, N, D); positive ints, D a head dim the Gluon kernels take."""
    parts = text.strip().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r} must be BxHxNxD with positive ints, e.g. 4x32x2048x128")
    shape = tuple(int(p) for p in parts)
    if shape[-1] not in GLUON_HEAD_DIMS:
        raise ValueError(f"shape {text!r} has head dim {shape[-1]}; must be one of {GLUON_HEAD_DIMS}")
    return shape


def run_fwd(rows: list[dict], paired_rounds: int = 0) -> None:
    """(a) forward correctness per config, then (b) forward timing of the configs that passed; with
    `paired_rounds`, (c) each of them against the config the gluon path launches in alternating rounds."""
    passed = check_configs(CONFIGS, check, "check", rows)
    # (b) timing: baselines, then every config that passed.
    for shape in BENCH_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            try:
                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                rows.append(bench(fn, shape, name))
            except Exception as e:
                print(f"time {name} {shape}: ERROR {_short(e, 2)}", flush=True)
        try:
            rows.append(bench(lambda: flash_attention_fwd(q, k, v, True), shape, "triton_tl"))
        except Exception as e:
            print(f"time triton_tl {shape}: ERROR {_short(e, 2)}", flush=True)
        for config in passed[shape[-1]]:
            try:
                rows.append(bench(lambda c=config: fg.gluon_attention_fwd(q, k, v, True, config=c), shape, "gluon",
                                  config.name))
            except Exception as e:
                print(f"time gluon {config.name} {shape}: ERROR {_short(e, 2)}", flush=True)
        if paired_rounds:
            rows.extend(paired_against_default(
                shape, passed[shape[-1]], gluon_fwd_config(q, k),
                lambda c: fg.gluon_attention_fwd(q, k, v, True, config=c), paired_rounds))
        q = k = v = None  # free the inputs before the next shape
        torch.cuda.empty_cache()


def paired_against_default(shape, configs: list, default, run, rounds: int, mode: str = "fwd",
                           bench=None) -> list[dict]:
    """Rows of kind 'paired' (`mode` fwd) or 'paired_bwd' (bwd): each config but `default` (what the gluon path
    launches at this shape: `gluon_fwd_config` / `gluon_bwd_config`) against it, `run(config)` timed in `rounds`
    alternating rounds (`raysys.measure.timing.paired_speedups`; `bench` None: do_bench for PAIRED_REP_MS):
    `paired_speedup_<mode>_vs_default` = default time / config time, > 1 where the config is faster. A config that
    fails prints one line and gets no row."""
    bench = bench or (lambda fn: triton.testing.do_bench(fn, warmup=25, rep=PAIRED_REP_MS))
    rows = []
    for config in configs:
        if config == default:
            continue
        try:
            metrics = paired_speedups({mode: lambda c=config: run(c)}, {mode: lambda: run(default)}, rounds, bench,
                                      "default")
        except Exception as e:
            print(f"paired gluon {mode} {config.name} {shape}: ERROR {_short(e, 2)}", flush=True)
            continue
        rows.append(_row(dict(kind="paired" if mode == "fwd" else f"paired_{mode}", provider="gluon",
                              config=config.name, default=default.name, shape="x".join(map(str, shape)),
                              head_dim=shape[-1], causal=True, dtype="torch.bfloat16"), metrics))
        print(f"paired {mode} {config.name} vs {default.name} {shape}: "
              f"{metrics[f'paired_speedup_{mode}_vs_default']:.3f} (+-{metrics[f'paired_speedup_{mode}_ci_rel']:.1%})",
              flush=True)
    return rows


def write(rows: list[dict], out_dir: str, start: float) -> None:
    """Summary tables (vs_cudnn = cuDNN time / time) and `<out>/flash_gluon.parquet`, written atomically."""
    df = pd.DataFrame(rows)
    df["ms"] = df["median_s"] * 1e3 if "median_s" in df else float("nan")  # the printed tables only
    for kind, title in (("time", "forward"), ("time_fwd_bwd", "forward+backward"), ("time_bwd", "backward")):
        if "kind" not in df or not (df.kind == kind).any():
            continue
        timed = df[df.kind == kind].copy()
        cudnn = timed[timed.provider == "sdpa_cudnn"].set_index("shape")["ms"]
        timed["vs_cudnn"] = cudnn.reindex(timed["shape"]).to_numpy() / timed["ms"]
        df.loc[timed.index, "vs_cudnn"] = timed["vs_cudnn"]
        print(f"\n{title}, causal bf16 (vs_cudnn = cuDNN ms / ms)")
        print(timed[["shape", "provider", "config", "ms", "tflops", "vs_cudnn"]].to_string(
            index=False, float_format=lambda x: f"{x:.3f}"))
    path = write_parquet(df.drop(columns="ms"), os.path.join(out_dir, f"{SWEEP}.parquet"))
    print(f"\nwrote {path} ({len(df)} rows, {time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
