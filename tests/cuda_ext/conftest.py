import pytest
import torch

import graphopt.cuda_ext  # noqa: F401  (defines torch.ops.graphopt.*)

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh random inputs on every run, but reproducible from the printed seed
    seed = torch.seed() % (2**31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def poison_allocator(device, nbytes: int = 1 << 26) -> None:
    """Fill free memory of the CUDA caching allocator with NaN so that an output element the
    kernel never writes shows up as NaN (the ops allocate their outputs with torch.empty)."""
    if torch.device(device).type != "cuda":
        return
    t = torch.full((nbytes // 4,), float("nan"), device=device)
    del t


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run by its interpreter (on the CPU)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
