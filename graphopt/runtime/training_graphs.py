"""Training steps as two CUDA graphs: the forward and the backward of a static-shape graph, each
captured once and replayed, inside one autograd node (the scheme of
``torch.cuda.make_graphed_callables``, with the guards a drop-in module needs).

A grad-enabled call of a :class:`~graphopt.runtime.cuda_graphs.Runner` whose decision is on for a
training graph goes through :meth:`TrainingGraphs.call`:

* the first call of an input signature (shapes, dtypes, non-tensor inputs, which inputs and
  parameters require grad) warms the step up on a side stream (forward and ``torch.autograd.grad``, the graph's own
  kernels only: parameters' ``.grad`` are not touched), then captures the forward into one graph
  and the gradient of its outputs with respect to the parameters and grad-requiring inputs into
  another, both in one memory pool;
* a call copies its inputs into the static input buffers and replays the forward; the outputs are
  clones of the static ones (a replay overwrites those), returned by an autograd node whose
  backward copies the output gradients in, replays the backward and hands autograd the static
  gradients. Autograd accumulates them into ``.grad`` as eager's would; the runner keeps a
  reference to each gradient it returns, so ``AccumulateGrad`` copies it instead of adopting the
  static buffer as ``.grad`` (which the next replay would overwrite);
* a forward whose activations the graph still holds for a backward not yet run (two forwards, then
  one backward: gradient accumulation over micro-batches) would overwrite them: such a call runs the
  graph eagerly. So do calls under autocast, and every call after a capture failed.

Random ops (dropout) draw new numbers at every replay: CUDA graphs register the default generator's
state and advance its offset per replay; the mask a forward draws is what its backward reads.

The saved activations live in the pool between a forward and its backward, as eager's do; the
pool, the static inputs and the gradient buffers stay allocated while graphs are kept.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


class _Token:
    """Alive while a replayed forward's autograd node is; ``done`` once its backward ran."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False


@dataclass
class _Step:
    fwd: object
    bwd: object
    static_inputs: list  # per flat leaf: its static buffer (tensors) or None
    surface: tuple  # what gradients are taken for: grad-requiring static inputs, then parameters
    surface_index: list  # flat leaf index of each grad-requiring input, in surface order
    out_leaves: list
    out_spec: object
    grad_out_index: list  # out_leaves index of each output that takes a gradient
    tensor_index: list  # out_leaves index of each tensor output (the autograd node's outputs, in order)
    static_grad_outs: list
    static_grads: list  # per surface entry: its gradient buffer, or None (unused)
    returned: list = field(default_factory=list)  # the gradients last handed to autograd (kept referenced)


class _Graphed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, step, token, *surface):
        runner._replay(step.fwd)
        ctx.runner, ctx.step, ctx.token = runner, step, token
        outs = [step.out_leaves[i].clone() for i in step.tensor_index]
        ctx.mark_non_differentiable(*[o for i, o in zip(step.tensor_index, outs) if i not in step.grad_out_index])
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        step = ctx.step
        by_leaf = dict(zip(step.tensor_index, grads))
        for buf, i in zip(step.static_grad_outs, step.grad_out_index):
            g = by_leaf[i]
            if g is None:
                buf.zero_()
            else:
                buf.copy_(g)
        ctx.runner._replay(step.bwd)
        ctx.token.done = True
        step.returned = [g.detach() if g is not None else None for g in step.static_grads]
        return (None, None, None, *step.returned)


class TrainingGraphs:
    """Per input signature, the captured forward and backward of ``gm`` (see the module docstring).
    ``backend``: graphopt.runtime.cuda_graphs' backend ("cuda", or the CPU emulation the tests use)."""

    def __init__(self, gm, backend, device, warmup: int = 3, max_graphs: int = 2):
        self.gm, self.backend, self.device = gm, backend, device
        self.warmup, self.max_graphs = warmup, max_graphs
        self.steps: dict = {}
        self.pool = None
        self._pending: weakref.ref | None = None
        self.disabled: str | None = None
        self.capture_traceback: str | None = None  # of the capture that failed (the first line is in disabled)
        self.stats = {"captures": 0, "replays": 0}

    def reset(self) -> None:
        self.steps.clear()
        self.pool = None
        self._pending = None

    def pending(self) -> bool:
        """A replayed forward's activations wait for its backward (its autograd node is alive)."""
        tok = self._pending() if self._pending is not None else None
        return tok is not None and not tok.done

    def _replay(self, graph) -> None:
        self.backend.replay(graph, self.device)
        self.stats["replays"] += 1

    def key(self, leaves: list, structure):
        # which parameters take a gradient is part of what a capture computes (a layer frozen or
        # unfrozen later captures another step)
        key = [structure, tuple(p.requires_grad for p in self.gm.parameters())]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key.append((x.shape, x.dtype, x.requires_grad))
            else:
                key.append((type(x), x))
        return tuple(key)

    def eager_reason(self) -> str | None:
        """Why this grad-enabled call cannot replay (None: it can)."""
        if self.disabled is not None:
            return self.disabled
        if torch.is_autocast_enabled(self.device.type):
            return "autocast is on: the captured step ran without it"
        if self.pending():
            return ("the last replayed forward's backward has not run (two forwards before a backward): "
                    "its activations are still needed")
        return None

    def call(self, key, leaves: list, args: tuple, kwargs: dict):
        """``leaves``: the call's flat inputs in pytree order (of ``(args, kwargs)``)."""
        step = self.steps.get(key)
        if step is None:
            step = self._capture(key, leaves, pytree.tree_flatten((args, kwargs))[1])
            if step is None:
                return None
        with torch.no_grad():
            for i, buf in enumerate(step.static_inputs):
                if buf is not None and leaves[i] is not buf:
                    buf.copy_(leaves[i])
        token = _Token()
        surface_args = [leaves[i] for i in step.surface_index] + list(step.surface[len(step.surface_index):])
        outs = _Graphed.apply(self, step, token, *surface_args)
        self._pending = weakref.ref(token)
        it = iter(outs)
        out_leaves = [next(it) if isinstance(o, torch.Tensor) else o for o in step.out_leaves]
        return pytree.tree_unflatten(out_leaves, step.out_spec)

    def _capture(self, key, leaves: list, spec):
        gm = self.gm
        names = [name for name, p in gm.named_parameters() if p.requires_grad]
        params = tuple(gm.get_parameter(name) for name in names)
        with torch.no_grad():
            static = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else None
                      for x in leaves]
        s_leaves = [s if s is not None else x for s, x in zip(static, leaves)]
        s_args, s_kwargs = pytree.tree_unflatten(s_leaves, spec)
        surface_index = [i for i, s in enumerate(static) if s is not None and s.requires_grad]
        surface = tuple(static[i] for i in surface_index) + params

        aliases: list = []

        def forward():
            # the parameters enter as views made in this call and the gradients are taken at those, so
            # the captured backward never reaches a parameter's gradient accumulator: one made on the
            # default stream and kept alive by an earlier call's graph (a loss the caller kept) would make
            # the backward wait on that stream, which ends the capture with an error
            views = {name: p.view_as(p) for name, p in zip(names, params)}
            aliases[:] = views.values()
            return torch.func.functional_call(gm, views, s_args, s_kwargs)

        def grads(outs, grad_outs):
            return torch.autograd.grad(outs, surface[:len(surface_index)] + tuple(aliases), grad_outs, allow_unused=True)

        try:
            if self.pool is None:
                self.pool = self.backend.new_pool(self.device)
            if len(self.steps) >= self.max_graphs:
                self.steps.pop(next(iter(self.steps)))
            fwd, bwd, out, grad_outs, gs = self.backend.capture_step(forward, grads, self.pool, self.device,
                                                                    self.warmup)
        except Exception as e:  # noqa: BLE001 - any capture failure means: stay eager, correctly
            self.disabled = (f"capture failed: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")
            self.capture_traceback = traceback.format_exc()
            self.reset()
            if getattr(self.backend, "device_type", "") == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:  # noqa: BLE001
                    pass
            return None
        out_leaves, out_spec = pytree.tree_flatten(out)
        grad_index = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        # the static outputs without the capture's autograd graph: holding it would keep the parameters'
        # gradient accumulators made on the capture stream alive (each later backward then syncs with it)
        out_leaves = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
        tensor_index = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
        step = _Step(fwd, bwd, static, surface, surface_index, out_leaves, out_spec, grad_index, tensor_index,
                     grad_outs, list(gs))
        self.steps[key] = step
        self.stats["captures"] += 1
        return step


def _requiring_grad(out) -> list:
    """The tensors among ``out``'s leaves that take a gradient (the outputs a step differentiates)."""
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]


def _warm_up(forward, grads, times: int) -> None:
    """Run the step (forward, then the gradients of its outputs) ``times`` times before a capture."""
    for _ in range(times):
        outs = _requiring_grad(forward())
        if outs:
            grads(outs, [torch.empty_like(o) for o in outs])


@contextlib.contextmanager
def _generator_restored_on_failure():
    """A capture that fails can leave the default CUDA generator in capture mode (torch ends the
    capture with an error before the generator's epilogue): every random op after it then fails
    ("Offset increment outside graph capture"). On failure the generator gets back a copy of its
    state from before."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    before = gen.clone_state()
    try:
        yield
    except BaseException:
        gen.graphsafe_set_state(before)
        raise


def capture_step_cuda(forward, grads, pool, device, warmup: int):
    """Warm-up (forward and gradients) on a side stream, then the forward and the gradients each
    captured into a CUDA graph in ``pool``: (forward graph, backward graph, static outputs, static
    output-gradient buffers, static gradients)."""
    with torch.cuda.device(device), _generator_restored_on_failure():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _warm_up(forward, grads, warmup)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(device)
        fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd, pool=pool, stream=side):
            out = forward()
        req = _requiring_grad(out)
        grad_outs = [torch.empty_like(o) for o in req]
        bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bwd, pool=pool, stream=side):
            gs = grads(req, grad_outs) if req else ()
        torch.cuda.current_stream().wait_stream(side)
    return fwd, bwd, out, grad_outs, gs


class EmulatedStep:
    """The CPU stand-in's captured forward or backward: a replay re-runs it and writes the results
    into the tensors the capture returned, so static buffers and aliasing behave as on a GPU."""

    def __init__(self, run):
        self.run = run
        self.replays = 0

    def replay(self):
        self.run()
        self.replays += 1


def capture_step_emulated(forward, grads, pool, device, warmup: int):
    """What :func:`capture_step_cuda` gives, on the CPU: the forward's replay runs it again (with
    autograd) and copies its outputs into the static ones; the backward's takes the gradient of that
    run's outputs with the static output gradients and copies it into the static gradients."""
    _warm_up(forward, grads, warmup)
    out = forward()
    req = _requiring_grad(out)
    grad_outs = [torch.zeros_like(o) for o in req]
    with torch.no_grad():
        gs = [g.detach().clone() if g is not None else None for g in grads(req, grad_outs)] if req else []
    static_out = pytree.tree_leaves(out)
    live = {}

    def run_forward():
        with torch.enable_grad():  # (replayed from inside the autograd node's forward, where grad is off)
            new = pytree.tree_leaves(forward())
        live["outs"] = _requiring_grad(new)
        with torch.no_grad():
            for s, n in zip(static_out, new):
                if isinstance(s, torch.Tensor):
                    s.copy_(n)

    def run_backward():
        new = grads(live.pop("outs"), grad_outs)
        with torch.no_grad():
            for s, n in zip(gs, new):
                if s is not None:
                    s.copy_(n)

    return EmulatedStep(run_forward), EmulatedStep(run_backward), out, grad_outs, gs
