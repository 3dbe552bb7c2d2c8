"""optimize()'s per-phase wall time (graphopt.timing) and its place in the report."""

import io
import time

from rich.console import Console

import graphopt
from graphopt import timing
from graphopt.examples import zoo
from tests.helpers import reference_check


def test_phases_are_exclusive_and_sum_to_the_total():
    t = timing.PhaseTimer()
    with t.active():
        with timing.phase("outer"):
            time.sleep(0.02)
            with timing.phase("inner"):
                time.sleep(0.03)
        with timing.phase("outer"):  # repeated phases accumulate
            time.sleep(0.01)
    total = t.total()
    assert 0.025 <= t.seconds["outer"] < 0.06  # 0.03 s of "inner" not counted in it
    assert 0.025 <= t.seconds["inner"] < 0.06
    d = t.as_dict(total)
    assert abs(sum(d.values()) - total) < 1e-9 and d["other"] >= 0


def test_phase_without_an_active_timer_records_nothing():
    t = timing.PhaseTimer()
    with timing.phase("capture: torch.export"):
        pass
    assert t.seconds == {}

    @timing.timed("cost model")
    def f(x):
        return x + 1

    assert f(1) == 2 and t.seconds == {}


def test_optimize_reports_its_phases():
    model, inputs = zoo.get("mlp")
    opt = graphopt.optimize(model, inputs)
    rep = opt.report
    ph = rep.optimize_phases
    for name in ("capture: torch.export", "capture: unlift (ep.module)", "fake propagation", "cost model",
                 "passes", "accuracy checks", "accuracy: eager + fp64 reference runs", "lowering"):
        assert name in ph, name
    assert all(v >= 0 for v in ph.values())
    assert abs(sum(ph.values()) - rep.optimize_seconds) < 1e-6
    assert rep.as_dict()["optimize_phases"] == ph
    buf = io.StringIO()
    rep.render(Console(file=buf, width=200))
    line = [s for s in buf.getvalue().splitlines() if s.startswith("optimized in")][0]
    biggest = max(ph, key=ph.get)
    assert line.startswith(f"optimized in {rep.optimize_seconds:.2f} s: {biggest} ")
    res = reference_check(model, opt, inputs)
    assert res.passed, res.reason


def test_format_phases_largest_first_small_ones_left_out_and_the_tail_summed():
    ph = {"capture: torch.export": 0.5, "fake propagation": 0.2, "cost model": 0.1, "passes": 0.05,
          "recompile": 0.001}
    assert timing.format_phases(ph) == ("capture: torch.export 0.50 s, fake propagation 0.20 s, cost model 0.10 s, "
                                        "passes 0.05 s")
    assert timing.format_phases(ph, limit=2) == ("capture: torch.export 0.50 s, fake propagation 0.20 s, "
                                                 "2 more 0.15 s")
