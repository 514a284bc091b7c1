"""A thread of its own that issues a wrapper's collectives, so the thread running backward never waits on them.

On a host-bound step every process-group call issued from a gradient hook adds its host time to backward: torch runs
a backward of CUDA tensors, and every hook, on one autograd device thread, and an asynchronous NCCL all-reduce still
costs that thread 14-30 us (`ProcessGroupNCCL`'s work object, events and stream syncs; results/runs/README.md). With
a `CommThread` the hook only queues the call (about a microsecond) and this thread issues it, while the autograd
thread goes on launching the backward's kernels. Process-group calls release the GIL (torch binds them with
`gil_scoped_release`), so the two threads share it only for the few Python lines around each call. Horovod issues its
collectives from a background thread for the same reason.

Order: calls run one at a time in submission order, so collectives are issued in the order the hooks queued them,
the order every rank must match. Streams: a collective is ordered after the work on the issuing thread's current
CUDA stream, and the current stream is per thread; `use_stream(stream)` makes this thread's current stream the one
backward runs on (autograd runs a backward op on its forward op's stream), before the calls queued after it.
Errors: the first exception a call raises is kept, every later call is skipped (collectives issued after a failed
one would pair with the wrong calls on the other ranks), and `drain()` raises it in the submitting thread.

    comm = CommThread("ddp-comm")
    comm.submit(group.allreduce, [grad], opts)   # from a hook: returns at once
    comm.drain()                                 # every queued call issued (or its error raised)
    comm.close()                                 # the thread exits once the queue is empty
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
from typing import Any, Callable

import torch

__all__ = ["CommThread", "OS_THREAD_NAME"]

OS_THREAD_NAME = "raysys-comm"
"""The name every comm thread has in the OS (`/proc/self/task/<tid>/comm`), where `raysys.timing.IssueClock` finds
it: its CPU time is part of issuing a step."""

_STOP = object()


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (Linux: prctl(PR_SET_NAME); elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _serve(calls: queue.SimpleQueue, errors: list[BaseException]) -> None:
    """The thread's loop: run `(fn, args)` items in order; a `threading.Event` item is set (a drain marker)."""
    _name_os_thread(OS_THREAD_NAME)
    torch.set_grad_enabled(False)  # grad mode is per thread; collectives never need it
    while True:
        item = calls.get()
        if item is _STOP:
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        if errors:
            continue  # after a failed call, issue nothing more (see Errors in the module docstring)
        fn, args = item
        try:
            fn(*args)
        except BaseException as exc:  # handed to the submitter by drain()
            errors.append(exc)
        # Hold nothing while waiting for the next call: a bound method would keep its wrapper alive.
        del item, fn, args


class CommThread:
    """One daemon thread running submitted calls in order (see the module docstring). Holds no reference to what
    submits to it, so a wrapper may hold it and close it from a `weakref.finalize`."""

    def __init__(self, name: str = "raysys-comm"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._stream: tuple[int, int] | None = None  # (device, stream id) of the last use_stream
        self._closed = False
        self._thread = threading.Thread(target=_serve, args=(self._calls, self._errors), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)`; it runs after every call queued before it."""
        if self._closed:
            raise RuntimeError("this CommThread was closed")
        self._calls.put((fn, args))

    def use_stream(self, stream: "torch.cuda.Stream") -> None:
        """Make `stream` the thread's current CUDA stream for the calls queued from now on (no-op if it already is)."""
        # Compared by id: a torch Stream is never `!=` None (its rich comparison answers False for any op on None).
        key = (stream.device_index, stream.stream_id)
        if key != self._stream:
            self._stream = key
            self.submit(torch.cuda.set_stream, stream)

    def drain(self) -> None:
        """Block until every call queued so far has run; raise the first error one of them raised (then forgotten:
        the thread issues again after it)."""
        if self._closed:
            return
        done = threading.Event()
        self._calls.put(done)
        done.wait()
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            raise error

    def close(self) -> None:
        """Let the thread finish what is queued and exit (idempotent; does not wait for it)."""
        if not self._closed:
            self._closed = True
            self._calls.put(_STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
