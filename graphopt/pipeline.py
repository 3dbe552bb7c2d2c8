"""Pass protocol, the one declared pipeline, and the PassManager that runs it.

A pass is a small object with a verb-first ``name`` (its CLI name, report key and test file
name), a ``family`` (where it sits in the pipeline) and ``run(gm, ctx) -> PassResult``. Passes
propose :class:`Candidate` rewrites; :meth:`PassResult.apply_ranked` asks the cost model's
predicted gain, ranks overlapping candidates, applies the winners and records the rest as
rejected with a reason. The manager checks graph invariants after every pass, guards accuracy,
reverts a pass that breaks it, and records predicted cost before and after.
"""

from __future__ import annotations

import copy
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
    untouched and ``refusal`` says why. New nodes are found by the provenance observer."""

    pattern: str
    nodes: list
    gain_s: float
    apply: Callable[[], object]
    label: str = ""
    refusal: str = ""

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
            limit = ctx.options.get("rewrite_limit")
            if limit is not None and len(self.rewrites) >= limit:
                self.reject(c.description, f"beyond the first {limit} rewrites (bisecting)")
                continue
            created_before = len(ctx.observer.created) if ctx.observer else 0
            touched_before = len(ctx.observer.touched) if ctx.observer else 0
            with (ctx.observer.sourced(c.nodes) if ctx.observer else _null()):
                out = c.apply()
            if out is None:
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


@dataclass
class PassContext:
    profile: DeviceProfile
    cost: CostModel
    training: bool = False
    disabled: frozenset = frozenset()
    verify: bool = True
    dump_dir: Path | None = None
    hints: dict = field(default_factory=dict)
    observer: ir.ProvenanceObserver | None = None
    options: dict = field(default_factory=dict)
    # accuracy_check(gm, low_dtype=None) -> AccuracyResult; set by the PassManager. low_dtype
    # judges against the model hand-converted to that dtype (the rule's bf16/fp16 tolerance).
    accuracy_check: Callable | None = None
    low_precision: torch.dtype | None = None  # set once assign_precision has lowered the graph
    # the passes this run will apply (set by the PassManager): a pass may leave a pattern to a
    # later one that handles it better (fuse_elementwise leaves conv epilogues to fuse_conv_relu)
    scheduled: frozenset = frozenset()

    @property
    def ignore_cost(self) -> bool:
        """options["ignore_cost"] (the fuzzer): every rewrite a pass finds legal applies, whatever
        its predicted gain, so legality is tested apart from the cost model's choices."""
        return bool(self.options.get("ignore_cost"))

    @property
    def fused_kernels(self) -> bool:
        """Whether rewrites onto torch.ops.graphopt.* kernels can pay on the planned device.
        (True for CUDA profiles, also when planning for a GPU on a machine without one: the
        rewritten graph then runs the ops' reference implementations.)"""
        return self.profile.kind == "cuda"

    def node_time(self, nodes: Iterable[fx.Node]) -> float:
        return sum(ir.concrete(self.cost.node_cost(n).time_s, self.hints) for n in nodes)


class Pass:
    """Base class: subclasses set ``name``, ``family``, ``description`` and implement run()."""

    name: str = ""
    family: str = ""
    description: str = ""
    inference_only: bool = False  # not applied to training graphs
    changes_dtypes: bool = False  # the invariant check then allows dtype changes
    requires: tuple = ()  # pass names that must run earlier when both are enabled

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover
        raise NotImplementedError

    def result(self) -> PassResult:
        return PassResult(self.name, self.family)


_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    if not cls.name or cls.family not in FAMILIES:
        raise PassConfigError(f"pass {cls.__name__} needs a name and a family in {FAMILIES}")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Pass]]:
    from . import passes  # noqa: F401  (importing registers every pass)

    return dict(_REGISTRY)


# The pipeline, declared once. Order inside a family is the order listed. A name whose module
# is not in passes/ yet is simply not run (assemble() lists only registered passes).
PIPELINE: tuple[str, ...] = (
    # cleanup
    "eliminate_dead_code",
    "fold_constants",
    # fusion
    "fold_conv_bn",
    "fuse_attention",
    "merge_sibling_linears",
    "fuse_rms_norm",
    "fuse_layer_norm",
    "fuse_rotary",
    "fuse_swiglu",
    "fuse_bias_act",
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
    "fuse_conv_relu",
    "lower_max_pool",
    "lower_attention",
    "lower_split_k",
    "lower_gemm_swiglu",
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


class PassManager:
    def __init__(self, passes: list[Pass], accuracy_check: Callable[[fx.GraphModule], object] | None = None,
                 check_each: bool = True):
        """``accuracy_check``: the guard, handed to passes (``ctx.accuracy_check``) and, with
        ``check_each``, run after every pass that changes the graph (a pass that fails it is
        reverted); without ``check_each`` the caller checks the result once."""
        self.passes = passes
        self.accuracy_check = accuracy_check
        self.check_each = check_each

    def run(self, gm: fx.GraphModule, ctx: PassContext, before=None) -> list[PassResult]:
        """Run the passes; ``before``: the cost of ``gm`` as it is, if the caller has it.
        ``final_cost`` is then the cost of the graph handed back."""
        results = []
        if ctx.dump_dir is not None:
            ctx.dump_dir.mkdir(parents=True, exist_ok=True)
            (ctx.dump_dir / "000_captured.py").write_text(gm.code)
        # with nothing to run the graph between passes (no accuracy check, no dump), its Python
        # code is generated once at the end rather than after every pass that changes it
        per_pass_check = self.accuracy_check if self.check_each else None
        defer_recompile = per_pass_check is None and ctx.dump_dir is None
        stale = False
        # (result, low dtype) of the last accuracy check that passed: the graph as it is now, since
        # every later change was either checked or undone (a revert restores the checked graph)
        self.last_check = None
        if before is None:
            before = ctx.cost.graph_cost(gm, ctx.hints)
        ctx.accuracy_check = self.accuracy_check
        ctx.scheduled = frozenset(p.name for p in self.passes if not getattr(p, "disabled", False))
        for i, p in enumerate(self.passes, start=1):
            res = p.result()
            res.predicted_s_before = before.total_s
            res.peak_bytes_before = before.peak_memory_bytes
            if getattr(p, "disabled", False):
                res.status, res.predicted_s_after, res.peak_bytes_after = "disabled", before.total_s, before.peak_memory_bytes
                results.append(res)
                continue
            if ctx.training and p.inference_only:
                res.status = "skipped"
                res.notes.append("inference-only pass; the graph is for training")
                res.predicted_s_after, res.peak_bytes_after = before.total_s, before.peak_memory_bytes
                results.append(res)
                continue
            t0 = time.perf_counter()
            devices_before = ir.graph_devices(gm) if ctx.verify else None
            with timing.phase("graph snapshots"):
                saved_graph = copy.deepcopy(gm.graph)
            ctx.observer = ir.ProvenanceObserver(gm, p.name)
            try:
                with ctx.observer.active(), timing.phase("passes"):
                    out = p.run(gm, ctx)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # a pass bug must not cost the user the other passes
                if ctx.options.get("strict") or (isinstance(e, GraphoptError) and not isinstance(e, ir.InvariantError)):
                    raise  # a GraphoptError is meant for the user (a broken invariant is a pass bug)
                full = "".join(traceback.format_exception(e))
                note = _revert_note(ctx, i, p.name, gm, f"the pass raised {type(e).__name__}: {one_line(e)}", full)
                _restore(gm, saved_graph)
                out = p.result()
                out.status = "reverted"
                out.notes.append(note)
            finally:
                ctx.observer = None
            out.predicted_s_before, out.peak_bytes_before = res.predicted_s_before, res.peak_bytes_before
            res = out
            res.family = p.family
            if res.changed and res.status != "reverted":
                if defer_recompile:
                    stale = True
                else:
                    with timing.phase("recompile"):
                        gm.recompile()
                broken = None
                if ctx.verify:
                    try:
                        ir.check_invariants(gm, p.name, allow_dtype_change=p.changes_dtypes,
                                            devices_before=devices_before)
                    except ir.InvariantError as e:
                        if ctx.options.get("strict"):
                            raise
                        broken = e
                if broken is not None:  # a pass bug: undo it, say so, keep the other passes
                    note = _revert_note(ctx, i, p.name, gm, str(broken), broken.detail or str(broken))
                    _restore(gm, saved_graph)
                    res.status = "reverted"
                    res.notes.append(note)
                    _one_line_record(res, ctx, i)
                    res.seconds = time.perf_counter() - t0
                    res.predicted_s_after, res.peak_bytes_after = before.total_s, before.peak_memory_bytes
                    results.append(res)
                    continue
                res.status = "applied"
                if per_pass_check is not None:
                    with timing.phase("accuracy checks"):
                        acc = per_pass_check(gm, ctx.low_precision)
                    res.accuracy = acc.as_dict()
                    if acc.passed:
                        self.last_check = (acc, ctx.low_precision)
                    else:
                        _restore(gm, saved_graph)
                        res.status = "reverted"
                        if p.changes_dtypes:
                            ctx.low_precision = None
                        res.notes.append(f"reverted: fails the accuracy rule ({acc.reason})")
            _one_line_record(res, ctx, i)
            res.seconds = time.perf_counter() - t0
            after = ctx.cost.graph_cost(gm, ctx.hints) if res.status == "applied" else before
            res.predicted_s_after, res.peak_bytes_after = after.total_s, after.peak_memory_bytes
            before = after
            if ctx.dump_dir is not None:
                (ctx.dump_dir / f"{i:03d}_{p.name}.py").write_text(gm.code)
            results.append(res)
        ir.remove_unused_attributes(gm)
        if stale:
            with timing.phase("recompile"):
                gm.recompile()
        self.final_cost = before
        return results


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
        gm.graph = saved
        ir.remove_unused_attributes(gm)
        gm.recompile()
    ir.repropagate(gm)


def run_passes(gm: fx.GraphModule, names: Iterable[str], *, target="h200", training: bool = False,
               accuracy_check=None) -> list[PassResult]:
    """Run the named passes (in pipeline order) on a captured graph with a given cost profile;
    the building block of the pass tests and of scripted use."""
    from .cost.profiles import get_profile

    profile, _ = get_profile(target)
    ctx = PassContext(profile=profile, cost=CostModel(profile), training=training, hints=ir.shape_hints(gm))
    return PassManager(assemble(list(names)), accuracy_check).run(gm, ctx)
