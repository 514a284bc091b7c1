"""The benchmark harness, CLI, results I/O, profiling summary and memory accounting on CPU."""

import re
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch

from raysys import cli
from raysys.cluster import studies
from raysys.measure import memory, profiling
from raysys.model.config import ModelConfig
from raysys.model.transformer import TransformerLM, cross_entropy
from raysys.results.records import ResultWriter, error_row, make_row, read_results, status_of, trial_id
from raysys.training import bench
from raysys.training.bench import BenchConfig, run_benchmark
from tests.subprocess_utils import repo_env, signal_when

TINY = dict(size="tiny", context_length=16, batch_size=2, warmup=1, steps=2, device="cpu")


def test_cli_bench_writes_parquet_with_expected_columns(tmp_path, capsys):
    rc = cli.main(["bench", "--size", "tiny", "--context-length", "16", "--batch-size", "2", "--mode", "forward",
                   "train-step", "--warmup", "1", "--steps", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    df = pd.read_parquet(tmp_path / "bench.parquet")
    assert len(df) == 2 and set(df["status"]) == {"ok"}
    for col in ("sweep", "trial_id", "size", "mode", "dtype", "forward_mean_s", "forward_std_s", "step_mean_s",
                "git_sha", "torch_version", "triton_version", "ray_version", "device_name", "host", "utc", "error"):
        assert col in df.columns, col
    train = df[df["mode"] == "train-step"].iloc[0]
    assert train.backward_mean_s > 0 and train.optimizer_mean_s > 0
    assert pd.isna(df[df["mode"] == "forward"].iloc[0].backward_mean_s)
    assert "forward (ms)" in capsys.readouterr().out
    # a second invocation adds its rows with --resume, and never replaces the file without it
    again = ["bench", "--size", "tiny", "--context-length", "8", "--batch-size", "1", "--mode", "forward",
             "--warmup", "0", "--steps", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert cli.main(again) == 2 and "already exists" in capsys.readouterr().err
    assert cli.main([*again, "--resume"]) == 0
    assert len(pd.read_parquet(tmp_path / "bench.parquet")) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(size="gigantic"), "size 'gigantic'"),
    (dict(mode="backward"), "mode 'backward'"),
    (dict(dtype="int8"), "dtype 'int8'"),
    (dict(steps=0), r"steps \(0\) must be in \[1, 100000\]"),
    (dict(steps=10**12), r"steps \(1000000000000\) must be in \[1, 100000\]"),
    (dict(warmup=-1), r"warmup \(-1\) must be in \[0, 100000\]"),
    (dict(attention="magic"), "attention 'magic'"),
    (dict(size="small", context_length=0), r"context_length \(0\) must be a positive integer"),
])
def test_bad_bench_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


def test_cuda_without_gpu_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        run_benchmark(BenchConfig(**{**TINY, "device": "cuda"}))
    assert cli.main(["bench", "--size", "tiny", "--device", "cuda"]) == 2


def test_oom_becomes_a_row(monkeypatch):
    def boom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(bench._Run, "forward_loss", boom)
    row, kernels = run_benchmark(BenchConfig(**TINY))
    assert row["status"] == "oom" and "80.00 GiB" in row["error"] and kernels is None


def test_other_errors_propagate(monkeypatch):
    monkeypatch.setattr(bench._Run, "forward_loss", lambda self: (_ for _ in ()).throw(RuntimeError("shape bug")))
    with pytest.raises(RuntimeError, match="shape bug"):
        run_benchmark(BenchConfig(**TINY))


def test_profile_summary_on_cpu(tmp_path):
    row, kernels = run_benchmark(BenchConfig(**TINY, profile=True), tmp_path)
    assert row["status"] == "ok"
    assert {"forward", "backward", "optimizer"} <= set(kernels["phase"])
    fwd = kernels[kernels.phase == "forward"]
    assert fwd["share_of_phase"].sum() == pytest.approx(1.0)
    assert fwd["is_matmul"].any()  # aten::mm self time is attributed to the forward phase
    assert 0 < row["matmul_share_forward"] < 1
    assert (tmp_path / "traces").exists() and row["trace_path"].endswith(".json")
    assert "**forward**" in profiling.format_top(kernels) and "total_ms" in profiling.format_top(kernels)
    assert (kernels["sweep"] == "bench_kernels").all() and (kernels["run_id"] == row["run_id"]).all()
    assert (kernels["git_sha"] == row["git_sha"]).all() and (kernels["device_name"] == row["device_name"]).all()


def test_is_matmul_names():
    assert profiling.is_matmul("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
    assert profiling.is_matmul("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN")
    assert profiling.is_matmul("aten::mm")
    assert not profiling.is_matmul("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel>")
    assert not profiling.is_matmul("aten::mul")


def test_saved_tensor_accounting_counts_storages_once():
    lin = torch.nn.Linear(8, 8, bias=False)
    model = torch.nn.Sequential(lin, torch.nn.ReLU())
    x = torch.randn(4, 8)
    account = memory.SavedTensorAccount(model)
    with account.track():
        y = model(x).sum()
    # linear saves its input x (the weight is a parameter, excluded); relu saves its output: 2 x (4*8*4 bytes)
    assert account.by_module["0"] == 4 * 8 * 4
    assert account.by_module["1"] == 4 * 8 * 4
    assert account.total_bytes == 256
    y.backward()


def test_saved_bytes_per_block_of_transformer():
    cfg = ModelConfig.from_name("tiny", context_length=16)
    model = TransformerLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    per_block, detail = memory.saved_bytes_per_block(model, lambda: cross_entropy(model(x), x))
    blocks = per_block[per_block.module.str.startswith("layers.")]
    assert len(blocks) == cfg.num_layers
    # identical blocks save the same, up to the RoPE tables the shared positional encoder saves once
    assert blocks.saved_bytes.max() - blocks.saved_bytes.min() <= 2 * 16 * (cfg.d_head // 2) * 4 * 4
    # every block keeps at least its input and the (B, H, S, S) attention probabilities
    assert blocks.saved_bytes.iloc[0] > 2 * 16 * cfg.d_model * 4 + 2 * cfg.num_heads * 16 * 16 * 4
    assert detail["bytes"].sum() == blocks.saved_bytes.iloc[0]


def test_results_writer_atomic_and_resume(tmp_path):
    cfg = {"a": 1, "b": "x"}
    w = ResultWriter(tmp_path, "demo")
    w.write([make_row("demo", cfg, {"m": 1.0})])
    w.write([make_row("demo", {"a": 2, "b": "y"}, status="error", error="boom")])
    # no temp files left behind; the lock file lives as long as the writer
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.parquet.lock", "demo.parquet"]
    resumed = ResultWriter(tmp_path, "demo", resume=True)
    assert resumed.done(trial_id(cfg)) and not resumed.done(trial_id({"a": 2, "b": "y"}))  # errors are retried
    resumed.write([make_row("demo", {"a": 2, "b": "y"}, {"m": 2.0})])
    df = read_results(tmp_path / "demo.parquet")
    assert len(df) == 2 and set(df.status) == {"ok"}
    assert trial_id({"b": "x", "a": 1}) == trial_id(cfg)
    with pytest.raises(ValueError, match="status 'weird'"):
        make_row("demo", cfg, status="weird")


def test_error_row_names_the_root_cause_of_a_ray_error():
    class RemoteError(RuntimeError):  # what RayTaskError looks like: the remote traceback as text, the cause kept
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  File ...\n" + repr(cause))
            self.cause = cause

    row = error_row("demo", {"a": 1}, RemoteError(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")))
    assert row["status"] == "oom" and row["error"].startswith("OutOfMemoryError: CUDA out of memory")
    wrapped = RemoteError(ValueError("shared memory, Required: 294912"))
    wrapped.add_note("(raised on rank 1 during trial)")
    row = error_row("demo", {"a": 1}, wrapped)
    assert row["status"] == "error"
    assert row["error"] == "ValueError: shared memory, Required: 294912\n(raised on rank 1 during trial)"
    assert error_row("demo", {"a": 1}, KeyError("k"))["error"] == "KeyError: 'k'"
    # every row of this process carries its run id (what "measured in the same run" is checked by)
    from raysys.results.records import RUN_ID

    assert row["run_id"] == make_row("demo", {"a": 2})["run_id"] == RUN_ID and len(RUN_ID) == 12


def test_status_of_classifies():
    assert status_of(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert status_of(TimeoutError("collective timed out")) == "timeout"
    assert status_of(RuntimeError("bad")) == "error"


def test_report_cli(tmp_path, capsys):
    ResultWriter(tmp_path, "demo").write([make_row("demo", {"n": n}, {"time_s": n / 10}) for n in (1, 2)])
    assert cli.main(["report", str(tmp_path), "--markdown", str(tmp_path / "out.md")]) == 0
    text = (tmp_path / "out.md").read_text()
    assert "## demo" in text and "time_ms" in text and "200" in text  # the data's seconds, shown in ms
    assert cli.main(["report", str(tmp_path / "missing")]) == 2


def test_run_script_turns_bad_input_into_exit_code_2(capsys):
    def main(argv):
        raise ValueError("batch (-3) must be a positive integer")

    assert studies.run_script(main) == 2
    assert "error: batch (-3) must be a positive integer" in capsys.readouterr().err
    assert studies.run_script(lambda argv: None) == 0


def test_sigterm_mid_run_leaves_no_lock_and_no_empty_run_dir(tmp_path):
    """`timeout` (SIGTERM) stops a bench run before its first row: one line, exit 130, and neither the writer's
    lock nor an empty ./runs/<UTC>-bench/ is left behind."""
    proc = subprocess.Popen([sys.executable, "-m", "raysys", "bench", "--size", "small", "--device", "cpu",
                             "--warmup", "0", "--steps", "1000"], cwd=tmp_path, env=repo_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # Once the writer holds its lock the run is under way (a small model's steps take seconds each on a CPU).
    out, err = signal_when(proc, lambda: any(tmp_path.glob("runs/*-bench/.bench.parquet.lock")), signal.SIGTERM)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "raysys bench: interrupted", err
    assert not any(tmp_path.glob("runs/*")), sorted(p.name for p in tmp_path.rglob("*"))


class _RecordingBar:
    """What `run_benchmark` tells its progress bar: the phases in order and the steps advanced in each."""

    def __init__(self):
        self.phases: list[str] = []
        self.steps: dict[str, int] = {}

    def set_postfix_str(self, text: str) -> None:
        self.phases.append(text)

    def update(self, n: int = 1) -> None:
        self.steps[self.phases[-1]] = self.steps.get(self.phases[-1], 0) + n


def test_bench_progress_names_each_phase_and_advances_every_step():
    bar = _RecordingBar()
    cfg = BenchConfig(**{**TINY, "warmup": 2, "steps": 3})
    run_benchmark(cfg, progress=bar)
    assert bar.phases == ["build", "warm-up", "timed"]
    assert bar.steps == {"warm-up": 2, "timed": 3} and sum(bar.steps.values()) == bench.num_steps(cfg)


def test_bench_cli_draws_a_bar_per_configuration_and_one_over_them(tmp_path, capsys):
    """The README's first example printed nothing for minutes: each configuration now has a bar of its steps, with
    its phase and an estimate, under a bar over the configurations (on stderr, as the sweeps' bars)."""
    assert cli.main(["bench", "--size", "tiny", "--context-length", "16,8", "--batch-size", "1", "--warmup", "1",
                     "--steps", "2", "--device", "cpu", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    for label in (r"\[1/2\] tiny ctx 16 train-step fp32", r"\[2/2\] tiny ctx 8 train-step fp32"):
        assert re.search(label + r": .*, build\]", err) and re.search(label + r": .*, warm-up\]", err), err
        # steps done of all, elapsed<estimate left, the rate (step/s, or s/step when slow) and the phase
        assert re.search(label + r": +\d+%.* [123]/3 \[\d\d:\d\d<\d\d:\d\d, .*(step/s|s/step), timed\]", err), err
    assert re.search(r"bench: 100%.* 2/2 \[\d\d:\d\d<00:00, .*(config/s|s/config), ok\]", err), err


def test_bench_list_flags_take_words_or_a_comma_list():
    """One meaning per list flag: `--dtype fp32,bf16` = `--dtype fp32 bf16`, as in the studies."""
    parse = cli.build_parser().parse_args
    words = cli.bench_configs(parse(["bench", "--size", "tiny", "small", "--context-length", "8", "16", "--mode",
                                     "forward", "train-step", "--dtype", "fp32", "bf16"]))
    commas = cli.bench_configs(parse(["bench", "--size", "tiny,small", "--context-length", "8,16", "--mode",
                                      "forward,train-step", "--dtype", "fp32,bf16"]))
    assert words == commas and len(words) == 16
    assert {(c.size, c.context_length, c.mode, c.dtype) for c in words} >= {("small", 16, "train-step", "bf16")}
    assert cli.bench_configs(parse(["bench"])) == [BenchConfig()]  # defaults: small, its context, train-step, fp32
    for argv, message in ((["--size", "tiny,huge"], "size 'huge' is not one of"),
                          (["--context-length", "8,x"], "--context-length 'x' must be an integer"),
                          (["--dtype", "fp8"], "dtype 'fp8' is not one of")):
        with pytest.raises(ValueError, match=message):
            cli.bench_configs(parse(["bench", *argv]))


def test_memory_profile_off_cuda_is_refused_before_any_work(tmp_path, capsys):
    """`bench --memory-profile` on a CPU returned rc 0 with NaN and no snapshot, silently."""
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert cli.main(["bench", "--size", "tiny", "--device", "cpu", "--memory-profile", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == ("raysys bench: error: --memory-profile needs a CUDA device (peak memory and the allocator snapshot "
                   "come from CUDA's caching allocator); --device cpu runs on cpu here\n")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="--memory-profile needs a CUDA device"):
        run_benchmark(BenchConfig(**TINY, memory_profile=True))
