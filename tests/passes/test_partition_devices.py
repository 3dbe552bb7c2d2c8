"""partition_devices: the pass plans stages (report + JSON + CLI), the placed module matches
eager, and one device leaves it a no-op with the reason."""

from __future__ import annotations

import json

import torch

import graphopt
from graphopt import accuracy
from graphopt.tools import cli
from graphopt.examples import zoo
from graphopt.passes.partition_devices import PartitionResult


def test_plans_two_stages_and_the_placed_module_matches_eager():
    model, inputs = zoo.get("bert-tiny", batch=2, seq_len=16)
    opt = graphopt.optimize(model, inputs, devices=["cpu", "cpu"], precision="fp32")
    res = opt.report.pass_result("partition_devices")
    assert res.status == "planned" and not res.rewrites
    assert isinstance(res, PartitionResult) and res.plan.num_stages == 2  # the plan comes back typed
    plan = res.details["partition"]
    n_compute = len([n for n in opt.graph_module.graph.nodes if n.op not in ("placeholder", "get_attr", "output")])
    assert [s["stage"] for s in plan["stages"]] == [0, 1]
    assert sum(s["nodes"] for s in plan["stages"]) == n_compute
    assert plan["boundaries"][0]["bytes"] > 0 and plan["boundaries"][0]["tensors"]
    assert opt.report.as_dict()["partition"] == plan
    with torch.no_grad():
        out, eager = opt(*inputs), model(*inputs)
    ref = accuracy.fp64_reference(model, tuple(inputs), {})
    assert accuracy.check(out, ref, eager).passed


def test_one_device_is_a_no_op_with_the_reason():
    model, inputs = zoo.get("mlp", batch=4)
    opt = graphopt.optimize(model, inputs, devices=["cpu"])
    res = opt.report.pass_result("partition_devices")
    assert res.status == "unchanged" and "one device" in res.notes[0]
    assert opt.report.partition is None and "placed" not in opt._modules
    res = graphopt.optimize(model, inputs).report.pass_result("partition_devices")
    assert res.status == "unchanged" and "no devices=" in res.notes[0]


def test_explain_devices_plans_for_gpus_from_a_cpu_machine(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["explain", "mlp", "--devices", "cuda:0,cuda:1", "--target", "h200", "--microbatches", "4",
                   "--schedule", "1f1b", "--json", str(out), "--no-accuracy"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "partition: 2 stages, 1f1b, 4 micro-batch(es)" in text and "bubble" in text
    plan = json.loads(out.read_text())["partition"]
    assert [s["device"] for s in plan["stages"]] == ["cuda:0", "cuda:1"]
    assert plan["bubble_fraction"] == 1 / 5
    rc = cli.main(["explain", "mlp", "--devices", "cpu,cpu", "--memory-cap", "1kB", "--no-accuracy"])
    assert rc == 2 and "needs" in capsys.readouterr().err


def test_interleaved_plan_in_explain_and_the_placed_module_matches_eager(capsys):
    rc = cli.main(["explain", "glm4-tiny", "--devices", "cuda:0,cuda:1", "--target", "h200", "--microbatches", "4",
                   "--schedule", "interleaved1f1b", "--virtual-stages", "2", "--no-accuracy"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "partition: 4 stages (2 per device), interleaved1f1b" in text
    assert "cuda:0: stage(s) 0, 2" in text and "cuda:1: stage(s) 1, 3" in text and "(S-1)/(v·M+S-1) = 11%" in text
    rc = cli.main(["explain", "mlp", "--devices", "cuda:0,cuda:1", "--target", "h200", "--microbatches", "3",
                   "--schedule", "interleaved1f1b", "--no-accuracy"])
    assert rc == 2 and "multiple of the devices" in capsys.readouterr().err
    model, inputs = zoo.get("glm4-tiny", batch=2, seq_len=16)
    opt = graphopt.optimize(model, inputs, devices=["cpu", "cpu"], precision="fp32", schedule="interleaved1f1b",
                            microbatches=2)
    plan = opt.report.partition
    assert plan["virtual_stages"] == 2 and [s["device"] for s in plan["stages"]] == ["cpu"] * 4
    assert opt.placed is not None
    with torch.no_grad():
        out, eager = opt(*inputs), model(*inputs)
    ref = accuracy.fp64_reference(model, tuple(inputs), {})
    assert accuracy.check(out.logits, ref.logits, eager.logits).passed
