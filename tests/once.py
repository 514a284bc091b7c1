"""A fixture value computed once per test run, however many pytest-xdist workers use it.

A module-scoped fixture runs once per worker that runs one of its tests; with `-n 2` a fixture that spawns ranks
for a minute ran twice, in both workers at once. `once_per_run` computes the value in the first worker to ask, under
a lock in the run's shared temporary directory, and the others read its pickle (they wait for it rather than compute
it beside the first: on two cores that is what a second computation would cost anyway). Without xdist it just
computes.

    @pytest.fixture(scope="module")
    def per_rank(tmp_path_factory):
        return once_per_run(tmp_path_factory, "fsdp_per_rank", lambda: run_ranks(_all_checks, 2))
"""

from __future__ import annotations

import fcntl
import os
import pickle
from typing import Callable, TypeVar

T = TypeVar("T")


def once_per_run(tmp_path_factory, name: str, compute: Callable[[], T]) -> T:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # <tmp>/pytest-N: this run's, shared by its workers
    path = shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()  # an exception leaves no file: the next worker computes it again (and fails the same way)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(value))
        os.replace(tmp, path)
        return value
