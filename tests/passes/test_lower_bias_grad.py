import copy

import pytest
import torch
import torch.nn as nn

from graphopt import accuracy, capture
from graphopt.cost.profiles import get_profile
from graphopt.pipeline import NO_FUSED_KERNELS, run_passes
from tests.helpers import op_counts

OURS = "graphopt.biased_linear.default"


class Mlp(nn.Module):
    """BERT's FFN: two biased linears, GELU between (3-D input)."""

    def __init__(self, h=32, frozen_bias=False):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        if frozen_bias:
            self.up.bias.requires_grad_(False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Conv1D(nn.Module):
    """GPT-2's projection: addmm(bias, x rows, weight [in, out])."""

    def __init__(self, nx=32, nf=384):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) * 0.1), nn.Parameter(torch.randn(nf))

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1).relu()


def _profile(aten_scale, ours_scale=0.8):
    """The H200 profile with aten's reduction's rate and the one-row matmul's (``ones @ g``, priced
    by ``small_m_linear``) set; None: aten's at the copy rate, the matmul as any matmul."""
    p = get_profile("h200")[0]
    p = p.with_efficiency("bias_grad_sum", None if aten_scale is None else {"memory_scale": aten_scale})
    return p.with_efficiency("small_m_linear", None if ours_scale is None else {"memory_scale": ours_scale})


def _grads(fn, module, x):
    module.zero_grad(set_to_none=True)
    out = fn(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(out.dtype))
    return [out.detach()] + [p.grad for _, p in sorted(module.named_parameters()) if p.grad is not None]


@pytest.mark.parametrize("cls,n", [(Mlp, 2), (Conv1D, 1)])
def test_applied_where_aten_reduction_is_slow_and_gradients_pass(cls, n):
    """Planned for a profile where aten's bias reduction runs at a twentieth of the copy rate: every
    biased linear becomes biased_linear; the output and every gradient pass the accuracy rule
    against the model's fp64 step (the references run here on the CPU)."""
    m, x = cls(128).train(), torch.randn(8, 256, 128)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_bias_grad"], target=_profile(0.05), training=True)
    assert res.status == "applied" and op_counts(gm)[OURS] == n
    assert all(r.predicted_gain_s > 0 for r in res.rewrites)
    m64 = copy.deepcopy(m).double()
    ours, eager, gold = _grads(gm, gm, x), _grads(m, m, x), _grads(m64, m64, x.double())
    assert len(ours) == len(gold)
    check = accuracy.check(ours, gold, eager, training=True)
    assert check.passed, check.reason


def test_decision_follows_the_measured_rates():
    m, x = Mlp(768).train(), torch.randn(16, 512, 768)

    def gain(profile):
        (res,) = run_passes(capture(m, (x,)), ["lower_bias_grad"], target=profile, training=True)
        return sum(r.predicted_gain_s for r in res.rewrites), res

    slow, _ = gain(_profile(0.25))
    slower, _ = gain(_profile(0.2))
    assert 0 < slow < slower
    level, res = gain(_profile(None, None))  # both at the copy rate: nothing to gain
    assert level == 0 and len(res.rejected) == 2 and all("predicted no gain" in r.reason for r in res.rejected)


def test_not_in_inference_nor_for_frozen_bias_nor_on_cpu():
    m, x = Mlp(128, frozen_bias=True).train(), torch.randn(8, 256, 128)
    gm = capture(m, (x,))
    (res,) = run_passes(gm, ["lower_bias_grad"], target=_profile(0.05), training=True)
    assert op_counts(gm)[OURS] == 1  # the down projection; the frozen bias takes no gradient
    gm = capture(m.eval(), (x,))
    (res,) = run_passes(gm, ["lower_bias_grad"], target=_profile(0.05))
    assert res.status == "unchanged" and not res.rejected and op_counts(gm)[OURS] == 0
    gm = capture(m.train(), (x,))
    (res,) = run_passes(gm, ["lower_bias_grad"], target="cpu", training=True)
    assert op_counts(gm)[OURS] == 0 and res.rejected and all(r.reason == NO_FUSED_KERNELS for r in res.rejected)


def test_refused_where_the_step_runs_eagerly():
    """Without CUDA-graph replay (cuda_graphs=False; a graph writing a buffer) the op's Python autograd
    would make the step host-bound: every candidate is refused, with the reason."""
    import dataclasses

    from graphopt.cost.model import CostModel
    from graphopt.pipeline import PASS_DEFAULTS, PassContext, PassManager, assemble

    m, x = Mlp(128).train(), torch.randn(8, 256, 128)
    gm = capture(m, (x,))
    ctx = PassContext(cost=CostModel(_profile(0.05)), training=True,
                      options=dataclasses.replace(PASS_DEFAULTS, cuda_graphs=False))
    (res,) = PassManager(assemble(["lower_bias_grad"])).run(gm, ctx)
    assert op_counts(gm)[OURS] == 0 and len(res.rejected) == 2
    assert all("runs eagerly (disabled (cuda_graphs=False))" in r.reason for r in res.rejected)
    bn = nn.Sequential(nn.Linear(128, 128), nn.BatchNorm1d(128)).train()
    gm = capture(bn, (torch.randn(512, 128),))
    (res,) = run_passes(gm, ["lower_bias_grad"], target=_profile(0.05), training=True)
    assert op_counts(gm)[OURS] == 0 and all("writes" in r.reason for r in res.rejected)
