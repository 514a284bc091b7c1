import os

# Ray in tests: no usage stats, no dashboard unless a test asks for one.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
