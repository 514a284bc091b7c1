"""Parallelism planner: the handout's section 8 (communication accounting of one FFN) as code.

Setting (handout 8.1-8.5): N devices, each sending W bytes/s and computing C FLOP/s; the FFN
y = (f(x W1) * (x W2)) W3 with x: (B, D), W1, W2: (D, D_FF), W3: (D_FF, D), b bytes per element; only matmuls count.
`ring_*_time` are the ring collectives' times; `dp_cost`, `fsdp_cost`, `tp_cost` and `fsdp_tp_cost` each pass's
communication against its compute (exact ring factors; a pass is compute-bound while communication <= compute, the
two overlapping); `max_devices` and `best_fsdp_tp` the largest compute-bound device counts, `fsdp_tp_continuous` the
closed form; `bandwidth_from_results` reads W from the collectives benchmark; `plan_tables` renders the tables
(`python -m raysys plan`, raysys/cli/planning.py). The formulas and their derivation: docs/parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = [
    "FFNProblem", "PassCost", "StrategyCost", "ring_all_gather_time", "ring_reduce_scatter_time",
    "ring_all_reduce_time", "alternate_all_reduce_time", "dp_cost", "fsdp_cost", "tp_cost", "fsdp_tp_cost",
    "max_devices", "best_fsdp_tp", "fsdp_tp_continuous", "bandwidth_from_results", "plan_tables",
    "H200_BF16_FLOPS", "H200_NVLINK_BYTES_PER_S",
]

H200_BF16_FLOPS = 989e12
"""H200 SXM dense BF16 tensor-core peak, FLOP/s (the default C)."""
H200_NVLINK_BYTES_PER_S = 450e9
"""H200 NVLink 4 per direction, bytes/s (the default W when no measured bandwidth is at hand)."""
_TOLERANCE = 1e-9  # relative slack so that communication == compute at an exact boundary counts as compute-bound


# ---------------------------------------------------------------------------------------------- primitives
def _check_collective(size_bytes: float, n: int, bandwidth: float) -> None:
    if size_bytes < 0 or n < 1 or bandwidth <= 0:
        raise ValueError(f"need size_bytes >= 0 ({size_bytes}), n >= 1 ({n}), bandwidth > 0 ({bandwidth})")


def ring_all_gather_time(size_bytes: float, n: int, bandwidth: float) -> float:
    """(N-1)/N * S/W: N-1 steps, each device sending one S/N chunk per step."""
    _check_collective(size_bytes, n, bandwidth)
    return (n - 1) / n * size_bytes / bandwidth


def ring_reduce_scatter_time(size_bytes: float, n: int, bandwidth: float) -> float:
    """(N-1)/N * S/W: like the all-gather, adding partial sums before forwarding."""
    return ring_all_gather_time(size_bytes, n, bandwidth)


def ring_all_reduce_time(size_bytes: float, n: int, bandwidth: float) -> float:
    """2(N-1)/N * S/W: a ring reduce-scatter followed by a ring all-gather."""
    return ring_reduce_scatter_time(size_bytes, n, bandwidth) + ring_all_gather_time(size_bytes, n, bandwidth)


def alternate_all_reduce_time(size_bytes: float, n: int, bandwidth: float) -> float:
    """(N-1) * S/W: N-1 steps in which every device forwards a whole tensor of S bytes (handout 8.1 problem)."""
    _check_collective(size_bytes, n, bandwidth)
    return (n - 1) * size_bytes / bandwidth


# ---------------------------------------------------------------------------------------------- problem
def _check_n(**counts: int) -> None:
    for name, n in counts.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} ({n!r}) must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class FFNProblem:
    """One FFN layer on identical devices (handout section 8)."""

    batch: int
    """B: rows of x (tokens in the global batch)."""
    d_model: int
    """D: model width."""
    d_ff: int
    """D_FF: hidden width."""
    flops: float = H200_BF16_FLOPS
    """C: FLOP/s per device."""
    bandwidth: float = H200_NVLINK_BYTES_PER_S
    """W: egress bytes/s per device."""
    bytes_per_element: float = 2
    """b: bytes per weight / activation / gradient element (2 = fp16/bf16)."""

    def __post_init__(self) -> None:
        _check_n(batch=self.batch, d_model=self.d_model, d_ff=self.d_ff)
        for name in ("flops", "bandwidth", "bytes_per_element"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be positive")

    @property
    def weight_bytes(self) -> float:
        """3bDF: W1, W2 and W3 together."""
        return 3 * self.bytes_per_element * self.d_model * self.d_ff

    @property
    def activation_bytes(self) -> float:
        """bBD: x, y or dx over the whole batch."""
        return self.bytes_per_element * self.batch * self.d_model

    def matmul_flops(self) -> float:
        """2BDF: one of the FFN's matmuls over the whole batch, unsharded."""
        return 2 * self.batch * self.d_model * self.d_ff


@dataclass(frozen=True)
class PassCost:
    """FLOPs and communication seconds of one pass on one device."""

    flops: float
    comm_s: float
    device_flops: float  # C, to turn FLOPs into seconds

    @property
    def compute_s(self) -> float:
        return self.flops / self.device_flops

    @property
    def comm_ratio(self) -> float:
        """Communication / compute time: <= 1 is compute-bound."""
        return self.comm_s / self.compute_s

    @property
    def compute_bound(self) -> bool:
        return self.comm_s <= self.compute_s * (1 + _TOLERANCE)


@dataclass(frozen=True)
class StrategyCost:
    strategy: str
    n_tp: int
    n_fsdp: int
    forward: PassCost
    backward: PassCost

    @property
    def num_devices(self) -> int:
        return self.n_tp * self.n_fsdp


def _strategy(name: str, p: FFNProblem, n_tp: int, n_fsdp: int, fwd_comm_s: float, bwd_comm_s: float
              ) -> StrategyCost:
    """Forward does the 3 matmuls, backward twice as many, both split evenly over the n_tp * n_fsdp devices."""
    n = n_tp * n_fsdp
    return StrategyCost(name, n_tp, n_fsdp, PassCost(3 * p.matmul_flops() / n, fwd_comm_s, p.flops),
                        PassCost(6 * p.matmul_flops() / n, bwd_comm_s, p.flops))


def dp_cost(p: FFNProblem, n_dp: int) -> StrategyCost:
    """Batch sharded n_dp ways; backward all-reduces the three weight gradients."""
    _check_n(n_dp=n_dp)
    return _strategy("DP", p, 1, n_dp, 0.0, ring_all_reduce_time(p.weight_bytes, n_dp, p.bandwidth))


def fsdp_cost(p: FFNProblem, n_fsdp: int) -> StrategyCost:
    """DP compute; weights all-gathered in both passes, gradients reduce-scattered in backward."""
    _check_n(n_fsdp=n_fsdp)
    gather = ring_all_gather_time(p.weight_bytes, n_fsdp, p.bandwidth)
    return _strategy("FSDP", p, 1, n_fsdp, gather, 2 * gather)  # a reduce-scatter takes an all-gather's time


def tp_cost(p: FFNProblem, n_tp: int) -> StrategyCost:
    """W1, W2 column- and W3 row-parallel; forward all-reduces y, backward all-reduces dx (both (B, D))."""
    _check_n(n_tp=n_tp)
    reduce = ring_all_reduce_time(p.activation_bytes, n_tp, p.bandwidth)
    return _strategy("TP", p, n_tp, 1, reduce, reduce)


def fsdp_tp_cost(p: FFNProblem, n_tp: int, n_fsdp: int, *, overlap: bool = True) -> StrategyCost:
    """2D: FSDP collectives on TP-sharded weights, TP all-reduces on FSDP-sharded activations (handout 8.5)."""
    _check_n(n_tp=n_tp, n_fsdp=n_fsdp)
    gather = ring_all_gather_time(p.weight_bytes / n_tp, n_fsdp, p.bandwidth)
    reduce = ring_all_reduce_time(p.activation_bytes / n_fsdp, n_tp, p.bandwidth)
    combine = max if overlap else (lambda a, b: a + b)
    return _strategy("FSDP+TP" + ("" if overlap else " (shared links)"), p, n_tp, n_fsdp, combine(gather, reduce),
                     combine(2 * gather, reduce))  # backward: the all-gather and a reduce-scatter of equal time


# ---------------------------------------------------------------------------------------------- limits
def max_devices(bound: Callable[[int], bool], limit: int = 1 << 24) -> int:
    """Largest n <= limit with bound(n) true, for a predicate true at 1 and monotone (true then false)."""
    if not bound(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and bound(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # bound(lo) true, bound(hi) false (or hi past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if bound(mid) else (lo, mid)
    return lo


def best_fsdp_tp(p: FFNProblem, *, overlap: bool = True, phase: str = "forward",
                 limit: int = 1 << 20) -> StrategyCost | None:
    """The integer (N_TP, N_FSDP) with the most devices whose `phase` stays compute-bound; ties go to the split
    with the smaller communication/compute ratio. None if even one device is communication-bound (never: N=1 has
    no communication)."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase ({phase!r}) must be forward or backward")
    ok = lambda t, f: getattr(fsdp_tp_cost(p, t, f, overlap=overlap), phase).compute_bound
    best: StrategyCost | None = None
    # For fixed N_TP the FSDP-axis condition is monotone in N_FSDP (and vice versa); scan N_TP while feasible.
    for n_tp in range(1, max_devices(lambda t: ok(t, 1), limit) + 1):
        n_fsdp = max_devices(lambda f: ok(n_tp, f), limit)
        cand = fsdp_tp_cost(p, n_tp, n_fsdp, overlap=overlap)
        key = (cand.num_devices, -getattr(cand, phase).comm_ratio)
        if best is None or key > (best.num_devices, -getattr(best, phase).comm_ratio):
            best = cand
    return best


def fsdp_tp_continuous(p: FFNProblem, *, overlap: bool = True) -> dict[str, float]:
    """The handout's closed forms for 8.5 (c)/(d), with (N-1)/N ~ 1 and no integer rounding."""
    b, beta, phi = p.bytes_per_element, p.batch * p.bandwidth / p.flops, p.d_ff * p.bandwidth / p.flops
    n_fsdp, n_tp = 2 * beta / b, 3 * phi / b
    if not overlap:
        n_fsdp, n_tp = n_fsdp / 2, n_tp / 2
    return {"n_fsdp": n_fsdp, "n_tp": n_tp, "n": n_fsdp * n_tp}


# ---------------------------------------------------------------------------------------------- tables
def _markdown(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def plan_tables(p: FFNProblem, devices: list[int]) -> str:
    """Markdown: largest compute-bound device counts per strategy, then comm/compute ratios at `devices`."""
    b, beta, phi = p.bytes_per_element, p.batch * p.bandwidth / p.flops, p.d_ff * p.bandwidth / p.flops
    rows = []
    one_d = [("DP", "backward", dp_cost, "N - 1 <= 2BW/(bC)", 1 + 2 * beta / b),
             ("FSDP", "forward", fsdp_cost, "N - 1 <= 2BW/(bC)", 1 + 2 * beta / b),
             ("FSDP", "backward", fsdp_cost, "N - 1 <= 2BW/(bC)", 1 + 2 * beta / b),
             ("TP", "forward", tp_cost, "N - 1 <= 3 D_FF W/(bC)", 1 + 3 * phi / b),
             ("TP", "backward", tp_cost, "N - 1 <= 6 D_FF W/(bC)", 1 + 6 * phi / b)]
    for name, phase, cost, formula, bound in one_d:
        n = max_devices(lambda k: getattr(cost(p, k), phase).compute_bound)
        rows.append([name, phase, formula, bound, n, "-"])
    for overlap in (True, False):
        cont = fsdp_tp_continuous(p, overlap=overlap)
        best = best_fsdp_tp(p, overlap=overlap)
        formula = ("N <= 6 B D_FF W^2/(b^2 C^2)" if overlap else "N <= 3 B D_FF W^2/(2 b^2 C^2)") + ", (N-1)/N ~ 1"
        rows.append(["FSDP+TP " + ("overlapped" if overlap else "shared links"), "forward", formula, cont["n"],
                     best.num_devices, f"N_TP={best.n_tp}, N_FSDP={best.n_fsdp} (continuous "
                     f"{cont['n_tp']:.3g} x {cont['n_fsdp']:.3g})"])
    limits = _markdown(["strategy", "pass", "compute-bound while", "closed-form bound on N", "largest N (exact ring)",
                        "best split"], rows)

    ratio_rows = []
    for n in devices:
        row = [n]
        for cost in (dp_cost, fsdp_cost, tp_cost):
            c = cost(p, n)
            row.append(f"{c.forward.comm_ratio:.3g} / {c.backward.comm_ratio:.3g}")
        for overlap in (True, False):
            splits = [fsdp_tp_cost(p, t, n // t, overlap=overlap) for t in range(1, n + 1) if n % t == 0]
            c = min(splits, key=lambda s: s.forward.comm_ratio)
            row.append(f"{c.forward.comm_ratio:.3g} ({c.n_tp}x{c.n_fsdp})")
        ratio_rows.append(row)
    ratios = _markdown(["N", "DP fwd / bwd", "FSDP fwd / bwd", "TP fwd / bwd", "FSDP+TP overlapped fwd (TPxFSDP)",
                        "FSDP+TP shared fwd (TPxFSDP)"], ratio_rows)
    head = (f"FFN: B = {p.batch}, D = {p.d_model}, D_FF = {p.d_ff}, C = {p.flops / 1e12:.4g} TFLOP/s, "
            f"W = {p.bandwidth / 1e9:.4g} GB/s, b = {p.bytes_per_element:g} bytes/element")
    return (f"{head}\n\n### Largest device count before communication-bound\n\n{limits}\n\n"
            f"### Communication / compute time (<= 1: compute-bound)\n\n{ratios}\n")


# ---------------------------------------------------------------------------------------------- measured W
def bandwidth_from_results(path: str | Path) -> list[dict]:
    """Bus bandwidth of the largest successful all-reduce per world size in the collectives benchmark's Parquet.

    In the ring model an all-reduce takes 2(N-1)/N S/W and busbw = (S/t) 2(N-1)/N, so busbw is W itself.
    Returns [{world_size, num_bytes, busbw_GBps, source}], best launch per world size; [] if the file is absent.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "allreduce.parquet"
    if not path.exists():
        return []
    import pandas as pd

    df = pd.read_parquet(path)
    need = {"op", "world_size", "busbw_GBps"}
    if not need <= set(df.columns):
        raise ValueError(f"{path} lacks the columns {sorted(need - set(df.columns))} of the collectives benchmark")
    size_col = "num_bytes" if "num_bytes" in df.columns else "size_bytes"
    df = df[(df["op"] == "all_reduce") & df["busbw_GBps"].notna()]
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    out = []
    for ws, part in df.groupby("world_size"):
        largest = part[part[size_col] == part[size_col].max()]
        row = largest.loc[largest["busbw_GBps"].idxmax()]
        launch = " ".join(str(row[c]) for c in ("backend", "launcher", "gpu_visibility") if c in row.index)
        device = f" on {row['device_name']}" if "device_name" in row.index else ""
        if "nccl_env" in row.index and isinstance(row["nccl_env"], str) and row["nccl_env"]:
            device += f" with {row['nccl_env']}"
        out.append({"world_size": int(ws), "num_bytes": int(row[size_col]), "busbw_GBps": float(row["busbw_GBps"]),
                    "source": f"{path.name}: all_reduce {int(row[size_col]):,} B, {int(ws)} ranks {launch}{device}"})
    return out
