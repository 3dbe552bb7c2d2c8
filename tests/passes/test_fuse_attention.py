import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten
SDPA = "aten.scaled_dot_product_attention.default"
PRE = ["eliminate_dead_code", "fold_constants"]


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default]


def _attention_left(gm):
    c = op_counts(gm)
    return c["aten.softmax.int"] + c["aten._softmax.default"] + c["aten.matmul.default"]


# ---------------------------------------------------------------- hand-written modules


class PaddedAttention(nn.Module):
    """BERT-style: separate heads, divide by sqrt(d), additive padding mask [B, 1, 1, S]."""

    def __init__(self, dim=32, heads=4, softmax_dim=-1, return_probs=False):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.softmax_dim, self.return_probs = softmax_dim, return_probs

    def forward(self, x, keep):
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, self.h, self.d).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        mask = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        probs = torch.softmax(scores + mask, dim=self.softmax_dim)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return (out, probs) if self.return_probs else out


class GqaConstMask(nn.Module):
    """Llama-style GQA with repeat_kv and a constant mask buffer (causal, or another pattern)."""

    def __init__(self, dim=32, heads=4, kv_heads=2, seq=8, mask="causal"):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.d)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d)
        if mask == "causal":
            m = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)
        else:  # sliding window of 2: not a causal mask
            i = torch.arange(seq)
            m = torch.where((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2), 0.0, float("-inf"))
        self.register_buffer("mask", m[None, None])

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        n = self.h // self.hkv
        rep = lambda t: t[:, :, None].expand(b, self.hkv, n, s, self.d).reshape(b, self.h, s, self.d)  # noqa: E731
        scores = torch.matmul(q, rep(k).transpose(2, 3)) * self.d ** -0.5 + self.mask.to(x.dtype)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, rep(v)).transpose(1, 2).reshape(b, s, -1)


class SdpaConstCausal(nn.Module):
    def __init__(self, seq=8):
        super().__init__()
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


class ArangeCausal(nn.Module):
    """Builds its causal mask from ``arange`` in every call, as Hugging Face does (optionally AND-ed
    with a padding mask read from an input, which makes it no longer a constant)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, keep=None):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        allowed = (i[None, :] <= i[:, None])[None, None].expand(b, 1, s, s)
        if keep is not None:
            allowed = allowed & keep[:, None, None, :].bool()
        mask = torch.zeros(b, 1, s, s, dtype=x.dtype, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.d ** -0.5 + mask, dim=-1)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)


class TrainingDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1)
        return torch.matmul(self.drop(p), v)


def _run(model, args, dtype=torch.float32, target="h200"):
    model = model.to(dtype).eval()
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    gm = capture(model, args)
    run_passes(gm, PRE)
    (res,) = run_passes(gm, ["fuse_attention"], target=target)
    return model, args, gm, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_attention_to_sdpa(dtype):
    torch.manual_seed(0)
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[1, 5:] = 0
    model, args, gm, res = _run(PaddedAttention(), (torch.randn(2, 8, 32), keep), dtype)
    assert res.status == "applied" and len(res.rewrites) == 1
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is not None and sd.args[5] is False  # padding mask passed as attn_mask
    assert sd.kwargs["scale"] == pytest.approx(1 / math.sqrt(8))
    assert _attention_left(gm) == 0
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_constant_causal_mask(dtype):
    torch.manual_seed(0)
    model, args, gm, res = _run(GqaConstMask(), (torch.randn(2, 8, 32),), dtype)
    assert len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is None and sd.args[5] is True and sd.kwargs.get("enable_gqa") is True
    assert sd.args[1].meta["val"].shape[1] == 2  # K is not repeated
    assert op_counts(gm)["aten.expand.default"] == 0 and _attention_left(gm) == 0
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("seq", [8, 1100])
def test_causal_mask_built_in_the_graph(seq):
    """A mask computed from arange in every call is evaluated at optimization time; when it is causal
    it becomes is_causal=True and the nodes that built it are erased. At seq 1100 the 4.6 MiB mask is
    too big for fold_constants to store, so fuse_attention sees the unfolded subgraph."""
    torch.manual_seed(0)
    model, args, gm, res = _run(ArangeCausal(), (torch.randn(1, seq, 32),))
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is None and sd.args[5] is True
    c = op_counts(gm)
    assert c["aten.arange.default"] + c["aten.arange.start"] + c["aten.masked_fill.Scalar"] + c["aten.le.Tensor"] == 0
    assert reference_check(model, gm, args).passed


def test_cpu_profile_also_rewrites():
    model, args, gm, res = _run(GqaConstMask(), (torch.randn(2, 8, 32),), target="cpu")
    assert len(res.rewrites) == 1 and len(_sdpa_nodes(gm)) == 1
    assert reference_check(model, gm, args).passed


class CosineAttention(nn.Module):
    """Swin V2's attention: cosine similarity of normalized q and k times a per-head learned logit
    scale ([H, 1, 1], clamped and exp'd: a constant once folded), plus a relative-position bias."""

    def __init__(self, dim=32, heads=4, seq=8, scale_shape=None):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(scale_shape or (heads, 1, 1)) + 1))
        self.bias = nn.Parameter(torch.randn(1, heads, seq, seq))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp() + self.bias
        return (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_per_score_row_multiplies_q(dtype):
    torch.manual_seed(0)
    model, args, gm, res = _run(CosineAttention(), (torch.randn(2, 8, 32),), dtype)
    assert res.status == "applied" and len(res.rewrites) == 1
    (sd,) = _sdpa_nodes(gm)
    assert sd.kwargs["scale"] == 1.0 and sd.args[3] is not None  # the bias stays attn_mask
    q = sd.args[0]
    assert q.target is aten.mul.Tensor and tuple(q.meta["val"].shape) == (2, 4, 8, 8)
    assert _attention_left(gm) == 0
    assert reference_check(model, gm, args).passed


def test_a_scale_that_varies_along_the_keys_is_refused():
    torch.manual_seed(0)
    model, args, gm, res = _run(CosineAttention(scale_shape=(4, 1, 8)), (torch.randn(2, 8, 32),))
    assert not _sdpa_nodes(gm)
    assert any("one per score row" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


class PermutedKeys(nn.Module):
    """K split into heads and permuted straight to [B, H, D, S] (no transpose of a [B, H, S, D] K),
    with a learned additive bias per head: LeViT's spelling. ``order``: the permute of the
    [B, S, H, D] keys; the scores are q @ that (any order: K is then that permute with its last two
    entries swapped)."""

    def __init__(self, dim=32, heads=4, seq=8, order=(0, 2, 3, 1)):
        super().__init__()
        self.h, self.d, self.order = heads, dim // heads, order
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).permute(0, 2, 1, 3)
        k = self.k(x).view(b, s, self.h, self.d).permute(*self.order)
        v = self.v(x).view(b, s, self.h, self.d).permute(0, 2, 1, 3)
        attn = (q @ k) * self.d ** -0.5 + self.bias
        return (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_permuted_straight_to_heads_by_keys_become_sdpa(dtype):
    """fuse_attention: a K^T that is a permute of K's source, not a swap of a [B, H, S, D] K's last two
    dims, reads K as that source permuted with the last two entries swapped (a view); the bias stays
    attn_mask."""
    torch.manual_seed(0)
    model, args, gm, res = _run(PermutedKeys(), (torch.randn(2, 8, 32),), dtype)
    assert res.status == "applied" and len(res.rewrites) == 1, [(r.candidate, r.reason) for r in res.rejected]
    (sd,) = _sdpa_nodes(gm)
    k = sd.args[1]
    assert k.target is aten.permute.default and list(k.args[1]) == [0, 2, 1, 3]
    assert tuple(k.meta["val"].shape) == (2, 4, 8, 8) and sd.args[3] is not None
    assert _attention_left(gm) == 0
    assert reference_check(model, gm, args).passed


class ContiguousKeys(nn.Module):
    """GC ViT's window attention: q scaled, ``k.transpose(-2, -1).contiguous()``, a relative position bias."""

    def __init__(self, h=2, d=8, s=9):
        super().__init__()
        self.h, self.d = h, d
        self.qkv = nn.Linear(h * d, 3 * h * d)
        self.bias = nn.Parameter(torch.randn(1, h, s, s) * 0.1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * self.d ** -0.5) @ k.transpose(-2, -1).contiguous() + self.bias
        return (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_key_made_contiguous_becomes_sdpa(dtype):
    """A copy of K^T (``.contiguous()``) holds K's values: SDPA reads K as it is, the copy goes."""
    torch.manual_seed(0)
    model, args, gm, res = _run(ContiguousKeys(), (torch.randn(3, 9, 16),), dtype)
    assert res.status == "applied" and len(res.rewrites) == 1, [(r.candidate, r.reason) for r in res.rejected]
    assert _attention_left(gm) == 0 and "aten.contiguous.default" not in op_counts(gm)
    assert reference_check(model, gm, args).passed


# ---------------------------------------------------------------- negative cases


def test_non_causal_constant_mask_stays_attn_mask():
    model, args, gm, res = _run(GqaConstMask(mask="window"), (torch.randn(2, 8, 32),))
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is not None and sd.args[5] is False  # the window mask is passed as attn_mask
    assert reference_check(model, gm, args).passed


def test_causal_mask_and_input_padding_stays_attn_mask():
    """The same causal mask AND-ed with a padding mask from an input is not a constant: it is passed
    as attn_mask, never dropped."""
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[1, 6:] = 0
    model, args, gm, res = _run(ArangeCausal(), (torch.randn(2, 8, 32), keep))
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is not None and sd.args[5] is False
    assert reference_check(model, gm, args).passed


def test_softmax_on_dim_1_is_refused():
    keep = torch.ones(2, 8, dtype=torch.long)
    model, args, gm, res = _run(PaddedAttention(softmax_dim=1), (torch.randn(2, 8, 32), keep))
    assert not _sdpa_nodes(gm) and op_counts(gm)["aten.softmax.int"] == 1
    assert any("dim 1" in r.reason for r in res.rejected)


def test_probabilities_read_twice_are_refused():
    keep = torch.ones(2, 8, dtype=torch.long)
    model, args, gm, res = _run(PaddedAttention(return_probs=True), (torch.randn(2, 8, 32), keep))
    assert not _sdpa_nodes(gm) and op_counts(gm)["aten.softmax.int"] == 1
    assert any("attention probabilities" in r.reason and "output_attentions" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


def test_active_dropout_in_training_graph_is_refused():
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    model = TrainingDropout().train()
    gm = capture(model, (q, k, v))
    (res,) = run_passes(gm, ["fuse_attention"], training=True)
    assert not _sdpa_nodes(gm)
    assert any("dropout" in r.reason for r in res.rejected)


def test_existing_sdpa_with_constant_causal_mask():
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    model, args, gm, res = _run(SdpaConstCausal(), (q, k, v))
    (sd,) = _sdpa_nodes(gm)
    assert len(res.rewrites) == 1 and sd.args[3] is None and sd.args[5] is True
    assert reference_check(model, gm, args).passed


class SdpaAllKeptMask(nn.Module):
    """An SDPA whose mask keeps every position, built in every call from ``arange`` (what Hugging Face's
    mask functions produce under torch.export for an input without padding), or a buffer."""

    def __init__(self, kind="arange", seq=8):
        super().__init__()
        self.kind = kind
        zeros = torch.zeros(1, 1, seq, seq)
        if kind == "one_masked":
            zeros[..., 0, -1] = float("-inf")
        self.register_buffer("zeros", zeros)

    def forward(self, q, k, v):
        if self.kind == "arange":
            pos = torch.arange(q.shape[-2], device=q.device) + 0
            mask = (pos[None, None, :, None] >= 0).expand(q.shape[0], -1, q.shape[-2], k.shape[-2])
        else:
            mask = self.zeros
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["arange", "zeros"])
def test_existing_sdpa_with_a_mask_that_masks_nothing_loses_it(kind):
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    model, args, gm, res = _run(SdpaAllKeptMask(kind), (q, k, v))
    (sd,) = _sdpa_nodes(gm)
    assert len(res.rewrites) == 1 and sd.args[3] is None and sd.args[5] is False
    assert not any(n.target in (aten.arange.default, aten.arange.start) for n in gm.graph.nodes)  # its builders go
    assert reference_check(model, gm, args).passed


def test_a_constant_mask_that_masks_one_position_stays():
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    model, args, gm, res = _run(SdpaAllKeptMask("one_masked"), (q, k, v))
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is not None and not res.rewrites
    assert any("neither empty nor a causal mask" in r.reason for r in res.rejected)


def test_explicit_attention_with_an_all_zero_additive_mask_gets_no_mask():
    class ZeroMask(PaddedAttention):
        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t(x).view(b, s, self.h, self.d).transpose(1, 2) for t in (self.q, self.k, self.v))
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.d) + torch.zeros(1, 1, 1, s)
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)

    model, args, gm, res = _run(ZeroMask(), (torch.randn(2, 8, 32),))
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is None and sd.args[5] is False and _attention_left(gm) == 0
    assert reference_check(model, gm, args).passed


class TrainedBias(PaddedAttention):
    """An additive attention bias that is a parameter initialised to zero (BEiT's relative position
    bias table): all zeros now, trained later."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(self.h, 8, 8))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t(x).view(b, s, self.h, self.d).transpose(1, 2) for t in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d) + self.bias
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)


def test_a_zero_bias_from_a_trained_parameter_stays_in_training():
    """Inference may drop the all-zero bias (the parameter is a constant there); training keeps it
    as SDPA's attn_mask, or the parameter would get no gradient (it did: BEiT's table got zeros)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    _, _, gm, _ = _run(TrainedBias(), (x,))
    assert _sdpa_nodes(gm)[0].args[3] is None
    model = TrainedBias().train()
    opt = graphopt.optimize(model, (x,), training=True, passes=["fuse_attention"], check_accuracy=False)
    (sd,) = _sdpa_nodes(opt.graph_module)
    assert sd.args[3] is not None
    g = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    (opt(x) * g).sum().backward()
    ours = model.bias.grad.clone()
    model.bias.grad = None
    (model(x) * g).sum().backward()
    assert ours.abs().sum() > 0
    torch.testing.assert_close(ours, model.bias.grad, rtol=1e-4, atol=1e-6)


def test_hf_vit_without_padding_runs_sdpa_without_a_mask():
    """transformers' ViT passes no mask in eager but builds an all-True one under torch.export: the
    optimized graph's SDPA calls read none (the flash kernel can take them on a GPU)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = transformers.ViTModel(cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    opt = graphopt.optimize(model, (x,), target="h200", measure=False)
    sds = _sdpa_nodes(opt.graph_module)
    assert len(sds) == 2 and all(sd.args[3] is None for sd in sds)
    assert opt.report.accuracy["passed"]


# ---------------------------------------------------------------- zoo models


def _check_zoo_graph(name, gm, layers):
    sds = _sdpa_nodes(gm)
    assert len(sds) == layers and _attention_left(gm) == 0
    if name == "glm4-tiny":  # GQA without repeat_kv, causal mask folded to is_causal
        assert all(sd.args[5] is True and sd.args[3] is None and sd.kwargs.get("enable_gqa") for sd in sds)
        assert all(n.target is not aten.expand.default or not n.users for n in gm.graph.nodes)
    else:  # the padding mask stays
        assert all(sd.args[3] is not None and sd.args[5] is False for sd in sds)


@pytest.mark.parametrize("name,layers", [("bert-tiny", 2), ("glm4-tiny", 2)])
def test_zoo_bf16_graph_and_numerics(name, layers):
    model, inputs = zoo.get(name)
    model = model.to(torch.bfloat16)
    gm = capture(model, inputs)
    run_passes(gm, PRE)
    (res,) = run_passes(gm, ["fuse_attention"])
    assert len(res.rewrites) == layers
    _check_zoo_graph(name, gm, layers)
    assert reference_check(model, gm, inputs).passed


def test_vit_already_sdpa_is_left_alone():
    model, inputs = zoo.get("vit-tiny")
    gm = capture(model, inputs)
    run_passes(gm, PRE)
    before = op_counts(gm)
    (res,) = run_passes(gm, ["fuse_attention"])
    assert res.status == "unchanged" and op_counts(gm) == before


@pytest.mark.parametrize("name,layers", [("bert-tiny", 2)])
def test_optimize_fp32_one_rewrite_per_layer(name, layers):
    model, inputs = zoo.get(name)
    opt = graphopt.optimize(model, inputs, target="h200", precision="fp32")
    res = opt.report.pass_result("fuse_attention")
    assert res.status == "applied" and len(res.rewrites) == layers
    _check_zoo_graph(name, opt.graph_module, layers)
    # fp32 numerics of the whole optimized pipeline against fp64
    assert reference_check(model, opt, inputs).passed


@pytest.mark.parametrize("name,layers", [
    ("bert-tiny", 2),
    ("glm4-tiny", 2),
])
def test_optimize_default_precision_one_rewrite_per_layer(name, layers):
    model, inputs = zoo.get(name)
    opt = graphopt.optimize(model, inputs, target="h200")
    assert len(opt.report.pass_result("fuse_attention").rewrites) == layers
    _check_zoo_graph(name, opt.graph_module, layers)
    assert reference_check(model, opt, inputs).passed


# ---------------------------------------------------------------- SDPA over repeat_kv'd K/V


class RepeatKvSdpa(nn.Module):
    """HF's repeat_kv (unsqueeze, expand, reshape) before an existing SDPA call, causal or with a
    constant mask."""

    def __init__(self, dim=32, heads=4, kv_heads=2, seq=8, mask=None):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d)
        self.mask = mask

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kvh, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        n = self.h // self.kvh
        k = k[:, :, None].expand(b, self.kvh, n, s, self.d).reshape(b, self.h, s, self.d)
        v = v[:, :, None].expand(b, self.kvh, n, s, self.d).reshape(b, self.h, s, self.d)
        if self.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def test_sdpa_over_repeated_kv_reads_them_unrepeated_with_enable_gqa():
    torch.manual_seed(0)
    model, args, gm, res = _run(RepeatKvSdpa(), (torch.randn(2, 8, 32),))
    (sd,) = _sdpa_nodes(gm)
    assert sd.kwargs.get("enable_gqa") is True and sd.args[5] is True
    assert all(n.target is not aten.expand.default for n in gm.graph.nodes)  # the repeat copies are gone
    assert [tuple(a.meta["val"].shape)[1] for a in sd.args[1:3]] == [2, 2]
    assert reference_check(model, gm, args).passed
    # training: gradients through SDPA's GQA path follow eager (the accuracy guard keeps the pass)
    opt = graphopt.optimize(RepeatKvSdpa().train(), args, training=True, passes=["fold_constants", "fuse_attention"])
    r = opt.report.pass_result("fuse_attention")
    assert r.status == "applied" and any(sd.kwargs.get("enable_gqa") for sd in _sdpa_nodes(opt.graph_module))


@pytest.mark.parametrize("masked_gqa_kernel, target", [(False, "a100"), (True, "a100"), (False, "h200")])
def test_sdpa_over_repeated_kv_with_a_non_causal_mask(monkeypatch, masked_gqa_kernel, target):
    """With a mask, the repeat goes only where a fused kernel takes GQA with a mask (torch >=
    2.14's memory-efficient attention, or cuDNN's on an sm_90 profile); the mask stays either way."""
    import graphopt.passes.fuse_attention as fa

    monkeypatch.setattr(fa, "_MASKED_GQA_KERNEL", masked_gqa_kernel)
    masked_gqa_kernel = masked_gqa_kernel or target == "h200"
    torch.manual_seed(0)
    mask = torch.rand(8, 8) > 0.3
    mask[:, 0] = True
    model, args, gm, res = _run(RepeatKvSdpa(mask=mask), (torch.randn(2, 8, 32),), target=target)
    (sd,) = _sdpa_nodes(gm)
    assert sd.args[3] is not None
    assert bool(sd.kwargs.get("enable_gqa")) is masked_gqa_kernel
    assert any(n.target is aten.expand.default for n in gm.graph.nodes) is not masked_gqa_kernel
    assert reference_check(model, gm, args).passed


def test_sdpa_over_repeated_kv_for_one_query_row_reads_the_cache_unrepeated(monkeypatch):
    """A decode step (one query row against the whole key/value cache, masked): SDPA reads the
    un-repeated K/V with enable_gqa whatever the kernels (the math kernel's own repeat costs what
    repeat_kv's copies did)."""
    import graphopt.passes.fuse_attention as fa

    monkeypatch.setattr(fa, "_MASKED_GQA_KERNEL", False)

    class Step(RepeatKvSdpa):
        def forward(self, x, k, v, mask):
            b = x.shape[0]
            q = self.q(x).view(b, 1, self.h, self.d).transpose(1, 2)
            n = self.h // self.kvh
            s = k.shape[2]
            k = k[:, :, None].expand(b, self.kvh, n, s, self.d).reshape(b, self.h, s, self.d)
            v = v[:, :, None].expand(b, self.kvh, n, s, self.d).reshape(b, self.h, s, self.d)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.manual_seed(0)
    mask = torch.rand(2, 1, 1, 16) > 0.3
    mask[..., 0] = True
    args = (torch.randn(2, 1, 32), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8), mask)
    model, args, gm, res = _run(Step(), args)
    (sd,) = _sdpa_nodes(gm)
    assert sd.kwargs.get("enable_gqa") is True and sd.args[3] is not None
    assert [n.op for n in sd.args[1:3]] == ["placeholder", "placeholder"]  # the cache itself
    assert reference_check(model, gm, args).passed


class MultiQuery(nn.Module):
    """Falcon-style multi-query attention: one K/V head broadcast over q's heads, by an SDPA call
    or by the explicit matmul spelling."""

    def __init__(self, dim=32, heads=4, explicit=False, masked=False):
        super().__init__()
        self.h, self.d, self.explicit, self.masked = heads, dim // heads, explicit, masked
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.d)

    def forward(self, x, keep=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 1, self.d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, 1, S, D]
        mask = keep[:, None, None, :].bool() if self.masked else None
        if not self.explicit:
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.d ** -0.5
        return torch.matmul(torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("explicit", [False, True])
def test_kv_broadcast_over_heads_becomes_enable_gqa(explicit):
    """One K/V head broadcast over q's heads: SDPA reads it with enable_gqa (a fused kernel takes
    GQA, none takes the broadcast), and the cost model priced the broadcast as the math kernel."""
    from graphopt.cost.model import CostModel, sdpa_math_reason
    from graphopt.cost.profiles import get_profile

    torch.manual_seed(0)
    model, args, gm, res = _run(MultiQuery(explicit=explicit), (torch.randn(2, 8, 32),))
    (sd,) = _sdpa_nodes(gm)
    assert sd.kwargs.get("enable_gqa") is True
    assert [tuple(a.meta["val"].shape)[1] for a in sd.args[:3]] == [4, 1, 1]
    assert sdpa_math_reason(sd) is None
    assert reference_check(model, gm, args).passed
    if not explicit:  # the call as captured: the math kernel, priced above the GQA call
        base = capture(model, args)
        (before,) = _sdpa_nodes(base)
        assert "without enable_gqa" in sdpa_math_reason(before)
        cm = CostModel(get_profile("h200")[0])
        assert cm.node_cost(before).time_s > cm.node_cost(sd).time_s
        assert any(r.pattern == "sdpa K/V broadcast over heads->enable_gqa" and r.predicted_gain_s > 0 for r in res.rewrites)


@pytest.mark.parametrize("masked_gqa_kernel, target", [(False, "a100"), (True, "a100"), (False, "h200")])
def test_masked_kv_broadcast_takes_enable_gqa_where_a_kernel_takes_a_mask(monkeypatch, masked_gqa_kernel, target):
    import graphopt.passes.fuse_attention as fa

    monkeypatch.setattr(fa, "_MASKED_GQA_KERNEL", masked_gqa_kernel)
    masked_gqa_kernel = masked_gqa_kernel or target == "h200"  # (cuDNN's attention on sm_90)
    torch.manual_seed(0)
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[1, 6:] = 0
    model, args, gm, res = _run(MultiQuery(masked=True), (torch.randn(2, 8, 32), keep), target=target)
    (sd,) = _sdpa_nodes(gm)
    assert bool(sd.kwargs.get("enable_gqa")) is masked_gqa_kernel and sd.args[3] is not None
    assert any("math kernel" in r.reason for r in res.rejected) is not masked_gqa_kernel
    assert reference_check(model, gm, args).passed


def test_a_shared_causal_mask_is_inspected_once(monkeypatch):
    """Every layer reads the same constant mask: it is proven causal once per pass run, and each
    layer's attention is still rewritten."""
    import graphopt.passes.fuse_attention as fa

    seen = []
    orig = fa.is_causal_mask
    monkeypatch.setattr(fa, "is_causal_mask", lambda v: seen.append(v) or orig(v))
    model, inputs = zoo.get("glm4-tiny")
    gm = capture(model.eval(), inputs)
    run_passes(gm, PRE)
    (res,) = run_passes(gm, ["fuse_attention"])
    assert len(res.rewrites) == 2 and len(seen) == 1
    assert all(n.kwargs.get("is_causal") or (len(n.args) > 5 and n.args[5]) for n in _sdpa_nodes(gm))
    assert reference_check(model, gm, inputs).passed
    # a mask that is not causal is inspected (once) and refused: no is_causal
    assert not fa.is_causal_mask(torch.zeros(4, 4))


class ShiftedWindowAttention(nn.Module):
    """Swin's shifted-window attention: B = images * windows rows of window attention; a relative-
    position bias [1, H, S, S] added, then a mask per window position added through a view that
    splits the batch into [images, windows] (torchvision, timm and transformers spell it so).
    ``mask_shape`` of 5 dims: a mask added as it is (one that may vary over the images)."""

    def __init__(self, dim=32, heads=4, seq=8, windows=3, mask_shape=None):
        super().__init__()
        self.h, self.d, self.w = heads, dim // heads, windows
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(1, heads, seq, seq))
        m = torch.zeros(mask_shape or (windows, seq, seq))
        m[..., 1:, :, seq // 2:] = -100.0
        self.register_buffer("mask", m)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * self.d ** -0.5) @ k.transpose(-2, -1) + self.bias
        mask = self.mask if self.mask.dim() == 5 else self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(b // self.w, self.w, self.h, s, s) + mask
        attn = attn.view(-1, self.h, s, s).softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(b, s, -1)


def test_shifted_window_attention_runs_the_windows_as_heads():
    torch.manual_seed(0)
    # bf16, at a size the H200 profile prices the rewrite a gain (in fp32 SDPA is priced slower than
    # the matmuls it replaces)
    model = ShiftedWindowAttention(dim=64, heads=2, seq=64, windows=4)
    model, args, gm, res = _run(model, (torch.randn(32, 64, 64),), torch.bfloat16)
    assert res.status == "applied" and len(res.rewrites) == 1
    (sd,) = _sdpa_nodes(gm)
    assert tuple(sd.args[0].meta["val"].shape) == (8, 8, 64, 32)  # 8 images, 4 windows x 2 heads
    assert tuple(sd.args[3].meta["val"].shape) == (1, 8, 64, 64)  # one mask, broadcast over the images
    assert _attention_left(gm) == 0
    assert reference_check(model, gm, args).passed


def test_a_window_mask_that_varies_over_the_images_is_refused():
    torch.manual_seed(0)
    model, args, gm, res = _run(ShiftedWindowAttention(mask_shape=(2, 3, 1, 8, 8)), (torch.randn(6, 8, 32),))
    assert not _sdpa_nodes(gm)
    assert any("varies over the images" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed
