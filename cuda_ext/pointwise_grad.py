"""Symbolic differentiation of pointwise programs: the backward of ``graphopt::fused_pointwise``.

:func:`backward_program` turns a program P (inputs x_i, outputs y_j) into the program P' that
computes the input gradients dL/dx_i from the forward inputs and the output gradients g_j. P'
recomputes the forward values it needs (nothing but the forward inputs is saved) and then walks
the statements in reverse, accumulating each value's adjoint. Its outputs have the broadcast
shape; the caller sums each over the dims its input was broadcast along (``sum_to_size``).

Derivatives follow torch's (``tools/autograd/derivatives.yaml`` and the ATen backward kernels),
subgradients included: ``relu`` 0 at 0; ``maximum``/``minimum`` split the gradient in half at
ties; ``clamp`` passes it strictly inside its bounds, and at a bound where the running torch does
(torch 2.11 does, 2.14 does not: :func:`clamp_passes_at_bounds` asks torch once); ``abs`` is ``sgn`` (0 at 0);
``hardswish`` is 0 up to -3, ``x/3 + 1/2`` between, 1 from 3 on; ``pow`` with exponent 0 is 0.
``where`` and comparisons give no gradient to their condition or operands. ``cast``: the gradient
is rounded to the dtype its operand had in the eager graph (the dtype torch's ``_to_copy``
backward would return); elsewhere, as in the forward, values stay in the compute type.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .pointwise import COMPARE, DTYPE_NAMES, DTYPES, Program, ProgramError, Value, compute_dtype_for, parse, value_kinds


@dataclass(frozen=True)
class Backward:
    """P' and how to call it: ``inputs`` (forward input indices P' reads, in its input order),
    then ``grads`` (output indices whose gradients it reads); ``outputs[k]`` is the forward input
    index its k-th output is the gradient of. ``source`` is None when no gradient flows."""

    source: str | None
    inputs: tuple[int, ...]
    grads: tuple[int, ...]
    outputs: tuple[int, ...]


def clamp_passes_at_bounds() -> tuple[bool, bool]:
    """Whether the running torch's ``clamp`` backward passes the gradient at its lower and at its
    upper bound (torch changed this convention between releases). Asked at import: a backward
    program may be derived where autograd is off (inside an autograd function's forward)."""
    return _CLAMP_AT_BOUNDS


def _ask_clamp_at_bounds() -> tuple[bool, bool]:
    x = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        y = torch.cat([torch.clamp(x[:1], 0.0, 1.0), torch.clamp(x[1:], -1.0, 0.0)])
        (g,) = torch.autograd.grad(y.sum(), x)
    return bool(g[0] == 1), bool(g[1] == 1)


_CLAMP_AT_BOUNDS = _ask_clamp_at_bounds()


def _eager_dtypes(p: Program, in_dtypes: Sequence[torch.dtype]) -> list[torch.dtype | None]:
    """The dtype each value has in the eager graph the program stands for (None: a weak
    constant, or an integer input), by torch's promotion rules."""
    out: list[torch.dtype | None] = []
    for s in p.stmts:
        a = [out[i] for i in s.args]
        if s.op == "input":
            d = in_dtypes[s.attrs[0]]
            out.append(d if d.is_floating_point or d == torch.bool else None)
        elif s.op == "const":
            out.append(None)
        elif s.op == "cast":
            out.append(DTYPES[s.attrs[0]])
        elif s.op in COMPARE:
            out.append(torch.bool)
        else:
            fl = [d for d in (a[1:] if s.op == "where" else a) if d is not None and d.is_floating_point]
            out.append(functools.reduce(torch.promote_types, fl) if fl else None)
    return out


def _prune(q: Program, n_fwd: int) -> tuple[Program, list[int]]:
    """Dead-code elimination and input renumbering: (program, old input index per new one)."""
    live = set(v for v, _ in q.outputs)
    for k in range(len(q.stmts) - 1, -1, -1):
        if k in live:
            live.update(q.stmts[k].args)
    used = sorted({q.stmts[k].attrs[0] for k in live if q.stmts[k].op == "input"})
    new_index = {old: new for new, old in enumerate(used)}
    r = Program()
    ids: dict[int, int] = {}
    for k, s in enumerate(q.stmts):
        if k not in live:
            continue
        attrs = (new_index[s.attrs[0]],) if s.op == "input" else s.attrs
        ids[k] = r._emit(s.op, tuple(ids[a] for a in s.args), attrs).id
    r.outputs = [(ids[v], d) for v, d in q.outputs]
    return r, used


@functools.lru_cache(maxsize=1024)
def backward_program(program: str, in_dtypes: tuple[torch.dtype, ...], needs: tuple[bool, ...],
                     grads: tuple[bool, ...]) -> Backward:
    """The backward of ``program`` run on inputs of ``in_dtypes``, for the inputs flagged in
    ``needs`` (non-floating ones are skipped) given gradients for the outputs flagged in ``grads``
    (bool outputs have none)."""
    p = parse(program)
    if not p.differentiable:
        raise ProgramError("a program with row reductions (rsum, rmax) or a catin has no generated backward")
    n = len(in_dtypes)
    ct = compute_dtype_for(in_dtypes)
    kinds = value_kinds(p, in_dtypes)
    edt = _eager_dtypes(p, in_dtypes)
    q = Program()
    v: list[Value] = []
    for s in p.stmts:  # the forward, recomputed (pruned to what the derivatives read below)
        v.append(q._emit(s.op, tuple(v[a].id for a in s.args), s.attrs))
    gin = {}
    for j, ((vid, dname), has) in enumerate(zip(p.outputs, grads)):
        if has and dname != "bool":
            gin[j] = q.input(n + len(gin))
    adj: dict[int, Value] = {}

    def acc(k: int, g: Value) -> None:
        if kinds[k] != "f":
            return
        adj[k] = g if k not in adj else adj[k] + g

    for j, g in gin.items():
        acc(p.outputs[j][0], g)
    for k in range(len(p.stmts) - 1, -1, -1):
        if k not in adj:
            continue
        s, g, y = p.stmts[k], adj[k], v[k]
        a = s.args
        x = [v[i] for i in a]
        op = s.op
        if op in ("input", "const") or op in COMPARE:
            continue
        if op == "add":
            acc(a[0], g), acc(a[1], g)
        elif op == "sub":
            acc(a[0], g), acc(a[1], -g)
        elif op == "mul":
            acc(a[0], g * x[1]), acc(a[1], g * x[0])
        elif op == "div":
            acc(a[0], g / x[1]), acc(a[1], -g * ((x[0] / x[1]) / x[1]))
        elif op in ("maximum", "minimum"):
            lose0 = q.lt(x[0], x[1]) if op == "maximum" else q.gt(x[0], x[1])
            lose1 = q.gt(x[0], x[1]) if op == "maximum" else q.lt(x[0], x[1])
            split = q.where(q.eq(x[0], x[1]), g * 0.5, g)
            acc(a[0], q.where(lose0, 0.0, split)), acc(a[1], q.where(lose1, 0.0, split))
        elif op == "neg":
            acc(a[0], -g)
        elif op == "abs":
            acc(a[0], q.where(q.gt(x[0], 0.0), g, q.where(q.lt(x[0], 0.0), -g, 0.0)))
        elif op == "exp":
            acc(a[0], g * y)
        elif op == "log":
            acc(a[0], g / x[0])
        elif op == "sqrt":
            acc(a[0], g / (2.0 * y))
        elif op == "rsqrt":
            acc(a[0], -0.5 * g * (y * y * y))
        elif op == "tanh":
            acc(a[0], g * (1.0 - y * y))
        elif op == "sigmoid":
            acc(a[0], g * ((1.0 - y) * y))
        elif op == "relu":
            acc(a[0], q.where(q.le(y, 0.0), 0.0, g))
        elif op == "erf":
            acc(a[0], g * (2.0 / math.sqrt(math.pi) * q.exp(-(x[0] * x[0]))))
        elif op == "cos":
            acc(a[0], -(g * q.sin(x[0])))
        elif op == "sin":
            acc(a[0], g * q.cos(x[0]))
        elif op == "gelu":  # ATen GeluBackward, approximate='none'
            cdf = 0.5 * (1.0 + q.erf(x[0] * math.sqrt(0.5)))
            pdf = q.exp(-0.5 * (x[0] * x[0])) * (0.5 * (2.0 / math.sqrt(math.pi)) * math.sqrt(0.5))
            acc(a[0], g * (cdf + x[0] * pdf))
        elif op == "gelu_tanh":  # ATen GeluBackward, approximate='tanh'
            beta, kappa = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, 0.044715
            x2 = x[0] * x[0]
            t = q.tanh(beta * (x[0] + kappa * (x2 * x[0])))
            d = 0.5 * (1.0 + t) + (0.5 * x[0]) * (1.0 - t * t) * (beta * (1.0 + 3.0 * kappa * x2))
            acc(a[0], g * d)
        elif op == "silu":  # ATen silu_backward
            sg = q.sigmoid(x[0])
            acc(a[0], g * (sg * (1.0 + x[0] * (1.0 - sg))))
        elif op == "hardswish":  # ATen hardswish_backward
            acc(a[0], q.where(q.le(x[0], -3.0), 0.0, q.where(q.lt(x[0], 3.0), g * (x[0] / 3.0 + 0.5), g)))
        elif op == "pow":
            e = s.attrs[0]
            if e != 0.0:
                acc(a[0], g * (e * q.pow(x[0], e - 1.0)))
            else:  # torch: zeros (not no gradient), also where g is inf or NaN; zeros of g's shape
                acc(a[0], q.where(q.eq(g, g), 0.0, 0.0))
        elif op == "clamp":
            lo, hi = s.attrs
            at_lo, at_hi = clamp_passes_at_bounds()
            inside = None
            if lo is not None:
                inside = q.ge(x[0], lo) if at_lo else q.gt(x[0], lo)
            if hi is not None:
                below = q.le(x[0], hi) if at_hi else q.lt(x[0], hi)
                inside = below if inside is None else q.where(inside, below, inside)
            acc(a[0], g if inside is None else q.where(inside, g, 0.0))
        elif op == "where":
            acc(a[1], q.where(x[0], g, 0.0)), acc(a[2], q.where(x[0], 0.0, g))
        elif op == "cast":
            if s.attrs[0] != "bool":
                src = edt[a[0]]
                acc(a[0], q.cast(g, src) if src is not None and src.is_floating_point and src != ct else g)
        else:
            raise AssertionError(f"no derivative for {op}")
    outputs = []
    for i, d in enumerate(in_dtypes):
        if not (needs[i] and d.is_floating_point):
            continue
        terms = [adj[k] for k, s in enumerate(p.stmts) if s.op == "input" and s.attrs[0] == i and k in adj]
        if terms:
            q.output(functools.reduce(lambda x, y: x + y, terms), DTYPE_NAMES[d])
            outputs.append(i)
    if not outputs:
        return Backward(None, (), (), ())
    r, used = _prune(q, n)
    fwd = tuple(i for i in used if i < n)
    grad_of = {n + pos: j for pos, j in enumerate(gin)}
    return Backward(r.validate().source, fwd, tuple(grad_of[i] for i in used if i >= n), tuple(outputs))
