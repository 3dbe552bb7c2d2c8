"""The nodes a rewrite would make, built before anything is rewritten, so that the cost model
prices a candidate the way it prices the graph afterwards (one pricer).

    r = cost.replacement(hints)
    w = r.tensor((n_total, k), x_dtype, x_device)        # a constant the rewrite would make
    y = r.call(aten.linear.default, x, w, b)              # x, b: nodes of the real graph
    z = r.call(torch.ops.graphopt.bias_act.default, y, b, "relu", None, -1)
    gain = cost.time_of(matched, hints) - r.time()

The nodes live in a scratch graph of their own: a node of the real graph used as an argument
becomes a placeholder carrying its value, and each call's value comes from running the op on fake
tensors (the fake mode of the real graph's values, so symbolic sizes stay symbolic), or from
``val=`` where the pass already has it.
"""

from __future__ import annotations

import torch
import torch.fx as fx


class ScratchGraph(fx.Graph):
    """A graph of nodes that exist only to be priced (the cost model does not memoize them)."""


class Replacement:
    def __init__(self, cost, hints: dict | None = None):
        self.cost, self.hints = cost, hints
        self.graph = ScratchGraph()
        self.nodes: list[fx.Node] = []  # the calls, in order: what time() prices
        self._inputs: dict[fx.Node, fx.Node] = {}
        self._pending: dict[fx.Node, tuple] = {}  # tensor() placeholders whose fake value is made on first use
        self._mode = None

    # ------------------------------------------------------------------ building

    def input(self, node: fx.Node) -> fx.Node:
        """The scratch placeholder standing for ``node`` of the real graph (made once)."""
        ph = self._inputs.get(node)
        if ph is None:
            ph = self.graph.placeholder(node.name)
            ph.meta["val"] = node.meta.get("val")
            self._inputs[node] = ph
        return ph

    def tensor(self, shape, dtype: torch.dtype, device, stride=None) -> fx.Node:
        """A tensor the rewrite would create (a reordered or concatenated weight): a placeholder of
        that shape, dtype, device and strides (default: contiguous)."""
        ph = self.graph.placeholder(f"new_{len(self._pending)}")
        self._pending[ph] = (tuple(shape), dtype, torch.device(device), None if stride is None else tuple(stride))
        return ph

    def constant(self, shape, dtype: torch.dtype, device) -> fx.Node:
        """A small constant the rewrite would store (a mask, a 0-d fill): :meth:`tensor` with its fake
        value made now, so the rewrite's builder can read its shape."""
        ph = self.tensor(shape, dtype, device)
        self._value(ph)
        return ph

    def like(self, node: fx.Node, *, memory_format=torch.preserve_format, dtype: torch.dtype | None = None) -> fx.Node:
        """A value the rewrite would have where ``node``'s is, in another memory format or dtype
        (a convolution's input once the layout pass has made its region channels_last): a
        placeholder, not priced."""
        val = node.meta.get("val")
        ph = self.graph.placeholder(f"{node.name}_like")
        with self._fake_mode(val):
            ph.meta["val"] = torch.empty_like(val, dtype=dtype or val.dtype, memory_format=memory_format)
        return ph

    def call(self, target, *args, val=None, **kwargs) -> fx.Node:
        """A ``target(*args, **kwargs)`` node; real-graph nodes in the arguments become inputs.
        Its value is ``val`` if given, else the op run on the fake values of its arguments."""
        def arg(a):
            if isinstance(a, fx.Node) and a.graph is not self.graph:
                return self.input(a)
            return a

        args = fx.node.map_aggregate(args, arg)
        kwargs = fx.node.map_aggregate(kwargs, arg)
        node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_aggregate((node.args, node.kwargs), lambda a: self._value(a) if isinstance(a, fx.Node) else a)
        node.meta["val"] = self._run(node.target, *vals) if val is None else val
        self.nodes.append(node)
        return node

    def read_placeholders(self) -> list[tuple[fx.Node, fx.Node | None]]:
        """The placeholders the calls read, in the scratch graph's order, each with the node of the real
        graph it stands for (None: a tensor the rewrite would make), every one with its fake value."""
        real = {ph: node for node, ph in self._inputs.items()}
        read = {a for n in self.nodes for a in n.all_input_nodes}
        out = []
        for ph in self.graph.find_nodes(op="placeholder"):
            if ph in read:
                self._value(ph)
                out.append((ph, real.get(ph)))
        return out

    # ------------------------------------------------------------------ pricing

    def time(self) -> float:
        """Predicted seconds of the calls made (the cost model's per-node time, summed)."""
        return self.cost.time_of(self.nodes, self.hints)

    # ------------------------------------------------------------------ fake values

    def _fake_mode(self, *vals):
        if self._mode is None:
            from torch._guards import detect_fake_mode
            from torch._subclasses.fake_tensor import FakeTensorMode

            vals = list(vals) + [ph.meta.get("val") for ph in self._inputs.values()]
            self._mode = detect_fake_mode([v for v in _leaves(vals) if isinstance(v, torch.Tensor)]) \
                or FakeTensorMode(allow_non_fake_inputs=True)
        return self._mode

    def _value(self, node: fx.Node):
        spec = self._pending.pop(node, None)
        if spec is not None:
            shape, dtype, device, stride = spec
            with self._fake_mode():
                node.meta["val"] = (torch.empty(shape, dtype=dtype, device=device) if stride is None else
                                    torch.empty_strided(shape, stride, dtype=dtype, device=device))
        return node.meta.get("val")

    def _run(self, target, args, kwargs):
        mode = self._fake_mode()
        prev = mode.allow_non_fake_inputs
        mode.allow_non_fake_inputs = True
        try:
            with mode:
                return target(*args, **kwargs)
        finally:
            mode.allow_non_fake_inputs = prev


def _leaves(vals):
    for v in vals:
        if isinstance(v, (list, tuple)):
            yield from _leaves(v)
        else:
            yield v


def is_scratch(node: fx.Node) -> bool:
    return isinstance(node.graph, ScratchGraph)

