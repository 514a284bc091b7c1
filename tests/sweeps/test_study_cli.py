"""The command line every study shares (issue 20): bad input is a one-line ValueError before Ray starts or any
trial runs, one spelling per flag with the old ones as hidden aliases, defaults in --help, a fresh run directory
by default, --resume / --overwrite, Ctrl-C in one line, GPU targets not judged on the CPU."""

from __future__ import annotations

import argparse
import importlib
import math
import os

import pandas as pd
import pytest

import raysys.cluster.sweep
from sweeps import common

STUDIES = ("allreduce", "attention", "checkpointing", "ddp", "end_to_end", "flash_bench", "flash_tiles", "fsdp",
           "sharded_optimizer")


class RayStarted(AssertionError):
    pass


@pytest.fixture
def no_ray(monkeypatch):
    """Any attempt to start or join Ray (or to run a sweep) fails the test: the checks must come first."""
    def refuse(*args, **kwargs):
        raise RayStarted("Ray was started before the flags were checked")

    import ray

    for target in (raysys.cluster.sweep, ray):
        monkeypatch.setattr(target, "init" if target is ray else "init_ray", refuse)
    monkeypatch.setattr(raysys.cluster.sweep, "run_sweep", refuse)
    monkeypatch.setattr(raysys.cluster.sweep, "tune_run", refuse)


def _study(name: str):
    return importlib.import_module(f"sweeps.{name}")


BAD = [
    ("ddp", ["--steps", "0"], r"--steps \(0\) must be an integer in \[2, 100000\]"),
    ("ddp", ["--variants", "single,bogus"], "variant 'bogus'"),
    ("ddp", ["--dtypes", "fp8"], r"--dtypes: \['fp8'\]"),
    ("ddp", ["--size", "huge"], "--size 'huge' is not one of"),
    ("ddp", ["--size", "../../etc"], r"--size '\.\./\.\./etc' is not one of"),
    ("ddp", ["--context-length", "0"], r"--context-length \(0\) must be an integer >= 1"),
    ("ddp", ["--context-length", "100000000"], "exceed this machine's"),
    ("ddp", ["--timeout-s", "nan"], r"--timeout-s \(nan\)"),
    ("ddp", ["--timeout-s", "inf"], r"--timeout-s \(inf\)"),
    ("ddp", ["--timeout-s", "0"], r"--timeout-s \(0.0\)"),
    ("ddp", ["--timeout-s", "-1"], r"--timeout-s \(-1.0\)"),
    ("ddp", ["--world-sizes", "2,4"], "one world size per run"),
    ("ddp", ["--launcher", "mp", "--world-size", "100000"], "asked for 100000 CPU ranks on this machine"),
    ("ddp", ["--max-steps", "3"], r"--max-steps \(3\) must be >= --steps"),
    # issue 48: upper bounds, stated
    ("ddp", ["--timeout-s", "1e15"], r"--timeout-s \(1000000000000000\.0\) must be a finite number of seconds "
                                     r"in \(0, 604800\]"),
    ("ddp", ["--steps", "1000000000000"], r"--steps \(1000000000000\) must be an integer in \[2, 100000\]"),
    ("ddp", ["--warmup", "100001"], r"--warmup \(100001\) must be an integer in \[0, 100000\]"),
    ("ddp", ["--max-steps", "100001"], r"--max-steps \(100001\) must be an integer in \[10, 100000\]"),
    ("ddp", ["--paired-rounds", "100001"], r"--paired-rounds \(100001\) must be an integer in \[0, 100000\]"),
    ("fsdp", ["--timeout-s", "1e15"], r"--timeout-s \(1000000000000000\.0\)"),
    ("sharded_optimizer", ["--steps", "100001"], r"--steps \(100001\) must be an integer in \[2, 100000\]"),
    ("allreduce", ["--timeout-s", "1e15"], r"--timeout-s \(1000000000000000\.0\) must be a finite number"),
    ("allreduce", ["--iters", "100001"], r"--iters \(100001\) must be an integer in \[1, 100000\]"),
    ("attention", ["--steps", "100001"], r"--steps \(100001\) must be an integer in \[1, 100000\]"),
    ("checkpointing", ["--warmup", "100001"], r"--warmup \(100001\) must be an integer in \[0, 100000\]"),
    ("flash_bench", ["--time-budget-s", "1e15"], r"--time-budget-s \(1000000000000000\.0\)"),
    ("fsdp", ["--steps", "0"], r"--steps \(0\)"),
    ("fsdp", ["--variants", "zero3"], r"--variants: \['zero3'\]"),
    ("fsdp", ["--dtypes", "fp8"], "fp8"),
    ("fsdp", ["--size", "huge"], "huge"),
    ("fsdp", ["--launcher", "mp", "--world-size", "100000"], "100000"),
    ("fsdp", ["--timeout-s", "-1"], "--timeout-s"),
    ("sharded_optimizer", ["--warmup", "0"], r"warmup \(0\) must be >= 1"),
    ("sharded_optimizer", ["--dtypes", "fp8"], "fp8"),
    ("allreduce", ["--sweep-name", "x" * 300], "sweep name"),
    ("allreduce", ["--world-sizes", "1"], "must be an integer >= 2"),
    ("allreduce", ["--timeout-s", "nan"], "--timeout-s"),
    ("allreduce", ["--launchers", "mp", "--world-sizes", "100000"], "100000 CPU ranks"),
    ("allreduce", ["--iters", "0"], r"--iters \(0\)"),
    ("checkpointing", ["--studies", "bogus"], r"--studies: \['bogus'\]"),
    ("checkpointing", ["--dtypes", "fp8"], "fp8"),
    ("checkpointing", ["--ks", "0"], "--ks"),
    ("checkpointing", ["--steps", "0"], r"--steps \(0\)"),
    ("attention", ["--steps", "0"], r"--steps \(0\)"),
    ("attention", ["--modes", "jit"], r"--modes: \['jit'\]"),
    ("end_to_end", ["--studies", "speed"], r"--studies: \['speed'\]"),
    ("flash_bench", ["--dtypes", "fp8"], "fp8"),
    ("flash_bench", ["--seqs", "0"], "--seqs"),
    ("flash_bench", ["--time-budget-s", "nan"], "--time-budget-s"),
    ("flash_tiles", ["--shapes", "4096/64/bf8/causal"], "bf8"),
    ("flash_tiles", ["--time-budget-s", "0"], "--time-budget-s"),
]


@pytest.mark.parametrize("study,argv,match", BAD, ids=[f"{s}:{' '.join(a)[:40]}" for s, a, _ in BAD])
def test_bad_input_is_one_line_before_ray_or_any_trial(no_ray, tmp_path, study, argv, match):
    with pytest.raises(ValueError, match=match):
        _study(study).main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.parquet"))


@pytest.mark.parametrize("study", ["ddp", "fsdp", "allreduce", "attention", "checkpointing"])
def test_out_paths_are_checked_first(no_ray, tmp_path, study):
    module = _study(study)
    name = "allreduce" if study == "allreduce" else module.SWEEP
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        module.main(["--out", str(tmp_path / "a_file")])
    with pytest.raises(ValueError, match="cannot"):
        module.main(["--out", str(tmp_path / "a_file" / "below")])
    (tmp_path / "dir" / f"{name}.parquet").mkdir(parents=True)   # the Parquet path is a directory
    with pytest.raises(ValueError, match="is a directory"):
        module.main(["--out", str(tmp_path / "dir")])
    (tmp_path / "old").mkdir()
    pd.DataFrame({"sweep": [name], "trial_id": ["x"]}).to_parquet(tmp_path / "old" / f"{name}.parquet")
    with pytest.raises(ValueError, match="--resume to continue it, --overwrite to replace it"):
        module.main(["--out", str(tmp_path / "old")])
    with pytest.raises(ValueError, match="--resume needs --out"):
        module.main(["--resume"])


def test_cpu_ranks_of_a_plain_process_gang_are_bounded(no_ray, tmp_path):
    """`--launcher mp --world-size 100000` spawned processes until the machine gave out; now it is refused."""
    from sweeps import ddp

    with pytest.raises(ValueError, match="CPU ranks on this machine"):
        ddp.main(["--launcher", "mp", "--device", "cpu", "--world-size", str(100 * (os.cpu_count() or 1)),
                  "--out", str(tmp_path)])


def test_every_default_is_in_the_help():
    for name in STUDIES:
        parser = _study(name).build_parser()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0:
                continue
            text = parser.formatter_class("x")._get_help_string(action)
            assert "default" in text.lower(), (name, action.option_strings, text)
        assert "--world-size " not in parser.format_help() and "--dtype " not in parser.format_help()


def test_one_spelling_per_flag_and_the_old_ones_still_parse():
    from sweeps import allreduce, checkpointing, ddp, end_to_end, flash_bench, fsdp

    for module in (ddp, fsdp):
        parser = module.build_parser()
        assert parser.parse_args(["--world-size", "4"]).world_sizes == parser.parse_args(["--world-sizes", "4"]) \
            .world_sizes == "4"
        assert parser.parse_args(["--dtype", "bf16"]).dtypes == "bf16"
    assert allreduce.build_parser().parse_args(["--launcher", "mp"]).launchers == "mp"
    for module in (checkpointing, end_to_end):
        assert module.build_parser().parse_args(["--study", "a", "b"]).studies == "a,b"   # the old nargs form
    args = flash_bench.build_parser().parse_args(["--study", "grid", "--max-seconds", "30"])
    assert args.studies == "grid" and args.time_budget_s == 30
    for module in (ddp, fsdp, allreduce):
        assert "--timeout-s" in module.build_parser().format_help()


def test_default_out_is_a_fresh_run_directory(tmp_path, monkeypatch):
    """Without --out a study never writes into the repository's results/: each run gets a directory of its own."""
    from sweeps import attention

    monkeypatch.setenv("RAYSYS_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("RAYSYS_RESULTS_DIR", raising=False)
    ns = argparse.Namespace(out=None, resume=False, report_only=False)
    first, second = common.output_dir(ns, "attention"), common.output_dir(ns, "attention")
    assert first != second and first.parent == second.parent == tmp_path / "runs"
    committed = common.ROOT / "results"
    before = {p.name: p.stat().st_mtime_ns for p in committed.glob("attention*")}
    attention.main(["--quick", "--device", "cpu", "--modes", "eager"])
    (run,) = [p for p in (tmp_path / "runs").iterdir() if (p / "attention.parquet").exists()]
    assert "-attention" in run.name and (run / "attention.md").exists()
    assert {p.name: p.stat().st_mtime_ns for p in committed.glob("attention*")} == before


def test_resume_continues_and_overwrite_replaces(tmp_path, monkeypatch):
    from sweeps import attention

    calls = []

    def fake(cfg, device, steps, warmup):
        calls.append(cfg["seq"])
        return {"forward_mean_s": 1e-3, "forward_std_s": 0.0, "backward_mean_s": 2e-3, "backward_std_s": 0.0,
                "memory_before_backward_bytes": math.nan, "saved_for_backward_bytes": 1.0}

    monkeypatch.setattr(attention, "run_trial", fake)
    argv = ["--quick", "--device", "cpu", "--out", str(tmp_path)]
    first = attention.main(argv)
    with pytest.raises(ValueError, match="exists"):
        attention.main(argv)
    again = attention.main([*argv, "--resume"])
    assert calls == [64, 128] and again["utc"].tolist() == first["utc"].tolist()   # nothing ran again
    attention.main([*argv, "--overwrite"])
    assert calls == [64, 128, 64, 128]
    with pytest.raises(SystemExit):     # argparse: --resume and --overwrite exclude each other
        attention.main([*argv, "--resume", "--overwrite"])


def test_ctrl_c_says_how_far_the_run_got(tmp_path, monkeypatch, capsys):
    """Ctrl-C during a study's own trial loop: one line, the trials finished of those planned, exit code 130."""
    from sweeps import attention

    def interrupted_on_the_second(cfg, device, steps, warmup):
        if cfg["seq"] == 128:
            raise KeyboardInterrupt
        return {"forward_mean_s": 1e-3, "forward_std_s": 0.0, "backward_mean_s": 2e-3, "backward_std_s": 0.0,
                "memory_before_backward_bytes": math.nan, "saved_for_backward_bytes": 1.0}

    monkeypatch.setattr(attention, "run_trial", interrupted_on_the_second)
    common.PROGRESS.planned = common.PROGRESS.finished = 0   # counts of this test's run only
    code = common.main_entry(attention.main, ["--quick", "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert "interrupted after 1 of 2 trials; rerun with --resume" in err
    assert len(pd.read_parquet(tmp_path / "attention.parquet")) == 1


def _gang_rows(backend: str, **extra) -> pd.DataFrame:
    rows = [dict(status="ok", dtype="bf16", variant=v, label=v, size="xl", context_length=512, world_size=2,
                 batch_per_rank=4, warmup=2, steps=8, step_mean_s=s / 1e3, step_std_s=1e-3,
                 step_median_s=s / 1e3, backend=backend,
                 peak_memory_max_rank_bytes=p * 2**30, state_bytes=2**30, expected_state_bytes=2**30, error="",
                 **extra) for v, s, p in (("single", 100.0, 40), ("fsdp", 130.0, 30), ("torch", 101.0, 50),
                                          ("fsdp2", 140.0, 32), ("overlapped", 103.0, 40))]
    return pd.DataFrame(rows)


def test_gpu_targets_do_not_apply_to_cpu_rows():
    from sweeps import allreduce, ddp, fsdp

    for backend, cpu in (("gloo", True), ("nccl", False)):
        df = _gang_rows(backend)
        lines = ddp.targets(ddp.with_ratios(df)) + fsdp.targets(df)
        text = "\n".join(lines)
        assert ("not applicable on CPU" in text) == cpu, text
        assert ("missed" in text) == (not cpu), text
    rows = [dict(op="all_reduce", size="1GiB", size_bytes=2**30, num_bytes=2**30, world_size=2, launcher=launcher,
                 gpu_visibility="none", nccl_env="", status="ok", error="", busbw_GBps=1.0, time_mean_s=1e-3,
                 device_name="cpu", run_id="r", backend="gloo") for launcher in ("mp", "ray")]
    text = "\n".join(allreduce.target_lines(pd.DataFrame(rows)))
    assert "not applicable on CPU" in text and "FAIL" not in text and "PASS" not in text
    assert "FAIL" in "\n".join(allreduce.target_lines(pd.DataFrame(rows).assign(backend="nccl")))


def test_dashboard_flag_starts_the_embedded_ray_with_its_dashboard(monkeypatch, tmp_path):
    """README: `python sweeps/<study>.py --dashboard` starts the embedded Ray with its dashboard."""
    seen = {}

    def init_ray(address=None, **kwargs):
        seen.update(kwargs, address=address)
        raise RayStarted("stop here")

    monkeypatch.setattr(raysys.cluster.sweep, "init_ray", init_ray)
    from sweeps import ddp, fsdp, sharded_optimizer

    for module in (ddp, fsdp, sharded_optimizer):
        seen.clear()
        with pytest.raises(RayStarted):
            module.main(["--dashboard", "--device", "cpu", "--out", str(tmp_path / module.SWEEP)])
        assert seen == {"dashboard": True, "address": None}


def test_a_run_refused_after_its_run_directory_was_made_leaves_none(tmp_path, monkeypatch, capsys):
    """A check that can only run once the run directory exists (Ray refusing the gang: too many ranks, no GPU)
    fails the run in one line and leaves no empty ./runs/<UTC>-<sweep>/ behind."""
    from sweeps import ddp

    def refuse(args, world_size):
        raise ValueError(f"asked for {world_size} ranks; the cluster has 1 node(s) with 2 CPUs")

    monkeypatch.setenv("RAYSYS_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("RAYSYS_RESULTS_DIR", raising=False)
    monkeypatch.setattr(common, "gang_device", refuse)
    assert common.main_entry(ddp.main, ["--device", "cpu", "--world-size", "2", "--launcher", "ray"]) == 2
    assert "asked for 2 ranks" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nor the runs root this run made for it
    # issue 49: an --out that this run created goes too (`ddp.py --world-sizes 4 --out D`); one that existed stays
    argv = ["--device", "cpu", "--world-size", "2", "--launcher", "ray", "--out"]
    assert common.main_entry(ddp.main, [*argv, str(tmp_path / "new" / "out")]) == 2
    (tmp_path / "mine").mkdir()
    assert common.main_entry(ddp.main, [*argv, str(tmp_path / "mine")]) == 2
    assert not (tmp_path / "new").exists() and list((tmp_path / "mine").iterdir()) == []


def test_leaderboard_context_length_is_bounded_before_any_model(tmp_path, capsys, no_ray):
    """The leaderboard step's CLIs (`sweeps/leaderboard.py`, `python -m raysys leaderboard`) take --context-length
    and --batch-size: on the CPU they are bounded by the machine's memory, in one line, before a model is built."""
    from raysys import cli
    from sweeps import leaderboard

    argv = ["--device", "cpu", "--size", "tiny", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="size tiny at context 100000000 with 1 sequences per rank needs at least"):
        leaderboard.main([*argv, "--context-length", "100000000"])
    with pytest.raises(ValueError, match=r"--context-length \(0\) must be >= 1"):
        leaderboard.main([*argv, "--context-length", "0"])
    assert cli.main(["leaderboard", *argv, "--context-length", "100000000"]) == 2
    assert "exceed this machine's" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("study", ["flash_bench", "fused_ops", "end_to_end"])
def test_studies_in_their_own_process_need_no_ray(study):
    """A study whose trials run in its own process imports nothing of Ray on its way to a bad-input exit: the GPU
    host without Ray runs it as it is (raysys.cluster.studies holds what the studies share; raysys.cluster.sweep the Ray
    part)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['ray'] = None\n"  # `import ray` raises ImportError from here on
            f"from sweeps.{study} import main\nfrom sweeps.common import main_entry\n"
            "sys.exit(main_entry(main, ['--bogus-flag']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unrecognized arguments: --bogus-flag" in done.stderr and "ray" not in done.stderr.lower()


def _planted_ddp_run(out, argv: list[str], **gang) -> list[str]:
    """`out/ddp.parquet` as a CPU run of `argv` on a Ray gang would have left it (one ok row per trial)."""
    from raysys.results.records import ResultWriter, make_row
    from sweeps import ddp

    args = ddp.build_parser().parse_args(argv)
    columns = {"world_size": 2, "launcher": "ray", "device": "cpu", "gpu_visibility": "none", **gang}
    rows = [make_row("ddp", {**t, **columns}, {"step_median_s": 0.1}, backend="gloo",
                     device_name="cpu" if columns["device"] == "cpu" else "NVIDIA H100 80GB HBM3")
            for t in ddp.grid(args, "cpu", 2)]
    with ResultWriter(out, "ddp", mode="overwrite") as w:
        w.write(rows)
    return argv


FIRST = ["--variants", "single,naive,flat,overlapped", "--no-single-rerun", "--profile", "", "--warmup", "1",
         "--steps", "2", "--device", "cpu", "--world-sizes", "2"]
MIXED = [(["--world-sizes", "1"], "rows with world_size = 2, this run has world_size = 1"),
         (["--launcher", "mp"], "rows with launcher = ray, this run has launcher = mp"),
         (["--steps", "3"], "rows with steps = 2, this run has steps = 3"),
         (["--warmup", "0"], "rows with warmup = 1, this run has warmup = 0"),
         (["--size", "small"], "rows with size = tiny, this run has size = small"),
         (["--profile", "naive"], "holds the trial dtype fp32, label naive with profile = False there, True here")]


@pytest.mark.parametrize("change,match", MIXED, ids=[" ".join(c) for c, _ in MIXED])
def test_resume_refuses_another_configuration_before_ray_starts(no_ray, tmp_path, change, match):
    """Issue 48: `ddp.py --resume` with another --world-sizes, --launcher, --steps or --warmup was accepted (4 -> 8
    rows). Every setting of the run and each trial of the same name is compared, before Ray starts."""
    from sweeps import ddp

    argv = [*_planted_ddp_run(tmp_path, FIRST), "--out", str(tmp_path), "--resume"]
    with pytest.raises(ValueError, match=match):
        ddp.main([*argv, *change])
    with pytest.raises(RayStarted):  # the same configuration, or --allow-mixed, goes on to start Ray
        ddp.main([*argv, *change, "--allow-mixed"])
    with pytest.raises(RayStarted):
        ddp.main(argv)
    assert len(pd.read_parquet(tmp_path / "ddp.parquet")) == 4


def test_resume_refuses_another_device_a_foreign_file_and_rows_without_provenance_before_ray(no_ray, tmp_path):
    """Issue 48: another device was refused only after Ray started and a trial ran; a foreign file (`{'foo': [1,
    2]}`) and rows without a git_sha were accepted."""
    from sweeps import ddp

    argv = [*_planted_ddp_run(tmp_path, FIRST, device="cuda", gpu_visibility="shared"), "--out", str(tmp_path),
            "--resume"]
    with pytest.raises(ValueError, match="rows with device = cuda, this run has device = cpu"):
        ddp.main(argv)
    _planted_ddp_run(tmp_path, FIRST)
    df = pd.read_parquet(tmp_path / "ddp.parquet")
    df.assign(device_name="NVIDIA H100 80GB HBM3").to_parquet(tmp_path / "ddp.parquet")
    with pytest.raises(ValueError, match="holds rows measured on NVIDIA H100 80GB HBM3, this run measures on cpu"):
        ddp.main(argv)
    df.drop(columns=["git_sha"]).to_parquet(tmp_path / "ddp.parquet")
    with pytest.raises(ValueError, match=r"holds rows without provenance \(git_sha\)"):
        ddp.main(argv)
    pd.DataFrame({"foo": [1, 2]}).to_parquet(tmp_path / "ddp.parquet")
    for flags in ([], ["--allow-mixed"]):
        with pytest.raises(ValueError, match="holds rows without sweep, trial_id, status"):
            ddp.main([*argv, *flags])


def test_allreduce_resume_refuses_other_warmup_or_iters_before_ray(no_ray, tmp_path):
    from raysys.results.records import ResultWriter, make_row
    from sweeps import allreduce

    rows = [make_row("allreduce", {**t, "world_size": 2, "launcher": "ray", "device": "cpu", "gpu_visibility": "none"},
                     {"busbw_GBps": 1.0}) for t in allreduce.trials(["all_reduce"], [1000], 1, 2)]
    with ResultWriter(tmp_path, "allreduce") as w:
        w.write(rows)
    argv = ["--device", "cpu", "--sizes", "1KB", "--ops", "all_reduce", "--out", str(tmp_path), "--resume"]
    for change, match in ((["--warmup", "3"], "rows with warmup = 1, this run has warmup = 3"),
                          (["--iters", "5"], "rows with iters = 2, this run has iters = 5")):
        with pytest.raises(ValueError, match=match):
            allreduce.main([*argv, "--iters", "2", "--warmup", "1", *change])
    with pytest.raises(RayStarted):
        allreduce.main([*argv, "--iters", "2", "--warmup", "1"])


def test_every_list_flag_takes_words_or_one_comma_list():
    """One meaning per list flag everywhere (`--variants a b` as the leaderboard took it, `--variants a,b` as the
    other studies did): both forms, on the new spellings and the old ones, and --help shows one form."""
    from sweeps import checkpointing, ddp, flash_tiles, fsdp

    for module, flag, values in ((ddp, "--variants", ["naive", "bucketed:10"]), (ddp, "--dtypes", ["fp32", "bf16"]),
                                 (fsdp, "--variants", ["fsdp", "ddp"]),
                                 (flash_tiles, "--variants", ["portable", "tma"]),
                                 (checkpointing, "--studies", ["segments", "offload"]), (ddp, "--world-sizes", ["2"])):
        parser = module.build_parser()
        dest = flag.lstrip("-").replace("-", "_")
        joined = ",".join(values)
        assert getattr(parser.parse_args([flag, *values]), dest) == getattr(parser.parse_args([flag, joined]), dest) \
            == joined, (module.__name__, flag)
        assert f"{flag} A,B,.." in parser.format_help() and f"{flag} A,B,.. [" not in parser.format_help()
    assert ddp.build_parser().parse_args(["--dtype", "fp32,bf16"]).dtypes == "fp32,bf16"   # an old spelling


def test_launcher_ray_means_ray_in_every_study():
    """`--launcher ray` runs the trials on Ray in every study that takes --launcher (checkpointing called it `tune`,
    which still parses); the other values name what runs instead."""
    from sweeps import checkpointing, ddp, flash_tiles, fsdp, sharded_optimizer

    for module in (checkpointing, ddp, flash_tiles, fsdp, sharded_optimizer):
        (action,) = [a for a in module.build_parser()._actions if a.dest == "launcher"]
        assert "ray" in action.choices and set(action.choices) <= {"auto", "ray", "mp", "local"}, module.__name__
    parse = checkpointing.build_parser().parse_args
    assert parse(["--launcher", "tune"]).launcher == parse(["--launcher", "ray"]).launcher == "ray"
    with pytest.raises(SystemExit):
        parse(["--launcher", "mp"])   # checkpointing's trials are one process each: no gang to launch
