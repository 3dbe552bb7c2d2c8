import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

COL2IM, OURS = "aten.col2im.default", "graphopt.col2im.default"


class Outlook(nn.Module):
    """VOLO-style outlook attention: v unfolded into 3x3 windows, each window's values mixed by
    weights made from its pooled pixel, folded back (stride 2, padding 1), projected per pixel."""

    def __init__(self, dim=24, heads=3, k=3, pad=1, stride=2):
        super().__init__()
        self.h, self.k, self.pad, self.stride = heads, k, pad, stride
        self.v, self.proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attn = nn.Linear(dim, heads * k ** 4)
        self.pool = nn.AvgPool2d(stride, stride, ceil_mode=True)

    def forward(self, x):
        B, H, W, C = x.shape
        k, kk = self.k, self.k * self.k
        v = self.v(x).permute(0, 3, 1, 2)
        h, w = math.ceil(H / self.stride), math.ceil(W / self.stride)
        v = F.unfold(v, k, padding=self.pad, stride=self.stride).reshape(B, self.h, C // self.h, kk, h * w)
        v = v.permute(0, 1, 4, 3, 2)
        a = self.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        a = self.attn(a).reshape(B, h * w, self.h, kk, kk).permute(0, 2, 1, 3, 4).softmax(-1)
        y = (a @ v).permute(0, 1, 4, 3, 2).reshape(B, C * kk, h * w)
        y = F.fold(y, (H, W), k, padding=self.pad, stride=self.stride)
        return self.proj(y.permute(0, 2, 3, 1))


class Fold(nn.Module):
    """A plain fold of a computed [N, C*kh*kw, L] tensor, read in NCHW (a residual add)."""

    def __init__(self, size, **kw):
        super().__init__()
        self.size, self.kw = size, kw

    def forward(self, cols, r):
        return F.fold(cols * 2.0, self.size, **self.kw) + r


def _ours(gm):
    return [n for n in gm.graph.nodes if str(n.target) == OURS]


def test_outlook_fold_reads_the_product_in_place_and_writes_channels_last():
    """The copy aten's fold needs of the permuted product is gone: the kernel reads the permute
    through a 7-D view (channels as heads x head dim), and writes channels_last, so the projection
    reads a contiguous tensor; the result passes the accuracy rule against float64."""
    torch.manual_seed(0)
    m = Outlook().eval()
    x = torch.randn(4, 14, 14, 24)
    gm = capture(m, (x,))
    copies = op_counts(gm)["aten.reshape.default"]
    res = run_passes(gm, ["lower_col2im"], target="h200")[0]
    assert res.status == "applied", res.rejected
    assert op_counts(gm).get(COL2IM) is None and op_counts(gm)["aten.reshape.default"] == copies - 1
    (node,) = _ours(gm)
    assert node.args[-1] is True and node.meta["val"].is_contiguous(memory_format=torch.channels_last)
    view = node.args[0]
    assert str(view.args[0].target) == "aten.permute.default" and view.args[1][1:3] == [3, 8]
    (reader,) = node.users
    assert reader.meta["val"].is_contiguous()
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("kw", [dict(kernel_size=3, padding=1), dict(kernel_size=(2, 3), dilation=(2, 1), stride=(1, 2)),
                                dict(kernel_size=2, stride=3, padding=1)])
def test_a_plain_fold_keeps_its_layout_and_passes_the_rule(kw):
    """A contiguous input is read as it is (C2 = 1) and the output stays NCHW for a reader that is
    not a permute to channels_last; overlapping, dilated and gapped windows alike."""
    from graphopt.cuda_ext.ops.col2im import windows

    size = (30, 32)
    k = kw["kernel_size"] if isinstance(kw["kernel_size"], tuple) else (kw["kernel_size"],) * 2
    args = [kw.get(n, dflt) for n, dflt in (("dilation", 1), ("padding", 0), ("stride", 1))]
    args = [a if isinstance(a, tuple) else (a, a) for a in args]
    L = math.prod(windows(size[i], k[i], args[0][i], args[1][i], args[2][i]) for i in range(2))
    m = Fold(size, **kw)
    inputs = (torch.randn(8, 32 * k[0] * k[1], L), torch.randn(8, 32, *size))
    gm = capture(m, inputs)
    assert run_passes(gm, ["lower_col2im"], target="h200")[0].status == "applied"
    (node,) = _ours(gm)
    assert node.args[-1] is False and node.args[0].args[1][2] == 1 and node.meta["val"].is_contiguous()
    assert reference_check(m, gm, inputs).passed


class Readers(nn.Module):
    """A fold read as tokens (``flatten(2).transpose(1, 2)`` then a linear) and, with ``nchw``, also as the
    NCHW tensor itself (a residual add)."""

    def __init__(self, nchw: bool):
        super().__init__()
        self.nchw, self.proj = nchw, nn.Linear(64, 64)

    def forward(self, cols, r):
        y = F.fold(cols, (32, 32), 2, stride=2)
        out = self.proj(y.flatten(2).transpose(1, 2))
        return (out, y + r) if self.nchw else out


@pytest.mark.parametrize("nchw", [False, True])
def test_the_layout_is_the_one_the_readers_views_read_in_order(nchw):
    """Read as tokens only, the fold is written channels_last (the tokens are then a contiguous tensor for
    the linear); read as the NCHW tensor too, it stays NCHW. Both pass the accuracy rule."""
    m = Readers(nchw)
    inputs = (torch.randn(16, 64 * 4, 256), torch.randn(16, 64, 32, 32))
    gm = capture(m, inputs)
    assert run_passes(gm, ["lower_col2im"], target="h200")[0].status == "applied"
    (node,) = _ours(gm)
    assert node.args[-1] is (not nchw)
    assert node.meta["val"].is_contiguous(memory_format=torch.contiguous_format if nchw else torch.channels_last)
    assert reference_check(m, gm, inputs).passed


def test_a_copy_read_elsewhere_stays():
    """The reshape copy before the fold is read by another node too: the fold reads the permute
    in place, the copy stays for its other reader, and only the fold is counted as replaced."""

    class TwoReaders(nn.Module):
        def forward(self, t):  # t [N, C1, L, kk, C2]
            cols = t.permute(0, 1, 4, 3, 2).reshape(8, 128 * 9, 49)
            return F.fold(cols, (15, 15), 3, stride=2, padding=0), cols.sum()

    gm = capture(TwoReaders(), (torch.randn(8, 4, 49, 9, 32),))
    res = run_passes(gm, ["lower_col2im"], target="h200")[0]
    assert res.status == "applied" and res.rewrites[0].matched == ["col2im"]
    assert op_counts(gm)["aten.reshape.default"] == 1


def test_a_source_written_in_place_after_the_copy_is_not_read():
    """The fold's input is a copy of a permuted graph input that the forward then writes in place: the
    kernel reads the copy (as the fold did), not the input after the write."""

    class WrittenAfter(nn.Module):
        def forward(self, t):  # t [N, C1, L, kk, C2]
            cols = t.permute(0, 1, 4, 3, 2).reshape(8, 128 * 9, 49)
            t.mul_(-3.0)
            return F.fold(cols, (15, 15), 3, stride=2)

    x = torch.randn(8, 4, 49, 9, 32)
    want = WrittenAfter()(x.clone())
    gm = capture(WrittenAfter(), (x.clone(),))
    assert any(n.target is torch.ops.aten.mul_.Tensor for n in gm.graph.nodes)
    assert run_passes(gm, ["lower_col2im"], target="h200")[0].status == "applied"
    (node,) = _ours(gm)
    assert str(node.args[0].args[0].target) != "aten.permute.default"  # the copy is read, not the input
    out = gm(x.clone())
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, want, rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_kernel():
    """The input's gradient through the rewritten graph (the op's backward is F.unfold) passes the
    accuracy rule against the float64 model's."""
    import copy

    from graphopt import accuracy

    torch.manual_seed(0)
    m = Outlook()
    x = torch.randn(2, 10, 10, 24)
    gm = capture(m, (x,))
    assert run_passes(gm, ["lower_col2im"], target="h200")[0].status == "applied"

    def grad(fn, t):
        t = t.clone().requires_grad_()
        out = fn(t)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return torch.autograd.grad(out.double().square().sum(), t)[0]

    res = accuracy.check([grad(gm, x)], [grad(copy.deepcopy(m).double(), x.double())], [grad(m, x)], training=True)
    assert res.passed, res.reason


def test_refusals_say_why():
    m = Fold((8, 8), kernel_size=2, stride=2)
    gm = capture(m, (torch.randn(2, 12, 16), torch.randn(2, 3, 8, 8)))
    res = run_passes(gm, ["lower_col2im"], target="cpu")[0]
    assert res.status == "unchanged" and NO_FUSED_KERNELS in res.rejected[0].reason
    gm = capture(m, (torch.randn(2, 12, 16, dtype=torch.float64), torch.randn(2, 3, 8, 8, dtype=torch.float64)))
    res = run_passes(gm, ["lower_col2im"], target="h200")[0]
    assert "float64" in res.rejected[0].reason and op_counts(gm)[COL2IM] == 1
    gm = capture(m, (torch.randn(12, 16), torch.randn(3, 8, 8)))
    res = run_passes(gm, ["lower_col2im"], target="h200")[0]
    assert "unbatched" in res.rejected[0].reason


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlook_fold_runs_the_kernel_on_gpu(dtype):
    """On the GPU the Triton kernel reads the permuted product in place and writes channels_last;
    the module passes the accuracy rule against float64; in bf16 the module optimize() returns too."""
    import graphopt

    torch.manual_seed(0)
    m = Outlook(dim=192, heads=6).to("cuda", dtype).eval()
    x = torch.randn(8, 28, 28, 192, device="cuda", dtype=dtype)
    gm = capture(m, (x,))
    assert run_passes(gm, ["lower_col2im"], target="h200")[0].status == "applied"
    assert reference_check(m, gm, (x,)).passed
    if dtype != torch.bfloat16:  # optimize() may run an fp32 model's GEMMs in lower precision (precision="auto")
        return
    opt = graphopt.optimize(m, (x,))
    applied = [p.name for p in opt.report.passes if p.status == "applied"]
    assert "lower_col2im" in applied, [(p.name, p.status, p.rejected[:1]) for p in opt.report.passes]
    assert reference_check(m, opt, (x,)).passed


def test_aten_col2im_is_priced_at_its_measured_rate_once():
    """aten's col2im moves its bytes at op_efficiency["col2im"] of the copy rate (measured on VOLO's folds, strided
    reads included); the strided-elementwise slowdown is not applied on top (it was: 2.7x the measured time)."""
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    prof = get_profile("h200")[0]
    gm = capture(Fold((28, 28), kernel_size=3, padding=1, stride=2),
                 (torch.randn(64, 1728, 196, dtype=torch.bfloat16), torch.randn(64, 192, 28, 28, dtype=torch.bfloat16)))
    node = next(n for n in gm.graph.nodes if str(n.target) == COL2IM)
    c = CostModel(prof).node_cost(node)
    rate = prof.bandwidth * prof.efficiency("col2im", "memory_scale", 1.0)
    assert c.memory_s == pytest.approx(c.bytes / rate, rel=1e-6)
