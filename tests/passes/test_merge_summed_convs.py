import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

CONV = "aten.conv2d.default"
BN = "aten.batch_norm.default"


def _conv_bn(cin, cout, k, stride=1, padding=0, groups=1, dilation=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=False), nn.BatchNorm2d(cout))


def _trained_stats(m, x):
    """BatchNorm statistics other than the initial ones (one training-mode forward), then eval mode."""
    with torch.no_grad():
        m.train()(x * 2 + 0.5)
    return m.eval()


class RepVGGBlock(nn.Module):
    """RepVGG's training-time block: 3x3 conv-BN + 1x1 conv-BN + BatchNorm of the input, then ReLU."""

    def __init__(self, c=8, groups=1):
        super().__init__()
        self.dense = _conv_bn(c, c, 3, padding=1, groups=groups)
        self.one = _conv_bn(c, c, 1, groups=groups)
        self.identity = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.dense(x) + self.one(x) + self.identity(x))


class MobileOneBlock(nn.Module):
    """MobileOne's depthwise block: k over-parameterized 3x3 branches, a 1x1 scale branch added to a
    zero (timm's ``scale_out + 0`` where a branch is absent), the input's BatchNorm at stride 1."""

    def __init__(self, c=8, k=2, stride=1):
        super().__init__()
        self.branches = nn.ModuleList(_conv_bn(c, c, 3, stride, 1, groups=c) for _ in range(k))
        self.scale = _conv_bn(c, c, 1, stride, groups=c)
        self.identity = nn.BatchNorm2d(c) if stride == 1 else None

    def forward(self, x):
        out = self.scale(x) + (self.identity(x) if self.identity is not None else 0)
        for b in self.branches:
            out = out + b(x)
        return nn.functional.gelu(out)


class RepMixer(nn.Module):
    """FastViT's RepMixer: x + gamma * (mixer(x) - norm(x)), mixer a depthwise conv sum with a BatchNorm."""

    def __init__(self, c=8):
        super().__init__()
        self.mixer = MobileOneBlock(c)
        self.norm = nn.BatchNorm2d(c)
        self.gamma = nn.Parameter(torch.rand(c, 1, 1) + 0.5)

    def forward(self, x):
        m = self.mixer.scale(x) + self.mixer.identity(x) + self.mixer.branches[0](x)
        return x + self.gamma * (m - self.norm(x))


class LargeSmall(nn.Module):
    """A large kernel and a small one over the same input, stride 2, two outputs per group (FastViT's patch embedding)."""

    def __init__(self, c=8):
        super().__init__()
        self.large = _conv_bn(c, 2 * c, 7, 2, 3, groups=c)
        self.small = _conv_bn(c, 2 * c, 3, 2, 1, groups=c)

    def forward(self, x):
        return nn.functional.gelu(self.large(x) + self.small(x))


class Asymmetric(nn.Module):
    """ACNet's asymmetric branches: 3x3 + 1x3 + 3x1, dilated."""

    def __init__(self, c=6, dilation=1):
        super().__init__()
        d = dilation
        self.sq = nn.Conv2d(c, c, 3, padding=d, dilation=d)
        self.hor = nn.Conv2d(c, c, (1, 3), padding=(0, d), dilation=d)
        self.ver = nn.Conv2d(c, c, (3, 1), padding=(d, 0), dilation=d)

    def forward(self, x):
        return self.sq(x) + self.hor(x) - 0.5 * self.ver(x)


def _run(m, x, **kw):
    gm = capture(m, (x,))
    res = run_passes(gm, ["fold_conv_bn", "merge_summed_convs"], target="h200", **kw)
    return gm, res[-1]


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_repvgg_block_is_one_conv_and_matches_fp64(groups):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 9, 9)
    m = _trained_stats(RepVGGBlock(groups=groups), x)
    w_before = m.dense[0].weight.detach().clone()
    gm, res = _run(m, x)
    assert res.status == "applied" and len(res.rewrites) == 1, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert c[CONV] == 1 and BN not in c and "aten.add.Tensor" not in c
    assert reference_check(m, gm, (x,)).passed
    assert torch.equal(m.dense[0].weight, w_before)  # the model's own weights untouched
    # the 1x1 branch and the identity sit on the merged 3x3's centre tap only
    conv = next(n for n in gm.graph.nodes if str(n.target) == CONV)
    w = getattr(gm, conv.args[1].target)
    assert w.shape == (8, 8 // groups, 3, 3) and conv.args[4] == [1, 1] and conv.args[6] == groups


@pytest.mark.parametrize("stride", [1, 2])
def test_mobileone_block_with_its_zero_and_over_parameterized_branches(stride):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 10, 10)
    m = _trained_stats(MobileOneBlock(k=3, stride=stride), x)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert c[CONV] == 1 and BN not in c
    assert reference_check(m, gm, (x,)).passed


def test_layer_scaled_residual_with_a_difference_is_one_depthwise_conv():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 7, 7)
    m = _trained_stats(RepMixer(), x)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert c[CONV] == 1 and set(c) - {CONV} <= {"aten.gelu.default"}, c  # the sub, mul, adds and BatchNorms gone
    conv = next(n for n in gm.graph.nodes if str(n.target) == CONV)
    assert conv.args[6] == 8
    assert reference_check(m, gm, (x,)).passed


def test_large_and_small_kernels_with_two_outputs_per_group():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 13, 13)
    m = _trained_stats(LargeSmall(), x)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1
    conv = next(n for n in gm.graph.nodes if str(n.target) == CONV)
    assert getattr(gm, conv.args[1].target).shape == (16, 1, 7, 7) and conv.args[4] == [3, 3]
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("dilation", [1, 2])
def test_asymmetric_branches_and_a_scaled_difference(dilation):
    torch.manual_seed(0)
    m = Asymmetric(dilation=dilation).eval()
    x = torch.randn(2, 6, 11, 11)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1 and op_counts(gm)[CONV] == 1
    assert reference_check(m, gm, (x,)).passed


class OffGrid(nn.Module):
    """Dilated 3x3 (taps -2, 0, 2) + dilated 2x2 of padding 1 (taps -1, 1): no common grid of taps."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 4, 3, padding=2, dilation=2), nn.Conv2d(4, 4, 2, padding=1, dilation=2)

    def forward(self, x):
        return self.a(x) + self.b(x)


class MixedGroups(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw, self.pw = nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.dw(x) + self.pw(x)


class AlsoRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a = self.a(x)
        return a + self.b(x), a.mean()


@pytest.mark.parametrize("m, why", [
    (OffGrid(), "dilation does not divide"),
    (MixedGroups(), "differ in groups"),
    (AlsoRead(), "read elsewhere too"),
])
def test_refusals_say_why_and_leave_the_graph(m, why):
    m = m.eval()
    x = torch.randn(1, 4, 8, 8)
    gm = capture(m, (x,))
    before = op_counts(gm)[CONV]
    (res,) = run_passes(gm, ["merge_summed_convs"], target="h200")
    assert not res.rewrites and op_counts(gm)[CONV] == before
    assert any(why in r.reason for r in res.rejected), [r.reason for r in res.rejected]


def test_a_sum_with_another_input_is_left_alone():
    class Residual(nn.Module):  # conv(x) + y: y is no function of x's convolution
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    m = Residual().eval()
    args = (torch.randn(1, 4, 6, 6), torch.randn(1, 4, 6, 6))
    gm = capture(m, args)
    (res,) = run_passes(gm, ["merge_summed_convs"], target="h200")
    assert not res.rewrites and op_counts(gm)[CONV] == 2


def test_training_graphs_are_left_alone():
    m = RepVGGBlock()
    x = torch.randn(2, 8, 9, 9)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["merge_summed_convs"], target="h200", training=True)
    assert not res.rewrites


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", [RepVGGBlock, MobileOneBlock, RepMixer, LargeSmall])
def test_optimized_on_the_gpu_in_bf16(model):
    import graphopt

    torch.manual_seed(0)
    x = torch.randn(16, 8, 28, 28)
    m = _trained_stats(model(), x).cuda().to(torch.bfloat16)
    om = graphopt.optimize(m, (x.cuda().to(torch.bfloat16),))
    res = next(p for p in om.report.passes if p.name == "merge_summed_convs")
    assert res.rewrites or "measured slower" in " ".join(res.notes + [r.reason for r in res.rejected]), res
    assert om.report.accuracy["checked"] and om.report.accuracy["passed"]  # the fp64 rule, on the device


def test_one_dimensional_branches():
    class Rep1d(nn.Module):  # an audio front end's 5-tap + 1-tap branches and the input's BatchNorm
        def __init__(self, c=6):
            super().__init__()
            self.a = nn.Sequential(nn.Conv1d(c, c, 5, padding=2, bias=False), nn.BatchNorm1d(c))
            self.b = nn.Sequential(nn.Conv1d(c, c, 1, bias=False), nn.BatchNorm1d(c))
            self.id = nn.BatchNorm1d(c)

        def forward(self, x):
            return self.a(x) + self.b(x) + self.id(x)

    torch.manual_seed(0)
    x = torch.randn(2, 6, 20)
    m = _trained_stats(Rep1d(), x)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert c["aten.conv1d.default"] == 1 and BN not in c
    assert reference_check(m, gm, (x,)).passed
