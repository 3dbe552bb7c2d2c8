"""graphopt.tools.measure: node-by-node timing, Spearman, explain --measure (CPU; no wall-clock assertions)."""

from __future__ import annotations

import json

import pytest
import torch

import graphopt
from graphopt.capture import capture, split_inputs
from graphopt.tools.cli import main
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.examples import zoo
from graphopt.tools.measure import accuracy_table, busy_fraction, graph_inputs, measure_nodes, spearman


def _mlp():
    model, inputs = zoo.get("mlp")
    return model, inputs


def test_measure_nodes_times_every_call_function_node():
    model, inputs = _mlp()
    gm = capture(model, inputs)
    args, kwargs = split_inputs(inputs)
    times = measure_nodes(gm, graph_inputs(gm, args, kwargs), "cpu", reps=2)
    names = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    assert names and set(times) == names
    assert all(t > 0 for t in times.values())


def test_measure_nodes_kwargs_model():
    model, inputs = zoo.get("bert-tiny")
    gm = capture(model, inputs)
    args, kwargs = split_inputs(inputs)
    times = measure_nodes(gm, graph_inputs(gm, args, kwargs), reps=1)
    assert len(times) == sum(1 for n in gm.graph.nodes if n.op == "call_function")


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)  # ties
    assert spearman([1], [2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    # against the textbook formula on distinct values
    a, b = [3, 1, 4, 1.5, 9, 2.6], [2, 7, 1, 8, 2.8, 1.8]
    ra = [sorted(a).index(x) + 1 for x in a]
    rb = [sorted(b).index(x) + 1 for x in b]
    n = len(a)
    ref = 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))
    assert spearman(a, b) == pytest.approx(ref)


def test_accuracy_table_cpu():
    model, inputs = _mlp()
    gm = capture(model, inputs)
    profile, _ = get_profile("cpu")
    t = accuracy_table(gm, inputs, CostModel(profile), reps=2, whole_reps=3)
    assert t["measured_ms"] > 0 and t["predicted_ms"] > 0
    assert t["nodes_costed"] >= 2 and -1 <= t["spearman"] <= 1
    assert all(r["measured_ms"] > 0 for r in t["nodes"])
    # the whole call is predicted by the execution model (serial on a CPU profile)
    assert t["execution"] == "eager" and t["predicted_busy"] is None
    assert t["predicted_ms"] == pytest.approx(CostModel(profile).execution_cost(gm).total_s * 1e3)
    assert t["heavy_threshold_ms"] == pytest.approx(3 * profile.launch_overhead_s * 1e3)
    assert t["nodes_heavy"] <= t["nodes_costed"]
    assert all({"predicted_host_ms", "predicted_device_ms", "measured_host_ms"} <= set(r) for r in t["nodes"])
    cpu = busy_fraction(lambda: gm(torch.randn(8, 64)), "cpu")
    assert cpu["busy"] is None and cpu["busy_loop"] is None


def test_explain_measure_mlp(capfd, tmp_path):
    path = tmp_path / "r.json"
    rc = main(["explain", "mlp", "--measure", "--json", str(path)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    m = json.loads(path.read_text())["measured"]
    assert m["before_ms"] > 0 and m["after_ms"] > 0
    assert m["busy_before"] is None and m["busy_after"] is None
    assert m["nodes"] and all(r["measured_ms"] > 0 for r in m["nodes"])
    assert "measured on cpu" in out and "n/a on CPU" in out


def test_explain_without_measure_leaves_it_empty(capfd, tmp_path):
    path = tmp_path / "r.json"
    assert main(["explain", "mlp", "--no-accuracy", "--json", str(path)]) == 0
    capfd.readouterr()
    assert json.loads(path.read_text())["measured"] is None


def test_render_measured_section():
    from rich.console import Console

    model, inputs = _mlp()
    opt = graphopt.optimize(model, inputs, check_accuracy=False)
    from graphopt.tools.measure import measure_report

    measure_report(opt, model, inputs, reps=1)
    console = Console(record=True, width=160)
    opt.report.render(console)
    text = console.export_text()
    assert "predicted vs measured" in text and "GPU busy" in text


@pytest.mark.cuda
def test_busy_fraction_and_nodes_cuda():
    model, inputs = zoo.get("bert-tiny", device="cuda")
    gm = capture(model, inputs)
    args, kwargs = split_inputs(inputs)
    times = measure_nodes(gm, graph_inputs(gm, args, kwargs), reps=2)
    assert times and all(t > 0 for t in times.values())
    # queued device times: each kernel node's device time, at most its host-bound loop time
    # (bert-tiny's nodes are launch-bound), and a big GEMM's device time near its loop time
    detail = measure_nodes(gm, graph_inputs(gm, args, kwargs), reps=2, detail=True, device_times=True)
    assert set(detail) == set(times)
    assert all(d is not None and 0 <= d <= loop * 1.2 for loop, _, d in detail.values())
    big = capture(torch.nn.Linear(4096, 4096).cuda().eval(), (torch.randn(8192, 4096, device="cuda"),))
    ((loop, _, dev),) = [v for k, v in measure_nodes(big, [torch.randn(8192, 4096, device="cuda")], reps=2, detail=True,
                                                     device_times=True).items() if "linear" in k]
    assert dev == pytest.approx(loop, rel=0.25)
    a = torch.randn(2048, 2048, device="cuda")
    busy = busy_fraction(lambda: [a @ a for _ in range(10)], "cuda")
    assert busy["busy"] is not None and 0 < busy["busy"] <= 1, busy
    # device-bound GEMMs back to back keep the GPU busy; a launch-bound eager graph cannot
    assert busy["busy_loop"] > 0.9 and busy["loop_ms"] <= busy["wall_ms"] * 1.1, busy
    tiny = busy_fraction(lambda: gm(*args, **kwargs), "cuda")
    assert tiny["busy"] is not None and 0 < tiny["busy"] <= 1, tiny
    assert tiny["busy_loop"] is not None and tiny["busy_loop"] < 0.9, tiny
