"""Launchers of the tl kernels (`kernels.py`) on a resolved path, `portable` or `tma`, with their autotuners.

`launch_fwd` and `launch_bwd` take inputs the caller checked (`interface.flash_attention_fwd` / `_bwd`: shapes,
dtypes, devices) as (B, N, d) or (B, H, N, d) with any strides, and allocate every output in its input's layout
(`empty_like_layout`) through `_empty`. A launch config (`FlashConfig`) given is launched as is; else the
autotuner of the kernel picks one per (dtype, sequence bucket, head dim, causal, precision, path) among
`tuning.valid_configs`, and its choice is launched directly afterwards. While torch.compile traces (fake tensors)
or with autotuning off, the first valid config runs, through `wrap_triton` when traced. Each launch records its path
and config in `dispatch.LAST_PATH` / `LAST_CONFIG`.
"""

from __future__ import annotations

import math

import torch
import triton

from kernels.attention.checks import as_4d, tma_layout_ok, traced
from kernels.attention.dispatch import LAST_CONFIG, LAST_PATH, autotune_enabled
from kernels.attention.triton.kernels import (
    LOG2E,
    _flash_bwd_dkdv_kernel,
    _flash_bwd_dq_kernel,
    _flash_bwd_preprocess_kernel,
    _flash_fwd_kernel,
)
from kernels.attention.triton.tuning import (
    AUTOTUNE_KEY,
    FlashConfig,
    config_list,
    even_heuristics,
    first_valid_config,
    make_pruner,
)
from kernels.device import INTERPRET, device_of, empty_like_layout, num_sms

_KERNELS = {"fwd": _flash_fwd_kernel, "dkdv": _flash_bwd_dkdv_kernel, "dq": _flash_bwd_dq_kernel,
            "dkdvq": _flash_bwd_dkdv_kernel}
# The one-pass kernel adds into DQ: the autotuner zeroes it before each timed run and before the real one.
_TUNED = {name: triton.autotune(configs=[c.to_triton(name) for c in config_list(name)], key=AUTOTUNE_KEY,
                                prune_configs_by={"early_config_prune": make_pruner(name)},
                                reset_to_zero=["DQ"] if name == "dkdvq" else None)(
              triton.heuristics(even_heuristics())(fn))
          for name, fn in _KERNELS.items()}
_CHOSEN: dict[tuple, FlashConfig] = {}
"""(kernel, dtype, *autotune key) -> the config the autotuner chose (`_launch` launches it directly after)."""


# Every buffer the kernels write is allocated here, uninitialised; the tests swap in a NaN-filled allocator with
# guard elements to prove each element is written exactly within bounds.
_empty = torch.empty


def _tma_scratch(size: int, alignment: int, stream):
    """Triton's allocator for the global scratch that device-side tensor descriptors live in."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _grid(num_tiles: int, num_bh: int, persistent: bool, device: torch.device) -> tuple[int, ...]:
    if persistent:
        return (min(num_tiles * num_bh, num_sms(device)),)
    return (num_tiles, num_bh)


def _launch(kernel: str, num_tiles, args: tuple, meta: dict, n_q: int, n_k: int, config: FlashConfig | None,
            path: str) -> None:
    """Launch `kernel` on `path` with `config`, or the autotuned launcher on real tensors.

    `num_tiles(block_m, block_n)` is the tile count along the sequence. While torch.compile traces the custom
    ops (fake tensors) nothing can be benchmarked: the launch config is the one autotuning off would take
    (tuned file first, then the built-in order), and the plain kernel goes through `wrap_triton` so that the
    compiler sees it.
    """
    q = args[0]
    tracing = traced(q)
    num_bh = q.shape[0] * q.shape[1]
    meta = dict(meta, USE_TMA=path == "tma")
    LAST_PATH[kernel] = path
    if meta["USE_TMA"] and not (tracing or INTERPRET):
        triton.set_allocator(_tma_scratch)  # a context variable: set on the thread that launches
    # Autotuning off: the first valid config, launched directly (Triton's autotuner would still time it).
    if config is None and (tracing or not autotune_enabled()):
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
    fn = torch.library.wrap_triton(_KERNELS[kernel]) if tracing else _KERNELS[kernel]
    options = {} if config.maxnreg is None or INTERPRET else {"maxnreg": config.maxnreg}
    fn[_grid(num_tiles(config.block_m, config.block_n), num_bh, config.persistent, q.device)](
        *args, **meta, **config.launch_meta(kernel), EVEN_M=n_q % config.block_m == 0,
        EVEN_N=n_k % config.block_n == 0, num_warps=config.num_warps, num_stages=config.num_stages, **options)


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


def launch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config: FlashConfig | None,
               path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on `path`: (O like q, L fp32 of shape q.shape[:-1]); `config` None: autotuned."""
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    heads, n_q = q4.shape[1], q4.shape[2]
    n_k = k4.shape[2]
    out = empty_like_layout(q, empty=_empty)
    lse = _empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    o4 = as_4d(out)
    args = (q4, k4, v4, o4, lse, *q4.stride(), *k4.stride(), *v4.stride(), *o4.stride(), heads,
            q4.shape[0] * heads, n_q, n_k, LOG2E / math.sqrt(q.shape[-1]), triton.next_power_of_2(max(n_q, n_k)))
    with device_of(q):
        _launch("fwd", lambda bm, bn: triton.cdiv(n_q, bm), args, _launch_meta(q, is_causal), n_q, n_k, config,
                path)
    return out, lse


def launch_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               grad_out: torch.Tensor, is_causal: bool, *, dkdv_config: FlashConfig | None,
               dq_config: FlashConfig | None, compute_dq: bool, compute_dkdv: bool, path: str, one_pass: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward kernels on `path` (D, then dK/dV, then dQ): (dQ, dK, dV) in the inputs' dtypes, None for a
    gradient not asked for. `one_pass` (with both asked for): the `dkdvq` kernel adds each tile's dS K into an fp32
    dQ, by the TMA unit (tma path) or by atomics (portable path), so the order of the additions, hence the last bits
    of dQ, can vary run to run."""
    grad_out = grad_out.to(q.dtype)
    if path == "tma" and not tma_layout_ok(grad_out):  # e.g. the stride-0 dO of `.sum().backward()`
        grad_out = grad_out.contiguous()
    lse = lse.contiguous()
    q4, k4, v4, o4, do4 = (as_4d(t) for t in (q, k, v, out, grad_out))
    batch, heads, n_q, head_dim = q4.shape
    n_k = k4.shape[2]
    meta = _launch_meta(q, is_causal)
    scale = 1.0 / math.sqrt(head_dim)
    bucket = triton.next_power_of_2(max(n_q, n_k))
    dq = dk = dv = None
    with device_of(q):
        delta = _empty(lse.shape, dtype=torch.float32, device=lse.device)
        pre_block = 64
        pre = torch.library.wrap_triton(_flash_bwd_preprocess_kernel) if traced(q) else _flash_bwd_preprocess_kernel
        pre[(triton.cdiv(n_q, pre_block), batch * heads)](
            o4, do4, delta, *o4.stride(), *do4.stride(), heads, n_q,
            HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], BLOCK_M=pre_block, num_warps=4 if not INTERPRET else 1)
        if compute_dkdv:
            dk = empty_like_layout(k, empty=_empty)
            dv = empty_like_layout(v, empty=_empty)
            dk4, dv4 = as_4d(dk), as_4d(dv)
            # one_pass: dQ accumulates in fp32 rows padded to BLOCK_D (16-byte aligned for the TMA unit)
            dq_acc = (torch.zeros((batch * heads, n_q, meta["BLOCK_D"]), dtype=torch.float32, device=q.device)
                      if one_pass else delta)
            args = (q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc, *q4.stride(), *k4.stride(), *v4.stride(),
                    *do4.stride(), *dk4.stride(), *dv4.stride(), heads, batch * heads, n_q, n_k, scale,
                    scale * LOG2E, bucket)
            dq_atomic = (2 if path == "tma" and not INTERPRET else 1) if one_pass else 0
            _launch("dkdvq" if one_pass else "dkdv", lambda bm, bn: triton.cdiv(n_k, bn), args,
                    dict(meta, DQ_ATOMIC=dq_atomic), n_q, n_k, dkdv_config, path)
        if one_pass:
            dq = empty_like_layout(q, empty=_empty)
            as_4d(dq).copy_(dq_acc.view(batch, heads, n_q, -1)[..., :head_dim])
        elif compute_dq:
            dq = empty_like_layout(q, empty=_empty)
            dq4 = as_4d(dq)
            args = (q4, k4, v4, do4, lse, delta, dq4, *q4.stride(), *k4.stride(), *v4.stride(), *do4.stride(),
                    *dq4.stride(), heads, batch * heads, n_q, n_k, scale, scale * LOG2E, bucket)
            _launch("dq", lambda bm, bn: triton.cdiv(n_q, bm), args, meta, n_q, n_k, dq_config, path)
    return dq, dk, dv
