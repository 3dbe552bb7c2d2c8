import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.add_rms_norm.default"


class HFRMSNorm(nn.Module):
    """LlamaRMSNorm / Glm4RMSNorm, as Hugging Face writes it (optionally with variations)."""

    def __init__(self, h, eps=1e-6, square="pow", weight_first=True, dims=(-1,), weight_shape=None):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(weight_shape or (h,)))
        self.eps, self.square, self.weight_first, self.dims = eps, square, weight_first, dims

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        sq = h.pow(2) if self.square == "pow" else h * h
        var = sq.mean(self.dims, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dt) if self.weight_first else h.to(dt) * self.weight


class Decoder(nn.Module):
    """Two pre-norm sublayers: the residual add before the 2nd norm and the final norm is also
    the residual stream."""

    def __init__(self, h=32, **kw):
        super().__init__()
        self.n1, self.n2, self.n3 = HFRMSNorm(h, **kw), HFRMSNorm(h, square="mul", weight_first=False), HFRMSNorm(h)
        self.l1, self.l2 = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x):
        h = x + self.l1(self.n1(x))
        h = h + self.l2(self.n2(h))
        return self.n3(h)


def _bf16(m, x):
    return m.to(torch.bfloat16), x.to(torch.bfloat16)


def _fused(m, dtype):
    """``m`` (on a [2, 8, 32] input, in ``dtype``) captured and run through fuse_rms_norm for the
    H200: (model, input, graph, the pass's result)."""
    m, x = m.eval(), torch.randn(2, 8, 32)
    if dtype == torch.bfloat16:
        m, x = _bf16(m, x)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    return m, x, gm, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuses_norms_and_residual_adds(dtype):
    m, x, gm, res = _fused(Decoder(), dtype)
    c = op_counts(gm)
    assert c[FUSED] == 3 and c["aten.rsqrt.default"] == 0 and c["aten.pow.Tensor_Scalar"] == 0
    assert sorted(r.pattern for r in res.rewrites) == ["residual add + rms_norm"] * 2 + ["rms_norm"]
    assert all(r.predicted_gain_s > 0 for r in res.rewrites)
    # the two residual adds are gone: the kernel's h output is the residual stream
    assert c["aten.add.Tensor"] == 0
    assert reference_check(m, gm, (x,)).passed


class AtenResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.n1, self.n2 = nn.Linear(32, 32), nn.RMSNorm(32, eps=1e-5), nn.RMSNorm(32)
        with torch.no_grad():
            self.n1.weight.normal_()
            self.n2.weight.normal_()

    def forward(self, x):
        h = x + self.l(self.n1(x))
        return self.n2(h) + h


def test_aten_rms_norm():
    # torch.nn.RMSNorm is one aten op: alone it gains nothing (the cost model says so); with the
    # residual add before it, the add is absorbed
    m, x = AtenResidual().eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["aten.rms_norm.default"] == 1
    assert [r.pattern for r in res.rewrites] == ["residual add + rms_norm"]
    assert any("predicted no gain" in r.reason for r in res.rejected)
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("kw,why", [
    (dict(dims=(-2, -1)), "not the last dim only"),
    (dict(weight_shape=(1, 32)), "not 1-D over the last dim"),
])
def test_refuses_other_norms(kw, why):
    m, x = HFRMSNorm(32, **kw).eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    assert op_counts(gm)[FUSED] == 0
    assert any(why in r.reason for r in res.rejected), res.rejected
    assert reference_check(m, gm, (x,)).passed


class Leaky(nn.Module):
    """The variance is also returned: fusing would drop a value someone reads."""

    def __init__(self):
        super().__init__()
        self.n = HFRMSNorm(32)

    def forward(self, x):
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        return self.n.weight * (h * torch.rsqrt(var + 1e-6)), var


class BroadcastResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 8, 32))
        self.n = HFRMSNorm(32)

    def forward(self, x):
        h = x + self.pos
        return self.n(h) + h


def test_refuses_when_an_intermediate_is_read_elsewhere():
    m, x = Leaky().eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    assert op_counts(gm)[FUSED] == 0
    assert any("read outside" in r.reason for r in res.rejected)


def test_broadcasting_add_is_not_absorbed_but_norm_is_fused():
    m, x = BroadcastResidual().eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["aten.add.Tensor"] == 2
    assert [r.pattern for r in res.rewrites] == ["rms_norm"]
    assert any("broadcasts" in r.reason for r in res.rejected)
    assert reference_check(m, gm, (x,)).passed


def test_cpu_profile_refuses():
    m, x = Decoder().eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="cpu")
    assert op_counts(gm)[FUSED] == 0 and not res.rewrites
    assert sum(r.reason == NO_FUSED_KERNELS for r in res.rejected) == 3


SANDWICH = "graphopt.rms_norm_add_rms_norm.default"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm4_tiny_every_norm_fused(dtype):
    model, inputs = zoo.get("glm4-tiny")
    if dtype == torch.bfloat16:
        model = model.to(torch.bfloat16)
    layers = model.config.num_hidden_layers
    gm = capture(model, inputs)
    *_, res = run_passes(gm, ["eliminate_dead_code", "fold_constants", "fuse_rms_norm"], target="h200")
    # 4 RMSNorms per GLM-4 layer (input, post_self_attn, post_attention, post_mlp) + the final norm
    norms = [r for r in res.rewrites if r.pattern != "rms_norm + residual add + rms_norm"]
    assert len(norms) == 4 * layers + 1
    # the residual adds before post_attention, the next layer's input norm and the final norm
    assert sum(r.pattern == "residual add + rms_norm" for r in norms) == 2 * layers
    # then each sandwich: post_self_attn's norm with post_attention's, post_mlp's with the next input (final) norm
    pairs = [r for r in res.rewrites if r.pattern == "rms_norm + residual add + rms_norm"]
    assert len(pairs) == 2 * layers and all(r.predicted_gain_s > 0 for r in pairs)
    c = op_counts(gm)
    assert c[SANDWICH] == 2 * layers and c[FUSED] == 1 and c["aten.rsqrt.default"] == 0  # the first input norm
    assert reference_check(model, gm, inputs).passed


class Sandwich(nn.Module):
    """GLM-4's sublayer: y = norm_post(f(x)); h = x + y; out = norm_next(h); with ``leak`` the
    post-norm's output is also returned (read outside the pair)."""

    def __init__(self, h=32, leak=False):
        super().__init__()
        self.f, self.post, self.next = nn.Linear(h, h), HFRMSNorm(h), HFRMSNorm(h, eps=1e-5)
        self.leak = leak

    def forward(self, x):
        y = self.post(self.f(x))
        h = x + y
        return (self.next(h), h, y) if self.leak else (self.next(h), h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sandwich_norm_is_one_kernel(dtype):
    m, x, gm, res = _fused(Sandwich(), dtype)
    c = op_counts(gm)
    assert c[SANDWICH] == 1 and c[FUSED] == 0 and c["aten.add.Tensor"] == 0
    assert [r.pattern for r in res.rewrites][-1] == "rms_norm + residual add + rms_norm"
    assert reference_check(m, gm, (x,)).passed


def test_sandwich_left_alone_when_the_post_norm_is_read_elsewhere():
    m, x = Sandwich(leak=True).eval(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    c = op_counts(gm)
    assert c[SANDWICH] == 0 and c[FUSED] == 2
    assert reference_check(m, gm, (x,)).passed


def test_sandwich_over_rows_wider_than_the_kernel_is_refused_with_the_reason():
    from graphopt.cuda_ext.norm_triton import MAX_HIDDEN

    m, x = Sandwich(h=MAX_HIDDEN + 8).eval(), torch.randn(1, 2, MAX_HIDDEN + 8)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200")
    assert op_counts(gm)[SANDWICH] == 0 and op_counts(gm)[FUSED] == 2
    assert any(f"rows wider than {MAX_HIDDEN}" in r.reason for r in res.rejected)


def test_sandwich_reference_matches_the_two_norms_in_float64():
    from graphopt.cuda_ext import reference

    torch.manual_seed(0)
    y, r = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    wy, w = torch.randn(64), torch.randn(64)
    out, h = reference.rms_norm_add_rms_norm(y, r, wy, w, 1e-6, 1e-5)
    yd = y.double()
    yn = yd * torch.rsqrt(yd.pow(2).mean(-1, keepdim=True) + 1e-6) * wy.double()
    hd = yn + r.double()
    od = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert out.dtype == h.dtype == torch.bfloat16
    torch.testing.assert_close(h.double(), hd, rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), od, rtol=2e-2, atol=5e-2)


# --------------------------------------------------------------------------- training graphs


def _train_opt(model, args, **kw):
    import graphopt

    opt = graphopt.optimize(model, args, training=True, check_accuracy=False, target="h200", **kw)
    model.train()
    return opt


def test_training_fuses_norms_and_trains():
    """add_rms_norm is differentiable: in a training graph the three norms (two with their residual
    add) fuse, predicted to gain with the backward counted, and one step's loss and gradients pass
    the accuracy rule against fp64."""
    from tests.helpers import step_check

    m, x = Decoder().train(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200", training=True)
    assert op_counts(gm)[FUSED] == 3 and all(r.predicted_gain_s > 0 for r in res.rewrites)
    opt = _train_opt(m, (x,), passes=["fuse_rms_norm"])
    assert op_counts(opt.graph_module)[FUSED] == 3
    step_check(m, opt, (x,))


def test_training_prices_the_backward():
    """The training gain adds eager's derivative kernels of the HF spelling against the fused
    backward (statistics recomputed, one kernel): more than the forward's gain alone."""
    m, x = Decoder(h=2048).train(), torch.randn(4, 512, 2048)
    inf, trn = capture(m.eval(), (x,)), capture(m.train(), (x,))
    (ri,) = run_passes(inf, ["fuse_rms_norm"], target="h200")
    (rt,) = run_passes(trn, ["fuse_rms_norm"], target="h200", training=True)
    assert len(rt.rewrites) == len(ri.rewrites) == 3
    assert sum(r.predicted_gain_s for r in rt.rewrites) > sum(r.predicted_gain_s for r in ri.rewrites)


def test_training_tiny_llama_every_norm_fused():
    """A tiny transformers Llama through optimize(training=True): every RMSNorm fused (the residual
    adds absorbed), gradients of every parameter by the accuracy rule against fp64."""
    from tests.helpers import step_check, tiny_llama_training

    model, ids = tiny_llama_training()
    opt = _train_opt(model, (ids,), passes=["fuse_rms_norm", "fuse_elementwise"])
    assert op_counts(opt.graph_module)[FUSED] == 2 * 2 + 1
    assert "aten.rsqrt.default" not in op_counts(opt.graph_module)
    step_check(model, opt, (ids,))


def test_training_sandwich_refused_without_a_backward():
    """GLM-4's sandwich norm: the add_rms_norm fusions apply in training, the merge into
    rms_norm_add_rms_norm (no backward) is refused with that reason."""
    m, x = Sandwich().train(), torch.randn(2, 8, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_rms_norm"], target="h200", training=True)
    c = op_counts(gm)
    assert c[SANDWICH] == 0 and c[FUSED] == 2
    assert any("rms_norm_add_rms_norm has no backward" in r.reason for r in res.rejected)
