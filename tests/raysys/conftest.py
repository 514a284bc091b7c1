import pytest
import torch

from tests.raysys.ray_fixtures import ray_cluster  # noqa: F401  (the session's one Ray)


@pytest.fixture
def host_independent_gemm():
    """CPU matrix products by ATen's own kernels, for tests that measure a step's allocations: oneDNN's bf16 GEMM
    allocates scratch whose size depends on the host's ISA (on an AVX512-BF16 host the tiny advisor step peaks
    about 9% higher than on an AVX2 one), which the advisor's memory model rightly leaves out."""
    with torch.backends.mkldnn.flags(enabled=False):
        yield
