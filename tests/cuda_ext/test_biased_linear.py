"""graphopt::biased_linear (a linear layer whose bias gradient is ones @ grad): its forward
is aten's product, its gradients match torch's autograd of linear / addmm (float64: to rounding;
gradcheck), the wrapper's refusals, the op's conformance checks, and on the GPU its bf16 gradients
against float64 by the accuracy rule."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.errors import KernelArgumentError


def _grads(fn, *args):
    args = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*args)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.device, out.dtype)
    out.backward(g)
    return [out.detach()] + [a.grad for a in args]


@pytest.mark.parametrize("weight_t", [False, True])
def test_gradients_match_torch(weight_t):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64) if not weight_t else torch.randn(15, 8, dtype=torch.float64)
    w = torch.randn(8, 6, dtype=torch.float64) if weight_t else torch.randn(6, 8, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    ours = _grads(lambda x, w, b: torch.ops.graphopt.biased_linear(x, w, b, weight_t), x, w, b)
    ref = _grads((lambda x, w, b: torch.addmm(b, x, w)) if weight_t else F.linear, x, w, b)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w, b: torch.ops.graphopt.biased_linear(x, w, b, weight_t),
                                    [t.clone().requires_grad_() for t in (x, w, b)])


def test_only_the_gradients_asked_for():
    x, w, b = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True), torch.randn(6, requires_grad=True)
    torch.ops.graphopt.biased_linear(x, w, b, False).sum().backward()
    assert x.grad is None and w.grad.shape == (6, 8) and torch.allclose(b.grad, torch.full((6,), 4.0))


def test_wrapper_refuses():
    from graphopt.cuda_ext import biased_linear

    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    with pytest.raises(KernelArgumentError, match=r"weight must be \[N, K\]"):
        biased_linear(x, w.t(), b)
    with pytest.raises(KernelArgumentError, match=r"weight must be \[K, N\]"):
        biased_linear(x, w, b, weight_t=True)
    with pytest.raises(KernelArgumentError, match="bias must be 1-D of length 6"):
        biased_linear(x, w, torch.randn(5))
    with pytest.raises(KernelArgumentError, match="share a dtype"):
        biased_linear(x, w.half(), b)


def test_conformance():
    from kx_conformance import check_op

    check_op("biased_linear", (torch.randn(2, 3, 8), torch.randn(6, 8), torch.randn(6), False))
    check_op("biased_linear", (torch.randn(6, 8), torch.randn(8, 5), torch.randn(5), True))


@pytest.mark.cuda
@pytest.mark.parametrize("weight_t", [False, True])
def test_bf16_gradients_on_gpu(weight_t):
    from graphopt import accuracy

    torch.manual_seed(0)
    x = torch.randn(4096, 768, device="cuda")
    w = (torch.randn(768, 3072, device="cuda") if weight_t else torch.randn(3072, 768, device="cuda")) * 0.03
    b = torch.randn(3072, device="cuda")
    fn = lambda x, w, b: torch.ops.graphopt.biased_linear(x, w, b, weight_t)  # noqa: E731
    ref = (lambda x, w, b: torch.addmm(b, x, w)) if weight_t else F.linear
    ours = _grads(fn, *(t.bfloat16() for t in (x, w, b)))
    eager = _grads(ref, *(t.bfloat16() for t in (x, w, b)))
    gold = _grads(ref, *(t.double() for t in (x, w, b)))
    res = accuracy.check(ours, gold, eager, training=True)
    assert res.passed, res.reason


def test_bias_gradient_rows_of_every_length():
    """The ones vector is kept per row count: a longer, then a shorter gradient each sum all their rows."""
    w, b = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, dtype=torch.float64, requires_grad=True)
    for rows in (9, 4, 9):
        b.grad = None
        g = torch.randn(rows, 6, dtype=torch.float64)
        torch.ops.graphopt.biased_linear(torch.randn(rows, 8, dtype=torch.float64), w, b, False).backward(g)
        torch.testing.assert_close(b.grad, g.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
def test_ones_made_during_capture_are_not_kept():
    """A backward captured into a CUDA graph makes its ones vector there (the fill is recorded, not
    run): a later eager backward of the same length must not read that vector."""
    from graphopt.cuda_ext.ops import biased_linear as mod

    mod._ONES.clear()
    rows = 1237  # a length no other test uses
    x = torch.randn(rows, 64, device="cuda", requires_grad=True)
    w, b = torch.randn(32, 64, device="cuda"), torch.randn(32, device="cuda", requires_grad=True)
    g = torch.randn(rows, 32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        db, = torch.autograd.grad(torch.ops.graphopt.biased_linear(x, w, b, False), b, g)
    torch.cuda.current_stream().wait_stream(stream)
    b2 = b.detach().clone().requires_grad_()
    torch.ops.graphopt.biased_linear(x.detach(), w, b2, False).backward(g)
    torch.testing.assert_close(b2.grad, g.sum(0), rtol=1e-4, atol=1e-3)
    graph.replay()
    torch.testing.assert_close(db, g.sum(0), rtol=1e-4, atol=1e-3)
