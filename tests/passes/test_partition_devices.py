"""partition_devices: the pass plans stages (report + JSON + CLI), the placed module matches
eager, and one device leaves it a no-op with the reason."""

from __future__ import annotations

import json

import torch

import graphopt
from graphopt import accuracy, cli
from graphopt.examples import zoo


def test_plans_two_stages_and_the_placed_module_matches_eager():
    model, inputs = zoo.get("bert-tiny", batch=2, seq_len=16)
    opt = graphopt.optimize(model, inputs, devices=["cpu", "cpu"], precision="fp32")
    res = opt.report.pass_result("partition_devices")
    assert res.status == "planned" and not res.rewrites
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
