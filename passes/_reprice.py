"""Pricing a value's readers as they would run if the value had other strides.

A rewrite that hands a node's readers a tensor of the same values in another layout (a piece of a
concatenation instead of its slice, a product written in the order its head merge reads) changes
what those readers cost: a convolution or GEMM that copied a strided input no longer does, a
``reshape`` that copied becomes a view, or the other way round. :func:`reprice` replays the views
reading the node and the nodes reading those views on a Replacement, with the new value standing
for the node, so the candidate's gain counts them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops whose output is a view of their first argument, through which a reader's strides follow the value
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.select.int, aten.transpose.int,
         aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.squeeze.default, aten.unflatten.int, aten.t.default, aten.alias.default,
         aten.slice.Tensor, aten.narrow.default, aten.expand.default, aten.as_strided.default,
         aten.diagonal.default}


def closure(node: fx.Node) -> tuple[list, list]:
    """(views, consumers): the views reading ``node`` transitively (as found) and the other nodes
    reading node or one of them."""
    views, consumers, todo, seen = [], [], [node], {node}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "call_function" and u.target in VIEWS and u.args[0] is n:
                views.append(u)
                todo.append(u)
            else:
                consumers.append(u)
    return views, consumers


def reprice(ctx, r, node: fx.Node, new: fx.Node, views: list, consumers: list) -> tuple[float, dict]:
    """Replay ``views`` and ``consumers`` (``closure(node)``) on the Replacement ``r`` with ``new``
    (a node of r) standing for ``node``. Returns (their predicted seconds now, the views' new fake
    values); raises where a view is not a view on the new strides (the fake tensors' RuntimeError)."""
    mapped = {node: new}
    for v in views:  # (closure finds a view after the view it reads)
        mapped[v] = r.call(v.target, *fx.node.map_arg(v.args, lambda a: mapped.get(a, a)),
                           **fx.node.map_arg(v.kwargs, lambda a: mapped.get(a, a)))
    for c in consumers:
        if c.op == "call_function":
            r.call(c.target, *fx.node.map_arg(c.args, lambda a: mapped.get(a, a)),
                   **fx.node.map_arg(c.kwargs, lambda a: mapped.get(a, a)))
    before = ctx.node_time(views + [c for c in consumers if c.op == "call_function"])
    return before, {v: mapped[v].meta["val"] for v in views}


def reader_chains(node: fx.Node) -> list[list[fx.Node]]:
    """Each way ``node``'s value is read: the views (fuse_elementwise's VIEW_OPS) it passes through,
    possibly none, before the first node that is not one."""
    from .fuse_elementwise import VIEW_OPS

    chains, stack = [], [(node, [])]
    while stack:
        n, chain = stack.pop()
        views = [u for u in n.users if u.op == "call_function" and u.target in VIEW_OPS]
        if len(views) != len(n.users) or not n.users:
            chains.append(chain)  # (a non-view reader, or a view read by nothing: its chain ends here)
        stack.extend((u, chain + [u]) for u in views)
    return chains


class _OnTensors:
    """A builder for fuse_elementwise.view_through that runs each view on a tensor."""

    @staticmethod
    def call(target, *args, **kwargs):
        return target(*args, **kwargs)


def row_major_after(t: torch.Tensor, chain: list[fx.Node]) -> bool:
    """Whether ``chain``'s views, replayed on ``t`` (a meta tensor of some layout), end in a row-major
    tensor (False where a view would need a copy)."""
    from .fuse_elementwise import view_through

    try:
        return view_through(_OnTensors, t, None, chain, expand=False).is_contiguous()
    except (RuntimeError, TypeError):
        return False
