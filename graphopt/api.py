"""Public API: optimize, explain, OptimizedModule."""

from __future__ import annotations

import copy

import contextlib
import gc
import time
import warnings
from pathlib import Path
from typing import Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import accuracy, ir, timing
from .capture import capture, flat_tensors, split_inputs
from .cost.model import CostModel
from .cost.profiles import get_profile
from .errors import GraphoptError, GuardError
from .pipeline import PassContext, PassManager, assemble
from .report import Report

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


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
                 max_graphs: int = 8, cuda_graphs_reuse_outputs: bool = False):
        super().__init__()
        self.graph_module = gm
        self.report = report
        self._signature = signature
        self._dynamic_dims = dynamic_dims  # flat input index -> set of dynamic axes
        self._training = training
        self._runner = None
        self._lower_note = None
        self.set_cuda_graphs(cuda_graphs, max_graphs=max_graphs, reuse_outputs=cuda_graphs_reuse_outputs,
                             example_flat=example_flat)

    def set_cuda_graphs(self, mode="auto", *, max_graphs: int = 8, reuse_outputs: bool = False,
                        example_flat: list | None = None) -> "OptimizedModule":
        """Choose how calls run (graphopt.lower): ``mode`` "auto" (CUDA graphs for static-shape
        inference on CUDA), True or False; ``max_graphs`` graphs kept (LRU); ``reuse_outputs``
        returns the graph's static outputs uncloned (valid until the next call). Updates the
        report's "CUDA graph: on/off (why)" note. Returns self."""
        from .lower import launch_savings_s, lower

        if example_flat is None:  # the signature stands in for the example inputs
            example_flat = [torch.empty(0, dtype=s[1], device=s[2]) if s is not None else None
                            for s in self._signature]
        self._runner = lower(self.graph_module, example_flat, cuda_graphs=mode, max_graphs=max_graphs,
                             reuse_outputs=reuse_outputs, dynamic=bool(self._dynamic_dims), training=self._training)
        decision = self._runner.decision
        note = decision.note()
        if decision.on and mode == "auto" and not reuse_outputs:
            # the cost model ranks the lowering too: replaying saves launch overhead, but each
            # call then clones the outputs out of the graph's static memory
            try:
                profile, _ = get_profile(self.report.target)
            except GraphoptError:
                profile = None
            if profile is not None:
                launches = int(self.report.cost_after.get("kernel_launches", 0) or 0)
                saving = launch_savings_s(launches, profile)
                out_node = next(n for n in reversed(self.graph_module.graph.nodes) if n.op == "output")
                made_after = set(self._runner.tail.nodes) if self._runner.tail is not None else set()
                cloned = [a for a in out_node.all_input_nodes if a not in made_after]
                out_bytes = sum(float(ir.concrete(t.nbytes)) for a in cloned for t in ir.infos(a))
                clone = profile.kernel_seconds(0.0, 2 * out_bytes / profile.bandwidth, launches=len(cloned))
                if saving <= clone:
                    self._runner = lower(self.graph_module, example_flat, cuda_graphs=False, max_graphs=max_graphs,
                                         reuse_outputs=reuse_outputs, dynamic=bool(self._dynamic_dims),
                                         training=self._training)
                    note = (f"CUDA graph: off (predicted launch saving {saving * 1e3:.3f} ms < {clone * 1e3:.3f} ms "
                            f"to clone {out_bytes / 1e6:.0f} MB of outputs per call; "
                            "set_cuda_graphs(True, reuse_outputs=True) replays without the clone)")
                    decision = self._runner.decision
        if decision.on:
            launches = int(self.report.cost_after.get("kernel_launches", 0) or 0)
            try:
                profile, _ = get_profile(self.report.target)
                tail = self._runner.tail
                outs = "reused, valid until the next call)" if reuse_outputs else "cloned)"
                if tail is not None:
                    outs = (f"{len(tail.nodes)} made after the replay by their last op ({tail.nbytes / 1e6:.0f} MB, "
                            "no clone)" + ("" if len(tail.keep) == 0 else f", {len(tail.keep)} cloned") + ")")
                note = note[:-1] + (f"; replays 1 graph instead of {launches} kernel launches, predicted "
                                    f"-{launch_savings_s(launches, profile) * 1e3:.3f} ms launch overhead; "
                                    "outputs " + outs)
            except GraphoptError:
                pass
        self._predict_execution(decision.on, reuse_outputs)
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
        """The :class:`graphopt.lower.Runner` calls go through (``.decision``, ``.stats``)."""
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

    _reoptimize = None  # (model, optimize kwargs, max specializations) when on_new_shape="reoptimize"

    def _specialization(self, args, kwargs, error: GuardError) -> "OptimizedModule":
        """Another input signature: re-optimize for it (bounded cache), or re-raise."""
        if self._reoptimize is None:
            raise error
        model, options, limit = self._reoptimize
        flat = flat_tensors(args, kwargs)
        key = tuple((tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else repr(x) for x in flat)
        cache = self.__dict__.setdefault("_specializations", {})
        if key not in cache:
            if len(cache) >= limit:
                raise GuardError(f"{error} (and {limit} re-optimized specializations are cached already: "
                                 "declare the varying dims dynamic=)") from None
            warnings.warn(f"graphopt: re-optimizing for new inputs ({error})", RuntimeWarning, stacklevel=3)
            cache[key] = optimize(model, (args, kwargs), **options)
            self.report.notes.append(f"re-optimized for inputs {key}: {len(cache)} specialization(s)")
        return cache[key]

    def forward(self, *args, **kwargs):
        args, kwargs = self._as_optimized(args, kwargs)
        flat, structure = call_leaves(args, kwargs)
        try:
            self._guard_flat(flat)
        except GuardError as e:
            return self._specialization(args, kwargs, e)(*args, **kwargs)
        placed = self._modules.get("placed")  # graphopt.partition.PlacedModule (optimize(devices=...))
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


class _AccuracyGuard:
    """The accuracy rule on the example inputs (and calibration batches): against an fp64
    reference, with the eager model's own error as the yardstick. A graph lowered to bf16/fp16
    (``low_dtype``) is judged with that dtype's tolerance against the *matmul floor*: the model as
    written with only its matrix multiplies' inputs rounded to that dtype (accuracy.matmul_floor),
    the error running GEMMs in low precision cannot avoid. The model hand-converted to that dtype,
    and the strict bar (the fp32 model as the yardstick), are reported beside it."""

    def __init__(self, model, args, kwargs, training, device, calibration_data=None):
        self.model, self.training, self.device = model, training, device
        self.batches = [(args, kwargs)] + [split_inputs(b) for b in (calibration_data or [])]
        self._ref64, self._eager = [], []
        # On a GPU the eager and fp64 runs are queued on a side stream, so the passes (which run
        # meanwhile and sync on their own small work, e.g. a mask proven causal) do not wait for
        # them; the first use of their outputs joins the streams (_ready). Training runs stay on
        # the current stream: they write BatchNorm statistics the passes may read.
        self._stream = None
        if device.type == "cuda" and not training:
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for a, k in self.batches:
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), self._keep_buffers(model):
                    self._eager.append(_run(model, a, k, training))
                self._ref64.append(accuracy.fp64_reference(model, a, k))
        self._low: dict = {}
        self._floor: dict = {}
        self._rmse_cache: dict = {}  # yardstick rmse per output (the yardsticks live as long as the guard)

    def _ready(self) -> None:
        """Join the side stream the reference runs were queued on (once)."""
        if self._stream is None:
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_stream(self._stream)
        for t in pytree.tree_leaves((self._eager, self._ref64)):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(cur)  # made on the side stream, read (and freed) on this one
        self._stream = None

    @property
    def eager(self) -> list:
        self._ready()
        return self._eager

    @property
    def ref64(self) -> list:
        self._ready()
        return self._ref64

    def _eager_low(self, dtype):
        self._ready()
        if dtype not in self._low:
            import copy

            low = copy.deepcopy(self.model).to(dtype)
            cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            self._low[dtype] = [_run(low, *pytree.tree_map(cast, (a, k)), self.training) for a, k in self.batches]
            del low
        return self._low[dtype]

    def _matmul_floor(self, dtype):
        self._ready()
        if dtype not in self._floor:
            outs = []
            for a, k in self.batches:
                with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                        self._keep_buffers(self.model):
                    outs.append(accuracy.matmul_floor(self.model, a, k, dtype, self.training))
            self._floor[dtype] = outs
        return self._floor[dtype]

    def _keep_buffers(self, gm):
        """Running a training graph updates BatchNorm statistics; the guard's runs must not."""
        import contextlib

        @contextlib.contextmanager
        def keep():
            if not self.training:
                yield
                return
            bufs = {id(b): (b, b.detach().clone()) for m in (self.model, gm) for b in m.buffers()}
            try:
                yield
            finally:
                with torch.no_grad():
                    for b, saved in bufs.values():
                        b.copy_(saved)

        return keep()

    def _results(self, gm, dtype, yardsticks):
        """The rule on each batch against ``yardsticks``, lazily (a caller may stop early)."""
        for (a, k), ref, yard in zip(self.batches, self.ref64, yardsticks):
            with self._keep_buffers(gm):
                out = _run(gm, a, k, self.training)
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


def _fp64_memory_shortfall(model: nn.Module, device: torch.device) -> str:
    """The guard runs a float64 copy of the model beside it; say so if that cannot fit."""
    need = sum(p.numel() for p in model.parameters()) * 8 + sum(b.numel() for b in model.buffers()) * 8
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            free = info.get("MemAvailable", info.get("MemFree", 0))
        except (OSError, ValueError):
            return ""
    if need * 1.5 > free:
        return (f"the float64 reference copy needs {need / 1e9:.1f} GB of parameters and {free / 1e9:.1f} GB are free "
                f"on {device}; not checked (run on a device with more memory, or check_accuracy=False to silence this)")
    return ""


def optimize(
    model: nn.Module,
    example_inputs,
    *,
    device: str | torch.device | None = None,
    target: str | None = None,
    passes: Iterable[str] | None = None,
    disable: Iterable[str] = (),
    training: bool = False,
    dynamic: dict | None = None,
    precision: str = "auto",
    calibration_data=None,
    cuda_graphs="auto",
    on_new_shape: str = "error",
    check_accuracy: bool = True,
    verify: bool = True,
    dump_dir: str | Path | None = None,
    model_name: str | None = None,
    memory_budget=None,
    checkpoint_backend: str = "auto",
    devices=None,
    memory_cap=None,
    microbatches: int = 1,
    schedule: str = "gpipe",
    virtual_stages: int | None = None,
) -> OptimizedModule:
    """Capture ``model``, run the pass pipeline ranked by the cost model, guard accuracy.

    device: where the model runs (default: where its parameters are); it must match the model.
    target: a cost profile to plan for ("h200", "a100", "cpu", a .json); default: ``device``'s.
    passes / disable: pass ids to run / to leave out (``graphopt.pipeline.PIPELINE`` lists them).
    training: capture and optimize a graph for training (inference-only passes are skipped;
      parameters stay the model's own objects so optimizers built on ``model.parameters()`` work).
    dynamic: ``{"arg": {axis: "name"}}`` dims left symbolic (the cost model keeps sympy formulas).
    precision: "auto" (bf16 — fp16 before Ampere — where the cost model predicts a gain, sensitive
      ops kept in fp32, guarded by the accuracy rule), "bf16", "fp16", or "fp32" (leave dtypes).
    calibration_data: more example inputs (a list, each like ``example_inputs``) the precision
      guard also checks.
    cuda_graphs: "auto" (replay CUDA graphs for static-shape inference on CUDA), True or False.
    on_new_shape: "error" (a call with another shape/dtype/device raises GuardError) or
      "reoptimize" (optimize again for it, up to 8 cached specializations, with a warning).
    check_accuracy: compare with an fp64 reference after each pass; a pass that fails is reverted.
    dump_dir: write the graph after each pass as ``NNN_<pass>.py``; a reverted pass's full reason
      and broken graph as ``NNN_<pass>.reverted.txt`` (the report keeps one line).
    memory_budget: training only: fit a step's activation memory (saved tensors, outputs, the
      backward's working set) into this budget by recomputing the cheapest activations in backward
      (pass insert_checkpoints): a fraction 0 < f <= 1 of the baseline step's activation memory,
      bytes, or a size string ("8GB", "512MB").
    checkpoint_backend: how the recomputation runs: "auto" (the AOTAutograd graph rewrite where it
      traces the graph, else the selective checkpoint), "aot" (the rewrite, or an error) or "sac"
      (torch.utils.checkpoint regions with a selective policy).
    devices: partition across devices (``["cuda:0", "cuda:1"]``, ``["cuda:0", "cpu"]``, or a count
      of GPUs): the partition_devices pass plans cost-balanced stages within each device's memory
      (``memory_cap`` bytes per device overrides the profiles'), the report gets the stage table,
      and where the devices exist the module runs placed across them (graphopt.partition); the
      example inputs are one micro-batch of a ``schedule`` ("gpipe"/"1f1b"/"interleaved1f1b": with
      ``virtual_stages`` (default 2) non-adjacent stages per device) pipeline of ``microbatches``
      (run multi-process with graphopt.distributed).
    """
    timer = timing.PhaseTimer()
    with timer.active(), _collect_young_only():
        opt = _optimize(model, example_inputs, device=device, target=target, passes=passes, disable=disable,
                        training=training, dynamic=dynamic, precision=precision, calibration_data=calibration_data,
                        cuda_graphs=cuda_graphs, on_new_shape=on_new_shape, check_accuracy=check_accuracy,
                        verify=verify, dump_dir=dump_dir, model_name=model_name, memory_budget=memory_budget,
                        checkpoint_backend=checkpoint_backend, devices=devices, memory_cap=memory_cap,
                        microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages)
    # the whole call, lowering (CUDA-graph planning) included; the phases sum to it
    opt.report.optimize_seconds = timer.total()
    opt.report.optimize_phases = timer.as_dict(opt.report.optimize_seconds)
    return opt


@contextlib.contextmanager
def _collect_young_only():
    """Garbage collections during optimize() scan only the objects it creates: the objects the
    process already holds (in a benchmark process after eager and torch.compile runs, ~0.4 M) are
    frozen for the duration (gc.freeze) and handed back to the collector afterwards
    (gc.unfreeze). A full collection over them in the middle of capture cost ~0.2 s of BERT-base's
    first optimize(). Nothing is left uncollected: what optimize() drops is collected as usual,
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


def _optimize(model, example_inputs, *, device, target, passes, disable, training, dynamic, precision,
              calibration_data, cuda_graphs, on_new_shape, check_accuracy, verify, dump_dir, model_name,
              memory_budget, checkpoint_backend, devices, memory_cap, microbatches, schedule,
              virtual_stages=None) -> OptimizedModule:
    t_start = time.perf_counter()
    if precision not in PRECISIONS:
        raise GraphoptError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not isinstance(model, nn.Module):
        raise GraphoptError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = split_inputs(example_inputs)
    flat = flat_tensors(args, kwargs)
    model_dev = _model_device(model, flat)
    if device is not None:
        try:
            want = torch.device(device)
        except (RuntimeError, TypeError):
            raise GraphoptError(f"unknown device '{device}'") from None
        if want.type != model_dev.type:
            hint = f" or use target='{want.type}' to only plan for it" if want.type in ("cuda", "cpu") else ""
            raise GraphoptError(f"the model is on {model_dev} but device={want}; move the model and inputs "
                                f"(model.to('{want}')){hint}")
    for x in flat:
        if isinstance(x, torch.Tensor) and x.device.type != model_dev.type:
            raise GraphoptError(f"an example input is on {x.device} but the model is on {model_dev}")
    if memory_budget is not None:
        from .cost.activations import parse_memory_budget

        if not training:
            raise GraphoptError("memory_budget applies to training; pass training=True (inference saves no activations)")
        memory_budget = parse_memory_budget(memory_budget)
    if checkpoint_backend not in ("auto", "aot", "sac"):
        raise GraphoptError(f"checkpoint_backend must be 'auto', 'aot' or 'sac', got {checkpoint_backend!r}")
    profile, profile_note = get_profile(target if target is not None else model_dev)
    run_profile = profile  # the device as it runs eager kernels: the execution-time predictions use it
    if (cuda_graphs is not False and not training and not dynamic and profile.kind == "cuda"
            and model_dev.type == "cuda" and profile.launch_overhead_graph_s < profile.launch_overhead_s):
        # static-shape inference on a GPU replays a CUDA graph when it pays (graphopt.lower): plan
        # the rewrites with the launch cost a replay leaves, where kernels' device time is what counts
        import dataclasses

        eager_launch = profile.launch_overhead_s
        profile = dataclasses.replace(profile, launch_overhead_s=profile.launch_overhead_graph_s)
        note = (f"planned for CUDA-graph replay: {profile.launch_overhead_s * 1e6:.2f} us per kernel launch "
                f"({eager_launch * 1e6:.1f} us eager)")
        profile_note = f"{profile_note}; {note}" if profile_note else note

    was_training = model.training
    model.train(training)
    try:
        gm = capture(model, (args, kwargs), dynamic=dynamic, stack_traces=dump_dir is not None)
        cap = gm.meta["graphopt_capture"]
        hints = ir.shape_hints(gm)
        cost = CostModel(profile)
        def new_context():
            ctx = PassContext(profile=profile, cost=cost, training=training, verify=verify,
                              dump_dir=Path(dump_dir) if dump_dir else None, hints=hints,
                              options={"precision": precision, "device": model_dev, "memory_budget": memory_budget,
                                       "checkpoint_backend": checkpoint_backend})
            if devices is not None:
                from .partition import resolve_devices

                ctx.options.update(devices=resolve_devices(devices, target, memory_cap), microbatches=microbatches,
                                   schedule=schedule, virtual_stages=virtual_stages)
            return ctx

        ctx = new_context()
        pipeline = assemble(passes, disable)
        before = cost.graph_cost(gm, hints)
        run_cost = CostModel(run_profile)
        execution = {"before": run_cost.execution_cost(gm, hints, "eager").as_dict()}

        acc_info: dict = {"checked": False}
        check = None
        if check_accuracy:
            short = _fp64_memory_shortfall(model, model_dev)
            if training and _has_random_ops(gm):
                acc_info["reason"] = "the training graph has random ops (dropout); outputs differ run to run"
            elif short:
                acc_info["reason"] = short
            else:
                with timing.phase("accuracy: eager + fp64 reference runs"):
                    check = _AccuracyGuard(model, args, kwargs, training, model_dev, calibration_data)

        # The guard runs optimistically: every pass, then one check of the result. Only when that
        # fails does the pipeline run again from the captured graph with a check after each pass,
        # which finds and reverts the pass(es) at fault (passes that search with the guard
        # themselves, like assign_precision, call it in both runs).
        snapshot = None
        if check is not None:
            with timing.phase("graph snapshots"):
                snapshot = copy.deepcopy(gm.graph)
        manager = PassManager(pipeline, check, check_each=False)
        results = manager.run(gm, ctx, before=before)
        acc_mode = "once, after all passes"
        if check is not None:
            with timing.phase("accuracy checks"):
                first = check(gm, ctx.low_precision)
            if first.passed:
                manager.last_check = (first, ctx.low_precision)
            else:
                with timing.phase("recompile"):
                    gm.graph = snapshot
                    ir.remove_unused_attributes(gm)
                    gm.recompile()
                ir.repropagate(gm)
                ctx = new_context()
                manager = PassManager(assemble(passes, disable), check, check_each=True)
                results = manager.run(gm, ctx, before=before)
                acc_mode = f"after each pass (the check after all passes failed: {first.reason})"
        after = manager.final_cost
        execution["after"] = {"eager": run_cost.execution_cost(gm, hints, "eager").as_dict()}
        if run_profile.kind == "cuda":
            execution["after"]["graphed"] = run_cost.execution_cost(gm, hints, "graphed").as_dict()
            execution["after"]["graphed_reuse_outputs"] = run_cost.execution_cost(
                gm, hints, "graphed", reuse_outputs=True).as_dict()
        if check is not None:
            last = manager.last_check
            if last is not None and last[1] == ctx.low_precision:
                final = last[0]  # the graph handed back is the one the last pass's check ran
            else:
                with timing.phase("accuracy checks"):
                    final = check(gm, ctx.low_precision)
            acc_info = {"checked": True, "mode": acc_mode, **final.as_dict()}
            if not final.passed:
                acc_info["reason"] = final.reason
    finally:
        model.train(was_training)

    notes = list(cap.notes)
    if profile_note:
        notes.append(profile_note)
    top = sorted(after.nodes, key=lambda c: -c.time_s)[:8]
    report = Report(
        model=model_name or type(model).__name__,
        device=str(model_dev),
        target=profile.name,
        profile={"name": profile.name, "description": profile.description},
        capture={"method": cap.method, "export_error": cap.export_error, "dynamic": {k: {str(a): d for a, d in v.items()} for k, v in cap.dynamic.items()},
                 "mha": cap.mha},
        predicted_s_before=execution["before"]["predicted_ms"] / 1e3,
        predicted_s_after=execution["after"]["eager"]["predicted_ms"] / 1e3,  # graphed: set by set_cuda_graphs
        cost_before=before.as_dict(),
        cost_after=after.as_dict(),
        passes=results,
        accuracy=acc_info,
        kernel_backend=_kernel_backend(),
        optimize_seconds=time.perf_counter() - t_start,
        notes=notes,
        top_nodes=[{"node": c.node, "op": c.op, "ms": c.time_s * 1e3, "bound": c.bound} for c in top if c.time_s > 0],
        execution=execution,
    )
    plan = ctx.options.get("partition_plan")
    if plan is not None:
        report.partition = plan.as_dict()
    signature, dyn = _signature(flat, args, kwargs, model, dynamic)
    with timing.phase("lowering"):
        opt = OptimizedModule(gm, report, signature, dyn, example_flat=flat, training=training, cuda_graphs=cuda_graphs)
    opt._example_flat = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
    opt._convention = _calling_convention(model, args, kwargs)
    if plan is not None:
        with timing.phase("lowering"):
            _place(opt, gm, plan, training, report)
    if on_new_shape == "reoptimize":
        opt._reoptimize = (model, dict(device=device, target=target, passes=passes, disable=disable, training=training,
                                       dynamic=dynamic, precision=precision, cuda_graphs=cuda_graphs,
                                       check_accuracy=check_accuracy, verify=verify, model_name=model_name,
                                       memory_budget=memory_budget, checkpoint_backend=checkpoint_backend,
                                       devices=devices, memory_cap=memory_cap,
                                       microbatches=microbatches, schedule=schedule,
                                       virtual_stages=virtual_stages), 8)
    elif on_new_shape != "error":
        raise GraphoptError(f"on_new_shape must be 'error' or 'reoptimize', got {on_new_shape!r}")
    return opt


def _place(opt: OptimizedModule, gm: fx.GraphModule, plan, training: bool, report: Report) -> None:
    """Run the optimized module placed across the plan's devices, where they exist here."""
    from .partition import PlacedModule

    missing = [s.device for s in plan.stages if torch.device(s.device).type == "cuda"
               and (not torch.cuda.is_available() or torch.device(s.device).index >= torch.cuda.device_count())]
    if missing:
        report.notes.append(f"partition planned only: {', '.join(dict.fromkeys(missing))} not present here; "
                            "the module runs unpartitioned")
        return
    opt.placed = PlacedModule(gm, plan, training=training)
    report.notes.append(f"placed across {', '.join(s.device for s in plan.stages)} in one process (outputs on "
                        f"{plan.stages[-1].device}); graphopt.distributed runs the stages as a pipeline")


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


def _signature(flat, args, kwargs, model, dynamic):
    sig = [(tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else None for x in flat]
    dyn: dict[int, set] = {}
    if dynamic:
        import inspect

        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
        order = []
        for name, val in bound.arguments.items():
            leaves = pytree.tree_leaves(val)
            order.extend((name, j) for j in range(len(leaves)))
        for i, (name, j) in enumerate(order):
            if name in dynamic and j == 0:
                dyn[i] = {a % len(sig[i][0]) for a in dynamic[name]} if sig[i] else set()
    return sig, dyn


def explain(model: nn.Module, example_inputs, **kwargs) -> Report:
    """Optimize and return only the Report (see :func:`optimize` for the options)."""
    return optimize(model, example_inputs, **kwargs).report
