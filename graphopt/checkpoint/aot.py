"""The AOTAutograd backend: recomputation as a graph rewrite.

Each region of the plan (a contiguous piece of the captured forward) is traced by AOTAutograd
(``torch._functorch.aot_autograd.aot_module_simplified``) into one joint forward+backward ATen
graph (functionalized: BatchNorm's running statistics and ``num_batches_tracked`` become graph
outputs that AOTAutograd's runtime copies back into the buffers once per call). Our own
``partition_fn`` then decides what the backward receives:

* every forward value the backward needs is walked back from the backward: a value is *saved*
  when it comes from a captured node the plan keeps, a random op (never recomputed, so no RNG
  replay is needed: the dropout mask itself is saved), an input (parameters, buffers, the
  model's inputs: held anyway), or a node with no tag (no captured counterpart: saved, as
  ``default_partition`` would); it is *recomputed* in the backward graph when it comes from a
  node the plan recomputes or is a view/getitem (free), and then its own inputs are walked;
* ``torch._functorch.partitioners._extract_fwd_bwd_modules`` cuts the joint graph with that
  saved list (the backward graph copies the recomputed forward ops), and
  ``reordering_to_mimic_autograd_engine`` moves each recomputation just before its first use.

The forward and backward graphs run as plain generated Python over ATen ops (the compilers return
the ``GraphModule`` itself, boxed so the backward frees its saved inputs as it goes): no Inductor,
no dispatch mode, no per-op Python layer beyond the graph's own code.

Captured nodes are mapped onto the joint graph by a tag: before tracing, every body node gets
``meta["custom"]["graphopt_ckpt"] = <its name>``; AOTAutograd copies the ``custom`` meta field
onto the joint nodes traced from it (where a torch does not, the ``from_node`` provenance it
records names the same node). If the installed torch lacks a helper or drops both,
:func:`available` / the partition raise ``AotUnavailable`` and the pass falls back to the
selective-checkpoint backend with a note saying why.
"""

from __future__ import annotations

import copy

import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt import ir
from graphopt.cost.activations import ActivationModel, format_bytes
from graphopt.errors import GraphoptError
from graphopt.pipeline import PassContext, PassResult

from .extract import REGION, extract_region, mutated_args, outer_region, region_cost
from .planner import Plan
from .sac import checkpoint_regions

TAG = "graphopt_ckpt"


class AotUnavailable(Exception):
    """The AOTAutograd backend cannot run here (a missing torch helper, an untraceable graph)."""


def _imports():
    try:
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import _extract_fwd_bwd_modules
    except ImportError as e:  # private helpers: absent or renamed in this torch
        raise AotUnavailable(f"torch {torch.__version__} lacks an AOTAutograd helper ({e})") from e
    try:
        from torch._functorch.partitioners import reordering_to_mimic_autograd_engine as reorder
    except ImportError:
        reorder = None
    return aot_module_simplified, _extract_fwd_bwd_modules, reorder


def available() -> str | None:
    """None when the AOT backend can run with this torch, else why not."""
    try:
        _, _, reorder = _imports()
    except AotUnavailable as e:
        return str(e)
    if reorder is None:
        return f"torch {torch.__version__} lacks reordering_to_mimic_autograd_engine (recomputation would all run first)"
    return None


class _Doubling(nn.Module):
    def forward(self, x):
        return (x * 2,)


_FREES_INCOMING_GRADS: list = []


def frees_incoming_grads() -> bool:
    """Does an AOT region's backward free each gradient it receives (its outputs' gradients)
    after the gradient's last use, or does the autograd engine hold them all until the backward
    returns? Torch whose custom autograd Functions receive gradients as one immutable tuple
    (before ``torch.autograd.Function.boxed_grads_call``, which AOTAutograd's compiled function
    sets) holds them. Found out once by running it: a one-op region's boxed backward drops its
    own reference to the incoming gradient and checks whether the tensor is gone. False where the
    probe cannot run (the planner then prices the gradients as held; it is tried again next time)."""
    if not _FREES_INCOMING_GRADS:
        found = _probe_incoming_grads()
        if found is None:
            return False
        _FREES_INCOMING_GRADS.append(found)
    return _FREES_INCOMING_GRADS[0]


def _probe_incoming_grads() -> bool | None:
    import weakref

    from torch.utils._python_dispatch import _disable_current_modes

    seen: dict = {}

    def fw_compiler(gm, example_inputs):
        def run(args):
            a = list(args)
            args.clear()
            return gm(*a)

        run._boxed_call = True
        return run

    def bw_compiler(gm, example_inputs):
        def run(args):
            grad = args[-1]
            ref = weakref.ref(grad)
            args.clear()
            out = grad * 2
            del grad
            seen["freed"] = ref() is None
            return [out]

        run._boxed_call = True
        return run

    try:
        aot, _, _ = _imports()
        with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(4, requires_grad=True)
            fn = aot(fx.symbolic_trace(_Doubling()), [x], fw_compiler=fw_compiler, bw_compiler=bw_compiler)
            (fn(x)[0] * 3).sum().backward()  # the region receives a fresh gradient (mul's backward's)
    except Exception:  # noqa: BLE001 - unknown: the caller prices the gradients as held
        return None
    return seen.get("freed")


# --------------------------------------------------------------------------- compilers


def _boxed(gm: fx.GraphModule):
    """Run ``gm`` as it is, with AOTAutograd's boxed calling convention; where torch has it, the
    generated code clears the argument list (a saved tensor is freed after its last use)."""
    try:
        from torch.fx.graph import _BoxedCodeGen

        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()

        def run(args):
            return gm(args)

        run._boxed_call = True
        run.frees_inputs = True
        return run
    except Exception:  # older torch: the list is held until the graph returns
        from functorch.compile import make_boxed_func

        run = make_boxed_func(gm)
        run.frees_inputs = False
        return run


# --------------------------------------------------------------------------- the partition


def _is_view(n: fx.Node) -> bool:
    t = n.target
    if t is operator.getitem:
        return True
    return isinstance(t, torch._ops.OpOverload) and bool(getattr(t, "is_view", False))


def _is_random(n: fx.Node) -> bool:
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return ir.is_random(n)  # seeded ops; attention only when its dropout_p is not 0


def _tag(n: fx.Node):
    """The captured node ``n`` was traced from: our ``custom`` tag, else (a torch that does not
    copy ``custom``) the last ``from_node`` provenance entry (the node being interpreted)."""
    custom = n.meta.get("custom")
    if isinstance(custom, dict) and TAG in custom:
        return custom[TAG]
    source = n.meta.get("from_node")
    if isinstance(source, list) and source and n.op != "placeholder":
        return getattr(source[-1], "name", None)
    return None


def _nbytes(n: fx.Node) -> int:
    """Bytes of the storage a saved value holds (saved values are never views: those rerun)."""
    total = 0
    for t in pytree.tree_leaves(n.meta.get("val")):
        if isinstance(t, torch.Tensor):
            try:
                total += int(t.untyped_storage().nbytes())
            except Exception:  # no storage (sparse) or symbolic sizes without a hint
                try:
                    total += int(t.numel()) * t.element_size()
                except Exception:
                    pass
    return total


def _bn_functional():
    op = getattr(torch.ops.aten, "_native_batch_norm_legit_functional", None)
    return op.default if op is not None else None


def _bn_no_stats():
    op = getattr(torch.ops.aten, "_native_batch_norm_legit", None)
    return getattr(op, "no_stats", None) if op is not None else None


def _is_training_bn(n: fx.Node) -> bool:
    fn = _bn_functional()
    if fn is None or n.target is not fn or _bn_no_stats() is None or len(n.args) < 8:
        return False
    return n.args[5] is True


class Partitioner:
    """``partition_fn`` for aot_module_simplified: saves what the plan keeps, recomputes the rest
    in the backward graph. ``recompute``/``keep`` are captured node names; ``mutated`` the
    positions of the inputs the forward updates in place (BatchNorm's buffers). After a call,
    ``.last`` describes the cut (saved values, their bytes, recomputed joint nodes).

    The recomputation is explicit: each recomputed forward node gets a copy in the joint graph
    that the backward's nodes read instead, so ``_extract_fwd_bwd_modules`` puts the copies in
    the backward graph and the originals stay in the forward. A training BatchNorm's copy is
    ``_native_batch_norm_legit.no_stats`` (same output, mean and invstd; it neither reads nor
    updates the running statistics, which the forward alone updates, once per step)."""

    def __init__(self, recompute: set, keep: set, mutated: tuple = ()):
        self.recompute, self.keep = set(recompute), set(keep)
        self.mutated = set(mutated)
        self.last: dict | None = None
        self._mutated_primals: set = set()
        self._updates: set = set()
        self._ancestors: set = set()

    def __getstate__(self):
        """The plan (tags), without the last partition's joint-graph nodes: those hold fake tensors
        that do not survive a copy (a deep copy of them corrupted the heap at exit)."""
        state = dict(self.__dict__)
        state.update(last=None, _mutated_primals=set(), _updates=set(), _ancestors=set())
        return state

    def can_recompute(self, n: fx.Node, memo: dict) -> bool:
        if n in memo:
            return memo[n]
        if n.op != "call_function" or _is_random(n):
            ok = False
        elif isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            ok = False  # an in-place op stays in the forward (the partitioner's rule too)
        elif n.target is operator.getitem:  # a multi-output op's piece: as its op
            src = n.args[0]
            if isinstance(src, fx.Node) and _is_training_bn(src) and n.args[1] >= 3:
                ok = False  # the new running statistics: forward outputs anyway (tiny)
            else:
                ok = isinstance(src, fx.Node) and self.can_recompute(src, memo)
        elif n not in self._ancestors:
            # not computed by the forward: a piece of a backward formula (sin's cos) that reads
            # no tangent; it runs in the backward, as default_partition has it
            ok = not any(a in self._mutated_primals for a in n.all_input_nodes)
        elif _is_training_bn(n):
            ok = _tag(n) in self.recompute and not any(a in self._mutated_primals for a in n.args[:3]
                                                       if isinstance(a, fx.Node))
        elif any(a in self._mutated_primals for a in n.all_input_nodes):
            # the buffer is updated before the backward runs (autograd's version check would
            # refuse it): only the forward reads it
            ok = False
        elif _is_view(n):  # free; its base decides what is held
            ok = True
        else:
            ok = _tag(n) in self.recompute  # kept, or untagged (no captured counterpart): saved
        memo[n] = ok
        return ok

    @staticmethod
    def _inputs(n: fx.Node) -> list:
        if _is_training_bn(n):
            return [a for a in n.args[:3] if isinstance(a, fx.Node)]
        return list(n.all_input_nodes)

    def __call__(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        _, extract, reorder = _imports()
        g = joint.graph
        out_node = next(n for n in reversed(g.nodes) if n.op == "output")
        flat = pytree.tree_leaves(out_node.args)
        fwd_outputs = [a for a in flat[:num_fwd_outputs] if isinstance(a, fx.Node)]
        bwd_outputs = [a for a in flat[num_fwd_outputs:] if isinstance(a, fx.Node)]
        # A: what the forward outputs depend on (the forward graph); fwd: everything that does not
        # depend on a tangent (computable before the backward starts)
        primals = [n for n in g.nodes if n.op == "placeholder" and "tangents" not in str(n.target)]
        self._mutated_primals = {primals[i] for i in self.mutated if i < len(primals)}
        # buffer updates kept in the graph (keep_inference_input_mutations): copy_(buffer, new value)
        # nodes at the joint graph's end, which the forward graph gets; their sources are forward values
        self._updates = {n for n in g.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
                         and n.args[0] in primals and not n.users}
        _training_bn_backward_without_stats(g)
        ancestors: set = set()
        stack = list(fwd_outputs) + [n.args[1] for n in self._updates if isinstance(n.args[1], fx.Node)]
        while stack:
            n = stack.pop()
            if n in ancestors:
                continue
            ancestors.add(n)
            stack.extend(n.all_input_nodes)
        after_tangent: set = set()
        for n in g.nodes:
            if (n.op == "placeholder" and "tangents" in str(n.target)) or any(a in after_tangent for a in n.all_input_nodes):
                after_tangent.add(n)
        fwd = {n for n in g.nodes if n not in after_tangent and n.op != "output"}
        self._ancestors = ancestors
        if ancestors and not any(_tag(n) is not None for n in ancestors):
            raise AotUnavailable("AOTAutograd did not carry graphopt's node tags (meta['custom']) into the joint graph")
        # the forward updates its buffers in place before the backward runs: a backward that read one
        # would see the new value where the joint graph means the old
        for n in g.nodes:
            if n not in fwd and n.op != "output" and any(a in self._mutated_primals for a in n.all_input_nodes):
                raise AotUnavailable(f"the backward reads a buffer the forward updates ({n.name})")
        # forward values the backward reads, walked back through what may be recomputed
        needed = []
        for n in g.nodes:
            if n not in fwd and n.op != "output":
                needed.extend(a for a in n.all_input_nodes if a in fwd)
        memo: dict = {}
        saved, sym, recomputed, seen = [], [], [], set()
        for a in bwd_outputs:  # a gradient that is a forward value itself (rare): saved as it is
            if a in fwd and a not in seen and a.op != "placeholder":
                seen.add(a)
                (saved if isinstance(a.meta.get("val"), torch.Tensor) else sym).append(a)
        stack = list(reversed(needed))
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            val = n.meta.get("val")
            if n.op == "placeholder":
                saved.append(n)
            elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                sym.append(n)
            elif self.can_recompute(n, memo):
                recomputed.append(n)
                stack.extend(a for a in self._inputs(n) if a in fwd)
            elif isinstance(val, torch.Tensor):
                saved.append(n)
            else:  # a multi-output op read directly (not through getitem): cannot be cut here
                raise AotUnavailable(f"the backward reads {n.name} ({n.target}) whole")
        order = {n: i for i, n in enumerate(g.nodes)}
        saved.sort(key=order.get)
        sym.sort(key=order.get)
        recomputed.sort(key=order.get)
        self._duplicate(g, ancestors, recomputed, order)
        info = {"saved": [(n.name, _tag(n), _nbytes(n) if n.op != "placeholder" else 0) for n in saved],
                "recomputed": [(n.name, _tag(n), str(n.target)) for n in recomputed
                               if n in ancestors and not _is_view(n)],
                "untagged_saved": [n.name for n in saved if n.op != "placeholder" and _tag(n) is None],
                # positions of the inputs the backward keeps (an earlier region's activations among them)
                "saved_inputs": [primals.index(n) for n in saved if n in primals],
                # saved values that are also forward outputs: (name, position among the forward outputs)
                "saved_outputs": [(n.name, fwd_outputs.index(n)) for n in saved if n in fwd_outputs],
                "num_fwd_outputs": len(flat[:num_fwd_outputs]),
                # a training BatchNorm's new running statistics (forward outputs anyway; [C] each)
                "running_stats_saved": [n.name for n in saved if n.target is operator.getitem
                                        and isinstance(n.args[0], fx.Node) and _is_training_bn(n.args[0])
                                        and n.args[1] >= 3]}
        fw, bw = extract(joint, saved, sym, num_fwd_outputs=num_fwd_outputs)
        if reorder is not None:
            bw = reorder(bw)
        info["saved_activation_bytes"] = sum(b for _, _, b in info["saved"])
        info["bw_ops"] = [(n.name, _tag(n), str(n.target)) for n in bw.graph.nodes if n.op == "call_function"]
        info["fw_graph"], info["bw_graph"] = fw, bw
        self.last = info
        return fw, bw

    def _duplicate(self, g: fx.Graph, ancestors: set, recomputed: list, order: dict) -> None:
        """Copy the recomputed nodes the forward computes (inputs mapped to copies) and point every
        other node at the copies. The graph is laid out as: the forward's nodes, the copies, the
        rest (nodes off the forward moved after the copies, keeping their order)."""
        redo = [n for n in recomputed if n in ancestors]
        if not redo:
            return
        tangents = [n for n in g.nodes if n.op == "placeholder" and "tangents" in str(n.target)]
        firsts = [u for t in tangents for u in t.users]
        anchor = min(firsts, key=order.get) if firsts else next(n for n in g.nodes if n.op == "output")
        if any(order[n] >= order[anchor] for n in ancestors if n.op != "placeholder"):
            raise AotUnavailable("the joint graph interleaves forward and backward ops")
        off_forward = [n for n in g.nodes if order[n] < order[anchor] and n not in ancestors and n.op != "placeholder"]
        for n in off_forward:
            anchor.prepend(n)
        first = off_forward[0] if off_forward else anchor
        copies: dict = {}
        no_stats = _bn_no_stats()
        with g.inserting_before(first):
            for n in redo:
                if _is_training_bn(n):
                    x, w, b, _, _, _, momentum, eps = n.args[:8]
                    c = g.call_function(no_stats, (copies.get(x, x), copies.get(w, w), copies.get(b, b), True,
                                                   momentum, eps))
                    c.meta = {k: v for k, v in n.meta.items() if k != "val"}
                    val = n.meta.get("val")
                    if isinstance(val, (tuple, list)):
                        c.meta["val"] = tuple(val[:3])
                else:
                    c = g.node_copy(n, lambda a: copies.get(a, a))
                copies[n] = c
        made = set(copies.values())
        for v in list(g.nodes):
            if v in ancestors or v.op == "output" or v in made or v in self._updates:
                continue  # (a buffer update writes the forward's value, not a recomputed copy)
            for a in list(v.all_input_nodes):
                if a in copies:
                    v.replace_input_with(a, copies[a])


def _training_bn_backward_without_stats(g: fx.Graph) -> int:
    """A training BatchNorm's backward (``native_batch_norm_backward``, train=True) reads the saved
    mean and inverse std, never the running statistics (eager passes None for a BatchNorm without
    them): pass None, so the backward neither saves nor reads buffers the forward updates in place.
    Returns how many."""
    count = 0
    for n in g.nodes:
        if n.target is not torch.ops.aten.native_batch_norm_backward.default or len(n.args) < 8 or n.args[7] is not True:
            continue
        if n.args[3] is not None or n.args[4] is not None:
            args = list(n.args)
            args[3] = args[4] = None
            n.args = tuple(args)
            count += 1
    return count


def fold_buffer_increments(gm: fx.GraphModule) -> int:
    """``copy_(buf, add(buf, c))`` (a buffer update kept in the graph, e.g. BatchNorm's
    ``num_batches_tracked += 1``) → ``add_(buf, c)``: one kernel, not two. Returns how many."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.target is not torch.ops.aten.copy_.default or n.users or len(n.args) != 2:
            continue
        dst, src = n.args
        if (not isinstance(src, fx.Node) or src.target is not torch.ops.aten.add.Tensor or len(src.users) != 1
                or src.args[0] is not dst or len(src.args) != 2 or src.kwargs
                or isinstance(src.args[1], fx.Node)):
            continue
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(torch.ops.aten.add_.Tensor, (dst, src.args[1]))
        new.meta = dict(n.meta)
        gm.graph.erase_node(n)
        gm.graph.erase_node(src)
        count += 1
    if count:
        gm.recompile()
    return count


# --------------------------------------------------------------------------- the runtime module


def native_training_bn(gm: fx.GraphModule) -> int:
    """Rewrite each training ``aten.batch_norm`` of ``gm`` as ``_native_batch_norm_legit`` (the op
    batch_norm runs without cuDNN: same output, running statistics updated in place, which
    functionalization turns into outputs). Tags and metadata carry over. Returns how many."""
    legit = getattr(getattr(torch.ops.aten, "_native_batch_norm_legit", None), "default", None)
    if legit is None:
        return 0
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.batch_norm.default or n.kwargs:
            continue
        a = n.args
        if len(a) < 8 or a[5] is not True or a[3] is None or a[4] is None:
            continue
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(legit, (a[0], a[1], a[2], a[3], a[4], True, a[6], a[7]))
            out = gm.graph.call_function(operator.getitem, (new, 0))
        new.meta = {k: v for k, v in n.meta.items() if k != "val"}
        out.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count


def cudnn_training_bn(gm: fx.GraphModule) -> int:
    """In a compiled forward graph, run each fp32 CUDA training BatchNorm
    (``_native_batch_norm_legit_functional``) as ``cudnn_batch_norm``, as eager does: one cuDNN
    kernel where aten's channels_last BatchNorm runs two and allocates and zeroes its scratch
    (host and device time on every BatchNorm of the step). cuDNN updates the running
    statistics it is given in place. Where the graph ends with its own buffer updates,
    ``copy_(buffer, new statistic)`` (AOTAutograd keeps buffer mutations in the graph) and nothing
    else reads those buffers, it gets the buffers and the copies go (the backward reads neither:
    ``Partitioner`` passes None for a training backward's running statistics). Otherwise it gets
    copies, returned as the new values. Its saved mean and inverse standard deviation are what
    ``native_batch_norm_backward`` reads. Returns how many."""
    fn = _bn_functional()
    op = getattr(getattr(torch.ops.aten, "cudnn_batch_norm", None), "default", None)
    if fn is None or op is None or not torch.backends.cudnn.is_available():
        return 0
    count = 0
    for n in list(gm.graph.nodes):
        if n.target is not fn or len(n.args) < 8 or n.args[5] is not True or n.kwargs:
            continue
        x, w, b, rm, rv = n.args[:5]
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, w, b, rm, rv)]
        if not all(isinstance(v, torch.Tensor) and v.is_cuda and v.dtype == torch.float32 for v in vals):
            continue
        if vals[0].dim() != 4:
            continue  # cuDNN's 2-D spatial path
        users = list(n.users)
        if not all(u.target is operator.getitem for u in users):
            continue
        # the graph's own buffer updates, copy_(buffer, new statistic), with nothing else reading
        # the buffer: cuDNN updates the buffers themselves and the copies go
        updates = {}
        for u in users:
            if u.args[1] in (3, 4):
                buf = (rm, rv)[u.args[1] - 3]
                sinks = list(u.users)
                if (len(sinks) == 1 and sinks[0].target is torch.ops.aten.copy_.default and sinks[0].args[0] is buf
                        and buf.op == "placeholder" and set(buf.users) == {n, sinks[0]}):
                    updates[u] = sinks[0]
        in_place = len(updates) == sum(1 for u in users if u.args[1] in (3, 4)) == 2
        with gm.graph.inserting_before(n):
            stats = [rm, rv] if in_place else [gm.graph.call_function(torch.ops.aten.clone.default, (a,))
                                                for a in (rm, rv)]
            c = gm.graph.call_function(op, (x, w, b, *stats, True, n.args[6], n.args[7]))
        if not in_place:
            for t, v in zip(stats, vals[3:]):
                t.meta["val"] = v
        c.meta = {k: v for k, v in n.meta.items() if k != "val"}
        for u in users:
            i = u.args[1]
            if i in (3, 4) and in_place:  # cuDNN updated the buffer itself: its copy_ goes
                gm.graph.erase_node(updates[u])
                gm.graph.erase_node(u)
            elif i in (3, 4):  # the new running statistics: the updated copies
                u.replace_all_uses_with(stats[i - 3])
                gm.graph.erase_node(u)
            else:  # 0 output, 1 mean, 2 inverse standard deviation: the same positions
                u.args = (c, i)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count


def views_as_reshapes(gm: fx.GraphModule) -> int:
    """Every ``view`` of ``gm`` (an AOTAutograd graph) as a ``reshape``. AOTAutograd lowers a
    model's ``reshape`` to ``view`` where the traced strides allow it, so the graph relies on
    every value keeping its traced layout; after a rewrite that changes a value's layout (a
    fused pointwise kernel writes its output contiguous where the ops it replaced followed
    their first input's layout) such a view fails on the real tensors. ``reshape`` is the same
    view where the strides allow one and a copy where not. Returns how many."""
    views = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
    count = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in views:
            n.target = torch.ops.aten.reshape.default
            count += 1
    if count:
        gm.recompile()
    return count


def _functorch_level() -> int:
    top = torch._C._functorch.peek_interpreter_stack()
    return top.level() if top is not None else 0


def _pop_functorch_levels_above(level: int) -> int:
    """Pop the functorch transform levels above ``level`` a failed trace left pushed (torch 2.11: a
    vmap level after AOTAutograd's "Cannot access storage of BatchedTensorImpl"; every autograd.Function
    applied after it, a checkpoint's included, then believed it ran under vmap and failed). Returns
    how many were popped."""
    functorch = torch._C._functorch
    pop = {functorch.TransformType.Vmap: functorch._vmap_decrement_nesting,
           functorch.TransformType.Grad: functorch._grad_decrement_nesting,
           functorch.TransformType.Jvp: functorch._jvp_decrement_nesting,
           functorch.TransformType.Functionalize: functorch._func_decrement_nesting}
    popped = 0
    while (top := functorch.peek_interpreter_stack()) is not None and top.level() > level:
        undo = pop.get(top.key())
        if undo is None:
            break
        undo()
        popped += 1
    return popped


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad)
                 if isinstance(a, torch.Tensor) else ("v", repr(a)) for a in args)


def _is_fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


class AotRecompute(nn.Module):
    """The forward body of a training graph compiled by AOTAutograd with our partition: one
    forward graph (returns the outputs and the saved values) and one backward graph (recomputes
    what the plan does not keep). Arguments: parameters and buffers (read from the parent graph
    on every call, so they are the model's own tensors) and the model's inputs. One compilation
    per input signature (shapes, strides, dtypes, devices), the first made at optimization time."""

    # a call runs a compiled forward graph and its backward a compiled backward graph (no Python state per
    # call that a replay would skip): a training step calling it may be captured into CUDA graphs
    # (graphopt.replay.replayable_region)
    graph_replay_safe = True

    def __init__(self, body: fx.GraphModule, recompute: set, keep: set, mutated: tuple = (), max_compiled: int = 8):
        super().__init__()
        native_training_bn(body)
        self.body = body
        self.partitioner = Partitioner(recompute, keep, mutated)
        self.max_compiled = max_compiled
        self._compiled: dict = {}
        self.partitions: dict = {}  # signature -> the partition's info (saved values, recomputed ops)
        self.frees_inputs = True
        self.cost: dict | None = None  # flops/bytes/launches/time of the body plus its recomputation
        # fuse(gm) -> int: rewrites a compiled forward/backward graph in place before it runs (the
        # pointwise fusion of insert_checkpoints' AOT backend), returns the groups fused
        self.fuse = None
        self.fuse_errors: list = []

    def __getstate__(self):
        """Without the compiled functions (AOTAutograd's runtime objects do not copy; a copy
        compiles again at its first call of a signature)."""
        state = dict(self.__dict__)
        state["_compiled"] = {}
        return state

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return new

    def compile(self, args) -> dict:
        """Compile for these (real or fake) arguments; returns the partition's info."""
        aot, _, _ = _imports()
        key = _signature(args)
        if len(self._compiled) >= self.max_compiled:
            oldest = next(iter(self._compiled))
            self._compiled.pop(oldest)
            self.partitions.pop(oldest, None)

        holder = {}

        def fused(gm, which):
            """``self.fuse`` over a compiled graph (pointwise fusion: the graphs run without
            autograd, so graphopt's kernels may appear in them); a failure leaves it as it was.
            A fused kernel may lay out its output otherwise than the ops it replaced did, and
            the backward receives the forward's values: both graphs' views become reshapes."""
            if self.fuse is None:
                return gm
            try:
                holder[which + "_fused"] = self.fuse(gm)
            except Exception as e:  # noqa: BLE001 - the unfused graph is correct as it is
                holder[which + "_fuse_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                self.fuse_errors.append(holder[which + "_fuse_error"])
            holder[which + "_reshapes"] = views_as_reshapes(gm)
            return gm

        def fw_compiler(gm, example_inputs):
            holder["fw_cudnn_bn"] = cudnn_training_bn(gm)
            holder["fw_increments"] = fold_buffer_increments(gm)
            holder["fw"] = gm = fused(gm, "fw")
            run = _boxed(gm)
            self.frees_inputs = self.frees_inputs and run.frees_inputs
            return run

        def bw_compiler(gm, example_inputs):
            holder["bw"] = gm = fused(gm, "bw")
            run = _boxed(gm)
            self.frees_inputs = self.frees_inputs and run.frees_inputs
            return run

        level = _functorch_level()
        try:
            # cuDNN stays on while tracing, so a convolution's traced output has the layout it will
            # have at call time (with cuDNN off, a channels_last convolution traces as contiguous:
            # every tangent was then copied to that layout and BatchNorm's backward met mixed
            # layouts). Training BatchNorms were rewritten to the native op (functionalized with its
            # running statistics as outputs; batch_norm would pick cudnn_batch_norm, which updates
            # them behind functionalization's back), and attention picks among the backends the
            # caller has enabled, as eager does (cuDNN's on a Hopper GPU, where excluding it left
            # masked attention to the slower memory-efficient kernel).
            # Buffer updates stay in the forward graph (copy_ nodes, as Inductor has them): no
            # copies back after each call, and cuDNN's BatchNorm may update the buffers directly.
            fn = aot(self.body, list(args), fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                     partition_fn=self.partitioner, keep_inference_input_mutations=True)
        except AotUnavailable:
            _pop_functorch_levels_above(level)
            raise
        except Exception as e:
            _pop_functorch_levels_above(level)
            raise AotUnavailable(f"AOTAutograd could not trace the graph: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else ''}") from e
        if self.partitioner.last is None:
            raise AotUnavailable("AOTAutograd traced no backward (no input requires grad)")
        info = dict(self.partitioner.last)
        info["graphs"] = holder  # what the compilers were given (the backward's: at its first run)
        self._compiled[key] = fn
        self.partitions[key] = info
        self.partitioner.last = None
        return info

    def forward(self, *args):
        if (not torch.is_grad_enabled() or any(_is_fake(a) for a in args if isinstance(a, torch.Tensor))
                or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return self.body(*args)  # no backward: the captured body as it is
        key = _signature(args)
        fn = self._compiled.get(key)
        if fn is None:
            self.compile(args)
            fn = self._compiled[key]
        outs = tuple(fn(*args))
        self._keep_unreached_grads_none(args, outs)
        return outs

    def _influence(self) -> list:
        """For each body input, a bitmask of the outputs it reaches (computed once)."""
        if getattr(self, "_reach", None) is None:
            reach: dict = {}
            # what in-place writes put into a storage (attn[:, 1:] += bias: the bias reaches every
            # later reader of attn's storage, though no edge leads from the add_ to them)
            storage, _ = ir.storages(self.body)
            written: dict = {}
            into = lambda a: reach.get(a, 0) | written.get(storage.get(a, a), 0)  # noqa: E731
            inputs = 0
            for n in self.body.graph.nodes:
                if n.op == "placeholder":
                    reach[n] = 1 << inputs
                    inputs += 1
                else:
                    m = 0
                    for a in n.all_input_nodes:
                        m |= into(a)
                    reach[n] = m
                    for w in ir.written(n):
                        written[storage.get(w, w)] = written.get(storage.get(w, w), 0) | m
            out_node = next(n for n in reversed(self.body.graph.nodes) if n.op == "output")
            outs = list(pytree.tree_leaves(out_node.args))
            self._reach = [sum(1 << j for j, o in enumerate(outs) if isinstance(o, fx.Node) and into(o) >> i & 1)
                           for i in range(inputs)]
        return self._reach

    def _keep_unreached_grads_none(self, args, outs) -> None:
        """AOTAutograd's backward gives every input that needs a gradient one, zeros where no used
        output depends on it; eager leaves such a parameter's ``.grad`` None (an optimizer then
        skips it). Parameters whose ``.grad`` is None and that reach only outputs the backward
        never reached get None back at the end of the backward."""
        if torch._C._current_graph_task_id() != -1:
            # run inside a backward: a checkpoint's rerun of this forward (two-level recomputation).
            # The first run watches the parameters; a second watch, set while their gradients are
            # being computed, put them back to None (every gradient a region under an outer
            # checkpoint computed was lost: Mamba's mixer with a memory budget)
            return
        reach = self._influence()
        used = sum(1 << j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
        watch = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf
                 and a.grad is None and i < len(reach) and (reach[i] & used) != used]
        if not watch:
            return
        state = {"received": 0, "queued": False}
        # the hooks live as long as the outputs (until the backward): they hold the watched
        # parameters only, never the other arguments (activations the backward does not save)
        watched = [(args[i], reach[i]) for i in watch]

        def restore():
            for param, mask in watched:
                if not mask & state["received"]:
                    param.grad = None

        def hook(j):
            def fn(grad):
                if grad is None:  # the output's node ran for another output: nothing flowed here
                    return
                state["received"] |= 1 << j
                if not state["queued"]:
                    state["queued"] = True
                    torch.autograd.Variable._execution_engine.queue_callback(restore)
            return fn

        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(hook(j))


def tag_nodes(nodes) -> None:
    for n in nodes:
        custom = n.meta.get("custom")
        custom = dict(custom) if isinstance(custom, dict) else {}
        custom[TAG] = n.name
        n.meta["custom"] = custom


def example_args(inputs: list, gm: fx.GraphModule, hints: dict | None, requires_grad=None):
    """Arguments to compile with at optimization time: parameters/buffers as they are (real),
    graph inputs as fake tensors of the captured shapes (concrete, from ``hints``);
    ``requires_grad(node)`` says whether an input will require grad when called (an earlier
    region's activation does), so the first call finds this compilation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    out = []
    for a in inputs:
        if a.op == "get_attr":
            val = ir.get_attr_value(gm, a.target)
            out.append(mode.from_tensor(val) if isinstance(val, torch.Tensor) else val)
            if isinstance(val, torch.Tensor) and val.requires_grad and not out[-1].requires_grad:
                out[-1].requires_grad_(True)
            continue
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            out.append(val)
            continue
        c = lambda v: int(ir.concrete(ir._dim(v), hints))  # noqa: E731
        with mode:
            t = torch.empty_strided([c(d) for d in val.shape], [c(s) for s in val.stride()], dtype=val.dtype,
                                    device=val.device)
        if (requires_grad(a) if requires_grad is not None else val.requires_grad) and t.is_floating_point():
            t.requires_grad_(True)
        out.append(t)
    return out

# --------------------------------------------------------------------------- the rewrite


def rewrite_aot(gm: fx.GraphModule, ctx: PassContext, am: ActivationModel, plan: Plan, res: PassResult,
                details: dict, strict: bool, every_region: bool = False, fuser=None) -> None:
    """Each region of the plan that recomputes something becomes one AotRecompute call (its
    own autograd function, so its parameters' gradients are released when its backward ends,
    as eager's are, not all at the end of one whole-graph backward), compiled here. If the
    first cannot be traced, AotUnavailable is raised before anything changed; a later one
    runs as selective-checkpoint regions instead (or, ``strict``, raises GraphoptError).
    ``every_region``: regions that recompute nothing are compiled too (fuse_training_graph);
    ``fuser(graph) -> groups fused``, when given, rewrites each compiled forward and backward graph
    (pointwise fusion) before it runs."""
    tag_nodes(am.body)
    keep = {n.name for n in am.body if n in plan.keep}
    recompute = {n.name for n in am.body if n not in plan.keep}
    totals = {"saved": 0, "values": 0, "recomputed": 0, "untagged": 0, "regions": 0}
    held_inputs: set = set()  # activations a region receives and saves (counted once)
    aot_ops: dict = {}  # joint-graph ops rerun in the backward graphs, by op
    by_name = {n.name: n for n in am.body}

    def needs_grad(node) -> bool:  # an activation flowing in from the graph (or an earlier region)
        src = by_name.get(node.meta.get("ckpt_source", node.name))
        if src is not None:
            return bool(am.grad.get(src, False))
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.requires_grad

    def saved_as_captured(nodes) -> None:
        """A region left as captured: eager autograd saves what the activation model probed
        (a max-pool's indices, a norm's statistics), each storage counted once."""
        for n in nodes:
            for r in am.saved.get(n, ()):
                if r in am.bytes and r not in held_inputs and r not in am.outputs:
                    held_inputs.add(r)
                    totals["saved"] += am.bytes[r]
                    totals["values"] += 1
            if am.extra.get(n, 0.0) > 0:
                totals["saved"] += am.extra[n]
                totals["values"] += 1

    frees, fallbacks = True, []
    details["selective_regions"] = 0
    for i, nodes in enumerate(plan.regions):
        for n in nodes:
            n.meta[REGION] = i
    for i, nodes in enumerate(plan.regions):
        rerun = [n for n in nodes if n not in plan.keep]
        if not rerun and not every_region:
            saved_as_captured(nodes)
            continue
        made = {}

        def make_module(body_gm, inputs, mutated, outputs):
            module = AotRecompute(body_gm, recompute, keep, mutated)
            module.fuse = fuser
            try:
                example = example_args(inputs, gm, ctx.hints, requires_grad=needs_grad)
            except Exception as e:
                raise AotUnavailable(f"no example inputs to compile with: {type(e).__name__}: {e}") from e
            made["info"] = module.compile(example)
            made["module"], made["inputs"], made["outputs"] = module, list(inputs), list(outputs)
            return module

        try:
            call = extract_region(gm, nodes, plan.keep, f"ckpt_aot_{i}", ctx, make_module=make_module)
        except AotUnavailable as e:
            if totals["regions"] == 0 and not fallbacks:
                raise  # nothing changed yet: the caller falls back as a whole
            if strict:
                raise GraphoptError(f"checkpoint_backend 'aot' cannot run region {i}: {e}") from e
            fallbacks.append(f"region {i}: {e}")
            checkpoint_regions(gm, ctx, am, plan, res, details, [nodes], f"ckpt_region_{i}_")
            continue
        if call is None:
            res.reject(f"checkpoint region {i} ({nodes[0].name}…{nodes[-1].name})",
                       "a node outside the region both reads it and feeds it; left as it is")
            saved_as_captured(nodes)
            continue
        info, module = made["info"], made["module"]
        totals["regions"] += 1
        totals["saved"] += info["saved_activation_bytes"]
        totals["values"] += len([s for s in info["saved"] if s[2] > 0])
        # a saved graph output is the caller's (the plan counts it with the outputs)
        for _, tag, b in info["saved"]:
            root = am.root.get(by_name.get(tag), None)
            if b > 0 and root in am.outputs and b == am.bytes.get(root):
                totals["saved"] -= b
                totals["values"] -= 1
        # a saved region output that a later region also saves as its input is one tensor
        outs = made["outputs"]
        first_user_output = info["num_fwd_outputs"] - len(outs)  # mutated buffers come first
        for _, pos in info["saved_outputs"]:
            k = pos - first_user_output
            if 0 <= k < len(outs):
                held_inputs.add(am.root.get(outs[k], outs[k]))
        totals["recomputed"] += len(info["recomputed"])
        for _, _, target in info["recomputed"]:
            op = str(target).split(".")[-2] if str(target).count(".") >= 2 else str(target)
            aot_ops[op] = aot_ops.get(op, 0) + 1
        totals["untagged"] += len(info["untagged_saved"])
        totals["fused"] = totals.get("fused", 0) + int(info["graphs"].get("fw_fused") or 0)
        if info["graphs"].get("fw_fuse_error"):
            res.notes.append(f"region {i}: forward graph left unfused ({info['graphs']['fw_fuse_error']})")
        for pos in info["saved_inputs"]:
            src = made["inputs"][pos] if pos < len(made["inputs"]) else None
            src = by_name.get(src.meta.get("ckpt_source", src.name)) if src is not None else None
            root = am.root.get(src, src) if src is not None else None
            if root is not None and root in am.bytes and root not in held_inputs:
                held_inputs.add(root)
                totals["saved"] += am.bytes[root]
                totals["values"] += 1
        frees = frees and module.frees_inputs
        if every_region:
            res.record(f"training region {i} as AOT forward/backward graphs with pointwise fusion "
                       f"({info['graphs'].get('fw_fused') or 0} forward groups)", [n.name for n in nodes][:6], [call], 0.0)
        else:
            res.record(f"recompute by graph rewrite, region {i} (AOTAutograd partition: {len(info['recomputed'])} "
                       f"forward ops rerun in backward)", [n.name for n in rerun][:6], [call],
                       -sum(am.seconds[n] for n in rerun))
    if totals["regions"] == 0 and not fallbacks:
        raise AotUnavailable("no region recomputes anything")
    # (a region run as a selective checkpoint saves what its policy caches; a graph traced on
    # another device than the plan's saves what that device's kernels do: CPU attention for a GPU plan)
    traced = next((v.device.type for n in gm.graph.nodes if n.op == "placeholder"
                   and isinstance(v := n.meta.get("val"), torch.Tensor)), None)
    if not fallbacks:
        _check_saved_against_plan(plan, totals["saved"], res, details, correct=traced == ctx.cost.device_kind)
    if plan.segments:
        wrap_segments(gm, ctx, am, plan, res, details)
    details.update(
        regions=totals["regions"] + details.get("selective_regions", 0),
        aot_regions=totals["regions"],
        aot_saved_bytes=totals["saved"],
        aot_saved_values=totals["values"],
        aot_recomputed_ops=totals["recomputed"],
        aot_recomputed_by_op=dict(sorted(aot_ops.items(), key=lambda kv: -kv[1])),
        aot_untagged_saved=totals["untagged"],
        aot_frees_saved_inputs=frees,
    )
    if fuser is not None:
        details["aot_fused_forward_groups"] = totals.get("fused", 0)
        res.notes.append(f"pointwise fusion in the AOT graphs (fuse_elementwise is on): {totals.get('fused', 0)} "
                         "groups in the forward graphs; the backward graphs are fused when first compiled "
                         "(at the first backward)")
    if fallbacks:
        details["aot_fallbacks"] = fallbacks
        res.notes.append(f"{len(fallbacks)} region(s) ran as selective checkpoints instead: {fallbacks[0]}")
    if not frees:
        res.notes.append("this torch lacks fx's boxed codegen: a backward graph holds its saved inputs "
                         "until it returns")
    if totals["untagged"]:
        res.notes.append(f"{totals['untagged']} joint-graph value(s) with no captured counterpart "
                         "saved (as default_partition would)")
    gm.recompile()


def _check_saved_against_plan(plan: Plan, saved: float, res: PassResult, details: dict, rel: float = 0.02,
                              correct: bool = True) -> None:
    """The AOT partitions (and the regions left as captured) save ``saved`` bytes; the plan's walk
    counted ``plan.one_level_saved`` for the same regions (the two count a value saved by one region
    and read by another in either region, so only the totals compare). Where they differ
    (``correct``: the graph was traced on the device planned for), the predicted memory follows
    what is saved (the plan's numbers moved by the difference) and a note says so."""
    planned = plan.one_level_saved
    if planned is None:
        return
    details["plan_saved_bytes"] = planned
    if not correct or abs(saved - planned) <= rel * max(planned, 1.0):
        return
    delta = saved - planned
    for key in ("predicted_saved_bytes", "predicted_held_bytes", "predicted_activation_bytes", "predicted_peak_bytes"):
        if key in details:
            details[key] += delta
    res.notes.append(f"the AOT partitions save {format_bytes(saved)} where the plan counted {format_bytes(planned)}: "
                     f"the predicted memory is moved by the difference ({'+' if delta > 0 else '-'}"
                     f"{format_bytes(abs(delta))})")


def wrap_segments(gm: fx.GraphModule, ctx: PassContext, am: ActivationModel, plan: Plan, res: PassResult,
                  details: dict) -> None:
    """Two-level recomputation: each segment (a run of the plan's regions, now AOT region
    calls, selective-checkpoint calls or nodes left as they were) becomes one plain
    checkpoint region around them (``OuterCheckpoint``)."""
    rows = []
    for k, (a, b) in enumerate(plan.segments):
        order = list(gm.graph.nodes)
        where = [i for i, n in enumerate(order) if a <= n.meta.get(REGION, -1) <= b]
        if not where:
            continue
        nodes = [n for n in order[where[0]:where[-1] + 1] if n.op not in ("placeholder", "get_attr", "output")]
        mutated = []
        for n in nodes:
            if n.op == "call_module":
                sub = gm.get_submodule(n.target)
                pos = sub.partitioner.mutated if isinstance(sub, AotRecompute) else getattr(sub, "mutated", ())
                mutated.extend(n.args[i] for i in pos)
            else:
                mutated.extend(mutated_args(n))
        secs = sum(am.seconds.get(n, 0.0) for r in plan.regions[a:b + 1] for n in r)
        # what the segment's calls and nodes cost (the plain nodes as a region that keeps them all),
        # plus the forward rerun
        inners = {n: getattr(gm.get_submodule(n.target), "cost", None) if n.op == "call_module" else None for n in nodes}
        plain = [n for n in nodes if not (isinstance(inners[n], dict) and "time_s" in inners[n])]
        cost = region_cost(ctx, plain, set(plain))
        cost["recompute_s"] += secs
        for n in nodes:
            if n not in plain:
                for key in cost:
                    cost[key] += inners[n].get(key, 0.0)
        call = outer_region(gm, nodes, mutated, f"ckpt_outer_{k}", cost)
        rows.append({"regions": [a, b], "forward_rerun_ms": secs * 1e3})
        res.record(f"outer checkpoint over regions {a}-{b} (their forward reruns once in backward; only the "
                   "segment's inputs are held through the forward)", [n.name for n in nodes][:6], [call], -secs)
    details["segments"] = rows


def fuse_training_graph(gm: fx.GraphModule, ctx: PassContext, fuser=None, regions: int = 4,
                        fuse: bool = True) -> PassResult:
    """Run a training graph's body as AOT regions that recompute nothing, so that its forward and
    backward graphs get pointwise fusion by ``fuser`` (a callable over a graph, as
    :func:`rewrite_aot` takes it; None where no fusion pays, and the graph is left as it is;
    ``fuse=False`` compiles the regions without it). Used for pipeline stages, which are not
    checkpointed. Only runs of ATen ops are taken (a stage's gradient-layout shims stay outside), cut into about
    ``regions`` pieces so each piece's backward hands its parameters' gradients back when it ends.
    Returns the record; the graph is unchanged when fusion or AOTAutograd is unavailable."""
    res = PassResult("fuse_training", "fusion")
    if fuse and fuser is None:
        res.notes.append("no pointwise fusion for this plan (fuse_elementwise off, or not a GPU)")
        return res
    why = available()
    if why is not None:
        res.notes.append(f"AOT backend unavailable: {why}")
        return res
    am = ActivationModel.build(gm, ctx.cost, ctx.hints, device_kind=ctx.cost.device_kind)

    def traceable(n):
        return n.op == "call_function" and (isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem)

    runs, cur = [], []
    for n in am.body:
        if traceable(n):
            cur.append(n)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    size = max(1, sum(len(r) for r in runs) // max(regions, 1))
    chunks = []
    for r in runs:
        start = 0
        while start < len(r):
            end = min(start + size, len(r))
            # never cut between a multi-output node and the getitems that unpack it
            while end < len(r) and (r[end].target is operator.getitem or
                                    isinstance(r[end - 1].meta.get("val"), (tuple, list))):
                end += 1
            chunks.append(r[start:end])
            start = end
    if not chunks:
        res.notes.append("no ATen ops to compile")
        return res
    body = [n for c in chunks for n in c]
    plan = Plan(set(am.body), chunks, 0.0, 0.0, 0.0)
    details: dict = {}
    try:
        rewrite_aot(gm, ctx, am, plan, res, details, strict=False, every_region=True,
                    fuser=fuser if fuse else None)
    except AotUnavailable as e:
        res.notes.append(f"left as it is: {e}")
        return res
    res.details = details
    res.changed = bool(res.rewrites)
    res.status = "applied" if res.changed else "unchanged"
    res.notes.append(f"{len(body)} ATen ops in {details.get('aot_regions', 0)} AOT regions"
                     + (" with pointwise fusion" if fuse else ""))
    return res
