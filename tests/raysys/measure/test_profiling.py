"""raysys.measure.profiling's Dynamo guard log: what a compiled function guards on, collected and counted by kind."""

from __future__ import annotations

import torch

from raysys.measure.profiling import dynamo_guard_log, guard_kinds


def test_guard_log_of_a_compiled_function_counts_its_guards_by_kind():
    torch._dynamo.reset()
    scale = {"factor": 2.0}

    @torch.compile(backend="eager")
    def f(x):
        return x * scale["factor"]

    with dynamo_guard_log() as log:
        f(torch.ones(3))
    kinds = guard_kinds(log.getvalue())
    assert kinds.get("TENSOR_MATCH", 0) >= 1, log.getvalue()[:2000]      # the input
    assert sum(n for k, n in kinds.items() if k.endswith("_MATCH")) >= 2, kinds  # and the dict read inside
    assert list(kinds.values()) == sorted(kinds.values(), reverse=True)
    with dynamo_guard_log() as log:  # compiled already: nothing new is logged
        f(torch.ones(3))
    assert guard_kinds(log.getvalue()) == {}
