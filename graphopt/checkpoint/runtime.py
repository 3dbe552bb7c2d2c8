"""The modules a checkpointed graph calls: ``CheckpointRegion`` (a graph region under
non-reentrant ``torch.utils.checkpoint``, with a selective policy when it keeps nodes inside) and
``OuterCheckpoint`` (a run of regions under one plain checkpoint: two-level recomputation).

Buffers a region updates in place (BatchNorm running statistics, ``num_batches_tracked``) are
not checkpoint arguments: the forward updates the real ones, the recomputation scratch copies, so
they are updated once per step, as in eager."""

from __future__ import annotations

import threading

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import ir

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


class OuterCheckpoint(CheckpointRegion):
    """A segment of regions under a plain non-reentrant checkpoint (two-level recomputation): the
    forward keeps only the segment's inputs; the backward reruns the segment's forward (its AOT
    regions' forward graphs save their values again) and the regions' own backwards follow.
    Buffers the segment updates are swapped for scratch copies in the rerun (CheckpointRegion)."""

