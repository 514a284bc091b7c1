"""How the README runs a study, in a clean environment (no PYTHONPATH), from the repository root; and that no module
but `raysys/__main__.py` edits `sys.path`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.subprocess_utils import REPO

EDITS = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\[[^\]]*\]\s*=|sys\.path\s*[+]?=")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0"}


def report_only(tmp_path, argv: list[str]) -> subprocess.CompletedProcess:
    """README: "`python sweeps/<study>.py --report-only --out results` redraws one study's tables", on a copy."""
    shutil.copy(REPO / "results" / "fsdp.parquet", tmp_path / "fsdp.parquet")
    return subprocess.run([sys.executable, *argv, "--report-only", "--out", str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def test_python_m_sweeps_runs_this_checkout_without_install_or_pythonpath(tmp_path):
    proc = report_only(tmp_path, ["-m", "sweeps.fsdp"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "fsdp.md").read_text().startswith("#") and f"wrote {tmp_path}" in proc.stdout


def test_python_sweeps_script_as_written_in_the_readme(tmp_path):
    """`python sweeps/fsdp.py` imports the installed project: meaningful where that install is this checkout."""
    where = subprocess.run([sys.executable, "-c", "import raysys, sweeps; print(raysys.__file__, sweeps.__file__)"],
                           cwd=REPO / "sweeps", env=clean_env(), capture_output=True, text=True, timeout=120)
    if where.returncode != 0 or not all(p.startswith(str(REPO)) for p in where.stdout.split()):
        pytest.skip(f"the installed project is not this checkout ({where.stdout.strip() or where.stderr[-200:]}); "
                    "`pip install -e .` here runs this test")
    proc = report_only(tmp_path, ["sweeps/fsdp.py"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "fsdp.md").read_text().startswith("#")


def test_no_module_but_raysys_main_edits_sys_path():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    editing = [f for f in files.stdout.split() if (REPO / f).is_file() and EDITS.search((REPO / f).read_text())]
    assert editing == ["raysys/__main__.py"], editing
