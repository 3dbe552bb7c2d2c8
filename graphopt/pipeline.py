"""Pass protocol, the one declared pipeline, and the PassManager that runs it.

A pass is a small object with a verb-first ``name`` (its CLI name, report key and test file
name), a ``family`` (where it sits in the pipeline) and ``run(gm, ctx) -> PassResult``. Passes
propose :class:`Candidate` rewrites; :meth:`PassResult.apply_ranked` asks the cost model's
predicted gain, ranks overlapping candidates, applies the winners and records the rest as
rejected with a reason. The manager runs each pass inside instruments (PassInstrument, as TVM's:
the predicted cost before and after, timing, IR dumps, invariant checks, the accuracy guard) and
reverts a pass that raises, breaks an invariant or fails the accuracy rule.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.fx as fx

from . import ir, timing
from .cost.model import CostModel
from .cost.profiles import DeviceProfile
from .errors import GraphoptError, PassConfigError, one_line
from .options import OptimizeOptions
from .setup_memory import ConstantAccount

log = logging.getLogger("graphopt.pipeline")

# why kernel fusions are refused on a CPU profile (the report shows it)
NO_FUSED_KERNELS = "graphopt's fused kernels are CUDA kernels; on the CPU their reference implementation is no faster"

# the declared order of families; a pipeline that breaks it is refused when assembled
FAMILIES = ("cleanup", "fusion", "layout", "precision", "checkpoint", "partition", "lower")


@dataclass
class Rewrite:
    pattern: str
    matched: list[str]
    replacement: list[str]
    predicted_gain_s: float

    def as_dict(self):
        return {"pattern": self.pattern, "matched": self.matched, "replacement": self.replacement,
                "predicted_gain_ms": self.predicted_gain_s * 1e3}


@dataclass
class Rejected:
    candidate: str
    reason: str

    def as_dict(self):
        return {"candidate": self.candidate, "reason": self.reason}


@dataclass
class Candidate:
    """A proposed rewrite: the nodes it replaces, its predicted gain, and how to apply it.

    ``apply()`` edits the graph and returns something true (the replacing node, or True for a
    pure deletion), or None if, looking closer, it cannot apply; it must then leave the graph
    untouched and ``refusal`` says why. New nodes are found by the provenance observer.
    ``constant_bytes``: bytes of new constants (weight copies) apply() stores in the graph; the
    context's :class:`~graphopt.setup_memory.ConstantAccount` may refuse the rewrite for them."""

    pattern: str
    nodes: list
    gain_s: float
    apply: Callable[[], object]
    label: str = ""
    refusal: str = ""
    constant_bytes: float = 0.0
    # what to apply instead when the weight-copy budget refuses this one (a layout without the copy)
    fallback: "Candidate | None" = None
    # the nodes apply() would make, as priced (a graphopt.cost.replacement.Replacement): where the
    # context has a candidate timer (optimize() measuring on the device it plans for), the rewrite
    # is timed there against ``nodes`` before it applies, and not applied where it measures slower
    replacement: object = None

    @property
    def description(self) -> str:
        return self.label or f"{self.pattern} at {', '.join(n.name for n in self.nodes[:4])}"


@dataclass
class PassResult:
    name: str
    family: str = ""
    changed: bool = False
    status: str = "unchanged"  # applied | unchanged | skipped | reverted | disabled
    rewrites: list[Rewrite] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    predicted_s_before: float = 0.0
    predicted_s_after: float = 0.0
    peak_bytes_before: float = 0.0
    peak_bytes_after: float = 0.0
    accuracy: dict | None = None
    details: dict = field(default_factory=dict)  # pass-specific structured data for the report

    def reject(self, candidate: str, reason: str) -> None:
        self.rejected.append(Rejected(candidate, reason))

    def reject_all(self, candidates: Iterable, reason: str) -> None:
        """Reject each of ``candidates`` (nodes, by name, or descriptions) for the same reason."""
        for c in candidates:
            self.reject(c.name if isinstance(c, fx.Node) else str(c), reason)

    def record(self, pattern: str, matched: Iterable, replacement: Iterable, gain_s: float) -> None:
        names = lambda xs: [x.name if isinstance(x, fx.Node) else str(x) for x in xs]  # noqa: E731
        self.rewrites.append(Rewrite(pattern, names(matched), names(replacement), gain_s))
        self.changed = True

    def consider(self, ctx: "PassContext", labelled: Iterable, build: Callable) -> None:
        """For each ``(match, label)``, ``build(match, label)`` gives ``(why not, None)`` or ``("",
        Candidate)``: refusals are recorded with their reason, the candidates applied ranked. The
        rewrites call graphopt's kernels, so on a profile where they cannot pay (a CPU) every match
        is refused with NO_FUSED_KERNELS before anything is built."""
        if not ctx.fused_kernels:
            self.reject_all([label for _, label in labelled], NO_FUSED_KERNELS)
            return
        candidates = []
        for m, label in labelled:
            why, c = build(m, label)
            if why:
                self.reject(label, why)
            else:
                candidates.append(c)
        self.apply_ranked(ctx, candidates, fused_kernels=True)

    def apply_ranked(self, ctx: "PassContext", candidates: list[Candidate], allow_zero_gain: bool = False,
                     fused_kernels: bool = False) -> None:
        """Apply candidates best predicted gain first; skip overlaps and predicted losses.
        ``fused_kernels=True``: the rewrites call torch.ops.graphopt.* kernels, so on a profile
        where they cannot pay (a CPU) every candidate is refused with NO_FUSED_KERNELS."""
        if fused_kernels and not ctx.fused_kernels:
            self.reject_all([c.description for c in candidates], NO_FUSED_KERNELS)
            return
        taken: set = set()
        winners: dict = {}
        for c in sorted(candidates, key=lambda c: -c.gain_s):
            if any(getattr(n, "_erased", False) for n in c.nodes if isinstance(n, fx.Node)):
                self.reject(c.description, "a node it matched was removed by an earlier rewrite")
                continue
            clash = next((n for n in c.nodes if n in taken), None)
            if clash is not None:
                self.reject(c.description, f"overlaps {winners[clash]} (higher predicted gain)")
                continue
            if (c.gain_s < 0 or (c.gain_s == 0 and not allow_zero_gain)) and not ctx.ignore_cost:
                self.reject(c.description, f"predicted no gain ({c.gain_s * 1e6:+.2f} us)")
                continue
            limit = ctx.rewrite_limit
            if limit is not None and len(self.rewrites) >= limit:
                self.reject(c.description, f"beyond the first {limit} rewrites (bisecting)")
                continue
            if c.replacement is not None and ctx.candidate_timer is not None and not ctx.ignore_cost:
                why_not = self._timed(ctx.candidate_timer, c)
                if why_not:
                    self.reject(c.description, why_not)
                    continue
            too_big = ctx.constants.refusal(c.constant_bytes)
            if too_big and c.fallback is not None:
                why_not = too_big
                c = c.fallback
                if c.gain_s <= 0:
                    self.reject(c.description, f"{why_not}; without the copy predicted no gain ({c.gain_s * 1e6:+.2f} us)")
                    continue
                too_big = ctx.constants.refusal(c.constant_bytes)
            if too_big:
                self.reject(c.description, too_big)
                continue
            created_before = len(ctx.observer.created) if ctx.observer else 0
            touched_before = len(ctx.observer.touched) if ctx.observer else 0
            with (ctx.observer.sourced(c.nodes) if ctx.observer else _null()):
                out = c.apply()
            if out is None:
                ctx.constants.charge(-c.constant_bytes)
                self.reject(c.description, c.refusal or "could not be applied")
                continue
            created = ctx.observer.created[created_before:] if ctx.observer else []
            # the new nodes and the nodes the rewrite redirected to read something else
            edited = created + list(dict.fromkeys(ctx.observer.touched[touched_before:] if ctx.observer else []))
            _read_live(edited, ctx.observer)
            wrong = ir.misplaced(edited)
            if wrong:  # a pass bug: the PassManager reverts the pass (strict: raises)
                raise ir.InvariantError(f"{self.name}: rewrite {c.description}: {wrong}")
            for n in c.nodes:
                taken.add(n)
                winners[n] = c.description
            shown = [n for n in created if n.op != "get_attr"] or created
            self.record(c.pattern, c.nodes, shown, c.gain_s)

    def _timed(self, timer, c: Candidate) -> str:
        """Why ``c`` is not applied after timing it on the device ("" where it applies); the times
        go to ``details["timed_candidates"]``."""
        times = timer.time(c.nodes, c.replacement)
        if times is None:
            return ""
        old, new = times
        refused = timer.slower(old, new)
        self.details.setdefault("timed_candidates", []).append(
            {"candidate": c.description, "predicted_gain_us": c.gain_s * 1e6, "before_us": old * 1e6,
             "after_us": new * 1e6, "refused": refused})
        if refused:
            return (f"measured slower on {timer.device_name}: {new * 1e6:.1f} us against {old * 1e6:.1f} us "
                    f"(predicted {c.gain_s * 1e6:+.1f} us)")
        return ""

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "family": self.family,
            "status": self.status,
            "rewrites": len(self.rewrites),
            "rewrite_list": [r.as_dict() for r in self.rewrites],
            "predicted_ms_before": self.predicted_s_before * 1e3,
            "predicted_ms_after": self.predicted_s_after * 1e3,
            "peak_memory_before": self.peak_bytes_before,
            "peak_memory_after": self.peak_bytes_after,
            "rejected": [r.as_dict() for r in self.rejected],
            "notes": list(self.notes),
            "seconds": self.seconds,
            "accuracy": self.accuracy,
            "details": self.details,
        }


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# a context made outside optimize() (run_passes, the pass tests, tools) leaves dtypes as they are
PASS_DEFAULTS = OptimizeOptions(precision="fp32")


@dataclass
class PassContext:
    """What a pass may read about the run: the cost model (prices and device facts), the example
    sizes, the caller's options (typed), and what the PassManager sets up around it."""

    cost: CostModel
    profile: DeviceProfile | None = None  # the cost model's (passes ask the cost model, not the profile)
    training: bool = False
    verify: bool = True
    dump_dir: Path | None = None
    hints: dict = field(default_factory=dict)
    observer: ir.ProvenanceObserver | None = None
    options: OptimizeOptions = PASS_DEFAULTS  # optimize()'s options (precision, memory_budget, devices...)
    device: torch.device | None = None  # where the model runs (None: planning only)
    strict: bool = False  # a pass that raises or breaks an invariant raises (tests, bisect, fuzz) instead of reverting
    rewrite_limit: int | None = None  # apply at most this many rewrites per pass (bisect)
    # every rewrite a pass finds legal applies, whatever its predicted gain (the fuzzer: legality
    # tested apart from the cost model's choices)
    ignore_cost: bool = False
    # the graph as it was before the pass now running (set by the PassManager; ``.graph()`` builds
    # it): an instrument may run it beside the rewritten one (graphopt.runtime.measured compares their times)
    before_pass: ir.GraphSnapshot | None = None
    # accuracy_check(gm, low_dtype=None) -> AccuracyResult; set by the PassManager. low_dtype
    # judges against the model hand-converted to that dtype (the rule's bf16/fp16 tolerance).
    accuracy_check: Callable | None = None
    low_precision: torch.dtype | None = None  # set once assign_precision has lowered the graph
    # the passes this run will apply (set by the PassManager): a pass may leave a pattern to a
    # later one that handles it better (fuse_elementwise leaves conv epilogues to fuse_conv_relu)
    scheduled: frozenset = frozenset()
    # bytes of constants (weight copies) the passes have added, against optimize's weight_copies limit
    constants: ConstantAccount = field(default_factory=ConstantAccount)
    # a training step's activation bytes of the graph as captured (set by optimize() when a
    # memory_budget fraction is given): the fraction is of the model's activations, not of what
    # the fusion passes before insert_checkpoints left of them
    captured_activation_bytes: float | None = None
    # times a candidate carrying its replacement on the device before it applies
    # (graphopt.runtime.candidates.CandidateTimer; set by optimize() where it measures)
    candidate_timer: object = None

    def __post_init__(self):
        if self.profile is None:
            self.profile = self.cost.profile

    @property
    def fused_kernels(self) -> bool:
        """Whether rewrites onto torch.ops.graphopt.* kernels can pay on the planned device.
        (True for CUDA profiles, also when planning for a GPU on a machine without one: the
        rewritten graph then runs the ops' reference implementations.)"""
        return self.cost.device_kind == "cuda"

    def untrainable(self, op) -> str:
        """Why a rewrite onto ``op`` (a ``torch.ops.graphopt`` overload) cannot go into this graph
        ("" when it can): in a training graph every op a rewrite makes needs a backward, and an op
        has one when its module in cuda_ext/ops declares ``autograd=``. A pass whose rewrites
        make such ops runs in training and refuses, candidate by candidate, the ones that do not."""
        if not self.training:
            return ""
        from graphopt.cuda_ext.registry import all_ops

        name = op.name().split("::", 1)[-1].split(".", 1)[0]
        d = all_ops().get(name)
        if d is not None and d.autograd is not None:
            return ""
        return f"graphopt::{name} has no backward; a training graph keeps the ATen ops autograd differentiates"

    def node_time(self, nodes: Iterable[fx.Node]) -> float:
        """Predicted seconds of these nodes of the graph (the cost model's, at the example sizes)."""
        return self.cost.time_of(nodes, self.hints)

    def replacement(self):
        """A builder for the nodes a rewrite would make, priced by the cost model
        (graphopt.cost.replacement): a candidate's gain is ``node_time(matched) - r.time()``."""
        return self.cost.replacement(self.hints)

    def price(self, target, *args, val=None, **kwargs) -> float:
        """Predicted seconds of one ``target(*args, **kwargs)`` node a rewrite would make."""
        return self.cost.price(target, *args, hints=self.hints, val=val, **kwargs)


class Pass:
    """Base class: subclasses set ``name``, ``family``, ``description`` and implement run()."""

    name: str = ""
    family: str = ""
    description: str = ""
    # not applied to training graphs (a pass whose ops are differentiable leaves it False and asks
    # ctx.untrainable(op) per candidate)
    inference_only: bool = False
    changes_dtypes: bool = False  # the invariant check then allows dtype changes
    # every rewrite deletes nodes or reads an earlier node's identical value instead: the graph runs
    # a subset of the ops it ran, so the measured guard times it alone, never against the graph before
    removes_work_only: bool = False
    requires: tuple = ()  # pass names that must run earlier when both are enabled

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover
        raise NotImplementedError

    def result(self) -> PassResult:
        return PassResult(self.name, self.family)


_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    if not cls.name or cls.family not in FAMILIES:
        raise PassConfigError(f"pass {cls.__name__} needs a name and a family in {FAMILIES}")
    old = _REGISTRY.get(cls.name)
    if old is not None and old.__module__ != cls.__module__:
        # the passes folder imported a second time under another name (`import passes.x` with the
        # repository on sys.path): its classes would replace graphopt.passes' own
        raise PassConfigError(f"pass {cls.name!r} is already registered by {old.__module__}; {cls.__module__} "
                              "registers it again (import passes as graphopt.passes)")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Pass]]:
    """The registered passes (graphopt.passes registers them; graphopt's __init__ imports it)."""
    return dict(_REGISTRY)


# The pipeline, declared once. Order inside a family is the order listed. A name whose module
# is not in passes/ yet is simply not run (assemble() lists only registered passes).
PIPELINE: tuple[str, ...] = (
    # cleanup
    "eliminate_dead_code",
    "eliminate_common_subexpressions",
    "fold_constants",
    "eliminate_cat_slices",
    # fusion
    "left_matmul_linears",  # (before fuse_bias_act and fuse_elementwise: its bias adds fuse with their readers)
    "merge_split_convs",  # (before fold_conv_bn: a BatchNorm after the concatenation folds into the merged one)
    "fold_conv_bn",
    "merge_summed_convs",  # (after fold_conv_bn: each branch's BatchNorm is inside its convolution)
    "fuse_attention",
    "fuse_gemv_swiglu",
    "merge_sibling_linears",
    "fuse_rms_norm",
    "fuse_layer_norm",
    "fuse_rotary",
    "fuse_cache_write",
    "merge_increments",
    "hoist_slices",  # (before fuse_swiglu: a gate and up computed from pieces fuse with their prologue)
    "fuse_swiglu",
    "fuse_bias_act",
    "decompose_im2col",
    "lower_col2im",
    "unroll_small_reductions",
    "fuse_elementwise",
    # layout
    "convert_channels_last",
    "eliminate_permutes",
    # precision
    "assign_precision",
    # checkpoint
    "insert_checkpoints",
    # partition
    "partition_devices",
    # lower
    "conv_space_to_depth",
    "lower_depthwise_conv",  # (fuse_conv_relu refuses grouped convolutions: no depthwise one is left to it)
    "fuse_conv_relu",
    "lower_group_norm",  # (before lower_pool: its output keeps a channels_last input's layout, aten's may not)
    "lower_pool",
    "lower_upsample",
    "fuse_channels_last_broadcasts",
    "lower_attention",
    "lower_decode_attention",
    "lower_strided_bmm",
    "lower_split_k",
    "lower_bias_grad",
    "lower_gemm_swiglu",
    "lower_gemv",
    "align_gemm",
)


def available() -> list[str]:
    """The registered passes, in pipeline order."""
    reg = registry()
    return [n for n in PIPELINE if n in reg]


def assemble(passes: Iterable[str] | None = None, disable: Iterable[str] = ()) -> list[Pass]:
    """Resolve names into pass objects in pipeline order; unknown names and broken order raise."""
    reg = registry()
    missing = [n for n in reg if n not in PIPELINE and not n.endswith("_planted")]
    if missing:
        raise PassConfigError(f"pass {missing[0]} is registered but not declared in pipeline.PIPELINE")
    known = [n for n in PIPELINE if n in reg]
    unknown = [n for n in list(passes or []) + list(disable) if n not in reg]
    if unknown:
        raise PassConfigError(f"unknown pass {', '.join(unknown)}; known passes: {', '.join(known)}")
    chosen = list(passes) if passes is not None else known  # passes=[]: none (capture and lower only)
    # keep the declared order whatever order the user listed them in
    chosen = sorted(dict.fromkeys(chosen), key=lambda n: PIPELINE.index(n))
    objs = [reg[n]() for n in chosen]
    order = [FAMILIES.index(p.family) for p in objs]
    if order != sorted(order):
        raise PassConfigError(f"pipeline order breaks families {FAMILIES}: {[p.name for p in objs]}")
    for i, p in enumerate(objs):
        for req in p.requires:
            if req in chosen and chosen.index(req) > i:
                raise PassConfigError(f"pass {p.name} requires {req} to run first")
    disabled = set(disable)
    for p in objs:
        p.disabled = p.name in disabled  # type: ignore[attr-defined]
    return objs


# ---------------------------------------------------------------------------- instruments

NOT_RUN = ("disabled", "skipped")


class PassInstrument:
    """Work done around every pass of a pipeline run, as TVM's PassInstrument: the PassManager
    calls ``enter``/``exit`` around the run and, for every pass, ``run_before_pass`` (in list
    order), ``should_run`` and ``run_after_pass`` (in reverse order: instruments nest like context
    managers, so the first one listed sees the others' verdicts). ``run_after_pass`` may return
    why the pass must be undone: the manager then restores the graph from before the pass and the
    instruments after it see it ``reverted``. Passes left out (status disabled/skipped) get the
    before/after calls too. ``needs_code``: the instrument runs or reads the graph's Python code
    after the pass just applied (asked after each pass; while no instrument does, the code is
    generated once, at the end or when one does again)."""

    needs_code = False

    def enter(self, gm: fx.GraphModule, ctx: "PassContext") -> None:
        pass

    def exit(self, gm: fx.GraphModule, ctx: "PassContext") -> None:
        pass

    def run_before_pass(self, gm: fx.GraphModule, p: Pass, ctx: "PassContext") -> None:
        pass

    def should_run(self, p: Pass, ctx: "PassContext") -> tuple[str, str] | None:
        """None to run ``p``, or (status, note) to leave it out."""
        return None

    def run_after_pass(self, gm: fx.GraphModule, p: Pass, ctx: "PassContext", res: PassResult) -> str | None:
        return None


class PassSelection(PassInstrument):
    """Leaves out the passes disabled by name, and inference-only passes on a training graph."""

    def should_run(self, p, ctx):
        if getattr(p, "disabled", False):
            return "disabled", ""
        if ctx.training and p.inference_only:
            return "skipped", "inference-only pass; the graph is for training"
        return None


class DumpIR(PassInstrument):
    """The graph's code as captured (``000_captured.py``) and after each pass that ran
    (``NNN_<pass>.py``, numbered in pipeline order) in ``directory``."""

    needs_code = True

    def __init__(self, directory: Path):
        self.directory, self.index = Path(directory), 0

    def enter(self, gm, ctx):
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "000_captured.py").write_text(gm.code)

    def run_before_pass(self, gm, p, ctx):
        self.index += 1

    def run_after_pass(self, gm, p, ctx, res):
        if res.status not in NOT_RUN:
            (self.directory / f"{self.index:03d}_{p.name}.py").write_text(gm.code)


class PredictedCost(PassInstrument):
    """The cost model's predicted time and peak memory before and after each pass; ``current`` is
    the cost of the graph as it is (priced again only after a pass that applied)."""

    def __init__(self, before=None):
        self.current = before

    def enter(self, gm, ctx):
        if self.current is None:
            self.current = ctx.cost.graph_cost(gm, ctx.hints)

    def run_before_pass(self, gm, p, ctx):
        self.before = self.current

    def run_after_pass(self, gm, p, ctx, res):
        if res.status == "applied":
            self.current = ctx.cost.graph_cost(gm, ctx.hints)
        res.predicted_s_before, res.peak_bytes_before = self.before.total_s, self.before.peak_memory_bytes
        res.predicted_s_after, res.peak_bytes_after = self.current.total_s, self.current.peak_memory_bytes


class Timing(PassInstrument):
    """Each pass's wall time (``PassResult.seconds``): its graph snapshot, the pass and its checks."""

    def run_before_pass(self, gm, p, ctx):
        self.t0 = time.perf_counter()

    def run_after_pass(self, gm, p, ctx, res):
        if res.status not in NOT_RUN:
            res.seconds = time.perf_counter() - self.t0


class InvariantCheck(PassInstrument):
    """graphopt.ir.check_invariants after every pass that changed the graph (``ctx.verify``): a
    pass that breaks one is undone (raises with ``ctx.strict``)."""

    devices = None  # the graph's device types, read again only after a pass that changed it

    def run_before_pass(self, gm, p, ctx):
        if ctx.verify and self.devices is None:
            self.devices = ir.graph_devices(gm)
        self.devices_before = self.devices if ctx.verify else None

    def run_after_pass(self, gm, p, ctx, res):
        if res.status != "applied" or not ctx.verify:
            return None
        self.devices = None
        try:
            ir.check_invariants(gm, p.name, allow_dtype_change=p.changes_dtypes, devices_before=self.devices_before)
        except ir.InvariantError as e:
            if ctx.strict:
                raise
            return e  # the manager keeps its one line in the report, its detail in the IR dump
        return None


class AccuracyCheck(PassInstrument):
    """The accuracy rule after every pass that changed the graph: a pass that fails it is undone.
    ``last``: (result, low dtype) of the last check that passed, which is the graph as it is now
    (every later change was checked or undone)."""

    needs_code = True

    def __init__(self, check: Callable):
        self.check, self.last = check, None

    def run_after_pass(self, gm, p, ctx, res):
        if res.status != "applied":
            return None
        with timing.phase("accuracy checks"):
            acc = self.check(gm, ctx.low_precision)
        res.accuracy = acc.as_dict()
        if not acc.passed:
            return f"fails the accuracy rule ({acc.reason})"
        self.last = (acc, ctx.low_precision)
        return None


# ---------------------------------------------------------------------------- the pass loop


class PassManager:
    def __init__(self, passes: list[Pass], accuracy_check: Callable[[fx.GraphModule], object] | None = None,
                 check_each: bool = True, instruments: Iterable[PassInstrument] = ()):
        """``accuracy_check``: the guard, handed to passes (``ctx.accuracy_check``) and, with
        ``check_each``, run after every pass that changes the graph (AccuracyCheck: a pass that
        fails it is reverted); without ``check_each`` the caller checks the result once.
        ``instruments``: more PassInstruments, outermost (they see the built-in ones' verdicts)."""
        self.passes = passes
        self.accuracy_check = accuracy_check
        self.check_each = check_each
        self.instruments = list(instruments)

    def run(self, gm: fx.GraphModule, ctx: PassContext, before=None) -> list[PassResult]:
        """Run the passes; ``before``: the cost of ``gm`` as it is, if the caller has it.
        ``final_cost`` is then the cost of the graph handed back."""
        self._cost = PredictedCost(before)
        self._accuracy = AccuracyCheck(self.accuracy_check) if self.accuracy_check is not None and self.check_each \
            else None
        inst = [*self.instruments, PassSelection(), *([DumpIR(ctx.dump_dir)] if ctx.dump_dir is not None else []),
                self._cost, Timing(), *([self._accuracy] if self._accuracy else []), InvariantCheck()]
        ctx.accuracy_check = self.accuracy_check
        ctx.scheduled = frozenset(p.name for p in self.passes if not getattr(p, "disabled", False))
        # with nothing to run the graph between passes, its Python code is generated once, at the end
        self._instruments, self._stale = inst, False
        for i in inst:
            i.enter(gm, ctx)
        self._snapshot, self._snapshot_fresh = None, False
        results = []
        for self._index, p in enumerate(self.passes, start=1):
            results.append(self._run_pass(gm, p, ctx, inst))
        ir.remove_unused_attributes(gm)
        if self._stale:
            with timing.phase("recompile"):
                gm.recompile()
        for i in reversed(inst):
            i.exit(gm, ctx)
        return results

    @property
    def final_cost(self):
        """The predicted cost of the graph the last run handed back."""
        return self._cost.current

    @property
    def last_check(self):
        """(result, low dtype) of the last per-pass accuracy check that passed (None without one)."""
        return self._accuracy.last if self._accuracy is not None else None

    def _run_pass(self, gm, p: Pass, ctx: PassContext, inst: list) -> PassResult:
        for i in inst:
            i.run_before_pass(gm, p, ctx)
        skip = next((s for s in (i.should_run(p, ctx) for i in inst) if s is not None), None)
        if skip is None:
            timing.progress("pass %d/%d: %s", self._index, len(self.passes), p.name)
            res = self._execute(gm, p, ctx)
        else:
            res = p.result()
            res.status = skip[0]
            if skip[1]:
                res.notes.append(skip[1])
        res.family = p.family
        for i in reversed(inst):
            why = i.run_after_pass(gm, p, ctx, res)
            if why and res.status != "reverted":
                self._revert(gm, ctx, res, why)
                self._cost.current = self._cost.before  # an outer instrument's revert: the cost of before
                res.predicted_s_after, res.peak_bytes_after = res.predicted_s_before, res.peak_bytes_before
        if res.status == "applied":  # constants the pass replaced are freed now, not at the end
            ir.remove_unused_attributes(gm)
        ctx.constants.recount(gm)
        _one_line_record(res, ctx, self._index)
        # a pass that left the graph as it was leaves the snapshot valid for the next one (a copy
        # costs time in proportion to the graph)
        self._snapshot_fresh = self._snapshot is not None and not res.changed and res.status == "unchanged"
        ctx.before_pass = None
        if res.status == "reverted" and res.details.get("bisect") and ctx.rewrite_limit is None:
            return self._bisect(gm, p, ctx, inst, res)
        return res

    def _bisect(self, gm, p: Pass, ctx: PassContext, inst: list, whole: PassResult) -> PassResult:
        """A pass an instrument undid as a whole but whose rewrites may be kept in part (its verdict
        set ``details["bisect"]``: a measured loss): run it again with only its first k rewrites, the
        highest predicted gains, k halving from half of them down to one, and keep the first run
        the instruments accept."""
        n = len(whole.rewrites)
        k = n // 2
        while k >= 1:
            ctx.rewrite_limit = k
            try:
                res = self._run_pass(gm, p, ctx, inst)
            finally:
                ctx.rewrite_limit = None
            if res.status == "applied":
                res.notes.append(f"kept its first {len(res.rewrites)} of {n} rewrites: {whole.notes[-1]}")
                return res
            if not res.details.get("bisect"):
                break
            k //= 2
        return whole

    def _execute(self, gm, p: Pass, ctx: PassContext) -> PassResult:
        """Run one pass: a snapshot to revert to, provenance stamped on the nodes it makes; a pass
        that raises (a bug) is reverted, so it does not cost the user the other passes."""
        if not self._snapshot_fresh:
            with timing.phase("graph snapshots"):
                self._snapshot = (ir.GraphSnapshot(gm.graph), ctx.low_precision)
        ctx.before_pass = self._snapshot[0]
        ctx.observer = ir.ProvenanceObserver(gm, p.name)
        try:
            with ctx.observer.active(), timing.phase("passes"):
                res = p.run(gm, ctx)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - a pass bug: undo it, say so, keep the other passes
            if ctx.strict or (isinstance(e, GraphoptError) and not isinstance(e, ir.InvariantError)):
                raise  # a GraphoptError is meant for the user (a broken invariant is a pass bug)
            res = p.result()
            self._revert(gm, ctx, res, f"the pass raised {type(e).__name__}: {one_line(e)}",
                         "".join(traceback.format_exception(e)))
        finally:
            ctx.observer = None
        if res.changed and res.status != "reverted":
            res.status = "applied"
            self._stale = True
            if any(i.needs_code for i in self._instruments):
                with timing.phase("recompile"):
                    gm.recompile()
                self._stale = False
        return res

    def _revert(self, gm, ctx: PassContext, res: PassResult, why, full: str | None = None) -> None:
        """Restore the graph from before the pass. ``why``: a reason or the InvariantError an
        instrument returned; the report keeps one line, the full text goes to the IR dump."""
        if isinstance(why, ir.InvariantError):
            why, full = str(why), why.detail or str(why)
        note = _revert_note(ctx, self._index, res.name, gm, str(why), full or str(why))
        snapshot, low_precision = self._snapshot
        _restore(gm, snapshot.graph())
        ctx.low_precision = low_precision
        ctx.constants.recount(gm)
        self._snapshot_fresh = False  # the snapshot is the graph now
        res.status = "reverted"
        res.notes.append(note)


def _read_live(created: list, observer) -> None:
    """A rewrite is planned against the graph before the pass's earlier rewrites: where one of its
    new nodes reads a node such a rewrite replaced (redirected all its uses, then erased), it reads
    the replacement, which computes the same value (a LayerNorm reading a LayerNorm both rewrite).
    Whether the replacement comes before the reader is checked next (ir.misplaced)."""
    if observer is None:
        return
    for n in created:
        if getattr(n, "_erased", False):
            continue
        for a in list(n.all_input_nodes):
            if getattr(a, "_erased", False):
                new = observer.live(a)
                if new is not None:
                    n.replace_input_with(a, new)


def _debug() -> bool:
    return os.environ.get("GRAPHOPT_DEBUG", "") not in ("", "0")


def _revert_note(ctx: PassContext, i: int, name: str, gm: fx.GraphModule, why: str, full: str) -> str:
    """The one-line note of a revert. The full text (a traceback, lint's message with the graph)
    and the graph as the pass left it go to ``NNN_<pass>.reverted.txt`` in the IR dump
    (``--dump-ir``), or to the ``graphopt`` logger with GRAPHOPT_DEBUG=1."""
    note = f"reverted: {one_line(why)}"
    text = f"{name} reverted: {why}\n\n{full}\n\ngraph as {name} left it:\n{gm.graph}"
    if ctx.dump_dir is not None:
        path = ctx.dump_dir / f"{i:03d}_{name}.reverted.txt"
        path.write_text(text)
        note += f" (full text: {path.name})"
    elif _debug():
        log.warning("%s", text)
    return note


def _one_line_record(res: PassResult, ctx: PassContext, i: int) -> None:
    """Keep every note and rejection reason of a pass to one line (explain prints one line per
    reason); a longer text goes whole to ``NNN_<pass>.notes.txt`` in the IR dump."""
    long = []
    for k, note in enumerate(res.notes):
        if one_line(note) != note:
            long.append(note)
            res.notes[k] = one_line(note)
    for r in res.rejected:
        if one_line(r.reason) != r.reason:
            long.append(f"{r.candidate}: {r.reason}")
            r.reason = one_line(r.reason)
    if long and ctx.dump_dir is not None:
        (ctx.dump_dir / f"{i:03d}_{res.name}.notes.txt").write_text("\n\n".join(long) + "\n")
    elif long and _debug():
        log.warning("%s: %s", res.name, "\n\n".join(long))


def _restore(gm: fx.GraphModule, saved: fx.Graph) -> None:
    """Undo a pass: its graph back, the constants it added dropped, metadata re-propagated."""
    with timing.phase("recompile"):
        gm.graph = saved  # (the setter recompiles; dropping unused attributes changes no code)
        ir.remove_unused_attributes(gm)
    ir.repropagate(gm)


def run_passes(gm: fx.GraphModule, names: Iterable[str], *, target="h200", training: bool = False,
               accuracy_check=None) -> list[PassResult]:
    """Run the named passes (in pipeline order) on a captured graph with a given cost profile;
    the building block of the pass tests and of scripted use."""
    from .cost.profiles import get_profile

    profile, _ = get_profile(target)
    ctx = PassContext(cost=CostModel(profile), training=training, hints=ir.shape_hints(gm))
    return PassManager(assemble(list(names)), accuracy_check).run(gm, ctx)
