"""capture_einsum: batched-matrix-product einsums captured as matmul; any other einsum kept, with why."""

import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.capture_einsum import NotMatmul, matmul_form
from tests.helpers import op_counts, reference_check

SIZES = dict(b=2, g=3, h=4, i=5, j=6, d=7, k=3)


def _by_form(eq, ops):
    f = matmul_form(eq, [o.shape for o in ops], [o.dtype for o in ops])
    left, right = ops[f.left], ops[1 - f.left]
    if f.left_perm is not None:
        left = left.permute(f.left_perm)
    if f.right_perm is not None:
        right = right.permute(f.right_perm)
    out = left @ right
    return out.permute(f.out_perm) if f.out_perm is not None else out


@pytest.mark.parametrize("eq,shapes", [
    ("bhid,bhjd->bhij", None),
    ("B G H I D, B G H J D -> B G H I J", [(2, 3, 4, 5, 7), (2, 3, 4, 6, 7)]),  # MaxViT's spelling
    ("bghij,bghjd->bghid", None),
    ("...id,...jd->...ij", [(2, 3, 4, 5, 7), (2, 3, 4, 6, 7)]),
    ("bhjd,bhij->bhid", None),  # the probabilities second: left is the operand of the output's first free label
    ("ibd,jbd->bij", None),  # batch dim in the middle
    ("bid,bjd->jbi", None),  # output permuted
    ("ij,jk", None),  # implicit output (the labels used once, sorted)
    ("ij,jk->ik", None),  # no batch label
])
def test_matmul_form_computes_the_einsum(eq, shapes):
    torch.manual_seed(0)
    terms = "".join(eq.split()).split("->")[0].split(",")
    shapes = shapes or [tuple(SIZES[c] for c in t) for t in terms]
    ops = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    torch.testing.assert_close(_by_form(eq, ops), torch.einsum(eq, *ops))


def test_matmul_form_broadcasts_batch_dims_as_einsum_does():
    ops = [torch.randn(2, 1, 5, 7, dtype=torch.float64), torch.randn(1, 3, 7, 6, dtype=torch.float64)]
    torch.testing.assert_close(_by_form("bgid,bgdj->bgij", ops), torch.einsum("bgid,bgdj->bgij", *ops))


@pytest.mark.parametrize("eq,shapes,why", [
    ("ii,ij->ij", [(5, 5), (5, 6)], "repeats a label"),
    ("bid,bjd->bi", [(2, 5, 7), (2, 6, 7)], "summed out of one operand"),
    ("bid,bjd->b", [(2, 5, 7), (2, 6, 7)], "summed out of one operand"),
    ("bid,bid->bi", [(2, 5, 7), (2, 5, 7)], "0/0 free"),  # a row-wise dot product
    ("bhid,hjd->bhij", [(2, 4, 5, 7), (4, 6, 7)], "free labels"),  # b only in q: not one free label per side
    ("bij,bjk->bik", [(2, 5, 1), (2, 4, 6)], "has sizes 1 and 4"),  # einsum broadcasts a contracted dim
    ("...ij,...jk->...ik", [(2, 3, 5, 4), (3, 4, 6)], "ellipses of 2 and 1 dims"),
    ("bij,bjk,bkl->bil", [(2, 5, 4), (2, 4, 6), (2, 6, 3)], "3 operands"),
])
def test_other_einsums_are_not_matmuls(eq, shapes, why):
    with pytest.raises(NotMatmul, match=why):
        matmul_form(eq, shapes, [torch.float32] * len(shapes))


def test_mixed_dtypes_are_not_a_matmul():
    with pytest.raises(NotMatmul, match="dtypes"):
        matmul_form("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], [torch.float32, torch.bfloat16])


class EinsumModel(nn.Module):
    """Einsum attention, a product with another operand, and a one-operand einsum (a diagonal, kept)."""

    def forward(self, q, k, v, w):
        p = torch.einsum("bhid,bhjd->bhij", q, k).softmax(-1)
        out = torch.einsum("bhij,bhjd->bhid", p, v)
        y = torch.einsum("bhid,bhde->bhie", out, w)
        return y + torch.einsum("bhii->bhi", p).unsqueeze(-1)


@pytest.mark.parametrize("strategy", ["export", "symbolic_trace"])
def test_capture_spells_matrix_product_einsums_as_matmul(strategy):
    torch.manual_seed(0)
    args = (torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 8, 4))
    model = EinsumModel()
    gm = capture(model, args, strategy=strategy)
    c = op_counts(gm)
    assert c["aten.matmul.default"] == 3
    kept = [n for n in gm.graph.nodes if n.op == "call_function" and "einsum" in str(n.target)]
    assert len(kept) == 1  # the diagonal
    notes = gm.meta["graphopt_capture"].notes
    assert any("3 einsum(s)" in n for n in notes)
    assert any("kept as einsum" in n and "1 operands" in n for n in notes)
    assert all(n.meta.get("val") is not None for n in gm.graph.nodes if n.op == "call_function")
    assert reference_check(model, gm, args).passed


class StridedReader(nn.Module):
    """A batch-broadcast product torch.einsum lays out [b, i, g, k]-major; the model then reads it
    through a transpose and a view that only that layout allows."""

    def forward(self, a, b):
        return torch.einsum("bgij,bgjk->bgik", a, b).transpose(1, 2).view(2, 5, 18)


def test_an_einsum_read_through_a_view_of_its_own_layout_is_kept():
    torch.manual_seed(0)
    args = (torch.randn(2, 1, 5, 4), torch.randn(1, 3, 4, 6))
    model = StridedReader()
    gm = capture(model, args)
    assert op_counts(gm)["aten.einsum.default"] == 1
    assert any("lays the result out with strides" in n for n in gm.meta["graphopt_capture"].notes)
    assert reference_check(model, gm, args).passed


def test_a_symbolic_batch_dim_stays_symbolic_through_the_rewrite():
    """The matmul form's metadata is made without running aten.matmul's fake kernel, which on torch
    2.11 reads a symbolic batch size as an int and so specializes every dim of that symbol."""

    class Scores(nn.Module):
        def forward(self, q, k):
            return torch.einsum("bghid,bghjd->bghij", q, k).softmax(-1)

    q, k = torch.randn(2, 3, 4, 8, 16), torch.randn(2, 3, 4, 8, 16)
    gm = capture(Scores(), (q, k), dynamic={"q": {0: "batch"}, "k": {0: "batch"}})
    assert "aten.einsum.default" not in op_counts(gm)
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n.target == torch.ops.aten.matmul.default:
            assert isinstance(n.meta["val"].shape[0], torch.SymInt), n.name
    q2, k2 = torch.randn(5, 3, 4, 8, 16), torch.randn(5, 3, 4, 8, 16)
    assert reference_check(Scores(), gm, (q2, k2)).passed
