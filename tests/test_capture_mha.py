"""nn.MultiheadAttention captured in the batch-first SDPA form eager's fast path runs
(graphopt.capture_mha): the graph, numerics against fp64, the calls that keep the module's own
forward, and the module left as it was."""

import json
import types

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import CaptureError, accuracy, capture, ir
from graphopt.tools.cli import main
from graphopt.examples import zoo
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten
SDPA = "aten.scaled_dot_product_attention.default"
# ops that copy a tensor into a new layout (the general path's QKV and output copies)
COPIES = ("aten.contiguous.default", "aten.clone.default", "aten._unsafe_view.default", "aten.copy.default",
          "aten.copy_.default", "aten._to_copy.default")


def _copies(gm):
    c = op_counts(gm)
    return sum(c[k] for k in COPIES)


class SelfAttn(nn.Module):
    """How torchvision's ViT calls it: self-attention, need_weights=False, optional padding mask."""

    def __init__(self, embed=36, heads=3, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(embed, heads, batch_first=True, **kw)

    def forward(self, x, kpm=None):
        return self.attn(x, x, x, key_padding_mask=kpm, need_weights=False)[0]


def _own_forwards(model):
    return all("forward" not in m.__dict__ and m.forward.__func__ is type(m).forward
               for m in model.modules() if isinstance(m, nn.MultiheadAttention))


def _sdpa_node(gm):
    (node,) = [n for n in gm.graph.nodes if str(n.target) == SDPA]
    return node


@pytest.mark.parametrize("bias", [True, False])
def test_standalone_odd_sizes_sdpa_form(bias):
    torch.manual_seed(0)
    model = SelfAttn(36, 3, bias=bias).eval()  # 3 heads of 12, 7 tokens, batch 3
    args = (torch.randn(3, 7, 36),)
    gm = capture(model, args)
    general = capture(model, args, mha="module")
    info = gm.meta["graphopt_capture"]
    assert info.mha["sdpa_calls"] == 1 and info.mha["kept_calls"] == 0
    assert any("1 call(s) captured in the batch-first SDPA form" in n for n in info.notes)
    c = op_counts(gm)
    assert c[SDPA] == 1 and c["aten.linear.default"] == 2
    # the general path copies the packed QKV (contiguous) and permutes the output through a copy
    assert _copies(general) >= 1 and _copies(gm) == 0
    assert c["aten.permute.default"] == 0 and op_counts(general)["aten.permute.default"] >= 1
    # q/k/v are views of the projection: select + transpose of one view, SDPA without mask/dropout
    sd = _sdpa_node(gm)
    for qkv in sd.args[:3]:
        assert qkv.target is aten.transpose.int and qkv.args[0].target is aten.select.int
        assert qkv.args[0].args[0].target is aten.view.default
    assert (sd.args[3:] + (None, 0.0, False))[:3] == (None, 0.0, False)
    # the out-projection reads the SDPA output through views only (reshape of a [B, S, H, D] layout)
    out_linear = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out_linear.target is aten.linear.default and out_linear.args[0].target is aten.reshape.default
    assert out_linear.args[0].meta["val"].is_contiguous() and sd.meta["val"].transpose(1, 2).is_contiguous()
    assert reference_check(model, gm, args).passed
    assert reference_check(model, general, args).passed
    assert _own_forwards(model)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_mask_as_additive_sdpa_mask(kind):
    torch.manual_seed(1)
    model = SelfAttn(20, 4).eval()
    x = torch.randn(3, 6, 20)
    if kind == "bool":
        kpm = torch.zeros(3, 6, dtype=torch.bool)
        kpm[0, 4:] = True
        kpm[2, :2] = True
    else:
        kpm = torch.zeros(3, 6)
        kpm[1, 3:] = -1e4
    gm = capture(model, (x, kpm))
    assert gm.meta["graphopt_capture"].mha["sdpa_calls"] == 1 and _copies(gm) == 0
    mask = _sdpa_node(gm).args[3]
    assert mask is not None and tuple(mask.meta["val"].shape) == (3, 1, 1, 6)
    assert mask.meta["val"].dtype == torch.float32
    assert reference_check(model, gm, (x, kpm)).passed
    # another mask through the same graph: the mask is an input, not a constant
    kpm2 = torch.zeros_like(kpm)
    kpm2[1, 0] = True if kind == "bool" else -1e4
    assert reference_check(model, gm, (x, kpm2)).passed


def test_training_dropout_goes_to_sdpa_with_the_same_draws():
    """Training: SDPA gets dropout_p as the general path passes it, on q/k/v of the same shape, so
    the same seed gives the same output."""
    torch.manual_seed(2)
    model = SelfAttn(24, 2, dropout=0.3).train()
    x = torch.randn(2, 5, 24)
    gm = capture(model, (x,))
    assert gm.meta["graphopt_capture"].mha["sdpa_calls"] == 1
    assert _sdpa_node(gm).args[4] == 0.3 and ir.is_random(_sdpa_node(gm))  # the passes see the rng
    torch.manual_seed(7)
    eager = model(x)
    torch.manual_seed(7)
    ref64 = accuracy.fp64_reference(model, (x,), {})  # float64 draws the same dropout masks
    torch.manual_seed(7)
    out = gm(x)
    res = accuracy.check(out, ref64, eager)
    assert res.passed and res.leaves[0].how == "allclose", res.reason  # other masks would be O(1) off
    torch.manual_seed(8)
    assert not torch.allclose(gm(x), out)  # dropout is live: another seed, another draw


def test_dynamic_batch():
    torch.manual_seed(3)
    model = SelfAttn(16, 2).eval()
    gm = capture(model, (torch.randn(3, 5, 16),), dynamic={"x": {0: "batch"}})
    assert gm.meta["graphopt_capture"].mha["sdpa_calls"] == 1 and _copies(gm) == 0
    assert reference_check(model, gm, (torch.randn(6, 5, 16),)).passed


def test_shared_module_called_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x):
            y = self.attn(x, x, x, need_weights=False)[0]
            return self.attn(y, y, y, need_weights=False)[0]

    model = Twice().eval()
    args = (torch.randn(2, 3, 16),)
    gm = capture(model, args)
    assert gm.meta["graphopt_capture"].mha["sdpa_calls"] == 2 and op_counts(gm)[SDPA] == 2
    assert _copies(gm) == 0 and reference_check(model, gm, args).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vit_tiny(dtype):
    model, inputs = zoo.get("vit-tiny")
    model = model.eval().to(dtype)
    args = tuple(x.to(dtype) for x in inputs)
    gm = capture(model, args)
    general = capture(model, args, mha="module")
    layers = 2
    info = gm.meta["graphopt_capture"]
    assert info.mha == {"mode": "sdpa", "sdpa_calls": layers, "kept_calls": 0, "kept": {}, "skipped": {}}
    assert op_counts(gm)[SDPA] == layers == op_counts(general)[SDPA]
    assert _copies(general) == layers and _copies(gm) == 0
    # fewer layout ops: per layer the general path's unflatten/unsqueeze/squeeze/permute are gone
    assert len(gm.graph.nodes) < len(general.graph.nodes)
    assert reference_check(model, gm, args).passed
    assert _own_forwards(model)


def test_vit_tiny_optimize_reports_and_keeps_sdpa():
    model, inputs = zoo.get("vit-tiny")
    opt = graphopt.optimize(model, inputs, target="h200")
    rep = opt.report
    assert rep.capture["mha"]["sdpa_calls"] == 2
    assert any("2 call(s) captured in the batch-first SDPA form" in n for n in rep.notes)
    assert rep.pass_result("fuse_attention").status == "unchanged"  # already SDPA
    assert rep.pass_result("fuse_layer_norm").status == "applied"
    assert op_counts(opt.graph_module)[SDPA] == 2 and _copies(opt.graph_module) == 0
    assert rep.accuracy["checked"] and rep.accuracy["passed"]
    assert "batch-first SDPA form" in rep.to_json()


# ---------------------------------------------------------------- calls that keep the module's forward


class Call(nn.Module):
    def __init__(self, how, **kw):
        super().__init__()
        self.how = how
        self.attn = nn.MultiheadAttention(16, 2, batch_first=kw.pop("batch_first", True), **kw)
        self.register_buffer("mask", torch.triu(torch.full((5, 5), float("-inf")), 1))

    def forward(self, x, y):
        a = self.attn
        if self.how == "need_weights":
            out, w = a(x, x, x)  # need_weights defaults to True
            return out + w.sum(-1, keepdim=True)
        if self.how == "attn_mask":
            return a(x, x, x, attn_mask=self.mask, need_weights=False)[0]
        if self.how == "cross":
            return a(x, y, y, need_weights=False)[0]
        if self.how == "unbatched":
            q = x[0]
            return a(q, q, q, need_weights=False)[0]
        return a(x, x, x, need_weights=False)[0]


NEGATIVE = [
    ("need_weights", {}, "need_weights=True"),
    ("attn_mask", {}, "an attn_mask is given"),
    ("plain", {"batch_first": False}, "batch_first=False"),
    ("cross", {}, "not self-attention"),
    # kdim/vdim != embed_dim: key and value cannot be the query, so it is cross-attention
    ("plain", {"kdim": 8, "vdim": 8}, "not self-attention"),
    ("plain", {"add_bias_kv": True}, "add_bias_kv=True"),
    ("plain", {"add_zero_attn": True}, "add_zero_attn=True"),
    ("unbatched", {}, "unbatched input"),
]


@pytest.mark.parametrize("how,kw,reason", NEGATIVE, ids=[f"{r[0]}-{r[2].split()[0]}" for r in NEGATIVE])
def test_ineligible_calls_keep_the_module_forward(how, kw, reason):
    torch.manual_seed(4)
    model = Call(how, **dict(kw)).eval()
    x = torch.randn(2, 5, 16)
    y = torch.randn(2, 5, 8 if "kdim" in kw else 16)
    if how == "plain" and "kdim" in kw:  # kdim != embed_dim: the module only supports it as cross-attention
        model.how = "cross"
    args = (x, y)
    gm = capture(model, args)
    info = gm.meta["graphopt_capture"]
    assert info.mha["sdpa_calls"] == 0 and info.mha["kept_calls"] == 1
    (reasons,) = info.mha["kept"].values()
    assert any(reason in r for r in reasons)
    assert any("kept its own forward" in n and reason in n for n in info.notes)
    # the same graph as with the opt-out: the module's own forward was traced
    assert op_counts(gm) == op_counts(capture(model, args, mha="module"))
    assert reference_check(model, gm, args).passed
    assert _own_forwards(model)


def test_subclass_and_replaced_forward_left_alone():
    class Mine(nn.MultiheadAttention):
        def forward(self, query, key, value, **kw):
            return super().forward(query, key, value, **kw)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Mine(16, 2, batch_first=True)
            self.b = nn.MultiheadAttention(16, 2, batch_first=True)
            # a user's wrapper bound to the instance (deepcopy rebinds it to the copy)
            self.b.forward = types.MethodType(lambda mod, *a, **k: nn.MultiheadAttention.forward(mod, *a, **k),
                                              self.b)

        def forward(self, x):
            y = self.a(x, x, x, need_weights=False)[0]
            return self.b(y, y, y, need_weights=False)[0]

    model = Two().eval()
    replaced = model.b.forward
    args = (torch.randn(2, 5, 16),)
    gm = capture(model, args)
    info = gm.meta["graphopt_capture"]
    assert info.mha["sdpa_calls"] == 0
    assert info.mha["skipped"] == {"a": "Mine overrides forward", "b": "its forward was replaced on the instance"}
    assert model.b.forward is replaced and "forward" not in model.a.__dict__
    assert reference_check(model, gm, args).passed


# ---------------------------------------------------------------- the module is left as it was


def test_forward_restored_when_export_raises():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            y = self.attn(x, x, x, need_weights=False)[0]
            if y.sum() > 0:  # data-dependent control flow: torch.export raises here
                return y * 2
            return y

    model = DataDependent().eval()
    args = (torch.randn(2, 5, 16),)
    for strategy in ("export", "auto"):  # auto: symbolic_trace fails on the branch too
        with pytest.raises(CaptureError, match="data-dependent|control flow"):
            capture(model, args, strategy=strategy)
        assert _own_forwards(model)


def test_forward_restored_when_the_call_itself_raises():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            y = self.attn(x, x, x, need_weights=False)[0]
            return y @ torch.ones(3, 3)  # shape error inside the trace, after the patched call

    model = Bad().eval()
    with pytest.raises(CaptureError):
        capture(model, (torch.randn(2, 5, 16),))
    assert _own_forwards(model)


# ---------------------------------------------------------------- opt-out


def test_opt_out_by_argument_and_environment(monkeypatch):
    model = SelfAttn(16, 2).eval()
    args = (torch.randn(2, 5, 16),)
    off = capture(model, args, mha="module")
    assert off.meta["graphopt_capture"].mha["sdpa_calls"] == 0 and _copies(off) >= 1
    assert any("GRAPHOPT_MHA=module" in n for n in off.meta["graphopt_capture"].notes)
    monkeypatch.setenv("GRAPHOPT_MHA", "module")
    assert op_counts(capture(model, args)) == op_counts(off)
    assert capture(model, args, mha="sdpa").meta["graphopt_capture"].mha["sdpa_calls"] == 1  # argument wins
    monkeypatch.setenv("GRAPHOPT_MHA", "fast")
    with pytest.raises(CaptureError, match="GRAPHOPT_MHA='fast' is not one of"):
        capture(model, args)
    with pytest.raises(CaptureError, match="mha='nope' is not one of"):
        capture(model, args, mha="nope")
    monkeypatch.delenv("GRAPHOPT_MHA")
    assert capture(model, args).meta["graphopt_capture"].mha["sdpa_calls"] == 1


def test_cli_explain_json_and_bad_env(monkeypatch, capfd, tmp_path):
    monkeypatch.delenv("GRAPHOPT_TRACEBACK", raising=False)
    path = tmp_path / "r.json"
    assert main(["explain", "vit-tiny", "--target", "h200", "--no-accuracy", "--passes", "eliminate_dead_code",
                 "--json", str(path)]) == 0
    out, _ = capfd.readouterr()
    assert "2 call(s) captured in the batch-first SDPA form" in out
    assert json.loads(path.read_text())["capture"]["mha"]["sdpa_calls"] == 2
    monkeypatch.setenv("GRAPHOPT_MHA", "fused")
    assert main(["explain", "vit-tiny", "--no-accuracy"]) == 2
    _, err = capfd.readouterr()
    assert "GRAPHOPT_MHA='fused' is not one of" in err and len(err.strip().splitlines()) == 1
