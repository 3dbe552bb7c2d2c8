import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.examples import zoo
from graphopt.passes._fusion_meta import set_meta
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

LIN = "aten.linear.default"


class QKV(nn.Module):
    def __init__(self, bias=True, d=32, heads=4):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v = (nn.Linear(d, d, bias=bias) for _ in range(3))
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = (t(x).view(B, S, self.h, -1).transpose(1, 2) for t in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v
        return self.o(a.transpose(1, 2).reshape(B, S, D))


class GateUp(nn.Module):
    """Llama MLP: gate and up siblings of different width from q."""

    def __init__(self, d=32, i=48):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False), nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MixedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.a(x) * self.b(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_qkv_merged_and_matches_fp64(dtype, bias):
    torch.manual_seed(0)
    m = QKV(bias).eval().to(dtype)
    x = torch.randn(2, 8, 32, dtype=dtype)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["merge_sibling_linears"])
    c = op_counts(gm)
    assert res.status == "applied" and len(res.rewrites) == 1
    assert c[LIN] == 2 and c["aten.split_with_sizes.default"] == 1
    assert res.rewrites[0].predicted_gain_s > 0
    assert reference_check(m, gm, (x,)).passed
    # the model's parameters are untouched; the merged weight is a new buffer
    assert m.q.weight.shape == (32, 32)
    merged = [b for n, b in gm.named_buffers() if "merged_weight" in n]
    assert len(merged) == 1 and merged[0].shape == (96, 32)


def test_gate_up_merged_in_graph_order():
    torch.manual_seed(0)
    m = GateUp().eval()
    x = torch.randn(3, 5, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["merge_sibling_linears"])
    assert op_counts(gm)[LIN] == 2 and len(res.rewrites) == 1
    split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default)
    assert split.args[1] == [48, 48]
    assert reference_check(m, gm, (x,)).passed


def test_refuses_mixed_bias():
    m = MixedBias().eval()
    x = torch.randn(4, 16)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["merge_sibling_linears"])
    assert op_counts(gm)[LIN] == 2 and not res.rewrites
    assert any("bias" in r.reason for r in res.rejected)


def test_refuses_different_weight_dtypes():
    m = MixedBias().eval()
    m.b = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    gm = capture(m, (x,))
    # one sibling's weight in another dtype (a hand-edited or mixed-precision graph)
    w = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "b.weight")
    gm.b.weight = nn.Parameter(gm.b.weight.detach().double())
    set_meta(gm, [w])
    (res,) = run_passes(gm, ["merge_sibling_linears"])
    assert op_counts(gm)[LIN] == 2 and not res.rewrites
    assert any("dtype" in r.reason for r in res.rejected)


def test_zoo_counts():
    for name, layers in (("bert-tiny", 2), ("glm4-tiny", 2)):
        model, inputs = zoo.get(name)
        gm = capture(model, inputs)
        before = op_counts(gm)[LIN]
        (res,) = run_passes(gm, ["merge_sibling_linears"])
        assert len(res.rewrites) == layers, name  # Q, K, V of every layer
        assert op_counts(gm)[LIN] == before - 2 * layers
        assert reference_check(model, gm, inputs).passed
