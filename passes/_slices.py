"""Reading slice, narrow, select and split nodes: which range of which dim each one takes (shared by
eliminate_cat_slices and merge_split_convs)."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
RANGES = (aten.slice.Tensor, aten.narrow.default, aten.select.int)


def arg(node: fx.Node, i: int, name: str, default):
    """Argument ``i`` (keyword ``name``) of ``node``, ``default`` where absent."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _clamp(v, size: int, default: int) -> int:
    if v is None:
        return default
    v = v + size if v < 0 else v
    return max(0, min(size, v))


def node_range(u: fx.Node, size: int):
    """(what, kind, dim, start, stop) a slice, narrow or select ``u`` (a RANGES node) reads along
    ``dim`` of a tensor ``size`` long there, kind "slice" or "select" (stop = start + 1), with
    ``start`` and ``stop`` None where symbolic or stepped."""
    if u.target is aten.slice.Tensor:
        d, start, end, step = arg(u, 1, "dim", 0), arg(u, 2, "start", None), arg(u, 3, "end", None), arg(u, 4, "step", 1)
        if not all(isinstance(v, int) or v is None for v in (start, end, step)) or step != 1:
            return "slice", "slice", d, None, None
        return "slice", "slice", d, _clamp(start, size, 0), _clamp(end, size, size)
    if u.target is aten.narrow.default:
        d, start, length = u.args[1], u.args[2], u.args[3]
        if not isinstance(start, int) or not isinstance(length, int):
            return "narrow", "slice", d, None, None
        start = start + size if start < 0 else start
        return "narrow", "slice", d, start, start + length
    d, i = u.args[1], u.args[2]
    if not isinstance(i, int):
        return "select", "select", d, None, None
    i = i + size if i < 0 else i
    return "select", "select", d, i, i + 1


def split_bounds(split: fx.Node, size: int) -> list | None:
    """The item boundaries [0, s0, s0 + s1, ..., size] of a SPLITS node over a dim ``size`` long,
    None where its sizes are symbolic."""
    sizes = split.args[1]
    if isinstance(sizes, int):
        sizes = [min(sizes, size - s) for s in range(0, size, sizes)] if sizes > 0 else None
    if sizes is None or not all(isinstance(s, int) for s in sizes):
        return None
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return bounds
