"""The pointwise program language: the generic elementwise backend behind
``torch.ops.graphopt.fused_pointwise(program, inputs)``.

A *program* is a small SSA text, one statement per line (``;`` also separates statements,
``#`` starts a comment). Every statement defines one value ``%N``; values are numbered in
order from 0::

    %0 = input 0                # the tensor inputs[0]
    %1 = input 1
    %2 = const 0.044715         # a float literal (also inf, -inf, nan)
    %3 = add %0 %1
    %4 = gelu_tanh %3
    %5 = cast %4 bf16           # round through a dtype (reproduces an eager intermediate)
    %6 = clamp %5 -1 none       # clamp x lo hi, either bound may be `none`
    %7 = pow %6 2               # pow x <literal exponent>
    out %4 bf16                 # an output and the dtype it is stored in
    out %7 f32

Ops (arity): ``add sub mul div maximum minimum`` (2), ``neg abs exp log sqrt rsqrt tanh
sigmoid relu gelu gelu_tanh silu hardswish erf cos sin`` (1), ``eq ne lt le gt ge`` (2, give bool),
``where c a b`` (3; ``c`` is bool or nonzero), ``pow x p``, ``clamp x lo hi``, ``cast x dtype``,
``catin d i j ...`` (the inputs ``i j ...`` concatenated along their dim ``d``: a
concatenation read in place, never written; each of those inputs is read only there), and the row reductions ``rsum x`` and ``rmax x`` (1): the sum or the maximum of ``x`` over the
output's last dim (its *row*), one value per row, broadcast back along it (a softmax is
``e = exp(x - rmax x); e / rsum e``). A line ``reduce D`` makes the row the output's dim ``D``
instead (a softmax over the tokens of ``[B, heads, tokens, dim]``, a mean over the channels of
an NCHW or channels_last tensor). Dtypes: ``f64 f32 f16 bf16 bool``. Outputs: ``out %v dtype``
(one or more, in order).

Semantics: inputs broadcast against each other with numpy/torch rules (a ``catin``'s inputs as
their concatenation) and may have any strides; every output has the broadcast shape, dense in the memory order its
full-size inputs agree on (``dense_order``), else row-major; a line ``layout row_major`` makes
the outputs row-major whatever the inputs (a program that writes what a copy after it would). Floating inputs are
computed in fp32 (fp64 when any input is fp64); bool inputs are bool values (1.0/0.0 when
used in arithmetic); integer inputs are converted to the compute type. Constants are weak
(they never change the compute type). Rounding happens only at ``cast`` and at the output
store, so a fused chain is at least as accurate as the eager chain it replaces; put ``cast``
where the eager graph rounded if bit-closeness matters more.

Three ways to run a program, all giving the same function:

* :func:`evaluate` — plain torch, any device, fp64 capable (the reference and the CPU path);
* the CUDA implementation — Triton code generated from the program (``pointwise_triton``),
  compiled on first use and cached by program text + input dtypes + rank;
* ``torch.ops.graphopt.fused_pointwise(program.source, inputs)`` — dispatches to one of the above.

Build programs with :class:`Program`::

    p = Program()
    x, b = p.input(), p.input()
    y = p.gelu_tanh(x + b)              # operators: + - * / unary -, and numbers as constants
    p.output(y, torch.bfloat16)
    outs = p(x_tensor, b_tensor)        # runs torch.ops.graphopt.fused_pointwise(p.source, ...)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

UNARY = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "gelu_tanh",
         "silu", "hardswish", "erf", "cos", "sin")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
REDUCE = ("rsum", "rmax")  # over the output's last dim, broadcast back along it
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ProgramError(ValueError):
    """A pointwise program is malformed (the message names the line)."""


@dataclass(frozen=True)
class Stmt:
    op: str                       # input catin const cast pow clamp where <unary> <binary> <compare>
    args: tuple[int, ...] = ()    # value ids
    attrs: tuple = ()             # input index / literal / dtype name / (lo, hi)


def _fmt_num(v: float | None) -> str:
    if v is None:
        return "none"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(float(v))


def _parse_num(tok: str, where: str) -> float | None:
    if tok == "none":
        return None
    try:
        return float(tok)
    except ValueError:
        raise ProgramError(f"{where}: {tok!r} is not a number") from None


class Value:
    """A handle on one SSA value of a :class:`Program`; supports + - * / and unary -."""

    __slots__ = ("prog", "id")

    def __init__(self, prog: "Program", id: int):
        self.prog, self.id = prog, id

    def __repr__(self) -> str:
        return f"%{self.id}"

    def _bin(self, op, other, rev=False):
        o = self.prog._v(other)
        return self.prog._emit(op, (o.id, self.id) if rev else (self.id, o.id))

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __neg__(self): return self.prog._emit("neg", (self.id,))


Operand = Union[Value, float, int, bool]


@dataclass
class Program:
    """An SSA pointwise program. Build it with the methods below (each returns a :class:`Value`),
    or :func:`parse` its text. ``source`` is the canonical text, the key of the compile cache."""

    stmts: list[Stmt] = field(default_factory=list)
    outputs: list[tuple[int, str]] = field(default_factory=list)   # (value id, dtype name)
    row_major: bool = False  # `layout row_major`: outputs row-major whatever the inputs' layout
    reduce_dim: int | None = None  # `reduce D`: rsum/rmax over the output's dim D (None: the last)

    # -- building ------------------------------------------------------------------------
    def _emit(self, op: str, args: tuple[int, ...] = (), attrs: tuple = ()) -> Value:
        for a in args:
            if not 0 <= a < len(self.stmts):
                raise ProgramError(f"%{len(self.stmts)} = {op}: operand %{a} is not defined before it")
        self.stmts.append(Stmt(op, tuple(args), tuple(attrs)))
        return Value(self, len(self.stmts) - 1)

    def _v(self, x: Operand) -> Value:
        if isinstance(x, Value):
            if x.prog is not self:
                raise ProgramError("a value from another Program was used")
            return x
        if isinstance(x, (int, float, bool)):
            return self.const(float(x))
        raise TypeError(f"expected a Value or a number, got {type(x).__name__}")

    def input(self, index: int | None = None) -> Value:
        """The tensor ``inputs[index]`` (default: the next unused index)."""
        if index is None:
            index = self.num_inputs
        return self._emit("input", (), (int(index),))

    def catin(self, dim: int, indices: Sequence[int]) -> Value:
        """The tensors ``inputs[i]`` for i in ``indices`` concatenated along their dim ``dim``."""
        return self._emit("catin", (), (int(dim), tuple(int(i) for i in indices)))

    def const(self, value: float) -> Value:
        return self._emit("const", (), (float(value),))

    def cast(self, x: Operand, dtype: torch.dtype | str) -> Value:
        return self._emit("cast", (self._v(x).id,), (_dtype_name(dtype),))

    def pow(self, x: Operand, exponent: float) -> Value:
        return self._emit("pow", (self._v(x).id,), (float(exponent),))

    def clamp(self, x: Operand, lo: float | None = None, hi: float | None = None) -> Value:
        return self._emit("clamp", (self._v(x).id,), (None if lo is None else float(lo),
                                                        None if hi is None else float(hi)))

    def where(self, cond: Operand, a: Operand, b: Operand) -> Value:
        return self._emit("where", (self._v(cond).id, self._v(a).id, self._v(b).id))

    def output(self, x: Value, dtype: torch.dtype | str) -> None:
        """Declare ``x`` an output stored as ``dtype``."""
        self.outputs.append((self._v(x).id, _dtype_name(dtype)))

    def __getattr__(self, name: str):
        if name in UNARY or name in REDUCE:
            return lambda x: self._emit(name, (self._v(x).id,))
        if name in BINARY or name in COMPARE:
            return lambda a, b: self._emit(name, (self._v(a).id, self._v(b).id))
        raise AttributeError(name)

    # -- inspecting ----------------------------------------------------------------------
    @property
    def num_inputs(self) -> int:
        idx = self._input_reads()
        return max(idx) + 1 if idx else 0

    def _input_reads(self) -> list[int]:
        """Every input index read, once per read (``input`` and each ``catin`` piece)."""
        out: list[int] = []
        for s in self.stmts:
            if s.op == "input":
                out.append(s.attrs[0])
            elif s.op == "catin":
                out.extend(s.attrs[1])
        return out

    def cat_inputs(self) -> dict[int, int]:
        """input index -> the dim its catin concatenates along."""
        return {i: s.attrs[0] for s in self.stmts if s.op == "catin" for i in s.attrs[1]}

    @property
    def source(self) -> str:
        lines = []
        for i, s in enumerate(self.stmts):
            if s.op == "input":
                rhs = f"input {s.attrs[0]}"
            elif s.op == "catin":
                rhs = f"catin {s.attrs[0]} " + " ".join(str(i) for i in s.attrs[1])
            elif s.op == "const":
                rhs = f"const {_fmt_num(s.attrs[0])}"
            elif s.op == "cast":
                rhs = f"cast %{s.args[0]} {s.attrs[0]}"
            elif s.op == "pow":
                rhs = f"pow %{s.args[0]} {_fmt_num(s.attrs[0])}"
            elif s.op == "clamp":
                rhs = f"clamp %{s.args[0]} {_fmt_num(s.attrs[0])} {_fmt_num(s.attrs[1])}"
            else:
                rhs = s.op + "".join(f" %{a}" for a in s.args)
            lines.append(f"%{i} = {rhs}")
        lines += [f"out %{v} {d}" for v, d in self.outputs]
        if self.row_major:
            lines.append("layout row_major")
        if self.reduce_dim is not None:
            lines.append(f"reduce {self.reduce_dim}")
        return "\n".join(lines) + "\n"

    def row_dim(self, ndim: int) -> int:
        """The output dim the row reductions run along, for an output of ``ndim`` dims."""
        return ndim - 1 if self.reduce_dim is None else self.reduce_dim

    @property
    def reduces(self) -> bool:
        """The program reduces over rows (``rsum``/``rmax``): it runs row by row."""
        return any(s.op in REDUCE for s in self.stmts)

    @property
    def concatenates(self) -> bool:
        """The program reads a concatenation in place (``catin``)."""
        return any(s.op == "catin" for s in self.stmts)

    @property
    def differentiable(self) -> bool:
        """pointwise_grad generates its backward (none for row reductions or a catin)."""
        return not (self.reduces or self.concatenates)

    def output_dtypes(self) -> list[torch.dtype]:
        return [DTYPES[d] for _, d in self.outputs]

    def validate(self) -> "Program":
        if not self.outputs:
            raise ProgramError("the program has no `out` statement")
        reads = self._input_reads()
        missing = sorted(set(range(self.num_inputs)) - set(reads))
        if missing:
            raise ProgramError(f"inputs {missing} are never read (inputs are numbered 0..n-1)")
        pieces = [i for s in self.stmts if s.op == "catin" for i in s.attrs[1]]
        twice = sorted({i for i in pieces if reads.count(i) > 1})
        if twice:
            raise ProgramError(f"inputs {twice} of a catin are read elsewhere too (a catin's inputs are read only there)")
        if any(s.op == "catin" and (not s.attrs[1] or s.attrs[0] < 0) for s in self.stmts):
            raise ProgramError("a catin needs a dim >= 0 and at least one input")
        if self.reduces and self.concatenates:
            raise ProgramError("a program cannot both reduce rows and read a catin")
        if self.reduce_dim is not None and (self.reduce_dim < 0 or not self.reduces):
            raise ProgramError("`reduce D` needs D >= 0 and rsum/rmax in the program")
        return self

    def __str__(self) -> str:
        return self.source

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return torch.ops.graphopt.fused_pointwise(self.source, list(inputs))


def _dtype_name(d: torch.dtype | str) -> str:
    if isinstance(d, torch.dtype):
        if d not in DTYPE_NAMES:
            raise ProgramError(f"dtype {d} is not supported (f64 f32 f16 bf16 bool)")
        return DTYPE_NAMES[d]
    if d not in DTYPES:
        raise ProgramError(f"unknown dtype {d!r} (f64 f32 f16 bf16 bool)")
    return d


@functools.lru_cache(maxsize=1024)
def parse(text: str) -> Program:
    """Parse program text into a :class:`Program` (cached by text). Raises :class:`ProgramError`."""
    p = Program()
    for lineno, raw in enumerate(text.replace(";", "\n").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"pointwise program line {lineno} ({line!r})"
        toks = line.split()

        def ref(tok: str) -> int:
            if not tok.startswith("%") or not tok[1:].isdigit():
                raise ProgramError(f"{where}: expected a value like %3, got {tok!r}")
            v = int(tok[1:])
            if v >= len(p.stmts):
                raise ProgramError(f"{where}: %{v} is used before it is defined")
            return v

        if toks == ["layout", "row_major"]:
            p.row_major = True
            continue
        if toks[0] == "reduce":
            if len(toks) != 2 or not toks[1].isdigit():
                raise ProgramError(f"{where}: expected `reduce D` (a non-negative integer dim)")
            p.reduce_dim = int(toks[1])
            continue
        if toks[0] == "out":
            if len(toks) != 3:
                raise ProgramError(f"{where}: expected `out %v dtype`")
            p.outputs.append((ref(toks[1]), _dtype_name_checked(toks[2], where)))
            continue
        if len(toks) < 3 or toks[1] != "=":
            raise ProgramError(f"{where}: expected `%N = op args...` or `out %v dtype`")
        if toks[0] != f"%{len(p.stmts)}":
            raise ProgramError(f"{where}: values must be numbered in order; expected %{len(p.stmts)}")
        op, args = toks[2], toks[3:]

        def need(n: int) -> None:
            if len(args) != n:
                raise ProgramError(f"{where}: {op} takes {n} operand(s), got {len(args)}")

        if op == "input":
            need(1)
            if not args[0].isdigit():
                raise ProgramError(f"{where}: input index must be a non-negative integer")
            p.stmts.append(Stmt("input", (), (int(args[0]),)))
        elif op == "catin":
            if len(args) < 2 or not all(a.isdigit() for a in args):
                raise ProgramError(f"{where}: expected `catin dim input input ...` (non-negative integers)")
            p.stmts.append(Stmt("catin", (), (int(args[0]), tuple(int(a) for a in args[1:]))))
        elif op == "const":
            need(1)
            v = _parse_num(args[0], where)
            if v is None:
                raise ProgramError(f"{where}: const needs a number")
            p.stmts.append(Stmt("const", (), (v,)))
        elif op == "cast":
            need(2)
            p.stmts.append(Stmt("cast", (ref(args[0]),), (_dtype_name_checked(args[1], where),)))
        elif op == "pow":
            need(2)
            e = _parse_num(args[1], where)
            if e is None:
                raise ProgramError(f"{where}: pow needs a literal exponent")
            p.stmts.append(Stmt("pow", (ref(args[0]),), (e,)))
        elif op == "clamp":
            need(3)
            p.stmts.append(Stmt("clamp", (ref(args[0]),), (_parse_num(args[1], where), _parse_num(args[2], where))))
        elif op == "where":
            need(3)
            p.stmts.append(Stmt("where", tuple(ref(a) for a in args)))
        elif op in UNARY or op in REDUCE:
            need(1)
            p.stmts.append(Stmt(op, (ref(args[0]),)))
        elif op in BINARY or op in COMPARE:
            need(2)
            p.stmts.append(Stmt(op, (ref(args[0]), ref(args[1]))))
        else:
            raise ProgramError(f"{where}: unknown op {op!r}")
    return p.validate()


def _dtype_name_checked(tok: str, where: str) -> str:
    if tok not in DTYPES:
        raise ProgramError(f"{where}: unknown dtype {tok!r} (f64 f32 f16 bf16 bool)")
    return tok


def value_kinds(p: Program, input_dtypes: Sequence[torch.dtype]) -> list[str]:
    """'b' (bool) or 'f' (floating) for every value, given the input dtypes."""
    kinds: list[str] = []
    for s in p.stmts:
        if s.op == "input":
            kinds.append("b" if input_dtypes[s.attrs[0]] == torch.bool else "f")
        elif s.op == "catin":  # (its pieces are read as the compute type)
            kinds.append("f")
        elif s.op in COMPARE or (s.op == "cast" and s.attrs[0] == "bool"):
            kinds.append("b")
        else:
            kinds.append("f")
    return kinds


def compute_dtype_for(input_dtypes: Sequence[torch.dtype]) -> torch.dtype:
    return torch.float64 if torch.float64 in input_dtypes else torch.float32


def broadcast_shape(inputs: Sequence[torch.Tensor], program: "Program | None" = None) -> torch.Size:
    """The outputs' shape: the inputs broadcast together, a ``catin``'s inputs as their concatenation."""
    if not inputs:
        return torch.Size([])
    cats = [s for s in program.stmts if s.op == "catin"] if program is not None else []
    if not cats:
        return torch.broadcast_shapes(*[t.shape for t in inputs])
    pieces = {i for s in cats for i in s.attrs[1]}
    shapes = [cat_shape([inputs[i] for i in s.attrs[1]], s.attrs[0]) for s in cats]
    return torch.broadcast_shapes(*shapes, *[t.shape for i, t in enumerate(inputs) if i not in pieces])


def cat_shape(pieces: Sequence[torch.Tensor], dim: int) -> torch.Size:
    """The shape of ``torch.cat(pieces, dim)``; a ProgramError where they do not concatenate."""
    first = tuple(pieces[0].shape)
    if dim >= len(first):
        raise ProgramError(f"catin along dim {dim} of tensors of rank {len(first)}")
    for t in pieces[1:]:
        sh = tuple(t.shape)
        if len(sh) != len(first) or any(a != b for d, (a, b) in enumerate(zip(sh, first)) if d != dim):
            raise ProgramError(f"catin along dim {dim}: shapes {first} and {sh} differ off that dim")
    return torch.Size(first[:dim] + (sum(t.shape[dim] for t in pieces),) + first[dim + 1:])


def full_views(p: "Program", inputs: Sequence[torch.Tensor], shape) -> list[torch.Tensor]:
    """Each input expanded to the output's rank and shape; a ``catin``'s input to that shape but
    its own size along the concatenated dim (its offset there: :func:`cat_offsets`)."""
    cats = p.cat_inputs()
    out = []
    for i, t in enumerate(inputs):
        if i in cats:
            d = cats[i] + len(shape) - t.dim()
            out.append(t.expand(tuple(shape[:d]) + (t.shape[cats[i]],) + tuple(shape[d + 1:])))
        else:
            out.append(t.expand(shape))
    return out


def cat_offsets(p: "Program", inputs: Sequence[torch.Tensor], ndim: int) -> dict[int, tuple[int, int, int]]:
    """input index -> (the output dim it is concatenated along, its first index there, one past its last)."""
    out = {}
    for s in p.stmts:
        if s.op == "catin":
            start = 0
            for i in s.attrs[1]:
                t = inputs[i]
                out[i] = (s.attrs[0] + ndim - t.dim(), start, start + t.shape[s.attrs[0]])
                start += t.shape[s.attrs[0]]
    return out


def with_cat_dims(p: "Program", dims: Sequence[int]) -> "Program":
    """``p`` with its catins' dims replaced by ``dims`` (one per catin, in order: a permuted layout's)."""
    it = iter(dims)
    return Program([Stmt("catin", (), (next(it), s.attrs[1])) if s.op == "catin" else s for s in p.stmts],
                   list(p.outputs), row_major=p.row_major, reduce_dim=p.reduce_dim)


def with_row_dim(p: "Program", order: Sequence[int], ndim: int) -> "Program":
    """``p`` run on its inputs permuted by ``order`` (outermost first): its row's dim as the
    permuted views number it."""
    if not p.reduces:
        return p
    return Program(list(p.stmts), list(p.outputs), row_major=p.row_major,
                   reduce_dim=list(order).index(p.row_dim(ndim)))


def dense_order(inputs: Sequence[torch.Tensor], shape, program: "Program | None" = None) -> list[int] | None:
    """The output layout rule of ``fused_pointwise``: when every input of the output's full shape
    orders its dims the same way by stride, and not the contiguous way (a channels_last activation
    and its residual; the slices of one along a split channel dim, which are not dense), the outputs
    are dense in that order, as aten's elementwise kernels lay theirs out; returns the dims outermost
    first (None: contiguous outputs). A program that reduces along the last dim (no ``reduce D``
    line) writes contiguous outputs, as one marked ``layout row_major`` does."""
    if program is not None and ((program.reduces and program.reduce_dim is None) or program.row_major):
        return None
    nd = len(shape)
    pieces = program.cat_inputs() if program is not None else {}
    full = [t for i, t in enumerate(inputs) if t.dim() == nd and (i in pieces or tuple(t.shape) == tuple(shape))
            and not broadcast_somewhere(t)]  # (an expanded view has no layout, as a smaller operand has none)
    if nd < 2 or not full:
        return None
    order = stride_order(full[0])
    if order is None or order == list(range(nd)) or any(stride_order(t) != order for t in full[1:]):
        return None
    return order


def broadcast_somewhere(t: torch.Tensor) -> bool:
    """Some dim of ``t`` of size over 1 has stride 0 (an expanded view)."""
    return any(st == 0 for sz, st in zip(t.shape, t.stride()) if sz != 1)


def stride_order(t: torch.Tensor) -> list[int] | None:
    """``t``'s dims outermost first by stride, or None where that says nothing definite (symbolic
    sizes, a broadcast dim, two dims of one stride); dims of size 1 sit where a dense tensor of that
    order would put them (after the dim outside them)."""
    sizes, strides = tuple(t.shape), tuple(t.stride())
    if not all(isinstance(v, int) for v in sizes + strides):
        return None
    big = [d for d in range(len(sizes)) if sizes[d] != 1]
    if any(strides[d] <= 0 for d in big) or len({strides[d] for d in big}) != len(big):
        return None
    order = sorted(big, key=lambda d: -strides[d])
    for d in range(len(sizes)):  # each size-1 dim right after the nearest dim before it in logical order
        if sizes[d] == 1:
            before = [i for i, o in enumerate(order) if o < d]
            order.insert(before[-1] + 1 if before else 0, d)
    return order


def empty_in_order(shape, order: list[int] | None, dtype, device) -> torch.Tensor:
    """An empty tensor of ``shape`` laid out in ``order`` (outermost first; None: contiguous)."""
    if order is None:
        return torch.empty(shape, dtype=dtype, device=device)
    inv = sorted(range(len(order)), key=lambda i: order[i])
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(inv)


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


_UNARY_TORCH = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
    "gelu": torch.nn.functional.gelu, "gelu_tanh": _gelu_tanh, "silu": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish, "erf": torch.erf, "cos": torch.cos, "sin": torch.sin,
}
_BINARY_TORCH = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
                 "maximum": torch.maximum, "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne,
                 "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


def evaluate(program: str | Program, inputs: Sequence[torch.Tensor],
             compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Run a program with torch ops: the reference semantics (and the CPU implementation).
    ``compute_dtype`` defaults to fp32, or fp64 when an input is fp64; pass torch.float64 to get
    an fp64 reference of a program whose inputs are bf16/fp16/fp32."""
    p = parse(program) if isinstance(program, str) else program.validate()
    if len(inputs) < p.num_inputs:
        raise ProgramError(f"the program reads {p.num_inputs} inputs, {len(inputs)} given")
    dts = [t.dtype for t in inputs]
    ct = compute_dtype or compute_dtype_for(dts)
    shape = broadcast_shape(inputs, p)
    device = inputs[0].device if inputs else torch.device("cpu")
    vals: list[torch.Tensor] = []
    for s in p.stmts:
        if s.op == "input":
            t = inputs[s.attrs[0]]
            v = t if t.dtype == torch.bool else t.to(ct)
        elif s.op == "catin":
            v = torch.cat([inputs[i].to(ct) for i in s.attrs[1]], s.attrs[0])
        elif s.op == "const":
            v = torch.tensor(s.attrs[0], dtype=ct, device=device)
        else:
            a = [vals[i] for i in s.args]
            if s.op not in COMPARE and s.op not in ("where", "cast"):
                a = [x.to(ct) if x.dtype == torch.bool else x for x in a]
            if s.op == "cast":
                d = DTYPES[s.attrs[0]]
                v = a[0] != 0 if d == torch.bool else a[0].to(d).to(ct)
            elif s.op == "pow":
                v = torch.pow(a[0], s.attrs[0])
            elif s.op == "clamp":
                lo, hi = s.attrs
                v = a[0]
                if lo is not None:
                    v = torch.where(v < lo, torch.tensor(lo, dtype=ct, device=device), v)
                if hi is not None:
                    v = torch.where(v > hi, torch.tensor(hi, dtype=ct, device=device), v)
            elif s.op == "where":
                c = a[0] if a[0].dtype == torch.bool else a[0] != 0
                x, y = [t.to(ct) if t.dtype == torch.bool else t for t in a[1:]]
                v = torch.where(c, x, y)
            elif s.op in _UNARY_TORCH:
                v = _UNARY_TORCH[s.op](a[0])
            elif s.op == "rsum":
                v = torch.broadcast_to(a[0], shape).sum(p.row_dim(len(shape)), keepdim=True)
            elif s.op == "rmax":
                v = torch.broadcast_to(a[0], shape).amax(p.row_dim(len(shape)), keepdim=True)
            else:
                x, y = a
                if s.op in COMPARE and (x.dtype == torch.bool) != (y.dtype == torch.bool):
                    x, y = x.to(ct), y.to(ct)
                v = _BINARY_TORCH[s.op](x, y)
        vals.append(v)
    outs = []
    for vid, dname in p.outputs:
        d = DTYPES[dname]
        v = vals[vid]
        v = (v != 0) if d == torch.bool and v.dtype != torch.bool else v.to(d)
        outs.append(v.expand(shape).contiguous())
    return outs
