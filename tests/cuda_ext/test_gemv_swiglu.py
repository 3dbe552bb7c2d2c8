"""graphopt::gemv_swiglu: the gate and up projections and silu(gate) * up in one weight stream; the
Triton kernels under Triton's interpreter (unsplit and split, odd sizes, a merged weight and two
weights, x read through strides) against float64, the plan, the cost, the wrapper's refusals, fake
and opcheck; on the GPU in bf16 at decode shapes, and replayed from a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import gemv_triton as gt
from graphopt.cuda_ext.ops import gemv_swiglu as op
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter, skip_old_interpreter

# M, n (columns of the gate and of the up each), K, merged weight, config
CASES = [
    (1, 40, 100, True, {}),                                     # unsplit, n and K not block multiples
    (3, 130, 300, False, {"splits": 3, "block_k": 32}),         # three splits: the reduce kernel applies silu
    (16, 64, 1000, False, {"splits": 5, "block_n": 32, "block_k": 64}),
    (1, 257, 96, True, {"block_n": 32, "block_k": 16, "splits": 1}),
]


def _inputs(M, n, K, merged, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + M * 7 + n + K)
    x = torch.randn(M, 2 * K, generator=g)[:, ::2]  # strided along K
    w = torch.randn(2 * n, K, generator=g) / K ** 0.5
    w = w.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype)
    return (x, w, None) if merged else (x, w[:n].clone(), w[n:].clone())


def _expected(x, w, u):
    wg, wu = (w, u) if u is not None else w.chunk(2)
    xd = x.double()
    return F.silu(F.linear(xd, wg.double())) * F.linear(xd, wu.double())


def _check(y, x, w, u, tol):
    ref = _expected(x, w, u)
    assert y.shape == ref.shape and y.dtype == x.dtype and y.is_contiguous()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_reference_in_float64_for_both_weight_forms():
    x, w, u = _inputs(3, 20, 30, False, torch.float64)
    _check(op.reference(x, w, u), x, w, u, 1e-12)
    merged = torch.cat([w, u])
    y = op.reference(x.reshape(1, 3, 30), merged, None)
    assert y.shape == (1, 3, 20)
    _check(y.reshape(3, 20), x, merged, None, 1e-12)


def interpreter_cases():
    for M, n, K, merged, cfg in CASES:
        x, w, u = _inputs(M, n, K, merged, torch.float16)
        wg, wu = op.halves(w, u)
        _check(gt.gemv_swiglu_triton(x, wg, wu, **cfg), x, w, u, 5e-3)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_gemv_swiglu:interpreter_cases")


def test_plan_streams_the_plain_gemvs_rows_per_program():
    # Llama-3-8B's gate and up at bs1: 448 programs of 32 gate + 32 up rows, unsplit, 256-deep K blocks
    p = gt.plan_swiglu(1, 14336, 4096, 132)
    q = gt.plan(1, 2 * 14336, 4096, 132)
    assert p["BLOCK_N"] * 2 == q["BLOCK_N"] and p["splits"] == q["splits"] == 1 and p["BLOCK_K"] == 256
    assert p["programs"] == q["programs"] == 448
    small = gt.plan_swiglu(1, 1024, 4096, 132)  # 32 column blocks of both: split along K
    assert small["splits"] > 1 and small["programs"] == 32 * small["splits"]
    assert gt.plan_swiglu(1, 1024, 4096, 132, block_n=128)["BLOCK_N"] == 64


def test_cost_reads_both_weights_once_and_the_partials_when_split():
    import torch.fx as fx

    from graphopt.cost.ops import op_call
    from graphopt.cost.profiles import get_profile

    prof, _ = get_profile("h200")
    g = fx.Graph()
    x, w, u = g.placeholder("x"), g.placeholder("w"), g.placeholder("u")
    for node, shape in ((x, (1, 1, 4096)), (w, (1024, 4096)), (u, (1024, 4096))):
        node.meta["val"] = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    n = g.call_function(torch.ops.graphopt.gemv_swiglu.default, (x, w, u))
    n.meta["val"] = torch.empty(1, 1, 1024, dtype=torch.bfloat16, device="meta")
    s = gt.plan_swiglu(1, 1024, 4096, prof.sm_count or gt.SM_COUNT)["splits"]
    c = op.cost(op_call(n), prof)
    assert c.launches == 2 and c.flops == 2 * 2 * 1024 * 4096
    assert c.bytes == 2 * 1024 * 4096 * 2 + 4096 * 2 + 1024 * 2 + 2 * s * 2 * 1024 * 4
    assert c.efficiency == "gemv"
    assert op.cost(op_call(n), prof.with_efficiency("gemv", None)).efficiency == "small_m_linear"


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, u: (x, w[:, :5], u), "weight must be"),
    (lambda x, w, u: (x, w, u[:3]), "up_weight must be"),
    (lambda x, w, u: (x, w[:5], None), "even row count"),
    (lambda x, w, u: (torch.cat([x] * 9), w, u), "at most 16"),
    (lambda x, w, u: (x, w, u.half()), "one dtype"),
    (lambda x, w, u: (x.int(), w, u), "float32, float16 or bfloat16"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    x, w, u = _inputs(2, 20, 30, False, torch.float32)
    with pytest.raises(KernelArgumentError, match=match):
        ops.gemv_swiglu(*bad(x, w, u))


def test_conformance():
    from kx_conformance import check_op

    x, w, u = _inputs(2, 20, 30, False, torch.float32)
    check_op("gemv_swiglu", (x.reshape(2, 1, 30), w, u))
    check_op("gemv_swiglu", (x, torch.cat([w, u]), None))


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("n,K,merged", [(14336, 4096, False), (13696, 4096, True), (1000, 333, False)])
def test_kernel_on_gpu(M, n, K, merged):
    from conftest import poison_allocator

    x, w, u = _inputs(M, n, K, merged, torch.bfloat16, device="cuda")
    poison_allocator("cuda")
    y = ops.gemv_swiglu(x, w, u)
    _check(y, x, w, u, 3e-2)
    wg, wu = op.halves(w, u)
    eager = F.silu(F.linear(x, wg)) * F.linear(x, wu)  # what the model computes in bf16
    ref = _expected(x, w, u)
    assert (y.double() - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-3


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph():
    from tests.helpers import same_when_graphed

    x, w, _ = _inputs(1, 4096, 4096, True, torch.bfloat16, device="cuda")
    same_when_graphed(lambda: torch.ops.graphopt.gemv_swiglu(x, w, None))
