import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import capture
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import fused_programs_in_triton_interpreter, op_counts, reference_check

CL = torch.channels_last
FP = "graphopt.fused_pointwise.default"
SUM = "aten.sum.dim_IntList"


class SplitAttention(nn.Module):
    """ResNeSt's split attention in small: a grouped convolution makes `radix` branches, their sum is
    pooled into weights, and the output is the branches' sum weighted by a softmax over them."""

    def __init__(self, c=16, radix=2):
        super().__init__()
        self.radix, self.c = radix, c
        self.conv = nn.Conv2d(c, c * radix, 3, padding=1, groups=radix)
        self.fc = nn.Conv2d(c, c * radix, 1)

    def forward(self, x):
        b = x.shape[0]
        y = torch.relu(self.conv(x)).reshape(b, self.radix, self.c, *x.shape[2:])
        gap = y.sum(dim=1).mean((2, 3), keepdim=True)
        attn = torch.softmax(self.fc(gap).view(b, self.radix, self.c, 1, 1), dim=1)
        return (y * attn).sum(dim=1)


def _split(radix=2, dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = SplitAttention(radix=radix).eval().to(dtype).to(memory_format=CL)
    x = torch.randn(8, 16, 40, 40, dtype=dtype).to(memory_format=CL)
    return m, x


@pytest.mark.parametrize("radix", [2, 4])
def test_split_attention_sums_become_one_kernel_each(radix):
    """Both sums over the branches are unrolled (the weighted one with its product moved into the
    terms), fuse_elementwise makes one kernel of each, and the result passes the accuracy rule."""
    m, x = _split(radix)
    gm = capture(m, (x,))
    res = run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    assert len(res[0].rewrites) == 2, res[0].rejected
    weighted = [r for r in res[0].rewrites if any(m.startswith("mul") for m in r.matched)]
    assert len(weighted) == 1
    counts = op_counts(gm)
    assert SUM not in counts and "aten.mul.Tensor" not in counts and counts[FP] == 2
    assert reference_check(m, gm, (x,)).passed


def test_the_unrolled_sum_keeps_a_channels_last_layout():
    """The slices of a channels_last tensor along its split channels are not dense, but their sum is
    written channels_last (fused_pointwise's layout rule, as aten's elementwise kernels do), where
    aten's reduction wrote a contiguous one."""
    m, x = _split()
    gm = capture(m, (x,))
    run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert out.meta["val"].is_contiguous(memory_format=CL)
    with torch.no_grad():
        assert gm(x).is_contiguous(memory_format=CL)


class Means(nn.Module):
    def forward(self, x, w):
        return (x * w + 1.0).mean(1, keepdim=True), x.sum(-1), x.sum(2)


def test_mean_keepdim_last_dim_and_what_is_refused():
    """A mean over 3 with keepdim (the product and add moved in) is unrolled; a sum over 9 elements
    is refused, and so is a lone sum over a last dim of 4 (nothing to fuse, the same layout: no gain)."""
    torch.manual_seed(0)
    m = Means()
    x, w = torch.randn(5, 3, 9, 4), torch.randn(3, 1, 1)
    gm = capture(m, (x, w))
    (res,) = run_passes(gm, ["unroll_small_reductions"], target="h200")
    assert [r.matched[0] for r in res.rewrites] == ["mean"], res.rejected
    reasons = {r.candidate.split(" ")[0]: r.reason for r in res.rejected}
    assert "over 9 elements" in reasons["sum_2"] and "no gain" in reasons["sum_1"]
    assert reference_check(m, gm, (x, w)).passed


def test_cpu_profiles_and_training_keep_the_reduction():
    m, x = _split(dtype=torch.float32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["unroll_small_reductions"], target="cpu")
    assert not res.rewrites and NO_FUSED_KERNELS in res.rejected[0].reason
    gm = capture(m.train(), (x,))
    (res,) = run_passes(gm, ["unroll_small_reductions"], target="h200", training=True)
    assert res.status == "skipped" and SUM in op_counts(gm)


def test_whole_pipeline_on_split_attention_unrolls_the_weighted_sum():
    """optimize() planned for the H200: the weighted sum over the branches is one fused kernel with
    its product, and the optimized module passes the accuracy rule."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = SplitAttention()
            self.after = nn.Conv2d(16, 16, 3, padding=1)

        def forward(self, x):
            return self.after(self.block(x))

    torch.manual_seed(0)
    m = Net().eval().to(torch.bfloat16)
    x = torch.randn(8, 16, 40, 40, dtype=torch.bfloat16)
    opt = graphopt.optimize(m, (x,), target="h200", cuda_graphs=False)
    (unroll,) = [p for p in opt.report.passes if p.name == "unroll_small_reductions"]
    assert any(m.startswith("mul") for r in unroll.rewrites for m in r.matched), unroll.rejected
    assert "aten.mul.Tensor" not in op_counts(opt.graph_module)
    assert opt.report.accuracy["passed"]


@pytest.mark.cuda
@pytest.mark.parametrize("radix", [2, 4])
def test_unrolled_sums_run_the_generated_kernel_on_strided_slices(radix):
    """On the GPU the fused kernel reads the slices of the channels_last branches through their
    strides and writes channels_last; the module passes the accuracy rule against fp64. (Captured on
    an H100, the lone sum over the branches stayed aten's, the pass predicting no gain from unrolling
    it alone, as on the meta device; the weighted one is unrolled with its product.)"""
    m, x = _split(radix)
    m, x = m.cuda(), x.cuda()
    gm = capture(m, (x,))
    run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    assert "aten.mul.Tensor" not in op_counts(gm) and op_counts(gm)[FP] >= 1
    with torch.no_grad():
        out = gm(x)
    assert out.is_contiguous(memory_format=CL)
    assert reference_check(m, gm, (x,)).passed


class Selective(nn.Module):
    """SKNet's selective kernel in small: two branches stacked, their sum pooled into weights, the
    weighted sum of the stacked branches."""

    def __init__(self, c=16):
        super().__init__()
        self.a, self.b = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=2, dilation=2)
        self.fc = nn.Conv2d(c, 2 * c, 1)

    def forward(self, x):
        y = torch.stack([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1)
        w = torch.softmax(self.fc(y.sum(1).mean((2, 3), keepdim=True)).view(x.shape[0], 2, -1, 1, 1), dim=1)
        return (y * w).sum(1)


def test_sums_over_a_stack_read_the_stacked_tensors():
    """Both sums over SKNet's stacked branches read the branches themselves: the stack is gone."""
    torch.manual_seed(0)
    m = Selective().eval().to(torch.bfloat16).to(memory_format=CL)
    x = torch.randn(8, 16, 40, 40, dtype=torch.bfloat16).to(memory_format=CL)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["unroll_small_reductions"], target="h200")
    counts = op_counts(gm)
    assert SUM not in counts and "aten.stack.default" not in counts, (counts, res.rejected)
    assert reference_check(m, gm, (x,)).passed


def test_an_op_whose_operand_is_written_before_the_sum_is_not_moved():
    """A product whose operand a buffer write changes before the sum reads the product is computed
    where it was (the sum reads its slices); moved down, it would read the written values."""

    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(4, 3, 1))

        def forward(self, x):
            y = x * self.w
            self.w.mul_(2.0)
            return y.sum(1)

    torch.manual_seed(0)
    m = Written().eval()
    x = torch.randn(4, 3, 64)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["unroll_small_reductions"], target="h200")
    assert all(not any(mm.startswith("mul") for mm in r.matched) for r in res.rewrites)
    assert "aten.mul.Tensor" in op_counts(gm)


class FactorizedAttention(nn.Module):
    """CoaT's factorized attention in small: K^T V over the tokens (a contraction over them: stays a
    GEMM), then q times that 8x8 matrix per head (a contraction over 8 channels), scaled, plus a
    residual term, heads merged."""

    def forward(self, q, k, v, res):
        b, h, n, c = q.shape
        kv = k.softmax(dim=2).transpose(-1, -2) @ v
        x = 0.3 * (q @ kv) + res
        return x.transpose(1, 2).reshape(b, n, h * c)


def _factor(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    qkv = torch.randn(2, 50, 3, 4, 8, dtype=dtype, device=device).permute(2, 0, 3, 1, 4)  # q, k, v permuted views
    return FactorizedAttention(), (qkv[0], qkv[1], qkv[2], torch.randn(2, 4, 50, 8, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matmul_contracting_a_few_channels_becomes_one_kernel_with_its_epilogue(dtype):
    """q @ kv (8 channels, q read through the qkv projection's permute: aten would copy it) is the sum
    of 8 outer products of q's and kv's slices; fuse_elementwise makes one kernel of them, the scale and
    the residual. K^T V (a contraction over 50 tokens) stays a matmul."""
    m, xs = _factor(dtype)
    gm = capture(m, xs)
    unroll, _ = run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    assert [r.pattern for r in unroll.rewrites] == ["small matmul -> sum of outer products"]
    assert any("contraction over 50" in r.reason for r in unroll.rejected)
    c = op_counts(gm)
    assert c["aten.matmul.default"] == 1 and c["aten.mul.Tensor"] == 0 and c["aten.add.Tensor"] == 0 and c[FP] >= 1
    assert reference_check(m, gm, xs).passed


def test_matmul_operand_copies_are_priced():
    """aten's matmul copies an operand whose batch dims do not fold (the permuted q); the cost model
    adds that copy, and not for contiguous or foldable operands (a transposed K^T is read as is)."""
    from graphopt.cost.model import matmul_copy_bytes

    m, xs = _factor()
    gm = capture(m, xs)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.matmul.default]
    kv, out = mms
    q = xs[0]
    assert matmul_copy_bytes(out) == 2 * q.numel() * q.element_size()  # q; kv is contiguous
    assert matmul_copy_bytes(kv) == 2 * q.numel() * q.element_size()  # v (the transposed softmax folds)
    gm2 = capture(FactorizedAttention(), tuple(t.contiguous() for t in xs))
    assert all(matmul_copy_bytes(n) == 0 for n in gm2.graph.nodes if n.target is torch.ops.aten.matmul.default)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unrolled_matmul_runs_the_generated_kernel(dtype):
    m, xs = _factor(dtype, "cuda")
    gm = capture(m, xs)
    run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    assert op_counts(gm)["aten.matmul.default"] == 1 and op_counts(gm)[FP] >= 1
    assert reference_check(m, gm, xs).passed


def test_unrolled_matmul_program_in_the_triton_interpreter(monkeypatch):
    """The fused kernel of the unrolled q @ kv (16 slices through their strides, the scale, the residual),
    generated by Triton and run by its interpreter on the CPU: the reference's values and layout."""
    pytest.importorskip("triton")
    m, xs = _factor()
    gm = capture(m, xs)
    run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    _, ran = fused_programs_in_triton_interpreter(gm, xs, monkeypatch)
    assert max(len(inputs) for _, inputs in ran) >= 16


class TalkingHeads(nn.Module):
    """CaiT's talking heads in small: linears over the heads dim of the permuted score tensor, before
    and after the softmax over the keys."""

    def __init__(self, heads=4):
        super().__init__()
        self.proj_l, self.proj_w = nn.Linear(heads, heads), nn.Linear(heads, heads)

    def forward(self, q, k):
        attn = q @ k.transpose(-2, -1)
        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.proj_w(attn.softmax(dim=-1).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _talking(dtype=torch.float32):
    torch.manual_seed(0)
    m = TalkingHeads().eval().to(dtype)
    return m, (torch.randn(2, 4, 40, 16, dtype=dtype), torch.randn(2, 4, 40, 16, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_over_a_few_inputs_becomes_the_sum_of_its_columns_with_the_bias(dtype):
    """A linear over the 4 heads of a permuted score tensor (aten copies it to read it as rows) is its
    input's 4 columns times the weight's, plus the bias, in float32; fuse_elementwise makes kernels of
    them; the accuracy rule holds."""
    from graphopt.cost.model import matmul_copy_bytes

    m, xs = _talking(dtype)
    gm = capture(m, xs)
    lins = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(lins) == 2 and all(matmul_copy_bytes(n) > 0 for n in lins)  # the permuted input is copied
    unroll, _ = run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    assert sum(r.pattern == "small matmul -> sum of outer products" for r in unroll.rewrites) == 2
    c = op_counts(gm)
    assert "aten.linear.default" not in c and c[FP] >= 1
    assert reference_check(m, gm, xs).passed


def test_unrolled_linear_program_in_the_triton_interpreter(monkeypatch):
    pytest.importorskip("triton")
    m, xs = _talking()
    gm = capture(m, xs)
    run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    _, ran = fused_programs_in_triton_interpreter(gm, xs, monkeypatch)
    assert max(len(inputs) for _, inputs in ran) >= 9  # 4 columns, 4 weight columns, the bias


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_unrolled_linear_runs_the_generated_kernel():
    m, xs = _talking(torch.bfloat16)
    m, xs = m.cuda(), tuple(x.cuda() for x in xs)
    gm = capture(m, xs)
    run_passes(gm, ["unroll_small_reductions", "fuse_elementwise"], target="h200")
    assert "aten.linear.default" not in op_counts(gm)
    assert reference_check(m, gm, xs).passed
