"""fuse_attention: explicit attention -> ``aten.scaled_dot_product_attention``.

Matched spelling (ATen graphs after eliminate_dead_code + fold_constants)::

    scores = matmul(q, transpose(k, -2, -1))         # or permute swapping the last two dims; either
                                                      # made contiguous (or cloned) first
    scores = scores * c | scores / c | scores         # scale: a literal, a one-element constant, or a
                                                      # constant per score row (moved onto q)
    scores = scores + mask                            # optional additive mask (either operand order)
    p = softmax(scores, -1[, float32])                # softmax.int or _softmax, over the key dim only
    p = p.to(q.dtype)                                 # optional cast back (HF eager_attention_forward)
    p = dropout(p, p_drop, train)                     # optional; refused when it draws random numbers
    out = matmul(p, v)

    -> scaled_dot_product_attention(q, k, v, attn_mask=mask | None, is_causal=..., scale=c | 1/c | 1.0)

* q, k, v are [B, H, S, D] or have more leading batch dims [*L, H, S, D] (MaxViT's [B, G, H, P, D]),
  the same L for all three. With more than one batch dim the SDPA call is 4-D (the fused kernels take
  only that): q, k, v are ``flatten``-ed over L and its output ``unflatten``-ed back; both are reshapes,
  correct for any strides and views where the strides allow (the cost model prices a flatten that
  must copy as a copy). The mask, padded to the scores' rank, is flattened over L alike when it
  broadcasts over all of L or none of it (a view), and expanded over L first (a copy, priced) when it
  broadcasts over part of it. At most one dim of L may be symbolic (unflatten takes one -1).
* An SDPA call itself over more than one batch dim (NesT's [B, H, T, N, D] blocks), which CUDA runs
  in the math kernel (the fused ones take 4-D q, k, v only), is flattened the same way where q, k, v
  share their leading dims and the cost model predicts a gain; where the mask broadcasts over every
  leading dim, one of them is moved to the heads' place first so that flattening the others is a view
  for all three (NesT's [B, H, T, N, D] from one projection: [B, T, H, N, D], B and T merging).
* Attention written with einsum is matched through capture, which spells a batched-matrix-product
  einsum (``"bghid,bghjd->bghij"``, ``"...id,...jd->...ij"``) as ``matmul`` (graphopt.capture_einsum).
* A literal factor q or k is multiplied (or divided) by and that nothing else reads (MaxViT's
  ``k * feat_dim ** -0.5``) goes into SDPA's scale: (c q) k^T = c (q k^T).

* A constant the scores are multiplied by that is one number per score row (last dim 1, e.g. Swin
  V2's per-head logit scale of shape [H, 1, 1], in q's dtype) multiplies q instead, and the scale is
  1: row i of (s q) k^T is s_i (q_i k^T).
* ``repeat_kv`` written as ``reshape(expand(unsqueeze(kv, 2), [B, Hkv, n, S, D]), [B, Hkv*n, S, D])``
  on BOTH K and V is removed and SDPA gets ``enable_gqa=True`` with the un-repeated K/V (SDPA's GQA
  maps query head h to kv head h // n, the same as repeat_kv's expand over a new dim 2). The shapes
  prove it: Hq == Hkv * n.
* K and V of one head broadcast over q's Hq heads (multi-query attention: Falcon's SDPA call, or
  the explicit spelling's matmul broadcasting k): SDPA gets ``enable_gqa=True`` (GQA with n = Hq maps
  every query head to the one K/V head, the broadcast's meaning). CUDA's fused kernels take no
  broadcast, so without it the call runs the math kernel (the cost model prices that:
  ``graphopt.cost.model.sdpa_math_reason``). Existing calls get it under repeat_kv's mask rule below.
* A constant mask (a get_attr buffer, e.g. the causal mask folded by fold_constants, or any subgraph
  of parameters, buffers and literals, e.g. the mask Hugging Face builds from ``arange`` in every
  call, evaluated here at optimization time for the captured shapes) whose VALUE is
  0 on and below the diagonal and <= finfo.min/2 (or -inf) above it, identical over batch and heads,
  with Sq == Sk, is dropped for ``is_causal=True`` (SDPA's causal mask is tril(ones(Sq, Sk)), top-left
  aligned, which for Sq == Sk is the same mask). Any other mask is passed as ``attn_mask`` when it is a
  float tensor of q's dtype broadcastable to [B, H, Sq, Sk] (the add must not broadcast the scores).
  A bool tensor in the additive position adds 0/1 - not a keep-mask - and is refused.
* A constant mask that masks nothing (bool all True, float all 0: Hugging Face's mask functions build
  one under torch.export for an input without padding, where eager passes none) is dropped, in the
  explicit spelling and on existing SDPA calls alike: without a mask the flash kernel can take them.
* Existing ``scaled_dot_product_attention`` calls (torchvision's MultiheadAttention) whose attn_mask
  is such a constant causal mask are rewritten to ``is_causal=True`` without the mask; the mask and
  the nodes that built it are erased.

Dtype: HF computes ``softmax(scores, dtype=float32).to(q.dtype)``; SDPA (math, flash,
memory-efficient and cuDNN backends, and the CPU's fused kernel) accumulates the softmax in fp32 for
bf16/fp16 inputs and rounds the probabilities to q's dtype before the PV product (or keeps them in
fp32), so it is at least as precise as the explicit spelling. A softmax without the dtype (BERT in
bf16) computes in bf16; SDPA is more precise. The pass checks that the output dtype equals q's.

Refused, with the reason recorded: softmax over another dim; scores or probabilities read outside
the pattern (e.g. attention weights returned by ``output_attentions``); masks of unsupported
shape/dtype; a scale that is not a literal or one-element constant; dropout that is active (rng);
q/k/v with fewer than 4 dims, of different ranks or batch dims (matmul would broadcast them), or whose
shapes do not line up; more than one symbolic batch dim; a mask broadcast over part of a symbolic L.

Cost: SDPA does not materialize the S x S scores; its bytes are q, k, v, mask and the output (the cost
model's ATTENTION_OPS rule), its FLOPs 4*B*H*Sq*Sk*D (halved when causal). The gain is the predicted
time of the matched nodes (both matmuls, scale, mask add, softmax, cast, the repeat_kv copies, a
folded operand scale) minus that of the SDPA node and any flatten/expand around it, estimated by
building them in a scratch graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.matcher import Alt, Any, Attr, Const, Match, Op, find
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register
from ._fusion_meta import GraphBuilder, set_meta
from .fold_constants import Constants, constant_value

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
ASSERT_META = aten._assert_tensor_metadata.default
SOFTMAXES = (aten.softmax.int, aten._softmax.default)
CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
# torch 2.14's memory-efficient SDPA kernel takes GQA (Hq = n * Hkv, enable_gqa=True) with a mask
_MASKED_GQA_KERNEL = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def _masked_gqa_kernel(ctx) -> bool:
    """Does a fused SDPA kernel take GQA with a mask where the graph runs: torch >= 2.14's memory-
    efficient kernel, or on sm_90 and newer cuDNN's attention, which torch 2.11 picks there
    (benchmarks/diag/diag_sdpa_broadcast.py: 0.032 ms against the math kernel's 0.342)."""
    return _MASKED_GQA_KERNEL or (ctx.cost.device_kind == "cuda" and ctx.cost.compute_capability >= (9, 0))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _repeat_kv(prefix: str):
    """HF repeat_kv: kv[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv*n, S, D)."""
    return Op(RESHAPES,
              Op(aten.expand.default,
                 Op(aten.unsqueeze.default, Any(f"{prefix}_kv"), Any(f"{prefix}_unsq_dim"), name=f"{prefix}_unsq"),
                 Any(), name=f"{prefix}_expand"),
              Any(), name=f"{prefix}_rep")


_K = Alt(_repeat_kv("k"), Any("k"))
_V = Alt(_repeat_kv("v"), Any("v"))
_KT_VIEW = Alt(Op(aten.transpose.int, _K, Any("kt_d0"), Any("kt_d1"), name="kt", single_use=False),
               Op(aten.permute.default, _K, Any("kt_perm"), name="kt", single_use=False))
# K^T made contiguous first (GC ViT's window attention): the same values, SDPA reads K as it is
_KT = Alt(Op((aten.contiguous.default, aten.clone.default), _KT_VIEW, name="kt_copy", single_use=False), _KT_VIEW)
_QK = Op(aten.matmul.default, Any("q"), _KT, name="qk", single_use=False)
_SCALED = Alt(
    Op(aten.mul.Tensor, _QK, Const("scale_mul", pred=_number), name="scale_op", single_use=False),
    Op((aten.div.Tensor, aten.div.Scalar), _QK, Const("scale_div", pred=_number), name="scale_op", single_use=False),
    Op(aten.mul.Tensor, _QK, Attr("scale_mul_t"), name="scale_op", single_use=False, commutative=True),
    Op(aten.div.Tensor, _QK, Attr("scale_div_t"), name="scale_op", single_use=False),
    _QK,
)
_MASKED = Alt(Op(aten.add.Tensor, _SCALED, Any("mask"), name="mask_add", single_use=False, commutative=True),
              _SCALED)
# shifted-window attention (Swin): the scores' batch dim split into [windows of an image, image]
# for a mask per window position, then merged back
_WINDOWED = Op(RESHAPES, Op(aten.add.Tensor, Op(RESHAPES, _MASKED, Any("win_shape"), name="win_split",
                                                 single_use=False),
                            Any("win_mask"), name="win_add", single_use=False, commutative=True),
               Any(), name="win_merge", single_use=False)
_SOFTMAX = Op(SOFTMAXES, Alt(_WINDOWED, _MASKED), Any("dim"), name="softmax", single_use=False)
_PROBS = Alt(Op(CASTS, _SOFTMAX, name="cast", single_use=False), _SOFTMAX)
_DROPPED = Alt(
    Op(aten.dropout.default, _PROBS, Any("p_drop"), Any("train"), name="dropout", single_use=False),
    Op(operator.getitem, Op(aten.native_dropout.default, _PROBS, Any("p_drop"), Any("train"),
                            name="dropout", single_use=False), Const(value=0), name="dropout_item", single_use=False),
    _PROBS,
)
PATTERN = Op(aten.matmul.default, _DROPPED, _V, name="pv")

# an SDPA call that already exists, with a constant mask
SDPA_PATTERN = Op(SDPA, Any("q"), Any("k"), Any("v"), Any("mask"), name="sdpa")


class Refuse(Exception):
    pass


def _shape(node) -> tuple:
    ti = ir.info(node) if isinstance(node, fx.Node) else None
    if ti is None:
        raise Refuse(f"{getattr(node, 'name', node)} has no tensor metadata")
    return ti.shape


def is_causal_mask(value: torch.Tensor) -> bool:
    """True when ``value`` (..., L, L) is a causal mask for every leading index: bool tril(ones), or
    float 0 on/below the diagonal and -inf or <= finfo.min/2 above it."""
    if value.dim() < 2 or value.shape[-1] != value.shape[-2] or value.shape[-1] < 1:
        return False
    n = value.shape[-1]
    tri = torch.ones(n, n, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool(value[..., tri].all()) and not bool(value[..., ~tri].any())
    if not value.is_floating_point():
        return False
    lo, up = value[..., tri], value[..., ~tri]
    thr = torch.finfo(value.dtype).min / 2
    return bool((lo == 0).all()) and bool(((up <= thr) | (up == float("-inf"))).all())


def masks_nothing(value: torch.Tensor) -> bool:
    """True when ``value`` as an SDPA attn_mask changes nothing: bool all True (every position kept)
    or float all 0 (nothing added to the scores). Hugging Face's mask functions build such a mask
    under torch.export for an input without padding, where eager passes no mask."""
    if value.numel() == 0:
        return False
    if value.dtype == torch.bool:
        return bool(value.all())
    return value.is_floating_point() and not bool(value.any())


# shape/dtype-only ops through which a constant mask is still a constant (fold_constants may leave
# e.g. ``buffer.to(x.dtype)`` when the cast is a no-op)
_CONST_THROUGH = CASTS + (aten.alias.default, aten.detach.default, aten.clone.default, aten.expand.default,
                          aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.contiguous.default)


def _const_value(gm, node, depth=4, memo: dict | None = None, consts: Constants | None = None):
    """The value of ``node`` if it is a get_attr, a cast/view chain of one, or any subgraph of
    parameters, buffers and literals (a causal mask the model builds from ``arange`` in every call,
    which fold_constants leaves unfolded rather than store it); else None (also for a buffer the
    graph writes in place, such as a cache). ``memo``: values already computed in this pass (every
    layer reads the same mask); ``consts``: the graph's constant analysis."""
    if not isinstance(node, fx.Node):
        return None
    consts = consts or Constants(gm)
    if memo is not None:
        if node not in memo:
            memo[node] = _const_value(gm, node, depth, consts=consts)
        return memo[node]
    if node not in consts.const or consts.written_after(node):
        return None
    if node.op == "get_attr":
        v = ir.get_attr_value(gm, node.target)
        return v if isinstance(v, torch.Tensor) else None
    if depth > 0 and node.op == "call_function" and node.target in _CONST_THROUGH:
        src = _const_value(gm, node.args[0], depth - 1, consts=consts)
        if src is not None and all(a is node.args[0] for a in node.all_input_nodes):
            with torch.no_grad():
                return node.target(src, *node.args[1:], **node.kwargs)
    return constant_value(gm, node, consts=consts)


def _erase_unread(gm, node) -> None:
    """Erase ``node`` and then each input it leaves unread (a dropped mask's whole subgraph)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and n.op in ("get_attr", "call_function") and not n.users and n.graph is gm.graph:
            ins = n.all_input_nodes
            gm.graph.erase_node(n)
            stack.extend(ins)


def _row_scale(t: torch.Tensor, qs, scores_shape, dtype) -> bool:
    """``t`` multiplies each score row by one number (its last dim 1, the rest broadcasting into the
    scores' dims) and ``q * t`` has q's shape and dtype."""
    shape = tuple(t.shape)
    return (t.dtype == dtype and 1 <= len(shape) <= len(qs) and shape[-1] == 1
            and _broadcastable(shape, tuple(scores_shape)) and _broadcastable(shape, tuple(qs)))


def _broadcastable(mshape, target) -> bool:
    if len(mshape) > len(target):
        return False
    return all(m == 1 or m == t for m, t in zip(reversed(mshape), reversed(target)))


@register
class FuseAttention(Pass):
    name = "fuse_attention"
    family = "fusion"
    description = "explicit matmul-scale-mask-softmax-matmul attention -> scaled_dot_product_attention (GQA, causal)"
    inference_only = False  # SDPA is differentiable; active dropout is refused per match

    def _mask_kind(self, value: torch.Tensor) -> str | None:
        """"empty" (masks nothing), "causal", or None (a mask that stays), judged once per mask value."""
        hit = self._kinds.get(id(value))
        if hit is None or hit[0] is not value:
            kind = "empty" if masks_nothing(value) else "causal" if is_causal_mask(value) else None
            hit = self._kinds[id(value)] = (value, kind)
        return hit[1]

    def _mask_value(self, gm, mask, ctx):
        """``mask``'s constant value (None: not a constant). In a training graph a mask computed from
        a trainable parameter is not a constant, whatever its value now (BEiT's relative position
        bias starts at zero): dropping it would drop that parameter's gradient."""
        value = _const_value(gm, mask, memo=self._masks, consts=self._constants(gm))
        if value is not None and ctx.training and self._constants(gm).trainable_sources(mask):
            return None
        return value

    def _constants(self, gm) -> Constants:
        if self._consts is None:
            self._consts = Constants(gm)
        return self._consts

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        self._masks: dict = {}
        self._consts = None  # Constants of the graph before this pass rewrites anything, made when needed
        self._kinds: dict = {}  # id(mask value) -> (value, _mask_kind): every layer reads the same mask
        candidates, explained = [], set()
        for m in _find_unchecked(gm, PATTERN):
            explained.add(m["softmax"])
            try:
                plan = self._plan(gm, m, ctx)
            except Refuse as e:
                res.reject(f"attention at {m['softmax'].name}", str(e))
                continue
            gain = ctx.node_time(plan["removed"]) - self._replacement_time(ctx, plan)
            candidates.append(Candidate(
                "attention->sdpa" + ("+gqa" if plan["gqa"] else "") + ("+causal" if plan["causal"] else "")
                + (f"+batch dims flattened ({plan['rank']}-D)" if plan["flat"] else ""),
                plan["removed"], gain, lambda p=plan: self._apply(gm, p),
                label=f"attention {m['qk'].name}..{m['pv'].name}"))
        causal_folds = []
        for m in find(gm, SDPA_PATTERN):
            sd = m["sdpa"]
            if _kwarg(sd, 5, "is_causal", False) or not isinstance(m["mask"], fx.Node):
                continue
            try:
                value = self._mask_value(gm, m["mask"], ctx)
                if value is None:
                    raise Refuse("its mask is computed from the inputs or trained parameters; kept as attn_mask")
                qs, ks, outs = _shape(m["q"]), _shape(m["k"]), _shape(sd)
                if not _broadcastable(tuple(value.shape), tuple(outs[:-1]) + (ks[-2],)):
                    raise Refuse(f"its constant mask {tuple(value.shape)} does not broadcast to the scores; kept")
                kind = self._mask_kind(value)
                causal = kind != "empty"
                if causal and not (kind == "causal" and value.shape[-1] == ks[-2] == qs[-2]):
                    raise Refuse("its constant mask is neither empty nor a causal mask for these shapes; kept as "
                                 "attn_mask")
            except Refuse as e:
                res.reject(f"sdpa {sd.name}", str(e))
                continue
            plan = {"kind": "sdpa", "node": sd, "causal": causal}
            new_args = (sd.args[0], sd.args[1], sd.args[2], None, _kwarg(sd, 4, "dropout_p", 0.0), causal)
            gain = ctx.node_time([sd]) - self._time_of(ctx, sd, new_args, _sdpa_kwargs(sd))
            causal_folds.append(Candidate("sdpa constant causal mask->is_causal" if causal else
                                          "sdpa constant mask that masks nothing->no mask", [sd], gain,
                                          lambda p=plan: self._apply_sdpa(gm, p), label=f"sdpa {sd.name}"))
        # softmaxes that look like attention but did not match are reported, not silently ignored
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in SOFTMAXES and n not in explained:
                why = self._diagnose(n)
                if why:
                    res.reject(f"softmax {n.name}", why)
        res.apply_ranked(ctx, candidates)
        # the same SDPA without reading the mask (and with the causal half of the FLOPs) is never
        # slower, also where launch-bound (a zero predicted gain); without a mask the flash kernel can
        # take it
        res.apply_ranked(ctx, causal_folds, allow_zero_gain=True)
        # an SDPA reading K and V repeated to q's heads (repeat_kv: unsqueeze, expand, reshape)
        # reads the un-repeated K/V with enable_gqa=True instead (as eager's SDPA call does): the
        # repeat's copies go, and the backward neither saves them nor reduces their gradients.
        # Mask-free SDPAs (the flash kernel's GQA path); masked ones where a fused kernel takes
        # GQA with a mask (memory-efficient attention, torch >= 2.14; cuDNN's on sm_90) or for one query row (a
        # decode step against a KV cache: the math kernel's own K/V repeat is what repeat_kv's
        # copies cost, and the graph keeps q [B, H, 1, D] against the cache itself)
        # an SDPA call over more than one batch dim ([*L, H, S, D], NesT's blocks): the fused kernels
        # take 4-D q, k, v only, so CUDA runs it in the math kernel; flattened over L it is the 4-D call
        # the spellings above become
        res.apply_ranked(ctx, self._flatten_sdpa_candidates(gm, ctx, res))
        unrepeats = []
        masked_gqa = _masked_gqa_kernel(ctx)
        for sd in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]:
            if sd.kwargs.get("enable_gqa", False):
                continue
            if _kwarg(sd, 3, "attn_mask", None) is not None and not (
                    masked_gqa or (ir.info(sd.args[0]) is not None and ir.info(sd.args[0]).shape[-2] == 1)):
                if _broadcast_heads(sd):  # (a repeat_kv'd call still runs a fused kernel: nothing to say)
                    res.reject(f"sdpa {sd.name}", "K/V of one head broadcast over q's heads with a mask: no fused "
                                                  f"kernel takes masked GQA on {ctx.cost.device_name} before torch "
                                                  "2.14, so SDPA's math kernel runs it")
                continue
            k0, v0 = _unrepeated(sd.args[1]), _unrepeated(sd.args[2])
            if (k0 is None or v0 is None) and _broadcast_heads(sd):
                # K/V of one head broadcast over q's heads (multi-query attention): SDPA's GQA with
                # n = Hq reads the same K/V for every query head, and a fused kernel takes it
                new_args = tuple(sd.args)
                kwargs = dict(_sdpa_kwargs(sd), enable_gqa=True)
                gain = ctx.node_time([sd]) - self._time_of(ctx, sd, new_args, kwargs)
                plan = {"node": sd, "k": sd.args[1], "v": sd.args[2]}
                unrepeats.append(Candidate("sdpa K/V broadcast over heads->enable_gqa", [sd], gain,
                                           lambda p=plan: self._apply_gqa(gm, p), label=f"sdpa {sd.name}"))
                continue
            if k0 is None or v0 is None or k0[1] != v0[1] or _shape(k0[0])[1] * k0[1] != _shape(sd.args[0])[1]:
                continue
            plan = {"node": sd, "k": k0[0], "v": v0[0]}
            new_args = (sd.args[0], k0[0], v0[0]) + tuple(sd.args[3:])
            kwargs = dict(_sdpa_kwargs(sd), enable_gqa=True)
            gain = ctx.node_time([sd, sd.args[1], sd.args[2]]) - self._time_of(ctx, sd, new_args, kwargs)
            unrepeats.append(Candidate("sdpa repeated K/V->enable_gqa", [sd], gain,
                                       lambda p=plan: self._apply_gqa(gm, p), label=f"sdpa {sd.name}"))
        res.apply_ranked(ctx, unrepeats, allow_zero_gain=True)
        return res

    def _flatten_sdpa_candidates(self, gm, ctx, res) -> list[Candidate]:
        out = []
        for sd in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]:
            q, k, v = sd.args[:3]
            infos = [ir.info(t) if isinstance(t, fx.Node) else None for t in (q, k, v)]
            if any(i is None for i in infos) or len(infos[0].shape) <= 4:  # (a call this pass made is 4-D)
                continue
            shapes = [i.shape for i in infos]
            try:
                if any(len(sh) != len(shapes[0]) or tuple(sh[:-3]) != tuple(shapes[0][:-3]) for sh in shapes[1:]):
                    raise Refuse(f"q, k, v of leading dims {[tuple(sh[:-3]) for sh in shapes]}: not one batch to flatten")
                if _kwarg(sd, 4, "dropout_p", 0.0) != 0.0:
                    raise Refuse("dropout draws random numbers")
                mask = _kwarg(sd, 3, "attn_mask", None)
                plan = {"q": q, "k": k, "v": v, "mask": mask, "causal": bool(_kwarg(sd, 5, "is_causal", False)),
                        "scale": sd.kwargs.get("scale"), "gqa": bool(sd.kwargs.get("enable_gqa", False)),
                        "flat": self._flattening(tuple(shapes[0]), mask), "root": sd, "removed": [sd],
                        "dropped_mask": None}
                perm = _view_flattening(infos) if mask is None or len(_shape(mask)) <= 2 else None
                if perm is not None:  # one leading dim as the heads, the rest flattened as a view
                    plan["flat"] = dict(plan["flat"], perm=perm,
                                        lead=[shapes[0][d] for d in perm[:len(shapes[0]) - 3]])
            except Refuse as e:
                res.reject(f"sdpa {sd.name}", f"{len(shapes[0])}-D, not flattened: {e}")
                continue
            gain = ctx.node_time([sd]) - self._replacement_time(ctx, plan)
            out.append(Candidate(f"{len(shapes[0])}-D sdpa->4-D sdpa over the batch dims flattened", [sd], gain,
                                 lambda p=plan: self._apply(gm, p), label=f"sdpa {sd.name}"))
        return out

    # ------------------------------------------------------------------ analysis

    def _plan(self, gm, m: Match, ctx: PassContext) -> dict:
        qk, sm, pv = m["qk"], m["softmax"], m["pv"]
        q = m["q"]
        qs = _shape(q)
        rank = len(qs)
        if rank < 4:
            raise Refuse(f"q {q.name} is {rank}-D; attention is rewritten for [B, H, S, D] or more leading batch dims")
        qi = ir.info(q)
        if not qi.dtype.is_floating_point:
            raise Refuse(f"q has dtype {qi.dtype}")
        # the K transpose swaps exactly the last two dims, or is a permute of K's source: K [.., S, D]
        # is then that source permuted by the same order with its last two entries swapped (a view),
        # e.g. heads split from [B, S, H, D] and permuted straight to [B, H, D, S] (LeViT)
        kt, k_perm = m["kt"], None
        if kt.target is aten.transpose.int:
            dims = sorted(d % rank for d in (m["kt_d0"], m["kt_d1"]))
            if dims != [rank - 2, rank - 1]:
                raise Refuse(f"{kt.name} transposes dims {dims}, not the last two")
        elif list(d % rank for d in m["kt_perm"]) != list(range(rank - 2)) + [rank - 1, rank - 2]:
            perm = [d % rank for d in m["kt_perm"]]
            if m.get("k_rep") is not None or len(perm) != rank:
                raise Refuse(f"{kt.name} permutes {list(m['kt_perm'])}, not a swap of the last two dims")
            k_perm = perm[:-2] + [perm[-1], perm[-2]]
        # softmax over the key dim, in q's dtype or fp32
        dim = m["dim"]
        if not isinstance(dim, int) or dim % rank != rank - 1:
            raise Refuse(f"softmax {sm.name} is over dim {dim}, not the last (key) dim")
        sm_dtype = ir.info(sm).dtype
        if sm_dtype not in (qi.dtype, torch.float32):
            raise Refuse(f"softmax {sm.name} computes in {sm_dtype}")
        probs = m.get("cast") or sm
        if ir.info(probs).dtype != qi.dtype or ir.info(probs).device != qi.device:
            raise Refuse(f"the probabilities are {ir.info(probs).dtype}, q is {qi.dtype}")
        if ir.info(pv).dtype != qi.dtype:
            raise Refuse(f"the output is {ir.info(pv).dtype}, q is {qi.dtype}")
        # dropout
        if m.get("dropout") is not None:
            p, train = m["p_drop"], m["train"]
            if train is not False and p != 0:
                raise Refuse(f"dropout {m['dropout'].name} (p={p}) is active: it draws random numbers "
                             "(rng) that SDPA's fused dropout would not reproduce")
        # K / V and GQA
        k_rep, v_rep = m.get("k_rep"), m.get("v_rep")
        repeat_nodes = [m.get(f"{p}_{x}") for p in "kv" for x in ("rep", "expand", "unsq")]
        repeat_nodes = [n for n in repeat_nodes if n is not None]
        gqa = unrepeated = False
        if k_rep is not None and v_rep is not None:
            k, v = m["k_kv"], m["v_kv"]
            n_k, n_v = self._repeat_factor(m, "k"), self._repeat_factor(m, "v")
            if n_k is None or n_v is None or n_k != n_v:
                k, v = k_rep, v_rep
            else:
                hkv = _shape(k)[1]
                if qs[1] % hkv != 0 or hkv * n_k != qs[1]:
                    raise Refuse(f"GQA needs Hq % Hkv == 0 and Hq == Hkv * n_rep; got Hq={qs[1]}, Hkv={hkv}, n_rep={n_k}")
                gqa, unrepeated = hkv != qs[1], True
        else:
            k = k_rep if k_rep is not None else m["k"]
            v = v_rep if v_rep is not None else m["v"]
        ks, vs = _shape(k), _shape(v)
        if k_perm is not None:
            ks = [ks[d] for d in k_perm]
        if len(ks) != rank or len(vs) != rank:
            raise Refuse(f"q is {rank}-D, k {len(ks)}-D, v {len(vs)}-D")
        lead = tuple(qs[:-3])
        if tuple(ks[:-3]) != lead or tuple(vs[:-3]) != lead:
            raise Refuse(f"the batch dims of q {qs}, k {ks}, v {vs} differ (matmul broadcasts them, SDPA's kernels "
                         "take them equal)")
        if ks[-1] != qs[-1] or ks[-2] != vs[-2] or ks[-3] != vs[-3]:
            raise Refuse(f"shapes do not line up: q {qs}, k {ks}, v {vs}")
        if not gqa and ks[-3] != qs[-3] and rank == 4 and ks[-3] == vs[-3] == 1:
            gqa = True  # one K/V head broadcast over q's heads (multi-query): GQA with n = Hq
        if not gqa and ks[-3] != qs[-3]:
            raise Refuse(f"q has {qs[-3]} heads, k/v {ks[-3]} (not a repeat_kv spelling)")
        for t in (k, v):
            if ir.info(t).dtype != qi.dtype:
                raise Refuse(f"{t.name} is {ir.info(t).dtype}, q is {qi.dtype}")
        scores_shape = _shape(qk)
        if tuple(scores_shape) != tuple(qs[:-1]) + (ks[-2],) or tuple(_shape(pv)) != tuple(qs[:-1]) + (vs[-1],):
            raise Refuse(f"scores {scores_shape} / output {_shape(pv)} do not line up with q {qs}, k {ks}, v {vs}")
        # scale: on the scores, and a literal factor q or k was multiplied by just for this product
        scale, q_scale = self._scale(gm, m, qs, scores_shape, qi.dtype)
        inside = set(m.nodes)
        q, q_factor, q_mul = _scaled_operand(q, inside, qi.dtype)
        k, k_factor, k_mul = _scaled_operand(k, inside, qi.dtype)
        scale = scale * q_factor * k_factor
        if scale == 0:
            raise Refuse("the scale is 0")
        # mask
        mask, causal, dropped = None, False, None
        if m.get("mask_add") is not None:
            add = m["mask_add"]
            if add.kwargs.get("alpha", 1) != 1:
                raise Refuse(f"mask add {add.name} has alpha={add.kwargs['alpha']}")
            mask = m["mask"]
            if not isinstance(mask, fx.Node) or ir.info(mask) is None:
                raise Refuse(f"the mask {mask!r} is not a tensor")
            mi = ir.info(mask)
            if mi.dtype == torch.bool:
                raise Refuse(f"mask {mask.name} is bool in an additive position (adds 0/1, not a keep-mask)")
            if mi.dtype != qi.dtype:
                raise Refuse(f"mask {mask.name} is {mi.dtype}, q is {qi.dtype} (the add would change precision)")
            if tuple(_shape(add)) != tuple(scores_shape) or not _broadcastable(mi.shape, scores_shape):
                raise Refuse(f"mask {mask.name} of shape {mi.shape} does not broadcast to the scores {scores_shape}")
            value = self._mask_value(gm, mask, ctx)
            if value is not None:
                kind = self._mask_kind(value)
                if kind == "empty":
                    mask, dropped = None, mask
                elif kind == "causal" and qs[-2] == ks[-2] and value.shape[-1] == ks[-2] and value.shape[-2] == qs[-2]:
                    mask, causal, dropped = None, True, mask
        window = self._window(gm, m, qs, scores_shape, mask, gqa) if m.get("win_add") is not None else None
        if window is not None:
            mask = None
        flat = self._flattening(qs, mask) if rank > 4 else None
        # nodes reading the scores / probabilities outside the pattern
        asserts = []
        for n in m.nodes[1:]:
            for u in n.users:
                if u in inside:
                    continue
                if u.target is ASSERT_META:
                    asserts.append(u)
                    continue
                what = "attention probabilities" if n in (sm, m.get("cast"), m.get("dropout"), m.get("dropout_item")) \
                    else "attention scores" if n in (qk, m.get("scale_op"), m.get("mask_add"), m.get("win_split"),
                                                     m.get("win_add"), m.get("win_merge")) \
                    else "transposed K" if n in (kt, m.get("kt_copy")) else "repeated K/V"
                raise Refuse(f"the {what} {n.name} are also read by {u.name} (e.g. output_attentions); "
                             "SDPA does not produce them")
        removed = [n for n in m.nodes if unrepeated or n not in repeat_nodes] + asserts
        removed += [n for n in dict.fromkeys((q_mul, k_mul)) if n is not None]
        return {"kind": "explicit", "q": q, "k": k, "k_perm": k_perm, "v": v, "mask": mask, "causal": causal, "scale": scale,
                "q_scale": q_scale, "window": window, "gqa": gqa, "root": pv, "removed": removed, "dropped_mask": dropped, "rank": rank, "flat": flat}

    @staticmethod
    def _window(gm, m: Match, qs, scores_shape, mask, gqa) -> dict:
        """The shifted-window spelling: scores [B, H, S, S'] viewed as [B/W, W, H, S, S'], a mask per
        window position added ([W, S, S'] broadcasting, the same for every image), viewed back. SDPA
        runs it with the W windows of an image as heads: q, k, v [B, H, S, D] reshaped to
        [B/W, W*H, S, D] (row b*W+w of the batch is window w of image b, so its heads are heads
        w*H..w*H+H-1), and one mask [1, W*H, S, S'], the window mask plus the additive term before
        the split (which must not vary over B), broadcast over the images."""
        if len(qs) != 4 or gqa:
            raise Refuse("a windowed mask on attention that is not [B, H, S, D] with as many K/V heads as q's")
        split, add, merge = m["win_split"], m["win_add"], m["win_merge"]
        b, h, sq, sk = (int(d) if isinstance(d, int) else None for d in scores_shape)
        s5 = _shape(split)
        if None in (b, h, sq, sk) or len(s5) != 5 or tuple(s5[2:]) != (h, sq, sk) or s5[0] * s5[1] != b:
            raise Refuse(f"the scores {tuple(scores_shape)} are viewed as {tuple(s5)}, not their batch dim split "
                         "in two")
        if tuple(_shape(merge)) != tuple(scores_shape) or tuple(_shape(add)) != tuple(s5):
            raise Refuse(f"the windowed scores are not viewed back to {tuple(scores_shape)}")
        wm = m["win_mask"]
        if not isinstance(wm, fx.Node) or ir.info(wm) is None or ir.info(wm).dtype != ir.info(m["q"]).dtype:
            raise Refuse(f"the window mask {getattr(wm, 'name', wm)!r} is not a tensor of q's dtype")
        ws = (1,) * (5 - len(ir.info(wm).shape)) + tuple(ir.info(wm).shape)
        if len(ws) != 5 or ws[0] != 1 or not _broadcastable(ws, s5):
            raise Refuse(f"the window mask {tuple(ir.info(wm).shape)} varies over the images or does not broadcast "
                         f"to {tuple(s5)}")
        inner = None
        if mask is not None:
            ms = (1,) * (4 - len(ir.info(mask).shape)) + tuple(ir.info(mask).shape)
            if len(ms) != 4 or ms[0] != 1:
                raise Refuse(f"the mask {mask.name} {tuple(ir.info(mask).shape)} before the window split varies "
                             "over the batch")
            inner = (mask, list(ms))
        return {"windows": int(s5[1]), "images": int(s5[0]), "heads": h, "mask": wm, "mask5": list(ws),
                "inner": inner, "scores": [b, h, sq, sk]}

    @staticmethod
    def _flattening(qs: tuple, mask) -> dict:
        """How a [*L, H, S, D] attention (len(L) > 1) runs as one 4-D SDPA: q, k, v and the output
        flattened over L (``flatten``/``unflatten``: correct for any strides, views where the
        strides allow), the mask flattened alike (a view where it broadcasts over all of L or none
        of it; expanded over L first, a copy, where it broadcasts over some of L)."""
        rank, lead = len(qs), tuple(qs[:-3])
        symbolic = [d for d in lead if not isinstance(d, int)]
        if len(symbolic) > 1:
            raise Refuse(f"{len(symbolic)} of the batch dims {lead} are symbolic; unflattening the output needs "
                         "all but one known")
        flat = {"end": rank - 4, "lead": [d if isinstance(d, int) else -1 for d in lead],
                "mask_expand": None, "mask_end": None}
        if mask is None:
            return flat
        ms = tuple(_shape(mask))
        mlead = (1,) * (rank - len(ms)) + ms[:-3] if len(ms) > 3 else (1,) * (rank - 3)
        if all(d == 1 for d in mlead) or mlead == lead:  # broadcast over all of L, or none of it: a view
            if len(ms) > 4:
                flat["mask_end"] = len(ms) - 4
            return flat
        if symbolic:
            raise Refuse(f"the mask {mask.name} {ms} broadcasts over some of the batch dims {lead}; expanding it "
                         "over them needs their sizes known")
        flat["mask_expand"] = list(lead) + [-1, -1, -1]
        flat["mask_end"] = rank - 4
        return flat

    @staticmethod
    def _repeat_factor(m: Match, p: str):
        kv, unsq, exp, rep = m[f"{p}_kv"], m[f"{p}_unsq"], m[f"{p}_expand"], m[f"{p}_rep"]
        try:
            s, es, rs = _shape(kv), _shape(exp), _shape(rep)
        except Refuse:
            return None
        if len(s) != 4 or m[f"{p}_unsq_dim"] % 5 != 2 or len(es) != 5:
            return None
        b, h, n, sl, d = es
        if (b, h, sl, d) != tuple(s) or tuple(rs) != (b, h * n, sl, d):
            return None
        return n

    @staticmethod
    def _scale(gm, m: Match, qs, scores_shape, dtype) -> tuple[float, fx.Node | None]:
        """(SDPA's scale, a constant to multiply q by or None). A constant factor of the scores that
        is the same along the key dim (last dim 1: Swin V2's per-head logit scale, [H, 1, 1]) scales
        each score row, so it scales q's row instead: (s q) k^T = s (q k^T) row by row. It must be
        q's dtype (a wider one would widen q) and broadcast into q without growing it."""
        if m.get("scale_mul") is not None:
            return float(m["scale_mul"]), None
        if m.get("scale_div") is not None:
            return 1.0 / float(m["scale_div"]), None
        for key, inv in (("scale_mul_t", False), ("scale_div_t", True)):
            if m.get(key) is not None:
                t = ir.get_attr_value(gm, m[key].target)
                if isinstance(t, torch.Tensor) and t.numel() == 1:
                    val = float(t.item())
                    if val == 0:
                        raise Refuse("the scale is 0")
                    return (1.0 / val if inv else val), None
                if isinstance(t, torch.Tensor) and not inv and _row_scale(t, qs, scores_shape, dtype):
                    return 1.0, m[key]
                raise Refuse(f"the scale {m[key].name} is not a one-element constant nor one per score row "
                             f"of q's dtype (its shape {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}, "
                             f"the scores' {tuple(scores_shape)})")
        if m.get("scale_op") is not None:
            raise Refuse(f"the scale {m['scale_op'].name} cannot be read as a constant")
        return 1.0, None

    def _diagnose(self, sm: fx.Node) -> str:
        dim = sm.args[1] if len(sm.args) > 1 else None
        nd = len(_shape(sm)) if ir.info(sm) is not None else None
        consumers = [u for u in sm.users if u.target is not ASSERT_META]
        frontier, seen = list(consumers), set()
        matmuls = []
        while frontier:
            u = frontier.pop()
            if u in seen:
                continue
            seen.add(u)
            if u.target in (aten.matmul.default, aten.bmm.default, aten.einsum.default):
                matmuls.append(u)
            elif u.target in CASTS + (aten.dropout.default, aten.native_dropout.default, operator.getitem):
                frontier.extend(u.users)
        if not matmuls:
            return ""  # a softmax that is not attention (classifier head, router): nothing to say
        if isinstance(dim, int) and nd and dim % nd != nd - 1:
            return f"softmax over dim {dim}, not the last (key) dim: not SDPA's attention"
        if len(consumers) > 1:
            return (f"the attention probabilities {sm.name} are read {len(consumers)} times "
                    f"({', '.join(u.name for u in consumers)}); SDPA does not produce them")
        for mm in matmuls:
            if mm.target is aten.einsum.default:
                return (f"the probabilities are multiplied by einsum {mm.name} {mm.args[0]!r}, not a batched matrix "
                        "product (capture keeps it as einsum; its notes say why)")
            mt = Match(root=mm)
            if not PATTERN.match(mm, mt):
                return f"not the matmul-scale-mask-softmax-matmul spelling at {mm.name}: {mt.why}"
        return "not the matmul-scale-mask-softmax-matmul spelling"

    # ------------------------------------------------------------------ cost

    def _replacement_time(self, ctx, plan) -> float:
        """The rewrite's predicted time; its SDPA call at lower_attention's price where that pass is
        scheduled and would take it (TNT's 16-pixel heads: SDPA's programs cost far more than the
        one-tile kernel's)."""
        r = ctx.replacement()
        _emit(r, plan)
        t = r.time()
        if "lower_attention" in ctx.scheduled:
            from .lower_attention import lowered_time

            for n in r.nodes:
                if n.target is SDPA:
                    lowered = lowered_time(ctx, n)
                    if lowered is not None:
                        t = t - ctx.node_time([n]) + lowered
        return t

    @staticmethod
    def _time_of(ctx, like: fx.Node, args, kwargs) -> float:
        """Predicted time of the SDPA node the rewrite makes (its output is ``like``'s)."""
        return ctx.price(SDPA, *args, val=like.meta.get("val"), **kwargs)

    # ------------------------------------------------------------------ rewrite

    @staticmethod
    def _apply(gm, plan) -> fx.Node:
        g = gm.graph
        root = plan["root"]
        b = _Recorder(g)
        with g.inserting_before(root):
            new = _emit(b, plan)
        if plan["flat"] or plan.get("q_scale") is not None or plan.get("window") is not None:
            set_meta(gm, b.nodes)
        else:
            new.meta["val"] = root.meta.get("val")
        ir.replace_with(root, new)
        ir.erase_dead(gm, plan["removed"])
        _erase_unread(gm, plan["dropped_mask"])  # the constant causal mask and what built it, now unread
        return new

    @staticmethod
    def _apply_gqa(gm, plan) -> fx.Node:
        g = gm.graph
        sd = plan["node"]
        # the repeat chains plan's K/V replace (none for K/V broadcast as they are)
        reps = [r for r, kv in ((sd.args[1], plan["k"]), (sd.args[2], plan["v"])) if r is not kv]
        args = (sd.args[0], plan["k"], plan["v"]) + tuple(sd.args[3:])
        with g.inserting_before(sd):
            new = g.call_function(SDPA, args, dict(sd.kwargs, enable_gqa=True))
        new.meta["val"] = sd.meta.get("val")
        ir.replace_with(sd, new)
        g.erase_node(sd)
        for r in reps:  # the repeat chains, now unread
            for n in (r, r.args[0], r.args[0].args[0]):
                if not n.users:
                    g.erase_node(n)
        return new

    @staticmethod
    def _apply_sdpa(gm, plan) -> fx.Node:
        g = gm.graph
        sd = plan["node"]
        mask = sd.args[3]
        args = (sd.args[0], sd.args[1], sd.args[2], None, _kwarg(sd, 4, "dropout_p", 0.0), plan["causal"])
        with g.inserting_before(sd):
            new = g.call_function(SDPA, args, _sdpa_kwargs(sd))
        new.meta["val"] = sd.meta.get("val")
        ir.replace_with(sd, new)
        g.erase_node(sd)
        _erase_unread(gm, mask)
        return new


def _emit(b, plan) -> fx.Node:
    """The SDPA call (and, for more than one batch dim, the flattening around it) that replaces
    the matched attention, built by ``b.call`` (a Replacement to price it, a builder to make it)."""
    q, k, v, mask, flat = plan["q"], plan["k"], plan["v"], plan["mask"], plan["flat"]
    if plan.get("k_perm") is not None:
        k = b.call(aten.permute.default, k, plan["k_perm"])
    if plan.get("q_scale") is not None:
        q = b.call(aten.mul.Tensor, q, plan["q_scale"])
    kwargs = {"scale": plan["scale"]}
    win = plan.get("window")
    if win is not None:
        return _emit_windowed(b, plan, q, k, v, win, kwargs)
    if plan["gqa"]:
        kwargs["enable_gqa"] = True
    perm = flat.get("perm") if flat else None
    if perm is not None:
        q, k, v = (b.call(aten.permute.default, t, perm) for t in (q, k, v))
    if flat:
        q, k, v = (b.call(aten.flatten.using_ints, t, 0, flat["end"]) for t in (q, k, v))
        if mask is not None and flat["mask_expand"] is not None:
            mask = b.call(aten.expand.default, mask, flat["mask_expand"])
        if mask is not None and flat["mask_end"] is not None:
            mask = b.call(aten.flatten.using_ints, mask, 0, flat["mask_end"])
    out = b.call(SDPA, q, k, v, mask, 0.0, plan["causal"],
                 val=None if flat else plan["root"].meta.get("val"), **kwargs)
    if flat:
        out = b.call(aten.unflatten.int, out, 0, flat["lead"])
    if perm is not None:
        out = b.call(aten.permute.default, out, sorted(range(len(perm)), key=perm.__getitem__))
    return out


def _view_flattening(infos) -> list[int] | None:
    """A permutation of [*L, H, S, D] tensors' dims that keeps S, D last and makes flattening the
    first len(L) of them a view for every one of ``infos`` (q, k, v): one leading dim moved to the
    heads' place, the others in stride order (NesT's [B, H, T, N, D] from one qkv projection:
    [B, T, H, N, D], B and T merging), or None where no choice is a view."""
    rank = len(infos[0].shape)
    if any(i.symbolic or i.stride is None or len(i.shape) != rank for i in infos):
        return None
    lead = list(range(rank - 2))
    for h in reversed(lead):  # the heads' own dim first: the identity where flattening is a view already
        rest = sorted((d for d in lead if d != h), key=lambda d: -infos[0].stride[d])
        if all(all(i.stride[a] == i.stride[b] * i.shape[b] or i.shape[a] == 1 for a, b in zip(rest, rest[1:]))
               for i in infos):
            perm = rest + [h, rank - 2, rank - 1]
            return None if perm == list(range(rank)) else perm
    return None


def _emit_windowed(b, plan, q, k, v, win, kwargs) -> fx.Node:
    """SDPA over [B/W, W*H, S, D] with the windows of an image as heads (FuseAttention._window)."""
    n_img, w, h = win["images"], win["windows"], win["heads"]
    bsz, _, sq, sk = win["scores"]
    mask = win["mask"]
    if tuple(win["mask5"]) != tuple(ir.info(mask).shape):
        mask = b.call(aten.view.default, mask, win["mask5"])
    if win["inner"] is not None:  # [1, H, S, S'] -> [1, 1, H, S, S'], added to the window mask
        inner, ms = win["inner"]
        mask = b.call(aten.add.Tensor, mask, b.call(aten.view.default, inner, [1] + ms))
    mask = b.call(aten.reshape.default, b.call(aten.expand.default, mask, [1, w, h, sq, sk]), [1, w * h, sq, sk])
    q = b.call(aten.reshape.default, q, [n_img, w * h, sq, -1])
    k, v = (b.call(aten.reshape.default, t, [n_img, w * h, sk, -1]) for t in (k, v))
    out = b.call(SDPA, q, k, v, mask, 0.0, False, **kwargs)
    return b.call(aten.reshape.default, out, list(_shape(plan["root"])), val=plan["root"].meta.get("val"))


class _Recorder(GraphBuilder):
    """A GraphBuilder that keeps the nodes it made (for their metadata)."""

    def __init__(self, g: fx.Graph):
        super().__init__(g)
        self.nodes: list[fx.Node] = []

    def call(self, target, *args, val=None, **kwargs) -> fx.Node:
        n = super().call(target, *args, **kwargs)
        self.nodes.append(n)
        return n


def _scaled_operand(node, inside: set, dtype: torch.dtype):
    """``(x, c, node)`` when ``node`` is ``x * c`` or ``x / c`` for a literal c (MaxViT scales k
    so) read only by the matched attention, with x of ``dtype``: the factor goes into SDPA's
    scale. Else ``(node, 1.0, None)``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
            and len(node.args) == 2 and not node.kwargs and all(u in inside for u in node.users)):
        return node, 1.0, None
    x, c = node.args
    if not isinstance(x, fx.Node) or not _number(c) or c == 0 or ir.info(x) is None or ir.info(x).dtype != dtype \
            or tuple(ir.info(x).shape) != tuple(_shape(node)):
        return node, 1.0, None
    return x, (float(c) if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / float(c)), node


def _unrepeated(node):
    """``(kv, n_rep)`` when ``node`` is repeat_kv's spelling of ``kv`` [B, Hkv, S, D] repeated to
    [B, Hkv * n_rep, S, D] (reshape of expand of unsqueeze(kv, 2)), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in RESHAPES):
        return None
    exp = node.args[0]
    if not (isinstance(exp, fx.Node) and exp.target is aten.expand.default and len(exp.users) == 1):
        return None
    unsq = exp.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.target is aten.unsqueeze.default and len(unsq.users) == 1
            and unsq.args[1] in (2, -3)):
        return None
    kv = unsq.args[0]
    try:
        s, es, rs = _shape(kv), _shape(exp), _shape(node)
    except Refuse:
        return None
    if len(s) != 4 or len(es) != 5 or len(rs) != 4:
        return None
    try:
        n_rep = int(es[2])
    except TypeError:  # a symbolic repeat count
        return None
    if n_rep < 1 or [es[0], es[1], es[3], es[4]] != list(s) or list(rs) != [s[0], s[1] * n_rep, s[2], s[3]]:
        return None
    return kv, n_rep


def _find_unchecked(gm, pattern: Op):
    """Matches of ``pattern`` without matcher.match's interior-users post-check.

    matcher._needs_single_use does not descend into Alt alternatives, so ``single_use=False``
    on an Op under an Alt is ignored by that post-check (the softmax read by an
    _assert_tensor_metadata node fails the match). _plan does the interior-user check itself,
    with a reason per node (and lets _assert_tensor_metadata readers go with the pattern)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and pattern._target_ok(node):
            m = Match(root=node)
            if pattern.match(node, m):
                yield m


def _broadcast_heads(sd) -> bool:
    """Does this 4-D SDPA call broadcast K and V of one head over q's Hq > 1 heads (the same batch)?"""
    infos = [ir.info(a) if isinstance(a, fx.Node) else None for a in sd.args[:3]]
    if any(i is None or len(i.shape) != 4 or i.symbolic for i in infos):
        return False
    q, k, v = (i.shape for i in infos)
    return q[1] > 1 and k[1] == 1 and v[1] == 1 and k[0] == v[0] == q[0]


def _kwarg(node, index, name, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _sdpa_kwargs(node) -> dict:
    return {k: v for k, v in node.kwargs.items() if k in ("scale", "enable_gqa")}
