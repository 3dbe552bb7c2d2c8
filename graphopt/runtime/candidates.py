"""A rewrite timed on the device before it applies: the nodes it would replace against the nodes it
would make, each run alone on inputs of the graph's shapes, strides and dtypes.

A lowering pass swaps one library kernel (cuDNN, cuBLAS, aten) for one of graphopt's; the cost model
prices both from rooflines and fitted rates, and a shape far from the ones it was fitted on can be
priced wrong by several times (a 7x7 depthwise convolution over 768 channels of 32x32 measured
2.4x slower than cuDNN where it was priced 2x faster). The measured guard then finds the loss only
for the whole pass, after compiling and timing the whole model with it. Here each distinct
candidate (by its ops, arguments and input layouts) is timed once, in a CUDA graph replaying it
several times (the device's time, not the launches'), in interleaved rounds against the nodes it
replaces; a candidate measured slower by more than the margin is not applied, and the pass's
report says so with both times. Results are kept per device for the process.

Inputs are made from the graph's fake values: floating tensors normal, integer and bool tensors
zero (an index stays in range). A candidate whose sizes are symbolic, whose nodes read something
that is not a tensor the graph computes or holds, or whose subgraphs fail to run or to be timed
is left to the cost model (``time`` returns None).
"""

from __future__ import annotations

import statistics

import torch
import torch.fx as fx

from .. import timing
from .measured import MARGIN, Timer

_RESULTS: dict = {}  # (device name, signature) -> (old seconds, new seconds) or None (not timeable)


def _concrete(val) -> bool:
    if not isinstance(val, torch.Tensor):
        return False
    return all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"T{tuple(val.shape)}{tuple(val.stride())}{val.dtype}"
    return repr(val)


def _signature(graph: fx.Graph) -> str:
    """The graph's ops, arguments and input layouts, names left out: equal for two candidates that
    would run the same kernels on the same shapes."""
    index: dict = {}
    parts = []
    for n in graph.nodes:
        index[n] = len(index)
        if n.op == "placeholder":
            parts.append(f"in {_describe(n.meta.get('val'))}")
        elif n.op == "output":
            parts.append(f"out {fx.node.map_arg(n.args, lambda a: index[a])}")
        else:
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
            parts.append(f"{n.op} {n.target} {args}")
    return "\n".join(parts)


class CandidateTimer:
    """Times candidates' old and new nodes on ``device``; one per optimize() call, results shared
    process-wide per device name."""

    def __init__(self, device: torch.device | str, margin: float | None = None, rounds: int = 5,
                 target_s: float = 2e-3, most_reps: int = 20):
        self.device = torch.device(device)
        self.margin = MARGIN if margin is None else margin
        self.rounds, self.target_s, self.most_reps = rounds, target_s, most_reps
        self._clock = Timer(self.device)  # its one-call clock: CUDA events on a GPU, perf_counter on the CPU
        self.timed = 0  # candidates timed by this timer (not taken from the results kept)
        if self.device.type == "cuda":
            self.device_name = torch.cuda.get_device_name(self.device)
        else:
            self.device_name = f"cpu:{torch.get_num_threads()} threads"

    # ------------------------------------------------------------------ subgraphs

    @staticmethod
    def _old_graph(nodes: list) -> tuple[fx.Graph, list] | None:
        """The matched nodes (in graph order) in a graph of their own, the values they read from
        outside as placeholders; its outputs are the matched values read outside the match."""
        pos = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
        nodes = sorted(set(nodes), key=lambda n: pos.get(n, -1))
        inside = set(nodes)
        if any(n.op != "call_function" for n in nodes):
            return None
        outer = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        g = fx.Graph()
        env: dict = {}
        for i, a in enumerate(outer):
            env[a] = g.placeholder(f"in{i}")
            env[a].meta["val"] = a.meta.get("val")
        for n in nodes:
            env[n] = g.node_copy(n, lambda a: env[a])
        outs = [n for n in nodes if any(u not in inside for u in n.users)] or nodes[-1:]
        g.output(tuple(env[n] for n in outs))
        return g, outer

    @staticmethod
    def _new_graph(replacement) -> tuple[fx.Graph, list] | None:
        """The replacement's calls in a graph with an output (its scratch graph is left as it is);
        its placeholders stand for nodes of the real graph, or (None in the returned list) for
        constants the rewrite would make."""
        if not replacement.nodes:
            return None
        g = fx.Graph()
        env: dict = {}
        outer: list = []
        for ph, real in replacement.read_placeholders():
            env[ph] = g.placeholder(f"in{len(outer)}")
            env[ph].meta["val"] = ph.meta.get("val")
            outer.append(real)
        for n in replacement.nodes:
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output((env[replacement.nodes[-1]],))
        return g, outer

    # ------------------------------------------------------------------ inputs

    def _make(self, val) -> torch.Tensor:
        """A tensor of ``val``'s shape, strides and dtype on the device, over storage filled first (a
        broadcast input's zero strides make elements share memory, which an in-place fill refuses)."""
        shape, stride = tuple(val.shape), tuple(val.stride())
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
        base = torch.empty(size, dtype=val.dtype, device=self.device)
        if base.is_floating_point() or base.is_complex():
            base.normal_()
        else:
            base.zero_()
        return base.as_strided(shape, stride)

    # ------------------------------------------------------------------ timing

    def _graphed(self, fn, reps: int):
        """A callable replaying ``reps`` calls of ``fn`` from one CUDA graph (None where the calls
        cannot be captured: they then run as launched)."""
        if self.device.type != "cuda":
            return None
        from .cuda_graphs import _CudaBackend

        try:
            graph, _ = _CudaBackend().capture(lambda: [fn() for _ in range(reps)], None, self.device, warmup=1)
            return graph.replay
        except Exception:
            return None

    def _pair(self, old, new) -> tuple[float, float] | None:
        """(old, new) seconds a call, medians of interleaved rounds."""
        with torch.inference_mode():
            for fn in (old, new):  # first use: a kernel's compilation, cuDNN's and cuBLAS's choices
                fn()
            self._clock._sync()
            first = max(self._clock._once(old), self._clock._once(new), 1e-7)
            reps = int(max(1, min(self.most_reps, self.target_s // first)))
            runs = [self._graphed(f, reps) for f in (old, new)]
            if None in runs:  # launched, not replayed: each run is reps calls
                runs = [lambda f=f: [f() for _ in range(reps)] for f in (old, new)]
            samples: list = [[], []]
            for _ in range(self.rounds):
                for i, run in enumerate(runs):
                    samples[i].append(self._clock._once(run) / reps)
        return statistics.median(samples[0]), statistics.median(samples[1])

    def time(self, nodes: list, replacement) -> tuple[float, float] | None:
        with timing.phase("measured guard: timing candidates"):
            return self._time(nodes, replacement)

    def _time(self, nodes: list, replacement) -> tuple[float, float] | None:
        """(old, new) seconds a call of the matched ``nodes`` and of ``replacement``'s calls on this
        device, or None where they cannot be timed (see the module's docstring)."""
        built_old, built_new = self._old_graph(nodes), self._new_graph(replacement)
        if built_old is None or built_new is None:
            return None
        (g_old, in_old), (g_new, in_new) = built_old, built_new
        vals = [ph.meta.get("val") for g in (g_old, g_new) for ph in g.find_nodes(op="placeholder")]
        if not all(_concrete(v) for v in vals):
            return None
        key = (self.device_name, _signature(g_old) + "\n=>\n" + _signature(g_new))
        if key in _RESULTS:
            return _RESULTS[key]
        result = None
        try:
            made: dict = {}  # a node of the real graph read by both sides: one tensor
            args = []
            for g, outer in ((g_old, in_old), (g_new, in_new)):
                args.append([])
                for o, ph in zip(outer, g.find_nodes(op="placeholder")):
                    if o is None:  # a constant the rewrite would make
                        args[-1].append(self._make(ph.meta["val"]))
                        continue
                    if o not in made:
                        made[o] = self._make(ph.meta["val"])
                    args[-1].append(made[o])
            mods = [fx.GraphModule(torch.nn.Module(), g) for g in (g_old, g_new)]
            result = self._pair(lambda: mods[0](*args[0]), lambda: mods[1](*args[1]))
            self.timed += 1
        except Exception:
            result = None
        finally:
            self._clock._sync()
        _RESULTS[key] = result
        return result

    def slower(self, old_s: float, new_s: float) -> bool:
        return new_s > old_s * (1.0 + self.margin)

