import pytest
import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten
BF = torch.bfloat16


class Gates(nn.Module):
    """A projection to an odd width, split into a value, a gate and a scalar per row (focal
    modulation's input projection), read by pointwise ops; ``returned``: the projection is also
    returned; ``viewed``: a view merges its last dim."""

    def __init__(self, k=64, n=195, returned=False, viewed=False):
        super().__init__()
        self.proj = nn.Linear(k, n)
        self.n, self.returned, self.viewed = n, returned, viewed

    def forward(self, x):
        y = self.proj(x)
        if self.viewed:
            return y.view(y.shape[0], -1).sum(-1)
        half = (self.n - 1) // 2
        v, g, s = y.split([half, half, 1], -1)
        out = torch.relu(v) * torch.sigmoid(g) + s
        return (out, y) if self.returned else out


def _linears(gm):
    return [n for n in gm.graph.nodes if n.target is aten.linear.default]


def test_odd_n_is_padded_to_a_multiple_of_8():
    m = Gates().eval().to(BF)
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied" and res.rewrites[0].predicted_gain_s > 0, res.rejected
    (lin,) = _linears(gm)
    w = ir.get_attr_value(gm, lin.args[1].target)
    assert tuple(w.shape) == (200, 64) and not w[195:].any()
    assert tuple(ir.get_attr_value(gm, lin.args[2].target).shape) == (200,)
    assert op_counts(gm)["aten.clone.default"] == 0  # pointwise readers take the strided rows
    assert reference_check(m, gm, (x,)).passed


def test_a_returned_projection_is_copied_back_to_its_layout():
    m = Gates(k=512, returned=True).eval().to(BF)  # (K 512: the GEMM's time outweighs the copy)
    x = torch.randn(8, 1024, 512, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    out, y = gm(x)
    assert y.shape == (8, 1024, 195) and y.is_contiguous()
    assert reference_check(m, gm, (x,)).passed


def test_refused_with_the_reason():
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(Gates(viewed=True).eval().to(BF), (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "unchanged" and "reads the strides" in res.rejected[0].reason
    m = Gates(k=63).eval().to(BF)
    x = torch.randn(8, 1024, 63, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "unchanged" and "K=63 is not a multiple of 8" in res.rejected[0].reason


def test_nothing_padded_where_the_profile_has_not_measured_the_fallback():
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(Gates().eval().to(BF), (x,))
    plain = get_profile("h200")[0].with_efficiency("gemm_align1", None)
    (res,) = run_passes(gm, ["align_gemm"], target=plain)
    assert res.status == "unchanged" and "no gain" in res.rejected[0].reason
    assert tuple(ir.info(_linears(gm)[0]).shape) == (8, 1024, 195)


@pytest.mark.cuda
def test_padded_projection_on_the_gpu():
    m = Gates(k=512, returned=True).eval().to("cuda", BF)
    x = torch.randn(8, 1024, 512, dtype=BF, device="cuda")
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    out, y = gm(x)
    assert y.is_contiguous() and y.shape == (8, 1024, 195)
    assert reference_check(m, gm, (x,)).passed
