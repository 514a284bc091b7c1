"""The matmul SM carve-out (parallel/carveout.py) and when the wrappers hold it: DDP from its first overlapped
all-reduce to the end of the synchronisation, FSDP from forward to the end of the synchronisation."""

import pytest
import torch
from torch import nn

from parallel.carveout import SMCarveout, check_sm_carveout
from parallel.ddp import BucketedDDP, OverlappedDDP
from parallel.fsdp import FSDP
from tests.parallel.dist_utils import run_ranks

get = torch._C._get_sm_carveout_experimental


@pytest.fixture(autouse=True)
def _no_carveout():
    torch._C._set_sm_carveout_experimental(None)
    yield
    torch._C._set_sm_carveout_experimental(None)


@pytest.mark.parametrize("bad", [-1, 2.0, "8", True])
def test_bad_carveout_is_a_value_error(bad):
    with pytest.raises(ValueError, match="sm_carveout"):
        check_sm_carveout(bad)
    with pytest.raises(ValueError, match="sm_carveout"):
        SMCarveout(bad)


def test_enter_sets_and_exit_restores_the_previous_value():
    torch._C._set_sm_carveout_experimental(5)
    carve = SMCarveout(3)
    carve.enter()
    carve.enter()  # idempotent: the value to restore stays 5
    assert get() == 3
    carve.exit()
    assert get() == 5
    carve.exit()
    assert get() == 5
    off = SMCarveout(None)
    off.enter()
    assert get() == 5 and not off.active


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))


def _carveout_timeline(rank, world_size):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, wrap in (("bucketed", lambda m: BucketedDDP(m, 0.0001, sm_carveout=3)),
                       ("overlapped", lambda m: OverlappedDDP(m, sm_carveout=3)),
                       ("fsdp", lambda m: FSDP(m, sm_carveout=2))):
        model = wrap(_model())
        seen = []
        for _ in range(2):  # the second step starts from the restored value again
            loss = model(x).square().sum()
            seen.append(get())
            loss.backward()
            seen.append(get())
            model.finish_gradient_synchronization()
            seen.append(get())
        model.remove_hooks()
        out[name] = seen
    return out


def test_wrappers_hold_the_carveout_only_while_collectives_overlap_compute():
    for result in run_ranks(_carveout_timeline, 2):
        assert result["bucketed"] == [None, 3, None] * 2
        assert result["overlapped"] == [None, 3, None] * 2
        assert result["fsdp"] == [2, 2, None] * 2


def test_wrapper_rejects_a_bad_carveout_before_communicating():
    with pytest.raises(ValueError, match="sm_carveout"):  # no process group needed to reject it
        BucketedDDP(_model(), 25, sm_carveout=-2)
