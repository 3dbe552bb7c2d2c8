"""lower_gemv: a projection of at most 16 rows -> graphopt::gemv, only where the profile's measured
efficiencies say the Triton GEMV beats cuBLAS (the op's reference runs here on the CPU)."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import NO_FUSED_KERNELS, PassContext, PassManager, assemble
from graphopt import ir
from tests.helpers import op_counts, reference_check

GEMV = "graphopt.gemv.default"


class MLP(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.up = nn.Linear(64, 96, bias=bias)
        self.down = nn.Linear(96, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _profile(gemv=None, cublas=None):
    """The H200's profile under CUDA-graph launch costs with the two fits set (None: unmeasured)."""
    p, _ = get_profile("h200")
    p = dataclasses.replace(p, launch_overhead_s=p.launch_overhead_graph_s)
    p = p.with_efficiency("gemv", None).with_efficiency("small_m_linear", None)
    if gemv is not None:
        p = p.with_efficiency("gemv", gemv)
    if cublas is not None:
        p = p.with_efficiency("small_m_linear", cublas)
    return p


def _run(model, x, profile, passes=("lower_gemv",)):
    gm = capture(model.eval(), (x,))
    ctx = PassContext(profile=profile, cost=CostModel(profile), hints=ir.shape_hints(gm))
    *_, res = PassManager(assemble(list(passes))).run(gm, ctx)
    return gm, res


@pytest.mark.parametrize("rows", [(1, 1), (2, 4)])
def test_lowers_where_measured_faster(rows):
    model, x = MLP().to(torch.bfloat16), torch.randn(*rows, 64, dtype=torch.bfloat16)
    faster = _profile(gemv={"memory_scale": 0.95, "fixed_s": 2e-6}, cublas={"memory_scale": 0.8, "fixed_s": 4e-6})
    gm, res = _run(model, x, faster)
    assert op_counts(gm)[GEMV] == 2 and op_counts(gm)["aten.linear.default"] == 0
    assert all(r.predicted_gain_s > 0 for r in res.rewrites)
    assert reference_check(model, gm, (x,)).passed


def test_keeps_cublas_when_it_measured_faster_or_gemv_is_not_measured():
    model, x = MLP().to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    slower = _profile(gemv={"memory_scale": 0.7, "fixed_s": 6e-6}, cublas={"memory_scale": 0.9, "fixed_s": 2e-6})
    gm, res = _run(model, x, slower)
    assert op_counts(gm)[GEMV] == 0 and all("against cuBLAS" in r.reason for r in res.rejected), res.rejected
    for unmeasured in (_profile(), _profile(cublas={"memory_scale": 0.5, "fixed_s": 2e-5})):
        gm, res = _run(model, x, unmeasured)  # priced as cuBLAS plus its partial sums: never chosen
        assert op_counts(gm)[GEMV] == 0 and all("against cuBLAS" in r.reason for r in res.rejected), res.rejected


def test_refuses_fp32_and_ignores_many_rows():
    faster = _profile(gemv={"memory_scale": 0.95, "fixed_s": 2e-6}, cublas={"memory_scale": 0.8, "fixed_s": 4e-6})
    gm, res = _run(MLP(), torch.randn(1, 64), faster)
    assert op_counts(gm)[GEMV] == 0 and all("fp16 or bf16" in r.reason for r in res.rejected)
    gm, res = _run(MLP().to(torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16), faster)
    assert op_counts(gm)[GEMV] == 0 and not res.rejected  # 32 rows: not a candidate at all


def test_cpu_profile_refuses():
    p, _ = get_profile("cpu")
    gm, res = _run(MLP().to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16), p)
    assert op_counts(gm)[GEMV] == 0 and {r.reason for r in res.rejected} == {NO_FUSED_KERNELS}


def test_small_m_linear_entry_prices_cublas_at_its_measured_rate():
    import torch.fx as fx

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"] = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
    w.meta["val"] = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    n = g.call_function(torch.ops.aten.linear.default, (x, w))
    n.meta["val"] = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
    plain = CostModel(_profile()).node_cost(n).time_s
    measured = CostModel(_profile(cublas={"memory_scale": 0.5, "fixed_s": 1e-5})).node_cost(n).time_s
    nbytes = (4096 * 4096 + 2 * 4096) * 2
    assert measured == pytest.approx(nbytes / (_profile().bandwidth * 0.5) + 1e-5)
    assert measured > plain


FUSED = "graphopt.gemv_add_rms_norm.default"


def _shipped(small_weights=False):
    """The shipped H200 profile under CUDA-graph launch costs; ``small_weights``: its gemv fit taken
    to cover this file's small test weights too (it was measured on 32 MB and up)."""
    p, _ = get_profile("h200")
    p = dataclasses.replace(p, launch_overhead_s=p.launch_overhead_graph_s)
    if small_weights:
        p = p.with_efficiency("gemv", {k: v for k, v in p.op_efficiency["gemv"].items() if k != "min_bytes"})
    return p


@pytest.mark.parametrize("rows", [(1, 1), (2, 4)])
def test_the_norm_after_a_projection_rides_on_the_gemv(rows):
    from tests.passes.test_fuse_rms_norm import Decoder

    model, x = Decoder(64).to(torch.bfloat16), torch.randn(*rows, 64, dtype=torch.bfloat16)
    gm, res = _run(model, x, _shipped(small_weights=True), passes=("fuse_rms_norm", "lower_gemv"))
    counts = op_counts(gm)
    # both projections feed a residual add + RMSNorm: each becomes one op (the first norm reads the input)
    assert counts[FUSED] == 2 and counts["graphopt.add_rms_norm.default"] == 1 and counts[GEMV] == 0, counts
    assert all(r.predicted_gain_s > 0 for r in res.rewrites) and len(res.rewrites) == 2
    assert reference_check(model, gm, (x,)).passed


@pytest.mark.parametrize("rows", [(1, 1), (2, 4)])
def test_a_sandwich_norm_after_a_projection_rides_on_the_gemv(rows):
    """GLM-4's sublayer: the projection's own norm, the residual add and the next norm -> one op."""
    from tests.passes.test_fuse_rms_norm import SANDWICH, Sandwich

    model, x = Sandwich(64).to(torch.bfloat16), torch.randn(*rows, 64, dtype=torch.bfloat16)
    gm, res = _run(model, x, _shipped(small_weights=True), passes=("fuse_rms_norm", "lower_gemv"))
    counts = op_counts(gm)
    assert counts[FUSED] == 1 and counts[SANDWICH] == 0 and counts["aten.linear.default"] == 0, counts
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert len(node.args) == 8 and node.args[7] == 1e-6 and node.args[5] == 1e-5  # the post norm goes first
    assert [r.pattern for r in res.rewrites] == ["linear %dx64x64 + rms_norm_add_rms_norm -> gemv_add_rms_norm"
                                                 % (rows[0] * rows[1])]
    assert reference_check(model, gm, (x,)).passed


def test_the_norm_stays_apart_when_the_projection_is_read_elsewhere():
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            from tests.passes.test_fuse_rms_norm import HFRMSNorm

            self.lin, self.norm = nn.Linear(64, 64, bias=False), HFRMSNorm(64)

        def forward(self, x):
            y = self.lin(x)
            h = x + y
            return self.norm(h), h, y * 2  # y read twice: the fused op does not return it

    model, x = TwoReaders().to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    gm, _ = _run(model, x, _shipped(small_weights=True), passes=("fuse_rms_norm", "lower_gemv"))
    assert op_counts(gm)[FUSED] == 0 and op_counts(gm)["graphopt.add_rms_norm.default"] == 1
    assert reference_check(model, gm, (x,)).passed


def test_a_plain_projection_within_the_fits_error_stays_on_cublas():
    # Llama-3-8B's merged gate/up projection at one token: the two fits price it within a few percent
    # (both measure 56 us on the H200); its o projection is lowered (10.6 against cuBLAS's 12.5 us)
    model, x = nn.Linear(4096, 28672, bias=False).to(torch.bfloat16), torch.randn(1, 4096, dtype=torch.bfloat16)
    gm, res = _run(model, x, _shipped())
    assert op_counts(gm)[GEMV] == 0 and all("not 5% faster" in r.reason for r in res.rejected), res.rejected
    model = nn.Linear(4096, 4096, bias=False).to(torch.bfloat16)
    gm, res = _run(model, x, _shipped())
    assert op_counts(gm)[GEMV] == 1


def test_unmeasured_gemv_keeps_the_norm_apart():
    from tests.passes.test_fuse_rms_norm import Decoder

    model, x = Decoder(64).to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    gm, res = _run(model, x, _profile(), passes=("fuse_rms_norm", "lower_gemv"))
    assert op_counts(gm)[FUSED] == 0 and op_counts(gm)[GEMV] == 0
    assert any("graphopt::gemv is not measured" in r.reason for r in res.rejected), res.rejected


def test_weights_smaller_than_the_fit_measured_are_not_lowered_on_a_guess():
    from tests.passes.test_fuse_rms_norm import Decoder

    model, x = Decoder(64).to(torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    p = _shipped()
    p = p.with_efficiency("gemv", {**p.op_efficiency["gemv"], "min_bytes": 64 * 64 * 2 + 1})
    gm, res = _run(model, x, p, passes=("fuse_rms_norm", "lower_gemv"))
    assert op_counts(gm)[FUSED] == 0 and op_counts(gm)[GEMV] == 0
    assert res.rejected and all("below the sizes graphopt::gemv was measured at" in r.reason for r in res.rejected)
