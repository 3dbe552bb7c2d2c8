"""insert_checkpoints: fit a training step into a memory budget by recomputing activations.

Training graphs only, and only when a ``memory_budget`` is set (``graphopt.optimize(...,
training=True, memory_budget=0.4)``: a fraction of the baseline step's activation memory — saved
tensors, outputs and the backward's working set — or bytes).

1. The activation memory model (:mod:`graphopt.cost.activations`) says what autograd saves for
   every node and how many bytes, and the cost model what recomputing each node costs.
2. Selection is a knapsack: each node either keeps its output for backward (memory: the bytes
   it owns plus what its op saves internally) or is recomputed in backward (time: its cost-model
   time). Nodes are moved to "recompute" in order of recompute-seconds per byte freed — views
   and casts first, then norms, activations and other memory-bound elementwise ops, then
   GEMMs/convolutions, attention last — until the outputs, the backward's working set, the
   predicted saved bytes and the recomputation transient fit the budget. For the aot backend a
   plan is priced as its backward runs (``_Selector.account_needed``: only the recomputation a
   backward formula needs costs time; saved values are those the backward reads; its memory is
   a walk over the backward in the order it runs). The graph outputs are always kept (the caller
   holds them). When no such plan fits, runs of consecutive regions go under an outer
   checkpoint that keeps only their inputs and reruns their forward in backward
   (``_Selector.nest``, ``OuterCheckpoint``: two-level recomputation). If that cannot fit
   either, ``BudgetError`` states the minimum.
3. Rewrite, two backends (``ctx.options.checkpoint_backend``: "auto" | "aot" | "sac"):

   * aot (the default where it works; :mod:`graphopt.passes._aot_recompute`): each region of
     the plan becomes one module that AOTAutograd traces into a joint forward+backward graph, cut by
     graphopt's own partition: the backward receives the values of kept nodes (random ops are
     always kept: dropout masks are saved, never redrawn) and recomputes the rest as copies in
     the backward graph; forward and backward run as plain generated ATen code. "auto" falls back
     to sac, with the reason in the report, when the torch helpers are missing, the graph does
     not trace, or the budget needs a random op recomputed and no two-level plan fits.
   * sac: the graph is cut into regions at points where nothing but kept tensors crosses (so
     checkpoint's own hold on a region's inputs costs nothing extra); each region becomes a
     sub-GraphModule called through ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
     preserve_rng_state=True)`` with a selective-checkpoint policy
     (``create_selective_checkpoint_contexts``): the kept nodes' outputs are cached, the rest
     rerun in backward. Random ops in a region are all kept or all recomputed, so the replayed RNG
     state gives the same dropout masks. Buffers mutated in a region (BatchNorm running stats,
     ``num_batches_tracked``) are swapped for scratch copies when the region is recomputed, so
     they are updated once per step, as in eager. Parameters are passed in from the parent graph,
     so the optimized module keeps using the model's own Parameter objects.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import ir
from graphopt.cost.activations import ActivationModel, format_bytes, layer_of, resolve_budget
from graphopt.errors import BudgetError, GraphoptError
from graphopt.pipeline import Pass, PassContext, PassResult, register

from . import _aot_recompute as aot

aten = torch.ops.aten

# ops that update their running-statistics arguments (positions) in place in training mode,
# though their schemas do not say so
_BN_OPS = {aten.batch_norm.default: (3, 4), aten.native_batch_norm.default: (3, 4),
           aten._native_batch_norm_legit.default: (3, 4), aten.instance_norm.default: (3, 4)}
_BN_TRAINING_ARG = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5,
                    aten._native_batch_norm_legit.default: 5, aten.instance_norm.default: 5}

# region sizes tried (recomputed bytes per region, as shares of the baseline saved bytes)
BACKENDS = ("auto", "aot", "sac")

REGION_SHARES = (0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5)


# --------------------------------------------------------------------------- runtime

_STATE = threading.local()


def _mark(save: bool) -> None:
    """Set in region code before each node: whether the ops that follow are kept (cached)."""
    _STATE.save = save


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    # a kept node's view ops (linear's view of its input, a weight's t()) are rerun, not cached:
    # a cached view would keep the viewed storage alive
    if getattr(_STATE, "save", False) and not getattr(op, "is_view", False):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # a kept composite op (CPU dropout: bernoulli_ then div_) mutates its own fresh outputs
    return create_selective_checkpoint_contexts(_policy, allow_cache_entry_mutation=True)


def _is_fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _write_only(gm: fx.GraphModule, buf: fx.Node) -> bool:
    """Is placeholder ``buf`` of ``gm`` only updated, never read for a value? Its uses: a training
    BatchNorm's running statistic (positions 3 and 4; training BatchNorm never reads them), an
    ``add_`` of a constant whose result nothing reads, or an argument of a submodule call whose
    graph (an AOT region's body) uses it so."""
    aten = torch.ops.aten
    bn_ops = {aten.batch_norm.default, aten._native_batch_norm_legit.default, aten.native_batch_norm.default,
              aten.cudnn_batch_norm.default}
    for u in buf.users:
        if u.op == "call_function" and u.target in bn_ops:
            if len(u.args) < 6 or u.args[5] is not True or buf in u.args[:3] or buf not in u.args[3:5] or u.kwargs:
                return False
        elif u.op == "call_function" and u.target is aten.add_.Tensor:
            if u.users or u.args[0] is not buf or isinstance(u.args[1], fx.Node) or len(u.args) != 2:
                return False
        elif u.op == "call_module":
            sub = gm.get_submodule(u.target)
            body = getattr(sub, "body", sub)
            if not isinstance(body, fx.GraphModule) or u.kwargs:
                return False
            ph = [n for n in body.graph.nodes if n.op == "placeholder"]
            if any(len(ph) <= j or not _write_only(body, ph[j]) for j, a in enumerate(u.args) if a is buf):
                return False
        else:
            return False
    return True


class CheckpointRegion(nn.Module):
    """A graph region run under non-reentrant ``torch.utils.checkpoint`` with a selective
    policy (kept nodes cached, the rest recomputed in backward). ``mutated`` are the argument
    positions of buffers the region updates in place: recomputation works on scratch copies."""

    def __init__(self, body: fx.GraphModule, mutated: tuple, kept: list, recomputed: list, cost: dict,
                 selective: bool | None = None):
        super().__init__()
        self.body = body
        # without kept nodes inside (a kept GEMM may end the region: its output leaves it, and
        # checkpoint's early stop repacks the GEMM's saved inputs before the GEMM would rerun),
        # a plain checkpoint does it: no per-op dispatch mode
        self.selective = bool(kept) if selective is None else selective
        self.mutated = tuple(mutated)
        self.kept, self.recomputed = list(kept), list(recomputed)  # node names
        self.cost = cost  # flops/bytes/launches/time of one forward plus the recomputation

    def forward(self, *args):
        if not torch.is_grad_enabled() or any(_is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            _mark(False)
            return self.body(*args)
        from torch.utils.checkpoint import checkpoint

        # buffers the region updates in place are not checkpoint arguments (checkpoint would
        # save them and see them modified): the forward gets the real ones, the recomputation
        # scratch copies (a buffer nothing reads, only updates, gets a scratch kept across calls)
        real = {i: args[i] for i in self.mutated}
        scratch = {i: self._scratch(i, t) if i in self.write_only() else t.detach().clone()
                   if isinstance(t, torch.Tensor) else t for i, t in real.items()}
        passed = [i for i in range(len(args)) if i not in real]
        calls = [0]

        def run(*a):
            calls[0] += 1
            full = dict(zip(passed, a))
            full.update(real if calls[0] == 1 else scratch)
            try:
                return self.body(*(full[i] for i in range(len(args))))
            finally:
                _mark(False)

        # a region that keeps nothing inside is a plain checkpoint (no dispatch-mode overhead)
        extra = {"context_fn": _contexts} if self.selective else {}
        return checkpoint(run, *(args[i] for i in passed), use_reentrant=False, preserve_rng_state=self.random(),
                          **extra)

    def write_only(self) -> frozenset:
        """The positions among ``mutated`` whose values the region only updates and never reads:
        a training BatchNorm's running statistics, ``num_batches_tracked += 1`` (followed into
        the graphs of the AOT regions the body calls)."""
        if getattr(self, "_write_only_positions", None) is None:
            ph = [n for n in self.body.graph.nodes if n.op == "placeholder"]
            self._write_only_positions = frozenset(i for i in self.mutated
                                                   if i < len(ph) and _write_only(self.body, ph[i]))
        return self._write_only_positions

    def _scratch(self, i: int, t):
        """A scratch buffer for the rerun's updates of write-only buffer ``i``: its contents never
        matter, so one per buffer serves every call (no copy per step)."""
        if not isinstance(t, torch.Tensor):
            return t
        kept = getattr(self, "_scratches", None)
        if kept is None:
            kept = self._scratches = {}
        key = (i, tuple(t.shape), t.dtype, t.device)
        if key not in kept:
            kept[key] = torch.zeros_like(t, memory_format=torch.preserve_format)
        return kept[key]

    def random(self) -> bool:
        """Does the region draw random numbers (its graph, or an AOT region's graph it calls)? Only
        then does checkpoint save and restore the RNG states for the rerun (host time per call)."""
        if getattr(self, "_random", None) is None:
            self._random = any(ir.is_random(n) for m in self.body.modules() if isinstance(m, fx.GraphModule)
                               for n in m.graph.nodes)
        return self._random


# --------------------------------------------------------------------------- selection


@dataclass
class Plan:
    keep: set
    regions: list  # lists of body nodes, in order
    saved_bytes: float  # held for backward after the forward (kept outputs, region inputs)
    transient_bytes: float  # beyond saved_bytes at the worst moment of backward (a region recomputed)
    extra_s: float  # predicted recomputation time
    crossing_bytes: float = 0.0
    notes: list = field(default_factory=list)
    recomputed: set | None = None  # the nodes that rerun (AOT accounting: only those backward needs)
    saved_roots: set | None = None  # the storages saved for backward (AOT accounting)
    early: dict = field(default_factory=dict)  # AOT: recomputed nodes rerun early by a recompute chain
    segments: list = field(default_factory=list)  # AOT: (first, last) region runs under an outer checkpoint
    walk: dict | None = None  # AOT: the memory walk nest() reads

    @property
    def total_bytes(self) -> float:
        return self.saved_bytes + self.transient_bytes


def _mutated_args(n: fx.Node) -> list:
    """Input nodes n updates in place (schema-declared writes, and BatchNorm running stats)."""
    out = []
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return out
    if t in _BN_OPS:
        train_pos = _BN_TRAINING_ARG[t]
        training = n.args[train_pos] if len(n.args) > train_pos else n.kwargs.get("training", False)
        if training:
            out.extend(n.args[i] for i in _BN_OPS[t] if i < len(n.args) and isinstance(n.args[i], fx.Node))
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i < len(n.args) and isinstance(n.args[i], fx.Node):
            out.append(n.args[i])
    return out


# attention is recomputed last (its kernel's time per byte freed is close to a GEMM's, but recomputing it
# also reruns the q/k/v chain it reads)
_ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_flash_attention_forward", "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu"}


def _tier(n: fx.Node) -> int:
    return 1 if isinstance(n.target, torch._ops.OpOverload) and ir.op_name(n) in _ATTENTION_OPS else 0


class _Selector:
    """Chooses what to keep. ``aot``: the plan is realized by the AOT backend, whose backward
    saves exactly the values it needs that are kept (or cross a region boundary) and reruns only
    the recomputed nodes it needs; the accounting then walks back from what backward reads
    (:meth:`account_needed`). Otherwise (selective checkpoint) every kept node's storages are
    cached and every recomputed node reruns (:meth:`account`)."""

    def __init__(self, am: ActivationModel, hints: dict | None = None, keep_random: bool = False,
                 aot: bool = False):
        self.am = am
        self.aot = aot
        body = am.body
        self.index = {n: i for i, n in enumerate(body)}
        self.held_roots = am.saved_roots()
        self.last: dict = {}
        for i, n in enumerate(body):
            for a in n.all_input_nodes:
                r = am.root.get(a, a)
                if r in self.index:
                    self.last[r] = max(self.last.get(r, -1), i)
        for r in am.outputs:
            if r in self.index:
                self.last[r] = len(body)
        # each step, a region copies the buffers it updates in place (for its recomputation)
        mutated = {a for n in body for a in _mutated_args(n) if a.op in ("get_attr", "placeholder")}
        self.scratch_bytes = sum(float(ir.concrete(t.nbytes, hints)) for a in mutated for t in ir.infos(a))
        # parameters (that get gradients) each node reads, for a region's gradient transient
        self.params_of: dict = {}
        self.param_bytes: dict = {}
        for n in body:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].requires_grad:
                    self.params_of.setdefault(n, []).append(a.target)
                    self.param_bytes[a.target] = sum(float(ir.concrete(t.nbytes, hints)) for t in ir.infos(a))
        # the backward's working set at each node (as ActivationModel.backward_working_bytes)
        self.work_pos = [am.node_working_bytes(n) for n in body]
        self.working = am.backward_working_bytes()
        self.forced_recompute = set()
        self.forced_keep = set()
        for n in body:
            val = n.meta.get("val")
            makes_tensors = isinstance(val, (torch.Tensor, tuple, list))
            if am.root.get(n) is n and n in am.outputs:
                self.forced_keep.add(n)  # the caller holds it anyway
            elif keep_random and ir.is_random(n) and makes_tensors:
                self.forced_keep.add(n)  # the AOT backend never reruns a random op (no RNG replay)
            elif self.cost_bytes(n) <= 0 or _mutated_args(n) or not makes_tensors:
                # views/aliases (keeping one would pin its base), buffer updates (rerun on
                # scratch copies), non-tensor values
                self.forced_recompute.add(n)

    def cost_bytes(self, n) -> float:
        """Memory a kept node holds: the selective checkpoint caches every new storage its ops
        return (its output, what it saves, its temporaries)."""
        own = self.am.bytes.get(n, 0.0) if self.am.root.get(n) is n else 0.0
        return max(own + self.am.extra.get(n, 0.0), self.am.made.get(n, 0.0))

    def order(self) -> list:
        """Candidates to recompute, cheapest recompute-seconds per byte freed first (memory-bound
        norms, casts, activations and elementwise ops before GEMMs/convolutions, tiny tensors such
        as a norm's statistics late), attention last."""
        cands = [n for n in self.am.body if n not in self.forced_keep and n not in self.forced_recompute]
        return sorted(cands, key=lambda n: (_tier(n), self.am.seconds[n] / max(self.cost_bytes(n), 1.0),
                                            self.index[n]))

    def evaluate(self, keep: set, cap: float) -> Plan:
        """The plan for a kept set: regions cut where few unkept bytes cross (checkpoint holds a
        region's inputs), each region's recomputed bytes near ``cap``; its memory and time."""
        am, body = self.am, self.am.body
        held = lambda r: r in keep or r in am.outputs  # noqa: E731
        # bytes of unkept tensors live across the boundary after each position
        ends: dict = {}
        live = 0.0
        crossing_at = []
        work_of = []
        for i, n in enumerate(body):
            if am.root.get(n) is n and self.last.get(n, -1) > i and not held(n):
                live += am.bytes.get(n, 0.0)
                ends.setdefault(self.last[n], []).append(n)
            for r in ends.pop(i, []):
                live -= am.bytes.get(r, 0.0)
            crossing_at.append(max(live, 0.0))
            w = 0.0
            if n not in keep:
                if n in self.held_roots and am.root.get(n) is n:
                    w += am.bytes.get(n, 0.0)
                w += am.extra.get(n, 0.0)
            work_of.append(w)
        cuttable = [not isinstance(n.meta.get("val"), (tuple, list)) for n in body]
        regions = []
        s, last = 0, len(body) - 1
        while s <= last:
            work, i = 0.0, s
            while i <= last and work < cap:
                work += work_of[i]
                i += 1
            if i > last:  # the rest fits in one region
                regions.append(body[s:])
                break
            # cut at the cheapest boundary in the second half of this region (latest on ties)
            # (never between a multi-output node and the getitems that unpack it)
            acc, best, j_best = 0.0, None, i - 1
            for j in range(s, i):
                acc += work_of[j]
                if acc >= cap / 2 and cuttable[j] and (best is None or crossing_at[j] <= best):
                    best, j_best = crossing_at[j], j
            while j_best < last and not cuttable[j_best]:
                j_best += 1
            if j_best >= last:
                regions.append(body[s:])
                break
            regions.append(body[s:j_best + 1])
            s = j_best + 1
        return self.account(keep, regions)

    def account_needed(self, keep: set, regions: list) -> Plan:
        """Memory and time of keeping ``keep`` with these region cuts, as the AOT backend runs it:
        from every value backward reads (what autograd saves, and the ops that save something of
        their own), walk back: a kept node's value is saved (its bytes and what its op saves), a
        value from an earlier region is saved (that region's output, this region's input), a
        graph output or input/parameter is held anyway; anything else is recomputed (its time)
        and its inputs are walked. Nodes recomputed but never needed cost nothing."""
        am = self.am
        region_of = {n: k for k, region in enumerate(regions) for n in region}
        saved_at = [0.0] * len(regions)  # bytes saved, by the region holding them
        saved_roots: set = set()
        recomputed: set = set()
        extra_s = 0.0

        def save(r, k):
            if r in saved_roots or r in am.outputs:
                return
            saved_roots.add(r)
            saved_at[k] += am.bytes.get(r, 0.0)

        # each saved value is needed in the region of the node whose backward reads it; items are
        # (value, region, position of the backward node reading it, or None: a recomputation reads it)
        stack = []
        for n in am.body:
            k = region_of.get(n, 0)
            j = self.index[n]
            stack.extend((r, k, j) for r in am.saved[n] if r in self.index)
            if am.extra.get(n, 0.0) > 0:
                stack.append((n, k, j))
        seen = set()
        read_at: dict = {}  # recomputed node -> positions of the backward nodes that read it
        rc_users: dict = {}  # recomputed node -> the recomputed nodes whose recomputation reads it
        while stack:
            n, k, j = stack.pop()
            if n not in region_of:
                continue  # an input, parameter or buffer: held anyway
            if isinstance(j, fx.Node):  # read by the recomputation of j
                rc_users.setdefault(n, set()).add(j)
            elif j is not None:
                read_at.setdefault(n, []).append(j)
            if (n, k) in seen:
                continue
            seen.add((n, k))
            r = am.root.get(n, n)
            if region_of[n] != k:  # produced by an earlier region: saved as this region's input
                save(r, k)
                continue
            if n in keep:
                save(r, k) if r in region_of else None
                if n not in recomputed and am.extra.get(n, 0.0) > 0 and (n, "x") not in seen:
                    seen.add((n, "x"))
                    saved_at[k] += am.extra[n]
                continue
            if n not in recomputed:
                recomputed.add(n)
                extra_s += am.seconds.get(n, 0.0)
            stack.extend((a, k, n) for a in n.all_input_nodes)
        # The backward runs the forward positions in reverse. At position p it holds: what was
        # saved before p (its later readers' backward has freed the rest); the recomputed values
        # live across p; the backward working set of node p (its output's and inputs' gradients,
        # its parameters' fresh gradients); and, inside an AOT region, the fresh gradients of the
        # region's parameters produced so far (its backward returns them together, when it ends).
        # A recomputed value runs when the first backward node needing it runs — directly, or
        # through the recomputation of a later value that reads it (a recomputed residual stream
        # reruns everything it is made of at once) — and is freed after its last reader.
        size = len(am.body) + 2
        diff = [0.0] * size
        need: dict = {}
        early: dict = {}  # recomputed nodes a later recomputation reruns early (positions early)
        for n in sorted(recomputed, key=self.index.get, reverse=True):
            reads = read_at.get(n, [])
            users = [need[u] for u in rc_users.get(n, ()) if u in need]
            hi = max(reads + users, default=None)
            if hi is None:
                continue
            need[n] = hi
            if reads and hi > max(reads):  # rerun before its own readers need it: a recompute chain
                early[n] = hi - max(reads)
            lo = min(reads + users)
            b = (am.bytes.get(n, 0.0) if am.root.get(n) is n else 0.0) + am.extra.get(n, 0.0)
            if b > 0:
                diff[lo] += b
                diff[hi + 1] -= b
        grads_diff = [0.0] * size  # fresh parameter gradients a region's backward holds, by position
        for region in regions:
            if all(n in keep or n in saved_roots for n in region):
                continue  # left as it is (the rewrite skips it): eager's backward accumulates each gradient at once
            made_at: dict = {}
            for n in region:
                for a in self.params_of.get(n, ()):
                    made_at[a] = self.index[n]  # made by its latest reader's backward (counted there as work)
            lo = self.index[region[0]]
            for a, pos in made_at.items():  # then held below it until the region's backward returns
                grads_diff[lo] += self.param_bytes.get(a, 0.0)
                grads_diff[pos] -= self.param_bytes.get(a, 0.0)
        for r in saved_roots:
            if r in self.index:
                diff[self.index[r] + 1] += am.bytes.get(r, 0.0)
        for n in am.body:
            if n in keep and n not in recomputed and am.extra.get(n, 0.0) > 0 and n in region_of:
                diff[self.index[n] + 1] += am.extra[n]
        live, grads, peak = 0.0, 0.0, 0.0
        curve = []
        for p, d in enumerate(diff):
            live += d
            grads += grads_diff[p]
            curve.append(live + (self.work_pos[p] if p < len(self.work_pos) else 0.0) + grads)
            peak = max(peak, curve[-1])
        kept_bytes = self.scratch_bytes + sum(saved_at)
        # the step's fixed part (outputs, the largest working set) is budgeted apart: the plan's
        # total is the walk's peak less that working set, so the transient may be negative (the
        # largest working set comes when much of what was saved is already freed)
        peak = self.scratch_bytes + peak - self.working
        keep = set(keep) | {n for n in saved_roots if n in region_of}
        plan = Plan(keep, regions, kept_bytes, peak - kept_bytes, extra_s)
        plan.recomputed, plan.saved_roots = recomputed, saved_roots
        plan.early = early
        # what nest() needs: the memory walk, and the bytes saved per (region of the value, region
        # of its last forward reader) -- a segment covering both drops them until its backward
        pairs: dict = {}
        for r in saved_roots:
            if r in self.index and r in region_of:
                last = self.last.get(r, len(am.body))
                key = (region_of[r], max(region_of[am.body[last]] if last < len(am.body) else len(regions), region_of[r]))
                pairs[key] = pairs.get(key, 0.0) + am.bytes.get(r, 0.0)
        for n in am.body:
            if n in keep and n not in recomputed and am.extra.get(n, 0.0) > 0 and n in region_of:
                k = region_of[n]
                pairs[(k, k)] = pairs.get((k, k), 0.0) + am.extra[n]
        plan.walk = {"curve": curve, "pairs": pairs}
        return plan

    def _region_reads(self, region: list, saved: set) -> list:
        """(activation, bytes) a region's nodes read that the plan frees after the forward (not
        saved, not a graph output), in first-read order."""
        am, out = self.am, {}
        for n in region:
            for x in n.all_input_nodes:
                x = am.root.get(x, x)
                if x in self.index and x not in saved and x not in am.outputs and am.bytes.get(x, 0.0) > 0:
                    out.setdefault(x, am.bytes[x])
        return list(out.items())

    def nest(self, plan: Plan, budget: float, max_len: int = 16) -> Plan | None:
        """Two-level recomputation for a plan that does not fit: runs of consecutive regions
        (segments) go under an outer checkpoint, which keeps only the segment's inputs through the
        forward and, when the backward reaches the segment, reruns the segment's forward (its
        regions' forward graphs) to get back what those regions save; their own backwards then
        recompute as before. A segment frees, for every moment of the backward before it is
        reached, the bytes its regions save for themselves, for one more forward of its nodes.
        Segments are chosen greedily by memory above the budget removed per second of forward
        rerun, then trimmed while the plan still fits. None when no segmentation fits."""
        walk = plan.walk
        if not walk or not plan.regions:
            return None
        am, regions = self.am, plan.regions
        R = len(regions)
        # what depends on the plan alone is kept in its walk across calls (select() bisects the
        # budget over the same plans)
        memo_all = walk.setdefault("nest_memo", {})
        if not memo_all:
            memo_all.update(
                curve=torch.tensor(walk["curve"], dtype=torch.float64),
                lo=[self.index[r[0]] for r in regions], hi=[self.index[r[-1]] for r in regions],
                secs=[sum(am.seconds.get(n, 0.0) for n in r) for r in regions],
                biggest=[max((am.bytes.get(n, 0.0) for n in r if am.root.get(n) is n), default=0.0) for r in regions],
                reads=[self._region_reads(r, plan.saved_roots or set()) for r in regions],
                inputs={}, own={}, effect={}, span={})
        curve, lo, hi, secs, biggest, reads = (memo_all[k] for k in ("curve", "lo", "hi", "secs", "biggest", "reads"))
        inputs_memo, own_memo, memo, span_memo = (memo_all[k] for k in ("inputs", "own", "effect", "span"))
        limit = budget - self.scratch_bytes + self.working
        pairs = walk["pairs"]
        n_pos = curve.shape[0]

        def held_inputs(a: int, b: int) -> list:
            """Activations the segment reads from before it that the plan frees after the forward:
            the outer checkpoint holds every input of its segment until the segment's backward."""
            if (a, b) in inputs_memo:
                return inputs_memo[(a, b)]
            out = {}
            for k in range(a, b + 1):
                for x, v in reads[k]:
                    if self.index[x] < lo[a]:
                        out[x] = v
            inputs_memo[(a, b)] = list(out.items())
            return inputs_memo[(a, b)]

        def own(a: int, b: int) -> float:
            """Bytes the segment's regions save for themselves (made and last read inside it)."""
            if (a, b) not in own_memo:
                own_memo[(a, b)] = sum(v for (i, j), v in pairs.items() if a <= i and j <= b)
            return own_memo[(a, b)]

        def drop(a: int, b: int) -> float:
            """What the segment takes off the bytes held after the forward."""
            return own(a, b) - sum(v for _, v in held_inputs(a, b))

        def effect(a: int, b: int) -> torch.Tensor:
            """The change to the walk of segment a..b: its regions' own saved bytes gone after its
            end (the backward reaches it later); its forward rerun as the backward enters it."""
            if (a, b) not in memo:
                d = torch.zeros(n_pos, dtype=torch.float64)
                d[hi[b] + 1:] -= own(a, b)
                for x, v in held_inputs(a, b):  # held from where it is made on
                    d[self.index[x] + 1:] += v
                d[hi[b]] += max(biggest[a:b + 1])
                memo[(a, b)] = d
            return memo[(a, b)]

        def span_s(a: int, b: int) -> float:
            """Seconds of the forward rerun of regions a..b."""
            if (a, b) not in span_memo:
                span_memo[(a, b)] = sum(secs[a:b + 1])
            return span_memo[(a, b)]

        def excess(c: torch.Tensor) -> float:
            return float((c - limit).clamp(min=0).sum())

        segs: list = []
        cur = curve.clone()
        kept = plan.saved_bytes  # held after the forward
        while float(cur.max()) > limit:
            base_ex = excess(cur)
            best = None
            for a in range(R):
                for b in range(a, min(R, a + max_len)):
                    inside = [s for s in segs if a <= s[0] and s[1] <= b]
                    if any(not (s[1] < a or s[0] > b) for s in segs if s not in inside):
                        continue  # overlaps a segment partly
                    if inside == [(a, b)]:
                        continue
                    trial = cur + effect(a, b)
                    for s in inside:
                        trial -= effect(*s)
                    gain = base_ex - excess(trial)
                    if gain <= 0:
                        continue
                    dt = span_s(a, b) - sum(span_s(*s) for s in inside)
                    score = gain / max(dt, 1e-9)
                    if best is None or score > best[0]:
                        best = (score, (a, b), inside, trial)
            if best is None:
                return None
            _, seg, inside, cur = best
            kept = kept - drop(*seg) + sum(drop(*s) for s in inside)
            segs = sorted([s for s in segs if s not in inside] + [seg])
        # trim: shrink each segment from either end while the plan still fits
        changed = True
        while changed:
            changed = False
            for k, (a, b) in enumerate(list(segs)):
                for na, nb in ((a + 1, b), (a, b - 1)):
                    if na > nb:
                        trial, trial_kept = cur - effect(a, b), kept + drop(a, b)
                    else:
                        trial = cur - effect(a, b) + effect(na, nb)
                        trial_kept = kept + drop(a, b) - drop(na, nb)
                    if float(trial.max()) <= limit:
                        cur, kept = trial, trial_kept
                        segs[k] = (na, nb)
                        changed = True
                        break
            segs = [s for s in segs if s[0] <= s[1]]
        peak = self.scratch_bytes + float(cur.max()) - self.working
        out = Plan(plan.keep, regions, kept, peak - kept, plan.extra_s + sum(sum(secs[a:b + 1]) for a, b in segs),
                   plan.crossing_bytes, list(plan.notes), plan.recomputed, plan.saved_roots, plan.early)
        out.segments = segs
        out.notes.append(f"two-level recomputation: {len(segs)} segment(s) of consecutive regions run under an outer "
                         "checkpoint (their forward reruns once more in backward) to fit the budget")
        return out

    def account(self, keep: set, regions: list) -> Plan:
        """Memory and time of keeping ``keep`` with these region cuts."""
        if self.aot:
            return self.account_needed(keep, regions)
        am, body = self.am, self.am.body
        held = lambda r: r in keep or r in am.outputs  # noqa: E731
        # what crosses a cut is held by checkpoint as the next region's input anyway: keep it
        # (no more memory, less recomputation)
        keep = set(keep)
        crossing = 0.0
        for region in regions[:-1]:
            j = self.index[region[-1]]
            for r in region:
                if am.root.get(r) is r and self.last.get(r, -1) > j and not held(r):
                    keep.add(r)
                    crossing += am.bytes.get(r, 0.0)
            # (a tensor from an earlier region that is still live crossed that region's cut too)
        # backward runs the regions last to first: while region k is recomputed, what regions
        # 0..k keep is still held and what later regions kept has been freed
        kept_bytes, peak = self.scratch_bytes, 0.0
        for region in regions:
            kept_bytes += sum(self.cost_bytes(n) for n in region
                              if n in keep and not (am.root.get(n) is n and n in am.outputs))
            work = sum(am.bytes.get(n, 0.0) if (n not in keep and n in self.held_roots and am.root.get(n) is n) else 0.0
                       for n in region) + sum(am.extra.get(n, 0.0) for n in region if n not in keep)
            peak = max(peak, kept_bytes + work)
        extra_s = sum(am.seconds[n] for n in body if n not in keep)
        return Plan(keep, regions, kept_bytes, max(peak - kept_bytes, 0.0), extra_s, crossing)

    def random_consistent(self, plan: Plan, cap: float) -> Plan:
        """A region's random ops are all kept or all recomputed (RNG replay then matches)."""
        keep = set(plan.keep)
        changed = False
        for region in plan.regions:
            rnd = [n for n in region if ir.is_random(n)]
            if rnd and any(n in keep for n in rnd) and any(n not in keep for n in rnd):
                keep.difference_update(rnd)
                changed = True
        if not changed:
            return plan
        out = self.account(keep, plan.regions)  # same cuts
        out.notes.append("random ops of a region recomputed together so the replayed RNG matches")
        return out

    def refine(self, plan: Plan, budget: float, tries: int = 64) -> Plan:
        """The cheapest-per-byte order can overshoot: keep again the costliest recomputed
        nodes that still fit (same region cuts). First (AOT), break recompute chains: a node a
        later recomputation reruns long before its own readers need it is kept where that costs
        no memory and no time (the chain's transient goes), which leaves room to keep GEMMs."""
        for _ in range(4 if self.aot else 0):
            changed = False
            for n in sorted(plan.early, key=lambda n: -plan.early[n] * self.cost_bytes(n))[:tries]:
                if n in plan.keep or ir.is_random(n) or n in self.forced_recompute:
                    continue
                trial = self.account(plan.keep | {n}, plan.regions)
                if trial.total_bytes <= plan.total_bytes and trial.extra_s <= plan.extra_s:
                    trial.notes, trial.crossing_bytes = plan.notes, plan.crossing_bytes
                    plan, changed = trial, True
            if not changed:
                break
        recomputed = [n for n in self.order() if n not in plan.keep and self.am.seconds[n] > 0]
        for n in sorted(recomputed, key=lambda n: -self.am.seconds[n])[:tries]:
            if ir.is_random(n):  # a region's random ops stay together
                continue
            trial = self.account(plan.keep | {n}, plan.regions)
            if trial.total_bytes <= budget and trial.extra_s < plan.extra_s:
                trial.notes, trial.crossing_bytes = plan.notes, plan.crossing_bytes
                plan = trial
        return plan

    def select(self, budget: float, caps: list, offset: float = 0.0, headroom: float = 0.0) -> Plan:
        """The plan that fits ``budget`` with the least predicted recomputation time, over
        region sizes ``caps`` (bigger regions: fewer boundary tensors held, a bigger transient
        while one region is recomputed). ``budget`` covers the step's activation memory:
        ``offset`` (the graph's outputs and the backward's working set) plus what the plan saves
        and its recomputation transient; plans fill at most ``1 - headroom`` of it (room for the
        prediction's error)."""
        asked = budget
        budget = budget * (1.0 - headroom) - offset
        order = self.order()
        all_keep = set(n for n in self.am.body if n not in self.forced_recompute)
        best_fit, minimum = None, None
        smallest: list = []  # each region size's sampled plans (smallest first): where two-level recomputation starts
        n = len(order)
        grid = sorted({round(n * i / 16) for i in range(17)})
        for cap in caps:
            def plan_for(k: int) -> Plan:
                return self.random_consistent(self.evaluate(all_keep - set(order[:k]), cap), cap)

            sampled = [(k, plan_for(k)) for k in grid]
            low = min((p for _, p in sampled), key=lambda p: p.total_bytes)
            if minimum is None or low.total_bytes < minimum.total_bytes:
                minimum = low
            # every sampled plan may start a two-level plan: the cheapest may recompute little itself
            # and leave the memory to the outer checkpoints
            smallest.extend(sorted((p for _, p in sampled), key=lambda p: p.total_bytes))
            fits = [k for k, p in sampled if p.total_bytes <= budget]
            if not fits:
                continue
            hi = fits[0]
            lo = max([k for k in grid if k < hi], default=hi)
            while lo < hi:  # the smallest k in (lo, hi] whose plan fits
                mid = (lo + hi) // 2
                if plan_for(mid).total_bytes <= budget:
                    hi = mid
                else:
                    lo = mid + 1
            plan = plan_for(hi)
            if plan.total_bytes <= budget and (best_fit is None or (plan.extra_s, plan.total_bytes) <
                                               (best_fit.extra_s, best_fit.total_bytes)):
                best_fit = plan
        if best_fit is not None:
            best_fit = self.refine(best_fit, budget)
        # the largest budget each sampled plan could not be nested under (by id: the plans live in
        # `smallest`); a plan that cannot meet a budget is not tried again under a smaller one
        failed_at: dict = {}

        def nested_under(p: Plan, b: float) -> Plan | None:
            if failed_at.get(id(p), -1.0) >= b:
                return None
            out = self.nest(p, b)
            if out is None:
                failed_at[id(p)] = max(failed_at.get(id(p), -1.0), b)
            return out

        if best_fit is None and self.aot:
            # no plan of one level fits: run consecutive regions under an outer checkpoint
            for p in smallest:
                nested = nested_under(p, budget)
                if nested is not None and (best_fit is None or nested.extra_s < best_fit.extra_s):
                    best_fit = nested
        if best_fit is None:
            base = self.am.step_activation_bytes()
            low = minimum.total_bytes + offset
            if self.aot and smallest:  # the smallest two-level plan: bisect the budget nest() can meet
                lo_b, hi_b = 0.0, min(p.total_bytes for p in smallest)
                for _ in range(10):
                    mid = (lo_b + hi_b) / 2
                    if any(nested_under(p, mid) is not None for p in smallest):
                        hi_b = mid
                    else:
                        lo_b = mid
                low = min(low, hi_b + offset)
            low = low / (1.0 - headroom)
            raise BudgetError(
                f"memory budget {format_bytes(asked)} is below the achievable minimum "
                f"{format_bytes(low)} ({low / base:.3f} of the baseline activation memory {format_bytes(base)}: "
                f"saved tensors, outputs and the backward's working set"
                + (f", plus {headroom:.0%} left free for the prediction's error" if headroom else "")
                + ") over the recompute/keep trade-offs searched; raise memory_budget to at least that")
        return best_fit


# --------------------------------------------------------------------------- rewrite


def _region_cost(ctx: PassContext, nodes: list, keep: set) -> dict:
    total = {"flops": 0.0, "bytes": 0.0, "launches": 0, "time_s": 0.0, "recompute_s": 0.0}
    for n in nodes:
        c = ctx.cost.node_cost(n)
        f = lambda v: float(ir.concrete(v, ctx.hints))  # noqa: E731
        total["flops"] += f(c.flops)
        total["bytes"] += f(c.bytes)
        total["launches"] += int(c.launches)
        total["time_s"] += f(c.time_s)
        if n not in keep:
            total["recompute_s"] += f(c.time_s)
    return total


_REGION = "graphopt_ckpt_region"  # node meta: the plan region a node (or its rewritten call) came from


def _boundary(nodes: list) -> tuple:
    """(set of nodes, the values they read from outside in first-use order, the nodes read outside)."""
    inside = set(nodes)
    inputs: list = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    return inside, inputs, [n for n in nodes if any(u not in inside for u in n.users)]


def _call_replacing(gm: fx.GraphModule, name: str, nodes: list, inputs: list, outputs: list, inside: set,
                    movers: tuple = (), source: bool = False) -> fx.Node:
    """Insert ``name(*inputs)`` after ``nodes``, one getitem per output in their place (``movers``
    after them), and erase ``nodes``. ``source``: each getitem records the node it stands for."""
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    if _REGION in nodes[0].meta:
        call.meta[_REGION] = nodes[0].meta[_REGION]
    getters = []
    prev = call
    for i, o in enumerate(outputs):
        with gm.graph.inserting_after(prev):
            prev = gm.graph.call_function(operator.getitem, (call, i))
        prev.meta = dict(o.meta)
        if source:
            prev.meta["ckpt_source"] = o.name  # the captured node this region output stands for
        getters.append(prev)
    for n in movers:
        prev.append(n)
        prev = n
    for o, gi in zip(outputs, getters):
        o.replace_all_uses_with(gi, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return call


def _placeholders(g: fx.Graph, inputs: list) -> dict:
    env = {}
    for a in inputs:
        p = g.placeholder(a.name)
        p.meta = dict(a.meta)
        env[a] = p
    return env


def _extract(gm: fx.GraphModule, nodes: list, keep: set, name: str, ctx: PassContext,
             selective: bool | None = None, make_module=None) -> fx.Node:
    """Replace ``nodes`` (contiguous in topological order) by one call of a CheckpointRegion
    (or of ``make_module(body, inputs)``'s module: the AOT backend's whole-graph body)."""
    inside, inputs, outputs = _boundary(nodes)
    # nodes interleaved with the region but not in it (export's _guards_fn) that read its values
    # move after it; one the region itself reads back would make a cycle: leave the region alone
    order = list(gm.graph.nodes)
    lo, hi = order.index(nodes[0]), order.index(nodes[-1])
    movers = [n for n in order[lo:hi] if n not in inside and any(a in inside for a in n.all_input_nodes)]
    closure = set(movers)
    for n in order[lo:hi]:  # and what reads those
        if n not in inside and n not in closure and any(a in closure for a in n.all_input_nodes):
            closure.add(n)
    if any(u in inside for n in closure for u in n.users):
        return None
    movers = [n for n in order[lo:hi] if n in closure]
    mutated = set()
    for n in nodes:
        mutated.update(a for a in _mutated_args(n) if a not in inside)
    if make_module is not None:
        # submodules (a higher-order op's body, e.g. export's wrap_with_autocast) are not
        # arguments AOTAutograd can take: the body reads them as attributes of its own
        owned = [a for a in inputs if a.op == "get_attr" and not isinstance(ir.get_attr_value(gm, a.target), torch.Tensor)]
        inputs = [a for a in inputs if a not in owned]
    else:
        owned = []
    g = fx.Graph()
    env = _placeholders(g, inputs)
    for a in owned:
        env[a] = g.node_copy(a)
    state = None
    for n in nodes:
        flag = n in keep
        if flag != state and make_module is None:
            g.call_function(_mark, (flag,))
            state = flag
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(gm if owned else nn.Module(), g, class_name="CheckpointBody")
    if make_module is not None:
        region = make_module(body, inputs, tuple(i for i, a in enumerate(inputs) if a in mutated), outputs)
        region.cost = _region_cost(ctx, nodes, keep)  # the cost model prices the call with it
    else:
        cost = _region_cost(ctx, nodes, keep)
        region = CheckpointRegion(body, tuple(i for i, a in enumerate(inputs) if a in mutated),
                                  [n.name for n in nodes if n in keep], [n.name for n in nodes if n not in keep],
                                  cost, selective)
    gm.add_submodule(name, region)
    return _call_replacing(gm, name, nodes, inputs, outputs, inside, movers, source=True)


class OuterCheckpoint(CheckpointRegion):
    """A segment of regions under a plain non-reentrant checkpoint (two-level recomputation): the
    forward keeps only the segment's inputs; the backward reruns the segment's forward (its AOT
    regions' forward graphs save their values again) and the regions' own backwards follow.
    Buffers the segment updates are swapped for scratch copies in the rerun (CheckpointRegion)."""


def _outer_region(gm: fx.GraphModule, nodes: list, mutated: list, name: str, cost: dict) -> fx.Node:
    """Replace ``nodes`` (a contiguous run of the graph, less its placeholders and attributes,
    so nothing outside both reads and feeds it) by one OuterCheckpoint call; its body calls the
    same submodules (AOT regions) the nodes called."""
    inside, inputs, outputs = _boundary(nodes)
    g = fx.Graph()
    env = _placeholders(g, inputs)
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(gm, g, class_name="OuterBody")
    region = OuterCheckpoint(body, tuple(i for i, a in enumerate(inputs) if a in set(mutated)), [],
                             [n.name for n in nodes], cost, False)
    gm.add_submodule(name, region)
    call = _call_replacing(gm, name, nodes, inputs, outputs, inside)
    for n in nodes:  # the region calls now live in the outer body only
        if n.op == "call_module" and not any(m.op == "call_module" and m.target == n.target for m in gm.graph.nodes):
            gm.delete_submodule(n.target)
    return call


# kept nodes whose backward saves only their inputs (and weights): ending a plain-checkpoint region
# with one costs no recomputation of it (the early stop comes before the kernel would run)
_INPUT_SAVING = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "conv1d", "conv2d", "conv3d", "convolution",
                 "_convolution"}


def _input_saving(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and ir.op_name(n) in _INPUT_SAVING


def split_at_kept_gemms(nodes: list, keep: set) -> list:
    """Split a region after each kept GEMM/convolution where only kept values (or the region's
    own inputs) cross the cut. Returns [(sub-region, selective)]: ``selective`` is False when no
    kept node sits inside the sub-region except an input-saving one at its end, so a plain
    checkpoint realizes it with the same saved memory and no per-op dispatch mode."""
    pos = {n: i for i, n in enumerate(nodes)}
    # last position (inside the region) that reads each node
    last_use = {n: max([pos[u] for u in n.users if u in pos], default=-1) for n in nodes}
    out, start = [], 0
    for i, n in enumerate(nodes):
        if i == len(nodes) - 1 or n not in keep or not _input_saving(n):
            continue
        crossing = [m for m in nodes[start:i + 1] if last_use[m] > i]
        if all(m in keep for m in crossing):
            out.append(nodes[start:i + 1])
            start = i + 1
    out.append(nodes[start:])
    result = []
    for sub in out:
        inner_kept = [n for n in sub[:-1] if n in keep]
        last_ok = sub[-1] not in keep or _input_saving(sub[-1])
        result.append((sub, bool(inner_kept) or not last_ok))
    return result


def recomputed_by_op(am: ActivationModel, keep: set, recomputed: set | None = None) -> dict:
    """The plan's recomputation by op: {op: {"count", "ms"}} (predicted), costliest first; views
    and other free nodes are left out. ``recomputed``: the nodes that rerun, where the plan knows
    (else every node not kept)."""
    rows: dict = {}
    for n in am.body:
        reruns = n in recomputed if recomputed is not None else n not in keep
        if not reruns or am.seconds.get(n, 0.0) <= 0:
            continue
        r = rows.setdefault(ir.op_name(n), {"count": 0, "ms": 0.0})
        r["count"] += 1
        r["ms"] += am.seconds[n] * 1e3
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms"]))


def saved_by_op(am: ActivationModel, keep: set, saved_roots: set | None = None,
                recomputed: set | None = None) -> dict:
    """What the plan holds for backward by op of the producing node: {op: {"count", "gb"}},
    largest first (kept outputs that autograd saves, and what kept ops save internally; where the
    plan knows them, ``saved_roots`` are the storages saved and ``recomputed`` the nodes rerun)."""
    rows: dict = {}
    held = am.saved_roots() if saved_roots is None else saved_roots
    for n in am.body:
        if n not in keep and n not in am.outputs or (recomputed is not None and n in recomputed):
            continue
        b = (am.bytes.get(n, 0.0) if am.root.get(n) is n and n in held else 0.0)
        b += am.extra.get(n, 0.0)
        if b <= 0:
            continue
        r = rows.setdefault(ir.op_name(n), {"count": 0, "gb": 0.0})
        r["count"] += 1
        r["gb"] += b / 1e9
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["gb"]))


def _by_layer(am: ActivationModel, keep: set) -> list:
    """Saved vs recomputed tensors (count, bytes) per layer."""
    rows: dict = {}
    held = am.saved_roots()
    for n in am.body:
        if am.root.get(n) is not n or n not in held and am.extra.get(n, 0.0) <= 0:
            continue
        layer = layer_of(n)
        r = rows.setdefault(layer, {"layer": layer, "saved": 0, "saved_bytes": 0.0, "recomputed": 0,
                                    "recomputed_bytes": 0.0, "recomputed_nodes": []})
        b = am.bytes.get(n, 0.0) + am.extra.get(n, 0.0)
        if n in keep or n in am.outputs:
            r["saved"] += 1
            r["saved_bytes"] += b
        else:
            r["recomputed"] += 1
            r["recomputed_bytes"] += b
            if len(r["recomputed_nodes"]) < 12:
                r["recomputed_nodes"].append(n.name)
    return list(rows.values())


def _training_fuser(ctx: PassContext):
    """fuse_elementwise for the AOT backend's forward and backward graphs, or None.

    The pass is inference-only because graphopt's kernels have no autograd formulas; the AOT
    graphs run without autograd (AOTAutograd already split forward from backward), so their
    pointwise chains (a norm's casts and statistics, SiLU and its derivative, rotary, the
    recomputed ones included) can run as generated kernels. Done when fuse_elementwise is one of
    this run's passes and the plan is for a GPU; the cost model decides each group as it does
    for inference."""
    if "fuse_elementwise" not in ctx.scheduled or not ctx.fused_kernels:
        return None
    from .fuse_elementwise import FuseElementwise

    def fuse(g: fx.GraphModule) -> int:
        sub = PassContext(cost=ctx.cost, training=True, verify=False)
        r = FuseElementwise().run(g, sub)
        g.graph.lint()
        g.recompile()
        return len(r.rewrites)

    return fuse


def fuse_training_graph(gm: fx.GraphModule, ctx: PassContext, regions: int = 4, fuse: bool = True) -> PassResult:
    """Run a training graph's body as AOT regions that recompute nothing, so that its forward and
    backward graphs get pointwise fusion (:func:`_training_fuser`; needs fuse_elementwise in
    ``ctx.scheduled`` and a GPU plan). Used for pipeline stages, which are not checkpointed.
    Only runs of ATen ops are taken (a stage's gradient-layout shims stay outside), cut into about
    ``regions`` pieces so each piece's backward hands its parameters' gradients back when it ends.
    Returns the record; the graph is unchanged when fusion or AOTAutograd is unavailable."""
    res = PassResult("fuse_training", "fusion")
    if fuse and _training_fuser(ctx) is None:
        res.notes.append("no pointwise fusion for this plan (fuse_elementwise off, or not a GPU)")
        return res
    why = aot.available()
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
        InsertCheckpoints()._rewrite_aot(gm, ctx, am, plan, res, details, strict=False, every_region=True,
                                         pointwise=fuse)
    except aot.AotUnavailable as e:
        res.notes.append(f"left as it is: {e}")
        return res
    res.details = details
    res.changed = bool(res.rewrites)
    res.status = "applied" if res.changed else "unchanged"
    res.notes.append(f"{len(body)} ATen ops in {details.get('aot_regions', 0)} AOT regions"
                     + (" with pointwise fusion" if fuse else ""))
    return res


@register
class InsertCheckpoints(Pass):
    name = "insert_checkpoints"
    family = "checkpoint"
    description = ("training under a memory budget: recompute the activations cheapest per byte "
                   "(an AOTAutograd graph rewrite, or torch.utils.checkpoint with a selective policy) "
                   "until the step fits")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = self.result()
        budget_opt = ctx.options.memory_budget
        if not ctx.training:
            res.notes.append("inference graph: autograd saves nothing, so there is nothing to checkpoint")
            return res
        if budget_opt is None:
            res.notes.append("no memory_budget set: activations are kept as autograd saves them")
            return res
        am = ActivationModel.build(gm, ctx.cost, ctx.hints, device_kind=ctx.cost.device_kind)
        # the budget covers a step's activation memory (what max_memory_allocated measures beyond
        # parameters, gradients and inputs): saved tensors, the outputs, the backward's working set
        base = am.step_activation_bytes()
        budget = resolve_budget(budget_opt, base)
        offset = am.all_output_bytes() + am.backward_working_bytes()
        details = {
            "checkpoint": True,
            "budget_bytes": budget,
            "budget": budget_opt if isinstance(budget_opt, (int, float)) else str(budget_opt),
            "baseline_saved_bytes": am.baseline_saved_bytes(),
            "baseline_activation_bytes": base,
            "baseline_peak_bytes": am.step_peak_bytes(),
            "output_bytes": am.all_output_bytes(),
            "baseline_held_bytes": am.held_bytes(),
            "backward_working_bytes": am.backward_working_bytes(),
        }
        res.details = details
        if base <= budget:
            details.update(predicted_saved_bytes=details["baseline_saved_bytes"], predicted_held_bytes=details["baseline_held_bytes"],
                           predicted_activation_bytes=details["baseline_activation_bytes"],
                           predicted_peak_bytes=details["baseline_peak_bytes"], extra_ms=0.0, regions=0)
            res.notes.append(f"the baseline activations ({format_bytes(base)}) fit the budget "
                             f"({format_bytes(budget)}): nothing recomputed")
            return res
        backend = str(ctx.options.checkpoint_backend or "auto").lower()
        if backend not in BACKENDS:
            raise GraphoptError(f"checkpoint_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        why_not_aot = None
        if backend in ("auto", "aot"):
            why_not_aot = aot.available()
            if why_not_aot is not None and backend == "aot":
                raise GraphoptError(f"checkpoint_backend 'aot' cannot run: {why_not_aot}")
        use_aot = backend in ("auto", "aot") and why_not_aot is None
        caps = [max(share * am.baseline_saved_bytes(), 1.0) for share in REGION_SHARES]
        # plans leave the profile's allocator headroom free: on the H200 a plan's measured step came
        # out up to 1% over its prediction (ResNet-50 at 0.35: 3.89 GB against 3.85 predicted)
        headroom = ctx.cost.allocator_headroom
        details["planned_bytes"] = budget * (1.0 - headroom)
        try:
            plan = _Selector(am, ctx.hints, keep_random=use_aot, aot=use_aot).select(budget, caps, offset,
                                                                                     headroom)
        except BudgetError as e:
            if not use_aot or backend == "aot":
                raise
            # the AOT rewrite keeps every random op's output; the selective checkpoint replays RNG
            plan = _Selector(am, ctx.hints).select(budget, caps, offset, headroom)
            use_aot = False
            if any(ir.is_random(n) for n in am.body):
                why_not_aot = f"the budget needs recomputing random ops, which the AOT rewrite never does ({e})"
            else:
                why_not_aot = f"no AOT plan fits the budget ({e}); a selective-checkpoint plan does"
        details.update(self._plan_details(am, plan))
        res.notes.extend(plan.notes)
        if use_aot:
            snapshot = gm.graph.python_code("self").src
            try:
                self._rewrite_aot(gm, ctx, am, plan, res, details, strict=backend == "aot")
                details["backend"] = "aot" if not details.get("aot_fallbacks") else "aot+sac"
                res.notes.append("backend aot: recomputation is a graph rewrite (AOTAutograd joint graph of each "
                                 "region cut by graphopt's partition); forward and backward run as plain ATen graphs"
                                 + ("" if backend == "aot" else " (chosen by default: it traced this graph)"))
                return res
            except aot.AotUnavailable as e:
                if gm.graph.python_code("self").src != snapshot:  # never half-rewritten
                    raise GraphoptError(f"the AOT checkpoint rewrite failed after changing the graph: {e}") from e
                if backend == "aot":
                    raise GraphoptError(f"checkpoint_backend 'aot' cannot run: {e}") from e
                why_not_aot = str(e)
                # the plan kept random ops for AOT; the selective backend replays RNG instead
                plan = _Selector(am, ctx.hints).select(budget, caps, offset, headroom)
                details.update(self._plan_details(am, plan))
        details["backend"] = "sac"
        why = ("asked for (checkpoint_backend='sac')" if backend == "sac"
               else f"the AOT rewrite could not run: {why_not_aot}")
        res.notes.append(f"backend sac: torch.utils.checkpoint regions with a selective policy; {why}")
        details["backend_reason"] = why
        self._rewrite_sac(gm, ctx, am, plan, res, details)
        return res

    @staticmethod
    def _plan_details(am: ActivationModel, plan: Plan) -> dict:
        return dict(
            predicted_saved_bytes=plan.saved_bytes,
            recompute_transient_bytes=max(plan.transient_bytes, 0.0),
            region_input_bytes=plan.crossing_bytes,
            predicted_held_bytes=am.held_bytes(plan.saved_bytes),
            predicted_activation_bytes=am.step_activation_bytes(plan.saved_bytes, plan.transient_bytes),
            predicted_peak_bytes=am.step_peak_bytes(plan.saved_bytes, plan.transient_bytes),
            extra_ms=plan.extra_s * 1e3,
            regions=len(plan.regions),
            kept_nodes=len(plan.keep),
            recomputed_nodes=len(plan.recomputed) if plan.recomputed is not None else len(am.body) - len(plan.keep),
            by_layer=_by_layer(am, plan.keep),
            recomputed_by_op=recomputed_by_op(am, plan.keep, plan.recomputed),
            saved_by_op=saved_by_op(am, plan.keep, plan.saved_roots, plan.recomputed),
        )

    def _rewrite_aot(self, gm, ctx, am: ActivationModel, plan: Plan, res: PassResult, details: dict,
                     strict: bool, every_region: bool = False, pointwise: bool = True) -> None:
        """Each region of the plan that recomputes something becomes one AotRecompute call (its
        own autograd function, so its parameters' gradients are released when its backward ends,
        as eager's are, not all at the end of one whole-graph backward), compiled here. If the
        first cannot be traced, AotUnavailable is raised before anything changed; a later one
        runs as selective-checkpoint regions instead (or, ``strict``, raises GraphoptError).
        ``every_region``: regions that recompute nothing are compiled too (fuse_training_graph);
        ``pointwise``: their graphs get pointwise fusion where :func:`_training_fuser` allows."""
        aot.tag_nodes(am.body)
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
        frees, fallbacks = True, []
        details["selective_regions"] = 0
        fuse = _training_fuser(ctx) if pointwise else None
        for i, nodes in enumerate(plan.regions):
            for n in nodes:
                n.meta[_REGION] = i
        for i, nodes in enumerate(plan.regions):
            rerun = [n for n in nodes if n not in plan.keep]
            if not rerun and not every_region:
                continue
            made = {}

            def make_module(body_gm, inputs, mutated, outputs):
                module = aot.AotRecompute(body_gm, recompute, keep, mutated)
                module.fuse = fuse
                try:
                    example = aot.example_args(inputs, gm, ctx.hints, requires_grad=needs_grad)
                except Exception as e:
                    raise aot.AotUnavailable(f"no example inputs to compile with: {type(e).__name__}: {e}") from e
                made["info"] = module.compile(example)
                made["module"], made["inputs"], made["outputs"] = module, list(inputs), list(outputs)
                return module

            try:
                call = _extract(gm, nodes, plan.keep, f"ckpt_aot_{i}", ctx, make_module=make_module)
            except aot.AotUnavailable as e:
                if totals["regions"] == 0 and not fallbacks:
                    raise  # nothing changed yet: the caller falls back as a whole
                if strict:
                    raise GraphoptError(f"checkpoint_backend 'aot' cannot run region {i}: {e}") from e
                fallbacks.append(f"region {i}: {e}")
                self._sac_regions(gm, ctx, am, plan, res, details, [nodes], f"ckpt_region_{i}_")
                continue
            if call is None:
                res.reject(f"checkpoint region {i} ({nodes[0].name}…{nodes[-1].name})",
                           "a node outside the region both reads it and feeds it; left as it is")
                continue
            info, module = made["info"], made["module"]
            totals["regions"] += 1
            totals["saved"] += info["saved_activation_bytes"]
            totals["values"] += len([s for s in info["saved"] if s[2] > 0])
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
            raise aot.AotUnavailable("no region recomputes anything")
        if plan.segments:
            self._wrap_segments(gm, ctx, am, plan, res, details)
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
        if fuse is not None:
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

    def _wrap_segments(self, gm, ctx: PassContext, am: ActivationModel, plan: Plan, res: PassResult, details: dict) -> None:
        """Two-level recomputation: each segment (a run of the plan's regions, now AOT region
        calls, selective-checkpoint calls or nodes left as they were) becomes one plain
        checkpoint region around them (``OuterCheckpoint``)."""
        rows = []
        for k, (a, b) in enumerate(plan.segments):
            order = list(gm.graph.nodes)
            where = [i for i, n in enumerate(order) if a <= n.meta.get(_REGION, -1) <= b]
            if not where:
                continue
            nodes = [n for n in order[where[0]:where[-1] + 1] if n.op not in ("placeholder", "get_attr", "output")]
            mutated = []
            for n in nodes:
                if n.op == "call_module":
                    sub = gm.get_submodule(n.target)
                    pos = sub.partitioner.mutated if isinstance(sub, aot.AotRecompute) else getattr(sub, "mutated", ())
                    mutated.extend(n.args[i] for i in pos)
                else:
                    mutated.extend(_mutated_args(n))
            secs = sum(am.seconds.get(n, 0.0) for r in plan.regions[a:b + 1] for n in r)
            cost = {"flops": 0.0, "bytes": 0.0, "launches": 0, "time_s": 0.0, "recompute_s": secs}
            for n in nodes:  # what the segment's calls and nodes cost, plus the forward rerun
                inner = getattr(gm.get_submodule(n.target), "cost", None) if n.op == "call_module" else None
                if isinstance(inner, dict) and "time_s" in inner:
                    for key in cost:
                        cost[key] += inner.get(key, 0.0)
                else:
                    c = ctx.cost.node_cost(n)
                    for key, v in (("flops", c.flops), ("bytes", c.bytes), ("time_s", c.time_s)):
                        cost[key] += float(ir.concrete(v, ctx.hints))
                    cost["launches"] += int(c.launches)
            call = _outer_region(gm, nodes, mutated, f"ckpt_outer_{k}", cost)
            rows.append({"regions": [a, b], "forward_rerun_ms": secs * 1e3})
            res.record(f"outer checkpoint over regions {a}-{b} (their forward reruns once in backward; only the "
                       "segment's inputs are held through the forward)", [n.name for n in nodes][:6], [call], -secs)
        details["segments"] = rows

    def _sac_regions(self, gm, ctx, am: ActivationModel, plan: Plan, res: PassResult, details: dict, regions: list,
                     prefix: str = "ckpt_region_") -> None:
        subregions = [sub for nodes in regions for sub in split_at_kept_gemms(nodes, plan.keep)]
        for i, (nodes, selective) in enumerate(subregions):
            recomputed = [n for n in nodes if n not in plan.keep]
            if not recomputed:
                continue
            extra = sum(am.seconds[n] for n in recomputed)
            call = _extract(gm, nodes, plan.keep, f"{prefix}{i}", ctx, selective)
            if call is None:
                res.reject(f"checkpoint region {i} ({nodes[0].name}…{nodes[-1].name})",
                           "a node outside the region both reads it and feeds it; left as it is")
                continue
            details["selective_regions"] = details.get("selective_regions", 0) + int(selective)
            kind = "selective" if selective else "plain"
            res.record(f"checkpoint region, {kind} ({len(recomputed)} of {len(nodes)} nodes recomputed)",
                       recomputed[:6], [call], -extra)

    def _rewrite_sac(self, gm, ctx, am: ActivationModel, plan: Plan, res: PassResult, details: dict) -> None:
        details["selective_regions"] = 0
        self._sac_regions(gm, ctx, am, plan, res, details, plan.regions)
        details["regions"] = sum(1 for n in gm.graph.nodes if n.op == "call_module"
                                 and isinstance(gm.get_submodule(n.target), CheckpointRegion))
        gm.recompile()
