"""tools/flash_host_cost.py on the CPU: its refusals before any GPU work, and rows from a call's printed lines."""

from __future__ import annotations

import sys

import pytest
import torch

import tools.flash_host_cost as script


def test_host_cost_script_never_replaces_an_earlier_file_unasked(tmp_path, monkeypatch):
    """tools/flash_host_cost.py refuses an existing flash_host_cost.parquet in its OUT_DIR before any work
    (one line, the file untouched); with --overwrite it goes on to its GPU check."""
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
