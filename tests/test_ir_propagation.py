"""Incremental fake propagation (ir.repropagate): kept values must never be stale."""
import pytest
import torch
import torch.nn as nn

from graphopt import capture, ir

aten = torch.ops.aten


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum(-1)


def _count_runs(gm, monkeypatch):
    runs = []
    orig = torch.fx.passes.fake_tensor_prop.FakeTensorProp.run_node

    def run_node(self, n):
        runs.append(n.name)
        return orig(self, n)

    monkeypatch.setattr(torch.fx.passes.fake_tensor_prop.FakeTensorProp, "run_node", run_node)
    ir.repropagate(gm)
    return runs


def test_unchanged_graph_reruns_nothing(monkeypatch):
    gm = capture(Chain().eval(), (torch.randn(4, 16),))
    ir.repropagate(gm)  # computes and keys every node
    runs = _count_runs(gm, monkeypatch)
    computed = [r for r in runs if r.startswith(("linear", "relu", "sum"))]
    assert computed == []


def test_changed_shape_reaches_every_reader(monkeypatch):
    gm = capture(Chain().eval(), (torch.randn(4, 16),))
    ir.repropagate(gm)
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    # a rewrite that changes a value's shape: take only the first 2 rows before the relu
    with gm.graph.inserting_before(relu):
        sl = gm.graph.call_function(aten.slice.Tensor, (relu.args[0], 0, 0, 2))
    relu.replace_input_with(relu.args[0], sl)
    gm.recompile()
    runs = _count_runs(gm, monkeypatch)
    assert {"relu", "sum"} <= {r.split("_")[0] for r in runs if r}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert tuple(out.meta["val"].shape) == (2,)
    first_linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert first_linear.name not in runs  # upstream of the change: kept


def test_changed_dtype_reaches_readers():
    gm = capture(Chain().eval(), (torch.randn(4, 16),))
    ir.repropagate(gm)
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    with gm.graph.inserting_before(relu):
        cast = gm.graph.call_function(aten._to_copy.default, (relu.args[0],), {"dtype": torch.float64})
    relu.replace_input_with(relu.args[0], cast)
    # the second linear now mixes float64 and float32: fake propagation raises there, and the relu
    # before it was recomputed in float64 rather than kept from the last run
    try:
        ir.repropagate(gm)
    except Exception as e:  # noqa: BLE001
        assert "dtype" in str(e).lower() or "expected" in str(e).lower()
    assert ir.info(relu).dtype == torch.float64


def _signatures(gm):
    return {n.name: ir._signature(n.meta.get("val")) for n in gm.graph.nodes if n.op != "output"}


@pytest.mark.parametrize("name", ["bert-tiny", "glm4-tiny", "vit-tiny"])
@pytest.mark.parametrize("training", [False, True])
def test_seeded_capture_values_are_a_propagation(name, training):
    """capture() keys export's values (ir.seed_propagation): the first incremental re-propagation
    then keeps them, and what it keeps is what a full propagation computes, node by node."""
    from graphopt.examples import zoo

    model, inputs = zoo.get(name)
    model.train(training)
    gm = capture(model, inputs)
    keyed = [n for n in gm.graph.nodes if n.meta.get(ir._IncrementalProp.KEY) is not None]
    assert len(keyed) > 0.9 * len([n for n in gm.graph.nodes if n.op == "call_function"])
    ir.repropagate(gm)
    incremental = _signatures(gm)
    ir.repropagate(gm, incremental=False)
    assert incremental == _signatures(gm)


def test_first_repropagation_after_capture_reruns_only_unkeyed_nodes(monkeypatch):
    gm = capture(Chain().eval(), (torch.randn(4, 16),))
    runs = _count_runs(gm, monkeypatch)
    assert [r for r in runs if r.startswith(("linear", "relu", "sum"))] == []


def test_a_seeded_value_goes_stale_when_its_input_changes(monkeypatch):
    gm = capture(Chain().eval(), (torch.randn(4, 16),))  # seeded, never propagated
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    with gm.graph.inserting_before(relu):
        sl = gm.graph.call_function(aten.slice.Tensor, (relu.args[0], 0, 0, 2))
    relu.replace_input_with(relu.args[0], sl)
    runs = _count_runs(gm, monkeypatch)
    assert {"relu", "sum"} <= {r.split("_")[0] for r in runs if r}
    assert tuple(ir.info(relu).shape) == (2, 32)


def test_symbolic_trace_capture_is_not_seeded():
    gm = capture(Chain().eval(), (torch.randn(4, 16),), strategy="symbolic_trace")
    assert not any(n.meta.get(ir._IncrementalProp.KEY) is not None for n in gm.graph.nodes
                   if n.op == "call_function")


def test_cached_value_signature_follows_in_place_changes():
    gm = capture(Chain().eval(), (torch.randn(4, 16),))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    before = ir._node_signature(x)
    assert ir._node_signature(x) is before  # cached
    val = x.meta["val"]
    with val.fake_mode:
        val.t_()  # an in-place metadata change bumps the (fake) tensor's version
    after = ir._node_signature(x)
    assert after != before and after[1] == ("16", "4")
    x.meta["val"] = val.new_empty((4, 16))  # a new value object: recomputed
    assert ir._node_signature(x)[1] == ("4", "16")


@pytest.mark.parametrize("training", [False, True])
def test_seeding_changes_no_value(training):
    """Seeding only adds keys: a pass that runs before any propagation reads export's values
    (parameters that require grad included: insert_checkpoints reads that in a training graph)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train(training)
    x = torch.randn(2, 3, 32, 32)
    plain = capture(model, (x,), strategy="export")
    vals = {n.name: n.meta.get("val") for n in plain.graph.nodes}
    for n in plain.graph.nodes:  # what capture keyed, undone: the values must be export's as they came
        n.meta.pop(ir._IncrementalProp.KEY, None)
    ir.seed_propagation(plain)
    assert all(n.meta.get("val") is vals[n.name] for n in plain.graph.nodes)
    params = [n for n in plain.graph.nodes if n.op == "get_attr" and "weight" in str(n.target)]
    assert params and all(n.meta["val"].requires_grad for n in params)
    assert not any(n.meta.get(ir._IncrementalProp.KEY) for n in params)  # re-run by the first propagation
    ir.repropagate(plain)
    incremental = _signatures(plain)
    ir.repropagate(plain, incremental=False)
    assert incremental == _signatures(plain)
