"""graphopt::strided_bmm: the reference is a float64 matmul; the Triton kernel under Triton's
interpreter (fp32/fp16; operands that are views of a fused qkv projection's output, transposed,
broadcast by a zero stride, one to three batch dims, sizes that are not tile multiples, K longer
than a tile; outputs contiguous and permuted) against float64; the gradient; the cost counts the
sectors strided rows touch; the wrapper's refusals; fake and opcheck; on the GPU the kernel in bf16
and replayed from a CUDA graph."""
import pytest
import torch

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import bmm_triton as kt
from graphopt.cuda_ext.ops import strided_bmm as op
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter, same_when_graphed, skip_old_interpreter


def _qkv(B, N, H, D, dtype, device="cpu", seed=0):
    """q, k, v as [B, H, N, D] views of one [B, N, 3, H, D] projection output (batch strides that do
    not fold)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(device=device, dtype=dtype)
    return (qkv[:, :, i].transpose(1, 2) for i in range(3))


def cases(dtype, device="cpu"):
    """(a, b, order) triples; the first two are CoaT's factorized attention (k^T v, then q @ kv)."""
    q, k, v = _qkv(2, 37, 3, 19, dtype, device)
    kv = torch.randn(2, 3, 19, 19).to(device=device, dtype=dtype)
    w = torch.randn(5, 7, 9).to(device=device, dtype=dtype)
    x = torch.randn(2, 4, 3, 7, 5).to(device=device, dtype=dtype)
    y = torch.randn(4, 5, 6).to(device=device, dtype=dtype)
    return [
        (k.transpose(-1, -2), v, []),                              # [19, 37] x [37, 19] per head
        (q, kv, [0, 2, 1, 3]),                                     # written [B, N, H, D]: a head merge is a view
        (q, k.transpose(-1, -2), [3, 2, 1, 0]),                    # scores, fully reversed order
        (w, w.transpose(-1, -2)[:, :, :5].contiguous(), []),       # one batch dim, M 7, N 5, K 9
        (x.permute(0, 2, 1, 3, 4), y.expand(2, 3, 4, 5, 6), [0, 1, 2, 3, 4]),  # three batch dims, b broadcast
        (torch.randn(2, 3, 150, 70).to(device=device, dtype=dtype).transpose(-1, -2)[..., :33, :],
         torch.randn(2, 3, 150, 140).to(device=device, dtype=dtype)[..., 3:133], [1, 0, 2, 3]),  # K 150 over tiles
    ]


def _check(out, a, b, order, tol):
    want = a.double() @ b.double()
    assert out.dtype == a.dtype and out.shape == want.shape
    if order:
        assert out.permute(*order).is_contiguous()
    else:
        assert out.is_contiguous()
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("i", range(6))
def test_reference_is_matmul(i):
    a, b, order = cases(torch.float64)[i]
    _check(op.reference(a, b, order), a, b, order, 1e-12)


def interpreter_cases():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):  # (the interpreter's bf16 dot is not usable)
        for a, b, order in cases(dtype):
            out = torch.full_like(op._empty(a, b, order), float("nan"))
            _check(kt.bmm_triton(a, b, out), a, b, order, tol)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_strided_bmm:interpreter_cases")


def test_tiles_fit_the_matrices():
    assert kt.blocks(19, 19, 3137) == (32, 32, 64)
    assert kt.blocks(3137, 19, 19) == (128, 32, 32)
    assert kt.blocks(3, 5, 7) == (16, 16, 16)


def test_gradient_is_the_products_of_the_transposes():
    q, k, v = _qkv(2, 5, 2, 4, torch.float64)
    a, b = q.detach().clone().requires_grad_(), v.transpose(-1, -2).detach().clone().requires_grad_()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    g = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    torch.ops.graphopt.strided_bmm(a, b, [0, 2, 1, 3]).backward(g)  # (fp64: the op, past the wrapper)
    (a2 @ b2).backward(g)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_cost_counts_the_sectors_strided_rows_touch():
    """A head of 19 bf16 values (38 bytes) read from rows 912 bytes apart moves two sectors a row;
    a contiguous tensor moves its bytes rounded up to one sector."""
    assert op.sector_bytes((2, 3, 37, 19), (37 * 3 * 3 * 19, 19, 3 * 3 * 19, 1), 2) == 2 * 3 * 37 * 64
    assert op.sector_bytes((4, 16), (16, 1), 2) == 4 * 32
    assert op.sector_bytes((4, 16), (1, 4), 2) == 16 * 32  # the unit-stride dim is the first: 16 rows of 4
    assert op.sector_bytes((3, 5), (10, 2), 4) == 15 * 32   # no unit stride: an element a sector


@pytest.mark.parametrize("a_shape, b_shape, order, msg", [
    ((2, 3, 4), (2, 5, 6), [], "must be b's rows"),
    ((2, 3, 4), (3, 4, 6), [], "one batch shape"),
    ((3, 4), (4, 6), [], "1 to 3 batch dims"),
    ((2, 3, 4), (2, 4, 6), [0, 1], "permutation"),
])
def test_refusals(a_shape, b_shape, order, msg):
    with pytest.raises(KernelArgumentError, match=msg):
        ops.strided_bmm(torch.randn(a_shape), torch.randn(b_shape), order)


def test_fake_and_opcheck():
    a, b, order = op.example()
    with torch._subclasses.FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        out = torch.ops.graphopt.strided_bmm(fa, fb, order)
    assert out.shape == (2, 4, 6, 6) and out.permute(*order).is_contiguous()
    torch.library.opcheck(torch.ops.graphopt.strided_bmm.default, (a, b, order))


def test_conformance():
    from kx_conformance import check_op

    for a, b, order in cases(torch.float32)[:2]:
        check_op("strided_bmm", (a, b, order))


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(6))
def test_kernel_on_gpu_bf16(i):
    a, b, order = cases(torch.bfloat16, "cuda")[i]
    _check(ops.strided_bmm(a, b, order), a, b, order, 2e-2)


@pytest.mark.cuda
def test_coat_sizes_on_gpu_and_replayed():
    q, k, v = _qkv(64, 3137, 8, 19, torch.bfloat16, "cuda")
    kv = ops.strided_bmm(k.transpose(-1, -2), v, [])
    _check(kv, k.transpose(-1, -2), v, [], 3e-2)
    _check(ops.strided_bmm(q, kv, [0, 2, 1, 3]), q, kv, [0, 2, 1, 3], 3e-2)
    same_when_graphed(lambda: ops.strided_bmm(q, kv, [0, 2, 1, 3]))
