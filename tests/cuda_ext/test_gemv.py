"""graphopt::gemv: the split-K Triton kernels under Triton's interpreter (fp16; one and several
splits, odd sizes, a bias, x read through strides) against float64, the plan's splits, the
wrapper's refusals, fake and opcheck; on the GPU in bf16 at decode shapes, and replayed from a
CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import gemv_triton as gt
from graphopt.cuda_ext.ops import gemv as op
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter, skip_old_interpreter

# M, N, K, bias, config
CASES = [
    (1, 40, 100, False, {}),                                   # one split, N and K not block multiples
    (3, 130, 300, True, {"splits": 3, "block_k": 32}),         # three splits of 128 (the last 44 deep)
    (16, 64, 1000, True, {"splits": 5, "block_n": 32, "block_k": 64}),
    (1, 257, 96, False, {"block_n": 32, "block_k": 16, "splits": 2}),
]


def _inputs(M, N, K, bias, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + M * 7 + N + K)
    x = torch.randn(M, 2 * K, generator=g)[:, ::2]  # strided along K
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(w), to(b)


def _check(y, x, w, b, tol):
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == ref.shape and y.dtype == x.dtype and y.is_contiguous()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_reference_is_linear_in_float64():
    x, w, b = _inputs(3, 20, 30, True, torch.float64)
    _check(op.reference(x.reshape(1, 3, 30), w, b).reshape(3, 20), x, w, b, 1e-12)


def interpreter_cases():
    for M, N, K, bias, cfg in CASES:
        x, w, b = _inputs(M, N, K, bias, torch.float16)
        _check(gt.gemv_triton(x, w, b, **cfg), x, w, b, 5e-3)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_gemv:interpreter_cases")


def test_plan_fills_the_sms_with_whole_k_blocks():
    # Llama-3-8B at bs1: the o projection (64 column blocks) splits K five ways, gate+up does not split
    p = gt.plan(1, 4096, 4096, 132)
    assert p["splits"] == 5 and p["k_per_split"] % p["BLOCK_K"] == 0 and p["splits"] * p["k_per_split"] >= 4096
    wide = gt.plan(1, 28672, 4096, 132)  # 448 column blocks: two programs per SM without a split
    assert wide["splits"] == 1 and wide["BLOCK_K"] == 256 and wide["num_stages"] == 3
    assert gt.plan(1, 28672, 4096, 132, splits=2)["BLOCK_K"] == 128  # split by hand: the usual depth
    assert gt.plan(1, 40, 100, 132, splits=8)["splits"] == 1  # no more splits than K blocks
    for M, N, K, _, cfg in CASES:
        q = gt.plan(M, N, K, 132, **cfg)
        assert (q["splits"] - 1) * q["k_per_split"] < K <= q["splits"] * q["k_per_split"]


def test_cost_adds_the_partials_when_k_is_split():
    import torch.fx as fx

    from graphopt.cost.ops import op_call
    from graphopt.cost.profiles import get_profile

    prof, _ = get_profile("h200")
    prof = prof.with_efficiency("gemv", None).with_efficiency("small_m_linear", None)  # unmeasured
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"] = torch.empty(1, 1, 4096, dtype=torch.bfloat16, device="meta")
    w.meta["val"] = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    n = g.call_function(torch.ops.graphopt.gemv.default, (x, w, None))
    n.meta["val"] = torch.empty(1, 1, 4096, dtype=torch.bfloat16, device="meta")
    c = op.cost(op_call(n), prof)
    assert c.launches == 2 and c.bytes == 4096 * 4096 * 2 + 2 * 4096 * 2 + 2 * 5 * 4096 * 4
    # priced as cuBLAS until measured, then at its own measured rate
    assert c.efficiency == "matmul"
    assert op.cost(op_call(n), prof.with_efficiency("small_m_linear", {"memory_scale": 0.8})).efficiency == \
        "small_m_linear"
    assert op.cost(op_call(n), prof.with_efficiency("gemv", {"memory_scale": 0.9})).efficiency == "gemv"


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, b: (x, w[:, :5], b), "weight must be"),
    (lambda x, w, b: (x, w, b[:3]), "bias must be"),
    (lambda x, w, b: (torch.cat([x] * 9), w, b), "at most 16"),
    (lambda x, w, b: (x, w.half(), b), "one dtype"),
    (lambda x, w, b: (x.int(), w, b), "float32, float16 or bfloat16"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    x, w, b = _inputs(2, 20, 30, True, torch.float32)
    with pytest.raises(KernelArgumentError, match=match):
        ops.gemv(*bad(x, w, b))


def test_conformance():
    from kx_conformance import check_op

    x, w, b = _inputs(2, 20, 30, True, torch.float32)
    check_op("gemv", (x.reshape(2, 1, 30), w, b))
    check_op("gemv", (x, w, None))


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (4608, 4096), (1000, 333)])
def test_kernel_on_gpu(M, N, K):
    from conftest import poison_allocator

    x, w, b = _inputs(M, N, K, N == 4608, torch.bfloat16, device="cuda")
    poison_allocator("cuda")
    y = ops.gemv(x, w, b)
    _check(y, x, w, b, 2e-2)
    cublas = F.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert (y.double() - ref).abs().max() <= 2 * (cublas.double() - ref).abs().max() + 1e-3


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph():
    from tests.helpers import same_when_graphed

    x, w, b = _inputs(1, 4096, 4096, True, torch.bfloat16, device="cuda")
    same_when_graphed(lambda: torch.ops.graphopt.gemv(x, w, b))
