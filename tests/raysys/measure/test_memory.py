"""raysys.measure.memory between trials: what TrialScope records, on the CPU (parameter counts; no allocator
statistics)."""

import math

import pytest
import torch
from torch import nn

from raysys.measure.memory import TrialScope, live_parameters, release

CPU = torch.device("cpu")


def _leaked(scope: TrialScope) -> int:
    return scope.metrics["live_parameters_after"] - scope.metrics["live_parameters_before"]


def test_trial_scope_counts_the_parameters_a_trial_leaks():
    kept = []
    with TrialScope(CPU) as scope:
        kept.append(nn.Linear(3, 3))               # outlives the trial: weight and bias
        nn.Linear(4, 4)                            # dropped at once
    assert _leaked(scope) == 2
    assert math.isnan(scope.metrics["memory_allocated_before_bytes"])
    assert math.isnan(scope.metrics["memory_reserved_after_bytes"])
    kept.clear()
    assert live_parameters() == scope.metrics["live_parameters_before"]


def test_a_failed_trial_does_not_keep_its_model_alive():
    def trial():
        model = nn.Linear(3, 3)  # noqa: F841  (a local of a frame the traceback holds)
        raise RuntimeError("boom")

    scope = TrialScope(CPU)
    with pytest.raises(RuntimeError, match="boom"):  # pytest keeps the exception, hence its traceback, alive
        with scope:
            trial()
    assert _leaked(scope) == 0


def test_release_removes_a_wrappers_hooks():
    class Wrapper(nn.Module):
        removed = 0

        def remove_hooks(self):
            self.removed += 1

    wrapper = Wrapper()
    release(wrapper)
    release(nn.Linear(2, 2))                       # no remove_hooks: nothing to do
    assert wrapper.removed == 1


def test_trials_scan_only_what_trials_made():
    """Each TrialScope collected garbage and counted parameters over every object of the process, the ~300k of
    torch and its compiler stack included (most of a tiny gang trial's time on a rank): the imports are frozen out of
    the collector's sight once, before the first trial, and a trial's own leaks still count."""
    import gc

    import torch._dynamo.convert_frame

    with TrialScope(CPU):
        pass
    frozen = gc.get_freeze_count()
    scanned = {id(obj) for obj in gc.get_objects()}
    assert frozen > 100_000 and id(torch._dynamo.convert_frame.__dict__) not in scanned
    kept = []
    with TrialScope(CPU) as scope:
        kept.append(nn.Linear(2, 2))
    assert _leaked(scope) == 2
    # Frozen once per process: the list made after the first scope is still in the collector's sight. (The frozen
    # count itself may drop: a frozen object is freed when its last reference goes.)
    assert any(obj is kept for obj in gc.get_objects()) and gc.get_freeze_count() <= frozen
