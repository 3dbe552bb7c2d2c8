"""lower_decode_attention: SDPA of a few query positions over a long key/value cache ->
graphopt::decode_attention (split-KV Triton kernels, cuda_ext/decode_attention_triton.py).

A decode step of a Hugging Face decoder with a static cache calls SDPA with q [B, Hq, Tq, D]
(Tq = 1, or a few tokens when speculating) over the whole preallocated cache [B, Hkv, L, D] and a
mask [B, 1, Tq, L] built from the cache positions; under torch.export the grouped K/V heads reach
SDPA repeated to q's heads (``repeat_kv``: a copy of the cache per layer), since Hugging Face
passes ``enable_gqa`` only without a mask. SDPA's kernels parallelize over query tiles, so one
query row per head leaves most of the GPU idle while it streams the cache. The bundled op reads
each K/V head once for its whole group of query heads, splits the keys over the SMs, and reads
only the keys before ``kv_len`` when the pass can give it one.

Applies to an SDPA call in an inference graph on a CUDA profile when (legality):
* q, k, v are 4-D bf16/fp16 with static shapes, a head dim of 16-256 (a multiple of 8), at most
  ``MAX_TQ`` query positions, fewer queries than keys (a decode shape, not a prefill), at most
  ``MAX_ROWS`` query rows per key/value head;
* K and V are read at q's heads, grouped with ``enable_gqa``, or repeated by ``repeat_kv`` on both
  (the repeat is dropped: the op groups the heads itself);
* dropout is 0, ``is_causal`` is False (a decode step's causality is in its mask) and the scale a
  number;
* the mask is absent, bool, or float, broadcastable to [B, Hq, Tq, L].

``kv_len`` is passed only when the mask proves it: a bool mask (or ``where(bool, x, -inf)``) that is,
through views, expands and conjunctions, the comparison ``kv_index <= q_position`` (``<``, ``>=``,
``>`` likewise), where ``kv_index`` is ``arange`` over the key dim (plus a literal) and
``q_position`` an integer tensor constant along it (``kv_index`` may be the constant fold_constants
makes of that arange), and nothing on the way is written in place.
Every key past ``max(q_position) + 1`` is then masked out, so ``kv_len = amax(q_position) + 1``
(two tiny kernels, shared by every layer that reads the same mask) bounds the keys read without
changing the answer. Anything else: no kv_len,
the mask alone decides, and the whole cache is read.

Profitability: the op is priced by the cost model (the K/V cache, q, the output, the mask and the
fp32 split partials, at the copy bandwidth; two launches with several splits), plus its share of
the kv_len nodes (split between the layers that read the same mask), against SDPA and the repeat
copies it makes unread. The cache is priced whole: kv_len is a run-time value, so the prediction
is the step at the end of the cache, and what kv_len saves before that is not priced (it never
reads more).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Any, Op, find, get_arg
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from .fuse_attention import _unrepeated

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
PATTERN = Op(SDPA, Any("q"), Any("k"), Any("v"), name="sdpa")

# shape-only steps a mask passes through with key j still at index j of its last dim
_EXPANDS = (aten.expand.default, aten.alias.default, aten.detach.default, aten.clone.default,
            aten.contiguous.default, aten.lift_fresh_copy.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
_ANDS = (aten.bitwise_and.Tensor, aten.logical_and.default, aten.__and__.Tensor, aten.mul.Tensor)
_ADDS = (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
# comparison -> (kv index side, strict): le(kv, q): j <= q; lt: j < q; ge(q, kv), gt(q, kv) the same
_COMPARES = {aten.le.Tensor: (0, False), aten.lt.Tensor: (0, True), aten.ge.Tensor: (1, False),
             aten.gt.Tensor: (1, True)}


def _static(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in shape)
    except TypeError:
        return None


def _shape(node) -> tuple[int, ...] | None:
    ti = ir.info(node) if isinstance(node, fx.Node) else None
    return None if ti is None else _static(ti.shape)


def _int_literal(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def kv_index_offset(node, L: int, depth: int = 8) -> int | None:
    """c when ``node`` holds j + c at index j of its last dim (L long) and nothing else varies:
    ``arange`` over L positions plus literals, through unsqueeze, view, expand and integer casts,
    or a constant (a get_attr, as fold_constants leaves that arange) holding those values; else None."""
    if depth < 0 or not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return _constant_offset(ir.get_attr_value(node.graph.owning_module, node.target), L)
    if node.op != "call_function":
        return None
    ti, shape = ir.info(node), _shape(node)
    if ti is None or shape is None or not shape or shape[-1] != L or ti.dtype.is_floating_point \
            or ti.dtype == torch.bool:
        return None
    t = node.target
    if t is aten.arange.default:
        return 0 if _int_literal(node.args[0]) and node.args[0] == L else None
    if t in (aten.arange.start, aten.arange.start_step):
        start, end = node.args[0], node.args[1]
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        ok = _int_literal(start) and _int_literal(end) and step == 1 and end - start == L
        return start if ok else None
    src = node.args[0] if node.args else None
    src_shape = _shape(src)
    if src_shape is None or not src_shape or src_shape[-1] != L:
        return None
    if t in _ADDS:
        other = node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        if not _int_literal(other) or not _int_literal(alpha):
            return None
        c = kv_index_offset(src, L, depth - 1)
        sign = -1 if t in (aten.sub.Tensor, aten.sub.Scalar) else 1
        return None if c is None else c + sign * alpha * other
    if math.prod(src_shape) != L:  # only one varying dim may carry the index
        return None
    if t is aten.unsqueeze.default or t in _VIEWS or t in _EXPANDS or t in _CASTS:
        return kv_index_offset(src, L, depth - 1)
    return None


def _constant_offset(value, L: int) -> int | None:
    """c when the integer tensor ``value`` [..., L] holds j + c at index j of its last dim everywhere."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[-1] != L or value.is_meta \
            or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        return None  # (a constant on meta has no values to prove anything from)
    d = value.reshape(-1, L).to(torch.int64) - torch.arange(L, device=value.device)
    c = d.flatten()[0]
    return int(c) if bool((d == c).all()) else None


def key_bound(node, L: int, depth: int = 12):
    """``(q_position node, c, comparison node)`` when the mask ``node`` (bool, or additive with -inf
    where it excludes) keeps key j only where j <= max(q_position) + c, proven from its graph (and
    nothing on the way is written in place); else None."""
    path: list = []
    found = _key_bound(node, L, depth, path)
    if found is None:
        return None
    if any(_mutated(n) for n in path + [found[0]]):
        return None
    return found


def _mutated(node: fx.Node) -> bool:
    """Some reader of ``node`` writes into it (an in-place op: the value read later differs)."""
    return any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in node.users)


def _key_bound(node, L: int, depth: int, path: list):
    if depth < 0 or not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    shape = _shape(node)
    if shape is None or not shape or shape[-1] != L:
        return None
    path.append(node)
    t = node.target
    if t in _COMPARES:
        kv_side, strict = _COMPARES[t]
        kv, q = node.args[kv_side], node.args[1 - kv_side]
        qs, qi = _shape(q), (ir.info(q) if isinstance(q, fx.Node) else None)
        if qs is None or qi is None or (qs and qs[-1] != 1) or qi.dtype.is_floating_point or qi.dtype == torch.bool:
            return None
        c = kv_index_offset(kv, L)
        if c is None:
            return None
        # j + c <= q  ->  j <= q - c;  j + c < q  ->  j <= q - c - 1
        return q, -c - (1 if strict else 0), node
    if t in _ANDS:
        if ir.info(node).dtype != torch.bool:
            return None
        for a in node.args[:2]:  # a conjunction keeps a key only where both keep it: either bound holds
            b = _key_bound(a, L, depth - 1, path)
            if b is not None:
                return b
        return None
    if t in (aten.where.self, aten.where.Scalar, aten.where.ScalarOther):  # where(keep, x, -inf): additive
        cond, _, fill = node.args[:3]
        if isinstance(fill, (int, float)) and fill == -math.inf:
            return _key_bound(cond, L, depth - 1, path)
        return None
    if not node.args:
        return None
    src = node.args[0]
    src_shape = _shape(src)
    if src_shape is None or not src_shape or src_shape[-1] != L:
        return None  # broadcast along the keys: the same for every key, no bound
    if t in _EXPANDS or t in _VIEWS:
        return _key_bound(src, L, depth - 1, path)
    if t is aten.unsqueeze.default and node.args[1] % len(shape) != len(shape) - 1:
        return _key_bound(src, L, depth - 1, path)
    if t in _CASTS and ir.info(node).dtype == torch.bool and ir.info(src).dtype == torch.bool:
        return _key_bound(src, L, depth - 1, path)
    return None


@register
class LowerDecodeAttention(Pass):
    name = "lower_decode_attention"
    family = "lower"
    description = ("SDPA of <= 16 query positions over a long K/V cache (bf16/fp16, inference) -> "
                   "graphopt::decode_attention: split-KV Triton kernels, GQA groups read K/V once, kv_len from "
                   "the mask")
    inference_only = True  # the bundled op has no backward
    requires = ("fuse_attention",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        self._bounds: dict = {}  # (q_position node, c, comparison) -> the kv_len node made for it
        matches = [(m, m["sdpa"].name) for m in find(gm, PATTERN)]
        plans = {m["sdpa"]: self._legal(m["sdpa"]) for m, _ in matches} if ctx.fused_kernels else {}
        # every layer reads the same mask: its kv_len nodes are shared, their time split between the readers
        self._sharing: dict = {}
        for _, plan in plans.values():
            if plan is not None and plan["bound"] is not None:
                self._sharing[plan["bound"]] = self._sharing.get(plan["bound"], 0) + 1
        res.consider(ctx, matches, lambda m, label: self._candidate(gm, ctx, m["sdpa"], *plans[m["sdpa"]]))
        return res

    # ------------------------------------------------------------------ legality

    def _legal(self, node):
        """(why not, plan)."""
        from graphopt.cuda_ext.decode_attention_triton import MAX_TQ, argument_problem, decode_shape, kernel_problem

        q, k, v = node.args[0], node.args[1], node.args[2]
        mask = get_arg(node, 3, "attn_mask")
        dropout = get_arg(node, 4, "dropout_p")
        causal = get_arg(node, 5, "is_causal")
        scale = get_arg(node, 6, "scale")
        gqa = bool(get_arg(node, 7, "enable_gqa"))
        qi, ki, vi = (ir.info(x) if isinstance(x, fx.Node) else None for x in (q, k, v))
        if qi is None or ki is None or vi is None:
            return "q, k or v has no tensor metadata", None
        qs, ks, vs = _static(qi.shape), _static(ki.shape), _static(vi.shape)
        if qs is None or ks is None or vs is None:
            return "symbolic shapes (the split count is chosen for one cache length)", None
        if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
            return "q, k and v must be [batch, heads, sequence, head_dim]", None
        if not decode_shape(qs, ks):
            return f"{qs[2]} queries over {ks[2]} keys: not a decode step (at most {MAX_TQ}, fewer than keys)", None
        if dropout not in (None, 0, 0.0):
            return f"dropout {dropout} (the kernel draws no random numbers)", None
        if causal:
            return "is_causal with fewer queries than keys (a decode step's causality is in its mask)", None
        if isinstance(scale, fx.Node):
            return "the scale is a tensor, not a number", None
        removed = []
        if ks[1] != qs[1]:
            if not gqa:
                return f"{qs[1]} query heads over {ks[1]} key heads without enable_gqa", None
        else:
            k0, v0 = _unrepeated(k), _unrepeated(v)
            if k0 is not None and v0 is not None and k0[1] == v0[1] and k0[1] > 1:
                removed = [x for x in (k, v) if len(x.users) == 1]
                removed += [x.args[0] for x in removed] + [x.args[0].args[0] for x in removed]
                k, v = k0[0], v0[0]
                ki, vi = ir.info(k), ir.info(v)
                ks, vs = _static(ki.shape), _static(vi.shape)
        mi = ms = None
        if mask is not None:
            mi = ir.info(mask) if isinstance(mask, fx.Node) else None
            ms = _static(mi.shape) if mi is not None else None
            if mi is None or ms is None:
                return "the mask is not a tensor of static shape", None
        why = argument_problem(qs, ks, vs, qi.dtype, ki.dtype, vi.dtype, ms, None if mi is None else mi.dtype)
        if why is None:
            why = kernel_problem(qs, ks, qi.dtype)
        if why is not None:
            return why, None
        bound = None
        if mask is not None:
            bound = key_bound(mask, ks[2])
        scale = float(qs[3] ** -0.5 if scale is None else scale)
        return "", {"q": q, "k": k, "v": v, "mask": mask, "scale": scale, "bound": bound, "removed": removed,
                    "shape": (qs, ks)}

    # ------------------------------------------------------------------ profitability

    def _candidate(self, gm, ctx, node, why, plan):
        if why:
            return why, None
        from graphopt.cuda_ext.decode_attention_triton import output_layout

        q, k, v, mask, scale, bound = (plan[x] for x in ("q", "k", "v", "mask", "scale", "bound"))
        kv_len_time = 0.0
        if bound is not None:
            qpos, c, _ = bound
            amax = qpos.meta["val"].amax() if isinstance(qpos.meta.get("val"), torch.Tensor) else None
            if amax is None:
                plan["bound"] = bound = None
            else:
                # the two tiny nodes that make kv_len, shared by every layer reading the same mask
                r = ctx.replacement()
                top = r.call(aten.amax.default, qpos, [], val=amax)
                r.call(aten.add.Tensor, top, 1 + c, val=amax)
                kv_len_time = r.time() / self._sharing[bound]
        r = ctx.replacement()
        kv_len = r.tensor((), ir.info(bound[0]).dtype, ir.info(q).device) if bound is not None else None
        args = (q, k, v, mask, kv_len, scale)
        r.call(torch.ops.graphopt.decode_attention.default, *args, val=output_layout(q.meta["val"]))
        new = r.time() + kv_len_time
        old = ctx.node_time([node] + plan["removed"])
        qs, ks = plan["shape"]
        desc = (f"SDPA {qs[0]}x{qs[1]}x{qs[2]} over {ks[1]}x{ks[2]}x{qs[3]} -> decode_attention"
                + (" (kv_len from the mask)" if bound is not None else ""))
        if new >= old:
            return (f"predicted {new * 1e6:.1f} us against SDPA's {old * 1e6:.1f} us"), None
        return "", Candidate(desc, [node], old - new, lambda: self._apply(gm, node, plan), label=node.name)

    # ------------------------------------------------------------------ rewrite

    def _kv_len(self, gm, bound) -> fx.Node:
        """``amax(q_position) + 1 + c``, made once per comparison, right after it (reading
        q_position where the mask reads it)."""
        if bound in self._bounds:
            return self._bounds[bound]
        qpos, c, cmp = bound
        g = gm.graph
        with g.inserting_after(cmp):
            amax = g.call_function(aten.amax.default, (qpos, []))
        with g.inserting_after(amax):
            n = g.call_function(aten.add.Tensor, (amax, 1 + c))
        amax.meta["val"] = qpos.meta["val"].amax()
        n.meta["val"] = amax.meta["val"] + (1 + c)
        self._bounds[bound] = n
        return n

    def _apply(self, gm, node, plan):
        from graphopt.cuda_ext.decode_attention_triton import output_layout

        g = gm.graph
        kv_len = self._kv_len(gm, plan["bound"]) if plan["bound"] is not None else None
        args = (plan["q"], plan["k"], plan["v"], plan["mask"], kv_len, plan["scale"])
        with g.inserting_before(node):
            new = g.call_function(torch.ops.graphopt.decode_attention.default, args)
        new.meta["val"] = output_layout(plan["q"].meta["val"])
        node.replace_all_uses_with(new)
        g.erase_node(node)
        ir.erase_dead(gm, plan["removed"])
        return new
