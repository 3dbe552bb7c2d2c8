"""graphopt::upsample_bilinear2d: the reference is aten's upsample in float64; the Triton kernel under
Triton's interpreter (fp32/fp16/bf16; up and down, align_corners or not, scale factors given or not,
a strided token view, NCHW and channels_last, both output layouts) against aten in float64; the
source scale rule; the wrapper's refusals; fake and opcheck; on the GPU the kernel in bf16 at
CoaT's sizes, and replayed from a CUDA graph."""
import pytest
import torch

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import upsample_triton as kt
from graphopt.cuda_ext.ops import upsample_bilinear2d as op
from tests.helpers import (assert_refuses, compiles_asked, cuda_graph_of, run_in_triton_interpreter,
                           sm90_global_accesses)

# N, C, (H, W), output size, align_corners, scale factors given, input layout, channels_last out
CASES = [
    (2, 6, (7, 7), (14, 14), False, (2.0, 2.0), "tokens", True),   # CoaT: tokens after the class token, x2
    (2, 6, (14, 14), (7, 7), False, (0.5, 0.5), "nhwc", True),     # and back down
    (1, 5, (5, 6), (9, 13), True, None, "nchw", False),            # align_corners, odd sizes
    (1, 3, (6, 5), (4, 11), False, None, "nhwc", False),           # down one dim, up the other, sizes only
    (2, 40, (3, 4), (7, 9), False, (2.5, 2.25), "nhwc", True),     # factors that are not the size ratio
    (1, 4, (1, 1), (3, 3), True, None, "nhwc", True),              # one source pixel
    (1, 4, (4, 4), (1, 1), True, None, "nchw", True),              # one output pixel (scale 0)
]


def _inputs(N, C, size, out, align, scales, layout, cl, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + N + 3 * C + 7 * size[0])
    H, W = size
    if layout == "tokens":  # [N, 1 + H*W, C] tokens, the class token dropped, seen as an image
        x = torch.randn(N, 1 + H * W, C, generator=g).to(device=device, dtype=dtype)
        x = x[:, 1:].transpose(1, 2).reshape(N, C, H, W)
    else:
        x = torch.randn(N, C, H, W, generator=g).to(device=device, dtype=dtype)
        if layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
    return x, list(out), align, scales, cl


def _expect64(x, out, align, scales):
    return torch.ops.aten.upsample_bilinear2d.vec(x.double(), None if scales else out, align,
                                                  list(scales) if scales else None)


def _check(y, args, tol):
    x, out, align, scales, cl = args
    assert y.dtype == x.dtype and tuple(y.shape) == (*x.shape[:2], *out)
    assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    torch.testing.assert_close(y.double(), _expect64(x, out, align, scales), rtol=tol, atol=tol)


def _op_args(x, out, align, scales, cl):
    sh, sw = scales if scales else (0.0, 0.0)
    return (x, out, align, sh, sw, cl)


@pytest.mark.parametrize("case", CASES)
def test_reference(case):
    args = _inputs(*case, torch.float64)
    assert case[6] != "tokens" or not args[0].is_contiguous(memory_format=torch.channels_last)
    _check(op.reference(*_op_args(*args)), args, 1e-12)


def interpreter_cases():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        for case in CASES:
            args = _inputs(*case, dtype)
            x, out, align, scales, cl = args
            y = torch.full_like(op._empty(x, out, cl), float("nan"))
            _check(kt.upsample_bilinear2d_triton(x, y, align, scales), args, tol)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_upsample_bilinear2d:interpreter_cases")


def test_compiled_for_sm90_a_token_view_loads_in_16_bytes():
    """The kernel as the launcher specializes it for CoaT's token view (bf16, 152 channels, rows of 304
    bytes, channel strides 1) compiles for sm_90 with 128-bit loads and stores; 19 channels cannot."""
    from graphopt.cuda_ext.dwconv_triton import alignment, tiles
    from graphopt.cuda_ext.norm_triton import row_vec

    fn = kt._build()

    def accesses(C, align):
        bc, bp, ncb, _, _ = tiles(C, 64 * 56 * 56)
        values = dict(CA=row_vec(C, 2), ALIGN_CORNERS=False, XA=align, OA=align, BLOCK_P=bp, BLOCK_C=bc, WIDE=False,
                      sxc=1, soc=1)
        return sm90_global_accesses(fn, values, ("X", "OUT"), floats=("rh", "rw"))

    tokens = torch.empty(64, 785, 152)[:, 1:].transpose(1, 2).reshape(64, 152, 28, 28)
    ld, st = accesses(152, alignment(tokens))
    assert ld == {"ld.global.v4.b32"} and st == {"st.global.v4.b32"}
    ld, st = accesses(19, 1)
    assert "ld.global.v4.b32" not in ld


def test_one_compiled_kernel_serves_every_image_and_channel_count(monkeypatch):
    """Warmed for sm_90 (stand-in driver, fakes, compiles recorded), 2x upsamplings of 128, 256 and 384
    channels at 28, 14 and 7 pixels ask for one compile (sizes runtime arguments); align_corners another."""
    pytest.importorskip("triton")

    def up(C, H, align=False):
        def make():
            x = torch.empty(8, C, H, H, device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
            return x, [2 * H, 2 * H], align, 2.0, 2.0, True
        return make

    requests = compiles_asked(monkeypatch, torch.ops.graphopt.upsample_bilinear2d.default,
                              [up(128, 28), up(256, 14), up(384, 7), up(256, 14, True)])
    assert len(set(requests[:3])) == 1 and len(set(requests)) == 2


@pytest.mark.parametrize("inp,out,align,factor,scale", [(7, 14, False, 2.0, 0.5), (7, 14, False, None, 0.5),
                                                        (3, 7, False, 2.25, 1 / 2.25), (5, 9, True, None, 0.5),
                                                        (4, 1, True, None, 0.0), (6, 4, False, None, 1.5)])
def test_source_scale_is_atens(inp, out, align, factor, scale):
    assert kt.source_scale(inp, out, align, factor) == pytest.approx(scale)


@pytest.mark.parametrize("bad,match", [
    (lambda a: {0: a[0][0]}, "must be \\[N, C, H, W\\]"),
    (lambda a: {1: [0, 4]}, "two integers >= 1"),
    (lambda a: {0: a[0].to(torch.int32)}, "float32, float16 or bfloat16"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    assert_refuses(ops.upsample_bilinear2d, _inputs(*CASES[0], torch.float32), bad, match)


def test_conformance():
    from kx_conformance import check_op

    check_op("upsample_bilinear2d", _op_args(*_inputs(*CASES[0], torch.float32)))
    check_op("upsample_bilinear2d", _op_args(*_inputs(*CASES[2], torch.float32)))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + [(64, 152, (28, 28), (56, 56), False, (2.0, 2.0), "tokens", True),
                                          (64, 152, (28, 28), (14, 14), False, (0.5, 0.5), "tokens", True),
                                          (64, 152, (14, 14), (56, 56), False, (4.0, 4.0), "tokens", True)])
def test_kernel_on_gpu(case):
    args = _inputs(*case, torch.bfloat16, device="cuda")
    _check(ops.upsample_bilinear2d(*args), args, 2e-2)


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph():
    args = _inputs(*CASES[0], torch.bfloat16, device="cuda")
    opargs = _op_args(*args)
    graph, y = cuda_graph_of(lambda: torch.ops.graphopt.upsample_bilinear2d(*opargs))
    for _ in range(2):
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, args, 2e-2)
