"""The activation memory model (graphopt/cost/activations.py) against autograd itself."""

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt.capture import capture
from graphopt.cost.activations import ActivationModel, parse_memory_budget, probe_saved, resolve_budget
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.errors import GraphoptError
from graphopt.examples import zoo


def hooks_saved_bytes(model, args):
    """Bytes of the distinct storages autograd saves during a real forward (parameters,
    buffers and inputs excluded), counted with saved_tensors_hooks."""
    skip = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    skip |= {x.untyped_storage()._cdata for x in args if isinstance(x, torch.Tensor)}
    seen = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            seen[key] = (t.untyped_storage().nbytes(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(v[0] for v in seen.values())


def _small_resnet():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10), (torch.randn(2, 3, 32, 32),)


@pytest.mark.parametrize("name", ["resnet18", "bert-tiny", "vit-tiny", "glm4-tiny"])
def test_predicted_saved_bytes_match_saved_tensor_hooks(name):
    model, args = _small_resnet() if name == "resnet18" else zoo.get(name)
    model.train()
    gm = capture(model, args)
    am = ActivationModel.build(gm)
    predicted = am.baseline_saved_bytes()
    with torch.random.fork_rng():
        measured = hooks_saved_bytes(model, args)
    assert measured > 0
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


class Shared(nn.Module):
    """relu's output is saved by relu itself, and views of it by two matmuls: one storage."""

    def __init__(self):
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(8, 8))
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        y = torch.relu(x @ self.w0)
        a = y.view(8, 8) @ self.w
        b = y.t() @ self.w.t()
        return a.sum() + b.sum()


def test_views_of_a_saved_tensor_count_once_and_parameters_are_not_activations():
    m = Shared()
    x = torch.randn(8, 8)
    gm = capture(m, (x,))
    am = ActivationModel.build(gm)
    relu = next(n for n in am.body if "relu" in str(n.target))
    savers = [n for n in am.body if relu in am.saved[n]]
    assert len(savers) >= 2  # relu (its output) and the matmuls (views of it)
    assert am.baseline_saved_bytes() == pytest.approx(8 * 8 * 4)  # one fp32 8x8 storage
    assert am.baseline_saved_bytes() == pytest.approx(hooks_saved_bytes(m, (x,)))
    rec = probe_saved(gm).records
    assert any(r.saved_inputs for r in rec.values())  # the weight is saved, but not counted
    assert am.param_bytes == 2 * 8 * 8 * 4 and am.grad_param_bytes == 2 * 8 * 8 * 4


def test_ops_that_make_what_they_save_have_extras():
    m = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    gm = capture(m, (torch.randn(8, 16),))
    am = ActivationModel.build(gm)
    drop = next(n for n in am.body if "dropout" in str(n.target))
    assert am.extra[drop] > 0  # the mask / scaled noise
    assert am.baseline_saved_bytes() == pytest.approx(hooks_saved_bytes(m, (torch.randn(8, 16),)))


def test_symbolic_batch_gives_sympy_sizes():
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).train()
    gm = capture(m, (torch.randn(8, 16),), dynamic={"input": {0: "batch"}})
    probe = probe_saved(gm)
    sizes = list(probe.root_bytes.values())
    assert any(isinstance(s, sympy.Expr) and s.free_symbols for s in sizes)
    am = ActivationModel.build(gm)  # evaluated with the example batch
    assert am.baseline_saved_bytes() == pytest.approx(hooks_saved_bytes(m, (torch.randn(8, 16),)))


class Attn(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q.relu(), k.relu(), v.relu(), is_causal=True)


def test_attention_is_read_with_cuda_kernels_when_planning_for_a_gpu():
    q = torch.randn(2, 4, 64, 16)
    gm = capture(Attn(), (q, q.clone(), q.clone()))
    prof, _ = get_profile("h200")
    am = ActivationModel.build(gm, CostModel(prof), device_kind="cuda")
    sdpa = next(n for n in am.body if "scaled_dot_product" in str(n.target))
    assert am.extra[sdpa] == 2 * 4 * 64 * 4  # float32 logsumexp per query row
    assert sdpa in am.saved[sdpa]  # flash/efficient backward reads the output
    assert all(am.seconds[n] >= 0 for n in am.body) and am.seconds[sdpa] > 0


@pytest.mark.parametrize("value,expected", [
    (0.4, 0.4), ("0.4", 0.4), (1, 1.0), ("8GB", 8_000_000_000), ("512MB", 512_000_000),
    ("2GiB", 2 * 2**30), (3_000_000, 3_000_000), ("1e9", 1_000_000_000), (2.5e9, 2_500_000_000),
])
def test_parse_memory_budget(value, expected):
    assert parse_memory_budget(value) == expected


@pytest.mark.parametrize("value", ["abc", "-1", 0, -0.5, "GB", "0.5XB", True, float("nan"), None, [1],
                                   2.0, "1.5", 10, 1e4 + 0.5])  # (a mistyped fraction, not a few bytes)
def test_bad_memory_budget_is_a_one_line_error(value):
    with pytest.raises(GraphoptError) as e:
        parse_memory_budget(value)
    assert "\n" not in str(e.value)


def test_fraction_budget_applies_to_the_baseline():
    assert resolve_budget(0.25, 1000.0) == 250.0
    assert resolve_budget("1kB", 10.0) == 1000.0
