import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

CONV = "aten.conv2d.default"


class MixedDepthwise(nn.Module):
    """MixNet's mixed depthwise convolution: channel groups with kernels 3, 5, 7 (``same`` padding)."""

    def __init__(self, splits=(8, 12, 12), kernels=(3, 5, 7), stride=1, bias=True, dilation=1):
        super().__init__()
        self.splits = list(splits)
        self.convs = nn.ModuleList(
            nn.Conv2d(c, c, k, stride, padding=((stride - 1) + dilation * (k - 1)) // 2, dilation=dilation,
                      groups=c, bias=bias) for c, k in zip(splits, kernels))

    def forward(self, x):
        xs = torch.split(x, self.splits, 1)
        return torch.cat([c(xi) for c, xi in zip(self.convs, xs)], 1) * 2.0


class SplitPointwise(nn.Module):
    """A 1x1 convolution written as two over the halves of the channels (a grouped conv of 2)."""

    def __init__(self, c=16, out=24):
        super().__init__()
        self.a, self.b = nn.Conv2d(c // 2, out // 2, 1), nn.Conv2d(c // 2, out // 2, 1)
        self.bn = nn.BatchNorm2d(out)

    def forward(self, x):
        h = x.shape[1] // 2
        return self.bn(torch.cat([self.a(x[:, :h]), self.b(x[:, h:])], 1))


class HeadGroups(nn.Module):
    """CoaT's position encoding: tokens to an image, head groups each through a depthwise conv."""

    def __init__(self, heads=(2, 3, 3), ch=4, windows=(3, 5, 7)):
        super().__init__()
        self.splits = [h * ch for h in heads]
        self.convs = nn.ModuleList(nn.Conv2d(c, c, w, padding=w // 2, groups=c) for c, w in zip(self.splits, windows))

    def forward(self, v):  # v [B, N, C] tokens of an 8x8 image
        B, N, C = v.shape
        img = v.transpose(1, 2).reshape(B, C, 8, 8)
        parts = torch.split(img, self.splits, dim=1)
        return torch.cat([c(p) for c, p in zip(self.convs, parts)], dim=1).flatten(2).transpose(1, 2)


def _merged(m, x, n_convs=1, **kw):
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["merge_split_convs"], target="h200", **kw)
    return gm, res


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_mixed_depthwise_is_one_conv_and_matches_fp64(stride, bias):
    torch.manual_seed(0)
    m = MixedDepthwise(stride=stride, bias=bias).eval()
    x = torch.randn(2, 32, 15, 15)
    gm, res = _merged(m, x)
    assert res.status == "applied" and len(res.rewrites) == 1, res.rejected
    c = op_counts(gm)
    assert c[CONV] == 1 and "aten.cat.default" not in c and "aten.split_with_sizes.default" not in c
    conv = next(n for n in gm.graph.nodes if str(n.target) == CONV)
    assert conv.args[6] == 32 and conv.args[4] == [3, 3]  # 32 groups, the 7x7 kernel's padding
    assert reference_check(m, gm, (x,)).passed
    # the model's own weights untouched; the merged weight [32, 1, 7, 7] has zero rings around the 3x3
    assert m.convs[0].weight.shape == (8, 1, 3, 3)
    w = next(b for n, b in gm.named_buffers() if "merged_weight" in n)
    assert w.shape == (32, 1, 7, 7)
    assert torch.equal(w[:8, :, 2:5, 2:5], m.convs[0].weight.detach()) and w[:8, :, :2].abs().sum() == 0


def test_dilated_pieces():
    torch.manual_seed(0)
    m = MixedDepthwise(splits=(4, 4), kernels=(3, 5), dilation=2).eval()
    x = torch.randn(1, 8, 20, 20)
    gm, res = _merged(m, x)
    assert len(res.rewrites) == 1 and op_counts(gm)[CONV] == 1
    assert reference_check(m, gm, (x,)).passed


def test_split_pointwise_becomes_two_groups_and_batch_norm_still_folds():
    torch.manual_seed(0)
    m = SplitPointwise()
    with torch.no_grad():
        m.train()(torch.randn(4, 16, 6, 6))
    m.eval()
    x = torch.randn(4, 16, 6, 6)
    gm = capture(m, (x,))
    res = run_passes(gm, ["merge_split_convs", "fold_conv_bn"], target="h200")
    assert [r.status for r in res] == ["applied", "applied"]
    c = op_counts(gm)
    assert c[CONV] == 1 and "aten.batch_norm.default" not in c
    conv = next(n for n in gm.graph.nodes if str(n.target) == CONV)
    assert conv.args[6] == 2
    assert reference_check(m, gm, (x,)).passed


def test_head_groups_of_a_token_image():
    torch.manual_seed(0)
    m = HeadGroups().eval()
    x = torch.randn(3, 64, 32)
    gm, res = _merged(m, x)
    assert len(res.rewrites) == 1 and op_counts(gm)[CONV] == 1
    assert reference_check(m, gm, (x,)).passed


class Reordered(MixedDepthwise):
    def forward(self, x):
        xs = torch.split(x, self.splits, 1)
        ys = [c(xi) for c, xi in zip(self.convs, xs)]
        return torch.cat([ys[1], ys[0], ys[2]], 1)


class AlsoRead(MixedDepthwise):
    def forward(self, x):
        xs = torch.split(x, self.splits, 1)
        ys = [c(xi) for c, xi in zip(self.convs, xs)]
        return torch.cat(ys, 1), ys[0].sum()


class Partial(MixedDepthwise):
    def forward(self, x):
        xs = torch.split(x, [8, 12, 12, 4], 1)
        return torch.cat([c(xi) for c, xi in zip(self.convs, xs)], 1)


class DifferentStride(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 4, 3, 1, 1, groups=4), nn.Conv2d(4, 4, 3, 2, 1, groups=4)

    def forward(self, x):
        return torch.cat([self.a(x[:, :4, ::2, ::2]), self.b(x[:, 4:])], 1)


@pytest.mark.parametrize("m, x, why", [
    (Reordered(), torch.randn(1, 32, 9, 9), "consecutive"),
    (AlsoRead(), torch.randn(1, 32, 9, 9), "more than the concatenation"),
    (Partial(), torch.randn(1, 36, 9, 9), "cover"),
    (DifferentStride(), torch.randn(1, 8, 8, 8), "channel slice"),
])
def test_refusals_say_why_and_leave_the_graph(m, x, why):
    m = m.eval()
    gm = capture(m, (x,))
    before = op_counts(gm)[CONV]
    (res,) = run_passes(gm, ["merge_split_convs"], target="h200")
    assert not res.rewrites and op_counts(gm)[CONV] == before
    assert any(why in r.reason for r in res.rejected), [r.reason for r in res.rejected]


def test_training_graphs_are_left_alone():
    m = MixedDepthwise()
    x = torch.randn(2, 32, 9, 9)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["merge_split_convs"], target="h200", training=True)
    assert not res.rewrites


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model, x", [(MixedDepthwise(stride=2), (8, 32, 28, 28)), (SplitPointwise(), (8, 16, 14, 14))])
def test_optimized_on_the_gpu_in_bf16_channels_last(model, x):
    import graphopt

    torch.manual_seed(0)
    m = model.eval().cuda().to(torch.bfloat16)
    xs = (torch.randn(*x, device="cuda", dtype=torch.bfloat16),)
    om = graphopt.optimize(m, xs)
    res = next(p for p in om.report.passes if p.name == "merge_split_convs")
    assert res.status == "applied", [r.reason for r in res.rejected]
    assert om.report.accuracy["checked"] and om.report.accuracy["passed"]  # the fp64 rule, on the device


class TfSameMixed(nn.Module):
    """TF's same padding written before each piece (timm's Conv2dSame, tf_mixnet): more after than before."""

    def __init__(self, splits=(8, 8, 8), kernels=(3, 5, 7), stride=2):
        super().__init__()
        self.splits, self.kernels, self.stride = list(splits), kernels, stride
        self.convs = nn.ModuleList(nn.Conv2d(c, c, k, stride, groups=c) for c, k in zip(splits, kernels))

    def _same(self, x, k):
        pads = []
        for n in reversed(x.shape[2:]):
            total = max((-(-n // self.stride) - 1) * self.stride + k - n, 0)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads)

    def forward(self, x):
        xs = torch.split(x, self.splits, 1)
        return torch.cat([c(self._same(xi, k)) for c, xi, k in zip(self.convs, xs, self.kernels)], 1)


@pytest.mark.parametrize("stride, size, padded", [(2, 16, True), (2, 15, False), (1, 12, False)])
def test_tf_same_padding_pieces(stride, size, padded):
    torch.manual_seed(0)
    m = TfSameMixed(stride=stride).eval()
    x = torch.randn(2, 24, size, size)
    gm, res = _merged(m, x)
    assert len(res.rewrites) == 1, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert c[CONV] == 1 and "aten.pad.default" not in c
    # more padding after than before (an even size at stride 2): one zero pad of the whole input first
    assert ("aten.constant_pad_nd.default" in c) == padded
    assert reference_check(m, gm, (x,)).passed
