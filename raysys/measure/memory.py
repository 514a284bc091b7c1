"""Memory measurement: peak memory, CUDA memory snapshots with offline timelines, saved-tensor accounting.

`SavedTensorAccount` counts the bytes backward keeps alive per module (a `saved_tensors_hooks` pack hook; each
storage once, parameters excluded). `TrialScope` records allocated CUDA memory and live `nn.Parameter`s before a
trial and after it is released, so `*_after - *_before` is what a trial leaked into the next one on the same rank
(bytes are NaN on the CPU; the first scope freezes the objects alive then out of the collector's sight).

    with SavedTensorAccount(model).track() as account:     # read while the graph is alive (before backward)
        loss = forward_loss()
    with TrialScope(device) as scope:                      # what a trial leaves behind
        metrics = run_trial()
    metrics.update(scope.metrics)
"""

from __future__ import annotations

import contextlib
import gc
import math
import pickle
import traceback
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from raysys.measure.device import free_memory

GiB = 1024**3
MiB = 1024**2


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> float:
    """Peak allocated bytes since the last `reset_peak` (NaN on the CPU, which has no allocator statistics)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device))


def peak_above(fn, device: torch.device) -> float:
    """Bytes `fn` allocates at its peak above what was allocated before it (NaN on the CPU)."""
    if device.type != "cuda":
        return float("nan")
    reset_peak(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    return peak_bytes(device) - base


def allocated_bytes(device: torch.device) -> float:
    return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else float("nan")


@contextlib.contextmanager
def record_memory_history(device: torch.device, max_entries: int = 200_000):
    """Record allocator events (CUDA only; a no-op elsewhere)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
    finally:  # dump_snapshot() inside the block stops recording too; stopping twice is harmless
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_snapshot(device: torch.device, path: str | Path) -> Path | None:
    """Write the allocator snapshot pickle (loadable at pytorch.org/memory_viz) and stop recording."""
    if device.type != "cuda":
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    return path


def snapshot_timeline(snapshot_path: str | Path) -> pd.DataFrame:
    """Active allocated bytes after every allocator event of the snapshot's trace (all devices summed)."""
    with open(snapshot_path, "rb") as f:
        snap = pickle.load(f)
    rows, active = [], 0
    for device_trace in snap.get("device_traces", []):
        for i, ev in enumerate(device_trace):
            if ev["action"] == "alloc":
                active += ev["size"]
            elif ev["action"] == "free_completed":
                active -= ev["size"]
            else:
                continue
            rows.append((len(rows), ev["time_us"] if "time_us" in ev else i, active))
    return pd.DataFrame(rows, columns=["event", "time_us", "active_bytes"])


def render_timeline(snapshot_path: str | Path, png_path: str | Path, title: str = "", html: bool = True) -> Path:
    """A PNG of the active-memory timeline; with `html`, also PyTorch's own interactive trace plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_path = Path(png_path)
    df = snapshot_timeline(snapshot_path)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(df["event"], df["active_bytes"] / GiB, lw=1)
    ax.set_xlabel("allocator event")
    ax.set_ylabel("active memory (GiB)")
    ax.set_title(title or Path(snapshot_path).stem)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    if html:
        from torch.cuda import _memory_viz

        with open(snapshot_path, "rb") as f:
            snap = pickle.load(f)
        png_path.with_suffix(".html").write_text(_memory_viz.trace_plot(snap))
    return png_path


@dataclass
class SavedTensorAccount:
    """Bytes saved for backward, attributed to the innermost module running when autograd saved them.

    Read the totals while the graph is alive (before backward): a tensor that was packed but whose graph node
    has since died (a discarded branch) costs nothing and is not counted, and its address may be reused.
    """

    model: nn.Module
    _packed: list = field(default_factory=list)

    def __post_init__(self):
        self._stack: list[str] = []
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._param_storages:
            where = self._stack[-1] if self._stack else "<root>"
            self._packed.append((where, tuple(t.shape), str(t.dtype).replace("torch.", ""), weakref.ref(t)))
        return t

    def _live(self) -> list[tuple[str, tuple, str, int]]:
        """(module, shape, dtype, bytes) per live saved storage, each storage once (first saver wins)."""
        seen, out = set(), []
        for where, shape, dtype, ref in self._packed:
            t = ref()
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out.append((where, shape, dtype, storage.nbytes()))
        return out

    @contextlib.contextmanager
    def track(self):
        def enter(name):
            return lambda module, args: self._stack.append(name)

        def leave(module, args, output):
            self._stack.pop()  # returns None: a forward hook's return value would replace the output

        handles = [h for name, module in self.model.named_modules()
                   for h in (module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()

    @property
    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for where, _, _, nbytes in self._live():
            out[where] += nbytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.by_module.values())

    def table(self) -> pd.DataFrame:
        """One row per saved storage: module, shape, dtype, bytes (largest first)."""
        df = pd.DataFrame(self._live(), columns=["module", "shape", "dtype", "bytes"])
        df["shape"] = df["shape"].map(lambda s: "x".join(map(str, s)))
        return df.sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True)

    def per_prefix(self, prefix: str) -> int:
        """Bytes saved by modules under `prefix` (e.g. 'layers.3')."""
        return sum(b for m, b in self.by_module.items() if m == prefix or m.startswith(prefix + "."))


def saved_bytes_per_block(model: nn.Module, forward_loss) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run `forward_loss()` under saved-tensor accounting; return (per-block totals, per-module detail of block 0)."""
    account = SavedTensorAccount(model)
    with account.track():
        loss = forward_loss()
    names = [f"layers.{i}" for i in range(len(getattr(model, "layers", ())))]
    names += [name for name, _ in model.named_children() if name != "layers"]
    rows = [{"module": name, "saved_bytes": account.per_prefix(name)} for name in names]
    rows.append({"module": "<root>", "saved_bytes": account.by_module.get("<root>", 0)})
    detail = account.table()
    detail = detail[detail.module.str.startswith("layers.0.") | (detail.module == "layers.0")]
    del loss  # only now: the counts above need the graph alive
    return pd.DataFrame(rows), detail.reset_index(drop=True)


def unique_storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages behind `tensors` not already in `seen` (updated): each storage counted once.

    DTensors (FSDP2) count this rank's local shard; empty (freed) storages count nothing.
    """
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


_FROZEN_IN: int | None = None  # the pid whose objects were frozen (a forked child inherits the frozen generation)


def freeze_process_objects() -> None:
    """Once per process: collect garbage, import what the first optimizer would (torch's compiler stack), then
    freeze every object alive (`gc.freeze`): later collections and `live_parameters` skip them.
    Frozen objects are still freed when no reference is left; only cycles among them are not collected."""
    global _FROZEN_IN
    import os

    if _FROZEN_IN == os.getpid():
        return
    import torch._dynamo  # noqa: F401  (every torch optimizer imports it in its constructor)

    gc.collect()
    gc.freeze()
    if _FROZEN_IN is None:  # give them back at exit: the interpreter's last collections free what extensions hold
        import atexit

        atexit.register(gc.unfreeze)
    _FROZEN_IN = os.getpid()


def live_parameters() -> int:
    """`nn.Parameter` objects alive in this process and made since `freeze_process_objects` (a model a finished
    trial leaked shows up here)."""
    # issubclass(type(...)), not isinstance: Parameter's metaclass makes isinstance probe attributes of every
    # object (slow, and it trips deprecation warnings of objects like torch.distributed.reduce_op).
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), nn.Parameter))


def release(model: nn.Module) -> None:
    """Unregister a wrapper's gradient hooks (`remove_hooks()`, where it has one) before it is dropped."""
    remove = getattr(model, "remove_hooks", None)
    if callable(remove):
        remove()


class TrialScope:
    """`with TrialScope(device) as scope: metrics = run_trial()`, then `metrics.update(scope.metrics)`.

    Records `memory_allocated_before_bytes`, `memory_reserved_before_bytes` and `live_parameters_before` on
    entry (after a collection), the same `*_after` on exit once everything the trial made is released; on
    the CPU the memory figures are NaN (no allocator statistics) and the parameter count tells. On an
    exception the traceback's finished frames are cleared (their locals would keep the trial's tensors
    alive as long as the exception object lives) before the memory is freed, and any SM carve-out is reset.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.metrics: dict[str, float] = {}

    def _record(self, when: str) -> None:
        free_memory(self.device)
        self.metrics[f"memory_allocated_{when}_bytes"] = allocated_bytes(self.device)
        self.metrics[f"memory_reserved_{when}_bytes"] = (float(torch.cuda.memory_reserved(self.device))
                                                         if self.device.type == "cuda" else math.nan)
        self.metrics[f"live_parameters_{when}"] = live_parameters()

    def __enter__(self) -> "TrialScope":
        freeze_process_objects()
        self._record("before")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            traceback.clear_frames(tb)
            # A trial that failed mid-step may have left a matmul SM carve-out set (parallel/carveout.py): it is
            # process-wide, and the next trial in this rank process must not inherit it.
            torch._C._set_sm_carveout_experimental(None)
        self._record("after")
