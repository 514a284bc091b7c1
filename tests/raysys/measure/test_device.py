"""raysys.measure.device: the one home of dtype names, device resolution, autocast, synchronisation and memory
release."""

import contextlib

import pytest
import torch

from raysys.measure import device as dev


def test_dtypes_name_the_compute_dtype():
    assert dev.DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert dev.low_precision("fp32") is None
    assert dev.low_precision("bf16") is torch.bfloat16
    assert dev.low_precision("fp16") is torch.float16
    with pytest.raises(ValueError, match=r"dtype 'float32' must be one of \['bf16', 'fp16', 'fp32'\]"):
        dev.low_precision("float32")


def test_autocast_is_off_for_fp32_and_casts_matmuls_otherwise():
    cpu = torch.device("cpu")
    assert isinstance(dev.autocast(cpu, "fp32"), contextlib.nullcontext)
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    with dev.autocast(cpu, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with dev.autocast("cpu", "fp32"):
        assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype 'half'"):
        dev.autocast(cpu, "half")


@pytest.mark.parametrize("name", ["tpu", "cuda:", "cuda:-1", "cpu:0", "CUDA", "", None])
def test_bad_device_names_are_value_errors(name):
    with pytest.raises(ValueError, match=r"must be one of auto, cpu, cuda, cuda:N"):
        dev.resolve_device(name)


def test_resolve_device_against_a_gpu_count():
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_device("auto", num_gpus=0) == torch.device("cpu")
    assert dev.resolve_device("auto", num_gpus=2) == torch.device("cuda")
    assert dev.resolve_device("cuda:1", num_gpus=2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device 'cuda' requested but the cluster has no CUDA GPU"):
        dev.resolve_device("cuda", num_gpus=0, where="the cluster")
    with pytest.raises(ValueError, match=r"device 'cuda:2' requested but this machine has 2 GPU\(s\)"):
        dev.resolve_device("cuda:2", num_gpus=2)


def test_resolve_device_defaults_to_this_machine():
    expected = "cuda" if torch.cuda.device_count() else "cpu"
    assert dev.resolve_device() == torch.device(expected)
    if not torch.cuda.device_count():
        with pytest.raises(ValueError, match="device 'cuda:0' requested but this machine has no CUDA GPU"):
            dev.resolve_device("cuda:0")


def test_synchronize_and_free_memory_on_cpu_touch_no_cuda(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA called for a CPU device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    monkeypatch.setattr(torch.cuda, "empty_cache", no_cuda)
    dev.synchronize(torch.device("cpu"))
    dev.synchronize("cpu")
    dev.free_memory("cpu")
    if not torch.cuda.is_initialized():
        dev.free_memory()


def test_free_memory_collects_reference_cycles():
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    gc.disable()
    try:
        del a, b
        assert ref() is not None  # only the cyclic collector can free them
        dev.free_memory(torch.device("cpu"))
        assert ref() is None
    finally:
        gc.enable()
