import collections
import os

# Ray in tests: no usage stats, no dashboard unless a test asks for one.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# No test may write ~/.ray/auth_token (Ray 2.60 enables token auth for an embedded ray.init() by default).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the CPU interpreter; @triton.jit picks interpreter vs GPU when the kernel
    # module is imported, so this must happen before any test imports kernels/.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tiny models on a 2-core CI machine run several times faster on one thread than on two fighting ones.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    _heavy_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


HEAVY_MARKS = ("slow", "ray", "multiproc")


def _heavy_modules_first(items):
    """Test files in order of how many of their tests are marked slow, ray or multiproc, most first (each file's
    tests keep their order, so module fixtures are set up once): under xdist's work stealing the minute-long tests
    then start early instead of ending the run on one worker while the other waits."""
    weight = collections.Counter()
    for item in items:
        weight[item.nodeid.split("::")[0]] += sum(mark in item.keywords for mark in HEAVY_MARKS)
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: ties keep the collected order
