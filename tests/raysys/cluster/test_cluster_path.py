"""The cluster path without a cluster: `raysys doctor` finds a taken head port, `raysys submit` builds a named job
that carries its commit and a results directory outside the job's temporary copy, `report --plots` draws every
study's plot, and a rank's telemetry samples what the dashboard shows (memory and utilisation)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pandas as pd
import pytest

from raysys import cli
from raysys.cluster.submit import HEAD_PORTS, job_spec, port_in_use
from raysys.cluster.telemetry import RankMonitor, SweepProgress
from raysys.results.records import git_sha_of

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_doctor_names_a_taken_dashboard_agent_port(taken_port, capsys):
    free = [str(_free_port()) for _ in range(3)]
    ports = ["--port", free[0], "--dashboard-port", free[1], "--ray-client-server-port", free[2]]
    assert port_in_use(taken_port) and not port_in_use(int(free[0]))
    assert cli.main(["doctor", *ports, "--dashboard-agent-listen-port", str(taken_port)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"raysys doctor: port {taken_port} (dashboard agent HTTP (the job agent)) is in use")
    assert "No available agent to submit job" in line and "--dashboard-agent-listen-port <free port>" in line
    assert cli.main(["doctor", *ports, "--dashboard-agent-listen-port", str(_free_port())]) == 0
    assert "are free" in capsys.readouterr().out
    assert HEAD_PORTS["dashboard agent HTTP (the job agent)"][0] == 52365  # Ray 2.60's default


def test_submit_names_the_job_and_passes_the_commit_and_runs_dir(tmp_path):
    spec = job_spec(["--", "python", "sweeps/ddp.py", "--device", "cpu"], name=None, working_dir=REPO,
                    runs_dir=tmp_path / "runs")
    env = spec["runtime_env"]["env_vars"]
    sha = git_sha_of(REPO)
    assert sha and env["RAYSYS_GIT_SHA"] == sha == spec["metadata"]["git_sha"]
    assert env["RAYSYS_RUNS_DIR"] == str(tmp_path / "runs") and env["RAYSYS_JOB_NAME"] == "ddp"
    assert spec["submission_id"].startswith("ddp-") and spec["metadata"]["job_name"] == "ddp"
    assert spec["entrypoint"] == "python sweeps/ddp.py --device cpu"
    assert spec["runtime_env"]["working_dir"] == str(REPO)
    named = job_spec(["python", "-c", "print(1)"], name="smoke", working_dir=tmp_path, runs_dir="runs")
    assert named["submission_id"].startswith("smoke-") and named["metadata"]["git_sha"] == "unknown"  # no repo
    for entrypoint, kwargs, match in [([], {}, "no command to run"),
                                      (["python", "x.py"], {"working_dir": tmp_path / "nope"}, "not a directory"),
                                      (["python", "x.py"], {"name": "../x"}, "sweep name")]:
        with pytest.raises(ValueError, match=match):
            job_spec(entrypoint, **{"name": None, "working_dir": tmp_path, "runs_dir": "runs", **kwargs})


def test_submit_without_a_dashboard_is_one_line(capsys):
    port = _free_port()
    assert cli.main(["submit", "--address", f"http://127.0.0.1:{port}", "--", "python", "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"raysys submit: error: no Ray dashboard answers at http://127.0.0.1:{port}: start a head with "
                   f"`ray start --head` or pass --address")


@pytest.mark.slow
def test_report_plots_draws_every_study_that_has_a_plot(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    for stem in ("ddp", "sharded_optimizer", "checkpointing", "allreduce", "e2e_timing", "fsdp"):
        (results / f"{stem}.parquet").write_bytes((REPO / "results" / f"{stem}.parquet").read_bytes())
    (results / "broken.parquet").write_bytes(b"not parquet")
    pd.DataFrame({"sweep": ["ddp_compiled"], "trial_id": ["x"]}).to_parquet(results / "ddp_compiled.parquet")
    assert cli.main(["report", str(results), "--plots", str(tmp_path / "plots")]) == 1  # not every file drew
    drawn = sorted(p.relative_to(tmp_path / "plots").as_posix() for p in (tmp_path / "plots").rglob("*.png"))
    # Laid out as the studies lay out their own (the committed results/ layout): results/plots/ for these two.
    assert {"ddp.png", "sharded_optimizer.png", "allreduce.png", "plots/e2e_timing.png"} <= set(drawn)
    assert any(p.startswith("plots/checkpointing_") for p in drawn)
    err = capsys.readouterr().err
    assert "no plot of ddp_compiled.parquet" in err  # a file its plot cannot draw: one line, the others drawn


def test_rank_monitor_samples_memory_and_cpu_utilisation():
    monitor = RankMonitor("toy", 0, "cpu", interval_s=0.05)
    assert monitor.tags == {"sweep": "toy", "rank": "0", "device": "cpu"}
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # busy: the process's CPU time grows with the wall time
        sum(range(10_000))
    sample = monitor.sample()
    assert sample["memory_bytes"] > 50 * 2**20 and 20 < sample["utilization_percent"] <= 100 * 64
    monitor.start()
    time.sleep(0.2)
    monitor.stop()
    assert monitor._thread is None
    SweepProgress("toy", 3).update(1, 0)  # without Ray: nothing to record, nothing raised
    with pytest.raises(ValueError, match="interval_s"):
        RankMonitor("toy", 0, "cpu", interval_s=0)


def _readme_commands() -> list[str]:
    """The README's shell lines: continuations joined, comments and extra blanks dropped."""
    text = (REPO / "README.md").read_text()
    blocks = text.split("```bash\n")[1:]
    lines = []
    for block in (b.split("```", 1)[0] for b in blocks):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line:
                lines.append(" ".join(line.split()))
    return lines


def test_doctor_checks_the_ports_of_the_readme_head_command(monkeypatch, capsys):
    """The README's cluster recipe runs `doctor` before its head command, which passes `--dashboard-agent-listen-port
    0`: doctor failed over Ray's default 52365 there, a port that command never binds."""
    from raysys.cluster import submit

    commands = _readme_commands()
    recipe = commands.index("python -m raysys doctor")
    assert commands[recipe + 1] == submit.HEAD_COMMAND   # the next step is the command doctor checks for
    ports = submit.head_command_ports()
    assert ports == {"--port": 6379, "--dashboard-port": 8265, "--dashboard-agent-listen-port": 0,
                     "--ray-client-server-port": 10001, "--metrics-export-port": 8080}
    taken = {52365}
    monkeypatch.setattr(submit, "port_in_use", lambda port, host="": port in taken)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("raysys doctor: the ports `ray start --head` binds are free: 6379 (gcs), 8265 "
                             "(dashboard), any free port (dashboard agent HTTP (the job agent))")
    assert out[1] == ("raysys doctor: note: 52365, Ray's default dashboard agent port, is in use here: keep "
                      "`--dashboard-agent-listen-port 0` on the head and on every node you add")
    taken = {8265}   # a port the README's head does bind
    assert cli.main(["doctor"]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("raysys doctor: port 8265 (dashboard) is in use on this machine")
    taken = {52365}  # Ray's default agent port, named explicitly
    assert cli.main(["doctor", "--dashboard-agent-listen-port", "52365"]) == 1
    assert "No available agent to submit job" in capsys.readouterr().out


@pytest.mark.parametrize("runtime_env, out, warns", [
    ({"env_vars": {}}, None, False),                                          # `ray job submit -- python ...`
    ({"working_dir": "gcs://_ray_pkg_0123abcd.zip", "env_vars": {}}, None, True),  # ... --working-dir .
    ({"working_dir": "gcs://_ray_pkg_0123abcd.zip"}, "{abs}", False),         # ... --out "$PWD/runs/x"
])
def test_the_temporary_directory_warning_only_where_ray_uploaded_one(tmp_path, monkeypatch, runtime_env, out, warns):
    """A plain `ray job submit -- python sweeps/ddp.py` runs where the head started and keeps its ./runs/: it warned
    that results went to the job's temporary working directory; only a job with an uploaded working dir does."""
    import json
    import warnings

    from raysys.cluster.studies import resolve_out_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYSYS_RUNS_DIR", raising=False)
    monkeypatch.delenv("RAYSYS_RESULTS_DIR", raising=False)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": runtime_env, "metadata": {}}))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-kept"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = resolve_out_dir(out and str(elsewhere), "ddp")
    said = [str(w.message) for w in caught if "temporary working directory" in str(w.message)]
    assert bool(said) == warns, said
    assert path.is_dir() and (path.is_relative_to(tmp_path) or path == elsewhere)


def test_task_names_put_what_differs_between_trials_first():
    """Four bucketed DDP trials all read `variant=bucketed,profile=False,compile=` in the dashboard (the first 120
    characters of each config); each name now starts with what tells it from the others."""
    from raysys.cluster.sweep import trial_labels
    from sweeps import ddp

    args = ddp.build_parser().parse_args(["--variants", "bucketed:1,bucketed:10,bucketed:100,bucketed:1000",
                                          "--device", "cpu"])
    trials = ddp.grid(args, "cpu", 2)
    labels = trial_labels(trials)
    assert len(set(labels)) == 4 and all(len(label) <= 120 for label in labels)
    assert labels[0].startswith("label=bucketed 1MB,bucket_size_mb=1.0,size=tiny,")
    assert trial_labels([{"a": 1, "b": 2}, {"a": 1, "b": 3}]) == ["b=2,a=1", "b=3,a=1"]
    assert trial_labels([{"a": 1}]) == ["a=1"] and trial_labels([{}]) == ["trial"]


class _Answers:
    """A local HTTP server answering GET paths with fixed JSON (Prometheus' query API, Grafana's health)."""

    def __init__(self, answers: dict[str, dict]):
        import http.server
        import json
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = answers.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(json.dumps(body).encode() if body is not None else b"")

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_metrics_says_whether_prometheus_and_grafana_answer_and_how_to_start_them(tmp_path, monkeypatch, capsys):
    """The Metrics tab needs Prometheus and Grafana, which the README did not say how to start: `raysys metrics` asks
    both what the dashboard asks and prints the command for the one that does not answer."""
    temp = tmp_path / "ray"
    assert cli.main(["metrics", "--temp-dir", str(temp)]) == 2
    assert f"no Ray head on this machine: {temp}/session_latest/metrics does not exist" in capsys.readouterr().err
    (temp / "session_latest" / "metrics" / "grafana").mkdir(parents=True)
    prometheus = _Answers({"/api/v1/query?query=vector(1)": {"status": "success", "data": {}}})
    grafana = _Answers({"/api/health": {"database": "ok", "version": "11"}})
    try:
        monkeypatch.setenv("RAY_PROMETHEUS_HOST", prometheus.url)
        monkeypatch.setenv("RAY_GRAFANA_HOST", grafana.url + "/")
        assert cli.main(["metrics", "--temp-dir", str(temp)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"raysys metrics: Prometheus answers at {prometheus.url}",
                       f"raysys metrics: Grafana answers at {grafana.url}",
                       "raysys metrics: the dashboard's Metrics tab has its panels (ray_raysys_* while a study runs)"]
    finally:
        grafana.close()
    monkeypatch.setenv("RAY_GRAFANA_HOST", f"http://127.0.0.1:{_free_port()}")   # nothing listens
    try:
        assert cli.main(["metrics", "--temp-dir", str(temp), "--timeout-s", "1"]) == 1
        _, line = capsys.readouterr().out.splitlines()
        assert line.startswith("raysys metrics: Grafana does not answer at http://127.0.0.1:")
        assert f"start it: grafana server --config {temp}/session_latest/metrics/grafana/grafana.ini --homepath" in line
    finally:
        prometheus.close()
    bad = _Answers({"/api/v1/query?query=vector(1)": {"status": "error"}})   # up, but its query engine is not
    try:
        monkeypatch.setenv("RAY_PROMETHEUS_HOST", bad.url)
        assert cli.main(["metrics", "--temp-dir", str(temp), "--timeout-s", "1"]) == 1
        first = capsys.readouterr().out.splitlines()[0]
        config = temp / "session_latest" / "metrics" / "prometheus" / "prometheus.yml"
        assert first == (f"raysys metrics: Prometheus does not answer at {bad.url}; on the head, start it: prometheus "
                         f"--config.file {config} --web.enable-lifecycle")
    finally:
        bad.close()
    from raysys.cluster.submit import PROMETHEUS_START

    assert PROMETHEUS_START == "(cd /tmp && ray metrics launch-prometheus)" and PROMETHEUS_START in _readme_commands()
