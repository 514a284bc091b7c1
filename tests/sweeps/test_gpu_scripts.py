"""The one-command GPU scripts on a machine without the GPUs they need: one line, exit 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.subprocess_utils import REPO, repo_env


@pytest.mark.parametrize("script, args, gpus, expect", [
    ("sweeps/gpu_run.sh", ["dist"], 2, "gpu_run.sh dist: needs 2 CUDA GPU(s); this machine has"),
    ("sweeps/gpu_run.sh", ["alone"], 1, "gpu_run.sh alone: needs 1 CUDA GPU(s); this machine has 0"),
    ("sweeps/gpu_run.sh", ["leaderboard"], 1, "gpu_run.sh leaderboard: needs 1 CUDA GPU(s); this machine has 0"),
    ("sweeps/gpu_run.sh", ["gluon"], 1, "gpu_run.sh gluon: needs 1 CUDA GPU(s); this machine has 0"),
    ("sweeps/gpu_run.sh", ["gluoncheck"], 1, "gpu_run.sh gluoncheck: needs 1 CUDA GPU(s); this machine has 0"),
    ("sweeps/gpu_run.sh", ["lb2"], 2, "gpu_run.sh lb2: needs 2 CUDA GPU(s); this machine has"),
    # An unknown phase is refused on any machine (so the "GPUs it needs" never skip it), before the GPU check.
    ("sweeps/gpu_run.sh", ["gluon gluoncheck"], 10**6, "gpu_run.sh: unknown phase 'gluon gluoncheck' (one of: dist "),
    ("sweeps/flash_gpu_check.sh", [], 1, "flash_gpu_check.sh: needs a CUDA GPU; this machine has none"),
])
def test_refused_without_gpus_before_writing_anything(tmp_path, script, args, gpus, expect):
    if torch.cuda.device_count() >= gpus:
        pytest.skip(f"this machine has the {gpus} GPU(s) {script} needs")
    tuned = (REPO / "kernels" / "attention" / "triton" / "tuned.json").read_bytes()
    # The scripts call `python3` (gpu_run.sh) or $PYTHON (flash_gpu_check.sh): this interpreter, which has torch.
    env = repo_env(OUT=str(tmp_path / "out"), RESULTS=str(tmp_path / "results"), MODE="candidates",
                   PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(expect), proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()
    assert (REPO / "kernels" / "attention" / "triton" / "tuned.json").read_bytes() == tuned  # the committed file untouched


def test_a_tuned_file_that_does_not_exist_is_an_error_not_untuned_kernels(tmp_path):
    """`RAYSYS_FLASH_TUNED` with a typo: one ValueError at import naming the path, not the built-in configs."""
    code = "import kernels.attention.dispatch"
    bad = subprocess.run([sys.executable, "-c", code], env=repo_env(RAYSYS_FLASH_TUNED=str(tmp_path / "nope.json")),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and f"ValueError: RAYSYS_FLASH_TUNED ({tmp_path / 'nope.json'}) names no file" \
        in bad.stderr, bad.stderr
    good = tmp_path / "tuned.json"
    good.write_bytes((REPO / "kernels" / "attention" / "triton" / "tuned.json").read_bytes())
    ok = subprocess.run([sys.executable, "-c", code + "; print(kernels.attention.dispatch.TUNED_CONFIGS_PATH)"],
                        env=repo_env(RAYSYS_FLASH_TUNED=str(good)), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == str(good), ok.stderr


def test_gluon_check_refused_without_an_sm90_gpu(tmp_path):
    """`sweeps/flash_gluon_check.py` on a machine without an sm_90 GPU: one line, exit 2, nothing written."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has the sm_90 GPU the script needs")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "sweeps/flash_gluon_check.py", "--out", str(out)], cwd=REPO,
                          env=repo_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(
        "flash_gluon_check.py: needs an sm_90 GPU and Triton's Gluon Hopper API; this machine has no CUDA GPU")
    assert not out.exists()


def test_gluon_check_never_replaces_an_earlier_file_unasked(tmp_path):
    earlier = tmp_path / "flash_gluon.parquet"
    earlier.write_bytes(b"an earlier run")
    proc = subprocess.run([sys.executable, "sweeps/flash_gluon_check.py", "--out", str(tmp_path)], cwd=REPO,
                          env=repo_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{earlier} exists (an earlier run); pass --overwrite" in proc.stderr, proc.stderr
    assert earlier.read_bytes() == b"an earlier run"



def test_gluon_check_refuses_a_bad_config_match(tmp_path):
    """A --config-match that is no regular expression: one line naming it, exit 2, before any GPU work."""
    proc = subprocess.run([sys.executable, "sweeps/flash_gluon_check.py", "--out", str(tmp_path / "out"),
                           "--config-match", "(bwd"], cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("flash_gluon_check.py: --config-match '(bwd' is not a regular expression")
    assert not (tmp_path / "out").exists()


def test_host_cost_script_never_replaces_an_earlier_file_unasked(tmp_path, monkeypatch):
    """tools/flash_host_cost.py refuses an existing flash_host_cost.parquet in its OUT_DIR before any work
    (one line, the file untouched); with --overwrite it goes on to its GPU check."""
    import tools.flash_host_cost as script

    earlier = tmp_path / "flash_host_cost.parquet"
    earlier.write_bytes(b"earlier rows")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["flash_host_cost.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="already exists; pass --overwrite"):
        script.main()
    monkeypatch.setattr(sys, "argv", ["flash_host_cost.py", str(tmp_path), "--overwrite"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        script.main()
    assert earlier.read_bytes() == b"earlier rows"


def test_host_cost_rows_from_printed_lines(tmp_path, monkeypatch):
    """`flash_host_cost.py logs` turns a call's printed lines (case lines, `--by-kernel` lines, one block per shape
    ending with its `wrote` line) into the rows the script writes, provenance it cannot know `unknown`; it refuses an
    existing target before reading anything, and a printout without a block."""
    import tools.flash_host_cost as script

    text = "\n".join([
        "NVIDIA H200, 345 MHz, 1980 MHz",
        "op host us/call 125.6  wall us/call 1756.7  kernels us/call 1664.2",
        "fwd+bwd sdpa cudnn host us/call 3146.0  wall us/call 7413.2  kernels us/call 7263.5",
        "  op:    1599.2 us/call   1.0 launches/call  _gluon_attn_fwd_kernel",
        "  fwd+bwd sdpa cudnn:     140.3 us/call   3.0 launches/call  void at::native::add<c10::BFloat16>, std::ar",
        "wrote /root/out/1,16,16384,128/flash_host_cost.parquet",
        "op host us/call 185.7  wall us/call 662.2  kernels us/call 659.2",
        "wrote /root/out/8,16,4096,64/flash_host_cost.parquet",
        "op host us/call 1.0  wall us/call 2.0  kernels us/call 3.0"])  # no `wrote` line: not a finished block
    rows = script.from_logs(text, "c8ec8f7a3d0a")
    assert list(rows["shape"]) == ["1x16x16384x128"] * 4 + ["8x16x4096x64"]
    assert list(rows["case"]) == ["op", "fwd+bwd sdpa cudnn", "kernel of op", "kernel of fwd+bwd sdpa cudnn", "op"]
    kernel = rows.iloc[3]
    assert kernel["kernel"].startswith("void at::native::add") and kernel["launches"] == 3.0
    assert kernel["kernel_s"] == pytest.approx(140.3e-6)
    assert rows.iloc[1]["host_s"] == pytest.approx(3146.0e-6) and rows.iloc[4]["kernel_s"] == pytest.approx(659.2e-6)
    assert set(rows["git_sha"]) == {"c8ec8f7a3d0a"} and set(rows["device_name"]) == {"NVIDIA H200"}
    assert set(rows["host"]) == {"unknown"}
    with pytest.raises(SystemExit, match="no block"):
        script.from_logs("op host us/call 1.0  wall us/call 2.0  kernels us/call 3.0", "x")
    source, target = tmp_path / "printed.txt", tmp_path / "rows.parquet"
    source.write_text(text)
    target.write_bytes(b"earlier rows")
    monkeypatch.setattr(sys, "argv", ["flash_host_cost.py", "logs", str(source), str(target), "c8ec8f7a3d0a"])
    with pytest.raises(SystemExit, match="already exists"):
        script.main()
    assert target.read_bytes() == b"earlier rows"
