"""The GPU-only scripts on a machine without the GPU they need: one line, exit 2, nothing written."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.subprocess_utils import REPO, repo_env


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
