"""The Ray layer on the session's simulated two-node cluster (CPU, gloo): gangs give the right collective
values, ranks/env are set up as documented, SPREAD spans nodes, impossible requests fail fast, and
run_sweep turns a dead actor / a hang / an exception into rows and goes on, and resumes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group_table

from parallel.collectives import Buffers, run_collective
from raysys.cluster.gang import NodeInfo, check_placement
from raysys.cluster.sweep import Gang, PlacementInfeasible, ProcessGang, run_sweep
from raysys.results.records import read_results

pytestmark = pytest.mark.ray
# pytest imports this file as a top-level module the Ray workers cannot import: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _live_placement_groups() -> int:
    return sum(1 for pg in placement_group_table().values() if pg["state"] != "REMOVED")


# ---------------------------------------------------------------------------------------------------- no Ray work
def test_check_placement_says_what_was_asked_and_what_exists():
    two_by_two = [NodeInfo("a", "10.0.0.1", 16, 2), NodeInfo("b", "10.0.0.2", 16, 2)]
    with pytest.raises(PlacementInfeasible) as err:
        check_placement(4, device="cuda", strategy="STRICT_PACK", cpus_per_rank=1, nodes=two_by_two)
    assert str(err.value) == ("asked for 4 ranks with 1 GPU each in one node (STRICT_PACK); "
                              "the cluster has 2 node(s) with 2, 2 GPUs")
    check_placement(4, device="cuda", strategy="PACK", cpus_per_rank=1, nodes=two_by_two)  # fits across nodes
    with pytest.raises(PlacementInfeasible, match="on distinct nodes"):
        check_placement(3, device="cuda", strategy="STRICT_SPREAD", cpus_per_rank=1, nodes=two_by_two)
    with pytest.raises(PlacementInfeasible, match=r"with 2 CPU each in the cluster \(SPREAD\).*16, 16 CPUs"):
        check_placement(17, device="cpu", strategy="SPREAD", cpus_per_rank=2, nodes=two_by_two)
    check_placement(16, device="cpu", strategy="SPREAD", cpus_per_rank=2, nodes=two_by_two)


def test_gang_rejects_bad_arguments():
    for kwargs, match in [({"strategy": "PACKED"}, "strategy 'PACKED'"), ({"device": "tpu"}, "device 'tpu'"),
                          ({"gpu_visibility": "all"}, "gpu_visibility 'all'"), ({"timeout_s": 0}, "timeout_s"),
                          ({"cpus_per_rank": 0}, "cpus_per_rank")]:
        with pytest.raises(ValueError, match=match):
            Gang(2, **kwargs)
    with pytest.raises(ValueError, match="world_size"):
        Gang(0)
    with pytest.raises(ValueError, match="launcher 'slurm'"):
        run_sweep("x", [{}], _toy_trial, 2, launcher="slurm")
    for env, match in [({"NCCL_NVLS_ENABLE": "1"}, "multicast must stay off"), ({"NCCL ALGO": "Ring"}, "name"),
                       ({"NCCL_ALGO": 1}, "str value")]:
        for make in (Gang, ProcessGang):
            with pytest.raises(ValueError, match=match):
                make(2, env=env)


def _infos(*nodes_gpus: tuple[str, list[str], str | None]) -> list[dict]:
    """describe() results of rank-ordered actors: (node id, Ray's GPU ids, CUDA_VISIBLE_DEVICES)."""
    return [{"node_id": node, "ip": f"10.0.0.{ord(node[-1])}", "gpu_ids": gpus, "cuda_visible_devices": visible}
            for node, gpus, visible in nodes_gpus]


@pytest.mark.parametrize("visibility", ["shared", "isolated"])
def test_rank_specs_gpu_visibility(visibility):
    """Without GPUs: what each rank of a two-node CUDA gang is told to see and use."""
    gang = Gang(4, device="cuda", gpu_visibility=visibility, timeout_s=30)
    gang.device = "cuda"
    # Ray gave node a GPUs 3 and 1 (in rank order: out of order), node b GPUs 0 and 2.
    infos = _infos(("a", ["3"], "3"), ("a", ["1"], "1"), ("b", ["0"], "0"), ("b", ["2"], "2"))
    gang.env = {"NCCL_ALGO": "Ring"}
    specs = gang._rank_specs(infos, port=12345)
    assert all(s.env == {"NCCL_ALGO": "Ring"} for s in specs)  # every rank gets the gang's env
    assert [(s.rank, s.node_rank, s.local_rank, s.local_world_size) for s in specs] == \
        [(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)]
    assert {(s.master_addr, s.master_port, s.backend, s.timeout_s) for s in specs} == {("10.0.0.97", 12345, "nccl", 30)}
    if visibility == "shared":  # a node's ranks all see its gang GPUs and take them in order: NVLink P2P works
        assert [s.visible_devices for s in specs] == ["1,3", "1,3", "0,2", "0,2"]
        assert [s.device_index for s in specs] == [0, 1, 0, 1]
    else:  # Ray's per-actor isolation: each rank sees only its GPU, as cuda:0
        assert [s.visible_devices for s in specs] == [None] * 4
        assert [s.device_index for s in specs] == [0, 0, 0, 0]
    # With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES every actor sees all GPUs: use the own one's index.
    nonset = gang._rank_specs(_infos(("a", ["1"], None), ("a", ["0"], None), ("b", ["0"], None), ("b", ["1"], None)),
                              port=1)
    assert [s.device_index for s in nonset] == ([0, 1, 0, 1] if visibility == "shared" else [1, 0, 0, 1])


# ---------------------------------------------------------------------------------------------------- gangs
def test_more_gpus_than_exist_fails_fast(ray_cluster, monkeypatch):
    import raysys.cluster.gang

    def reserve(*args, **kwargs):
        raise AssertionError("a placement group was asked for: the gang waited for resources that never come")

    before = _live_placement_groups()
    monkeypatch.setattr(raysys.cluster.gang, "placement_group", reserve)  # fast = refused before any reservation or actor
    # A cluster with no GPU at all is refused when the device is resolved; one with too few GPUs by the
    # placement check (its message is tested above on fake nodes).
    with pytest.raises(ValueError, match=r"device 'cuda' requested but the Ray cluster \(2 node\(s\).* has no CUDA GPU"):
        with Gang(2, device="cuda", name="too-big"):
            pass
    assert _live_placement_groups() == before  # nothing was reserved


def _rank_report(ctx, numel: int) -> dict:
    """Everything a rank should have been given, plus the three collectives on rank-dependent data."""
    group = ctx.process_group
    x = torch.arange(numel, dtype=torch.float32) * (ctx.rank + 1)
    reduced = x.clone()
    run_collective(Buffers("all_reduce", reduced, reduced), group)
    gathered = torch.empty(numel * ctx.world_size)
    run_collective(Buffers("all_gather", x, gathered), group)
    scattered = torch.empty(numel // ctx.world_size)
    run_collective(Buffers("reduce_scatter", x, scattered), group)
    ctx.barrier()
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                          "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                          "NVSHMEM_DISABLE_NVLS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    return {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank,
            "backend": ctx.backend, "device": str(ctx.device), "threads": torch.get_num_threads(), "env": env,
            "node_id": ray.get_runtime_context().get_node_id(), "all_reduce": reduced, "all_gather": gathered,
            "reduce_scatter": scattered}


def test_cuda_on_a_cluster_without_gpus_is_a_value_error(ray_cluster):
    from raysys.cluster.gang import gang_device

    if ray.cluster_resources().get("GPU", 0):
        pytest.skip("this cluster has GPUs")
    with pytest.raises(ValueError, match="device 'cuda' requested but the Ray cluster .* has no CUDA GPU"):
        gang_device("cuda")
    with pytest.raises(ValueError, match="device 'cuda:0' must be one of"):
        gang_device("cuda:0")  # a gang gives each rank its GPU; it cannot be pinned to one
    assert gang_device("auto") == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,strategy", [(2, "SPREAD"), (4, "STRICT_PACK")])
def test_gang_collectives_ranks_and_placement(ray_cluster, world_size, strategy):
    numel = 12
    before = _live_placement_groups()
    with Gang(world_size, device="cpu", strategy=strategy, name=f"test-{strategy.lower()}") as gang:
        assert gang.backend == "gloo" and len(gang.actors) == world_size
        names = [info["actor_name"] for info in gang.ranks]
        assert names[1].startswith(f"test-{strategy.lower()}#") and names[1].endswith(".rank1")
        assert ray.get_actor(names[0]) is not None  # visible by its readable name (dashboard, `ray list actors`)
        out = gang.run(_rank_report, numel)
    xs = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(world_size)]
    total = torch.stack(xs).sum(0)
    chunk = numel // world_size
    for r, rep in enumerate(out):
        assert (rep["rank"], rep["world_size"], rep["backend"], rep["device"]) == (r, world_size, "gloo", "cpu")
        assert rep["env"]["RANK"] == str(r) and rep["env"]["WORLD_SIZE"] == str(world_size)
        assert rep["env"]["LOCAL_RANK"] == str(rep["local_rank"]) and rep["env"]["MASTER_PORT"].isdigit()
        assert rep["env"]["NCCL_NVLS_ENABLE"] == "0" and rep["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert rep["env"]["NVSHMEM_DISABLE_NVLS"] == "1" and rep["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert rep["threads"] == 1  # one CPU reserved per rank
        torch.testing.assert_close(rep["all_reduce"], total)
        torch.testing.assert_close(rep["all_gather"], torch.cat(xs))
        torch.testing.assert_close(rep["reduce_scatter"], total[r * chunk:(r + 1) * chunk])
    if strategy == "SPREAD":  # the two ranks landed on the two nodes
        assert out[0]["node_id"] != out[1]["node_id"]
        assert [(rep["node_rank"], rep["local_rank"]) for rep in out] == [(0, 0), (1, 0)]
    else:  # one node: local ranks follow global ranks
        assert len({rep["node_id"] for rep in out}) == 1
        assert [(rep["node_rank"], rep["local_rank"]) for rep in out] == [(0, r) for r in range(world_size)]
    assert _live_placement_groups() == before  # removed on exit
    with pytest.raises(ValueError):  # the actors are gone too
        for _ in range(50):
            ray.get_actor(names[0])
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------- sweeps
def _toy_trial(ctx, config: dict) -> dict:
    """kind ok: all-reduce rank+1 and log the call; die: rank 1 exits; hang: sleep; raise: rank 0 raises."""
    kind = config["kind"]
    if kind == "die" and ctx.rank == 1:
        os._exit(1)
    if kind == "hang":
        time.sleep(600)
    if kind == "raise" and ctx.rank == 0:
        raise ValueError("trial raised on purpose")
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t, group=ctx.process_group)
    Path(config["log"], f"{config['i']}.rank{ctx.rank}").touch()
    return {"total": t.item(), "i": config["i"]}


@pytest.mark.slow
def test_run_sweep_survives_dead_actor_and_hang_then_resumes(ray_cluster, tmp_path):
    log = tmp_path / "calls"
    log.mkdir()
    trials = [{"kind": k, "i": i, "log": str(log)} for i, k in enumerate(["ok", "die", "ok", "hang"])]
    # The trials that end by themselves get a generous limit (a loaded 2-core host once took over 20 s for a fresh
    # gang's first all-reduce), the hang a short one of its own, in a second call that resumes the file. The
    # process-group timeout is far longer than anything these sweeps should wait for.
    group_timeout_s, hang_timeout_s = 300, 2
    stamps = [pd.Timestamp.now(tz="UTC")]
    first = run_sweep("toy", trials[:3], _toy_trial, 2, tmp_path, device="cpu", trial_timeout_s=120,
                      timeout_s=group_timeout_s)
    stamps.append(pd.Timestamp.now(tz="UTC"))
    hung = run_sweep("toy", trials[3:], _toy_trial, 2, tmp_path, device="cpu", resume=True,
                     trial_timeout_s=hang_timeout_s, timeout_s=group_timeout_s, show=False)
    stamps.append(pd.Timestamp.now(tz="UTC"))
    df = pd.concat([first, hung], ignore_index=True)
    assert list(df["status"]) == ["ok", "error", "ok", "timeout"]  # a fresh gang ran trial 2 after the death
    # Nothing waited for the process-group timeout (rank 0 of the dead and of the hung trial sat in a collective
    # that only it ends): a bound on what the code controls, however busy the host. Between two rows (or a call's
    # start or end and its row) lie at most a gang's shutdown, a new gang's start and one trial.
    ends = pd.to_datetime(df["utc"])
    for calls_rows in ([stamps[0], *ends[:3], stamps[1]], [stamps[1], ends[3], stamps[2]]):
        gaps = [(b - a).total_seconds() for a, b in zip(calls_rows, calls_rows[1:])]
        assert max(gaps) < group_timeout_s, gaps
    assert (ends[3] - stamps[1]).total_seconds() >= hang_timeout_s - 1  # the hang ended at its timeout (whole seconds)
    assert list(df.loc[df["status"] == "ok", "total"]) == [3.0, 3.0]
    assert "ActorDied" in df["error"][1] or "RayActorError" in df["error"][1], df["error"][1]
    assert f"still running after {hang_timeout_s} s" in df["error"][3]
    on_disk = read_results(tmp_path / "toy.parquet")
    assert list(on_disk["status"]) == list(df["status"])
    assert {"world_size", "launcher", "device", "gpu_visibility", "backend"} <= set(on_disk.columns)
    assert (on_disk["world_size"] == 2).all() and (on_disk["launcher"] == "ray").all()

    # --resume: the ok trials are not run again, the new one is; failed ones are retried (here: dropped).
    done_calls = sorted(p.name for p in log.iterdir())
    resumed = [t for t in trials if t["kind"] == "ok"] + [{"kind": "ok", "i": 5, "log": str(log)}]
    df2 = run_sweep("toy", resumed, _toy_trial, 2, tmp_path, device="cpu", resume=True, show=False)
    assert sorted(p.name for p in log.iterdir()) == sorted(done_calls + ["5.rank0", "5.rank1"])
    assert list(df2["status"]) == ["ok"] * 3
    old_utc = dict(zip(on_disk["trial_id"], on_disk["utc"]))
    assert all(old_utc[tid] == utc for tid, utc in zip(df2["trial_id"][:2], df2["utc"][:2]))
    assert len(read_results(tmp_path / "toy.parquet")) == 5  # 4 old rows (2 failed) + 1 new


@pytest.mark.slow
@pytest.mark.multiproc
def test_process_gang_sweep_turns_exception_and_death_into_rows(tmp_path):
    trials = [{"kind": "raise", "i": 0, "log": str(tmp_path)}, {"kind": "die", "i": 1, "log": str(tmp_path)}]
    df = run_sweep("toy-mp", trials, _toy_trial, 2, tmp_path, device="cpu", launcher="mp", show=False)
    assert list(df["status"]) == ["error", "error"]
    assert df["error"][0].startswith("ValueError: trial raised on purpose")
    assert "rank 1" in df["error"][1] and "exited with code 1" in df["error"][1]
    assert (df["launcher"] == "mp").all()


def test_process_gang_more_gpus_than_exist_fails_fast():
    have = torch.cuda.device_count()
    with pytest.raises(PlacementInfeasible, match=f"asked for {have + 1} GPUs on this machine .*it has {have}"):
        ProcessGang(have + 1, device="cuda").start()


@pytest.mark.parametrize("given, env, expected", [(None, None, "local"), (None, "10.0.0.9:6379", "10.0.0.9:6379"),
                                                   ("10.0.0.7:6379", None, "10.0.0.7:6379"),
                                                   ("auto", None, "auto")])
def test_init_ray_joins_only_the_cluster_it_is_given(ray_cluster, monkeypatch, given, env, expected):
    """With the session's Ray running on this machine (its address recorded where Ray's `address="auto"` looks),
    a process that names no address starts a Ray of its own instead of joining that one; `--address` and
    RAY_ADDRESS are followed as given."""
    import raysys.cluster.gang

    calls = []

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        calls.append(kwargs["address"])
        raise Stop

    monkeypatch.setattr(raysys.cluster.gang.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(raysys.cluster.gang.ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    with pytest.raises(Stop):
        raysys.cluster.gang.init_ray(given)
    assert calls == [expected]
