"""SIGTERM as Ctrl-C: what lets `timeout`, `ray job stop` and batch schedulers stop a run cleanly."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["interrupt_on_sigterm", "keep_sigterm_interrupt"]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


@contextlib.contextmanager
def keep_sigterm_interrupt():
    """Around `ray.init`, which sets a SIGTERM handler of its own (`sys.exit(15)`) as it starts: when
    `interrupt_on_sigterm` was in force, a SIGTERM during the start raises KeyboardInterrupt as it would have (not
    a silent exit 15), and the handler is ours again afterwards. Elsewhere it changes nothing."""
    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _raise_interrupt)
    try:
        yield
    except SystemExit as exc:
        if ours and exc.code == signal.SIGTERM:
            raise KeyboardInterrupt("SIGTERM received") from None
        raise
    finally:
        if ours:
            signal.signal(signal.SIGTERM, _raise_interrupt)


@contextlib.contextmanager
def interrupt_on_sigterm():
    """Within the block, SIGTERM (`timeout`, `ray job stop`, schedulers) raises KeyboardInterrupt in the main thread,
    as Ctrl-C does, so `finally` blocks stop gangs and trials and the rows written stay. The previous handler comes
    back afterwards. An application's own handler (not the default, not Ray's) is left alone, as is everything in
    a worker thread; so blocks nest.
    """
    previous = signal.getsignal(signal.SIGTERM)
    ours = previous in (signal.SIG_DFL, None) or getattr(previous, "__module__", "").startswith("ray.")
    if threading.current_thread() is not threading.main_thread() or not ours:
        yield
        return

    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
