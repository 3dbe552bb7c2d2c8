"""Multi-process pipelines on the CPU (gloo): graphopt's stage plan run by
torch.distributed.pipelining gives the unpartitioned model's outputs and gradients (accuracy
rule), with GPipe, 1F1B and interleaved 1F1B (two stages per process), on 2 and 3 processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from graphopt import accuracy
from graphopt.runtime import distributed as gd
from graphopt.errors import GraphoptError
from graphopt.examples import zoo


def mlp_loss(out, labels):
    return F.cross_entropy(out, labels)


def build(batch, name="glm4-tiny"):
    """(model, inputs, loss_fn, target): glm4-tiny (next-token loss on its own ids) or the zoo MLP."""
    if name == "mlp":
        m, (x,) = zoo.get("mlp", batch=batch)
        labels = torch.arange(batch) % 10
        return m, x, mlp_loss, labels
    m, (ids,) = zoo.get("glm4-tiny", batch=batch, seq_len=8)
    return zoo.LogitsOnly(m), ids, zoo.next_token_loss, ids


def _work(rank, world, path, batch, runs, name, passes=(), plan_for=None):
    out = {}
    for schedule, mbs, train in runs:
        model, x, loss, target = build(batch, name)
        pipe = gd.Pipeline(model, x, microbatches=mbs, schedule=schedule, loss_fn=loss if train else None,
                           example_target=target if train else None, passes=passes, target=plan_for)
        if passes:
            out.setdefault("ops", set()).update(str(n.target) for m in pipe.modules for n in m.graph.nodes
                                                if n.op == "call_function")
        key = f"{schedule}-{mbs}-{'train' if train else 'infer'}"
        losses = []
        res = pipe.step(x, target=target if train else None, losses=losses if train else None)
        out[key] = {"out": res, "losses": [x.detach() for x in losses], "plan": pipe.plan.as_dict(),
                    "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
                    "stage_indices": pipe.stage_indices}
    if any(s == "interleaved1f1b" for s, _, _ in runs):  # the negative case, on every rank
        model, x, loss, target = build(batch, name)
        try:
            gd.Pipeline(model, x, microbatches=1, schedule="interleaved1f1b", loss_fn=loss, example_target=target)
        except GraphoptError as e:
            out["refused"] = str(e)
    torch.save(out, f"{path}/rank{rank}.pt")


def _reference(batch, name):
    model, x, loss, target = build(batch, name)
    with torch.no_grad():
        eager_out = model(x)
    ref_out = accuracy.fp64_reference(model, (x,), {})
    loss(model(x), target).backward()
    m64 = copy.deepcopy(model).double()
    m64.zero_grad()
    x64 = x.double() if x.is_floating_point() else x
    loss(m64(x64), target).backward()
    eager_g = {n: p.grad for n, p in model.named_parameters()}
    ref_g = {n: p.grad for n, p in m64.named_parameters()}
    return eager_out, ref_out, eager_g, ref_g


def _check(tmp_path, world, batch, runs, name="glm4-tiny", passes=(), plan_for=None, start_method="spawn"):
    gd.spawn(_work, world, str(tmp_path), batch, runs, name, passes, plan_for, start_method=start_method)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    eager_out, ref_out, eager_g, ref_g = _reference(batch, name)
    for schedule, mbs, train in runs:
        key = f"{schedule}-{mbs}-{'train' if train else 'infer'}"
        plan = ranks[0][key]["plan"]
        v = 2 if schedule == "interleaved1f1b" else 1
        assert len(plan["stages"]) == world * v and plan["schedule"] == schedule and plan["virtual_stages"] == v
        for r in range(world):  # rank r holds stages r, r + world, …
            assert ranks[r][key]["stage_indices"] == list(range(r, world * v, world))
            assert [s["device"] for s in plan["stages"]][r::world] == ["cpu"] * v
        assert any("loss on the last stage is costed" in n for n in plan["notes"]) == train
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
    return ranks


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_two_processes_gpipe_and_1f1b_match_the_unpartitioned_model(tmp_path):
    _check(tmp_path, 2, 4, [("gpipe", 2, False), ("gpipe", 2, True), ("1f1b", 4, True)])


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_two_processes_interleaved_1f1b_two_stages_each_match_the_unpartitioned_model(tmp_path):
    ranks = _check(tmp_path, 2, 4, [("interleaved1f1b", 2, True), ("interleaved1f1b", 4, True),
                                    ("interleaved1f1b", 2, False)])
    for r in ranks:  # each rank trained the parameters of its two non-adjacent stages
        assert "multiple of the devices (1 micro-batches on 2 devices)" in r["refused"]
    plan = ranks[0]["interleaved1f1b-4-train"]["plan"]
    assert plan["bubble_fraction"] == pytest.approx(1 / (2 * 4 + 1))
    assert [d["stages"] for d in plan["devices"]] == [[0, 2], [1, 3]]


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_two_processes_with_fused_stage_graphs(tmp_path):
    """Stage graphs cut from the graph after graphopt's fusion passes (planned for the H200, so
    the graphopt kernels are used; their reference implementations run here): same outputs and
    gradients as the unpartitioned model."""
    from graphopt.pipeline import available, registry

    reg = registry()
    passes = tuple(n for n in available() if reg[n].family in ("cleanup", "fusion", "layout"))
    ranks = _check(tmp_path, 2, 4, [("gpipe", 2, False), ("gpipe", 2, True)], passes=passes, plan_for="h200")
    ops = set().union(*(r["ops"] for r in ranks))
    assert any(o.startswith("graphopt.") for o in ops), ops  # fused kernels ended up in the stages


def test_three_processes_gpipe_and_1f1b_match_the_unpartitioned_mlp(tmp_path):
    # forked from one server process that imported this module (torch, graphopt, the zoo) once:
    # three spawned interpreters each imported them, most of the test's time on two cores
    import multiprocessing

    multiprocessing.set_forkserver_preload([__name__])
    _check(tmp_path, 3, 12, [("gpipe", 4, False), ("1f1b", 3, True)], name="mlp", start_method="forkserver")


def _outputs_to_host(rank, world, path):
    res = {}
    for schedule in ("gpipe", "1f1b", "interleaved1f1b"):
        model, x, _, _ = build(4)
        pipe = gd.Pipeline(model, x, microbatches=2, schedule=schedule, outputs_to_host=True)
        first = pipe.step(x)
        again = pipe.step(x)  # from the second step on, the rows of one buffer per output
        if pipe.is_last:
            assert first is not pipe._to_host._batch[0]  # the first step concatenates
            assert again is pipe._to_host._batch[0] and again.shape[0] == x.shape[0]
            torch.testing.assert_close(again, first, rtol=0, atol=0)
        res[schedule] = {"out": again, "names": sorted(n for n, _ in pipe.named_parameters()),
                         "notes": pipe.plan.notes}
    torch.save(res, f"{path}/rank{rank}.pt")


@pytest.mark.slow  # make test-all; the mechanism's fast tests stay in make test
def test_outputs_copied_to_the_host_give_the_unpartitioned_models_outputs(tmp_path):
    """outputs_to_host under GPipe, 1F1B and interleaved 1F1B: the last stage's outputs go through
    the copy wrapper (torch's pipelining infers its shapes and validates its outputs with it in
    place); same outputs as the unpartitioned model, parameters named as in the model, the plan says
    so."""
    gd.spawn(_outputs_to_host, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    eager_out, ref_out, _, _ = _reference(4, "glm4-tiny")
    model, _, _, _ = build(4)
    for schedule, last in ranks[1].items():
        assert ranks[0][schedule]["out"] is None and last["out"].device.type == "cpu"
        res = accuracy.check(last["out"], ref_out, eager_out)
        assert res.passed, (schedule, res.reason)
        names = [r[schedule]["names"] for r in ranks]
        assert set(names[0]) | set(names[1]) <= {n for n, _ in model.named_parameters()}
        assert all(not n.startswith("inner.") for ns in names for n in ns)
        assert any("to host memory" in n for n in ranks[0][schedule]["notes"])


def test_outputs_to_host_write_each_microbatch_into_one_batch_buffer():
    """Micro-batch i's outputs land in rows i·n.. of one batch buffer, and the merge returns that
    buffer (no concatenation); a strided output is copied on its own and concatenated; meta tensors
    (torch's shape inference) pass through uncounted."""
    from torch.distributed.pipelining.microbatch import merge_chunks

    class Two(torch.nn.Module):
        def forward(self, x):
            return x * 2, (x * 3).t()

    w = gd._OutputsToHost(Two(), microbatches=3)
    assert w(torch.empty(2, 4, device="meta"))[0].device.type == "meta" and w.calls == 0
    xs = [torch.randn(2, 4) for _ in range(3)]
    for rows in (False, True):  # the first step: chunks copied on their own; later ones: rows of one buffer
        w.rows, w.calls = rows, 0
        chunks = [w(x) for x in xs]
        merged = merge_chunks(chunks, w.merge_spec(2))
        assert (merged[0] is w._batch[0]) == rows and merged[0].shape == (6, 4)
        torch.testing.assert_close(merged[0], torch.cat(xs) * 2)
        torch.testing.assert_close(merged[1], torch.cat([(x * 3).t() for x in xs]))


def test_pipeline_refuses_bad_setups_in_one_line():
    model, ids, _, _ = build(4)
    with pytest.raises(GraphoptError, match="process group"):
        gd.Pipeline(model, ids, microbatches=2)
    with pytest.raises(GraphoptError, match="does not split into 3"):
        gd.microbatch(ids, 3)
    # checked before the process group: nothing to set up for a request that cannot run
    with pytest.raises(GraphoptError, match="outputs_to_host is for inference"):
        gd.Pipeline(model, ids, microbatches=2, loss_fn=zoo.next_token_loss, outputs_to_host=True)
