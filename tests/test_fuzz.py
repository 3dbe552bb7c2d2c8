"""Fuzzing the passes (issue 10.2): random programs from graphopt.tools.fuzz's grammar, random pass
subsets (pipeline order), cpu and h200 targets, with and without the cost model's choices
(ignore_cost: every legal rewrite applies), checked against eager by the accuracy rule.
Bounded budget here; `python benchmarks/sweep.py fuzz --examples N --seed S` is the long campaign, and
its shrunk failures live in tests/fuzz_regressions/."""

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from graphopt.tools import fuzz
from graphopt.pipeline import available

# signatures of known, still-open pass bugs the CI property skips (each pinned by an xfail test in
# tests/fuzz_regressions/); both bugs the first campaign found are fixed, so none today
KNOWN: set = set()

_ci = settings(max_examples=40, deadline=None, database=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _check(program, passes, target, mode, ignore_cost=False):
    try:
        fuzz.check_program(program, passes, target, mode, ignore_cost=ignore_cost)
    except fuzz.FuzzFailure as e:
        if e.signature() in KNOWN:
            return
        raise


def test_grammar_renders_every_op():
    p = fuzz.Program(2, 4, 8, ("f32", "bf16"), (
        ("linear", 0, 16, True), ("act", 2, "gelu_tanh"), ("linear", 3, 8, False),
        ("binary", "add", 4, "value", 0), ("layer_norm", 5, True), ("rms_norm", 1),
        ("mha", 5, 2, True), ("swiglu", 7, 16), ("conv", 8, 4, 3, True, True),
        ("split", 8), ("permute", 11, (0, 2, 1, 3)), ("contiguous", 12), ("merge", 13),
        ("attention", 8, 8, 8, True), ("bmm", 15, 15), ("softmax", 16), ("matmul_w", 17, 4),
        ("cast", 18, "bf16"), ("binary", "div", 19, "param", (1, 4)), ("transpose", 20),
        ("binary", "mul", 21, "scalar", 0.5), ("act", 22, "hardswish")), (23, 7), seed=1)
    model, inputs = fuzz.build(p)
    out = model(*inputs)
    assert out[0].shape == (2, 4, 4) and out[1].dtype == torch.float32
    assert [tuple(s) for s in model.shapes][-1] == (2, 4, 4)


def _one_pass(model, inputs, name, ignore_cost=False, before=None):
    """The captured program after the pass ``name`` alone, planned for the H200 profile (strict:
    a pass bug raises), and its result; ``before(gm)`` is asserted on the captured graph first."""
    from graphopt import ir
    from graphopt.capture import capture
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import PassContext, PassManager, assemble

    gm = capture(model, inputs)
    assert before is None or before(gm)
    ctx = PassContext(cost=CostModel(get_profile("h200")[0]), hints=ir.shape_hints(gm), strict=True,
                      ignore_cost=ignore_cost)
    (res,) = PassManager(assemble([name])).run(gm, ctx)
    return gm, res


def test_grammar_renders_unfold_and_its_decomposition_keeps_the_numbers():
    """F.unfold of a value viewed as [B, C, 2, L/2] (3x3 windows, padding 1, stride 2): [2, 36, 2], the same
    through decompose_im2col (applied whatever its price) and fuse_elementwise."""
    p = fuzz.Program(2, 4, 8, ("f32",), (("unfold", 0, 3, 1, 2), ("act", 1, "gelu_tanh")), (2, 1), seed=1)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 36, 2)
    fuzz.check_program(p, ["decompose_im2col", "fuse_elementwise"], "h200", "passes", ignore_cost=True)
    # the decomposition did happen there: aten's im2col is gone from the graph
    gm, res = _one_pass(model, inputs, "decompose_im2col", ignore_cost=True,
                        before=lambda gm: any("im2col" in str(n.target) for n in gm.graph.nodes))
    assert res.status == "applied" and not any("im2col" in str(n.target) for n in gm.graph.nodes)


def test_grammar_renders_fold_and_lower_col2im_keeps_the_numbers():
    """F.fold of a transposed value [2, 8, 4] (2x2 windows, stride 1: an image of 2 x 5): [2, 2, 10], the
    same through lower_col2im (applied whatever its price: the kernel reads the transpose in place)."""
    p = fuzz.Program(2, 4, 8, ("f32",), (("transpose", 0), ("fold", 1, 2, 0, 1), ("act", 2, "gelu_tanh")), (3, 2),
                     seed=1)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 2, 10)
    fuzz.check_program(p, ["lower_col2im", "fuse_elementwise"], "h200", "passes", ignore_cost=True)
    gm, res = _one_pass(model, inputs, "lower_col2im", ignore_cost=True)
    assert res.status == "applied" and any("graphopt.col2im" in str(n.target) for n in gm.graph.nodes)


def test_grammar_renders_catslice_and_eliminate_cat_slices_keeps_the_numbers():
    """A head joined to a value and read back by slices, split items and selects (each inside one piece:
    the concatenations go), and by a range across both pieces (kept), the same through the pass."""
    ops = (("catslice", 0, 1, 2, "slice"), ("catslice", 1, 2, 1, "split"), ("catslice", 2, 0, 3, "select"),
           ("catslice", 3, 1, 2, "span"), ("act", 4, "gelu_tanh"))
    p = fuzz.Program(2, 4, 8, ("f32",), ops, (5, 2), seed=1)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 4, 8)
    fuzz.check_program(p, ["eliminate_cat_slices", "fuse_elementwise"], "h200", "passes")
    gm, res = _one_pass(model, inputs, "eliminate_cat_slices")
    assert res.status == "applied" and len(res.rewrites) == 3
    assert sum(str(n.target) == "aten.cat.default" for n in gm.graph.nodes) == 1


def test_grammar_renders_headprod_and_lower_strided_bmm_keeps_the_numbers():
    """Per-head products of a split projection (q, k, v with batch strides that do not fold), the heads
    merged back: both products become graphopt::strided_bmm (its reference on the CPU), the same numbers."""
    p = fuzz.Program(2, 8, 8, ("f32",), (("headprod", 0, 2), ("act", 1, "gelu_tanh")), (2, 1), seed=1)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 8, 8)
    fuzz.check_program(p, ["lower_strided_bmm", "fuse_elementwise"], "h200", "passes")
    gm, res = _one_pass(model, inputs, "lower_strided_bmm")
    assert res.status == "applied" and len(res.rewrites) == 2


def test_grammar_renders_reductions_broadcasts_masks_norms_inplace_dropout_host_constants():
    p = fuzz.Program(2, 4, 8, ("f32",), (
        ("split", 0), ("permute", 1, (0, 2, 1, 3)),
        ("attention", 2, 2, 2, ("bias", (2, 4, 4))), ("attention", 3, 3, 3, ("pad", (2, 1, 1, 4))),
        ("attention", 4, 4, 4, ("window", (1, 4, 4))), ("attention", 5, 5, 5, ("bool", (4, 4))),
        ("sdpa", 6, 6, 6, "causal"), ("sdpa", 7, 7, 7, ("pad", (2, 1, 1, 4))), ("sdpa", 8, 8, 8, ("bool", (2, 1, 4, 4))),
        ("reduce", 9, "var", 1, True), ("reduce", 9, "amax", -1, False), ("softmax_dim", 9, "logsumexp", 0, False),
        ("softmax_dim", 9, "log_softmax", 2, False), ("unsqueeze", 12, 1), ("binary", "add", 10, "value", 14),
        ("norm", 0, "ln_manual"), ("norm", 16, "ln_var"), ("norm", 17, "rms_plain"), ("norm", 18, "rms_gemma"),
        ("norm", 19, "rms_torch"), ("norm", 20, "ln_module"), ("inplace", 21, "slice_fill"),
        ("inplace", 22, "slice_add"), ("inplace", 23, "masked_fill_"), ("inplace", 24, "relu_"),
        ("dropout", 25, "module_inplace"), ("dropout", 26, "native"), ("dropout", 27, "alpha"),
        ("dropout", 28, "functional_inplace"), ("host_const", 29, "slice_mask"), ("host_const", 30, "arange_bias"),
        ("host_const", 31, "scalar"), ("reduce", 15, "mean", -2, True)), (32, 15, 11, 12, 13, 33), seed=1)
    model, inputs = fuzz.build(p)
    outs = model(*inputs)
    assert [tuple(o.shape) for o in outs] == [(2, 4, 8), (2, 1, 4, 4), (2, 2, 4), (2, 4, 4), (2, 2, 4, 4), (2, 1, 1, 4)]
    assert tuple(model.shapes[-1]) == (2, 1, 1, 4) and tuple(model.shapes[15]) == (2, 1, 4, 4)
    fuzz.check_program(p, fuzz.strict_passes(), "h200", "passes", ignore_cost=True)
    heads = fuzz.Program(2, 4, 16, ("f32",), (("linear", 0, 16, True), ("heads", 1, 2),
                                              ("attention", 2, 2, 2, ("pad", (2, 1, 1, 4))), ("merge_heads", 3)), (4,))
    model, inputs = fuzz.build(heads)
    assert [tuple(s) for s in model.shapes[2:]] == [(2, 2, 4, 8), (2, 2, 4, 8), (2, 4, 16)]
    assert model(*inputs).shape == (2, 4, 16)


@_ci
@given(fuzz.programs(), fuzz.pass_subsets(), st.sampled_from(("cpu", "h200")), st.booleans())
def test_random_passes_keep_eager_numbers(program, passes, target, ignore_cost):
    _check(program, passes, target, "passes", ignore_cost)


@settings(_ci, max_examples=8)
@given(fuzz.programs(max_ops=6), fuzz.pass_subsets(available()), st.sampled_from(("cpu", "h200")))
def test_optimize_end_to_end(program, passes, target):
    _check(program, passes, target, "optimize")


@pytest.mark.slow
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz.programs(max_ops=12), fuzz.pass_subsets(), st.sampled_from(("cpu", "h200")), st.booleans())
def test_random_passes_long(program, passes, target, ignore_cost):
    _check(program, passes, target, "passes", ignore_cost)


def test_regression_file_reproduces(tmp_path):
    p = fuzz.Program(1, 4, 8, ("f32",), (("act", 0, "relu"),), (1,))
    src = fuzz.regression_source(p, ["fuse_elementwise"], "cpu", "passes", "[passes] boom", xfail=False)
    f = tmp_path / "test_r.py"
    f.write_text(src)
    ns: dict = {}
    exec(compile(src, str(f), "exec"), ns)
    assert ns["PROGRAM"] == p
    ns["test_reproduces"]()


@seed(3)  # (before the grammar drew GQA and attn_block ops, this seed's 1462nd program drew a binary op whose
# first operand is over the element limit; with today's grammar the seed draws other programs)
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz.programs(max_ops=30))
def test_long_programs_draw(program):
    """The grammar at the campaign's larger sizes draws a program every time (that binary op found no
    second operand and raised TypeError in the generator, ending a campaign). 300 draws here (3 s);
    the 1500 that found it: test_long_programs_draw_1500, make test-all."""
    assert len(program.ops) >= 1


@pytest.mark.slow  # make test-all: test_long_programs_draw's property over 1500 draws (15 s)
@seed(3)
@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz.programs(max_ops=30))
def test_long_programs_draw_1500(program):
    assert len(program.ops) >= 1


def test_grammar_renders_grouped_query_attention_blocks_and_reduced_broadcasts():
    """attention/sdpa over fewer k/v heads (repeat_kv; enable_gqa), the Llama-style attn_block with masks
    (and K^T permuted straight from the projection, keys_last), and a binary op against a reduction of its operand (another rank); fuse_attention takes the
    generator's repeat_kv spelling as GQA"""
    from graphopt import ir
    from graphopt.capture import capture
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import PassContext, PassManager, assemble

    p = fuzz.Program(2, 4, 16, ("f32",), (
        ("linear", 0, 16, False), ("heads", 1, 4), ("linear", 0, 8, False), ("heads", 3, 2),
        ("attention", 2, 4, 4, False, 2), ("sdpa", 2, 4, 4, None, 2),
        ("attn_block", 0, 4, 1, ("pad", (2, 1, 1, 4)), "manual"), ("attn_block", 7, 2, 2, "causal", "sdpa"),
        ("reduce", 8, "amax", 0, False), ("binary", "sub", 8, "value", 9),
        ("attn_block", 0, 2, 2, ("bias", (1, 2, 4, 4)), "keys_last")), (10, 5, 6, 11), seed=2)
    model, inputs = fuzz.build(p)
    outs = model(*inputs)
    assert [tuple(o.shape) for o in outs] == [(2, 4, 16), (2, 4, 4, 4), (2, 4, 4, 4), (2, 4, 16)]
    torch.testing.assert_close(outs[1], outs[2])  # repeat_kv then attention == SDPA's enable_gqa
    fuzz.check_program(p, ["fuse_attention", "lower_attention"], "h200", "passes", ignore_cost=True)
    gm = capture(model, inputs)
    ctx = PassContext(cost=CostModel(get_profile("h200")[0]), hints=ir.shape_hints(gm), strict=True, ignore_cost=True)
    PassManager(assemble(["fuse_attention"])).run(gm, ctx)
    gqa = [n for n in gm.graph.nodes if n.op == "call_function" and n.kwargs.get("enable_gqa")]
    assert len(gqa) == 3  # the eager SDPA, and both repeat_kv attentions (the 4-head block's k/v have one head)
    # the keys_last block's K^T, one permute of the projection, is read as K through a view
    sdpa = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert any(n.args[1].target is torch.ops.aten.permute.default and list(n.args[1].args[1]) == [0, 2, 1, 3]
               for n in sdpa)


def test_grammar_renders_group_norms_and_lower_group_norm_survives_them():
    """GroupNorm in the grammar: one group and per-channel groups, with and without affine and an
    activation, 3-D and as channels_last 4-D; every legal rewrite of lower_group_norm (planned for the
    H200, run by the reference on the CPU) passes the accuracy rule."""
    from graphopt import capture
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import PassContext, registry
    from tests.helpers import op_counts

    p = fuzz.Program(2, 4, 8, ("f32",), (
        ("group_norm", 0, 1, True, "silu", True), ("group_norm", 1, 4, False, "none", False),
        ("group_norm", 2, 2, True, "gelu", True), ("binary", "add", 3, "value", 1)), (4,), seed=3)
    model, inputs = fuzz.build(p)
    assert model(*inputs).shape == (2, 4, 8)
    fuzz.check_program(p, ["lower_group_norm"], target="h200", ignore_cost=True)
    gm = capture(model, inputs)
    ctx = PassContext(cost=CostModel(get_profile("h200")[0]), hints={}, strict=True, ignore_cost=True)
    registry()["lower_group_norm"]().run(gm, ctx)
    assert op_counts(gm)["graphopt.group_norm.default"] == 3


def test_grammar_renders_mixconv_and_merge_split_convs_keeps_the_numbers():
    """Convolutions of a split's pieces concatenated back (MixNet's mixed depthwise, split 1x1): one
    grouped convolution each after merge_split_convs, the same numbers."""
    p = fuzz.Program(2, 4, 8, ("f32",), (("mixconv", 0, "depthwise"), ("mixconv", 1, "pointwise"),
                                          ("act", 2, "gelu_tanh")), (3, 2), seed=1)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 4, 8)
    fuzz.check_program(p, ["merge_split_convs", "fuse_elementwise"], "h200", "passes")
    gm, res = _one_pass(model, inputs, "merge_split_convs")
    assert res.status == "applied" and len(res.rewrites) == 2
    assert sum(str(n.target) == "aten.conv2d.default" for n in gm.graph.nodes) == 2


def test_grammar_renders_resample_and_the_lowerings_keep_the_numbers():
    """Bilinear down and back up (by factor or by size, align_corners or not) over a depthwise mixconv:
    lower_upsample and lower_depthwise_conv on an h200 target, every rewrite legal applied, the numbers kept."""
    p = fuzz.Program(2, 4, 8, ("f32",), (("mixconv", 0, "depthwise"), ("resample", 1, False, True),
                                          ("resample", 2, True, False)), (3, 2), seed=2)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 4, 8)
    fuzz.check_program(p, ["merge_split_convs", "lower_depthwise_conv", "lower_upsample"], "h200", "passes",
                       ignore_cost=True)
    gm, res = _one_pass(model, inputs, "lower_upsample", ignore_cost=True)
    assert res.status == "applied"
    assert sum(str(n.target) == "graphopt.upsample_bilinear2d.default" for n in gm.graph.nodes) == 4


def test_grammar_renders_gate_and_hoist_slices_keeps_the_numbers():
    """A pointwise op before a split into gate and up (a row-masking masked_fill, a bias of the whole width,
    a scale; chunk, split or slices): hoist_slices computes the pieces from the operand's pieces, the numbers kept."""
    p = fuzz.Program(2, 4, 8, ("f32", "bf16"), (("gate", 0, "masked", "chunk"), ("gate", 0, "bias", "split"),
                                                  ("gate", 1, "scale", "slices")), (2, 3, 4), seed=3)
    model, inputs = fuzz.build(p)
    assert [o.shape for o in model(*inputs)] == [(2, 4, 4)] * 3
    fuzz.check_program(p, ["hoist_slices", "fuse_swiglu", "fuse_elementwise"], "h200", "passes")
    from graphopt.capture import capture
    from graphopt.pipeline import run_passes

    gm = capture(model, inputs)
    res = run_passes(gm, ["hoist_slices", "fuse_elementwise"], target="h200")[0]
    assert res.status == "applied" and len(res.rewrites) == 3, [r.reason for r in res.rejected]


def test_grammar_renders_tokenmix_and_left_matmul_linears_keeps_the_numbers():
    """Linears over the tokens (Mixer's MLP, gMLP's gate, one without bias behind an activation):
    each a matmul from the left after left_matmul_linears (every legal rewrite applied), the numbers kept."""
    p = fuzz.Program(2, 4, 8, ("f32",), (("tokenmix", 0, 8, "mlp"), ("tokenmix", 1, 4, "gate"),
                                          ("tokenmix", 2, 3, "plain"), ("tokenmix", 3, 3, "glu")), (4, 1), seed=3)
    model, inputs = fuzz.build(p)
    assert model(*inputs)[0].shape == (2, 4, 8)
    fuzz.check_program(p, ["left_matmul_linears", "fuse_elementwise"], "h200", "passes", ignore_cost=True)
    gm, res = _one_pass(model, inputs, "left_matmul_linears", ignore_cost=True)
    assert res.status == "applied" and len(res.rewrites) == 4
    assert not any(str(n.target) == "aten.linear.default" for n in gm.graph.nodes)


def test_grammar_renders_convattn_and_channels_last_keeps_the_numbers():
    """Attention over a map's pixels with 1x1 convolutions (two heads: the fold back into the map is a
    reshape that copies; one head: a view): convert_channels_last (every legal rewrite applied) keeps
    the numbers, and each copying reshape is either written NHWC or named with the reason it stays."""
    from graphopt import ir

    p = fuzz.Program(2, 4, 8, ("f32",), (("convattn", 0, 2), ("convattn", 1, 1), ("conv", 2, 4, 3, True, False)),
                     (3,), seed=3)
    model, inputs = fuzz.build(p)
    assert model(*inputs).shape == (2, 4, 8)
    fuzz.check_program(p, ["convert_channels_last", "eliminate_permutes"], "h200", "passes", ignore_cost=True)
    copying = lambda gm: [n for n in gm.graph.nodes if n.target is torch.ops.aten.reshape.default  # noqa: E731
                          and len(ir.info(n).shape) == 4 and not ir.reshape_is_view(ir.info(n.args[0]), ir.info(n).shape)]
    gm, res = _one_pass(model, inputs, "convert_channels_last", ignore_cost=True, before=lambda g: len(copying(g)) == 1)
    named = [r for r in res.rejected if "reshape that copies" in r.candidate]
    assert res.status == "applied" and res.details["reshapes_to_channels_last"] + len(named) == 1, res.rejected
