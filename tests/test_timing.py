"""optimize()'s per-phase wall time (graphopt.timing) and its place in the report."""

import io
import logging
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


def test_optimize_announces_each_step_on_the_progress_logger(caplog):
    model, inputs = zoo.get("mlp")
    with caplog.at_level(logging.INFO, logger="graphopt.progress"):
        opt = graphopt.optimize(model, inputs)
    said = [r.getMessage() for r in caplog.records if r.name == "graphopt.progress"]
    assert said[0] == "capturing the graph with torch.export"
    assert "accuracy guard: running the model and its float64 reference" in said
    # one line per pass that ran, in the pipeline's order, numbered among the passes scheduled
    steps = [s.split(" ", 2)[1:] for s in said if s.startswith("pass ")]
    ran = [r.name for r in opt.report.passes if r.status not in ("skipped", "disabled")]
    assert [name for _, name in steps] == ran and ran
    numbers = [tuple(int(x) for x in k.rstrip(":").split("/")) for k, _ in steps]
    assert all(a[0] < b[0] for a, b in zip(numbers, numbers[1:]))
    assert {total for _, total in numbers} == {len(opt.report.passes)}
    assert said.index("lowering") > said.index(f"pass {steps[-1][0]} {steps[-1][1]}")
    assert reference_check(model, opt, inputs).passed


def test_progress_is_silent_by_default(capfd):
    model, inputs = zoo.get("mlp")
    graphopt.optimize(model, inputs, measure=False)
    out, err = capfd.readouterr()
    assert "capturing the graph" not in out + err


def test_the_cli_status_line_shows_the_step_and_the_elapsed_seconds():
    from graphopt.tools.cli import _StatusLine

    class Status:
        def update(self, shown):
            self.text = str(shown.__rich__())

    st = Status()
    line = _StatusLine(st)
    assert st.text.startswith("graphopt: starting  [")
    rec = logging.LogRecord("graphopt.progress", logging.INFO, __file__, 1, "pass %d/%d: %s", (3, 31, "fuse_[x]"), None)
    line.emit(rec)
    assert st.text.startswith("graphopt: pass 3/31: fuse_[x]  [") and st.text.endswith(" s]")  # no markup read
    line.t0 -= 7  # the seconds are read each time the line is drawn
    assert str(line.__rich__()).endswith("[7 s]")


def test_the_cli_status_line_is_attached_only_while_a_command_optimizes(monkeypatch):
    from rich.console import Console

    from graphopt.tools.cli import _StatusLine, _progress_line

    log = timing.PROGRESS
    before = (log.level, log.propagate, list(log.handlers))
    with _progress_line():  # stderr is no terminal under pytest: nothing attached
        assert log.handlers == before[2]
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    with _progress_line():
        assert [type(h) for h in log.handlers if h not in before[2]] == [_StatusLine]
        assert log.isEnabledFor(logging.INFO) and not log.propagate
        timing.progress("pass %d/%d: %s", 1, 2, "x")
    assert (log.level, log.propagate, list(log.handlers)) == before
