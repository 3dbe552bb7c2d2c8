import torch
import torch.nn as nn

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten


class Dead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        unused = torch.exp(self.fc(x)) * 3  # noqa: F841 - dead on purpose
        return torch.relu(x) + 1


class Random(nn.Module):
    def forward(self, x):
        noise = torch.rand_like(x)  # noqa: F841 - unused, but it advances the RNG
        return x + torch.rand_like(x)


def test_removes_dead_chain_and_keeps_numerics():
    m = Dead().eval()
    x = torch.randn(4, 16)
    gm = capture(m, (x,))
    assert op_counts(gm)["aten.exp.default"] == 1
    (res,) = run_passes(gm, ["eliminate_dead_code"])
    counts = op_counts(gm)
    assert counts["aten.exp.default"] == 0 and counts["aten.linear.default"] == 0 and counts["aten.mul.Tensor"] == 0
    assert counts["aten.relu.default"] == 1
    assert res.status == "applied" and len(res.rewrites) >= 3
    assert res.predicted_s_after < res.predicted_s_before
    assert reference_check(m, gm, (x,)).passed


def test_does_not_remove_random_ops():
    m = Random()
    x = torch.randn(8)
    gm = capture(m, (x,))
    n_rand = op_counts(gm)["aten.rand_like.default"]
    run_passes(gm, ["eliminate_dead_code"])
    assert op_counts(gm)["aten.rand_like.default"] == n_rand == 2
    torch.manual_seed(3)
    a = m(x)
    torch.manual_seed(3)
    b = gm(x)
    torch.testing.assert_close(a, b)


def test_nothing_dead_nothing_changed():
    class Live(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    gm = capture(Live(), (torch.randn(3),))
    before = op_counts(gm)
    (res,) = run_passes(gm, ["eliminate_dead_code"])
    assert res.status == "unchanged" and op_counts(gm) == before


def test_under_a_rewrite_limit_it_removes_that_many_and_stops():
    """The measured guard's bisection reruns a pass with only its first k rewrites: the dead nodes
    beyond k stay, and the pass must end (it looped for ever removing nothing more)."""
    from graphopt import ir
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import PassContext, registry

    gm = capture(Dead().eval(), (torch.randn(4, 16),))
    ctx = PassContext(cost=CostModel(get_profile("cpu")[0]), hints=ir.shape_hints(gm), rewrite_limit=1)
    res = registry()["eliminate_dead_code"]().run(gm, ctx)
    assert len(res.rewrites) == 1 and any("beyond the first 1 rewrites" in r.reason for r in res.rejected)
    assert op_counts(gm)["aten.exp.default"] == 1  # the chain's first dead node (the last one) went, the rest stay


class VmapInForward(nn.Module):
    """torch.vmap inside a forward (transformers' mask functions on some versions): export records
    functorch's nesting calls, whose results nothing reads, around the batch-dim ops."""

    def forward(self, x):
        keep = torch.vmap(lambda row: row.cumsum(0) > 0)(x)
        return torch.where(keep, x, torch.zeros_like(x)) * 2


def test_the_nesting_calls_of_a_vmap_stay():
    """Removing _vmap_increment_nesting / _vmap_decrement_nesting (unread) broke the graph on torch 2.11
    (Falcon with transformers 5.13: "your tensor may have escaped from inside a function being vmapped")."""
    m, x = VmapInForward(), torch.randn(3, 5)
    gm = capture(m, (x,))
    nesting = [n for n in gm.graph.nodes if str(getattr(n.target, "__name__", "")).endswith("_nesting")]
    (res,) = run_passes(gm, ["eliminate_dead_code"])
    assert res.status != "reverted", res.notes
    assert nesting and all(n in gm.graph.nodes for n in nesting)
    assert torch.equal(gm(x), m(x))
