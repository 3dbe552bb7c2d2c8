"""graphopt::gemm_swiglu: the two gate/up weight layouts (halves: cat([Wg, Wu]) as it is, block 0;
interleaved blocks), the reference, and the persistent Triton GEMM with the SwiGLU epilogue: on the
CPU through Triton's interpreter (fp16: the interpreter misreads bf16 tensors through TMA
descriptors), on an sm_90+ GPU when marked cuda; against fp64."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.cuda_ext import gemm_triton, reference
from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up
from tests.helpers import run_in_triton_interpreter, same_when_graphed


def _case(M, K, n, dtype, device="cpu", seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * n, K, generator=g) / K ** 0.5).to(dtype).to(device)
    return x, w


def _ref(x, w, n):
    gu = x.double() @ w.double().T
    return F.silu(gu[..., :n]) * gu[..., n:]


def _check(y, x, w, n, rel=1e-2):
    ref = _ref(x, w, n)
    assert y.shape == ref.shape and y.dtype == x.dtype and y.is_contiguous()
    err = (y.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), (err, ref.abs().max().item())


def interpreter_cases():
    """The kernel on small tiles (16 x 16, K steps of 16, 3 programs for more tiles than that):
    rows, outputs and K not multiples of the tile (TMA pads loads with zeros and clips stores)."""
    cfg = (16, 16, 16, 2, 4)
    for M, K, n in [(40, 48, 24), (33, 40, 16), (16, 16, 8)]:
        x, w = _case(M, K, n, torch.float16, seed=M)
        _check(gemm_triton.gemm_swiglu(x, interleave_gate_up(w, 16), n, cfg, programs=3), x, w, n)
        _check(gemm_triton.gemm_swiglu_halves(x, w, n, cfg + (2,), programs=3), x, w, n)
        y = gemm_triton.gemm(x, w, cfg, programs=3)
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-2, atol=1e-2)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        # triton 3.6's interpreter fails inside its own __index__ on this kernel's loop bounds; the
        # cuda-marked tests below run the kernel itself on that version
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run the persistent loop")
    run_in_triton_interpreter("tests.cuda_ext.test_gemm_triton:interpreter_cases")


def test_interleaved_layout():
    n, K, block = 6, 3, 4
    w = torch.arange(2 * n * K, dtype=torch.float32).reshape(2 * n, K) + 1
    wi = interleave_gate_up(w, block)
    gate, up = w[:n], w[n:]
    assert wi.shape == (16, K)  # each half padded from 6 to 8 rows
    assert torch.equal(wi[0:4], gate[0:4]) and torch.equal(wi[4:8], up[0:4])
    assert torch.equal(wi[8:10], gate[4:6]) and torch.equal(wi[12:14], up[4:6])
    assert not wi[10:12].any() and not wi[14:16].any()
    with pytest.raises(ValueError, match="interleave_gate_up"):
        interleave_gate_up(w[:5], block)


def test_reference_matches_fp64_and_rounds_once():
    """The reference never rounds the projection: in bf16 it is closer to float64 than
    linear -> swiglu (two roundings)."""
    x, w = _case(64, 96, 40, torch.bfloat16, lead=(2,))
    y = reference.gemm_swiglu(x, interleave_gate_up(w, 16), 40, 16)
    _check(y, x, w, 40)
    ref = _ref(x, w, 40)
    two = reference.swiglu(F.linear(x, w))
    assert (y.double() - ref).abs().max() < (two.double() - ref).abs().max()
    with pytest.raises(ValueError, match="gate and up blocks"):
        reference.gemm_swiglu(x, w, 40, 16)  # 80 rows are not pairs of 16-row blocks


def test_halves_reference_reads_the_weight_as_it_is():
    x, w = _case(33, 96, 40, torch.bfloat16, lead=(2,))
    y = reference.gemm_swiglu(x, w, 40, 0)
    _check(y, x, w, 40)
    assert torch.equal(y, reference.gemm_swiglu(x, interleave_gate_up(w, 16), 40, 16))
    with pytest.raises(ValueError, match="block 0"):
        reference.gemm_swiglu(x, w, 39, 0)  # 80 rows are not 2 x 39


def test_refusals():
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert "GPU with TMA" in gemm_triton.supported(x, w, 128, 128)  # the CPU
    assert "dtypes" in gemm_triton.supported(x.float(), w.float(), 128, 128)
    assert "block 32" in gemm_triton.supported(x, torch.zeros(64, 64, dtype=torch.bfloat16), 32, 32)
    assert "multiples of 8" in gemm_triton.supported(x, w, 100, 128)
    assert "blocks of 128" in gemm_triton.supported(x, w[:128], 64, 128)
    assert "GPU with TMA" in gemm_triton.supported(x, w, 128, 0)  # halves: 256 rows = 2 x 128
    assert "cat([gate, up])" in gemm_triton.supported(x, w, 120, 0)
    with pytest.raises(ValueError, match="unsupported needs a GPU"):
        gemm_triton.gemm_swiglu_triton(x, w, 128, 128)


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1024, 4096, 13696), (300, 4096, 264), (129, 72, 136), (1, 8, 8)])
def test_op_on_gpu(dtype, shape):
    if not _sm90():
        pytest.skip("the Triton GEMM needs sm_90+")
    M, K, n = shape
    x, w = _case(M, K, n, dtype, device="cuda", lead=(1,))
    wi = interleave_gate_up(w, gemm_triton.SWIGLU_BLOCK)
    assert gemm_triton.supported(x, wi, n, 128) is None
    y = torch.ops.graphopt.gemm_swiglu(x, wi, n, 128)
    _check(y, x, w, n)
    same_when_graphed(lambda: torch.ops.graphopt.gemm_swiglu(x, wi, n, 128))
    # a view at an odd offset (TMA needs a 16-byte aligned base) and fp32 (the reference) still answer
    xs = torch.cat([x.reshape(-1)[:1], x.reshape(-1)])[1:].view_as(x)
    torch.testing.assert_close(torch.ops.graphopt.gemm_swiglu(xs, wi, n, 128), y, rtol=0, atol=0)
    _check(torch.ops.graphopt.gemm_swiglu(x.float(), wi.float(), n, 128), x.float(), w.float(), n, rel=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1024, 4096, 13696), (300, 4096, 264), (129, 72, 136), (1, 8, 8)])
def test_halves_op_on_gpu(dtype, shape):
    """block 0: the weight as the model holds it; the same values as the interleaved copy gives."""
    if not _sm90():
        pytest.skip("the Triton GEMM needs sm_90+")
    M, K, n = shape
    x, w = _case(M, K, n, dtype, device="cuda", lead=(1,))
    assert gemm_triton.supported(x, w, n, 0) is None
    y = torch.ops.graphopt.gemm_swiglu(x, w, n, 0)
    _check(y, x, w, n)
    same_when_graphed(lambda: torch.ops.graphopt.gemm_swiglu(x, w, n, 0))
    _check(torch.ops.graphopt.gemm_swiglu(x.float(), w.float(), n, 0), x.float(), w.float(), n, rel=1e-3)
