"""Exact tensor-memory timeline of a piece of PyTorch code, on any device (the CPU included).

``torch.cuda.max_memory_allocated`` exists only on a GPU. :class:`MemoryTrace` gives the same
quantity for tensors anywhere: a ``TorchDispatchMode`` sees every ATen op that runs under it
(the forward, and the backward too: the autograd engine carries the mode into the ops it runs),
records each new storage an op returns (``untyped_storage()``, its ``nbytes``) and frees it
through a ``weakref.finalize`` on the storage (PyTorch preserves a storage's Python object for
as long as the storage lives, so the finalizer runs exactly when the memory is released). The
live total after every op and its maximum (``peak``) follow; storages that existed before the
trace started (parameters, their ``.grad``, inputs) are not counted, as
``max_memory_allocated() - memory_allocated()`` before the step does not count them.

Not seen: allocations an op makes and frees inside its kernel (a GEMM's workspace), and
storages made by code that bypasses the dispatcher. ::

    with MemoryTrace() as tr:
        loss = model(x).sum()
        after_forward = tr.live
        loss.backward()
    tr.peak  # bytes: the step's activation memory

``label(text)`` marks a point of the timeline (``tr.marks``); ``tr.top(k)`` lists the largest
storages live at the peak, with the op that made them.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import GraphoptError


def _key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return None


class MemoryTrace(TorchDispatchMode):
    """Live tensor bytes made under the mode, with their peak. ``record_ops``: keep, for each
    live storage, the op that made it (for :meth:`top`)."""

    def __init__(self, record_ops: bool = True):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.ops = 0
        self.record_ops = record_ops
        self._sizes: dict = {}  # storage key -> bytes (live storages made under the trace)
        self._made_by: dict = {}  # storage key -> (op name, op index)
        self._at_peak: list = []  # (bytes, op, index) of the storages live at the peak
        self.marks: list = []  # (label, op index, live bytes)
        self.paused = False  # ops run while paused make storages that are not counted

    # storages are keyed by their StorageImpl address, unique while alive
    def _track(self, t: torch.Tensor, func, inputs) -> None:
        try:
            st = t.untyped_storage()
        except Exception:  # no storage (sparse, nested, functional wrappers)
            return
        key = st._cdata
        nbytes = int(st.nbytes())
        old = self._sizes.get(key)
        if old is not None:
            if old != nbytes:  # resized in place (an out= op)
                self.live += nbytes - old
                self._sizes[key] = nbytes
            return
        if nbytes == 0 or st.device.type == "meta" or key in inputs():
            return  # empty, or an alias of a storage made before the trace (a view of a parameter)
        self._sizes[key] = nbytes
        self.live += nbytes
        if self.record_ops:
            self._made_by[key] = (str(func), self.ops)
        weakref.finalize(st, self._free, key)

    def _free(self, key) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None:
            self.live -= nbytes
            self._made_by.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if self.paused:
            return out
        keys: list = []

        def inputs():  # storages of the arguments (computed only when an output is new to us)
            if not keys:
                keys.append({_key(a) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)})
            return keys[0]

        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, func, inputs)
        if self.live > self.peak:
            self.peak = self.live
            if self.record_ops:
                self._at_peak = [(self._sizes[k], *self._made_by.get(k, ("?", -1))) for k in self._sizes]
        return out

    def label(self, text: str) -> None:
        """Mark this point of the timeline: (text, ops so far, live bytes)."""
        self.marks.append((text, self.ops, self.live))

    def top(self, k: int = 10) -> list:
        """The ``k`` largest storages live at the peak: (bytes, op that made it, its op index)."""
        return sorted(self._at_peak, key=lambda r: -r[0])[:k]

    def by_op_at_peak(self) -> dict:
        """Bytes live at the peak by the op that made them, largest first."""
        rows: dict = {}
        for b, op, _ in self._at_peak:
            rows[op] = rows.get(op, 0) + b
        return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def trace_step(fn, args, grads_out=None, params=None) -> dict:
    """One training step of ``fn(*args)`` (forward, then backward of the floating outputs that
    require grad on ``grads_out``, or on ones) under a :class:`MemoryTrace`. Parameters'
    gradients that exist are zeroed in place first (as in a training loop after its first step),
    so their storages are not the step's. Returns {"peak", "after_forward", "trace"} (bytes)."""
    for p in params or ():
        if p.grad is not None:
            p.grad.zero_()
    outs_grads = grads_out
    with MemoryTrace() as tr:
        out = fn(*args)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
                and t.requires_grad]
        if not outs:
            raise GraphoptError("trace_step: the step has no floating output that requires grad (nothing to "
                                "run backward on)")
        after = tr.live
        tr.label("forward done")
        if outs_grads is None:  # the caller's, made before the step: not counted
            tr.paused = True
            outs_grads = [torch.ones_like(o) for o in outs]
            tr.paused = False
        torch.autograd.backward(outs, outs_grads)
        del out, outs
        tr.label("backward done")
    return {"peak": tr.peak, "after_forward": after, "trace": tr}
