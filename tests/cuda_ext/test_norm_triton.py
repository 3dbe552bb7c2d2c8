"""graphopt::layer_norm's Triton kernel (many rows per program): on the CPU through Triton's
interpreter, on the GPU when marked cuda; against the fp64 reference."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.cuda_ext import norm_triton, reference
from tests.helpers import run_in_triton_interpreter, same_when_graphed


def _check(y, x, w, b, eps, dtype):
    ref = F.layer_norm(x.double(), x.shape[-1:], None if w is None else w.double(), None if b is None else b.double(),
                       eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def interpreter_cases():
    """Every CPU case through Triton's interpreter (run in a fresh process: the interpreter must
    be on before triton is imported for tl.sum and the other library functions to work)."""
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (1, 7, 96, 200):
            torch.manual_seed(hidden)
            x = (torch.randn(37, hidden) * 3 + 1).to(dtype)  # 37 rows: the last program is partial
            w, b = torch.randn(hidden), torch.randn(hidden)
            _check(norm_triton.layer_norm_triton(x, w, b, 1e-6), x, w, b, 1e-6, dtype)
            _check(norm_triton.layer_norm_triton(x, None, None, 1e-5), x, None, None, 1e-5, dtype)
    x = torch.randn(4, 96, 5).transpose(1, 2)  # a permuted view, as ConvNeXt's NHWC LayerNorm reads
    _check(norm_triton.layer_norm_triton(x, None, None, 1e-6), x, None, None, 1e-6, torch.float32)
    print("interpreter cases ok")


def _check_sandwich(y, r, wy, w, dtype):
    out, h = norm_triton.rms_norm_add_rms_norm_triton(y, r, wy, w, 1e-6, 1e-5)
    ref_out, ref_h = reference.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == y.shape
    # rsqrt against 1/sqrt can move a 16-bit rounding by one step, and h's step carries into out: a
    # tolerance of about two steps at the values' size (|h| < 8, |out| < 16 here)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 6.25e-2)
    torch.testing.assert_close(h.double(), ref_h.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=rtol, atol=2 * atol)


def interpreter_sandwich_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (1, 7, 96, 200):
            torch.manual_seed(hidden)
            y, r = torch.randn(37, hidden).to(dtype), torch.randn(37, hidden).to(dtype)
            _check_sandwich(y, r, torch.randn(hidden), torch.randn(hidden).to(dtype), dtype)
    y = torch.randn(3, 5, 64)
    _check_sandwich(y, torch.randn(1, 5, 64), torch.randn(64), torch.randn(64), torch.float32)  # a broadcast residual
    print("interpreter cases ok")


def test_rms_norm_add_rms_norm_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_norm_triton:interpreter_sandwich_cases")


def test_layer_norm_rows_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_norm_triton:interpreter_cases")


def test_rows_whose_bytes_are_not_a_multiple_of_16_are_priced_at_the_measured_unvectorized_rate():
    """The many-rows kernel compiles the row width in; its accesses are 128-bit where 16 divides a row's
    bytes and narrower where not (diag_ln_rows_ptx): graphopt::layer_norm and add_layer_norm_rows over bf16
    rows of 150 cost their bytes at op_efficiency["ln_rows_unaligned"] of the copy rate, rows of 152
    (CoaT-Tiny's, 304 bytes) at the copy rate; a CPU profile is unchanged."""
    from graphopt import capture
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.cost.ops import OpCost

    prof = get_profile("h200")[0]
    scale = prof.efficiency("ln_rows_unaligned", "memory_scale")
    assert scale is not None and scale < 1

    class M(torch.nn.Module):
        def forward(self, x, r):
            return torch.ops.graphopt.add_layer_norm_rows(x, r, None, None, 1e-5)[0], \
                torch.ops.graphopt.layer_norm(x, None, None, 1e-5)

    times = {}
    for width in (150, 152):
        x = torch.randn(64, 100, width, dtype=torch.bfloat16)
        gm = capture(M(), (x, x.clone()))
        nodes = [n for n in gm.graph.nodes if str(n.target).startswith("graphopt.")]
        cm = CostModel(prof)
        times[width] = [(cm.node_cost(n).memory_s, cm.node_cost(n).bytes) for n in nodes]
    for (m150, b150), (m152, b152) in zip(times[150], times[152]):
        assert m150 / b150 == pytest.approx(m152 / b152 / scale, rel=1e-6)
    cpu = get_profile("cpu")[0]
    assert norm_triton.rows_cost(OpCost(1, 1), 150, 2, cpu).slowdown == 1.0
    assert norm_triton.rows_cost(OpCost(1, 1), 150, 2, prof).slowdown == pytest.approx(1 / scale)
    assert norm_triton.rows_cost(OpCost(1, 1), 150, 4, prof).slowdown == pytest.approx(1 / scale)  # 600 bytes
    assert norm_triton.rows_cost(OpCost(1, 1), 152, 4, prof).slowdown == 1.0


def test_row_widths_share_a_kernel_and_keep_their_128_bit_accesses():
    """The many-rows kernel takes the row width as (H // VEC) * VEC with VEC its largest power of two up to a
    16-byte access: widths of one block and VEC (RDNet's LayerNorms over 336 and 440 channels) share one compiled
    kernel, and its sm_90 accesses are still 128-bit where a row's bytes are a multiple of 16 (CoaT's 152), 4-byte
    where not (150)."""
    from graphopt.cuda_ext.norm_triton import next_pow2, row_vec
    from tests.helpers import sm90_global_accesses

    assert [row_vec(h, 2) for h in (150, 152, 336, 440, 768)] == [2, 8, 8, 8, 8]
    assert row_vec(336, 4) == 4 and row_vec(7, 2) == 1
    assert (row_vec(336, 2), next_pow2(336)) == (row_vec(440, 2), next_pow2(440))  # one kernel for both widths

    def accesses(H):
        bh = next_pow2(H)
        values = {"S": 0, "HAS_BIAS": False, "HAS_X": True, "HAS_W": True, "HAS_B": True, "STORE_H": False,
                  "VEC": row_vec(H, 2), "ROWS": max(1, min(128, 8192 // bh)), "BLOCK_H": bh}
        return sm90_global_accesses(norm_triton._build(), values, ("P", "BIAS", "X", "W", "B", "OUT", "HOUT"),
                                    floats=("eps",))

    loads, stores = accesses(152)
    assert "ld.global.v4.b32" in loads and stores == {"st.global.v4.b32"}
    loads, stores = accesses(150)
    assert not any(".v4" in a for a in loads | stores)


def test_too_wide_rows_refused():
    with pytest.raises(ValueError, match="hidden size"):
        norm_triton.layer_norm_triton(torch.zeros(1, norm_triton.MAX_HIDDEN + 1), None, None, 1e-5)


def test_reference_matches_torch():
    x = torch.randn(6, 33, dtype=torch.bfloat16)
    w = torch.randn(33)
    y = reference.layer_norm(x, w, None, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.layer_norm(x.float(), (33,), w, None, 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 192, 384, 768, 1000, 4096])
def test_layer_norm_op_on_gpu(dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(3, 57, hidden, device="cuda").to(dtype)
    w, b = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    _check(torch.ops.graphopt.layer_norm(x, w, b, 1e-6), x, w, b, 1e-6, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 1000, 4096, 8192])
def test_rms_norm_add_rms_norm_op_on_gpu(dtype, hidden):
    torch.manual_seed(0)
    y, r = torch.randn(3, 57, hidden, device="cuda").to(dtype), torch.randn(3, 57, hidden, device="cuda").to(dtype)
    _check_sandwich(y, r, torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda").to(dtype), dtype)
    # the op (what the pass emits) gives the kernel's result, also replayed from a CUDA graph
    wy, w = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda").to(dtype)
    same_when_graphed(lambda: torch.ops.graphopt.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5))


def _linear_ln_case(M, N, K, dtype, device="cpu", residual=True, affine=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    x = r(1, M, K).to(dtype)
    w = r(N, K, scale=K ** -0.5).to(dtype)
    return (x, w, r(N).to(dtype) if bias else None, r(1, M, N).to(dtype) if residual else None,
            r(N) * 0.1 + 1 if affine else None, r(N) * 0.1 if affine else None)


def _check_linear_ln(args, splits, dtype):
    out, h = norm_triton.linear_add_layer_norm_triton(*args, 1e-12, splits)
    x, w, b, res, lw, lb = args
    d = [t.double() if t is not None else None for t in args]
    h64 = F.linear(d[0], d[1], d[2]) + (d[3] if res is not None else 0)
    ref = F.layer_norm(h64, (w.shape[0],), d[4], d[5], 1e-12)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == (*x.shape[:-1], w.shape[0])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(h.double(), h64, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=2 * tol)
    # the op's reference gives the same (its one rounding of h is the kernel's)
    ref_out, ref_h = reference.linear_add_layer_norm(*args, 1e-12, splits)
    torch.testing.assert_close(h, ref_h, rtol=tol, atol=tol)


def interpreter_split_k_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for M, N, K, splits in ((37, 48, 96, 3), (5, 200, 64, 2), (16, 64, 128, 1)):
            _check_linear_ln(_linear_ln_case(M, N, K, dtype), splits, dtype)
    # no bias, no residual, no affine parameters
    _check_linear_ln(_linear_ln_case(9, 32, 64, torch.float32, residual=False, affine=False, bias=False), 4,
                     torch.float32)
    print("interpreter cases ok")


def test_linear_add_layer_norm_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_norm_triton:interpreter_split_k_cases")


def test_split_k_refusals():
    x, w = torch.zeros(4, 96), torch.zeros(8, 96)
    assert norm_triton.split_k_supported(x, w, 6) is None
    assert "do not divide" in norm_triton.split_k_supported(x, w, 5)
    assert "dtypes" in norm_triton.split_k_supported(x.double(), w.double(), 2)
    assert "shapes" in norm_triton.split_k_supported(x, torch.zeros(8, 64), 2)
    assert "wider" in norm_triton.split_k_supported(torch.zeros(1, 2), torch.zeros(norm_triton.MAX_HIDDEN + 1, 2), 1)
    with pytest.raises(ValueError, match="do not divide"):
        norm_triton.linear_add_layer_norm_triton(x, w, None, None, None, None, 1e-5, 5)
    with pytest.raises(ValueError, match="does not divide"):
        reference.linear_add_layer_norm(x, w, None, None, None, None, 1e-5, 5)


def test_linear_add_layer_norm_reference_rounds_once():
    """The reference adds the projection to the residual before rounding: in bf16 it is closer
    to float64 than linear -> add_layer_norm's two roundings, never farther than one step."""
    x, w, b, res, lw, lb = _linear_ln_case(64, 96, 384, torch.bfloat16, seed=3)
    out, h = reference.linear_add_layer_norm(x, w, b, res, lw, lb, 1e-5, 4)
    h64 = F.linear(x.double(), w.double(), b.double()) + res.double()
    two = reference.add_layer_norm(F.linear(x, w, b), res, lw, lb, 1e-5)[1]
    assert (h.double() - h64).abs().max() <= (two.double() - h64).abs().max()
    assert (h.double() - h64).abs().max() <= h64.abs().max() * 2 ** -8


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 768, 3072, 6), (197, 768, 3072, 4), (50, 1000, 512, 2), (1, 64, 64, 1)])
def test_linear_add_layer_norm_op_on_gpu(dtype, shape):
    M, N, K, splits = shape
    args = _linear_ln_case(M, N, K, dtype, device="cuda")
    _check_linear_ln(args, splits, dtype)
    same_when_graphed(lambda: torch.ops.graphopt.linear_add_layer_norm(*args, 1e-12, splits))


def _check_add(x, r, w, b, eps, dtype):
    out, h = norm_triton.add_layer_norm_triton(x, r, w, b, eps)
    ref_out, ref_h = reference.add_layer_norm(*(t.double() if t is not None else None for t in (x, r, w, b)), eps)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(h.double(), ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=2 * tol)
    if x.is_cuda:  # h is rounded once, as eager's add of the two (the interpreter's fp32 -> 16-bit rounding differs)
        assert torch.equal(h, (x + r.to(dtype)) if r is not None else x.contiguous())


def interpreter_add_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (1, 7, 96, 200):
            torch.manual_seed(hidden)
            x, r = (torch.randn(37, hidden) * 3 + 1).to(dtype), torch.randn(37, hidden).to(dtype)
            _check_add(x, r, torch.randn(hidden), torch.randn(hidden), 1e-6, dtype)
            _check_add(x, None, None, None, 1e-5, dtype)
            _check_add(x, r, None, torch.randn(hidden), 1e-5, dtype)
    x = torch.randn(4, 96, 5).transpose(1, 2)  # permuted views, as a conv net's channels-first stream reads
    _check_add(x, torch.randn(4, 96, 5).transpose(1, 2), None, None, 1e-6, torch.float32)
    _check_add(torch.randn(3, 5, 64), torch.randn(1, 5, 64), torch.randn(64), None, 1e-6, torch.float32)  # broadcast
    print("interpreter cases ok")


def test_add_layer_norm_rows_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_norm_triton:interpreter_add_cases")


def test_add_layer_norm_rows_refuses_too_wide_rows():
    from graphopt.errors import KernelArgumentError

    from graphopt.cuda_ext.ops.add_layer_norm_rows import add_layer_norm_rows

    with pytest.raises(KernelArgumentError, match="wider than"):
        add_layer_norm_rows(torch.zeros(1, norm_triton.MAX_HIDDEN + 1), None, None, None, 1e-5)


def test_add_layer_norm_rows_op_on_the_cpu():
    from kx_conformance import check_op

    x, r = torch.randn(4, 9, 96, dtype=torch.bfloat16), torch.randn(4, 9, 96, dtype=torch.bfloat16)
    w = torch.randn(96)
    out, h = torch.ops.graphopt.add_layer_norm_rows(x, r, w, None, 1e-6)
    ref_out, ref_h = torch.ops.graphopt.add_layer_norm(x, r, w, None, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(h, ref_h)  # the same reference on the CPU
    check_op("add_layer_norm_rows", (x, r, w, None, 1e-6))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96, 195, 768, 4096])
def test_add_layer_norm_rows_op_on_gpu(dtype, hidden):
    from kx_conformance import check_op

    torch.manual_seed(0)
    x, r = torch.randn(3, 57, hidden, device="cuda").to(dtype), torch.randn(3, 57, hidden, device="cuda").to(dtype)
    w, b = torch.randn(hidden, device="cuda").to(dtype), torch.randn(hidden, device="cuda").to(dtype)
    _check_add(x, r, w, b, 1e-6, dtype)
    out, h = torch.ops.graphopt.add_layer_norm_rows(x, r, w, b, 1e-6)
    out2, h2 = torch.ops.graphopt.add_layer_norm(x, r, w, b, 1e-6)
    assert torch.equal(h, h2)  # both round h once
    same_when_graphed(lambda: torch.ops.graphopt.add_layer_norm_rows(x, r, w, b, 1e-6))
    check_op("add_layer_norm_rows", (x, r, w, b, 1e-6))
