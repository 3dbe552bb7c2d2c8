import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import run_passes
from tests.helpers import op_counts

IM2COL = "aten.im2col.default"


class Unfold(nn.Module):
    def __init__(self, kernel, dilation=1, padding=0, stride=1):
        super().__init__()
        self.args = dict(kernel_size=kernel, dilation=dilation, padding=padding, stride=stride)

    def forward(self, x):
        return F.unfold(x, **self.args).transpose(-1, -2) * 2.0


CASES = [
    dict(kernel=4, stride=4),                              # TNT's non-overlapping patches
    dict(kernel=3, padding=1, stride=2),                   # VOLO's outlooker windows
    dict(kernel=3, dilation=2, padding=2),                 # dilated taps: a stepped slice of each window
    dict(kernel=(2, 3), padding=(0, 1), stride=(1, 2)),    # unequal height and width
]


@pytest.mark.parametrize("case", CASES)
def test_the_window_view_and_copy_equal_im2col_exactly(case):
    """The rewrite copies the same values: equal to F.unfold in float64 to the bit, for channels_last
    inputs too; no im2col is left."""
    m = Unfold(**case)
    for x in (torch.randn(16, 5, 13, 11, dtype=torch.float64),
              torch.randn(16, 5, 13, 11, dtype=torch.float64).to(memory_format=torch.channels_last)):
        gm = capture(m, (x,))
        res = run_passes(gm, ["decompose_im2col"], target="h200")[0]
        assert res.status == "applied", res.rejected
        assert op_counts(gm).get(IM2COL) is None
        assert torch.equal(gm(x)[0] if isinstance(gm(x), (tuple, list)) else gm(x), m(x))


def test_gradients_flow_through_the_views():
    m = Unfold(kernel=3, padding=1, stride=2)
    x = torch.randn(8, 4, 10, 10, dtype=torch.float64, requires_grad=True)
    gm = capture(m, (x,))
    run_passes(gm, ["decompose_im2col"], target="h200")
    out = gm(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    (g,) = torch.autograd.grad(out.square().sum(), x)
    (ref,) = torch.autograd.grad(m(x).square().sum(), x)
    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)


def test_aten_im2col_is_priced_as_a_kernel_per_sample_on_cuda():
    """aten's CUDA im2col launches one kernel per sample: 64 samples cost at least 64 kernels'
    fixed time, and the rewrite is predicted a gain there; with two samples the copy and the pad
    are not worth it, and the report says so."""
    prof = get_profile("h200")[0]
    m = Unfold(kernel=3, padding=1, stride=2)
    big = capture(m, (torch.randn(64, 8, 28, 28, dtype=torch.bfloat16),))
    node = next(n for n in big.graph.nodes if str(n.target) == IM2COL)
    assert CostModel(prof).node_cost(node).time_s >= 64 * prof.kernel_fixed_s
    assert run_passes(big, ["decompose_im2col"], target="h200")[0].status == "applied"
    small = capture(m, (torch.randn(2, 8, 28, 28, dtype=torch.bfloat16),))
    res = run_passes(small, ["decompose_im2col"], target="h200")[0]
    assert res.status == "unchanged" and "no gain" in res.rejected[0].reason
    assert op_counts(small).get(IM2COL) == 1


def test_an_unbatched_input_is_left_with_its_reason():
    m = Unfold(kernel=2, stride=2)
    gm = capture(m, (torch.randn(3, 8, 8),))
    res = run_passes(gm, ["decompose_im2col"], target="h200")[0]
    assert "3-D input" in res.rejected[0].reason and op_counts(gm).get(IM2COL) == 1
