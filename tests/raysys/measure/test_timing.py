"""raysys.measure.timing: the step timer (phases, adaptive length, paused collector, ABBA pairing) on sleeping stand-in
steps, and a real TrainStep with compiled blocks (raysys.training.step)."""

from __future__ import annotations

import copy
import gc
import math
import random
import sys
import time
import types

import pytest
import torch

from raysys.measure.timing import (PHASES, Marks, kernel_time, median_ci_rel, median_s, paired_speedups, paired_steps,
                                   time_calls, time_steps)
from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerLM, cross_entropy
from raysys.training.step import TrainStep, compile_blocks


class _Clock:
    """A virtual `perf_counter` that only the stand-in steps move: what a test of the timer's logic reads instead of
    the host's clock, which a loaded CI machine stretches by tens of percent."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _SleepStep:
    """A stand-in TrainStep whose phases sleep for the given seconds (on `clock` when given: virtual time);
    records whether the GC was on."""

    def __init__(self, durations, clock: _Clock | None = None):
        self.device, self.durations, self.calls, self.gc_on = torch.device("cpu"), iter(durations), 0, []
        self.sleep = clock.sleep if clock is not None else time.sleep

    def __call__(self):
        marks = Marks(self.device)
        seconds = next(self.durations)
        for _ in PHASES:
            marks.mark()
            self.sleep(seconds / len(PHASES))
        marks.mark()
        self.calls += 1
        self.gc_on.append(gc.isenabled())
        return marks


class _DriftingStep(_SleepStep):
    """Sleeps `base` seconds times a host slowdown that grows with every step of any _DriftingStep (shared `log`),
    in virtual time (`clock`)."""

    def __init__(self, name, base, log, clock: _Clock):
        super().__init__([], clock)
        self.name, self.base, self.log = name, base, log

    def __call__(self):
        self.log.append(self.name)
        self.durations = iter([self.base * (1 + 0.1 * len(self.log))])
        return super().__call__()


def test_paired_steps_alternate_blocks_and_cancel_drift(monkeypatch):
    clock = _Clock()  # the timer reads virtual time: the drift below is the only one
    monkeypatch.setattr("raysys.measure.timing.time", types.SimpleNamespace(perf_counter=clock, process_time=time.process_time,
                                                                    thread_time=time.thread_time,
                                                                    clock_gettime=time.clock_gettime))
    log = []
    slow, fast = _DriftingStep("slow", 0.004, log, clock), _DriftingStep("fast", 0.002, log, clock)
    out = paired_steps(slow, fast, rounds=4, block=2)
    blocks = [log[i] for i in range(0, len(log), 3)]                # 1 untimed + 2 timed steps per block
    assert blocks == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "slow"] and len(log) == 24
    assert out["paired_rounds"] == 4 and 1.8 < out["paired_ratio"] < 2.2, out
    assert out["paired_ratio_min"] <= out["paired_ratio"] <= out["paired_ratio_max"]
    # How far the median of the rounds' ratios can be trusted: median_ci_rel of those ratios.
    assert 0 < out["paired_ratio_ci_rel"] < 0.5
    assert paired_steps(slow, fast, rounds=2, block=2)["paired_ratio_ci_rel"] == math.inf  # too few rounds
    assert math.isnan(out["paired_allocator_retries"]) and math.isnan(out["paired_cuda_mallocs"])  # no CUDA allocator
    assert out["paired_step_median_s"] > out["paired_reference_median_s"] > 0
    # Timed in trials some steps apart, the slow step looks ~3.5x the fast one (the host slowed down meanwhile).
    first = time_steps(_DriftingStep("fast", 0.002, log, clock), 1, 8)["step_median_s"]
    log.extend(["other trials"] * 20)
    later = time_steps(_DriftingStep("slow", 0.004, log, clock), 1, 8)["step_median_s"]
    assert later / first > 2.6
    with pytest.raises(ValueError, match="rounds"):
        paired_steps(slow, fast, rounds=0)


def test_median_confidence_and_adaptive_step_count():
    assert median_ci_rel([10.0, 10.0, 10.0, 10.0]) == 0.0
    assert median_ci_rel([10.0, 10.0]) == math.inf
    assert 0 < median_ci_rel([9.0, 10.0, 11.0, 10.0, 10.5]) < 0.1
    # Steps alternating 2 ms and 20 ms: the median stays uncertain, so the timer goes on up to max_steps ...
    noisy = _SleepStep([0.002, 0.020] * 20)
    out = time_steps(noisy, warmup=1, steps=4, max_steps=8)
    assert out["timed_steps"] == 8 and noisy.calls == 1 + 8
    assert not any(noisy.gc_on) and gc.isenabled()               # collector paused inside, restored after
    assert out["step_min_s"] <= out["step_median_s"] <= out["step_max_s"]
    assert out["forward_median_s"] > 0 and out["host_backward_median_s"] > 0 and out["cpu_time_per_step_s"] >= 0
    assert out["torch_threads"] == torch.get_num_threads()
    # ... and without max_steps it times exactly `steps`.
    assert time_steps(_SleepStep([0.001] * 10), warmup=0, steps=3)["timed_steps"] == 3
    with pytest.raises(ValueError, match="max_steps"):
        time_steps(noisy, warmup=0, steps=4, max_steps=3)


def test_compiled_blocks_and_the_graphs_the_timer_counts():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_name("tiny", context_length=16))
    eager = copy.deepcopy(model)
    assert compile_blocks(model, backend="aot_eager") == len(model.layers) > 1
    x = torch.randint(0, 256, (2, 17))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = time_steps(TrainStep(model, opt, (x[:, :-1], x[:, 1:]), "fp32", torch.device("cpu")),
                                warmup=1, steps=2)
    assert out["graphs_compiled_warmup"] >= 1 and out["graphs_compiled_timed"] == 0
    # Three optimizer steps later (warm-up + 2), the compiled model took the steps eager training takes.
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        cross_entropy(eager(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="no TransformerBlock"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_paired_speedups_cancel_a_drift_and_alternate_the_order():
    """A GPU whose speed drifts over the run (here 1% slower per timed call) skews a ratio of two blocks timed one
    after the other; alternating rounds recover the true ratio (base 1.2x slower than ours) within the drift."""
    calls = []

    def bench(fn):
        calls.append(fn.__name__)
        return fn() * (1 + 0.01 * len(calls))

    def ours():
        return 1.0

    def base():
        return 1.2

    out = paired_speedups({"fwd": ours}, {"fwd": base}, 5, bench, "sdpa_cudnn")
    assert calls == ["ours", "base", "base", "ours", "ours", "base", "base", "ours", "ours", "base"]
    assert out["paired_rounds"] == 5
    assert out["paired_speedup_fwd_vs_sdpa_cudnn"] == pytest.approx(1.2, rel=0.011)
    assert 0 < out["paired_speedup_fwd_ci_rel"] < 0.05
    blocks = [bench(ours) for _ in range(5)], [bench(base) for _ in range(5)]  # per-provider blocks: skewed
    assert sorted(blocks[1])[2] / sorted(blocks[0])[2] > 1.2 * 1.04


class _BurnStep:
    """Burns `burn_s` of this thread's CPU time, then sleeps a random 0-20 ms (a host whose thread is descheduled
    now and then): its wall time is noisy, its issuing CPU time is not."""

    def __init__(self, burn_s, seed):
        self.device, self.burn_s, self.rng = torch.device("cpu"), burn_s, random.Random(seed)

    def __call__(self):
        marks = Marks(self.device)
        end = time.thread_time() + self.burn_s
        while time.thread_time() < end:
            pass
        time.sleep(self.rng.uniform(0, 0.02))
        for _ in range(len(PHASES) + 1):
            marks.mark()
        return marks


def test_paired_host_cpu_ratio_sees_through_a_jittery_host():
    """The paired ratio of the CPU time a thread spends issuing each step: 2x for a step that burns twice the CPU,
    with a half-width far below the wall-time ratio's, which the random pauses dominate."""
    out = paired_steps(_BurnStep(0.004, 1), _BurnStep(0.002, 2), rounds=6, block=3)
    assert 1.7 < out["paired_host_cpu_ratio"] < 2.3, out
    assert out["paired_host_cpu_ratio_ci_rel"] < min(0.1, out["paired_ratio_ci_rel"])
    timed = time_steps(_BurnStep(0.002, 3), warmup=1, steps=4)
    assert 0.0015 < timed["host_cpu_step_median_s"] < timed["step_median_s"]


class _BackwardThreadStep:
    """A step whose CPU work runs on another thread named as torch names its autograd device threads, while the
    calling thread waits: what a GPU backward and its gradient hooks look like to the host."""

    def __init__(self, burn_s):
        import ctypes
        import queue
        import threading

        self.device, self.burn_s = torch.device("cpu"), burn_s
        self.requests, self.done = queue.Queue(), threading.Event()

        def serve():
            ctypes.CDLL(None).prctl(15, b"pt_autograd_7")  # PR_SET_NAME
            while (burn := self.requests.get()) is not None:
                end = time.thread_time() + burn
                while time.thread_time() < end:
                    pass
                self.done.set()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def __call__(self):
        marks = Marks(self.device)
        marks.mark()
        self.done.clear()
        self.requests.put(self.burn_s)
        self.done.wait()
        for _ in range(len(PHASES)):
            marks.mark()
        return marks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and CPU clocks from /proc")
def test_issue_cpu_time_counts_the_autograd_threads():
    """A backward's host work on an autograd device thread is issuing work: counted, with the thread."""
    step = _BackwardThreadStep(0.004)
    try:
        timed = time_steps(step, warmup=1, steps=4)
    finally:
        step.requests.put(None)
        step.thread.join()
    # This thread and the fake autograd one; torch may have started idle autograd device threads of its own in this
    # process (2.14 does, for devices it does not use here), which add threads but no CPU time.
    assert timed["host_cpu_threads"] >= 2, timed
    assert 0.0035 < timed["host_cpu_step_median_s"] < 0.02, timed


def test_paired_summary_names_both_ratios():
    from sweeps.common import paired_summary

    row = {"paired_rounds": 10.0, "paired_ratio_min": 0.91, "paired_ratio_max": 1.08, "paired_ratio_ci_rel": 0.045,
           "paired_host_cpu_ratio": 1.031, "paired_host_cpu_ratio_ci_rel": 0.004}
    assert paired_summary(row) == ("paired: median of 10 rounds, range 0.910-1.080, median +-4.5% (95% confidence); "
                                   "host CPU time per step 1.031x +-0.4%")
    earlier = {k: v for k, v in row.items() if "cpu" not in k}  # rows of runs before the CPU ratio
    assert paired_summary(earlier) == "paired: median of 10 rounds, range 0.910-1.080, median +-4.5% (95% confidence)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_paired_steps_count_the_allocator_on_a_gpu():
    """On a GPU the paired rows say how often the caching allocator called cudaMalloc or freed its cache."""
    device = torch.device("cuda")

    class Alloc:
        def __init__(self, n):
            self.device, self.n = device, n

        def __call__(self):
            marks = Marks(device)
            marks.mark()
            torch.empty(self.n, device=device).fill_(1.0)
            for _ in range(len(PHASES)):
                marks.mark()
            return marks

    out = paired_steps(Alloc(1 << 20), Alloc(1 << 10), rounds=2, block=2)
    assert out["paired_allocator_retries"] == 0 and out["paired_cuda_mallocs"] >= 0, out


def test_the_call_timers_answer_in_seconds_on_the_cpu():
    """`time_calls`, `median_s` and `kernel_time` on sleeping calls: seconds, and the calls they say they made."""
    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.002)

    cpu = torch.device("cpu")
    out = time_calls(nap, cpu, warmup=2, steps=3)
    assert len(calls) == 5 and out["timed_steps"] == 3
    assert 0.002 <= out["time_min_s"] <= out["time_median_s"] <= out["time_max_s"] < 1
    calls.clear()
    assert 0.002 <= median_s(nap, cpu, cpu_calls=3) < 1 and len(calls) == 4  # one untimed call first
    t = kernel_time(nap, cpu)
    assert t["time_p20_s"] == t["time_median_s"] == t["time_p80_s"] >= 0.002
