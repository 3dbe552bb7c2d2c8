"""Activation memory model of a training forward graph.

Which tensors autograd saves for backward, and how many bytes they hold, is read off the graph
itself: the graph is run once on fake tensors (no memory, no compute) with autograd on and
``torch.autograd.graph.saved_tensors_hooks`` installed around every node, so each op saves
exactly what its real autograd formula saves (no rule table to drift from PyTorch). Every saved
tensor is traced to the storage it lives in:

* a storage produced by a graph node (or a view of it) counts once, however many ops save it
  or views of it — the *activations*;
* a storage of a parameter, buffer or graph input is not an activation (it lives anyway);
* a storage that is none of those was made inside the op (dropout's mask, batch norm's saved
  mean/invstd, an attention kernel's logsumexp, a copy made for a matmul) — an *extra* of that
  node, freed with it.

Sizes come from shapes and dtypes (sympy expressions when dims are symbolic; ``hints`` give
numbers). ``ActivationModel`` adds the recompute time of every node from the cost model, the
predicted activation memory of a step (saved tensors + the graph's outputs + a backward working
set) and the predicted training-step peak (parameters, their gradients, inputs and activations).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from .. import ir
from ..errors import GraphoptError

aten = torch.ops.aten


@dataclass
class NodeActivations:
    """What one node's autograd saves: activation storages (by producing node) and extras."""

    name: str
    saved: list = field(default_factory=list)  # producer nodes (storage roots) of saved activations
    saved_inputs: int = 0  # count of saved graph inputs / parameters / buffers (not activations)
    extra_bytes: object = 0  # storages created inside the op and saved (mask, stats, lse, copies)


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # tensors without storage (sparse, nested)
        return None


def _storage_bytes(t: torch.Tensor):
    try:
        return ir._dim(t.untyped_storage().nbytes())
    except Exception:
        return ir.tensor_info(t).nbytes if ir.tensor_info(t) is not None else 0


def _tensors(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        out = []
        for v in val:
            out.extend(_tensors(v))
        return out
    return []


class _MadeRecorder(TorchDispatchMode):
    """Sums the bytes of the new storages the ops under it return (what a selective
    checkpoint caches when it keeps a node: its output and every temporary of its ops)."""

    def __init__(self, known: dict):
        super().__init__()
        self.known = known
        self.seen: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            key = _storage_key(t)
            if key is not None and key not in self.known and key not in self.seen:
                self.seen[key] = (_storage_bytes(t), t)
        return out

    def total(self):
        return sum((b for b, _ in self.seen.values()), 0)


class _SavedProbe(fx.Interpreter):
    """Runs the graph on fake tensors with autograd on, recording what each node saves."""

    def __init__(self, gm: fx.GraphModule, mode):
        super().__init__(gm, garbage_collect_values=False)
        self.mode = mode
        self.attr_cache: dict = {}
        self.owner: dict = {}  # storage key -> (node, kind) kind in activation/input/param
        self.root_bytes: dict = {}  # node -> bytes of the storage it owns
        self.records: dict = {}
        self.alias: dict = {}  # node -> the node owning the storage of its (first) output
        self.made: dict = {}  # node -> bytes of all new storages its ops make (outputs, temporaries)
        self.grad: dict = {}  # node -> does its output require grad
        self.keep: list = []  # keep probed tensors alive so storage keys stay unique

    def fetch_attr(self, target: str):
        if target not in self.attr_cache:
            real = super().fetch_attr(target)
            if isinstance(real, torch.Tensor):
                fake = self.mode.from_tensor(real, static_shapes=True)
                if real.requires_grad and not fake.requires_grad:
                    fake.requires_grad_(True)
                self.attr_cache[target] = fake
            else:
                self.attr_cache[target] = real
        return self.attr_cache[target]

    def _own(self, node, val, kind):
        for t in _tensors(val):
            key = _storage_key(t)
            if key is not None and key not in self.owner:
                self.owner[key] = (node, kind)
                if kind == "activation":
                    self.root_bytes[node] = self.root_bytes.get(node, 0) + _storage_bytes(t)
            self.keep.append(t)

    def run_node(self, n: fx.Node):
        if n.op == "placeholder":
            val = n.meta.get("val")
            self._own(n, val, "input")
            return val
        if n.op == "get_attr":
            val = self.fetch_attr(n.target)
            self._own(n, val, "param")
            return val
        if n.op == "call_module" and n.target.startswith("_guards"):
            return None
        if n.op == "output":
            return super().run_node(n)
        packed: list = []

        def pack(t):
            packed.append(t)
            return t

        recorder = _MadeRecorder(self.owner)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
            out = super().run_node(n)
        self.made[n] = recorder.total()
        self._own(n, out, "activation")
        ts = _tensors(out)
        if ts:
            owner = self.owner.get(_storage_key(ts[0]))
            self.alias[n] = owner[0] if owner is not None else n
            self.grad[n] = any(t.requires_grad for t in ts)
        rec = NodeActivations(n.name)
        seen = set()
        for t in packed:
            key = _storage_key(t)
            if key is None or key in seen:
                continue
            seen.add(key)
            self.keep.append(t)
            owner = self.owner.get(key)
            if owner is None:  # made inside the op
                rec.extra_bytes = rec.extra_bytes + _storage_bytes(t)
                self.owner[key] = (n, "extra")
            elif owner[1] == "activation":
                rec.saved.append(owner[0])
            elif owner[1] == "extra":  # an extra of an earlier node, saved again
                continue
            else:
                rec.saved_inputs += 1
        self.records[n] = rec
        return out


def probe_saved(gm: fx.GraphModule) -> "_SavedProbe":
    """Run the probe: ``.records`` {node: NodeActivations} for every call node, ``.root_bytes``
    {node: bytes of the storage it owns}, ``.alias`` {node: owner of its output's storage},
    ``.grad`` {node: output requires grad}.

    Runs ``gm`` once on fake tensors (from the placeholders' ``meta["val"]``) with grad enabled;
    parameters keep their ``requires_grad``. Raises GraphoptError if the graph cannot run there."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    fakes = ir.placeholder_fakes(gm)
    mode = detect_fake_mode([v for v in fakes if isinstance(v, torch.Tensor)])
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in fakes]
    probe = _SavedProbe(gm, mode)
    prev = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        with mode, torch.enable_grad(), torch.random.fork_rng(devices=[]):
            probe.run(*fakes)
    except GraphoptError:
        raise
    except Exception as e:
        raise GraphoptError(f"cannot model the activations of this graph: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}") from e
    finally:
        mode.allow_non_fake_inputs = prev
    return probe


# --------------------------------------------------------------------------- the model

_ATTENTION = {aten.scaled_dot_product_attention.default}
_DROPOUT = {aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default}


def layer_of(node: fx.Node) -> str:
    """The layer a node belongs to, for reports: the innermost module of its
    ``nn_module_stack`` that is a numbered child (``layers.3``, ``layer2.1``), else the
    innermost module, else the node's name."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    paths = [p.replace("L['self'].", "").replace("L__self___", "") for p in paths if p]
    for p in reversed(paths):
        parts = p.split(".")
        for i in range(len(parts) - 1, -1, -1):
            if parts[i].isdigit():
                return ".".join(parts[: i + 1])
    if paths:
        return paths[-1]
    return node.name


@dataclass
class ActivationModel:
    """Per-node activation facts of a training forward graph, with concrete sizes.

    ``bytes[n]``: bytes of the storage node n owns (0 for a view of another node's output);
    ``root[n]``: the node owning n's output storage; ``saved[n]``: storage roots n's autograd
    saves; ``extra[n]``: bytes made and saved inside n; ``seconds[n]``: time to recompute n
    (cost model); ``grad[n]``: n's output requires grad; ``outputs``: roots of the graph outputs.
    """

    gm: fx.GraphModule
    body: list  # call nodes in topological order
    bytes: dict
    root: dict
    saved: dict
    extra: dict
    seconds: dict
    grad: dict
    outputs: set
    param_bytes: float
    grad_param_bytes: float
    input_bytes: float
    largest_param_grad: float
    obytes: dict  # node -> bytes of its output tensors (views included)
    made: dict  # node -> bytes of every new storage its ops make (what keeping it caches)
    param_grad_bytes: dict = field(default_factory=dict)  # parameter target -> bytes of its gradient

    @classmethod
    def build(cls, gm: fx.GraphModule, cost=None, hints: dict | None = None,
              device_kind: str | None = None) -> "ActivationModel":
        """Probe ``gm`` (see :func:`probe_saved`); ``cost`` (a CostModel) prices recomputation.

        ``device_kind``: the device planned for. For "cuda", attention is read as CUDA's
        flash/memory-efficient kernels save (inputs, output and a float32 logsumexp, not the
        math path's attention matrix), and, when the graph was captured off the GPU (CPU,
        meta), dropout as a bool mask."""
        hints = hints if hints is not None else ir.shape_hints(gm)
        c = lambda v: float(ir.concrete(v, hints))  # noqa: E731
        probe = probe_saved(gm)
        body = [n for n in gm.graph.nodes if n in probe.records]
        nbytes = {n: c(b) for n, b in probe.root_bytes.items()}
        root = {n: probe.alias.get(n, n) for n in body}
        saved = {n: list(dict.fromkeys(probe.records[n].saved)) for n in body}
        extra = {n: c(probe.records[n].extra_bytes) for n in body}
        attention_nodes = []
        if device_kind == "cuda":
            for n in body:
                t = ir.info(n)
                if t is None:
                    continue
                if n.target in _ATTENTION:  # whatever backend fake tensors would pick
                    ins = [a for a in n.all_input_nodes if a in root]
                    saved[n] = list(dict.fromkeys([root.get(a, a) for a in ins] + [root.get(n, n)]))
                    shape = [c(d) for d in t.shape]
                    extra[n] = float(torch.Size([int(x) for x in shape[:-1]]).numel()) * 4  # logsumexp
                    attention_nodes.append(n)
                elif n.target in _DROPOUT and t.device.type != "cuda" and probe.records[n].extra_bytes != 0:
                    extra[n] = c(t.numel)  # a bool mask
        seconds = {n: (c(cost.node_cost(n).time_s) if cost is not None else 0.0) for n in body}
        out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        outputs = set()
        for a in out_node.all_input_nodes:
            outputs.add(root.get(a, a))
        params = grads = largest = inputs = 0.0
        pgrads: dict = {}
        seen = set()
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                val = probe.attr_cache.get(n.target)
                if isinstance(val, torch.Tensor) and n.target not in seen:
                    seen.add(n.target)
                    b = c(ir.tensor_info(val).nbytes)
                    params += b
                    if val.requires_grad:
                        grads += b
                        largest = max(largest, b)
                        pgrads[n.target] = b
            elif n.op == "placeholder":
                inputs += sum(c(t.nbytes) for t in ir.infos(n))
        obytes = {n: sum(c(t.nbytes) for t in ir.infos(n)) for n in body}
        made = {n: c(probe.made.get(n, 0)) for n in body}
        for n in attention_nodes:  # re-read for CUDA: output + logsumexp
            made[n] = (nbytes.get(n, 0.0) if root.get(n) is n else 0.0) + extra[n]
        return cls(gm, body, nbytes, root, saved, extra, seconds, dict(probe.grad), outputs,
                   params, grads, inputs, largest, obytes, made, pgrads)

    # ---------------------------------------------------------------- baseline

    def saved_roots(self) -> set:
        out = set()
        for n in self.body:
            out.update(r for r in self.saved[n] if r in self.bytes)
        return out

    def baseline_saved_bytes(self) -> float:
        """Bytes autograd holds for backward after the forward, without checkpointing."""
        return sum(self.bytes[r] for r in self.saved_roots()) + sum(self.extra.values())

    def output_bytes(self) -> float:
        """Bytes of the graph's outputs not already counted as saved (the caller holds them)."""
        saved = self.saved_roots()
        return sum(self.bytes.get(r, 0.0) for r in self.outputs if r not in saved)

    def all_output_bytes(self) -> float:
        """Bytes of all the graph's outputs (held by the caller)."""
        return sum(self.bytes.get(r, 0.0) for r in self.outputs)

    def held_bytes(self, saved_bytes: float | None = None) -> float:
        """Predicted memory held when the forward returns: saved tensors and outputs. With a
        plan's ``saved_bytes`` (which leaves the outputs out), all outputs are added."""
        if saved_bytes is None:
            return self.baseline_saved_bytes() + self.output_bytes()
        return saved_bytes + self.all_output_bytes()

    def backward_working_bytes(self) -> float:
        """A backward working set: the largest (gradient of a node's output + gradients of
        its inputs that need them + the fresh gradients of the parameters it reads) over the
        nodes. The gradient of a graph output is the caller's (``backward(outs, grads)``, or the
        loss's backward), not made in the graph's backward."""
        return max((self.node_working_bytes(n) for n in self.body), default=0.0)

    def largest_working(self) -> tuple:
        """(node, its working set's bytes, [(parameter target, bytes of its fresh gradient)]) of the
        node with the largest backward working set, or (None, 0.0, []) without one."""
        n = max(self.body, key=self.node_working_bytes, default=None)
        if n is None or self.node_working_bytes(n) <= 0:
            return None, 0.0, []
        params = {a.target: self.param_grad_bytes[a.target] for a in n.all_input_nodes
                  if a.op == "get_attr" and a.target in self.param_grad_bytes}
        return n, self.node_working_bytes(n), sorted(params.items(), key=lambda kv: -kv[1])

    def node_working_bytes(self, n) -> float:
        """The backward's working set at node ``n`` (0 where no gradient flows through it)."""
        if not self.grad.get(n):
            return 0.0
        g = 0.0 if self.root.get(n, n) in self.outputs else self.obytes.get(n, 0.0)
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                g += self.param_grad_bytes.get(a.target, 0.0)
            elif self.grad.get(a):
                g += self.obytes.get(a, 0.0)
        return g

    def step_activation_bytes(self, saved_bytes: float | None = None, transient: float = 0.0) -> float:
        """Predicted activation memory of a training step (what ``max_memory_allocated`` during
        forward+backward minus the memory allocated before the forward measures). The eager step
        (no arguments): :meth:`baseline_walk_bytes`. A plan's: its saved tensors + outputs + the
        largest backward working set + its recomputation transient (an upper bound: the working
        set is taken at the moment everything saved is still held)."""
        if saved_bytes is None and not transient:
            return self.baseline_walk_bytes()
        return self.held_bytes(saved_bytes) + self.backward_working_bytes() + transient

    def baseline_walk_bytes(self) -> float:
        """The eager step's activation memory, walked in the order the backward runs: at each
        node, what is still saved for it and the nodes before it (their backward has not run yet)
        plus that node's working set; the largest, plus the outputs. A CNN's largest working set
        comes at the end of its backward (the first layers' gradients), when most saved tensors
        are gone; a language model's (the logits' gradient) at the start, with everything held."""
        index = {n: i for i, n in enumerate(self.body)}
        diff = [0.0] * (len(self.body) + 1)
        first: dict = {}
        for n in self.body:
            for r in self.saved[n]:
                if r in self.bytes:
                    first[r] = min(first.get(r, index[n]), index[n])
        for r, i in first.items():
            diff[i] += self.bytes[r]
        for n, b in self.extra.items():
            if n in index:
                diff[index[n]] += b
        live = best = 0.0
        for p, n in enumerate(self.body):
            live += diff[p]
            best = max(best, live + self.node_working_bytes(n))
        return best + self.output_bytes()

    def step_peak_bytes(self, saved_bytes: float | None = None, transient: float = 0.0) -> float:
        """Predicted peak of a training step: parameters, their gradients, inputs, activations."""
        return self.param_bytes + self.grad_param_bytes + self.input_bytes + self.step_activation_bytes(saved_bytes, transient)


# --------------------------------------------------------------------------- budgets

_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_budget(value):
    """A memory budget as given by a user: a fraction 0 < f <= 1 of the baseline activation
    memory, a whole number of bytes (at least 64), or a string ("0.4", "8GB", "512MB", "2GiB", "1e9").
    Returns a float fraction (<= 1) or an int byte count; bad values raise GraphoptError (among them
    2.0 or 1.5, which read as a fraction mistyped more likely than as bytes)."""
    from ..errors import GraphoptError

    orig = value
    if isinstance(value, bool) or value is None:
        raise GraphoptError(f"memory_budget must be a fraction in (0, 1] or a size like 8GB, got {orig!r}")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u) and text[: -len(u)]), None)
        number = text[: -len(unit)] if unit else text
        try:
            value = float(number)
        except ValueError:
            raise GraphoptError(f"memory_budget {orig!r} is not a fraction in (0, 1] or a size like 8GB / 512MB") from None
        if unit:
            value = value * _UNITS[unit]
            if value < 1:
                raise GraphoptError(f"memory_budget {orig!r} is less than one byte")
            return int(value)
    if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise GraphoptError(f"memory_budget must be a fraction in (0, 1] or a size like 8GB, got {orig!r}")
    if value <= 0:
        raise GraphoptError(f"memory_budget must be positive, got {orig!r}")
    if value <= 1:
        return float(value)
    if value < 64 or (isinstance(value, float) and not value.is_integer()):
        raise GraphoptError(f"memory_budget {orig!r} is neither a fraction in (0, 1] of the activations nor a whole "
                            "number of bytes (at least 64); pass e.g. 0.5 or a size like '8GB'")
    return int(value)


def resolve_budget(value, baseline_bytes: float) -> float:
    """Budget in bytes: a fraction applies to ``baseline_bytes``."""
    v = parse_memory_budget(value)
    return float(v) * baseline_bytes if isinstance(v, float) else float(v)


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
