"""Activation checkpointing policies for a stack of Transformer blocks (handout section 3; Chen et al. 2016,
Korthikanti et al. 2022).

Policies, by what a block keeps for backward: `NoCheckpoint` (all autograd saves), `FullCheckpoint(every_k)`
(segments of k blocks keep their input and rerun; `.sqrt(N)`: k = sqrt(N)), `NestedCheckpoint(leaf_size)` (recursive
halves, O(log N) memory), `SelectiveCheckpoint` (attention keeps its projections, recomputes the core and RoPE),
`FfnCheckpoint` (the feed-forward branch reruns), `Offload` (saved tensors to pinned host memory, back one block
ahead), `PerLayer([...])` (one policy per block).

Invariant: a policy changes which tensors live between forward and backward, never a value (fp32: bit for bit).
`apply_activation_checkpointing(model, policy)` patches `forward` / `ffn_branch` of the blocks in `model.layers`
(wrapping no module); `remove_activation_checkpointing(model)` or `handle.remove()` undoes it. Block hooks do not
fire during recomputation (per-block FSDP needs k = 1); torch.compile of checkpointed blocks is unsupported.
See docs/parallel.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

FUSED_ATTENTION_BACKENDS = frozenset({"sdpa", "cudnn", "flash_triton", "flash_pytorch"})
"""Backends that keep O and the log-sum-exp and recompute P in their own backward."""

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the projections (Linear is `x @ W.t()` -> mm) and fused
# attention kernels (never recomputed). Everything else in the attention module is recomputed.
_SELECTIVE_SAVE_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
})


# ----------------------------------------------------------------------------------------------------------------
# Policies: small frozen dataclasses; `regions(num_layers)` says what each block gets.

@dataclass(frozen=True)
class Region:
    """Blocks [start, stop) under one mechanism: none | full | nested | selective | ffn | offload."""

    kind: str
    start: int
    stop: int
    policy: "Policy"


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")
    return value


class Policy:
    """Base class. `regions(num_layers)` cuts the blocks into `Region`s, in order, covering every block once."""

    kind = "none"
    arg: str | None = None
    """The field that `parse_policy`'s `kind:ARG` sets; `spec` shows it when it differs from its default."""

    def regions(self, num_layers: int) -> list[Region]:
        return [Region(self.kind, i, i + 1, self) for i in range(_positive_int("num_layers", num_layers))]

    @property
    def spec(self) -> str:
        """Canonical string form, parsed back by `parse_policy`."""
        value = getattr(self, self.arg) if self.arg else None
        return self.kind if value is None or value == getattr(type(self), self.arg) else f"{self.kind}:{value}"


@dataclass(frozen=True)
class NoCheckpoint(Policy):
    """Keep every residual (the baseline)."""

    kind = "none"


@dataclass(frozen=True)
class FullCheckpoint(Policy):
    """Segments of `every_k` consecutive blocks, each rerun from its input in backward."""

    every_k: int = 1
    """Blocks per segment (the last segment may be shorter)."""

    kind = "full"
    arg = "every_k"

    def __post_init__(self):
        _positive_int("every_k", self.every_k)

    @classmethod
    def sqrt(cls, num_layers: int) -> "FullCheckpoint":
        """k = round(sqrt(N)): N/k checkpoints + k live blocks is smallest there (Chen et al. 2016)."""
        return cls(max(1, round(math.sqrt(_positive_int("num_layers", num_layers)))))

    def regions(self, num_layers: int) -> list[Region]:
        n = _positive_int("num_layers", num_layers)
        return [Region("full", s, min(s + self.every_k, n), self) for s in range(0, n, self.every_k)]


@dataclass(frozen=True)
class NestedCheckpoint(Policy):
    """Recursive halving, each half checkpointed, down to `leaf_size` blocks: O(log N) memory."""

    leaf_size: int = 1
    """Blocks run without a further checkpoint at the bottom of the recursion."""

    kind = "nested"
    arg = "leaf_size"

    def __post_init__(self):
        _positive_int("leaf_size", self.leaf_size)

    def regions(self, num_layers: int) -> list[Region]:
        return [Region("nested", 0, _positive_int("num_layers", num_layers), self)]


@dataclass(frozen=True)
class SelectiveCheckpoint(Policy):
    """Keep projections and the residual stream, recompute the attention core (no-op for fused backends)."""

    fused_backends: frozenset = FUSED_ATTENTION_BACKENDS
    """Attention backends left alone: they already recompute P in their backward."""

    kind = "selective"


@dataclass(frozen=True)
class FfnCheckpoint(Policy):
    """Keep the feed-forward branch's input only; rerun ln2 and SwiGLU's w1, w3 and gating in backward."""

    kind = "ffn"


@dataclass(frozen=True)
class Offload(Policy):
    """Saved tensors to host memory during forward, back to the device one block ahead of backward."""

    min_bytes: int = 1 << 16
    """Storages smaller than this stay on the device (a transfer costs more than it saves)."""
    pin_memory: bool = True
    """Copy into page-locked host memory (needed for asynchronous copies); CUDA only."""
    prefetch: bool = True
    """On the first unpack of a block, start copying the previous offloaded block back."""

    kind = "offload"
    arg = "min_bytes"

    def __post_init__(self):
        if self.min_bytes < 0:
            raise ValueError(f"min_bytes ({self.min_bytes}) must be >= 0")


@dataclass(frozen=True)
class PerLayer(Policy):
    """One policy per block, in order; `len(layers)` must equal the model's number of blocks."""

    layers: tuple = ()

    kind = "per_layer"

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, p in enumerate(self.layers):
            if not isinstance(p, Policy) or isinstance(p, PerLayer):
                raise ValueError(f"PerLayer entry {i} ({p!r}) must be a non-PerLayer Policy")

    def regions(self, num_layers: int) -> list[Region]:
        n = _positive_int("num_layers", num_layers)
        if len(self.layers) != n:
            raise ValueError(f"PerLayer has {len(self.layers)} entries but the model has {n} blocks")
        out, i = [], 0
        while i < n:
            p, j = self.layers[i], i + 1
            if isinstance(p, (FullCheckpoint, NestedCheckpoint)):
                while j < n and self.layers[j] == p:
                    j += 1
                out += [dataclasses.replace(r, start=r.start + i, stop=r.stop + i) for r in p.regions(j - i)]
            else:
                out.append(Region(p.kind, i, j, p))
            i = j
        return out

    @property
    def spec(self) -> str:
        return "+".join(f"{p.spec}*{len(list(run))}" for p, run in itertools.groupby(self.layers))


_NAMED = {p.kind: p for p in (NoCheckpoint, SelectiveCheckpoint, FfnCheckpoint, Offload, FullCheckpoint,
                              NestedCheckpoint)}


def parse_policy(spec: str, num_layers: int) -> Policy:
    """`none | selective | ffn | offload | offload:MIN_BYTES | full | full:K | sqrt | nested | nested:LEAF`, or
    per-layer runs joined by `+` with counts: `full*8+ffn*8+none*16` (counts must add up to `num_layers`)."""
    spec = spec.strip()
    if "+" in spec or "*" in spec:
        layers: list[Policy] = []
        for part in spec.split("+"):
            name, _, count = part.partition("*")
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"per-layer part {part!r} must be NAME*COUNT with COUNT >= 1")
            layers += [parse_policy(name, num_layers)] * int(count)
        return PerLayer(tuple(layers))
    name, _, arg = spec.partition(":")
    if arg and not arg.isdigit():
        raise ValueError(f"policy argument in {spec!r} must be a positive integer")
    if name == "sqrt" and not arg:
        return FullCheckpoint.sqrt(num_layers)
    cls = _NAMED.get(name)
    if cls is None or (arg and cls.arg is None):
        raise ValueError(f"unknown checkpoint policy {spec!r}; expected none, selective, ffn, offload[:MIN_BYTES], "
                         f"full[:K], sqrt, nested[:LEAF] or NAME*COUNT+...")
    return cls(**{cls.arg: int(arg)}) if arg else cls()


# ----------------------------------------------------------------------------------------------------------------
# Mechanisms: small callable objects installed as instance `forward`s (picklable, deepcopy-safe).

def class_forward(module: nn.Module, *args, **kwargs):
    """The module's own forward, bypassing an instance-level replacement (a policy's, a compiled one)."""
    return type(module).forward(module, *args, **kwargs)


class _SegmentForward:
    """Forward of the first block of a segment: run blocks[0..k) under checkpoint (flat or nested)."""

    def __init__(self, blocks: Sequence[nn.Module], nested_leaf: int | None):
        self.blocks = list(blocks)
        self.nested_leaf = nested_leaf
        self.last_output: weakref.ref | None = None

    def _run(self, lo: int, hi: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.nested_leaf is not None and hi - lo > self.nested_leaf and torch.is_grad_enabled():
            mid = (lo + hi) // 2
            x = checkpoint(self._run, lo, mid, x, *args, use_reentrant=False, **kwargs)
            return checkpoint(self._run, mid, hi, x, *args, use_reentrant=False, **kwargs)
        for block in self.blocks[lo:hi]:
            x = class_forward(block, x, *args, **kwargs)
        return x

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # without autograd nothing is saved: the plain blocks; nested: the top level is not wrapped (its input is x)
        if self.nested_leaf is not None or not torch.is_grad_enabled():
            out = self._run(0, len(self.blocks), x, *args, **kwargs)
        else:
            out = checkpoint(self._run, 0, len(self.blocks), x, *args, use_reentrant=False, **kwargs)
        self.last_output = weakref.ref(out)
        return out


class _PassThrough:
    """Forward of a non-first block of a segment: the first block already ran it."""

    def __init__(self, head: _SegmentForward, block: nn.Module):
        self.head, self.block = head, block

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        ref = self.head.last_output
        if ref is not None and ref() is x:
            return x
        # Not called with the segment's output (the block used on its own): behave like the plain block.
        return class_forward(self.block, x, *args, **kwargs)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed:
    """`fn(module, ...)` under its own checkpoint: selective keeps the attention's projections (`_SELECTIVE_SAVE_OPS`),
    otherwise only the inputs (the ffn branch keeps h)."""

    def __init__(self, module: nn.Module, fn, selective: bool = False):
        self.module, self.fn, self.selective = module, fn, selective

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fn(self.module, *args, **kwargs)
        if self.selective:
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(self.fn, self.module, *args, use_reentrant=False, **kwargs)


class OffloadForward:
    """Forward of a block whose saved tensors go to the host store. `inner` (default: the block's class forward)
    is what runs inside the store's hooks; a faster forward of the same block may take its place
    (`raysys.training.leaderboard.lean_blocks` does)."""

    def __init__(self, block: nn.Module, store: "OffloadStore", group: int):
        self.block, self.store, self.group = block, store, group
        self.inner = None

    def __call__(self, *args, **kwargs):
        with self.store.offloading(self.group, self.block):
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            return class_forward(self.block, *args, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Offload store.

class _HostCopy:
    """One offloaded storage: its host copy, and the device copy while one exists (never both needed)."""

    __slots__ = ("host", "nbytes", "device", "device_buf", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, nbytes: int, device: torch.device, device_buf: torch.Tensor | None):
        self.host, self.nbytes, self.device = host, nbytes, device
        self.device_buf = device_buf  # the original storage (until the next block ends) or a fetched copy
        self.ready: torch.cuda.Event | None = None  # set when device_buf is a host->device copy


class _Packed:
    """What autograd keeps instead of a saved tensor: a view description into a `_HostCopy`."""

    __slots__ = ("copy", "dtype", "size", "stride", "offset", "group")

    def __init__(self, copy: _HostCopy, t: torch.Tensor, group: int):
        self.copy, self.dtype, self.group = copy, t.dtype, group
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


@dataclass
class OffloadStats:
    packed_tensors: int = 0
    """Saved tensors replaced by a host copy."""
    kept_tensors: int = 0
    """Saved tensors left in place (parameters, small ones, other devices)."""
    offloaded_bytes: int = 0
    """Bytes copied to the host (each storage once)."""
    unpacked_tensors: int = 0
    prefetched_bytes: int = 0
    """Bytes copied back ahead of need."""


class OffloadStore:
    """Moves the tensors saved inside `offloading(group)` to host memory and brings them back for backward.

    Device -> host: the side stream waits for the compute stream and copies each storage once (views of one
    storage share the copy) into pinned memory; `record_stream` keeps the allocator from reusing the device
    storage before that copy ran. A block's device storages are dropped when the next block's forward ends, so
    the last block's tensors are still on the device when backward starts and are used in place.
    Host -> device: on the first unpack of block g, the previous offloaded block is copied back on the side
    stream (prefetch); the compute stream waits on each copy's event before it reads the tensor.
    On the CPU the "host copy" is a separate CPU buffer and unpacking returns a view of it.
    """

    def __init__(self, policy: Offload):
        self.policy = policy
        self.stats = OffloadStats()
        # group -> its host copies (weak: the graph owns them), in the order the groups' forwards first ran
        self._groups: dict[int, list[weakref.ref]] = {}
        self._live: dict[int, _HostCopy] | None = None  # storage ptr -> copy, while a group's forward runs
        self._skip: set[int] = set()
        self._previous: list[weakref.ref] = []  # copies of the last finished group, device storage still held
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._prefetched: set[int] = set()

    # -- forward ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def offloading(self, group: int, module: nn.Module):
        if self._live is not None:
            raise RuntimeError("Offload regions cannot nest")
        self._live = {}
        # Parameters and buffers live anyway; copying them would only cost bandwidth.
        self._skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        self._groups[group] = []  # a dict keeps a re-assigned key in its first place
        self._prefetched.discard(group)
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, group), self._unpack):
                yield
        finally:
            for ref in self._previous:
                if (copy := ref()) is not None and copy.ready is None:
                    copy.device_buf = None
            self._previous = [weakref.ref(c) for c in self._live.values()]
            self._live = None

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, group: int, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if (t.layout != torch.strided or nbytes == 0 or nbytes < self.policy.min_bytes or ptr in self._skip
                or t.device.type not in ("cuda", "cpu")):
            self.stats.kept_tensors += 1
            return t
        copy = self._live.get(ptr)  # safe: _live holds every storage of this group, so no address is reused
        if copy is None:
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            if t.device.type == "cuda":
                stream = self._stream(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.policy.pin_memory)
                with torch.cuda.stream(stream):
                    host.copy_(src, non_blocking=True)
                src.record_stream(stream)
                copy = _HostCopy(host, nbytes, t.device, device_buf=src)
            else:
                copy = _HostCopy(src.clone(), nbytes, t.device, device_buf=src)
            self._live[ptr] = copy
            self._groups[group].append(weakref.ref(copy))
            self.stats.offloaded_bytes += nbytes
        self.stats.packed_tensors += 1
        return _Packed(copy, t, group)

    # -- backward ---------------------------------------------------------------------------------------------
    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        self.stats.unpacked_tensors += 1
        if self.policy.prefetch and packed.group not in self._prefetched:
            self._prefetched.add(packed.group)
            order = list(self._groups)
            pos = order.index(packed.group)
            if pos > 0:
                self._prefetch(order[pos - 1])
        copy = packed.copy
        if copy.device.type == "cpu":
            base = copy.host
        else:
            if copy.device_buf is None:
                self._fetch(copy)
            if copy.ready is not None:
                torch.cuda.current_stream(copy.device).wait_event(copy.ready)
            base = copy.device_buf
        out = torch.empty(0, dtype=packed.dtype, device=copy.device)
        return out.set_(base.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _fetch(self, copy: _HostCopy) -> None:
        stream = self._stream(copy.device)
        buf = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
        stream.wait_stream(torch.cuda.current_stream(copy.device))  # buf's memory may have just been freed
        with torch.cuda.stream(stream):
            buf.copy_(copy.host, non_blocking=True)
            copy.ready = torch.cuda.Event()
            copy.ready.record(stream)
        buf.record_stream(stream)
        copy.device_buf = buf

    def _prefetch(self, group: int) -> None:
        for ref in self._groups.get(group, ()):
            copy = ref()
            if copy is not None and copy.device.type == "cuda" and copy.device_buf is None:
                self._fetch(copy)
                self.stats.prefetched_bytes += copy.nbytes

    def host_copies(self, group: int | None = None) -> list[torch.Tensor]:
        """The live host buffers (of one block, or all): what tests inspect."""
        groups = [group] if group is not None else list(self._groups)
        return [c.host for g in groups for ref in self._groups.get(g, ()) if (c := ref()) is not None]


# ----------------------------------------------------------------------------------------------------------------
# Applying and removing.

@dataclass
class CheckpointHandle:
    """What `apply_activation_checkpointing` did to a model; `remove()` undoes it."""

    model: nn.Module
    policy: Policy
    regions: list[Region]
    stores: list[OffloadStore]
    _patched: list[tuple[nn.Module, str]]
    """(module, attribute) pairs whose instance-level replacement `remove()` drops."""
    notes: list[str]

    def remove(self) -> None:
        for module, attr in self._patched:
            module.__dict__.pop(attr, None)
        self._patched.clear()
        if getattr(self.model, "_activation_checkpointing", None) is self:
            del self.model._activation_checkpointing

    def describe(self) -> list[str]:
        """One line per block: its mechanism (and segment)."""
        def segment(r: Region) -> str:
            grouped = r.kind in ("full", "nested") and r.stop - r.start > 1
            return f" (segment {r.start}-{r.stop - 1})" if grouped else ""

        return [f"block {i}: {r.kind}{segment(r)}" for r in self.regions for i in range(r.start, r.stop)]


def apply_activation_checkpointing(model: nn.Module, policy: Policy) -> CheckpointHandle:
    """Install `policy` on `model.layers` (see the module docstring); returns a handle whose `remove()` undoes it."""
    if not isinstance(policy, Policy):
        raise ValueError(f"policy must be a Policy instance, got {type(policy).__name__}")
    layers = getattr(model, "layers", None)
    if layers is None or not isinstance(layers, (nn.ModuleList, nn.Sequential, list, tuple)):
        raise ValueError(f"{type(model).__name__} has no `layers` sequence of blocks to checkpoint")
    if getattr(model, "_activation_checkpointing", None) is not None:
        raise ValueError("activation checkpointing is already applied to this model; call "
                         "remove_activation_checkpointing(model) first")
    blocks = list(layers)
    regions = policy.regions(len(blocks))
    handle = CheckpointHandle(model, policy, regions, stores=[], _patched=[], notes=[])
    stores: dict[Offload, OffloadStore] = {}
    for r in regions:
        if r.kind == "none":
            continue
        if r.kind in ("full", "nested"):
            head = _SegmentForward(blocks[r.start:r.stop], r.policy.leaf_size if r.kind == "nested" else None)
            _install(handle, blocks[r.start], head)
            for block in blocks[r.start + 1:r.stop]:
                _install(handle, block, _PassThrough(head, block))
        elif r.kind == "selective":
            attn = getattr(blocks[r.start], "attn", None)
            if attn is None or not hasattr(attn, "attention"):
                raise ValueError(f"block {r.start} has no `attn` module with an `attention` backend name")
            if attn.attention in r.policy.fused_backends:
                handle.notes.append(f"block {r.start}: selective is a no-op with the fused {attn.attention!r} backend")
                continue
            _install(handle, attn, _Checkpointed(attn, class_forward, selective=True))
        elif r.kind == "ffn":
            for i in range(r.start, r.stop):
                if not callable(getattr(blocks[i], "ffn_branch", None)):
                    raise ValueError(f"block {i} ({type(blocks[i]).__name__}) has no `ffn_branch(h)` method to "
                                     "checkpoint")
                _install(handle, blocks[i], _Checkpointed(blocks[i], type(blocks[i]).ffn_branch), attr="ffn_branch")
        elif r.kind == "offload":
            if r.policy not in stores:
                stores[r.policy] = OffloadStore(r.policy)
            _install(handle, blocks[r.start], OffloadForward(blocks[r.start], stores[r.policy], r.start))
        else:
            raise AssertionError(f"unknown region kind {r.kind}")
    handle.stores = list(stores.values())
    model._activation_checkpointing = handle
    return handle


def remove_activation_checkpointing(model: nn.Module) -> None:
    """Undo `apply_activation_checkpointing` (a no-op on a model without it)."""
    handle = getattr(model, "_activation_checkpointing", None)
    if handle is not None:
        handle.remove()


def _install(handle: CheckpointHandle, module: nn.Module, fn, attr: str = "forward") -> None:
    if attr in module.__dict__:
        raise ValueError(f"{type(module).__name__} already has an instance-level {attr}; refusing to replace it")
    setattr(module, attr, fn)
    handle._patched.append((module, attr))
