import gc
import os

import pytest
import torch

# pytest -n N (pytest-xdist, `make test`): each worker gets its share of the cores for torch's
# threads (N workers at the default thread count would oversubscribe them) and a cache of its own
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ.setdefault("GRAPHOPT_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache",
                                                         f"graphopt{'-' + _WORKER if _WORKER else ''}"))
# optimize()'s measured guard ("auto") off: a revert it makes depends on the machine's timing, and the
# tests check plans; tests/test_measured_guard.py turns it on (measure=True) where it is the subject
os.environ.setdefault("GRAPHOPT_MEASURE", "0")


def pytest_configure(config):
    # failure reports show captured log records from INFO up: torch.export's structured trace
    # logger ("torch.__trace") writes a DEBUG record per traced op, which buried the assertion
    if config.getoption("log_level", None) is None and not config.getini("log_level"):
        config.option.log_level = "INFO"


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """No cyclic garbage collection while the test modules are imported and their asserts rewritten:
    torch's ~0.4 M objects are not frozen yet (``_freeze_the_imports`` runs with the first test), and
    the collections the rewrite's syntax trees set off walked them all: a worker's collection took
    18 s, 13 s without (2 cores, PYTHONDONTWRITEBYTECODE as in a fresh clone's first run)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="session", autouse=True)
def _freeze_the_imports():
    """The objects the imports made (torch, torch.export's and AOTAutograd's machinery, transformers,
    torchvision, graphopt: ~0.4 M) are frozen for the session (gc.freeze), so a full collection during
    a test (an autograd or fx graph's cycles, bench's gc.collect) walks only what the tests made since:
    such collections took about a fifth of the checkpoint and bench tests' time. Objects frozen are
    never collected; these live as long as the process anyway. tests/test_api.py's collector test
    unfreezes them for its own run (see ``unfrozen``)."""
    import importlib

    for name in ("torch._dynamo", "torch.export", "torch._functorch.aot_autograd",
                 "torch._functorch.partitioners", "torch.utils.checkpoint",
                 "transformers", "torchvision", "graphopt", "graphopt.examples.zoo", "graphopt.checkpoint"):
        try:
            importlib.import_module(name)
        except ImportError:  # the zoo's extras are optional
            pass
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def unfrozen():
    """The session's frozen objects handed back to the collector for one test (a test of how
    graphopt itself freezes), frozen again after it (a full collection first: nothing it left
    unreachable stays behind)."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


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


@pytest.fixture(autouse=True)
def _quiet_torch_trace_logs(caplog):
    # torch.export logs every traced op at DEBUG; keep failure reports readable
    import logging

    caplog.set_level(logging.WARNING, logger="torch")
    yield
