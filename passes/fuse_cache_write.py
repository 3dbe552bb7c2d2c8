"""fuse_cache_write: rotary of q and k, then the rotated k and v written into a KV cache in place
-> one ``graphopt::rotary_cache_write``.

A Hugging Face decoder with a static cache runs, per layer (after fuse_rotary)::

    q_r, k_r = graphopt.rotary(q, k, cos, sin, interleaved)
    idx = arange(T) + cumulative_length          # the step's cache positions
    k_cache.index_copy_(2, idx, k_r)             # -> SDPA reads k_cache, v_cache
    v_cache.index_copy_(2, idx, v)

four kernels that each move a few KB in a decode step. This becomes
``q_r = rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved)``, with ``pos``
the 0-dim start when ``idx`` is proven ``arange(T) + start`` (the add then has no reader left), else
``idx`` itself. The op writes the caches where the rotary ran.

Legality (each refusal says which failed):
* the rotary's k output is read only by an ``index_copy_`` along dim 2 of a 4-D cache, and exactly
  one other ``index_copy_`` writes v along dim 2 at the same ``idx``; shapes and dtypes as the op
  takes them (``ops/rotary_cache_write.problem``), the two caches distinct;
* the writes may move to where the op goes (after its last input): nothing between there and the
  later of the two ``index_copy_`` reads or writes either cache, and with ``pos`` a start, nothing
  between there and ``idx`` writes the start's tensor (the position counter's ``add_``);
* every reader of the written caches is the graph's output or also reads the rotated q (attention
  over them does): a reader that did not would not be ordered after the write by the graph
  (a custom op cannot return an alias of the cache it writes; ir.mutation_order_violation).

Profitability: the op priced by the cost model (q, k, v, cos, sin read, q and the k/v rows
written, one launch) against the rotary, the two writes and the position add it replaces. On a
CPU profile every candidate is refused (NO_FUSED_KERNELS).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pipeline import Candidate, Pass, PassContext, PassResult, register

from ._norms_common import position

aten = torch.ops.aten
INDEX_COPY_ = aten.index_copy_.default


def _start_of(idx: fx.Node, T: int) -> fx.Node | None:
    """``s`` when ``idx`` is ``arange(T) + s`` (either operand order) with ``s`` a 0-dim integer
    tensor, proven from the graph; else None."""
    from .lower_decode_attention import kv_index_offset

    if idx.op != "call_function" or idx.target is not aten.add.Tensor or idx.kwargs.get("alpha", 1) != 1:
        return None
    a, b = idx.args[0], idx.args[1]
    for ar, s in ((a, b), (b, a)):
        si = ir.info(s) if isinstance(s, fx.Node) else None
        if si is None or len(si.shape) != 0 or si.dtype.is_floating_point or si.dtype == torch.bool:
            continue
        if isinstance(ar, fx.Node) and kv_index_offset(ar, T) == 0:
            return s
    return None


def _feeders(idx: fx.Node, readers: set, keep: fx.Node) -> list[fx.Node]:
    """``idx`` and the pure nodes computing it that nothing else reads (the positions' arange),
    ``keep`` (the start) excluded: what the rewrite leaves without a reader."""
    if set(idx.users) != readers:
        return []
    dead, stack = [idx], list(idx.all_input_nodes)
    while stack:
        n = stack.pop()
        if n is keep or n in dead or n.op not in ("call_function", "get_attr") or not set(n.users) <= set(dead):
            continue
        if n.op == "call_function" and (not isinstance(n.target, torch._ops.OpOverload) or n.target._schema.is_mutable):
            continue
        dead.append(n)
        stack.extend(n.all_input_nodes)
    return dead


def _dim2(node: fx.Node) -> bool:
    d = node.args[1]
    return isinstance(d, int) and d % 4 == 2


@register
class FuseCacheWrite(Pass):
    name = "fuse_cache_write"
    family = "fusion"
    description = ("rotary of q and k + index_copy_ of the rotated k and of v into a KV cache -> "
                   "rotary_cache_write (one kernel)")
    inference_only = True
    requires = ("fuse_rotary",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        rots = [(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.graphopt.rotary.default]
        res.consider(ctx, rots, lambda r, label: self._candidate(gm, ctx, r))
        return res

    # ------------------------------------------------------------------ legality

    def _plan(self, gm, rot):
        """(why not, plan)."""
        from graphopt.cuda_ext.ops.rotary_cache_write import problem

        outs = {}
        for u in rot.users:
            if u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1):
                return f"{u.name} reads the rotary's tuple", None
            if u.args[1] in outs:
                return "the rotary's outputs are read twice", None
            outs[u.args[1]] = u
        if 1 not in outs or 0 not in outs:
            return "the rotary's q or k output is unused", None
        q_r, k_r = outs[0], outs[1]
        readers = list(k_r.users)
        if len(readers) != 1 or readers[0].target is not INDEX_COPY_ or readers[0].args[3] is not k_r \
                or not _dim2(readers[0]):
            return "the rotated k is not only written into a cache (index_copy_ along dim 2)", None
        ick = readers[0]
        idx = ick.args[2]
        if not isinstance(idx, fx.Node):
            return "the cache positions are not a tensor", None
        others = [u for u in idx.users if u is not ick and u.target is INDEX_COPY_ and _dim2(u)]
        if len(others) != 1:
            return f"{len(others)} other writes at the same positions (the value cache's: one)", None
        icv = others[0]
        q, k, cos, sin = rot.args[:4]
        interleaved = rot.args[4]
        kc, v, vc = ick.args[0], icv.args[3], icv.args[0]
        if not all(isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
                   for x in (q, k, cos, sin, kc, v, vc, idx)):
            return "an operand has no tensor metadata", None
        memo: dict = {}
        kroot, vroot = ir.alias_root(kc, memo), ir.alias_root(vc, memo)
        if kroot is vroot:
            return "the key and value caches are the same tensor", None
        T = ir.info(k).shape[2]
        start = _start_of(idx, T) if isinstance(T, int) else None
        pos = start if start is not None else idx
        vals = [x.meta["val"] for x in (q, k, v, cos, sin, kc, vc, pos)]
        why = problem(*vals)
        if why:
            return why, None
        for name, cache in (("k_cache", kc), ("v_cache", vc)):
            for src in (q, k, v):
                if ir.alias_root(src, memo) in (kroot, vroot):
                    return f"{name} shares memory with {src.name}", None
        # placement: right after the op's last input
        order = position(gm)
        inputs = [q, k, v, cos, sin, kc, vc, pos]
        anchor = max(inputs, key=lambda n: order[n])
        first_q_use = min((order[u] for u in q_r.users), default=len(order))
        if order[anchor] >= first_q_use:
            return "no place after the op's inputs precedes the rotated q's readers", None
        lo, hi = order[anchor], max(order[ick], order[icv])
        removed = {rot, q_r, k_r, ick, icv}
        for n in gm.graph.nodes:
            p = order[n]
            if p <= lo or p >= hi or n in removed:
                continue
            roots = {ir.alias_root(a, memo) for a in n.all_input_nodes}
            if kroot in roots or vroot in roots:
                return f"{n.name} ({ir.target_name(n)}) uses a cache between the op's place and the writes", None
        if start is not None:
            sroot = ir.alias_root(start, memo)
            a, b = sorted((order[anchor], order[idx]))
            for n in gm.graph.nodes:
                if a < order[n] < b and any(ir.alias_root(w, memo) is sroot for w in ir.written_args(n)):
                    return f"{n.name} writes the start position between the op's place and the positions", None
        for w in (ick, icv):
            for u in w.users:
                if u.op != "output" and not ir.reads_result_of(u, rot) and q_r not in u.all_input_nodes:
                    return (f"{u.name} ({ir.target_name(u)}) reads the written cache but not the rotated q: "
                            "nothing would order it after the write"), None
        dead = _feeders(idx, {ick, icv}, start) if start is not None else []
        return "", {"args": (q, k, v, cos, sin, kc, vc, pos, interleaved), "anchor": anchor, "q_r": q_r,
                    "k_r": k_r, "writes": (ick, icv), "rot": rot, "dead": dead, "start": start is not None}

    # ------------------------------------------------------------------ profitability

    def _candidate(self, gm, ctx, rot):
        from graphopt.cuda_ext.ops.rotary import layout

        why, plan = self._plan(gm, rot)
        if why:
            return f"not fused: {why}", None
        new = ctx.price(torch.ops.graphopt.rotary_cache_write.default, *plan["args"],
                        val=layout(plan["q_r"].meta["val"]))
        old_nodes = [rot, *plan["writes"], *plan["dead"]]
        gain = ctx.node_time(old_nodes) - new
        ick, icv = plan["writes"]
        label = (f"{rot.name} + {ick.name} + {icv.name}" + (f" + {plan['dead'][0].name}" if plan["dead"] else "")
                 + (" (positions from the start)" if plan["start"] else ""))
        return "", Candidate("rotary + cache write", old_nodes + [plan["q_r"], plan["k_r"]], gain,
                             lambda: self._apply(gm, plan), label=label)

    # ------------------------------------------------------------------ rewrite

    @staticmethod
    def _apply(gm, plan):
        g = gm.graph
        with g.inserting_after(plan["anchor"]):
            fused = g.call_function(torch.ops.graphopt.rotary_cache_write.default, plan["args"])
        fused.meta["val"] = plan["q_r"].meta["val"]
        plan["q_r"].replace_all_uses_with(fused)
        for w in plan["writes"]:  # the cache after the write: the tensor written (the op writes it in place)
            w.replace_all_uses_with(w.args[0])
        for n in (*plan["writes"], plan["k_r"], plan["q_r"], plan["rot"]):
            g.erase_node(n)
        ir.erase_dead(gm, plan["dead"])
        return fused
