from pathlib import Path

import sympy
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import CaptureError, capture, ir
from graphopt.examples import zoo
from tests.helpers import op_counts

aten = torch.ops.aten


def _outputs_equal(a, b):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "shape-branch", "vit-tiny", "bert-tiny", "glm4-tiny"])
def test_capture_matches_model_and_has_metadata(name):
    model, inputs = zoo.get(name)
    gm = capture(model, inputs)
    with torch.no_grad():
        _outputs_equal(gm(*inputs), model(*inputs))
    info = gm.meta["graphopt_capture"]
    assert info.method == "torch.export"
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.nn.Module):
            continue  # a higher-order op's body (transformers 5.17's rotary runs under wrap_with_autocast)
        if n.op in ("placeholder", "call_function", "get_attr"):
            assert "val" in n.meta, n.name
    # parameters stay attributes of the module, read with get_attr, not graph inputs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(torch.utils._pytree.tree_leaves(inputs))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)


def test_canonical_vocabulary_has_no_inplace_ops():
    model, inputs = zoo.get("shape-branch")
    gm = capture(model, inputs)
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            assert not n.target._schema.is_mutable, n.target
    assert op_counts(gm)["aten.relu.default"] >= 1


def test_glm_returns_model_output_with_cache():
    model, inputs = zoo.get("glm4-tiny")
    gm = capture(model, inputs)
    out = gm(*inputs)
    ref = model(*inputs)
    assert type(out) is type(ref)
    cache = out[1]  # logits, then the cache (named past_key_values or cache by transformers version)
    assert type(cache).__name__ == "DynamicCache"
    _outputs_equal(out, ref)


def test_symbolic_trace_fallback_normalizes_to_aten():
    model, inputs = zoo.get("mlp")
    gm = capture(model, inputs, strategy="symbolic_trace")
    assert gm.meta["graphopt_capture"].method == "symbolic_trace"
    counts = op_counts(gm)
    assert counts["aten.linear.default"] == 3
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs))


def test_symbolic_trace_fallback_conv_bn():
    model, inputs = zoo.get("shape-branch")
    # shape-branch has Python control flow on shapes: symbolic_trace cannot follow it
    with pytest.raises(CaptureError):
        capture(model, inputs, strategy="symbolic_trace")

    class ConvBn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.pool = nn.AdaptiveAvgPool2d(1)

        def forward(self, x):
            return torch.flatten(self.pool(torch.relu(self.bn(self.conv(x)))), 1)

    m = ConvBn().eval()
    x = torch.randn(2, 3, 16, 16)
    gm = capture(m, (x,), strategy="symbolic_trace")
    counts = op_counts(gm)
    assert counts["aten.conv2d.default"] == 1 and counts["aten.batch_norm.default"] == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(x), m(x))


def test_data_dependent_control_flow_names_the_line():
    from graphopt.examples import data_dependent

    model, inputs = data_dependent.build()
    with pytest.raises(CaptureError) as e:
        capture(model, inputs)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"data_dependent.py:{data_dependent.BRANCH_LINE}" in msg
    assert "torch.cond" in msg or "torch.where" in msg


def test_dynamic_dims_are_sympy_symbols():
    model, inputs = zoo.get("mlp")
    gm = capture(model, inputs, dynamic={"x": {0: "batch"}})
    x_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    batch = ir.info(x_node).shape[0]
    assert isinstance(batch, sympy.Expr) and batch.free_symbols
    out = next(n for n in gm.graph.nodes if n.op == "call_function" and ir.info(n) is not None)
    assert ir.info(out).symbolic
    bigger = torch.randn(5, *inputs[0].shape[1:])
    with torch.no_grad():
        torch.testing.assert_close(gm(bigger), model(bigger))
    assert ir.shape_hints(gm)  # the example size is the hint


def test_bad_inputs_give_capture_errors():
    model, inputs = zoo.get("mlp")
    with pytest.raises(CaptureError, match="nn.Module"):
        capture(lambda x: x, inputs)
    with pytest.raises(CaptureError, match="no tensor"):
        capture(model, (3,))
    with pytest.raises(CaptureError, match="forward takes"):
        capture(model, inputs, dynamic={"nope": {0: "b"}})
    with pytest.raises(CaptureError, match="outside"):
        capture(model, inputs, dynamic={"x": {7: "b"}})
    # an example of size 1 in a dynamic dim: export would specialize it (it said the model had)
    with pytest.raises(CaptureError, match="has size 1 in the example"):
        capture(model, (inputs[0][:1],), dynamic={"x": {0: "batch"}})


class _ViewsTo5Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv(x).view(5, -1)


@pytest.mark.parametrize("shape,said", [((2, 4, 16, 16), "to have 3 channels"),  # the conv's check
                                        ((2, 3, 16, 16), "is invalid for input of size")])  # the view's
def test_example_inputs_that_do_not_fit_the_model_are_named_as_such(shape, said):
    with pytest.raises(CaptureError) as e:
        capture(_ViewsTo5Rows(), (torch.randn(*shape),))
    msg = str(e.value)
    assert "\n" not in msg and said in msg
    assert "fix: an op rejected the shapes it was given: check that example_inputs" in msg
    assert f"{Path(__file__).name}:" in msg  # the forward's line, not generated code's "<string>"


def test_kwargs_inputs():
    model, inputs = zoo.get("bert-tiny")
    ids, mask = inputs
    gm = capture(model, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        _outputs_equal(gm(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask))


def test_capture_is_reexported():
    assert graphopt.capture is capture


def test_dtype_asserts_dropped_inside_subgraphs():
    """Export's _assert_tensor_metadata nodes inside a higher-order op's body graph (CUDA captures
    of HF rotary embeddings) go too, or lowering a dtype trips them."""
    import torch.fx as fx

    from graphopt.capture import canonicalize

    aten = torch.ops.aten
    body = fx.Graph()
    x = body.placeholder("x")
    body.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    body.output(body.call_function(aten.mul.Tensor, (x, 2)))
    outer = fx.Graph()
    y = outer.placeholder("y")
    outer.output(outer.call_module("body", (y,)))
    root = torch.nn.Module()
    root.body = fx.GraphModule(torch.nn.Module(), body)
    gm = fx.GraphModule(root, outer)
    canonicalize(gm)
    assert not any(n.target is aten._assert_tensor_metadata.default for n in gm.body.graph.nodes)
    t = torch.randn(3, dtype=torch.bfloat16)
    assert torch.equal(gm(t), t * 2)  # a bf16 input no longer trips the fp32 assertion


def test_stack_traces_are_left_out_unless_asked_for():
    """torch.export's per-node source locations cost export time and graphopt never reads them;
    capture(stack_traces=True) (optimize(dump_dir=...)) keeps them. The graph is the same."""
    config = getattr(torch.fx, "config", None)
    if not hasattr(config, "do_not_emit_stack_traces"):
        pytest.skip("this torch records stack traces unconditionally")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    plain = capture(model, (x,))
    traced = capture(model, (x,), stack_traces=True)
    assert config.do_not_emit_stack_traces is False  # restored
    ops = lambda gm: [(n.op, str(n.target)) for n in gm.graph.nodes]  # noqa: E731
    assert ops(plain) == ops(traced)
    assert not any(n.stack_trace for n in plain.graph.nodes if n.op == "call_function")
    assert any(n.stack_trace for n in traced.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(plain(x), model(x))


def test_cache_rebuilt_without_copies_and_usable_for_decoding():
    """The returned DynamicCache holds the graph's key/value outputs themselves (no concatenation
    to an empty past per layer on every call), and a next-token step appends to it as to the
    model's own cache."""
    model, inputs = zoo.get("glm4-tiny")
    gm = capture(model, inputs)
    from torch.utils import _pytree as pytree

    out = gm(*inputs)
    cache = out[1]
    leaves, spec = pytree.tree_flatten(cache)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), leaves))
    ref = model(*inputs)[1]
    assert rebuilt.get_seq_length() == ref.get_seq_length() == inputs[0].shape[1]
    nxt = torch.randint(0, 256, (inputs[0].shape[0], 1))
    with torch.no_grad():
        a = model(nxt, past_key_values=rebuilt).logits
        b = model(nxt, past_key_values=ref).logits
    torch.testing.assert_close(a, b)
    assert rebuilt.get_seq_length() == inputs[0].shape[1] + 1


class _Dropouts(nn.Module):
    """Every dropout spelling, as an inference model calls it: modules in eval (in place or not),
    functions with training=False, the ATen-level torch.* ops, native_dropout, and p=0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.d_inplace = nn.Dropout(0.3, inplace=True)
        self.d = nn.Dropout(0.2)
        self.d2 = nn.Dropout2d(0.1)
        self.d1 = nn.Dropout1d(0.1, inplace=True)
        self.alpha = nn.AlphaDropout(0.1)
        self.falpha = nn.FeatureAlphaDropout(0.1)

    def forward(self, x):
        y = self.d_inplace(self.fc(x).flatten(1).view(x.shape))  # EfficientNet: in place on a view
        y = self.d(y) + 1
        y = torch.nn.functional.dropout(y, 0.5, training=False)
        y = self.d2(y.unsqueeze(-1)).squeeze(-1)
        y = self.falpha(self.alpha(y).unsqueeze(-1)).squeeze(-1)
        y = torch.dropout(y, 0.1, False) * torch.feature_dropout(y, 0.1, False) - torch.alpha_dropout(y, 0.2, False)
        y, keep = torch.native_dropout(y, 0.3, False)
        y = torch.nn.functional.dropout(y, 0.0, training=True) * keep
        return torch.relu(self.d1(y))


@pytest.mark.parametrize("strategy", ["export", "symbolic_trace"])
def test_eval_dropout_of_every_spelling_is_removed(strategy):
    from graphopt.runtime import cuda_graphs as lower

    model, x = _Dropouts().eval(), torch.randn(2, 4, 8)
    gm = capture(model, (x,), strategy=strategy)
    left = [n.name for n in gm.graph.nodes if "dropout" in str(n.target).lower()
            or (n.op == "call_module" and str(n.target).startswith(("d", "alpha", "falpha")))]
    assert not left and not any(ir.is_random(n) for n in gm.graph.nodes), left
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert "random op" not in lower.decide(gm, [x], device_type="cpu").why


class _Units(nn.Module):
    """A disabled layer scale (gamma = 1.0), an accumulator started at 0, a subtract of 0 and a
    divide by 1: removed. An int tensor times 1.0 (promotes), a strided slice times 1 (the product
    is dense: a new layout), a product written in place and one returned as it is: kept."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gamma = 1.0

    def forward(self, x, n):
        h = self.fc(x)
        acc = 0
        for k in range(2):
            acc = acc + h * (k + 2)
        y = x + self.gamma * h
        y = (y - 0) / 1
        y = 1.0 * y + acc
        w = y * 1
        w.add_(1.0)
        return y + (n * 1.0).sum() + (h[:, ::2] * 1).sum(), h * 1, w


def _unit_ops(gm):
    unit = {aten.mul.Tensor: 1, aten.div.Tensor: 1, aten.add.Tensor: 0, aten.sub.Tensor: 0}
    return [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.target in unit
            and any(type(a) in (int, float) and a == unit[nd.target] for a in nd.args)]


def test_arithmetic_with_its_unit_is_removed():
    model, x, n = _Units().eval(), torch.randn(2, 4, 8), torch.arange(8)
    gm = capture(model, (x, n))
    left = _unit_ops(gm)
    assert [str(nd.target) for nd in left] == ["aten.mul.Tensor"] * 4, [(nd.name, nd.args) for nd in left]
    operands = {nd.args[0].op if nd.args[0].op == "placeholder" else str(nd.args[0].target) for nd in left}
    assert {"placeholder", "aten.slice.Tensor"} <= operands
    with torch.no_grad():
        got, want = gm(x, n), model(x, n)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_training_dropout_stays_random():
    model, x = _Dropouts().train(), torch.randn(2, 4, 8)
    gm = capture(nn.Sequential(model.fc, model.d), (x,))
    drops = [n for n in gm.graph.nodes if "dropout" in str(n.target)]
    assert drops and all(ir.is_random(n) for n in drops)


def test_native_dropout_copy_kept_when_written_through():
    """native_dropout(train=False) returns a copy: where an in-place op writes into it, the copy
    stays (as a clone) and the input is untouched."""
    import torch.fx as fx

    from graphopt.capture import remove_eval_dropout

    g = fx.Graph()
    x = g.placeholder("x")
    nd = g.call_function(aten.native_dropout.default, (x, 0.5, False))
    y = g.call_function(__import__("operator").getitem, (nd, 0))
    g.call_function(aten.add_.Tensor, (g.call_function(aten.view.default, (y, [-1])), 1.0))
    g.output(y)
    gm = fx.GraphModule(nn.Module(), g)
    t = torch.randn(3)
    want = gm(t.clone())
    assert remove_eval_dropout(gm) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert aten.clone.default in targets and aten.native_dropout.default not in targets
    t0 = t.clone()
    torch.testing.assert_close(gm(t), want)
    assert torch.equal(t, t0)


@pytest.mark.slow
def test_efficientnet_classifier_dropout_leaves_no_random_op():
    """torchvision EfficientNet-B0's classifier: nn.Dropout(p, inplace=True) on a flattened view."""
    torchvision = pytest.importorskip("torchvision")
    from graphopt.runtime import cuda_graphs as lower

    model, x = torchvision.models.efficientnet_b0().eval(), torch.randn(1, 3, 64, 64)
    gm = capture(model, (x,))
    assert not [n.name for n in gm.graph.nodes if ir.is_random(n)]
    assert lower.decide(gm, [x], device_type="cpu").on


def test_export_builds_lazy_graph_modules_and_hands_back_a_plain_one(monkeypatch):
    """torch.export runs with torch.fx's lazy GraphModules (export's intermediate modules generate
    their code only if used); the captured module is a plain one whose code is current."""
    import importlib

    import torch.fx._lazy_graph_module as lazy

    cap = importlib.import_module("graphopt.capture")
    seen = []
    real = cap._export

    def export(*a, **k):
        seen.append(lazy._use_lazy_graph_module_flag)
        return real(*a, **k)

    monkeypatch.setattr(cap, "_export", export)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    gm = graphopt.capture(model, (torch.randn(2, 4),))
    assert seen == [True] and not lazy._use_lazy_graph_module_flag
    assert not isinstance(gm, lazy._LazyGraphModule) and gm.code == gm.graph.python_code("self").src


def test_a_static_capture_carries_no_per_call_checks_of_exports_and_a_dynamic_one_keeps_them():
    """With static shapes the optimized module's own guard checks every call, so the captured module
    has neither export's forward hooks nor its _guards_fn node (tens of µs a call); with dynamic dims
    export's checks stay."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    gm = graphopt.capture(model, (x,))
    assert not gm._forward_pre_hooks and not gm._forward_hooks
    assert not gm.graph.find_nodes(op="call_module", target="_guards_fn")
    torch.testing.assert_close(gm(x), model(x))
    opt = graphopt.optimize(model, (x,), measure=False)
    with pytest.raises(graphopt.GuardError, match="shape"):
        opt(torch.randn(3, 4))
    dyn = graphopt.capture(model, (torch.randn(4, 4),), dynamic={"input": {0: "batch"}})
    assert dyn._forward_pre_hooks and dyn.graph.find_nodes(op="call_module", target="_guards_fn")
    with pytest.raises(Exception):
        dyn(torch.randn(3, 5))  # a static dim changed: export's checks refuse it


class _GradRegions(nn.Module):
    """A no_grad helper (as transformers' rotary embedding), an enable_grad region and
    set_grad_enabled used as a function and as a context."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.no_grad()
    def table(self, x):
        return torch.cos(x) * 2

    def forward(self, x):
        y = self.lin(x) + self.table(x)
        with torch.enable_grad():
            y = y * 3
        with torch.set_grad_enabled(False):
            y = y - 1
        return y


def _grad_regions(gm):
    return [n for n in gm.graph.nodes if "set_grad_enabled" in str(n.target)]


def test_inference_capture_records_no_switch_to_the_mode_in_force():
    """capture(inference=True) exports under no_grad: the model's no_grad regions record nothing
    (torch 2.11 split and re-inlined the whole graph for each), an enable_grad region still
    changes the mode; outputs equal the model's, and torch's grad-mode classes are restored."""
    from torch.autograd import grad_mode

    before = {c: dict(vars(getattr(grad_mode, c))) for c in ("no_grad", "enable_grad", "set_grad_enabled")}
    model, x = _GradRegions().eval(), torch.randn(2, 8)
    gm = capture(model, (x,), inference=True)
    with torch.no_grad():
        _outputs_equal(gm(x), model(x))
    assert all(dict(vars(getattr(grad_mode, c))) == before[c] for c in before)
    # only the enable_grad region is kept as a grad-mode region; captured with grad on, all three
    assert len(_grad_regions(gm)) == 1 and len(_grad_regions(capture(model, (x,)))) == 3
    assert torch.is_grad_enabled()


def test_grad_switches_keep_their_meaning_while_redundant_ones_are_skipped():
    """Inside the capture's context the grad-mode classes behave as torch's: each switch leaves
    the mode torch's would, as a context, a decorator and set_grad_enabled called as a function."""
    from graphopt.capture import _inference_grad_mode

    seen = []

    @torch.enable_grad()
    def on():
        seen.append(torch.is_grad_enabled())

    with _inference_grad_mode(True):
        assert not torch.is_grad_enabled()
        with torch.no_grad():
            seen.append(torch.is_grad_enabled())
            with torch.enable_grad():
                seen.append(torch.is_grad_enabled())
            seen.append(torch.is_grad_enabled())
        on()
        seen.append(torch.is_grad_enabled())
        torch.set_grad_enabled(True)
        seen.append(torch.is_grad_enabled())
        with torch.set_grad_enabled(False):
            seen.append(torch.is_grad_enabled())
        seen.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)
    assert seen == [False, True, False, True, False, True, False, True]
    assert torch.is_grad_enabled()


def test_a_torch_without_the_expected_grad_classes_exports_under_plain_no_grad(monkeypatch):
    """Where torch's grad-mode classes are not laid out as expected, nothing is replaced: the
    capture still runs under no_grad."""
    from torch.autograd import grad_mode

    from graphopt.capture import _inference_grad_mode

    monkeypatch.setattr(grad_mode, "enable_grad", None)
    enter = vars(grad_mode.no_grad)["__enter__"]
    with _inference_grad_mode(True):
        assert not torch.is_grad_enabled() and vars(grad_mode.no_grad)["__enter__"] is enter
    assert torch.is_grad_enabled()


def test_optimize_captures_inference_without_grad(monkeypatch):
    """optimize() asks for an inference capture unless it optimizes a training step."""
    import importlib

    api = importlib.import_module("graphopt.api")
    calls = []
    real = api.capture

    def spy(*a, **k):
        calls.append(k.get("inference"))
        return real(*a, **k)

    monkeypatch.setattr(api, "capture", spy)
    model, x = _GradRegions(), torch.randn(2, 8)
    graphopt.optimize(model.eval(), (x,), check_accuracy=False)
    graphopt.optimize(model.train(), (x,), training=True, check_accuracy=False)
    assert calls == [True, False]


class _CastsItsRouter(nn.Module):
    """A forward that converts a submodule to a dtype (Switch Transformers' router: its classifier
    cast to the router dtype on every call); ``dtype``: the one asked for."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.router, self.proj, self.dtype = nn.Linear(8, 4), nn.Linear(8, 8), dtype

    def forward(self, x):
        self.router = self.router.to(self.dtype)
        return self.proj(x) * torch.softmax(self.router(x), -1).amax(-1, keepdim=True)


def test_a_module_conversion_in_the_forward_that_changes_nothing_is_captured():
    """torch.export refuses Module.to inside a forward ("Couldn't swap"); one that changes nothing is
    skipped while capturing, so the model captures and optimizes by the rule; one that converts
    still reaches export (and fails as before, in one line), and Module.to is torch's own after."""
    torch.manual_seed(0)
    model, x = _CastsItsRouter().eval(), torch.randn(2, 8)
    opt = graphopt.optimize(model, (x,), measure=False)
    assert opt.report.capture["method"] == "torch.export" and opt.report.accuracy["passed"]
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    converting = _CastsItsRouter(torch.float64).eval()
    with pytest.raises(CaptureError):
        capture(converting, (x,), strategy="export")
    assert nn.Module.to.__qualname__ == "Module.to"


class _CausalDecoder(nn.Module):
    def __init__(self, hint=None):
        super().__init__()
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.dec, self.hint = nn.TransformerDecoder(layer, 2), hint

    def forward(self, x, memory):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.dec(x, memory, tgt_mask=mask, tgt_is_causal=self.hint)


@pytest.mark.parametrize("hint", [None, True])
def test_torch_transformer_layers_with_a_mask_and_no_causal_hint_are_captured(hint):
    # without a hint, nn.TransformerDecoder compares the mask with a causal one (a branch on tensor
    # values export refused); captured with the mask applied as given, a hint given is kept
    from torch.nn.modules import transformer

    torch.manual_seed(0)
    model, x, memory = _CausalDecoder(hint).eval(), torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    detect = transformer._detect_is_causal_mask
    gm = capture(model, (x, memory))
    assert transformer._detect_is_causal_mask is detect
    with torch.no_grad():
        out, eager = gm(x, memory), model(x, memory)
    res = graphopt.accuracy.check(out, graphopt.accuracy.fp64_reference(model, (x, memory), {}), eager)
    assert res.passed, res.reason


class _BranchOnValues(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x - 1


def test_a_dynamic_capture_that_export_refuses_says_the_fallback_cannot_keep_dims_dynamic():
    with pytest.raises(CaptureError) as e:
        capture(_BranchOnValues(), (torch.randn(4, 3),), dynamic={"x": {0: "batch"}})
    msg = str(e.value)
    assert "\n" not in msg and "its fallback (symbolic_trace) fixes every size" in msg
    assert "declare fewer dims dynamic" in msg


def test_the_shape_solvers_own_warnings_are_quiet_while_graphopt_exports(monkeypatch, capfd):
    # a failed dynamic capture printed ~200 lines of torch's solver warnings before the one-line error
    import logging

    solver = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    before = solver.level
    seen = []

    def export(*args, **kwargs):
        seen.append(solver.getEffectiveLevel())
        solver.warning("Failed to reduce inequalities")
        raise RuntimeError("no")

    monkeypatch.delenv("GRAPHOPT_TRACEBACK", raising=False)
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    monkeypatch.setattr(torch.export, "export", export)
    with pytest.raises(CaptureError):
        capture(_BranchOnValues(), (torch.randn(4, 3),), dynamic={"x": {0: "batch"}})
    assert seen == [logging.ERROR] and solver.level == before
    assert "Failed to reduce" not in capfd.readouterr().err


def test_convolutions_with_string_padding_are_captured_with_integer_padding():
    """padding="same" / "valid" (ConvMixer's depthwise convolutions) as conv*.default, which every
    convolution pass matches; a "same" of odd total padding (aten pads its right side more) stays."""
    from graphopt.pipeline import run_passes
    from tests.helpers import op_counts, reference_check

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = torch.nn.Conv2d(8, 8, 7, padding="same", groups=8)
            self.dil = torch.nn.Conv2d(8, 8, 3, padding="same", dilation=2)
            self.valid = torch.nn.Conv1d(8, 8, 3, padding="valid")
            self.odd = torch.nn.Conv2d(8, 8, (2, 3), padding="same")
            self.bn = torch.nn.BatchNorm2d(8)

        def forward(self, x):
            y = self.bn(self.dw(x)) + self.dil(x)
            return self.odd(y), self.valid(y.flatten(2))

    torch.manual_seed(0)
    m = M().eval()
    x = torch.randn(2, 8, 9, 9)
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1), m.bn.running_var.uniform_(0.5, 2)
    gm = capture(m, (x,))
    c = op_counts(gm)
    assert c["aten.conv2d.default"] == 2 and c["aten.conv1d.default"] == 1 and c["aten.conv2d.padding"] == 1
    pads = sorted(tuple(n.args[4]) for n in gm.graph.nodes if str(n.target) == "aten.conv2d.default")
    assert pads == [(2, 2), (3, 3)]
    assert reference_check(m, gm, (x,)).passed
    (res,) = run_passes(gm, ["fold_conv_bn"], target="h200")
    assert len(res.rewrites) == 1 and reference_check(m, gm, (x,)).passed
