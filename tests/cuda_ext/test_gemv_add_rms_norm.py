"""graphopt::gemv_add_rms_norm: the split GEMV whose second kernel adds the residual and
normalizes the row. The reference against float64 composition; the Triton kernels under the
interpreter (one and several splits, a bias, no residual, rows longer than one block) against the
reference's roundings; the wrapper's refusals, fake and opcheck; on the GPU at decode shapes
against cuBLAS + add_rms_norm, and replayed from a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import gemv_triton as gt
from graphopt.cuda_ext.ops import gemv_add_rms_norm as op
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter, skip_old_interpreter

# M, N, K, bias, residual, config
CASES = [
    (1, 40, 100, False, True, {}),                                  # one split: partials still go through memory
    (3, 130, 300, True, True, {"splits": 3, "block_k": 32}),
    # (the split kernel's 256 columns a program: the interpreter runs each program in Python, and at its
    # default 64 these two cases took 12.9 of the test's 14.3 s; the norm kernel's blocks are the point)
    (2, 5000, 64, False, True, {"splits": 2, "block_k": 32, "block_n": 256}),   # the row's partial sums in one block
    (1, 20000, 32, False, True, {"splits": 2, "block_k": 16, "block_n": 256}),  # a row over several blocks (two passes)
    (16, 64, 1000, True, False, {"splits": 5, "block_n": 32, "block_k": 64}),  # no residual
]


def _inputs(M, N, K, bias, residual, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + M * 7 + N + K)
    x = torch.randn(M, 2 * K, generator=g)[:, ::2]  # strided along K
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    r = torch.randn(M, N, generator=g) if residual else None
    nw = 1 + 0.1 * torch.randn(N, generator=g)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(w), to(b), to(r), to(nw)


def _f64(x, w, b, r, nw, eps=1e-6):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    h = F.linear(d(x), d(w), d(b)) + (0 if r is None else d(r))
    return d(nw) * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), h


def test_reference_is_linear_then_add_rms_norm():
    x, w, b, r, nw = _inputs(3, 20, 30, True, True, torch.float64)
    out, h = op.reference(x.reshape(1, 3, 30), w, b, r.reshape(1, 3, 20), nw, 1e-6)
    ref_out, ref_h = _f64(x, w, b, r, nw)
    torch.testing.assert_close(h.reshape(3, 20), ref_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.reshape(3, 20), ref_out, rtol=1e-12, atol=1e-12)
    # in bf16 it is exactly gemv's rounding followed by add_rms_norm's
    xb, wb, bb, rb, nb = (t.bfloat16() for t in (x, w, b, r, nw))
    got = op.reference(xb, wb, bb, rb, nb, 1e-6)
    want = ops.add_rms_norm(ops.gemv(xb, wb, bb), rb, nb, 1e-6)
    assert all(torch.equal(a, c) for a, c in zip(got, want))


def _pre_weight(N, dtype, device="cpu"):
    g = torch.Generator().manual_seed(N)
    return (1 + 0.1 * torch.randn(N, generator=g)).to(device=device, dtype=dtype)


def test_reference_with_a_pre_norm_is_linear_then_the_sandwich_norm():
    x, w, b, r, nw = _inputs(3, 20, 30, True, True, torch.float64)
    pw = _pre_weight(20, torch.float64)
    out, h = op.reference(x, w, b, r, nw, 1e-6, pw, 1e-5)
    y = F.linear(x, w, b)
    y = pw * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(h, (y + r), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, nw * (y + r) * torch.rsqrt((y + r).pow(2).mean(-1, keepdim=True) + 1e-6),
                               rtol=1e-12, atol=1e-12)
    # in bf16 it is exactly gemv's rounding followed by rms_norm_add_rms_norm's
    xb, wb, bb, rb, nb, pb = (t.bfloat16() for t in (x, w, b, r, nw, pw))
    got = op.reference(xb, wb, bb, rb, nb, 1e-6, pb, 1e-5)
    want = ops.rms_norm_add_rms_norm(ops.gemv(xb, wb, bb), rb, pb, nb, 1e-5, 1e-6)
    assert all(torch.equal(a, c) for a, c in zip(got, want))


def interpreter_cases():
    for M, N, K, bias, res, cfg in CASES:
        x, w, b, r, nw = _inputs(M, N, K, bias, res, torch.float16)
        for pw in (None, _pre_weight(N, torch.float16)):
            out, h = gt.gemv_add_rms_norm_triton(x, w, b, r, nw, 1e-6, pw, 1e-5, **cfg)
            ref_out, ref_h = op.reference(x, w, b, r, nw, 1e-6, pw, 1e-5)
            # the sum of the partials differs from the reference's fp32 sum by their order: an ulp of
            # h (with a pre-norm, an ulp of y carried through its norm)
            torch.testing.assert_close(h.float(), ref_h.float(), rtol=4e-3, atol=4e-3)
            torch.testing.assert_close(out.float(), ref_out.float(), rtol=8e-3, atol=8e-3)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_gemv_add_rms_norm:interpreter_cases")


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, b, r, nw: (x, w[:, :5], b, r, nw), "weight must be"),
    (lambda x, w, b, r, nw: (x, w, b[:3], r, nw), "bias must be"),
    (lambda x, w, b, r, nw: (x, w, b, r, nw[:3]), "norm_weight must have"),
    (lambda x, w, b, r, nw: (x, w, b, r[:, :3], nw), "does not broadcast"),
    (lambda x, w, b, r, nw: (torch.cat([x] * 9), w, b, torch.cat([r] * 9), nw), "at most 16"),
    (lambda x, w, b, r, nw: (x.int(), w, b, r, nw), "float32, float16 or bfloat16"),
    (lambda x, w, b, r, nw: (x, w, b, r, nw, 1e-6, nw[:3]), "pre_weight must have"),
    (lambda x, w, b, r, nw: (x, w, b, r, nw, 1e-6, nw.int()), "pre_weight is torch.int32"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    x, w, b, r, nw = _inputs(2, 20, 30, True, True, torch.float32)
    with pytest.raises(KernelArgumentError, match=match):
        ops.gemv_add_rms_norm(*bad(x, w, b, r, nw))


def test_conformance():
    from kx_conformance import check_op

    x, w, b, r, nw = _inputs(2, 20, 30, True, True, torch.float32)
    check_op("gemv_add_rms_norm", (x.reshape(2, 1, 30), w, b, r.reshape(2, 1, 20), nw, 1e-6))
    check_op("gemv_add_rms_norm", (x, w, None, None, nw, 1e-5))
    check_op("gemv_add_rms_norm", (x, w, b, r, nw, 1e-6, _pre_weight(20, torch.float32), 1e-5))


def test_cost_adds_the_norm_to_the_gemv():
    import torch.fx as fx

    from graphopt.cost.ops import op_call
    from graphopt.cost.profiles import get_profile
    from graphopt.cuda_ext.ops import gemv

    prof, _ = get_profile("h200")
    g = fx.Graph()
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    x, w, r, nw = (g.placeholder(n) for n in ("x", "w", "r", "nw"))
    for node, v in ((x, meta(1, 4096)), (w, meta(4096, 4096)), (r, meta(1, 4096)), (nw, meta(4096))):
        node.meta["val"] = v
    n = g.call_function(torch.ops.graphopt.gemv_add_rms_norm.default, (x, w, None, r, nw, 1e-6))
    n.meta["val"] = (meta(1, 4096), meta(1, 4096))
    plain = g.call_function(torch.ops.graphopt.gemv.default, (x, w, None))
    plain.meta["val"] = meta(1, 4096)
    c, cg = op.cost(op_call(n), prof), gemv.cost(op_call(plain), prof)
    assert c.launches == 2 and c.flops == cg.flops
    assert c.bytes == cg.bytes + 3 * 4096 * 2  # the residual read, h written, the norm weight read


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("N,K,bias,pre", [(4096, 4096, False, False), (4096, 14336, False, False),
                                          (1000, 333, True, False), (4096, 4096, False, True),
                                          (4096, 13696, False, True)])
def test_kernel_on_gpu(M, N, K, bias, pre):
    from conftest import poison_allocator

    x, w, b, r, nw = _inputs(M, N, K, bias, True, torch.bfloat16, device="cuda")
    pw = _pre_weight(N, torch.bfloat16, "cuda") if pre else None
    poison_allocator("cuda")
    out, h = ops.gemv_add_rms_norm(x, w, b, r, nw, 1e-6, pw, 1e-5)
    if pre:  # the fp64 reference of the sandwich: y normalized first
        y = F.linear(x.double(), w.double())
        y = pw.double() * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        ref_h = y + r.double()
        ref_out = nw.double() * ref_h * torch.rsqrt(ref_h.pow(2).mean(-1, keepdim=True) + 1e-6)
        eager_out, eager_h = ops.rms_norm_add_rms_norm(F.linear(x, w, b), r, pw, nw, 1e-5, 1e-6)
    else:
        ref_out, ref_h = _f64(x, w, b, r, nw)
        eager_out, eager_h = ops.add_rms_norm(F.linear(x, w, b), r, nw, 1e-6)
    for got, eager, ref in ((h, eager_h, ref_h), (out, eager_out, ref_out)):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert (got.double() - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-2


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph():
    from tests.helpers import same_when_graphed

    x, w, b, r, nw = _inputs(1, 4096, 4096, False, True, torch.bfloat16, device="cuda")
    same_when_graphed(lambda: torch.ops.graphopt.gemv_add_rms_norm(x, w, b, r, nw, 1e-6))
