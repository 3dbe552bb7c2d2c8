import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

GN = "graphopt.group_norm.default"


class Block(nn.Module):
    """PoolFormer's token mixer over a GroupNorm of one group, then a UNet-style GroupNorm + SiLU."""

    def __init__(self, c=64):
        super().__init__()
        self.n1, self.n2 = nn.GroupNorm(1, c), nn.GroupNorm(8, c)

    def forward(self, x):
        y = self.n1(x)
        x = x + (F.avg_pool2d(y, 3, 1, 1, count_include_pad=False) - y)
        return F.silu(self.n2(x))


def _inputs(cl=False, n=2, size=32):
    x = torch.randn(n, 64, size, size, dtype=torch.bfloat16)
    return (x.contiguous(memory_format=torch.channels_last) if cl else x,)


@pytest.mark.parametrize("cl", [False, True])
def test_group_norms_lowered_with_their_activation(cl):
    torch.manual_seed(0)
    m = Block().eval().to(torch.bfloat16)
    inputs = _inputs(cl)
    gm = capture(m, inputs)
    (res,) = run_passes(gm, ["lower_group_norm"], target="h200")
    c = op_counts(gm)
    assert c[GN] == 2 and c.get("aten.group_norm.default", 0) == 0 and c.get("aten.silu.default", 0) == 0
    acts = sorted(n.args[5] for n in gm.graph.nodes if str(n.target) == GN)
    assert acts == ["none", "silu"] and len(res.rewrites) == 2
    fmt = torch.channels_last if cl else torch.contiguous_format
    assert all(n.meta["val"].is_contiguous(memory_format=fmt) for n in gm.graph.nodes if str(n.target) == GN)
    assert reference_check(m, gm, inputs).passed


def test_refused_off_cuda_in_training_and_without_a_measurement():
    from graphopt.cost.profiles import get_profile

    m = Block().eval().to(torch.bfloat16)
    gm = capture(m, _inputs())
    (res,) = run_passes(gm, ["lower_group_norm"], target="cpu")
    assert op_counts(gm).get(GN, 0) == 0 and all("CUDA" in r.reason for r in res.rejected) and res.rejected
    unmeasured = get_profile("h200")[0].with_efficiency("group_norm", None)
    (res,) = run_passes(gm, ["lower_group_norm"], target=unmeasured)
    assert op_counts(gm).get(GN, 0) == 0 and all("not measured" in r.reason for r in res.rejected)
    gm = capture(m.train(), _inputs())
    (res,) = run_passes(gm, ["lower_group_norm"], target="h200", training=True)
    assert op_counts(gm).get(GN, 0) == 0


def test_aten_group_norm_priced_by_its_rows():
    """aten's statistics kernel streams each (sample, group) row with one block: few long rows cost
    far more than the same bytes in many short rows; the bundled kernel's price does not care."""
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    p = get_profile("h200")[0]
    few = capture(nn.GroupNorm(1, 64).to(torch.bfloat16), (torch.randn(2, 64, 64, 64, dtype=torch.bfloat16),))
    many = capture(nn.GroupNorm(32, 64).to(torch.bfloat16), (torch.randn(2, 64, 64, 64, dtype=torch.bfloat16),))
    t = [CostModel(p).node_cost(next(n for n in g.graph.nodes if n.op == "call_function"
                                     and "group_norm" in str(n.target))).time_s for g in (few, many)]
    assert t[0] > 4 * t[1]


def test_a_pool_after_the_norm_runs_on_its_channels_last_output():
    """lower_group_norm runs before lower_pool: its output keeps the channels_last layout (aten's
    GroupNorm gives NCHW), so PoolFormer's pooling of the norm's output takes the NHWC kernel."""
    m = Block().eval().to(torch.bfloat16)
    inputs = _inputs(cl=True, n=8, size=56)
    gm = capture(m, inputs)
    run_passes(gm, ["lower_pool", "lower_group_norm"], target="h200")
    assert op_counts(gm).get("graphopt.avg_pool2d_nhwc.default", 0) == 1
    assert reference_check(m, gm, inputs).passed
