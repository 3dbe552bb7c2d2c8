"""graphopt::group_norm against float64 GroupNorm by the accuracy rule: on the CPU (the reference),
through Triton's interpreter (the kernel's source, several splits and tiles a row), and, marked
``cuda``, on the GPU kernel: one group and many, NCHW and channels_last (the output keeps x's
layout), a 3-D input, each activation, no affine; the wrapper's refusals; fake and opcheck."""
import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext as ce
from graphopt.errors import KernelArgumentError
from kx_accuracy import check
from kx_group_norm_interpreter import ACT, CASES
from conftest import DEVICES, poison_allocator

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
def _case(shape, groups, cl, affine, dtype, device, shift=3.0):
    g = torch.Generator().manual_seed(sum(shape) + groups)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + shift).to(device=device, dtype=dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(shape[1], generator=g, dtype=torch.float64).to(device=device, dtype=dtype) if affine else None
    b = torch.randn(shape[1], generator=g, dtype=torch.float64).to(device=device, dtype=dtype) if affine else None
    return x, w, b


def _want(x, groups, w, b, act):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    return ACT[act](F.group_norm(x.double(), groups, d(w), d(b), 1e-5))


def _eager(x, groups, w, b, act):
    return ACT[act](F.group_norm(x, groups, w, b, 1e-5))


def _run_cases(device, dtype):
    for shape, groups, cl, act, affine in CASES:
        x, w, b = _case(shape, groups, cl, affine, dtype, device)
        poison_allocator(device)
        y = torch.ops.graphopt.group_norm(x, groups, w, b, 1e-5, act)
        fmt = torch.channels_last if cl else torch.contiguous_format
        assert y.is_contiguous(memory_format=fmt) and y.dtype == dtype, shape
        check(y, _want(x, groups, w, b, act), _eager(x, groups, w, b, act), what=f"{shape} {groups} {act} cl={cl}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm(device, dtype):
    _run_cases(device, dtype)


def test_triton_kernel_in_interpreter():
    from tests.helpers import run_in_triton_interpreter, skip_old_interpreter

    skip_old_interpreter()  # (its tile loops have runtime bounds; the cuda-marked tests run the kernel itself)
    run_in_triton_interpreter("tests.cuda_ext.kx_group_norm_interpreter:interpreter_cases")


def test_plan_fills_the_device_in_whole_tiles():
    from graphopt.cuda_ext.group_norm_triton import BLOCK, plan

    for rows, length in [(64, 200704), (64, 25088), (4096, 1024), (1, 10), (2, 5 * BLOCK + 1)]:
        splits, chunk = plan(rows, length)
        assert chunk % BLOCK == 0 and splits * chunk >= length > (splits - 1) * chunk
    assert plan(64, 200704)[0] >= 8 and plan(4096, 1024)[0] == 1


def test_wrapper_refuses_bad_arguments():
    x = torch.randn(2, 6, 4, 4)
    with pytest.raises(KernelArgumentError, match="divisible"):
        ce.group_norm(x, 4)
    with pytest.raises(KernelArgumentError, match="weight"):
        ce.group_norm(x, 3, torch.randn(5))
    with pytest.raises(KernelArgumentError, match="activation"):
        ce.group_norm(x, 3, act="tanh")


def test_conformance():
    from kx_conformance import check_op

    check_op("group_norm", (torch.randn(2, 8, 5, 5), 2, torch.randn(8), torch.randn(8), 1e-5, "silu"))
    check_op("group_norm", (torch.randn(2, 8, 4, 3).contiguous(memory_format=torch.channels_last), 1, None, None,
                            1e-5, "none"))
