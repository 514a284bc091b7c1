"""The README's cluster recipe against a real `ray start --head` (token auth, `--dashboard-agent-listen-port 0`):
`python -m raysys submit` runs a sweep as a named job whose rows carry the submitter's commit and land in the
submitter's runs directory; while a study runs, the dashboard shows its ranks and progress (Ray's state API:
named actors and `[i/n]` tasks; the node's metrics endpoint: per-rank memory / utilisation and trial gauges);
a wrong token is refused. A head whose dashboard agent port is taken cannot take jobs: `submit` says why.

Each head runs as `ray start --head --block` in a subprocess we own, with its own temporary directory and free
ports. Its running jobs are stopped first (the jobs API; a driver sits outside the head's process group), then the
head through its own process group (SIGTERM, then SIGKILL after 1 s): exactly what it started.
`ray stop` is not used here: it stops every Ray on the machine, including the test session's own cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from raysys.cluster.rank import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
RAY = str(Path(sys.executable).with_name("ray"))


def _ray_env(token: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYSYS_"))}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # as in an activated venv
    return env


def _get(url: str, token: str | None = None, timeout: float = 5) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}  # what curl needs: -H "Authorization: Bearer ..."
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
        return resp.read().decode()


@contextlib.contextmanager
def ray_head(token: str, agent_port: int, metrics_port: int | None = None, num_cpus: int = 2):
    """`ray start --head --block` with its own temp dir, free ports and `num_cpus` logical CPUs; yields the dashboard
    URL."""
    env = _ray_env(token)
    env["RAY_metrics_report_interval_ms"] = "1000"  # export gauges every second (default 10 s)
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    dash_port = free_port()
    ports = {"--port": free_port(), "--dashboard-port": dash_port, "--dashboard-agent-listen-port": agent_port,
             "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
             "--metrics-export-port": metrics_port or free_port(), "--ray-client-server-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port()}
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus", str(num_cpus), "--num-gpus", "0", "--object-store-memory",
         str(100 * 2**20), "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--temp-dir", temp_dir,
         "--disable-usage-stats", *[str(x) for kv in ports.items() for x in kv]],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{dash_port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if head.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {head.returncode}: {head.stdout.read()}")
            try:
                _get(f"{url}/api/version", token, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the dashboard at {url} did not come up") from None
                time.sleep(0.2)
        yield url
    finally:
        drivers = _stop_jobs(url, token)
        # Our `ray start --block` and what it started, nothing else. Ray's graceful shutdown (its raylet drains) takes
        # 15-60 s on two cores, so a grace of a few seconds was always spent in full; nothing here outlives the test,
        # so a short grace and then SIGKILL.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # the group: a raylet or worker still draining
        head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
    # A job's driver runs in a session of its own, out of the head's process group: one still running when the head
    # went would spin on its lost GCS connection (most of two cores, for a minute) after the test.
    alive = [pid for pid in drivers if _alive(pid)]
    assert not alive, f"job drivers outlived their head: {alive}"


def _stop_jobs(url: str, token: str) -> list[int]:
    """Stop every job of the head that has not ended and wait (at most 60 s) until each has; returns the drivers'
    pids. Nothing, if the head does not answer."""
    try:
        jobs = json.loads(_get(f"{url}/api/jobs/", token))
        for job in jobs:
            if job["status"] in ("PENDING", "RUNNING"):
                request = urllib.request.Request(f"{url}/api/jobs/{job['submission_id']}/stop", method="POST",
                                                 headers={"Authorization": f"Bearer {token}"})
                urllib.request.urlopen(request, timeout=10).close()
    except OSError:  # the head is gone or did not start: nothing of ours to stop
        return []
    drivers = [j["driver_info"]["pid"] for j in jobs if (j.get("driver_info") or {}).get("pid")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(int(pid)) for pid in drivers):
        time.sleep(0.2)
    return [int(pid) for pid in drivers]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (ProcessLookupError, FileNotFoundError):  # gone (also between the two looks)
        return False


def _work_repo(tmp_path: Path) -> tuple[Path, str]:
    """A git repository with the packages a sweep imports (the repo minus its virtualenv and results)."""
    work = tmp_path / "work"
    for pkg in ("raysys", "parallel", "sweeps", "kernels"):
        shutil.copytree(REPO / pkg, work / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (work / "telemetry_demo.py").write_text(textwrap.dedent("""
        import time
        from raysys.cluster.sweep import run_sweep

        def trial(ctx, config):
            held = bytearray(64 * 2**20)  # memory the rank's gauge should see
            time.sleep(config["sleep_s"])
            return {"held_bytes": len(held)}

        if __name__ == "__main__":
            run_sweep("telemetry_demo", [{"i": i, "sleep_s": 5.0} for i in range(4)], trial, 2, device="cpu")
    """))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(work)]
    subprocess.run([*git[:1], "init", "-q", str(work)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "work"], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    return work, sha


def _submit_command(url: str, work: Path, runs: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "raysys", "submit", "--address", url, "--working-dir", str(work), "--runs-dir",
            str(runs), *args]


def _submit(url: str, token: str, work: Path, runs: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_submit_command(url, work, runs, *args), cwd=work, env=_ray_env(token), capture_output=True,
                          text=True, timeout=timeout)


def _state(url: str, token: str, kind: str) -> list[dict]:
    body = json.loads(_get(f"{url}/api/v0/{kind}?limit=1000&detail=1", token))
    return body["data"]["result"]["result"]


def test_readme_recipe_submit_named_job_with_commit_and_dashboard_telemetry(tmp_path):
    token = secrets.token_hex(16)
    work, sha = _work_repo(tmp_path)
    runs = tmp_path / "runs"
    metrics_port = free_port()
    # 4 logical CPUs: the sweep that `submit` follows and the study whose telemetry is read (2 ranks each) run at the
    # same time, so the one's waits (job start, trial sleeps, metric exports) overlap the other's.
    logs = tmp_path / "followed.out"  # a file, not a pipe: nobody reads a pipe while the study is watched
    with ray_head(token, agent_port=0, metrics_port=metrics_port, num_cpus=4) as url, open(logs, "w") as log:
        followed = subprocess.Popen(  # the README's --dashboard-agent-listen-port 0
            _submit_command(url, work, runs, "--", "python", "sweeps/allreduce.py", "--device", "cpu",
                            "--world-sizes", "2", "--sizes", "1KB", "--ops", "all_reduce", "--launchers", "ray",
                            "--iters", "2"),
            cwd=work, env=_ray_env(token), stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            # a study while it runs: named rank actors, tasks named with the trial's place, gauges on the node
            started = _submit(url, token, work, runs, "--no-wait", "--", "python", "telemetry_demo.py", timeout=120)
            assert started.returncode == 0, started.stderr[-3000:]
            seen, deadline = "", time.monotonic() + 150
            study = r'(?=[^}]*sweep="telemetry_demo")'  # the study's series, not the followed sweep's
            wanted = [rf'ray_raysys_rank_memory_bytes\{{{study}[^}}]*rank="0"[^}}]*\}} (\S+)',
                      rf'ray_raysys_rank_memory_bytes\{{{study}[^}}]*rank="1"[^}}]*\}} (\S+)',
                      rf'ray_raysys_rank_utilization_percent\{{{study}[^}}]*rank="1"[^}}]*\}} (\S+)',
                      rf'ray_raysys_sweep_trials\{{{study}[^}}]*state="total"[^}}]*\}} (\S+)']
            while time.monotonic() < deadline:
                seen = _get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)  # Prometheus format, no token
                if all(re.search(w, seen) for w in wanted):
                    break
                time.sleep(1)
            found = [re.search(w, seen) for w in wanted]
            assert all(found), [w for w, f in zip(wanted, found) if not f]
            assert 'sweep="telemetry_demo"' in seen and 'device="cpu"' in seen
            assert float(found[0].group(1)) > 64 * 2**20 and float(found[3].group(1)) == 4
            actors = [a for a in _state(url, token, "actors") if a.get("class_name") == "RankActor"]
            assert {a["name"].split("#")[0] for a in actors} >= {"telemetry_demo"}
            tasks = [t["name"] for t in _state(url, token, "tasks")]
            assert any(re.match(r"telemetry_demo\.rank[01]:\[\d/4\] i=", name) for name in tasks), tasks[:20]

            refused = subprocess.run([RAY, "job", "list", "--address", url], env=_ray_env("not-the-token"),
                                     capture_output=True, text=True, timeout=60)
            assert refused.returncode != 0, refused.stdout

            followed.wait(timeout=300)
        finally:
            if followed.poll() is None:
                followed.kill()
                followed.wait()
        assert followed.returncode == 0, logs.read_text()[-6000:]
        (out,) = runs.glob("*-allreduce")  # no --out: the submitter's runs dir, not the job's temporary copy
        df = pd.read_parquet(out / "allreduce.parquet")
        assert list(df["status"]) == ["ok"] and df["busbw_GBps"].iloc[0] > 0
        assert list(df["git_sha"]) == [sha]  # the commit reached the job without a .git
        assert (out / "allreduce.md").exists() and (out / "allreduce.png").exists()
        jobs = json.loads(_get(f"{url}/api/jobs/", token))
        (job,) = [j for j in jobs if (j.get("submission_id") or "").startswith("allreduce-")]
        assert job["status"] == "SUCCEEDED" and job["metadata"]["job_name"] == "allreduce"
        assert job["metadata"]["git_sha"] == sha and job["entrypoint"].startswith("python sweeps/allreduce.py")


def test_a_taken_dashboard_agent_port_is_explained(tmp_path):
    token = secrets.token_hex(16)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with ray_head(token, agent_port=taken) as url:
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "raysys", "submit", "--address", url, "--working-dir",
                                   str(tmp_path), "--", "python", "-c", "print(1)"], env=_ray_env(token),
                                  capture_output=True, text=True, timeout=180)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
            line = done.stderr.strip().splitlines()[-1]  # after the client's own "uploading ..." log lines
            assert line.startswith("raysys submit: error: ") and "answered HTTP 500 'No available agent to submit job'" in line
            assert "--dashboard-agent-listen-port 0" in line and time.monotonic() - t0 < 120
