"""The cluster path: `python -m raysys submit` (a named job that knows its commit), `python -m raysys doctor` (before
the head starts) and `python -m raysys metrics` (Prometheus and Grafana for the dashboard's Metrics tab).

`submit` wraps Ray's `JobSubmissionClient`: it uploads the working directory, names the job (`<name>-<UTC
time>-<hex>`), attaches metadata and sets `RAYSYS_GIT_SHA` and `RAYSYS_RUNS_DIR` in the job's env, then follows
its logs and exits 0 if it succeeded; a head without a job agent is said with its fix. `doctor` checks which ports
the README's head command (`HEAD_COMMAND`) binds are taken; `metrics` asks the Prometheus and Grafana the dashboard
reads and prints how to start one that does not answer. docs/raysys.md has the details.

    python -m raysys doctor                                  # before `ray start --head`
    python -m raysys submit -- python sweeps/ddp.py --device cpu
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import getpass
import json
import os
import re
import shlex
import socket
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from raysys.results.records import check_sweep_name, git_sha_of

if TYPE_CHECKING:
    import argparse

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# What `ray start --head` binds by default (Ray 2.60), with the flag that moves each (Ray picks the metrics export
# port at random: 8080 is the one the README's head command passes).
HEAD_PORTS = {
    "gcs": (6379, "--port"),
    "dashboard": (8265, "--dashboard-port"),
    "dashboard agent HTTP (the job agent)": (52365, "--dashboard-agent-listen-port"),
    "Ray client server": (10001, "--ray-client-server-port"),
    "metrics export": (8080, "--metrics-export-port"),
}
AGENT_FLAG = "--dashboard-agent-listen-port"
NO_AGENT = "No available agent to submit job"
HEAD_COMMAND = ("ray start --head --dashboard-host 127.0.0.1 --dashboard-port 8265 --dashboard-agent-listen-port 0 "
                "--metrics-export-port 8080")
"""The head command of the README's cluster recipe, whose ports `doctor` checks by default (the tests hold the README
to it)."""

def head_command_ports(command: str = HEAD_COMMAND) -> dict[str, int]:
    """The port of each `HEAD_PORTS` flag that `command` binds: its value there, else Ray's default (0: any free
    port, nothing to check)."""
    words = shlex.split(command)
    given = {w: int(words[i + 1]) for i, w in enumerate(words[:-1]) if w in {f for _, f in HEAD_PORTS.values()}}
    return {flag: given.get(flag, default) for default, flag in HEAD_PORTS.values()}

def _address(address: str | None) -> str:
    chosen = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    if "://" not in chosen:  # `RAY_ADDRESS=<ip>:6379` names the GCS, not the dashboard
        chosen = DEFAULT_ADDRESS
    return chosen.rstrip("/")

def port_in_use(port: int, host: str = "") -> bool:
    """Whether a TCP listener could not bind `port` on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False

def _agent_hint(address: str) -> str:
    host = address.split("://", 1)[1].split(":")[0]
    local = host in ("127.0.0.1", "localhost", socket.gethostname())
    default_taken = local and port_in_use(HEAD_PORTS["dashboard agent HTTP (the job agent)"][0])
    return ("the head's dashboard agent serves no HTTP, so no job can be submitted; usually its port (52365 unless "
            "`ray start --dashboard-agent-listen-port` moved it) was taken when the head started"
            + (" (52365 is in use on this machine now)" if default_taken else "")
            + ". Restart the head with `ray stop` and `ray start --head --dashboard-agent-listen-port 0 ...` "
              "(any free port); `python -m raysys doctor` lists the head's ports that are taken. A head started "
              "moments ago on a busy machine can answer the same while its agent starts (Ray waits 10 s for it): "
              "then submit again in a minute")

# ---------------------------------------------------------------------------------------------------- submit
def job_spec(entrypoint: list[str], *, name: str | None, working_dir: str | os.PathLike,
             runs_dir: str | os.PathLike) -> dict:
    """The `JobSubmissionClient.submit_job` arguments of a raysys job (no network): entrypoint, submission id,
    runtime env (working dir, `RAYSYS_GIT_SHA`, `RAYSYS_RUNS_DIR`, `RAYSYS_JOB_NAME`) and metadata."""
    if entrypoint[:1] == ["--"]:
        entrypoint = entrypoint[1:]
    if not entrypoint:
        raise ValueError("no command to run: put it after `--`, e.g. -- python sweeps/ddp.py")
    work = Path(working_dir).expanduser().resolve()
    if not work.is_dir():
        raise ValueError(f"--working-dir {work} is not a directory")
    if name is None:  # the script's stem (`python sweeps/ddp.py` -> ddp), else the program's name
        script = next((a for a in entrypoint if a.endswith(".py")), None)
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(script).stem if script else Path(entrypoint[0]).name) or "job"
    check_sweep_name(name)
    sha = git_sha_of(work) or "unknown"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = shlex.join(entrypoint)
    env = {"RAYSYS_GIT_SHA": sha, "RAYSYS_RUNS_DIR": str(Path(runs_dir).expanduser().resolve()),
           "RAYSYS_JOB_NAME": name}
    return {
        "entrypoint": command,
        "submission_id": f"{name}-{stamp}-{uuid.uuid4().hex[:4]}",
        "runtime_env": {"working_dir": str(work), "env_vars": env, "excludes": ["/runs/", "/.venv/", "/.git/"]},
        "metadata": {"job_name": name, "git_sha": sha, "command": command,
                     "submitted_by": f"{getpass.getuser()}@{socket.gethostname()}", "submitted_from": str(work)},
    }

async def _follow(client, submission_id: str) -> None:
    async for lines in client.tail_job_logs(submission_id):
        print(lines, end="", flush=True)

def run_submit(args: argparse.Namespace) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    spec = job_spec(args.entrypoint, name=args.name, working_dir=args.working_dir, runs_dir=args.runs_dir)
    address = _address(args.address)
    try:
        client = JobSubmissionClient(address)
    except ConnectionError:
        raise ValueError(f"no Ray dashboard answers at {address}: start a head with `ray start --head` or pass "
                         f"--address") from None
    try:
        submission_id = client.submit_job(**spec)
    except RuntimeError as exc:
        text = str(exc)
        if NO_AGENT in text:
            raise ValueError(f"{address} answered HTTP 500 '{NO_AGENT}': {_agent_hint(address)}") from None
        if "status code 401" in text or "status code 403" in text:
            raise ValueError(f"{address} refused the job ({text.split(':', 1)[0]}): token authentication needs "
                             f"RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)") from None
        raise
    meta = spec["metadata"]
    print(f"submitted job {submission_id} (commit {meta['git_sha']}) to {address}; results without --out go to "
          f"{spec['runtime_env']['env_vars']['RAYSYS_RUNS_DIR']}", flush=True)
    if args.no_wait:
        print(f"follow it with `ray job logs -f {submission_id} --address {address}`")
        return 0
    try:
        asyncio.run(_follow(client, submission_id))
    except KeyboardInterrupt:
        print(f"\nstopped following; the job keeps running: `ray job stop {submission_id} --address {address}` "
              f"stops it", file=sys.stderr)
        return 130
    status = client.get_job_status(submission_id)
    print(f"job {submission_id}: {status.value}", flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1

# ---------------------------------------------------------------------------------------------------- doctor
def run_doctor(args: argparse.Namespace) -> int:
    """Exit 0 when every port the head command will bind is free here (by default the README's `HEAD_COMMAND`; 0 is
    any free port), else 1 with a line per taken port."""
    problems = []
    ports = {flag: getattr(args, flag.lstrip("-").replace("-", "_")) for _, flag in HEAD_PORTS.values()}
    for what, (default, flag) in HEAD_PORTS.items():
        port = ports[flag]
        if port and port_in_use(port):
            effect = (" (the head would run without a job agent: `ray job submit` and `raysys submit` would answer "
                      f"HTTP 500 '{NO_AGENT}')" if flag == AGENT_FLAG else "")
            problems.append(f"port {port} ({what}) is in use on this machine{effect}; pass `ray start --head "
                            f"{flag} <free port>`" + (" (0: any free port)" if flag == AGENT_FLAG else ""))
    for line in problems:
        print(f"raysys doctor: {line}")
    if not problems:
        print("raysys doctor: the ports `ray start --head` binds are free: "
              + ", ".join(f"{ports[f] or 'any free port'} ({w})" for w, (_, f) in HEAD_PORTS.items()))
        ray_default = HEAD_PORTS["dashboard agent HTTP (the job agent)"][0]
        if ports[AGENT_FLAG] == 0 and port_in_use(ray_default):
            print(f"raysys doctor: note: {ray_default}, Ray's default dashboard agent port, is in use here: keep "
                  f"`{AGENT_FLAG} 0` on the head and on every node you add")
    return 1 if problems else 0

# ---------------------------------------------------------------------------------------------------- metrics
PROMETHEUS = ("RAY_PROMETHEUS_HOST", "http://localhost:9090")  # what the dashboard reads (Ray 2.60's defaults)
GRAFANA = ("RAY_GRAFANA_HOST", "http://localhost:3000")
PROMETHEUS_START = "(cd /tmp && ray metrics launch-prometheus)"
"""Ray's own launcher: downloads Prometheus into the current directory (hence /tmp), starts it in the background
with `/tmp/ray/session_latest/metrics/prometheus/prometheus.yml`, which finds every node's metrics port."""

def _get_json(url: str, timeout_s: float) -> dict | None:
    """The JSON `url` answers with 200, else None (nothing listening, another status, not JSON)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = json.loads(resp.read().decode() or "null")
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors; a bad body is a ValueError
        return None
    return body if isinstance(body, dict) else None

def metrics_status(temp_dir: str | os.PathLike = "/tmp/ray", timeout_s: float = 3.0
                   ) -> list[tuple[str, str, bool, str]]:
    """(service, host, answers, how to start it) for Prometheus and Grafana, each asked what the dashboard asks:
    Prometheus a query (`vector(1)`), Grafana its health (database ok). A ValueError when this machine has no Ray
    head session (no `<temp_dir>/session_latest/metrics/`, which the head writes the configs to)."""
    if not timeout_s > 0:
        raise ValueError(f"--timeout-s ({timeout_s!r}) must be > 0")
    metrics = Path(temp_dir) / "session_latest" / "metrics"
    if not metrics.is_dir():
        raise ValueError(f"no Ray head on this machine: {metrics} does not exist (start one with `{HEAD_COMMAND}`, "
                         f"or pass the head's --temp-dir)")
    prometheus = os.environ.get(*PROMETHEUS).rstrip("/")
    grafana = os.environ.get(*GRAFANA).rstrip("/")
    config = metrics / "prometheus" / "prometheus.yml"
    start_prometheus = (PROMETHEUS_START if Path(temp_dir) == Path("/tmp/ray")
                        else f"prometheus --config.file {config} --web.enable-lifecycle")
    start_grafana = (f"grafana server --config {metrics / 'grafana' / 'grafana.ini'} --homepath <Grafana's "
                     f"install directory, e.g. /usr/share/grafana> web")
    answer = _get_json(f"{prometheus}/api/v1/query?query=vector(1)", timeout_s)
    prometheus_up = answer is not None and answer.get("status") == "success"
    health = _get_json(f"{grafana}/api/health", timeout_s)
    grafana_up = health is not None and health.get("database") == "ok"
    return [("Prometheus", prometheus, prometheus_up, start_prometheus),
            ("Grafana", grafana, grafana_up, start_grafana)]

def run_metrics(args: argparse.Namespace) -> int:
    """Exit 0 when Prometheus and Grafana both answer as the dashboard needs, else 1 with the command that starts the
    missing one."""
    status = metrics_status(args.temp_dir, args.timeout_s)
    for service, host, up, start in status:
        if up:
            print(f"raysys metrics: {service} answers at {host}")
        else:
            print(f"raysys metrics: {service} does not answer at {host}; on the head, start it: {start}")
    if all(up for _, _, up, _ in status):
        print("raysys metrics: the dashboard's Metrics tab has its panels (ray_raysys_* while a study runs)")
        return 0
    return 1
