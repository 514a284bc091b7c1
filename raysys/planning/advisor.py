"""Activation-checkpointing advisor: the cheapest per-layer recompute plan that fits a memory budget.

`advise(config, batch_size, gpu_memory_bytes, dtype, ...)` scores per-layer plans (blocks full, offload, ffn,
selective or kept) with `raysys.planning.recompute_model` and returns the `Plan` with the least predicted overhead
whose predicted peak fits (nested checkpointing when no per-layer plan does). `python -m raysys advise` is the command
(`raysys.cli.planning`); docs/raysys.md has the search in full.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from parallel.checkpointing import PerLayer, Policy, parse_policy
from raysys.model.config import ModelConfig
from raysys.planning.recompute_model import (PRECISIONS, GiB, PeakEstimate, Workload, block_flops, fmt_bytes,
                                             predict_peak, saved_per_block, static_bytes, step_flops)

KINDS = ("none", "selective", "ffn", "full", "offload")
DEFAULT_TFLOPS = {"fp32": 50.0, "bf16": 400.0, "fp16": 400.0}
"""Achieved matmul TFLOP/s assumed when none is given (H100/H200 class; fp32 without TF32)."""
CONTEXT_RESERVE_BYTES = GiB // 2
"""Device memory the CUDA context and kernels' code take outside the caching allocator."""


@dataclass(frozen=True)
class Plan:
    """The advisor's answer: one policy per block, its predicted peak and overhead, and why."""

    workload: Workload
    layers: tuple[str, ...]
    """Per-block kind: none | selective | ffn | full | offload, or nested for every block."""
    fits: bool
    predicted_peak_bytes: int
    usable_bytes: int
    overhead: float
    """Predicted extra step time over no checkpointing, as a fraction."""
    recompute_flops: int
    step_flops: int
    where: str
    """The moment of the step where the predicted peak happens."""
    reason: str

    @property
    def policy(self) -> Policy:
        """The plan as a `parallel.checkpointing` policy, ready for `apply_activation_checkpointing`."""
        return policy_for(self.layers)

    @property
    def spec(self) -> str:
        """`parallel.checkpointing.parse_policy` form (`full*8+none*24`)."""
        return self.policy.spec

    def as_dict(self) -> dict:
        w, c = self.workload, self.workload.config
        return {"size": c.name, "num_layers": c.num_layers, "batch_size": w.batch_size,
                "seq_len": w.S, "precision": w.precision, "param_dtype": w.param_dtype, "loss": w.loss,
                "compiled": w.compiled, "lean": w.lean, "optimizer": w.optimizer,
                "optimizer_in_backward": w.optimizer_in_backward,
                "shards": w.shards, "attention": c.attention, "attention_kernels": w.attention_kernels,
                "policy": self.spec, "layers": list(self.layers), "fits": self.fits,
                "predicted_peak_bytes": self.predicted_peak_bytes, "usable_bytes": self.usable_bytes,
                "overhead": self.overhead, "recompute_flops": self.recompute_flops, "step_flops": self.step_flops,
                "peak_at": self.where, "reason": self.reason}

    def format(self) -> str:
        w, c = self.workload, self.workload.config
        n = len(self.layers)
        starts = [i for i in range(n) if i == 0 or self.layers[i] != self.layers[i - 1]]
        state = (f"{w.param_dtype} weights" + (f" sharded over {w.shards} ranks" if w.shards > 1 else "")
                 + (", autocast" if w.amp else ""))
        lines = [f"{c.name} ({c.num_layers} layers, d_model {c.d_model}), batch {w.batch_size} x {w.S} tokens, "
                 f"{w.precision} compute, {state}, attention {c.attention}, {w.loss} loss, {w.optimizer} AdamW"
                 + (" in backward" if w.optimizer_in_backward else "")
                 + (", lean compiled blocks" if w.lean else ", compiled pieces" if w.compiled else ""),
                 "per-layer policy:"]
        lines += [f"  blocks {lo:>3}-{hi - 1:<3} {self.layers[lo]}" for lo, hi in zip(starts, starts[1:] + [n])]
        lines += [f"policy spec:     {self.spec}",
                  f"predicted peak:  {fmt_bytes(self.predicted_peak_bytes)} of {fmt_bytes(self.usable_bytes)} usable"
                  f" ({'fits' if self.fits else 'DOES NOT FIT'}; peak at {self.where})",
                  f"overhead:        +{100 * self.overhead:.1f}% step time "
                  f"({self.recompute_flops / 1e12:.2f} of {self.step_flops / 1e12:.2f} TFLOP recomputed)",
                  f"why:             {self.reason}"]
        return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141e9', '512MiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(text))
    if not m:
        raise ValueError(f"memory size {text!r} must look like 80GiB, 80GB or 8.5e10")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in scale:
        raise ValueError(f"memory unit in {text!r} must be one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value * scale[unit])


def policy_for(layers: tuple[str, ...]) -> Policy:
    """Per-block kinds -> policy (a single policy when every block has the same kind)."""
    if len(set(layers)) == 1:
        return parse_policy(layers[0], len(layers))
    return PerLayer(tuple(parse_policy(k, 1) for k in layers))


@dataclass(frozen=True)
class _Cost:
    tflops: float
    pcie_gbps: float

    def seconds(self, flops: float) -> float:
        return flops / (self.tflops * 1e12)


@functools.lru_cache(maxsize=None)
def _score(w: Workload, layers: tuple[str, ...], cost: _Cost) -> tuple[float, PeakEstimate, dict]:
    regions = policy_for(layers).regions(w.config.num_layers)
    peak = predict_peak(w, regions)
    flops = step_flops(w, regions)
    base_s = cost.seconds(flops["forward"] + flops["backward"])
    extra_s = cost.seconds(flops["recompute"])
    if "offload" in layers:
        extra_s += _offload_seconds(w, layers, cost)
    return extra_s / base_s, peak, flops


def _offload_seconds(w: Workload, layers: tuple[str, ...], cost: _Cost) -> float:
    """Step time the host link adds (`parallel.checkpointing.OffloadStore`). Device-to-host copies queue on one
    side stream from the first offloaded block's forward on and must be done when backward starts (what is still
    queued then is counted as a stall); in backward each offloaded block is copied back while the block after it
    runs its backward (the last offloaded block never left the device), stalling when a copy outlasts it."""
    bf = block_flops(w)
    fwd_s = cost.seconds(bf["linear"] + bf["core"])
    bwd_s = cost.seconds(2 * bf["linear"] + (2.5 if w.fused else 2.0) * bf["core"])
    transfer_s = saved_per_block(w, "none") / (cost.pcie_gbps * 1e9)
    n_off = layers.count("offload")
    forward_after = (len(layers) - layers.index("offload")) * fwd_s
    return max(0.0, n_off * transfer_s - forward_after) + (n_off - 1) * max(0.0, transfer_s - bwd_s)


def advise(config: ModelConfig, batch_size: int, gpu_memory_bytes: int, dtype: str = "fp32", *,
           seq_len: int | None = None, attention: str | None = None, tflops: float | None = None,
           pcie_gbps: float = 25.0, margin: float = 0.05, kinds: tuple[str, ...] = KINDS,
           host_memory_bytes: int | None = None, param_dtype: str = "fp32", loss: str = "materialized",
           compiled: bool = False, optimizer: str = "reference", shards: int = 1,
           device_type: str = "cuda", optimizer_in_backward: bool = False, lean: bool = False,
           attention_kernels: str = "") -> Plan:
    """The per-layer plan with the least predicted overhead whose predicted peak fits
    `(gpu_memory_bytes - CUDA context) * (1 - margin)` (and whose offloaded bytes fit `host_memory_bytes`).
    `param_dtype`, `loss`, `compiled`, `lean`, `optimizer`, `shards`, `device_type`, `optimizer_in_backward`,
    `attention_kernels`: see `raysys.planning.recompute_model.Workload`."""
    if attention is not None:
        config = config.replace(attention=attention)
    if gpu_memory_bytes <= CONTEXT_RESERVE_BYTES:
        raise ValueError(f"gpu_memory_bytes ({gpu_memory_bytes}) must exceed the {CONTEXT_RESERVE_BYTES} bytes "
                         f"the CUDA context takes")
    if not 0 <= margin < 1:
        raise ValueError(f"margin ({margin}) must lie in [0, 1)")
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype {dtype!r} must be one of {PRECISIONS}")
    unknown = set(kinds) - set(KINDS)
    if unknown or "none" not in kinds:
        raise ValueError(f"kinds {kinds} must be a subset of {KINDS} containing 'none'")
    if pcie_gbps <= 0 or (tflops is not None and tflops <= 0):
        raise ValueError(f"pcie_gbps ({pcie_gbps}) and tflops ({tflops}) must be positive")
    w = Workload(config=config, batch_size=batch_size, seq_len=seq_len, precision=dtype, device_type=device_type,
                 param_dtype=param_dtype, loss=loss, compiled=compiled, lean=lean, optimizer=optimizer,
                 shards=shards, optimizer_in_backward=optimizer_in_backward, attention_kernels=attention_kernels)
    cost = _Cost(tflops or DEFAULT_TFLOPS[dtype], pcie_gbps)
    usable = int((gpu_memory_bytes - CONTEXT_RESERVE_BYTES) * (1 - margin))
    n = config.num_layers
    kinds = tuple(k for k in kinds if not (k == "selective" and w.fused))  # a no-op with fused attention

    # Overhead is additive per converted block, so for each (n_full, n_offload) only the fewest selective
    # blocks that fit matter: peak memory falls as blocks turn selective, so bisect on n_selective.
    # Offload is skipped when a full block costs less time than an offloaded one (it saves as much memory).
    one = {k: _score(w, (k,) * n, cost)[0] / n for k in kinds}
    offload_useful = "offload" in kinds and ("full" not in kinds or one["offload"] < one["full"])
    candidates: dict[tuple[str, ...], tuple] = {}

    def evaluate(counts: dict[str, int]) -> bool:
        fit = False
        for order in (("full", "offload", "ffn", "selective", "none"), ("none", "selective", "ffn", "offload", "full")):
            layers = tuple(k for k in order for _ in range(counts[k]))
            if layers not in candidates:
                overhead, peak, flops = _score(w, layers, cost)
                candidates[layers] = (peak.peak_bytes <= usable, overhead, peak.peak_bytes, layers, peak, flops)
            fit |= candidates[layers][0]
        return fit

    def boundary(make, lo: int, hi: int) -> None:
        """Score make(lo) and make(hi) and, where one fits and the other does not, bisect to where fitting starts
        (fitting is monotone along such a line; the cost is linear, so its cheapest fitting point is scored)."""
        fit_lo, fit_hi = evaluate(make(lo)), evaluate(make(hi))
        while fit_lo != fit_hi and hi - lo > 1:
            mid = (lo + hi) // 2
            if evaluate(make(mid)) == fit_lo:
                lo = mid
            else:
                hi = mid

    max_off = n if host_memory_bytes is None else min(n, host_memory_bytes // max(saved_per_block(w, "none"), 1))
    cheap = [k for k in ("ffn", "selective") if k in kinds]
    for n_full in range(n + 1) if "full" in kinds else (0,):
        for n_off in range(min(n - n_full, max_off) + 1) if offload_useful else (0,):
            rest = n - n_full - n_off
            fixed = {"full": n_full, "offload": n_off, "ffn": 0, "selective": 0}
            if not cheap:
                evaluate({**fixed, "none": rest})
            for kind in cheap:  # the fewest blocks of one cheap kind that fit, the others kept
                boundary(lambda i: {**fixed, kind: i, "none": rest - i}, 0, rest)
            if len(cheap) == 2:  # both kinds, none kept: costs and savings add up per block, so the cheapest
                # fitting mix uses one kind (above) or both with no block kept (a linear program's vertices)
                boundary(lambda i: {**fixed, "ffn": rest - i, "selective": i, "none": 0}, 0, rest)
    candidates = list(candidates.values())
    fitting = [c for c in candidates if c[0]]
    if fitting:
        # ties: fewer blocks over the host link (pinned memory, copies sharing the link), then the lower peak
        _, overhead, _, layers, peak, flops = min(fitting, key=lambda c: (round(c[1], 6), c[3].count("offload"),
                                                                          c[2]))
        return _plan(w, layers, True, peak, usable, overhead, flops, _why(w, layers, peak, usable, cost))
    nested = ("nested",) * n
    overhead, peak, flops = _score(w, nested, cost)
    smallest = min(candidates, key=lambda c: (c[2], c[1]))
    if peak.peak_bytes <= usable:
        reason = (f"no per-layer plan fits (smallest: {smallest[3][0]} everywhere, {fmt_bytes(smallest[2])}); "
                  f"nested checkpointing keeps one input per recursion level")
        return _plan(w, nested, True, peak, usable, overhead, flops, reason)
    _, overhead, _, layers, peak, flops = smallest
    state = sum(v for k, v in static_bytes(w).items() if k in ("weights", "optimizer")) + w.pb * config.num_params() // shards
    reason = (f"nothing fits: the smallest predicted peak ({fmt_bytes(peak.peak_bytes)}, at {peak.where}) exceeds "
              f"{fmt_bytes(usable)}; {w.param_dtype} weights, gradients and AdamW state alone take "
              f"{fmt_bytes(state)}" + (f" per rank of {shards}" if shards > 1 else "")
              + " - shard them (FSDP / ZeRO), hold them in bf16, fuse the loss or cut the batch")
    return _plan(w, layers, False, peak, usable, overhead, flops, reason)


def _plan(w, layers, fits, peak: PeakEstimate, usable, overhead, flops, reason) -> Plan:
    return Plan(w, tuple(layers), fits, peak.peak_bytes, usable, overhead, flops["recompute"],
                flops["forward"] + flops["backward"] + flops["recompute"], peak.where, reason)


def _why(w: Workload, layers: tuple[str, ...], peak: PeakEstimate, usable: int, cost: _Cost) -> str:
    n = len(layers)
    none_peak = _score(w, ("none",) * n, cost)[1].peak_bytes
    if set(layers) == {"none"}:
        return f"everything fits without recomputation ({fmt_bytes(none_peak)} <= {fmt_bytes(usable)})"
    parts = [f"no checkpointing needs {fmt_bytes(none_peak)} > {fmt_bytes(usable)} usable"]
    per_block = {k: saved_per_block(w, k) for k in ("none", "selective", "ffn", "full")}
    if {"selective", "ffn", "full"} & set(layers):
        selective = ("selective is a no-op with fused attention" if w.fused else
                     f"selective {fmt_bytes(per_block['selective'])} (recomputes the attention core only)")
        parts.append(f"a block keeps {fmt_bytes(per_block['none'])}; {selective}; ffn {fmt_bytes(per_block['ffn'])} "
                     f"(reruns ln2, w1, w3); full {fmt_bytes(per_block['full'])} (reruns the block)")
    if "offload" in layers:
        parts.append(f"offload moves {fmt_bytes(per_block['none'])} per block over {cost.pcie_gbps:g} GB/s, "
                     f"cheaper than rerunning it at {cost.tflops:g} TFLOP/s")
    elif "full" in layers or "ffn" in layers:
        t_copy = per_block["none"] / (cost.pcie_gbps * 1e9)
        parts.append(f"offloading a block would take {1e3 * t_copy:.0f} ms per direction over {cost.pcie_gbps:g} GB/s, "
                     f"more than recomputing it")
    counts = {k: layers.count(k) for k in KINDS if layers.count(k)}
    parts.append("the cheapest mix that fits: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "; ".join(parts)
