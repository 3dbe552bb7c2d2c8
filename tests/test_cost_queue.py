"""The host/device queue model of a call (CostModel.execution_cost) on hand-built graphs, and how
optimize() reports it. CPU only: the graphs are captured on the CPU and priced for a synthetic
GPU profile whose numbers make every expected time a closed form."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import capture
from graphopt import ir
from graphopt.cost import model as cost_model
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import DeviceProfile, get_profile
from graphopt.errors import GraphoptError

LAUNCH, GRAPH_LAUNCH, HOST_NODE = 10e-6, 1e-6, 2e-6


def _gpu(**kw) -> DeviceProfile:
    base = dict(name="toy-gpu", kind="cuda", peak_flops={"float32": 1e12}, elementwise_flops=1e12, bandwidth=1e11,
                launch_overhead_s=LAUNCH, memory_bytes=1e10, launch_overhead_graph_s=GRAPH_LAUNCH,
                host_node_s=HOST_NODE)
    base.update(kw)
    return DeviceProfile(**base)


class ViewsThenMatmul(nn.Module):
    """Forty views (no kernel) before one big matmul."""

    def forward(self, x, w):
        for _ in range(10):
            x = x.t().unsqueeze(0).squeeze(0).t()
        return x @ w


class TinyKernels(nn.Module):
    def forward(self, x):
        for _ in range(100):
            x = x + 1.0
        return x


class BigMatmuls(nn.Module):
    def forward(self, x, w):
        for _ in range(4):
            x = x @ w
        return x


def _steps(cm, gm):
    return [(n, cm.node_times(n)) for n in gm.graph.nodes]


def _lead(cm, gm) -> float:
    """Host time until the first kernel is launched (export's input guard, then its launch)."""
    t = 0.0
    for n in gm.graph.nodes:
        h, d = cm.node_times(n)
        t += h
        if d > 0:
            return t
    return t


def test_views_then_one_big_kernel():
    gm = capture(ViewsThenMatmul().eval(), (torch.randn(512, 512), torch.randn(512, 512)))
    cm = CostModel(_gpu())
    steps = _steps(cm, gm)
    views = [n for n, (h, d) in steps if h == HOST_NODE and d == 0]
    kernels = [(n, h, d) for n, (h, d) in steps if d > 0]
    assert len(views) >= 30 and len(kernels) == 1
    (_, h_mm, d_mm) = kernels[0]
    ex = cm.execution_cost(gm, mode="eager")
    # the device idles while the host issues the views; the matmul starts once it is launched
    host_total = sum(h for _, (h, _) in steps)
    assert ex.total_s == pytest.approx(host_total + d_mm)
    assert ex.host_s == pytest.approx(host_total) and ex.device_s == pytest.approx(d_mm)
    assert d_mm > host_total  # the kernel dominates: device-bound, but the views still show
    assert ex.bound == "device" and ex.busy == pytest.approx(d_mm / (host_total + d_mm))
    # planning semantics unchanged: views cost nothing per node, the graph sum is the matmul's time
    assert all(cm.node_cost(n).time_s == 0 for n in views)
    assert cm.graph_cost(gm).total_s == pytest.approx(max(d_mm, LAUNCH))


def test_many_tiny_kernels_are_host_bound():
    gm = capture(TinyKernels().eval(), (torch.randn(8),))
    cm = CostModel(_gpu())
    kernels = [cm.node_times(n) for n in gm.graph.nodes if cm.node_times(n)[1] > 0]
    assert len(kernels) == 100 and all(d < LAUNCH for _, d in kernels)
    others = sum(cm.node_times(n)[0] for n in gm.graph.nodes if cm.node_times(n)[1] == 0)
    assert others <= HOST_NODE  # export's input guard (a module call) at most
    ex = cm.execution_cost(gm, mode="eager")
    # each kernel waits for its launch: the call costs the host's time plus the last kernel
    assert ex.total_s == pytest.approx(others + 100 * LAUNCH + kernels[-1][1])
    assert ex.bound == "host" and ex.busy < 0.5
    assert ex.launches == 100 and len(ex.nodes) == len(gm.graph.nodes)


def test_graphed_replay_is_device_bound():
    x = torch.randn(8)
    gm = capture(TinyKernels().eval(), (x,))
    cm = CostModel(_gpu())
    eager = cm.execution_cost(gm, mode="eager")
    graphed = cm.execution_cost(gm, mode="graphed")
    body = sum(max(d, GRAPH_LAUNCH) for n in gm.graph.nodes for h, d in [cm.node_times(n)] if d > 0)
    copy = cm.profile.gpu_seconds(0.0, 2 * 8 * 4 / cm.profile.bandwidth)
    # host: copy the input in, launch the replay, clone the output; the device runs them in turn
    assert graphed.launches == 3
    assert graphed.device_s == pytest.approx(body + 2 * copy)
    assert graphed.total_s == pytest.approx(2 * LAUNCH + body + copy)
    assert graphed.bound == "device" and graphed.busy > 0.8
    assert graphed.total_s < eager.total_s / 3
    reused = cm.execution_cost(gm, mode="graphed", reuse_outputs=True)
    assert reused.launches == 2 and reused.total_s == pytest.approx(2 * LAUNCH + body)


def test_big_kernels_are_device_bound_in_eager():
    gm = capture(BigMatmuls().eval(), (torch.randn(1024, 1024), torch.randn(1024, 1024)))
    cm = CostModel(_gpu())
    dev = [d for n in gm.graph.nodes for _, d in [cm.node_times(n)] if d > 0]
    assert len(dev) == 4 and min(dev) > LAUNCH
    ex = cm.execution_cost(gm, mode="eager")
    # only the first launch shows; the rest are issued while the device is busy
    assert LAUNCH <= _lead(cm, gm) <= LAUNCH + HOST_NODE
    assert ex.total_s == pytest.approx(_lead(cm, gm) + sum(dev))
    assert ex.bound == "device"
    # and the sum of per-node planning times agrees once kernels dominate
    assert cm.graph_cost(gm).total_s == pytest.approx(sum(dev))


def test_host_sync_makes_the_host_wait(monkeypatch):
    class MatmulThenTiny(nn.Module):
        def forward(self, x, w):
            return (x @ w).t() + 1.0

    gm = capture(MatmulThenTiny().eval(), (torch.randn(1024, 1024), torch.randn(1024, 1024)))
    cm = CostModel(_gpu())
    times = {n.op + ":" + str(n.target): cm.node_times(n) for n in gm.graph.nodes}
    (h_mm, d_mm), = [v for k, v in times.items() if "mm" in k or "matmul" in k]
    (h_add, d_add), = [v for k, v in times.items() if "add" in k]
    free = cm.execution_cost(gm, mode="eager").total_s
    lead = _lead(cm, gm)  # the matmul's launch (and export's guard before it)
    assert free == pytest.approx(lead + d_mm + d_add)  # the add is issued during the matmul
    # pretend the transpose synchronized (as .item() or nonzero do): the add's launch now
    # starts only after the matmul has finished
    monkeypatch.setattr(ir, "HOST_SYNC_OPS", ir.HOST_SYNC_OPS | {"t"})
    synced = cm.execution_cost(gm, mode="eager").total_s
    assert synced == pytest.approx(lead + d_mm + h_add + d_add)


def test_host_op_times_replace_the_launch_cost():
    gm = capture(TinyKernels().eval(), (torch.randn(8),))
    slow = CostModel(_gpu(host_op_s={"add": 3 * LAUNCH}))
    others = sum(slow.node_times(n)[0] for n in gm.graph.nodes if slow.node_times(n)[1] == 0)
    last = [slow.node_times(n)[1] for n in gm.graph.nodes if slow.node_times(n)[1] > 0][-1]
    assert slow.execution_cost(gm).total_s == pytest.approx(others + 300 * LAUNCH + last)
    # NodeCost (what the passes compare) still charges launches * launch_overhead_s
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert slow.node_cost(add).time_s == pytest.approx(LAUNCH)
    assert slow.node_loop_s(add) == pytest.approx(3 * LAUNCH)
    # a view op measured by calibrate costs its own host time; unmeasured views host_node_s
    gv = capture(ViewsThenMatmul().eval(), (torch.randn(64, 64), torch.randn(64, 64)))
    cm = CostModel(_gpu(host_op_s={"t": 5e-6}))
    hosts = {n.target.__name__.split(".")[0]: cm.node_times(n)[0] for n in gv.graph.nodes
             if n.op == "call_function" and cm.node_times(n)[1] == 0}
    assert hosts["t"] == 5e-6 and hosts["unsqueeze"] == HOST_NODE


def test_cpu_profile_is_serial_and_matches_the_planning_sum():
    gm = capture(ViewsThenMatmul().eval(), (torch.randn(64, 64), torch.randn(64, 64)))
    cm = CostModel(get_profile("cpu")[0])
    ex = cm.execution_cost(gm, mode="eager")
    assert ex.mode == "serial" and ex.busy is None
    assert ex.total_s == pytest.approx(cm.graph_cost(gm).total_s)
    assert cm.execution_cost(gm, mode="graphed").total_s == pytest.approx(ex.total_s)


def test_bad_execution_mode_is_a_one_line_error():
    gm = capture(TinyKernels().eval(), (torch.randn(8),))
    with pytest.raises(GraphoptError, match="execution mode must be one of eager, graphed"):
        CostModel(_gpu()).execution_cost(gm, mode="compiled")


def test_optimize_reports_the_execution_it_runs():
    """On the CPU, planned for the H200: the module runs eagerly (no GPU here), so the report's
    predicted time after is the eager queue's; the graphed prediction is recorded beside it and
    becomes the report's time when the module replays a graph."""
    from graphopt.examples import zoo

    model, inputs = zoo.get("bert-tiny")
    opt = graphopt.optimize(model, inputs, target="h200", check_accuracy=False)
    ex = opt.report.execution
    assert ex["mode"] == "eager" and set(ex["after"]) == {"eager", "graphed", "graphed_reuse_outputs"}
    assert ex["before"]["mode"] == "eager" and ex["before"]["bound"] == "host"  # bert-tiny: launch-bound
    assert opt.report.predicted_s_after == pytest.approx(ex["after"]["eager"]["predicted_ms"] / 1e3)
    assert opt.report.predicted_s_before == pytest.approx(ex["before"]["predicted_ms"] / 1e3)
    assert ex["after"]["graphed"]["predicted_ms"] < ex["after"]["eager"]["predicted_ms"]
    opt._predict_execution(True)
    assert ex["mode"] == "graphed"
    assert opt.report.predicted_s_after == pytest.approx(ex["after"]["graphed"]["predicted_ms"] / 1e3)
    assert opt.report.as_dict()["execution"]["mode"] == "graphed"
    from rich.console import Console

    console = Console(record=True, width=200)
    opt.report.render(console)
    line = next(t for t in console.export_text().splitlines() if t.startswith("predicted"))
    assert "; eager, host-bound" in line and "→ CUDA graph replay, device-bound" in line
    opt._predict_execution(False)
    assert opt.report.predicted_s_after == pytest.approx(ex["after"]["eager"]["predicted_ms"] / 1e3)


def test_attention_efficiency_and_addmm_reduction_dim():
    """SDPA runs at its own fitted efficiency when calibrated (the GEMM's when not); addmm-style
    ops count FLOPs over the first matrix's last dim, not the bias's."""
    import torch.nn.functional as F

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))
    gm = capture(Attn().eval(), (q, k, v))
    sdpa = next(n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target))
    flops = 4 * 2 * 4 * 128 * 128 * 64
    base = CostModel(_gpu(matmul_scale=0.5, matmul_fixed_s=1e-6))
    compute = flops / 1e12
    assert base.node_times(sdpa)[1] == pytest.approx(max(compute / 0.5 + 1e-6, base.node_cost(sdpa).memory_s))
    fitted = CostModel(_gpu(matmul_scale=0.5, matmul_fixed_s=1e-6, attention_scale=0.1, attention_fixed_s=5e-6))
    assert fitted.node_times(sdpa)[1] == pytest.approx(compute / 0.1 + 5e-6)
    assert fitted.node_cost(sdpa).time_s == pytest.approx(compute / 0.1 + 5e-6)

    g = torch.fx.Graph()
    b, x, w = g.placeholder("b"), g.placeholder("x"), g.placeholder("w")
    out = g.call_function(torch.ops.aten._addmm_activation.default, (b, x, w), {"use_gelu": False})
    g.output(out)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        vals = {"b": torch.empty(256), "x": torch.empty(8, 64), "w": torch.empty(64, 256)}
        for n in g.nodes:
            if n.op == "placeholder":
                n.meta["val"] = vals[n.name]
        out.meta["val"] = torch.ops.aten._addmm_activation.default(vals["b"], vals["x"], vals["w"])
    gm2 = torch.fx.GraphModule(nn.Module(), g)
    assert gm2.graph is g
    assert CostModel(_gpu()).flops_bytes(out)[0] == 2 * 8 * 256 * 64
