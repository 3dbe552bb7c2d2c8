"""eliminate_common_subexpressions: pure nodes computing the same op on the same arguments (no write
into those arguments' memory in between, no later write into the value) are computed once."""
import copy

import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.examples import decoders
from graphopt.pipeline import run_passes
from tests.helpers import op_counts

PASS = "eliminate_common_subexpressions"


def _run(model, args):
    gm = capture(model, copy.deepcopy(args))
    before = op_counts(gm)
    *_, res = run_passes(gm, [PASS])
    ir.check_invariants(gm)
    return gm, res, before


class Repeated(nn.Module):
    """The same slice-and-repeat of a shared input in each of three 'layers' (GLM-4's partial rotary)."""

    def forward(self, x, cos):
        for _ in range(3):
            c = cos[..., :4].repeat_interleave(2, dim=-1)
            x = x * c + 1
        return x


def test_per_layer_recomputation_is_computed_once():
    args = (torch.randn(2, 8), torch.randn(2, 8))
    model = Repeated()
    gm, res, before = _run(model, args)
    after = op_counts(gm)
    assert before["aten.repeat_interleave.self_int"] == 3 and after["aten.repeat_interleave.self_int"] == 1
    assert after["aten.slice.Tensor"] == 1 and after["aten.mul.Tensor"] == 3  # x differs in each layer
    assert len(res.rewrites) == 4  # two slices, two repeats
    torch.testing.assert_close(gm(*copy.deepcopy(args)), model(*args), rtol=0, atol=0)


def _written(b, x):
    aten = torch.ops.aten
    s1 = aten.sin.default(b)
    aten.add_.Tensor(b, 1)
    s2 = aten.sin.default(b)       # the same op on the same node after a write into it: another value
    c1 = aten.clone.default(x)
    c2 = aten.clone.default(x)     # equal to c1 when computed, then written in place: must stay apart
    aten.mul_.Tensor(c2, 3)
    return s1 + s2 + c1 + c2


def test_reads_across_an_in_place_write_and_written_values_stay_apart():
    """A graph with in-place writes left in it (as capture leaves them on inputs and buffers)."""
    import torch.fx as fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(_written)
    args = (torch.randn(4), torch.randn(4))
    FakeTensorProp(gm).propagate(*copy.deepcopy(args))
    before = op_counts(gm)
    *_, res = run_passes(gm, [PASS])
    after = op_counts(gm)
    assert after["aten.sin.default"] == 2 and after["aten.clone.default"] == before["aten.clone.default"] == 2
    assert not res.rewrites
    mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
    torch.testing.assert_close(gm(*mine), _written(*theirs), rtol=0, atol=0)


class Random(nn.Module):
    def forward(self, x):
        return torch.rand_like(x) + torch.rand_like(x)


def test_random_ops_are_not_merged():
    gm, res, _ = _run(Random(), (torch.randn(8),))
    assert op_counts(gm)["aten.rand_like.default"] == 2 and not res.rewrites


def test_glm_decode_step_computes_the_rotary_tables_once():
    """A GLM-4 decode step with a static cache: the per-layer repeat of cos and sin is computed
    once for the graph, the cache writes are untouched and the logits equal the captured graph's."""
    from transformers import StaticCache

    cfg = decoders.tiny_config("glm4", layers=3)
    model = decoders.build(cfg, seed=0)
    arg = decoders.cache_arg(model)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(3, 200, (1, 4)), use_cache=True, **{arg: cache})
    inputs = {"input_ids": torch.randint(3, 200, (1, 1)), arg: cache, "use_cache": True}
    gm = capture(model, copy.deepcopy(inputs))
    ref = copy.deepcopy(gm)
    captured = ir.mutation_signature(gm)
    before = op_counts(gm)["aten.repeat_interleave.self_int"]
    *_, res = run_passes(gm, [PASS])
    assert before == 2 * 3 and op_counts(gm)["aten.repeat_interleave.self_int"] == 2, res.rewrites
    assert ir.mutation_signature(gm) == captured
    mine, theirs = copy.deepcopy(inputs), copy.deepcopy(inputs)
    with torch.no_grad():
        out, want = gm(**mine), ref(**theirs)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    for a, b in zip(mine[arg].layers, theirs[arg].layers):  # the cache writes happened alike
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
