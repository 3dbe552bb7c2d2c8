"""fuse_attention on attention with more than one leading batch dim ([*L, H, S, D], MaxViT's
[B, G, H, P, D]) and attention written with einsum: one 4-D SDPA with q, k, v, the mask and the
output flattened over L; the refusals, each with its reason."""

import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten
PRE = ["eliminate_dead_code", "fold_constants"]


class NdAttention(nn.Module):
    """x [*L, S, E] -> q, k, v [*L, H, S, D] -> softmax(q k^T * s + bias) v.

    ``spelling``: "einsum" (MaxViT's named labels for 5-D, else "...id,...jd->...ij"), or "matmul".
    ``scale_on``: "k" (MaxViT: ``k * s`` before the product) or "scores". ``bias``: None, "table"
    (a parameter [H, S, S], MaxViT's relative position bias, as [1, H, S, S]), "causal" (a constant
    causal mask), a shape (a parameter of that shape), "from_q" (computed from q) or "from_scores"."""

    def __init__(self, lead=2, dim=32, heads=4, seq=8, spelling="einsum", scale_on="k", bias="table",
                 softmax_dim=-1):
        super().__init__()
        self.lead, self.h, self.d, self.seq = lead, heads, dim // heads, seq
        self.qkv = nn.Linear(dim, 3 * dim)
        self.scale = dim ** -0.5
        self.spelling, self.scale_on, self.bias, self.softmax_dim = spelling, scale_on, bias, softmax_dim
        if bias == "table":
            self.table = nn.Parameter(torch.randn(heads, seq, seq) * 0.5)
        elif bias == "causal":
            self.register_buffer("causal", torch.full((seq, seq), float("-inf")).triu(1))
        elif isinstance(bias, tuple):
            self.table = nn.Parameter(torch.randn(*bias) * 0.5)

    def _product(self, eq5, eq, a, b, transpose_b):
        if self.spelling == "matmul":
            return a @ (b.transpose(-2, -1) if transpose_b else b)
        return torch.einsum(eq5 if self.lead == 2 else eq, a, b)

    def forward(self, x):
        *lead, s, e = x.shape
        q, k, v = self.qkv(x).view(*lead, s, 3, self.h, self.d).unbind(-3)
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [*L, H, S, D]
        if self.scale_on == "k":
            k = k * self.scale
        scores = self._product("B G H I D, B G H J D -> B G H I J", "...id,...jd->...ij", q, k, True)
        if self.scale_on == "scores":
            scores = scores * self.scale
        if self.bias == "table":
            scores = scores + self.table.unsqueeze(0)
        elif self.bias == "causal":
            scores = scores + self.causal
        elif self.bias == "from_q":
            scores = scores + q.mean(-1, keepdim=True)
        elif self.bias == "from_scores":
            scores = scores + scores.amax(-1, keepdim=True)
        elif isinstance(self.bias, tuple):
            scores = scores + self.table
        p = scores.softmax(self.softmax_dim)
        out = self._product("B G H I J, B G H J D -> B G H I D", "...ij,...jd->...id", p, v, False)
        return out.transpose(-3, -2).reshape(*lead, s, e)


def _run(model, args, dtype=torch.float32, dynamic=None):
    model = model.to(dtype).eval()
    args = tuple(a.to(dtype) for a in args)
    gm = capture(model, args, dynamic=dynamic)
    run_passes(gm, PRE)
    (res,) = run_passes(gm, ["fuse_attention"], target="h200")
    return model, args, gm, res


def _sdpas(gm):
    sdpa = aten.scaled_dot_product_attention.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is sdpa]


def _left(gm):
    c = op_counts(gm)
    return c["aten.matmul.default"] + c["aten.softmax.int"] + c["aten.einsum.default"]


def _shape(n):
    return tuple(n.meta["val"].shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_maxvit_style_5d_einsum_attention_with_a_relative_position_bias(dtype):
    torch.manual_seed(0)
    model, args, gm, res = _run(NdAttention(), (torch.randn(2, 3, 8, 32),), dtype)
    assert res.status == "applied" and len(res.rewrites) == 1 and "flattened (5-D)" in res.rewrites[0].pattern
    (sd,) = _sdpas(gm)
    q, k, v, mask = sd.args[:4]
    assert [_shape(t) for t in (q, k, v)] == [(6, 4, 8, 8)] * 3  # [B * G, H, P, D]
    assert _shape(mask) == (1, 4, 8, 8) and sd.args[5] is False  # the bias broadcast over B * G, as it is
    assert sd.kwargs["scale"] == pytest.approx(32 ** -0.5)  # k * s folded into SDPA's scale
    assert op_counts(gm)["aten.mul.Tensor"] == 0 and _left(gm) == 0
    assert [u.target for u in sd.users] == [aten.unflatten.int]
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("spelling", ["einsum", "matmul"])
@pytest.mark.parametrize("bias,mask_shape", [
    (None, None),
    ((4, 8, 8), (4, 8, 8)),  # over none of L: as it is
    ((1, 1, 1, 4, 8, 8), (1, 4, 8, 8)),  # padded to the scores' rank, over none of L: flattened, a view
    ((2, 3, 2, 1, 8, 8), (12, 1, 8, 8)),  # over all of L: flattened
    ((3, 1, 1, 8, 8), (12, 1, 8, 8)),  # over part of L: expanded, then flattened
    ("causal", None),  # a constant causal mask: is_causal
])
def test_6d_attention(spelling, bias, mask_shape):
    torch.manual_seed(0)
    model, args, gm, res = _run(NdAttention(lead=3, spelling=spelling, scale_on="scores", bias=bias),
                                (torch.randn(2, 3, 2, 8, 32),))
    assert len(res.rewrites) == 1 and "flattened (6-D)" in res.rewrites[0].pattern
    (sd,) = _sdpas(gm)
    assert [_shape(t) for t in sd.args[:3]] == [(12, 4, 8, 8)] * 3
    assert (sd.args[3] is None) == (mask_shape is None)
    if mask_shape is not None:
        assert _shape(sd.args[3]) == mask_shape
    assert sd.args[5] is (bias == "causal")
    assert _left(gm) == 0
    assert reference_check(model, gm, args).passed


def test_symbolic_batch_dim_unflattens_with_minus_one():
    torch.manual_seed(0)
    model, args, gm, res = _run(NdAttention(), (torch.randn(2, 3, 8, 32),), dynamic={"x": {0: "batch"}})
    (sd,) = _sdpas(gm)
    (unflat,) = sd.users
    assert unflat.args[2] == [-1, 3]
    x = torch.randn(5, 3, 8, 32)
    assert reference_check(model, gm, (x,)).passed


def test_two_symbolic_batch_dims_are_refused():
    model, args, gm, res = _run(NdAttention(), (torch.randn(2, 3, 8, 32),), dynamic={"x": {0: "batch", 1: "groups"}})
    assert not _sdpas(gm)
    assert any("symbolic" in r.reason for r in res.rejected)


def test_a_bias_computed_from_q_is_an_attn_mask():
    """SDPA adds any float tensor that broadcasts to the scores; where it comes from does not matter."""
    torch.manual_seed(0)
    model, args, gm, res = _run(NdAttention(bias="from_q"), (torch.randn(2, 3, 8, 32),))
    (sd,) = _sdpas(gm)
    assert _shape(sd.args[3]) == (6, 4, 8, 1)
    assert reference_check(model, gm, args).passed


def test_a_bias_computed_from_the_scores_is_refused():
    torch.manual_seed(0)
    model, args, gm, res = _run(NdAttention(bias="from_scores"), (torch.randn(2, 3, 8, 32),))
    assert not _sdpas(gm) and op_counts(gm)["aten.softmax.int"] == 1
    assert any("attention scores" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


def test_softmax_over_another_dim_is_refused():
    model, args, gm, res = _run(NdAttention(softmax_dim=-2), (torch.randn(2, 3, 8, 32),))
    assert not _sdpas(gm)
    assert any("dim -2" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


class BroadcastQ(nn.Module):
    """q shared over G (matmul broadcasts it against k and v [B, G, H, S, D])."""

    def forward(self, q, k, v):
        p = torch.einsum("bghid,bghjd->bghij", q, k).softmax(-1)
        return torch.einsum("bghij,bghjd->bghid", p, v)


def test_batch_dims_that_broadcast_are_refused():
    torch.manual_seed(0)
    args = (torch.randn(2, 1, 4, 8, 16), torch.randn(2, 3, 4, 8, 16), torch.randn(2, 3, 4, 8, 16))
    model, args, gm, res = _run(BroadcastQ(), args)
    assert not _sdpas(gm)
    assert any("batch dims" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


class NotAttention(nn.Module):
    """Einsum products without a softmax between them, and a softmax whose probabilities go into an
    einsum that is not a matrix product (the query label summed out)."""

    def forward(self, a, b, c):
        y = torch.einsum("bgij,bgjk->bgik", a, b)
        z = torch.einsum("bgik,bgkl->bgil", y, c)
        p = torch.einsum("bgid,bgjd->bgij", a, b.transpose(-2, -1)).softmax(-1)
        return z, torch.einsum("bgij,bgjd->bgd", p, a)


def test_einsums_that_are_not_attention_are_left_as_products():
    torch.manual_seed(0)
    args = (torch.randn(2, 3, 5, 4), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6))
    model, args, gm, res = _run(NotAttention(), args)
    assert not _sdpas(gm)
    c = op_counts(gm)
    assert c["aten.matmul.default"] == 3 and c["aten.einsum.default"] == 1 and c["aten.softmax.int"] == 1
    assert any("einsum" in r.reason and "not a batched matrix product" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


class SharedScaledQ(nn.Module):
    """q * s is also returned: the multiply stays and SDPA reads it (scale 1)."""

    def forward(self, q, k, v):
        qs = q * 0.25
        p = torch.einsum("bghid,bghjd->bghij", qs, k).softmax(-1)
        return torch.einsum("bghij,bghjd->bghid", p, v), qs


def test_a_scaled_operand_read_elsewhere_is_not_folded():
    torch.manual_seed(0)
    args = tuple(torch.randn(2, 3, 4, 8, 16) for _ in range(3))
    model, args, gm, res = _run(SharedScaledQ(), args)
    (sd,) = _sdpas(gm)
    assert sd.kwargs["scale"] == 1.0 and op_counts(gm)["aten.mul.Tensor"] == 1
    assert reference_check(model, gm, args).passed


def test_training_step_through_the_flattened_sdpa():
    """Gradients of the parameters (the bias table included) through the flattened SDPA, against fp64."""
    import graphopt
    from tests.helpers import step_check

    torch.manual_seed(0)
    model = NdAttention().train()
    args = (torch.randn(2, 3, 8, 32),)
    opt = graphopt.optimize(model, args, training=True, passes=["fold_constants", "fuse_attention"])
    assert opt.report.pass_result("fuse_attention").status == "applied" and _sdpas(opt.graph_module)
    step_check(model, opt, args)


class NestBlocks(nn.Module):
    """NesT's attention: an SDPA call on q, k, v of [B, H, T, N, D] (T image blocks, 3 heads of 32);
    ``mask``: a boolean causal mask [N, N]; ``share_k``: k of the first image for all (broadcast over B)."""

    def __init__(self, mask=False, share_k=False):
        super().__init__()
        self.qkv = nn.Linear(96, 288)
        self.mask, self.share_k = mask, share_k

    def forward(self, x):  # [B, T, N, C]
        b, t, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, n, 3, 3, 32).permute(3, 0, 4, 1, 2, 5).unbind(0)
        if self.share_k:
            k = k[:1]
        m = torch.ones(n, n, dtype=torch.bool).tril() if self.mask else None
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return o.permute(0, 2, 3, 4, 1).reshape(b, t, n, 96)


def _nest_sdpa(m):
    """fuse_attention on ``m`` (NesT-sized input), checked against fp64: its result and the rank of
    the one SDPA call's q."""
    torch.manual_seed(0)
    m, x = m.eval(), torch.randn(2, 16, 196, 96)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_attention"], target="h200")
    (sd,) = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert reference_check(m, gm, (x,)).passed
    if sd.args[0].meta["val"].dim() == 4:  # q, k, v from one projection: flattened as views (the blocks
        cm = CostModel(get_profile("h200")[0])  # dim beside the batch, the heads' dim as the heads)
        flats = [n for n in gm.graph.nodes if n.target is aten.flatten.using_ints]
        assert len(flats) == 3 and all(cm.node_cost(n).time_s == 0 for n in flats)
    return res, sd.args[0].meta["val"].dim()


@pytest.mark.parametrize("mask", [False, True])
def test_an_sdpa_call_over_more_batch_dims_is_flattened_to_4d(mask):
    """CUDA's fused kernels take 4-D q, k, v only (the cost model prices a 5-D call as the math
    kernel); flattened over its leading dims the call is 4-D, its output unflattened back."""
    res, q_rank = _nest_sdpa(NestBlocks(mask=mask))
    assert q_rank == 4 and any("4-D sdpa" in r.pattern for r in res.rewrites)


def test_an_sdpa_call_whose_k_broadcasts_over_a_batch_dim_stays():
    res, q_rank = _nest_sdpa(NestBlocks(share_k=True))
    assert q_rank == 5 and any("not one batch to flatten" in r.reason for r in res.rejected)
