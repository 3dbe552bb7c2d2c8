"""insert_checkpoints on a GLM-4 decoder (tiny, SDPA attention), planned for the H200: the budget
covers the step's activation memory, attention is never recomputed (the GEMMs recomputed are the
MLP's), the AOT backward saves what the plan predicts, gradients follow eager by the accuracy
rule, and a budget below the minimum raises BudgetError stating it."""

import copy
import importlib

import pytest
import torch

import graphopt
from graphopt.errors import BudgetError
from graphopt.examples import zoo
from tests.helpers import step_check
from tests.passes.test_insert_checkpoints import held_after_forward
from tests.passes.test_insert_checkpoints_aot import aot_modules

aot = importlib.import_module("graphopt.checkpoint.aot")

pytestmark = pytest.mark.skipif(aot.available() is not None, reason=f"AOT backend unavailable: {aot.available()}")


def glm_sdpa(batch=2, seq=64):
    from transformers import Glm4ForCausalLM

    cfg = zoo.glm4_tiny_config()
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    model = Glm4ForCausalLM(cfg)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


def module_of(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


@pytest.fixture(scope="module")
def planned():
    model, args = glm_sdpa()
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.6, passes=["insert_checkpoints"],
                            check_accuracy=False, target="h200")
    return model, args, opt, opt.report.pass_result("insert_checkpoints").details


def test_plan_fits_the_step_budget_and_never_recomputes_attention(planned):
    model, args, opt, d = planned
    assert d["backend"] == "aot" and d["regions"] >= 1
    # the budget is a fraction of the step's activation memory (saved + outputs + backward working set)
    assert d["budget_bytes"] == pytest.approx(0.6 * d["baseline_activation_bytes"])
    assert d["predicted_activation_bytes"] <= d["budget_bytes"]
    assert d["predicted_saved_bytes"] < 0.6 * d["baseline_saved_bytes"]
    recomputed = d["recomputed_by_op"]
    assert "scaled_dot_product_attention" not in recomputed and recomputed.get("mul", {}).get("count", 0) > 0
    # what the AOT backward graphs rerun: no attention kernel; the GEMMs rerun are decoder-layer
    # projections (cheapest seconds per byte: o_proj, the MLP's), never the LM head
    reruns = d["aot_recomputed_by_op"]
    assert not any("attention" in op for op in reruns), reruns
    body_nodes = {n.name: n for m in aot_modules(opt) for n in m.body.graph.nodes}
    gemms = [tag for m in aot_modules(opt) for info in m.partitions.values() for _, tag, target in info["recomputed"]
             if "mm" in target]
    assert gemms, reruns
    mods = [module_of(body_nodes[t]) for t in gemms]
    assert all(".layers." in m and m.endswith("_proj") for m in mods), mods


def test_aot_saves_what_the_plan_predicts_and_gradients_follow_eager(planned):
    model, args, opt, d = planned
    assert d["aot_saved_bytes"] == pytest.approx(d["predicted_saved_bytes"], rel=0.15)
    ref = copy.deepcopy(model).train()
    model.train()
    eager, ours = held_after_forward(ref, args), held_after_forward(opt, args)
    assert ours == pytest.approx(d["predicted_held_bytes"], rel=0.15) and ours < 0.75 * eager
    step_check(model, opt, args)


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_budget_below_the_minimum_raises_with_the_minimum():
    model, args = glm_sdpa()
    with pytest.raises(BudgetError, match=r"achievable minimum .* of the baseline activation memory"):
        graphopt.optimize(model, args, training=True, memory_budget=0.2, passes=["insert_checkpoints"],
                          check_accuracy=False, target="h200", checkpoint_backend="aot")


def test_after_fuse_attention_sdpa_reads_unrepeated_kv_and_the_plan_still_fits(planned):
    """fold_constants + fuse_attention first (SDPA is_causal with enable_gqa, as eager calls it):
    the checkpointed step saves less than with the captured SDPA (``planned``: insert_checkpoints
    alone) and gradients follow eager."""
    model, args = glm_sdpa()
    kw = dict(training=True, memory_budget=0.6, check_accuracy=False, target="h200")
    opt = graphopt.optimize(model, args, passes=["fold_constants", "fuse_attention", "insert_checkpoints"], **kw)
    d0 = planned[3]
    d = opt.report.pass_result("insert_checkpoints").details
    sds = [n for n in opt.graph_module.graph.nodes if n.op == "call_module"]
    bodies = [n for m in aot_modules(opt) for n in m.body.graph.nodes if "scaled_dot_product" in str(n.target)]
    outside = [n for n in opt.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sds and all(n.kwargs.get("enable_gqa") for n in bodies + outside) and bodies + outside
    assert d["backend"] == "aot" and d["baseline_saved_bytes"] < d0["baseline_saved_bytes"]
    assert d["predicted_activation_bytes"] <= d["budget_bytes"]
    assert d["aot_saved_bytes"] == pytest.approx(d["predicted_saved_bytes"], rel=0.15)
    model.train()
    step_check(model, opt, args)


def _fused_ops(opt, which):
    return sum(1 for m in aot_modules(opt) for info in m.partitions.values()
               for n in info["graphs"][which].graph.nodes
               if n.op == "call_function" and n.target is torch.ops.graphopt.fused_pointwise.default)


def test_with_fuse_elementwise_the_aot_graphs_run_fused_pointwise_kernels_and_gradients_follow_eager(planned):
    # planned for the H200 on this machine: the fused kernels run their reference evaluation here
    model, args = glm_sdpa()
    assert _fused_ops(planned[2], "fw") == 0  # insert_checkpoints alone: no fused kernels
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.6, check_accuracy=False,
                            passes=["fuse_elementwise", "insert_checkpoints"], target="h200")
    res = opt.report.pass_result("insert_checkpoints")
    # the graph's own groups are fused (fused_pointwise is differentiable); AOTAutograd traces through
    # them, and the fuser adds the groups the joint graphs make (the backward's among them)
    assert opt.report.pass_result("fuse_elementwise").status == "applied"
    d = res.details
    assert d["backend"] == "aot" and _fused_ops(opt, "fw") >= d["aot_fused_forward_groups"] and _fused_ops(opt, "fw") > 0
    assert any("pointwise fusion in the AOT graphs" in n for n in res.notes)
    step_check(model, opt, args)  # runs backward: the backward graphs are compiled (and fused) now
    assert _fused_ops(opt, "bw") > 0
    assert not any(m.fuse_errors for m in aot_modules(opt))


def test_on_a_cpu_profile_the_aot_graphs_are_not_fused():
    model, args = glm_sdpa()
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.6, check_accuracy=False,
                            passes=["fuse_elementwise", "insert_checkpoints"], target="cpu")
    assert opt.report.pass_result("insert_checkpoints").details["backend"] == "aot"
    assert _fused_ops(opt, "fw") == 0 and "aot_fused_forward_groups" not in \
        opt.report.pass_result("insert_checkpoints").details


# fuse=False in make test-all only: the same regions' gradients are checked fused here (True), and
# fuse=False's unfused regions by test_insert_checkpoints_decoders' test_the_unfused_aot_graphs_keep_their_views
@pytest.mark.parametrize("fuse", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fuse_training_graph_runs_a_training_graph_as_aot_regions_that_recompute_nothing(fuse):
    from graphopt import ir
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.checkpoint import fuse_training_graph
    from graphopt.passes.insert_checkpoints import training_fuser
    from graphopt.pipeline import PassContext

    model, args = glm_sdpa()
    opt = graphopt.optimize(model, args, training=True, passes=[], check_accuracy=False, target="h200",
                            cuda_graphs=False)
    gm = opt.graph_module
    profile, _ = get_profile("h200")
    ctx = PassContext(profile=profile, cost=CostModel(profile), training=True, hints=ir.shape_hints(gm),
                      scheduled=frozenset({"fuse_elementwise"}))
    res = fuse_training_graph(gm, ctx, training_fuser(ctx), regions=4, fuse=fuse)
    mods = aot_modules(opt)
    assert res.status == "applied" and len(mods) == res.details["aot_regions"] >= 2
    assert all(not info["recomputed"] for m in mods for info in m.partitions.values())
    assert (_fused_ops(opt, "fw") > 0) == fuse
    step_check(model, opt, args)


def test_fuse_training_graph_leaves_a_cpu_plan_alone():
    from graphopt import ir
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.checkpoint import fuse_training_graph
    from graphopt.passes.insert_checkpoints import training_fuser
    from graphopt.pipeline import PassContext

    model, args = glm_sdpa()
    opt = graphopt.optimize(model, args, training=True, passes=[], check_accuracy=False, target="cpu")
    profile, _ = get_profile("cpu")
    ctx = PassContext(profile=profile, cost=CostModel(profile), training=True, hints=ir.shape_hints(opt.graph_module),
                      scheduled=frozenset({"fuse_elementwise"}))
    res = fuse_training_graph(opt.graph_module, ctx, training_fuser(ctx))
    assert res.status == "unchanged" and "no pointwise fusion" in res.notes[0]
    assert not any(isinstance(m, aot.AotRecompute) for m in opt.graph_module.modules())
