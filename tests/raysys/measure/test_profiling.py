"""raysys.measure.profiling: the Dynamo guard log (what a compiled function guards on, counted by kind) and the
profiler's stderr (Kineto's `USDT:` lines and, without a GPU, its device-count error dropped; everything else kept)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from raysys.measure.profiling import _split_noise, dynamo_guard_log, guard_kinds


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


def _stderr_of(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    return done.stderr.decode()  # as written: carriage returns kept


def test_without_kineto_noise_drops_only_usdt_lines_and_keeps_the_rest_in_order():
    err = _stderr_of("""
        import os, sys, threading
        from raysys.measure.profiling import without_kineto_noise
        print("before", file=sys.stderr)
        with without_kineto_noise():
            os.write(2, b"USDT:2026 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\\nkept 1\\n")
            print("kept 2", file=sys.stderr)
            t = threading.Thread(target=lambda: os.write(2, b"kept 3\\nUSDT: profiler_stop\\n"))
            t.start(); t.join()
            os.write(2, b"\\rbar 50%USDT:2026 SyncActivityProfilerHandler.cpp:59] profiler_stop\\n\\rbar 100%\\n")
            os.write(2, b"no newline at the end")
        print("after", file=sys.stderr)
    """)
    assert err == "before\nkept 1\nkept 2\nkept 3\n\rbar 50%\rbar 100%\nno newline at the endafter\n", err


def test_split_noise_holds_only_what_may_be_a_kineto_span():
    assert _split_noise(b"a\rbar USDT:x y\nb USDT:z\nc") == (b"a\rbar b c", b"")
    assert _split_noise(b"progress US") == (b"progress ", b"US")    # the next read may complete "USDT:"
    assert _split_noise(b"progress USDT:2026 profiler_st") == (b"progress ", b"USDT:2026 profiler_st")
    assert _split_noise(b"U.S. dollars: USD\n") == (b"U.S. dollars: USD\n", b"")
    count = b"ERROR:2026-12-07 15:59:43 13169:13169 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
    assert _split_noise(b"a" + count + b"b", no_gpu=lambda: True) == (b"ab", b"")
    assert _split_noise(b"a" + count + b"b") == (b"a" + count + b"b", b"")  # with a GPU it is a real error
    other = b"ERROR:2026 DeviceProperties.cpp:56] something else\n"
    assert _split_noise(other + b"c", no_gpu=lambda: True) == (other + b"c", b"")
    assert _split_noise(b"x ERROR:2026 gpuGetDev", no_gpu=lambda: True) == (b"x ", b"ERROR:2026 gpuGetDev")
    assert _split_noise(b"x ERR", no_gpu=lambda: True) == (b"x ", b"ERR")
    asked = []
    no_gpu = lambda: asked.append(1) or True  # noqa: E731
    assert _split_noise(b"USDT:a\n" + other + b"b\n", no_gpu) == (other + b"b\n", b"") and not asked  # no CUDA call
    assert _split_noise(count, no_gpu) == (b"", b"") and asked == [1]


def test_without_kineto_noise_drops_the_device_count_error_only_without_a_gpu():
    """A CUDA build of torch on a machine without a GPU: Kineto's `gpuGetDeviceCount failed` line is dropped, another
    `ERROR:` line (here written in two pieces) passes whole."""
    err = _stderr_of("""
        import os, torch
        from raysys.measure.profiling import without_kineto_noise
        torch.cuda.is_available = lambda: False
        with without_kineto_noise():
            os.write(2, b"ERROR:2026-12-07 15:59:43 1:1 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\\n")
            os.write(2, b"ERROR:2026 other.cpp:1] a real ")
            os.write(2, b"error\\nkept\\n")
    """)
    assert err == "ERROR:2026 other.cpp:1] a real error\nkept\n", err


def test_profiling_a_cpu_step_prints_no_usdt_lines():
    err = _stderr_of("""
        import os, torch
        from raysys.measure.profiling import profile_steps
        x = torch.ones(8, 8)
        prof = profile_steps(lambda: os.write(2, b"step\\n") and x @ x, torch.device("cpu"))
        assert prof.events
    """)
    assert "USDT" not in err and "gpuGetDeviceCount" not in err and err.count("step\n") == 2, err


def test_without_kineto_noise_with_stderr_closed_profiles_as_is():
    code = """
        import os
        from raysys.measure.profiling import without_kineto_noise
        os.close(2)
        with without_kineto_noise():
            print("profiled")
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0 and done.stdout == "profiled\n", done
