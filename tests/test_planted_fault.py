"""Planted fault (issue 10, item 5, CPU part): a pass that makes a deliberately wrong rewrite on
a real zoo model (bert-tiny: the first layer's attention output scaled by 1.05) must be reverted
by the optimizer's accuracy guard, leaving the model's output intact. The planted pass is not
registered: it is handed to a PassManager in a custom pass list (as in tests/test_pipeline.py)."""

import pytest
import torch

import graphopt
from graphopt import accuracy, ir
from graphopt.api import _AccuracyGuard
from graphopt.capture import split_inputs
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.examples import zoo
from graphopt.options import OptimizeOptions
from graphopt.pipeline import Candidate, Pass, PassContext, PassManager, assemble

aten = torch.ops.aten


def _first_attention_output(gm):
    """The first attention's context: the matmul that consumes the first softmax."""
    soft = next(n for n in gm.graph.nodes if n.op == "call_function"
                and n.target in (aten.softmax.int, aten._softmax.default))
    return next(u for u in soft.users if u.target in (aten.matmul.default, aten.bmm.default))


class ScaleAttentionOutput(Pass):
    """Deliberately wrong: the first attention output -> attention output * 1.05."""

    name = "scale_attention_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        n = _first_attention_output(gm)

        def apply():
            with gm.graph.inserting_after(n):
                new = gm.graph.call_function(aten.mul.Tensor, (n, 1.05))
            n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
            return new

        # a predicted gain, so the ranked apply takes it like a real rewrite
        res.apply_ranked(ctx, [Candidate("planted: scale attention output", [n], 1e-3, apply)], allow_zero_gain=True)
        return res


@pytest.fixture(scope="module")
def bert():
    model, inputs = zoo.get("bert-tiny")
    args, kwargs = split_inputs(inputs)
    with torch.no_grad():
        eager = model(*args, **kwargs)
    return model, args, kwargs, eager


def _ctx(gm, target="cpu"):
    prof = get_profile(target)[0]
    return PassContext(cost=CostModel(prof), hints=ir.shape_hints(gm), options=OptimizeOptions(precision="auto"),
                       device=torch.device("cpu"))


def _run(gm, args, kwargs):
    with torch.no_grad():
        return gm(*args, **kwargs)


def test_planted_rewrite_breaks_the_accuracy_rule_without_a_guard(bert):
    """The fault is real: applied unguarded, the output fails the rule."""
    model, args, kwargs, eager = bert
    gm = graphopt.capture(model, (args, kwargs))
    (res,) = PassManager([ScaleAttentionOutput()]).run(gm, _ctx(gm))
    assert res.status == "applied" and len(res.rewrites) == 1
    ref = accuracy.fp64_reference(model, args, kwargs)
    assert not accuracy.check(_run(gm, args, kwargs), ref, eager).passed


@pytest.mark.parametrize("target", ["cpu", "h200"])
def test_accuracy_guard_reverts_the_planted_rewrite_in_the_full_pipeline(bert, target):
    """The planted pass runs between the real passes with optimize()'s own guard: it alone is
    reverted, the others still apply, and the optimized graph passes the accuracy rule."""
    model, args, kwargs, eager = bert
    gm = graphopt.capture(model, (args, kwargs))
    guard = _AccuracyGuard(model, args, kwargs, False, torch.device("cpu"))
    real = assemble()
    cut = next(i for i, p in enumerate(real) if p.family != "cleanup")
    pipeline = real[:cut] + [ScaleAttentionOutput()] + real[cut:]
    results = PassManager(pipeline, guard).run(gm, _ctx(gm, target))
    by = {r.name: r for r in results}
    planted = by["scale_attention_planted"]
    assert planted.status == "reverted"
    assert any("accuracy" in note for note in planted.notes), planted.notes
    assert all(r.status != "reverted" for r in results if r.name != "scale_attention_planted"), \
        [(r.name, r.notes) for r in results if r.status == "reverted"]
    # no trace of the planted multiply is left in the graph
    assert not any(n.meta.get("graphopt_from", {}).get("pass") == "scale_attention_planted" for n in gm.graph.nodes)
    res = guard(gm)  # the accuracy rule on the example inputs (fp64 reference, eager's error as yardstick)
    assert res.passed, res.reason


def test_optimize_checks_once_then_per_pass_when_the_result_fails(bert, monkeypatch):
    """optimize()'s guard checks the result of all passes once; the planted fault fails that
    check, so the pipeline runs again from the captured graph with a check after each pass: the
    planted pass alone is reverted, the real passes apply, and the report says how it checked."""
    from graphopt import api

    model, args, kwargs, eager = bert

    def with_planted(passes=None, disable=None):
        real = assemble(passes, disable)
        cut = next(i for i, p in enumerate(real) if p.family != "cleanup")
        return real[:cut] + [ScaleAttentionOutput()] + real[cut:]

    calls = []
    orig = api._AccuracyGuard.__call__
    monkeypatch.setattr(api._AccuracyGuard, "__call__", lambda self, gm, low=None: calls.append(1) or orig(self, gm, low))
    monkeypatch.setattr(api, "assemble", with_planted)
    opt = graphopt.optimize(model, (args, kwargs), target="h200", cuda_graphs=False)
    by = {r.name: r for r in opt.report.passes}
    assert by["scale_attention_planted"].status == "reverted"
    applied = [r for r in opt.report.passes if r.status == "applied"]
    assert len(applied) >= 5 and all(r.accuracy["passed"] for r in applied)
    assert len(calls) == 1 + len(applied) + 1  # the failed check, one per changed graph (the planted one too)
    acc = opt.report.accuracy
    assert acc["passed"] and acc["mode"].startswith("after each pass (the check after all passes failed")
    res = accuracy.check(_run(opt.graph_module, args, kwargs), accuracy.fp64_reference(model, args, kwargs), eager)
    assert res.passed, res.reason


# ---- GPU: a wrong CUDA kernel ------------------------------------------------------------------
_WRONG = {}


def _wrong_relu_op():
    """graphopt_test::relu_off: a CUDA kernel (Triton) that computes relu(x) * 1.02."""
    if "op" in _WRONG:
        return _WRONG["op"]
    import triton
    import triton.language as tl

    @triton.jit
    def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(y_ptr + offs, tl.maximum(x, 0.0) * 1.02, mask=m)  # the planted error: 2% too big

    @torch.library.custom_op("graphopt_test::relu_off", mutates_args=(), device_types="cuda")
    def relu_off(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        _kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    @relu_off.register_fake
    def _(x):
        return torch.empty_like(x)

    _WRONG["op"] = torch.ops.graphopt_test.relu_off.default
    return _WRONG["op"]


class WrongReluKernel(Pass):
    """Planted fault on the GPU: the second ReLU -> a CUDA kernel that is 2% off."""

    name = "wrong_relu_kernel_planted"
    family = "fusion"

    def run(self, gm, ctx):
        res = self.result()
        op = _wrong_relu_op()
        relus = [n for n in gm.graph.nodes if n.target is aten.relu.default]
        cands = []
        for i, n in enumerate(relus):
            def apply(n=n, i=i):
                with gm.graph.inserting_after(n):
                    new = gm.graph.call_function(op if i == 1 else aten.relu.default, (n.args[0],))
                new.meta["val"] = n.meta["val"]
                n.replace_all_uses_with(new)
                gm.graph.erase_node(n)
                return new

            cands.append(Candidate("planted: relu kernel", [n], 1e-3 - i * 1e-6, apply, label=f"relu #{i + 1}"))
        res.apply_ranked(ctx, cands)
        return res


def _mlp_cuda():
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 16)).eval().cuda()


@pytest.mark.cuda
def test_wrong_cuda_kernel_is_reverted_by_the_guard():
    model = _mlp_cuda()
    x = torch.randn(64, 256, device="cuda")
    gm = graphopt.capture(model, (x,))
    guard = _AccuracyGuard(model, (x,), {}, False, torch.device("cuda"))
    prof = get_profile("h200")[0]
    ctx = PassContext(cost=CostModel(prof), hints=ir.shape_hints(gm), options=OptimizeOptions(precision="fp32"),
                      device=torch.device("cuda"))
    # unguarded, the kernel really is wrong on the GPU
    probe = graphopt.capture(model, (x,))
    (res,) = PassManager([WrongReluKernel()]).run(probe, ctx)
    assert res.status == "applied"
    with torch.no_grad():
        assert not accuracy.check(probe(x), accuracy.fp64_reference(model, (x,), {}), model(x)).passed
    # guarded: reverted, and the graph computes the model again
    results = PassManager(assemble(["eliminate_dead_code"]) + [WrongReluKernel()], guard).run(gm, ctx)
    assert results[-1].status == "reverted" and any("accuracy" in note for note in results[-1].notes)
    assert not any(n.target is _WRONG["op"] for n in gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


@pytest.mark.cuda
def test_bisect_names_the_wrong_cuda_kernel():
    from graphopt.tools.bisect import bisect

    model = _mlp_cuda()
    x = torch.randn(64, 256, device="cuda")
    result = bisect(model, (x,), pipeline=assemble(["eliminate_dead_code"]) + [WrongReluKernel()], precision="fp32")
    assert result.pass_name == "wrong_relu_kernel_planted"
    assert result.rewrite_index == 2 and result.rewrite.matched == ["relu_1"]
