import pytest
import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

OURS = "graphopt.strided_bmm.default"


class FactorAttention(nn.Module):
    """CoaT's factorized attention: q, k, v split out of one projection (batch strides that do not
    fold), k's softmax over tokens, k^T v per head, q times that, heads merged, projected."""

    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        kv = k.softmax(dim=2).transpose(-1, -2) @ v
        y = (q * 0.5) @ kv
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


def _ours(gm):
    return [n for n in gm.graph.nodes if str(n.target) == OURS]


def test_factorized_attention_reads_the_heads_in_place_and_writes_the_merged_layout():
    """Both products become the op; the second writes [B, N, heads, dim] so the head merge is a view;
    the result passes the accuracy rule against float64 (the op runs its reference on the CPU)."""
    torch.manual_seed(0)
    m = FactorAttention().eval()
    x = torch.randn(2, 37, 24)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_strided_bmm"], target="h200")
    assert res.status == "applied", res.rejected
    assert op_counts(gm).get("aten.matmul.default") is None
    kv, y = _ours(gm)
    assert kv.args[2] == [] and y.args[2] == [0, 2, 1, 3]
    assert not y.args[0].meta["val"].is_contiguous()  # (q's view of the projection, read in place)
    merged = next(u for u in gm.graph.nodes if str(u.target) in ("aten.reshape.default", "aten.view.default")
                  and u.args[0].op == "call_function" and u.args[0].args[0] is y)
    assert ir.reshape_is_view(ir.info(merged.args[0]), [2, 37, 24])  # (the merge is a view: no copy)
    assert all(r.predicted_gain_s > 0 for r in res.rewrites)
    assert reference_check(m, gm, (x,)).passed


class Plain(nn.Module):
    def forward(self, a, b):
        return a @ b


@pytest.mark.parametrize("shapes, reason", [
    (((2, 3, 8, 4), (2, 3, 4, 5)), "aten copies no operand"),
    (((2, 300, 200), (2, 200, 300)), "cuBLAS's"),
    (((8, 4), (4, 5)), "not batched"),
])
def test_refusals_say_why(shapes, reason):
    xs = tuple(torch.randn(s) for s in shapes)
    gm = capture(Plain(), xs)
    (res,) = run_passes(gm, ["lower_strided_bmm"], target="h200")
    assert res.status != "applied"
    assert any(reason in r.reason for r in res.rejected), res.rejected


def test_on_a_cpu_profile_nothing_is_lowered():
    m = FactorAttention().eval()
    gm = capture(m, (torch.randn(2, 37, 24),))
    (res,) = run_passes(gm, ["lower_strided_bmm"], target="cpu")
    assert res.status != "applied" and not _ours(gm)
    assert any(r.reason == NO_FUSED_KERNELS for r in res.rejected)


class Broadcast(nn.Module):
    """A 2-D right operand over a left one whose batch dims do not fold (aten copies the left)."""

    def forward(self, x, w):
        return x.permute(1, 0, 2, 3) @ w


def test_a_two_dim_operand_is_broadcast_by_a_view():
    x, w = torch.randn(3, 2, 5, 4), torch.randn(4, 6)
    gm = capture(Broadcast(), (x, w))
    (res,) = run_passes(gm, ["lower_strided_bmm"], target="h200")
    assert res.status == "applied", res.rejected
    (node,) = _ours(gm)
    assert str(node.args[1].target) == "aten.expand.default"
    assert reference_check(Broadcast(), gm, (x, w)).passed


def test_a_training_step_through_the_op_passes_the_rule():
    """In a training graph the op's backward (g @ b^T, a^T @ g) carries the gradients: the projection's
    weight and bias gradients and the loss after optimize(training=True) with the pass alone pass the
    accuracy rule against float64."""
    import graphopt
    from tests.helpers import step_check

    torch.manual_seed(0)
    m = FactorAttention()
    x = torch.randn(2, 37, 24)
    opt = graphopt.optimize(m, (x,), training=True, check_accuracy=False, target="h200",
                            passes=["lower_strided_bmm"])
    m.train()
    assert len(_ours(opt.graph_module)) == 2
    step_check(m, opt, (x,))
