import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.conv_bias_relu.default"


class Bottleneck(nn.Module):
    """conv-bn-relu, then conv-bn + identity -> relu, and a side branch reading a conv output."""

    def __init__(self, c=8, groups=1, side=False):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(c)
        self.side = side

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        z = self.b2(self.c2(y))
        out = torch.relu(z + x)
        return (out, z) if self.side else out


def _model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    m = Bottleneck(**kw).eval()
    for b in (m.b1, m.b2):  # non-trivial folded biases
        b.running_mean.uniform_(-0.5, 0.5)
        b.running_var.uniform_(0.5, 2.0)
        b.weight.data.uniform_(0.5, 1.5)
        b.bias.data.uniform_(-0.5, 0.5)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_relu_and_residual_fused(dtype):
    m = _model(dtype)
    x = torch.randn(2, 8, 10, 10, dtype=dtype)
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="h200")
    c = op_counts(gm)
    assert len(res.rewrites) == 2 and c[FUSED] == 2
    assert c["aten.conv2d.default"] == 0 and c["aten.relu.default"] == 0 and c["aten.add.Tensor"] == 0
    fused = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert [n.args[3] is not None for n in fused] == [False, True]  # the second one carries the residual
    assert all(n.args[2] is not None for n in fused)  # the folded BN bias rides along
    assert reference_check(m, gm, (x,)).passed


def test_full_pipeline_fuses_after_channels_last():
    # big enough for the NHWC region to pay for its two conversions on the H200 profile (70 us at batch 16;
    # still 14 us at 8). fp32: eager's bf16 NCHW convolutions, which the accuracy check runs, took 8 s of the
    # test's 10 on the CPU; bf16 fusion is test_conv_relu_and_residual_fused's
    m = nn.Sequential(*(_model(c=64) for _ in range(4)))
    x = torch.randn(16, 64, 28, 28)
    gm = capture(m, (x,))
    from graphopt.pipeline import available

    results = run_passes(gm, available(), target="h200")
    by = {r.name: r for r in results}
    assert by["convert_channels_last"].rewrites and len(by["fuse_conv_relu"].rewrites) == 8
    assert op_counts(gm)[FUSED] == 8
    out = gm(x)
    assert out.is_contiguous()  # the caller's layout comes back
    assert reference_check(m, gm, (x,)).passed


class Downsample(nn.Module):
    """ResNet's downsampling block end: relu(bn(conv(y)) + bn(conv_1x1(x)))."""

    def __init__(self, c=8, side=False):
        super().__init__()
        self.c, self.b = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c)
        self.d, self.db = nn.Conv2d(c, 2 * c, 1, stride=2, bias=False), nn.BatchNorm2d(2 * c)
        self.side = side

    def forward(self, x):
        z = self.db(self.d(x))
        out = torch.relu(self.b(self.c(x)) + z)
        return (out, z) if self.side else out


def _downsample(**kw):
    torch.manual_seed(1)
    m = Downsample(**kw).eval()
    for b in (m.b, m.db):
        b.running_mean.uniform_(-0.5, 0.5)
        b.running_var.uniform_(0.5, 2.0)
        b.bias.data.uniform_(-0.5, 0.5)
    return m


def test_residual_convolution_bias_moves_into_the_fused_bias():
    m = _downsample()
    x = torch.randn(2, 8, 10, 10)
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="h200")
    (fused,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    (z,) = [n for n in gm.graph.nodes if str(n.target) == "aten.conv2d.default"]
    assert fused.args[3] is z and (len(z.args) < 3 or z.args[2] is None) and "bias" not in z.kwargs
    moved = [r for r in res.rewrites if r.pattern.startswith("residual convolution's bias")]
    assert len(moved) == 1 and moved[0].predicted_gain_s > 0
    # the fused bias is the sum of both folded BatchNorm biases
    bias = getattr(gm, fused.args[2].target)
    want = (m.b.bias - m.b.running_mean * m.b.weight / (m.b.running_var + m.b.eps).sqrt()
            + m.db.bias - m.db.running_mean * m.db.weight / (m.db.running_var + m.db.eps).sqrt())
    torch.testing.assert_close(bias, want.detach(), rtol=1e-5, atol=1e-6)
    assert reference_check(m, gm, (x,)).passed
    # negative: the residual convolution's output is also returned, so its bias must stay
    m = _downsample(side=True)
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="h200")
    (z,) = [n for n in gm.graph.nodes if str(n.target) == "aten.conv2d.default"]
    assert z.args[2] is not None and not any(r.pattern.startswith("residual") for r in res.rewrites)
    assert any("also read elsewhere" in r.reason for r in res.rejected)
    assert reference_check(m, gm, (x,)).passed


def test_refusals():
    x = torch.randn(2, 8, 10, 10)
    # grouped convolution: unmeasured fused engines
    m = _model(groups=2)
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="h200")
    assert op_counts(gm)[FUSED] == 1
    assert any("grouped" in r.reason for r in res.rejected)
    # the pre-ReLU sum is also an output: cannot fuse the second conv
    m = _model(side=True)
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="h200")
    assert op_counts(gm)[FUSED] == 1
    assert any("read elsewhere" in r.reason for r in res.rejected)
    assert reference_check(m, gm, (x,)).passed
    # a CPU plan: cuDNN's fused convolution does not exist there
    gm = capture(_model(), (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="cpu")
    assert op_counts(gm)[FUSED] == 0
    assert [r.candidate for r in res.rejected] == ["2 conv + bias (+ residual) + ReLU epilogues"]
    assert "GPU op" in res.rejected[0].reason


def test_training_graph_untouched():
    m = _model().train()
    x = torch.randn(2, 8, 10, 10)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_conv_relu"], target="h200", training=True)
    assert not res.rewrites and op_counts(gm)[FUSED] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_op_matches_reference_and_keeps_layout(dtype):
    from graphopt.cuda_ext import reference

    torch.manual_seed(0)
    x = torch.randn(3, 16, 13, 11, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(24, 16, 3, 3, device="cuda", dtype=dtype) / 12).contiguous(memory_format=torch.channels_last)
    b = torch.randn(24, device="cuda", dtype=dtype)
    for z, stride in ((None, 1), (torch.randn(3, 24, 13, 11, device="cuda", dtype=dtype), 1),
                      (torch.randn(3, 24, 7, 6, device="cuda", dtype=dtype), 2)):
        args = (x, w, b, z, [stride] * 2, [1, 1], [1, 1], 1)
        y = torch.ops.graphopt.conv_bias_relu(*args)
        ref = reference.conv_bias_relu(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
        assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
        tol = 1e-2 if dtype == torch.float32 else 3e-2  # TF32 convolutions under fp32
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_residual_bias_moves_when_the_fused_convolution_has_none():
    class NoBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.d = nn.Conv2d(8, 8, 1, bias=True)

        def forward(self, x):
            return torch.relu(self.c(x) + self.d(x))

    torch.manual_seed(2)
    m = NoBias().eval()
    x = torch.randn(2, 8, 6, 6)
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["fold_conv_bn", "fuse_conv_relu"], target="h200")
    (fused,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    torch.testing.assert_close(getattr(gm, fused.args[2].target), m.d.bias.detach())
    (z,) = [n for n in gm.graph.nodes if str(n.target) == "aten.conv2d.default"]
    assert len(z.args) < 3 or z.args[2] is None
    assert reference_check(m, gm, (x,)).passed
