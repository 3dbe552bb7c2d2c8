"""Two-level recomputation (insert_checkpoints' outer checkpoints over runs of AOT regions) and the
eager step's memory walk: where a plan of one level cannot reach the budget (ResNet-50 at 0.4 of
its step's activation memory), consecutive regions run under a plain checkpoint that holds only
their inputs and reruns their forward when the backward reaches them."""

import copy
import importlib

import pytest
import torch

import graphopt
from graphopt.errors import BudgetError
from graphopt.memtrace import trace_step
from tests.passes.test_insert_checkpoints import _meta_model, small_resnet

ic = importlib.import_module("graphopt.passes.insert_checkpoints")
aot = importlib.import_module("graphopt.passes._aot_recompute")

pytestmark = pytest.mark.skipif(aot.available() is not None, reason=f"AOT backend unavailable: {aot.available()}")


def _resnet50_meta():
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
        x = torch.randn(128, 3, 224, 224)
    return _meta_model(model, x)


def test_resnet50_at_0_4_needs_two_levels_and_gets_them(monkeypatch):
    am = _resnet50_meta()
    base = am.step_activation_bytes()
    offset = am.all_output_bytes() + am.backward_working_bytes()
    caps = [max(s * am.baseline_saved_bytes(), 1.0) for s in ic.REGION_SHARES]
    sel = ic._Selector(am, keep_random=True, aot=True)
    plan = sel.select(0.4 * base, caps, offset)
    assert plan.segments and plan.total_bytes + offset <= 0.4 * base
    assert all(0 <= a <= b < len(plan.regions) for a, b in plan.segments)
    assert sorted(plan.segments) == plan.segments and all(s[1] < t[0] for s, t in zip(plan.segments, plan.segments[1:]))
    # each segment reruns its forward once: the plan costs more than its inner plan alone
    assert plan.extra_s > 0 and any("two-level" in n for n in plan.notes)
    monkeypatch.setattr(ic._Selector, "nest", lambda self, plan, budget, max_len=16: None)
    with pytest.raises(BudgetError, match="achievable minimum"):
        ic._Selector(am, keep_random=True, aot=True).select(0.4 * base, caps, offset)


def test_eager_step_memory_is_walked_in_backward_order():
    """A CNN's largest backward working set (the first convolutions' gradients) comes when most
    saved tensors are gone: the walk predicts the traced eager step within 3% (on ResNet-50 bs128,
    saved + largest working set over-predicted it by 11%)."""
    model, args = small_resnet(batch=16, res=64)
    model.train()
    params = list(model.parameters())
    trace_step(model, args, params=params)
    traced = trace_step(model, args, params=params)["peak"]
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.99, passes=["insert_checkpoints"],
                            check_accuracy=False, checkpoint_backend="aot")
    d = opt.report.pass_result("insert_checkpoints").details
    assert abs(d["baseline_activation_bytes"] / traced - 1) < 0.03
    assert d["baseline_activation_bytes"] <= d["baseline_held_bytes"] + d["backward_working_bytes"]


def _one_level(monkeypatch):
    monkeypatch.setattr(ic._Selector, "nest", lambda self, plan, budget, max_len=16: None)


def _forced_segments(monkeypatch):
    """Plans of one level as selected, plus one outer segment over all their regions but the last."""
    orig = ic._Selector.select

    def select(self, budget, caps, offset=0.0):
        plan = orig(self, budget, caps, offset)
        if self.aot and len(plan.regions) >= 2:
            plan.segments = [(0, len(plan.regions) - 2)]
        return plan

    monkeypatch.setattr(ic._Selector, "select", select)


def test_outer_segments_keep_gradients_and_running_stats_and_free_memory(monkeypatch):
    model, args = small_resnet(batch=32, res=96)
    ref = copy.deepcopy(model).train()
    kwargs = dict(training=True, memory_budget=0.97, passes=["insert_checkpoints"], check_accuracy=False,
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
    state = copy.deepcopy(model.state_dict())
    ref.load_state_dict(state)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    nested(*args).sum().backward()
    ref(*args).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    # BatchNorm statistics updated once per step, as eager's (the rerun updates scratch copies)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, msg=name)
