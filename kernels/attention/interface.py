"""FlashAttention-2 in Triton: fused forward (Algorithm 1) and backward (Algorithm 2), two kernel paths.

Computes O = softmax(Q K^T / sqrt(d) + mask) V and the row log-sum-exp L = logsumexp(Q K^T / sqrt(d) + mask)
(natural log), where the causal mask adds -1e6 to the score of key j for query i when j > i
[T. Dao, FlashAttention-2, 2023; CS336 assignment 2, section 4.2].

Shape legend: B batch, H heads (absent for 3-D input), M n_queries, N n_keys, D head dim in [16, 128],
BLOCK_D = next power of two >= D (padded columns are masked). Inputs are (B, M, D) / (B, N, D) or
(B, H, M, D) / (B, H, N, D), any strides, fp32 / fp16 / bf16; causal needs M == N.

Forward: a program keeps one query tile on chip and walks the key tiles once with fp32 running max, denominator
and output; scores in base-2 units (one FMA + exp2 each). Causal: key tiles above the diagonal are skipped, only
the diagonal ones build a mask, and work items are numbered heaviest first. Backward: D = rowsum(O * dO), then
`two_pass` (default: a dK/dV kernel walking query tiles and a dQ kernel walking key tiles, P recomputed in each,
no atomics) or `one_pass` (the dK/dV kernel also adds dS K into an fp32 dQ: 5 matmuls per tile pair instead of
7; slower on the H200, results/flash_bench.parquet, study hopper). Accumulators are fp32; fp32 inputs use exact
fp32 products unless `torch.set_float32_matmul_precision` allows TF32.

Paths (one kernel family, a constexpr apart): `portable` (pointer loads; every GPU and the interpreter) and `tma`
(sm_90 with Triton >= 3.4: device-side tensor descriptors for the Q/K/V/O/dO/dK/dV/dQ tiles, whose edges the TMA
unit clips; optional persistent grid and warp specialisation). On sm_90 there is also `gluon`
(`kernels/flash_attention_gluon*.py`: warp-specialised, FlashAttention-3 style; bf16 / fp16, head dim 64 or 128,
TMA-able layouts): its forward, and its one-pass backward (dQ summed in fp32 by TMA reductions) unless the
backward is asked to be two_pass or deterministic (`torch.use_deterministic_algorithms`), when the tl kernels run
it on the same L. `RAYSYS_FLASH_PATH` / `path=` picks one; `auto` takes the gluon forward where it runs and the
call is large enough to hide its launch (`GLUON_AUTO_MIN_WORK`; and no launch config is given), the gluon
backward on the larger calls at the head dims where it was measured faster (`GLUON_BWD_AUTO_MIN_WORK`), and for the tl kernels
tma on sm_90 when the tuned file's `auto_path` says so (set by the measurement that wrote it), else portable. Launch configs are autotuned per
(sequence bucket, head dim, causal, dtype, path) among `kernels/flash_attention_tuning.py`'s candidates (the tuned
file's entries when it has some);
`RAYSYS_FLASH_AUTOTUNE=0` takes the first valid one. Under `TRITON_INTERPRET=1` (read at import) each kernel has
one small config and CPU tensors are accepted; the interpreter has no bf16.

torch.compile: under tracing `flash_attention` calls the custom op `raysys::flash_attn_fwd` (autograd registered,
backward `raysys::flash_attn_bwd`): `triton_op`s on a GPU, so Inductor launches the kernels itself (with the configs
autotuning off takes), opaque `custom_op`s with fake implementations under the interpreter. Eager calls on real
tensors (`_eager`) skip the ops' dispatch, about 100 us of host time per op and call, which short calls pay in full
(results/runs/flash_host_cost.py): an autograd.Function calls the same launchers, and an autotuned launch config,
once chosen for its key, is launched directly instead of through Triton's autotuner.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

import kernels.attention.gluon.forward as gluon_fwd
import kernels.attention.gluon.backward_two_pass as gluon_bwd
import kernels.attention.gluon.backward as gluon_bwd_onepass
from kernels.device import device_of, empty_like_layout
from kernels.attention.triton.kernels import (
    _flash_bwd_dkdv_kernel,
    _flash_bwd_dq_kernel,
    _flash_bwd_preprocess_kernel,
    _flash_fwd_kernel,
)
from kernels.attention.reference import MASK_VALUE, autocast_inputs, check_attention_inputs, check_backward_inputs
from kernels.attention.triton.tuning import (
    AUTOTUNE_KEY,
    INTERPRET,
    PATHS,
    FlashConfig,
    autotune_enabled,
    config_list,
    even_heuristics,
    first_valid_config,
    make_pruner,
    tuned_auto_path,
)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------
# Autotuning (configs and the pruning predicate live in kernels/flash_attention_tuning.py)
# ----------------------------------------------------------------------------------------------------------
_KERNELS = {"fwd": _flash_fwd_kernel, "dkdv": _flash_bwd_dkdv_kernel, "dq": _flash_bwd_dq_kernel,
            "dkdvq": _flash_bwd_dkdv_kernel}
# The one-pass kernel adds into DQ: the autotuner zeroes it before each timed run and before the real one.
_TUNED = {name: triton.autotune(configs=[c.to_triton(name) for c in config_list(name)], key=AUTOTUNE_KEY,
                                prune_configs_by={"early_config_prune": make_pruner(name)},
                                reset_to_zero=["DQ"] if name == "dkdvq" else None)(
              triton.heuristics(even_heuristics())(fn))
          for name, fn in _KERNELS.items()}
LAST_PATH: dict[str, str] = {}
"""kernel -> the path its last launch in this process took, and `bwd` -> the last backward's mode (benchmark
rows report them)."""
LAST_CONFIG: dict[str, FlashConfig | gluon_fwd.GluonConfig] = {}
"""kernel -> the launch config of its last launch in this process (a GluonConfig for the gluon forward)."""
_CHOSEN: dict[tuple, FlashConfig] = {}
"""(kernel, dtype, *autotune key) -> the config the autotuner chose (`_launch` launches it directly after)."""


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
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty((batch, n_q, heads, head_dim), dtype=dtype, device=device).transpose(1, 2)
        k = torch.empty((batch, n_k, heads, head_dim), dtype=dtype, device=device).transpose(1, 2)
    reason = gluon_unsupported(q, k, k)
    fwd = resolve_path(None, q, k, k, forward=True, gluon_reason=reason)
    if fwd == GLUON and _gluon_broken("fwd", gluon_fwd.problem_config(q, k), q, is_causal) is not None:
        fwd = _tl_path(q, k, k)
    if gluon_bwd_chosen(None, None, q, k, k, reason) and _gluon_broken(
            "bwd", gluon_bwd_onepass.problem_config(q), q, is_causal) is None:
        return _paths_text(fwd, GLUON, "one_pass")
    path = resolve_path(None, q, k, k)
    return _paths_text(fwd, path, resolve_bwd(None, path))


def best_configs() -> dict[str, dict[tuple, FlashConfig]]:
    """What the autotuners picked so far in this process: kernel -> {autotune key: config}."""
    return {name: {key: FlashConfig.from_triton(cfg) for key, cfg in tuner.cache.items()}
            for name, tuner in _TUNED.items()}


def _traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracing stand-in (fake or functional tensor inside torch.compile / export)."""
    return is_fake(t) or isinstance(t, FunctionalTensor)


def _tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator for the global scratch that device-side tensor descriptors live in."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that each walks several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def _grid(num_tiles: int, num_bh: int, persistent: bool, device: torch.device) -> tuple[int, ...]:
    if persistent:
        return (min(num_tiles * num_bh, _num_sms(device)),)
    return (num_tiles, num_bh)


def _launch(kernel: str, num_tiles, args: tuple, meta: dict, n_q: int, n_k: int, config: FlashConfig | None,
            path: str) -> None:
    """Launch `kernel` on `path` with `config`, or the autotuned launcher on real tensors.

    `num_tiles(block_m, block_n)` is the tile count along the sequence. While torch.compile traces the custom
    ops below (fake tensors) nothing can be benchmarked: the launch config is the one autotuning off would take
    (tuned file first, then the built-in order), and the plain kernel goes through `wrap_triton` so that the
    compiler sees it.
    """
    q = args[0]
    traced = _traced(q)
    num_bh = q.shape[0] * q.shape[1]
    meta = dict(meta, USE_TMA=path == "tma")
    LAST_PATH[kernel] = path
    if meta["USE_TMA"] and not (traced or INTERPRET):
        triton.set_allocator(_tma_scratch)  # a context variable: set on the thread that launches
    # Autotuning off: the first valid config, launched directly (Triton's autotuner would still time it).
    if config is None and (traced or not autotune_enabled()):
        config = first_valid_config(kernel, q.dtype, meta["HEAD_DIM"], meta["BLOCK_D"], q.device, path)
    if config is None:
        # The autotuner's key (AUTOTUNE_KEY and the tensors' dtypes, all q's but L's fp32): once it has chosen for
        # a key, later calls launch its choice directly (the same kernel and meta, less host time).
        key = (kernel, q.dtype, triton.next_power_of_2(max(n_q, n_k)), meta["HEAD_DIM"], meta["IS_CAUSAL"],
               meta["INPUT_PRECISION"], meta["USE_TMA"])
        config = _CHOSEN.get(key)
        if config is None:
            tuner = _TUNED[kernel]
            tuner[lambda m: _grid(num_tiles(m["BLOCK_M"], m["BLOCK_N"]), num_bh, m["PERSISTENT"], q.device)](
                *args, **meta)
            LAST_CONFIG[kernel] = _CHOSEN[key] = FlashConfig.from_triton(tuner.best_config)
            return
    LAST_CONFIG[kernel] = config
    config.check(kernel, path)
    fn = torch.library.wrap_triton(_KERNELS[kernel]) if traced else _KERNELS[kernel]
    options = {} if config.maxnreg is None or INTERPRET else {"maxnreg": config.maxnreg}
    fn[_grid(num_tiles(config.block_m, config.block_n), num_bh, config.persistent, q.device)](
        *args, **meta, **config.launch_meta(kernel), EVEN_M=n_q % config.block_m == 0,
        EVEN_N=n_k % config.block_n == 0, num_warps=config.num_warps, num_stages=config.num_stages, **options)


# ----------------------------------------------------------------------------------------------------------
# Path choice and launchers
# ----------------------------------------------------------------------------------------------------------
PATH_ENV = "RAYSYS_FLASH_PATH"
"""auto (default), portable, tma or gluon: the path `flash_attention` and the custom ops take."""
GLUON = "gluon"
"""The Gluon kernels' path: their forward, and their one-pass backward (`gluon_bwd_chosen`), else the tl kernels'
auto path backward."""
GLUON_AUTO_MIN_WORK = {128: 2**36, 64: 2**37}
"""Head dim -> B * H * n_q * n_k * d from which `auto` takes the gluon forward. Its launch costs more host time
than the tl kernels' (host-side TMA descriptors, Gluon's launcher), so short calls stay on the tl kernels. Set from
the hopper shapes: at d 128 it was faster from 4x32x2048x128 (2^36) on (results/runs/flash_bench_hopper_e5db843.parquet);
at d 64 from 8x16x4096x64 (2^37) on once its tile sweep ran on that shape and chose 2x64x128 tiles in groups of 8
heads (results/flash_hopper_notes.md, sections 8 and 9)."""
GLUON_BWD_AUTO_MIN_WORK = {128: 2**36, 64: 2**37}
"""Head dim -> B * H * n_q * n_k * d from which `auto` takes the Gluon one-pass backward (other head dims keep the
tl kernels). d 128: with its key tiles taken a few heads at a time (the tuned file's `head_group`) it beat the tl
backward at every hopper shape, 4x32x2048x128 included (results/flash_hopper_notes.md, section 9). d 64: with each
tile's dQ whole by one group (`dq_whole`) it beat the tl two-pass backward at 8x16x4096x64, where it had lost
before (section 10; the run: results/runs/flash_gluon_bwd_dqw_ebe812e.parquet)."""
AUTO_TMA = tuned_auto_path() == "tma"
"""Whether `auto` takes the tma path where it can (sm_90, Triton with device-side tensor descriptors): the tuned
file's `auto_path`, which the candidates study of sweeps/flash_bench.py sets from its timings of both paths."""
BWD_ENV = "RAYSYS_FLASH_BWD"
"""auto (default), two_pass or one_pass: the backward `flash_attention` and the custom ops take."""
BWD_MODES = ("two_pass", "one_pass")
AUTO_BWD = {"portable": "two_pass", "tma": "two_pass"}
"""What `auto` takes per path: two_pass, which the H200 hopper study measured faster on every shape."""


def tma_supported(device: torch.device) -> bool:
    """The `auto` rule: a Hopper GPU (sm_90) and a Triton with device-side tensor descriptors (3.4+, hence
    3.6 on the GPU host). The interpreter emulates descriptors but keeps the portable path unless asked."""
    if INTERPRET or device.type != "cuda" or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return gluon_fwd.capability(device)[0] == 9


def tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """What TMA needs of each (batch[, heads], seq, d) tensor: unit stride along d, and every other stride
    (of a dimension longer than 1, and the sequence dimension's) and the start a multiple of 16 bytes."""
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or (t.storage_offset() * elem) % 16:
            return False
        if any((stride * elem) % 16 for i, (size, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1]))
               if size > 1 or i == t.dim() - 2):
            return False
        if not _traced(t) and t.data_ptr() % 16:
            return False
    return True


def gluon_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """'' when the Gluon forward runs on these (B[, H], N, d) tensors, also torch.compile's fake ones, else the rule
    broken (`kernels.attention.gluon.forward.unsupported_reason`: an sm_90 GPU, Gluon's Hopper API, bf16 / fp16,
    head dim 64 or 128, TMA-able layouts)."""
    if INTERPRET:
        return "the Triton interpreter (TRITON_INTERPRET=1) runs no Gluon kernel"
    return gluon_fwd.unsupported_reason(_as_4d(q), _as_4d(k), _as_4d(v))


def _work(q: torch.Tensor, k: torch.Tensor) -> int:
    """B * H * n_q * n_k * d: the size of an attention call, in units of half its FLOPs without a mask."""
    return q.numel() * k.shape[-2]


def gluon_bwd_chosen(path: str | None, bwd: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     gluon_reason: str | None = None) -> bool:
    """Whether a backward of dQ and dK/dV on (B[, H], N, d) `q, k, v` runs the Gluon one-pass kernel: `path` gluon,
    or auto at a head dim of GLUON_BWD_AUTO_MIN_WORK from its bound on, where the Gluon
    kernels run; and `bwd` one_pass, or auto outside `torch.use_deterministic_algorithms` (its dQ additions have no
    fixed order). `bwd` two_pass keeps the tl kernels. None reads RAYSYS_FLASH_PATH / RAYSYS_FLASH_BWD. Under
    torch.compile the choice is made when the backward is traced (a later determinism switch needs a recompile)."""
    requested, mode = _requested_path(path), _requested_bwd(bwd)
    if requested not in ("auto", GLUON) or mode not in ("auto", "one_pass"):
        return False
    if mode == "auto" and torch.are_deterministic_algorithms_enabled():
        return False
    if requested == "auto" and _work(q, k) < GLUON_BWD_AUTO_MIN_WORK.get(q.shape[-1], math.inf):
        return False
    return not (gluon_unsupported(q, k, v) if gluon_reason is None else gluon_reason)


def resolve_path(requested: str | None, *tensors: torch.Tensor, forward: bool = False,
                 gluon_reason: str | None = None) -> str:
    """The path of a call on (q, k, v, ...) `tensors`: `portable` or `tma`, or `gluon` for a `forward` (for the
    backward, `gluon_bwd_chosen` decides first); `requested` None reads RAYSYS_FLASH_PATH (default auto).
    `gluon_reason`: `gluon_unsupported(q, k, v)` when the caller has it already (`_validated`)."""
    requested = _requested_path(requested)
    if requested not in ("auto", GLUON) + PATHS:
        raise ValueError(f"flash path {requested!r} must be one of auto, {', '.join(PATHS + (GLUON,))}")
    if requested in ("auto", GLUON) and forward:
        reason = gluon_unsupported(*tensors[:3]) if gluon_reason is None else gluon_reason
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


# Every buffer the kernels write is allocated here, uninitialised; the tests swap in a NaN-filled allocator with
# guard elements to prove each element is written exactly within bounds.
_empty = torch.empty


_VALIDATED: dict[tuple, str] = {}
"""The geometry of an eager call's tensors (`_validated`) -> `gluon_unsupported`'s answer, for calls whose checks
passed."""


def _validated(check, is_causal, *tensors: torch.Tensor) -> str:
    """Run `check()` (which raises on bad input) and return `gluon_unsupported(q, k, v)` of `tensors` (q, k, v, ...),
    once per geometry: both read only the tensors' shapes, strides, dtypes, devices and pointer alignment, and
    is_causal, so a later eager call of the same geometry skips them (host time on every call:
    results/runs/flash_host_cost.py --pieces). Anything else (not plain tensors, a non-bool is_causal, tracing) is
    checked every time."""
    if type(is_causal) is not bool or not all(type(t) in _PLAIN for t in tensors) or not _eager(tensors[0]):
        check()
        return gluon_unsupported(*tensors[:3])
    key = (is_causal, *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors])
    reason = _VALIDATED.get(key)
    if reason is None:
        check()
        reason = gluon_unsupported(*tensors[:3])
        if len(_VALIDATED) >= 4096:
            _VALIDATED.clear()
        _VALIDATED[key] = reason
    return reason


def _check_device(q: torch.Tensor) -> None:
    if q.device.type == "cuda":
        return
    if not INTERPRET:
        raise ValueError(f"tensors on {q.device} need a CUDA device, or TRITON_INTERPRET=1 set before "
                         "kernels.attention.interface is imported (CPU interpreter)")
    if q.dtype == torch.bfloat16:
        raise ValueError("dtype torch.bfloat16 is not supported by the Triton CPU interpreter (NumPy has no "
                         "bfloat16); use float16 or float32 under TRITON_INTERPRET=1")


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit inputs


def _launch_meta(q: torch.Tensor, is_causal: bool) -> dict:
    """Constexprs shared by the kernels: the head dim padded to a power of two, masks, dot precision."""
    head_dim = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, IS_CAUSAL=is_causal, EVEN_D=head_dim == block_d,
                INPUT_PRECISION=_input_precision(q.dtype))


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        config: FlashConfig | None = None, path: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: (O like q, L fp32 of shape q.shape[:-1]). `config` (a tl launch config) skips
    autotuning; `path` (auto, portable, tma, gluon; None reads RAYSYS_FLASH_PATH) picks the kernel variant."""
    reason = _validated(lambda: (check_attention_inputs(q, k, v, is_causal), _check_device(q)), is_causal, q, k, v)
    requested = _requested_path(path)
    if config is not None and requested == GLUON:
        raise ValueError("a FlashConfig is a launch config of the tl kernels, not of the gluon path")
    path = resolve_path(requested, q, k, v, forward=config is None, gluon_reason=reason)  # a config is a tl one
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    if path == GLUON:
        out, lse = (gluon_attn_fwd_op(q4, k4, v4, is_causal) if _traced(q4) else
                    _gluon_fwd(q4, k4, v4, is_causal, checked=True, strict=requested == GLUON))
        return (out, lse) if q.dim() == 4 else (out.view(q.shape), lse.view(q.shape[:-1]))
    heads, n_q = q4.shape[1], q4.shape[2]
    n_k = k4.shape[2]
    out = empty_like_layout(q, empty=_empty)
    lse = _empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    o4 = _as_4d(out)
    args = (q4, k4, v4, o4, lse, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4), heads,
            q4.shape[0] * heads, n_q, n_k, LOG2E / math.sqrt(q.shape[-1]), triton.next_power_of_2(max(n_q, n_k)))
    with device_of(q):
        _launch("fwd", lambda bm, bn: triton.cdiv(n_q, bm), args, _launch_meta(q, is_causal), n_q, n_k, config,
                path)
    return out, lse


def flash_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor, is_causal: bool = False, *, dkdv_config: FlashConfig | None = None,
                        dq_config: FlashConfig | None = None, compute_dq: bool = True, compute_dkdv: bool = True,
                        path: str | None = None, bwd: str | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the backward kernels (D, then dK/dV, then dQ): returns (dQ, dK, dV) in the inputs' dtypes.

    `bwd` (auto, two_pass, one_pass; None reads RAYSYS_FLASH_BWD): one_pass runs the `dkdvq` kernel (with
    `dkdv_config`) when both dQ and dK/dV are wanted, its dQ summed in fp32 by the TMA unit (tma path) or by
    atomics (portable path), so the order of the additions, hence the last bits of dQ, can vary run to run."""
    def check() -> None:
        check_attention_inputs(q, k, v, is_causal)
        check_backward_inputs(q, out, lse, grad_out)
        _check_device(q)

    reason = _validated(check, is_causal, q, k, v, out, lse, grad_out)
    resolve_bwd(bwd, "portable")  # a bad request raises here, whichever kernels would run
    if compute_dq and compute_dkdv and gluon_bwd_chosen(path, bwd, q, k, v, reason):
        LAST_PATH["bwd"] = "one_pass"
        args = (*(_as_4d(t) for t in (q, k, v, out)), lse.reshape(_as_4d(q).shape[:-1]),
                _as_4d(grad_out if grad_out.dtype == q.dtype else grad_out.to(q.dtype)), is_causal)
        dq, dk, dv = (gluon_attn_bwd_op(*args) if _traced(q) else
                      _gluon_bwd(*args, checked=True, strict=_requested_path(path) == GLUON))
        return (dq, dk, dv) if q.dim() == 4 else (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape))
    path = resolve_path(path, q, k, v)
    one_pass = compute_dq and compute_dkdv and resolve_bwd(bwd, path) == "one_pass"
    LAST_PATH["bwd"] = "one_pass" if one_pass else "two_pass"
    grad_out = grad_out.to(q.dtype)
    if path == "tma" and not tma_layout_ok(grad_out):  # e.g. the stride-0 dO of `.sum().backward()`
        grad_out = grad_out.contiguous()
    lse = lse.contiguous()
    q4, k4, v4, o4, do4 = (_as_4d(t) for t in (q, k, v, out, grad_out))
    batch, heads, n_q, head_dim = q4.shape
    n_k = k4.shape[2]
    meta = _launch_meta(q, is_causal)
    scale = 1.0 / math.sqrt(head_dim)
    bucket = triton.next_power_of_2(max(n_q, n_k))
    dq = dk = dv = None
    with device_of(q):
        delta = _empty(lse.shape, dtype=torch.float32, device=lse.device)
        pre_block = 64
        pre = torch.library.wrap_triton(_flash_bwd_preprocess_kernel) if _traced(q) else _flash_bwd_preprocess_kernel
        pre[(triton.cdiv(n_q, pre_block), batch * heads)](
            o4, do4, delta, *_strides(o4), *_strides(do4), heads, n_q,
            HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], BLOCK_M=pre_block, num_warps=4 if not INTERPRET else 1)
        if compute_dkdv:
            dk = empty_like_layout(k, empty=_empty)
            dv = empty_like_layout(v, empty=_empty)
            dk4, dv4 = _as_4d(dk), _as_4d(dv)
            # one_pass: dQ accumulates in fp32 rows padded to BLOCK_D (16-byte aligned for the TMA unit)
            dq_acc = (torch.zeros((batch * heads, n_q, meta["BLOCK_D"]), dtype=torch.float32, device=q.device)
                      if one_pass else delta)
            args = (q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc, *_strides(q4), *_strides(k4), *_strides(v4),
                    *_strides(do4), *_strides(dk4), *_strides(dv4), heads, batch * heads, n_q, n_k, scale,
                    scale * LOG2E, bucket)
            dq_atomic = (2 if path == "tma" and not INTERPRET else 1) if one_pass else 0
            _launch("dkdvq" if one_pass else "dkdv", lambda bm, bn: triton.cdiv(n_k, bn), args,
                    dict(meta, DQ_ATOMIC=dq_atomic), n_q, n_k, dkdv_config, path)
        if one_pass:
            dq = empty_like_layout(q, empty=_empty)
            _as_4d(dq).copy_(dq_acc.view(batch, heads, n_q, -1)[..., :head_dim])
        elif compute_dq:
            dq = empty_like_layout(q, empty=_empty)
            dq4 = _as_4d(dq)
            args = (q4, k4, v4, do4, lse, delta, dq4, *_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4),
                    *_strides(dq4), heads, batch * heads, n_q, n_k, scale, scale * LOG2E, bucket)
            _launch("dq", lambda bm, bn: triton.cdiv(n_q, bm), args, meta, n_q, n_k, dq_config, path)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# Custom ops (what torch.compile sees), autograd, public API
# ----------------------------------------------------------------------------------------------------------
# On a GPU the ops are `triton_op`s: the compiler traces their bodies (fake tensors, `wrap_triton` launches) and
# Inductor calls the Triton kernels itself. The interpreter's kernels cannot be traced, so under
# TRITON_INTERPRET=1 the same functions become opaque `custom_op`s with fake implementations.
def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, path: str, bwd: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_fwd(q, k, v, is_causal, path=path)  # `bwd` is for the backward (setup_context)


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              grad_out: torch.Tensor, is_causal: bool, compute_dq: bool, compute_dkdv: bool, path: str, bwd: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV); a gradient not asked for is an empty tensor (custom ops return no None)."""
    dq, dk, dv = flash_attention_bwd(q, k, v, out, lse, grad_out, is_causal, compute_dq=compute_dq,
                                     compute_dkdv=compute_dkdv, path=path, bwd=bwd)
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            v.new_empty(0) if dv is None else dv)


# The fakes allocate like the launchers: O and the gradients in their inputs' layout (`empty_like_layout`), L
# contiguous.
def _fwd_fake(q, k, v, is_causal, path, bwd):
    return empty_like_layout(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _bwd_fake(q, k, v, out, lse, grad_out, is_causal, compute_dq, compute_dkdv, path, bwd):
    return (empty_like_layout(q) if compute_dq else q.new_empty(0),
            empty_like_layout(k) if compute_dkdv else k.new_empty(0),
            empty_like_layout(v) if compute_dkdv else v.new_empty(0))


def _define_op(name: str, impl, fake):
    if INTERPRET:
        op = torch.library.custom_op(f"raysys::{name}", impl, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(f"raysys::{name}", impl, mutates_args=())


_GLUON_BROKEN: dict[tuple, str] = {}
"""(kernel, config, head dim, dtype, is_causal, device) -> why that Gluon kernel does not build here (its build probe,
`kernels.attention.gluon.forward.build`): calls that would run it take the tl kernels instead."""


def _gluon_broken(kernel: str, config, q: torch.Tensor, is_causal: bool, exc: Exception | None = None) -> str | None:
    """Why the Gluon `kernel` (fwd | bwd) with `config` does not build for q's head dim, dtype and device (None: it
    builds, or was never tried); with `exc` (its build probe's `BuildFailed`), record it and warn once."""
    key = (kernel, config, q.shape[-1], q.dtype, is_causal, q.device)
    if exc is not None and key not in _GLUON_BROKEN:
        _GLUON_BROKEN[key] = str(exc)
        warnings.warn(f"raysys: the Gluon attention {kernel} ({getattr(config, 'name', config)}, d {q.shape[-1]}, "
                      f"{str(q.dtype).removeprefix('torch.')}) cannot run here ({exc}); the tl kernels run instead",
                      RuntimeWarning, stacklevel=3)
    return _GLUON_BROKEN.get(key)


def _tl_path(*tensors: torch.Tensor) -> str:
    """The tl kernels' `auto` path for these tensors (what runs when a Gluon kernel cannot)."""
    return resolve_path("auto", *tensors)


def _gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, checked: bool = False,
               strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gluon forward of 4-D inputs; `checked`: `gluon_unsupported` accepted them already (its host time once).
    Where the kernel does not build, the tl forward runs (with one warning), or with `strict` (the gluon path asked
    for by name) a ValueError says why."""
    config = gluon_fwd.problem_config(q, k)
    broken = _gluon_broken("fwd", config, q, is_causal)
    if broken is None:
        try:
            LAST_PATH["fwd"], LAST_CONFIG["fwd"] = GLUON, config
            return (gluon_fwd.launch_fwd if checked else gluon_fwd.gluon_attention_fwd)(q, k, v, is_causal, config)
        except gluon_fwd.BuildFailed as exc:
            broken = _gluon_broken("fwd", config, q, is_causal, exc)
    if strict:
        raise ValueError(f"the gluon path cannot run here: {broken}")
    return flash_attention_fwd(q, k, v, is_causal, path=_tl_path(q, k, v))


def _gluon_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               grad_out: torch.Tensor, is_causal: bool, checked: bool = False, strict: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of 4-D inputs by the Gluon one-pass backward; `checked`: as `_gluon_fwd`'s (and the shapes of
    out, lse and grad_out too). Where the kernel does not build, the tl two-pass backward runs (one warning), or with
    `strict` a ValueError says why."""
    config = gluon_bwd_onepass.problem_config(q)
    broken = _gluon_broken("bwd", config, q, is_causal)
    if broken is None:
        try:
            LAST_PATH["dkdvq"], LAST_CONFIG["dkdvq"] = GLUON, config
            if checked:
                return gluon_bwd.launch_bwd(q, k, v, out, lse, grad_out, is_causal, config)
            return gluon_bwd.gluon_attention_bwd(q, k, v, out, lse, grad_out, is_causal, config, mode="one_pass")
        except gluon_fwd.BuildFailed as exc:
            broken = _gluon_broken("bwd", config, q, is_causal, exc)
    if strict:
        raise ValueError(f"the gluon path cannot run here: {broken}")
    return flash_attention_bwd(q, k, v, out, lse, grad_out, is_causal, path=_tl_path(q, k, v), bwd="two_pass")


# The Gluon kernels are opaque ops while traced (Inductor calls them; it cannot trace Gluon launches as it does tl
# ones), so the triton_ops that call them stay traceable; eager calls skip the ops (and the checks done before).
@torch.library.custom_op("raysys::gluon_attn_fwd", mutates_args=())
def gluon_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return _gluon_fwd(q, k, v, is_causal)


@gluon_attn_fwd_op.register_fake
def _gluon_fwd_fake(q, k, v, is_causal):
    return empty_like_layout(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("raysys::gluon_attn_bwd", mutates_args=())
def gluon_attn_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      grad_out: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gluon_bwd(q, k, v, out, lse, grad_out, is_causal)


@gluon_attn_bwd_op.register_fake
def _gluon_bwd_fake(q, k, v, out, lse, grad_out, is_causal):
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


flash_attn_fwd_op = _define_op("flash_attn_fwd", _fwd_impl, _fwd_fake)
flash_attn_bwd_op = _define_op("flash_attn_bwd", _bwd_impl, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, path, bwd = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.path, ctx.bwd = is_causal, path, bwd
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    dq, dk, dv = flash_attn_bwd_op(q, k, v, out, lse, grad_out, ctx.is_causal, need_q, need_k or need_v, ctx.path,
                                   ctx.bwd)
    return dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None, None


flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _eager(q: torch.Tensor) -> bool:
    """Whether a call on `q` runs the launchers straight from Python rather than through the custom ops: a real
    tensor (not torch.compile's or export's stand-in, not on the meta device) outside tracing and functorch
    transforms. The ops' dispatch costs about 100 us of host time per call (results/runs/flash_host_cost.py)."""
    return (type(q) in _PLAIN and q.device.type != "meta" and not torch.compiler.is_compiling()
            and torch._C._functorch.peek_interpreter_stack() is None)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with Triton forward and backward (the course's interface); saves Q, K, V, O and L only.
    `path` / `bwd` None read RAYSYS_FLASH_PATH / RAYSYS_FLASH_BWD. Eager calls (`_eager`) run the launchers
    directly, traced ones the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, path=None, bwd=None):
        ctx.path, ctx.bwd = _requested_path(path), _requested_bwd(bwd)
        out, lse = (_fwd_impl if _eager(q) else flash_attn_fwd_op)(q, k, v, is_causal, ctx.path, ctx.bwd)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = (_bwd_impl if _eager(q) else flash_attn_bwd_op)(
            q, k, v, out, lse, grad_out, ctx.is_causal, need_q, need_k or need_v, ctx.path, ctx.bwd)
        return dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None, None


def _requested_path(path: str | None) -> str:
    return path or os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"


def _requested_bwd(bwd: str | None) -> str:
    return bwd or os.environ.get(BWD_ENV, "auto").strip().lower() or "auto"


def resolve_bwd(requested: str | None, path: str) -> str:
    """`two_pass` (dK/dV kernel, then dQ kernel; no atomics) or `one_pass` (dK/dV kernel adds dS K into an fp32
    dQ: 5 matmuls per tile pair instead of 7); `requested` None reads RAYSYS_FLASH_BWD (default auto)."""
    requested = _requested_bwd(requested)
    if requested not in ("auto",) + BWD_MODES:
        raise ValueError(f"flash backward {requested!r} must be one of auto, {', '.join(BWD_MODES)}")
    return AUTO_BWD[path] if requested == "auto" else requested


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    path: str | None = None, bwd: str | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V with the Triton kernels (differentiable, torch.compile-able).
    `path`: auto, portable, tma or gluon (None reads RAYSYS_FLASH_PATH); the backward takes the same
    (`gluon_bwd_chosen` says when the Gluon one-pass backward runs). `bwd`: auto, two_pass or one_pass (None reads
    RAYSYS_FLASH_BWD)."""
    if _eager(q):  # the launchers check the inputs
        return FlashAttentionTriton.apply(q, k, v, is_causal, path, bwd)
    check_attention_inputs(q, k, v, is_causal)
    return flash_attn_fwd_op(q, k, v, is_causal, _requested_path(path), _requested_bwd(bwd))[0]


def attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Model backend `flash_triton`: (batch, heads, seq, d_head) in and out; follows autocast like SDPA."""
    return flash_attention(*autocast_inputs(q, k, v), is_causal)


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                              return_lse: bool = False):
    """Plain-torch attention (eqs. 4-6 and 12) in q's dtype: the test oracle (in fp64) and the naive baseline.

    Masked scores are replaced by -1e6, as in the course's reference, so L matches the kernels' L.
    Returns O, or (O, L) with `return_lse=True`.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, MASK_VALUE)
    out = torch.softmax(scores, dim=-1) @ v
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out


def flash_attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, is_causal: bool,
                          mode: str = "fwd") -> float:
    """Matmul FLOPs of attention: 2 matmuls forward (QK^T, PV) and 5 backward (S recompute, dV, dP, dQ, dK).

    Causal counts only the unmasked (query, key) pairs, n (n + 1) / 2 per head. `mode` is fwd, bwd or fwd_bwd.
    """
    if mode not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"mode {mode!r} must be one of fwd, bwd, fwd_bwd")
    if is_causal:
        pairs = sum(min(i + 1, n_k) for i in range(n_q)) if n_q != n_k else n_q * (n_q + 1) // 2
    else:
        pairs = n_q * n_k
    per_matmul = 2.0 * batch * heads * pairs * d
    return per_matmul * {"fwd": 2, "bwd": 5, "fwd_bwd": 7}[mode]
