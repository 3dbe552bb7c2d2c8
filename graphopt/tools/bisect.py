"""Find the first pass, and the first rewrite within it, that breaks the accuracy rule.

    graphopt explain MODEL --bisect
    graphopt.tools.bisect.bisect(model, example_inputs)

The pipeline runs one pass at a time with the optimizer's own guard switched off; after each
pass that changed the graph the accuracy rule is applied (fp64 reference, the same rule as the
guard). The first pass that fails is the culprit. Then the passes before it are replayed on a
fresh capture and the culprit runs with only its first k rewrites (``rewrite_limit``), k found by
binary search: the k-th rewrite is the first one that breaks the rule. A pass that raises counts
as failing at that pass.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .. import ir
from ..api import _AccuracyGuard, _model_device
from ..capture import capture, flat_tensors, split_inputs
from ..cost.model import CostModel
from ..cost.profiles import get_profile
from ..options import OptimizeOptions
from ..pipeline import Pass, PassContext, PassManager, Rewrite, assemble


@dataclass
class BisectResult:
    pass_name: str | None  # None: every pass keeps the rule
    rewrite_index: int | None = None  # 1-based, in the order the pass applied them
    rewrite: Rewrite | None = None
    error: str = ""
    checked: list = field(default_factory=list)  # (pass, "ok" | "fails" | "unchanged" | "raised")

    def summary(self) -> str:
        if self.pass_name is None:
            return f"no pass breaks the accuracy rule ({len(self.checked)} passes checked)"
        where = f"pass {self.pass_name}"
        if self.rewrite is not None:
            r = self.rewrite
            where += (f", rewrite #{self.rewrite_index} ({r.pattern}: {', '.join(r.matched[:6])}"
                      f" -> {', '.join(r.replacement[:4]) or '(removed)'})")
        elif self.rewrite_index is not None:
            where += f", rewrite #{self.rewrite_index}"
        return f"first failure: {where}: {self.error}"


def bisect(model: torch.nn.Module, example_inputs, *, target=None, passes=None, disable=(), precision="auto",
           training: bool = False, pipeline: list[Pass] | None = None) -> BisectResult:
    """``pipeline`` (Pass objects) overrides ``passes``/``disable`` (used to test planted faults)."""
    args, kwargs = split_inputs(example_inputs)
    device = _model_device(model, flat_tensors(args, kwargs))
    profile, _ = get_profile(target if target is not None else device)
    chosen = pipeline if pipeline is not None else assemble(passes, disable)
    was = model.training
    model.train(training)
    try:
        def fresh():
            gm = capture(model, (args, kwargs))
            ctx = PassContext(cost=CostModel(profile), training=training, hints=ir.shape_hints(gm),
                              options=OptimizeOptions(precision=precision, training=training), device=device,
                              strict=True)
            return gm, ctx

        gm, ctx = fresh()
        # the guard's runs get their own copies of the inputs the graph writes (a decode step's cache)
        guard = _AccuracyGuard(model, args, kwargs, training, device,
                               mutated=ir.mutated_flat_inputs(gm, flat_tensors(args, kwargs)))
        result = BisectResult(None)
        culprit = None
        for p in chosen:
            try:
                (res,) = PassManager([p]).run(gm, ctx)
            except Exception as e:  # a pass that raises fails right here
                result.checked.append((p.name, "raised"))
                return BisectResult(p.name, None, None, f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                                    result.checked)
            if res.status != "applied":
                result.checked.append((p.name, "unchanged"))
                continue
            acc = guard(gm, ctx.low_precision)
            if acc.passed:
                result.checked.append((p.name, "ok"))
                continue
            result.checked.append((p.name, "fails"))
            culprit, n_rewrites, error = p, len(res.rewrites), acc.reason
            break
        if culprit is None:
            return result
        before = chosen[:chosen.index(culprit)]

        def fails_with(k: int):
            g2, c2 = fresh()
            if before:
                PassManager(list(before)).run(g2, c2)
            c2.rewrite_limit = k
            (r2,) = PassManager([type(culprit)() if pipeline is None else copy.copy(culprit)]).run(g2, c2)
            acc2 = guard(g2, c2.low_precision)
            return not acc2.passed, r2, acc2

        lo, hi = 1, max(n_rewrites, 1)
        last = None
        while lo < hi:
            mid = (lo + hi) // 2
            bad, r2, acc2 = fails_with(mid)
            if bad:
                hi = mid
                last = (r2, acc2)
            else:
                lo = mid + 1
        if last is None or len(last[0].rewrites) != lo:
            bad, r2, acc2 = fails_with(lo)
            last = (r2, acc2) if bad else None
        if last is None:  # the failure needs rewrites together: name the pass only
            return BisectResult(culprit.name, None, None, error + " (no single prefix of its rewrites fails alone)",
                                result.checked)
        r2, acc2 = last
        rewrite = r2.rewrites[lo - 1] if len(r2.rewrites) >= lo else None
        return BisectResult(culprit.name, lo, rewrite, acc2.reason, result.checked)
    finally:
        model.train(was)
