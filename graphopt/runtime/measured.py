"""Timing on the device a module runs on, for optimize()'s measured guard.

:class:`Timer` times calls the way a caller sees them: on a GPU with CUDA events around each call
(the device idle before it, so host launch time counts as it does for one call), on the CPU with
``perf_counter``; the median over ``reps`` calls after ``warmup`` calls. :meth:`Timer.compare`
times two or more callables in interleaved rounds (a, b, a, b, ...), so a drift of the machine
(clock, another process) lands on all of them alike, and gives each one's median.

:func:`slower` is the guard's rule: a candidate is slower than a baseline when its median exceeds
the baseline's by more than ``margin`` (2%: the run-to-run spread of one call on an idle GPU).
:func:`settled` lets a comparison stop before its full count of rounds once the rounds so far make
the verdict clear (three rounds for a difference of 10% or more every round, six otherwise): the
verdict is still :func:`slower`'s, on the rounds taken.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from .. import timing

MARGIN = 0.02


@dataclass
class Timing:
    median_s: float
    samples: list = field(default_factory=list)

    @property
    def spread(self) -> float:
        """(max - min) / median over the samples: how noisy this measurement was."""
        if not self.samples or self.median_s <= 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.median_s

    def as_dict(self) -> dict:
        return {"median_ms": self.median_s * 1e3, "reps": len(self.samples), "spread": self.spread}


def slower(candidate: Timing, baseline: Timing, margin: float | None = None) -> bool:
    """Slower by more than ``margin`` (default MARGIN) at the median and, where both have samples,
    at the fastest call too: interference from the rest of the machine only adds time, so a call
    that is slow only at the median (a CPU shared with other work) is not taken for a loss."""
    m = MARGIN if margin is None else margin
    if candidate.median_s <= baseline.median_s * (1.0 + m):
        return False
    if candidate.samples and baseline.samples:
        return min(candidate.samples) > min(baseline.samples) * (1.0 + m)
    return True


def settled(candidate: list, baseline: list, margin: float | None = None, rounds: int = 6,
            clear_rounds: int = 3) -> bool:
    """True once the interleaved rounds taken make the verdict clear: ``clear_rounds`` rounds with
    the candidate more than five margins from its round's baseline call, every one on the same side
    (a clear win or loss: the rounds a long call would take otherwise are spared); or ``rounds`` rounds or more
    with the candidate beyond the baseline's call of its round by more than ``margin`` in every round
    (a loss), or its median ratio to the baseline within half the margin with at most a third of the
    rounds beyond the margin (no loss; a pass that changes nothing measurable settles here instead of
    taking every round). Paired rounds, so a drift over the rounds lands on both calls of a round."""
    m = MARGIN if margin is None else margin
    n = min(len(candidate), len(baseline))
    if n < min(rounds, clear_rounds):
        return False
    ratios = [c / b if b > 0 else float("inf") for c, b in zip(candidate[:n], baseline[:n])]
    if n >= clear_rounds and (all(r > 1.0 + 5 * m for r in ratios) or all(r < 1.0 - 5 * m for r in ratios)):
        return True
    if n < rounds:
        return False
    beyond = sum(r > 1.0 + m for r in ratios)
    return beyond == n or (statistics.median(ratios) <= 1.0 + m / 2 and 3 * beyond <= n)


class Timer:
    """Times calls on ``device``. ``reps`` adapts to the call's length: at least ``min_reps``,
    and as many more as fit in ``target_s`` per measurement, at most ``max_reps``. With
    ``early=True`` a comparison of two callables stops once :func:`settled` says its verdict is
    clear (three rounds for a difference of 10% every round, ``settle_rounds`` otherwise), and one
    callable timed alone gets ``settle_rounds``."""

    def __init__(self, device: torch.device | str, *, warmup: int = 2, min_reps: int = 5, max_reps: int = 25,
                 target_s: float = 0.25, early: bool = False, settle_rounds: int = 6, margin: float | None = None):
        self.device = torch.device(device)
        self.warmup, self.min_reps, self.max_reps, self.target_s = warmup, min_reps, max_reps, target_s
        self.early, self.settle_rounds = early, settle_rounds
        self.margin = MARGIN if margin is None else margin
        self.spent_s = 0.0  # wall time spent timing (warm-up included)
        # CUDA events on a GPU the guard has to itself: a graph's median moves by less than the margin
        # from one pass to the next, so a new graph timed alone can be held against the last one timed
        # (a CPU shared with other work drifts: there every verdict comes from interleaved rounds)
        self.steady = self.device.type == "cuda"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _once(self, fn) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._sync()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def _reps(self, first_s: float) -> int:
        if first_s <= 0:
            return self.max_reps
        return int(min(self.max_reps, max(self.min_reps, self.target_s // first_s)))

    def time(self, fn, most: int | None = None, within: float | None = None) -> Timing:
        """``fn``'s median; ``most``: at most this many timed calls. ``within``: a time the caller
        only asks whether the median exceeds; the calls stop once more than half of those planned
        took at most that long (the median of every planned call could not exceed it then)."""
        return self.compare(fn, most=most, within=within)[0]

    def compare(self, *fns, most: int | None = None, within: float | None = None) -> list[Timing]:
        """Each callable's median over interleaved rounds (warm-up calls first, untimed: they are
        charged to "measured guard: first calls", where a new graph's CUDA-graph capture and its
        kernels' compilation fall). With ``early`` and two callables (baseline, candidate), the
        rounds stop once :func:`settled`. ``most``: at most this many rounds; ``within``: see :meth:`time`."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            with timing.phase("measured guard: first calls"):
                for fn in fns:
                    for _ in range(self.warmup):
                        fn()
                self._sync()
            with timing.phase("measured guard: timed calls"):
                first = [self._once(fn) for fn in fns]
                reps = self._reps(max(first))
                if most is not None:
                    reps = max(1, min(most, reps))
                if self.early and len(fns) == 1:  # one callable alone decides nothing: its median for the report
                    reps = min(reps, self.settle_rounds)
                samples = [[f] for f in first]
                for _ in range(reps - 1):
                    if self.early and len(fns) == 2 and settled(samples[1], samples[0], self.margin,
                                                                self.settle_rounds):
                        break
                    if within is not None and len(fns) == 1 and \
                            2 * sum(x <= within for x in samples[0]) > reps:
                        break
                    for i, fn in enumerate(fns):
                        samples[i].append(self._once(fn))
                self._sync()
        self.spent_s += time.perf_counter() - t0
        return [Timing(statistics.median(s), s) for s in samples]


# ----------------------------------------------------------------------------- the guard


def runnable(gm, flat_inputs: list, args: tuple, kwargs: dict, cuda_graphs, warmup: int = 1):
    """A no-argument callable that runs ``gm`` the way optimize()'s module would (CUDA-graph replay
    where graphopt.runtime.cuda_graphs' decision allows it, outputs not cloned), on these inputs.
    ``warmup``: eager calls before a capture (one does the lazy work a capture must not record:
    kernel loads, library handles and workspaces; the guard makes a graph per pass it times)."""
    from .cuda_graphs import lower

    runner = lower(gm, flat_inputs, cuda_graphs=cuda_graphs, reuse_outputs=True, warmup=warmup)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return lambda: runner.call_flat(leaves, spec, args, kwargs)


class MeasuredTime:
    """A PassInstrument (graphopt.pipeline) that times the graph after every pass that changed it,
    on the device it runs on, the way the returned module will run it (``make(gm)`` gives the
    callable). A pass measured slower than the graph before it by more than ``margin`` — both graphs
    timed in interleaved rounds — is undone; its result carries ``details["bisect"]``
    so the PassManager tries its first rewrites alone. Each applied pass's result carries its
    ``measured_ms`` beside the prediction; a pass that only removes work (``Pass.removes_work_only``:
    dead code, common subexpressions) is timed alone, never compared nor undone. A pass is timed only while ``budget_s`` has room for
    its comparison (both graphs' warm-up and fewest rounds at the last measured call's length);
    the passes after that are applied unmeasured, with a note. On a steady device (``Timer.steady``:
    a GPU) the graph after a pass is first timed alone against the last graph timed, and only a
    graph that looks slower is compared in interleaved rounds; elsewhere a comparison that finds a
    loss is taken again, and the second decides. With ``hold`` set, a pass measured
    slower is kept instead and named in ``held``: the caller judges it by the whole pipeline
    (graphopt.api runs the passes again without it and keeps the faster of the two results)."""

    def __init__(self, make, timer: Timer, budget_s: float, margin: float | None = None):
        self.make, self.timer, self.budget_s = make, timer, budget_s
        self.margin = MARGIN if margin is None else margin
        self.first: Timing | None = None  # the graph as the pipeline got it (the captured graph)
        self.current: Timing | None = None
        self.skipped: list[str] = []  # passes applied after the budget was spent
        # hold: a pass measured slower stays applied (its name in ``held``), because the passes after
        # it may build on it (a folded batch norm lets a convolution take its bias and ReLU in one
        # kernel); the caller then runs the passes again without it and keeps the faster result.
        # judge_again: passes a second run must measure, or undo where the budget has no room.
        self.hold = False
        self.held: list[str] = []
        self.judge_again: set[str] = set()
        # the graphs timed and found no slower than the one before them, by the chain of passes applied to
        # the captured graph so far (each with its rewrites): a second run of the passes (the held ones judged
        # alone) applies the same passes in the same way up to the first held pass, so it makes the same
        # graphs, and takes their times from here instead of timing them again
        self.timed: dict = {}
        self.chain: tuple = ()

    def enter(self, gm, ctx) -> None:
        self.chain = ()  # a run of the passes starts from the captured graph
        if self.first is None:
            timing.progress("measured guard: timing the captured graph")
            with timing.phase("measured guard: building the callables"):
                first = self.make(gm)
            # its length, for planning the comparisons within the budget, and the report's time of
            # the captured graph (the comparisons time it again against each pass)
            self.first = self.timer.time(first, most=3)
        if self.current is None:
            self.current = self.first

    def exit(self, gm, ctx) -> None:
        pass

    def affordable(self) -> bool:
        """Room in the budget for one more comparison of two graphs, at the last measured length."""
        if self.current is None:
            return False
        calls = 2 * (self.timer.warmup + self.timer.settle_rounds)
        return self.timer.spent_s + calls * self.current.median_s <= self.budget_s

    @property
    def needs_code(self) -> bool:  # the graph after a pass runs only when that pass is timed
        return self.affordable()

    def run_before_pass(self, gm, p, ctx) -> None:
        pass

    def should_run(self, p, ctx):
        return None

    def _record(self, res, after: Timing, before: Timing) -> None:
        """The pass's times in its result; the graph after it is the baseline of the next."""
        res.details["measured_ms"] = after.median_s * 1e3
        res.details["measured_before_ms"] = before.median_s * 1e3
        self.current = after

    def run_after_pass(self, gm, p, ctx, res) -> str | None:
        if res.status != "applied" or self.current is None:
            return None
        rewrites = tuple((r.pattern, tuple(r.matched), tuple(r.replacement)) for r in getattr(res, "rewrites", ()))
        self.chain = key = (self.chain, p.name, rewrites)
        if self.judge_again and p.name not in self.judge_again and key in self.timed:
            res.details["measured_in_first_run"] = True  # a second run: this graph was timed in the first, not slower
            self._record(res, self.timed[key], self.current)
            return None
        verdict = self._after_pass(gm, p, ctx, res)
        if verdict is None and "measured_ms" in res.details and not res.details.get("measured_loss_held"):
            self.timed[key] = self.current
        return verdict

    def _after_pass(self, gm, p, ctx, res) -> str | None:
        if getattr(p, "removes_work_only", False):
            # the graph runs a subset of the ops it ran (dead nodes gone, duplicates read once): not a
            # loss, so never compared nor undone; timed alone for the report and the next pass's baseline
            if not self.affordable():
                res.details["not_timed"] = "runs a subset of the graph's ops; no room left in the guard's time budget"
                return None
            timing.progress("measured guard: timing the graph after %s", p.name)
            with timing.phase("measured guard: building the callables"):
                after_fn = self.make(gm)
            self._record(res, self.timer.time(after_fn, most=self.timer.settle_rounds), self.current)
            return None
        if not self.affordable() or ctx.before_pass is None:
            if p.name in self.judge_again:
                return ("measured slower than the graph before it in the first run of the passes; the guard's "
                        "time budget had no room to measure it again")
            self.skipped.append(p.name)
            return None
        import torch.fx as fx

        timing.progress("measured guard: timing the graph after %s", p.name)
        after_fn = None
        if self.timer.steady and self.current.samples:
            # the graph after the pass alone, against the last graph timed: where it is not slower,
            # that is the verdict (half the calls); where it looks slower, interleaved rounds decide
            with timing.phase("measured guard: building the callables"):
                after_fn = self.make(gm)
            after = self.timer.time(after_fn, within=self.current.median_s * (1.0 + self.margin))
            if not slower(after, self.current, self.margin):
                self._record(res, after, self.current)
                return None
        # the graph before the pass (on gm's constants, still all there) and after it, in interleaved
        # rounds: a drift of the machine while they run lands on both alike
        with timing.phase("measured guard: building the callables"):
            fns = self.make(fx.GraphModule(gm, ctx.before_pass.graph())), after_fn or self.make(gm)
        before, after = self.timer.compare(*fns)
        if slower(after, before, self.margin) and not self.timer.steady:
            # a loss is the verdict of two measurements (on a steady device the graph timed alone was
            # the first): a CPU shared with other work can put one comparison's rounds on one side
            before, after = self.timer.compare(*fns)
        res.details["measured_ms"] = after.median_s * 1e3
        res.details["measured_before_ms"] = before.median_s * 1e3
        if slower(after, before, self.margin):
            if self.hold:
                self.held.append(p.name)
                res.details["measured_loss_held"] = True
                res.notes.append(f"measured {after.median_s * 1e3:.3f} ms against {before.median_s * 1e3:.3f} ms before "
                                 "it; kept while the passes after it run, then judged against the passes run without it")
                self.current = after
                return None
            res.details["bisect"] = True
            self.current = before
            return (f"measured {after.median_s * 1e3:.3f} ms against {before.median_s * 1e3:.3f} ms before it "
                    f"(predicted {(res.predicted_s_after - res.predicted_s_before) * 1e3:+.3f} ms)")
        self.current = after
        return None
