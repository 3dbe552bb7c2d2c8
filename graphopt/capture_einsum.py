"""Einsums that are batched matrix products, in matmul form (part of capture's canonical vocabulary).

    einsum("bhid,bhjd->bhij", q, k)   ->  matmul(q, permute(k, [0, 1, 3, 2]))
    einsum("bhij,bhjd->bhid", p, v)   ->  matmul(p, v)
    einsum("bjd,bid->bij", x, y)      ->  matmul(y, permute(x, [0, 2, 1]))     (the operand order of the output)

An einsum is rewritten when it has two operands and its labels split into batch labels (in both
operands and the output), exactly one contracted label (in both operands, not in the output) and
exactly one free label per operand (in that operand and the output): the product is then
``matmul(permute(left, [batch..., m, k]), permute(right, [batch..., k, n]))`` with the batch labels
in the output's order, followed by a permute to the output's order where the output does not end
in ``m, n``. The left operand is the one whose free label comes first in the output. torch.einsum
computes such a product the same way (its operands permuted and reshaped for one bmm), so the
rewrite changes no kernel; passes written against ``matmul`` (fuse_attention) then see it.

Kept as they are, each with its reason in the capture notes: other operand counts, repeated labels
(diagonals), labels summed out of one operand, more or fewer than one contracted or free label per
side, ellipses of different ranks, contracted sizes that differ (einsum broadcasts a size-1
contracted dim, matmul does not), batch sizes that neither match nor broadcast, mixed dtypes, and
a product whose matmul form lays the result out with other strides while something reads it
through a stride-dependent view (``view``, ``as_strided``) or writes into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from . import ir

aten = torch.ops.aten
EINSUMS = (aten.einsum.default, torch.einsum, torch.functional.einsum)
# ops through which a reader still sees the product's memory (their results alias it)
_VIEWS = {"permute", "transpose", "t", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand",
          "select", "slice", "narrow", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind",
          "contiguous", "view_as", "expand_as", "movedim", "swapaxes", "getitem", "diagonal"}
# readers whose result depends on the strides of what they read (or that write into it)
_STRIDED = {"view", "_unsafe_view", "as_strided", "view_as_real", "view_as_complex"}


class NotMatmul(Exception):
    pass


@dataclass(frozen=True)
class MatmulForm:
    left: int  # which einsum operand is matmul's first
    left_perm: tuple | None  # permute of the left operand to [batch..., m, k] (None: already)
    right_perm: tuple | None  # permute of the right operand to [batch..., k, n]
    out_perm: tuple | None  # permute of matmul's [batch..., m, n] to the output's order


def _terms(equation: str) -> tuple[list[str], str | None]:
    eq = "".join(equation.split())
    lhs, arrow, rhs = eq.partition("->")
    return lhs.split(","), (rhs if arrow else None)


def _labels(term: str, rank: int | None, ell: int | None) -> list[str]:
    """The term's labels, its ellipsis expanded to ``ell`` labels ``...0``, ``...1`` (for an operand:
    its rank minus its letters)."""
    head, dots, tail = term.partition("...")
    if "." in head or "." in tail:
        raise NotMatmul(f"term {term!r} has a malformed ellipsis")
    for ch in head + tail:
        if not ch.isalpha():
            raise NotMatmul(f"term {term!r} has label {ch!r}")
    if dots:
        n = (rank - len(head) - len(tail)) if rank is not None else ell
        if n is None or n < 0:
            raise NotMatmul(f"term {term!r} does not fit a {rank}-D operand")
        mid = [f"...{i}" for i in range(n)]
    else:
        if rank is not None and len(head) != rank:
            raise NotMatmul(f"term {term!r} does not fit a {rank}-D operand")
        mid = []
    return list(head) + mid + list(tail)


def matmul_form(equation: str, shapes: list[tuple], dtypes: list[torch.dtype]) -> MatmulForm:
    """The matmul spelling of ``einsum(equation, *operands)`` for operands of these shapes and
    dtypes; raises NotMatmul with the reason when it is not a batched matrix product."""
    terms, out_term = _terms(equation)
    if len(terms) != 2 or len(shapes) != 2:
        raise NotMatmul(f"{len(shapes)} operands (a matrix product has two)")
    if dtypes[0] != dtypes[1]:
        raise NotMatmul(f"operands of dtypes {dtypes[0]} and {dtypes[1]}")
    ops = [_labels(t, len(s), None) for t, s in zip(terms, shapes)]
    ells = [sum(lb.startswith("...") for lb in o) for o in ops]
    if "..." in terms[0] and "..." in terms[1] and ells[0] != ells[1]:
        raise NotMatmul(f"ellipses of {ells[0]} and {ells[1]} dims (broadcast over missing dims)")
    ell = max(ells)
    if out_term is None:  # implicit output: the ellipsis, then the labels used once, sorted
        once = [c for c in sorted(set("".join(terms).replace(".", ""))) if "".join(terms).count(c) == 1]
        out = [f"...{i}" for i in range(ell)] + once
    else:
        out = _labels(out_term, None, ell)
    for name, labels in (("operand 0", ops[0]), ("operand 1", ops[1]), ("the output", out)):
        if len(set(labels)) != len(labels):
            raise NotMatmul(f"{name} repeats a label (a diagonal)")
    a, b = ops
    unknown = [lb for lb in out if lb not in a and lb not in b]
    if unknown:
        raise NotMatmul(f"output label {unknown[0]!r} is in no operand")
    summed = [lb for lb in a + b if lb not in out and not (lb in a and lb in b)]
    if summed:
        raise NotMatmul(f"label {summed[0]!r} is summed out of one operand")
    contracted = [lb for lb in a if lb in b and lb not in out]
    free = [[lb for lb in o if lb in out and lb not in other] for o, other in ((a, b), (b, a))]
    if len(contracted) != 1 or len(free[0]) != 1 or len(free[1]) != 1:
        raise NotMatmul(f"{len(contracted)} contracted and {len(free[0])}/{len(free[1])} free labels "
                        "(a matrix product has one of each)")
    (k,), (fa,), (fb,) = contracted, free[0], free[1]
    size = {}
    for o, s in zip(ops, shapes):
        for lb, d in zip(o, s):
            size.setdefault(lb, []).append(d)
    if size[k][0] != size[k][1]:
        raise NotMatmul(f"the contracted label {k!r} has sizes {size[k][0]} and {size[k][1]}")
    batch = [lb for lb in out if lb in a and lb in b]
    for lb in batch:
        d0, d1 = size[lb]
        if not (d0 == d1 or d0 == 1 or d1 == 1):
            raise NotMatmul(f"batch label {lb!r} has sizes {d0} and {d1}")
    left = 0 if out.index(fa) < out.index(fb) else 1
    (lo, lf), (ro, rf) = ((a, fa), (b, fb)) if left == 0 else ((b, fb), (a, fa))

    def perm(labels, order):
        p = tuple(labels.index(lb) for lb in order)
        return None if p == tuple(range(len(p))) else p

    result = batch + [lf, rf]
    return MatmulForm(left, perm(lo, batch + [lf, k]), perm(ro, batch + [k, rf]), perm(result, out))


def _operands(node: fx.Node):
    """(equation, [operand nodes]) of an einsum call (``aten.einsum(eq, [a, b])``, or
    ``torch.einsum(eq, a, b)`` / ``torch.einsum(eq, [a, b])`` left by symbolic_trace), or None."""
    if node.op != "call_function" or node.target not in EINSUMS or not node.args:
        return None
    eq, rest = node.args[0], node.args[1:]
    if node.target is aten.einsum.default:
        operands = rest[0] if rest else node.kwargs.get("tensors", ())
    else:
        operands = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    operands = list(operands)
    if not isinstance(eq, str) or not all(isinstance(o, fx.Node) for o in operands):
        return None
    return eq, operands


def _dense_strides(t) -> tuple:
    """Strides of the dims of size > 1 (the others' strides do not matter)."""
    return tuple(st for d, st in zip(t.shape, t.stride()) if d != 1)


def _stride_dependent_reader(node: fx.Node) -> fx.Node | None:
    """A node reading ``node``'s memory (directly or through views) whose result depends on its
    strides, or that writes into it; else None."""
    stack, seen = list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op != "call_function":
            continue
        if isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable:
            return u
        name = ir.op_name(u) if isinstance(u.target, torch._ops.OpOverload) else getattr(u.target, "__name__", "")
        if name in _STRIDED:
            return u
        if name in _VIEWS:
            stack.extend(u.users)
    return None


def _matmul_val(left, right):
    """The value of ``matmul(left, right)`` for operands of equal rank whose batch dims are equal or 1
    (what matmul_form admits): a fresh contiguous tensor of the product's shape, made without running
    aten.matmul, whose fake kernel on torch 2.11 reads a symbolic batch size as an int and so
    specializes it to the example's value."""
    batch = [b if isinstance(a, int) and a == 1 else a for a, b in zip(left.shape[:-2], right.shape[:-2])]
    return left.new_empty([*batch, left.shape[-2], right.shape[-1]])


def _fake_run(target, args, mode):
    def load(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    vals = fx.node.map_aggregate(args, load)
    if target is aten.matmul.default and all(isinstance(v, torch.Tensor) for v in vals) \
            and len({v.dim() for v in vals}) == 1 and vals[0].dim() >= 3:
        target = _matmul_val
    if mode is None:
        return target(*vals)
    prev = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        with mode:
            return target(*vals)
    finally:
        mode.allow_non_fake_inputs = prev


def einsums_as_matmul(gm: fx.GraphModule) -> tuple[int, dict[str, list[str]]]:
    """Rewrite every einsum of ``gm`` that is a batched matrix product into matmul form. Returns
    the number rewritten and, for the einsums kept, ``{reason: [node names]}``."""
    from torch._guards import detect_fake_mode

    g = gm.graph
    rewritten, kept = 0, {}
    mode = None
    for node in list(g.nodes):
        call = _operands(node)
        if call is None:
            continue
        eq, operands = call
        infos = [ir.info(o) for o in operands]
        out_val = node.meta.get("val")
        if any(i is None for i in infos) or not isinstance(out_val, torch.Tensor):
            kept.setdefault("an operand or the result has no tensor metadata", []).append(node.name)
            continue
        try:
            form = matmul_form(eq, [i.shape for i in infos], [i.dtype for i in infos])
        except NotMatmul as e:
            kept.setdefault(str(e), []).append(node.name)
            continue
        if mode is None:
            mode = detect_fake_mode([out_val]) or False
        new = []
        with g.inserting_before(node):
            def call_(target, *args):
                n = g.call_function(target, args)
                n.meta["val"] = _fake_run(target, args, mode or None)
                new.append(n)
                return n

            left, right = operands[form.left], operands[1 - form.left]
            if form.left_perm is not None:
                left = call_(aten.permute.default, left, list(form.left_perm))
            if form.right_perm is not None:
                right = call_(aten.permute.default, right, list(form.right_perm))
            out = call_(aten.matmul.default, left, right)
            if form.out_perm is not None:
                out = call_(aten.permute.default, out, list(form.out_perm))
        val = out.meta["val"]
        if tuple(val.shape) != tuple(out_val.shape) or val.dtype != out_val.dtype:
            why = (f"its matmul form gives {tuple(val.shape)} {val.dtype}, the einsum "
                   f"{tuple(out_val.shape)} {out_val.dtype}")
        elif _dense_strides(val) != _dense_strides(out_val) and (reader := _stride_dependent_reader(node)) is not None:
            why = (f"its matmul form lays the result out with strides {tuple(val.stride())} (the einsum's: "
                   f"{tuple(out_val.stride())}) and {reader.name} depends on them")
        else:
            why = ""
        if why:
            for n in reversed(new):
                g.erase_node(n)
            kept.setdefault(why, []).append(node.name)
            continue
        node.replace_all_uses_with(out)
        g.erase_node(node)
        rewritten += 1
    if rewritten:
        g.lint()
        gm.recompile()
    return rewritten, kept
