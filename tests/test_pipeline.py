import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt import ir
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.errors import PassConfigError
from graphopt.examples import zoo
from graphopt.ir import InvariantError
from graphopt.pipeline import (PIPELINE, Candidate, available, Pass, PassContext, PassInstrument, PassManager, assemble,
                               registry)

aten = torch.ops.aten


def _ctx(gm, **kw):
    prof = get_profile("h200")[0]
    return PassContext(cost=CostModel(prof), hints=ir.shape_hints(gm), **kw)


class ScaleOutputs(Pass):
    """A deliberately wrong rewrite: relu(x) -> relu(x) * 1.01."""

    name = "scale_relu_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        cands = []
        for n in list(gm.graph.nodes):
            if n.target is aten.relu.default:
                def apply(n=n):
                    with gm.graph.inserting_after(n):
                        new = gm.graph.call_function(aten.mul.Tensor, (n, 1.01))
                    n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
                    return new
                cands.append(Candidate("planted", [n], 1e-6, apply))
        res.apply_ranked(ctx, cands)
        return res


class BreakGraph(Pass):
    name = "break_graph_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        n = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        # give the relu a float32 -> float64 change: metadata now disagrees with the graph
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(aten._to_copy.default, (n,), {"dtype": torch.float64})
        n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        new.meta["val"] = n.meta["val"]
        res.record("planted", [n], [new], 0.0)
        return res


def _mlp_gm():
    model, inputs = zoo.get("mlp")
    return model, inputs, graphopt.capture(model, inputs)


def test_pipeline_is_declared_in_family_order():
    reg = registry()
    assert set(reg) <= set(PIPELINE)  # every registered pass has its place
    from graphopt.pipeline import FAMILIES

    fams = [FAMILIES.index(reg[n].family) for n in available()]
    assert fams == sorted(fams)


def test_assemble_rejects_unknown_and_keeps_order():
    with pytest.raises(PassConfigError, match="unknown pass nope"):
        assemble(["nope"])
    with pytest.raises(PassConfigError, match="unknown pass"):
        assemble(None, disable=["fold_everything"])
    names = [p.name for p in assemble(["fold_conv_bn", "eliminate_dead_code"])]
    assert names == ["eliminate_dead_code", "fold_conv_bn"]


def test_accuracy_guard_reverts_a_wrong_pass():
    from graphopt import accuracy

    model, inputs, gm = _mlp_gm()
    ref64 = accuracy.fp64_reference(model, inputs, {})
    with torch.no_grad():
        eager = model(*inputs)

    def check(g, low_dtype=None):
        with torch.no_grad():
            return accuracy.check(g(*inputs), ref64, eager)

    before = [n.target for n in gm.graph.nodes]
    (res,) = PassManager([ScaleOutputs()], check).run(gm, _ctx(gm))
    assert res.status == "reverted"
    assert "accuracy" in res.notes[0]
    assert [n.target for n in gm.graph.nodes] == before
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), eager)


def test_a_snapshot_rebuilds_the_graph_as_it_was_after_the_graph_is_rewritten():
    """ir.GraphSnapshot keeps a graph's nodes without copying the graph; edits made after it (args
    replaced, nodes erased, meta written) leave what it rebuilds as the graph was."""
    model, inputs, gm = _mlp_gm()
    before_code, before_meta = gm.code, {n.name: dict(n.meta) for n in gm.graph.nodes}
    snap = ir.GraphSnapshot(gm.graph)
    for n in list(gm.graph.nodes):
        if n.target is aten.relu.default:
            with gm.graph.inserting_after(n):
                new = gm.graph.call_function(aten.sigmoid.default, (n.args[0],))
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            new.meta["val"] = None
        elif n.op == "call_function":
            n.meta["planted"] = True
    gm.recompile()
    assert gm.code != before_code
    rebuilt = fx.GraphModule(gm, snap.graph())
    assert rebuilt.code == before_code
    assert {n.name: n.meta for n in rebuilt.graph.nodes} == before_meta
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(*inputs), model(*inputs))
    assert snap.graph() is not snap.graph()  # each rebuild is a new graph


def test_invariant_check_names_the_node():
    model, inputs, gm = _mlp_gm()
    ctx = _ctx(gm)
    ctx.strict = True  # tests and debugging: a broken invariant raises
    with pytest.raises(InvariantError, match="changed metadata"):
        PassManager([BreakGraph()]).run(gm, ctx)


def test_broken_invariant_reverts_the_pass_for_users():
    model, inputs, gm = _mlp_gm()
    before = [n.target for n in gm.graph.nodes]
    (res,) = PassManager([BreakGraph()]).run(gm, _ctx(gm))
    assert res.status == "reverted" and "changed metadata" in res.notes[0]
    assert [n.target for n in gm.graph.nodes] == before
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs))


class UseBeforeDef(Pass):
    """Inserts a node before one of its inputs: graph.lint()'s message ends with the whole graph."""

    name = "use_before_def_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        n = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        first = next(x for x in gm.graph.nodes if x.op == "call_function")
        with gm.graph.inserting_before(first):
            new = gm.graph.call_function(aten.neg.default, (n,))
        n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        res.record("planted", [n], [new], 0.0)
        return res


class Raises(Pass):
    name = "raises_planted"
    family = "fusion"

    def run(self, gm, ctx):
        raise RuntimeError("first line\nsecond line\n" + str(gm.graph))


@pytest.mark.parametrize("planted, says", [(UseBeforeDef, "used before it has been defined"),
                                           (Raises, "the pass raised RuntimeError: first line")])
def test_a_revert_note_is_one_line_and_the_full_text_goes_to_the_dump(tmp_path, planted, says):
    from graphopt.report import Report

    model, inputs, gm = _mlp_gm()
    before = [n.target for n in gm.graph.nodes]
    (res,) = PassManager([planted()]).run(gm, _ctx(gm))
    (note,) = res.notes
    assert res.status == "reverted" and says in note
    assert "\n" not in note and "graph()" not in note and "%" not in note and len(note) < 400
    assert [n.target for n in gm.graph.nodes] == before
    # with an IR dump, the note names the file holding the whole text and the broken graph
    gm = graphopt.capture(model, inputs)
    (res,) = PassManager([planted()]).run(gm, _ctx(gm, dump_dir=tmp_path))
    name = f"001_{planted.name}.reverted.txt"
    assert res.notes[0].endswith(f"(full text: {name})")
    text = (tmp_path / name).read_text()
    assert says in text and "graph()" in text
    # explain prints the note on one line
    import io

    from rich.console import Console

    report = graphopt.optimize(model, inputs, passes=[], check_accuracy=False).report
    report.passes.append(res)
    buf = io.StringIO()
    report.render(Console(file=buf, width=10000))
    (line,) = [ln for ln in buf.getvalue().splitlines() if "reverted:" in ln]
    assert says in line and "graph()" not in buf.getvalue()


class StaleInput(Pass):
    """Two rewrites planned on the graph as it was: the second reads the relu the first replaced."""

    name = "stale_input_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        out = next(iter(gm.graph.find_nodes(op="output")))

        def first():
            with gm.graph.inserting_before(relu):
                new = gm.graph.call_function(aten.relu.default, relu.args)
            new.meta = dict(relu.meta)
            relu.replace_all_uses_with(new)
            gm.graph.erase_node(relu)
            return new

        def second():  # reads the relu the first rewrite replaced
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(aten.mul.Tensor, (relu, 1.0))
            new.meta = dict(relu.meta)
            return new

        res.apply_ranked(ctx, [Candidate("first", [relu], 2e-6, first),
                               Candidate("second", [], 1e-6, second, label="second")])
        return res


class InsertedTooEarly(Pass):
    """A rewrite that puts its node before one of its inputs."""

    name = "too_early_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        first = next(n for n in gm.graph.nodes if n.op == "call_function")

        def apply():
            with gm.graph.inserting_before(first):
                new = gm.graph.call_function(aten.neg.default, (relu,))
            relu.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
            return new

        res.apply_ranked(ctx, [Candidate("early", [relu], 1e-6, apply, label="early")])
        return res


def test_a_rewrite_reading_a_replaced_node_reads_its_replacement():
    """A rewrite planned before an earlier rewrite of the same pass replaced one of its inputs
    reads the replacement (the same value), as fuse_layer_norm's second LayerNorm of Swin's patch
    embedding does."""
    model, inputs, gm = _mlp_gm()
    ctx = _ctx(gm)
    ctx.strict = True
    (res,) = PassManager([StaleInput()]).run(gm, ctx)
    assert res.status == "applied" and len(res.rewrites) == 2
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert mul.args[0].target is aten.relu.default and not getattr(mul.args[0], "_erased", False)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs))


def test_a_rewrite_placed_before_its_input_reverts_the_pass_naming_it():
    model, inputs, gm = _mlp_gm()
    before = [n.target for n in gm.graph.nodes]
    (res,) = PassManager([InsertedTooEarly()]).run(gm, _ctx(gm))
    assert res.status == "reverted"
    assert "rewrite early" in res.notes[0] and "defined after it" in res.notes[0]
    assert [n.target for n in gm.graph.nodes] == before
    ctx = _ctx(gm)
    ctx.strict = True
    with pytest.raises(InvariantError, match="defined after it"):
        PassManager([InsertedTooEarly()]).run(gm, ctx)


def test_multi_line_reasons_are_kept_to_one_line(tmp_path):
    class Chatty(Pass):
        name = "chatty_planted"
        family = "fusion"

        def run(self, gm, ctx):
            res = self.result()
            res.reject("x", "why\n" + str(gm.graph))
            res.notes.append("note " + "y" * 1000)
            return res

    model, inputs, gm = _mlp_gm()
    (res,) = PassManager([Chatty()]).run(gm, _ctx(gm, dump_dir=tmp_path))
    assert res.rejected[0].reason == "why …" and len(res.notes[0]) <= 300 and res.notes[0].endswith("…")
    assert "graph()" in (tmp_path / "001_chatty_planted.notes.txt").read_text()


def test_provenance_is_stamped_automatically():
    model, inputs, gm = _mlp_gm()
    (res,) = PassManager([ScaleOutputs()]).run(gm, _ctx(gm))
    assert res.status == "applied"
    stamped = [n for n in gm.graph.nodes if "graphopt_from" in n.meta]
    assert stamped and all(n.meta["graphopt_from"]["pass"] == "scale_relu_planted" for n in stamped)
    assert stamped[0].meta["graphopt_from"]["sources"] == [res.rewrites[0].matched[0]]


def test_ranked_candidates_reject_overlap_and_losses():
    model, inputs, gm = _mlp_gm()
    ctx = _ctx(gm)
    ctx.observer = ir.ProvenanceObserver(gm, "t")
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    from graphopt.pipeline import PassResult

    res = PassResult("t")
    applied = []
    cands = [Candidate("big", [relu], 2e-6, lambda: applied.append("big") or True),
             Candidate("small", [relu], 1e-6, lambda: applied.append("small") or True),
             Candidate("loss", [next(iter(gm.graph.nodes))], -1e-6, lambda: applied.append("loss") or True)]
    with ctx.observer.active():
        res.apply_ranked(ctx, cands)
    assert applied == ["big"]
    reasons = {r.candidate.split(" ")[0]: r.reason for r in res.rejected}
    assert "overlaps" in reasons["small"] and "no gain" in reasons["loss"]


def test_dump_dir_writes_each_pass(tmp_path):
    model, inputs = zoo.get("shape-branch")
    opt = graphopt.optimize(model, inputs, dump_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0] == "000_captured.py"
    assert [f[4:-3] for f in files[1:]] == available()


def test_disabled_pass_is_reported():
    model, inputs = zoo.get("shape-branch")
    opt = graphopt.optimize(model, inputs, disable=["fold_conv_bn"])
    assert opt.report.pass_result("fold_conv_bn").status == "disabled"
    assert any(n.target is aten.batch_norm.default for n in opt.graph_module.graph.nodes)


def test_code_is_generated_once_when_nothing_runs_the_graph_between_passes(monkeypatch):
    """No accuracy check and no dump: the PassManager recompiles the graph's Python code once,
    after the last pass (not after each pass that changed it); the module handed back runs the
    final graph. The accuracy guard checks the result once (optimistically), so with it too the
    code is generated once."""
    import sys

    from tests.helpers import reference_check

    model, inputs = zoo.get("bert-tiny")
    model.eval()
    counts = []
    orig = fx.GraphModule.recompile

    def counting(self):
        if sys._getframe(1).f_code.co_filename.endswith(("graphopt/pipeline.py", "graphopt\\pipeline.py")):
            counts.append(1)  # the PassManager's own (capture and some passes recompile themselves)
        return orig(self)

    monkeypatch.setattr(fx.GraphModule, "recompile", counting)
    opt = graphopt.optimize(model, inputs, target="h200", check_accuracy=False, cuda_graphs=False)
    applied = [p.name for p in opt.report.passes if p.status == "applied"]
    assert len(applied) >= 5 and len(counts) == 1
    assert reference_check(model, opt.graph_module, inputs).passed
    gm = opt.graph_module
    assert gm.code == gm.graph.python_code("self").src  # the code is the final graph's
    counts.clear()
    guarded = graphopt.optimize(model, inputs, target="h200", cuda_graphs=False)
    assert len(counts) == 1 and guarded.report.accuracy["passed"]
    assert guarded.report.accuracy["mode"] == "once, after all passes"


def test_the_code_is_current_whenever_an_instrument_asks_for_it():
    """An instrument whose ``needs_code`` is asked after each pass (a measured guard with room left in
    its budget) sees code that is the graph's as it is then, also after passes applied while no
    instrument wanted code; at the end the code is the final graph's."""

    class Reader(PassInstrument):
        def __init__(self, want):
            self.want, self.seen, self.name = set(want), [], None

        @property
        def needs_code(self):
            return self.name in self.want

        def run_before_pass(self, gm, p, ctx):
            self.name = p.name

        def run_after_pass(self, gm, p, ctx, res):
            if res.status == "applied" and p.name in self.want:
                self.seen.append((p.name, gm.code == gm.graph.python_code("self").src))
            return None

    model, inputs = zoo.get("bert-tiny")
    model.eval()
    dry = graphopt.capture(model, inputs)
    applied = [r.name for r in PassManager(assemble()).run(dry, _ctx(dry)) if r.status == "applied"]
    assert len(applied) >= 4
    gm = graphopt.capture(model, inputs)
    reader = Reader(applied[2:])  # code wanted from the third applied pass on
    out = PassManager(assemble(), instruments=[reader]).run(gm, _ctx(gm))
    assert [r.name for r in out if r.status == "applied"] == applied
    assert reader.seen == [(n, True) for n in applied[2:]]
    assert gm.code == gm.graph.python_code("self").src


def test_the_guard_checks_once_when_the_result_passes(monkeypatch):
    """The guard runs optimistically: all passes, then one check of the result, which is the one
    reported (no pass carries a check of its own). With no pass applied, the captured graph is
    checked once."""
    from graphopt import api

    calls = []
    orig = api._AccuracyGuard.__call__

    def counting(self, gm, low_dtype=None):
        calls.append(low_dtype)
        return orig(self, gm, low_dtype)

    monkeypatch.setattr(api._AccuracyGuard, "__call__", counting)
    model, inputs = zoo.get("bert-tiny")
    model.eval()
    opt = graphopt.optimize(model, inputs, target="h200", cuda_graphs=False)
    applied = [p for p in opt.report.passes if p.status == "applied"]
    assert len(applied) >= 5 and len(calls) == 1
    assert all(p.accuracy is None for p in opt.report.passes)
    assert opt.report.accuracy["passed"] and opt.report.accuracy["mode"] == "once, after all passes"
    calls.clear()
    none = graphopt.optimize(model, inputs, target="h200", passes=[], cuda_graphs=False)
    assert len(calls) == 1 and none.report.accuracy["checked"] and none.report.accuracy["passed"]


class NoMatch(Pass):
    """A pass that finds nothing: the graph is left as it was."""

    name = "no_match_planted"
    family = "fusion"

    def run(self, gm, ctx):
        return self.result()


class Raises(Pass):
    """A pass that edits the graph, then fails."""

    name = "raises_planted"
    family = "fusion"

    def run(self, gm, ctx):
        n = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        with gm.graph.inserting_after(n):
            gm.graph.call_function(aten.neg.default, (n,))
        raise RuntimeError("planted")


def test_a_pass_that_changed_nothing_leaves_the_graph_copy_for_the_next(monkeypatch):
    """Undoing a pass needs a copy of the graph before it; after passes that left the graph as it was,
    the copy taken before them still is that graph: one copy serves them all, and a later pass that
    fails is still undone."""
    model, inputs, gm = _mlp_gm()  # captured first: torch.export copies graphs of its own
    copies = []
    real = ir.GraphSnapshot.__init__
    monkeypatch.setattr(ir.GraphSnapshot, "__init__", lambda s, g: copies.append(1) or real(s, g))
    before = [n.target for n in gm.graph.nodes]
    results = PassManager([NoMatch(), NoMatch(), Raises(), NoMatch(), ScaleOutputs()]).run(gm, _ctx(gm))
    assert [r.status for r in results] == ["unchanged", "unchanged", "reverted", "unchanged", "applied"]
    assert len(copies) == 2  # before the first pass; after the revert (the copy became the graph)
    assert [n.target for n in gm.graph.nodes if n.target is not aten.mul.Tensor] == before


class _Recorder(PassInstrument):
    """Records the hooks it sees; undoes the passes named in ``undo``, leaves out those in ``skip``."""

    def __init__(self, undo=(), skip=()):
        self.calls, self.undo, self.skip = [], set(undo), set(skip)

    def enter(self, gm, ctx):
        self.calls.append("enter")

    def exit(self, gm, ctx):
        self.calls.append("exit")

    def run_before_pass(self, gm, p, ctx):
        self.calls.append(("before", p.name))

    def should_run(self, p, ctx):
        return ("skipped", "left out by the recorder") if p.name in self.skip else None

    def run_after_pass(self, gm, p, ctx, res):
        self.calls.append(("after", p.name, res.status))
        return "the recorder undoes it" if p.name in self.undo else None


def test_instruments_run_around_each_pass_and_may_undo_or_skip_it():
    """PassInstruments as TVM's: enter/exit around the run, before/after each pass; an instrument
    listed by the caller is outermost (it sees the built-in checks' verdict, "applied"), its undo
    restores the graph from before the pass, and should_run can leave a pass out."""
    model, inputs, gm = _mlp_gm()
    code = gm.code
    rec = _Recorder(undo={"scale_relu_planted"})
    (res,) = PassManager([ScaleOutputs()], instruments=[rec]).run(gm, _ctx(gm))
    assert rec.calls == ["enter", ("before", "scale_relu_planted"), ("after", "scale_relu_planted", "applied"), "exit"]
    assert res.status == "reverted" and res.notes == ["reverted: the recorder undoes it"]
    assert gm.code == code and not any(n.target is aten.mul.Tensor for n in gm.graph.nodes)
    skip = _Recorder(skip={"scale_relu_planted"})
    (res,) = PassManager([ScaleOutputs()], instruments=[skip]).run(gm, _ctx(gm))
    assert res.status == "skipped" and res.notes == ["left out by the recorder"] and gm.code == code


def test_a_pass_registered_again_from_another_module_is_refused():
    """`import passes.x` (the repository on sys.path) executes the pass modules a second time; their
    classes must not replace graphopt.passes' own, which the rest of graphopt compares against."""
    from graphopt.pipeline import register, registry

    original = registry()["fold_constants"]
    twin = type("FoldConstants", (original,), {"__module__": "passes.fold_constants"})
    with pytest.raises(PassConfigError, match="already registered by graphopt.passes.fold_constants"):
        register(twin)
    assert registry()["fold_constants"] is original
