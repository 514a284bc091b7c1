"""Which attention kernel runs, with which config: every threshold and environment variable that steers them.

A call resolves a path: `portable` or `tma` (the tl kernels; tma on sm_90 where the tuned file's `auto_path` says),
or `gluon` (the Gluon kernels on sm_90, bf16 / fp16, head dim 64 or 128, TMA-able layouts). `auto` takes the gluon
forward from GLUON_AUTO_MIN_WORK on and the Gluon one-pass backward from GLUON_BWD_AUTO_MIN_WORK on (outside
`torch.use_deterministic_algorithms`); `RAYSYS_FLASH_PATH` / `path=` and `RAYSYS_FLASH_BWD` / `bwd=` ask for one.
The Gluon kernels' configs: the tuned file's `gluon` part (its entry for the running card first), else
DEFAULT_*_CONFIGS with the per-head-dim knobs below, head groups fit to the L2 cache (`l2_head_group`). A Gluon
kernel whose build fails here is recorded (`gluon_broken`) and its calls run the tl kernels instead.

Environment (read per call unless noted): RAYSYS_FLASH_PATH, RAYSYS_FLASH_BWD, RAYSYS_FLASH_AUTOTUNE (0: the first
valid tl config, no benchmarking), RAYSYS_FLASH_TUNED (another tuned file, read at import), RAYSYS_FLASH_COMPILE
(the PyTorch reference's backward: auto, 1 or 0). `LAST_PATH` / `last_paths()` record what ran; `planned_paths`
says what a call of a given shape would run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings
from pathlib import Path

import torch
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels.attention.checks import as_4d, tma_layout_ok, unsupported_reason
from kernels.attention.gluon.backward import GluonBwdConfig
from kernels.attention.gluon.forward import GluonConfig
from kernels.attention.tuned_file import COMMITTED_TUNED_PATH, TUNED_CONFIGS_PATH, TUNED_ENV  # noqa: F401
from kernels.device import INTERPRET, capability, device_name, l2_cache_bytes

# ----------------------------------------------------------------------------------------------------------
# Environment and names
# ----------------------------------------------------------------------------------------------------------
PATH_ENV = "RAYSYS_FLASH_PATH"
"""auto (default), portable, tma or gluon: the path `flash_attention` and the custom ops take."""
BWD_ENV = "RAYSYS_FLASH_BWD"
"""auto (default), two_pass or one_pass: the backward `flash_attention` and the custom ops take."""
AUTOTUNE_ENV = "RAYSYS_FLASH_AUTOTUNE"
"""0 (or false, no, off): the tl kernels take the first valid config without benchmarking; else they autotune."""
COMPILE_ENV = "RAYSYS_FLASH_COMPILE"
"""auto (default: on CUDA only), 1 or 0: whether the PyTorch reference's backward runs through torch.compile."""

PATHS = ("portable", "tma")
"""The tl kernels' paths: pointer loads (every GPU and the interpreter), and tensor descriptors (sm_90)."""
GLUON = "gluon"
"""The Gluon kernels' path: their forward, and their one-pass backward (`gluon_bwd_chosen`), else the tl kernels'
auto path backward."""
BWD_MODES = ("two_pass", "one_pass")



def requested_path(path: str | None) -> str:
    """`path`, or RAYSYS_FLASH_PATH when None (default auto), lower case."""
    return path or os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"


def requested_bwd(bwd: str | None) -> str:
    """`bwd`, or RAYSYS_FLASH_BWD when None (default auto), lower case."""
    return bwd or os.environ.get(BWD_ENV, "auto").strip().lower() or "auto"


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def reference_compiles(device: torch.device) -> bool:
    """Whether the PyTorch reference's backward runs through torch.compile on `device` (RAYSYS_FLASH_COMPILE)."""
    policy = os.environ.get(COMPILE_ENV, "auto").strip().lower()
    if policy == "auto":
        return device.type == "cuda"
    if policy in ("1", "0"):
        return policy == "1"
    raise ValueError(f"{COMPILE_ENV}={policy!r} must be one of auto, 1, 0")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the tuned file names it (`bfloat16`)."""
    return str(dtype).removeprefix("torch.")


def tuned_auto_path(path: str | os.PathLike = TUNED_CONFIGS_PATH) -> str:
    """The path `auto` takes on an sm_90 GPU: the tuned file's `auto_path` (`tma` or `portable`), else `portable`."""
    path = Path(path)
    value = json.loads(path.read_text()).get("auto_path", "portable") if path.exists() else "portable"
    if value not in PATHS:
        raise ValueError(f"{path}: auto_path {value!r} must be one of {PATHS}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Thresholds
# ----------------------------------------------------------------------------------------------------------
GLUON_AUTO_MIN_WORK = {128: 2**36, 64: 2**37}
"""Head dim -> B * H * n_q * n_k * d from which `auto` takes the gluon forward (short calls stay on the tl kernels,
whose launch costs less host time)."""
GLUON_BWD_AUTO_MIN_WORK = {128: 2**36, 64: 2**37}
"""Head dim -> B * H * n_q * n_k * d from which `auto` takes the Gluon one-pass backward (other head dims keep the
tl kernels)."""
AUTO_TMA = tuned_auto_path() == "tma"
"""Whether `auto` takes the tl kernels' tma path where it can (sm_90, Triton with device-side tensor descriptors)."""
AUTO_BWD = {"portable": "two_pass", "tma": "two_pass"}
"""The tl backward `auto` takes per path."""
EXP2_EMULATED = {64: 8}
"""Head dim -> the gluon forward's `GluonConfig.exp2_emulated` where the tuned file does not set it."""
RESCALE_UNDER_S = {64: True}
"""Head dim -> the gluon forward's `GluonConfig.rescale_under_s` where the tuned file does not set it."""
PERSISTENT_GRID = {128: (32768, {"persistent": True, "head_group": 4})}
"""Head dim -> (n_q up to which, the fields that replace the gluon forward's config there) when that config has two
consumer groups (what the persistent grid takes)."""
L2_SHARE = 4
"""`l2_head_group` keeps a head group's re-read rows within 1 / L2_SHARE of the L2 cache."""
DQ_BUFFERS = {64: 2}
"""Head dim -> the Gluon one-pass backward's `GluonBwdConfig.dq_buffers` where the tuned file does not set it."""
DEFAULT_FWD_CONFIGS = {64: GluonConfig(block_m=64, block_n=128, num_stages=3, num_consumers=2),
                       128: GluonConfig(block_m=64, block_n=128, num_stages=2, num_consumers=2)}
"""Per head dim, the gluon forward's config where the tuned file has none: two 64-row consumer groups, 128-key
tiles (FlashAttention-3's d-128 shape)."""
DEFAULT_BWD_CONFIGS = {64: GluonBwdConfig(block_m=64, num_stages=2), 128: GluonBwdConfig(block_m=64, num_stages=2)}
"""Per head dim, the Gluon one-pass backward's config where the tuned file has none."""


# ----------------------------------------------------------------------------------------------------------
# The tuned file's `gluon` part
# ----------------------------------------------------------------------------------------------------------
GLUON_KINDS = ("fwd", "bwd")
"""The Gluon kernels the tuned file's `gluon` part holds configs of: the forward and the one-pass backward."""
GLUON_FIELDS = {kind: frozenset(field.name for field in dataclasses.fields(cls))
                for kind, cls in (("fwd", GluonConfig), ("bwd", GluonBwdConfig))}
"""The config fields of each Gluon kind a tuned entry may hold (`GluonConfig`'s, `GluonBwdConfig`'s)."""
GLUON_MEASURED = {"head_dim", "dtype", "device", "shapes", "geomean_ms", "geomean_vs_reference", "shape", "median_ms",
                  "tflops", "vs_reference"}
"""The other fields of a tuned Gluon entry: what it was measured on (`device`: the card's name, absent in entries
written before it was recorded) and how it did (`sweeps/flash_tiles.py`)."""


def load_gluon_tuned(path: str | os.PathLike = TUNED_CONFIGS_PATH) -> dict[str, list[dict]]:
    """The tuned file's `gluon` part, {kind: entries} (each the config's fields, `head_dim`, `dtype`, and `shapes`
    for a winner over the swept shapes or `shape` for one shape's), or {} without a file or part; an entry with a
    field neither its config nor the measurement has is a ValueError."""
    path = Path(path)
    if not path.exists():
        return {}
    part = json.loads(path.read_text()).get("gluon", {})
    if not isinstance(part, dict) or set(part) - set(GLUON_KINDS):
        raise ValueError(f"{path}: 'gluon' must map some of {GLUON_KINDS} to lists of config objects")
    for kind, entries in part.items():
        for entry in entries:
            unknown = set(entry) - GLUON_FIELDS[kind] - GLUON_MEASURED if isinstance(entry, dict) else None
            if unknown is None or unknown:
                raise ValueError(f"{path}: gluon {kind} entry {entry!r} has fields {sorted(unknown or [])} that are "
                                 f"not among {sorted(GLUON_FIELDS[kind])} and the measurement's")
    return {kind: list(part.get(kind, [])) for kind in GLUON_KINDS}


_GLUON_TUNED = {} if INTERPRET else load_gluon_tuned()


def gluon_tuned_fields(kind: str, head_dim: int, dtype: torch.dtype, device: str | None = None) -> dict | None:
    """The config fields of the tuned file's sweep-wide winner for this Gluon `kind`, head dim and dtype, or None:
    the entry measured on the card named `device` where there is one, else one that names no card, else another
    card's (a Hopper card's tuning is a better start than none)."""
    winners = [entry for entry in _GLUON_TUNED.get(kind, [])
               if "shapes" in entry and entry.get("head_dim") == head_dim and entry.get("dtype") == dtype_name(dtype)]
    rank = lambda e: 0 if device is not None and e.get("device") == device else 1 if "device" not in e else 2  # noqa: E731
    entry = min(winners, key=rank, default=None)  # (the first of the best rank)
    return None if entry is None else {k: v for k, v in entry.items() if k in GLUON_FIELDS[kind]}


# ----------------------------------------------------------------------------------------------------------
# The Gluon kernels' configs
# ----------------------------------------------------------------------------------------------------------
def gluon_fwd_default(head_dim: int, dtype: torch.dtype, device: str | None = None) -> GluonConfig:
    """The tuned file's forward config for this head dim and dtype (on the card named `device`:
    `gluon_tuned_fields`), else DEFAULT_FWD_CONFIGS'; its `exp2_emulated` and `rescale_under_s` from EXP2_EMULATED
    and RESCALE_UNDER_S unless the file sets them."""
    fields = dict(gluon_tuned_fields("fwd", head_dim, dtype, device) or {})
    config = GluonConfig(**fields) if fields else DEFAULT_FWD_CONFIGS[head_dim]
    if "exp2_emulated" not in fields and head_dim in EXP2_EMULATED:
        config = dataclasses.replace(config, exp2_emulated=EXP2_EMULATED[head_dim])
    if "rescale_under_s" not in fields and head_dim in RESCALE_UNDER_S:
        config = dataclasses.replace(config, rescale_under_s=RESCALE_UNDER_S[head_dim])
    return config


def gluon_fwd_config(q: torch.Tensor, k: torch.Tensor) -> GluonConfig:
    """The forward config the gluon path launches for q (B, H, N_Q, d) and k (B, H, N_K, d): `gluon_fwd_default`,
    with PERSISTENT_GRID's fields up to its length when that config has two consumer groups, and its head group fit
    to the L2 cache of q's device (`l2_head_group`: every query tile of a head reads that head's K and V again, 2 *
    N_K * d elements); one lookup per problem shape."""
    batch, heads, n_q, head_dim = q.shape
    return _gluon_fwd_config(head_dim, q.dtype, n_q, k.shape[2], batch * heads, q.device)


@functools.lru_cache(maxsize=64)
def _gluon_fwd_config(head_dim: int, dtype: torch.dtype, n_q: int, n_k: int, heads: int,
                      device: torch.device) -> GluonConfig:
    config = gluon_fwd_default(head_dim, dtype, device_name(device))
    n_max, fields = PERSISTENT_GRID.get(head_dim, (0, {}))
    if n_q <= n_max and config.num_consumers == 2:
        config = dataclasses.replace(config, **fields)
    head_bytes = 2 * n_k * head_dim * dtype.itemsize
    group = l2_head_group(config.head_group, head_bytes, heads, l2_cache_bytes(device))
    return config if group == config.head_group else dataclasses.replace(config, head_group=group)


def gluon_bwd_default(head_dim: int, dtype: torch.dtype, n_q: int | None = None, heads: int | None = None,
                      l2_bytes: int | None = None, device: str | None = None) -> GluonBwdConfig:
    """The tuned file's one-pass backward config for this head dim and dtype (on the card named `device`:
    `gluon_tuned_fields`), else DEFAULT_BWD_CONFIGS', with its `dq_buffers` from DQ_BUFFERS unless the file sets it;
    given the problem's query length `n_q`, its B * H `heads` and the device's L2 bytes, its `head_group` capped by
    `l2_head_group` (a head's Q and dO rows and its fp32 dQ, n_q * d * (2 * elem + 4) bytes)."""
    fields = gluon_tuned_fields("bwd", head_dim, dtype, device) or {}
    config = GluonBwdConfig(**fields) if fields else DEFAULT_BWD_CONFIGS[head_dim]
    if "dq_buffers" not in fields and head_dim in DQ_BUFFERS:
        config = dataclasses.replace(config, dq_buffers=DQ_BUFFERS[head_dim])
    if n_q is None:
        return config
    elem = dtype.itemsize
    group = l2_head_group(config.head_group, n_q * head_dim * (2 * elem + 4), heads, l2_bytes)
    return config if group == config.head_group else dataclasses.replace(config, head_group=group)


def gluon_bwd_config(q: torch.Tensor) -> GluonBwdConfig:
    """The one-pass backward config the gluon path launches for q (B, H, N_Q, d): `gluon_bwd_default` with its head
    group fit to the L2 cache of q's device; one lookup per problem shape."""
    batch, heads, n_q, head_dim = q.shape
    return _gluon_bwd_config(head_dim, q.dtype, n_q, batch * heads, q.device)


@functools.lru_cache(maxsize=64)
def _gluon_bwd_config(head_dim: int, dtype: torch.dtype, n_q: int, heads: int,
                      device: torch.device) -> GluonBwdConfig:
    return gluon_bwd_default(head_dim, dtype, n_q, heads, l2_cache_bytes(device), device_name(device))


def l2_head_group(head_group: int, head_bytes: int, heads: int | None, l2_bytes: int | None) -> int:
    """`head_group` (0: all `heads`) lowered to the heads whose re-read rows fit their share of the L2 cache
    (L2_SHARE) together, `head_bytes` a head (what every program of the head streams again: K and V in the forward;
    Q, dO and the fp32 dQ in the one-pass backward). Unchanged without `l2_bytes` or where the group fits."""
    if l2_bytes is None or l2_bytes <= 0:
        return head_group
    fit = max(1, l2_bytes // (L2_SHARE * head_bytes))
    current = head_group or heads
    if current is None or current <= fit:
        return head_group
    return fit


# ----------------------------------------------------------------------------------------------------------
# Path rules
# ----------------------------------------------------------------------------------------------------------
def tma_supported(device: torch.device) -> bool:
    """The `auto` rule: a Hopper GPU (sm_90) and a Triton with device-side tensor descriptors (3.4+). The
    interpreter emulates descriptors but keeps the portable path unless asked."""
    if INTERPRET or device.type != "cuda" or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return capability(device)[0] == 9


def gluon_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """'' when the Gluon kernels run on these (B[, H], N, d) tensors, also torch.compile's fake ones, else the rule
    broken (`checks.unsupported_reason`: an sm_90 GPU, Gluon's Hopper API, bf16 / fp16, head dim 64 or 128, TMA-able
    layouts)."""
    if INTERPRET:
        return "the Triton interpreter (TRITON_INTERPRET=1) runs no Gluon kernel"
    return unsupported_reason(as_4d(q), as_4d(k), as_4d(v))


def _work(q: torch.Tensor, k: torch.Tensor) -> int:
    """B * H * n_q * n_k * d: the size of an attention call, in units of half its FLOPs without a mask."""
    return q.numel() * k.shape[-2]


def gluon_bwd_chosen(path: str | None, bwd: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     gluon_reason: str | None = None) -> bool:
    """Whether a backward of dQ and dK/dV on (B[, H], N, d) `q, k, v` runs the Gluon one-pass kernel: `path` gluon,
    or auto at a head dim of GLUON_BWD_AUTO_MIN_WORK from its bound on, where the Gluon kernels run; and `bwd`
    one_pass, or auto outside `torch.use_deterministic_algorithms` (its dQ additions have no fixed order). `bwd`
    two_pass keeps the tl kernels. None reads RAYSYS_FLASH_PATH / RAYSYS_FLASH_BWD. Under torch.compile the choice is
    made when the backward is traced (a later determinism switch needs a recompile)."""
    requested, mode = requested_path(path), requested_bwd(bwd)
    if requested not in ("auto", GLUON) or mode not in ("auto", "one_pass"):
        return False
    if mode == "auto" and torch.are_deterministic_algorithms_enabled():
        return False
    if requested == "auto" and _work(q, k) < GLUON_BWD_AUTO_MIN_WORK.get(q.shape[-1], math.inf):
        return False
    return not (gluon_unsupported_reason(q, k, v) if gluon_reason is None else gluon_reason)


def resolve_path(requested: str | None, *tensors: torch.Tensor, forward: bool = False,
                 gluon_reason: str | None = None) -> str:
    """The path of a call on (q, k, v, ...) `tensors`: `portable` or `tma`, or `gluon` for a `forward` (for the
    backward, `gluon_bwd_chosen` decides first); `requested` None reads RAYSYS_FLASH_PATH (default auto).
    `gluon_reason`: `gluon_unsupported_reason(q, k, v)` when the caller has it already."""
    requested = requested_path(requested)
    if requested not in ("auto", GLUON) + PATHS:
        raise ValueError(f"flash path {requested!r} must be one of auto, {', '.join(PATHS + (GLUON,))}")
    if requested in ("auto", GLUON) and forward:
        reason = gluon_unsupported_reason(*tensors[:3]) if gluon_reason is None else gluon_reason
        if not reason and (requested == GLUON or _work(*tensors[:2]) >= GLUON_AUTO_MIN_WORK[tensors[0].shape[-1]]):
            return GLUON
        if requested == GLUON:
            raise ValueError(f"the gluon path cannot run here: {reason}")
    if requested == GLUON:
        requested = "auto"
    if requested == "portable":
        return "portable"
    device = tensors[0].device
    if requested == "tma":
        if not (INTERPRET or tma_supported(device)):
            raise ValueError(f"the tma path needs an sm_90 GPU and Triton >= 3.4 (or TRITON_INTERPRET=1), not {device}")
        if not tma_layout_ok(*tensors):
            raise ValueError("the tma path needs tensors with unit stride along d and 16-byte aligned strides and "
                             f"offsets, got strides {[tuple(t.stride()) for t in tensors]}")
        return "tma"
    return "tma" if AUTO_TMA and tma_supported(device) and tma_layout_ok(*tensors) else "portable"


def tl_path(*tensors: torch.Tensor) -> str:
    """The tl kernels' `auto` path for these tensors (what runs when a Gluon kernel cannot)."""
    return resolve_path("auto", *tensors)


def resolve_bwd(requested: str | None, path: str) -> str:
    """`two_pass` (dK/dV kernel, then dQ kernel; no atomics) or `one_pass` (dK/dV kernel adds dS K into an fp32
    dQ: 5 matmuls per tile pair instead of 7); `requested` None reads RAYSYS_FLASH_BWD (default auto)."""
    requested = requested_bwd(requested)
    if requested not in ("auto",) + BWD_MODES:
        raise ValueError(f"flash backward {requested!r} must be one of auto, {', '.join(BWD_MODES)}")
    return AUTO_BWD[path] if requested == "auto" else requested


# ----------------------------------------------------------------------------------------------------------
# Gluon builds that failed here, and what ran
# ----------------------------------------------------------------------------------------------------------
_GLUON_BROKEN: dict[tuple, str] = {}
"""(kernel, config, head dim, dtype, is_causal, device) -> why that Gluon kernel does not build here (its build
probe's `BuildFailed`): calls that would run it take the tl kernels instead."""


def gluon_broken(kernel: str, config, q: torch.Tensor, is_causal: bool, exc: Exception | None = None) -> str | None:
    """Why the Gluon `kernel` (fwd | bwd) with `config` does not build for q's head dim, dtype and device (None: it
    builds, or was never tried); with `exc` (its build probe's `BuildFailed`), record it and warn once."""
    key = (kernel, config, q.shape[-1], q.dtype, is_causal, q.device)
    if exc is not None and key not in _GLUON_BROKEN:
        _GLUON_BROKEN[key] = str(exc)
        warnings.warn(f"raysys: the Gluon attention {kernel} ({getattr(config, 'name', config)}, d {q.shape[-1]}, "
                      f"{dtype_name(q.dtype)}) cannot run here ({exc}); the tl kernels run instead",
                      RuntimeWarning, stacklevel=3)
    return _GLUON_BROKEN.get(key)


LAST_PATH: dict[str, str] = {}
"""kernel -> the path its last launch in this process took, and `bwd` -> the last backward's mode (benchmark
rows report them)."""
LAST_CONFIG: dict[str, object] = {}
"""kernel -> the launch config of its last launch in this process (a FlashConfig, or a Gluon config)."""


def last_paths() -> str:
    """The paths of this process's last forward and backward, as benchmark rows record them: `tma, two_pass`, or
    `gluon fwd / portable bwd, two_pass` when the two halves took different ones."""
    mode = LAST_PATH.get("bwd", "?")
    fwd, bwd = LAST_PATH.get("fwd", "?"), LAST_PATH.get("dkdvq" if mode == "one_pass" else "dkdv", "?")
    return _paths_text(fwd, bwd, mode)


def _paths_text(fwd: str, bwd: str, mode: str) -> str:
    return f"{fwd if fwd == bwd else f'{fwd} fwd / {bwd} bwd'}, {mode}"


def planned_paths(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str, is_causal: bool = True) -> str:
    """What `flash_attention` runs (as `last_paths` writes it) for a call of this shape on `device` with the inputs in
    the model's layout ((B, S, H, D) projections viewed as (B, H, S, D)): the dispatch's own rules applied to fake
    tensors (no memory), a Gluon kernel whose build failed here excepted. What the memory model plans for."""
    with FakeTensorMode():
        q = torch.empty((batch, n_q, heads, head_dim), dtype=dtype, device=device).transpose(1, 2)
        k = torch.empty((batch, n_k, heads, head_dim), dtype=dtype, device=device).transpose(1, 2)
    reason = gluon_unsupported_reason(q, k, k)
    fwd = resolve_path(None, q, k, k, forward=True, gluon_reason=reason)
    if fwd == GLUON and gluon_broken("fwd", gluon_fwd_config(q, k), q, is_causal) is not None:
        fwd = tl_path(q, k, k)
    if gluon_bwd_chosen(None, None, q, k, k, reason) and gluon_broken(
            "bwd", gluon_bwd_config(q), q, is_causal) is None:
        return _paths_text(fwd, GLUON, "one_pass")
    path = resolve_path(None, q, k, k)
    return _paths_text(fwd, path, resolve_bwd(None, path))
