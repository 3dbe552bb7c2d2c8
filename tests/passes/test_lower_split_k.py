"""lower_split_k: a small-M, long-K linear feeding add_layer_norm becomes graphopt::linear_add_layer_norm
where the cost model expects cuBLASLt to split K (H200 profile), and nowhere else."""
import pytest
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.cost.model import CostModel, cublas_split_k, split_k_slices
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts, reference_check

FUSED = "graphopt.linear_add_layer_norm.default"
ALN = "graphopt.add_layer_norm.default"
PASSES = ["fuse_layer_norm", "lower_split_k"]


class FFN(nn.Module):
    """BERT's FFN output block: up, GELU, down (K = 4 H), residual add, LayerNorm."""

    def __init__(self, h=256, reread=False):
        super().__init__()
        self.up, self.down, self.ln = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.LayerNorm(h, eps=1e-12)
        self.reread = reread
        with torch.no_grad():
            self.ln.weight.normal_(1, 0.1)
            self.ln.bias.normal_(0, 0.1)

    def forward(self, x):
        y = self.down(nn.functional.gelu(self.up(x)))
        out = self.ln(y + x)
        return out + y if self.reread else out


def _run(m, x, passes=PASSES, target="h200"):
    gm = capture(m, (x,))
    results = run_passes(gm, passes, target=target)
    return gm, results[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_down_projection_is_split(dtype):
    m, x = FFN().eval().to(dtype), torch.randn(1, 64, 256, dtype=dtype)
    gm, res = _run(m, x)
    c = op_counts(gm)
    assert c[FUSED] == 1 and c[ALN] == 0 and c["aten.linear.default"] == 1  # the up projection stays
    (node,) = [n for n in gm.graph.nodes if str(n.target) == FUSED]
    assert node.args[-1] == 4  # K = 1024: 4 slices of 256 (8 would be 128 deep)
    (rw,) = res.rewrites
    assert rw.predicted_gain_s > 0 and "4 K slices" in rw.pattern
    assert reference_check(m, gm, (x,)).passed


def test_h_output_kept_for_a_pre_norm_stack():
    """ViT-style: the sum is the residual stream, read after the norm -> the op's h output."""
    class Pre(nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = FFN()

        def forward(self, x):
            h = self.ffn.down(nn.functional.gelu(self.ffn.up(x))) + x
            return self.ffn.ln(h) * 2 + h

    m, x = Pre().eval(), torch.randn(1, 64, 256)
    gm, _ = _run(m, x)
    assert op_counts(gm)[FUSED] == 1
    assert reference_check(m, gm, (x,)).passed


def test_not_split_where_the_projection_is_read_elsewhere():
    m, x = FFN(reread=True).eval(), torch.randn(1, 64, 256)
    gm, res = _run(m, x)
    assert op_counts(gm)[FUSED] == 0
    assert any("also read elsewhere" in r.reason for r in res.rejected)


def test_refused_for_symbolic_shapes():
    m, x = FFN().eval(), torch.randn(1, 64, 256)
    gm = capture(m, (x,), dynamic={"x": {1: "seq"}})
    (_, res) = run_passes(gm, PASSES, target="h200")
    assert op_counts(gm)[FUSED] == 0
    assert any("symbolic shapes" in r.reason for r in res.rejected), res.rejected


def test_refused_where_cublas_would_not_split():
    """1024 rows (BERT bs8-sized): cuBLAS fills the GPU without split-K, so there is no reduction
    kernel to remove and the partials only add bytes."""
    m, x = FFN().eval(), torch.randn(8, 128, 256)
    gm, res = _run(m, x)
    assert op_counts(gm)[FUSED] == 0
    assert any("without split-K" in r.reason for r in res.rejected), res.rejected


def test_refused_on_a_cpu_profile():
    m, x = FFN().eval(), torch.randn(1, 64, 256)
    gm, _ = _run(m, x, passes=["fuse_layer_norm"])  # the residual norm as an H200 plan has it
    (res,) = run_passes(gm, ["lower_split_k"], target="cpu")
    assert op_counts(gm)[FUSED] == 0 and op_counts(gm)[ALN] == 1
    assert any(NO_FUSED_KERNELS in r.reason for r in res.rejected)


def test_split_k_rule_matches_what_the_h200_ran():
    """diag_splitk / diag_busy on the H200: split-K only for BERT-base bs1's FFN down projection."""
    p = get_profile("h200")[0]
    assert cublas_split_k(p, 128, 768, 3072)          # BERT-base bs1 FFN down: split
    assert not cublas_split_k(p, 128, 768, 768)       # its attention output projection
    assert not cublas_split_k(p, 128, 3072, 768)      # its up projection
    assert not cublas_split_k(p, 128, 2304, 768)      # its QKV projection
    assert not cublas_split_k(p, 197, 768, 3072)      # ViT-B/16 bs1 FFN down
    assert not cublas_split_k(p, 1024, 768, 3072)     # BERT-base bs8 FFN down
    assert not cublas_split_k(get_profile("cpu")[0], 128, 768, 3072)
    assert split_k_slices(p, 128, 768, 3072) == 6     # the fastest of 2-8 slices measured
    assert split_k_slices(p, 4096, 4096, 4096) == 1   # already more tiles than SMs


def test_cost_model_prices_the_reduction_kernel():
    """The same linear costs one more launch and the reduction's bytes where cuBLAS splits K."""
    p = get_profile("h200")[0]
    cm = CostModel(p)

    def linear_node(M):
        m = nn.Linear(3072, 768).to(torch.bfloat16)
        gm = capture(m, (torch.randn(1, M, 3072, dtype=torch.bfloat16),))
        return next(n for n in gm.graph.nodes if str(n.target) == "aten.linear.default")

    split, plain = cm.node_cost(linear_node(128)), cm.node_cost(linear_node(197))
    assert split.launches == 2 and plain.launches == 1
    assert split.time_s > plain.time_s * 128 / 197 + p.kernel_fixed_s * 0.9


@pytest.mark.cuda
def test_bert_base_bs1_on_the_gpu():
    """BERT-base at bs1 on the GPU: every FFN down projection (128 x 768 x 3072) takes the split
    path, the optimized model passes the fp64 accuracy rule and matches itself replayed."""
    import graphopt
    from graphopt.examples import zoo

    model, inputs = zoo.get("bert-base", batch=1, dtype=torch.bfloat16, device="cuda")
    opt = graphopt.optimize(model, inputs)
    assert op_counts(opt.graph_module)[FUSED] == 12
    assert opt.report.accuracy["passed"], opt.report.accuracy
    with torch.inference_mode():
        a, b = opt(*inputs), opt(*inputs)
    torch.testing.assert_close(a.last_hidden_state, b.last_hidden_state, rtol=0, atol=0)
