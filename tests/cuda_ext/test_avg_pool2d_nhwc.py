"""graphopt::avg_pool2d_nhwc against float64 average pooling by the accuracy rule, on the CPU (the
reference) and, marked ``cuda``, on the kernel: padding counted and not, odd image sizes, channel
counts on the vector path and off it, an unaligned and an NCHW input; the wrapper's refusals; fake
and opcheck."""
import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext as ce
from graphopt.errors import KernelArgumentError
from kx_accuracy import check
from conftest import DEVICES, poison_allocator

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [((2, 64, 13, 11), 3, 1, 1), ((1, 3, 7, 7), 3, 2, 1), ((2, 16, 8, 9), 2, 2, 0),
         ((1, 24, 5, 6), 3, 1, 1), ((3, 8, 4, 4), 1, 1, 0), ((1, 40, 9, 9), 5, 3, 2)]


def _nhwc(n, c, h, w, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed + n * 1000 + c * 10 + h + w)
    return torch.randn(n, h, w, c, generator=g, dtype=torch.float64).to(device=device, dtype=dtype).permute(0, 3, 1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("include_pad", [True, False])
def test_avg_pool2d_nhwc(device, dtype, include_pad):
    for shape, k, st, p in CASES:
        x = _nhwc(*shape, dtype, device)
        poison_allocator(device)
        y = torch.ops.graphopt.avg_pool2d_nhwc(x, k, st, p, include_pad)
        assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype, shape
        want = F.avg_pool2d(x.double(), k, st, p, count_include_pad=include_pad)
        check(y, want, F.avg_pool2d(x, k, st, p, count_include_pad=include_pad), what=f"{shape} {k}/{st}/{p}")
    base = torch.randn(1 + 2 * 16 * 6 * 6, dtype=torch.float64).to(device=device, dtype=dtype)[1:]
    x = base.view(2, 6, 6, 16).permute(0, 3, 1, 2)  # unaligned: the scalar path
    for inp in (x, x.contiguous()):
        y = torch.ops.graphopt.avg_pool2d_nhwc(inp, 3, 1, 1, include_pad)
        check(y, F.avg_pool2d(inp.double(), 3, 1, 1, count_include_pad=include_pad),
              F.avg_pool2d(inp, 3, 1, 1, count_include_pad=include_pad))


def test_wrapper_refuses_a_window_the_kernel_does_not_take():
    x = _nhwc(2, 16, 6, 6, torch.float32, "cpu")
    with pytest.raises(KernelArgumentError, match="padding"):
        ce.avg_pool2d_nhwc(x, 3, 2, 2)
    with pytest.raises(KernelArgumentError, match="4-D"):
        ce.avg_pool2d_nhwc(x[0], 3, 1, 1)


def test_conformance():
    from kx_conformance import check_op

    check_op("avg_pool2d_nhwc", (_nhwc(2, 16, 7, 6, torch.float32, "cpu"), 3, 1, 1, True))
    check_op("avg_pool2d_nhwc", (_nhwc(1, 8, 5, 5, torch.float32, "cpu"), 2, 2, 0, False))
