"""insert_checkpoints: selection under a memory budget, the checkpointed graph, losses, gradients
and BatchNorm statistics by the accuracy rule (fp64 reference), dropout masks replayed, training
with the model's parameters."""

import collections
import copy
import importlib
import json

import pytest
import torch
import torch.nn as nn

from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import graphopt
from graphopt import accuracy
from graphopt.capture import capture
from graphopt.tools.cli import main
from graphopt.cost.activations import ActivationModel
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.errors import BudgetError, GraphoptError
from graphopt.examples import zoo
from tests.helpers import sgd_check, step_check

ic = importlib.import_module("graphopt.checkpoint")


def budget_model(name, resnet_res=32, resnet_batch=16):
    """The models the memory tests run: a small ResNet-18, a dropout MLP stack, or a zoo model."""
    if name == "resnet18":
        return small_resnet(batch=resnet_batch, res=resnet_res)
    if name == "stack":
        torch.manual_seed(0)
        return Stack(d=32, layers=6, p=0.3), (torch.randn(16, 32),)
    return zoo.get(name)


def small_resnet(batch=16, res=32, blocks=2):
    """torchvision's ResNet-18 (``blocks=2`` per stage), or with one BasicBlock per stage (a ResNet-10:
    the same stem, stages, downsampling shortcuts and head, half the AOT regions to compile)."""
    import torchvision
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10) if blocks == 2 else ResNet(BasicBlock, [blocks] * 4, num_classes=10)
    return model, (torch.randn(batch, 3, res, res),)


class Block(nn.Module):
    def __init__(self, d, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, d=32, layers=6, p=0.0):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, p) for _ in range(layers)])
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        return self.head(self.blocks(x))


class _Held(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.refs.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return out


class Count(TorchDispatchMode):
    """Counts the aten ops that run (by overload packet name)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def held_after_forward(fn, args):
    """Bytes of the storages made during a forward that are still alive after it (what
    autograd and checkpoint hold for backward, plus the outputs), measured on the CPU.
    Views of parameters, buffers and inputs (a weight's ``t()``) are not new storage."""
    old = {t.untyped_storage()._cdata for t in list(fn.parameters()) + list(fn.buffers()) + list(args)}
    tracker = _Held()
    with tracker:
        out = fn(*args)
    held = sum(n for key, (ref, n) in tracker.refs.items() if not ref.expired() and key not in old)
    del out
    return held


def regions(opt):
    return [m for m in opt.graph_module.modules() if isinstance(m, ic.CheckpointRegion)]


# --------------------------------------------------------------------------- graph + numerics


def test_resnet_checkpointed_step_matches_eager_with_batchnorm_statistics():
    model, args = small_resnet()
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.85, checkpoint_backend="sac")
    res = opt.report.pass_result("insert_checkpoints")
    assert res.status == "applied"
    rs = regions(opt)
    assert rs and sum(len(r.recomputed) for r in rs) > 0
    recomputed = {n for r in rs for n in r.recomputed}
    assert any(n.startswith("batch_norm") for n in recomputed)  # BN recomputed, stats still once
    d = res.details
    # the budget covers the step's activation memory: saved, transient, outputs, backward working set
    assert (d["predicted_saved_bytes"] + d["recompute_transient_bytes"] + d["output_bytes"]
            + d["backward_working_bytes"]) <= d["budget_bytes"]
    assert d["predicted_activation_bytes"] <= d["budget_bytes"]
    # a fraction of the model's activations as captured (the passes before this one changed them)
    assert d["budget_bytes"] == pytest.approx(0.85 * d["captured_activation_bytes"])
    assert d["extra_ms"] > 0 and d["by_layer"]
    model.train()
    step_check(model, opt, args)  # loss, gradients and BatchNorm statistics (updated once: the counters equal)
    assert int(model.bn1.num_batches_tracked) == 1


@pytest.mark.parametrize("name,budget", [("resnet18", 0.85), ("resnet18", 0.92), ("stack", 0.5), ("glm4-tiny", 0.7)])
def test_memory_held_after_the_forward_is_what_was_predicted(name, budget):
    model, args = budget_model(name)
    ref = copy.deepcopy(model).train()
    opt = graphopt.optimize(model, args, training=True, memory_budget=budget, check_accuracy=False,
                            checkpoint_backend="sac")
    d = opt.report.pass_result("insert_checkpoints").details
    model.train()
    eager = held_after_forward(ref, args)
    ours = held_after_forward(opt, args)
    assert eager == pytest.approx(d["baseline_held_bytes"], rel=0.15)
    assert ours == pytest.approx(d["predicted_held_bytes"], rel=0.15)
    assert ours <= d["budget_bytes"] * 1.15 and ours < eager  # the model's 15%


def test_dropout_masks_are_replayed_in_recomputation():
    torch.manual_seed(0)
    model = Stack(d=32, layers=6, p=0.3)
    args = (torch.randn(16, 32),)
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.5, checkpoint_backend="sac")
    recomputed = {n for r in regions(opt) for n in r.recomputed}
    assert any("dropout" in n for n in recomputed), recomputed
    model.train()
    for seed in (1, 2):  # a rerun drawing other masks would give other gradients
        step_check(model, opt, args, seed)


def test_optimizer_on_model_parameters_trains_the_optimized_module():
    torch.manual_seed(0)
    model = Stack(d=32, layers=4)
    args = (torch.randn(16, 32),)
    keys = list(model.state_dict())
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.6, checkpoint_backend="sac")
    assert regions(opt)
    assert {id(p) for p in opt.parameters()} == {id(p) for p in model.parameters()}
    assert list(model.state_dict()) == keys
    model.train()
    sgd_check(model, opt, args, steps=3)


# --------------------------------------------------------------------------- selection


def _meta_model(model, x):
    """Capture a realistic-size model on the meta device (no memory) and model it for the H200."""
    gm = capture(model.train(), (x,))
    prof, _ = get_profile("h200")
    return ActivationModel.build(gm, CostModel(prof), device_kind="cuda")


def test_selection_recomputes_cheap_memory_bound_ops_before_gemms():
    with torch.device("meta"):
        model = Stack(d=2048, layers=8)
        x = torch.randn(16384, 2048)
    am = _meta_model(model, x)
    sel = ic.planner._Selector(am)
    order = sel.order()
    kind = lambda n: str(n.target).split(".")[-2]  # noqa: E731
    first_linear = next(i for i, n in enumerate(order) if kind(n) == "linear")
    cheap = [i for i, n in enumerate(order) if kind(n) in ("layer_norm", "gelu")]
    assert cheap and max(cheap) < first_linear
    base = am.baseline_saved_bytes()
    plan = sel.select(0.65 * base, [s * base for s in ic.planner.REGION_SHARES])
    recomputed = {kind(n) for n in am.body if n not in plan.keep}
    assert {"layer_norm", "gelu"} <= recomputed
    linears = [n for n in am.body if kind(n) == "linear"]
    assert all(n in plan.keep for n in linears)  # every GEMM stays kept at this budget
    assert plan.total_bytes <= 0.65 * base
    tighter = sel.select(0.5 * base, [s * base for s in ic.planner.REGION_SHARES])
    assert tighter.extra_s > plan.extra_s and not all(n in tighter.keep for n in linears)


def test_budget_below_the_achievable_minimum_raises_with_the_minimum():
    model, args = small_resnet()
    with pytest.raises(BudgetError, match=r"achievable minimum .* of the baseline activation memory"):
        graphopt.optimize(model, args, training=True, memory_budget=0.01, check_accuracy=False)


# --------------------------------------------------------------------------- when it must not fire


def test_inference_and_no_budget_and_a_budget_that_fits_change_nothing():
    torch.manual_seed(0)
    model, args = Stack(d=16, layers=2), (torch.randn(4, 16),)
    inf = graphopt.optimize(model, args)
    r = inf.report.pass_result("insert_checkpoints")
    assert r.status == "unchanged" and "inference" in r.notes[0]
    tr = graphopt.optimize(model, args, training=True)
    r = tr.report.pass_result("insert_checkpoints")
    assert r.status == "unchanged" and "no memory_budget" in r.notes[0]
    fits = graphopt.optimize(model, args, training=True, memory_budget="1GB")
    r = fits.report.pass_result("insert_checkpoints")
    assert r.status == "unchanged" and "fit the budget" in r.notes[0] and not regions(fits)
    assert r.details["predicted_saved_bytes"] == r.details["baseline_saved_bytes"]


def test_memory_budget_needs_training():
    model, args = Stack(d=16, layers=2), (torch.randn(4, 16),)
    with pytest.raises(GraphoptError, match="training=True"):
        graphopt.optimize(model, args, memory_budget=0.5)
    with pytest.raises(GraphoptError, match="memory_budget"):
        graphopt.optimize(model, args, training=True, memory_budget="lots")


# --------------------------------------------------------------------------- CLI / report


def test_cli_explain_training_memory_budget(capfd, tmp_path):
    path = tmp_path / "r.json"
    rc = main(["explain", "bert-tiny", "--batch", "32", "--seq-len", "128", "--training", "--memory-budget", "0.75",
               "--json", str(path)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "activation memory (saved for backward)" in out and "encoder.layer.0" in out
    data = json.loads(path.read_text())
    ck = next(p for p in data["passes"] if p["name"] == "insert_checkpoints")
    assert ck["status"] == "applied" and ck["details"]["predicted_saved_bytes"] < ck["details"]["baseline_saved_bytes"]
    rc = main(["explain", "mlp", "--training", "--memory-budget", "8XB"])
    out, err = capfd.readouterr()
    assert rc == 2 and len((out + err).strip().splitlines()) == 1 and "memory_budget" in out + err


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_full_pipeline_planned_for_a_gpu_keeps_the_checkpoints():
    """With the H200 plan other passes run first (channels_last adds an input clone that
    export's _guards_fn reads, interleaved with the first region): the regions still apply."""
    model, args = small_resnet()
    opt = graphopt.optimize(model, args, training=True, memory_budget=0.85, checkpoint_backend="sac", target="h200")
    res = opt.report.pass_result("insert_checkpoints")
    assert res.status == "applied", res.notes
    assert regions(opt)
    model.train()
    step_check(model, opt, args, layouts=opt.report.pass_result("convert_channels_last").status == "applied")


def test_dynamic_batch_plan_runs_at_other_batch_sizes():
    torch.manual_seed(0)
    model = Stack(d=32, layers=6)
    opt = graphopt.optimize(model, (torch.randn(16, 32),), training=True, memory_budget=0.5, checkpoint_backend="sac",
                            dynamic={"x": {0: "batch"}})
    assert opt.report.pass_result("insert_checkpoints").status == "applied" and regions(opt)
    model.train()
    step_check(model, opt, (torch.randn(24, 32),))


def test_split_at_kept_gemms_plain_regions():
    """A region cut after each kept convolution where only kept values cross runs as plain
    checkpoints (checkpoint's early stop repacks a convolution's saved input before the
    convolution would rerun: no per-op dispatch mode); a residual that would cross a cut keeps
    the region whole and selective."""
    import torch.nn as nn

    from graphopt import capture
    from graphopt.checkpoint.sac import split_at_kept_gemms

    class Chain(nn.Module):
        def __init__(self, residual):
            super().__init__()
            self.residual = residual
            self.bn1, self.c1 = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)
            self.bn2, self.c2 = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            h = self.c1(torch.relu(self.bn1(x)))
            y = self.c2(torch.relu(self.bn2(h)))
            return y + x if self.residual else y

    for residual, expect in ((False, [False, False]), (True, [True])):
        gm = capture(Chain(residual).train(), (torch.randn(2, 4, 8, 8),))
        body = [n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target) or
                n.op == "call_function" and any(k in str(n.target) for k in ("batch_norm", "relu", "add.Tensor"))]
        x = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "x")
        body = [x] + body  # x is produced inside the region, as a previous block's output would be
        keep = {n for n in body if "conv" in str(n.target)}
        subs = split_at_kept_gemms(body, keep)
        assert [sel for _, sel in subs] == expect, [(len(s), sel) for s, sel in subs]
        assert [n for s, _ in subs for n in s] == body


def test_plain_regions_recompute_the_cheap_ops_but_not_the_convolutions():
    """A conv chain at a 0.8 budget: regions ending in a kept convolution run as plain checkpoints
    (no selective dispatch mode); the backward reruns batch norm and ReLU but no convolution
    (checkpoint's early stop); gradients and running statistics pass the accuracy rule."""
    from graphopt import checkpoint as ic

    class ConvChain(nn.Module):
        def __init__(self):
            super().__init__()
            self.bns = nn.ModuleList(nn.BatchNorm2d(16) for _ in range(4))
            self.convs = nn.ModuleList(nn.Conv2d(16, 16, 3, padding=1) for _ in range(4))

        def forward(self, x):
            for bn, conv in zip(self.bns, self.convs):
                x = conv(torch.relu(bn(x)))
            return x

    torch.manual_seed(0)
    model, x = ConvChain().train(), torch.randn(4, 16, 32, 32)
    opt = graphopt.optimize(model, (x,), training=True, memory_budget=0.8, checkpoint_backend="sac", check_accuracy=False,
                            passes=["insert_checkpoints"], target="h200")
    regions = [m for m in opt.graph_module.modules() if isinstance(m, ic.CheckpointRegion)]
    assert any(not r.selective for r in regions)
    step_check(model, opt, (x,))
    out = opt(x)
    with Count() as backward:
        out.square().mean().backward()
    assert backward.ops["native_batch_norm"] > 0 and backward.ops["convolution"] == 0


# --------------------------------------------------------------------------- in-place writes into regions' values


class ScoresBias(nn.Module):
    """MViT's attention: the scores written in place through a slice (``attn[:, 1:, 1:] += bias``)."""

    def __init__(self, d=64, n=33):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(n - 1, n - 1) * 0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        attn = q @ k.transpose(-2, -1)
        attn[:, 1:, 1:] += self.bias
        return x + self.proj(attn.softmax(-1) @ v)


def scores_bias_grads_match_eager(backend, budget):
    """One training step through optimize(memory_budget=budget) on four ScoresBias blocks: the loss and
    every parameter's gradient (none missing) against float64 by the accuracy rule."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[ScoresBias() for _ in range(4)]).train(), torch.randn(2, 33, 64)
    opt = graphopt.optimize(model, x, training=True, memory_budget=budget, checkpoint_backend=backend)
    step_check(model, opt, (x,))
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("budget", [0.9, 0.7])
def test_a_kept_value_the_region_writes_in_place_is_rerun_not_cached(budget):
    # the selective policy's cache held the GEMM's scores after the write; the rerun wrote them again
    scores_bias_grads_match_eager("sac", budget)


def test_a_region_writing_its_input_through_a_view_does_not_save_it():
    from graphopt.checkpoint.extract import extract_region
    from graphopt.pipeline import PassContext

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(4, 4))

        def forward(self, q, k):
            attn = q @ k.transpose(-2, -1)
            attn[:, 1:, 1:] += self.bias
            return attn.softmax(-1)

    torch.manual_seed(0)
    m, q, k, g = M().train(), torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 5, 8), torch.randn(2, 5, 5)
    gm = capture(m, (q, k))
    nodes = list(gm.graph.nodes)
    i = next(j for j, n in enumerate(nodes) if n.op == "call_function" and "matmul" in str(n.target))
    prof = get_profile("cpu")[0]
    # a region cut after the scores' GEMM: it writes its input in place (slice, add_, copy_)
    extract_region(gm, [n for n in nodes[i + 1:] if n.op == "call_function"], set(), "ckpt_r",
                   PassContext(profile=prof, cost=CostModel(prof)))
    gm.recompile()
    assert gm.ckpt_r.mutated == (0,)
    (gm(q, k) * g).sum().backward()
    got = [q.grad.clone(), m.bias.grad.clone()]
    q.grad = m.bias.grad = None
    (m(q, k) * g).sum().backward()
    eager = [q.grad.clone(), m.bias.grad.clone()]
    q64 = q.detach().double().requires_grad_()
    m64 = copy.deepcopy(m).double()
    (m64(q64, k.double()) * g.double()).sum().backward()
    res = accuracy.check(got, [q64.grad, m64.bias.grad], eager, training=True)
    assert res.passed, res.reason


class GRUHead(nn.Module):
    """nn.GRU (aten.gru: sigmoid_ and tanh_ on chunks of its gates' GEMM, below the graph) and a head
    reading its batch-first output, a transposed view."""

    def __init__(self, dropout=0.0, layers=1):
        super().__init__()
        self.rnn = nn.GRU(8, 16, num_layers=layers, dropout=dropout, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        out, h = self.rnn(x)
        return self.head(out), h


@pytest.mark.parametrize("backend", ["sac", "auto"])
def test_a_recurrent_layer_kept_under_a_budget_trains_as_eager(backend):
    # torch's selective checkpoint cannot cache what aten.gru decomposes into (its rerun took another
    # path: "aten.view.default encountered during backward but not found in storage"): it runs
    # outside the regions
    from graphopt.checkpoint.sac import writes_below_the_graph

    torch.manual_seed(0)
    model, x = GRUHead().train(), torch.randn(3, 6, 8)
    opt = graphopt.optimize(model, (x,), training=True, memory_budget=0.6, checkpoint_backend=backend)
    assert [n for n in opt.graph_module.graph.nodes if n.op == "call_function" and "gru" in str(n.target)]
    step_check(model, opt, (x,))
    gm = capture(model, (x,))
    flags = {str(n.target): writes_below_the_graph(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert flags["aten.gru.input"] and not flags["aten.linear.default"]


def test_a_recurrent_layer_draws_random_numbers_only_with_dropout_between_layers():
    from graphopt import ir

    for dropout, layers, train, random in ((0.0, 1, True, False), (0.3, 2, True, True), (0.3, 2, False, False)):
        model = GRUHead(dropout, layers).train(train)
        gm = capture(model, (torch.randn(2, 4, 8),))
        gru = next(n for n in gm.graph.nodes if n.op == "call_function" and "gru" in str(n.target))
        assert ir.is_random(gru) is random, (dropout, layers, train)


class Timesteps(nn.Module):
    """A diffusion model's time embedding: integer timesteps cast to float32 in the forward."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x, t):
        freqs = torch.exp(-torch.arange(4, dtype=torch.float32) / 4)
        ang = t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([ang.sin(), ang.cos()], 1)) + x


def test_training_a_model_that_casts_to_float32_itself_is_judged_in_float64():
    # the float64 copy's own .float() is widened (as the guard's reference does), so the check runs
    torch.manual_seed(0)
    model = Timesteps().train()
    args = (torch.randn(2, 4), torch.tensor([3, 250]))
    step_check(model, graphopt.optimize(model, args, training=True), args)


class WeightNormed(nn.Module):
    """Weight-normalized layers (torch.nn.utils.parametrizations.weight_norm): a model this small fits
    a budget only by the AOT graphs' own saved tensors, recomputing nothing."""

    def __init__(self):
        super().__init__()
        wn = torch.nn.utils.parametrizations.weight_norm
        self.conv, self.lin = wn(nn.Conv1d(4, 8, 3, padding=1)), wn(nn.Linear(8, 3))

    def forward(self, x):
        return self.lin(torch.relu(self.conv(x)).mean(-1))


def test_the_minimum_a_budget_error_names_is_a_budget_that_trains():
    # the AOT plan at the minimum recomputed nothing; the rewrite refused it ("no region recomputes
    # anything") and the selective checkpoint's own minimum, higher, came back as a second error
    torch.manual_seed(0)
    model, x = WeightNormed().train(), torch.randn(2, 4, 10)
    with pytest.raises(BudgetError) as e:
        graphopt.optimize(model, (x,), training=True, memory_budget=0.3)
    assert e.value.minimum and "raise memory_budget to at least" in str(e.value)
    opt = graphopt.optimize(model, (x,), training=True, memory_budget=int(e.value.minimum * 1.02))
    step_check(model, opt, (x,))
