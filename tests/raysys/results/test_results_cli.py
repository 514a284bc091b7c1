"""`python -m raysys` under bad input and faults: one line and an exit code, never a traceback; a fresh run
directory by default; --resume / --overwrite for an existing file; an impossible context length is an `oom` row."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from raysys import cli
from raysys.cluster import studies

REPO = Path(__file__).resolve().parents[3]
TINY = ["bench", "--size", "tiny", "--context-length", "16", "--batch-size", "1", "--warmup", "0", "--steps", "1",
        "--device", "cpu"]


def test_bench_out_that_cannot_be_created_is_one_line(capsys):
    assert cli.main([*TINY, "--out", "/proc/raysys-x"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "raysys bench: error: cannot create results directory /proc/raysys-x: No such file or directory"


def test_bench_writes_a_fresh_run_directory_and_never_replaces_a_file_silently(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAYSYS_RESULTS_DIR", raising=False)
    monkeypatch.setenv("RAYSYS_RUNS_DIR", str(tmp_path / "runs"))
    assert cli.main(TINY) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.endswith("-bench") and len(pd.read_parquet(run / "bench.parquet")) == 1
    capsys.readouterr()
    assert cli.main([*TINY, "--out", str(run)]) == 2
    assert "bench.parquet already exists; pass --resume" in capsys.readouterr().err
    before = pd.read_parquet(run / "bench.parquet")
    assert cli.main([*TINY, "--out", str(run), "--resume", "--mode", "forward"]) == 0  # train-step is skipped
    after = pd.read_parquet(run / "bench.parquet")
    assert sorted(after["mode"]) == ["forward", "train-step"]
    assert after.set_index("mode").loc["train-step", "utc"] == before["utc"].iloc[0]
    assert cli.main([*TINY, "--out", str(run), "--overwrite"]) == 0
    assert list(pd.read_parquet(run / "bench.parquet")["mode"]) == ["train-step"]


def _limit_memory() -> None:  # the machine is shared: refused allocations, not a swapping host
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))


def test_bench_context_length_beyond_the_machine_is_refused_before_any_work(tmp_path, capsys):
    assert cli.main([*TINY[:3], "--context-length", "1000000", *TINY[5:], "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "size tiny at context 1000000 with 1 sequences per rank needs at least" in err
    assert "exceed this machine's" in err and "Traceback" not in err and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_allocation_refused_during_a_trial_is_an_oom_row(tmp_path):
    # within the machine's bound (one layer's scores: 9 GiB), beyond the process's 8 GiB address space
    proc = subprocess.run([sys.executable, "-m", "raysys", *TINY[:3], "--context-length", "24576", *TINY[5:],
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_memory)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    row = pd.read_parquet(tmp_path / "bench.parquet").iloc[0]
    assert row["status"] == "oom" and row["context_length"] == 24576
    assert "can't allocate memory" in row["error"] or "MemoryError" in row["error"], row["error"]


def test_a_closed_stdout_ends_quietly():  # `python -m raysys advise --json | head -1`
    proc = subprocess.Popen([sys.executable, "-m", "raysys", "advise", "--json"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_run_script_turns_interrupts_and_a_full_disk_into_one_line(capsys):
    from raysys.results.files import DiskFull

    def interrupted(argv):
        raise KeyboardInterrupt

    def noted(argv):
        exc = KeyboardInterrupt()
        exc.add_note("ddp: interrupted after 1 of 3 trials; rerun with --resume")
        raise exc

    def full(argv):
        raise DiskFull("no space left writing x.parquet; the previous x.parquet is intact")

    assert studies.run_script(interrupted) == 130
    assert capsys.readouterr().err.endswith(": interrupted\n")
    assert studies.run_script(noted) == 130 and capsys.readouterr().err == ""  # run_sweep printed its own line
    assert studies.run_script(full) == 1
    assert capsys.readouterr().err.endswith("error: no space left writing x.parquet; the previous x.parquet is intact\n")


def test_bench_steps_and_warmup_are_bounded_before_any_work(tmp_path, capsys):
    """Issue 48: `bench --steps 1e12` had no bound (a run that never ends); now one line, nothing made."""
    for flag, value, match in (("--steps", "1000000000000", "steps (1000000000000) must be in [1, 100000]"),
                               ("--warmup", "100001", "warmup (100001) must be in [0, 100000]")):
        assert cli.main(["bench", "--size", "tiny", "--device", "cpu", flag, value, "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b").exists()


def test_bench_failing_after_its_out_was_made_leaves_no_empty_directory(tmp_path, capsys):
    """Issue 49: `bench --attention cudnn` on a CPU fails once the run directory exists and left it empty; an --out
    this run created goes again, one that existed stays."""
    argv = ["bench", "--size", "tiny", "--attention", "cudnn", "--device", "cpu", "--warmup", "0", "--steps", "1"]
    assert cli.main([*argv, "--out", str(tmp_path / "new" / "b")]) == 2
    assert "attention 'cudnn' needs CUDA tensors" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    assert cli.main([*argv, "--out", str(tmp_path / "mine")]) == 2
    assert not (tmp_path / "new").exists() and list((tmp_path / "mine").iterdir()) == []


_EDITABLE_INSTALL = """
import runpy, sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location

ROOT = {root!r}
MAPPING = {{name: ROOT + "/" + name for name in ("raysys", "kernels", "parallel", "sweeps")}}


class EditableFinder:
    # What `pip install -e .` appends to sys.meta_path (setuptools' _EditableFinder), after the path finder:
    # top-level names mapped to this checkout's folders, their children looked up there.
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname in MAPPING:
            return spec_from_file_location(fullname, MAPPING[fullname] + "/__init__.py",
                                           submodule_search_locations=[MAPPING[fullname]])
        parent = fullname.rpartition(".")[0]
        return PathFinder.find_spec(fullname, [MAPPING[parent]]) if parent in MAPPING else None


sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.meta_path.append(EditableFinder)
sys.argv = ["raysys", *{argv!r}]
runpy.run_module("raysys", run_name="__main__", alter_sys=True)
"""


def test_python_m_raysys_from_the_parent_of_a_clone_named_raysys(tmp_path):
    """`python -m raysys` beside a clone named `raysys` (after `git clone ... raysys && pip install -e raysys`):
    Python takes the clone for a namespace package found before the editable install, and `raysys.results.records` was
    the clone's results/ folder (ImportError); the console script worked."""
    (tmp_path / "raysys").symlink_to(REPO, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = _EDITABLE_INSTALL.format(root=str(REPO), argv=["report", str(tmp_path / "none.parquet")])
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr == f"raysys report: error: results file {tmp_path / 'none.parquet'} does not exist\n"


def test_the_cluster_and_report_commands_start_without_torch(tmp_path):
    """`python -m raysys doctor`, the first step of the cluster recipe, imported torch, Triton and the kernels to
    build every command's parser (20 s on a busy 2-core host): a command now imports what it runs."""
    code = f"""
import sys
from raysys import cli
codes = [cli.main(argv) for argv in (["doctor", "--port", "0"], ["metrics", "--temp-dir", {str(tmp_path)!r}],
                                     ["report", {str(tmp_path / "none")!r}], ["submit"])]
print(codes, sorted(m for m in ("torch", "triton", "kernels") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] in ("[0, 2, 2, 2] []", "[1, 2, 2, 2] []"), done.stdout
    assert "raysys submit: error: no command to run" in done.stderr
