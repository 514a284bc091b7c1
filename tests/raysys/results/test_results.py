"""raysys.results.records / raysys.results.files: a run never replaces or mixes results silently, under faults too.

Modes (new refuses, resume checks commit / configuration / device, overwrite), the writer's lock against a
second process, a writer SIGKILLed mid-write (the old file stays readable, its temp file is cleaned up), a full
disk (mocked ENOSPC, and a real 64 KiB tmpfs where this user may mount one), file modes under the umask, keys
that would overwrite a row column, the tolerant reader and the fresh default run directory."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from raysys import cli
from raysys.results import files
from raysys.results.records import (DiskFull, FileBusy, ResultsError, ResultWriter, default_out_dir, make_row,
                                    provenance, read_results, resolve_out, save_figure, status_of, trial_id, write_text)

REPO = Path(__file__).resolve().parents[3]


def _rows(n: int, start: int = 0, sweep: str = "demo", **metrics) -> list[dict]:
    return [make_row(sweep, {"i": i}, {"m": float(i), **metrics}) for i in range(start, start + n)]


# ---------------------------------------------------------------------------------------------------- modes
def test_new_refuses_an_existing_file_resume_keeps_it_overwrite_replaces_it(tmp_path):
    with ResultWriter(tmp_path, "demo") as w:
        w.write(_rows(3))
    with pytest.raises(ResultsError, match=r"demo.parquet already exists; pass --resume .* --overwrite"):
        ResultWriter(tmp_path, "demo")
    with ResultWriter(tmp_path, "demo", resume=True) as w:
        assert w.done(trial_id({"i": 2})) and not w.done(trial_id({"i": 3}))
        w.write(_rows(1, start=3))
    assert sorted(read_results(tmp_path / "demo.parquet")["i"]) == [0, 1, 2, 3]
    with ResultWriter(tmp_path, "demo", mode="overwrite") as w:
        assert w.rows == []
        assert len(read_results(tmp_path / "demo.parquet")) == 4  # the old file stays until the first write
        w.write(_rows(1, start=7))
    assert list(read_results(tmp_path / "demo.parquet")["i"]) == [7]
    with pytest.raises(ValueError, match="mode 'append'"):
        ResultWriter(tmp_path, "demo", mode="append")
    with pytest.raises(ValueError, match="not a row of sweep 'other'"):
        ResultWriter(tmp_path, "other").write(_rows(1))


def test_resume_refuses_rows_of_another_commit_configuration_or_device(tmp_path):
    here = provenance()["git_sha"]
    old = [dict(r, git_sha="0123456789ab") for r in _rows(2)]
    with pytest.raises(ResultsError, match=f"of commit 0123456789ab, this run is commit {here}; writing it would mix"):
        ResultWriter(tmp_path, "demo").write(old)
    ResultWriter(tmp_path, "demo", mode="overwrite", allow_mixed=True).write(old)
    with pytest.raises(ResultsError, match=f"rows of commit 0123456789ab, this run is commit {here}"):
        ResultWriter(tmp_path, "demo", resume=True)
    assert len(ResultWriter(tmp_path, "demo", resume=True, allow_mixed=True).rows) == 2

    rows = [make_row("demo", {"size": "xl", "i": i}, {"m": 1.0}, device_name="NVIDIA H200") for i in range(2)]
    ResultWriter(tmp_path, "demo", mode="overwrite").write(rows)
    with pytest.raises(ResultsError, match="rows with size = xl, this run has size = tiny"):
        ResultWriter(tmp_path, "demo", resume=True, expect={"size": "tiny"})
    w = ResultWriter(tmp_path, "demo", resume=True, expect={"size": "xl"})
    with pytest.raises(ResultsError, match="measured on NVIDIA H200, this row on cpu"):
        w.write([make_row("demo", {"size": "xl", "i": 5}, {"m": 1.0}, device_name="cpu")])
    w.write([make_row("demo", {"size": "xl", "i": 5}, status="error", error="x", device_name="cpu")])  # not measured
    w.write([make_row("demo", {"size": "xl", "i": 6}, {"m": 1.0}, device_name="NVIDIA H200")])
    w = ResultWriter(tmp_path, "demo", resume=True, allow_mixed=True)
    w.write([make_row("demo", {"size": "xl", "i": 7}, {"m": 1.0}, device_name="cpu")])
    assert len(read_results(tmp_path / "demo.parquet")) == 5


def test_write_takes_only_rows_with_a_known_status_and_provenance(tmp_path):
    """Issue 48: `write` accepted a hand-made row with status `hacked`, no provenance and a foreign commit."""
    good = _rows(1)[0]
    w = ResultWriter(tmp_path, "demo")
    for change, match in [({"status": "hacked"}, "status 'hacked'; a status is one of ok, oom, error"),
                          ({"git_sha": None}, "lacks its provenance: git_sha is None"),
                          ({"run_id": ""}, "lacks its provenance: run_id is ''"),
                          ({"git_sha": "HEAD~1; rm -rf"}, "git_sha 'HEAD~1; rm -rf'; it must be 12 hex digits"),
                          ({"run_id": "me"}, "run_id 'me'; it must be 12 hex digits"),
                          ({"utc": "yesterday"}, "utc 'yesterday'; it must be YYYY-mm-ddTHH:MM:SSZ"),
                          ({"git_sha": "fedcba987654"}, "is of commit fedcba987654, this run is commit")]:
        with pytest.raises(ValueError, match=match):
            w.write([{**good, **change}])
    hand_made = {k: v for k, v in good.items() if k not in ("torch_version", "host")}
    with pytest.raises(ValueError, match="lacks its provenance: torch_version is None"):
        w.write([hand_made])
    assert not (tmp_path / "demo.parquet").exists() and w.rows == []
    w.write([good])
    w.write([dict(good, m=2.0)])  # a row of the file rewritten (same trial, run and commit)
    assert read_results(tmp_path / "demo.parquet")["m"].tolist() == [2.0]


def test_resume_refuses_a_foreign_schema_and_rows_without_provenance(tmp_path):
    """Issue 48: `--resume` accepted `pd.DataFrame({'foo': [1, 2]})` as demo.parquet and rows without a git_sha."""
    import pandas as pd

    pd.DataFrame({"foo": [1, 2]}).to_parquet(tmp_path / "demo.parquet")
    for allow_mixed in (False, True):
        with pytest.raises(ResultsError, match=r"holds rows without sweep, trial_id, status \(not a raysys results "
                                               r"file\), not rows of sweep 'demo'; --overwrite replaces it"):
            ResultWriter(tmp_path, "demo", resume=True, allow_mixed=allow_mixed)
    pd.DataFrame(_rows(2, sweep="other")).to_parquet(tmp_path / "demo.parquet")
    with pytest.raises(ResultsError, match="holds rows of sweep other, not rows of sweep 'demo'"):
        ResultWriter(tmp_path, "demo", resume=True)
    bare = pd.DataFrame(_rows(2)).drop(columns=["git_sha", "host"])
    bare.to_parquet(tmp_path / "demo.parquet")
    with pytest.raises(ResultsError, match=r"holds rows without provenance \(git_sha, host\); resuming would mix"):
        ResultWriter(tmp_path, "demo", resume=True)
    assert len(ResultWriter(tmp_path, "demo", resume=True, allow_mixed=True).rows) == 2
    assert len(read_results(tmp_path / "demo.parquet")) == 2


def test_resume_compares_every_setting_and_each_trial_with_the_same_name(tmp_path):
    """`check_resume`: the run's settings (`expect`, a missing column counting as none), each trial that has the
    name (`key`) of one of this run's with the same configuration, and the device, all before anything runs."""
    configs = [{"dtype": "fp32", "label": v, "profile": False, "steps": 2, "launcher": "ray"} for v in ("a", "b")]
    ResultWriter(tmp_path, "demo").write([make_row("demo", c, {"m": 1.0}, device_name="cpu") for c in configs])
    for expect, match in [({"steps": 3}, "rows with steps = 2, this run has steps = 3"),
                          ({"launcher": "mp"}, "rows with launcher = ray, this run has launcher = mp"),
                          ({"world_size": 1}, "rows with world_size = none, this run has world_size = 1")]:
        with pytest.raises(ResultsError, match=match):
            ResultWriter(tmp_path, "demo", resume=True, expect=expect)
    w = ResultWriter(tmp_path, "demo", resume=True, expect={"steps": 2.0, "launcher": "ray", "world_size": None})
    w.check_resume(trials=[*configs, dict(configs[0], label="c")], key=("dtype", "label"), device_name="cpu")
    profiled = [dict(configs[0], profile=True)]
    with pytest.raises(ResultsError, match="holds the trial dtype fp32, label a with profile = False there, True here"):
        w.check_resume(trials=profiled, key=("dtype", "label"))
    with pytest.raises(ResultsError, match="holds rows measured on cpu, this run measures on NVIDIA H100"):
        w.check_resume(device_name="NVIDIA H100")
    w.close()
    mixed = ResultWriter(tmp_path, "demo", resume=True, allow_mixed=True, expect={"steps": 3})
    mixed.check_resume(trials=profiled, key=("dtype", "label"), device_name="NVIDIA H100")


def test_a_corrupt_file_is_refused_by_resume_and_replaced_by_overwrite(tmp_path):
    (tmp_path / "demo.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ResultsError, match="not a readable Parquet file.*--overwrite replaces it"):
        ResultWriter(tmp_path, "demo", resume=True)
    ResultWriter(tmp_path, "demo", mode="overwrite").write(_rows(1))
    assert len(read_results(tmp_path / "demo.parquet")) == 1


def test_bad_out_dirs_and_sweep_names_are_one_line_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "d" / "demo.parquet").mkdir(parents=True)
    for out, sweep, match in [(tmp_path / "afile", "demo", "is a file, not a directory"),
                              ("/proc/raysys-x", "demo", "cannot create results directory /proc/raysys-x"),
                              (tmp_path / "d", "demo", "demo.parquet is a directory"),
                              (tmp_path, "x" * 300, "must be 1-100 letters"),
                              (tmp_path, "../etc", "must be 1-100 letters")]:
        with pytest.raises(ValueError, match=match) as err:
            ResultWriter(out, sweep)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------- the lock
_WRITER = textwrap.dedent("""
    import sys, time
    from raysys.results.records import RUN_ID, ResultWriter
    out, n, pad, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
    w = ResultWriter(out, "demo", mode="resume")
    print("locked", flush=True)
    mine = {"run_id": RUN_ID, "git_sha": sys.argv[6], "torch_version": "-", "triton_version": "-",
            "ray_version": "-", "device_name": "cpu", "host": "h", "utc": "2026-01-01T00:00:00Z"}
    for i in range(start, start + n):
        w.write([{"sweep": "demo", "trial_id": f"t{i}", "i": i, "status": "ok", "pad": "x" * pad, **mine}])
        print(i, flush=True)
    time.sleep(float(sys.argv[4]))
""")


def _writer(out: Path, n: int, pad: int = 10, linger_s: float = 0.0, start: int = 0) -> subprocess.Popen:
    """A writer in another process (rows by hand: no torch import, a fast start) of this test's commit, given to it
    (RAYSYS_GIT_SHA): a commit made by someone else in the meantime changes neither's."""
    sha = provenance()["git_sha"]
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(out), str(n), str(pad), str(linger_s), str(start),
                             sha], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAYSYS_GIT_SHA": sha})


def test_a_second_writer_fails_at_once_naming_the_first(tmp_path):
    first = _writer(tmp_path, 2, linger_s=60)
    try:
        assert [first.stdout.readline().strip() for _ in range(3)] == ["locked", "0", "1"]
        t0 = time.monotonic()
        with pytest.raises(FileBusy, match=rf"demo.parquet is being written by another run \(pid {first.pid} on "):
            ResultWriter(tmp_path, "demo", resume=True)
        assert time.monotonic() - t0 < 2
        second = _writer(tmp_path, 50)  # two sweeps at once: the second stops before writing anything
        assert second.wait(timeout=60) != 0 and "FileBusy" in second.stderr.read()
    finally:
        first.kill()
        first.wait()
    # the lock goes with its process (kill -9 included): the next writer gets it
    with ResultWriter(tmp_path, "demo", resume=True) as w:
        assert sorted(r["i"] for r in w.rows) == [0, 1]


def test_concurrent_writers_lose_no_row(tmp_path):
    procs = [_writer(tmp_path, 40, start=start) for start in (0, 100)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0, outs
    # either they ran one after the other (both 0) or the later one failed at once; every row written is there
    written = {int(line) for out, _ in outs for line in out.split()[1:] if line.isdigit()}
    on_disk = set(read_results(tmp_path / "demo.parquet")["i"])
    assert written == on_disk and len(written) in (40, 80)
    if codes[1] != 0:
        assert any("is being written by another run" in err for _, err in outs)


def test_a_reader_polling_a_live_sweep_never_sees_two_files_mixed(tmp_path):
    """The writer replaces the file after every row; `pd.read_parquet(path)` opens it again after the footer, so it
    can mix two versions ("Couldn't deserialize thrift"). `read_results` reads the bytes once: never."""
    import threading

    path, stop = tmp_path / "demo.parquet", threading.Event()

    def write():
        with ResultWriter(tmp_path, "demo") as w:
            for i in range(100_000):
                if stop.is_set():
                    return
                w.write(_rows(1, start=i, pad="x" * (i % 97)))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while not path.exists():
            time.sleep(0.001)
        counts, deadline = [], time.monotonic() + 3
        while time.monotonic() < deadline:
            counts.append(len(read_results(path)))
    finally:
        stop.set()
        writer.join()
    assert len(counts) > 50 and counts == sorted(counts) and counts[-1] > counts[0], counts[:5]


def test_sigkill_during_writes_leaves_a_readable_file_and_no_stale_temp(tmp_path):
    seen = 0
    for round_ in range(3):
        proc = _writer(tmp_path, 10_000, pad=50_000)  # 50 kB rows: each rewrite takes a while
        assert proc.stdout.readline().strip() == "locked", proc.communicate()[1]
        last = -1
        deadline = time.monotonic() + 0.5 + 0.3 * round_
        while time.monotonic() < deadline:
            line = proc.stdout.readline().strip()
            last = int(line) if line.isdigit() else last
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        df = read_results(tmp_path / "demo.parquet")  # readable: the old file or the new one, never half of one
        assert set(range(last + 1)) <= set(df["i"]) and len(df) >= seen
        seen = len(df)
    dead = files._tmp_name(tmp_path / "demo.parquet", pid=2**22 + 1)  # above pid_max: surely dead
    dead.write_bytes(b"half a file")
    stale = list(tmp_path.glob(".demo.parquet.*.tmp"))
    with ResultWriter(tmp_path, "demo", resume=True) as w:  # the next writer removes the dead ones' temp files
        assert len(w.rows) == seen
    assert not list(tmp_path.glob(".demo.parquet.*.tmp")), stale


def test_cleanup_removes_only_temp_files_of_dead_writers_named_by_this_module(tmp_path):
    """Issue 48: the cleanup deleted any `.<sweep>.parquet.*.tmp`, a user's too. Now only a name this module made
    (its check matches), on this host, whose pid is gone."""
    path = tmp_path / "demo.parquet"
    dead = files._tmp_name(path, pid=2**22 + 1)
    kept = [tmp_path / ".demo.parquet.backup.tmp",                             # a user's file
            tmp_path / f".demo.parquet.{2**22 + 1}-{files._HOST}.0badf00d.tmp",  # looks like an old writer's
            files._tmp_name(path),                                             # a live writer's (this process)
            Path(str(dead).replace(dead.name[-8 - 4:-4], "0" * 8)),           # our shape, a forged check
            files._tmp_name(tmp_path / "other.parquet", pid=2**22 + 1)]        # another file's
    for p in [dead, *kept]:
        p.write_bytes(b"x")
    with ResultWriter(tmp_path, "demo"):
        pass
    assert not dead.exists() and all(p.exists() for p in kept), sorted(p.name for p in tmp_path.iterdir())


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    """Issue 48: a `.<sweep>.parquet.lock` that was a symlink got its target overwritten with the lock text."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / ".demo.parquet.lock").symlink_to(target)
    with pytest.raises(ResultsError, match=r"lock file .*\.demo\.parquet\.lock is a symbolic link; remove it"):
        ResultWriter(tmp_path, "demo")
    assert target.read_text() == "keep me\n" and not (tmp_path / "demo.parquet").exists()
    (tmp_path / ".demo.parquet.lock").unlink()
    (tmp_path / ".demo.parquet.lock").mkdir()
    with pytest.raises(ResultsError, match="cannot open lock file .*Is a directory"):
        ResultWriter(tmp_path, "demo")


# ---------------------------------------------------------------------------------------------------- full disk
def test_a_full_disk_keeps_the_previous_file_and_says_so(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = ResultWriter(tmp_path, "demo")
    w.write(_rows(2))
    fig = plt.figure()
    png = save_figure(fig, tmp_path / "demo.png")
    before = {p: p.read_bytes() for p in (tmp_path / "demo.parquet", png)}
    real_write = os.write

    def full(fd, data):  # the disk fills up after a few bytes of each file
        real_write(fd, bytes(data[:100]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "write", full)
    with pytest.raises(DiskFull, match="no space left writing .*demo.parquet .*the previous demo.parquet is intact"):
        w.write(_rows(50, start=2))
    with pytest.raises(DiskFull, match="the previous demo.png is intact"):
        save_figure(fig, png)
    with pytest.raises(DiskFull, match="new.md was not written"):
        write_text(tmp_path / "new.md", "# x\n")
    monkeypatch.undo()
    plt.close(fig)
    assert {p: p.read_bytes() for p in before} == before
    assert len(w.rows) == 2 and not list(tmp_path.glob(".*.tmp")) and not (tmp_path / "new.md").exists()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)  # busy: detach it now, free it when idle


def test_a_really_full_tmpfs_keeps_the_previous_file(tiny_tmpfs):
    with ResultWriter(tiny_tmpfs, "demo") as w:
        w.write(_rows(2))
        before = (tiny_tmpfs / "demo.parquet").read_bytes()
        with pytest.raises(DiskFull, match="the previous demo.parquet is intact"):
            w.write([make_row("demo", {"i": 9}, {"pad": os.urandom(60_000).hex()})])  # 120 kB > 64 KiB
    assert (tiny_tmpfs / "demo.parquet").read_bytes() == before
    assert not list(tiny_tmpfs.glob(".*.tmp"))


# ---------------------------------------------------------------------------------------------------- modes, keys
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_files_are_created_with_the_umask_not_0600(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        ResultWriter(tmp_path, "demo").write(_rows(1))
        write_text(tmp_path / "demo.md", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "demo.parquet").stat().st_mode & 0o777 == mode
    assert (tmp_path / "demo.md").stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("key", ["trial_id", "sweep", "run_id", "status", "error", "git_sha", "utc"])
def test_no_key_may_overwrite_a_row_column(key):
    with pytest.raises(ValueError, match=f"config key '{key}' would overwrite the row's own '{key}' column"):
        make_row("demo", {key: 1})
    with pytest.raises(ValueError, match=f"metric '{key}' would overwrite the row's own '{key}' column"):
        make_row("demo", {"a": 1}, {key: 1})
    with pytest.raises(ValueError, match="metric 'world_size'=3 would overwrite the trial's config column"):
        make_row("demo", {"world_size": 2}, {"world_size": 3})
    row = make_row("demo", {"i": 1}, {"i": 1}, device_name="NVIDIA H200")  # equal values and provenance: fine
    assert row["device_name"] == "NVIDIA H200" and row["trial_id"] == trial_id({"i": 1})


def test_cpu_allocation_failures_are_oom():
    cpu_refused = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 512000000 bytes. Error code 12 (Cannot allocate memory)")
    assert status_of(cpu_refused) == "oom" and status_of(MemoryError()) == "oom"
    assert status_of(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert status_of(RuntimeError("shape mismatch")) == "error"


# ---------------------------------------------------------------------------------------------------- read, where
def test_report_names_a_corrupt_file_in_one_line_and_reports_the_others(tmp_path, capsys):
    ResultWriter(tmp_path, "good").write(_rows(2, sweep="good"))
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    assert set(read_results(tmp_path)["source"]) == {"good"}
    assert "skipped: " in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path)]) == 1  # reported, but not every file
    out = capsys.readouterr()
    assert "## good" in out.out
    bad = [line for line in (out.out + out.err).splitlines() if "bad.parquet" in line]
    assert len(bad) == 1 and "not a readable Parquet file" in bad[0]
    with pytest.raises(ResultsError, match="bad.parquet is not a readable Parquet file"):
        read_results(tmp_path / "bad.parquet")


def test_the_default_out_is_a_fresh_run_directory_outside_results(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYSYS_RESULTS_DIR", raising=False)
    monkeypatch.setenv("RAYSYS_RUNS_DIR", str(tmp_path / "runs"))
    first, second = default_out_dir("ddp"), resolve_out(None, "ddp")
    assert first != second and first.parent == second.parent == tmp_path / "runs"
    assert first.name.endswith("Z-ddp") and second.name.endswith(("Z-ddp-2", "Z-ddp"))  # same second, or later
    assert first.is_dir() and not list(first.iterdir())
    assert resolve_out(tmp_path / "mine", "ddp") == tmp_path / "mine"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYSYS_RUNS_DIR")
    assert default_out_dir("ddp").parent == tmp_path / "runs"
    assert "/runs/" in (REPO / ".gitignore").read_text()


def test_a_long_error_keeps_its_first_line_and_its_end():
    """Issue 48: a rank's error with its remote traceback was cut to its last 2000 characters, so tables showed a
    fragment (`l_impl`) instead of the exception."""
    from raysys.results.records import error_row

    text = "RankFailed: dies:exits: rank 0 exited with code 3\n" + "  File x, line 1, in _call_impl\n" * 500
    row = make_row("demo", {"i": 1}, status="error", error=text + "EOFError: the end")
    assert row["error"].splitlines()[0] == "RankFailed: dies:exits: rank 0 exited with code 3"
    assert row["error"].endswith("EOFError: the end") and len(row["error"]) <= 2000
    assert "characters cut" in row["error"]
    exc = ValueError("boom " + "y" * 5000)
    exc.add_note("(raised on rank 1 during ddp:[1/4] label=naive)")
    cut = error_row("demo", {"i": 2}, exc)["error"]
    assert cut.startswith("ValueError: boom yyy") and cut.endswith("(raised on rank 1 during ddp:[1/4] label=naive)")
    assert make_row("demo", {"i": 3}, status="error", error="short\ntext")["error"] == "short\ntext"


def test_resume_runs_again_what_the_infrastructure_skipped(tmp_path):
    """Issue 48: a `skipped` row counted as finished, so a trial a lost node skipped was never run again. A row
    whose error says `not run:` is retried; a trial that cannot run (`unsupported: ...`) is not."""
    ResultWriter(tmp_path, "demo").write([
        make_row("demo", {"i": 0}, status="skipped", error="not run: the cluster has 0 node(s)"),
        make_row("demo", {"i": 1}, status="skipped", error="unsupported: no bf16 on this device"),
        make_row("demo", {"i": 2}, status="error", error="x"), make_row("demo", {"i": 3}, {"m": 1.0})])
    with ResultWriter(tmp_path, "demo", resume=True) as w:
        assert [w.done(trial_id({"i": i})) for i in range(4)] == [False, True, False, True]


def test_the_fault_table_names_tests_that_exist():
    """docs/faults.md names the test that guards each promise: a renamed or deleted test makes the table lie."""
    import re

    table = (REPO / "docs" / "faults.md").read_text()
    named, path = [], None
    for m in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)`", table):
        path = m.group(1) or path
        named.append((path, m.group(2)))
    assert len(named) > 30
    missing = [f"{p}::{t}" for p, t in named if not re.search(rf"^def {t}\(", (REPO / p).read_text(), re.M)]
    assert not missing, missing
