import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture
from graphopt.examples import zoo
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

SWIGLU = "graphopt.swiglu.default"


class Mlp(nn.Module):
    def __init__(self, style, d=32, i=40):
        super().__init__()
        self.style = style
        self.gate_up = nn.Linear(d, 2 * i, bias=False)
        self.gate, self.up = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down = nn.Linear(i, d, bias=False)
        self.i = i

    def forward(self, x):
        s = self.style
        if s == "llama":  # separate gate/up projections: merge_sibling_linears makes them halves
            h = F.silu(self.gate(x)) * self.up(x)
        elif s == "glm":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            h = up * F.silu(gate)
        elif s == "slice":
            gu = self.gate_up(x)
            h = F.silu(gu[..., : self.i]) * gu[..., self.i:]
        elif s == "split":
            gate, up = self.gate_up(x).split(self.i, dim=-1)
            h = F.silu(gate) * up
        elif s == "swapped":  # silu of the SECOND half: not swiglu's contract
            up, gate = self.gate_up(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif s == "silu_twice":  # the silu output is also read by the residual
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            a = F.silu(gate)
            h = a * up + a
        return self.down(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["llama", "glm", "slice", "split"])
def test_fuses_and_matches_fp64(style, dtype):
    torch.manual_seed(0)
    m = Mlp(style).eval().to(dtype)
    x = torch.randn(2, 6, 32, dtype=dtype)
    gm = capture(m, (x,))
    results = run_passes(gm, ["merge_sibling_linears", "fuse_swiglu"], target="h200")
    res = results[-1]
    c = op_counts(gm)
    assert res.status == "applied" and len(res.rewrites) == 1 and res.rewrites[0].predicted_gain_s > 0
    assert c[SWIGLU] == 1 and c["aten.silu.default"] == 0 and c["aten.mul.Tensor"] == 0
    assert reference_check(m, gm, (x,)).passed


@pytest.mark.parametrize("style,why", [("swapped", "first half"), ("silu_twice", "read elsewhere")])
def test_does_not_fire(style, why):
    m = Mlp(style).eval()
    x = torch.randn(2, 6, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_swiglu"], target="h200")
    assert op_counts(gm)[SWIGLU] == 0 and not res.rewrites
    assert any(why in r.reason for r in res.rejected), res.rejected
    assert reference_check(m, gm, (x,)).passed


def test_cpu_profile_refuses():
    m = Mlp("glm").eval()
    x = torch.randn(2, 6, 32)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["fuse_swiglu"], target="cpu")
    assert op_counts(gm)[SWIGLU] == 0
    assert [r.reason for r in res.rejected] == [NO_FUSED_KERNELS]


def test_glm4_tiny_one_per_layer():
    model, inputs = zoo.get("glm4-tiny")
    gm = capture(model, inputs)
    layers = model.config.num_hidden_layers
    res = run_passes(gm, ["merge_sibling_linears", "fuse_swiglu"], target="h200")[-1]
    assert len(res.rewrites) == layers and op_counts(gm)[SWIGLU] == layers
    assert reference_check(model, gm, inputs).passed
