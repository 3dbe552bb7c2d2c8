import logging

import torch
import torch.nn as nn

from graphopt import capture
from graphopt.matcher import Any, Attr, Const, Op, find, get_arg, match

aten = torch.ops.aten


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h) + h  # h has two users


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


PAT = Op(aten.relu.default, Op(aten.linear.default, Any("x"), Attr("w"), Attr("b", optional=True), name="lin"), name="relu")


def test_binds_names_and_nodes():
    gm = capture(Chain().eval(), (torch.randn(2, 8),))
    (m,) = list(find(gm, PAT))
    assert m["lin"].target is aten.linear.default
    assert m["x"].op == "placeholder"
    assert m["w"].op == "get_attr"
    assert m.nodes[0] is m.root and m.root.target is aten.relu.default


def test_interior_node_with_other_users_does_not_match(caplog):
    gm = capture(M().eval(), (torch.randn(2, 8),))
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert match(PAT, relu) is None
    shared = Op(aten.relu.default, Op(aten.linear.default, Any(), Attr(), Attr(), single_use=False))
    assert match(shared, relu) is not None


def test_wrong_target_and_const():
    gm = capture(Chain().eval(), (torch.randn(2, 8),))
    assert list(find(gm, Op(aten.gelu.default, Any()))) == []
    lin = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert match(Op(aten.linear.default, Any(), Any(), Const(value=None)), lin) is None  # bias is a node


def test_get_arg_reads_schema_defaults():
    class G(nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x, approximate="tanh")

    gm = capture(G(), (torch.randn(3),))
    gelu = next(n for n in gm.graph.nodes if n.target is aten.gelu.default)
    assert get_arg(gelu, 1, "approximate") == "tanh"
    gm2 = capture(Chain().eval(), (torch.randn(2, 8),))
    relu = next(n for n in gm2.graph.nodes if n.target is aten.relu.default)
    assert get_arg(relu, 5) is None


def test_debug_variable_explains_failures(monkeypatch, caplog):
    import graphopt.matcher as mt

    monkeypatch.setattr(mt, "_DEBUG", True)
    gm = capture(M().eval(), (torch.randn(2, 8),))
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    with caplog.at_level(logging.WARNING, logger="graphopt.matcher"):
        assert match(PAT, relu) is None
    assert "users" in caplog.text or "outside" in caplog.text


def test_commutative_and_alternatives():
    from graphopt.matcher import Alt

    class AddRes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(x)  # linear is the second operand

    gm = capture(AddRes().eval(), (torch.randn(2, 8),))
    lin = Op(aten.linear.default, Any(), Attr(), Attr(), name="lin")
    assert list(find(gm, Op(aten.add.Tensor, lin, Any("res")))) == []
    (m,) = list(find(gm, Op(aten.add.Tensor, lin, Any("res"), commutative=True)))
    assert m["res"].op == "placeholder" and m["lin"].target is aten.linear.default
    alt = Op(aten.add.Tensor, Alt(Op(aten.gelu.default, Any()), lin), Any(), commutative=True)
    (m2,) = list(find(gm, alt))
    assert m2["lin"] is m["lin"]
