"""`python -m raysys report` in ordinary use (issue 49): a one-row file shows its values, every bad path or name is one
line before anything is printed or written, the markdown file is replaced atomically, and a file that cannot be read
makes the exit code 1 while the others still report."""

from __future__ import annotations

import errno
import os

import pandas as pd
import pytest

from raysys import cli
from raysys.results import files
from raysys.results.records import ResultWriter, make_row


@pytest.fixture
def results(tmp_path):
    """A results directory of one multi-row sweep (`ddp`) and a one-row `bench` run."""
    out = tmp_path / "results"
    with ResultWriter(out, "ddp") as w:
        w.write([make_row("ddp", {"variant": v, "size": "tiny"}, {"step_median_s": s, "peak_bytes": 2**30})
                 for v, s in (("naive", 0.25), ("bucketed", 0.125))])
    with ResultWriter(out, "bench") as w:
        w.write([make_row("bench", {"size": "tiny", "mode": "train-step"}, {"step_mean_s": 0.5, "peak_bytes": 2**31})])
    return out


def _run(capsys, *argv):
    code = cli.main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_one_row_file_shows_every_value(results, capsys):
    """A single `bench` run printed a table of only `| status | ok |`: nothing varies between one row's rows."""
    code, out, err = _run(capsys, results / "bench.parquet")
    assert code == 0 and err == ""
    lines = out.splitlines()
    for cell in ("| size ", "| mode ", "| step_mean_ms ", "| peak_GiB ", "| status "):
        assert any(line.startswith(cell) for line in lines), (cell, out)
    assert any(line.startswith("| step_mean_ms") and "| 500 " in line for line in lines), out  # seconds as ms
    assert any(line.startswith("| peak_GiB") and "| 2 " in line for line in lines), out
    code, out, _ = _run(capsys, results, "--only", "ddp")  # several rows: the columns that vary, as before
    assert code == 0 and "| variant " in out and "step_median_ms" in out and "| size " not in out


@pytest.mark.parametrize("argv, message", [
    (["{r}", "--only", "nosuch"], "--only nosuch: {r} has no nosuch.parquet (its sweeps: bench, ddp)"),
    (["{r}", "--only", "ddp,nosuch"], "--only nosuch: {r} has no nosuch.parquet (its sweeps: bench, ddp)"),
    (["{r}/missing.parquet"], "results file {r}/missing.parquet does not exist"),
    (["{r}/missing"], "results directory {r}/missing does not exist"),
    (["{r}", "--markdown", "{r}/no/such/dir/x.md"], "--markdown {r}/no/such/dir/x.md: directory {r}/no/such/dir does "
                                                    "not exist"),
    (["{r}", "--markdown", "{r}"], "--markdown {r} is a directory; it takes a file"),
    (["{r}", "--plots", "{r}/ddp.parquet"], "--plots {r}/ddp.parquet is a file; it takes a directory"),
])
def test_bad_paths_and_names_are_one_line_before_anything_is_printed(results, capsys, argv, message):
    code, out, err = _run(capsys, *[a.format(r=results) for a in argv])
    assert code == 2 and out == "", out
    assert err == f"raysys report: error: {message.format(r=results)}\n"
    assert sorted(p.name for p in results.iterdir() if not p.name.startswith(".")) == ["bench.parquet", "ddp.parquet"]


def test_only_takes_words_or_a_comma_list(results, capsys):
    assert _run(capsys, results, "--only", "ddp", "bench")[1] == _run(capsys, results, "--only", "bench,ddp")[1]


def test_an_unreadable_file_is_one_line_and_exit_code_1(results, capsys, tmp_path):
    (results / "broken.parquet").write_bytes(b"not parquet")
    code, out, err = _run(capsys, results, "--markdown", tmp_path / "report.md")
    assert code == 1 and "## ddp" in out and "## bench" in out
    (line,) = [line for line in (out + err).splitlines() if "broken.parquet" in line]
    assert line.startswith(f"_skipped: {results / 'broken.parquet'} is not a readable Parquet file"), line
    text = (tmp_path / "report.md").read_text()
    assert "## ddp" in text and "## bench" in text and "broken.parquet" in text
    assert _run(capsys, results, "--only", "ddp,bench")[0] == 0  # the readable ones alone


def test_markdown_on_a_full_disk_keeps_the_previous_file(results, capsys, monkeypatch, tmp_path):
    """`--markdown FILE` on a full disk printed a traceback and left FILE truncated to 0 bytes."""
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("the previous report\n")
    real_write = os.write

    def full(fd, data):  # the disk fills up after a few bytes
        real_write(fd, bytes(data[:100]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "write", full)
    code, out, err = _run(capsys, results, "--markdown", target)
    monkeypatch.undo()
    assert code == 1 and "## ddp" in out
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("raysys report: error: no space left writing") and "BENCHMARKS.md is intact" in err, err
    assert target.read_text() == "the previous report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BENCHMARKS.md", "results"]  # no temp file left


def test_plots_of_a_results_directory_are_drawn_beside_one_line_per_failure(results, capsys, tmp_path):
    """`--plots` draws into a directory it makes; a file whose plot cannot be drawn is one line and exit code 1."""
    pd.DataFrame({"sweep": ["ddp_compiled"], "trial_id": ["x"]}).to_parquet(results / "ddp_compiled.parquet")
    code, out, err = _run(capsys, results, "--only", "ddp_compiled", "--plots", tmp_path / "plots" / "new")
    assert code == 1 and (tmp_path / "plots" / "new").is_dir()
    assert [line for line in err.splitlines() if "ddp_compiled" in line] == [
        line for line in err.splitlines() if line.startswith("raysys report: no plot of ddp_compiled.parquet: ")]
    assert len(err.splitlines()) == 1, err


def test_the_library_report_may_take_the_sweeps_that_are_there(results):
    """`sweeps/flash_summary.py` prints the FlashAttention studies of a directory that holds either or both."""
    from raysys.results.report import report

    text = report(results, only=["ddp", "nosuch"], missing_ok=True)
    assert "## ddp" in text and "## bench" not in text
    with pytest.raises(ValueError, match="has no nosuch.parquet"):
        report(results, only=["nosuch"], missing_ok=True)
    with pytest.raises(ValueError, match="has no nosuch.parquet"):
        report(results, only=["ddp", "nosuch"])
