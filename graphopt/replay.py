"""Whether a graph's calls can be replayed from CUDA graphs, by inspection alone (no device): the
rules graphopt.runtime.cuda_graphs decides with, where a pass can ask them too (a training rewrite
that pays only when the step is replayed asks :func:`training_replay_refusal`)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import ir
from .errors import GraphoptError
from .ir import HOST_SYNC_OPS, host_sync  # noqa: F401 (the rule lives in ir; HOST_SYNC_OPS re-exported)

_TRUE = {True, "on", "true", "1", "yes", "force"}
_FALSE = {False, None, "off", "false", "0", "no"}


def replay_mode(cuda_graphs) -> str:
    if isinstance(cuda_graphs, str) and cuda_graphs.lower() == "auto":
        return "auto"
    key = cuda_graphs.lower() if isinstance(cuda_graphs, str) else cuda_graphs
    if key in _TRUE:
        return "on"
    if key in _FALSE:
        return "off"
    raise GraphoptError(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
                return True
    return False


def training_refusal(gm: fx.GraphModule, mode: str = "auto") -> str | None:
    """Why a training graph's steps are not replayed whatever the device (None: nothing here stops it).
    ``mode``: :func:`replay_mode`'s; a checkpointed step (a memory budget) is replayed only when forced."""
    written = ir.input_mutations(gm)
    if written:
        return (f"training graph that writes {written[0][1].name} in place ({written[0][0].name}; BatchNorm's "
                "running statistics): a warm-up and a capture would write it too")
    regions = [n for n in gm.graph.nodes if n.op == "call_module" and not str(n.target).startswith("_guards")]
    for n in regions:
        if replayable_region(gm, n) is None:
            return (f"training graph with checkpointed regions run by torch.utils.checkpoint ({n.name}): their "
                    "recomputation runs eagerly")
    if regions and mode != "on":
        return (f"training graph with checkpointed regions ({regions[0].name}): its memory budget comes first (a replay's "
                "pool keeps a copy of every parameter's gradient beside the step's working memory: 1.1-1.5x the budget "
                "measured); cuda_graphs=True replays it")
    return None


def replayable_region(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The graph a submodule call runs if a training step calling it can be captured (an AOT
    checkpoint region: a compiled forward and a compiled backward that recomputes, no per-call Python
    state a replay would skip; its module says so with ``graph_replay_safe``), else None."""
    try:
        mod = gm.get_submodule(str(node.target))
    except AttributeError:
        return None
    body = getattr(mod, "body", None)
    if getattr(mod, "graph_replay_safe", False) and isinstance(body, fx.GraphModule):
        return body
    return None


def step_nodes(gm: fx.GraphModule):
    """The call nodes a training step runs: ``gm``'s, and those of the replayable regions it calls."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            body = replayable_region(gm, n)
            if body is not None:
                yield from step_nodes(body)
        yield n


def shape_refusal(gm: fx.GraphModule, mode: str, dynamic: bool) -> str | None:
    """Why ``gm``'s shapes stop a replay in ``mode`` (:func:`replay_mode`'s), or None: dynamic shapes
    unless the replay is forced (then one graph per shape)."""
    if (dynamic or has_symbolic_shapes(gm)) and mode == "auto":
        return ("dynamic shapes: every new size would be a new capture (cuda_graphs=True captures one graph "
                "per shape, LRU-bounded)")
    return None


def node_refusal(n: fx.Node, training: bool) -> str | None:
    """Why node ``n`` stops a replay, devices aside (None: it does not): a random op outside
    training (a replay would repeat its numbers) or a call the host must wait for."""
    if n.op != "call_function":
        return None
    if ir.is_random(n) and not training:
        return f"random op {ir.op_name(n)} ({n.name}): a replay would repeat or freeze its random numbers"
    if host_sync(n):
        return f"data-dependent op {ir.op_name(n)} ({n.name}) synchronizes with the host"
    return None


def training_replay_refusal(gm: fx.GraphModule, *, cuda_graphs="auto", dynamic: bool = False) -> str | None:
    """Why the steps of training graph ``gm`` would run eagerly on a GPU rather than be replayed
    (what graphopt.runtime.cuda_graphs.decide says, devices aside: the same rules, in its order), or
    None: a pass that makes a training step's host work heavier asks this before it prices the
    rewrite as if replayed."""
    mode = replay_mode(cuda_graphs)
    if mode == "off":
        return "disabled (cuda_graphs=False)"
    why = shape_refusal(gm, mode, dynamic)
    if why:
        return why
    for n in step_nodes(gm):
        why = node_refusal(n, training=True)
        if why:
            return why
    return training_refusal(gm, mode)
