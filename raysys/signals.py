"""SIGTERM as Ctrl-C: what lets `timeout`, `ray job stop` and batch schedulers stop a run cleanly."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["interrupt_on_sigterm"]


@contextlib.contextmanager
def interrupt_on_sigterm():
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does.

    `timeout`, `ray job stop` and batch schedulers stop a process with SIGTERM. By default that kills it on
    the spot, and a Ray driver's handler (installed by `ray.init`) exits from inside the signal handler; either
    way `finally` blocks may not get to stop gangs and Tune trials. With this, cleanup runs and the rows already
    written stay. The previous handler comes back afterwards. An application's own handler (not the default,
    not Ray's) is left alone, as is everything in a worker thread; so blocks nest.
    """
    previous = signal.getsignal(signal.SIGTERM)
    ours = previous in (signal.SIG_DFL, None) or getattr(previous, "__module__", "").startswith("ray.")
    if threading.current_thread() is not threading.main_thread() or not ours:
        yield
        return

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
