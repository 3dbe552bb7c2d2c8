"""optimize()'s measured guard (graphopt.runtime.measured): every pass that changed the graph is
timed on the device against the graph before it and undone when it measures slower (its first
rewrites kept where they alone are faster); the module is timed against the model as given, which
its calls run where the module is slower. The planted passes here are predicted gains that are
really slow (a 256 x 256 x 2048 matmul per rewrite, multiplied by zero so the result is unchanged, against
a model of about a millisecond): the margins are large enough that timing noise on a loaded CPU
cannot hide them."""

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import api, ir
from graphopt.pipeline import Candidate, Pass, assemble
from graphopt.runtime.measured import Timer, Timing, settled, slower
from tests.helpers import reference_check

aten = torch.ops.aten


class MLP(nn.Module):
    def __init__(self, d=256, layers=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(lin(x))
        return x


class SlowRelu(Pass):
    """relu(x) -> relu(x + 0 * sum(x @ W)) with a 256 x 2048 constant W: the same values, one big
    matmul more per relu (of x, so nothing folds it away), claimed as a gain. ``fast``: the first rewrites (by predicted gain) only
    spell relu as clamp_min(x, 0), which costs the same, so bisecting over the rewrites keeps them."""

    name = "slow_relu_planted"
    family = "fusion"

    def __init__(self, fast: int = 0):
        self.fast = fast

    def run(self, gm, ctx):
        res = self.result()
        relus = [n for n in gm.graph.nodes if n.target is aten.relu.default]
        w = ir.register_constant(gm, "planted_w", torch.randn(256, 2048))
        cands = []
        for i, n in enumerate(relus):
            def apply(n=n, slow=i >= self.fast):
                g = gm.graph
                with g.inserting_before(n):
                    if not slow:
                        new = g.call_function(aten.clamp_min.default, (n.args[0], 0.0))
                        n.replace_all_uses_with(new)
                        g.erase_node(n)
                        return new
                    wn = g.get_attr(w)
                    zero = g.call_function(aten.mul.Tensor, (g.call_function(aten.sum.default, (
                        g.call_function(aten.mm.default, (n.args[0], wn)),)), 0.0))
                    x = g.call_function(aten.add.Tensor, (n.args[0], zero))
                n.args = (x,)
                return x
            cands.append(Candidate("planted: slow relu", [n], 1.0 - i * 1e-3, apply, label=f"relu #{i + 1}"))
        res.apply_ranked(ctx, cands)
        if res.changed:
            ir.repropagate(gm)
        return res


def _with(planted):
    def pipeline(passes=None, disable=None):
        real = assemble(passes, disable)
        return real[:1] + [planted] + real[1:]
    return pipeline


@pytest.fixture
def mlp(monkeypatch):
    monkeypatch.setenv("GRAPHOPT_MEASURE_BUDGET_S", "60")  # a slow CI machine must not run out of it
    torch.manual_seed(0)
    return MLP().eval(), torch.randn(256, 256)


@pytest.mark.parametrize("threads", [1, None])
def test_a_pass_measured_slower_is_undone_and_the_others_show_their_time(mlp, monkeypatch, threads):
    """On one thread and on all of them: the planted pass is undone with the measured times in its
    note, every applied pass carries its measured time beside its prediction, the module is not
    slower than the model as given, and its output passes the accuracy rule."""
    model, x = mlp
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        monkeypatch.setattr(api, "assemble", _with(SlowRelu()))
        opt = graphopt.optimize(model, (x,), measure=True)
    finally:
        torch.set_num_threads(before)
    by = {r.name: r for r in opt.report.passes}
    planted = by["slow_relu_planted"]
    assert planted.status == "reverted" and any("measured" in n and "ms before it" in n for n in planted.notes)
    # held in the first run, undone in the second, which the last comparison chose
    assert planted.details["held_verdict"].startswith("judged alone: the passes with slow_relu_planted kept")
    assert not any(n.target is aten.mm.default for n in opt.graph_module.graph.nodes)
    for r in opt.report.passes:
        if r.status == "applied":
            assert r.details["measured_ms"] > 0 and "measured_before_ms" in r.details
    speed = opt.report.speed
    assert speed["measured"] and speed["returned"] in ("optimized", "model") and speed["model_ms"] > 0
    assert opt.report.to_json()  # the measured times serialize with the report
    phases = opt.report.optimize_phases  # the guard's own time is a phase of optimize()'s
    assert phases["measured guard: timed calls"] > 0 and "measured guard: building the callables" in phases
    assert reference_check(model, opt.graph_module, (x,)).passed


class HeavyMLP(MLP):
    """Each layer ends in a no-op the model computes anyway: ``x + 0 * sum(x @ W)`` with a 256 x 2048
    W. Only PlantedPayoff removes it, and only after PlantedEnabler marked the layer's ReLU."""

    def __init__(self, d=256, layers=4):
        super().__init__(d, layers)
        self.register_buffer("w", torch.randn(d, 2048))

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(lin(x))
            x = x + 0.0 * (x @ self.w).sum()
        return x


class PlantedEnabler(SlowRelu):
    """SlowRelu that also marks each ReLU it rewrites: measured alone, a loss (a matmul per layer)."""

    name = "planted_enabler"

    def run(self, gm, ctx):
        res = super().run(gm, ctx)
        for n in gm.graph.nodes:
            if n.target is aten.relu.default and n.args[0].target is aten.add.Tensor:
                n.meta["planted_enabled"] = True
        return res


class PlantedPayoff(Pass):
    """At a marked ReLU: drop the enabler's matmul and the model's own no-op after the ReLU (both
    ``add(v, 0 * sum(v @ W))``), leaving the linear layers alone; the last layer's output is scaled
    by a constant of ones the pass adds (so the kept result reads a constant of its own)."""

    name = "planted_payoff"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        cands = []
        for i, n in enumerate(n for n in gm.graph.nodes if n.meta.get("planted_enabled")):
            def apply(n=n):
                n.args = (n.args[0].args[0],)
                for u in list(n.users):
                    if u.target is aten.add.Tensor and u.args[0] is n:
                        u.replace_all_uses_with(n)
                return n
            cands.append(Candidate("planted: payoff", [n], 1.0 - i * 1e-3, apply, label=f"relu #{i + 1}"))
        res.apply_ranked(ctx, cands)
        if res.changed:
            out = next(n for n in gm.graph.nodes if n.op == "output")
            last = out.args[0][0]
            ones = ir.register_constant(gm, "planted_ones", torch.ones(last.meta["val"].shape[-1]))
            with gm.graph.inserting_before(out):
                scaled = gm.graph.call_function(aten.mul.Tensor, (last, gm.graph.get_attr(ones)))
            out.args = ((scaled, *out.args[0][1:]),)
            gm.graph.eliminate_dead_code()
            ir.repropagate(gm)
        return res


def test_a_pass_measured_slower_alone_is_kept_where_the_passes_after_it_build_on_it(monkeypatch):
    """The enabler alone measures slower; the payoff, which needs it, then removes every matmul. The
    guard keeps the enabler after timing the pipeline with it against the pipeline with it judged
    alone (undone, so the payoff finds nothing): the kept result runs no matmul and passes the
    accuracy rule. A pass that is a loss whatever follows it is still undone (the first test)."""
    monkeypatch.setenv("GRAPHOPT_MEASURE_BUDGET_S", "60")
    torch.manual_seed(0)
    model, x = HeavyMLP().eval(), torch.randn(256, 256)

    def pipeline(passes=None, disable=None):
        real = assemble(passes, disable)
        return real[:1] + [PlantedEnabler()] + real[1:] + [PlantedPayoff()]

    monkeypatch.setattr(api, "assemble", pipeline)
    opt = graphopt.optimize(model, (x,), measure=True)
    enabler, payoff = opt.report.pass_result("planted_enabler"), opt.report.pass_result("planted_payoff")
    assert enabler.status == "applied" and enabler.details["measured_loss_held"], enabler.notes
    assert any(n.startswith("kept: the passes with planted_enabler kept measured") for n in enabler.notes), enabler.notes
    assert enabler.details["held_verdict"].startswith("kept: ")  # what the bench and the sweep record
    assert payoff.status == "applied" and len(payoff.rewrites) == 4
    assert not any(n.target is aten.mm.default for n in opt.graph_module.graph.nodes)
    # the enabler's W went with the matmuls; the payoff's constant, dropped by the second run, is back
    assert [k for k, _ in opt.graph_module.named_buffers() if k.startswith("_graphopt_")] == ["_graphopt_planted_ones"]
    assert opt.report.speed["passes_ms"] < opt.report.speed["captured_ms"]
    assert opt.report.accuracy["passed"]
    assert reference_check(model, opt.graph_module, (x,)).passed


def test_within_a_pass_the_first_rewrites_that_are_not_slower_are_kept(mlp, monkeypatch):
    """The pass's three highest-gain rewrites add nothing, the other three a matmul each: the whole
    pass measures slower, the first half alone does not, so those are kept."""
    from graphopt.runtime import measured

    model, x = mlp
    monkeypatch.setattr(measured, "MARGIN", 0.25)  # clamp_min for relu must not measure as a loss on a noisy CPU
    monkeypatch.setattr(api, "assemble", _with(SlowRelu(fast=3)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a CPU shared with other work swings less on one thread
    try:
        opt = graphopt.optimize(model, (x,), measure=True, check_accuracy=False)
    finally:
        torch.set_num_threads(threads)
    planted = opt.report.pass_result("slow_relu_planted")
    assert planted.status == "applied" and len(planted.rewrites) == 3
    assert any("kept its first 3 of 6 rewrites" in n for n in planted.notes), planted.notes
    assert not any(n.target is aten.mm.default for n in opt.graph_module.graph.nodes)


def test_a_module_slower_than_the_model_runs_the_model(mlp, monkeypatch):
    """Where even the result is slower than the model as given (here the guard's per-pass timing is
    out of budget, so the planted pass stays), the module's calls run the model itself."""
    model, x = mlp
    monkeypatch.setattr(api, "assemble", _with(SlowRelu()))
    monkeypatch.setenv("GRAPHOPT_MEASURE_BUDGET_S", "0")
    opt = graphopt.optimize(model, (x,), measure=True, check_accuracy=False)
    assert opt.report.pass_result("slow_relu_planted").status == "applied"
    assert opt.report.speed["returned"] == "model" and "slow_relu_planted" in opt.report.speed["not_timed_passes"]
    assert any("calls run the model as given" in n for n in opt.report.notes)
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))
    # the model itself, with nothing in front of it: no input guard either (a new batch runs)
    monkeypatch.setattr(type(opt), "_guard_flat", lambda *a: (_ for _ in ()).throw(AssertionError("guarded")))
    with torch.no_grad():
        assert torch.equal(opt(x[:3]), model(x[:3]))


def test_measure_off_and_where_it_cannot_apply(mlp, monkeypatch):
    model, x = mlp
    monkeypatch.setattr(api, "assemble", _with(SlowRelu()))
    opt = graphopt.optimize(model, (x,), measure=False, check_accuracy=False)
    assert opt.report.pass_result("slow_relu_planted").status == "applied"
    assert opt.report.speed == {"measured": False, "note": "not measured (measure=False)"}
    planned = graphopt.optimize(model, (x,), target="h200", measure=True, check_accuracy=False)
    assert not planned.report.speed["measured"] and "planned for h200" in planned.report.speed["note"]
    with pytest.raises(graphopt.GraphoptError, match="measure must be"):
        graphopt.optimize(model, (x,), measure="sometimes")


def test_a_pass_is_timed_only_while_the_budget_has_room_for_its_comparison():
    """A comparison takes both graphs' warm-up and fewest rounds (here 2 x (2 + 6) calls): a pass is
    timed only when that many calls of the last measured length fit in what is left of the budget,
    so a model whose calls are long is not timed past the budget; the passes after are applied
    unmeasured and named."""
    from types import SimpleNamespace

    from graphopt.runtime.measured import MeasuredTime

    timer = Timer("cpu", warmup=2, settle_rounds=6, early=True)
    meter = MeasuredTime(lambda g: (lambda: None), timer, budget_s=1.0)
    assert not meter.needs_code  # nothing timed yet: no length to plan with
    meter.current = Timing(0.05, [0.05])
    assert meter.needs_code  # 16 calls of 50 ms: 0.8 s of the 1 s
    timer.spent_s = 0.3
    assert not meter.needs_code  # 0.3 + 0.8 > 1
    res = SimpleNamespace(status="applied", details={})
    ctx = SimpleNamespace(before_pass=object())
    assert meter.run_after_pass(None, SimpleNamespace(name="fuse_x"), ctx, res) is None
    assert meter.skipped == ["fuse_x"] and "measured_ms" not in res.details
    timer.spent_s = 0.0
    meter.current = Timing(0.07, [0.07])  # 16 x 70 ms = 1.12 s: one comparison alone is over the budget
    assert not meter.affordable()


def test_on_a_steady_device_a_gain_is_timed_alone_and_a_loss_in_interleaved_rounds():
    """On a GPU (``Timer.steady``) the graph after a pass is timed alone against the last graph
    timed: a gain is settled with one graph built and timed; a graph that looks slower is built
    beside the graph before the pass and both are timed in interleaved rounds, which decide."""
    import time
    from types import SimpleNamespace

    import torch.fx as fx

    from graphopt.runtime.measured import MeasuredTime

    gm = fx.symbolic_trace(nn.Identity())
    built = []

    def make(g, lengths):
        built.append(g)
        d = lengths[len(built) - 1]
        return lambda: time.sleep(d)

    timer = Timer("cpu", warmup=1, settle_rounds=4, early=True)
    timer.steady = True
    meter = MeasuredTime(lambda g: make(g, [0.004]), timer, budget_s=30.0)
    meter.current = Timing(0.010, [0.010] * 4)
    res = SimpleNamespace(status="applied", details={})
    ctx = SimpleNamespace(before_pass=ir.GraphSnapshot(gm.graph))
    assert meter.run_after_pass(gm, SimpleNamespace(name="fuse_x"), ctx, res) is None
    assert len(built) == 1 and built[0] is gm and 3.5 < res.details["measured_ms"] < 8
    assert meter.current.median_s < 0.008

    built.clear()
    meter.make = lambda g: make(g, [0.012, 0.004])  # after the pass 12 ms, the graph before it 4 ms
    res = SimpleNamespace(status="applied", details={}, predicted_s_after=0.0, predicted_s_before=0.0)
    why = meter.run_after_pass(gm, SimpleNamespace(name="slow_x"), ctx, res)
    assert why and why.startswith("measured") and res.details["bisect"]
    assert len(built) == 2 and built[0] is gm and built[1] is not gm  # the graph before, rebuilt beside it
    assert 3.5 < meter.current.median_s * 1e3 < 8  # the graph before the pass stays the one to beat


def test_off_a_steady_device_a_loss_is_taken_again_and_the_second_comparison_decides():
    from types import SimpleNamespace

    import torch.fx as fx

    from graphopt.runtime.measured import MeasuredTime

    gm = fx.symbolic_trace(nn.Identity())
    timer = Timer("cpu", early=True)
    meter = MeasuredTime(lambda g: (lambda: None), timer, budget_s=30.0)
    meter.current = Timing(0.010, [0.010] * 6)
    base, lost, level = Timing(0.010, [0.010] * 6), Timing(0.013, [0.013] * 6), Timing(0.0101, [0.0101] * 6)
    for second, loss in ((level, False), (lost, True)):
        rounds = [(base, lost), (base, second)]
        timer.compare = lambda *fns, most=None: rounds.pop(0)
        res = SimpleNamespace(status="applied", details={}, predicted_s_after=0.0, predicted_s_before=0.0)
        why = meter.run_after_pass(gm, SimpleNamespace(name="p"), SimpleNamespace(before_pass=ir.GraphSnapshot(gm.graph)), res)
        assert not rounds and bool(why) is loss and res.details["measured_ms"] == second.median_s * 1e3


def test_the_margin_and_the_interleaved_rounds():
    assert slower(Timing(1.03), Timing(1.0)) and not slower(Timing(1.01), Timing(1.0))
    # slow at the median only (the machine busy with other work): not a loss
    assert not slower(Timing(1.5, [1.0, 1.5, 2.0]), Timing(1.0, [1.0, 1.0, 1.0]))
    assert slower(Timing(1.5, [1.4, 1.5, 2.0]), Timing(1.0, [0.9, 1.0, 1.1]))
    t = Timer("cpu", warmup=1, min_reps=3, max_reps=3)
    calls = []
    a, b = t.compare(lambda: calls.append("a"), lambda: calls.append("b"))
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then interleaved rounds
    assert len(a.samples) == len(b.samples) == 3 and t.spent_s > 0
    calls.clear()
    assert len(t.time(lambda: calls.append("c"), most=2).samples) == 2 and len(calls) == 3  # a cap on the rounds


def test_explain_shows_the_measured_times(mlp, monkeypatch, capsys):
    from rich.console import Console

    model, x = mlp
    monkeypatch.setattr(api, "assemble", _with(SlowRelu()))
    report = graphopt.optimize(model, (x,), measure=True, check_accuracy=False).report
    report.render(Console(width=160, force_terminal=False))
    out = capsys.readouterr().out
    assert "Δ measured ms" in out and "measured captured graph" in out and "against the model as given" in out


class Counter(nn.Module):
    """A decode step's shape in small: it reads its position, uses it, and moves it on in place."""

    def forward(self, x, pos):
        y = x * pos.float()
        pos.add_(1)
        return y


def test_a_graph_writing_its_inputs_is_not_timed_and_the_inputs_are_untouched():
    """Timed calls one after another would each read the last one's writes (a decode step's position
    running past its cache): such a graph is not measured, and optimize() leaves the caller's
    tensors as they were."""
    x, pos = torch.randn(4, 8), torch.tensor([3])
    opt = graphopt.optimize(Counter(), (x, pos), measure=True, check_accuracy=False)
    assert opt.report.speed["measured"] is False
    assert "writes 1 of its inputs in place" in opt.report.speed["note"]
    assert pos.item() == 3
    out = opt(x, pos)
    assert pos.item() == 4 and torch.equal(out, x * 3)


def test_a_comparison_stops_once_every_round_agrees():
    """Rounds where the candidate is beyond the margin every time settle a loss; rounds whose median
    is within half the margin, at most a third of them beyond it, settle no loss; anything between
    takes the full count."""
    assert settled([1.0] * 6, [1.1] * 6) and settled([1.2] * 6, [1.0] * 6)
    assert not settled([1.0] * 5, [1.1] * 5)  # too few rounds
    assert not settled([1.0, 1.2] * 3, [1.0] * 6)  # half the rounds beyond the margin
    assert settled([1.0, 1.0, 1.03, 1.0, 1.005, 1.0], [1.0] * 6)  # noise around no change: no loss
    assert not settled([1.015] * 6, [1.0] * 6)  # within the margin, but not within half of it: more rounds
    assert not settled([1.03] * 5 + [1.0], [1.0] * 6)  # a 3% loss in most rounds is not settled as none
    assert settled([0.5] * 3, [1.0] * 3) and settled([1.2, 1.3, 1.15], [1.0] * 3)  # clear: 10% or more each round
    assert not settled([0.5, 0.5], [1.0] * 2)  # two rounds decide nothing
    assert not settled([0.5, 0.5, 0.95], [1.0] * 3) and not settled([0.5, 1.2, 0.5], [1.0] * 3)
    script = iter([1.0, 0.95] + [1.0, 0.95] * 24)  # first round, then baseline/candidate rounds

    class Scripted(Timer):
        def _once(self, fn):
            fn()
            return next(script)

    calls = []
    t = Scripted("cpu", warmup=0, min_reps=25, max_reps=25, early=True)
    base, cand = t.compare(lambda: calls.append("a"), lambda: calls.append("b"))
    assert len(base.samples) == len(cand.samples) == 6 and not slower(cand, base)
    script = iter([1.0, 0.5] + [1.0, 0.5] * 24)  # twice as fast: clear after three rounds
    t = Scripted("cpu", warmup=0, min_reps=25, max_reps=25, early=True)
    base, cand = t.compare(lambda: None, lambda: None)
    assert len(base.samples) == len(cand.samples) == 3 and not slower(cand, base)
    script = iter([1.0, 1.1, 1.0, 0.9] * 13)  # the candidate behind in half the rounds, ahead in the others
    t = Scripted("cpu", warmup=0, min_reps=25, max_reps=25, early=True)
    assert len(t.compare(lambda: None, lambda: None)[0].samples) == 25
    script = iter([1.0] * 30)
    t = Scripted("cpu", warmup=0, min_reps=25, max_reps=25, early=True)
    assert len(t.time(lambda: None).samples) == 6  # one callable alone: only the report reads it


def test_a_graph_timed_alone_stops_once_its_median_cannot_exceed_the_time_asked_about():
    """``within``: once more than half of the planned calls took at most that long, the median of all
    of them could not exceed it; the calls stop there, with the verdict the full count would give."""
    def scripted(values):
        script = iter(values)

        class T(Timer):
            def _once(self, fn):
                return next(script)
        return T("cpu", warmup=0, min_reps=25, max_reps=25, early=True, settle_rounds=6)

    fast = scripted([0.9, 1.5, 0.9, 0.95, 1.0] + [9.0] * 10)
    got = fast.time(lambda: None, within=1.02)
    assert got.samples == [0.9, 1.5, 0.9, 0.95, 1.0] and not slower(got, Timing(1.0))  # 4 of 6 within
    full = scripted([0.9, 1.5, 0.9, 0.95, 1.0, 9.0])
    assert not slower(full.time(lambda: None), Timing(1.0))  # the same verdict from all six
    slow = scripted([1.1, 0.9, 1.2, 1.3, 1.0, 1.4] + [0.5] * 10)
    got = slow.time(lambda: None, within=1.02)
    assert len(got.samples) == 6 and slower(got, Timing(1.0))  # never settled within: every call


def test_a_pass_that_only_removes_ops_is_timed_alone(monkeypatch):
    """Dead-code and common-subexpression elimination leave a subset of the graph's ops: the guard
    times the graph after them alone, for the report (no comparison, never undone); every applied
    pass shows a measured time."""
    from graphopt.pipeline import registry
    from graphopt.runtime import measured

    monkeypatch.setenv("GRAPHOPT_MEASURE_BUDGET_S", "60")
    assert {n for n, p in registry().items() if p.removes_work_only} == {
        "eliminate_dead_code", "eliminate_common_subexpressions"}
    compared, in_pass = [], []  # the callables of each comparison the guard makes while judging a pass
    real_compare, real_after = measured.Timer.compare, measured.MeasuredTime.run_after_pass

    def compare(self, *fns, **kw):
        if in_pass:
            compared.append(len(fns))
        return real_compare(self, *fns, **kw)

    def after(self, *a, **kw):
        in_pass.append(1)
        try:
            return real_after(self, *a, **kw)
        finally:
            in_pass.pop()

    monkeypatch.setattr(measured.Timer, "compare", compare)
    monkeypatch.setattr(measured.MeasuredTime, "run_after_pass", after)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    x = torch.randn(2, 3, 32, 32)
    opt = graphopt.optimize(model, (x,), measure=True, passes=["eliminate_dead_code"])
    dce = {r.name: r for r in opt.report.passes}["eliminate_dead_code"]
    assert dce.status == "applied" and dce.details["measured_ms"] > 0 and "not_timed" not in dce.details
    assert compared == [1]  # timed alone, never against the graph before it
    opt = graphopt.optimize(model, (x,), measure=True)
    # fold_conv_bn changed the graph and was timed (kept or, on a noisy machine, undone by its measurement)
    applied = [r for r in opt.report.passes if r.status in ("applied", "reverted")]
    assert "fold_conv_bn" in {r.name for r in applied} and all(r.details["measured_ms"] > 0 for r in applied)
    assert reference_check(model, opt.graph_module, (x,)).passed


class DoubleRelu(MLP):
    """Each layer ``relu(relu(linear(x)) * 0.5)``: fuse_bias_act takes the first ReLU on the CPU too, and the
    planted pass after it slows the second."""

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(torch.relu(lin(x)) * 0.5)
        return x


def test_the_second_run_takes_the_times_of_the_graphs_the_first_timed(monkeypatch):
    """A pass held in the first run is judged alone in a second run of the passes; the graphs before it
    are the same in both runs, so the second takes their times from the first instead of timing them
    again (fuse_bias_act's here)."""
    monkeypatch.setenv("GRAPHOPT_MEASURE_BUDGET_S", "60")
    torch.manual_seed(0)
    model, x = DoubleRelu(layers=4).eval(), torch.randn(256, 256)

    def pipeline(passes=None, disable=None):
        real = assemble(passes, disable)
        i = [p.name for p in real].index("fuse_bias_act") + 1
        return real[:i] + [SlowRelu()] + real[i:]

    monkeypatch.setattr(api, "assemble", pipeline)
    opt = graphopt.optimize(model, (x,), measure=True)
    bias_act, planted = opt.report.pass_result("fuse_bias_act"), opt.report.pass_result("slow_relu_planted")
    assert bias_act.status == "applied" and bias_act.details["measured_in_first_run"] and bias_act.details["measured_ms"] > 0
    assert planted.details["held_verdict"].startswith("judged alone"), planted.details  # (undone: the first test)
    assert reference_check(model, opt.graph_module, (x,)).passed
