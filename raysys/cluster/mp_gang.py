"""The same gang without Ray: one `torch.multiprocessing` process per rank on this machine.

`ProcessGang` implements `raysys.cluster.rank.BaseGang` as `raysys.cluster.gang.Gang` does and runs the same trial
functions with the same `RankContext` and bootstrap (`init_rank`), so a benchmark runs both ways and the
difference is what Ray costs. Rank r uses `cuda:r`. Each rank is a persistent process (CPU ranks forked from a
forkserver that imported torch once; CUDA ranks spawned) that serves pickled `(fn, args, kwargs)` calls over a
pipe, answering by value. A rank that raises, dies or times out makes `run` raise at once (`RankFailed` names the
rank and its exit code) and marks the gang `broken`; ranks ignore SIGINT; `shutdown` leaves no process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any, Callable, Mapping

import torch

from raysys.cluster.rank import (DEVICES, BaseGang, PlacementInfeasible, RankSpec, adopt_environ, check_local_cpu_ranks,
                                 check_seconds, destroy_rank, device_description, die_with_parent, free_port, init_rank,
                                 rank_process_context)
from raysys.measure.device import resolve_device


def local_device(device: str) -> str:
    """`auto` -> `cuda` when this machine has a GPU, else `cpu` (a `cuda` gang checks the count at start)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} must be one of {DEVICES}")
    return device if device != "auto" else resolve_device("auto").type


def check_local_placement(world_size: int, device: str) -> None:
    """Raise `PlacementInfeasible` (a ValueError) when this machine cannot give each of `world_size` `cuda` ranks
    a GPU of its own, or cannot run `world_size` `cpu` rank processes (`raysys.cluster.rank.check_local_cpu_ranks`)."""
    if device != "cuda":
        check_local_cpu_ranks(world_size)
        return
    num_gpus = torch.cuda.device_count()
    if device == "cuda" and num_gpus < world_size:
        raise PlacementInfeasible(f"asked for {world_size} GPUs on this machine (multiprocessing launch); "
                                  f"it has {num_gpus}")


class RankFailed(RuntimeError):
    """A rank process raised an exception that could not be sent back as itself, or died."""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def _ranks_ignore_sigint():
    """Start ranks with SIGINT ignored, so a terminal's Ctrl-C is handled by the driver alone (which stops the
    ranks); a Ctrl-C while a rank forks is lost. Off the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve(spec: RankSpec, conn, environ: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's, however this process was started
    die_with_parent()
    adopt_environ(environ)
    try:
        ctx = init_rank(spec)
        conn.send_bytes(pickle.dumps(("ok", device_description(ctx))))
    except BaseException as exc:
        conn.send_bytes(_error_payload(exc))
        return
    try:
        while True:
            msg = conn.recv_bytes()
            if not msg:  # shutdown
                break
            fn, args, kwargs = pickle.loads(msg)
            try:
                payload = pickle.dumps(("ok", fn(ctx, *args, **kwargs)))
            except BaseException as exc:
                payload = _error_payload(exc)
            conn.send_bytes(payload)
    except (EOFError, OSError):  # the driver went away
        pass
    finally:
        destroy_rank()


def _error_payload(exc: BaseException) -> bytes:
    text = traceback.format_exc()
    try:
        return pickle.dumps(("error", (exc, text)))
    except Exception:  # unpicklable exception: send its text
        return pickle.dumps(("error", (None, text)))


class ProcessGang(BaseGang):
    """`world_size` local rank processes joined in one process group; `BaseGang`'s interface, as
    `raysys.cluster.gang.Gang`. `start_timeout_s` bounds the wait for every rank to join. Each rank takes the machine's
    CPUs divided among the ranks as torch threads, at most as many as the driver's `torch.get_num_threads()`."""

    def __init__(self, world_size: int, *, device: str = "auto", name: str = "gang", timeout_s: float = 600.0,
                 start_timeout_s: float = 120.0, env: Mapping[str, str] | None = None):
        super().__init__(world_size, device=device, name=name, timeout_s=timeout_s, env=env)
        check_seconds("start_timeout_s", start_timeout_s)
        self.start_timeout_s = start_timeout_s
        self._procs: list = []
        self._conns: list = []

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def _resolve_device(self) -> str:
        return local_device(self.requested_device)

    def _check_placement(self) -> None:
        check_local_placement(self.world_size, self.device)

    def _start(self) -> None:
        ctx = rank_process_context(self.device)
        port = free_port()
        # The machine's CPUs shared by the ranks, and no more threads than the driver uses itself (a driver pinned
        # to one thread, as under pytest-xdist, must not have its ranks' OpenMP threads spin against each other).
        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // self.world_size))
        for rank in range(self.world_size):
            spec = RankSpec(rank=rank, world_size=self.world_size, local_rank=rank,
                            local_world_size=self.world_size, node_rank=0, master_addr="127.0.0.1",
                            master_port=port, device_type=self.device,
                            device_index=rank if self.device == "cuda" else None, timeout_s=self.timeout_s,
                            num_threads=threads, env=self.env)
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_serve, args=(spec, child, dict(os.environ)), name=f"{self.name}.rank{rank}",
                               daemon=True)
            with _ranks_ignore_sigint():
                proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        names = self._replies(self.start_timeout_s, "process-group init")
        self.ranks = [{"rank": r, "local_rank": r, "node_rank": 0, "pid": p.pid, "device_name": n,
                       "device_index": r if self.device == "cuda" else None}
                      for r, (p, n) in enumerate(zip(self._procs, names))]

    def _submit(self, fn: Callable[..., Any], args: tuple, kwargs: dict, label: str) -> bytes:
        return pickle.dumps((fn, args, kwargs))

    def _collect(self, msg: bytes, label: str, timeout_s: float) -> list:
        for conn in self._conns:
            conn.send_bytes(msg)
        return self._replies(timeout_s, f"{self.name}:{label}")

    def _replies(self, timeout_s: float, what: str) -> list:
        """One reply per rank; the first error, a death or the deadline raises at once. The driver sleeps in
        `multiprocessing.connection.wait` on the pending ranks' pipes and process sentinels: a dead rank's pipe
        reads EOF (and its sentinel fires), which ends the wait with that rank named, not the deadline."""
        deadline = time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in results]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what}: ranks {pending} still running after {timeout_s:g} s")
            conns = {self._conns[r]: r for r in pending}
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = mpc.wait([*conns, *sentinels], timeout=remaining)
            for obj in ready:  # replies first: a rank that answered, then exited, has answered
                if obj not in conns:
                    continue
                rank = conns[obj]
                try:
                    status, payload = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):  # its end of the pipe closed: the rank is gone
                    raise self._died(what, rank) from None
                if status == "error":
                    exc, text = payload
                    err = exc if exc is not None else RankFailed(text.strip().splitlines()[-1])
                    err.add_note(f"(raised on rank {rank} during {what})\n--- remote traceback ---\n{text}")
                    raise self._dead_rank(what, err) or err
                results[rank] = payload
            for obj in ready:
                rank = sentinels.get(obj)
                # an exited rank whose pipe still holds a reply (or the EOF) is read on the next pass
                if rank is not None and rank not in results and not self._conns[rank].poll():
                    raise self._died(what, rank)
        return [results[r] for r in range(self.world_size)]

    def _died(self, what: str, rank: int) -> RankFailed:
        proc = self._procs[rank]
        proc.join(timeout=2.0)  # its pipe closes as it exits, a moment before it can be reaped
        code = proc.exitcode
        if code is None:
            how = "closed its pipe to the driver"
        elif code < 0:
            how = f"was killed by {_signal_name(-code)} (exit code {code})"
        else:
            how = f"exited with code {code}"
        return RankFailed(f"{what}: rank {rank} (pid {proc.pid}) {how}")

    def _dead_rank(self, what: str, err: BaseException, grace_s: float = 1.0) -> RankFailed | None:
        """A dead rank makes its peers' collectives fail too; report the death, not the echo (waiting up to
        `grace_s` on the other ranks' sentinels for one to exit)."""
        deadline = time.monotonic() + grace_s
        dead = [r for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)]
        alive = {p.sentinel: r for r, p in enumerate(self._procs) if p.exitcode is None}
        while not dead and alive and (remaining := deadline - time.monotonic()) > 0:
            exited = mpc.wait(list(alive), timeout=remaining)
            if not exited:
                break
            for sentinel in exited:
                rank = alive.pop(sentinel)
                self._procs[rank].join(timeout=1.0)
                if self._procs[rank].exitcode not in (None, 0):
                    dead.append(rank)
        if not dead:
            return None
        death = self._died(what, dead[0])
        death.add_note(f"(errors that followed: {type(err).__name__}: {str(err).splitlines()[0][:200]})")
        return death

    def shutdown(self) -> None:
        """Ask healthy ranks to leave the group and exit; kill whatever is still running after 10 s."""
        if not self.broken:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # BrokenPipeError included: that rank is gone
                    conn.send_bytes(b"")
        deadline = time.monotonic() + (10.0 if not self.broken else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
