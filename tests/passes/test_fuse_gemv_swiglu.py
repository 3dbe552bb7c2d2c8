"""fuse_gemv_swiglu: a SwiGLU MLP's gate and up projections of at most 16 rows and its activation ->
graphopt::gemv_swiglu, in both spellings (two weights as Llama holds them, one merged weight as
GLM-4 does), only where the profile's measured efficiencies price it faster (the op's reference
runs here on the CPU)."""
import dataclasses
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import capture, ir
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import NO_FUSED_KERNELS, PassContext, PassManager, assemble
from tests.helpers import op_counts, reference_check

OP = "graphopt.gemv_swiglu.default"


class TwoWeights(nn.Module):
    """Llama's MLP: gate_proj and up_proj apart."""

    def __init__(self, h=64, n=96, bias=False):
        super().__init__()
        self.gate, self.up = nn.Linear(h, n, bias=bias), nn.Linear(h, n, bias=False)
        self.down = nn.Linear(n, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Merged(nn.Module):
    """GLM-4's MLP: one gate_up_proj, chunked."""

    def __init__(self, h=64, n=96, spelling="chunk"):
        super().__init__()
        self.gate_up, self.down, self.n, self.spelling = nn.Linear(h, 2 * n, bias=False), nn.Linear(n, h, bias=False), n, spelling

    def forward(self, x):
        y = self.gate_up(x)
        if self.spelling == "chunk":
            gate, up = y.chunk(2, dim=-1)
        elif self.spelling == "slice":
            gate, up = y[..., :self.n], y[..., self.n:]
        else:  # the halves swapped: not SwiGLU's layout
            up, gate = y.chunk(2, dim=-1)
        return self.down(up * F.silu(gate))


def _shipped(measured=True):
    """The shipped H200 profile under CUDA-graph launch costs with its gemv fit covering this file's
    small weights (it was measured on 32 MB and up); ``measured=False``: no gemv fit."""
    p, _ = get_profile("h200")
    p = dataclasses.replace(p, launch_overhead_s=p.launch_overhead_graph_s)
    if not measured:
        return p.with_efficiency("gemv", None)
    return p.with_efficiency("gemv", {k: v for k, v in p.op_efficiency["gemv"].items() if k != "min_bytes"})


def _run(model, x, profile, passes=("fuse_gemv_swiglu",)):
    gm = capture(model.eval(), (x,))
    ctx = PassContext(profile=profile, cost=CostModel(profile), hints=ir.shape_hints(gm))
    *_, res = PassManager(assemble(list(passes))).run(gm, ctx)
    return gm, res


@pytest.mark.parametrize("model", [TwoWeights(), Merged(), Merged(spelling="slice")], ids=["two", "chunk", "slice"])
@pytest.mark.parametrize("rows", [(1, 1), (2, 4)])
def test_both_spellings_become_one_op(model, rows):
    model, x = model.to(torch.bfloat16), torch.randn(*rows, 64, dtype=torch.bfloat16)
    gm, res = _run(model, x, _shipped())
    counts = op_counts(gm)
    assert counts[OP] == 1 and counts["aten.linear.default"] == 1 and counts["aten.silu.default"] == 0, counts
    (node,) = [n for n in gm.graph.nodes if str(n.target) == OP]
    assert (node.args[2] is None) == isinstance(model, Merged)  # the merged weight is passed whole, no copy
    assert all(r.predicted_gain_s > 0 for r in res.rewrites)
    assert reference_check(model, gm, (x,)).passed


def test_two_weights_spend_no_weight_copy_where_merging_would():
    """Planned for the H200 with merge_sibling_linears after it: the gate and up weights the op reads
    are the model's own tensors and no concatenated copy is stored (merging them for cuBLAS would
    have added one)."""
    model, x = TwoWeights().to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    gm = capture(model.eval(), (x,))
    before = sum(t.numel() for t in [*gm.parameters(), *gm.buffers()])
    p = _shipped()
    ctx = PassContext(profile=p, cost=CostModel(p), hints=ir.shape_hints(gm))
    PassManager(assemble(["fuse_gemv_swiglu", "merge_sibling_linears", "fuse_swiglu"])).run(gm, ctx)
    (node,) = [n for n in gm.graph.nodes if str(n.target) == OP]
    gate, up = (ir.info(a) for a in node.args[1:3])
    assert tuple(gate.shape) == tuple(up.shape) == (96, 64)
    assert sum(t.numel() for t in [*gm.parameters(), *gm.buffers()]) <= before
    for arg, weight in zip(node.args[1:3], (model.gate.weight, model.up.weight)):
        assert arg.op == "get_attr" and torch.equal(functools.reduce(getattr, arg.target.split("."), gm), weight)


def test_refusals_say_why():
    p = _shipped()
    cases = [
        (TwoWeights(bias=True).to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16), "has a bias"),
        (TwoWeights(), torch.randn(1, 64), "fp16 or bf16"),
        (TwoWeights().to(torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16), "at most 16"),
        (Merged(spelling="swapped").to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16), "second half"),
    ]
    for model, x, why in cases:
        gm, res = _run(model, x, p)
        assert op_counts(gm)[OP] == 0 and res.rejected and all(why in r.reason for r in res.rejected), res.rejected


def test_a_silu_read_elsewhere_is_not_fused():
    class Tapped(TwoWeights):
        def forward(self, x):
            s = F.silu(self.gate(x))
            return self.down(s * self.up(x)), s

    model, x = Tapped().to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    gm, res = _run(model, x, _shipped())
    assert op_counts(gm)[OP] == 0 and any("also read elsewhere" in r.reason for r in res.rejected), res.rejected
    assert reference_check(model, gm, (x,)).passed


def test_unmeasured_or_cpu_profile_refuses():
    model, x = TwoWeights().to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    gm, res = _run(model, x, _shipped(measured=False))
    assert op_counts(gm)[OP] == 0 and all("not measured" in r.reason for r in res.rejected), res.rejected
    gm, res = _run(model, x, get_profile("cpu")[0])
    assert op_counts(gm)[OP] == 0 and {r.reason for r in res.rejected} == {NO_FUSED_KERNELS}


@pytest.mark.parametrize("h,n", [(4096, 14336), (4096, 13696)])
def test_decode_sized_mlps_are_priced_faster_on_the_shipped_profile(h, n):
    """Llama-3-8B's and GLM-4-9B's MLP at one token, on meta tensors: the H200's fits price one
    weight stream with the activation below cuBLAS's projections and the activation apart."""
    for model in (TwoWeights(h, n), Merged(h, n)):
        model = model.to(device="meta", dtype=torch.bfloat16)
        gm = capture(model.eval(), (torch.empty(1, h, dtype=torch.bfloat16, device="meta"),))
        p, _ = get_profile("h200")
        p = dataclasses.replace(p, launch_overhead_s=p.launch_overhead_graph_s)
        ctx = PassContext(profile=p, cost=CostModel(p), hints=ir.shape_hints(gm))
        *_, res = PassManager(assemble(["fuse_gemv_swiglu"])).run(gm, ctx)
        assert op_counts(gm)[OP] == 1, res.rejected
