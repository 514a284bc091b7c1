"""`python -m tools.gpu` on the CPU: the phase table, its refusals (one line, exit 2, nothing written), the runner."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import tools.gpu as gpu
from tests.subprocess_utils import REPO, repo_env


def run_gpu(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = repo_env(OUT=str(tmp_path / "out"), RESULTS=str(tmp_path / "results"))
    return subprocess.run([sys.executable, "-m", "tools.gpu", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_list_prints_every_phase_with_its_gpus(tmp_path):
    proc = run_gpu(tmp_path, "--list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(gpu.PHASES)
    for line, phase in zip(lines, gpu.PHASES.values()):
        assert f"{phase.gpus} GPU" in line and phase.summary in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()
    # the phases gpu_run.sh had, flash_gpu_check.sh's two modes, and the check after a kernel change
    assert set(gpu.PHASES) == {"headline", "dist", "allreduce", "fsdp", "paired", "compiled", "alone", "ckpt",
                               "flash", "gluon", "gluoncheck", "gluontiles", "leaderboard", "lbtune", "lb2", "tests",
                               "e2e", "flashcheck", "candidates"}


@pytest.mark.parametrize("args", [["gluon gluoncheck"], ["dist", "nope"], ["nope", "--dry-run"]])
def test_an_unknown_phase_is_one_line_naming_it_on_any_machine(tmp_path, args):
    proc = run_gpu(tmp_path, *args)
    bad = next(a for a in args if a not in gpu.PHASES and not a.startswith("--"))
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [f"tools.gpu: unknown phase '{bad}' (one of: {' '.join(gpu.PHASES)})"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("phases, need", [(["dist"], 2), (["alone"], 1), (["leaderboard"], 1), (["gluon"], 1),
                                          (["gluoncheck"], 1), (["lb2"], 2), (["flashcheck"], 1),
                                          (["candidates"], 1), (["tests", "lb2"], 2)])
def test_refused_without_the_gpus_a_phase_needs_before_writing_anything(tmp_path, phases, need):
    have = torch.cuda.device_count()
    if have >= need:
        pytest.skip(f"this machine has the {need} GPU(s) {phases} need")
    tuned = (REPO / "kernels" / "attention" / "triton" / "tuned.json").read_bytes()
    proc = run_gpu(tmp_path, *phases)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [f"tools.gpu {' '.join(phases)}: needs {need} CUDA GPU(s); this machine has "
                                        f"{have}"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()
    assert (REPO / "kernels" / "attention" / "triton" / "tuned.json").read_bytes() == tuned


def test_with_a_gpu_driver_torch_counts_the_gpus(tmp_path, monkeypatch, capsys):
    """Where the driver loads, the count is torch's, asked in a child (above, without one, no child asks)."""
    monkeypatch.setattr(gpu, "gpu_driver_present", lambda: True)
    have = torch.cuda.device_count()
    if have >= 2:
        assert gpu.gpu_count(gpu.study_env(None)) == have
        return
    assert gpu.main(["--out", str(tmp_path / "out"), "--results", str(tmp_path / "results"), "lb2"]) == 2
    assert capsys.readouterr().err == f"tools.gpu lb2: needs 2 CUDA GPU(s); this machine has {have}\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


def test_without_a_driver_neither_torch_is_asked_nor_wheels_installed(tmp_path, monkeypatch, capsys):
    def never(*args):
        raise AssertionError("asked without a driver")
    monkeypatch.setattr(gpu, "gpu_driver_present", lambda: False)
    monkeypatch.setattr(gpu, "gpu_count", never)
    monkeypatch.setattr(gpu, "install_wheels", never)
    monkeypatch.setenv("WHEELS", str(tmp_path))
    assert gpu.main(["--out", str(tmp_path / "out"), "--results", str(tmp_path / "results"), "alone"]) == 2
    assert capsys.readouterr().err == "tools.gpu alone: needs 1 CUDA GPU(s); this machine has 0\n"


def test_a_driver_is_its_library_or_one_of_its_nodes(tmp_path, monkeypatch):
    """Where libcuda does not load (a container may lack it), a driver's device node still counts as a driver."""
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(gpu.ctypes, "CDLL", no_library)
    node = tmp_path / "nvidiactl"
    monkeypatch.setattr(gpu, "DRIVER_NODES", (str(tmp_path / "kfd"), str(node)))
    assert not gpu.gpu_driver_present()
    node.touch()
    assert gpu.gpu_driver_present()


def planned(tmp_path, name: str) -> list[gpu.Study]:
    ctx = gpu.Context(tmp_path / "out", tmp_path / "results", gpu.study_env(None), dry=True)
    gpu.run_steps(ctx, gpu.PHASES[name])
    return ctx.planned


@pytest.mark.parametrize("name", list(gpu.PHASES))
def test_every_study_of_a_phase_runs_something_that_exists(tmp_path, name, capsys):
    studies = planned(tmp_path, name)
    assert studies and len({s.name for s in studies}) == len(studies), [s.name for s in studies]
    for study in studies:
        argv = list(study.argv)
        if argv[0] == "ncu":  # a profiler around the project's own script
            argv = argv[argv.index("python"):]
        assert argv[0] == "python", study
        if argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]) is not None, study
        else:
            assert (REPO / argv[1]).is_file() and argv[1].endswith(".py"), study
        for arg in argv[2:]:  # test files, test folders and scripts named as arguments
            if arg.startswith(("tests/", "sweeps/", "tools/")):
                assert (REPO / arg).exists(), (study, arg)
        assert study.seconds <= 600, study  # every study fits one 10-minute command
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()  # a dry run writes nothing


def test_dry_run_prints_each_command_with_the_folders_filled_in(tmp_path):
    proc = run_gpu(tmp_path, "--dry-run", "gluon", "lbtune")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# gluon: 1 GPU(s)" in out and "# lbtune: 1 GPU(s)" in out
    assert f"-m tools.flash_host_cost {tmp_path / 'results'} --overwrite" in out
    assert f"OUT={tmp_path / 'results'}/leaderboard LABEL=fast" in out and "{results}" not in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


def test_knobs_from_the_environment_reach_the_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDS", "20")
    monkeypatch.setenv("MATCH", "^bwd")
    argv = [a for s in planned(tmp_path, "alone") + planned(tmp_path, "gluoncheck") for a in s.argv]
    assert "20" in argv and argv[argv.index("--config-match") + 1] == "^bwd"
    monkeypatch.delenv("MATCH")
    assert "--config-match" not in [a for s in planned(tmp_path, "gluoncheck") for a in s.argv]
    for name in ("KERNELS", "VARIANTS", "SHAPES"):
        monkeypatch.delenv(name, raising=False)
    tiles = [a for s in planned(tmp_path, "gluontiles") for a in s.argv]
    assert tiles[tiles.index("--kernels") + 1] == "fwd,dkdvq" and tiles[tiles.index("--variants") + 1] == "gluon"
    monkeypatch.setenv("KERNELS", "dkdvq")
    monkeypatch.setenv("VARIANTS", "gluon_persistent")
    monkeypatch.setenv("SHAPES", "16384/128/bf16/causal")
    tiles = [a for s in planned(tmp_path, "gluontiles") for a in s.argv]
    assert [tiles[tiles.index(flag) + 1] for flag in ("--kernels", "--variants", "--shapes")] == [
        "dkdvq", "gluon_persistent", "16384/128/bf16/causal"]


def test_studies_env_puts_this_checkout_and_the_carried_wheels_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = gpu.study_env("/wheels")
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), str(tmp_path / ".site"), "/elsewhere"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    assert gpu.study_env(None)["PYTHONPATH"].split(":") == [str(tmp_path), "/elsewhere"]


def test_the_runner_keeps_a_log_the_exit_code_and_a_timeout(tmp_path, capsys):
    ctx = gpu.Context(tmp_path, tmp_path / "results", gpu.study_env(None))
    assert ctx.run(gpu.Study("ok", 60, ("python", "-c", "print('hello {results}')"))) == 0 and not ctx.failed
    assert (tmp_path / "ok.log").read_text() == f"hello {tmp_path / 'results'}\nok exit code 0\n"
    assert f"ok: exit 0 ; last lines:\nhello {tmp_path / 'results'}" in capsys.readouterr().out
    assert ctx.run(gpu.Study("late", 1, ("python", "-c", "import time; time.sleep(60)"))) == 124 and ctx.failed
    background = ctx.start(gpu.Study("bg", 60, ("python", "-c", "print('{out}')")), done=tmp_path / "bg.done")
    ctx.wait([background])
    assert (tmp_path / "bg.log").read_text() == f"{tmp_path}\nbg exit code 0\n" and (tmp_path / "bg.done").exists()


def test_headline_runs_the_readme_leaderboard_command_with_flags_it_takes(tmp_path):
    from raysys.training.leaderboard_bench import build_leaderboard_parser

    (tests, leaderboard) = planned(tmp_path, "headline")
    assert tests.argv == gpu.PHASES["gluon"].steps[0].argv  # the same Gluon GPU tests as the gluon phase
    argv = list(leaderboard.argv)
    assert argv[:4] == ["python", "-m", "raysys", "leaderboard"]
    args = build_leaderboard_parser().parse_args(argv[4:])
    assert (args.size, args.device, args.batch_size, args.no_batch2) == ("leaderboard", "cuda", 1, True)
    assert args.variants == "best,today" and args.out == "{results}/headline"
