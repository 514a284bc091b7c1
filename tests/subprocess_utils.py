"""Driving a Python process from a test: this checkout on its path, and a signal sent once it reached a point.

    proc = subprocess.Popen([sys.executable, "-m", "raysys", ...], env=repo_env(), stdout=PIPE, stderr=PIPE, text=True)
    out, err = signal_when(proc, lambda: lock.exists(), signal.SIGTERM)   # raises if it exits or stalls first
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (a child imports this checkout)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def signal_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int = signal.SIGTERM, *,
                wait_s: float = 120.0, exit_s: float = 60.0) -> tuple[str | None, str | None]:
    """Send `sig` to `proc` once `ready()` holds, then its (stdout, stderr). Fails the test if `proc` exits first or
    `ready()` does not hold within `wait_s`; kills `proc` if it has not exited `exit_s` after the signal."""
    try:
        deadline = time.monotonic() + wait_s
        while not ready():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"the process exited ({proc.returncode}) before it was ready:\n{out}\n{err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the process was not ready after {wait_s:.0f} s")
            time.sleep(0.1)
        proc.send_signal(sig)
        return proc.communicate(timeout=exit_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
