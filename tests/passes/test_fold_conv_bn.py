import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten


def _randomize_bn(m):
    for bn in m.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.normal_()
                bn.bias.normal_()
    return m


class ConvBn(nn.Module):
    def __init__(self, bias=False, groups=1, affine=True):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1, bias=bias, groups=groups)
        self.bn = nn.BatchNorm2d(16, affine=affine)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class SharedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)

    def forward(self, x):
        c = self.conv(x)
        return self.bn(c) + c  # the conv output is read twice: folding would change c


@pytest.mark.parametrize("bias,groups,affine", [(False, 1, True), (True, 1, True), (True, 8, True), (False, 2, False)])
def test_folds_and_matches_fp64(bias, groups, affine):
    m = _randomize_bn(ConvBn(bias, groups, affine)) if affine else ConvBn(bias, groups, affine)
    if not affine:
        with torch.no_grad():
            m.bn.running_mean.normal_()
            m.bn.running_var.uniform_(0.5, 2.0)
    m.eval()
    x = torch.randn(2, 8, 12, 12)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fold_conv_bn"])
    counts = op_counts(gm)
    assert counts["aten.batch_norm.default"] == 0 and counts["aten.conv2d.default"] == 1
    assert res.status == "applied" and len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    assert reference_check(m, gm, (x,)).passed


def test_not_in_training_mode():
    m = _randomize_bn(ConvBn()).train()
    x = torch.randn(2, 8, 12, 12)
    gm = capture(m, (x,))
    run_passes(gm, ["fold_conv_bn"], training=True)
    assert op_counts(gm)["aten.batch_norm.default"] == 1
    # even when asked for an inference graph, a BN in training mode does not match
    gm2 = capture(m, (x,))
    (res,) = run_passes(gm2, ["fold_conv_bn"])
    assert op_counts(gm2)["aten.batch_norm.default"] == 1
    assert any("training mode" in r.reason for r in res.rejected)


def test_not_when_conv_output_is_shared():
    m = _randomize_bn(SharedConv()).eval()
    x = torch.randn(2, 8, 12, 12)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fold_conv_bn"])
    assert op_counts(gm)["aten.batch_norm.default"] == 1
    assert any("other users" in r.reason for r in res.rejected)
    assert reference_check(m, gm, (x,)).passed


def test_resnet50_reports_53_folds_and_passes_accuracy():
    model, inputs = zoo.get("resnet50")
    opt = graphopt.optimize(model, inputs)
    rep = opt.report
    assert rep.rewrites("fold_conv_bn") == 53
    assert rep.accuracy["checked"] and rep.accuracy["passed"]
    assert op_counts(opt.graph_module)["aten.batch_norm.default"] == 0
