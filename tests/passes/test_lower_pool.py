import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

CL = torch.channels_last
POOL = "graphopt.max_pool2d_nhwc.default"


class ConvPool(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = pool

    def forward(self, x):
        return self.pool(torch.relu(self.conv(x))) * 2


def _model(pool=None, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return ConvPool(pool or nn.MaxPool2d(3, 2, 1)).eval().to(dtype).to(memory_format=CL)


def _x(dtype=torch.bfloat16, n=8, hw=(113, 110)):  # big enough that aten's slow pool costs more than a launch
    return torch.randn(n, 8, *hw, dtype=dtype).to(memory_format=CL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_channels_last_max_pool_lowered_exactly(dtype):
    m = _model(dtype=dtype)
    gm = capture(m, (_x(dtype, n=1, hw=(9, 8)),))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert not res.rewrites and "gain" in res.rejected[0].reason  # launch-bound either way
    x = _x(dtype)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    counts = op_counts(gm)
    assert counts.get(POOL) == 1 and "aten.max_pool2d.default" not in counts
    (node,) = [n for n in gm.graph.nodes if str(n.target) == POOL]
    assert list(node.args[1:]) == [3, 2, 1] and node.meta["val"].is_contiguous(memory_format=CL)
    with torch.no_grad():
        assert torch.equal(gm(x), m(x))  # a max is exact
    assert reference_check(m, gm, (x,)).passed


def test_whole_pipeline_on_a_resnet_block_lowers_the_pool():
    m, x = _model(), _x()
    opt = graphopt.optimize(m, (x,), target="h200", cuda_graphs=False)
    assert op_counts(opt.graph_module).get(POOL) == 1
    assert opt.report.accuracy["passed"]


@pytest.mark.parametrize("pool,why", [
    (nn.MaxPool2d(3, 2, 1, ceil_mode=True), "floor-mode"),
    (nn.MaxPool2d(3, 2, 1, dilation=2), "undilated"),
    (nn.MaxPool2d((3, 2), 2), "square"),
])
def test_windows_the_kernel_does_not_cover_are_refused(pool, why):
    m, x = _model(pool), _x()
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert not res.rewrites and why in res.rejected[0].reason, res.rejected
    assert "aten.max_pool2d.default" in op_counts(gm)


def test_nchw_input_cpu_profile_and_training_are_left_to_aten():
    m = _model().to(memory_format=torch.contiguous_format)
    x = _x().contiguous()
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert not res.rewrites and "channels_last" in res.rejected[0].reason
    m, x = _model(), _x()
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="cpu")
    assert not res.rewrites and "CUDA" in res.rejected[0].reason
    gm = capture(m.train(), (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="h200", training=True)
    assert res.status == "skipped" and "aten.max_pool2d.default" in op_counts(gm)


@pytest.mark.cuda
def test_lowered_pool_runs_the_cuda_kernel_exactly():
    m, x = _model().cuda(), _x().cuda()
    opt = graphopt.optimize(m, (x,), cuda_graphs=False)
    assert op_counts(opt.graph_module).get(POOL) == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), rtol=1e-2, atol=1e-2)  # the fused conv rounds differently
    assert opt.report.accuracy["passed"]


AVG = "graphopt.avg_pool2d_nhwc.default"


@pytest.mark.parametrize("include_pad", [True, False])
def test_channels_last_avg_pool_lowered_with_atens_divisor(include_pad):
    """Inception's branch pool (3x3, stride 1, padding 1): lowered, and by the accuracy rule
    against fp64 the same as aten's average, with the padding counted or not."""
    m = _model(nn.AvgPool2d(3, 1, 1, count_include_pad=include_pad))
    x = _x()
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert len(res.rewrites) == 1 and "avg_pool2d_nhwc" in res.rewrites[0].pattern
    (node,) = [n for n in gm.graph.nodes if str(n.target) == AVG]
    assert list(node.args[1:]) == [3, 1, 1, include_pad] and "aten.avg_pool2d.default" not in op_counts(gm)
    assert reference_check(m, gm, (x,)).passed
    edge = torch.ones(1, 8, 5, 5, dtype=torch.float64).to(memory_format=CL)  # the divisor shows at the border
    y = torch.ops.graphopt.avg_pool2d_nhwc(edge, 3, 1, 1, include_pad)
    assert y[0, 0, 0, 0].item() == pytest.approx(4 / 9 if include_pad else 1.0)


def test_avg_pools_the_kernel_does_not_cover_are_refused():
    for pool, why in [(nn.AvgPool2d(3, 1, 1, divisor_override=4), "divisor override"),
                      (nn.AvgPool2d(3, 2, 1, ceil_mode=True), "floor-mode")]:
        m, x = _model(pool), _x()
        gm = capture(m, (x,))
        (res,) = run_passes(gm, ["lower_pool"], target="h200")
        assert not res.rewrites and why in res.rejected[0].reason, res.rejected


def test_ceil_mode_that_adds_no_window_is_lowered():
    """ResNet-D's shortcut pool (2x2, stride 2, ceil mode, padding not counted) on even sizes: ceil mode
    adds no window there, so it is floor mode's pool and is lowered, matching aten's by the accuracy
    rule; on an odd size it adds a partial window and stays aten's."""
    pool = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
    m = _model(pool)
    x = _x(hw=(112, 110))
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert len(res.rewrites) == 1 and AVG in op_counts(gm), res.rejected
    assert reference_check(m, gm, (x,)).passed
    gm = capture(m, (_x(hw=(113, 110)),))
    (res,) = run_passes(gm, ["lower_pool"], target="h200")
    assert not res.rewrites and "floor-mode" in res.rejected[0].reason
