"""lower_gemm_swiglu: a merged gate/up linear feeding graphopt::swiglu becomes graphopt::gemm_swiglu
(one Triton GEMM with the activation in its epilogue) on an sm_90+ profile where the cost model
expects a gain, and nowhere else."""
import pytest
import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.cost.profiles import get_profile
from graphopt.cuda_ext.ops.gemm_swiglu import persistent_rounds_factor
from graphopt.pipeline import NO_FUSED_KERNELS, available, run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.gemm_swiglu.default"
PASSES = ["merge_sibling_linears", "fuse_swiglu", "lower_gemm_swiglu"]


class MLP(nn.Module):
    """GLM-4's spelling (one gate_up linear, chunk) or Llama's (gate_proj, up_proj)."""

    def __init__(self, h=256, f=1024, merged=True, bias=False, reread=False):
        super().__init__()
        self.merged, self.reread = merged, reread
        if merged:
            self.gate_up = nn.Linear(h, 2 * f, bias=bias)
        else:
            self.gate, self.up = nn.Linear(h, f, bias=bias), nn.Linear(h, f, bias=bias)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        if self.merged:
            gu = self.gate_up(x)
            g, u = gu.chunk(2, -1)
        else:
            g, u = self.gate(x), self.up(x)
        y = self.down(nn.functional.silu(g) * u)
        return (y, gu) if self.reread else y


def _run(m, x, passes=PASSES, target="h200"):
    gm = capture(m, (x,))
    return gm, run_passes(gm, passes, target=target)[-1]


def _run_budget(m, x, limit, profile=None):
    """The passes with a weight-copy budget of ``limit`` bytes (None: unlimited)."""
    import dataclasses

    from graphopt.cost.model import CostModel
    from graphopt.pipeline import PassContext, PassManager, assemble
    from graphopt.setup_memory import ConstantAccount

    gm = capture(m, (x,))
    profile = profile or get_profile("h200")[0]
    ctx = PassContext(profile=profile, cost=CostModel(profile), hints=ir.shape_hints(gm),
                      constants=ConstantAccount(limit=limit, setting="test"))
    res = PassManager(assemble(PASSES)).run(gm, ctx)[-1]
    return gm, res


@pytest.mark.parametrize("merged", [True, False])
def test_interleaved_copy_where_the_budget_allows(merged):
    """With room for a copy the weight's gate and up rows are reordered once (block 128), the
    faster kernel: GLM-4's gate_up weight and Llama's merged siblings alike. (1024 tokens: predicted
    5.3 us faster on the H200, 14.6 us at 8192; the fp64 check is an eighth of 8192's.)"""
    m, x = MLP(merged=merged).eval().bfloat16(), torch.randn(2, 512, 256).bfloat16()
    gm, res = _run_budget(m, x, None)
    c = op_counts(gm)
    assert c[FUSED] == 1 and c["graphopt.swiglu.default"] == 0 and c["aten.linear.default"] == 1  # down stays
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert node.args[2:] == (1024, 128)
    w = ir.get_attr_value(gm, node.args[1].target)
    assert w.shape == (2048, 256) and w is not (m.gate_up.weight if merged else m.up.weight)
    (rw,) = res.rewrites
    assert rw.predicted_gain_s > 0 and "1024 x 256 x 2048" in rw.pattern
    assert reference_check(m, gm, (x,)).passed


def test_without_room_for_a_copy_the_halves_layout_is_priced_at_its_measured_rate():
    """No room for the copy: the fallback reads cat([Wg, Wu]) as it is (block 0); on the H200 its
    measured rate (op_efficiency gemm_swiglu_halves) makes it slower than cuBLAS + swiglu, so the
    pair stays, with both reasons in one line; on a profile without that measurement the fallback
    is applied on the model's own weight."""
    import dataclasses

    with torch.device("meta"):
        glm = MLP(4096, 13696).eval().bfloat16()  # GLM-4-9B's MLP at bs8
    gm, res = _run_budget(glm.to_empty(device="cpu"), torch.zeros(8, 1024, 4096, dtype=torch.bfloat16), 0)
    assert op_counts(gm)[FUSED] == 0
    (why,) = [r.reason for r in res.rejected]
    assert "would copy" in why and "without the copy predicted no gain" in why
    h200 = get_profile("h200")[0]
    unmeasured = dataclasses.replace(h200, op_efficiency={k: v for k, v in h200.op_efficiency.items()
                                                          if k != "gemm_swiglu_halves"})
    m, x = MLP(merged=True).eval().bfloat16(), torch.randn(2, 512, 256).bfloat16()
    gm, res = _run_budget(m, x, 0, unmeasured)
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert node.args[2:] == (1024, 0) and ir.get_attr_value(gm, node.args[1].target) is m.gate_up.weight
    assert not [name for name, _ in gm.named_buffers() if name.startswith("_graphopt_")]
    assert reference_check(m, gm, (x,)).passed


def _reasons(m, x, target="h200"):
    gm, res = _run(m, x, target=target)
    assert op_counts(gm)[FUSED] == 0
    return " | ".join(r.reason for r in res.rejected)


def test_refusals_say_why():
    x = torch.randn(8, 1024, 256).bfloat16()
    assert "has a bias" in _reasons(MLP(bias=True).eval().bfloat16(), x)
    assert "also read elsewhere" in _reasons(MLP(reread=True).eval().bfloat16(), x)
    assert "dtypes torch.float32" in _reasons(MLP().eval(), x.float())
    assert "sm_80" in _reasons(MLP().eval().bfloat16(), x, target="a100")
    gm = capture(MLP().eval().bfloat16(), (x,))
    run_passes(gm, PASSES[:2], target="h200")
    (res,) = run_passes(gm, PASSES[2:], target="cpu")
    assert op_counts(gm)[FUSED] == 0 and NO_FUSED_KERNELS in res.rejected[0].reason


def test_symbolic_shapes_refused():
    m, x = MLP().eval().bfloat16(), torch.randn(8, 1024, 256).bfloat16()
    gm = capture(m, (x,), dynamic={"x": {1: "seq"}})
    res = run_passes(gm, PASSES, target="h200")[-1]
    assert op_counts(gm)[FUSED] == 0 and any("symbolic" in r.reason for r in res.rejected)


def test_rounds_factor_at_glm_shapes():
    """GLM-4-9B's gate/up GEMM (27392 rows, 107 blocks of 128 per half): 8192 tokens fill 51.9
    rounds of 132 SMs, 1024 tokens 6.5; the H200 ran the fused GEMM 0.99x and 1.08x cuBLAS's time."""
    p, _ = get_profile("h200")
    assert persistent_rounds_factor(p, 8192, 27392) == pytest.approx(1.0023, abs=1e-4)
    assert persistent_rounds_factor(p, 1024, 27392) == pytest.approx(1.0794, abs=1e-4)
    assert persistent_rounds_factor(p, 1, 256) == 132.0
    assert persistent_rounds_factor(get_profile("cpu")[0], 8192, 27392) == 1.0


@pytest.mark.parametrize("tokens,applied", [(8192, True), (1024, False)])
def test_glm_shaped_mlp_priced_as_measured(tokens, applied):
    """At GLM-4-9B's shape the pass fuses bs8 (8192 tokens: the swiglu kernel's 0.16 ms outweighs
    the last round) and leaves bs1 (1024: the measured burst times tied) on cuBLAS."""
    with torch.device("meta"):
        m = MLP(4096, 13696).eval().bfloat16()
    m = m.to_empty(device="cpu")
    gm, res = _run(m, torch.zeros(tokens // 1024, 1024, 4096, dtype=torch.bfloat16))
    assert (op_counts(gm)[FUSED] == 1) is applied
    if not applied:
        assert any("predicted no gain" in r.reason for r in res.rejected)


def test_glm4_tiny_every_layer_fused():
    from graphopt.examples import zoo

    model, (ids,) = zoo.get("glm4-tiny", batch=16, seq_len=128)  # (both layers fused from batch 8 on)
    model = model.to(torch.bfloat16)
    gm = capture(model, (ids,))
    res = run_passes(gm, available(), target="h200")
    assert op_counts(gm)[FUSED] == 2  # both layers
    assert any(r.name == "lower_gemm_swiglu" and r.status == "applied" for r in res)
    assert reference_check(model, gm, (ids,)).passed
