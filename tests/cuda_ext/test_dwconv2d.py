"""graphopt::dwconv2d: the reference is conv2d(groups=C) + bias, the activation and the residual in
float64; the Triton kernel under Triton's interpreter (fp32/fp16/bf16; channels_last, NCHW and a
channel slice of a wider channels_last tensor read in place; stride, padding, dilation, unequal
kernels; every activation; a broadcast residual; both output layouts) against it in float64; the
alignment hint and channel blocks; the cost; the wrapper's refusals; fake and opcheck; on the GPU
the kernel in bf16 at model sizes, and replayed from a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import dwconv_triton as kt
from graphopt.cuda_ext.ops import dwconv2d as op
from graphopt.cuda_ext.ops.bias_act import activation
from graphopt.cuda_ext.ops.col2im import windows
from tests.helpers import (assert_refuses, compiles_asked, cuda_graph_of, run_in_triton_interpreter,
                           sm90_global_accesses)

# N, C, (H, W), (kh, kw), stride, padding, dilation, act, input layout, residual, channels_last out
CASES = [
    (2, 6, (7, 9), (3, 3), (1, 1), (1, 1), (1, 1), "none", "nhwc", "full", True),     # CoaT's position encoding
    (2, 19, (8, 8), (7, 7), (1, 1), (3, 3), (1, 1), "gelu", "slice", None, True),      # a value head of qkv, 7x7
    (1, 8, (9, 10), (5, 5), (2, 2), (2, 2), (1, 1), "silu", "nhwc", None, True),        # EfficientNet's stride 2
    (2, 5, (6, 7), (3, 2), (1, 2), (2, 0), (2, 1), "hardswish", "nchw", None, False),   # dilated, unequal
    (1, 40, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1), "relu", "nhwc", "bcast", True),     # several channel blocks
    (2, 3, (4, 6), (1, 1), (1, 1), (0, 0), (1, 1), "leaky_relu:0.1", "nhwc", None, True),
    (1, 16, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1), "gelu_tanh", "nhwc", None, False),
    (1, 4, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1), "sigmoid", "nchw", "full", True),
    (1, 4, (5, 5), (3, 3), (3, 3), (0, 0), (1, 1), "tanh", "nhwc", None, True),
]


def _inputs(N, C, size, k, s, p, d, act, layout, residual, cl, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + N + 3 * C + 11 * size[0])
    H, W = size
    if layout == "slice":  # channels [C, 2C) of a channels_last tensor of 3C channels (qkv's v), sliced
        x = torch.randn(N, 3 * C, H, W, generator=g)  # after the conversion below (a copy of a slice is dense)
    else:
        x = torch.randn(N, C, H, W, generator=g)
        if layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(C, 1, *k, generator=g) / k[0]
    b = torch.randn(C, generator=g)
    oh, ow = (windows(size[i], k[i], d[i], p[i], s[i]) for i in range(2))
    r = None
    if residual == "full":
        r = torch.randn(N, C, oh, ow, generator=g).contiguous(memory_format=torch.channels_last)
    elif residual == "bcast":
        r = torch.randn(C, 1, 1, generator=g)
    t = [v.to(device=device, dtype=dtype) if v is not None else None for v in (x, w, b, r)]
    if layout == "slice":
        t[0] = t[0].contiguous(memory_format=torch.channels_last)[:, C:2 * C]
    return (*t, list(s), list(p), list(d), act, cl)


def _expect64(x, w, b, r, s, p, d, act, cl):
    y = F.conv2d(x.double(), w.double(), b.double(), s, p, d, groups=x.shape[1])
    y = activation(y, act)
    return y + r.double() if r is not None else y


def _check(out, args, tol):
    x, *_, cl = args
    assert out.dtype == x.dtype
    assert out.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    torch.testing.assert_close(out.double(), _expect64(*args), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
def test_reference(case):
    args = _inputs(*case, torch.float64)
    assert case[8] != "slice" or not args[0].is_contiguous(memory_format=torch.channels_last)
    _check(op.reference(*args), args, 1e-12)


def interpreter_cases():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)):
        for case in CASES:
            args = _inputs(*case, dtype)
            x, w, b, r, s, p, d, act, cl = args
            out = torch.full_like(op._empty(x, op.out_shape(x.shape, w.shape, s, p, d), cl), float("nan"))
            _check(kt.dwconv2d_triton(x, w, b, r, out, s, p, d, act), args, tol)
        args = _inputs(*CASES[1], dtype)  # the filter stored tap-major (lower_depthwise_conv's constant)
        x, w, b, r, s, p, d, act, cl = args
        wt = w.permute(2, 3, 0, 1).contiguous().permute(2, 3, 0, 1)
        out = op._empty(x, op.out_shape(x.shape, w.shape, s, p, d), cl)
        _check(kt.dwconv2d_triton(x, wt, b, r, out, s, p, d, act), args, tol)
        args = _inputs(*CASES[0], dtype)  # no bias
        x, w, b, r, s, p, d, act, cl = args
        out = op._empty(x, op.out_shape(x.shape, w.shape, s, p, d), cl)
        _check(kt.dwconv2d_triton(x, w, None, r, out, s, p, d, act), (x, w, torch.zeros_like(b), r, s, p, d, act, cl),
               tol)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_dwconv2d:interpreter_cases")


def test_compiled_for_sm90_a_channel_slice_and_tap_major_filter_load_in_16_bytes():
    """The kernel as the launcher specializes it for CoaT's value slice (bf16, 152 of 456 channels,
    channel strides 1) compiles for sm_90 with every input, filter, residual load and output store a
    128-bit one (the alignment hint, the channel count and tap stride passed as multiples of 8, the
    tap-major filter), the sizes runtime integers; 19 channels (rows of 38 bytes) cannot."""
    fn = kt._build()

    def accesses(C, align):
        bc, bp, ncb, _, _ = kt.tiles(C, 64 * 28 * 28)
        vec = kt.row_vec(C, 2)
        values = dict(KH=3, KW=3, SH=1, SW=1, PH=1, PW=1, DH=1, DW=1, HAS_B=True, HAS_R=True, ACT=0, XA=align,
                      RA=align, OA=align, BLOCK_P=bp, BLOCK_C=bc, WIDE=False, sxc=1, SWC=1, CA=vec, WA=vec, src=1,
                      soc=1)
        return sm90_global_accesses(fn, values, ("X", "Wt", "B", "R", "OUT"), floats=("slope",))

    qkv = torch.empty(64, 456, 28, 28).contiguous(memory_format=torch.channels_last)
    ld, st = accesses(152, kt.alignment(qkv[:, 304:]))
    assert ld == {"ld.global.v4.b32"} and st == {"st.global.v4.b32"}
    ld, st = accesses(19, 1)
    assert "ld.global.v4.b32" not in ld


def test_one_compiled_kernel_serves_every_image_and_channel_count(monkeypatch):
    """Warmed for sm_90 (a stand-in driver, fake CUDA tensors, the compiles recorded instead of run),
    RDNet-like 7x7 convolutions over 128, 256 and 384 channels of 56, 28 and 14 pixels ask for one
    compile: sizes are runtime arguments, never specialized; a 3x3 one and a fp32 one each ask for
    another. (Every size a compile-time constant had asked for a kernel per shape.)"""
    pytest.importorskip("triton")

    def conv(C, H, K, dtype):
        def make():
            x = torch.empty(8, C, H, H, device="cuda", dtype=dtype, memory_format=torch.channels_last)
            w, b = torch.empty(C, 1, K, K, device="cuda", dtype=dtype), torch.empty(C, device="cuda", dtype=dtype)
            return x, w, b, None, [1, 1], [K // 2] * 2, [1, 1], "gelu", True
        return make

    bf16 = torch.bfloat16
    requests = compiles_asked(monkeypatch, torch.ops.graphopt.dwconv2d.default,
                              [conv(128, 56, 7, bf16), conv(256, 28, 7, bf16), conv(384, 14, 7, bf16),
                               conv(256, 28, 3, bf16), conv(256, 28, 7, torch.float32)])
    assert len(set(requests)) == 3
    assert len(set(requests[:3])) == 1


def test_alignment_is_the_power_of_two_dividing_every_stride_but_the_channels():
    nhwc = torch.empty(2, 152, 28, 28).contiguous(memory_format=torch.channels_last)
    assert kt.alignment(nhwc) == 8  # 152 = 8 x 19
    v = torch.empty(2, 456, 28, 28).contiguous(memory_format=torch.channels_last)[:, 304:]
    assert kt.alignment(v) == 8
    assert kt.alignment(torch.empty(2, 19, 5, 5).contiguous(memory_format=torch.channels_last)) == 1
    assert kt.alignment(torch.empty(1, 12, 5, 5)) == 1  # NCHW: the width's stride is 1
    assert kt.alignment(torch.empty(1, 12, 1, 1)) == 8  # no stride that moves


@pytest.mark.parametrize("C,block", [(152, 32), (96, 32), (768, 128), (672, 32), (8, 16), (40, 16), (64, 64)])
def test_channel_block_wastes_the_fewest_lanes(C, block):
    assert kt.block_c(C) == block


def _call_node(args):
    import torch.fx as fx

    g = fx.Graph()
    names = ("x", "w", "b", "r")
    nodes = []
    for name, t in zip(names, args[:4]):
        if t is None:
            nodes.append(None)
            continue
        n = g.placeholder(name)
        n.meta["val"] = t
        nodes.append(n)
    call = g.call_function(torch.ops.graphopt.dwconv2d.default, (*nodes, *args[4:]))
    call.meta["val"] = op.reference(*args)
    return call


def test_cost_reads_each_tensor_once_and_floors_at_the_taps_cache_reads():
    from graphopt.cost.ops import op_call
    from graphopt.cost.profiles import get_profile

    args = _inputs(*CASES[1], torch.bfloat16)
    call = _call_node(args)
    x, w, b = args[:3]
    out = call.meta["val"]
    prof = get_profile("h200")[0]
    c = op.cost(op_call(call), prof)
    assert c.bytes == 2 * (x.numel() + w.numel() + b.numel() + out.numel()) and c.launches == 1
    assert c.flops == 2 * 49 * out.numel()
    assert c.device_floor_s == pytest.approx(49 * out.numel() * 2 / (prof.bandwidth * op.CACHE_SPEEDUP))
    assert op.cost(op_call(call), get_profile("cpu")[0]).device_floor_s is None


@pytest.mark.parametrize("bad,match", [
    (lambda a: {1: a[1].expand(a[1].shape[0], 2, 3, 3)}, "one filter per channel"),
    (lambda a: {2: a[2][:3]}, "bias must be"),
    (lambda a: {7: "swish"}, "unknown activation"),
    (lambda a: {5: [-1, 1]}, "padding >= 0"),
    (lambda a: {1: torch.randn(a[0].shape[1], 1, 11, 11)}, "does not fit"),
    (lambda a: {3: torch.randn(2, 6, 2, 2)}, "does not broadcast to the output's"),
    (lambda a: {0: a[0].to(torch.int32)}, "float32, float16 or bfloat16"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    assert_refuses(ops.dwconv2d, _inputs(*CASES[0], torch.float32), bad, match)


def test_conformance():
    from kx_conformance import check_op

    check_op("dwconv2d", tuple(_inputs(*CASES[0], torch.float32)))
    check_op("dwconv2d", tuple(_inputs(*CASES[3], torch.float32)))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + [
    (64, 152, (28, 28), (3, 3), (1, 1), (1, 1), (1, 1), "none", "nhwc", "full", True),    # CoaT-Tiny's cpe
    (64, 152, (28, 28), (7, 7), (1, 1), (3, 3), (1, 1), "none", "slice", None, True),     # its merged crpe
    (64, 96, (56, 56), (7, 7), (1, 1), (3, 3), (1, 1), "none", "nhwc", None, True),       # ConvNeXt-T
    (64, 144, (56, 56), (3, 3), (2, 2), (1, 1), (1, 1), "silu", "nhwc", None, True),      # EfficientNet-B0
])
def test_kernel_on_gpu(case):
    args = _inputs(*case, torch.bfloat16, device="cuda")
    _check(ops.dwconv2d(*args), args, 3e-2)


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph():
    args = _inputs(*CASES[0], torch.bfloat16, device="cuda")
    graph, out = cuda_graph_of(lambda: torch.ops.graphopt.dwconv2d(*args))
    for _ in range(2):
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, args, 3e-2)
