import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import capture
from graphopt.pipeline import run_passes
from tests.helpers import op_counts, reference_check

CAT = "aten.cat.default"


class ConvPosEnc(nn.Module):
    """A class token joined to the image tokens, split off again around a depthwise convolution
    over the tokens as an image (CoaT's convolutional position encoding)."""

    def __init__(self, dim=16, size=(6, 5)):
        super().__init__()
        self.size = size
        self.norm = nn.LayerNorm(dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.proj = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, tokens):
        B, N, C = tokens.shape
        x = torch.cat((self.cls.expand(B, -1, -1), self.norm(tokens)), dim=1)
        cls, img = x[:, :1], x[:, 1:]
        feat = img.transpose(1, 2).view(B, C, *self.size)
        y = (self.proj(feat) + feat).flatten(2).transpose(1, 2)
        return torch.cat((cls, y), dim=1) * 2.0


def _pass(gm, target="h200"):
    (res,) = run_passes(gm, ["eliminate_cat_slices"], target=target)
    return res


def test_class_token_slices_read_the_pieces_and_the_concatenation_dies():
    """Both slices are whole pieces: the convolution reads the norm's output itself (dense, where the
    slice of the concatenation had a batch stride one token longer), the first concatenation is
    gone, and the result passes the accuracy rule against float64."""
    torch.manual_seed(0)
    m = ConvPosEnc().eval()
    x = torch.randn(3, 30, 16)
    gm = capture(m, (x,))
    assert op_counts(gm)[CAT] == 2
    res = _pass(gm)
    assert res.status == "applied", res.rejected
    assert op_counts(gm)[CAT] == 1 and op_counts(gm).get("aten.slice.Tensor") is None
    conv = next(n for n in gm.graph.nodes if "conv" in str(n.target))
    src = conv.args[0]
    while "layer_norm" not in str(src.target):
        src = src.args[0]
    assert len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    assert reference_check(m, gm, (x,)).passed


class Pieces(nn.Module):
    """Selects, slices inside a piece and split items of a three-piece concatenation."""

    def forward(self, a, b, c):
        y = torch.cat((a, b, c), dim=1)
        first = y[:, 0]                 # select inside a
        mid = y[:, 3:5]                 # a slice inside b (not all of it)
        p, q, r = torch.split(y, [2, 4, 3], dim=1)  # items: all of a, then part of b and of c
        return first * 2 + mid.sum(1), p.sum(1), q.mean(1), r.amax(1)


def test_selects_slices_and_split_items_inside_a_piece_read_it():
    torch.manual_seed(0)
    xs = (torch.randn(4, 2, 5), torch.randn(4, 4, 5), torch.randn(4, 3, 5))
    m = Pieces()
    gm = capture(m, xs)
    res = _pass(gm)
    assert res.status == "applied", res.rejected
    assert op_counts(gm).get(CAT) is None  # every reader was inside one piece: the copy is gone
    assert op_counts(gm).get("aten.split_with_sizes.default") is None
    assert reference_check(m, gm, xs).passed


class Spanning(nn.Module):
    def forward(self, a, b):
        y = torch.cat((a, b), dim=1)
        return y[:, 1:3] * 2, y[:, 2:] + 1  # the first spans both pieces, the second is all of b


def test_a_slice_spanning_two_pieces_keeps_the_concatenation():
    torch.manual_seed(0)
    xs = (torch.randn(2, 2, 3), torch.randn(2, 4, 3))
    gm = capture(Spanning(), xs)
    res = _pass(gm, target="cpu")
    reasons = [r.reason for r in res.rejected]
    assert any("spans more than one piece" in r for r in reasons)
    assert op_counts(gm)[CAT] == 1  # still read by the spanning slice
    assert reference_check(Spanning(), gm, xs).passed


class WrittenPiece(nn.Module):
    def forward(self, x, z):
        y = torch.cat((x, z), dim=1)
        x.add_(1.0)  # the caller's tensor, written after the concatenation copied it
        return y[:, :2] * x


class Promoted(nn.Module):
    def forward(self, a, b):
        y = torch.cat((a, b), dim=1)
        return y[:, :2] * 3


class Returned(nn.Module):
    def forward(self, a, b):
        y = torch.cat((a, b), dim=1)
        return y[:, 2:], y[:, :2] + 1


class ViewOfTransposed(nn.Module):
    def forward(self, a, b):
        y = torch.cat((a.transpose(0, 1), b), dim=0)
        return y[:3].view(-1) * 2, y[3:] + 1


@pytest.mark.parametrize("model, xs, reason", [
    (WrittenPiece(), (torch.randn(2, 2, 3), torch.randn(2, 4, 3)), "in place"),
    (Promoted(), (torch.randn(2, 2, 3), torch.randn(2, 4, 3, dtype=torch.float64)), "promotes"),
    (Returned(), (torch.randn(2, 2, 3), torch.randn(2, 4, 3)), "the graph returns it"),
    (ViewOfTransposed(), (torch.randn(4, 3), torch.randn(2, 4)), "does not take the piece's strides"),
])
def test_refusals_say_why_and_keep_the_values(model, xs, reason):
    """A piece written in place after the copy, a dtype the concatenation promotes, a slice the graph
    returns (the caller would get an alias of an input), a view the piece's strides do not allow."""
    gm = capture(model, tuple(x.clone() for x in xs))
    res = _pass(gm, target="cpu")
    assert any(reason in r.reason for r in res.rejected), res.rejected
    assert reference_check(model, gm, tuple(x.clone() for x in xs)).passed


def test_optimize_on_the_cpu_removes_the_copy_and_leaves_the_inputs_alone():
    torch.manual_seed(0)
    m = ConvPosEnc().eval()
    x = torch.randn(2, 30, 16)
    before = x.clone()
    opt = graphopt.optimize(m, (x,), target="cpu", measure=False)
    p = next(p for p in opt.report.passes if p.name == "eliminate_cat_slices")
    assert p.status == "applied"
    assert reference_check(m, opt, (x,)).passed
    assert torch.equal(x, before)
