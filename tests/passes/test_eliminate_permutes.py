import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

aten = torch.ops.aten
CONTIG, CLONE = "aten.contiguous.default", "aten.clone.default"
PERMUTE, TRANSPOSE, VIEW, RESHAPE = "aten.permute.default", "aten.transpose.int", "aten.view.default", "aten.reshape.default"


def _run(model, args, dtype=torch.float32, mha=None):
    model = model.eval().to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    gm = capture(model, args, mha=mha)
    before = op_counts(gm)
    (res,) = run_passes(gm, ["eliminate_permutes"])
    return model, args, gm, before, op_counts(gm), res


# nn.MultiheadAttention's general path (F.multi_head_attention_forward), as capture records it with
# mha="module" (GRAPHOPT_MHA=module); by default capture takes the batch-first SDPA form instead
# (graphopt.capture_mha, tests/test_capture_mha.py), which has none of these copies to remove.
class Mha(nn.Module):  # torchvision's ViT block attention: nn.MultiheadAttention, batch_first
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class InversePair(nn.Module):
    def forward(self, x):
        y = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2)  # identity
        z = x.transpose(1, 2).transpose(2, 1)  # identity
        return y * 2 + z


class NotInverse(nn.Module):
    def forward(self, x):
        return x.permute(0, 2, 1, 3).permute(0, 1, 3, 2) * 2


class NoopCopies(nn.Module):
    def forward(self, x):
        y = (x * 2).contiguous()
        return torch.clone(y + 1) * 3


class StridedPointwise(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2).contiguous() + 1  # a real copy read by a pointwise op


class ViewChain(nn.Module):
    def forward(self, x):  # x [4, 6, 8] contiguous
        return (x * 2).view(4, 48).unsqueeze(0).flatten(1).unflatten(1, (4, 6, 8)).squeeze(0) + 1


class StridedChain(nn.Module):
    def forward(self, x):  # x [4, 6, 8]; t = x^T [4, 8, 6] strided: a single view of t is invalid
        t = (x * 2).transpose(1, 2)
        return t.reshape(4, 48).view(4, 6, 8) + 1


class StridedBmm(nn.Module):
    def forward(self, a, b):  # a copy of a transposed operand before bmm: bmm takes it strided
        return torch.bmm(a, b.transpose(1, 2).contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_qkv_copy_removed(dtype):
    model, args, gm, before, after, res = _run(Mha(), (torch.randn(2, 9, 32),), dtype, mha="module")
    assert before[CONTIG] == 1 and after[CONTIG] == 0
    assert res.details["removed"]["drop_strided_contiguous"] == 1
    assert all(r.predicted_gain_s >= 0 for r in res.rewrites)
    assert any(r.predicted_gain_s > 0 for r in res.rewrites if r.pattern == "drop_strided_contiguous")
    assert res.predicted_s_after < res.predicted_s_before
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_pairs_cancel(dtype):
    model, args, gm, before, after, res = _run(InversePair(), (torch.randn(2, 3, 4, 5),), dtype)
    assert before[PERMUTE] + before[TRANSPOSE] == 4
    assert after[PERMUTE] + after[TRANSPOSE] == 0
    assert res.details["removed"]["cancel_permute_pair"] == 2
    assert reference_check(model, gm, args).passed


def test_non_inverse_pair_stays():
    model, args, gm, before, after, res = _run(NotInverse(), (torch.randn(2, 3, 4, 5),))
    assert after[PERMUTE] == 2 and res.details["removed"]["cancel_permute_pair"] == 0
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noop_contiguous_and_clone_removed(dtype):
    model = NoopCopies().to(dtype)
    args = (torch.randn(3, 5).to(dtype),)
    gm = capture(model, args)
    # export drops a contiguous() of a contiguous tensor itself; such nodes appear after other
    # passes change layouts (bert's SDPA output), so plant one here after the mul
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    with gm.graph.inserting_after(mul):
        c = gm.graph.call_function(aten.contiguous.default, (mul,))
    c.meta["val"] = mul.meta["val"]
    mul.replace_all_uses_with(c, delete_user_cb=lambda u: u is not c)
    gm.recompile()
    before = op_counts(gm)
    (res,) = run_passes(gm, ["eliminate_permutes"])
    after = op_counts(gm)
    assert before[CONTIG] + before[CLONE] == 2 and after[CONTIG] + after[CLONE] == 0
    assert res.details["removed"]["drop_noop_contiguous"] == 2
    clone = [r for r in res.rewrites if "clone" in r.matched[0]]
    assert clone and clone[0].predicted_gain_s > 0  # a clone is a real copy in the cost model
    assert reference_check(model, gm, args).passed


def test_clone_returned_to_caller_stays():
    class Out(nn.Module):
        def forward(self, x):
            return (x * 2).clone()
    model, args, gm, before, after, res = _run(Out(), (torch.randn(3, 5),))
    assert before[CLONE] == after[CLONE] == 1
    assert any("returned to the caller" in r.reason for r in res.rejected)


def test_contiguous_before_pointwise_stays():
    model, args, gm, before, after, res = _run(StridedPointwise(), (torch.randn(2, 3, 4),))
    assert after[CONTIG] == 1
    assert any("wants a contiguous input" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_view_chain_merged(dtype):
    model, args, gm, before, after, res = _run(ViewChain(), (torch.randn(4, 6, 8),), dtype)
    shape_ops = ("view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten")
    count = lambda c: sum(v for k, v in c.items() if k.split(".")[1] in shape_ops)  # noqa: E731
    assert count(before) == 5 and count(after) == 1 and after[VIEW] == 1
    assert reference_check(model, gm, args).passed


def test_invalid_view_on_strided_input_not_made():
    model, args, gm, before, after, res = _run(StridedChain(), (torch.randn(4, 6, 8),))
    t = next(n for n in gm.graph.nodes if n.target is aten.transpose.int)
    # the chain becomes one reshape (a copy), never a view of the strided tensor
    assert [u.target for u in t.users] == [aten.reshape.default]
    assert reference_check(model, gm, args).passed


def test_contiguous_before_bmm_removed():
    model, args, gm, before, after, res = _run(StridedBmm(), (torch.randn(2, 5, 6), torch.randn(2, 7, 6)))
    assert before[CONTIG] == 1 and after[CONTIG] == 0
    assert reference_check(model, gm, args).passed


# ---------------------------------------------------------------- zoo


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vit_tiny_qkv_copies_gone(dtype):
    model, inputs = zoo.get("vit-tiny")
    model, args, gm, before, after, res = _run(model, tuple(inputs), dtype, mha="module")
    layers = 2
    assert before[CONTIG] == layers and after[CONTIG] == 0
    assert res.details["removed"]["drop_strided_contiguous"] == layers
    assert res.predicted_s_after < res.predicted_s_before
    sdpa = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(sdpa) == layers
    assert reference_check(model, gm, args).passed


@pytest.mark.parametrize("name,mha", [("vit-tiny", "module"), ("vit-tiny", "sdpa"), ("bert-tiny", "sdpa")])
def test_optimize_zoo_keeps_accuracy(name, mha, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_MHA", mha)
    model, inputs = zoo.get(name)
    opt = graphopt.optimize(model, inputs, target="h200")
    res = opt.report.pass_result("eliminate_permutes")
    # ViT captured in the batch-first SDPA form has no layout copy left to remove
    assert res.status == ("unchanged" if name == "vit-tiny" and mha == "sdpa" else "applied")
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"]
    if name == "vit-tiny":
        assert op_counts(opt.graph_module)[CONTIG] == 0
        assert opt.report.capture["mha"]["sdpa_calls"] == (2 if mha == "sdpa" else 0)


def _linear_inputs(gm):
    return [n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_transposes_around_linears(dtype):
    """nn.MultiheadAttention(batch_first) works sequence-first inside: its in-projection reads a
    transposed input (at::linear would copy it) and its out-projection reads the attention output
    reordered to [L, B, E] (a copy) and transposes back. Both linears end up on rows in the
    caller's order: the in-projection's result is transposed (a view the QKV views still accept),
    and the out-projection reads the attention output as [B, L, E], which SDPA's CUDA kernels
    write contiguously."""
    model, args, gm, before, after, res = _run(Mha(), (torch.randn(2, 9, 32),), dtype, mha="module")
    assert res.details["removed"]["sink_transpose_below_linear"] == 1
    assert res.details["removed"]["hoist_transpose_above_linear"] == 1
    ins = _linear_inputs(gm)
    assert all(i.target is not aten.transpose.int for i in ins)  # neither reads a transposed tensor
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out.target is aten.linear.default  # the out-projection's result is returned directly
    assert all(r.predicted_gain_s > 0 for r in res.rewrites if "transpose" in r.pattern)
    assert reference_check(model, gm, args).passed


class LastDimTranspose(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):  # x [2, 6, 7]: the transpose moves the last dim: not a row-wise reorder
        return self.fc(x.transpose(1, 2))


class ViewNeedsRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):  # x [3, 4, 8]; flattening the (transposed) rows needs them in this order
        return self.fc(x.transpose(0, 1)).view(12, 8) * 2


def test_transpose_sinking_refused_when_unsafe():
    _, args, gm, _, _, res = _run(LastDimTranspose(), (torch.randn(2, 6, 7),))
    assert res.details["removed"]["sink_transpose_below_linear"] == 0
    model, args, gm, _, _, res = _run(ViewNeedsRows(), (torch.randn(3, 4, 8),))
    # the view of the linear's result would be invalid on the sunk transpose's strides: undone
    assert res.details["removed"]["sink_transpose_below_linear"] == 0
    assert any("would need a copy" in r.reason for r in res.rejected)
    assert reference_check(model, gm, args).passed
