import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

BIAS_ACT = "graphopt.bias_act.default"
ADDMM_ACT = "aten._addmm_activation.default"


class ConvAct(nn.Module):
    def __init__(self, act, residual=False):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.act, self.residual = act, residual

    def forward(self, x):
        y = self.act(self.conv(x))
        return y + x if self.residual else y


class LinearActRes(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.act = act

    def forward(self, x, r):
        return self.act(self.fc(x)) + r


class MatmulBiasAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 24) / 6)
        self.b = nn.Parameter(torch.randn(24))

    def forward(self, x):
        return F.silu(x @ self.w + self.b)


class LinearRelu(nn.Module):
    def __init__(self, reuse=False):
        super().__init__()
        self.fc, self.reuse = nn.Linear(32, 48), reuse

    def forward(self, x, r=None):
        a = torch.relu(self.fc(x))
        return a + r if r is not None else a


class SharedPreact(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        y = self.fc(x)
        return torch.sigmoid(y) * y  # the pre-activation is read twice


class ActTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x, r):
        a = torch.relu(self.fc(x))
        return a + r, a * 2  # the activation output is read twice: blocks the residual fusion


ACTS = {"relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU("tanh"), "silu": nn.SiLU(),
        "sigmoid": nn.Sigmoid(), "tanh": nn.Tanh(), "hardswish": nn.Hardswish(),
        "leaky_relu:0.01": nn.LeakyReLU(), "leaky_relu:0.2": nn.LeakyReLU(0.2, inplace=True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["relu", "gelu", "hardswish", "leaky_relu:0.01", "leaky_relu:0.2"])
def test_conv_bias_act(act, dtype):
    torch.manual_seed(0)
    m = ConvAct(ACTS[act]).eval().to(dtype)
    x = torch.randn(2, 8, 10, 10, dtype=dtype)
    gm = capture(m, (x,))
    # a100: no measured NCHW penalty, so no channels_last region for the epilogue to break
    (res,) = run_passes(gm, ["fuse_bias_act"], target="a100")
    c = op_counts(gm)
    assert len(res.rewrites) == 1 and c[BIAS_ACT] == 1 and c["aten.conv2d.default"] == 1
    conv = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.conv2d.default)
    assert len(conv.args) < 3 or conv.args[2] is None
    ba = next(n for n in gm.graph.nodes if str(n.target) == BIAS_ACT)
    assert ba.args[2] == act and ba.args[4] == 1
    assert reference_check(m, gm, (x,)).passed


def test_conv_bias_residual_no_activation():
    m = ConvAct(nn.Identity(), residual=True).eval()
    x = torch.randn(2, 8, 10, 10)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="a100")
    assert op_counts(gm)[BIAS_ACT] == 1 and op_counts(gm)["aten.add.Tensor"] == 0
    assert reference_check(m, gm, (x,)).passed


class DepthwiseMixer(nn.Module):
    """ConvMixer's depthwise half: a residual around conv + bias + ReLU + BatchNorm."""

    def __init__(self, c=16):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn(torch.relu(self.dw(x)))


def test_conv_bias_read_by_elementwise_ops_goes_into_their_fused_kernel():
    """Where the activation's readers are elementwise ops (a BatchNorm, a residual add) the bias is
    an explicit add that fuse_elementwise takes in: one kernel after the convolution, not bias_act's
    and then another."""
    torch.manual_seed(0)
    m = DepthwiseMixer().eval()
    x = torch.randn(2, 16, 12, 12)
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1), m.bn.running_var.uniform_(0.5, 2)
    gm = capture(m, (x,))
    res, fused = run_passes(gm, ["fuse_bias_act", "fuse_elementwise"], target="h200")
    assert len(res.rewrites) == 1 and "the bias as an add" in res.rewrites[0].pattern, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert BIAS_ACT not in c and c["graphopt.fused_pointwise.default"] == 1 and "aten.batch_norm.default" not in c
    conv = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.conv2d.default)
    assert len(conv.args) < 3 or conv.args[2] is None
    assert "aten.view.default" not in c  # the constant bias's column is stored, no node to run
    assert reference_check(m, gm, (x,)).passed
    # where lower_depthwise_conv runs, its kernel takes a depthwise convolution's bias and activation
    gm = capture(m, (x,))
    res = run_passes(gm, ["fuse_bias_act", "fuse_elementwise", "lower_depthwise_conv"], target="h200")[0]
    assert not any("the bias as an add" in r.pattern for r in res.rewrites)
    assert reference_check(m, gm, (x,)).passed
    # nothing elementwise after the activation: bias_act as before
    gm = capture(ConvAct(nn.ReLU()).eval(), (x[:, :8],))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    assert op_counts(gm)[BIAS_ACT] == 1


class ConvChain(nn.Module):
    """conv + bias + SiLU, then a conv whose bias nothing follows, then a grouped conv + bias + SiLU."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(32, 64, 3, padding=1)
        self.b = nn.Conv2d(64, 128, 1)
        self.c = nn.Conv2d(128, 128, 3, padding=1, groups=128)

    def forward(self, x):
        y = self.b(F.silu(self.a(x)))
        return F.silu(self.c(y)).mean((2, 3))


def test_conv_epilogues_keep_the_channels_last_region():
    """On a GPU that runs convolutions on NHWC tensors, bias_act's output keeps its input's layout:
    the epilogues stay inside convert_channels_last's region, every convolution reads channels_last,
    and a convolution's lone bias moves into bias_act too (aten adds it in a broadcast kernel)."""
    torch.manual_seed(0)
    m = ConvChain().eval().to(torch.bfloat16)
    x = torch.randn(8, 32, 56, 56, dtype=torch.bfloat16)
    gm = capture(m, (x,))
    res, layout = run_passes(gm, ["fuse_bias_act", "convert_channels_last"], target="h200")
    assert layout.status == "applied", layout.rejected
    acts = sorted(n.args[2] for n in gm.graph.nodes if str(n.target) == BIAS_ACT)
    assert acts == ["none", "silu", "silu"], [(r.candidate, r.reason) for r in res.rejected]
    convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.conv2d.default]
    assert len(convs) == 3 and all(len(c.args) < 3 or c.args[2] is None for c in convs)
    for n in convs + [n for n in gm.graph.nodes if str(n.target) == BIAS_ACT]:
        assert n.meta["val"].is_contiguous(memory_format=torch.channels_last), n.name
    assert reference_check(m, gm, (x,)).passed


def test_bias_act_keeps_a_channels_last_layout():
    """The op's rule (its CPU reference and its fake, as the CUDA kernel): channels_last in, with
    the bias along the channels or none, gives channels_last out; a bias along another dim, or
    a contiguous input, gives a contiguous result."""
    from graphopt.cuda_ext.ops.bias_act import fake, reference

    x = torch.randn(2, 16, 5, 7).contiguous(memory_format=torch.channels_last)
    b, r = torch.randn(16), torch.randn(2, 16, 5, 7)
    want = F.silu(x + b.view(1, -1, 1, 1)) + r
    for fn in (reference, fake):
        assert fn(x, b, "silu", r, 1).is_contiguous(memory_format=torch.channels_last)
        assert fn(x, None, "relu", None, -1).is_contiguous(memory_format=torch.channels_last)
        assert fn(x, torch.randn(7), "relu", None, -1).is_contiguous()
        assert fn(x.contiguous(), b, "silu", r, 1).is_contiguous()
    torch.testing.assert_close(reference(x, b, "silu", r, 1), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_linear_act_residual(act, dtype):
    torch.manual_seed(0)
    m = LinearActRes(ACTS[act]).eval().to(dtype)
    x, r = torch.randn(2, 5, 32, dtype=dtype), torch.randn(2, 5, 32, dtype=dtype)
    gm = capture(m, (x, r))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    c = op_counts(gm)
    assert len(res.rewrites) == 1 and c[BIAS_ACT] == 1 and c["aten.add.Tensor"] == 0
    ba = next(n for n in gm.graph.nodes if str(n.target) == BIAS_ACT)
    assert ba.args[2] == act and ba.args[3] is not None and ba.args[4] == -1
    assert reference_check(m, gm, (x, r)).passed


def test_explicit_matmul_bias_add():
    torch.manual_seed(0)
    m = MatmulBiasAct().eval()
    x = torch.randn(4, 7, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    assert op_counts(gm)[BIAS_ACT] == 1 and op_counts(gm)["aten.add.Tensor"] == 0
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("target", ["h200", "cpu"])
@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32)])
def test_linear_relu_uses_addmm_activation(shape, target):
    m = LinearRelu().eval()
    x = torch.randn(*shape)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_bias_act"], target=target)
    c = op_counts(gm)
    assert c[ADDMM_ACT] == 1 and c["aten.relu.default"] == 0 and c["aten.linear.default"] == 0
    assert reference_check(m, gm, (x,)).passed


def test_activation_read_twice_blocks_residual_only():
    m = ActTwice().eval()
    x, r = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    gm = capture(m, (x, r))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    c = op_counts(gm)
    # bias+relu still fuses (aten path); the residual add stays because relu's output is read twice
    assert c[ADDMM_ACT] == 1 and c["aten.add.Tensor"] == 1 and c[BIAS_ACT] == 0
    assert reference_check(m, gm, (x, r)).passed


def test_preactivation_read_twice_does_not_fire():
    m = SharedPreact().eval()
    x = torch.randn(2, 5, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    assert not res.rewrites and op_counts(gm)["aten.linear.default"] == 1
    assert any("read elsewhere" in r.reason for r in res.rejected)


def test_cpu_profile_refuses_kernel_rewrites():
    m = ConvAct(nn.ReLU()).eval()
    x = torch.randn(2, 8, 10, 10)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="cpu")
    assert op_counts(gm)[BIAS_ACT] == 0
    assert [r.reason for r in res.rejected] == [NO_FUSED_KERNELS]


def test_bert_tiny_bias_gelu_refused_with_reason():
    """BERT's intermediate dense + GELU: the linear applies its bias in the cuBLASLt epilogue, so
    moving it into bias_act would only swap the GELU kernel for another: refused, with the reason."""
    model, inputs = zoo.get("bert-tiny")
    gm = capture(model, inputs)
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    layers = model.config.num_hidden_layers
    assert op_counts(gm)[BIAS_ACT] == 0
    assert sum("bias + gelu after linear" in r.reason for r in res.rejected) == layers


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_bf16_linear_gelu_uses_the_gemm_epilogue(act):
    """bf16 on a CUDA profile: linear + bias + GELU -> _addmm_activation(use_gelu) (cuBLASLt's
    tanh-form GELU epilogue, within a bf16 ulp of either spelling); fp32 keeps the GELU kernel."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 96), ACTS[act]).eval().to(torch.bfloat16)
    x = torch.randn(4, 7, 32, dtype=torch.bfloat16)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    c = op_counts(gm)
    assert c[ADDMM_ACT] == 1 and c["aten.gelu.default"] == 0
    fused = next(n for n in gm.graph.nodes if str(n.target) == ADDMM_ACT)
    assert fused.kwargs["use_gelu"] is True
    assert reference_check(m, gm, (x,)).passed
    m32 = m.float()
    gm = capture(m32, (x.float(),))
    (res,) = run_passes(gm, ["fuse_bias_act"], target="h200")
    assert op_counts(gm)[ADDMM_ACT] == 0 and op_counts(gm)["aten.gelu.default"] == 1
