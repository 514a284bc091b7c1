"""sweeps/common.py: the frozen trials, the flags every study shares, the checks that run before Ray starts, and
what a study prints when it is interrupted."""

from __future__ import annotations

import dataclasses

import pytest

from raysys.cluster.sweep import run_sweep
from sweeps import common
from sweeps import ddp as ddp_sweep

TINY = dict(size="tiny", context_length=16, batch_per_rank=2, warmup=1, steps=2)


def _what_the_rank_got(ctx, trial) -> dict:
    return {"trial_type": type(trial).__name__, "model_layers": trial.model_config().num_layers}


@pytest.mark.multiproc
def test_a_frozen_trial_reaches_the_rank_as_itself(tmp_path):
    """run_sweep hands each trial to the ranks as the object the study built (not a dict of its fields), and the
    row's configuration is the trial's mapping."""
    trials = ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["naive", "overlapped@4"], profile=[], **TINY)
    df = run_sweep("kinds", trials, _what_the_rank_got, 1, tmp_path, device="cpu", launcher="mp", show=False)
    assert (df["status"] == "ok").all(), df[["status", "error"]]
    assert df["trial_type"].tolist() == ["DDPTrial", "DDPTrial"] and (df["model_layers"] == 2).all()
    assert df["label"].tolist() == ["naive", "overlapped @4 CTAs"]
    # a variant without a cap of its own has no sm_carveout column (the ids of rows written before stay)
    assert "sm_carveout" not in dict(trials[0]) and dict(trials[1])["sm_carveout"] is None


def test_trials_are_frozen_and_checked():
    trial = ddp_sweep.ddp_trials(dtypes=["fp32"], variants=["flat"], profile=[], **TINY)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        trial.steps = 5
    for change, match in ((dict(steps=1), "steps"), (dict(dtype="fp8"), "fp8"), (dict(size="huge"), "huge"),
                          (dict(context_length=0), "context_length"), (dict(batch_per_rank=0), "batch_per_rank"),
                          (dict(variant="ring"), "ring"), (dict(max_steps=1), "max_steps")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(trial, **change)
    assert ddp_sweep.DDPTrial.of(dict(trial)) == trial and ddp_sweep.DDPTrial.of(trial) is trial
    x, y = trial.batch(common.torch.device("cpu"), rank=1)
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()
