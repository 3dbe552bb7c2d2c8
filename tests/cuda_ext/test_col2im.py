"""graphopt::col2im: the reference is F.fold of the 7-D windows (float64, both layouts); the Triton
kernel under Triton's interpreter (fp32/fp16/bf16; windows read through the strides of a permuted
tensor, channels split over two dims; dilation, padding, unequal height and width, overlapping
and gapped windows; both output layouts) against F.fold in float64; the gradient is F.unfold's;
the wrapper's refusals; fake and opcheck; on the GPU the kernel in bf16, VOLO's outlooker fold
among the cases, and replayed from a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import col2im_triton as kt
from graphopt.cuda_ext.ops import col2im as op
from tests.helpers import assert_refuses, cuda_graph_of, run_in_triton_interpreter

# N, C1, C2, (H, W), kernel, dilation, padding, stride, permuted (the windows a permute of a product), channels_last
CASES = [
    (2, 3, 4, (14, 14), (3, 3), (1, 1), (1, 1), (2, 2), True, True),     # VOLO's outlooker fold, NHWC out
    (2, 5, 1, (9, 11), (3, 3), (1, 1), (1, 1), (1, 1), False, False),    # overlapping stride-1 windows
    (1, 2, 3, (10, 12), (2, 3), (2, 1), (1, 0), (1, 2), True, False),    # dilated, unequal, permuted
    (3, 4, 2, (8, 8), (2, 2), (1, 1), (0, 0), (2, 2), False, True),      # non-overlapping patches
    (1, 3, 2, (13, 9), (3, 2), (1, 1), (2, 1), (3, 3), True, True),      # stride above the kernel: gaps
    (2, 4, 1, (15, 17), (7, 7), (1, 1), (3, 3), (4, 4), False, True),    # overlapping patches: 2 of 7 taps a dim
]


def _inputs(N, C1, C2, size, k, d, p, s, permuted, cl, dtype, device="cpu", seed=0):
    """The 7-D windows [N, C1, C2, kh, kw, lh, lw]; ``permuted``: a view of a [N, C1, lh*lw, kh*kw, C2]
    tensor (the product VOLO folds), channels over two dims with C2 innermost."""
    lh, lw = (op.windows(*a) for a in zip(size, k, d, p, s))
    g = torch.Generator().manual_seed(seed + 7 * N + C1 + 13 * lh)
    if permuted:
        base = torch.randn(N, C1, lh * lw, k[0] * k[1], C2, generator=g).to(device=device, dtype=dtype)
        x = base.permute(0, 1, 4, 3, 2).view(N, C1, C2, k[0], k[1], lh, lw)
    else:
        x = torch.randn(N, C1, C2, k[0], k[1], lh, lw, generator=g).to(device=device, dtype=dtype)
    return x, list(size), list(k), list(d), list(p), list(s), cl


def _fold64(x, size, k, d, p, s):
    return F.fold(x.double().reshape(x.shape[0], -1, x.shape[5] * x.shape[6]), size, k, dilation=d, padding=p,
                  stride=s)


def _check(out, args, tol):
    x, size, k, d, p, s, cl = args
    assert out.dtype == x.dtype and tuple(out.shape) == (x.shape[0], x.shape[1] * x.shape[2], *size)
    fmt = torch.channels_last if cl else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(out.double(), _fold64(x, size, k, d, p, s), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
def test_reference_is_fold(case):
    args = _inputs(*case, torch.float64)
    assert not case[8] or not args[0].is_contiguous()
    _check(op.reference(*args), args, 1e-12)


def interpreter_cases():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        for case in CASES:
            args = _inputs(*case, dtype)
            x, size, k, d, p, s, cl = args
            out = torch.full_like(op._empty(x, size, cl), float("nan"))
            _check(kt.col2im_triton(x, out, k, d, p, s, cl), args, tol)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_col2im:interpreter_cases")


@pytest.mark.parametrize("k,d,s,visited", [(3, 1, 2, (2, True)), (16, 1, 16, (1, True)), (7, 1, 4, (2, True)),
                                           (3, 1, 1, (3, False)), (3, 2, 2, (3, False))])
def test_an_element_visits_only_the_taps_that_can_land_on_it(k, d, s, visited):
    assert kt.taps(k, d, s) == visited


def test_gradient_is_unfold():
    x, size, k, d, p, s, cl = _inputs(*CASES[2], torch.float64)
    x = x.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: torch.ops.graphopt.col2im(t, size, k, d, p, s, True), (x,))


def test_cost_reads_the_windows_and_writes_the_output_once():
    import torch.fx as fx

    from graphopt.cost.ops import op_call

    x, size, k, d, p, s, cl = _inputs(*CASES[0], torch.bfloat16)
    g = fx.Graph()
    xn = g.placeholder("x")
    xn.meta["val"] = x
    call = g.call_function(torch.ops.graphopt.col2im.default, (xn, size, k, d, p, s, cl))
    call.meta["val"] = op.reference(x, size, k, d, p, s, cl)
    c = op.cost(op_call(call), None)
    assert c.bytes == 2 * (x.numel() + call.meta["val"].numel()) and c.launches == 1
    assert c.flops == 4 * call.meta["val"].numel()  # 2 x 2 of the 3 x 3 taps visited at stride 2


@pytest.mark.parametrize("bad,match", [
    (lambda a: {0: a[0][0]}, "must be \\[N, C1, C2"),
    (lambda a: {1: [15, 14]}, "last four dims"),
    (lambda a: {4: [-1, 1]}, "padding >= 0"),
    (lambda a: {0: a[0].to(torch.int32)}, "float32, float16 or bfloat16"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    assert_refuses(ops.col2im, _inputs(*CASES[0], torch.float32), bad, match)


def test_conformance():
    from kx_conformance import check_op

    check_op("col2im", tuple(_inputs(*CASES[0], torch.float32)))
    check_op("col2im", tuple(_inputs(*CASES[2], torch.float32)))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + [(64, 6, 32, (28, 28), (3, 3), (1, 1), (1, 1), (2, 2), True, True),
                                          (8, 64, 1, (32, 32), (3, 3), (1, 1), (1, 1), (1, 1), False, False),
                                          (64, 3, 1, (224, 224), (16, 16), (1, 1), (0, 0), (16, 16), False, False)])
def test_kernel_on_gpu(case):
    args = _inputs(*case, torch.bfloat16, device="cuda")
    _check(ops.col2im(*args), args, 2e-2)


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph():
    x, size, k, d, p, s, cl = _inputs(*CASES[0], torch.bfloat16, device="cuda")
    graph, out = cuda_graph_of(lambda: torch.ops.graphopt.col2im(x, size, k, d, p, s, cl))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, (x, size, k, d, p, s, cl), 2e-2)
