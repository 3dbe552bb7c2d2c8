"""Two-level recomputation (insert_checkpoints' outer checkpoints over runs of AOT regions) and the
eager step's memory walk: where a plan of one level cannot reach the budget (ResNet-50 at 0.3 of
its step's activation memory), consecutive regions run under a plain checkpoint that holds only
their inputs and reruns their forward when the backward reaches them."""

import importlib
import operator

import pytest
import torch

import graphopt
from graphopt.errors import BudgetError
from graphopt.tools.memtrace import trace_step
from tests.helpers import step_check
from tests.passes.test_insert_checkpoints import _meta_model, small_resnet

ic = importlib.import_module("graphopt.checkpoint")
aot = importlib.import_module("graphopt.checkpoint.aot")

pytestmark = pytest.mark.skipif(aot.available() is not None, reason=f"AOT backend unavailable: {aot.available()}")


def _resnet50_meta():
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
        x = torch.randn(128, 3, 224, 224)
    return _meta_model(model, x)


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_resnet50_at_0_3_needs_two_levels_and_gets_them(monkeypatch):
    am = _resnet50_meta()
    base = am.step_activation_bytes()
    offset = am.all_output_bytes() + am.backward_working_bytes()
    caps = [max(s * am.baseline_saved_bytes(), 1.0) for s in ic.planner.REGION_SHARES]
    sel = ic.planner._Selector(am, keep_random=True, aot=True)
    plan = sel.select(0.3 * base, caps, offset)
    assert plan.segments and plan.total_bytes + offset <= 0.3 * base
    assert all(0 <= a <= b < len(plan.regions) for a, b in plan.segments)
    assert sorted(plan.segments) == plan.segments and all(s[1] < t[0] for s, t in zip(plan.segments, plan.segments[1:]))
    # each segment reruns its forward once: the plan costs more than its inner plan alone
    assert plan.extra_s > 0 and any("two-level" in n for n in plan.notes)
    monkeypatch.setattr(ic.planner._Selector, "nest", lambda self, plan, budget, max_len=16: None)
    with pytest.raises(BudgetError, match="achievable minimum"):
        ic.planner._Selector(am, keep_random=True, aot=True).select(0.3 * base, caps, offset)


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_plans_leave_the_allocator_headroom_of_the_budget_free():
    """A plan fills at most (1 - headroom) of the budget (the H200 profile keeps 1%: a ResNet-50
    plan at 0.35 measured 1% over its prediction, just over the budget); the BudgetError's minimum
    is in the caller's terms, the headroom included."""
    am = _resnet50_meta()
    base = am.step_activation_bytes()
    offset = am.all_output_bytes() + am.backward_working_bytes()
    caps = [max(s * am.baseline_saved_bytes(), 1.0) for s in ic.planner.REGION_SHARES]
    budget = 0.4 * base
    plan = ic.planner._Selector(am, keep_random=True, aot=True).select(budget, caps, offset, headroom=0.01)
    assert plan.total_bytes + offset <= 0.99 * budget
    with pytest.raises(BudgetError, match=r"1% left free") as e:
        ic.planner._Selector(am, keep_random=True, aot=True).select(0.05 * base, caps, offset, headroom=0.01)
    minimum = float(str(e.value).split("(")[1].split(" of the baseline")[0]) * base
    with pytest.raises(BudgetError):  # just under the stated minimum: still refused
        ic.planner._Selector(am, keep_random=True, aot=True).select(0.99 * minimum, caps, offset, headroom=0.01)


def test_eager_step_memory_is_walked_in_backward_order():
    """A CNN's largest backward working set (the first convolutions' gradients) comes when most
    saved tensors are gone: the walk predicts the traced eager step within 3%, where saved + largest
    working set over-predicts it by over 10% here (19% on ResNet-18 at this size; 11% on ResNet-50
    bs128 on the H200). (The numbers the pass reports, from its plan; the rewrite is not needed for
    them.)"""
    from tests.test_checkpoint_api import captured

    model, args = small_resnet(batch=16, res=128, blocks=1)
    _, gm, ctx = captured(model, args)
    d = ic.plan_checkpoints(gm, ctx, 0.99, "aot").details
    model.train()
    params = list(model.parameters())
    trace_step(model, args, params=params)
    traced = trace_step(model, args, params=params)["peak"]
    assert abs(d["baseline_activation_bytes"] / traced - 1) < 0.03
    assert d["baseline_held_bytes"] + d["backward_working_bytes"] > 1.1 * traced


def _one_level(monkeypatch):
    monkeypatch.setattr(ic.planner._Selector, "nest", lambda self, plan, budget, max_len=16: None)


def _forced_segments(monkeypatch):
    """Plans of one level as selected, plus one outer segment over all their regions but the last."""
    orig = ic.planner._Selector.select

    def select(self, budget, caps, offset=0.0, headroom=0.0):
        plan = orig(self, budget, caps, offset, headroom)
        if self.aot and len(plan.regions) >= 2:
            plan.segments = [(0, len(plan.regions) - 2)]
        return plan

    monkeypatch.setattr(ic.planner._Selector, "select", select)


def test_outer_segments_keep_gradients_and_running_stats_and_free_memory(monkeypatch):
    model, args = small_resnet(batch=16, res=64, blocks=1)  # (its parameters' gradients: a one-level plan meets 0.99)
    kwargs = dict(training=True, memory_budget=0.99, passes=["insert_checkpoints"], check_accuracy=False,
                  checkpoint_backend="aot", target="h200")
    _one_level(monkeypatch)
    flat = graphopt.optimize(model, args, **kwargs)
    assert not flat.report.pass_result("insert_checkpoints").details.get("segments")
    _forced_segments(monkeypatch)
    nested = graphopt.optimize(model, args, **kwargs)
    model.train()
    d = nested.report.pass_result("insert_checkpoints").details
    assert d["segments"] and d["backend"] == "aot"
    outer = [m for m in nested.graph_module.modules() if isinstance(m, ic.OuterCheckpoint)]
    assert len(outer) == 1 and sum(isinstance(m, aot.AotRecompute) for m in outer[0].modules()) >= 1
    params = list(model.parameters())
    after_flat = trace_step(flat, args, params=params)["after_forward"]
    after_nested = trace_step(nested, args, params=params)["after_forward"]
    assert after_nested < 0.9 * after_flat  # the segment's own saved tensors are gone after the forward
    # gradients, and BatchNorm statistics updated once per step (the rerun updates scratch copies)
    step_check(model, nested, args)


def test_compiled_forward_runs_fp32_cuda_training_batchnorm_on_cudnn():
    """The rewrite of a compiled forward graph (checked on fake CUDA tensors: no GPU needed): one
    cudnn_batch_norm whose output, mean and inverse std keep their readers, and whose running
    statistics are copies of the buffers it updated; CPU or bf16 BatchNorms stay."""
    import operator

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not torch.backends.cudnn.is_available():
        pytest.skip("this torch has no cuDNN")
    aten = torch.ops.aten

    def graph(device, dtype, updates=False):
        g = fx.Graph()
        with FakeTensorMode(allow_non_fake_inputs=True):
            vals = [torch.empty(8, 16, 4, 4, device=device, dtype=dtype)] + [
                torch.empty(16, device=device, dtype=dtype) for _ in range(4)]
        ph = []
        for name, v in zip(("x", "w", "b", "rm", "rv"), vals):
            p = g.placeholder(name)
            p.meta["val"] = v
            ph.append(p)
        bn = g.call_function(aten._native_batch_norm_legit_functional.default, (*ph, True, 0.1, 1e-5))
        outs = [g.call_function(operator.getitem, (bn, i)) for i in range(5)]
        if updates:  # the buffer updates kept in the graph (keep_inference_input_mutations)
            for buf, new in ((ph[3], outs[3]), (ph[4], outs[4])):
                g.call_function(aten.copy_.default, (buf, new))
            g.output((outs[0], outs[1], outs[2]))
        else:
            g.output((outs[3], outs[4], outs[0], outs[1], outs[2]))
        return fx.GraphModule(torch.nn.Module(), g), ph

    gm, ph = graph("cuda", torch.float32)
    assert aot.cudnn_training_bn(gm) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert [n.target for n in calls] == [aten.clone.default, aten.clone.default, aten.cudnn_batch_norm.default]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    # the running statistics: copies of the buffers, updated by cuDNN and returned (the inputs stay untouched)
    assert out[0] is calls[0] and out[1] is calls[1] and calls[0].args == (ph[3],) and calls[1].args == (ph[4],)
    assert calls[2].args[3:5] == (calls[0], calls[1])
    assert [(a.args[0], a.args[1]) for a in out[2:]] == [(calls[2], 0), (calls[2], 1), (calls[2], 2)]
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        gm, _ = graph(device, dtype)
        assert aot.cudnn_training_bn(gm) == 0
    # with the graph's own buffer updates: cuDNN updates the buffers themselves, no copies either way
    gm, ph = graph("cuda", torch.float32, updates=True)
    assert aot.cudnn_training_bn(gm) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert [n.target for n in calls] == [aten.cudnn_batch_norm.default]
    assert calls[0].args[3:5] == (ph[3], ph[4])
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [(a.args[0], a.args[1]) for a in out] == [(calls[0], 0), (calls[0], 1), (calls[0], 2)]


@pytest.mark.cuda
def test_cudnn_batchnorm_rewrite_matches_aten_on_the_gpu():
    """The compiled forward's cuDNN BatchNorm on real channels_last CUDA tensors, against the graph
    it replaces: the same output, and the running statistics updated in place as aten's."""
    import torch.fx as fx

    aten = torch.ops.aten
    torch.manual_seed(0)
    x = torch.randn(32, 64, 14, 14, device="cuda").to(memory_format=torch.channels_last)
    w, b = torch.rand(64, device="cuda") + 0.5, torch.randn(64, device="cuda")

    def forward_graph():
        g = fx.Graph()
        ph = [g.placeholder(n) for n in ("x", "w", "b", "rm", "rv")]
        for p, v in zip(ph, (x, w, b, w, w)):
            p.meta["val"] = v
        bn = g.call_function(aten._native_batch_norm_legit_functional.default, (*ph, True, 0.1, 1e-5))
        outs = [g.call_function(operator.getitem, (bn, i)) for i in range(5)]
        g.call_function(aten.copy_.default, (ph[3], outs[3]))
        g.call_function(aten.copy_.default, (ph[4], outs[4]))
        g.output((outs[0],))
        return fx.GraphModule(torch.nn.Module(), g)

    ref, new = forward_graph(), forward_graph()
    assert aot.cudnn_training_bn(new) == 1
    stats = [(torch.randn(64, device="cuda"), torch.rand(64, device="cuda") + 0.5) for _ in range(2)]
    stats[1] = (stats[0][0].clone(), stats[0][1].clone())
    (y_ref,), (y_new,) = ref(x, w, b, *stats[0]), new(x, w, b, *stats[1])
    torch.testing.assert_close(y_new, y_ref, rtol=1e-4, atol=1e-4)
    for a, c in zip(stats[0], stats[1]):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)


def test_buffer_updates_stay_in_the_forward_graph(monkeypatch):
    """AOT regions keep their buffer updates in the forward graph: BatchNorm's running statistics
    are copied in place at its end (on a GPU, cuDNN updates them itself), ``num_batches_tracked``
    is one ``add_``; the forward returns no buffers for a copy after each call, and the backward
    neither saves nor reads the running statistics. Statistics and gradients by the accuracy rule, also with
    an outer checkpoint over the regions (its rerun updates scratch copies)."""
    model, args = small_resnet(batch=4, res=64, blocks=1)
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.7, passes=["insert_checkpoints"],
                            check_accuracy=False, checkpoint_backend="aot", target="h200")
    model.train()
    assert opt.report.pass_result("insert_checkpoints").details["segments"]
    import torch.utils.checkpoint as tuc

    rng_kept, real = [], tuc.checkpoint

    def checkpoint(*a, **kw):
        rng_kept.append(kw.get("preserve_rng_state"))
        return real(*a, **kw)

    monkeypatch.setattr(tuc, "checkpoint", checkpoint)
    for _ in range(2):
        step_check(model, opt, args)
    assert rng_kept and not any(rng_kept)  # no random ops: no RNG states saved and restored
    regions = [m for m in opt.graph_module.modules() if isinstance(m, aot.AotRecompute)]
    assert regions
    aten = torch.ops.aten
    counts = {}
    for region in regions:
        info = next(iter(region.partitions.values()))
        fw, bw = info["graphs"]["fw"], info["graphs"]["bw"]
        for n in fw.graph.nodes:
            counts[n.target] = counts.get(n.target, 0) + 1
        # the copies write BatchNorm's new statistics (the increment's copy_ folded into its add_)
        assert all(n.args[1].target is operator.getitem and n.args[1].args[1] in (3, 4)
                   for n in fw.graph.nodes if n.target is aten.copy_.default)
        assert info["fw_graph"] is not None and info["num_fwd_outputs"] == len(region.body.graph.output_node().args[0])
        backs = [n for n in bw.graph.nodes if n.target is aten.native_batch_norm_backward.default]
        assert all(n.args[3] is None and n.args[4] is None for n in backs)
    bns = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert counts[aten._native_batch_norm_legit_functional.default] == bns
    assert counts[aten.copy_.default] == 2 * bns and counts[aten.add_.Tensor] == bns
    outers = [m for m in opt.graph_module.modules() if isinstance(m, ic.OuterCheckpoint)]
    for outer in outers:
        assert not outer.random()  # no random ops: checkpoint keeps no RNG states
        # BatchNorm's buffers are only updated: the rerun's scratch buffers are kept, not copied per step
        assert outer.mutated and outer.write_only() == set(outer.mutated)
        assert len(outer._scratches) == len(outer.mutated)


def test_a_buffer_the_region_reads_is_not_write_only():
    import torch.fx as fx

    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count.add_(1)
            return self.bn(x) * self.count

    gm = torch.export.export(Counted().train(), (torch.randn(8, 4),)).module()
    ph = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    stats = [n for name, n in ph.items() if "running" in name or "num_batches" in name]
    assert stats and all(ic.runtime._write_only(gm, n) for n in stats)
    assert not ic.runtime._write_only(gm, ph["count"])


def test_buffer_increment_folds_into_one_in_place_add():
    import torch.fx as fx

    aten = torch.ops.aten
    g = fx.Graph()
    buf, other = g.placeholder("buf"), g.placeholder("other")
    inc = g.call_function(aten.add.Tensor, (buf, 1))
    g.call_function(aten.copy_.default, (buf, inc))
    kept = g.call_function(aten.add.Tensor, (other, 1))  # read elsewhere: stays
    g.call_function(aten.copy_.default, (other, kept))
    g.output((kept,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert aot.fold_buffer_increments(gm) == 1
    calls = [(n.target, n.args[0].name) for n in gm.graph.nodes if n.op == "call_function"]
    assert sorted(calls, key=str) == sorted([(aten.add_.Tensor, "buf"), (aten.add.Tensor, "other"),
                                             (aten.copy_.default, "other")], key=str)
    b, o = torch.zeros(3), torch.ones(3)
    (res,) = gm(b, o)
    assert b.tolist() == [1, 1, 1] and o.tolist() == [2, 2, 2] and res.tolist() == [2, 2, 2]


@pytest.mark.slow  # 7 s on two cores; two levels are planned in test_resnet50_at_0_3_needs_two_levels_and_gets_them
def test_two_level_plan_traces_as_predicted():
    """A budget no plan of one level meets (ResNet-18 at batch 16, 64 px: 0.65; one level needs more
    than 0.7): the two-level plan's step traces within 5% of its prediction, and the memory after its
    forward within 3% of the predicted held bytes (the outer checkpoint holds its segment's inputs,
    which the plan frees otherwise)."""
    model, args = small_resnet(batch=16, res=64)
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.65, passes=["insert_checkpoints"],
                            check_accuracy=False, checkpoint_backend="aot", target="h200")
    model.train()
    d = opt.report.pass_result("insert_checkpoints").details
    assert d["segments"]
    params = list(model.parameters())
    trace_step(opt, args, params=params)
    traced = trace_step(opt, args, params=params)
    assert abs(traced["peak"] / d["predicted_activation_bytes"] - 1) < 0.05
    assert abs(traced["after_forward"] / d["predicted_held_bytes"] - 1) < 0.03


class _ScaledBlock(torch.nn.Module):
    """A pre-norm MLP block whose input only a scalar multiply and the residual add read: nothing
    saves it for backward, so a plan frees it after the forward, but an outer checkpoint whose
    segment starts here holds it."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x * 0.5))))


def test_outer_checkpoints_are_priced_with_the_inputs_they_hold():
    """Two-level plans of a stack of blocks whose inputs nothing saves trace as predicted. The
    budgets span where two levels are needed on torch with and without boxed backward gradients
    (without, each AOT region's backward holds the gradients it receives until it returns: the
    plans differ and the minimum is higher)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_ScaledBlock(64) for _ in range(8)], torch.nn.Linear(64, 8))
    args = (torch.randn(2048, 64),)
    params = list(model.parameters())
    planned = 0
    # (the minimum: 0.228 of the step on torch 2.11, 0.216 on 2.14, where 0.22 plans too; 0.205, below
    # both, spent 3.9 s of a search that ends in BudgetError)
    for budget in (0.23, 0.22):
        try:
            opt = graphopt.optimize(model, args, training=True, memory_budget=budget, passes=["insert_checkpoints"],
                                    check_accuracy=False, checkpoint_backend="aot", target="h200")
        except BudgetError:  # below what two levels reach once the held inputs are counted
            continue
        model.train()
        d = opt.report.pass_result("insert_checkpoints").details
        planned += bool(d.get("segments"))
        trace_step(opt, args, params=params)
        traced = trace_step(opt, args, params=params)
        # (priced without the held inputs, the 0.205 plan traced 11% over its prediction, 39% after the forward;
        # on torch 2.11, priced without the held incoming gradients, the 0.22 plan traced 11% over)
        assert abs(traced["peak"] / d["predicted_activation_bytes"] - 1) < 0.05, budget
        assert abs(traced["after_forward"] / d["predicted_held_bytes"] - 1) < 0.03, budget
    assert planned
