"""raysys.cluster.rank.BaseGang: the interface Gang (Ray) and ProcessGang (multiprocessing) share, its lifecycle rules
on an in-process stand-in launcher, and ProcessGang held to them with real rank processes (no Ray started here)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from raysys.cluster.gang import Gang
from raysys.cluster.mp_gang import ProcessGang
from raysys.cluster.rank import BaseGang, PlacementInfeasible, RankContext
from tests.subprocess_utils import repo_env


class FakeGang(BaseGang):
    """Ranks as plain calls in this process; `fail` names the step that raises."""

    def __init__(self, world_size: int = 2, fail: str = "", **kwargs):
        super().__init__(world_size, device=kwargs.pop("device", "cpu"), name="fake", timeout_s=5.0, env=None)
        self.fail, self.up, self.shutdowns = fail, False, 0

    @property
    def running(self) -> bool:
        return self.up

    def _resolve_device(self) -> str:
        return "cpu" if self.requested_device == "auto" else self.requested_device

    def _check_placement(self) -> None:
        if self.fail == "placement":
            raise PlacementInfeasible("never fits")

    def _start(self) -> None:
        self.up = True
        if self.fail == "start":
            raise RuntimeError("rank 1 did not join")
        self.ranks = [{"rank": r, "device_name": "cpu"} for r in range(self.world_size)]

    def _submit(self, fn, args, kwargs, label):
        return pickle.dumps((fn, args, kwargs))

    def _collect(self, request, label, timeout_s):
        fn, args, kwargs = pickle.loads(request)
        return [fn(r, *args, **kwargs) for r in range(self.world_size)]

    def shutdown(self) -> None:
        self.up = False
        self.shutdowns += 1


def _rank_times(rank, x):
    return rank * x


def _raise(rank):
    raise ValueError(f"rank {rank} failed on purpose")


def test_both_launchers_implement_the_interface():
    assert issubclass(Gang, BaseGang) and issubclass(ProcessGang, BaseGang)
    assert not Gang.__abstractmethods__ and not ProcessGang.__abstractmethods__
    with pytest.raises(TypeError, match="abstract"):
        BaseGang(2, device="cpu", name="x", timeout_s=1.0, env=None)


@pytest.mark.parametrize("make", [Gang, ProcessGang])
def test_shared_arguments_are_checked_alike_before_anything_starts(make):
    for args, kwargs, match in [((0,), {}, r"world_size \(0\) must be an int >= 1"),
                                ((2.0,), {}, r"world_size \(2.0\) must be an int >= 1"),
                                ((2,), {"device": "cuda:0"}, "device 'cuda:0' must be one of"),
                                ((2,), {"timeout_s": 0}, r"timeout_s \(0\) must be a finite number of seconds"),
                                ((2,), {"timeout_s": 1e15},
                                 r"timeout_s \(1000000000000000\.0\) must be a finite number of seconds in "
                                 r"\(0, 604800\]"),
                                ((2,), {"env": {"NCCL_NVLS_ENABLE": "1"}}, "multicast must stay off")]:
        with pytest.raises(ValueError, match=match):
            make(*args, **kwargs)
    gang = make(2, device="cpu", name="idle")
    assert (gang.device, gang.backend, gang.ranks, gang.broken, gang.running) == ("", "", [], False, False)
    with pytest.raises(RuntimeError, match="gang 'idle' is not running"):
        gang.run(_rank_times, 3)


def test_lifecycle_rules_of_the_base():
    with FakeGang(3) as gang:
        assert (gang.device, gang.backend) == ("cpu", "gloo")
        assert gang.run(_rank_times, 5) == [0, 5, 10]
        assert gang.call(_rank_times, (2,), label="double") == [0, 2, 4]
        with pytest.raises((pickle.PicklingError, AttributeError)):   # nothing reached a rank: still usable
            gang.run(lambda rank: rank)
        assert not gang.broken and gang.run(_rank_times, 1) == [0, 1, 2]
        with pytest.raises(ValueError, match="rank 0 failed on purpose"):
            gang.run(_raise)
        assert gang.broken
        with pytest.raises(RuntimeError, match="broken by an earlier failure"):
            gang.run(_rank_times, 1)
    assert gang.shutdowns == 1 and not gang.running


def test_a_failed_start_is_shut_down_and_broken():
    gang = FakeGang(fail="start")
    with pytest.raises(RuntimeError, match="did not join"):
        gang.start()
    assert gang.broken and gang.shutdowns == 1 and not gang.running
    never = FakeGang(fail="placement")
    with pytest.raises(PlacementInfeasible):
        never.start()
    assert not never.broken and never.shutdowns == 0 and never.device == "cpu"


def _whoami(ctx: RankContext, tag: str) -> dict:
    return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend, "pid": os.getpid(), "tag": tag}


def _fail_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("rank 1 raised on purpose")
    return ctx.rank


def _ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT (bit SIGINT - 1 of SigIgn in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


@pytest.fixture
def terminal_sigint():
    """A terminal's Ctrl-C handler in this process, also when pytest was started with SIGINT ignored (`nohup ... &`)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.multiproc
def test_process_gang_keeps_the_interfaces_rules(terminal_sigint):
    with ProcessGang(2, device="cpu", name="iface", timeout_s=60) as gang:
        assert (gang.device, gang.backend, len(gang.ranks)) == ("cpu", "gloo", 2)
        assert all(_ignores_sigint(r["pid"]) for r in gang.ranks)  # Ctrl-C is the driver's (issue 48)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ... and still reaches it
        out = gang.run(_whoami, "a")
        assert [r["rank"] for r in out] == [0, 1] and {r["backend"] for r in out} == {"gloo"}
        assert [r["pid"] for r in out] == [r["pid"] for r in gang.ranks] and os.getpid() not in [r["pid"] for r in out]
        with pytest.raises((pickle.PicklingError, AttributeError)):   # not picklable: never sent
            gang.run(lambda ctx: ctx.rank)
        assert not gang.broken and gang.call(_whoami, ("b",), label="again")[1]["tag"] == "b"
        with pytest.raises(ValueError, match="rank 1 raised on purpose") as info:
            gang.call(_fail_on_rank_1, label="boom")
        assert "(raised on rank 1 during iface:boom)" in "".join(info.value.__notes__)
        assert gang.broken
        with pytest.raises(RuntimeError, match="broken"):
            gang.run(_whoami, "c")
        procs = list(gang._procs)
    assert not gang.running and not any(p.is_alive() for p in procs)


def _rank_0_hangs_up_then_exits_3(ctx: RankContext) -> None:
    """Rank 0 closes its sockets (its pipe to the driver among them), then exits with code 3 a moment later: the
    order in which a dying rank's pipe and its process sentinel may reach the driver. Rank 1 sleeps."""
    if ctx.rank == 0:
        import stat

        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.close(fd)
            except OSError:
                pass
        time.sleep(0.5)
        os._exit(3)
    time.sleep(60)


@pytest.mark.multiproc
def test_a_dead_rank_is_named_with_its_exit_code_at_once_not_at_the_deadline(monkeypatch):
    """Issue 48: a rank that exits while its peer sleeps (no collective fails to echo it) was noticed only at the
    deadline, the driver spinning on the dead rank's pipe (it reads ready at EOF) meanwhile. Now its EOF ends the
    wait: the rank and its exit code, after a handful of waits, long before the deadline; the same for a rank
    killed while the gang starts."""
    import multiprocessing
    import threading

    import raysys.cluster.mp_gang as mp_gang

    waits = []
    real_wait = mp_gang.mpc.wait

    def counted_wait(objects, timeout=None):
        waits.append(timeout)
        return real_wait(objects, timeout)

    monkeypatch.setattr(mp_gang.mpc, "wait", counted_wait)
    with ProcessGang(2, device="cpu", name="dies", timeout_s=30) as gang:
        waits.clear()
        t0 = time.monotonic()
        with pytest.raises(mp_gang.RankFailed, match=r"dies:exits: rank 0 \(pid \d+\) exited with code 3$"):
            gang.call(_rank_0_hangs_up_then_exits_3, label="exits")
        assert time.monotonic() - t0 < 30 and len(waits) <= 4, waits   # not the deadline, no spinning

    def kill_rank_0_once_spawned():
        while not (ranks := [p for p in multiprocessing.active_children() if p.name == "starting.rank0"]):
            time.sleep(0.01)
        os.kill(ranks[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_0_once_spawned, daemon=True)
    killer.start()
    gang = ProcessGang(2, device="cpu", name="starting", timeout_s=30, start_timeout_s=30)
    with pytest.raises(mp_gang.RankFailed, match=r"process-group init: rank 0 \(pid \d+\) was killed by SIGKILL"):
        gang.start()
    killer.join()
    assert gang.broken and not gang.running and not multiprocessing.active_children()


def _environ(ctx: RankContext, *names: str) -> dict:
    return {name: os.environ.get(name) for name in names}


@pytest.mark.multiproc
def test_process_gang_ranks_see_the_drivers_environment_as_it_is_when_they_start(monkeypatch):
    """Ranks are forked from a forkserver that imported torch once (its environment is the driver's when it started);
    each rank still sees the driver's environment of the moment its gang starts, as a spawned rank would."""
    monkeypatch.setenv("RAYSYS_TEST_SEEN", "first")
    monkeypatch.setenv("RAYSYS_TEST_GONE", "set")
    with ProcessGang(2, device="cpu", name="env", timeout_s=60) as gang:
        assert gang.run(_environ, "RAYSYS_TEST_SEEN", "RAYSYS_TEST_GONE") == [
            {"RAYSYS_TEST_SEEN": "first", "RAYSYS_TEST_GONE": "set"}] * 2
    monkeypatch.setenv("RAYSYS_TEST_SEEN", "second")   # the forkserver, if any, is running since the first gang
    monkeypatch.delenv("RAYSYS_TEST_GONE")
    with ProcessGang(2, device="cpu", name="env", timeout_s=60, env={"NCCL_DEBUG": "WARN"}) as gang:
        seen = gang.run(_environ, "RAYSYS_TEST_SEEN", "RAYSYS_TEST_GONE", "NCCL_DEBUG", "NCCL_NVLS_ENABLE", "RANK")
    assert seen == [{"RAYSYS_TEST_SEEN": "second", "RAYSYS_TEST_GONE": None, "NCCL_DEBUG": "WARN",
                     "NCCL_NVLS_ENABLE": "0", "RANK": str(r)} for r in range(2)]


def _threads(ctx: RankContext) -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.multiproc
def test_process_gang_ranks_take_no_more_threads_than_the_driver():
    """A rank took the machine's CPUs / ranks as threads: 2 under a one-thread pytest worker on 2 cores, whose OpenMP
    threads then spun against the other worker's (tiny steps of ~1 s instead of ~7 ms)."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with ProcessGang(1, device="cpu", name="threads", timeout_s=60) as gang:
            assert gang.run(_threads) == [1]
        torch.set_num_threads(2)
        with ProcessGang(1, device="cpu", name="threads", timeout_s=60) as gang:
            assert gang.run(_threads) == [min(2, os.cpu_count() or 1)]
    finally:
        torch.set_num_threads(before)


_ORPHAN_DRIVER = """
import os, signal, sys, time
from raysys.cluster.rank import die_with_parent, rank_process_context


def child(ready):
    die_with_parent()
    ready.set()
    time.sleep(120)


if __name__ == "__main__":
    ctx = rank_process_context()
    ready = ctx.Event()
    proc = ctx.Process(target=child, args=(ready,), daemon=True)  # as ProcessGang and the test harness start ranks
    proc.start()
    print(proc.pid, flush=True)
    if not ready.wait(60):  # the child has called die_with_parent
        sys.exit("the child did not start")
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs: daemon children would outlive it
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_its_killed_driver(tmp_path):
    """What ProcessGang's ranks and the test harness's ranks do first: when the driver is SIGKILLed (a CI timeout),
    the kernel ends them too, rather than leaving them blocked in a collective."""
    script = tmp_path / "driver.py"
    script.write_text(_ORPHAN_DRIVER)
    log = tmp_path / "driver.out"  # a file, not a pipe: an orphan writing to a pipe nobody reads can die of that
    with open(log, "w") as f:
        returncode = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT, timeout=120,
                                    env=repo_env()).returncode
    assert returncode == -signal.SIGKILL, log.read_text()
    pid = int(log.read_text().split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper is gone too
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except (ProcessLookupError, FileNotFoundError):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"rank {pid} outlived its killed driver")
