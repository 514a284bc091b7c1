"""kernels/device.py: the launchers' device switch, without a GPU (the CUDA calls stand in)."""

from __future__ import annotations

import types

import torch

import kernels.device as kd


def test_device_of_switches_only_to_another_cuda_device(monkeypatch):
    entered = []

    class Switch:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(("enter", self.index))

        def __exit__(self, *exc):
            entered.append(("exit", self.index))

    monkeypatch.setattr(kd, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Switch)
    on = lambda device: types.SimpleNamespace(device=torch.device(device))  # noqa: E731
    for device in ("cuda:0", "cpu", "meta"):
        with kd.device_of(on(device)):
            pass
    assert entered == []
    with kd.device_of(on("cuda:1")):
        assert entered == [("enter", 1)]
    assert entered == [("enter", 1), ("exit", 1)]
