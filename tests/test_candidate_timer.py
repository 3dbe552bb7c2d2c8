"""Rewrites timed on the device before they apply (graphopt.runtime.candidates): a candidate that
carries its replacement is run against the nodes it replaces, on inputs of the graph's shapes, and
refused where it measures slower. The planted replacement here computes relu(x) the slow way (one
256 x 2048 matmul more, multiplied by zero): a margin no timing noise on a loaded CPU can hide."""

import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt import api, ir
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import Candidate, Pass, PassContext, assemble
from graphopt.runtime import candidates
from graphopt.runtime.candidates import CandidateTimer
from tests.helpers import reference_check
from tests.test_measured_guard import HeavyMLP  # each layer ends in x + 0 * sum(x @ W), W 256 x 2048

aten = torch.ops.aten


def _slow(r, x):
    """relu(x + 0 * sum(x @ W)) in the replacement ``r``, W a constant the rewrite would make."""
    info = ir.info(x)
    w = r.tensor((info.shape[-1], 2048), info.dtype, info.device)
    zero = r.call(aten.mul.Tensor, r.call(aten.sum.default, r.call(aten.mm.default, x, w)), 0.0)
    return r.call(aten.relu.default, r.call(aten.add.Tensor, x, zero))


def _no_op(add: fx.Node):
    """[mm, sum, mul, add] where ``add`` is x + 0 * sum(x @ W), else None."""
    if add.target is not aten.add.Tensor or not isinstance(add.args[1], fx.Node):
        return None
    mul = add.args[1]
    if mul.target is not aten.mul.Tensor or mul.args[1] != 0.0 or mul.args[0].target is not aten.sum.default:
        return None
    mm = mul.args[0].args[0]
    if mm.target not in (aten.mm.default, aten.matmul.default) or mm.args[0] is not add.args[0]:
        return None
    return [mm, mul.args[0], mul, add]


class PlantedLowering(Pass):
    """Two kinds of candidate, each claimed a gain and carrying its replacement: the model's no-op
    chain -> a copy of x (really faster), and relu -> the slow spelling of :func:`_slow` (really
    slower)."""

    name = "planted_lowering"
    family = "lower"

    def run(self, gm, ctx):
        res = self.result()
        cands = []
        for i, n in enumerate(n for n in gm.graph.nodes if n.target is aten.relu.default):
            r = ctx.replacement()
            _slow(r, n.args[0])

            def apply(n=n):
                g = gm.graph
                with g.inserting_before(n):
                    w = g.get_attr(ir.register_constant(gm, "planted_w", torch.randn(ir.info(n).shape[-1], 2048)))
                    zero = g.call_function(aten.mul.Tensor, (g.call_function(aten.sum.default, (
                        g.call_function(aten.mm.default, (n.args[0], w)),)), 0.0))
                    new = g.call_function(aten.relu.default, (g.call_function(aten.add.Tensor, (n.args[0], zero)),))
                n.replace_all_uses_with(new)
                g.erase_node(n)
                return new
            cands.append(Candidate("planted: slow relu", [n], 1.0 - i * 1e-3, apply, label=f"relu #{i + 1}",
                                   replacement=r))
        for i, chain in enumerate(filter(None, map(_no_op, list(gm.graph.nodes)))):
            r = ctx.replacement()
            x = chain[-1].args[0]
            r.call(aten.clone.default, x)

            def apply(chain=chain, x=x):
                g = gm.graph
                with g.inserting_before(chain[-1]):
                    new = g.call_function(aten.clone.default, (x,))
                chain[-1].replace_all_uses_with(new)
                for n in reversed(chain):
                    if not n.users:
                        g.erase_node(n)
                return new
            cands.append(Candidate("planted: no-op chain", chain, 0.5 - i * 1e-3, apply, label=f"no-op #{i + 1}",
                                   replacement=r))
        res.apply_ranked(ctx, cands)
        if res.changed:
            gm.graph.eliminate_dead_code()
            ir.repropagate(gm)
        return res


def _planted(passes=None, disable=None):
    real = assemble(passes, disable)
    return real[:1] + [PlantedLowering()] + real[1:]


def test_a_candidate_measured_slower_is_refused_with_both_times_and_the_others_apply(monkeypatch):
    """optimize(measure=True) on the CPU: the slow candidates are refused, each with its measured
    times in one line, before the pass applies (the measured guard then has nothing to undo); the
    fast one applies; the times are in the pass's details; the result passes the accuracy rule."""
    monkeypatch.setenv("GRAPHOPT_MEASURE_BUDGET_S", "60")
    monkeypatch.setattr(candidates, "_RESULTS", {})
    torch.manual_seed(0)
    model, x = HeavyMLP().eval(), torch.randn(256, 256)
    monkeypatch.setattr(api, "assemble", _planted)
    opt = graphopt.optimize(model, (x,), measure=True)
    res = opt.report.pass_result("planted_lowering")
    assert res.status == "applied" and [r.pattern for r in res.rewrites] == ["planted: no-op chain"] * 4, \
        (res.status, res.rejected)
    refused = [r for r in res.rejected if r.reason.startswith("measured slower on cpu")]
    assert [r.candidate for r in refused] == [f"relu #{i}" for i in range(1, 5)], res.rejected
    assert all(" us against " in r.reason and "predicted +" in r.reason for r in refused)
    timed = res.details["timed_candidates"]
    assert len(timed) == 8 and all(t["before_us"] > 0 and t["after_us"] > 0 for t in timed)
    assert sorted(t["candidate"] for t in timed if t["refused"]) == [r.candidate for r in refused]
    assert not any(n.target in (aten.mm.default, aten.matmul.default) for n in opt.graph_module.graph.nodes)
    assert opt.report.optimize_phases.get("measured guard: timing candidates", 0) > 0
    from graphopt.tools.bench import _graphopt_extra  # what the bench and the perf sweep record

    assert _graphopt_extra(opt)["timed_candidates"] == {"planted_lowering": [4, 8]}
    assert reference_check(model, opt.graph_module, (x,)).passed


def test_without_measuring_the_candidates_apply_on_their_prediction(monkeypatch):
    """measure=False: no timer, so every candidate applies on its claimed gain (the measured guard
    is what would catch it): the timer is what refused them above."""
    torch.manual_seed(0)
    model, x = HeavyMLP().eval(), torch.randn(256, 256)
    monkeypatch.setattr(api, "assemble", _planted)
    opt = graphopt.optimize(model, (x,), measure=False)
    res = opt.report.pass_result("planted_lowering")
    assert len(res.rewrites) == 8 and "timed_candidates" not in res.details


def _graph_with_relus(shapes):
    """A captured graph with one relu per shape in ``shapes`` (its input a placeholder)."""
    class M(nn.Module):
        def forward(self, *xs):
            return tuple(torch.relu(x) for x in xs)

    xs = tuple(torch.randn(*s) for s in shapes)
    gm = graphopt.capture(M(), xs)
    return gm, [n for n in gm.graph.nodes if n.target is aten.relu.default]


def test_candidates_alike_are_timed_once_and_each_subgraph_reads_what_it_matched(monkeypatch):
    """Two relus of one shape and one of another: two timings, the third candidate's result taken
    from the first's; the old side's subgraph reads the relu's input and outputs the relu, the
    new side's reads the same input and the constant the rewrite would make."""
    monkeypatch.setattr(candidates, "_RESULTS", {})
    gm, relus = _graph_with_relus([(64, 256), (64, 256), (32, 256)])
    ctx = PassContext(cost=CostModel(get_profile("cpu")[0]), hints=ir.shape_hints(gm))
    timer = CandidateTimer("cpu", rounds=3)
    old_graph, outer = timer._old_graph([relus[0]])
    assert outer == [relus[0].args[0]]
    assert [n.target for n in old_graph.nodes if n.op == "call_function"] == [aten.relu.default]
    results = []
    for n in relus:
        r = ctx.replacement()
        _slow(r, n.args[0])
        new_graph, new_outer = timer._new_graph(r)
        # the relu's input, and W (a constant of the rewrite's own, made from its fake value)
        assert new_outer.count(None) == 1 and n.args[0] in new_outer
        results.append(timer.time([n], r))
    assert timer.timed == 2 and results[1] == results[0] and results[2] != results[0]
    assert all(timer.slower(old, new) for old, new in results)


def test_a_candidate_with_symbolic_sizes_is_left_to_the_cost_model(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    monkeypatch.setattr(candidates, "_RESULTS", {})
    mode = FakeTensorMode(shape_env=ShapeEnv())
    sym = mode.from_tensor(torch.randn(8, 64), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = sym
    relu = g.call_function(aten.relu.default, (x,))
    relu.meta["val"] = sym
    g.output(relu)
    r = PassContext(cost=CostModel(get_profile("cpu")[0]), hints={}).replacement()
    r.call(aten.clamp_min.default, x, 0.0, val=sym)
    timer = CandidateTimer("cpu")
    assert timer.time([relu], r) is None and timer.timed == 0


def test_a_subgraph_that_fails_to_run_is_left_to_the_cost_model(monkeypatch):
    """A replacement whose op raises on real tensors: no times (None), nothing raised."""
    monkeypatch.setattr(candidates, "_RESULTS", {})
    gm, relus = _graph_with_relus([(16, 32)])
    ctx = PassContext(cost=CostModel(get_profile("cpu")[0]), hints=ir.shape_hints(gm))
    r = ctx.replacement()
    x = relus[0].args[0]
    w = r.tensor((31, 8), torch.float32, torch.device("cpu"))  # inner sizes disagree: mm raises
    r.call(aten.mm.default, x, w, val=torch.empty(16, 8))
    timer = CandidateTimer("cpu")
    assert timer.time([relus[0]], r) is None


def test_inputs_keep_the_graph_strides_a_broadcast_one_included():
    """A residual expanded over the batch (stride 0) and a channels_last map are made with those strides."""
    timer = CandidateTimer("cpu")
    wide = torch.empty(4, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    expanded = torch.empty(1, 8, 5, 5).expand(4, 8, 5, 5)
    for val in (wide, expanded, torch.empty(0, 3), torch.zeros(3, 2, dtype=torch.int64)):
        t = timer._make(val)
        assert t.shape == val.shape and t.stride() == val.stride() and t.dtype == val.dtype
    assert timer._make(expanded).std() > 0 and not timer._make(torch.zeros(3, dtype=torch.int64)).any()
