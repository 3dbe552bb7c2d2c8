"""graphopt::column_sum (a linear layer's bias gradient, cuda_ext/column_sum_triton.py): the Triton
kernel on the CPU through Triton's interpreter and on the GPU when marked cuda, against a float64
sum over the rows; its plan; the wrapper's refusals; the op's conformance checks."""

import pytest
import torch

from graphopt.cuda_ext import column_sum_triton
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter, same_when_graphed, skip_old_interpreter


def _check(x):
    """The kernel's sum within one rounding of x's dtype (fp32 sums) of the float64 sum."""
    out = column_sum_triton.column_sum_triton(x)
    ref = x.double().reshape(-1, x.shape[-1]).sum(0)
    assert out.dtype == x.dtype and out.shape == (x.shape[-1],)
    eps = torch.finfo(x.dtype).eps
    scale = x.double().abs().reshape(-1, x.shape[-1]).sum(0)
    assert ((out.double() - ref).abs() <= eps * ref.abs() + 1e-6 * scale + 1e-12).all()


def interpreter_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((37, 1), (37, 5), (300, 160), (2, 50, 130), (16, 600)):  # several bands; several column blocks
            torch.manual_seed(shape[-1])
            _check(torch.randn(*shape).to(dtype))
    _check(torch.randn(4, 96, 5).transpose(1, 2))  # a permuted view
    print("interpreter cases ok")


def test_column_sum_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_column_sum:interpreter_cases")


@pytest.mark.parametrize("rows,width,sms", [(16384, 768, 132), (12608, 3072, 132), (64, 4096, 132), (37, 5, 2),
                                            (1, 1, 132)])
def test_plan_covers_every_row_once(rows, width, sms):
    block_n, tile, iters, bands, _ = column_sum_triton.column_sum_plan(rows, width, sms)
    assert (bands - 1) * iters * tile < rows <= bands * iters * tile  # every row, no empty band
    assert block_n >= min(width, 128) and bands * -(-width // block_n) <= max(4 * sms, -(-width // block_n))


def test_wrapper_refuses():
    from graphopt.cuda_ext import column_sum

    with pytest.raises(KernelArgumentError, match="float32, float16 or bfloat16"):
        column_sum(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(KernelArgumentError, match="0-d"):
        column_sum(torch.tensor(1.0))


def test_reference_and_conformance():
    from kx_conformance import check_op

    x = torch.randn(3, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.graphopt.column_sum(x), x.sum((0, 1)), rtol=1e-12, atol=1e-12)
    check_op("column_sum", (torch.randn(3, 5, 24),))
    check_op("column_sum", (torch.randn(7, 3).to(torch.bfloat16),))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16384, 768), (32, 512, 3072), (8192, 256), (64, 4096), (37, 5)])
def test_column_sum_on_gpu(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda").to(dtype)
    _check(x)
    same_when_graphed(lambda: torch.ops.graphopt.column_sum(x))
