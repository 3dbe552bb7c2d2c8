import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.rotary.default"


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class Attn(nn.Module):
    """q/k projections + rotary (Llama full, partial rotate_half, or GLM partial interleaved) + SDPA.
    cos/sin are computed in the graph from position ids (Llama) or are buffers (GLM-like)."""

    def __init__(self, form="llama", heads=4, kv_heads=2, d=16, rot=None, rotate_k=True, cos_over_heads=False,
                 upcast=False, bshd=False):
        super().__init__()
        self.bshd = bshd  # rotate [B, S, H, D] before the heads are transposed (GPT-J, CodeGen), tables [1, S, 1, R]
        self.form, self.heads, self.kv, self.d = form, heads, kv_heads, d
        self.rot = rot or d
        self.rotate_k, self.cos_over_heads = rotate_k, cos_over_heads
        # upcast: rotate float32 copies of q and k with float32 tables and cast back (ModernBERT's spelling);
        # "keep": the float32 k is read again after the cast back
        self.upcast = upcast
        self.q = nn.Linear(64, heads * d)
        self.k = nn.Linear(64, kv_heads * d)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.rot, 2).float() / self.rot)))
        self.register_buffer("head_scale", torch.rand(1, heads, 1, 1) + 0.5)

    def tables(self, x):
        S = x.shape[1]
        pos = torch.arange(S, dtype=torch.float32, device=x.device)
        f = pos[:, None] * self.inv_freq[None, :]
        emb = f.repeat_interleave(2, dim=-1) if self.form == "glm" else torch.cat((f, f), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, S, R]
        if not self.upcast:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.cos_over_heads:
            cos = cos * self.head_scale.to(x.dtype)  # [1, H, S, R]: not a per-position table
        return cos, sin

    def apply(self, t, cos, sin):
        r = self.rot
        rot = rotate_pairs if self.form == "glm" else rotate_half
        if r == t.shape[-1]:
            return t * cos + rot(t) * sin
        tr, tp = t[..., :r], t[..., r:]
        return torch.cat((tr * cos + rot(tr) * sin, tp), dim=-1)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.d)
        k = self.k(x).view(B, S, self.kv, self.d)
        cos, sin = self.tables(x)
        if self.bshd:
            cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [1, S, 1, R]
            if self.bshd == "3d":
                cos, sin = cos[0], sin[0]  # [S, 1, R]
            q, k = self.apply(q, cos, sin), self.apply(k, cos, sin)
            return q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(self.heads // self.kv, dim=1).transpose(-1, -2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.upcast:
            qf, kf = self.apply(q.float(), cos, sin), self.apply(k.float(), cos, sin)
            q, k = qf.to(x.dtype), kf.to(x.dtype)
            if self.upcast == "keep":
                q = q + kf.sum(-1, keepdim=True).mean(1, keepdim=True).to(x.dtype)
        else:
            q = self.apply(q, cos, sin)
            if self.rotate_k:
                k = self.apply(k, cos, sin)
        k = k.repeat_interleave(self.heads // self.kv, dim=1)
        return q @ k.transpose(-1, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form,rot,interleaved", [("llama", None, False), ("llama", 8, False), ("glm", 8, True),
                                                  ("glm", None, True)])
def test_fuses_q_and_k(form, rot, interleaved, dtype):
    m, x = Attn(form, rot=rot).eval().to(dtype), torch.randn(2, 12, 64, dtype=dtype)
    gm = capture(m, (x,))
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["aten.neg.default"] == 0
    assert len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert node.args[4] is interleaved
    # the op gets [B or 1, S, R] tables
    assert tuple(node.args[2].meta["val"].shape) == (1, 12, rot or 16)
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form,rot,tables", [("llama", None, True), ("glm", 8, True), ("glm", None, True),
                                             ("llama", 8, "3d")])
def test_fuses_a_rotation_before_the_heads_are_transposed(form, rot, tables, dtype):
    """GPT-J's and CodeGen's spelling: x [B, S, H, D], tables [1, S, 1, R]; the op gets x transposed (a view)
    and its results are transposed back, laid out as eager's; tables [S, 1, R] too."""
    m, x = Attn(form, rot=rot, bshd=tables).eval().to(dtype), torch.randn(2, 12, 64, dtype=dtype)
    gm = capture(m, (x,))
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["aten.neg.default"] == 0 and len(res.rewrites) == 1, (c, res.rejected)
    assert res.rewrites[0].predicted_gain_s > 0
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert tuple(node.args[0].meta["val"].shape) == (2, 4, 12, 16)
    assert tuple(node.args[2].meta["val"].shape) == (1, 12, rot or 16)
    outs = [u for g in node.users for u in g.users]
    assert all(u.target is torch.ops.aten.transpose.int for u in outs)
    assert all(u.meta["val"].is_contiguous() for u in outs)  # as the rotation's eager result
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("form,rot", [("llama", None), ("glm", 8)])
def test_absorbs_the_casts_of_a_float32_rotation(form, rot):
    m, x = Attn(form, rot=rot, upcast=True).eval().to(torch.bfloat16), torch.randn(2, 12, 64, dtype=torch.bfloat16)
    gm = capture(m, (x,))
    assert op_counts(gm)["aten.to.dtype"] == 4
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["aten.to.dtype"] == 0, c
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    # bfloat16 q and k in, float32 tables
    assert [a.meta["val"].dtype for a in node.args[:4]] == [torch.bfloat16] * 2 + [torch.float32] * 2
    assert "casts absorbed" in res.rewrites[0].pattern
    assert reference_check(m, gm, (x,)).passed
    # the op's result is the float32 rotation rounded once, as the casts made it
    fq = m.q(x).view(2, 12, 4, 16).transpose(1, 2)
    fk = m.k(x).view(2, 12, 2, 16).transpose(1, 2)
    cos, sin = m.tables(x)
    want = m.apply(fq.float(), cos, sin).to(torch.bfloat16)
    got, _ = torch.ops.graphopt.rotary(fq, fk, cos.squeeze(1), sin.squeeze(1), form == "glm")
    assert torch.equal(got, want)


def test_keeps_the_casts_when_the_float32_result_is_read():
    m, x = Attn("llama", upcast="keep").eval().to(torch.bfloat16), torch.randn(2, 12, 64, dtype=torch.bfloat16)
    gm = capture(m, (x,))
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert node.args[0].meta["val"].dtype == torch.float32 and "absorbed" not in res.rewrites[0].pattern
    assert reference_check(m, gm, (x,)).passed


def test_refuses_cos_that_varies_over_heads():
    m, x = Attn("llama", kv_heads=4, cos_over_heads=True).eval(), torch.randn(2, 12, 64)
    gm = capture(m, (x,))
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    assert op_counts(gm)[FUSED] == 0
    assert any("broadcast over the heads" in r.reason for r in res.rejected), res.rejected
    assert reference_check(m, gm, (x,)).passed


def test_refuses_a_rotation_without_partner():
    m, x = Attn("glm", rot=8, rotate_k=False).eval(), torch.randn(2, 12, 64)
    gm = capture(m, (x,))
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    assert op_counts(gm)[FUSED] == 0
    assert any("no partner rotation" in r.reason for r in res.rejected)


def test_cpu_profile_refuses():
    m, x = Attn("llama").eval(), torch.randn(2, 12, 64)
    gm = capture(m, (x,))
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="cpu")
    assert op_counts(gm)[FUSED] == 0 and not res.rewrites
    assert [r.reason for r in res.rejected] == [NO_FUSED_KERNELS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm4_tiny_one_rotary_per_layer(dtype):
    model, inputs = zoo.get("glm4-tiny")
    if dtype == torch.bfloat16:
        model = model.to(dtype)
    gm = capture(model, inputs)
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    layers = model.config.num_hidden_layers
    assert len(res.rewrites) == layers and not res.rejected
    c = op_counts(gm)
    assert c[FUSED] == layers and c["aten.stack.default"] == 0 and c["aten.neg.default"] == 0
    rot = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert all(n.args[4] is True for n in rot)  # GLM's partial interleaved form
    assert reference_check(model, gm, inputs).passed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form,rot", [("llama", None), ("glm", 8)])
def test_rotation_before_the_transpose_on_the_gpu(form, rot):
    m = Attn(form, rot=rot, bshd=True).eval().cuda().to(torch.bfloat16)
    x = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
    gm = capture(m, (x,))
    run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rotary"], target="h200")
    assert op_counts(gm)[FUSED] == 1
    assert reference_check(m, gm, (x,)).passed
