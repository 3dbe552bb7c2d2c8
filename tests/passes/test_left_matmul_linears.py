import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

LINEAR = "aten.linear.default"
BMM = "aten.bmm.default"
TRANSPOSE = "aten.transpose.int"


class TokenMixer(nn.Module):
    """MLP-Mixer's token mixing: a two-layer MLP over the tokens of [batch, tokens, channels]."""

    def __init__(self, tokens=12, channels=16, hidden=20, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.fc1, self.fc2 = nn.Linear(tokens, hidden, bias=bias), nn.Linear(hidden, tokens, bias=bias)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x).transpose(1, 2)))).transpose(1, 2)


class SpatialGating(nn.Module):
    """gMLP's spatial gating unit: one half gates a linear over the tokens of the other."""

    def __init__(self, tokens=12, channels=16):
        super().__init__()
        self.norm = nn.LayerNorm(channels // 2)
        self.proj = nn.Linear(tokens, tokens)

    def forward(self, x):
        u, v = x.chunk(2, dim=-1)
        v = self.proj(self.norm(v).transpose(-1, -2))
        return u * v.transpose(-1, -2)


class GatedTokenMixer(nn.Module):
    """gMixer's token MLP: a GLU over the tokens (chunk along the transposed last dim), a per-token
    scale (a 1-D constant) on one half."""

    def __init__(self, tokens=12, channels=16, hidden=10):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(tokens, 2 * hidden), nn.Linear(hidden, tokens)
        self.scale = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x):
        a, g = self.fc1(x.transpose(1, 2)).chunk(2, dim=-1)
        return x + self.fc2(a * self.scale * nn.functional.silu(g)).transpose(1, 2)


class ReadTransposed(nn.Module):
    """The linear's result is read as it is (transposed tokens), by a sum over its last dim."""

    def __init__(self, tokens=12):
        super().__init__()
        self.fc = nn.Linear(tokens, tokens)

    def forward(self, x):
        return torch.relu(self.fc((x * 2).transpose(1, 2))).sum(-1)


def _run(m, *xs, ignore_cost=False):
    gm = capture(m, xs)
    if ignore_cost:  # legality alone: sizes too small for the cost model to see a gain
        from graphopt.cost.model import CostModel
        from graphopt.cost.profiles import get_profile
        from graphopt.ir import shape_hints
        from graphopt.pipeline import PassContext, PassManager, assemble

        ctx = PassContext(cost=CostModel(get_profile("h200")[0]), hints=shape_hints(gm), ignore_cost=True)
        return gm, PassManager(assemble(["left_matmul_linears"])).run(gm, ctx)[-1]
    res = run_passes(gm, ["left_matmul_linears"], target="h200")
    return gm, res[-1]


@pytest.mark.parametrize("bias", [True, False])
def test_token_mixing_mlp_is_two_matmuls_from_the_left(bias):
    torch.manual_seed(0)
    m = TokenMixer(bias=bias).eval()
    x = torch.randn(3, 12, 16)
    gm, res = _run(m, x)
    assert res.status == "applied" and len(res.rewrites) == 1, [r.reason for r in res.rejected]
    assert [n for n in res.rewrites[0].matched] == ["linear", "linear_1"]
    c = op_counts(gm)
    assert LINEAR not in c and TRANSPOSE not in c and c[BMM] == 2
    assert reference_check(m, gm, (x,)).passed


def test_spatial_gating_reads_the_norm_in_its_own_order():
    torch.manual_seed(0)
    m = SpatialGating().eval()
    x = torch.randn(2, 12, 16)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert LINEAR not in c and TRANSPOSE not in c and c[BMM] == 1
    # the weight is repeated over the batch as a view (stride 0), not copied
    exp = next(n for n in gm.graph.nodes if str(n.target) == "aten.expand.default")
    assert exp.meta["val"].stride()[0] == 0
    assert reference_check(m, gm, (x,)).passed


def test_two_batch_dims_and_a_plain_matrix():
    # (a 2-D linear reads its transposed input without a copy: no gain there, legal all the same)
    class Four(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 5)

        def forward(self, x, y):
            a = self.fc(x.transpose(-1, -2)).transpose(-1, -2)  # x: [2, 3, 6, 7]
            b = self.fc(y.t()).t()  # y: [6, 4]
            return a.sum() + b.sum() + a * 2

    torch.manual_seed(0)
    m = Four().eval()
    x, y = torch.randn(2, 3, 6, 7), torch.randn(6, 4)
    gm, res = _run(m, x, y, ignore_cost=True)
    assert len(res.rewrites) == 2, [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert LINEAR not in c and c["aten.mm.default"] == 1 and c[BMM] == 1
    assert reference_check(m, gm, (x, y)).passed


def test_gated_token_mlp_splits_along_the_other_dim():
    torch.manual_seed(0)
    m = GatedTokenMixer().eval()
    x = torch.randn(3, 12, 16)
    gm, res = _run(m, x, ignore_cost=True)
    assert len(res.rewrites) == 1 and res.rewrites[0].matched == ["linear", "linear_1"], \
        [r.reason for r in res.rejected]
    c = op_counts(gm)
    assert LINEAR not in c and TRANSPOSE not in c and c[BMM] == 2
    chunk = next(n for n in gm.graph.nodes if str(n.target) == "aten.chunk.default")
    assert chunk.args[2] % 3 == 1  # the tokens' dim of the untransposed values
    # the bias is added to each piece (a column each), so it fuses with the gate's elementwise ops
    assert str(chunk.args[0].target) == BMM
    assert reference_check(m, gm, (x,)).passed


def test_gated_token_mlp_in_the_pipeline_fuses_each_piece_with_its_bias():
    import graphopt

    torch.manual_seed(0)
    m = GatedTokenMixer(tokens=196, channels=64, hidden=96).eval()
    x = torch.randn(8, 196, 64)
    opt = graphopt.optimize(m, (x,), target="h200")
    assert "left_matmul_linears" in [p.name for p in opt.report.passes if p.status == "applied"]
    c = op_counts(opt.graph_module)
    assert LINEAR not in c and c[BMM] == 2 and "aten.add.Tensor" not in c and "aten.silu.default" not in c
    assert opt.report.accuracy["passed"]


def test_a_result_read_transposed_is_left_with_the_reason():
    torch.manual_seed(0)
    m = ReadTransposed().eval()
    x = torch.randn(2, 12, 16)
    gm, res = _run(m, x)
    assert res.status == "unchanged" and not res.rewrites
    assert any("read transposed by sum" in r.reason for r in res.rejected), [r.reason for r in res.rejected]
    assert op_counts(gm)[LINEAR] == 1


def test_a_group_returned_transposed_is_left_whole():
    """fc's reader is a linear over fc's other axis (a member of its group); that one is returned."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(12, 12), nn.Linear(12, 4)

        def forward(self, x):
            return self.out(torch.relu(self.fc(x.transpose(1, 2))))

    gm, res = _run(Two().eval(), torch.randn(2, 12, 16))
    assert not res.rewrites and op_counts(gm)[LINEAR] == 2
    assert any("returned transposed" in r.reason for r in res.rejected), [r.reason for r in res.rejected]


def test_a_transpose_read_elsewhere_too_stays_for_that_reader():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(12, 12)

        def forward(self, x):
            t = x.transpose(1, 2)
            return self.fc(t).transpose(1, 2) + t.sum(-1, keepdim=True).transpose(1, 2)

    torch.manual_seed(0)
    m = Shared().eval()
    x = torch.randn(2, 12, 16)
    gm, res = _run(m, x)
    assert len(res.rewrites) == 1
    assert op_counts(gm)[TRANSPOSE] >= 1  # the sum's transpose
    assert reference_check(m, gm, (x,)).passed


def test_in_the_pipeline_the_bias_fuses_with_its_readers_and_matches_fp64():
    """The whole pipeline on a small Mixer layer: the bias add and GELU become one elementwise kernel."""
    import graphopt

    torch.manual_seed(0)
    m = TokenMixer().eval()
    x = torch.randn(3, 12, 16)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = graphopt.optimize(m, (x,), target="h200")
    assert "left_matmul_linears" in [p.name for p in opt.report.passes if p.status == "applied"]
    c = op_counts(opt.graph_module)
    assert LINEAR not in c and c[BMM] == 2 and "aten.gelu.default" not in c
    assert opt.report.accuracy["passed"]
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", [TokenMixer, SpatialGating, GatedTokenMixer])
def test_optimized_on_the_gpu_in_bf16(model):
    """cuBLAS's batched GEMM over the weight repeated as a stride-0 view, in bf16, within the fp64 rule
    (or, where the guard measured the pass slower, undone with the reason)."""
    import graphopt

    torch.manual_seed(0)
    kw = {"hidden": 192} if model is GatedTokenMixer else {}
    m = model(tokens=196, channels=256, **kw).cuda().to(torch.bfloat16).eval()
    x = torch.randn(32, 196, 256, device="cuda", dtype=torch.bfloat16)
    om = graphopt.optimize(m, (x,))
    res = next(p for p in om.report.passes if p.name == "left_matmul_linears")
    assert res.rewrites or "measured slower" in " ".join(res.notes + [r.reason for r in res.rejected]), res
    assert om.report.accuracy["checked"] and om.report.accuracy["passed"]


@pytest.mark.parametrize("model", [TokenMixer, GatedTokenMixer])
def test_training_step_matches_fp64(model):
    """The rewrite is plain ATen (expand, bmm, add, chunk): autograd differentiates it; one step's loss
    and every gradient within the rule."""
    import graphopt
    from tests.helpers import step_check

    torch.manual_seed(0)
    m = model()
    x = torch.randn(3, 12, 16)
    opt = graphopt.optimize(m, (x,), training=True, target="h200", passes=["left_matmul_linears"])
    assert [p.name for p in opt.report.passes if p.status == "applied"] == ["left_matmul_linears"]
    step_check(m, opt, (x,))
