"""Autograd of graphopt::fused_pointwise: the derived backward program (pointwise_grad) checked by
gradcheck in fp64 op by op and on random multi-op programs with broadcasting and several outputs,
torch's subgradient conventions at ties and bounds, what is saved, and the backward's generated
Triton kernel (interpreter here, GPU when marked cuda)."""
import random

import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext  # noqa: F401  (defines torch.ops.graphopt.*)
from graphopt.cuda_ext import pointwise_triton as pwt
from graphopt.cuda_ext.pointwise import UNARY, Program, evaluate
from graphopt.cuda_ext.pointwise_grad import backward_program

from kx_accuracy import check
from conftest import HAS_CUDA

F64 = torch.float64
POSITIVE = {"log", "sqrt", "rsqrt"}  # domains: gradcheck's inputs are shifted above 0


def run(p, *ins):
    return tuple(torch.ops.graphopt.fused_pointwise(p.source, list(ins)))


def leaf(*shape, lo=None):
    t = torch.randn(*shape, dtype=F64)
    if lo is not None:
        t = t.abs() + lo
    return t.requires_grad_()


def unary_program(op):
    p = Program()
    p.output(getattr(p, op)(p.input()), F64)
    return p


@pytest.mark.parametrize("op", UNARY)
def test_gradcheck_unary(op):
    x = leaf(3, 5, lo=0.2 if op in POSITIVE else None)
    assert torch.autograd.gradcheck(lambda x: run(unary_program(op), x), (x,))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum"])
def test_gradcheck_binary_with_broadcasting(op):
    p = Program()
    a, b = p.input(), p.input()
    p.output(getattr(p, op)(a, b), F64)
    x, y = leaf(3, 4), leaf(4, lo=0.5 if op == "div" else None)
    assert torch.autograd.gradcheck(lambda x, y: run(p, x, y), (x, y))
    assert torch.autograd.gradcheck(lambda x, y: run(p, y, x), (x, y))  # the broadcast one first


@pytest.mark.parametrize("e", [2.0, 3.0, 0.5, -1.5, 1.0, 0.0, -1.0])
def test_gradcheck_pow(e):
    p = Program()
    p.output(p.pow(p.input(), e), F64)
    assert torch.autograd.gradcheck(lambda x: run(p, x), (leaf(2, 6, lo=0.3),))


@pytest.mark.parametrize("lo,hi", [(-0.5, 0.5), (-0.3, None), (None, 0.2)])
def test_gradcheck_clamp(lo, hi):
    p = Program()
    p.output(p.clamp(p.input(), lo, hi), F64)
    assert torch.autograd.gradcheck(lambda x: run(p, x), (leaf(4, 7),))


def test_gradcheck_where_compare_and_casts():
    p = Program()
    x, y, m = p.input(), p.input(), p.input()
    c = p.where(m, x * y, p.where(p.gt(x, y), x, -y))          # condition input and a compare
    d = p.cast(p.cast(c, "f64") * 2.0, "f64") + p.cast(p.le(x, 0.0), "f64")  # a bool cast adds no gradient
    p.output(d, F64)
    p.output(p.lt(d, 0.0), torch.bool)
    mask = torch.rand(3, 1) > 0.5
    assert torch.autograd.gradcheck(lambda x, y: run(p, x, y, mask)[0], (leaf(3, 4), leaf(1, 4)))


def random_program(rng: random.Random, n_inputs: int, n_stmts: int, n_outputs: int) -> Program:
    """A random program over every differentiable op, domain-safe (log/sqrt/rsqrt/div/pow read a
    positive value), its outputs spread over the values it makes."""
    p = Program()
    vals = [p.input(i) for i in range(n_inputs)]

    def pos(v):
        return p.sigmoid(v) + 0.5

    for _ in range(n_stmts):
        a, b = rng.choice(vals), rng.choice(vals)
        kind = rng.randrange(6)
        if kind == 0:
            op = rng.choice([u for u in UNARY if u not in POSITIVE])
            v = getattr(p, op)(a)
        elif kind == 1:
            v = getattr(p, rng.choice(sorted(POSITIVE)))(pos(a))
        elif kind == 2:
            op = rng.choice(["add", "sub", "mul", "maximum", "minimum"])
            v = getattr(p, op)(a, b)
        elif kind == 3:
            v = a / pos(b) if rng.random() < 0.5 else p.pow(pos(a), rng.choice([2.0, -0.5, 1.5]))
        elif kind == 4:
            v = p.where(p.gt(a, b), a * 0.5, b) if rng.random() < 0.5 else p.clamp(a, -1.0, 1.5)
        else:
            v = p.cast(a, "f64") * 1.5 - b
        vals.append(v)
    made = vals[n_inputs:]
    for v in rng.sample(made, min(n_outputs, len(made))):
        p.output(v, F64)
    return p


@pytest.mark.parametrize("seed", range(6))
def test_gradcheck_random_programs(seed):
    rng = random.Random(seed)
    p = random_program(rng, 3, 10, rng.choice([1, 2, 3]))
    shapes = [(2, 3, 4), (3, 1), (4,)]
    rng.shuffle(shapes)
    ins = [leaf(*s) for s in shapes]
    assert torch.autograd.gradcheck(lambda *xs: run(p, *xs), tuple(ins)), p.source


def test_gradgradcheck_through_the_backward_program():
    p = Program()
    x, b = p.input(), p.input()
    p.output(p.gelu_tanh(x * b) + p.silu(b), F64)
    assert torch.autograd.gradgradcheck(lambda x, b: run(p, x, b), (leaf(3, 4), leaf(4)))


def _eager_vs_fused(p, eager, *values):
    xs = [torch.tensor(v, dtype=F64, requires_grad=True) for v in values]
    ys = [torch.tensor(v, dtype=F64, requires_grad=True) for v in values]
    eager(*xs).sum().backward()
    run(p, *ys)[0].sum().backward()
    for x, y in zip(xs, ys):
        assert torch.equal(x.grad, y.grad), (p.source, x.grad, y.grad)


def test_subgradients_at_ties_and_bounds_are_torchs():
    pts = [-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 2.0, float("nan")]
    for op, fn in [("relu", torch.relu), ("abs", torch.abs), ("hardswish", F.hardswish)]:
        _eager_vs_fused(unary_program(op), fn, pts)
    for op in ("maximum", "minimum"):
        p = Program()
        p.output(getattr(p, op)(p.input(), p.input()), F64)
        _eager_vs_fused(p, getattr(torch, op), [1.0, 2.0, -1.0, 0.0, float("nan")], [1.0, 1.0, 3.0, 0.0, 1.0])
    for lo, hi in [(-0.5, 0.5), (-0.5, None), (None, 0.5)]:
        p = Program()
        p.output(p.clamp(p.input(), lo, hi), F64)
        _eager_vs_fused(p, lambda x: torch.clamp(x, lo, hi), [-1.0, -0.5, 0.0, 0.5, 1.0, float("nan")])
    p = Program()
    p.output(p.pow(p.input(), 0.0), F64)
    _eager_vs_fused(p, lambda x: torch.pow(x, 0.0), [0.0, 2.0, -1.0])
    p = Program()
    p.output(p.pow(p.input(), 2.0), F64)
    _eager_vs_fused(p, lambda x: torch.pow(x, 2.0), [0.0, 2.0, -1.0])


def test_no_gradient_to_conditions_integers_or_unused_outputs():
    p = Program()
    x, m, k = p.input(), p.input(), p.input()
    y = p.where(m, x * k, 0.0)
    p.output(y, F64)
    p.output(p.exp(x), F64)
    xv, mask, ints = leaf(3, 4), torch.rand(3, 4) > 0.5, torch.randint(-3, 3, (4,))
    y0, _ = run(p, xv, mask, ints)
    (g,) = torch.autograd.grad(y0.sum(), xv)  # the exp output gets no gradient
    assert torch.equal(g, torch.where(mask, ints.to(F64).expand(3, 4), 0.0))
    # unused output: its gradient is left out of the backward program (exp is not recomputed)
    bw = backward_program(p.source, (F64, torch.bool, torch.int64), (True, False, False), (True, False))
    assert "exp" not in bw.source and bw.outputs == (0,)


def test_only_the_inputs_the_derivative_reads_are_saved():
    p = Program()
    a, b, c = p.input(), p.input(), p.input()
    p.output(a + b * c, F64)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    xs = [leaf(2, 3), leaf(2, 3), torch.randn(2, 3, dtype=F64)]  # c needs no gradient
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(p, *xs)[0]
    # d/da = g (nothing), d/db = g * c: c alone is saved, intermediates never
    assert len(saved) == 1 and saved[0] is xs[2]
    out.sum().backward()
    assert torch.equal(xs[1].grad, xs[2].expand(2, 3))


def test_cast_rounds_the_gradient_to_its_operands_dtype():
    """x (bf16) -> f32 math -> bf16 out: the input gradient is rounded where eager rounds it."""
    bf = torch.bfloat16
    p = Program()
    x = p.input()
    p.output(p.cast(p.silu(p.cast(x, "f32")) * 3.0, "bf16"), bf)
    xv = torch.randn(5, 64).to(bf).requires_grad_()
    g = torch.randn(5, 64).to(bf)
    (got,) = torch.autograd.grad(run(p, xv)[0], xv, g)
    x64 = xv.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad((F.silu(x64) * 3.0), x64, g.double())
    xe = xv.detach().requires_grad_()
    (eager,) = torch.autograd.grad((F.silu(xe.float()) * 3.0).to(bf), xe, g)
    assert got.dtype == bf
    check(got, ref, eager, dtype=bf)


def test_backward_program_runs_as_a_triton_kernel(triton_interpreter):
    """The backward program is an ordinary program: its generated kernel (interpreter) matches
    the evaluator, erf (gelu's derivative) included."""
    p = Program()
    x, b = p.input(), p.input()
    p.output(p.gelu(x + b) * p.tanh(b), torch.float32)
    p.output(p.maximum(x, 0.0), torch.float32)
    bw = backward_program(p.source, (torch.float32,) * 2, (True, True), (True, True))
    ins = [torch.randn(3, 33), torch.randn(33), torch.randn(3, 33), torch.randn(3, 33)]
    got = pwt.fused_pointwise_triton(bw.source, ins)
    ref64 = evaluate(bw.source, [t.double() for t in ins])
    eager = evaluate(bw.source, ins)
    for o, r, e in zip(got, ref64, eager):
        check(o, r, e, dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_on_cuda_against_fp64(dtype):
    p = Program()
    x, b, r = p.input(), p.input(), p.input()
    y = p.gelu_tanh(x + b) * p.sigmoid(r) + p.maximum(r, 0.0)
    p.output(y, dtype)
    p.output(p.silu(y), dtype)
    ins = [torch.randn(8, 4099, device="cuda"), torch.randn(4099, device="cuda"), torch.randn(8, 4099, device="cuda")]
    gs = [torch.randn(8, 4099, device="cuda").to(dtype) for _ in range(2)]

    def grads(ts, fn, cast):
        ts = [t.to(cast).detach().requires_grad_() for t in ts]
        return torch.autograd.grad(fn(*ts), ts, [g.to(cast) for g in gs])

    got = grads(ins, lambda *ts: run(p, *ts), dtype)
    ref = grads(ins, lambda *ts: evaluate(p, ts, torch.float64), torch.float64)
    eager = grads(ins, lambda *ts: evaluate(p, ts), dtype)
    for o, r, e in zip(got, ref, eager):
        check(o, r, e, dtype=dtype)
