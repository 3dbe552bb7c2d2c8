"""lower_depthwise_conv: depthwise conv2d (+ its bias_act epilogue) -> graphopt::dwconv2d, on a GPU
profile, checked against float64 with the accuracy rule (the op's CPU implementation is its
reference)."""
import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

OURS, CONV, EPI = "graphopt.dwconv2d.default", "aten.conv2d.default", "graphopt.bias_act.default"


class ValueConv(nn.Module):
    """CoaT's relative position encoding over the value heads: the tokens' qkv laid out [B, H, W, 3C],
    seen as an image (a channels_last view), its value channels convolved depthwise, + the values."""

    def __init__(self, c=12, k=5):
        super().__init__()
        self.c = c
        self.conv = nn.Conv2d(c, c, k, padding=k // 2, groups=c)

    def forward(self, qkv):
        img = qkv.permute(0, 3, 1, 2)
        v = img[:, 2 * self.c:]
        return self.conv(v) + v


class Block(nn.Module):
    """MobileNet's depthwise 3x3 (stride 2) + bias + SiLU over a channels_last input."""

    def __init__(self, c=16, stride=2, act=nn.SiLU()):
        super().__init__()
        self.conv, self.act = nn.Conv2d(c, c, 3, stride, 1, groups=c), act

    def forward(self, x):
        return self.act(self.conv(x))


def _ours(gm):
    return [n for n in gm.graph.nodes if str(n.target) == OURS]


def test_value_heads_are_read_in_place_with_the_residual_in_the_epilogue():
    """The convolution reads a channel slice of the permuted qkv (aten's cuDNN call would copy it):
    one dwconv2d takes the slice as it is, the bias and the residual; no conv2d or bias_act left."""
    torch.manual_seed(0)
    m = ValueConv().eval()
    qkv = torch.randn(2, 7, 9, 36)
    gm = capture(m, (qkv,))
    res = run_passes(gm, ["fuse_bias_act", "lower_depthwise_conv"], target="h200")
    assert res[-1].status == "applied", res[-1].rejected
    counts = op_counts(gm)
    assert counts.get(CONV) is None and counts.get(EPI) is None
    (node,) = _ours(gm)
    x, w, bias, residual = node.args[:4]
    assert not x.meta["val"].is_contiguous(memory_format=torch.channels_last)  # the slice itself
    assert bias is not None and residual is not None and node.args[7] == "none"
    assert node.args[8] is True and node.meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert w.op == "get_attr" and w.meta["val"].stride()[0] == 1  # the filter stored tap-major
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "conv.weight"]  # the model's: unread
    assert reference_check(m, gm, (qkv,)).passed


@pytest.mark.parametrize("act,name", [(nn.SiLU(), "silu"), (nn.Hardswish(), "hardswish"), (nn.GELU(), "gelu")])
def test_stride_two_block_takes_its_activation(act, name):
    torch.manual_seed(0)
    m = Block(act=act).eval()
    x = torch.randn(2, 16, 9, 11).contiguous(memory_format=torch.channels_last)
    gm = capture(m, (x,))
    res = run_passes(gm, ["fuse_bias_act", "lower_depthwise_conv"], target="h200")
    assert res[-1].status == "applied", res[-1].rejected
    (node,) = _ours(gm)
    assert node.args[7] == name and node.args[4] == [2, 2]
    assert reference_check(m, gm, (x,)).passed


def test_nchw_stays_nchw_and_a_bias_alone_goes_in():
    """A contiguous input: the output keeps aten's contiguous layout (a reader's view of it stays valid)."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8)

        def forward(self, x):
            return self.conv(x).view(x.shape[0], 8, -1).sum(-1)

    m = M().eval()
    x = torch.randn(2, 8, 6, 7)
    gm = capture(m, (x,))
    res = run_passes(gm, ["lower_depthwise_conv"], target="h200")
    assert res[-1].status == "applied", res[-1].rejected
    (node,) = _ours(gm)
    assert node.args[8] is False and node.args[2] is not None and node.args[3] is None
    assert reference_check(m, gm, (x,)).passed


def test_refusals_say_why():
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)  # 2 channels a group
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

        def forward(self, x):
            return self.grouped(x) + self.dw(x)

    x = torch.randn(1, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    gm = capture(M().eval(), (x,))
    res = run_passes(gm, ["lower_depthwise_conv"], target="cpu")[-1]
    assert res.status == "unchanged" and [r.reason for r in res.rejected] == ["the kernel is for CUDA; cpu runs aten's"]
    res = run_passes(gm, ["lower_depthwise_conv"], target="h200")[-1]
    assert len(_ours(gm)) == 1 and not res.rejected  # the grouped convolution is no candidate: not reported


def test_an_epilogue_reading_the_conv_as_its_residual_is_left():
    """bias_act(y, b, act, residual=conv(x)): the conv (over a channel slice, so it gains) is lowered
    alone, the epilogue stays."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False)

        def forward(self, x, y):
            return torch.ops.graphopt.bias_act(y, None, "relu", self.dw(x[:, 32:]), 1)

    x = torch.randn(2, 64, 24, 24).contiguous(memory_format=torch.channels_last)
    y = torch.randn(2, 32, 24, 24).contiguous(memory_format=torch.channels_last)
    m = M().eval()
    gm = capture(m, (x, y))
    res = run_passes(gm, ["lower_depthwise_conv"], target="h200")[-1]
    assert res.status == "applied", res.rejected
    assert op_counts(gm).get(EPI) == 1 and len(_ours(gm)) == 1
    assert "epilogue left: its epilogue reads it as the residual" in res.rewrites[0].pattern
    assert reference_check(m, gm, (x, y)).passed


def test_training_graphs_are_left_alone():
    m = Block()
    x = torch.randn(2, 16, 9, 11, requires_grad=True)
    import graphopt

    opt = graphopt.optimize(m, (x,), target="h200", training=True, check_accuracy=False)
    (p,) = [p for p in opt.report.passes if p.name == "lower_depthwise_conv"]
    assert p.status == "skipped"


def test_float64_is_refused_with_its_dtype():
    m = Block(c=6, stride=1, act=nn.ReLU()).eval().double()
    x = torch.randn(1, 6, 5, 5, dtype=torch.float64)
    gm = capture(m, (x,))
    res = run_passes(gm, ["fuse_bias_act", "lower_depthwise_conv"], target="h200")[-1]
    assert not _ours(gm) and any("torch.float64" in r.reason for r in res.rejected)


class Mixing(nn.Module):
    """A 7x7 depthwise convolution + ReLU + the residual over many channels (ConvMixer's), then a
    3x3 one + SiLU over a few (MobileNet's): two candidates of two shapes."""

    def __init__(self, c=768, small=16):
        super().__init__()
        self.big = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.proj = nn.Conv2d(c, small, 1)
        self.small = nn.Conv2d(small, small, 3, padding=1, groups=small)

    def forward(self, x):
        x = torch.relu(self.big(x)) + x
        return torch.nn.functional.silu(self.small(self.proj(x)))


@pytest.mark.cuda
def test_on_the_gpu_each_candidate_is_timed_and_applied_only_where_not_measured_slower():
    """With a candidate timer (optimize() sets one where it measures), every candidate is timed
    against the convolution and epilogue it replaces; the applied ones measured no slower than the
    margin allows, the refused ones say "measured slower" with both times; the graph keeps the
    accuracy rule either way. (Which way each goes is the device's call: not asserted.)"""
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt import ir
    from graphopt.pipeline import PassContext, PassManager, assemble
    from graphopt.runtime import candidates

    torch.manual_seed(0)
    m = Mixing().cuda().to(torch.bfloat16).eval().to(memory_format=torch.channels_last)
    x = torch.randn(4, 768, 32, 32, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    gm = capture(m, (x,))
    timer = candidates.CandidateTimer("cuda")
    ctx = PassContext(cost=CostModel(get_profile("h200")[0]), hints=ir.shape_hints(gm), candidate_timer=timer)
    (res,) = [r for r in PassManager(assemble(["fuse_bias_act", "lower_depthwise_conv"])).run(gm, ctx)
              if r.name == "lower_depthwise_conv"]
    timed = {t["candidate"]: t for t in res.details.get("timed_candidates", [])}
    applied = {r.matched[0] for r in res.rewrites}
    refused = {r.candidate: r.reason for r in res.rejected}
    assert len(timed) == 2 and set(timed) == applied | {c for c in refused if c in timed}, (timed, refused)
    for name, t in timed.items():
        if name in applied:
            assert t["after_us"] <= t["before_us"] * (1 + timer.margin)
        else:
            assert refused[name].startswith("measured slower on ") and " us against " in refused[name]
    assert reference_check(m, gm, (x,)).passed
