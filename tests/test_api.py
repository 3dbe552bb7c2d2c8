"""The public API: optimize() returns a module that matches eager, carries its report, guards
its inputs, honours dynamic dims, and in training mode shares the model's parameters."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx
from torch import nn

import graphopt
from graphopt import accuracy
from graphopt.examples import zoo
from graphopt.pipeline import PassResult, assemble
from tests.helpers import step_check

PIPELINE = [p.name for p in assemble()]  # the declared pipeline, less passes not built yet
STATUSES = {"applied", "unchanged", "skipped", "reverted", "disabled"}


def _chosen_dtype(opt):
    """The compute dtype the optimizer chose (assign_precision may lower fp32 to bf16/fp16)."""
    try:
        res = opt.report.pass_result("assign_precision")
    except KeyError:
        return None
    name = getattr(res, "details", {}).get("dtype") if res.status == "applied" else None
    return getattr(torch, name) if name else None


def _rule(out, model, inputs, opt, training=False):
    """The accuracy rule (docs/design.md) against an fp64 copy of the model, with the tolerance of the
    precision the optimizer chose."""
    with torch.no_grad():
        eager = model(*inputs)
    kw = {"dtype": _chosen_dtype(opt)} if _chosen_dtype(opt) is not None else {}
    return accuracy.check(out, accuracy.fp64_reference(model, tuple(inputs), {}), eager, training=training, **kw)


@pytest.fixture(scope="module")
def mlp():
    model, inputs = zoo.get("mlp")
    return model, inputs, graphopt.optimize(model, inputs)


@pytest.fixture(scope="module")
def mlp_dynamic():
    model, inputs = zoo.get("mlp")
    return model, inputs, graphopt.optimize(model, inputs, dynamic={"x": {0: "batch"}})


# ----------------------------------------------------------------------------- inference


def test_optimize_returns_a_module_matching_eager(mlp):
    model, inputs, opt = mlp
    assert isinstance(opt, nn.Module) and isinstance(opt, graphopt.OptimizedModule)
    assert isinstance(opt.graph_module, fx.GraphModule)
    with torch.no_grad():
        out = opt(*inputs)
    assert out.shape == model(*inputs).shape
    res = _rule(out, model, inputs, opt)
    assert res.passed, res.reason
    # not the same inputs it was optimized on: still right
    x = torch.randn_like(inputs[0])
    with torch.no_grad():
        res = _rule(opt(x), model, (x,), opt)
    assert res.passed, res.reason


def test_report_has_a_record_per_pass(mlp):
    _, _, opt = mlp
    report = opt.report
    assert isinstance(report, graphopt.Report)
    assert [p.name for p in report.passes] == PIPELINE
    for p in report.passes:
        assert isinstance(p, PassResult) and p.status in STATUSES
    assert report.accuracy["checked"] and report.accuracy["passed"]
    assert report.predicted_s_after <= report.predicted_s_before
    assert report.model == "MLP" and report.device == "cpu"


def test_conv_bn_folded_for_inference_and_report_says_so():
    model, inputs = zoo.get("shape-branch")
    opt = graphopt.optimize(model, inputs)
    fold = opt.report.pass_result("fold_conv_bn")
    assert fold.status == "applied" and len(fold.rewrites) == 2
    ops = {str(n.target) for n in opt.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in o for o in ops), ops
    with torch.no_grad():
        res = _rule(opt(*inputs), model, inputs, opt)
    assert res.passed, res.reason


def test_explain_returns_the_report():
    model, inputs = zoo.get("mlp")
    report = graphopt.explain(model, inputs, passes=["eliminate_dead_code"])
    assert isinstance(report, graphopt.Report)
    assert [p.name for p in report.passes] == ["eliminate_dead_code"]


def test_disable_and_unknown_pass():
    model, inputs = zoo.get("shape-branch")
    opt = graphopt.optimize(model, inputs, disable=["fold_conv_bn"])
    assert opt.report.pass_result("fold_conv_bn").status == "disabled"
    assert any("batch_norm" in str(n.target) for n in opt.graph_module.graph.nodes)
    with pytest.raises(graphopt.PassConfigError, match="no_such_pass"):
        graphopt.optimize(model, inputs, passes=["no_such_pass"])


# ----------------------------------------------------------------------------- the guard


@pytest.mark.parametrize("case", ["batch", "features", "rank", "dtype", "two inputs", "no inputs", "not a tensor"])
def test_guard_rejects_other_inputs(mlp, case):
    _, inputs, opt = mlp
    (x,) = inputs
    bad = {
        "batch": (torch.randn(x.shape[0] + 1, x.shape[1]),),
        "features": (torch.randn(x.shape[0], x.shape[1] + 1),),
        "rank": (x.unsqueeze(0),),
        "dtype": (x.double(),),
        "two inputs": (x, x),
        "no inputs": (),
        "not a tensor": (x.tolist(),),
    }[case]
    with pytest.raises(graphopt.GuardError) as ei:
        opt(*bad)
    assert "\n" not in str(ei.value) and str(ei.value)
    assert isinstance(ei.value, graphopt.GraphoptError)


def test_dynamic_batch(mlp_dynamic):
    model, inputs, opt = mlp_dynamic
    assert opt.report.capture["dynamic"] == {"x": {"0": "batch"}}
    for batch in (1, 3, 17):
        x = torch.randn(batch, inputs[0].shape[1])
        with torch.no_grad():
            res = _rule(opt(x), model, (x,), opt)
        assert res.passed, (batch, res.reason)
    with pytest.raises(graphopt.GuardError):  # only the batch dim is dynamic
        opt(torch.randn(3, inputs[0].shape[1] + 1))


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(50, 8), nn.Linear(8, 8)

    def forward(self, ids, mask=None, scale=None):
        return self.lin(self.emb(ids)) * mask[..., None] * scale.sum()


def test_dynamic_dims_follow_keyword_order():
    """Keyword inputs given in another order than the forward's parameters: the dynamic dims
    are those of the named inputs (they were given by parameter order to the flat inputs, so a
    legal call raised GuardError and the guard let another input's size vary)."""
    torch.manual_seed(0)
    model = _Masked().eval()
    scale = torch.rand(3)
    example = {"scale": scale, "mask": torch.ones(2, 6), "ids": torch.randint(0, 50, (2, 6))}
    opt = graphopt.optimize(model, example, dynamic={"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}},
                            check_accuracy=False)
    call = {"ids": torch.randint(0, 50, (3, 7)), "mask": torch.rand(3, 7), "scale": scale}
    with torch.no_grad():
        out, eager = opt(**call), model(**call)
    res = accuracy.check(out, accuracy.fp64_reference(model, (), call), eager)
    assert res.passed, res.reason
    with pytest.raises(graphopt.GuardError):  # scale is not dynamic
        opt(**dict(call, scale=torch.rand(4)))


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def mlp_training():
    model, inputs = zoo.get("mlp")
    model.train()
    # fp32 training (tolerance 1e-3): what these tests hold the gradients to
    return model, inputs, graphopt.optimize(model, inputs, training=True, precision="fp32")


def test_training_shares_the_models_parameters(mlp_training):
    model, _, opt = mlp_training
    mine, theirs = list(opt.parameters()), list(model.parameters())
    assert len(mine) == len(theirs) > 0
    assert all(any(p is q for q in theirs) for p in mine)
    assert all(any(p is q for q in mine) for p in theirs)


def test_training_grads_match_eager(mlp_training):
    model, inputs, opt = mlp_training
    (x,) = inputs
    x = torch.randn_like(x)
    eager_model = copy.deepcopy(model)
    ref64_model = copy.deepcopy(model).double()
    for m in (model, eager_model, ref64_model):
        m.zero_grad(set_to_none=True)
    opt(x).square().mean().backward()
    eager_model(x).square().mean().backward()
    ref64_model(x.double()).square().mean().backward()
    got = [p.grad for p in model.parameters()]
    assert all(g is not None for g in got)
    res = accuracy.check(got, [p.grad for p in ref64_model.parameters()], [p.grad for p in eager_model.parameters()],
                         training=True)
    assert res.passed, res.reason


def test_training_optimizer_step_reaches_the_optimized_module(mlp_training):
    """An optimizer built on model.parameters() trains the optimized module too."""
    model, inputs, opt = mlp_training
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before = opt(*inputs).detach()
    sgd.zero_grad()
    opt(*inputs).square().mean().backward()
    sgd.step()
    after = opt(*inputs).detach()
    assert not torch.allclose(before, after)
    res = _rule(after, model, inputs, opt)  # the module runs the updated weights
    assert res.passed, res.reason


@pytest.fixture(scope="module")
def conv_bn_training():
    model, inputs = zoo.get("shape-branch")
    model.train()
    # fp32, so running statistics can be compared with eager's at fp32 tolerance
    return model, inputs, graphopt.optimize(model, inputs, training=True, precision="fp32")


def _bns(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_training_does_not_fold_conv_bn(conv_bn_training):
    model, _, opt = conv_bn_training
    fold = opt.report.pass_result("fold_conv_bn")
    assert fold.status == "skipped" and not fold.rewrites
    assert model.training  # left as the user had it
    n_bn = sum("batch_norm" in str(n.target) for n in opt.graph_module.graph.nodes)
    assert n_bn == len(_bns(model)) == 2


def test_training_batchnorm_running_stats_update_as_in_eager(conv_bn_training):
    """A step's loss, gradients and running statistics by the accuracy rule; the counters as eager's."""
    model, inputs, opt = conv_bn_training
    eager = step_check(model, opt, (torch.randn_like(inputs[0]),))
    for bn, ebn in zip(_bns(model), _bns(eager)):
        assert int(bn.num_batches_tracked) == int(ebn.num_batches_tracked)


def test_training_optimize_leaves_running_stats_alone():
    model, inputs = zoo.get("shape-branch")
    model.train()
    before = copy.deepcopy([(bn.running_mean, bn.running_var, int(bn.num_batches_tracked)) for bn in _bns(model)])
    graphopt.optimize(model, inputs, training=True, passes=["eliminate_dead_code"])
    for bn, (mean, var, n) in zip(_bns(model), before):
        assert int(bn.num_batches_tracked) == n
        assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("device", [
    # (id not "cuda": conftest skips tests with a "cuda" keyword on machines without a GPU)
    pytest.param("cuda", id="absent-gpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")),
    "meta",
    "not-a-device",
])
def test_device_mismatch_or_unknown(mlp, device):
    model, inputs, _ = mlp
    with pytest.raises(graphopt.GraphoptError) as ei:
        graphopt.optimize(model, inputs, device=device)
    assert "\n" not in str(ei.value)


def test_input_on_another_device_than_the_model(mlp):
    model, inputs, _ = mlp
    with pytest.raises(graphopt.GraphoptError, match="input"):
        graphopt.optimize(model, (inputs[0].to("meta"),))


@pytest.mark.parametrize("model", [lambda x: x + 1, "mlp", None, torch.nn.Linear])
def test_not_a_module(model):
    with pytest.raises(graphopt.GraphoptError, match="nn.Module"):
        graphopt.optimize(model, (torch.randn(2, 2),))


def test_keyword_and_positional_calls_are_the_same_call():
    model, (ids, mask) = zoo.get("bert-tiny")
    opt = graphopt.optimize(model, (ids, mask), precision="fp32")
    a = opt(ids, mask).last_hidden_state
    b = opt(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(a, b)
    with pytest.raises(graphopt.GuardError, match="token_type_ids"):
        opt(ids, mask, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(graphopt.GuardError, match="missing"):
        opt(input_ids=ids)


def test_on_new_shape_reoptimize_specializes_and_stays_correct():
    model, (x,) = zoo.get("mlp")
    opt = graphopt.optimize(model, (x,), precision="fp32", on_new_shape="reoptimize")
    bigger = torch.randn(3, x.shape[1])
    with pytest.warns(RuntimeWarning, match="re-optimizing"):
        out = opt(bigger)
    res = _rule(out, model, (bigger,), opt)
    assert res.passed, res.reason
    opt(bigger)  # cached: no second optimization
    assert len(opt._specializations) == 1
    assert any("specialization" in n for n in opt.report.notes)
    with pytest.raises(graphopt.GraphoptError, match="on_new_shape"):
        graphopt.optimize(model, (x,), on_new_shape="sometimes")


def test_reoptimize_reuses_a_specialization_whose_dynamic_dims_take_the_call():
    """dynamic= batch with on_new_shape="reoptimize": a new sequence length is optimized again, and
    the specialization (dynamic in the batch too) serves that length at every batch size (it was
    keyed by exact shapes: one re-optimization per batch size, then GuardError at the limit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    opt = graphopt.optimize(model, (torch.randn(2, 4, 8),), dynamic={"input": {0: "batch"}},
                            on_new_shape="reoptimize", check_accuracy=False, measure=False)
    with pytest.warns(RuntimeWarning, match="re-optimizing"):
        opt(torch.randn(3, 5, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for batch in (2, 4, 7):
            x = torch.randn(batch, 5, 8)
            with torch.no_grad():
                out, eager = opt(x), model(x)
            res = accuracy.check(out, accuracy.fp64_reference(model, (x,), {}), eager)
            assert res.passed, res.reason
    assert len(opt._specializations) == 1


class _ScaledGate(nn.Module):
    """Python scalars as arguments: torch.export holds ``k`` and ``flag`` as constants of the graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, k: int = 2, flag: bool = True):
        y = self.lin(x) * k
        return y.relu() if flag else y


@pytest.mark.parametrize("other", [(5, True), (3, False), (3.0, True)], ids=["value", "bool", "type"])
def test_a_changed_scalar_argument_is_a_guard_error_and_reoptimize_takes_it(other):
    """A scalar argument the graph captured as a constant, called with another value (or an equal one
    of another type), is a one-line GuardError (torch's own guard raised an AssertionError, and
    without it the graph would compute with the old value); on_new_shape="reoptimize" optimizes
    again for it and matches the model (measure=False: the module must run the graph, not the model)."""
    torch.manual_seed(0)
    model, x = _ScaledGate().eval(), torch.randn(2, 8)
    opt = graphopt.optimize(model, (x, 3, True), precision="fp32", measure=False)
    with torch.no_grad():
        assert torch.equal(opt(x, 3, True), model(x, 3, True))
        with pytest.raises(graphopt.GuardError, match="when optimized") as ei:
            opt(x, *other)
    assert "\n" not in str(ei.value)
    again = graphopt.optimize(model, (x, 3, True), precision="fp32", measure=False, on_new_shape="reoptimize")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="re-optimizing"):
        out = again(x, *other)
    res = accuracy.check(out, accuracy.fp64_reference(model, (x, *other), {}), model(x, *other))
    assert res.passed, res.reason


def test_optimize_hands_the_process_objects_back_to_the_collector(unfrozen):
    """optimize() freezes the process's existing objects for its duration so its collections scan
    only what it creates (api._collect_young_only); afterwards nothing stays frozen, the collector
    is as it was, and objects the caller froze stay frozen."""
    import gc

    model, inputs = zoo.get("mlp")
    seen = []
    cb = lambda phase, info: phase == "start" and seen.append(gc.get_freeze_count())  # noqa: E731
    gc.callbacks.append(cb)
    try:
        gc.collect()
        graphopt.optimize(model, inputs, check_accuracy=False)
        gc.collect()  # a collection while optimize() runs would have seen the frozen objects
    finally:
        gc.callbacks.remove(cb)
    assert any(c > 0 for c in seen[:-1]) and seen[-1] == 0  # frozen during, none after
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.freeze()  # the caller's own freeze is left alone
    try:
        frozen = gc.get_freeze_count()
        graphopt.optimize(model, inputs, check_accuracy=False)
        assert frozen - 1000 < gc.get_freeze_count() <= frozen  # (a frozen object freed meanwhile leaves)
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        graphopt.optimize(model, inputs, check_accuracy=False)
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_a_model_on_meta_plans_without_an_accuracy_check():
    """Shapes only: optimize() plans for the target and says why accuracy was not checked, instead of
    failing on the first comparison of values that do not exist."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval().to("meta")
    opt = graphopt.optimize(model, (torch.randn(4, 16, device="meta"),), target="h200")
    acc = opt.report.accuracy
    assert not acc["checked"] and "meta" in acc["reason"]


class _CachedBias(nn.Module):
    """A tensor derived from a parameter, cached in a Python dict keyed by device in eval mode (as
    LeViT's attention biases are): not a parameter or buffer, so a float64 or bf16 run of the model
    stores a tensor of its own dtype there. ``holder``: an object whose attributes hold the cache instead."""

    def __init__(self, holder=None):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.randn(4, 8))
        self.register_buffer("idx", torch.tensor([0, 1, 2, 3, 3, 2, 1, 0]), persistent=False)
        self.cache = {}
        self.holder = holder

    def bias(self, device):
        if self.training:
            return self.table[:, self.idx]
        cache = self.holder.__dict__ if self.holder is not None else self.cache
        if str(device) not in cache:
            cache[str(device)] = self.table[:, self.idx]
        return cache[str(device)]

    def forward(self, x):
        return torch.relu(self.proj(x)) @ self.bias(x.device).T  # (a float64 bias beside bf16: no kernel)


@pytest.mark.parametrize("prefilled", [False, True], ids=["empty", "prefilled"])
def test_a_cache_the_forward_fills_is_the_callers_as_given_after_optimize(prefilled):
    """The guard's eager and float64 runs each start from the model's Python-side state as given and
    leave nothing there (accuracy.ModuleState): the float64 run never reads the bf16 tensor an
    eager run cached, no bf16 run reads a float64 one, and the caller's dict is the same object
    holding the same tensors afterwards. fp64_reference alone leaves the cache as it found it."""
    torch.manual_seed(0)
    model = _CachedBias().eval().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    if prefilled:
        with torch.no_grad():
            model(x)
    cache, held = model.cache, dict(model.cache)
    ref = accuracy.fp64_reference(model, (x,), {})
    assert model.cache is cache and model.cache == held and ref.dtype == torch.float64
    opt = graphopt.optimize(model, (x,))
    assert model.cache is cache and list(cache) == list(held) and all(cache[k] is v for k, v in held.items())
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"]
    with torch.no_grad():
        eager = model(x)  # a bf16 call after optimize(): no float64 tensor was left in its cache
        assert accuracy.check(opt(x), ref, eager).passed


class _IndexedBlock(nn.Module):
    """LeViT's attention block in small: a long Python list of ints kept beside a dict its eval forward
    fills with a tensor derived from the weights."""

    def __init__(self, n: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.indices = list(range(n))
        self.cache = {}

    def forward(self, x):
        if str(x.device) not in self.cache:
            self.cache[str(x.device)] = self.lin.weight * 0.5
        return x + torch.relu(x @ self.cache[str(x.device)].T)


def test_long_lists_of_scalars_do_not_hide_a_cache_from_the_state_kept():
    """The walk of the model's Python-side state records every module's dicts however many scalars
    the lists before them hold (accuracy.ModuleState.MAX_ENTRIES): the capture's trace leaves no fake
    tensor in a cache after them, and optimize() leaves every cache as the caller had it (empty)."""
    from graphopt import accuracy

    torch.manual_seed(0)
    n = accuracy.ModuleState.MAX_ENTRIES + 10
    model = nn.Sequential(_IndexedBlock(n), _IndexedBlock(n), _IndexedBlock(4)).eval()
    x = torch.randn(3, 8)
    opt = graphopt.optimize(model, (x,))
    assert all(b.cache == {} for b in model)
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"]
    ref = accuracy.fp64_reference(model, (x,), {})
    with torch.no_grad():
        eager = model(x)
    assert accuracy.check(opt(x), ref, eager).passed
    huge = nn.Sequential(_IndexedBlock(4), _IndexedBlock(4))
    huge[0].indices = list(range(accuracy.ModuleState.MAX_SCANNED + 5))  # past the scan budget: still recorded
    state = accuracy.ModuleState(huge)
    huge[0].indices.append(-1)
    huge[1].cache["cpu"] = torch.zeros(1)
    state.restore()
    assert len(huge[0].indices) == accuracy.ModuleState.MAX_SCANNED + 5 and huge[1].cache == {}


class _Stateful(nn.Module):
    """Buffers its forward writes: a step counter reassigned (``+=`` sets the attribute), a running
    mean written in place and an average reassigned out of place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.steps += 1
        self.total.add_(x.mean(0))
        self.ema = 0.5 * self.ema + x.mean(0)
        return self.lin(x) + self.ema


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_optimize_leaves_the_buffers_a_forward_writes_as_given(training):
    """optimize() runs the model (the guard's eager and float64 runs, timing) and the graph: none of
    those runs leaves its writes in the caller's buffers, and the float64 run's reassignments (a float64
    ``ema``) are undone (accuracy.ModuleState). A call of the optimized module then writes the model's
    own buffers as an eager call does."""
    torch.manual_seed(0)
    model, x = _Stateful().train(training), torch.randn(3, 4)
    before = {k: (b, b.clone()) for k, b in model.named_buffers()}
    opt = graphopt.optimize(model, (x,), training=training)
    for k, b in model.named_buffers():
        assert b is before[k][0] and b.dtype == before[k][1].dtype and torch.equal(b, before[k][1]), k
    ref, ref64 = copy.deepcopy(model), accuracy.fp64_reference(model, (x,), {})
    with torch.set_grad_enabled(training):
        out, eager = opt(x), ref(x)
    res = accuracy.check(out, ref64, eager, training=training)
    assert res.passed, res.reason
    for (k, b), r in zip(model.named_buffers(), ref.buffers()):
        assert b.dtype == r.dtype and torch.allclose(b, r), k


def test_a_cache_filled_under_inference_mode_is_a_constant_graphopt_can_propagate_again():
    """A tensor the caller's own torch.inference_mode() call cached is an inference tensor, which keeps
    no version counter: the capture lifts it as a constant, and propagating metadata again (after a
    pass is reverted) must not key on its version (it raised on the H200 for timm's LeViT)."""
    from graphopt import ir

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.cache = {}

        def forward(self, x):
            if str(x.device) not in self.cache:
                self.cache[str(x.device)] = self.w * 2
            return torch.relu(x @ self.cache[str(x.device)])

    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(2, 8)
    with torch.inference_mode():
        model(x)
    gm = graphopt.capture(model, (x,))
    consts = [ir.get_attr_value(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    assert any(t.is_inference() for t in consts if isinstance(t, torch.Tensor))
    ir.repropagate(gm)
    ir.repropagate(gm, incremental=True)
    opt = graphopt.optimize(model, (x,))
    assert opt.report.accuracy["passed"]


def test_a_cache_in_a_plain_object_is_restored_and_one_graphopt_does_not_walk_is_a_one_line_error():
    """The attributes of a plain object the model holds are state as well (restored, converted); an
    object of Python's own classes (SimpleNamespace) is not walked into, and the fake tensor the
    capture's trace leaves there makes optimize() raise ReferenceRunError (one line) instead of a
    raw torch error."""
    import types

    x = torch.randn(2, 8, dtype=torch.bfloat16)
    holder = type("Holder", (), {})()
    model = _CachedBias(holder).eval().to(torch.bfloat16)
    graphopt.optimize(model, (x,))
    assert vars(holder) == {}
    model = _CachedBias(types.SimpleNamespace()).eval().to(torch.bfloat16)
    with pytest.raises(graphopt.ReferenceRunError, match="fake tensor.*check_accuracy=False") as err:
        graphopt.optimize(model, (x,))
    assert "\n" not in str(err.value) and isinstance(err.value, graphopt.GraphoptError)


class _RandomlyMasked(nn.Module):
    """ViT-MAE's masking at inference: noise from torch.rand ranks the tokens, which are gathered in
    that order; the order is an (integer) output too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        ids = torch.rand(x.shape[0], x.shape[1]).argsort(-1)
        return torch.gather(self.lin(x), 1, ids.unsqueeze(-1).expand(-1, -1, x.shape[-1])), ids


def test_the_accuracy_guard_runs_a_model_that_draws_at_inference_from_one_rng_state():
    """Every run of the accuracy guard (eager, float64, each graph checked) starts from the same RNG
    state, so a model that draws random numbers in eval mode is compared like for like (its integer
    output differed run to run, and the guard failed it); the float64 reference draws as the model does
    (in the default dtype), and the caller's RNG state is as it was."""
    torch.manual_seed(0)
    model, x = _RandomlyMasked().eval(), torch.randn(2, 16, 8)
    state = torch.get_rng_state()
    opt = graphopt.optimize(model, (x,), measure=False)
    assert torch.equal(torch.get_rng_state(), state)
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"], opt.report.accuracy.get("reason")
    with torch.random.fork_rng():
        torch.manual_seed(3)
        ref = accuracy.fp64_reference(model, (x,), {})
        torch.manual_seed(3)
        with torch.no_grad():
            eager = model(x)
    assert torch.equal(ref[1], eager[1]) and ref[0].dtype == torch.float64


class _Counted(nn.Module):
    """Buffers a training forward updates: a running mean in place, a step counter by ``+=`` (which
    rebinds the attribute to what ``__iadd__`` returns)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * y.mean(0))
                self.steps += 1
        return y - self.avg


def test_the_guards_runs_leave_the_callers_buffers_as_given_even_when_the_forward_rebinds_them():
    # the float64 run's ``self.steps += 1`` bound the model's buffer to its converted copy (steps 1
    # after optimize(), and a float64 running mean beside float32 weights in the next step)
    torch.manual_seed(0)
    model, x = _Counted().train(), torch.randn(4, 8)
    steps, avg = model.steps, model.avg
    opt = graphopt.optimize(model, (x,), training=True)
    assert opt.report.accuracy["checked"]
    assert model.steps is steps and model.avg is avg and int(steps) == 0 and not avg.any()
    step_check(model, opt, (x,))  # (its buffers after one step, the counter exactly, by the rule)
    assert int(model.steps) == 1


def test_a_model_in_train_mode_optimized_for_inference_is_told_it_runs_as_in_eval_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    x = torch.randn(2, 3, 8, 8)
    opt = graphopt.optimize(model, (x,), measure=False)
    assert model.training  # handed back as given
    assert any("train mode: optimized for inference" in n for n in opt.report.notes)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model.eval()(x))
    assert not any("train mode" in n for n in graphopt.optimize(model.eval(), (x,), measure=False).report.notes)
