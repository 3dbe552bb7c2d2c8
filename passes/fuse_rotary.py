"""fuse_rotary: the rotate_half rotary embedding of q and k -> one ``graphopt::rotary`` call.

Matches, for each of q and k (``x`` is [B, H, S, D], cos/sin broadcast over heads; or ``x`` is [B, S, H, D]
with cos/sin [B or 1, S, 1, R], a rotation before the heads are transposed as GPT-J and CodeGen write it:
the op then takes x transposed, a view, and its results are transposed back)::

    x * cos + rotate(x) * sin                                  # full head (R = D)
    cat([xr * cos + rotate(xr) * sin, x[..., R:]], -1)         # partial: xr = x[..., :R]

with ``rotate`` either Llama's rotate_half ``cat([-x[..., R/2:], x[..., :R/2]], -1)``
(``interleaved=False``) or GLM's pairwise form ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)``
(``interleaved=True``); products and the sum in either operand order. Two rotations that share
cos, sin, R and the form (q and k of one attention) become ``rotary(q, k, cos, sin, interleaved)``;
cos/sin are given to the op as [B or 1, S, R] (a squeeze/unsqueeze view is inserted).

Proven from metadata before rewriting: x is 4-D; every slice, cat, stack and flatten is over
the last dim with the exact bounds of the form; cos and sin have the same shape, which (left-
padded to 4-D) is [B or 1, 1, S, R] -- constant over heads, one row per position, R wide -- so the
op's broadcast is the model's; the result keeps x's dtype and shape (a cos of a wider dtype
would promote). Refused with the reason recorded: any of those failing, a rotation with no
partner sharing its cos/sin (only q's or only k's found), a pair with no valid place in the
graph, and everything on a CPU profile (``NO_FUSED_KERNELS``).

Casts around a float32 rotation are absorbed: where q and k are half/bfloat16 activations cast to
float32 for it (``x.float()``, ModernBERT's spelling), cos/sin are float32 or of x's dtype, and every
reader of both results casts them back to x's dtype, the op takes x itself and its results replace
those casts. The op reads float32 tables as float32 and computes in float32, so each result is the
float32 rotation rounded once to x's dtype, as the casts made it; the casts' reads and writes of
float32 copies are gone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Alt, Any, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._fusion_meta import set_meta
from ._norms_common import CASTS, Seq, is_noop_cast, position

aten = torch.ops.aten
SLICE = aten.slice.Tensor
MUL, ADD, NEG = aten.mul.Tensor, aten.add.Tensor, aten.neg.default


def _sl(src, tag: str, name: str | None = None, single_use: bool = True) -> Op:
    return Op(SLICE, src, Any(f"d{tag}"), Any(f"s{tag}"), Any(f"e{tag}"), Any(f"st{tag}"), name=name or f"x{tag}",
              single_use=single_use)


def _body(xr) -> Op:
    half = Op(aten.cat.default, Seq(Op(NEG, _sl(xr, "2")), _sl(xr, "1")), Any("rot_dim"), name="rot")
    inter = Op(aten.flatten.using_ints,
               Op(aten.stack.default, Seq(Op(NEG, _sl(xr, "2")), _sl(xr, "1")), Any("stack_dim"), name="stack"),
               Any("flat_start"), Any("flat_end"), name="rot")
    mul_sin = Op(MUL, Alt(inter, half), Any("sin"), name="mul_sin", commutative=True)
    mul_cos = Op(MUL, xr, Any("cos"), name="mul_cos", commutative=True)
    # the sin product first: it pins xr, so the cos product cannot bind the operands swapped
    return Op(ADD, mul_sin, mul_cos, name="body", commutative=True)


FULL = _body(Any("q"))
# xr is read three times inside the match (the cos product and both slices of the rotation);
# single_use=False lifts the matcher's per-Op "one user" test, and the whole-match test (no
# reader outside the match) still applies to it.
PARTIAL = Op(aten.cat.default, Seq(_body(_sl(Any("q"), "r", name="xr", single_use=False)), _sl(Any("q"), "p", name="xp")),
             Any("out_dim"), name="root")

_MAX = 2**62


def _bounds(start, end, step, size):
    """Normalized (start, end, step) of a slice over a dim of ``size`` (None on symbolic)."""
    start = 0 if start is None else start
    end = size if end is None else end
    step = 1 if step is None else step
    if not all(isinstance(v, int) for v in (start, end, step, size)):
        return None
    if start < 0:
        start += size
    if end < 0:
        end += size
    return max(0, min(start, size)), max(0, min(end, size)), step


def _is_last(dim, ndim) -> bool:
    return isinstance(dim, int) and dim % ndim == ndim - 1


class _Rot:
    def __init__(self, m, partial: bool):
        self.m, self.partial = m, partial
        self.root = m["root"] if partial else m["body"]
        self.q, self.cos, self.sin = m["q"], m["cos"], m["sin"]
        self.interleaved = m.get("stack") is not None
        self.nodes = list(m.nodes)
        self.R = None
        self.bshd = False  # x is [B, S, H, D] (positions before heads: rotated before the heads are transposed)

    @property
    def label(self):
        return f"{self.root.name} (rotary of {self.q.name})"


def _check(r: _Rot) -> str:
    m = r.m
    qi = ir.info(r.q) if isinstance(r.q, fx.Node) else None
    if qi is None or len(qi.shape) != 4:
        return f"x {getattr(r.q, 'name', r.q)} is not a 4-D [B, H, S, D] tensor"
    B, H, S, D = qi.shape
    xr = m["xr"] if r.partial else r.q
    R = ir.info(xr).shape[-1]
    if not isinstance(R, int) or R % 2 or R > D or R == 0:
        return f"rotary dim {R} is not even and <= head dim {D}"
    r.R = R
    if r.partial:
        if not (_is_last(m["dr"], 4) and _bounds(m["sr"], m["er"], m["str"], D) == (0, R, 1)):
            return f"{m['xr'].name} is not x[..., :{R}]"
        if not (_is_last(m["dp"], 4) and _bounds(m["sp"], m["ep"], m["stp"], D) == (R, D, 1)):
            return f"{m['xp'].name} is not x[..., {R}:]"
        if not (_is_last(m["out_dim"], 4) and list(m["root"].args[0]) == [m["body"], m["xp"]]):
            return f"{m['root'].name} does not concatenate [rotated, pass-through] on the last dim"
    b1 = _bounds(m["s1"], m["e1"], m["st1"], R)
    b2 = _bounds(m["s2"], m["e2"], m["st2"], R)
    if not (_is_last(m["d1"], 4) and _is_last(m["d2"], 4)):
        return "the rotation's slices are not over the last dim"
    if r.interleaved:
        if b1 != (0, R, 2) or b2 != (1, R, 2):
            return f"the pairwise rotation does not take x[..., 0::2] and x[..., 1::2] (got {b1}, {b2})"
        if not (_is_last(m["stack_dim"], 5) and _is_last(m["flat_start"] + 1, 5) and _is_last(m["flat_end"], 5)
                if all(isinstance(m[k], int) for k in ("stack_dim", "flat_start", "flat_end")) else False):
            return "stack/flatten are not over the last dims"
    else:
        if b1 != (0, R // 2, 1) or b2 != (R // 2, R, 1):
            return f"rotate_half does not take the two halves (got {b1}, {b2})"
        if not _is_last(m["rot_dim"], 4):
            return "rotate_half does not concatenate on the last dim"
    for what in ("cos", "sin"):
        t = m[what]
        ti = ir.info(t) if isinstance(t, fx.Node) else None
        if ti is None:
            return f"{what} is not a tensor"
        shape = (1,) * (4 - len(ti.shape)) + tuple(ti.shape) if len(ti.shape) <= 4 else None
        ok = shape is not None and shape[3] == R and shape[0] in (1, B)
        if ok and shape[1] == 1 and shape[2] == S:
            r.bshd = False  # [B, H, S, D]: one row per position (dim 2), broadcast over the heads (dim 1)
        elif ok and shape[2] == 1 and shape[1] == H:
            r.bshd = True  # [B, S, H, D] (GPT-J, CodeGen: rotated before the transpose): positions at dim 1
        else:
            return (f"{what} {t.name} has shape {list(ti.shape)}; the op needs [B or 1, (1,) S={S}, R={R}] "
                    f"broadcast over the heads of {list(qi.shape)} as [B, H, S, D], or [B or 1, {H}, 1, {R}] "
                    f"as [B, S, H, D]")
        if ti.device != qi.device:
            return f"{what} is on {ti.device}, x on {qi.device}"
    if ir.info(r.cos).shape != ir.info(r.sin).shape:
        return "cos and sin shapes differ"
    out = ir.info(r.root)
    if out is None or out.dtype != qi.dtype or tuple(out.shape) != tuple(qi.shape):
        return (f"the result is {getattr(out, 'dtype', None)} {list(getattr(out, 'shape', []))}, x is "
                f"{qi.dtype} {list(qi.shape)} (cos/sin of another dtype promote)")
    return ""


HALF = (torch.float16, torch.bfloat16)


def _cast_of(n, dtype=None):
    """The tensor ``n`` casts to another dtype on its device (one of ``CASTS``, no layout asked for; to
    ``dtype`` if given), else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in CASTS and 1 <= len(n.args) <= 2
            and isinstance(n.args[0], fx.Node)) or is_noop_cast(n):
        return None
    ni, si = ir.info(n), ir.info(n.args[0])
    if ni is None or si is None or si.device != ni.device \
            or n.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None
    return n.args[0] if dtype is None or ni.dtype == dtype else None


def _absorbed_casts(a: _Rot, b: _Rot):
    """((x_q, x_k), (cast_q, cast_k)) when the pair rotates float32 casts of half x_q and x_k and every
    reader of each result casts it back to x's dtype (then the op takes x and its results replace the
    casts back: one rounding, as before; the pipeline re-propagates their layout); else None."""
    xs = [_cast_of(r.q) for r in (a, b)]
    if any(x is None for x in xs) or ir.info(a.q).dtype != torch.float32:
        return None
    dt = ir.info(xs[0]).dtype
    if dt not in HALF or ir.info(xs[1]).dtype != dt:
        return None
    if any(ir.info(t).dtype not in (torch.float32, dt) for t in (a.cos, a.sin)):
        return None
    downs = []
    for r in (a, b):
        users = list(r.root.users)
        if len(users) != 1 or _cast_of(users[0], dt) is not r.root:
            return None  # a reader of the float32 result (or two casts): the float32 rotation stays
        downs.append(users[0])
    return (xs[0], xs[1]), (downs[0], downs[1])


@register
class FuseRotary(Pass):
    name = "fuse_rotary"
    family = "fusion"
    description = "rotate_half rotary embedding (full and GLM's partial interleaved form) of q and k -> rotary"
    inference_only = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        rots: list[_Rot] = []
        covered: set = set()
        for pattern, partial in ((PARTIAL, True), (FULL, False)):
            for m in find(gm, pattern):
                if m.root in covered:
                    continue
                r = _Rot(m, partial)
                why = _check(r)
                if why:
                    res.reject(f"rotary at {r.label}", f"not fused: {why}")
                    continue
                covered.update(r.nodes)
                rots.append(r)
        # pair rotations sharing cos, sin, R and form, in graph order (q and k of one attention)
        pos = position(gm)
        groups: dict = {}
        for r in sorted(rots, key=lambda r: pos[r.root]):
            groups.setdefault((r.cos, r.sin, r.R, r.interleaved), []).append(r)
        candidates = []
        for rs in groups.values():
            while rs:
                a = rs.pop(0)
                partner = next((b for b in rs if self._compatible(a, b)), None)
                if partner is None:
                    res.reject(f"rotary at {a.label}", "not fused: no partner rotation (q or k) with the same cos/sin, "
                               "rotary dim and form was found")
                    continue
                rs.remove(partner)
                candidates.append(self._candidate(gm, ctx, a, partner))
        res.apply_ranked(ctx, candidates, fused_kernels=True)
        return res

    @staticmethod
    def _compatible(a: _Rot, b: _Rot) -> bool:
        qa, qb = ir.info(a.q), ir.info(b.q)
        s = 1 if a.bshd else 2  # the positions' dim
        return (a.bshd == b.bshd and qa.shape[0] == qb.shape[0] and qa.shape[s] == qb.shape[s]
                and qa.shape[3] == qb.shape[3] and qa.dtype == qb.dtype and qa.device == qb.device)

    @staticmethod
    def _candidate(gm, ctx, a: _Rot, b: _Rot) -> Candidate:
        gone = list(dict.fromkeys(a.nodes + b.nodes))
        casts = _absorbed_casts(a, b)
        if casts is None:
            ins, outs = (a.q, b.q), (a.root, b.root)
        else:
            ins, outs = casts
            # the up-casts go too where nothing else reads them
            gone += list(outs) + [
                c for c in (a.q, b.q) if all(u in gone or u in (a.root, b.root) for u in c.users)]
            gone = list(dict.fromkeys(gone))
        # (the kernel reads the tables through views of cos and sin: the same bytes)
        if a.bshd:  # the op takes [B, H, S, D]: q and k transposed (views), the tables [B or 1, S, R]
            r = ctx.replacement()
            qt = [r.call(aten.transpose.int, x, 1, 2) for x in ins]
            tabs = [r.call(aten.squeeze.dim, t, -2) for t in (a.cos, a.sin)]
            r.call(torch.ops.graphopt.rotary.default, qt[0], qt[1], tabs[0], tabs[1], a.interleaved)
            new_t = r.time()
        else:
            new_t = ctx.price(torch.ops.graphopt.rotary.default, ins[0], ins[1], a.cos, a.sin, a.interleaved,
                              val=(outs[0].meta.get("val"), outs[1].meta.get("val")))
        gain = ctx.node_time(gone) - new_t
        form = "interleaved" if a.interleaved else "rotate_half"
        kind = "partial" if a.partial else "full"
        cast = ", casts absorbed" if casts else ""
        label = f"rotary {a.root.name} + {b.root.name} ({form}, {kind}, R={a.R}{cast})"
        return Candidate(f"rotary q+k ({form}{cast})", gone, gain, lambda: FuseRotary._apply(gm, a, b, casts), label=label,
                         refusal="no point in the graph follows both inputs and precedes both outputs' readers")

    @staticmethod
    def _apply(gm: fx.GraphModule, a: _Rot, b: _Rot, casts=None):
        g = gm.graph
        pos = position(gm)
        (qa, qb), (oa_old, ob_old) = casts if casts else ((a.q, b.q), (a.root, b.root))
        after = max((qa, qb, a.cos, a.sin), key=lambda n: pos[n])
        first_use = min((pos[u] for r in (oa_old, ob_old) for u in r.users), default=len(pos))
        if pos[after] >= first_use:
            return None
        ci = ir.info(a.cos)
        made: list = []

        def call(target, *args):  # each new node after the one made before it (fx inserts each after `after`)
            with g.inserting_after(made[-1] if made else after):
                made.append(g.call_function(target, args))
            return made[-1]

        tabs, depth = [a.cos, a.sin], len(ci.shape)
        if a.bshd or depth == 4:  # [.., S, 1, R] (bshd) or [B, 1, S, R] -> [.., S, R]
            tabs, depth = [call(aten.squeeze.dim, t, -2 if a.bshd else 1) for t in tabs], depth - 1
        for _ in range(3 - depth):  # -> [B or 1, S, R]
            tabs = [call(aten.unsqueeze.default, t, 0) for t in tabs]
        if a.bshd:
            qa, qb = (call(aten.transpose.int, x, 1, 2) for x in (qa, qb))
        set_meta(gm, made)
        anchor = made[-1] if made else after
        with g.inserting_after(anchor):
            fused = g.call_function(torch.ops.graphopt.rotary.default,
                                    (qa, qb, tabs[0], tabs[1], a.interleaved))
        with g.inserting_after(fused):
            oa = g.call_function(operator.getitem, (fused, 0))
        with g.inserting_after(oa):
            ob = g.call_function(operator.getitem, (fused, 1))
        if a.bshd:  # the op's [B, H, S, D] results (laid out [B, S, H, D]) transposed back: views
            set_meta(gm, [fused, oa, ob])
            with g.inserting_after(ob):
                oa = g.call_function(aten.transpose.int, (oa, 1, 2))
            with g.inserting_after(oa):
                ob = g.call_function(aten.transpose.int, (ob, 1, 2))
            set_meta(gm, [oa, ob])
        else:
            oa.meta["val"], ob.meta["val"] = oa_old.meta.get("val"), ob_old.meta.get("val")
            fused.meta["val"] = (oa.meta["val"], ob.meta["val"])
        # the results (or, casts absorbed, the casts back) are read from the op now; the up-casts go
        # where nothing else reads them
        oa_old.replace_all_uses_with(oa)
        ob_old.replace_all_uses_with(ob)
        ir.erase_dead(gm, [oa_old, ob_old] + a.nodes + b.nodes + ([a.q, b.q] if casts else []))
        return fused
