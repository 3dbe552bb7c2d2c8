"""lower_upsample: bilinear upsample_bilinear2d -> graphopt::upsample_bilinear2d on a GPU profile,
checked against float64 with the accuracy rule (the op's CPU implementation is its reference)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

OURS = "graphopt.upsample_bilinear2d.default"


class TokenResize(nn.Module):
    """CoaT's parallel blocks: the tokens after the class token as an image, resized, back to tokens."""

    def __init__(self, size, factor):
        super().__init__()
        self.size, self.factor = size, factor

    def forward(self, x):
        B, _, C = x.shape
        img = x[:, 1:].transpose(1, 2).reshape(B, C, *self.size)
        y = F.interpolate(img, scale_factor=self.factor, mode="bilinear", align_corners=False,
                          recompute_scale_factor=False)
        return torch.cat((x[:, :1], y.reshape(B, C, -1).transpose(1, 2)), dim=1)


def _ours(gm):
    return [n for n in gm.graph.nodes if str(n.target) == OURS]


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_token_view_is_resized_in_place(factor):
    torch.manual_seed(0)
    m = TokenResize((28, 28), factor).eval()
    x = torch.randn(4, 785, 152)
    gm = capture(m, (x,))
    res = run_passes(gm, ["lower_upsample"], target="h200")[-1]
    assert res.status == "applied", res.rejected
    (node,) = _ours(gm)
    assert not node.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert node.args[3:5] == (factor, factor) and node.args[5] is True
    assert reference_check(m, gm, (x,)).passed


def test_sizes_only_and_align_corners_over_channels_last():
    torch.manual_seed(0)

    class M(nn.Module):
        def forward(self, x):
            return F.interpolate(x, size=(45, 37), mode="bilinear", align_corners=True)

    m = M().eval()
    x = torch.randn(4, 64, 32, 24).contiguous(memory_format=torch.channels_last)
    gm = capture(m, (x,))
    res = run_passes(gm, ["lower_upsample"], target="h200")[-1]
    assert res.status == "applied", res.rejected
    (node,) = _ours(gm)
    assert node.args[1] == [45, 37] and node.args[2] is True and node.args[3:5] == (0.0, 0.0)
    assert node.args[5] is True
    assert reference_check(m, gm, (x,)).passed


def test_an_nchw_input_is_left_to_atens_kernel_at_the_copy_rate():
    """aten's NCHW kernel is priced at the copy rate, as the Triton kernel is: nothing to gain."""

    class M(nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=2.0, mode="bilinear")

    gm = capture(M().eval(), (torch.randn(4, 64, 32, 24),))
    res = run_passes(gm, ["lower_upsample"], target="h200")[-1]
    assert res.status == "unchanged" and "predicted no gain" in res.rejected[0].reason


def test_refused_on_the_cpu_and_for_float64():
    m = TokenResize((4, 4), 2.0).eval()
    x = torch.randn(1, 17, 8)
    gm = capture(m, (x,))
    res = run_passes(gm, ["lower_upsample"], target="cpu")[-1]
    assert res.status == "unchanged" and "the kernel is for CUDA" in res.rejected[0].reason
    gm = capture(m.double(), (x.double(),))
    res = run_passes(gm, ["lower_upsample"], target="h200")[-1]
    assert not _ours(gm) and "torch.float64" in res.rejected[0].reason
    assert op_counts(gm)["aten.upsample_bilinear2d.vec"] == 1
