"""raysys.results / raysys.files: a run never replaces or mixes results silently, under faults too.

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

from raysys import cli, files
from raysys.results import (DiskFull, FileBusy, ResultsError, ResultWriter, default_out_dir, make_row, provenance,
                            read_results, resolve_out, save_figure, status_of, trial_id, write_text)

REPO = Path(__file__).resolve().parents[2]


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
    ResultWriter(tmp_path, "demo").write(old)
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
# Rows without make_row's provenance: no torch import (fast start), and no git_sha that a commit made by
# someone else in the meantime would change between two writers.
_WRITER = textwrap.dedent("""
    import sys, time
    from raysys.results import ResultWriter
    out, n, pad, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
    w = ResultWriter(out, "demo", mode="resume")
    print("locked", flush=True)
    for i in range(start, start + n):
        w.write([{"sweep": "demo", "trial_id": f"t{i}", "i": i, "status": "ok", "pad": "x" * pad}])
        print(i, flush=True)
    time.sleep(float(sys.argv[4]))
""")


def _writer(out: Path, n: int, pad: int = 10, linger_s: float = 0.0, start: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(out), str(n), str(pad), str(linger_s), str(start)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    dead = tmp_path / f".demo.parquet.{2**22 + 1}-{files._HOST}.0badf00d.tmp"  # above pid_max: surely dead
    dead.write_bytes(b"half a file")
    stale = list(tmp_path.glob(".demo.parquet.*.tmp"))
    with ResultWriter(tmp_path, "demo", resume=True) as w:  # the next writer removes the dead ones' temp files
        assert len(w.rows) == seen
    assert not list(tmp_path.glob(".demo.parquet.*.tmp")), stale


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
