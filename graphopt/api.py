"""Public API: optimize, explain, OptimizedModule."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import time
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import accuracy, ir, setup_memory, timing
from .capture import _register_hf_pytrees, capture, flat_tensors, split_inputs
from .cost.model import CostModel
from .cost.profiles import DeviceProfile, get_profile
from .errors import GraphoptError, GuardError, ReferenceRunError, one_line
from .options import OptimizeOptions
from .passes.partition_devices import PartitionResult
from .pipeline import PassContext, PassManager, assemble
from .report import Report

# seconds optimize() may spend timing graphs (the measured guard); GRAPHOPT_MEASURE_BUDGET_S overrides
MEASURE_BUDGET_S = 5.0
# float64 reference outputs larger than this (a decoder's logits at batch 8) wait on the host; the rule
# moves them to the device a chunk at a time
REFERENCE_ON_DEVICE_BYTES = 1 << 30


def _kernel_backend() -> str:
    try:
        from . import cuda_ext

        return cuda_ext.backend()
    except (ImportError, AttributeError):
        return "aten only"


class OptimizedModule(nn.Module):
    """The optimized model: call it like the original. ``.report`` says what was done;
    ``.graph_module`` is the rewritten torch.fx graph. Parameters are the model's own objects
    (except constants folded at optimization time)."""

    def __init__(self, gm: fx.GraphModule, report: Report, signature: list, dynamic_dims: dict, *,
                 example_flat: list | None = None, training: bool = False, cuda_graphs="auto",
                 max_graphs: int = 8, cuda_graphs_reuse_outputs: bool = False,
                 profile: DeviceProfile | None = None, kernel_launches: int = 0):
        """``profile``: the device as it runs eager kernels and ``kernel_launches`` the graph's,
        what set_cuda_graphs weighs a replay with (no profile: replay whenever the runner can)."""
        super().__init__()
        self.graph_module = gm
        self.report = report
        self._profile, self._kernel_launches = profile, kernel_launches
        self._signature = signature
        self._dynamic_dims = dynamic_dims  # flat input index -> set of dynamic axes
        self._training = training
        self._runner = None
        self._lower_note = None
        self.set_cuda_graphs(cuda_graphs, max_graphs=max_graphs, reuse_outputs=cuda_graphs_reuse_outputs,
                             example_flat=example_flat)

    def set_cuda_graphs(self, mode="auto", *, max_graphs: int = 8, reuse_outputs: bool = False,
                        example_flat: list | None = None, bind_inputs: bool = False) -> "OptimizedModule":
        """Choose how calls run (graphopt.runtime.cuda_graphs): ``mode`` "auto" (CUDA graphs for static-shape
        inference on CUDA), True or False; ``max_graphs`` graphs kept (LRU); ``reuse_outputs``
        returns the graph's static outputs uncloned (valid until the next call); ``bind_inputs``
        reads every input at the caller's address, no copy into a static buffer (a caller that
        passes the same tensors on every call, updated in place; inputs the graph writes are
        bound either way). Updates the report's "CUDA graph: on/off (why)" note. Returns self."""
        from .runtime.cuda_graphs import launch_savings_s, lower

        if example_flat is None:  # the signature stands in for the example inputs
            example_flat = [torch.empty(0, dtype=s[1], device=s[2]) if isinstance(s, tuple) else None
                            for s in self._signature]
        self._runner = lower(self.graph_module, example_flat, cuda_graphs=mode, max_graphs=max_graphs,
                             reuse_outputs=reuse_outputs, dynamic=bool(self._dynamic_dims), training=self._training,
                             bind_inputs=bind_inputs)
        decision = self._runner.decision
        note = decision.note()
        profile, launches = self._profile, self._kernel_launches
        # the launches a replay stands for: a training step replays its backward too, about twice the forward's
        replayed = launches * (3 if decision.training else 1)
        if decision.on and mode == "auto" and not reuse_outputs:
            # the cost model ranks the lowering too: replaying saves launch overhead, but each
            # call then clones the outputs out of the graph's static memory
            if profile is not None:
                saving = launch_savings_s(replayed, profile)
                out_node = next(n for n in reversed(self.graph_module.graph.nodes) if n.op == "output")
                made_after = set(self._runner.tail.nodes) if self._runner.tail is not None else set()
                # outputs that are inputs written in place (a KV cache) are handed back, not cloned
                written = {root for _, root in ir.input_mutations(self.graph_module)}
                memo: dict = {}
                cloned = [a for a in out_node.all_input_nodes if a not in made_after
                          and ir.alias_root(a, memo) not in written]
                out_bytes = sum(float(ir.concrete(t.nbytes)) for a in cloned for t in ir.infos(a))
                clone = profile.kernel_seconds(0.0, 2 * out_bytes / profile.bandwidth, launches=len(cloned))
                if saving <= clone:
                    self._runner = lower(self.graph_module, example_flat, cuda_graphs=False, max_graphs=max_graphs,
                                         reuse_outputs=reuse_outputs, dynamic=bool(self._dynamic_dims),
                                         training=self._training, bind_inputs=bind_inputs)
                    note = (f"CUDA graph: off (predicted launch saving {saving * 1e3:.3f} ms < {clone * 1e3:.3f} ms "
                            f"to clone {out_bytes / 1e6:.0f} MB of outputs per call; "
                            "set_cuda_graphs(True, reuse_outputs=True) replays without the clone)")
                    decision = self._runner.decision
        if decision.on and profile is not None:
            tail = self._runner.tail
            outs = "reused, valid until the next call)" if reuse_outputs else "cloned)"
            if tail is not None:
                outs = (f"{len(tail.nodes)} made after the replay by their last op ({tail.nbytes / 1e6:.0f} MB, "
                        "no clone)" + ("" if len(tail.keep) == 0 else f", {len(tail.keep)} cloned") + ")")
            if decision.training:  # a step: the forward's launches, and about twice as many in its backward
                note = note[:-1] + (f"; a step replays 2 graphs instead of about {replayed} kernel launches, "
                                    f"predicted -{launch_savings_s(replayed, profile) * 1e3:.3f} ms launch "
                                    "overhead; outputs cloned)")
            else:
                note = note[:-1] + (f"; replays 1 graph instead of {launches} kernel launches, predicted "
                                    f"-{launch_savings_s(launches, profile) * 1e3:.3f} ms launch overhead; "
                                    "outputs " + outs)
        graphed = decision.on
        if not graphed and self.report.device == "meta" and any("planned for CUDA-graph replay" in n
                                                                for n in self.report.notes):
            graphed = True  # shapes only, planned for a GPU target: predicted as the target would replay it
            note += "; predicted as the target replays it"
        self._predict_execution(graphed, reuse_outputs)
        if self._lower_note in self.report.notes:
            self.report.notes.remove(self._lower_note)
        self.report.notes.append(note)
        self._lower_note = note
        return self

    def _predict_execution(self, graphed: bool, reuse_outputs: bool = False) -> None:
        """The report's predicted time after optimizing is that of the execution calls get: one
        replayed CUDA graph, or the graph run eagerly (graphopt.cost.model.execution_cost)."""
        ex = getattr(self.report, "execution", None)
        if not ex or "after" not in ex:
            return
        mode = ("graphed_reuse_outputs" if reuse_outputs else "graphed") if graphed else "eager"
        if mode not in ex["after"]:
            mode = "eager"
        ex["mode"] = mode
        self.report.predicted_s_after = ex["after"][mode]["predicted_ms"] / 1e3

    @property
    def runner(self):
        """The :class:`graphopt.runtime.cuda_graphs.Runner` calls go through (``.decision``, ``.stats``)."""
        return self._runner

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if getattr(self, "_runner", None) is not None:
            self._runner.reset()  # captured graphs point at the old parameter memory
        return out

    def _guard_flat(self, flat: list) -> None:
        if len(flat) != len(self._signature):
            raise GuardError(f"optimized for {len(self._signature)} inputs, called with {len(flat)}; "
                             "call graphopt.optimize again for this calling convention")
        for i, (x, sig) in enumerate(zip(flat, self._signature)):
            if sig is None:
                continue
            if type(sig) is Specialized:
                if not sig.matches(x):
                    raise GuardError(f"input {i} was {sig.value!r} when optimized, got {x!r}: the captured graph "
                                     "holds it as a constant - optimize again for this value")
                continue
            if not isinstance(x, torch.Tensor):
                raise GuardError(f"input {i} was a tensor when optimized, got {type(x).__name__}")
            shape, dtype, device = sig
            if x.dtype != dtype or x.device.type != device.type:
                raise GuardError(f"input {i} is {x.dtype} on {x.device}; optimized for {dtype} on {device} - "
                                 "optimize again for this dtype/device")
            if x.shape == shape:
                continue
            dyn = self._dynamic_dims.get(i, set())
            if x.dim() != len(shape) or any(a != b for d, (a, b) in enumerate(zip(x.shape, shape)) if d not in dyn):
                raise GuardError(f"input {i} has shape {tuple(x.shape)}; optimized for {tuple(shape)} "
                                 f"(dynamic dims: {sorted(dyn) or 'none'}) - pass dynamic= to graphopt.optimize "
                                 "or optimize again for this shape")

    _convention = None  # (inspect.Signature of the model's forward, positional names, keyword names)

    def _as_optimized(self, args, kwargs):
        """Re-spell a call in the convention the graph was captured with (positional vs keyword),
        so opt(x=t) works for a model optimized with opt(t) and vice versa."""
        if self._convention is None:
            return args, kwargs
        sig, pos_names, kw_names = self._convention
        if len(args) == len(pos_names) and len(kwargs) == len(kw_names) and list(kwargs) == kw_names:
            return args, kwargs  # spelled as captured (what binding would hand back)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise GuardError(f"cannot call the optimized module this way: {e}") from None
        extra = [k for k in bound.arguments if k not in pos_names and k not in kw_names]
        if extra:
            raise GuardError(f"argument(s) {', '.join(extra)} were not given when the model was optimized; "
                             "optimize again with them in example_inputs")
        missing = [k for k in list(pos_names) + list(kw_names) if k not in bound.arguments]
        if missing:
            raise GuardError(f"argument(s) {', '.join(missing)} were given when the model was optimized and "
                             "are missing now")
        return tuple(bound.arguments[k] for k in pos_names), {k: bound.arguments[k] for k in kw_names}

    _reoptimize = None  # (model, OptimizeOptions, max specializations) when on_new_shape="reoptimize"
    # (the model as given,) when the measured guard found this module slower than it (a tuple: the
    # model is not registered as a submodule, so its parameters are not this module's)
    _fallback = None

    def _specialization(self, args, kwargs, error: GuardError) -> "OptimizedModule":
        """Another input signature: re-optimize for it (bounded cache), or re-raise."""
        if self._reoptimize is None:
            raise error
        model, options, limit = self._reoptimize
        flat = flat_tensors(args, kwargs)
        key = tuple((tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else repr(x) for x in flat)
        cache = self.__dict__.setdefault("_specializations", {})
        if key not in cache:
            for spec in cache.values():  # one optimized with dims dynamic= that takes this call too
                try:
                    spec._guard_flat(flat)
                except GuardError:
                    continue
                return spec
            if len(cache) >= limit:
                raise GuardError(f"{error} (and {limit} re-optimized specializations are cached already: "
                                 "declare the varying dims dynamic=)") from None
            warnings.warn(f"graphopt: re-optimizing for new inputs ({error})", RuntimeWarning, stacklevel=3)
            cache[key] = _optimize_timed(model, (args, kwargs), options)
            self.report.notes.append(f"re-optimized for inputs {key}: {len(cache)} specialization(s)")
        return cache[key]

    def forward(self, *args, **kwargs):
        if self._fallback is not None:
            # measured slower than the model as given: calls run the model, with nothing in front of
            # it (the guard and the call's flattening cost tens of µs, a loss on a sub-ms model)
            return self._fallback[0](*args, **kwargs)
        args, kwargs = self._as_optimized(args, kwargs)
        flat, structure = call_leaves(args, kwargs)
        try:
            self._guard_flat(flat)
        except GuardError as e:
            return self._specialization(args, kwargs, e)(*args, **kwargs)
        placed = self._modules.get("placed")  # graphopt.runtime.placement.PlacedModule (optimize(devices=...))
        if placed is not None:
            return placed(*args, **kwargs)
        if self._runner is None:
            return self.graph_module(*args, **kwargs)
        return self._runner.call_flat(flat, structure, args, kwargs)


def call_leaves(args: tuple, kwargs: dict):
    """(leaves, structure) of a call: for the common call whose arguments are all tensors, its
    tensors in pytree order and a cheap structure key, without flattening; otherwise pytree's
    leaves and TreeSpec."""
    if all(type(a) is torch.Tensor for a in args) and all(type(v) is torch.Tensor for v in kwargs.values()):
        return [*args, *kwargs.values()], ("tensors", len(args), tuple(kwargs))
    return pytree.tree_flatten((args, kwargs))


def _model_device(model: nn.Module, flat_inputs: list) -> torch.device:
    for p in model.parameters():
        return p.device
    for x in flat_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _has_random_ops(gm: fx.GraphModule) -> bool:
    return any(ir.is_random(n) for n in gm.graph.nodes)


def _run(fn, args, kwargs, training):
    if training:
        return fn(*args, **kwargs)
    with torch.no_grad():
        return fn(*args, **kwargs)


class CallInputs:
    """One call's inputs as the caller passed them, never written by optimize(). ``fresh()`` is
    a copy for one run: containers rebuilt through pytree (a DynamicCache an eager run appends to
    is the run's own) and the tensors the graph writes in place (``mutated``: flat indices, a
    StaticCache's keys, values and position) cloned; the others shared."""

    def __init__(self, args: tuple, kwargs: dict, mutated=()):
        self.leaves, self.spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.mutated = set(mutated)

    def fresh(self) -> tuple[tuple, dict]:
        leaves = [x.detach().clone() if i in self.mutated and isinstance(x, torch.Tensor) else x
                  for i, x in enumerate(self.leaves)]
        return pytree.tree_unflatten(leaves, self.spec)

    @property
    def mutated_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for i, x in enumerate(self.leaves)
                   if i in self.mutated and isinstance(x, torch.Tensor))


def _held(out):
    """Outputs the guard keeps for the whole of optimize(): those on a GPU wait on the host when they
    are larger than REFERENCE_ON_DEVICE_BYTES in total (the rule moves them back a chunk at a time)."""
    return accuracy.offload(out, REFERENCE_ON_DEVICE_BYTES)


@contextlib.contextmanager
def _reference_run(how: str):
    """A run of the model the guard makes (as given, in float64) that fails raises ReferenceRunError."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as e:
        raise ReferenceRunError(
            f"the accuracy guard's run of the model {how} on the example inputs failed ({type(e).__name__}: "
            f"{one_line(e, 200)}); optimize(..., check_accuracy=False) skips the guard", detail=repr(e)) from e


def _real(out):
    """``out``, when no tensor in it is a fake one (which a model's run returns when it read a fake
    tensor the capture's trace stored where accuracy.ModuleState does not restore it)."""
    from torch._subclasses.fake_tensor import is_fake

    if any(isinstance(t, torch.Tensor) and is_fake(t) for t in pytree.tree_leaves(out)):
        raise RuntimeError("it returned a fake tensor: the model kept a tensor from the capture's trace in an object "
                           "graphopt does not restore (keep such a cache in a module attribute, dict or list)")
    return out


class _AccuracyGuard:
    """The accuracy rule on the example inputs (and calibration batches): against an fp64
    reference, with the eager model's own error as the yardstick. A graph lowered to bf16/fp16
    (``low_dtype``) is judged with that dtype's tolerance against the *matmul floor*: the model as
    written with only its matrix multiplies' inputs rounded to that dtype (accuracy.matmul_floor),
    the error running GEMMs in low precision cannot avoid. The model hand-converted to that dtype,
    and the strict bar (the fp32 model as the yardstick), are reported beside it."""

    def __init__(self, model, args, kwargs, training, device, calibration_data=None, mutated=(), written=()):
        self.model, self.training, self.device = model, training, device
        self.written = list(written)  # the model's tensors the graph writes in place (_keep_state)
        # the RNG state every run starts from (_same_draws)
        self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        # every run (eager, fp64, each check of the graph) gets its own copy of what it writes
        self.batches = [CallInputs(args, kwargs, mutated)] + [
            CallInputs(*split_inputs(b), mutated) for b in (calibration_data or [])]
        self._ref64, self._eager = [], []
        self._ref64_ready = False
        # On a GPU the eager and fp64 runs are queued on a side stream, so the passes (which run
        # meanwhile and sync on their own small work, e.g. a mask proven causal) do not wait for
        # them; the first use of their outputs joins the streams (_ready). Training runs stay on
        # the current stream: they write BatchNorm statistics the passes may read.
        self._stream = None
        if device.type == "cuda" and not training:
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for batch in self.batches:
                with self._same_draws(), self._keep_state(model), _reference_run("as given"):
                    self._eager.append(_held(_real(_run(model, *batch.fresh(), training))))
                # large outputs' references are kept in float32 for bf16/fp16 outputs, and wait on the
                # host from the first check on (_ready): moving them now would wait for the run
                with self._same_draws(), _reference_run("in float64"):
                    self._ref64.append(_real(accuracy.fp64_reference(model, *batch.fresh(), like=self._eager[-1],
                                                                     large_bytes=REFERENCE_ON_DEVICE_BYTES)))
        self._low: dict = {}
        self._floor: dict = {}
        self._rmse_cache: dict = {}  # yardstick rmse per output (the yardsticks live as long as the guard)

    @contextlib.contextmanager
    def _same_draws(self):
        """A run of the guard from the RNG state the first one started from, the caller's state left
        as it was: a model that draws random numbers at inference (ViT-MAE's masking noise) draws the
        same ones in the eager, float64 and optimized runs, so they are compared like for like."""
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.set_rng_state(self._rng[0])
            if cuda:
                torch.cuda.set_rng_state(self._rng[1], self.device)
            yield

    def _ready(self) -> None:
        """Join the side stream the reference runs were queued on, and move references larger than
        REFERENCE_ON_DEVICE_BYTES to the host (once)."""
        if self._ref64_ready:
            return
        self._ref64_ready = True
        if self._stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self._stream)
            for t in pytree.tree_leaves((self._eager, self._ref64)):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(cur)  # made on the side stream, read (and freed) on this one
            self._stream = None
        self._ref64 = [_held(r) for r in self._ref64]

    @property
    def eager(self) -> list:
        self._ready()
        return self._eager

    @property
    def ref64(self) -> list:
        self._ready()
        return self._ref64

    def _eager_low(self, dtype):
        """The model hand-converted to ``dtype`` (what ``copy.deepcopy(model).to(dtype)`` computes), each
        parameter converted when an op reads it rather than a converted copy of the model."""
        self._ready()
        if dtype not in self._low:
            cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            outs = []
            for b in self.batches:
                with accuracy._Float64State(self.model, dtype), self._same_draws():
                    outs.append(_held(_run(self.model, *pytree.tree_map(cast, b.fresh()), self.training)))
            self._low[dtype] = outs
        return self._low[dtype]

    def _matmul_floor(self, dtype):
        self._ready()
        if dtype not in self._floor:
            outs = []
            for b in self.batches:
                with self._same_draws(), self._keep_state(self.model):
                    outs.append(_held(accuracy.matmul_floor(self.model, *b.fresh(), dtype, self.training)))
            self._floor[dtype] = outs
        return self._floor[dtype]

    def _keep_state(self, gm):
        """Running a training graph updates BatchNorm statistics, and a graph may write other
        buffers in place (a step counter, a running sum); the guard's runs must not. Nor may
        a run of the model leave what its forward stores in its Python-side state (a cache of a
        tensor derived from the weights, accuracy.ModuleState) to the next run: each starts from the
        state the caller's model had."""

        @contextlib.contextmanager
        def keep():
            state = accuracy.ModuleState(self.model) if gm is self.model else None
            bufs = {id(b): (b, b.detach().clone()) for b in self.written}
            if self.training:
                bufs.update({id(b): (b, b.detach().clone()) for m in (self.model, gm) for b in m.buffers()})
            try:
                yield
            finally:
                with torch.no_grad():
                    for b, saved in bufs.values():
                        b.copy_(saved)
                if state is not None:
                    state.restore()

        return keep()

    def _results(self, gm, dtype, yardsticks):
        """The rule on each batch against ``yardsticks``, lazily (a caller may stop early)."""
        if self.device.type == "cuda" and isinstance(gm, fx.GraphModule):
            from .runtime.precompile import precompile

            precompile(gm)  # the Triton kernels its eager run would compile one by one, on a pool first
        for b, ref, yard in zip(self.batches, self.ref64, yardsticks):
            with self._same_draws(), self._keep_state(gm):
                out = _run(gm, *b.fresh(), self.training)
            yield accuracy.check(out, ref, yard, training=self.training, dtype=dtype, cache=self._rmse_cache)

    def __call__(self, gm, low_dtype=None):
        yardsticks = self._matmul_floor(low_dtype) if low_dtype is not None else self.eager
        result = None
        for result in self._results(gm, low_dtype, yardsticks):
            if not result.passed:
                break
        return result

    def strict_result(self, gm, dtype):
        """Does ``gm`` (lowered to dtype) pass with the fp32 model itself as the yardstick?"""
        res = list(self._results(gm, dtype, self.eager))
        return all(r.passed for r in res), max(r.worst_rmse for r in res)

    def hand_converted_result(self, dtype):
        """The model hand-converted to dtype: does it pass the same bar as the optimized graph
        (the matmul floor as the yardstick), and the strict bar (the fp32 model as the
        yardstick)? Reported beside our own result."""
        floor = self._matmul_floor(dtype)
        floor_rmse = max(accuracy.check(f, r, e, dtype=dtype).worst_rmse for f, r, e in zip(floor, self.ref64, self.eager))
        try:
            hand = self._eager_low(dtype)
        except RuntimeError as e:  # e.g. a mask filled with finfo(float32).min, out of bf16's range
            return {"passes": False, "passes_strict": False, "rmse": None, "matmul_floor_rmse": floor_rmse,
                    "error": str(e).splitlines()[0][:160]}
        same = [accuracy.check(h, r, f, dtype=dtype) for h, r, f in zip(hand, self.ref64, floor)]
        strict = [accuracy.check(h, r, e, dtype=dtype) for h, r, e in zip(hand, self.ref64, self.eager)]
        return {"passes": all(r.passed for r in same), "passes_strict": all(r.passed for r in strict),
                "rmse": max(r.worst_rmse for r in same), "matmul_floor_rmse": floor_rmse}


def _fp64_memory_shortfall(model: nn.Module, device: torch.device, flat_inputs=(), copied_bytes: int = 0) -> str:
    """The guard's float64 run converts one parameter or buffer at a time (a large 2-D weight by
    blocks, accuracy._Float64State) and runs on float64 copies of the inputs (a KV cache's too); each
    run gets its own copy of what the graph writes (``copied_bytes``). Say so if that cannot fit."""
    def fp64_bytes(t):
        whole = t.numel() * 8
        return min(whole, accuracy._Float64State.CHUNK_BYTES) if t.dim() == 2 and t.is_floating_point() else whole

    need = max((fp64_bytes(t) for t in (*model.parameters(), *model.buffers())), default=0)
    need += sum(x.numel() * 8 for x in flat_inputs if isinstance(x, torch.Tensor) and x.is_floating_point())
    need += copied_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # memory the caching allocator holds but no tensor uses (an earlier guard's fp64 copy) is free too
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            free = info.get("MemAvailable", info.get("MemFree", 0))
        except (OSError, ValueError):
            return ""
    if need * 1.5 > free:
        return (f"the float64 reference needs {need / 1e9:.1f} GB (its largest weight, the inputs) and {free / 1e9:.1f} GB are free "
                f"on {device}; not checked (run on a device with more memory, or check_accuracy=False to silence this)")
    return ""


def optimize(model: nn.Module, example_inputs, **options) -> OptimizedModule:
    """Capture ``model``, run the pass pipeline ranked by the cost model, guard accuracy.

    ``options``: keyword arguments, each a field of :class:`graphopt.options.OptimizeOptions`,
    whose docstring says what each does (device, target, passes, disable, training, dynamic,
    precision, calibration_data, cuda_graphs, on_new_shape, check_accuracy, memory_budget,
    devices, ...). They are checked before anything is captured; a bad one raises GraphoptError.
    """
    return _optimize_timed(model, example_inputs, OptimizeOptions.of(options))


def _optimize_timed(model: nn.Module, example_inputs, opts: OptimizeOptions) -> OptimizedModule:
    timer = timing.PhaseTimer()
    peak = _SetupPeak(model)
    try:
        with timer.active(), _collect_young_only(), peak:
            opt = _optimize(model, example_inputs, opts)
    finally:
        accuracy.release_host_memory()  # the guard's offloaded outputs are freed with it
    peak.record(opt.report)
    # the whole call, lowering (CUDA-graph planning) included; the phases sum to it
    opt.report.optimize_seconds = timer.total()
    opt.report.optimize_phases = timer.as_dict(opt.report.optimize_seconds)
    return opt


class _SetupPeak:
    """optimize()'s peak memory on the model's GPU: the device's peak statistic is reset on entry and
    read on exit (torch.cuda.max_memory_allocated). Elsewhere the report's account stands in: the
    model plus the most constants the passes held at once."""

    def __init__(self, model: nn.Module):
        dev = torch.device("cpu")
        if isinstance(model, nn.Module):  # (anything else is refused with its error inside optimize)
            dev = next((t.device for t in (*model.parameters(), *model.buffers())), dev)
        self.device = dev if dev.type == "cuda" else None
        self.start = self.peak = None

    def __enter__(self):
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.device is not None and exc[0] is None:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        return False

    def record(self, report: Report) -> None:
        mem = report.memory if report.memory is not None else {}
        if self.peak is not None:
            mem.update(setup_peak_bytes=self.peak, setup_start_bytes=self.start, setup_peak_source="measured")
        elif "model_bytes" in mem:
            mem.update(setup_peak_bytes=mem["model_bytes"] + mem.get("added_peak_bytes", 0.0),
                       setup_start_bytes=None, setup_peak_source="account")
        report.memory = mem
        report.setup_peak_bytes = mem.get("setup_peak_bytes")


@contextlib.contextmanager
def _collect_young_only():
    """Garbage collections during optimize() scan only the objects it creates: the objects the
    process already holds (in a benchmark process after eager and torch.compile runs, ~0.4 M) are
    frozen for the duration (gc.freeze) and handed back to the collector afterwards
    (gc.unfreeze), so a full collection in the middle of capture does not walk them. Nothing is
    left uncollected: what optimize() drops is collected as usual,
    and the process's own garbage at the next full collection. Not done when the collector is off
    or the caller froze objects itself (unfreezing would hand back theirs)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _optimize(model: nn.Module, example_inputs, opts: OptimizeOptions) -> OptimizedModule:
    t_start = time.perf_counter()
    inputs, args, kwargs, flat, model_dev = _validate(model, example_inputs, opts)
    planning = _plan_profile(opts, model_dev)
    # what a forward stores in the model's Python-side state (a cache of a tensor derived from the
    # weights), and what model.train() clears there, is the caller's as given again on return
    with accuracy.module_state_kept(model):
        was_training = model.training
        model.train(opts.training)
        saved: list = []  # the model's tensors the graph writes, as the caller had them
        try:
            try:
                with accuracy.module_state_kept(model):  # (a trace may store proxies or fakes there)
                    gm = _capture(model, args, kwargs, opts)
                inputs.mutated = ir.mutated_flat_inputs(gm, flat)
                written = _written_state(gm, model)
                saved = [(t, t.detach().clone()) for t in written]
                check, acc_info = _build_guard(model, gm, inputs, flat, model_dev, opts, written)
                constants = setup_memory.account(opts.weight_copies, model, model_dev)
                meter, measure_note = _meter(opts, planning, model_dev, inputs)
                run = _run_pipeline(gm, planning, check, model_dev, opts, constants, meter)
            finally:
                model.train(was_training)
            report = _build_report(model, gm, planning, run, acc_info, model_dev, opts, t_start)
            if was_training and not opts.training:
                report.notes.append("the model was in train mode: optimized for inference, which runs it as in "
                                    "eval mode (BatchNorm's running statistics, no dropout); training=True optimizes "
                                    "the training step")
            opt = _lower(gm, report, run, planning, model, inputs, args, kwargs, flat, opts)
            _measured_guard(opt, model, inputs, meter, measure_note)
        finally:  # what the guard's, the passes' and the timing's runs wrote there, undone
            with torch.no_grad():
                for t, value in saved:
                    t.copy_(value)
    return opt


def _written_state(gm: fx.GraphModule, model: nn.Module) -> list:
    """The model's parameters and buffers the captured graph writes in place (a step counter, a
    running statistic): every run of the model or the graph during optimize() writes them."""
    own = {id(t): t for t in (*model.parameters(), *model.buffers())}
    out: dict = {}
    for _, root in ir.input_mutations(gm):
        if root.op != "get_attr":
            continue
        t = ir.get_attr_value(gm, root.target)
        if isinstance(t, torch.Tensor) and id(t) in own:
            out[id(t)] = t
    return list(out.values())


def _plain(spec) -> bool:
    """A call's inputs held in tuples, lists and dicts only (no cache object a run would grow)."""
    if spec.type is None or spec.is_leaf():
        return True
    kids = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return spec.type in (tuple, list, dict) and all(_plain(c) for c in kids)


def _meter(opts: OptimizeOptions, planning: "_Planning", model_dev: torch.device, inputs: "CallInputs"):
    """(the MeasuredTime instrument or None, why there is none): measuring needs the plan to be for
    the device the model runs on, inference, static shapes."""
    import os

    from .runtime.measured import MeasuredTime, Timer, runnable

    want = opts.measure
    if want == "auto":
        env = os.environ.get("GRAPHOPT_MEASURE", "").strip().lower()
        want = {"0": False, "false": False, "off": False, "no": False, "1": True, "true": True, "on": True,
                "yes": True}.get(env, "auto")
    if want is False:
        return None, "not measured (measure=False)"
    if opts.training or opts.dynamic:
        return None, "not measured (training graphs and dynamic shapes are not timed)"
    if opts.target is not None and planning.run_profile.kind != model_dev.type:
        return None, f"not measured (planned for {planning.run_profile.name}, running on {model_dev})"
    if inputs.mutated:
        # a KV cache, a position counter: each timed call would read the previous call's writes
        # (a decode step's positions run past the end of its cache)
        return None, (f"not measured (the graph writes {len(inputs.mutated)} of its inputs in place; "
                      "calls timed one after another would each read the last one's writes)")
    args, kwargs = inputs.fresh()
    flat = flat_tensors(args, kwargs)
    budget = float(os.environ.get("GRAPHOPT_MEASURE_BUDGET_S", MEASURE_BUDGET_S))
    # one untimed call of each graph: its capture (or, eager, its lazy first use); the calls after it are alike
    timer = Timer(model_dev, early=True, warmup=1)
    meter = MeasuredTime(lambda g: runnable(g, flat, args, kwargs, opts.cuda_graphs), timer, budget)
    return meter, ""


def _measured_guard(opt: "OptimizedModule", model: nn.Module, inputs: "CallInputs", meter, note: str) -> None:
    """The module as returned timed against the model as given (interleaved rounds on the model's
    device); where it is slower by more than the margin, its calls run the model instead. The
    report's ``speed`` holds the measured times, the passes' too (``PassResult.details``)."""
    from .runtime.measured import slower

    report = opt.report
    if meter is None:
        report.speed = {"measured": False, "note": note}
        return
    speed = {"measured": True, "captured_ms": meter.first.median_s * 1e3 if meter.first else None,
             "passes_ms": meter.current.median_s * 1e3 if meter.current else None,
             "timing_s": meter.timer.spent_s, "not_timed_passes": list(meter.skipped)}
    if meter.skipped:
        report.notes.append(f"measured guard: the time budget ({meter.budget_s:.0f} s) had no room for another "
                            "comparison; "
                            f"{', '.join(meter.skipped)} applied unmeasured")
    if inputs.mutated or not _plain(inputs.spec):
        speed.update(model_ms=None, returned="optimized",
                     note="the model as given not timed (its inputs include a cache or tensors it writes)")
        report.speed = speed
        return
    args, kwargs = inputs.fresh()
    timing.progress("measured guard: timing the optimized module against the model as given")
    was = model.training
    model.train(False)
    try:
        as_given, ours = meter.timer.compare(lambda: model(*args, **kwargs), lambda: opt(*args, **kwargs))
    finally:
        model.train(was)
    speed.update(model_ms=as_given.median_s * 1e3, optimized_ms=ours.median_s * 1e3, timing_s=meter.timer.spent_s)
    if slower(ours, as_given, meter.margin):
        opt._fallback = (model,)
        speed["returned"] = "model"
        report.notes.append(f"measured guard: the optimized module took {ours.median_s * 1e3:.3f} ms against the "
                            f"model's {as_given.median_s * 1e3:.3f} ms; calls run the model as given")
    else:
        speed["returned"] = "optimized"
    report.speed = speed


@dataclasses.dataclass
class _Planning:
    """The device profile the passes plan with, the one eager execution is predicted with (they
    differ when planning for CUDA-graph replay), and what the report says about them."""

    profile: DeviceProfile
    run_profile: DeviceProfile
    note: str


@dataclasses.dataclass
class _PipelineRun:
    """What running the passes gave: their results, the graph's predicted cost before and after,
    the predicted execution times, the accuracy verdict and the partition plan, if any."""

    results: list
    before: object  # GraphCost
    after: object  # GraphCost
    execution: dict
    accuracy: dict | None  # None: not checked (the guard-less entry is _build_guard's)
    constants: object  # graphopt.setup_memory.ConstantAccount: the weight copies the passes added
    plan: object = None  # graphopt.partition.StagePlan


def _validate(model, example_inputs, opts: OptimizeOptions):
    """(the caller's inputs, args, kwargs, flat tensors, the model's device); the model, its inputs
    and the pass names checked against each other (the options checked themselves). optimize()
    never writes what the caller passed: its runs use ``CallInputs.fresh()`` copies, and capture
    gets rebuilt containers (new cache objects around the caller's tensors, which torch.export
    only reads)."""
    if not isinstance(model, nn.Module):
        raise GraphoptError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    assemble(opts.passes, opts.disable)  # unknown pass names fail before anything runs
    args, kwargs = split_inputs(example_inputs)
    _register_hf_pytrees()  # a transformers cache flattens to its tensors, at optimization as at call time
    # optimize() never writes what the caller passed: its runs use CallInputs.fresh() copies, and
    # capture gets rebuilt containers (new cache objects around the caller's tensors, which
    # torch.export only reads)
    inputs = CallInputs(args, kwargs)
    args, kwargs = inputs.fresh()
    flat = flat_tensors(args, kwargs)
    model_dev = _model_device(model, flat)
    if opts.device is not None:
        try:
            want = torch.device(opts.device)
        except (RuntimeError, TypeError):
            raise GraphoptError(f"unknown device '{opts.device}'") from None
        if want.type != model_dev.type:
            hint = f" or use target='{want.type}' to only plan for it" if want.type in ("cuda", "cpu") else ""
            raise GraphoptError(f"the model is on {model_dev} but device={want}; move the model and inputs "
                                f"(model.to('{want}')){hint}")
    for x in flat:
        if isinstance(x, torch.Tensor) and x.device.type != model_dev.type:
            raise GraphoptError(f"an example input is on {x.device} but the model is on {model_dev}")
    return inputs, args, kwargs, flat, model_dev


def _plan_profile(opts: OptimizeOptions, model_dev: torch.device) -> _Planning:
    profile, note = get_profile(opts.target if opts.target is not None else model_dev)
    run_profile = profile  # the device as it runs eager kernels: the execution-time predictions use it
    if (opts.cuda_graphs is not False and not opts.training and not opts.dynamic and profile.kind == "cuda"
            and model_dev.type in ("cuda", "meta") and profile.launch_overhead_graph_s < profile.launch_overhead_s):
        # (a model on meta is shapes only, planned for the target: as it would run there)
        # static-shape inference on a GPU replays a CUDA graph when it pays (graphopt.runtime.cuda_graphs): plan
        # the rewrites with the launch cost a replay leaves, where kernels' device time is what counts
        eager_launch = profile.launch_overhead_s
        profile = dataclasses.replace(profile, launch_overhead_s=profile.launch_overhead_graph_s)
        replay = (f"planned for CUDA-graph replay: {profile.launch_overhead_s * 1e6:.2f} us per kernel launch "
                  f"({eager_launch * 1e6:.1f} us eager)")
        note = f"{note}; {replay}" if note else replay
    return _Planning(profile, run_profile, note)


def _capture(model, args, kwargs, opts: OptimizeOptions) -> fx.GraphModule:
    return capture(model, (args, kwargs), dynamic=opts.dynamic, stack_traces=opts.dump_dir is not None,
                   inference=not opts.training)


def _build_guard(model, gm, inputs: "CallInputs", flat, model_dev, opts: OptimizeOptions, written=()):
    """(the accuracy guard or None, the report's accuracy entry when there is none). The guard's
    runs get their own copies of what the graph writes (``inputs.fresh()``; ``written``: the
    model's tensors it writes, as they were before each run)."""
    acc_info: dict = {"checked": False}
    if not opts.check_accuracy:
        return None, acc_info
    if model_dev.type == "meta":
        acc_info["reason"] = "the model is on meta (shapes only): there are no values to compare"
        return None, acc_info
    short = _fp64_memory_shortfall(model, model_dev, flat, 3 * inputs.mutated_bytes)
    if opts.training and _has_random_ops(gm):
        acc_info["reason"] = "the training graph has random ops (dropout); outputs differ run to run"
    elif short:
        acc_info["reason"] = short
    else:
        args, kwargs = inputs.fresh()
        timing.progress("accuracy guard: running the model and its float64 reference")
        with timing.phase("accuracy: eager + fp64 reference runs"):
            return _AccuracyGuard(model, args, kwargs, opts.training, model_dev, opts.calibration_data,
                                  mutated=inputs.mutated, written=written), acc_info
    return None, acc_info


def _captured_activation_bytes(gm, cost, hints, opts: OptimizeOptions) -> float | None:
    """A training step's activation bytes of the captured graph, where a memory_budget fraction
    needs them (the fraction is of the model's activations); None otherwise."""
    if not opts.training or opts.memory_budget is None:
        return None
    from .cost.activations import ActivationModel, parse_memory_budget

    if not isinstance(parse_memory_budget(opts.memory_budget), float):
        return None
    with timing.phase("activation baseline"):
        return ActivationModel.build(gm, cost, hints, device_kind=cost.device_kind).step_activation_bytes()


def _run_pipeline(gm, planning: _Planning, check, model_dev, opts: OptimizeOptions, constants,
                  meter=None) -> _PipelineRun:
    """The passes, ranked by the cost model. The guard runs optimistically: every pass, then one
    check of the result. Only when that fails does the pipeline run again from the captured graph
    with a check after each pass, which finds and reverts the pass(es) at fault (passes that
    search with the guard themselves, like assign_precision, call it in both runs)."""
    hints = ir.shape_hints(gm)
    cost = CostModel(planning.profile)
    before = cost.graph_cost(gm, hints)
    run_cost = CostModel(planning.run_profile)
    execution = {"before": run_cost.execution_cost(gm, hints, "eager").as_dict()}

    captured_act = _captured_activation_bytes(gm, cost, hints, opts)
    candidate_timer = None
    if meter is not None:  # measuring on the device planned for: lowerings are timed there before they apply
        from .runtime.candidates import CandidateTimer

        candidate_timer = CandidateTimer(model_dev, margin=meter.margin)

    def context():
        constants.used = constants.peak = 0.0  # a second run starts from the captured graph again
        return PassContext(cost=cost, training=opts.training, verify=opts.verify, dump_dir=opts.dump_dir,
                           hints=hints, options=opts, device=model_dev, constants=constants,
                           captured_activation_bytes=captured_act, candidate_timer=candidate_timer)

    snapshot = None
    if check is not None or meter is not None:
        with timing.phase("graph snapshots"):
            snapshot = ir.GraphSnapshot(gm.graph)  # the captured graph, rebuilt where a second run starts from it
    ctx = context()
    instruments = [meter] if meter is not None else []

    def manager_for(check_each: bool) -> PassManager:
        return PassManager(assemble(opts.passes, opts.disable), check, check_each=check_each, instruments=instruments)

    if meter is not None:
        meter.hold = True  # a measured loss is judged by the whole pipeline (_without_held)
    manager = manager_for(False)
    results = manager.run(gm, ctx, before=before)
    if meter is not None:
        meter.hold = False
        if meter.held:
            results, ctx, manager = _without_held(gm, snapshot, meter, (results, ctx, manager),
                                                  lambda: manager_for(False), context, before)
    acc_mode, final = "once, after all passes", None
    if check is not None:
        timing.progress("accuracy guard: checking the optimized graph")
        with timing.phase("accuracy checks"):
            first = check(gm, ctx.low_precision)
        if first.passed:
            final = first
        else:
            _set_graph(gm, snapshot.graph())
            ctx = context()
            if meter is not None:
                meter.current = meter.first  # the captured graph again
            manager = manager_for(True)
            timing.progress("accuracy guard: the optimized graph failed (%s); running the passes again, "
                            "checking after each", first.reason)
            results = manager.run(gm, ctx, before=before)
            acc_mode = f"after each pass (the check after all passes failed: {first.reason})"
            last = manager.last_check
            if last is not None and last[1] == ctx.low_precision:
                final = last[0]  # the graph handed back is the one the last pass's check ran
    execution["after"] = {"eager": run_cost.execution_cost(gm, hints, "eager").as_dict()}
    if planning.run_profile.kind == "cuda":
        execution["after"]["graphed"] = run_cost.execution_cost(gm, hints, "graphed").as_dict()
        execution["after"]["graphed_reuse_outputs"] = run_cost.execution_cost(
            gm, hints, "graphed", reuse_outputs=True).as_dict()
    accuracy_info = None
    if check is not None:
        if final is None:
            with timing.phase("accuracy checks"):
                final = check(gm, ctx.low_precision)
        accuracy_info = {"checked": True, "mode": acc_mode, **final.as_dict()}
        if not final.passed:
            accuracy_info["reason"] = final.reason
    plan = next((r.plan for r in results if isinstance(r, PartitionResult)), None)
    return _PipelineRun(results, before, manager.final_cost, execution, accuracy_info, constants, plan)


def _set_graph(gm, graph) -> None:
    """``gm`` runs ``graph`` (a snapshot taken earlier): its code regenerated, the constants no node
    reads any more dropped, fake values propagated again."""
    with timing.phase("recompile"):
        gm.graph = graph  # (the setter recompiles)
        ir.remove_unused_attributes(gm)
    ir.repropagate(gm)


def _without_held(gm, snapshot, meter, first: tuple, make_manager, context, before) -> tuple:
    """The passes measured slower in the first run were kept (``meter.held``): the passes after
    them may have built on them. Run the pipeline again from the captured graph with each of them
    judged alone (undone, or bisected over its rewrites, where it measures slower), time both
    results against each other, and keep the first only where the second is slower. Returns the
    kept run's (results, context, manager); ``gm`` holds its graph."""
    from .runtime.measured import slower

    held = list(meter.held)
    with timing.phase("graph snapshots"):
        kept = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # the first result, with the constants it reads
        captured = snapshot.graph()  # (the snapshot stays for the accuracy guard's second run)
    _set_graph(gm, captured)
    first_skipped = list(meter.skipped)
    meter.current, meter.held, meter.skipped, meter.judge_again = meter.first, [], [], set(held)
    ctx = context()
    # the first result's constants stay resident while the second run adds its own: the weight-copy
    # limit covers both
    ctx.constants.reserved = setup_memory.added_constant_bytes(kept)
    ctx.constants.recount(gm)
    timing.progress("running the passes again with %s judged alone (measured slower)", ", ".join(held))
    try:
        manager = make_manager()
        results = manager.run(gm, ctx, before=before)
    finally:
        meter.judge_again = set()
        ctx.constants.reserved = 0.0
    with timing.phase("measured guard: building the callables"):
        fns = meter.make(kept), meter.make(gm)
    with_held, without = meter.timer.compare(*fns)
    del fns
    names = ", ".join(held)
    verdict = (f"the passes with {names} kept measured {with_held.median_s * 1e3:.3f} ms, run again with "
               f"{'it' if len(held) == 1 else 'them'} judged alone {without.median_s * 1e3:.3f} ms")
    if not slower(without, with_held, meter.margin):
        ctx.constants.recount(gm)
        meter.current = without
        for r in results:
            if r.name in held:
                r.notes.append(verdict)
                r.details["held_verdict"] = f"judged alone: {verdict}"
        return results, ctx, manager
    for name in {n.target for n in kept.graph.nodes if n.op == "get_attr"}:
        if name.startswith("_graphopt_"):  # the constants the first run's passes added
            gm.register_buffer(name, ir.get_attr_value(kept, name), persistent=True)
    _set_graph(gm, kept.graph)
    first[1].constants.recount(gm)
    meter.current, meter.skipped = with_held, first_skipped
    for r in first[0]:
        if r.name in held:
            r.notes.append(f"kept: {verdict}")
            r.details["held_verdict"] = f"kept: {verdict}"
    return first


def _build_report(model, gm, planning: _Planning, run: _PipelineRun, acc_info: dict, model_dev,
                  opts: OptimizeOptions, t_start: float) -> Report:
    cap = gm.meta["graphopt_capture"]
    profile = planning.profile
    notes = list(cap.notes)
    if planning.note:
        notes.append(planning.note)
    top = sorted(run.after.nodes, key=lambda c: -c.time_s)[:8]
    report = Report(
        model=opts.model_name or type(model).__name__,
        device=str(model_dev),
        target=profile.name,
        profile={"name": profile.name, "description": profile.description},
        capture={"method": cap.method, "export_error": cap.export_error, "dynamic": {k: {str(a): d for a, d in v.items()} for k, v in cap.dynamic.items()},
                 "mha": cap.mha},
        predicted_s_before=run.execution["before"]["predicted_ms"] / 1e3,
        predicted_s_after=run.execution["after"]["eager"]["predicted_ms"] / 1e3,  # graphed: set by set_cuda_graphs
        cost_before=run.before.as_dict(),
        cost_after=run.after.as_dict(),
        passes=run.results,
        accuracy=run.accuracy if run.accuracy is not None else acc_info,
        kernel_backend=_kernel_backend(),
        optimize_seconds=time.perf_counter() - t_start,
        notes=notes,
        top_nodes=[{"node": c.node, "op": c.op, "ms": c.time_s * 1e3, "bound": c.bound} for c in top if c.time_s > 0],
        execution=run.execution,
        memory={"model_bytes": setup_memory.model_bytes(model), **run.constants.as_dict()},
    )
    if run.plan is not None:
        report.partition = run.plan.as_dict()
    return report


def _lower(gm, report: Report, run: _PipelineRun, planning: _Planning, model, inputs: "CallInputs", args, kwargs,
           flat, opts: OptimizeOptions) -> OptimizedModule:
    """The OptimizedModule: CUDA graphs where they pay, placed across devices where planned."""
    signature, dyn = _signature(flat, args, kwargs, model, opts.dynamic,
                                constants=report.capture.get("method") == "torch.export")
    timing.progress("lowering")
    with timing.phase("lowering"):
        opt = OptimizedModule(gm, report, signature, dyn, example_flat=flat, training=opts.training,
                              cuda_graphs=opts.cuda_graphs, profile=planning.run_profile,
                              kernel_launches=int(run.after.launches))
    # kept for export's trace, which runs the graph: private copies of what it writes
    opt._example_flat = [x.detach() if isinstance(x, torch.Tensor) else x
                         for x in flat_tensors(*inputs.fresh())]
    opt._convention = _calling_convention(model, args, kwargs)
    if run.plan is not None:
        with timing.phase("lowering"):
            _place(opt, gm, run.plan, opts.training, report)
    if opts.on_new_shape == "reoptimize":
        # the same options for every specialization, but the calibration batches: they have this
        # call's shapes, dtypes and devices, which a specialization's graph does not take (it is
        # checked on the inputs it is made for)
        opt._reoptimize = (model, dataclasses.replace(opts, calibration_data=None), 8)
    return opt


def _place(opt: OptimizedModule, gm: fx.GraphModule, plan, training: bool, report: Report) -> None:
    """Run the optimized module placed across the plan's devices, where they exist here."""
    from .runtime.placement import PlacedModule

    missing = [s.device for s in plan.stages if torch.device(s.device).type == "cuda"
               and (not torch.cuda.is_available() or torch.device(s.device).index >= torch.cuda.device_count())]
    if missing:
        report.notes.append(f"partition planned only: {', '.join(dict.fromkeys(missing))} not present here; "
                            "the module runs unpartitioned")
        return
    opt.placed = PlacedModule(gm, plan, training=training)
    report.notes.append(f"placed across {', '.join(s.device for s in plan.stages)} in one process (outputs on "
                        f"{plan.stages[-1].device}); graphopt.runtime.distributed runs the stages as a pipeline")


def _calling_convention(model, args, kwargs):
    import inspect

    try:
        sig = inspect.signature(model.forward)
        params = list(sig.parameters.values())
        if any(p.kind == p.VAR_POSITIONAL for p in params):
            return None
        pos_names = [p.name for p in params[:len(args)]]
        return sig, pos_names, list(kwargs)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Specialized:
    """A non-tensor input (a Python scalar, string, dtype...) torch.export captured as a constant:
    a call must pass the same value, of the same type, or the graph computes with the old one."""

    value: object

    TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)

    def matches(self, x) -> bool:
        if type(x) is not type(self.value):
            return False
        return x == self.value or (isinstance(x, float) and x != x and self.value != self.value)


def _signature(flat, args, kwargs, model, dynamic, constants: bool = True):
    """Per flat input: (shape, dtype, device) of a tensor; with ``constants`` (a torch.export
    capture, which specializes them), :class:`Specialized` for a scalar-like value; else None."""
    sig = [(tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
           else Specialized(x) if constants and type(x) in Specialized.TYPES else None for x in flat]
    dyn: dict[int, set] = {}
    if dynamic:
        import inspect

        # the flat inputs are the call's leaves in pytree order: the positional arguments, then the
        # keyword arguments in the order the call gave them (not the forward's parameter order)
        positional = inspect.signature(model.forward).bind_partial(*args).arguments
        order = []
        for name, val in [*positional.items(), *kwargs.items()]:
            leaves = pytree.tree_leaves(val)
            order.extend((name, j) for j in range(len(leaves)))
        for i, (name, j) in enumerate(order):
            if name in dynamic and j == 0:
                dyn[i] = {a % len(sig[i][0]) for a in dynamic[name]} if isinstance(sig[i], tuple) else set()
    return sig, dyn


def explain(model: nn.Module, example_inputs, **kwargs) -> Report:
    """Optimize and return only the Report (see :func:`optimize` for the options)."""
    return optimize(model, example_inputs, **kwargs).report
