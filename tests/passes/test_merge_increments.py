"""merge_increments: a static cache's per-layer position increments (add_ on 0-dim integer inputs,
each their last access) -> one _foreach_add_ at the end of the graph (CUDA profiles)."""
import copy

import pytest
import torch
import torch.nn as nn

from graphopt import capture, ir
from graphopt.examples import decoders
from graphopt.pipeline import run_passes
from tests.helpers import op_counts

MERGED = "aten._foreach_add_.Scalar"


class Counters(nn.Module):
    """Three counters, each read (a position) and then advanced in place; ``late_read``: the
    second counter is read again after its add; ``by``: the third counter's increment."""

    def __init__(self, late_read=False, by=1):
        super().__init__()
        self.late_read, self.by = late_read, by

    def forward(self, x, a, b, c):
        y = x * a + 1
        a.add_(1)
        y = y + x * b
        b.add_(1)
        y = y - c
        c.add_(self.by)
        if self.late_read:
            y = y + b
        return y


def _inputs():
    return (torch.randn(4), torch.tensor(3), torch.tensor(5), torch.tensor(7))


def _run(model, target="h200"):
    args = _inputs()
    gm = capture(model, copy.deepcopy(args))
    captured = ir.mutation_signature(gm)
    *_, res = run_passes(gm, ["merge_increments"], target=target)
    return gm, res, captured, args


def test_merges_the_increments_at_the_end():
    model = Counters()
    gm, res, captured, args = _run(model)
    c = op_counts(gm)
    assert c[MERGED] == 1 and c["aten.add_.Tensor"] == 0 and len(res.rewrites) == 1
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert str(last.target) == MERGED and len(last.args[0]) == 3
    assert ir.mutation_signature(gm) == captured
    ir.check_invariants(gm)
    mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
    out, want = gm(*mine), model(*theirs)
    torch.testing.assert_close(out, want)
    assert [int(t) for t in mine[1:]] == [int(t) for t in theirs[1:]] == [4, 6, 8]


def test_refuses_a_counter_read_after_its_add_and_other_increments():
    gm, res, _, _ = _run(Counters(late_read=True, by=2))
    assert op_counts(gm)[MERGED] == 0 and op_counts(gm)["aten.add_.Tensor"] == 3
    reasons = {r.candidate: r.reason for r in res.rejected}
    assert any("result is read" in r for r in reasons.values()), reasons  # the later read goes through the add
    assert any("nothing to merge" in r for r in reasons.values()), reasons


def test_cpu_profile_keeps_the_adds():
    gm, res, _, _ = _run(Counters(), target="cpu")
    assert op_counts(gm)[MERGED] == 0 and any("same loop" in r.reason for r in res.rejected)


def test_decoder_step_advances_every_layer_once():
    from transformers import StaticCache

    model = decoders.build(decoders.tiny_config("llama", layers=3), seed=0)
    arg = decoders.cache_arg(model)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(3, 256, (1, 4)), use_cache=True, **{arg: cache})
    inputs = {"input_ids": torch.randint(3, 256, (1, 1)), arg: cache, "use_cache": True}
    gm = capture(model, copy.deepcopy(inputs))
    captured = ir.mutation_signature(gm)
    *_, res = run_passes(gm, ["fuse_attention", "merge_increments"], target="h200")
    c = op_counts(gm)
    assert c[MERGED] == 1 and c["aten.add_.Tensor"] == 0, res.rejected
    assert ir.mutation_signature(gm) == captured
    ir.check_invariants(gm)
    mine, theirs = copy.deepcopy(inputs), copy.deepcopy(inputs)
    with torch.no_grad():
        out, want = gm(**mine), model(**theirs)
    torch.testing.assert_close(out.logits, want.logits)
    assert [int(x.cumulative_length) for x in mine[arg].layers] == [5, 5, 5]
