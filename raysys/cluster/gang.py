"""The Ray layer: connect to (or start) Ray, reserve a gang of rank actors, run functions on all of them.

A `Gang` is `world_size` Ray actors, one per rank, reserved together in a placement group (`STRICT_PACK` by
default; `PACK`, `SPREAD`, `STRICT_SPREAD` for several nodes) that join one torch.distributed process group. On CUDA
an actor owns one GPU (`gpu_visibility`: `shared`, every actor of a node sees the gang's GPUs so NCCL can use
NVLink, or `isolated`); on CPU it gets `cpus_per_rank` CPUs and threads. `env` is set in every rank before its
process group starts. Invariants: ranks are ordered by node (the driver's first), then GPU; the placement group
and actors go when the gang ends, whatever happened; a rank that raises, dies or times out makes `Gang.run` raise
at once (the first failing rank's error, annotated with its rank) and marks the gang `broken`; a lost head (GCS)
is noticed within seconds (`GcsWatch`).
"""

from __future__ import annotations

import _thread
import functools
import importlib.util
import itertools
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysys.cluster.rank import (DEVICES, RANK_ENV, BaseGang, PlacementInfeasible, RankContext, RankSpec, check_seconds,
                                 destroy_rank, device_description, free_port, init_rank, max_cpu_ranks)
from raysys.cluster.signals import keep_sigterm_interrupt
from raysys.cluster.telemetry import RankMonitor
from raysys.measure.device import machine_memory_bytes, resolve_device

log = logging.getLogger(__name__)

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
GPU_VISIBILITY = ("shared", "isolated")
_gang_ids = itertools.count()
_DASHBOARD: dict[str, str] = {}  # the dashboard URL of the Ray this process connected to


# ---------------------------------------------------------------------------------------------------- connect
def init_ray(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None,
             object_store_memory: int | None = None, dashboard: bool = False) -> dict:
    """Connect to the Ray cluster the user names, or start an embedded one of this process's own.

    Address resolution: `address` ("local" forces an embedded Ray; "auto" is Ray's own guess), else `RAY_ADDRESS`,
    else an embedded Ray with `num_cpus` (default: all cores), `num_gpus` (default: detected) and a small object
    store (5% of RAM, clamped to [256 MiB, 2 GiB]). A cluster on the machine that was not named is never joined.
    Returns `cluster_info()`. Idempotent.
    """
    if ray.is_initialized():
        return cluster_info()
    address = (os.environ.get("RAY_ADDRESS") if address is None else address) or "local"
    embedded = address == "local"
    if not embedded and any(v is not None for v in (num_cpus, num_gpus, object_store_memory)):
        log.warning("connecting to the Ray cluster at %s: num_cpus/num_gpus/object_store_memory are ignored", address)
    own = dict(num_cpus=os.cpu_count() if num_cpus is None else num_cpus, num_gpus=num_gpus,
               object_store_memory=object_store_memory or _default_object_store_bytes(), include_dashboard=dashboard)
    with keep_sigterm_interrupt():  # SIGTERM while Ray starts: the run's one line, not a silent exit 15
        context = ray.init(address=address, logging_level=logging.WARNING, **(own if embedded else {}))
    _DASHBOARD["url"] = context.dashboard_url or ""
    GcsWatch.watch(ray.get_runtime_context().gcs_address, embedded=embedded)
    info = cluster_info()
    if info["dashboard_url"]:
        print(f"Ray dashboard: http://{info['dashboard_url']}", flush=True)
    return info


class GcsWatch(threading.Thread):
    """Notices the loss of the Ray cluster's head (its GCS) while it is still time to say so.

    A daemon thread connects to the GCS's port every `period_s`; once it has refused for `grace_s` (shorter for an
    embedded Ray than for a named cluster, which may come back), `lost` says why and `on_lost` runs (default: a
    KeyboardInterrupt in the main thread, as Ctrl-C). It makes no Ray call and stops quietly after `ray.shutdown()`.
    """

    current: "GcsWatch | None" = None

    def __init__(self, address: str, *, grace_s: float, period_s: float = 1.0,
                 on_lost: Callable[[], None] = _thread.interrupt_main):
        super().__init__(name="raysys-gcs-watch", daemon=True)
        host, _, port = address.rpartition(":")
        self.address, self.target = address, (host.strip("[]"), int(port))
        self.grace_s, self.period_s, self.on_lost = grace_s, period_s, on_lost
        self.lost = ""
        self._stopping = threading.Event()

    @classmethod
    def watch(cls, address: str, embedded: bool) -> "GcsWatch":
        """Watch the GCS at `address` (one watch per process: a new address replaces the old watch)."""
        if cls.current is not None and cls.current.address == address and cls.current.is_alive():
            return cls.current
        if cls.current is not None:
            cls.current.stop()
        cls.current = cls(address, grace_s=5.0 if embedded else 40.0)
        cls.current.start()
        return cls.current

    def stop(self) -> None:
        self._stopping.set()

    def _answers(self) -> bool:
        try:
            socket.create_connection(self.target, timeout=min(2.0, self.period_s * 2)).close()
            return True
        except OSError:
            return False

    def run(self) -> None:
        refused_since = None
        while not self._stopping.wait(self.period_s):
            if self._answers():
                refused_since = None
                continue
            now = time.monotonic()
            refused_since = refused_since if refused_since is not None else now
            if now - refused_since >= self.grace_s:
                if not ray.is_initialized():  # ray.shutdown() stopped it: nothing was lost
                    return
                self.lost = f"the GCS at {self.address} stopped answering {self.grace_s:g} s ago"
                self.on_lost()
                return


def gcs_lost() -> str:
    """Why the Ray cluster this process uses is lost (`GcsWatch`), or ''."""
    watch = GcsWatch.current
    return watch.lost if watch is not None else ""


def _default_object_store_bytes() -> int:
    return int(min(max((machine_memory_bytes() or 0) // 20, 256 * 2**20), 2 * 2**30))


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    num_cpus: float
    num_gpus: float


def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes of the cluster with their total CPUs and GPUs."""
    nodes = [NodeInfo(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0),
                      n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n["Alive"]]
    return sorted(nodes, key=lambda n: (n.address, n.node_id))


def cluster_info() -> dict:
    """Address, dashboard URL, nodes (CPUs, GPUs) and total resources of the connected cluster."""
    return {"address": ray.get_runtime_context().gcs_address, "dashboard_url": _DASHBOARD.get("url", ""),
            "nodes": [n.__dict__ for n in cluster_nodes()], "resources": ray.cluster_resources()}


def gang_device(device: str) -> str:
    """The device type (`cuda` or `cpu`) a gang asking for `device` runs on: `auto` -> `cuda` when the cluster (not
    necessarily this driver) has GPUs; `cuda` on a cluster without GPUs is a ValueError."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} must be one of {DEVICES}")
    gpus = ray.cluster_resources().get("GPU", 0)
    where = f"the Ray cluster ({len(ray.nodes())} node(s), resources {dict(ray.cluster_resources())})"
    return resolve_device(device, num_gpus=math.ceil(gpus), where=where).type


# ---------------------------------------------------------------------------------------------------- placement
def check_placement(world_size: int, *, device: str, strategy: str, cpus_per_rank: float,
                    nodes: Sequence[NodeInfo] | None = None) -> None:
    """Raise `PlacementInfeasible` when no state of the cluster could ever hold the gang."""
    nodes = list(cluster_nodes() if nodes is None else nodes)
    gpu = device == "cuda"

    def fits(n: NodeInfo) -> int:  # how many rank bundles node n can hold at most
        by_cpu = min(int(n.num_cpus // cpus_per_rank), max_cpu_ranks(n.num_cpus))  # tiny cpus_per_rank: bounded
        return min(by_cpu, int(n.num_gpus)) if gpu else by_cpu

    per_node = [fits(n) for n in nodes]
    unit = "GPUs" if gpu else "CPUs"
    have = ", ".join(f"{n.num_gpus:g}" if gpu else f"{n.num_cpus:g}" for n in nodes) or "none"
    if strategy == "STRICT_PACK":
        ok, where = max(per_node, default=0) >= world_size, "in one node"
    elif strategy == "STRICT_SPREAD":
        ok, where = sum(1 for k in per_node if k >= 1) >= world_size, "on distinct nodes"
    else:
        ok, where = sum(per_node) >= world_size, "in the cluster"
    if not ok:
        raise PlacementInfeasible(
            f"asked for {world_size} ranks with {'1 GPU' if gpu else f'{cpus_per_rank:g} CPU'} each {where} "
            f"({strategy}); the cluster has {len(nodes)} node(s) with {have} {unit}")


def _placement_order(pg, driver_node: str) -> list[tuple[int, str]]:
    """(bundle index, node id) in rank order: by node (the driver's first), then bundle index."""
    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    first_bundle: dict[str, int] = {}
    for b in sorted(bundle_nodes):
        first_bundle.setdefault(bundle_nodes[b], b)
    node_key = {n: (n != driver_node, first) for n, first in first_bundle.items()}
    return sorted(((b, n) for b, n in bundle_nodes.items()), key=lambda bn: (node_key[bn[1]], bn[0]))


# ---------------------------------------------------------------------------------------------------- actors
@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """One rank: holds the process group between calls; `run` calls a trial function with the RankContext."""

    def __init__(self, label: str, sweep: str = ""):
        self.label, self.sweep = label, sweep or label
        self.ctx: RankContext | None = None
        self.monitor: RankMonitor | None = None  # memory / utilisation gauges for the dashboard (raysys.cluster.telemetry)

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with its repr
        return self.label

    def describe(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(), "host": socket.gethostname(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def free_port(self) -> int:
        return free_port()

    def setup(self, spec: RankSpec) -> str:
        self.ctx = init_rank(spec)
        self.monitor = RankMonitor(self.sweep, self.ctx.rank, self.ctx.device).start()
        return device_description(self.ctx)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.ctx is None:
            raise RuntimeError(f"{self.label}: run() before setup()")
        return fn(self.ctx, *args, **kwargs)

    def teardown(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        destroy_rank()
        self.ctx = None


def _gather(refs: list, timeout_s: float, what: str) -> list:
    """ray.get on all refs; the first failing rank raises immediately, annotated with its rank."""
    deadline = time.monotonic() + timeout_s
    pending = {ref: rank for rank, ref in enumerate(refs)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GetTimeoutError(f"{what}: ranks {sorted(pending.values())} still running after {timeout_s:g} s")
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                ray.get(ref)
            except Exception as exc:
                exc.add_note(f"(raised on rank {rank} during {what})")
                raise _root_cause(exc, pending) from None
    return ray.get(refs)


def _root_cause(exc: Exception, pending: dict, grace_s: float = 1.0) -> Exception:
    """A dead rank makes its peers' collectives fail too; prefer the death (RayActorError) as the error."""
    if isinstance(exc, RayActorError) or not pending:
        return exc
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as death:
            death.add_note(f"(rank {pending[ref]} died; rank errors that followed: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:200]})")
            return death
        except Exception:
            pass
    return exc


class Gang(BaseGang):
    """`world_size` rank actors in one placement group, joined in one process group (`BaseGang`'s interface).

        with Gang(2, device="cpu", name="allreduce") as gang:
            per_rank = gang.run(fn, 1024)        # fn(ctx, 1024) on every rank; results ordered by rank

    `timeout_s` is both the process-group timeout and the default limit of one `run`; `placement_timeout_s`
    bounds the wait for the placement group. A run that fails leaves the gang `broken` (the survivors may
    be stuck in a collective): leave the `with` block and build a new one.
    """

    def __init__(self, world_size: int, *, device: str = "auto", strategy: str = "STRICT_PACK", name: str = "gang",
                 timeout_s: float = 600.0, gpu_visibility: str = "shared", cpus_per_rank: float = 1,
                 placement_timeout_s: float = 120.0, env: Mapping[str, str] | None = None):
        super().__init__(world_size, device=device, name=name, timeout_s=timeout_s, env=env)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} must be one of {STRATEGIES}")
        if gpu_visibility not in GPU_VISIBILITY:
            raise ValueError(f"gpu_visibility {gpu_visibility!r} must be one of {GPU_VISIBILITY}")
        check_seconds("placement_timeout_s", placement_timeout_s)
        if cpus_per_rank <= 0:
            raise ValueError(f"cpus_per_rank ({cpus_per_rank}) must be > 0")
        self.strategy, self.gpu_visibility = strategy, gpu_visibility
        self.placement_timeout_s, self.cpus_per_rank = placement_timeout_s, cpus_per_rank
        self.actors: list = []               # by rank
        self._pg = None

    # -- lifecycle
    @property
    def running(self) -> bool:
        return bool(self.actors)

    def _resolve_device(self) -> str:
        init_ray()
        return gang_device(self.requested_device)

    def _check_placement(self) -> None:
        check_placement(self.world_size, device=self.device, strategy=self.strategy, cpus_per_rank=self.cpus_per_rank)

    def _start(self) -> None:
        gid = next(_gang_ids)
        bundle = {"CPU": self.cpus_per_rank, **({"GPU": 1} if self.device == "cuda" else {})}
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=self.strategy,
                                   name=f"{self.name}#{gid}")
        try:
            ray.get(self._pg.ready(), timeout=self.placement_timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"placement group for {self.world_size} x {bundle} ({self.strategy}) not ready after "
                f"{self.placement_timeout_s:g} s; available now: {ray.available_resources()}") from None
        order = _placement_order(self._pg, ray.get_runtime_context().get_node_id())
        names = [f"{self.name}#{gid}.rank{rank}" for rank in range(self.world_size)]
        self.actors = [
            RankActor.options(
                name=names[rank], num_cpus=self.cpus_per_rank,
                num_gpus=1 if self.device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=b),
                runtime_env=_runtime_env(),
            ).remote(f"{self.name}.rank{rank}", self.name)
            for rank, (b, _) in enumerate(order)]
        infos = _gather([a.describe.remote() for a in self.actors], self.placement_timeout_s, "actor start")
        specs = self._rank_specs(infos, port=ray.get(self.actors[0].free_port.remote()))
        devices = _gather([a.setup.remote(s) for a, s in zip(self.actors, specs)], self.timeout_s,
                          "process-group init")
        self.ranks = [{**info, "actor_name": name, "rank": s.rank, "local_rank": s.local_rank,
                       "node_rank": s.node_rank, "device_index": s.device_index, "visible_devices": s.visible_devices,
                       "device_name": device} for info, s, name, device in zip(infos, specs, names, devices)]

    def _rank_specs(self, infos: list[dict], port: int) -> list[RankSpec]:
        node_order = list(dict.fromkeys(info["node_id"] for info in infos))
        by_node = {n: [r for r, info in enumerate(infos) if info["node_id"] == n] for n in node_order}
        node_gpus = {n: sorted({g for r in rs for g in infos[r]["gpu_ids"]}, key=_gpu_key) for n, rs in by_node.items()}
        if self.device == "cuda" and self.gpu_visibility == "isolated":
            for rs in by_node.values():
                firsts = [_gpu_key(infos[r]["gpu_ids"][0]) for r in rs]
                if firsts != sorted(firsts):
                    log.warning("%s: Ray assigned GPUs %s to ranks %s of a node out of order (isolated visibility "
                                "keeps Ray's assignment)", self.name, [infos[r]["gpu_ids"] for r in rs], rs)
        specs = []
        for rank, info in enumerate(infos):
            node = info["node_id"]
            local_rank = by_node[node].index(rank)
            visible, index = None, None
            if self.device == "cuda":
                shared = self.gpu_visibility == "shared"
                visible, index = (",".join(node_gpus[node]), local_rank) if shared else (None, _own_index(info))
            specs.append(RankSpec(rank=rank, world_size=self.world_size, local_rank=local_rank,
                                  local_world_size=len(by_node[node]), node_rank=node_order.index(node),
                                  master_addr=infos[0]["ip"], master_port=port, device_type=self.device,
                                  device_index=index, visible_devices=visible, timeout_s=self.timeout_s,
                                  num_threads=max(1, int(self.cpus_per_rank)), env=self.env))
        return specs

    def shutdown(self) -> None:
        """Destroy the process group (if the gang is healthy), kill the actors, remove the placement group."""
        try:
            if self.actors and not self.broken:
                try:
                    _gather([a.teardown.remote() for a in self.actors], 30.0, "teardown")
                except Exception as exc:  # the actors are killed below either way
                    log.warning("%s: teardown failed: %s", self.name, exc)
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self.actors = []
            if self._pg is not None and not gcs_lost():  # without a GCS this call waits for Ray to end the process
                remove_placement_group(self._pg)
            self._pg = None

    # -- running
    def _submit(self, fn: Callable[..., Any], args: tuple, kwargs: dict, label: str) -> list:
        """One task per actor, named `<name>.rank<r>:<label>` in the Ray dashboard."""
        return [a.run.options(name=f"{self.name}.rank{r}:{label}").remote(fn, args, kwargs)
                for r, a in enumerate(self.actors)]

    def _collect(self, refs: list, label: str, timeout_s: float) -> list:
        return _gather(refs, timeout_s, f"{self.name}:{label}")


@functools.cache
def _runtime_env() -> dict | None:
    """RANK_ENV as the actors' runtime env. Ray's runtime-env agent needs `ray[default]` (aiohttp); on a bare
    `ray` install the same variables are set in-process by `init_rank`, before NCCL or CUDA read them."""
    if importlib.util.find_spec("aiohttp") is None:
        log.warning("aiohttp missing (ray without [default]): the rank env vars are set in-process, "
                    "not through the actors' runtime env")
        return None
    return {"env_vars": dict(RANK_ENV)}


def _own_index(info: dict) -> int:
    """Ray Train's rule: the device index of the actor's own GPU within its CUDA_VISIBLE_DEVICES."""
    visible = [v for v in (info["cuda_visible_devices"] or "").split(",") if v]
    own = info["gpu_ids"][0]
    return visible.index(own) if own in visible else int(own)  # unset: Ray was told not to set it


def _gpu_key(gpu_id: str) -> tuple:
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)  # "10" after "9"; UUIDs after indices
