"""Incremental fake propagation (ir.repropagate): kept values must never be stale."""
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
