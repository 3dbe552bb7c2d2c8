"""The pointwise program language: builder, parser, reference evaluator, and the generated
Triton kernels (run on the CPU through Triton's interpreter here, on the GPU when marked cuda)."""
import math

import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext as ce
from graphopt.cuda_ext import pointwise_triton as pwt
from graphopt.cuda_ext import reference
from graphopt.cuda_ext.pointwise import Program, ProgramError, evaluate, parse
from graphopt.cuda_ext import pointwise as pw

from kx_accuracy import check
from conftest import DEVICES, HAS_CUDA, poison_allocator


def gelu_bias_res_program():
    p = Program()
    x, b, r = p.input(), p.input(), p.input()
    y = p.gelu_tanh(x + b) + r
    p.output(y, torch.bfloat16)
    p.output(p.cast(y, "bf16") * 2.0, "f32")
    return p


def every_op_program():
    p = Program()
    x, y, m = p.input(), p.input(), p.input()
    vals = [p.neg(x), p.abs(x), p.exp(p.clamp(x, None, 5)), p.log(p.abs(x) + 1), p.sqrt(p.abs(y)),
            p.rsqrt(p.abs(y) + 0.5), p.tanh(x), p.sigmoid(x), p.relu(x), p.gelu(x), p.gelu_tanh(x),
            p.silu(x), p.hardswish(x), p.pow(x, 2), p.pow(p.abs(x), 0.75), p.pow(y, -1), p.maximum(x, y),
            p.minimum(x, y), p.where(m, x, y), p.where(p.lt(x, y), 1.0, -1.0), p.clamp(x, -0.5, 0.5),
            x - y, x / (p.abs(y) + 1), 3.0 - x, p.cast(p.eq(x, x), "f32") + p.cast(p.ne(x, y), "f32"),
            p.cast(p.le(x, 0.0), "f32") + p.cast(p.ge(y, 0.0), "f32") + p.cast(p.gt(x, y), "f32"),
            p.cos(x * 3.0), p.sin(y * 3.0), p.erf(x)]
    acc = vals[0]
    for v in vals[1:]:
        acc = acc + v
    p.output(acc, torch.float32)
    p.output(p.gt(acc, 0.0), torch.bool)
    return p


def test_builder_source_roundtrip():
    p = gelu_bias_res_program()
    src = p.source
    assert parse(src).source == src
    assert parse(src.replace("\n", " ; ")).source == src  # one-line form
    assert p.output_dtypes() == [torch.bfloat16, torch.float32]
    assert "gelu_tanh" in src and "out %" in src
    q = every_op_program()
    assert parse(q.source).source == q.source


@pytest.mark.parametrize("bad, msg", [
    ("%0 = input 0\n%1 = frob %0\nout %1 f32", "unknown op"),
    ("%0 = input 0\n%1 = add %0 %2\nout %1 f32", "before it is defined"),
    ("%0 = input 0\n%2 = exp %0\nout %2 f32", "numbered in order"),
    ("%0 = input 0\nout %0 f8", "unknown dtype"),
    ("%0 = input 0\n%1 = exp %0", "no `out`"),
    ("%0 = input 1\nout %0 f32", "never read"),
    ("%0 = input 0\n%1 = add %0\nout %1 f32", "takes 2 operand"),
])
def test_parse_errors(bad, msg):
    with pytest.raises(ProgramError, match=msg):
        parse(bad)


def test_evaluate_matches_torch_composite_fp64():
    x, b, r = torch.randn(4, 7, dtype=torch.float64), torch.randn(7, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    p = Program()
    xi, bi, ri = p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(xi + bi) + ri, torch.float64)
    (y,) = evaluate(p, [x, b, r])
    torch.testing.assert_close(y, F.gelu(x + b, approximate="tanh") + r)


def test_cast_rounds_like_eager():
    x = torch.randn(1000, dtype=torch.float32)
    p = Program()
    xi = p.input()
    p.output(p.cast(xi * 3.0, "bf16") + 1.0, "f32")
    (y,) = evaluate(p, [x])
    torch.testing.assert_close(y, (x * 3).bfloat16().float() + 1, rtol=0, atol=0)


def _inputs(device, dtype):
    """broadcasting and strided inputs: [5, 1, 33] strided, [4, 1] , [33] bool mask"""
    x = torch.randn(33, 5, device=device, dtype=dtype).t().unsqueeze(1)  # [5, 1, 33], non-contiguous
    y = torch.randn(4, 1, device=device, dtype=dtype)
    m = torch.rand(33, device=device) > 0.5
    return [x, y, m]


@pytest.mark.parametrize("device", DEVICES)
def test_op_matches_evaluator(device):
    p = every_op_program()
    ins = _inputs(device, torch.float32)
    outs = ce.fused_pointwise(p, ins)
    ref = evaluate(p, [t.double() if t.is_floating_point() else t for t in ins])
    assert outs[0].shape == (5, 4, 33) and outs[1].dtype == torch.bool
    check(outs[0], ref[0], evaluate(p, ins)[0])


def _run_triton(program, inputs):
    return pwt.fused_pointwise_triton(program, inputs)


@pytest.fixture
def triton_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_generated_triton_kernel_in_interpreter(triton_interpreter, dtype):
    """The generated kernel (same source the GPU compiles) on the CPU via TRITON_INTERPRET."""
    # gelu_bias_res_program rounds through bf16 inside (cast), so it is held to bf16's tolerance
    for p, ins, tdt in [(every_op_program(), _inputs("cpu", dtype), dtype),
                        (gelu_bias_res_program(), [torch.randn(3, 1023).to(dtype), torch.randn(1023).to(dtype),
                                                   torch.randn(3, 1023).to(dtype)], torch.bfloat16)]:
        outs = _run_triton(p.source, ins)
        ref64 = evaluate(p, [t.double() if t.is_floating_point() else t for t in ins])
        eager = evaluate(p, ins)
        for o, r, e in zip(outs, ref64, eager):
            if o.dtype == torch.bool:
                # comparisons near 0 may flip with rounding; require 99% agreement
                assert (o == e).float().mean() > 0.99
            else:
                check(o, r, e, dtype=tdt)


def test_triton_single_element_and_scalar_inputs(triton_interpreter):
    p = Program()
    a, b = p.input(), p.input()
    p.output(p.silu(a) * b, "f32")
    for ins in [[torch.randn(1), torch.randn(())], [torch.randn(()), torch.randn(())], [torch.randn(7, 1), torch.randn(1, 3)]]:
        (o,) = _run_triton(p.source, ins)
        torch.testing.assert_close(o, F.silu(ins[0]) * ins[1])


def test_coalesce_dims():
    # contiguous [2, 3, 4] -> one dim; a broadcast input keeps its zero stride
    shape, st = pwt.coalesce([2, 3, 4], [[12, 4, 1], [0, 0, 1]])
    assert shape == [6, 4] and st == [[4, 1], [0, 1]]
    shape, st = pwt.coalesce([2, 3, 4], [[12, 4, 1], [12, 4, 1]])
    assert shape == [24] and st == [[1], [1]]
    shape, st = pwt.coalesce([1, 1], [[0, 0]])
    assert shape == [1]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pointwise_cuda(dtype):
    bf = torch.bfloat16
    for p, ins, tdt in [(every_op_program(), _inputs("cuda", dtype), dtype),
                        (gelu_bias_res_program(), [torch.randn(3, 4097, device="cuda").to(dtype),
                                                   torch.randn(4097, device="cuda").to(dtype),
                                                   torch.randn(3, 4097, device="cuda").to(dtype)], bf),
                        (gelu_bias_res_program(), [torch.randn(1, device="cuda").to(dtype),
                                                   torch.randn(1, device="cuda").to(dtype),
                                                   torch.randn(1, device="cuda").to(dtype)], bf)]:
        poison_allocator("cuda")
        outs = ce.fused_pointwise(p, ins)
        ref64 = evaluate(p, [t.double() if t.is_floating_point() else t for t in ins])
        eager = evaluate(p, ins)
        for o, r, e in zip(outs, ref64, eager):
            if o.dtype == torch.bool:
                assert (o == e).float().mean() > 0.99
            else:
                check(o, r, e, dtype=tdt)


def test_dense_inputs_mixed_with_broadcast(triton_interpreter):
    """a and c laid out like the output (flat index), b broadcast (stride walk), plus a
    transposed operand that must not be taken as dense."""
    p = Program()
    a, b, c, d = p.input(), p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(a + b) * c + d, "f32")
    a_, b_, c_ = torch.randn(6, 33), torch.randn(33), torch.randn(6, 33)
    d_ = torch.randn(33, 6).t()
    (o,) = _run_triton(p.source, [a_, b_, c_, d_])
    torch.testing.assert_close(o, F.gelu(a_ + b_, approximate="tanh") * c_ + d_)


def test_rank2_broadcast_uses_tiles_without_division(triton_interpreter):
    """A bias row or a per-row scale on a 2-D output: the [BM, BN] tile kernel indexes them by row and
    column (no div/mod per element) and matches the evaluator, odd sizes included."""
    p = Program()
    a, b, c = p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(a + b) * c, "f32")
    src = pwt.generate(parse(p.source), (torch.float32,) * 3, 2, False, (True, False, False), tile2d=True)
    assert "BM: tl.constexpr" in src and "%" not in src and "//" not in src
    for ins in [[torch.randn(5, 37), torch.randn(37), torch.randn(5, 1)],        # row bias, column scale
                [torch.randn(3, 1500), torch.randn(1, 1500), torch.randn(3, 1500)]]:  # BN capped at BLOCK
        (o,) = _run_triton(p.source, ins)
        torch.testing.assert_close(o, F.gelu(ins[0] + ins[1], approximate="tanh") * ins[2], rtol=1e-5, atol=1e-5)


def _cl_case():
    p = Program()
    a, s, r = p.input(), p.input(), p.input()
    p.output(p.relu(a * s + r), torch.float32)
    x = torch.randn(2, 6, 5, 7).contiguous(memory_format=torch.channels_last)
    res = torch.randn(2, 6, 5, 7).contiguous(memory_format=torch.channels_last)
    scale = torch.randn(6, 1, 1)  # ConvNeXt's layer scale: broadcast over H, W
    return p, [x, scale, res]


def test_channels_last_inputs_give_channels_last_outputs():
    """Outputs take the layout of the full-size inputs (reference, fake and, below, Triton)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p, ins = _cl_case()
    (ref,) = reference.fused_pointwise(p.source, ins)
    assert ref.is_contiguous(memory_format=torch.channels_last) and not ref.is_contiguous()
    torch.testing.assert_close(ref, torch.relu(ins[0] * ins[1] + ins[2]))
    with FakeTensorMode() as mode:
        (fake,) = torch.ops.graphopt.fused_pointwise(p.source, [mode.from_tensor(t) for t in ins])
    assert fake.stride() == ref.stride()
    # mixed layouts among the full-size inputs: contiguous outputs
    (mixed,) = reference.fused_pointwise(p.source, [ins[0], ins[1], ins[2].contiguous()])
    assert mixed.is_contiguous()


def test_channels_last_in_the_triton_kernel(triton_interpreter):
    p, ins = _cl_case()
    (out,) = _run_triton(p.source, ins)
    assert out.stride() == reference.fused_pointwise(p.source, ins)[0].stride()
    torch.testing.assert_close(out, torch.relu(ins[0] * ins[1] + ins[2]))


def test_size1_operand_over_a_transposed_input(triton_interpreter):
    """A transposed input (its memory order becomes the run order) with a size-1 operand coalesces
    to one dim: the flat walk, not the 2-D tile kernel (the compute-sanitizer driver found it raising
    'tile2d needs ... rank >= 2' at 33 x 5)."""
    p = Program()
    a, b = p.input(), p.input()
    p.output(p.gelu_tanh(a + b), "f32")
    for x in (torch.randn(33, 5).t(), torch.randn(7, 70).t()):
        s = torch.randn(1)
        (o,) = _run_triton(p.source, [x, s])
        torch.testing.assert_close(o, F.gelu(x + s, approximate="tanh"), rtol=1e-5, atol=1e-5)


def _softmax_normalize_program(scale: float = 0.5):
    """softmax(x * scale + bias) and the same scores L2-normalized over the row (F.normalize's
    spelling: x / max(sqrt(sum(x^2)), eps)): the row reductions, prologue and epilogue."""
    p = Program()
    x, bias = p.input(), p.input()
    s = x * scale + bias
    e = p.exp(s - p.rmax(s))
    p.output(e / p.rsum(e), "f32")
    p.output(x / p.maximum(p.sqrt(p.rsum(x * x)), 1e-12), "f32")
    return p


def test_row_reductions_evaluate_as_torch():
    p = _softmax_normalize_program()
    x, bias = torch.randn(3, 5, 37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    soft, norm = evaluate(p, [x, bias])
    assert torch.allclose(soft.double(), torch.softmax(x * 0.5 + bias, -1), atol=1e-6)  # (outputs stored as f32)
    assert torch.allclose(norm.double(), torch.nn.functional.normalize(x, dim=-1), atol=1e-6)
    assert p.reduces and parse(p.source).reduces and not every_op_program().reduces
    with pytest.raises(ProgramError, match="rmax takes 1"):
        parse("%0 = input 0\n%1 = rmax %0 %0\nout %1 f32\n")


def _check_row_reductions(row: int, device: str, rows=(6,)):
    p = _softmax_normalize_program()
    x = torch.randn(*rows, 2 * row, dtype=torch.bfloat16, device=device)[..., ::2]  # strided along the row
    bias = torch.randn(row, dtype=torch.bfloat16, device=device)
    outs = _run_triton(p.source, [x, bias]) if device == "cpu" else ce.fused_pointwise(p, [x, bias])
    x, bias = x.cpu(), bias.cpu()
    ref64 = evaluate(p, [x.double(), bias.double()])
    eager = evaluate(p, [x, bias])
    for o, r, e in zip(outs, ref64, eager):
        assert o.is_contiguous() and o.shape == (*rows, row)
        check(o.cpu(), r, e, dtype=torch.bfloat16)


@pytest.mark.parametrize("row", [1, 37, 64, 1000, 8192])
def test_row_reductions_in_the_generated_kernel(triton_interpreter, row):
    """Rows of any length up to MAX_ROW, broadcast and strided inputs, bf16 and fp32 outputs."""
    _check_row_reductions(row, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("row", [1, 32, 37, 1000, 8192])
def test_row_reductions_cuda(row):
    poison_allocator("cuda")
    _check_row_reductions(row, "cuda", rows=(3, 1000))


def test_row_reductions_loop_over_rows_over_the_limit_and_have_no_backward():
    from graphopt.cuda_ext.pointwise_grad import backward_program

    p = _softmax_normalize_program()
    assert pwt._make_plan(p, p.source, [torch.randn(2, 8193), torch.randn(8193)]).rows == "looped"
    assert pwt._make_plan(p, p.source, [torch.randn(2, 8192), torch.randn(8192)]).rows == ""
    with pytest.raises(ProgramError, match="no generated backward"):
        backward_program(p.source, (torch.float32, torch.float32), (True, True), (True, True))


# ---------------------------------------------------------------------------------- concatenations read in place


def _cat_cases(device: str, dtype=torch.bfloat16):
    """(program, inputs, expected in fp64): a gate times a concatenation along the last dim of a split
    (strided) and a permuted tensor; a channels_last concatenation along C under a per-channel affine."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    x = r(2, 5, 6, 24)
    gate, i = x[..., :8], x[..., 8:12]
    c = r(2, 4, 5, 6).permute(0, 2, 3, 1)
    p1 = Program()
    v = p1.gelu(p1.input(0)) * p1.catin(3, [1, 2])
    p1.output(v, dtype)
    a = r(2, 3, 4, 5).to(memory_format=torch.channels_last)
    b = r(2, 6, 4, 5).to(memory_format=torch.channels_last)
    s = r(9, 1, 1)
    p2 = Program()
    cat = p2.catin(1, [0, 1])
    p2.output(cat * p2.input(2) + 1.0, dtype)
    p2.output(p2.relu(cat), "f32")
    d = lambda t: t.double()  # noqa: E731
    want1 = [F.gelu(d(gate)) * torch.cat([d(i), d(c)], -1)]
    want2 = [torch.cat([d(a), d(b)], 1) * d(s) + 1.0, torch.relu(torch.cat([d(a), d(b)], 1))]
    mv = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    return [(p1, mv([gate, i, c]), want1, [gate, i, c]), (p2, mv([a, b, s]), want2, [a, b, s])]


def test_catin_parses_evaluates_and_validates():
    p, ins, want, _ = _cat_cases("cpu", torch.float64)[1]
    assert parse(p.source).source == p.source and "catin 1 0 1" in p.source and p.concatenates
    for o, w in zip(evaluate(p, ins), want):
        torch.testing.assert_close(o.double(), w)
    with pytest.raises(ProgramError, match="read elsewhere"):
        parse("%0 = catin 0 0 1\n%1 = input 1\n%2 = add %0 %1\nout %2 f32\n")
    with pytest.raises(ProgramError, match="differ off that dim"):
        evaluate("%0 = catin 1 0 1\nout %0 f32\n", [torch.randn(2, 3), torch.randn(3, 3)])
    with pytest.raises(ProgramError, match="no generated backward"):
        from graphopt.cuda_ext.pointwise_grad import backward_program

        backward_program(p.source, (torch.float32,) * 3, (True,) * 3, (True, True))


def _check_cat(device: str):
    for p, ins, want, eager_ins in _cat_cases(device):
        outs = _run_triton(p.source, ins) if device == "cpu" else ce.fused_pointwise(p, ins)
        eager = evaluate(p, eager_ins)
        ref_outs = reference.fused_pointwise(p.source, [t.cpu() for t in ins])
        for o, w, e, ro in zip(outs, want, eager, ref_outs):
            assert o.shape == w.shape and o.stride() == ro.stride()  # the pieces' layout (channels_last in, out)
            check(o.cpu(), w, e, dtype=torch.bfloat16)


def test_catin_in_the_generated_kernel(triton_interpreter):
    """Each piece read through its own strides in its range of the concatenated dim, which stays a
    dim of its own while the others coalesce; a channels_last concatenation runs in its memory order."""
    _check_cat("cpu")
    _, strides, kept = pwt.coalesce_keeping([2, 5, 6, 8], [[240, 48, 8, 1]], keep=3)
    assert kept == 1 and strides == [[8, 1]]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_catin_cuda():
    poison_allocator("cuda")
    _check_cat("cuda")


def _row_major_case(device):
    """Inputs that agree on a permuted dense order (the factors of an attention output, transposed
    heads-first): by default the output takes their order; with ``layout row_major`` it is row-major."""
    p = Program()
    a, b, c = p.input(), p.input(), p.input()
    p.output(a * 0.3 + c * b, "f32")
    a_, b_ = (torch.randn(2, 4, 10, 8, device=device).transpose(1, 2) for _ in range(2))
    return p, [a_, b_, torch.randn(8, device=device)]


def _check_row_major(run, device):
    p, ins = _row_major_case(device)
    want = ins[0] * 0.3 + ins[2] * ins[1]
    (default,) = run(p.source, ins)
    assert not default.is_contiguous()  # the inputs' order
    rm = parse(p.source + "layout row_major\n")
    assert rm.row_major and parse(rm.source).row_major and not p.row_major
    (out,) = run(rm.source, ins)
    assert out.is_contiguous()
    torch.testing.assert_close(out, want)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        (fake,) = torch.ops.graphopt.fused_pointwise(rm.source, [mode.from_tensor(t) for t in ins])
    assert fake.stride() == out.stride()


def test_row_major_layout_line():
    _check_row_major(reference.fused_pointwise, "cpu")


def test_row_major_layout_in_the_triton_kernel(triton_interpreter):
    _check_row_major(_run_triton, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_row_major_layout_cuda():
    poison_allocator("cuda")
    _check_row_major(lambda s, ins: torch.ops.graphopt.fused_pointwise(s, ins), "cuda")


def test_an_expanded_operand_has_no_say_in_the_output_layout():
    """A layer scale expanded to the full shape (stride 0 but along channels) beside channels_last
    operands: the output stays channels_last, as with the unexpanded [C, 1, 1] scale."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = Program()
    g, y, r = p.input(), p.input(), p.input()
    p.output(r + g * y, "f32")
    y_ = torch.randn(2, 5, 6, 16).permute(0, 3, 1, 2)  # NHWC values seen as NCHW: channels_last strides
    r_ = torch.randn(2, 16, 5, 6).contiguous(memory_format=torch.channels_last)
    g_ = torch.randn(16)[None, :, None, None].expand(2, 16, 5, 6)
    (out,) = reference.fused_pointwise(p.source, [g_, y_, r_])
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, r_ + g_ * y_)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        (fake,) = torch.ops.graphopt.fused_pointwise(p.source, [mode.from_tensor(t) for t in (g_, y_, r_)])
    assert fake.stride() == out.stride()


# ---------------------------------------------------------------------------------- rows along any dim


def _reduce_dim_cases(device: str):
    """(program, inputs): a softmax over the tokens of [B, heads, tokens, dim] read through the
    permute of a qkv projection (the row strided, adjacent rows contiguous: looped, and short enough for
    one tile); a channel mean and variance of an NCHW and a channels_last tensor with a per-channel
    affine after it; a row longer than MAX_ROW."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    cases = []
    for tokens in (300, 37):
        qkv = r(2, tokens, 3, 4, 8).permute(2, 0, 3, 1, 4)  # [3, B, heads, tokens, dim]
        p = Program(reduce_dim=2)
        k = p.input(0) * 1.5
        e = p.exp(k - p.rmax(k))
        p.output(e / p.rsum(e), torch.bfloat16)
        cases.append((p, [qkv[1]]))
    for cl in (False, True):
        x = r(2, 24, 5, 7)
        x = x.to(memory_format=torch.channels_last) if cl else x
        w = r(24, 1, 1)
        p = Program(reduce_dim=1)
        v = p.input(0)
        d = v - p.rsum(v) * (1 / 24)
        var = p.rsum(d * d) * (1 / 24)
        p.output(d * p.rsqrt(var + 1e-6) * p.input(1), torch.bfloat16)
        cases.append((p, [x, w]))
    p = Program()
    v = p.input(0)
    p.output(p.exp(v - p.rmax(v)) / p.rsum(p.exp(v - p.rmax(v))), torch.float32)
    cases.append((p, [r(3, 9000)]))
    return cases


def _check_reduce_dim(device: str, looped: bool = True):
    """``looped``: the cases whose kernel loops over the row too (runtime loop bounds)."""
    for p, ins in _reduce_dim_cases(device):
        p = parse(p.source)  # (the `reduce D` line round-trips)
        plan = pwt._make_plan(p, p.source, ins)
        if not looped and (plan.sub or plan).rows == "looped":
            continue
        outs = _run_triton(p.source, ins) if device == "cpu" else ce.fused_pointwise(p, ins)
        cpu = [t.cpu() for t in ins]
        ref64 = evaluate(p, [t.double() for t in cpu])
        eager = evaluate(p, cpu)
        for o, rf, e in zip(outs, ref64, eager):
            order = pw.dense_order(cpu, rf.shape, p)
            assert o.shape == rf.shape and (order is None) == o.is_contiguous(), (p.source, o.stride())
            check(o.cpu(), rf, e, dtype=torch.bfloat16)


def test_reduce_dim_evaluates_as_torch():
    x = torch.randn(2, 3, 11, 5, dtype=torch.float64)
    p = Program(reduce_dim=2)
    v = p.input(0)
    e = p.exp(v - p.rmax(v))
    p.output(e / p.rsum(e), "f64")
    assert torch.allclose(evaluate(parse(p.source), [x])[0], torch.softmax(x, 2))
    with pytest.raises(ProgramError, match="reduce D"):
        parse("%0 = input 0\n%1 = exp %0\nout %1 f32\nreduce 1\n")
    with pytest.raises(ValueError, match="`reduce 4` of an output of 2 dims"):
        pwt._make_plan(parse(p.source.replace("reduce 2", "reduce 4")), "", [torch.randn(3, 4)])


def test_reduce_dim_in_the_generated_kernel(triton_interpreter):
    """Rows along a dim other than the last (strided and looped, and channels in either memory
    format) and a row over MAX_ROW, in the generated kernel; outputs laid out as the inputs are. (The
    looped kernels' runtime loop bounds need triton >= 3.7's interpreter; the cuda test runs them on
    3.6, the H200 image's.)"""
    import triton

    _check_reduce_dim("cpu", looped=tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_reduce_dim_cuda():
    poison_allocator("cuda")
    _check_reduce_dim("cuda")


def test_row_tiles_of_widths_with_one_vector_share_a_kernel():
    """The row tiles take the width as WV * VEC (VEC a compile-time power of two up to a 16-byte access): a
    program over rows of 336 and of 440 bf16 elements (both VEC 8, tiles of 512) launches one compiled kernel
    with the same compile-time arguments; rows of 150 get VEC 2."""
    from graphopt.cuda_ext import pointwise_triton as pwt

    p = parse("%0 = input 0\n%1 = rmax %0\n%2 = sub %0 %1\n%3 = exp %2\n%4 = rsum %3\n%5 = div %3 %4\nout %5 bf16")
    plans = {w: pwt._make_plan(p, p.source, [torch.randn(64, w, dtype=torch.bfloat16)]) for w in (336, 440, 150)}
    const = lambda pl: {k: v for k, v in pl.meta.items() if k != "WV"}  # noqa: E731
    assert plans[336].kern is plans[440].kern and const(plans[336]) == const(plans[440])
    assert (plans[336].meta["VEC"], plans[336].meta["WV"], plans[440].meta["WV"]) == (8, 42, 55)
    assert plans[150].meta["VEC"] == 2 and plans[150].meta["WV"] == 75
