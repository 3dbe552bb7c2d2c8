import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.examples import zoo
from graphopt.pipeline import run_passes
from tests.helpers import reference_check, resnet18

aten = torch.ops.aten


class FeatureMap(nn.Module):
    """Returns a 4-D feature map: the caller must get it back in the contiguous layout."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.dw = nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.conv2 = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        return self.conv2(torch.relu(self.dw(h)) + h)


def _convs(gm):
    return [n for n in gm.graph.nodes if n.target is aten.conv2d.default]


def test_converts_weights_once_and_inputs_at_the_boundary():
    # fp32 (as test_each_connected_region_is_decided_on_its_own): eager's bf16 NCHW depthwise convolution,
    # which the accuracy check runs, took 11 s on the CPU; the layout rewrite is the same, and bf16
    # graphs are test_resnet_one_region_and_accuracy's. Batch 16: predicted 84 us faster on the H200
    # (still 14 us at batch 4).
    m = FeatureMap().eval()
    x = torch.randn(16, 3, 64, 64)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "applied" and res.details["convolutions"] == 3
    for c in _convs(gm):
        w = c.args[1]
        assert w.op == "get_attr" and ir.get_attr_value(gm, w.target).is_contiguous(memory_format=torch.channels_last)
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert [n.kwargs["memory_format"] for n in clones] == [torch.channels_last, torch.contiguous_format]
    out = gm(x)
    assert out.is_contiguous()  # the layout the caller expects
    assert reference_check(m, gm, (x,)).passed


def test_small_maps_are_not_worth_the_conversions():
    m = FeatureMap().eval().to(torch.bfloat16)
    x = torch.randn(1, 3, 8, 8, dtype=torch.bfloat16)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "unchanged" and "no gain" in res.rejected[0].reason


def test_refused_where_no_penalty_is_measured():
    import dataclasses

    from graphopt.cost.profiles import get_profile

    m = FeatureMap().eval()
    x = torch.randn(2, 3, 16, 16)
    gm = capture(m, (x,))
    # a CPU whose oneDNN convolutions are no slower on NCHW (this machine's measured slowdown aside)
    flat = dataclasses.replace(get_profile("cpu")[0], conv_nchw_slowdown=1.0)
    (res,) = run_passes(gm, ["convert_channels_last"], target=flat)
    assert res.status == "unchanged" and "no measured NCHW penalty" in res.rejected[0].reason
    assert not any(n.target is aten.clone.default for n in gm.graph.nodes)


def test_no_convolutions_nothing_to_do():
    model, inputs = zoo.get("mlp", dtype=torch.bfloat16)
    gm = capture(model, inputs)
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "unchanged" and not res.rejected


def test_resnet_one_region_and_accuracy():
    import dataclasses

    from graphopt.cost.profiles import get_profile

    model, inputs = resnet18(4, 64, torch.bfloat16)
    gm = capture(model, inputs)
    # planned for CUDA-graph replay (as optimize() plans static-shape inference on a GPU): at
    # batch 4 the convolutions' device time, not their launch, is what the layout changes (at
    # 64 px it still pays from batch 1 on)
    h200 = get_profile("h200")[0]
    replay = dataclasses.replace(h200, launch_overhead_s=h200.launch_overhead_graph_s)
    (res,) = run_passes(gm, ["fold_conv_bn", "convert_channels_last"], target=replay)[1:]
    assert res.status == "applied" and res.details["convolutions"] == 20 and len(res.details["regions"]) == 1
    assert res.details["input_conversions"] == 1 and res.details["output_conversions"] == 0
    assert reference_check(model, gm, inputs).passed


def test_cpu_channels_last_where_onednn_is_faster():
    """On the CPU the profile's measured oneDNN NCHW slowdown decides, as on the GPU."""
    import dataclasses

    from graphopt.cost.profiles import get_profile

    model, inputs = resnet18(2, 128)  # (here it pays down to 32 px)
    gm = capture(model, inputs)
    slow = dataclasses.replace(get_profile("cpu")[0], conv_nchw_slowdown=1.3)
    (res,) = run_passes(gm, ["fold_conv_bn", "convert_channels_last"], target=slow)[1:]
    assert res.status == "applied" and res.details["convolutions"] == 20
    assert reference_check(model, gm, inputs).passed


def test_cpu_training_keeps_nchw_since_the_guard_checks_only_the_forward():
    """Where the CPU measures channels_last faster, a training graph still keeps NCHW: oneDNN's
    channels_last convolution backward can be far from fp64 (on a 2-thread AMD EPYC, a ResNet's
    conv1 weight gradient 1e-2 off against NCHW's 1e-5) and the guard judges the forward alone."""
    import dataclasses

    from graphopt.cost.profiles import get_profile

    model, x = FeatureMap(), torch.randn(2, 3, 16, 16)
    slow = dataclasses.replace(get_profile("cpu")[0], conv_nchw_slowdown=1.3)
    (res,) = run_passes(capture(model, (x,)), ["convert_channels_last"], target=slow, training=True)
    assert res.status != "applied" and any("training on the CPU" in r.reason for r in res.rejected), res.rejected
    (inference,) = run_passes(capture(model, (x,)), ["convert_channels_last"], target=slow)
    assert inference.status == "applied"


class EncoderDecoder(nn.Module):
    """Two conv regions joined by a linear: a big encoder (NHWC pays) and a small decoder at 4x4
    (its two conversions cost more than they save)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                                 nn.ReLU(), nn.Conv2d(64, 8, 3, stride=16, padding=1))
        self.mid = nn.Linear(8 * 4 * 4, 8 * 4 * 4)
        self.dec = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        h = self.enc(x).flatten(1)
        return self.dec(self.mid(h).view(-1, 8, 4, 4))


def test_each_connected_region_is_decided_on_its_own():
    m = EncoderDecoder().eval()
    x = torch.randn(8, 3, 64, 64)  # (fp32: the encoder's region is predicted 53 us faster; still 4.5 us at batch 2)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "applied" and len(res.details["regions"]) == 1
    assert res.details["convolutions"] == 3 and res.details["output_conversions"] == 0
    assert any(r.candidate.startswith("region 2: 1 convolutions") and "no gain" in r.reason for r in res.rejected)
    enc, dec = _convs(gm)[:3], _convs(gm)[3]
    assert all(ir.get_attr_value(gm, c.args[1].target).is_contiguous(memory_format=torch.channels_last) for c in enc)
    assert ir.get_attr_value(gm, dec.args[1].target).is_contiguous()  # the decoder stays NCHW
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert [n.kwargs["memory_format"] for n in clones] == [torch.channels_last]
    assert reference_check(m, gm, (x,)).passed


def test_3d_convolutions_are_named_as_refused():
    """A video network's Conv3d: left NCHW-style (NCDHW) with a one-line reason, not passed over silently."""
    m = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 8, 3, padding=1)).eval()
    x = torch.randn(1, 3, 4, 16, 16)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "unchanged"
    assert any("3-D convolution" in r.candidate and "2-D convolutions only" in r.reason for r in res.rejected), res.rejected
    assert reference_check(m, gm, (x,)).passed


class Modulation(nn.Module):
    """A block that computes on NHWC rows (a linear) and on NCHW maps (depthwise convolutions),
    moving between them with permute + contiguous, as focal modulation does."""

    def __init__(self, c=32, view_back=False):
        super().__init__()
        self.inp = nn.Linear(c, 2 * c + 1)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.h = nn.Conv2d(c, c, 1)
        self.out = nn.Linear(c, c)
        self.c, self.view_back = c, view_back

    def forward(self, x):  # x: [B, H, W, C]
        q, ctx, gate = self.inp(x).permute(0, 3, 1, 2).contiguous().split([self.c, self.c, 1], 1)
        ctx = torch.nn.functional.gelu(self.dw(ctx)) * gate
        y = q * self.h(ctx)
        if self.view_back:  # reads the strides of the copy's layout
            b, c, hh, ww = y.shape
            return self.out(y.view(b, c, hh * ww).transpose(1, 2))
        return self.out(y.permute(0, 2, 3, 1).contiguous())


def _copies_to_nchw(gm):
    return [n for n in gm.graph.nodes if n.target is aten.contiguous.default]


def test_copies_to_nchw_inside_a_region_are_dropped():
    m = Modulation().eval()
    x = torch.randn(16, 28, 28, 32)
    gm = capture(m, (x,))
    assert len(_copies_to_nchw(gm)) == 2
    res, res2 = run_passes(gm, ["convert_channels_last", "eliminate_permutes"], target="h200")
    assert res.status == "applied" and res.details["copies_dropped"] == 1, (res.status, res.rejected)
    # the region stays channels_last past the convolutions, so the copy back to NHWC is a no-op
    assert any(r.pattern == "drop_noop_contiguous" for r in res2.rewrites)
    assert not _copies_to_nchw(gm)
    assert all(ir.info(c.args[0]).stride[1] == 1 for c in _convs(gm))
    assert reference_check(m, gm, (x,)).passed


def test_a_copy_whose_layout_a_view_reads_is_kept():
    m = Modulation(view_back=True).eval()
    x = torch.randn(16, 28, 28, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert any(r.candidate.startswith("contiguous") and "reads the strides" in r.reason for r in res.rejected), \
        res.rejected
    assert len(_copies_to_nchw(gm)) == 1
    assert reference_check(m, gm, (x,)).passed


class ModulationReturned(Modulation):
    """The copy to NCHW itself returned beside the result, and a flattened map read after the copy
    returned too: the caller gets both in the layout the model gave them."""

    def forward(self, x):
        y = self.inp(x).permute(0, 3, 1, 2).contiguous()
        q, ctx, gate = y.split([self.c, self.c, 1], 1)
        z = q * self.h(torch.nn.functional.gelu(self.dw(ctx)) * gate)
        return self.out(z.permute(0, 2, 3, 1).contiguous()), y, z.flatten(2)


def test_copies_returned_to_the_caller_are_kept():
    m = ModulationReturned().eval()
    x = torch.randn(16, 28, 28, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    reasons = [r.reason for r in res.rejected if r.candidate.startswith("contiguous")]
    assert any("returned to the caller" in r for r in reasons), res.rejected
    out = gm(x)
    assert out[1].is_contiguous() and out[2].is_contiguous()
    assert reference_check(m, gm, (x,)).passed


class ConvAttention(nn.Module):
    """Self-attention on a feature map with 1x1 convolutions for its projections (CoAtNet's and
    BoTNet's spelling): the heads' output ``[B, heads, HW, d]`` is folded back into ``[B, C, H, W]``
    by a reshape that copies."""

    def __init__(self, c=64, heads=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.proj = nn.Conv2d(c, c, 1)
        self.mlp = nn.Conv2d(c, c, 3, padding=1)
        self.heads = heads

    def forward(self, x):
        x = self.stem(x)
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).view(b, self.heads, 3 * c // self.heads, h * w).chunk(3, 2)
        q, k, v = (t.transpose(-1, -2).contiguous() for t in (q, k, v))  # (as timm's Attention2d)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(-1, -2).reshape(b, c, h, w))
        return torch.relu(self.mlp(x))


def _reshapes(gm):
    return [n for n in gm.graph.nodes if n.target is aten.reshape.default]


def test_a_reshape_that_copies_into_a_map_writes_it_channels_last():
    m = ConvAttention().eval()
    x = torch.randn(32, 3, 28, 28)
    gm = capture(m, (x,))
    assert len(_reshapes(gm)) == 1
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "applied" and res.details["reshapes_to_channels_last"] == 1, (res.status, res.rejected)
    assert not _reshapes(gm)
    # every convolution after the reshape reads NHWC too (the projection, the residual sum's reader)
    assert all(ir.info(c.args[0]).stride[1] == 1 for c in _convs(gm))
    assert reference_check(m, gm, (x,)).passed


class TokensToMap(nn.Module):
    """Tokens ``[B, HW, C]`` mixed by four heads' attention and folded into a map by a reshape that copies; the
    map also flattened by ``view(B, -1)``, which NHWC strides cannot serve."""

    def __init__(self, c=64):
        super().__init__()
        self.proj, self.mlp = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, padding=1)
        self.head = nn.Linear(c * 28 * 28, 10)

    def forward(self, t):
        b, hw, c = t.shape
        q = t.view(b, hw, 4, c // 4).transpose(1, 2).contiguous()
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        y = a.transpose(-1, -2).reshape(b, c, 28, 28)
        return torch.relu(self.mlp(self.proj(y))), self.head(y.view(b, -1))


def test_a_reshape_whose_new_layout_a_view_cannot_read_is_kept():
    m = TokensToMap().eval()
    t = torch.randn(32, 28 * 28, 64)
    gm = capture(m, (t,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "applied", (res.status, res.notes)
    assert any("reshape that copies" in r.candidate and "cannot read it laid out NHWC" in r.reason
               for r in res.rejected), res.rejected
    assert len(_reshapes(gm)) == 1
    assert reference_check(m, gm, (t,)).passed


class TwoFolds(TokensToMap):
    """Two folds into maps: the first also flattened by ``view(B, -1)``, the second read by
    convolutions only."""

    def forward(self, t):
        y, logits = super().forward(t)
        b, hw, c = t.shape
        q = (2 * t).view(b, hw, 4, c // 4).transpose(1, 2).contiguous()
        z = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(-1, -2).reshape(b, c, 28, 28)
        return y + self.mlp(self.proj(z)), logits


def test_of_two_reshapes_the_one_a_view_cannot_read_is_kept_and_the_other_written():
    """Tried together the rewrites fail (the first's view); tried one by one the second applies."""
    m = TwoFolds().eval()
    t = torch.randn(32, 28 * 28, 64)
    gm = capture(m, (t,))
    assert len(_reshapes(gm)) == 2
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "applied" and res.details["reshapes_to_channels_last"] == 1, (res.notes, res.rejected)
    assert len([r for r in res.rejected if "cannot read it laid out NHWC" in r.reason]) == 1
    assert len(_reshapes(gm)) == 1
    assert reference_check(m, gm, (t,)).passed


class Flattened(nn.Module):
    """A classifier reading the last map through ``view(B, -1)`` (older models' spelling of flatten)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 28 * 28, 10)

    def forward(self, x):
        y = self.c2(torch.relu(self.c1(x)))
        return self.fc(y.view(y.size(0), -1))


def test_a_view_nhwc_strides_cannot_serve_becomes_a_reshape():
    """Before, the region's shapes failed to propagate and the whole pass was undone."""
    m = Flattened().eval()
    x = torch.randn(32, 3, 28, 28)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["convert_channels_last"], target="h200")
    assert res.status == "applied" and res.details["views_as_reshapes"] == 1, (res.status, res.notes)
    assert all(ir.info(c.args[0]).stride[1] == 1 for c in _convs(gm) if c.args[0].op != "placeholder")
    assert reference_check(m, gm, (x,)).passed


def test_refine_gives_one_copy_for_every_split_or_merge():
    """_refine's refined view, permuted to NHWC order and copied, equals reshape for random shapes
    and strides; where the dims neither split nor merge one to many it says None."""
    import random

    from graphopt.passes.convert_channels_last import _refine

    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        old = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 5))]
        new, rest, k = [1, 1, 1, 1], 1, 2
        for d in old:
            rest *= d
        while rest > 1:
            while rest % k:
                k += 1
            new[rng.randrange(4)] *= k
            rest //= k
        got = _refine(tuple(old), tuple(new))
        if got is None:
            continue
        refined, groups = got
        order = [i for j in (0, 2, 3, 1) for i in groups[j]]
        x = torch.randn(*old)
        for t in (x, x.mT.contiguous().mT if x.dim() >= 2 else x):
            y = t.view(refined).permute(order).contiguous().view(new[0], new[2], new[3], new[1]).permute(0, 3, 1, 2)
            assert torch.equal(y, t.reshape(new)), (old, new, got)
            assert y.is_contiguous(memory_format=torch.channels_last) or 1 in new
        checked += 1
    assert checked > 100
    assert _refine((4, 6), (6, 4, 1, 1)) is None
