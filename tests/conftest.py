import os

import pytest
import torch

os.environ.setdefault("GRAPHOPT_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "graphopt"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
