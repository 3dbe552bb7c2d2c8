import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.fused_pointwise.default"
SWIGLU = "graphopt.swiglu.default"
PASSES = ["hoist_slices", "fuse_swiglu", "fuse_elementwise"]


class Gated(nn.Module):
    """A gate-and-up projection whose result a pointwise op touches before it is split."""

    def __init__(self, style, d=16, i=24):
        super().__init__()
        self.style, self.i = style, i
        self.gate_up = nn.Linear(d, 2 * i, bias=False)
        self.bias = nn.Parameter(torch.randn(2 * i))
        self.down = nn.Linear(i, d, bias=False)

    def forward(self, x, pad):
        s, i = self.style, self.i
        gu = self.gate_up(x)
        if s == "masked":  # transformers' grouped-GEMM experts: padding rows zeroed, then the gate
            gate, up = gu.masked_fill(pad.unsqueeze(-1), 0.0).chunk(2, dim=-1)
        elif s == "bias":  # a bias of the whole width added before the split: it is sliced too
            gate, up = (gu + self.bias).split(i, dim=-1)
        elif s == "slices":
            y = gu * 0.5
            gate, up = y[..., :i], y[..., i:]
        elif s == "overlap":  # the two slices share columns: hoisting would compute them twice
            y = gu.masked_fill(pad.unsqueeze(-1), 0.0)
            gate, up = y[..., : i + 2], y[..., i - 2: 2 * i]
            return self.down(F.silu(gate[..., :i]) * up[..., 2:])
        elif s == "matmul_reads":  # the pieces go only to GEMMs: nothing to fuse them with
            y = gu.masked_fill(pad.unsqueeze(-1), 0.0)
            gate, up = y.chunk(2, dim=-1)
            return self.down(gate) + self.down(up)
        elif s == "read_whole":  # the masked result is also read whole
            y = gu.masked_fill(pad.unsqueeze(-1), 0.0)
            gate, up = y.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up) + y.sum(-1, keepdim=True)
        return self.down(F.silu(gate) * up)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, dtype=dtype)
    pad = torch.zeros(10, dtype=torch.bool)
    pad[7:] = True
    return x, pad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["masked", "bias", "slices"])
def test_pieces_fuse_with_their_readers(style, dtype):
    torch.manual_seed(0)
    m = Gated(style).eval().to(dtype)
    args = _inputs(dtype)
    gm = capture(m, args)
    hoist, swiglu, fuse = run_passes(gm, PASSES, target="h200")
    assert hoist.status == "applied" and len(hoist.rewrites) == 1 and hoist.rewrites[0].predicted_gain_s > 0
    c = op_counts(gm)
    # the pointwise op, the two halves' silu and product: one generated kernel, no swiglu, no split
    assert c[FUSED] == 1 and c[SWIGLU] == 0, c
    assert c["aten.masked_fill.Scalar"] == c["aten.add.Tensor"] == c["aten.silu.default"] == 0, c
    assert c["aten.chunk.default"] == c["aten.split.Tensor"] == 0, c
    assert reference_check(m, gm, args).passed


@pytest.mark.parametrize("style,why", [("overlap", "overlap"), ("matmul_reads", "no pointwise op fuse_elementwise joins"),
                                       ("read_whole", "not a piece")])
def test_refused_with_a_reason(style, why):
    m = Gated(style).eval()
    args = _inputs()
    gm = capture(m, args)
    before = op_counts(gm)
    hoist, _, _ = run_passes(gm, PASSES, target="h200")
    assert not hoist.rewrites and any(why in r.reason for r in hoist.rejected), hoist.rejected
    assert op_counts(gm)["aten.masked_fill.Scalar"] <= before["aten.masked_fill.Scalar"]
    assert reference_check(m, gm, args).passed


def test_returned_piece_is_refused():
    class M(nn.Module):
        def forward(self, x):
            a, b = (x * 2.0).chunk(2, dim=-1)
            return a, torch.relu(b)

    m = M()
    x = torch.randn(4, 8)
    gm = capture(m, (x,))
    hoist, _, _ = run_passes(gm, PASSES, target="h200")
    assert not hoist.rewrites and any("returns the piece" in r.reason for r in hoist.rejected), hoist.rejected
    assert reference_check(m, gm, (x,)).passed


def test_without_fuse_elementwise_or_on_a_cpu_profile_nothing_changes():
    m = Gated("masked").eval()
    args = _inputs()
    for passes, target in ((["hoist_slices", "fuse_swiglu"], "h200"), (PASSES, "cpu")):
        gm = capture(m, args)
        hoist = run_passes(gm, passes, target=target)[0]
        assert not hoist.rewrites and any("nothing fuses the pieces" in r.reason for r in hoist.rejected)
        assert op_counts(gm)["aten.masked_fill.Scalar"] == 1


def test_operand_broadcast_along_the_split_dim_is_read_whole():
    """A [S, 1] mask splits nothing; a [2I] bias is sliced; a 0-dim value stays as it is."""
    class M(nn.Module):
        def forward(self, x, scale, bias):
            y = x * scale + bias
            a, b = y.split([3, 5], dim=1)
            return torch.sigmoid(a).sum(1) + torch.tanh(b).sum(1)

    m = M()
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g), torch.randn(8, generator=g))
    gm = capture(m, args)
    (hoist,) = run_passes(gm, ["hoist_slices", "fuse_elementwise"], target="h200")[:1]
    assert len(hoist.rewrites) == 2  # the add read in two pieces, then the mul its pieces read
    slices = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor]
    assert all(tuple(n.meta["val"].shape) in ((6, 3), (6, 5), (3,), (5,)) for n in slices)
    assert reference_check(m, gm, args).passed


@pytest.mark.parametrize("style", ["masked", "bias"])
def test_generated_kernel_reads_the_halves_in_place(style, monkeypatch):
    """The fused group's inputs are the two halves of the projection (views with the full row's
    stride): the Triton kernel, under its interpreter, gives the reference program's values."""
    pytest.importorskip("triton")
    from tests.helpers import fused_programs_in_triton_interpreter

    torch.manual_seed(0)
    m = Gated(style).eval()
    args = _inputs()
    gm = capture(m, args)
    run_passes(gm, PASSES, target="h200")
    _, ran = fused_programs_in_triton_interpreter(gm, args, monkeypatch)
    halves = [a for call in ran for a in call[1] if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[1] == 24]
    assert ran and len(halves) == 2 and all(h.stride() == (48, 1) for h in halves), [
        [(tuple(a.shape), a.stride()) for a in call[1] if isinstance(a, torch.Tensor)] for call in ran]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("style", ["masked", "bias"])
def test_optimized_on_the_gpu_in_bf16(style):
    import graphopt

    torch.manual_seed(0)
    m = Gated(style, d=512, i=1408).eval().cuda().to(torch.bfloat16)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    pad = torch.zeros(4096, dtype=torch.bool, device="cuda")
    pad[3000:] = True
    om = graphopt.optimize(m, (x, pad), measure=False)
    res = {p.name: p for p in om.report.passes}
    assert res["hoist_slices"].status == "applied", [r.reason for r in res["hoist_slices"].rejected]
    assert res["fuse_elementwise"].status == "applied"
    assert om.report.accuracy["checked"] and om.report.accuracy["passed"]  # the fp64 rule, on the device
    assert reference_check(m, om, (x, pad)).passed


def test_a_convolutions_activation_stays_its_epilogue():
    """CSPDarknet: conv -> LeakyReLU -> a channel split. The activation is the convolution's epilogue
    (fuse_bias_act takes it whole): not hoisted over the split even where a piece has a pointwise reader."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 16, 3, padding=1)

        def forward(self, x):
            a, b = F.leaky_relu(self.conv(x), 0.1).split(8, dim=1)
            return torch.sigmoid(a) * b

    m = M().eval()
    x = torch.randn(2, 8, 6, 6)
    gm = capture(m, (x,))
    (hoist,) = run_passes(gm, ["hoist_slices", "fuse_elementwise"], target="h200")[:1]
    assert not hoist.rewrites and any("epilogue" in r.reason for r in hoist.rejected), hoist.rejected
    assert reference_check(m, gm, (x,)).passed


def test_an_operand_read_twice_is_sliced_once():
    class M(nn.Module):
        def forward(self, x):
            a, b = (x * x).chunk(2, dim=-1)
            return torch.sigmoid(a) * b

    m = M()
    x = torch.randn(4, 8)
    gm = capture(m, (x,))
    (hoist,) = run_passes(gm, ["hoist_slices", "fuse_elementwise"], target="h200")[:1]
    assert len(hoist.rewrites) == 1
    slices = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor]
    assert len(slices) == 2  # one per piece, each read twice by its square
    assert reference_check(m, gm, (x,)).passed
