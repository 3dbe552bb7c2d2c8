import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.add_layer_norm.default"
LN = "aten.layer_norm.default"


def _randomize(m):
    for mod in m.modules():
        if isinstance(mod, nn.LayerNorm) and mod.weight is not None:
            with torch.no_grad():
                mod.weight.normal_()
                mod.bias.normal_()
    return m


class PreNorm(nn.Module):
    """ViT-style: the add result is also the residual stream."""

    def __init__(self, h=32):
        super().__init__()
        self.l1, self.l2 = nn.Linear(h, h), nn.Linear(h, h)
        self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h, elementwise_affine=False)

    def forward(self, x):
        h = x + self.l1(x)
        h = h + self.l2(self.n1(h))
        return self.n2(h) * 2 + h


class PostNorm(nn.Module):
    """BERT-style: add -> LayerNorm, the sum read by nothing else."""

    def __init__(self, h=32):
        super().__init__()
        self.l, self.n = nn.Linear(h, h), nn.LayerNorm(h, eps=1e-12)

    def forward(self, x):
        return self.n(self.l(x) + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,h_kept", [(PreNorm, True), (PostNorm, False)])
def test_fuses_residual_layer_norm(cls, h_kept, dtype):
    m, x = _randomize(cls()).eval().to(dtype), torch.randn(2, 8, 32, dtype=dtype)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    c = op_counts(gm)
    n = 2 if cls is PreNorm else 1
    assert c[FUSED] == n and c[LN] == 0
    assert all(r.pattern == "residual add + layer_norm" and r.predicted_gain_s > 0 for r in res.rewrites)
    # the kernel's h output replaces the add only where something else reads it
    assert (c["<built-in function getitem>"] == 2 * n) == h_kept
    assert reference_check(m, gm, (x,)).passed


def test_plain_layer_norm_gains_nothing():
    m, x = _randomize(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32))).eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    assert op_counts(gm)[LN] == 1 and not res.rewrites
    assert any("predicted no gain" in r.reason for r in res.rejected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_rows_take_the_many_rows_kernel(dtype):
    """ConvNeXt-shaped: 96-wide rows, 16K of them. aten's one-block-per-row kernel is priced by the
    H200 profile's row_norm efficiency; the many-rows layer_norm wins. The same LayerNorm planned for a
    profile without that measurement stays aten."""
    m = _randomize(nn.Sequential(nn.Linear(96, 96), nn.LayerNorm(96, eps=1e-6))).eval().to(dtype)
    x = torch.randn(4, 64, 64, 96, dtype=dtype)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    assert op_counts(gm)["graphopt.layer_norm.default"] == 1 and op_counts(gm)[LN] == 0
    assert res.rewrites[0].pattern == "layer_norm -> many-rows layer_norm" and res.rewrites[0].predicted_gain_s > 0
    ln = next(n for n in gm.graph.nodes if str(n.target) == "graphopt.layer_norm.default")
    assert ln.args[3] == 1e-6
    assert reference_check(m, gm, (x,)).passed
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="a100")
    assert op_counts(gm)[LN] == 1 and not res.rewrites


def test_layer_norm_reading_a_fused_layer_norm():
    """Swin's patch embedding: a LayerNorm whose input is another LayerNorm (the first block's
    norm1). Both take the many-rows kernel; the second reads the first's replacement (it read
    the replaced node when its match was stale: a use-before-def after the pass, swin_t at 224)."""
    m = _randomize(nn.Sequential(nn.Linear(96, 96), nn.LayerNorm(96), nn.LayerNorm(96))).eval()
    x = torch.randn(2, 64, 64, 96)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    assert res.status == "applied" and len(res.rewrites) == 2
    assert op_counts(gm)["graphopt.layer_norm.default"] == 2 and op_counts(gm)[LN] == 0
    assert reference_check(m, gm, (x,)).passed


def test_rows_wider_than_the_many_rows_kernel_are_refused_with_the_reason():
    from graphopt.cuda_ext.norm_triton import MAX_HIDDEN

    h = MAX_HIDDEN + 8
    m, x = _randomize(nn.Sequential(nn.Linear(h, h), nn.LayerNorm(h))).eval(), torch.randn(1, 2, h)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    assert op_counts(gm)[LN] == 1 and not res.rewrites
    assert any(f"rows wider than {MAX_HIDDEN}" in r.reason for r in res.rejected)


def test_refuses_norm_over_two_dims():
    m = _randomize(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm([8, 32]))).eval()
    x = torch.randn(2, 8, 32)

    class Add(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m[1](self.m[0](x) + x)

    mod = Add().eval()
    gm = capture(mod, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    assert op_counts(gm)[LN] == 1 and op_counts(gm)[FUSED] == 0
    assert any("not the last dim only" in r.reason for r in res.rejected)
    assert reference_check(mod, gm, (x,)).passed


def test_cpu_profile_refuses():
    m, x = _randomize(PreNorm()).eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="cpu")
    assert op_counts(gm)[FUSED] == 0 and not res.rewrites
    assert sum(r.reason == NO_FUSED_KERNELS for r in res.rejected) == 2


def _layers(model):
    cfg = getattr(model, "config", None)
    return cfg.num_hidden_layers if cfg is not None else len(model.encoder.layers)


@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zoo_counts(name, dtype):
    model, inputs = zoo.get(name)
    if dtype == torch.bfloat16:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    gm = capture(model, inputs)
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_layer_norm"], target="h200")
    # BERT: attention-output and output residual+LN per layer; ViT: ln_2 of every layer, ln_1 of
    # every layer after the first, and the final ln (ln_1 of layer 0 follows the broadcast
    # position-embedding add, and BERT's embedding LN follows the broadcast token-type add)
    assert len(res.rewrites) == 2 * _layers(model)
    assert all(r.pattern == "residual add + layer_norm" for r in res.rewrites)
    assert op_counts(gm)[LN] == 1
    assert any("broadcasts" in r.reason for r in res.rejected)
    assert any("predicted no gain" in r.reason for r in res.rejected)
    assert reference_check(model, gm, inputs).passed


# --------------------------------------------------------------------------- training graphs


def _forced(m, x):
    """``m`` captured for training and fuse_layer_norm applied with the cost model ignored."""
    from graphopt import ir
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import PassContext, PassManager, assemble

    gm = capture(m, (x,))
    ctx = PassContext(cost=CostModel(get_profile("h200")[0]), training=True, hints=ir.shape_hints(gm),
                      ignore_cost=True)
    PassManager(assemble(["fuse_layer_norm"])).run(gm, ctx)
    return gm


def _grads(fn, module, x, seed=0):
    module.zero_grad(set_to_none=True)
    out = fn(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    out.backward(g)
    return [out.detach()] + [p.grad for _, p in sorted(module.named_parameters())]


def test_training_post_norm_is_priced_with_both_backwards_measured_rates():
    """BERT's add + LayerNorm in a training graph: the fused backward (graphopt::fused_norm_backward,
    one pass that recomputes the statistics and sums the weight gradients) against aten's, each at
    the rate the H200 profile measured for it (op_efficiency layer_norm_backward and
    fused_norm_backward): applied with a small gain at 768 wide, where the two kernels run about
    level; the gain follows each measurement (none were aten's backward at the copy rate, more were
    ours)."""
    from graphopt.cost.profiles import get_profile

    m, x = _randomize(PostNorm(768)).train(), torch.randn(16, 512, 768)  # rows enough to leave launch costs behind
    h200 = get_profile("h200")[0]

    def gain(profile):
        (res,) = run_passes(capture(m, (x,)), ["fuse_layer_norm"], target=profile, training=True)
        return sum(w.predicted_gain_s for w in res.rewrites), res

    measured, res = gain(h200)
    assert res.status == "applied" and measured > 0
    aten_at_copy_rate, res = gain(h200.with_efficiency("layer_norm_backward", None))
    assert aten_at_copy_rate == 0 and any("predicted no gain" in r.reason for r in res.rejected)
    ours_at_copy_rate, _ = gain(h200.with_efficiency("fused_norm_backward", None))
    assert ours_at_copy_rate > measured
    (res,) = run_passes(capture(m.eval(), (x,)), ["fuse_layer_norm"], target="h200")
    assert res.rewrites  # inference keeps it


@pytest.mark.parametrize("cls,fused", [(PreNorm, {FUSED: 2}), (PostNorm, {FUSED: 1}),
                                       (lambda: nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)),
                                        {"graphopt.layer_norm.default": 1})])
def test_training_fused_layer_norm_gradients(cls, fused):
    """add_layer_norm / layer_norm in a training graph (cost ignored): the output and every
    parameter's gradient (h's second reader included, PreNorm) by the accuracy rule against the
    model's own fp64 step, the model's fp32 step the yardstick."""
    import copy

    from graphopt import accuracy

    m, x = _randomize(cls()).train(), torch.randn(2, 8, 32)
    gm = _forced(m, x)
    assert all(op_counts(gm)[k] == v for k, v in fused.items()) and op_counts(gm)[LN] == 0
    m64 = copy.deepcopy(m).double()
    assert [n for n, _ in sorted(gm.named_parameters())] == [n for n, _ in sorted(m.named_parameters())]
    ours, eager, gold = _grads(gm, gm, x), _grads(m, m, x), _grads(m64, m64, x.double())
    res = accuracy.check(ours, gold, eager, training=True)
    assert res.passed, res.reason


def test_training_cpu_profile_refuses():
    m, x = _randomize(PostNorm()).train(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="cpu", training=True)
    assert not res.rewrites and res.rejected and all(r.reason == NO_FUSED_KERNELS for r in res.rejected)


ROWS = "graphopt.add_layer_norm_rows.default"


def test_narrow_rows_take_the_many_rows_add_layer_norm():
    """96-wide rows, 16K of them: add_layer_norm's one block per row is priced by the H200 profile's
    row_norm floor, the many-rows kernel with the residual summed in is not; on a profile without that
    measurement the two price the same and add_layer_norm stays."""
    m = _randomize(PreNorm(96)).eval()
    x = torch.randn(4, 4096, 96)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    c = op_counts(gm)
    assert c[ROWS] == 2 and c[FUSED] == 0 and c[LN] == 0, c
    assert all(r.pattern == "residual add + layer_norm -> many-rows add_layer_norm" for r in res.rewrites)
    assert reference_check(m, gm, (x,)).passed
    gm = capture(m, (x,))
    run_passes(gm, ["fuse_layer_norm"], target="a100")
    assert op_counts(gm)[FUSED] == 2 and op_counts(gm)[ROWS] == 0


class ChannelsFirstStream(nn.Module):
    """A conv net's residual stream kept channels-first and normalized over its channels through a
    permute (MetaFormer / ConvNeXt-style blocks)."""

    def __init__(self, c=64):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.n1, self.n2 = nn.LayerNorm(c), nn.LayerNorm(c)

    def forward(self, x):  # x: [B, C, H, W], channels_last in memory
        s = x + self.conv1(x)
        y = self.n1(s.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        s = s + self.conv2(y)
        return self.n2(s.permute(0, 2, 3, 1)), s


def test_a_residual_add_read_through_a_permute_is_absorbed():
    m = _randomize(ChannelsFirstStream()).eval()
    x = torch.randn(4, 64, 32, 32).contiguous(memory_format=torch.channels_last)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    c = op_counts(gm)
    assert c[ROWS] + c[FUSED] == 2 and c[LN] == 0 and c["aten.add.Tensor"] == 0, c
    assert all(r.pattern.startswith("residual add + permute + layer_norm") for r in res.rewrites)
    assert reference_check(m, gm, (x,)).passed
    # the same block on an NCHW input: the permuted operands are not rows in memory, the adds stay
    x = torch.randn(4, 64, 32, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_layer_norm"], target="h200")
    assert op_counts(gm)["aten.add.Tensor"] == 2
    assert any("not rows in memory" in r.reason for r in res.rejected), res.rejected
    assert reference_check(m, gm, (x,)).passed


class ChannelsFirstStreamOut(ChannelsFirstStream):
    def forward(self, x):
        y, s = super().forward(x)
        return y.permute(0, 3, 1, 2) * s


@pytest.mark.parametrize("cls,shape,fused", [
    (lambda: PreNorm(96), (8, 4096, 96), {ROWS: 2}),  # narrow rows: the many-rows kernel
    (ChannelsFirstStreamOut, (2, 64, 16, 16), None),  # through permutes (either kernel, by price)
])
def test_training_many_rows_and_permuted_forms_gradients(cls, shape, fused):
    """add_layer_norm_rows and the permuted residual form in a training graph: the output and every
    parameter's gradient by the accuracy rule against the model's own fp64 step."""
    import copy

    from graphopt import accuracy

    x = torch.randn(*shape)
    if len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    m = _randomize(cls()).train()
    gm = _forced(m, x)
    c = op_counts(gm)
    assert c[LN] == 0 and (fused is None or all(c[k] == v for k, v in fused.items())), c
    assert c[ROWS] + c[FUSED] == 2
    m64 = copy.deepcopy(m).double()
    ours, eager, gold = _grads(gm, gm, x), _grads(m, m, x), _grads(m64, m64, x.double())
    res = accuracy.check(ours, gold, eager, training=True)
    assert res.passed, res.reason
