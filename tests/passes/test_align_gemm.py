import pytest
import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten
BF = torch.bfloat16


class Gates(nn.Module):
    """A projection to an odd width, split into a value, a gate and a scalar per row (focal
    modulation's input projection), read by pointwise ops; ``returned``: the projection is also
    returned; ``viewed``: a view merges its last dim."""

    def __init__(self, k=64, n=195, returned=False, viewed=False):
        super().__init__()
        self.proj = nn.Linear(k, n)
        self.n, self.returned, self.viewed = n, returned, viewed

    def forward(self, x):
        y = self.proj(x)
        if self.viewed:
            return y.view(y.shape[0], -1).sum(-1)
        half = (self.n - 1) // 2
        v, g, s = y.split([half, half, 1], -1)
        out = torch.relu(v) * torch.sigmoid(g) + s
        return (out, y) if self.returned else out


def _linears(gm):
    return [n for n in gm.graph.nodes if n.target is aten.linear.default]


def test_odd_n_is_padded_to_a_multiple_of_8():
    m = Gates().eval().to(BF)
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied" and res.rewrites[0].predicted_gain_s > 0, res.rejected
    (lin,) = _linears(gm)
    w = ir.get_attr_value(gm, lin.args[1].target)
    assert tuple(w.shape) == (200, 64) and not w[195:].any()
    assert tuple(ir.get_attr_value(gm, lin.args[2].target).shape) == (200,)
    assert op_counts(gm)["aten.clone.default"] == 0  # pointwise readers take the strided rows
    assert reference_check(m, gm, (x,)).passed


def test_a_returned_projection_is_copied_back_to_its_layout():
    m = Gates(k=512, returned=True).eval().to(BF)  # (K 512: the GEMM's time outweighs the copy)
    x = torch.randn(8, 1024, 512, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    out, y = gm(x)
    assert y.shape == (8, 1024, 195) and y.is_contiguous()
    assert reference_check(m, gm, (x,)).passed


def test_refused_with_the_reason():
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(Gates(viewed=True).eval().to(BF), (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "unchanged" and "reads the strides" in res.rejected[0].reason
    m = Gates(k=63).eval().to(BF)  # padding K as well costs a copy of the input: more than the GEMM gains here
    x = torch.randn(8, 1024, 63, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "unchanged" and "no gain" in res.rejected[0].reason
    assert "K=63 padded to 64 and N=195 padded to 200" in res.rejected[0].candidate


class Wide(nn.Module):
    """A wide projection from rows of 1020 (8-byte aligned only) or 1021 (odd) features."""

    def __init__(self, k, n=1024):
        super().__init__()
        self.proj = nn.Linear(k, n)

    def forward(self, x):
        return torch.relu(self.proj(x))


def test_an_unaligned_input_is_copied_into_padded_rows_where_the_gemm_gains_more():
    k = 1021  # odd: cuBLAS's align1 kernel; the input's padded copy costs less than it loses
    m = Wide(k).eval().to(BF)
    x = torch.randn(4, 1024, k, dtype=BF)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied" and res.rewrites[0].predicted_gain_s > 0, res.rejected
    assert res.rewrites[0].pattern == f"K={k} padded to 1024"
    (lin,) = _linears(gm)
    assert str(lin.args[0].target) == "aten.constant_pad_nd.default"
    w = ir.get_attr_value(gm, lin.args[1].target)
    assert tuple(w.shape) == (1024, 1024) and not w[:, k:].any()
    assert tuple(ir.info(lin).shape) == (4, 1024, 1024) and not _unaligned(gm)
    assert reference_check(m, gm, (x,)).passed


def test_nothing_padded_where_the_profile_has_not_measured_the_fallback():
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(Gates().eval().to(BF), (x,))
    plain = get_profile("h200")[0].with_efficiency("gemm_align1", None)
    (res,) = run_passes(gm, ["align_gemm"], target=plain)
    assert res.status == "unchanged" and "no gain" in res.rejected[0].reason
    assert tuple(ir.info(_linears(gm)[0]).shape) == (8, 1024, 195)


def test_padded_with_a_dynamic_batch():
    """Alignment does not depend on the rows: with the batch symbolic, the odd N is padded and any batch runs."""
    m = Gates().eval().to(BF)
    x = torch.randn(8, 1024, 64, dtype=BF)
    gm = capture(m, (x,), dynamic={"x": {0: "batch"}})
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    x3 = torch.randn(3, 1024, 64, dtype=BF)
    assert reference_check(m, gm, (x3,)).passed


@pytest.mark.cuda
def test_padded_projection_on_the_gpu():
    m = Gates(k=512, returned=True).eval().to("cuda", BF)
    x = torch.randn(8, 1024, 512, dtype=BF, device="cuda")
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    out, y = gm(x)
    assert y.is_contiguous() and y.shape == (8, 1024, 195)
    assert reference_check(m, gm, (x,)).passed


class TokenMlp(nn.Module):
    """MLP-Mixer's token MLP: linears over the tokens (196: 8-byte rows), read transposed."""

    def __init__(self, tokens=196, hidden=384, dim=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(tokens, hidden), nn.Linear(hidden, tokens)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x).transpose(1, 2))))
        return x + y.transpose(1, 2)


def _unaligned(gm):
    from graphopt.cost.model import gemm_row_alignment

    return [n for n in gm.graph.nodes if (gemm_row_alignment(n) or 8) < 8]


def test_a_constant_operand_is_stored_with_aligned_rows():
    m = TokenMlp().eval().to(BF)
    x = torch.randn(64, 196, 64, dtype=BF)
    gm = capture(m, (x,))
    lm, res = run_passes(gm, ["left_matmul_linears", "align_gemm"], target="h200")
    assert lm.status == "applied", lm.rejected
    assert res.status == "applied" and all(r.predicted_gain_s > 0 for r in res.rewrites), res.rejected
    assert all(r.pattern == "rows of 196 stored 200 apart" for r in res.rewrites)
    assert not _unaligned(gm)
    padded = [ir.get_attr_value(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"
              and "_rows200" in str(n.target)]
    assert padded and all(tuple(w.shape)[-1] == 196 and w.stride()[-2] == 200 for w in padded)
    assert reference_check(m, gm, (x,)).passed


def test_constant_rows_refused_with_the_reason():
    class Viewed(TokenMlp):
        def forward(self, x):  # the weight is also read by a view that needs its rows in memory
            return super().forward(x), self.fc1.weight.view(-1).sum()

    x = torch.randn(64, 196, 64, dtype=BF)
    gm = capture(Viewed().eval().to(BF), (x,))
    _, res = run_passes(gm, ["left_matmul_linears", "align_gemm"], target="h200")
    assert any("reads the strides" in r.reason for r in res.rejected), res.rejected
    gm = capture(TokenMlp().eval().to(BF), (x,))
    plain = get_profile("h200")[0].with_efficiency("gemm_align_partial", None)
    _, res = run_passes(gm, ["left_matmul_linears", "align_gemm"], target=plain)
    assert res.status == "unchanged" and all("no gain" in r.reason for r in res.rejected), res.rejected


@pytest.mark.cuda
def test_constant_rows_on_the_gpu():
    m = TokenMlp().eval().to("cuda", BF)
    x = torch.randn(64, 196, 64, dtype=BF, device="cuda")
    gm = capture(m, (x,))
    _, res = run_passes(gm, ["left_matmul_linears", "align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.cuda
def test_padded_input_rows_on_the_gpu():
    m = Wide(1021).eval().to("cuda", BF)
    x = torch.randn(4, 1024, 1021, dtype=BF, device="cuda")
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["align_gemm"], target="h200")
    assert res.status == "applied", res.rejected
    assert reference_check(m, gm, (x,)).passed
