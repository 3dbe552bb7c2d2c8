"""fuse_channels_last_broadcasts: the SE scale of a CNN given NCHW, channels_last after the layout pass,
becomes a one-op fused_pointwise (planned for the H200 on the CPU; the reference by the accuracy rule)."""
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

FP = "graphopt.fused_pointwise.default"


class SqueezeExcite(nn.Module):
    """A convolution, then squeeze-and-excitation's per-channel scale, then a projection: given in NCHW,
    the scale's mul is NCHW when fuse_elementwise runs and channels_last after the layout pass."""

    def __init__(self, c=32):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(3))
        self.reduce, self.expand, self.proj = nn.Conv2d(c, 8, 1), nn.Conv2d(8, c, 1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        y = x
        for conv in self.convs:
            y = torch.relu(conv(y))
        s = torch.sigmoid(self.expand(torch.relu(self.reduce(y.mean((2, 3), keepdim=True)))))
        return self.proj(y * s)


def test_the_se_scale_of_a_model_given_nchw_becomes_a_kernel_after_the_layout_pass():
    """fuse_channels_last_broadcasts: after convert_channels_last, the SE scale's mul broadcasts into a
    channels_last tensor (aten's strided kernel); it becomes a one-op fused_pointwise whose output
    keeps that layout, and only such ops are taken."""
    torch.manual_seed(0)
    m = SqueezeExcite(64).to(torch.bfloat16).eval()
    x = torch.randn(16, 64, 56, 56, dtype=torch.bfloat16)
    gm = capture(m, (x,))
    (*_, res) = run_passes(gm, ["fuse_elementwise", "convert_channels_last", "fuse_channels_last_broadcasts"],
                           target="h200")
    assert res.status == "applied", [(r.candidate, r.reason) for r in res.rejected]
    fused = [n for n in gm.graph.nodes if str(n.target) == FP]
    assert len(fused) == 1 and op_counts(gm).get("aten.mul.Tensor", 0) == 0
    assert fused[0].meta["val"][0].is_contiguous(memory_format=torch.channels_last)
    assert op_counts(gm)["aten.relu.default"] >= 1  # not a broadcast: left to the earlier passes
    assert reference_check(m, gm, (x,)).passed


def test_training_graph_keeps_the_fused_scale_and_its_gradients():
    """In a training graph the fused scale has fused_pointwise's backward: the accuracy guard's check
    of the output and every parameter gradient against float64 passes with the pass applied."""
    import graphopt

    torch.manual_seed(0)
    m = SqueezeExcite(64).train()
    opt = graphopt.optimize(m, (torch.randn(16, 64, 56, 56),), training=True, target="h200", measure=False)
    assert opt.report.pass_result("fuse_channels_last_broadcasts").status == "applied"
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"], opt.report.accuracy
