"""run_sweep's input is checked before any work, resource-sized input is bounded by the machine, Ctrl-C and
SIGTERM say how far the sweep got, and a lost Ray node or head is said in one line. Plain processes
(`launcher="mp"`), and stand-ins for Ray's calls: no Ray is started here."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from raysys.cluster.rank import MIN_CPU_RANKS, max_cpu_ranks
from raysys.cluster.sweep import PlacementInfeasible, ProcessGang, check_gang, interrupted_message, run_sweep
from raysys.results.records import read_results


def _trial(ctx, config: dict) -> dict:
    return {"rank_sum": ctx.rank, "x2": config["x"] * 2}


def _hostile_metric(ctx, config: dict) -> dict:
    return {"status": "great"}


@pytest.mark.parametrize("config, match", [
    ({"trial_id": "mine"}, "config key 'trial_id' would overwrite"),
    ({"run_id": 1}, "config key 'run_id' would overwrite"),
    ({"world_size": 3}, "trial config world_size=3 contradicts the gang's world_size=1"),
    ({"launcher": "ray"}, "trial config launcher='ray' contradicts the gang's launcher='mp'"),
])
def test_hostile_trial_configs_are_refused_before_anything_runs(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        run_sweep("toy", [{"x": 1}, {"x": 2, **config}], _trial, 1, tmp_path, device="cpu", launcher="mp")
    assert not list(tmp_path.iterdir()) and not multiprocessing.active_children()


def test_timeouts_out_of_bounds_are_refused_before_anything_runs(tmp_path):
    """Issue 48: `timeout_s=1e15` passed and every trial became an OverflowError row."""
    for kwargs, match in (({"timeout_s": 1e15},
                           r"timeout_s \(1000000000000000\.0\) must be a finite number of seconds in \(0, 604800\]"),
                          ({"trial_timeout_s": float("nan")}, r"trial_timeout_s \(nan\)")):
        with pytest.raises(ValueError, match=match):
            run_sweep("toy", [{"x": 1}], _trial, 1, tmp_path, device="cpu", launcher="mp", **kwargs)
    assert not list(tmp_path.iterdir()) and not multiprocessing.active_children()


def test_bad_sweep_names_are_refused(tmp_path):
    for name in ("x" * 300, "../etc", ""):
        with pytest.raises(ValueError, match="sweep name"):
            run_sweep(name, [{"x": 1}], _trial, 1, tmp_path, device="cpu", launcher="mp")


def test_mp_world_size_is_bounded_by_the_machine_before_spawning(tmp_path):
    limit = max_cpu_ranks(len(os.sched_getaffinity(0)), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    assert MIN_CPU_RANKS <= limit < 10**5
    for world_size in (limit + 1, 10**6):
        with pytest.raises(PlacementInfeasible, match=f"asked for {world_size} CPU ranks on this machine"):
            ProcessGang(world_size, device="cpu").start()  # the library call, not only the CLI
        with pytest.raises(PlacementInfeasible, match=f"at most {limit}"):
            check_gang(world_size, device="cpu", launcher="mp")
    assert not multiprocessing.active_children()
    df = run_sweep("toy", [{"x": 1}, {"x": 2}], _trial, 10**6, tmp_path, device="cpu", launcher="mp", show=False)
    assert list(df["status"]) == ["skipped", "skipped"] and "allow at most" in df["error"][0]
    assert not multiprocessing.active_children()
    assert max_cpu_ranks(2, 24 * 2**30) == 8 and max_cpu_ranks(64, 512 * 2**30) == 256
    assert max_cpu_ranks(64, 4 * 2**30) == 16  # memory bounds it too


@pytest.mark.multiproc
@pytest.mark.slow
def test_ctrl_c_says_how_far_the_sweep_got_and_keeps_its_rows(tmp_path, capsys):
    calls = []

    def reduce(config, per_rank):  # runs in the driver: the user presses Ctrl-C during the second trial
        calls.append(config["x"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return per_rank[0]

    trials = [{"x": 1}, {"x": 2}, {"x": 3}]
    with pytest.raises(KeyboardInterrupt) as err:
        run_sweep("toy", trials, _trial, 1, tmp_path, device="cpu", launcher="mp", reduce=reduce, show=False)
    line = interrupted_message("toy", 1, 3, tmp_path / "toy.parquet")
    assert line == (f"toy: interrupted after 1 of 3 trials; its rows are in {tmp_path / 'toy.parquet'}; "
                    "rerun with --resume to continue")
    assert line in capsys.readouterr().err.splitlines() and err.value.__notes__ == [line]
    assert list(read_results(tmp_path / "toy.parquet")["x"]) == [1]
    assert not multiprocessing.active_children()  # the gang was shut down
    df = run_sweep("toy", trials, _trial, 1, tmp_path, device="cpu", launcher="mp", resume=True, show=False)
    assert list(df["x2"]) == [2, 4, 6] and calls == [1, 2]

    with pytest.raises(ValueError, match="metric 'status' would overwrite the row's own 'status' column"):
        run_sweep("hostile", [{"x": 1}], _hostile_metric, 1, tmp_path, device="cpu", launcher="mp", show=False)
    assert not (tmp_path / "hostile.parquet").exists()


_CTRL_C_AT_GANG_START = """
import os, signal, sys, threading, time
from raysys.cluster.studies import run_script
from raysys.cluster.sweep import run_sweep
from tests.raysys.cluster.test_cluster_inputs import _trial


def descendants(pid):
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []
    return [c for child in children for c in [child, *descendants(child)]]


def ctrl_c_while_the_ranks_start():
    while len(descendants(os.getpid())) < 4:  # the resource tracker, the forkserver and both ranks
        time.sleep(0.01)
    time.sleep(0.5)  # the ranks are importing torch
    os.killpg(0, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground process group


def main(argv):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, also when pytest runs with it ignored
    threading.Thread(target=ctrl_c_while_the_ranks_start, daemon=True).start()
    run_sweep("toy", [{"x": 1}], _trial, 2, sys.argv[1], device="cpu", launcher="mp", show=False)


if __name__ == "__main__":
    sys.exit(run_script(main))
"""


@pytest.mark.multiproc
def test_ctrl_c_while_the_ranks_start_is_one_line_naming_no_missing_file(tmp_path):
    """Issue 48: Ctrl-C during the mp gang's start printed every rank's KeyboardInterrupt traceback and a line
    naming a .parquet that was never written. The ranks ignore SIGINT (the driver stops them), and the one line
    says that no row was written."""
    import subprocess
    import sys

    from tests.subprocess_utils import REPO, repo_env

    script = tmp_path / "driver.py"
    script.write_text(_CTRL_C_AT_GANG_START)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], cwd=REPO, env=repo_env(),
                          capture_output=True, text=True, timeout=120, start_new_session=True)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr[-3000:]
    assert "toy: interrupted before any of 1 trials finished; no rows were written" in done.stderr.splitlines()
    assert "toy.parquet" not in done.stderr and not (tmp_path / "out" / "toy.parquet").exists()


def test_a_lost_node_is_said_once_and_resume_runs_the_trials_it_cost(tmp_path, monkeypatch, capsys):
    """Issue 48: a raylet killed during trial 2 of 4 left trial 3 `error` and trial 4 `skipped` (the cluster too
    small now), and `--resume` never ran the skipped one. On a stand-in two-node cluster (no Ray started): the lost
    node is said once and named in the failed row; the skipped rows are `not run:`; resume runs 2, 3 and 4 again."""
    import raysys.cluster.sweep as cluster
    from raysys.cluster.gang import NodeInfo, check_placement
    from raysys.cluster.rank import BaseGang

    nodes = [NodeInfo("a" * 56, "10.0.0.1", 2.0, 0.0), NodeInfo("b" * 56, "10.0.0.2", 2.0, 0.0)]
    state = {"alive": list(nodes), "ran": [], "dies": True}

    class TwoNodeGang(BaseGang):  # one rank per node; node b dies during the first trial with x == 2
        def __init__(self, world_size, *, device, name, timeout_s, env, strategy, **_):
            super().__init__(world_size, device=device, name=name, timeout_s=timeout_s, env=env)
            self.strategy, self.up = strategy, False

        running = property(lambda self: self.up)

        def _resolve_device(self):
            return "cpu"

        def _check_placement(self):
            check_placement(self.world_size, device="cpu", strategy=self.strategy, cpus_per_rank=1,
                            nodes=state["alive"])

        def _start(self):
            self.up, self.ranks = True, [{"rank": r, "device_name": "cpu"} for r in range(self.world_size)]

        def _submit(self, fn, args, kwargs, label):
            return args[0]

        def _collect(self, config, label, timeout_s):
            state["ran"].append(config["x"])
            if config["x"] == 2 and state["dies"]:
                state["alive"], state["dies"] = nodes[:1], False
                raise RuntimeError("ActorDiedError: the actor died unexpectedly before finishing this task")
            return [{"x2": 2 * config["x"]}] * self.world_size

        def shutdown(self):
            self.up = False

    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: {})
    monkeypatch.setattr(cluster, "gang_device", lambda device: "cpu")
    monkeypatch.setattr(cluster, "cluster_nodes", lambda: list(state["alive"]))
    monkeypatch.setattr(cluster, "Gang", TwoNodeGang)
    trials = [{"x": x} for x in (1, 2, 3, 4)]
    df = run_sweep("toy", trials, _trial, 2, tmp_path, device="cpu", strategy="STRICT_SPREAD", show=False)
    assert list(df["status"]) == ["ok", "error", "skipped", "skipped"] and state["ran"] == [1, 2]
    said = [line for line in capsys.readouterr().err.splitlines() if "lost Ray node" in line]
    assert said == [f"toy: lost Ray node {'b' * 12} (10.0.0.2) by trial 2 of 4; the trials it failed or skipped are "
                    "rows that --resume runs again"]
    assert df["error"][1].startswith("RuntimeError: ActorDiedError") and "(10.0.0.2) lost" in df["error"][1]
    assert df["error"][2].startswith("not run: asked for 2 ranks") and "1 node(s)" in df["error"][2]

    state["alive"] = list(nodes)  # the node is back (or the cluster repaired)
    again = run_sweep("toy", trials, _trial, 2, tmp_path, device="cpu", strategy="STRICT_SPREAD", resume=True,
                      show=False)
    assert state["ran"] == [1, 2, 2, 3, 4] and list(again["status"]) == ["ok"] * 4
    assert list(read_results(tmp_path / "toy.parquet")["status"]) == ["ok"] * 4


def test_sigterm_while_ray_starts_is_an_interrupt_and_the_handler_is_ours_again(monkeypatch):
    """Issue 48: SIGTERM during Ray's start exited 15 without a word, because `ray.init` first sets a SIGTERM
    handler of its own, `sys.exit(signum)` (ray._private.worker.init). Under `interrupt_on_sigterm` (every script's
    entry point) it is a KeyboardInterrupt there too, and after a start our handler is back."""
    import signal
    import sys
    import time

    import ray

    import raysys.cluster.gang as gang
    from raysys.cluster.signals import interrupt_on_sigterm

    def ray_init(**kwargs):  # what Ray does first, then the signal arrives while it starts
        ray._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))
        if kwargs["num_cpus"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler runs before this returns
        return type("Context", (), {"dashboard_url": ""})()

    monkeypatch.setattr(gang.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(gang.ray, "init", ray_init)
    monkeypatch.setattr(gang, "cluster_info", lambda: {"dashboard_url": ""})
    monkeypatch.setattr(gang.GcsWatch, "watch", lambda address, embedded: None)
    monkeypatch.setattr(gang.ray, "get_runtime_context", lambda: type("Runtime", (), {"gcs_address": "x:1"})())
    with interrupt_on_sigterm():
        ours = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            gang.init_ray("local", num_cpus=1)
        assert signal.getsignal(signal.SIGTERM) is ours
        gang.init_ray("local", num_cpus=2)  # a start that went through: a later SIGTERM is still an interrupt
        assert signal.getsignal(signal.SIGTERM) is ours


def test_the_watch_notices_a_gcs_that_stops_answering(monkeypatch):
    """Issue 48: after the GCS died the driver exited 1 after 61 s with Ray's message only. `GcsWatch` probes the
    GCS's port: quiet while it answers, and once it has refused for the grace period it says why and calls
    `on_lost` (by default a KeyboardInterrupt in the main thread)."""
    import socket
    import threading

    import raysys.cluster.gang as gang

    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    lost = threading.Event()
    monkeypatch.setattr(gang.ray, "is_initialized", lambda: True)
    watch = gang.GcsWatch(address, grace_s=0.2, period_s=0.02, on_lost=lost.set)
    watch.start()
    assert not lost.wait(0.4) and watch.lost == ""  # 20 probes answered: nothing said
    server.close()
    assert lost.wait(60), "the watch did not notice the closed port"
    assert watch.lost == f"the GCS at {address} stopped answering 0.2 s ago"
    watch.join(timeout=10)
    assert not watch.is_alive()


def test_a_lost_cluster_ends_the_sweep_with_one_line_and_exit_code_1(tmp_path, monkeypatch, capsys):
    """What a sweep does when `GcsWatch` interrupts it: one line that says the cluster was lost, where the rows are
    and to resume, exit code 1; no call that would wait for Ray's end (listing nodes, removing the placement
    group)."""
    import raysys.cluster.sweep as cluster
    from raysys.cluster.gang import NodeInfo
    from raysys.cluster.rank import BaseGang
    from raysys.cluster.studies import run_script

    state = {"lost": "", "node_calls": 0, "shutdowns": 0}

    class HeadDies(BaseGang):  # the GCS dies during the second trial
        def __init__(self, world_size, *, device, name, timeout_s, env, **_):
            super().__init__(world_size, device=device, name=name, timeout_s=timeout_s, env=env)
            self.up = False

        running = property(lambda self: self.up)

        def _resolve_device(self):
            return "cpu"

        def _check_placement(self):
            pass

        def _start(self):
            self.up, self.ranks = True, [{"rank": 0, "device_name": "cpu"}]

        def _submit(self, fn, args, kwargs, label):
            return args[0]

        def _collect(self, config, label, timeout_s):
            if config["x"] == 2:
                state["lost"] = "the GCS at 10.0.0.1:6379 stopped answering 5 s ago"
                raise KeyboardInterrupt  # what GcsWatch's on_lost does to the main thread
            return [{"x2": 2 * config["x"]}]

        def shutdown(self):
            state["shutdowns"] += 1
            self.up = False

    def nodes():
        state["node_calls"] += 1
        return [NodeInfo("a" * 56, "10.0.0.1", 2.0, 0.0)]

    monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: {})
    monkeypatch.setattr(cluster, "gang_device", lambda device: "cpu")
    monkeypatch.setattr(cluster, "cluster_nodes", nodes)
    monkeypatch.setattr(cluster, "gcs_lost", lambda: state["lost"])
    monkeypatch.setattr(cluster, "Gang", HeadDies)

    def main(argv):
        run_sweep("toy", [{"x": x} for x in (1, 2, 3)], _trial, 1, tmp_path, device="cpu", show=False)

    assert run_script(main) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("toy:")]
    assert said == [f"toy: lost its Ray cluster (the GCS at 10.0.0.1:6379 stopped answering 5 s ago) after 1 of 3 "
                    f"trials; its rows are in {tmp_path / 'toy.parquet'}; rerun with --resume once the cluster is back"]
    assert state["node_calls"] == 1 and state["shutdowns"] == 1  # nodes listed at the start only
    assert list(read_results(tmp_path / "toy.parquet")["x"]) == [1]


def test_a_gang_whose_cluster_is_lost_shuts_down_without_waiting_on_the_gcs(monkeypatch):
    """Removing a placement group needs the GCS: without one the call waits until Ray ends the process (60 s). The
    actors are killed (no GCS needed); the placement group is left to the cluster that lost it."""
    import raysys.cluster.gang as gang

    calls = []
    monkeypatch.setattr(gang.ray, "kill", lambda actor, no_restart: calls.append(("kill", actor)))
    monkeypatch.setattr(gang, "remove_placement_group", lambda pg: calls.append(("remove", pg)))
    for lost, expected in (("the GCS at x:1 stopped answering 5 s ago", [("kill", "a0")]),
                           ("", [("kill", "a0"), ("remove", "pg")])):
        monkeypatch.setattr(gang, "gcs_lost", lambda: lost)
        g = gang.Gang(1, device="cpu")
        g.actors, g._pg, g.broken = ["a0"], "pg", True
        calls.clear()
        g.shutdown()
        assert calls == expected and g._pg is None and g.actors == []
