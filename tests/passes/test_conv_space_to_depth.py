import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.pipeline import run_passes
from graphopt.passes.conv_space_to_depth import plan, regroup_weight
from tests.helpers import op_counts, reference_check

CL = torch.channels_last


class Stem(nn.Module):
    def __init__(self, cin=3, cout=16, k=7, stride=2, pad=3):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, pad)

    def forward(self, x):
        return torch.relu(self.conv(x))


def _stem(dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    return Stem(**kw).eval().to(dtype).to(memory_format=CL)


@pytest.mark.parametrize("cin,k,pad,hw", [(3, 7, 3, (32, 32)), (3, 7, 3, (33, 30)), (1, 3, 1, (17, 17)),
                                          (4, 5, 2, (20, 23)), (3, 4, 1, (16, 16))])
def test_regrouping_is_exact_in_fp64(cin, k, pad, hw):
    """The padded, regrouped input convolved with the regrouped weight at stride 1 is the
    stride-2 convolution, to fp64 rounding, for odd sizes, odd and even kernels and 1-4 channels."""
    x = torch.randn(2, cin, *hw, dtype=torch.float64)
    w = torch.randn(5, cin, k, k, dtype=torch.float64)
    c4, kbs, pads, blocks = plan(list(x.shape), [k, k], [pad, pad])
    (ph0, ph1), (pw0, pw1) = pads
    xp = F.pad(x, (pw0, pw1, ph0, ph1, 0, c4 - cin)).permute(0, 2, 3, 1)
    xs = xp.reshape(2, blocks[0], 2, blocks[1], 2, c4).permute(0, 1, 3, 2, 4, 5).reshape(2, blocks[0], blocks[1], 4 * c4)
    got = F.conv2d(xs.permute(0, 3, 1, 2), regroup_weight(w, c4, kbs))
    torch.testing.assert_close(got, F.conv2d(x, w, stride=2, padding=pad), rtol=1e-12, atol=1e-12)


def test_stem_rewritten_and_accurate():
    m = _stem()
    # a tiny image: three kernels for one launch-bound convolution do not pay
    tiny = torch.randn(2, 3, 33, 31, dtype=torch.bfloat16).to(memory_format=CL)
    gm = capture(m, (tiny,))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200")
    assert not res.rewrites and res.rejected
    m = _stem(cout=64)  # ResNet-sized: the slow path pays for the extra kernels
    x = torch.randn(8, 3, 225, 223, dtype=torch.bfloat16).to(memory_format=CL)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200")
    assert len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    (conv,) = [n for n in gm.graph.nodes if str(n.target) == "aten.conv2d.default"]
    xs, w = conv.args[0].meta["val"], conv.args[1].meta["val"]
    assert tuple(xs.shape[1:2]) == (16,) and xs.is_contiguous(memory_format=CL)
    assert tuple(w.shape) == (64, 16, 4, 4) and list(conv.args[3]) == [1, 1]
    assert op_counts(gm)["aten.clone.default"] == 1  # the one regrouping copy
    assert reference_check(m, gm, (x,)).passed
    # then fuse_conv_relu takes the new convolution's bias and ReLU
    gm = capture(m, (x,))
    run_passes(gm, ["conv_space_to_depth", "fuse_conv_relu"], target="h200")
    assert op_counts(gm)["graphopt.conv_bias_relu.default"] == 1
    assert reference_check(m, gm, (x,)).passed


def test_refusals():
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16).to(memory_format=CL)
    # stride 1: nothing to regroup
    gm = capture(_stem(stride=1), (x,))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200")
    assert not res.rewrites and "stride" in res.rejected[0].reason
    # fp32: the slow path was measured in bf16/fp16
    gm = capture(_stem(torch.float32), (x.float(),))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200")
    assert not res.rewrites and "float32" in res.rejected[0].reason
    # a CPU plan: no slow path measured there
    gm = capture(_stem(), (x,))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="cpu")
    assert not res.rewrites and "no slow path" in res.rejected[0].reason
    # 8 input channels: cuDNN's regular path, not a candidate at all
    x8 = torch.randn(2, 8, 32, 32, dtype=torch.bfloat16).to(memory_format=CL)
    gm = capture(_stem(cin=8), (x8,))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200")
    assert not res.rewrites and not res.rejected
    # NCHW input: not the channels_last slow path
    gm = capture(_stem(), (x.contiguous(),))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200")
    assert not res.rewrites


def test_training_graph_untouched():
    m = _stem(torch.float32).train()
    x = torch.randn(2, 3, 32, 32).to(memory_format=CL)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["conv_space_to_depth"], target="h200", training=True)
    assert not res.rewrites


@pytest.mark.cuda
def test_stem_on_the_gpu():
    """ResNet-50's stem shape at bs8 on the GPU: regrouped, fused with bias + ReLU by
    fuse_conv_relu, equal to the fp64 reference by the accuracy rule."""
    m = _stem(cout=64).cuda()
    x = torch.randn(8, 3, 224, 224, dtype=torch.bfloat16, device="cuda").to(memory_format=CL)
    gm = capture(m, (x,))
    run_passes(gm, ["conv_space_to_depth", "fuse_conv_relu"], target="h200")
    assert op_counts(gm)["graphopt.conv_bias_relu.default"] == 1 and op_counts(gm)["aten.clone.default"] == 1
    assert gm(x).is_contiguous(memory_format=CL)
    assert reference_check(m, gm, (x,)).passed
