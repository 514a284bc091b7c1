"""Smoke test of the README's cluster recipe: `ray start --head` with token auth, `ray job submit
--working-dir ... -- python sweeps/allreduce.py --out <abs dir>`, results on disk, a wrong token refused.

The head runs as `ray start --head --block` in a subprocess we own, with its own temporary directory and free
ports, and is stopped by terminating that process (which shuts down exactly the processes it started).
`ray stop` is not used here: it stops every Ray on the machine, including the test session's own cluster.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from raysys.rank import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _ray_env(token: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # as in an activated venv
    return env


def _wait_for_dashboard(url: str, token: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start` exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            req = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the dashboard at {url} did not come up within {timeout_s:g} s")


def test_ray_start_job_submit_with_token_auth(tmp_path):
    token = secrets.token_hex(16)
    env = _ray_env(token)
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    dash_port = free_port()
    ports = {"--port": free_port(), "--dashboard-port": dash_port, "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
             "--metrics-export-port": free_port(), "--ray-client-server-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port()}
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus", "2", "--num-gpus", "0", "--object-store-memory",
         str(100 * 2**20), "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--temp-dir", temp_dir,
         "--disable-usage-stats", *[str(x) for kv in ports.items() for x in kv]],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{dash_port}"
    try:
        _wait_for_dashboard(url, token, head)
        # The job's working dir: the packages the sweep imports (the repo minus its virtualenv and results).
        work = tmp_path / "work"
        for pkg in ("raysys", "parallel", "sweeps"):
            shutil.copytree(REPO / pkg, work / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        out = tmp_path / "results"
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", url, "--working-dir", str(work), "--",
             "python", "sweeps/allreduce.py", "--device", "cpu", "--world-sizes", "2", "--sizes", "1KB",
             "--ops", "all_reduce", "--launchers", "ray", "--iters", "2", "--out", str(out)],
            env=env, capture_output=True, text=True, timeout=240)
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        df = pd.read_parquet(out / "allreduce.parquet")
        assert list(df["status"]) == ["ok"] and df["busbw_GBps"].iloc[0] > 0
        assert (out / "allreduce.md").exists() and (out / "allreduce.png").exists()

        refused = subprocess.run([RAY, "job", "list", "--address", url], env=_ray_env("not-the-token"),
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0, refused.stdout
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # our `ray start --block` and only it; it stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
