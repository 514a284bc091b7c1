"""Launch configs of the tl kernels: candidates per path and dtype, the pruning predicate, the tuned file's tl part.

Four kernels are tuned separately: `fwd`, `dkdv`, `dq` and `dkdvq` (the dK/dV kernel that also adds each tile's dS K
into an fp32 dQ: the one-pass backward). A `FlashConfig` is (block_m query rows, block_n key rows, num_warps,
num_stages) and knobs: `warp_specialize` and `persistent` (tma path), `maxnreg`, `lazy_rescale` (fwd) and `unroll`;
`label()` writes it, `from_label` reads it back. The causal split needs whole tiles on the diagonal: block_m % block_n
== 0 for fwd and dq, block_n % block_m == 0 for dkdv(q).

The autotuner of a kernel benchmarks `valid_configs`: the tuned file's entries for the call's (kernel, path, head dim,
dtype) where it has some (`sweeps/flash_tiles.py` writes them), else the built-in candidates of the path and dtype
family that `config_fits` keeps (tile divisibility, shared memory, a register budget); with autotuning off
(`dispatch.autotune_enabled`) the first of them runs. Under the interpreter each kernel has one small config.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels.attention.dispatch import (
    PATHS,
    TUNED_CONFIGS_PATH,
    autotune_enabled,
    dtype_name,
)
from kernels.device import INTERPRET, shared_memory_limit

KERNELS = ("fwd", "dkdv", "dq", "dkdvq")
@dataclass(frozen=True)
class FlashConfig:
    """Launch parameters of one FlashAttention kernel (block_m: query rows per tile, block_n: key rows)."""

    block_m: int
    """Query rows per tile (power of two, >= 16)."""
    block_n: int
    """Key rows per tile (power of two, >= 16)."""
    num_warps: int = 4
    """Warps per program (1, 2, 4, 8 or 16)."""
    num_stages: int = 2
    """Software-pipelining depth of the tile loop (>= 1)."""
    warp_specialize: bool = False
    """tma path: Triton's warp specialisation of the unmasked tile loop (producer / consumer warp groups)."""
    persistent: bool = False
    """tma path: one program per SM loops over the tiles (heaviest first) instead of one program per tile."""
    maxnreg: int | None = None
    """Register cap per thread (Triton's `maxnreg`, CUDA only): 128 lets two 8-warp programs share an SM."""
    lazy_rescale: bool = False
    """fwd only: rescale the output accumulator only in tiles where some row's running max grew."""
    unroll: int = 1
    """Unroll factor of the tile loop (`tl.range(loop_unroll_factor=...)`; 1: not unrolled)."""

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} ({value!r}) must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps ({self.num_warps!r}) must be one of 1, 2, 4, 8, 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages ({self.num_stages!r}) must be an int >= 1")
        for name in ("warp_specialize", "persistent", "lazy_rescale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be a bool")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 24 <= self.maxnreg <= 255
                                         or self.maxnreg % 8):
            raise ValueError(f"maxnreg ({self.maxnreg!r}) must be None or a multiple of 8 in [24, 255]")
        if not isinstance(self.unroll, int) or self.unroll not in (1, 2, 4):
            raise ValueError(f"unroll ({self.unroll!r}) must be 1, 2 or 4")

    def check(self, kernel: str, path: str | None = None) -> FlashConfig:
        """Raise ValueError unless the tiles fit `kernel`'s causal split (diagonal = whole tiles) and the knobs
        exist on `path`."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel {kernel!r} must be one of {KERNELS}")
        if kernel in ("fwd", "dq") and self.block_m % self.block_n:
            raise ValueError(f"{kernel}: block_m ({self.block_m}) must be a multiple of block_n ({self.block_n})")
        if kernel in ("dkdv", "dkdvq") and self.block_n % self.block_m:
            raise ValueError(f"{kernel}: block_n ({self.block_n}) must be a multiple of block_m ({self.block_m})")
        if path is not None and path not in PATHS:
            raise ValueError(f"path {path!r} must be one of {PATHS}")
        if path == "portable" and (self.warp_specialize or self.persistent):
            raise ValueError(f"{self.label()}: warp_specialize and persistent exist on the tma path only")
        if self.lazy_rescale and kernel != "fwd":
            raise ValueError(f"{kernel}: lazy_rescale exists in the forward kernel only")
        return self

    def label(self) -> str:
        """`128x64/w8/s3` plus `/ws`, `/persistent`, `/r<maxnreg>`, `/lazy` and `/u<unroll>` when set
        (`from_label` reads it back)."""
        return (f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"
                + ("/ws" if self.warp_specialize else "") + ("/persistent" if self.persistent else "")
                + (f"/r{self.maxnreg}" if self.maxnreg else "") + ("/lazy" if self.lazy_rescale else "")
                + (f"/u{self.unroll}" if self.unroll > 1 else ""))

    @classmethod
    def from_label(cls, label: str) -> FlashConfig:
        """The config of a `label()` string, e.g. `128x64/w8/s2/r128`."""
        parts = label.strip().split("/")
        try:
            block_m, block_n = (int(x) for x in parts[0].split("x"))
            kw: dict = {}
            for part in parts[1:]:
                if part in ("ws", "persistent", "lazy"):
                    kw[{"ws": "warp_specialize", "lazy": "lazy_rescale"}.get(part, part)] = True
                elif part[:1] in ("w", "s", "r", "u") and part[1:].isdigit():
                    kw[{"w": "num_warps", "s": "num_stages", "r": "maxnreg", "u": "unroll"}[part[0]]] = int(part[1:])
                else:
                    raise ValueError(part)
        except ValueError:
            raise ValueError(f"config label {label!r} must look like 128x64/w8/s3[/ws][/persistent][/r128][/lazy]"
                             "[/u2]") from None
        return cls(block_m, block_n, **kw)

    def launch_meta(self, kernel: str) -> dict:
        """The kernel's constexprs and launch options this config sets (besides the EVEN_* heuristics)."""
        meta = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "WARP_SPECIALIZE": self.warp_specialize,
                "PERSISTENT": self.persistent, "UNROLL": self.unroll}
        if kernel == "fwd":
            meta["LAZY_RESCALE"] = self.lazy_rescale
        return meta

    def to_triton(self, kernel: str) -> triton.Config:
        extra = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        return triton.Config(self.launch_meta(kernel), num_warps=self.num_warps, num_stages=self.num_stages, **extra)

    @classmethod
    def from_triton(cls, config: triton.Config) -> FlashConfig:
        kw = config.kwargs
        return cls(kw["BLOCK_M"], kw["BLOCK_N"], config.num_warps, config.num_stages,
                   bool(kw.get("WARP_SPECIALIZE", False)), bool(kw.get("PERSISTENT", False)),
                   getattr(config, "maxnreg", None), bool(kw.get("LAZY_RESCALE", False)), int(kw.get("UNROLL", 1)))


# Candidates per path and dtype family, in order of preference (with autotuning off the first valid one wins;
# docs/attention.md says how each order was measured). 16-bit inputs, portable path: 128-row query tiles with 8
# warps (two warp groups) feed wgmma; 3 stages hide the K/V loads; the dK/dV pass wants tall key tiles and short
# query tiles (and dQ the reverse), its registers holding two fp32 accumulators.
_GPU_CONFIGS = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2),
            (128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2)],
    "dkdv": [(64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 4), (32, 64, 4, 3), (32, 128, 8, 2),
             (32, 128, 4, 4), (16, 128, 8, 3), (64, 64, 4, 3), (16, 64, 4, 3), (16, 32, 4, 2)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 8, 4), (128, 32, 4, 3), (128, 64, 8, 2),
           (64, 32, 4, 3), (64, 64, 4, 2), (64, 16, 4, 3), (32, 16, 4, 2)],
    "dkdvq": [(32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (32, 64, 4, 3), (16, 64, 4, 3),
              (16, 32, 4, 2)],
}
# 16-bit inputs, tma path (sm_90+): the portable winners, larger key tiles (the TMA unit moves them without
# registers) and the persistent grid; the last ones cap registers at 128 so that two 8-warp programs share an SM.
# Warp specialisation is a knob but no candidate: Triton 3.6 on sm_90 fails to compile the dQ loops with it, and
# the fwd and dK/dV kernels it built gave wrong results.
_TMA_CONFIGS = {
    "fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 64, 8, 3, False, True),
            (64, 32, 4, 2), (128, 64, 8, 2, False, False, 128)],
    "dkdv": [(64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (32, 128, 8, 3), (16, 64, 4, 3), (16, 32, 4, 2),
             (32, 128, 8, 3, False, False, 128)],
    "dq": [(128, 64, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 3, False, True),
           (64, 16, 4, 3), (32, 16, 4, 2)],
    "dkdvq": [(32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 8, 3, False, True),
              (16, 64, 4, 3), (16, 32, 4, 2)],
}
# fp32 inputs with exact fp32 products (FMA, no tensor cores) hold whole operand tiles in registers: small
# tiles, and 8 warps where the tiles are larger (both paths).
_GPU_CONFIGS_FP32 = {
    "fwd": [(64, 32, 8, 2), (32, 32, 4, 2), (32, 16, 4, 2), (64, 16, 4, 2)],
    "dkdv": [(16, 64, 8, 2), (16, 32, 4, 2), (32, 64, 8, 2), (16, 16, 4, 2)],
    "dq": [(64, 16, 8, 2), (32, 16, 4, 2), (64, 32, 8, 2), (16, 16, 4, 2)],
    "dkdvq": [(16, 64, 8, 2), (16, 32, 4, 2), (16, 16, 4, 2)],
}
# The interpreter runs every tile op in NumPy: one small config, with BLOCK_M != BLOCK_N so that the
# diagonal split takes several steps and the tail tiles are exercised at test sizes.
_INTERPRET_CONFIGS = {"fwd": [(32, 16, 1, 1)], "dkdv": [(16, 32, 1, 1)], "dq": [(32, 16, 1, 1)],
                      "dkdvq": [(16, 32, 1, 1)]}


def load_tuned_configs(path: str | os.PathLike = TUNED_CONFIGS_PATH) -> dict[str, list[dict]]:
    """Entries `{block_m, block_n, num_warps, num_stages[, warp_specialize, persistent, path, head_dim, dtype,
    ...]}` per kernel (a missing `path` is `portable`), or {} if no file."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    out: dict[str, list[dict]] = {}
    for kernel in KERNELS:
        entries = data.get(kernel, [])
        if not isinstance(entries, list):
            raise ValueError(f"{path}: '{kernel}' must be a list of config objects")
        for entry in entries:
            _entry_config(entry).check(kernel, entry.get("path", "portable"))
        out[kernel] = entries
    return out


def _entry_config(entry: dict) -> FlashConfig:
    return FlashConfig(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"],
                       bool(entry.get("warp_specialize", False)), bool(entry.get("persistent", False)),
                       entry.get("maxnreg"), bool(entry.get("lazy_rescale", False)), int(entry.get("unroll", 1)))


_TUNED = {} if INTERPRET else load_tuned_configs()


def _tuned_entries(kernel: str, dtype: torch.dtype, path: str) -> list[dict]:
    return [e for e in _TUNED.get(kernel, []) if e.get("dtype", dtype_name(dtype)) == dtype_name(dtype)
            and e.get("path", "portable") == path]


def tuned_exact(kernel: str, dtype: torch.dtype, head_dim: int | None, path: str = "portable") -> list[FlashConfig]:
    """The tuned file's configs for exactly this (kernel, path, head dim, dtype), best first."""
    entries = _tuned_entries(kernel, dtype, path)
    return list(dict.fromkeys(_entry_config(e) for e in entries if e.get("head_dim") == head_dim))


def candidates(kernel: str, dtype: torch.dtype, head_dim: int | None = None,
               path: str = "portable") -> list[FlashConfig]:
    """Configs worth trying, best guess first: tuned for this path, head dim and dtype, the built-in family,
    then configs tuned for other head dims of this path and dtype."""
    if path not in PATHS:
        raise ValueError(f"path {path!r} must be one of {PATHS}")
    if INTERPRET:
        return [FlashConfig(*c).check(kernel) for c in _INTERPRET_CONFIGS[kernel]]
    other = [_entry_config(e) for e in _tuned_entries(kernel, dtype, path) if e.get("head_dim") != head_dim]
    if dtype == torch.float32:
        family = _GPU_CONFIGS_FP32
    else:
        family = _TMA_CONFIGS if path == "tma" else _GPU_CONFIGS
    return list(dict.fromkeys(tuned_exact(kernel, dtype, head_dim, path)
                              + [FlashConfig(*c).check(kernel) for c in family[kernel]] + other))


def config_list(kernel: str) -> list[FlashConfig]:
    """Every config the autotuner of `kernel` knows (all paths and dtypes); the pruner keeps the call's."""
    if INTERPRET:
        return candidates(kernel, torch.float32)
    return list(dict.fromkeys(c for path in PATHS for dtype in (torch.bfloat16, torch.float32)
                              for c in candidates(kernel, dtype, path=path)))


def _estimated_shared_bytes(kernel: str, cfg: FlashConfig, block_d: int, elem: int) -> int:
    """Operand tiles Triton stages through shared memory: the resident tile(s) plus `num_stages` streamed ones."""
    if kernel == "fwd":  # Q resident; K, V streamed
        resident, streamed = cfg.block_m, 2 * cfg.block_n
    elif kernel == "dkdv":  # K, V resident; Q, dO streamed
        resident, streamed = 2 * cfg.block_n, 2 * cfg.block_m
    elif kernel == "dkdvq":  # and the fp32 dQ tile on its way out (two 16-bit rows' worth per row)
        resident, streamed = 2 * cfg.block_n + 2 * cfg.block_m, 2 * cfg.block_m
    else:  # Q, dO resident; K, V streamed
        resident, streamed = 2 * cfg.block_m, 2 * cfg.block_n
    return (resident + cfg.num_stages * streamed) * block_d * elem


def config_fits(kernel: str, cfg: FlashConfig, block_d: int, dtype: torch.dtype, device: torch.device,
                path: str = "portable") -> bool:
    """The pruning predicate: tile divisibility for the causal split, knobs of the path, and a shared-memory /
    register budget."""
    try:
        cfg.check(kernel, path)
    except ValueError:
        return False
    if INTERPRET:
        return True
    elem = torch.tensor([], dtype=dtype).element_size()
    # Warp specialisation (see _TMA_CONFIGS): 16-bit wgmma loops of 4-warp programs, not the dQ loops.
    if cfg.warp_specialize and (elem == 4 or kernel in ("dq", "dkdvq") or cfg.num_warps != 4):
        return False
    if _estimated_shared_bytes(kernel, cfg, block_d, elem) > 0.9 * shared_memory_limit(device):
        return False
    if elem == 4 and cfg.block_m * cfg.block_n > 64 * 32:  # see _GPU_CONFIGS_FP32
        return False
    # Register budget: fp32 accumulators (O, or dK and dV, or dQ) plus the score tile, per thread; past ~160
    # values a thread the sm_90 builds spill. A warp-specialised program's two consumer warp groups hold them.
    rows = cfg.block_n if kernel in ("dkdv", "dkdvq") else cfg.block_m
    accumulators = (1 if kernel in ("fwd", "dq") else 2) * rows * block_d + cfg.block_m * cfg.block_n
    if kernel == "dkdvq":  # the dS K tile
        accumulators += cfg.block_m * block_d
    per_thread = 160 if cfg.maxnreg is None else min(160, cfg.maxnreg - 32)  # a cap leaves ~32 for the rest
    return accumulators <= per_thread * 32 * cfg.num_warps * (2 if cfg.warp_specialize else 1)


def valid_configs(kernel: str, dtype: torch.dtype, head_dim: int, block_d: int, device: torch.device,
                  path: str = "portable", allowed=None) -> list[FlashConfig]:
    """What the autotuner benchmarks: the tuned file's valid configs for this (kernel, path, head dim, dtype)
    when it has any, else every valid candidate (restricted to `allowed` when given), in order of preference."""

    def ok(c):
        return (allowed is None or c in allowed) and config_fits(kernel, c, block_d, dtype, device, path)

    exact = [c for c in tuned_exact(kernel, dtype, head_dim, path) if ok(c)]
    return exact or [c for c in candidates(kernel, dtype, head_dim, path) if ok(c)]


def first_valid_config(kernel: str, dtype: torch.dtype, head_dim: int, block_d: int, device: torch.device,
                       path: str = "portable") -> FlashConfig:
    """The config autotuning off takes (the tuned file's, else the built-in order's first that fits)."""
    valid = valid_configs(kernel, dtype, head_dim, block_d, device, path)
    if valid:
        return valid[0]
    plain = [c for c in candidates(kernel, dtype, head_dim, path) if not (c.warp_specialize or c.persistent)]
    return min(plain, key=lambda c: (c.block_m * c.block_n, c.num_stages))


def make_pruner(kernel: str):
    """`early_config_prune` for `kernel`: the call's `valid_configs` in order of preference; only the first one
    when autotuning is off."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        q = args["Q"]
        path = "tma" if args.get("USE_TMA", False) else "portable"
        known = {FlashConfig.from_triton(c): c for c in configs}
        valid = [known[c] for c in valid_configs(kernel, q.dtype, args["HEAD_DIM"], args["BLOCK_D"], q.device,
                                                 path, known)]
        if not valid:  # nothing fits the estimates: the smallest plain tiles rather than no launch at all
            plain = [c for c in configs if not (c.kwargs["WARP_SPECIALIZE"] or c.kwargs["PERSISTENT"])]
            valid = [min(plain, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))]
        return valid if autotune_enabled() else valid[:1]

    return prune


def even_heuristics():
    return {"EVEN_M": lambda a: a["N_Q"] % a["BLOCK_M"] == 0, "EVEN_N": lambda a: a["N_K"] % a["BLOCK_N"] == 0}


AUTOTUNE_KEY = ["SEQ_BUCKET", "HEAD_DIM", "IS_CAUSAL", "INPUT_PRECISION", "USE_TMA"]  # + the tensor dtypes
