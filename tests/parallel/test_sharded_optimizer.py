"""ShardedOptimizer against the unsharded optimizer, on 2 gloo ranks (with BucketedDDP averaging gradients).

Each rank trains on its slice of the batch; the reference is one plain optimizer over a replica trained on
the whole batch. Parameters must agree after every step, the state must really be split, and the
consolidated state dict must equal the plain optimizer's and resume training exactly, at any world size.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.ddp import BucketedDDP
from parallel.sharded_optimizer import ShardedOptimizer, local_state_bytes
from raysys.model.transformer import AdamW as RaysysAdamW
from tests.once import once_per_run
from tests.parallel.dist_utils import run_ranks
from tests.parallel.test_ddp import TiedModel, ToyModel, _batch

pytestmark = pytest.mark.multiproc

WORLD_SIZE = 2
ATOL = 1e-6
HPARAMS = dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
OPTIMIZERS = {"torch_adamw": torch.optim.AdamW, "raysys_adamw": RaysysAdamW}


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _step(model: nn.Module, optimizer, x, y, finish=None) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if finish is not None:
        finish()
    optimizer.step()


def _local(x, rank: int, world_size: int):
    return x.chunk(world_size)[rank]


def _equivalence(rank: int, world_size: int) -> dict:
    results = {}
    for opt_name, optimizer_cls in OPTIMIZERS.items():
        for model_cls in (ToyModel, TiedModel):
            torch.manual_seed(0)
            reference = model_cls()
            ddp = BucketedDDP(copy.deepcopy(reference), bucket_size_mb=0.003)
            ref_opt = optimizer_cls(reference.parameters(), **HPARAMS)
            # 0.002 MiB broadcast buckets: rank 1's two small matrices travel together, rank 0's alone.
            sharded = ShardedOptimizer(ddp.parameters(), optimizer_cls, bucket_size_mb=0.002, **HPARAMS)
            diffs = []
            for step in range(10):
                x, y = _batch("toy", step)
                _step(reference, ref_opt, x, y)
                _step(ddp, sharded, _local(x, rank, world_size), _local(y, rank, world_size),
                      ddp.finish_gradient_synchronization)
                diffs.append(_max_diff(reference, ddp.module))
            params = list(ddp.module.parameters())
            position = {id(p): i for i, p in enumerate(params)}
            owned = [i for i, p in enumerate(params) if sharded.owner_of(p) == rank]
            results[f"{opt_name}/{model_cls.__name__}"] = dict(
                diffs=diffs, owners=[sharded.owner_of(p) for p in params], owned=owned,
                state_params=sorted(position[id(p)] for p in sharded.local_optimizer.state),
                state_bytes=local_state_bytes(sharded), full_state_bytes=local_state_bytes(ref_opt),
                loads=sharded.owned_numel)
    return results


def _all_checks(rank: int, world_size: int) -> dict:
    """Everything the tests below assert on, computed in one spawn of the ranks (spawns are slow)."""
    return {"equivalence": _equivalence(rank, world_size), "checkpoint": _checkpoint_and_groups(rank, world_size)}


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> list[dict]:
    return once_per_run(tmp_path_factory, "sharded_optimizer_checks", lambda: run_ranks(_all_checks, WORLD_SIZE))


def test_sharded_matches_unsharded_and_splits_state(checks):
    results = [c["equivalence"] for c in checks]
    for case in results[0]:
        r0, r1 = results[0][case], results[1][case]
        for rank, r in enumerate((r0, r1)):
            assert max(r["diffs"]) <= ATOL, f"{case} rank {rank}: parameter diffs per step {r['diffs']}"
            # State exists only for owned parameters (frozen ones own no state anywhere).
            assert set(r["state_params"]) <= set(r["owned"]), case
            assert 0 < r["state_bytes"] < r["full_state_bytes"], case
        assert r0["owners"] == r1["owners"], f"{case}: ranks disagree on the assignment"
        assert set(r0["owned"]).isdisjoint(r1["owned"]) and len(r0["owned"]) + len(r1["owned"]) == len(r0["owners"])
        assert r0["state_bytes"] + r1["state_bytes"] == pytest.approx(r0["full_state_bytes"], rel=0.02), case
    # Greedy largest-first on ToyModel's element counts (fc2.w 500, fc3.w 250, fc1.w 100, fc2.b 50, fixed 2):
    # 500 -> rank 0, then everything else fits under it on rank 1. In parameters() order (the module's own
    # parameter first): no_grad_fixed_param, fc1.w, fc2.w, fc2.b, fc3.w.
    assert results[0]["torch_adamw/ToyModel"]["loads"] == [500, 402]
    assert results[0]["torch_adamw/ToyModel"]["owners"] == [1, 1, 0, 1, 1]


def _checkpoint_and_groups(rank: int, world_size: int) -> dict:
    out = {}
    # --- state_dict round trip: consolidate after 4 steps, resume in a fresh optimizer and in a 1-rank one.
    torch.manual_seed(0)
    reference = ToyModel()
    ddp = BucketedDDP(copy.deepcopy(reference), bucket_size_mb=0.003)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HPARAMS)
    sharded = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **HPARAMS)
    for step in range(4):
        x, y = _batch("toy", step)
        _step(reference, ref_opt, x, y)
        _step(ddp, sharded, _local(x, rank, world_size), _local(y, rank, world_size),
              ddp.finish_gradient_synchronization)
    consolidated = sharded.state_dict()
    expected = ref_opt.state_dict()
    out["groups_equal"] = consolidated["param_groups"] == expected["param_groups"]
    out["state_keys_equal"] = sorted(consolidated["state"]) == sorted(expected["state"])
    out["state_diff"] = max((consolidated["state"][i][k].float() - v.float()).abs().max().item()
                            for i, s in expected["state"].items() for k, v in s.items())
    out["all_cpu"] = all(v.device.type == "cpu" for s in consolidated["state"].values() for v in s.values())
    # A plain optimizer accepts the consolidated dict.
    plain = torch.optim.AdamW(copy.deepcopy(reference).parameters(), **HPARAMS)
    plain.load_state_dict(consolidated)

    # Resume (a) 2 ranks, new optimizer; (b) each rank alone in a 1-rank group (a different world size).
    singletons = [dist.new_group([r]) for r in range(world_size)]
    resumed = {}
    for name, group in (("two_ranks", None), ("one_rank", singletons[rank])):
        model = copy.deepcopy(ddp.module)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, **HPARAMS)
        opt.load_state_dict(consolidated)
        resumed[name] = (model, opt)
    diffs = {name: [] for name in resumed}
    for step in range(4, 8):
        x, y = _batch("toy", step)
        _step(reference, ref_opt, x, y)
        for name, (model, opt) in resumed.items():
            _step(model, opt, x, y)       # the full batch on every rank: no DDP needed to match
            diffs[name].append(_max_diff(reference, model))
    out["resume_diffs"] = diffs

    # --- add_param_group after construction (unfreezing fc3 with its own lr) and an lr change, both AdamWs.
    for opt_name, optimizer_cls in OPTIMIZERS.items():
        torch.manual_seed(0)
        reference = ToyModel()
        model = copy.deepcopy(reference)
        ref_opt = optimizer_cls([reference.fc1.weight, reference.fc2.weight], **HPARAMS)
        opt = ShardedOptimizer([model.fc1.weight, model.fc2.weight], optimizer_cls, **HPARAMS)
        loads_before = opt.owned_numel
        group_diffs = []
        for step in range(6):
            if step == 3:
                ref_opt.add_param_group({"params": [reference.fc3.weight], "lr": 0.01})
                opt.add_param_group({"params": [model.fc3.weight], "lr": 0.01})
            if step == 4:   # a scheduler's change to the wrapper's group reaches the local shard
                ref_opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] = 0.02
            x, y = _batch("toy", step)
            _step(reference, ref_opt, x, y)
            _step(model, opt, x, y)
            group_diffs.append(_max_diff(reference, model))
        out[f"add_group/{opt_name}"] = dict(diffs=group_diffs, loads_before=loads_before, loads_after=opt.owned_numel,
                                            lr=opt.param_groups[1]["lr"])
    return out


def test_state_dict_round_trip_and_add_param_group(checks):
    for rank, r in enumerate(c["checkpoint"] for c in checks):
        assert r["groups_equal"] and r["state_keys_equal"] and r["all_cpu"], r
        assert r["state_diff"] <= ATOL, r["state_diff"]
        for name, diffs in r["resume_diffs"].items():
            assert max(diffs) <= ATOL, f"rank {rank} resumed on {name}: {diffs}"
        for opt_name in OPTIMIZERS:
            g = r[f"add_group/{opt_name}"]
            assert max(g["diffs"]) <= ATOL, f"rank {rank} {opt_name}: {g['diffs']}"
            assert g["loads_before"] == [500, 100] and g["loads_after"] == [500, 350] and g["lr"] == 0.01


def test_bad_arguments_are_value_errors():
    # Checked before anything touches torch.distributed, so no process group is needed here.
    with pytest.raises(ValueError, match=r"optimizer_cls \('AdamW'\) must be a torch.optim.Optimizer subclass"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), "AdamW")
    with pytest.raises(ValueError, match=r"bucket_size_mb \(-1\) must be a finite number >= 0"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, bucket_size_mb=-1, lr=0.1)
    with pytest.raises(ValueError, match="process group"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
