"""Lowering: run the optimized GraphModule, replaying CUDA graphs for static-shape inference.

    runner = lower(gm, example_flat_inputs)        # cuda_graphs="auto", max_graphs=8
    out = runner(*args, **kwargs)                  # same calling convention as gm
    runner.decision                                # Decision(on=..., why="...")
    runner.stats                                   # captures, replays, eager calls, evictions

What happens on a call when CUDA graphs are on (``runner.decision.on``):

* The call's key is the shape, dtype and device of every tensor input plus the non-tensor inputs
  and the calling structure. A key seen before replays its graph; a new key captures a new graph
  (warm-up on a side stream, then ``torch.cuda.graph`` capture), keeping at most ``max_graphs``
  graphs and evicting the least recently used one. All graphs of a runner share one memory pool
  (``torch.cuda.graph_pool_handle()``).
* Inputs are copied into the graph's static input buffers, the graph is replayed, and the
  outputs are the graph's static output tensors **cloned** (one device copy per output). Replay
  writes the same static tensors every time, so without the clone an output kept by the caller
  would silently change on the next call. ``reuse_outputs=True`` skips the clone (the fastest
  path): outputs are then only valid until the next call of the runner (of any shape: graphs
  share one pool).
* An output of at least ``TAIL_MIN_BYTES`` that the graph's last op on it makes (a fresh tensor,
  read by nothing else: a language model's logits) is not captured: that op runs eagerly right
  after the replay, on the graph's static buffers, and its result is the caller's to keep, so it
  needs no clone (a language model's logits). :func:`tail_nodes` picks them.
* Calls that cannot be replayed safely run the GraphModule eagerly, with a one-time warning
  per reason: grad-enabled calls with anything requiring grad (a replayed graph records no
  autograd history), inputs on another device, unhashable non-tensor inputs, or a capture
  that failed (the runner then stays eager).

* Inputs the graph writes in place (a decode step's StaticCache: ``index_copy_`` of the new
  keys/values into the preallocated cache, ``add_`` of its position) are **bound by address**:
  no static copy; the graph reads and writes the caller's tensors themselves, and their
  addresses are part of the key (a call with other tensors there captures another graph). A
  warm-up run would write them too, so for such a graph the first call of a key runs eagerly
  (that is its warm-up and its result) and is then captured; later calls replay. Outputs that
  are such an input's memory are handed back as the caller's tensor, never cloned.
  ``bind_inputs=True`` binds every input this way (a caller that updates the same input
  tensors in place between calls, as graphopt.generation does).

CUDA graphs stay off (``decision.why`` says why) for inference graphs with random ops (rand*; a
training step's dropout draws new numbers at every replay from the generator state CUDA graphs
register, its mask saved for the backward in the same pool),
data-dependent ops that synchronize with the host (``.item()``, ``nonzero``), CPU tensors
(inputs, parameters or intermediates), or when CUDA is absent. With
``cuda_graphs="auto"`` they are also off for dynamic-shape graphs (every new size would be a new
capture) and for training graphs; ``cuda_graphs=True`` captures those per shape anyway.

Moving the module's parameters (``.to()``, ``.cuda()``, ``.half()``) makes captured graphs stale:
:class:`graphopt.OptimizedModule` calls :meth:`Runner.reset` when that happens; callers holding
a Runner directly must call it themselves. In-place updates (``load_state_dict``, optimizer
steps) keep the memory and need nothing.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import ir
from ..ir import TAIL_MIN_BYTES, flat_outputs as _flat_outputs, tail_nodes
from ..replay import HOST_SYNC_OPS, node_refusal, replay_mode as _mode, shape_refusal
from ..replay import step_nodes, training_refusal as _training_refusal, training_replay_refusal

__all__ = ["Decision", "Runner", "decide", "lower", "launch_savings_s", "tail_nodes", "training_replay_refusal", "RANDOM_OPS",
           "HOST_SYNC_OPS"]


# op names (ATen schema names, without the namespace) that make a graph unfit for replay
RANDOM_OPS = ir.RANDOM_OPS  # (re-exported; ir.is_random is the one definition; HOST_SYNC_OPS is graphopt.replay's)


@dataclass(frozen=True)
class Decision:
    """Whether a runner replays CUDA graphs, and why (one line, for the report)."""

    on: bool
    why: str
    mode: str = "auto"  # the requested mode: "auto" | "on" | "off"
    device: torch.device | None = None
    training: bool = False  # grad-enabled calls replay a captured forward and backward (training_graphs)

    def note(self) -> str:
        return f"CUDA graph: {'on' if self.on else 'off'} ({self.why})"


def _val_device(val) -> torch.device | None:
    if isinstance(val, torch.Tensor):
        return val.device
    return None


def decide(gm: fx.GraphModule, example_flat_inputs, *, cuda_graphs="auto", dynamic: bool = False,
           training: bool = False, device_type: str = "cuda") -> Decision:
    """Decide whether ``gm`` called with inputs like ``example_flat_inputs`` should be replayed as
    CUDA graphs. Pure inspection: touches no device. ``device_type`` is the kind of device the
    replay backend runs on ("cuda"; "cpu" for the emulated backend the tests use)."""
    mode = _mode(cuda_graphs)
    if mode == "off":
        return Decision(False, "disabled (cuda_graphs=False)", mode)
    tensors = [x for x in example_flat_inputs if isinstance(x, torch.Tensor)]
    devices = {x.device for x in tensors}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        devices.add(t.device)
    if not devices:
        return Decision(False, "no tensor inputs or parameters", mode)
    other = sorted({str(d) for d in devices if d.type != device_type})
    if other:
        where = "the CPU" if other == ["cpu"] else ", ".join(other)
        return Decision(False, f"the model runs on {where}" if not any(d.type == device_type for d in devices)
                        else f"tensors on {where} mixed with {device_type} tensors", mode)
    if len(devices) > 1:
        return Decision(False, f"tensors on several devices ({', '.join(sorted(map(str, devices)))})", mode)
    device = next(iter(devices))
    if device_type == "cuda" and not torch.cuda.is_available():
        return Decision(False, "CUDA is not available", mode, device)
    why = shape_refusal(gm, mode, dynamic)
    if why:
        return Decision(False, why, mode, device)
    for n in step_nodes(gm):  # (the bodies of replayable checkpoint regions included)
        why = node_refusal(n, training)
        if why:
            return Decision(False, why, mode, device)
        d = _val_device(n.meta.get("val")) if n.op == "call_function" else None
        if d is not None and d.type != device_type and n.meta["val"].dim() > 0:
            return Decision(False, f"{n.name} ({ir.op_name(n)}) makes a tensor on {d}", mode, device)
    for name, t in _tensor_constants(gm):
        if t.device.type != device_type and t.dim() > 0:
            return Decision(False, f"constant {name} is on {t.device}", mode, device)
    if training:
        why = _training_refusal(gm, mode)
        if why:
            return Decision(False, why, mode, device)
        why = (f"static shapes, training on {device}: forward and backward each replayed as one graph"
               if mode == "auto" else f"forced, training on {device}")
        return Decision(True, why, mode, device, training=True)
    why = f"static shapes, inference on {device}" if mode == "auto" else f"forced, on {device}"
    written = ir.mutated_placeholder_indices(gm)
    if written:
        why += (f"; {len(written)} input(s) written in place are bound by address: the graph writes the "
                "caller's tensors, a call with other tensors there captures another graph")
    return Decision(True, why, mode, device)


def _tensor_constants(gm: fx.GraphModule):
    seen = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        try:
            obj = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, torch.Tensor) and id(obj) not in seen:
            yield str(n.target), obj


def launch_savings_s(kernel_launches: int, profile) -> float:
    """Launch overhead a replayed CUDA graph removes: each kernel costs
    ``profile.launch_overhead_s`` when launched eagerly, ``profile.launch_overhead_graph_s``
    (about 1 µs) inside a replayed graph."""
    per_graph = getattr(profile, "launch_overhead_graph_s", 1e-6)
    return max(0.0, kernel_launches * (profile.launch_overhead_s - per_graph))


# ------------------------------------------------------------------------------------- eager tail


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


class _Tail:
    """``gm`` split in two: ``head`` (captured) returns the outputs the replay keeps, then the
    values the tail's nodes read; ``run`` runs those nodes' ops on them and puts every output
    back in its place, unflattened like ``gm``'s."""

    def __init__(self, gm: fx.GraphModule, nodes: list[fx.Node]):
        flat = _flat_outputs(gm)
        cg = gm.graph._codegen
        self.out_spec = cg.pytree_info.out_spec
        self.nodes = list(nodes)
        self.n_flat = len(flat)
        self.keep = [i for i, n in enumerate(flat) if n not in self.nodes]  # output positions the replay fills
        self.slots = [flat.index(n) for n in self.nodes]
        self.reads = list(dict.fromkeys(a for n in self.nodes for a in n.all_input_nodes))
        self.nbytes = sum(ir.nbytes(n.meta["val"]) for n in self.nodes)
        g = fx.Graph()
        env: dict = {}
        mapped = g.graph_copy(gm.graph, env)
        for n in self.nodes:
            g.erase_node(env[n])
        g.output(tuple(mapped[i] for i in self.keep) + tuple(env[a] for a in self.reads))
        head_cg = copy.copy(cg)
        head_cg.pytree_info = cg.pytree_info._replace(out_spec=None)
        g._codegen = head_cg
        self.head = fx.GraphModule(gm, g)

    def run(self, kept: list, read_values: list):
        env = dict(zip(self.reads, read_values))
        flat = [None] * self.n_flat
        for i, v in zip(self.keep, kept):
            flat[i] = v
        for i, n in zip(self.slots, self.nodes):
            flat[i] = n.target(*fx.node.map_arg(n.args, env.__getitem__), **fx.node.map_arg(n.kwargs, env.__getitem__))
        return pytree.tree_unflatten(flat, self.out_spec)


# ------------------------------------------------------------------------------------- backends


class _CudaBackend:
    """torch.cuda.graphs, as the docs prescribe: warm up on a side stream, capture with
    ``torch.cuda.graph(g, pool=...)``, replay on the caller's current stream."""

    device_type = "cuda"

    def new_pool(self, device):
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def run_once(self, fn, device):
        """One eager call on a side stream (the warm-up of a graph that writes its inputs)."""
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = fn()
            torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn, pool, device, warmup: int, probe=None):
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    out = fn()
                    del out
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fn()
        return graph, out

    def capture_step(self, forward, grads, pool, device, warmup: int):
        from .training_graphs import capture_step_cuda

        return capture_step_cuda(forward, grads, pool, device, warmup)

    def replay(self, graph, device) -> None:
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                graph.replay()
        else:
            graph.replay()


class _EmulatedGraph:
    def __init__(self, fn, out):
        self.fn = fn
        self.static = pytree.tree_leaves(out)
        self.replays = 0

    def replay(self):
        new = pytree.tree_leaves(self.fn())
        for s, n in zip(self.static, new):
            if isinstance(s, torch.Tensor):
                s.copy_(n)
        self.replays += 1


class _EmulatedBackend:
    """A CPU stand-in for tests: "capture" runs the function once and keeps its outputs as the
    static outputs; "replay" re-runs it and writes the results into those same tensors, so the
    cache, guards, static-buffer copies and output aliasing behave as with real CUDA graphs."""

    device_type = "cpu"

    def new_pool(self, device):
        return None

    def run_once(self, fn, device):
        return fn()

    def capture(self, fn, pool, device, warmup: int, probe=None):
        """``probe``: makes the static outputs where running ``fn`` would write the caller's
        tensors (a CUDA capture records without running)."""
        for _ in range(warmup):
            fn()
        out = (probe or fn)()
        return _EmulatedGraph(fn, out), out

    def capture_step(self, forward, grads, pool, device, warmup: int):
        from .training_graphs import capture_step_emulated

        return capture_step_emulated(forward, grads, pool, device, warmup)

    def replay(self, graph, device) -> None:
        graph.replay()


_BACKENDS = {"cuda": _CudaBackend, "emulate": _EmulatedBackend}


# ------------------------------------------------------------------------------------- runner


@dataclass
class _Entry:
    graph: object
    static_inputs: list  # per flat input: the static buffer, or None (non-tensor leaf, or bound input)
    in_spec: object
    out_leaves: list
    out_spec: object
    out_is_tensor: list = field(default_factory=list)
    tail: _Tail | None = None  # outputs made after the replay (their ops' inputs follow the kept outputs)
    # out_leaves index -> (bound input index, size, stride, storage offset from the input's): an
    # output that is a bound input's memory (a cache written in place) is handed back as the
    # caller's tensor (or a view of it), never cloned
    aliases: dict = field(default_factory=dict)
    copied: list = field(default_factory=list)  # indices of the inputs copied into static buffers

    def __post_init__(self):
        self.copied = [i for i, b in enumerate(self.static_inputs) if b is not None]


class Runner:
    """Calls ``gm`` like ``gm(*args, **kwargs)``, replaying CUDA graphs when
    ``decision.on`` (see the module docstring). Build it with :func:`lower`."""

    def __init__(self, gm: fx.GraphModule, decision: Decision, *, max_graphs: int = 8,
                 reuse_outputs: bool = False, warmup: int = 3, backend: str = "cuda",
                 tail_min_bytes: int | None = TAIL_MIN_BYTES, bound_inputs=(), bind_all: bool = False):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.gm = gm
        # flat inputs the graph reads and writes at the caller's address (no static copy): those
        # it writes in place, or all of them with bind_all
        self.bound_inputs = frozenset(bound_inputs)
        self.bind_all = bind_all
        self.decision = decision
        self.max_graphs = max_graphs
        self.reuse_outputs = reuse_outputs
        self.warmup = warmup
        self.backend_name = backend
        self.tail_min_bytes = tail_min_bytes
        self._tail: _Tail | None | bool = False  # False: not looked for yet
        self._backend = _BACKENDS[backend]()
        self._graphs: OrderedDict = OrderedDict()
        self._pool = None
        self._disabled: str | None = None
        self._train = None  # graphopt.runtime.training_graphs.TrainingGraphs, made on the first grad-enabled call
        self._warned: set[str] = set()
        self.stats = {"captures": 0, "replays": 0, "eager_calls": 0, "evictions": 0, "fallbacks": {}}
        self.precompiled = None  # graphopt.runtime.precompile.Precompiled, where lower() compiled ahead

    # -------------------------------------------------------------- state

    @property
    def active(self) -> bool:
        """True while calls may replay graphs (decision on and no capture failed)."""
        return self.decision.on and self._disabled is None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    _epoch = 0  # bumped whenever captured graphs are dropped (fixed_call's entries then expire)

    def reset(self) -> None:
        """Drop every captured graph, the memory pool and the head/tail split (after parameters
        moved: the split's head module holds the constants it was built with)."""
        self._epoch += 1
        self._graphs.clear()
        self._pool = None
        self._tail = False
        self._train = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_graphs"] = OrderedDict()
        state["_pool"] = None
        state["_tail"] = False
        state["_train"] = None
        return state

    def __deepcopy__(self, memo):
        new = Runner(copy.deepcopy(self.gm, memo), self.decision, max_graphs=self.max_graphs,
                     reuse_outputs=self.reuse_outputs, warmup=self.warmup, backend=self.backend_name,
                     tail_min_bytes=self.tail_min_bytes, bound_inputs=self.bound_inputs, bind_all=self.bind_all)
        new._disabled = self._disabled
        return new

    def __repr__(self) -> str:
        return (f"Runner({self.decision.note()}, graphs={len(self._graphs)}/{self.max_graphs}, "
                f"reuse_outputs={self.reuse_outputs})")

    # -------------------------------------------------------------- calls

    def _eager(self, args, kwargs, reason: str | None):
        if reason is not None:
            fb = self.stats["fallbacks"]
            fb[reason] = fb.get(reason, 0) + 1
            if reason not in self._warned:
                self._warned.add(reason)
                warnings.warn(f"graphopt: CUDA graph not used for this call ({reason}); running eagerly. "
                              "This warning is shown once.", RuntimeWarning, stacklevel=4)
        self.stats["eager_calls"] += 1
        return self.gm(*args, **kwargs)

    def _needs_grad(self, leaves) -> bool:
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
            return True
        return any(p.requires_grad for p in self.gm.parameters())

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return self.call_flat(leaves, spec, args, kwargs)

    def call_flat(self, leaves: list, structure, args: tuple, kwargs: dict):
        """A call whose flat inputs are ``leaves``; ``structure``: its TreeSpec, or any hashable
        key that tells call structures apart (graphopt.api.call_leaves)."""
        if not self.decision.on or self._disabled is not None:
            self.stats["eager_calls"] += 1
            return self.gm(*args, **kwargs)
        if torch.is_grad_enabled() and self._needs_grad(leaves):
            if not self.decision.training:
                return self._eager(args, kwargs, "grad-enabled call: wrap inference in torch.no_grad() or torch.inference_mode()")
            return self._train_call(leaves, structure, args, kwargs)
        device = self.decision.device
        key = [structure]
        bound, bind_all = self.bound_inputs, self.bind_all
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if x.device != device:
                    return self._eager(args, kwargs, f"an input is on {x.device}, graphs are on {device}")
                if bind_all or i in bound:  # read and written where it is: its address is part of the graph
                    key.append((x.shape, x.dtype, x.data_ptr(), x.stride()))
                else:
                    key.append((x.shape, x.dtype))
            else:
                key.append((type(x), x))
        key = tuple(key)
        try:
            entry = self._graphs.get(key)
        except TypeError:  # an unhashable non-tensor input
            return self._eager(args, kwargs, "a non-tensor input is not hashable")
        self.last_key = key
        if entry is None:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            return self._capture_and_run(key, leaves, spec, args, kwargs)
        self._graphs.move_to_end(key)
        self._copy_in(entry, leaves)
        return self._replay(entry, leaves)

    last_key = None  # the graph key of the last call that could replay

    def _train_call(self, leaves: list, structure, args: tuple, kwargs: dict):
        """A grad-enabled call of a training graph: its captured forward replayed inside one autograd
        node whose backward replays the captured backward (graphopt.runtime.training_graphs), or the
        graph run eagerly where that cannot be done safely (the reason warned once)."""
        from .training_graphs import TrainingGraphs

        device = self.decision.device
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.device != device:
                return self._eager(args, kwargs, f"an input is on {x.device}, graphs are on {device}")
        if self._train is None:
            self._train = TrainingGraphs(self.gm, self._backend, device, warmup=self.warmup)
        why = self._train.eager_reason()
        if why is None:
            try:
                key = self._train.key(leaves, structure)
                hash(key)
            except TypeError:
                return self._eager(args, kwargs, "a non-tensor input is not hashable")
            out = self._train.call(key, leaves, args, kwargs)
            if out is not None:
                self.stats["replays"] += 1
                return out
            why = self._train.disabled
        return self._eager(args, kwargs, why)

    @staticmethod
    def _copy_in(entry: _Entry, leaves: list) -> None:
        static = entry.static_inputs
        bufs = [(static[i], leaves[i]) for i in entry.copied if leaves[i] is not static[i]]
        if len(bufs) > 1:  # one multi-tensor copy kernel instead of one launch per input
            torch._foreach_copy_([b for b, _ in bufs], [x for _, x in bufs])
        elif bufs:
            bufs[0][0].copy_(bufs[0][1])

    def fixed_call(self, leaves: list, structure, args: tuple, kwargs: dict):
        """A function of no arguments calling with exactly these inputs, for a caller that passes
        the same tensors on every call and updates them in place (a generation loop's decode
        step): once their graph is captured, a call is its replay, without re-deriving the key
        from the inputs (nor refreshing its place in the LRU order). Shapes, dtypes and addresses
        must stay those of the first call."""
        found = None  # (entry, the runner's epoch when it was found)

        def call():
            nonlocal found
            if found is not None and found[1] == self._epoch:  # no graph dropped since: still captured
                entry = found[0]
                self._copy_in(entry, leaves)
                return self._replay(entry, leaves)
            self.last_key = None
            out = self.call_flat(leaves, structure, args, kwargs)
            entry = self._graphs.get(self.last_key) if self.last_key is not None else None
            found = (entry, self._epoch) if entry is not None else None
            return out

        return call

    @property
    def tail(self) -> _Tail | None:
        """The outputs made outside the graph (None: every output comes from the replay)."""
        if self._tail is False:
            nodes = [] if self.reuse_outputs or self.tail_min_bytes is None else tail_nodes(self.gm, self.tail_min_bytes)
            self._tail = _Tail(self.gm, nodes) if nodes else None
        return self._tail

    def _replay(self, entry: _Entry, leaves: list):
        self._backend.replay(entry.graph, self.decision.device)
        self.stats["replays"] += 1
        aliases = entry.aliases
        if self.reuse_outputs:
            outs = list(entry.out_leaves) if aliases else entry.out_leaves
        else:
            outs = [o.clone() if t and j not in aliases else o
                    for j, (o, t) in enumerate(zip(entry.out_leaves, entry.out_is_tensor))]
        for j, (i, size, stride, delta) in aliases.items():
            x = leaves[i]
            outs[j] = x if delta == 0 and x.shape == size and x.stride() == stride else \
                x.as_strided(size, stride, x.storage_offset() + delta)
        if entry.tail is not None:  # the tail's ops read the head's static values, right after the replay
            k = len(entry.tail.keep)
            return entry.tail.run(outs[:k], entry.out_leaves[k:])
        return pytree.tree_unflatten(outs, entry.out_spec)

    def _capture_and_run(self, key, leaves, spec, args, kwargs):
        device = self.decision.device
        bound = {i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                 and (self.bind_all or i in self.bound_inputs)}
        first = None
        with torch.inference_mode(False), torch.no_grad():
            # static buffers live outside the graph pool, so no graph's replay can overwrite them;
            # bound inputs are the caller's tensors themselves
            static = [x.detach().clone() if isinstance(x, torch.Tensor) and i not in bound else None
                      for i, x in enumerate(leaves)]
            s_leaves = [s if s is not None else x for s, x in zip(static, leaves)]
            s_args, s_kwargs = pytree.tree_unflatten(s_leaves, spec)

            tail = self.tail
            module = tail.head if tail is not None else self.gm

            def fn():
                return module(*s_args, **s_kwargs)

            cap_leaves, probe = s_leaves, None
            if bound and self._backend.device_type != "cuda":
                # the emulated capture runs its function: it does so on copies of the bound inputs
                cap_leaves = [x.detach().clone() if i in bound else x for i, x in enumerate(s_leaves)]
                p_args, p_kwargs = pytree.tree_unflatten(cap_leaves, spec)

                def probe():
                    return module(*p_args, **p_kwargs)

            if len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
                self._epoch += 1
                self.stats["evictions"] += 1
            try:
                if self._pool is None:
                    self._pool = self._backend.new_pool(device)
                if any(i in self.bound_inputs for i in bound):
                    # the graph writes the caller's tensors: a warm-up would write them too, so the
                    # warm-up is this call itself, run eagerly once; the capture then records
                    # without running, and the next call replays
                    first = self._backend.run_once(fn, device)
                    graph, out = self._backend.capture(fn, self._pool, device, 0, probe)
                else:
                    graph, out = self._backend.capture(fn, self._pool, device, self.warmup, probe)
            except Exception as e:  # noqa: BLE001 - any capture failure means: stay eager, correctly
                self._disabled = f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                self.reset()
                if self.backend_name == "cuda":
                    try:
                        torch.cuda.synchronize(device)
                    except Exception:  # noqa: BLE001
                        pass
                if first is not None:  # it ran already: its result is this call's
                    return self._finish_eager(first, tail)
                return self._eager(args, kwargs, self._disabled)
        if tail is not None:  # the head returns a flat tuple: kept outputs, then the tail's inputs
            out_leaves, out_spec = list(out), None
            flags = [isinstance(o, torch.Tensor) for o in out_leaves[:len(tail.keep)]]
        else:
            out_leaves, out_spec = pytree.tree_flatten(out)
            flags = [isinstance(o, torch.Tensor) for o in out_leaves]
        aliases = _bound_aliases(out_leaves[:len(flags)], {i: cap_leaves[i] for i in bound})
        entry = _Entry(graph, static, spec, out_leaves, out_spec, flags, tail, aliases)
        self._graphs[key] = entry
        self.stats["captures"] += 1
        if first is not None:  # this call ran eagerly as the warm-up: that is its result
            return self._finish_eager(first, tail)
        # capture records the work without running it: replay once for this call's result
        return self._replay(entry, leaves)

    def _finish_eager(self, out, tail: _Tail | None):
        self.stats["eager_calls"] += 1
        if tail is None:
            return out
        k = len(tail.keep)
        return tail.run(list(out[:k]), list(out[k:]))


def _bound_aliases(out_leaves: list, bound: dict) -> dict:
    """Outputs whose memory is a bound input's: out index -> (input index, size, stride, storage
    offset relative to the input's)."""
    if not bound:
        return {}
    by_storage = {}
    for i, x in bound.items():
        by_storage.setdefault(x.untyped_storage().data_ptr(), (i, x))
    out = {}
    for j, o in enumerate(out_leaves):
        if not isinstance(o, torch.Tensor):
            continue
        hit = by_storage.get(o.untyped_storage().data_ptr())
        if hit is not None:
            i, x = hit
            out[j] = (i, o.shape, o.stride(), o.storage_offset() - x.storage_offset())
    return out


def lower(gm: fx.GraphModule, example_flat_inputs, *, cuda_graphs="auto", max_graphs: int = 8,
          reuse_outputs: bool = False, dynamic: bool = False, training: bool = False,
          warmup: int = 3, backend: str = "cuda", tail_min_bytes: int | None = TAIL_MIN_BYTES,
          bind_inputs: bool = False) -> Runner:
    """Wrap ``gm`` in a :class:`Runner` that replays CUDA graphs where that is safe.

    example_flat_inputs: the flat list of example inputs (tensors and other leaves) ``gm`` was
      captured with; their devices decide where graphs would run.
    cuda_graphs: "auto" (default: on for static-shape inference graphs on CUDA), True (also for
      dynamic shapes and training graphs: one graph per shape), False (never).
    max_graphs: graphs kept per runner (one per input shape/dtype); the least recently used one
      is evicted when a new key arrives.
    reuse_outputs: return the graph's static output tensors instead of clones (no copy; outputs
      are overwritten by the next call).
    dynamic / training: what the graph was captured for (``auto`` keeps graphs off for both).
    warmup: eager runs on a side stream before each capture.
    backend: "cuda", or "emulate" (a CPU stand-in used by the tests; see ``_EmulatedBackend``).
    tail_min_bytes: outputs this large made by their own last op run after the replay instead of
      being cloned (:func:`tail_nodes`); None keeps every op in the graph.
    bind_inputs: read every tensor input at the caller's address instead of copying it into a
      static buffer (calls then pass the same tensors, updated in place; other tensors capture
      another graph). Inputs the graph writes in place are bound either way.

    ``runner.decision.note()`` is the line for the report: ``CUDA graph: on/off (why)``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    decision = decide(gm, list(example_flat_inputs), cuda_graphs=cuda_graphs, dynamic=dynamic,
                      training=training, device_type=_BACKENDS[backend].device_type)
    example_flat_inputs = list(example_flat_inputs)
    runner = Runner(gm, decision, max_graphs=max_graphs, reuse_outputs=reuse_outputs, warmup=warmup,
                    backend=backend, tail_min_bytes=tail_min_bytes,
                    bound_inputs=ir.mutated_flat_inputs(gm, example_flat_inputs), bind_all=bind_inputs)
    if backend == "cuda":
        # the Triton kernels its first call would compile one by one, compiled on a pool of threads first
        from .precompile import precompile

        runner.precompiled = precompile(gm)
    return runner
