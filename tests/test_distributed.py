"""Multi-process pipelines on the CPU (gloo): graphopt's stage plan run by
torch.distributed.pipelining gives the unpartitioned model's outputs and gradients (accuracy
rule), with GPipe and 1F1B, on 2 and 3 processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphopt import accuracy
from graphopt import distributed as gd
from graphopt.errors import GraphoptError
from graphopt.examples import zoo


class LM(nn.Module):
    """glm4-tiny returning only the logits (no KV cache)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


def loss_fn(logits, ids):
    """Next-token cross-entropy on the shifted logits."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def build(batch):
    m, (ids,) = zoo.get("glm4-tiny", batch=batch, seq_len=8)
    return LM(m), ids


def _work(rank, world, path, batch, runs):
    out = {}
    for schedule, mbs, train in runs:
        model, ids = build(batch)
        pipe = gd.Pipeline(model, ids, microbatches=mbs, schedule=schedule, loss_fn=loss_fn if train else None)
        key = f"{schedule}-{mbs}-{'train' if train else 'infer'}"
        losses = []
        res = pipe.step(ids, target=ids if train else None, losses=losses if train else None)
        out[key] = {"out": res, "losses": [x.detach() for x in losses], "plan": pipe.plan.as_dict(),
                    "grads": {n: p.grad.clone() for n, p in pipe.module.named_parameters() if p.grad is not None}}
    torch.save(out, f"{path}/rank{rank}.pt")


def _reference(batch):
    model, ids = build(batch)
    with torch.no_grad():
        eager_out = model(ids)
    ref_out = accuracy.fp64_reference(model, (ids,), {})
    loss_fn(model(ids), ids).backward()
    m64 = copy.deepcopy(model).double()
    m64.zero_grad()
    loss_fn(m64(ids), ids).backward()
    eager_g = {n: p.grad for n, p in model.named_parameters()}
    ref_g = {n: p.grad for n, p in m64.named_parameters()}
    return eager_out, ref_out, eager_g, ref_g


def _check(tmp_path, world, batch, runs):
    gd.spawn(_work, world, str(tmp_path), batch, runs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    eager_out, ref_out, eager_g, ref_g = _reference(batch)
    for schedule, mbs, train in runs:
        key = f"{schedule}-{mbs}-{'train' if train else 'infer'}"
        plan = ranks[0][key]["plan"]
        assert len(plan["stages"]) == world and plan["schedule"] == schedule
        assert all(r[key]["out"] is None for r in ranks[:-1])
        last = ranks[-1][key]
        res = accuracy.check(last["out"], ref_out, eager_out, training=train)
        assert res.passed, (key, res.reason)
        if not train:
            continue
        assert len(last["losses"]) == mbs
        seen = set()
        for r, rank in enumerate(ranks):
            grads = rank[key]["grads"]
            assert grads, f"stage {r} got no gradients"
            for name, g in grads.items():
                res = accuracy.check(g, ref_g[name], eager_g[name], training=True)
                assert res.passed, (key, r, name, res.reason)
            assert not seen & set(grads), "a parameter trained on two stages"
            seen |= set(grads)
        assert seen == {n for n, g in eager_g.items() if g is not None}


def test_two_processes_gpipe_and_1f1b_match_the_unpartitioned_model(tmp_path):
    _check(tmp_path, 2, 4, [("gpipe", 2, False), ("gpipe", 2, True), ("1f1b", 4, True)])


def test_three_processes_1f1b_match_the_unpartitioned_model(tmp_path):
    _check(tmp_path, 3, 6, [("1f1b", 3, True)])


def test_pipeline_refuses_bad_setups_in_one_line():
    model, ids = build(4)
    with pytest.raises(GraphoptError, match="process group"):
        gd.Pipeline(model, ids, microbatches=2)
    with pytest.raises(GraphoptError, match="does not split into 3"):
        gd.microbatch(ids, 3)
