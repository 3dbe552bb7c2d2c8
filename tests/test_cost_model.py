import dataclasses

import pytest
import sympy
import torch
import torch.nn as nn

from graphopt import capture
from graphopt.cost.model import CostModel, conv_bias_add_s
from graphopt.cost.profiles import DeviceProfile, get_profile, profile_names
from graphopt.errors import GraphoptError


def _h200():
    return get_profile("h200")[0]


def _node(gm, opname):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and opname in str(n.target))


class Lin(nn.Module):
    def __init__(self, k=256, n=512):
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_shipped_profiles():
    assert {"h200", "a100", "cpu"} <= set(profile_names())
    p = _h200()
    assert p.peak_flops["bfloat16"] == 776e12 and p.bandwidth == 4.2e12
    assert p.matmul_rate(torch.bfloat16) == 776e12
    assert p.matmul_rate(torch.float32, allow_tf32=False) == 50e12
    assert p.matmul_rate(torch.float32, allow_tf32=True) > 50e12
    with pytest.raises(GraphoptError, match="unknown device or profile"):
        get_profile("tpu-v9")


def test_linear_flops_and_bytes():
    gm = capture(Lin().eval(), (torch.randn(64, 256),))
    cm = CostModel(_h200())
    lin = cm.node_cost(_node(gm, "linear"))
    assert lin.flops == 2 * 64 * 512 * 256
    # x, W, b read once; out written once (fp32)
    assert lin.bytes == 4 * (64 * 256 + 512 * 256 + 512 + 64 * 512)
    relu = cm.node_cost(_node(gm, "relu"))
    assert relu.bytes == 4 * 2 * 64 * 512
    assert relu.bound in ("memory", "launch")
    # on a GPU the host's launch overlaps running kernels: the longer of the two
    p = _h200()
    gpu = max(relu.compute_s, relu.memory_s + p.kernel_fixed_s)
    assert relu.time_s == pytest.approx(max(gpu, p.launch_overhead_s))


class _Experts(nn.Module):
    """A mixture of experts' two grouped GEMMs: rows routed to 4 experts (2-D x 3-D), and the
    per-expert weight gradient form (2-D x 2-D, the groups splitting the shared dim)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 32, 48, dtype=torch.bfloat16))
        self.register_buffer("offs", torch.tensor([16, 32, 48, 64], dtype=torch.int32))

    def forward(self, x, g):
        return torch._grouped_mm(x, self.w, offs=self.offs), torch._grouped_mm(x.t(), g, offs=self.offs)


def test_grouped_gemms_priced_by_their_multiply_adds():
    """torch._grouped_mm is priced as a GEMM: 2 x rows x K x N over the groups (not a pointwise op's
    one flop per element), and where both operands are 2-D each group sums over its share of K."""
    x, g = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 24, dtype=torch.bfloat16)
    gm = capture(_Experts().eval(), (x, g))
    routed, wgrad = [n for n in gm.graph.nodes if n.op == "call_function" and "_grouped_mm" in str(n.target)]
    cm = CostModel(_h200())
    assert cm.flops_bytes(routed)[0] == 2 * 64 * 32 * 48 and cm.flops_bytes(routed)[3] == "matmul"
    assert cm.flops_bytes(wgrad)[0] == 2 * 32 * 24 * 64


def test_grouped_gemms_run_below_the_gemm_rate():
    """aten's grouped GEMM is priced at GROUPED_MM_SCALE of the profile's GEMM rate (a profile's own
    op_efficiency["grouped_mm"]["scale"] where it has one), so its compute time is the dense GEMM's over that."""
    import dataclasses as dc

    from graphopt.cost.model import GROUPED_MM_SCALE

    x, g = torch.randn(4096, 1024, dtype=torch.bfloat16), torch.randn(4096, 24, dtype=torch.bfloat16)
    m = _Experts()
    m.w = nn.Parameter(torch.randn(4, 1024, 2048, dtype=torch.bfloat16))
    m.offs = torch.tensor([1024, 2048, 3072, 4096], dtype=torch.int32)
    gm = capture(m.eval(), (x, g))
    routed = next(n for n in gm.graph.nodes if n.op == "call_function" and "_grouped_mm" in str(n.target))
    p = _h200()
    c = CostModel(p).node_cost(routed)
    assert c.compute_s == pytest.approx(2 * 4096 * 1024 * 2048 / (p.matmul_rate(torch.bfloat16) * GROUPED_MM_SCALE))
    own = dc.replace(p, op_efficiency={**p.op_efficiency, "grouped_mm": {"scale": 0.5}})
    assert CostModel(own).node_cost(routed).compute_s == pytest.approx(c.compute_s * GROUPED_MM_SCALE / 0.5)


def test_calibrated_efficiencies_and_cpu_dispatch():
    """A fitted GEMM efficiency slows GEMMs, a convolution gets its own, a memory-bound kernel its
    fixed time; on the CPU an op's dispatch adds to its work instead of overlapping it."""
    gm = capture(Lin(1024, 1024).eval().to(torch.bfloat16), (torch.randn(4096, 1024, dtype=torch.bfloat16),))
    ideal = dataclasses.replace(_h200(), matmul_scale=1.0, matmul_fixed_s=0.0, conv_scale=1.0, conv_fixed_s=0.0,
                                kernel_fixed_s=0.0)
    fitted = dataclasses.replace(ideal, matmul_scale=0.5, matmul_fixed_s=3e-6, kernel_fixed_s=2e-6)
    a = CostModel(ideal).node_cost(_node(gm, "linear"))
    b = CostModel(fitted).node_cost(_node(gm, "linear"))
    assert b.time_s == pytest.approx(max(a.compute_s / 0.5 + 3e-6, a.memory_s + 2e-6, ideal.launch_overhead_s))
    cpu = dataclasses.replace(ideal, kind="cpu")
    r = CostModel(cpu).node_cost(_node(gm, "relu"))
    assert r.time_s == pytest.approx(max(r.compute_s, r.memory_s) + cpu.launch_overhead_s)
    conv = nn.Conv2d(64, 64, 3, padding=1).eval().to(torch.bfloat16)
    gc = capture(conv, (torch.randn(64, 64, 56, 56, dtype=torch.bfloat16).to(memory_format=torch.channels_last),))
    slow_conv = dataclasses.replace(ideal, conv_scale=0.25, conv_fixed_s=0.0)
    c0 = CostModel(ideal).node_cost(_node(gc, "conv2d"))
    c1 = CostModel(slow_conv).node_cost(_node(gc, "conv2d"))
    assert float(c1.time_s) > float(c0.time_s)
    assert CostModel(slow_conv).node_cost(_node(gm, "linear")).time_s == a.time_s  # GEMMs untouched


def test_unfused_conv_and_pooling_calibration():
    """An aten convolution on a GPU runs conv_unfused_slowdown times slower than the fused op the
    conv fit measured; pooling reaches op_efficiency["pool"]["memory_scale"] of the copy rate."""
    from graphopt.cuda_ext import conv_bias_relu

    x = torch.randn(64, 64, 56, 56, dtype=torch.bfloat16).to(memory_format=torch.channels_last)

    class ConvPool(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(64, 64, 3, padding=1).to(torch.bfloat16)

        def forward(self, x):
            a = self.conv(x)
            b = conv_bias_relu(x, self.conv.weight, self.conv.bias, None, (1, 1), (1, 1))
            return torch.nn.functional.max_pool2d(a + b, 3, 2, 1)

    gm = capture(ConvPool().eval(), (x,))
    base = dataclasses.replace(_h200(), conv_scale=0.5, conv_fixed_s=0.0, kernel_fixed_s=0.0, conv_unfused_slowdown=1.0,
                               conv_memory_scale=None).with_efficiency("pool", None)
    cal = dataclasses.replace(base, conv_unfused_slowdown=2.0).with_efficiency("pool", {"memory_scale": 0.25})
    plain, fused, pool = (_node(gm, k) for k in ("conv2d", "conv_bias_relu", "max_pool2d"))
    c0, c1 = CostModel(base), CostModel(cal)
    # aten's bias kernel after the convolution is priced on its own (conv_bias_add_scale)
    bias_add = float(conv_bias_add_s(base, plain))
    assert bias_add > 0 and conv_bias_add_s(base, fused) == 0.0
    assert c1.node_cost(plain).time_s - bias_add == pytest.approx(2 * (c0.node_cost(plain).time_s - bias_add))
    assert c1.node_cost(fused).time_s == pytest.approx(c0.node_cost(fused).time_s)
    assert c1.node_cost(pool).time_s == pytest.approx(4 * c0.node_cost(pool).time_s)
    # the CPU profile has no fused kernels to compare with: aten convolutions are what it measured
    cpu = dataclasses.replace(cal, kind="cpu")
    assert CostModel(cpu).node_cost(plain).compute_s == pytest.approx(c0.node_cost(plain).compute_s)


def test_inference_batch_norm_at_its_measured_rate_per_layout():
    """aten's BatchNorm in inference reaches op_efficiency["batch_norm"]'s fraction of the copy rate
    for its input's layout (memory_scale NCHW, memory_scale_cl channels_last); in training, or on a
    profile that has not measured it, it is priced at the copy rate."""
    x = torch.randn(16, 64, 28, 28, dtype=torch.bfloat16)
    bn = nn.BatchNorm2d(64).to(torch.bfloat16)
    graphs = {"nchw": capture(bn.eval(), (x,)), "cl": capture(bn.eval(), (x.to(memory_format=torch.channels_last),)),
              "train": capture(bn.train(), (x,), inference=False)}
    base = dataclasses.replace(_h200(), kernel_fixed_s=0.0).with_efficiency("batch_norm", None)
    cal = base.with_efficiency("batch_norm", {"memory_scale": 0.25, "memory_scale_cl": 0.5})
    c0, c1 = CostModel(base), CostModel(cal)
    for layout, factor in (("nchw", 4), ("cl", 2), ("train", 1)):
        node = next(n for n in graphs[layout].graph.nodes if "batch_norm" in str(n.target))
        assert c1.node_cost(node).memory_s == pytest.approx(factor * c0.node_cost(node).memory_s), layout
        assert c1.slow_aten_batch_norm(node) == (layout != "train") and not c0.slow_aten_batch_norm(node)


def test_conv_bias_add_and_narrow_input_pricing():
    """aten's separate bias kernel costs 2 x the output at conv_bias_add_scale of the copy rate; a
    channels_last convolution over 3 channels (ResNet's stem) pays conv_narrow_input_slowdown, one
    over 8 does not, and neither applies on the CPU."""
    x3 = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    x8 = torch.randn(2, 8, 32, 32).to(memory_format=torch.channels_last)
    g3 = capture(nn.Conv2d(3, 16, 7, 2, 3).eval().to(memory_format=torch.channels_last), (x3,))
    g8 = capture(nn.Conv2d(8, 16, 7, 2, 3).eval().to(memory_format=torch.channels_last), (x8,))
    c3, c8 = _node(g3, "conv2d"), _node(g8, "conv2d")
    base = dataclasses.replace(_h200(), conv_bias_add_scale=1.0, conv_narrow_input_slowdown=1.0)
    slow = dataclasses.replace(base, conv_bias_add_scale=0.25, conv_narrow_input_slowdown=9.0)
    out_bytes = 2 * 16 * 16 * 16 * 4
    assert float(conv_bias_add_s(base, c8)) == pytest.approx(2 * out_bytes / base.bandwidth + base.kernel_fixed_s)
    assert float(conv_bias_add_s(slow, c8)) == pytest.approx(2 * out_bytes / (0.25 * base.bandwidth) + base.kernel_fixed_s)
    # device time (node_times, the queue model's): the conv fit x the slowdown, plus the bias kernel
    conv_only = lambda prof, n: float(CostModel(prof).node_times(n)[1]) - float(conv_bias_add_s(prof, n))  # noqa: E731
    assert conv_only(slow, c3) == pytest.approx(9.0 * conv_only(base, c3))
    assert conv_only(slow, c8) == pytest.approx(conv_only(base, c8))
    # the bias add is a kernel of its own: one more launch, and at least a launch's time
    nc = CostModel(slow).node_cost(c8)
    assert nc.launches == 2 and nc.time_s >= 2 * slow.launch_overhead_s
    cpu = dataclasses.replace(slow, kind="cpu")
    assert conv_bias_add_s(cpu, c8) == 0.0
    assert CostModel(cpu).node_cost(c3).time_s == pytest.approx(CostModel(dataclasses.replace(base, kind="cpu"))
                                                                .node_cost(c3).time_s)


def test_conv_channel_chunk():
    """cuDNN steps conv_channel_chunk input channels per kernel tap: an ungrouped convolution over
    16 channels runs its compute at 16/64 of the rate; 64 channels, a grouped convolution, the CPU
    and a profile without a chunk are unaffected."""
    from graphopt.cost.model import conv_channel_padding

    def conv(cin, groups=1):
        x = torch.randn(2, cin, 16, 16).to(memory_format=torch.channels_last)
        m = nn.Conv2d(cin, 64, 3, padding=1, groups=groups, bias=False).eval().to(memory_format=torch.channels_last)
        return _node(capture(m, (x,)), "conv2d")

    on = dataclasses.replace(_h200(), conv_channel_chunk=64)
    off = dataclasses.replace(on, conv_channel_chunk=0)
    c16, c64, g16 = conv(16), conv(64), conv(16, groups=16)
    assert conv_channel_padding(c16, on) == 4.0 and conv_channel_padding(c64, on) == 1.0
    assert conv_channel_padding(g16, on) == 1.0 and conv_channel_padding(c16, off) == 1.0
    assert CostModel(on).node_cost(c16).compute_s == pytest.approx(4 * CostModel(off).node_cost(c16).compute_s)
    cpu = dataclasses.replace(on, kind="cpu")
    assert CostModel(cpu).node_cost(c16).compute_s == pytest.approx(
        CostModel(dataclasses.replace(cpu, conv_channel_chunk=0)).node_cost(c16).compute_s)


def test_narrow_copies_and_strided_conv_bytes():
    """A copy whose input comes in runs under 16 bytes (the space-to-depth regrouping) is priced
    at narrow_copy_scale of the bandwidth; a plain or a head-transposing copy is not. A 1x1
    stride-2 convolution reads a quarter of its input."""
    from graphopt.cost.model import narrow_copy

    class Regroup(nn.Module):
        def forward(self, x, y):
            a = x.view(2, 5, 2, 5, 2, 4).permute(0, 1, 3, 2, 4, 5).contiguous()  # 8-byte runs
            b = y.transpose(1, 2).contiguous()  # [B, S, H, 128] <- [B, H, S, 128]: 256-byte runs
            return a, b, x.clone()

    x = torch.randn(2, 10, 10, 4, dtype=torch.bfloat16)
    y = torch.randn(2, 4, 6, 128, dtype=torch.bfloat16)
    gm = capture(Regroup(), (x, y))
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).split(".")[-2]
              in ("clone", "contiguous")]
    assert [narrow_copy(n) for n in copies] == [True, False, False]
    fast = dataclasses.replace(_h200(), narrow_copy_scale=1.0, conv_bias_add_scale=1.0)  # (no strided rate either)
    slow = dataclasses.replace(fast, narrow_copy_scale=0.25)
    assert CostModel(slow).node_cost(copies[0]).memory_s == pytest.approx(4 * CostModel(fast).node_cost(copies[0]).memory_s)
    assert CostModel(slow).node_cost(copies[1]).memory_s == pytest.approx(CostModel(fast).node_cost(copies[1]).memory_s)

    xs = torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last)
    down = _node(capture(nn.Conv2d(16, 32, 1, stride=2, bias=False).eval(), (xs,)), "conv2d")
    same = _node(capture(nn.Conv2d(16, 32, 1, stride=1, bias=False).eval(), (xs,)), "conv2d")
    _, b_down, _, _ = CostModel(_h200()).flops_bytes(down)
    _, b_same, _, _ = CostModel(_h200()).flops_bytes(same)
    w_bytes, x_bytes = 32 * 16 * 4, 2 * 16 * 8 * 8 * 4
    assert b_down == x_bytes // 4 + w_bytes + 2 * 32 * 4 * 4 * 4
    assert b_same == x_bytes + w_bytes + 2 * 32 * 8 * 8 * 4


def test_conv_flops():
    m = nn.Conv2d(16, 32, 3, padding=1, groups=2).eval()
    gm = capture(m, (torch.randn(2, 16, 8, 8),))
    c = CostModel(_h200()).node_cost(_node(gm, "conv2d"))
    assert c.flops == 2 * (2 * 32 * 8 * 8) * (16 // 2 * 3 * 3)


def test_bound_classification_big_matmul_is_compute_bound():
    gm = capture(Lin(4096, 4096).eval().to(torch.bfloat16), (torch.randn(8192, 4096, dtype=torch.bfloat16),))
    c = CostModel(_h200()).node_cost(_node(gm, "linear"))
    assert c.bound == "compute"
    assert c.compute_s == pytest.approx(2 * 8192 * 4096 * 4096 / 776e12)


def test_roofline_floor_at_the_sustained_gemm_rate():
    """The H200 sustains ~86% of its burst GEMM rate under its power limit: the floor at that rate
    divides the matmul part by the fraction and leaves the rest; unmeasured (1.0), there is none."""
    gm = capture(Lin(4096, 4096).eval().to(torch.bfloat16), (torch.randn(8192, 4096, dtype=torch.bfloat16),))
    h200 = _h200()
    assert 0.5 < h200.matmul_sustained_fraction < 1
    cost = CostModel(h200).graph_cost(gm)
    mm = 2 * 8192 * 4096 * 4096 / 776e12
    assert cost.roofline_floor_s >= mm
    assert cost.roofline_floor_sustained_s == pytest.approx(
        cost.roofline_floor_s + mm * (1 / h200.matmul_sustained_fraction - 1), rel=1e-6)
    assert cost.as_dict()["roofline_floor_sustained_ms"] == pytest.approx(cost.roofline_floor_sustained_s * 1e3)
    burst = CostModel(dataclasses.replace(h200, matmul_sustained_fraction=1.0)).graph_cost(gm)
    assert burst.roofline_floor_sustained_s is None and burst.as_dict()["roofline_floor_sustained_ms"] is None
    assert burst.roofline_floor_s == pytest.approx(cost.roofline_floor_s)


def test_launch_bound_tiny_graph():
    gm = capture(Lin(8, 8).eval(), (torch.randn(2, 8),))
    cost = CostModel(_h200()).graph_cost(gm)
    assert cost.bound_share["launch"] > 0.9
    assert cost.launches == 2


def test_symbolic_shapes_give_sympy_formulas():
    gm = capture(Lin().eval(), (torch.randn(64, 256),), dynamic={"x": {0: "batch"}})
    cm = CostModel(_h200())
    lin = cm.node_cost(_node(gm, "linear"))
    assert isinstance(lin.flops, sympy.Expr)
    (sym,) = lin.flops.free_symbols
    assert lin.flops.subs(sym, 10) == 2 * 10 * 512 * 256
    total = cm.graph_cost(gm)
    assert total.symbolic_total is not None
    assert total.flops == 2 * 64 * 512 * 256 + 64 * 512  # linear + relu, at the example size


def test_roofline_floor_and_peak_memory():
    gm = capture(Lin().eval(), (torch.randn(64, 256),))
    cost = CostModel(_h200()).graph_cost(gm)
    assert 0 < cost.roofline_floor_s <= cost.total_s
    params = 4 * (512 * 256 + 512)
    assert cost.parameter_bytes == params
    # live at once: x, linear out, relu out
    assert cost.peak_memory_bytes == params + 4 * (64 * 256 + 64 * 512 + 64 * 512)


def test_views_are_free():
    class V(nn.Module):
        def forward(self, x):
            return x.view(4, -1).t().unsqueeze(0)

    gm = capture(V(), (torch.randn(8, 8),))
    cost = CostModel(_h200()).graph_cost(gm)
    assert cost.launches == 0 and cost.total_s == 0


def test_cpu_profile_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    p1, _ = get_profile("cpu")
    assert p1.kind == "cpu" and p1.bandwidth > 1e8 and p1.peak_flops["float32"] > 1e8
    assert list(tmp_path.glob("cpu-*.json"))
    from graphopt.cost import profiles

    # the probe matmul as fast as when measured (a machine that got quieter in between re-measures:
    # stale_cpu_profile; the suite's other workers move the load between the two calls)
    monkeypatch.setattr(profiles, "_matmul_rate", lambda: p1.peak_flops["float32"])
    p2, _ = get_profile("cpu")
    assert p2.bandwidth == p1.bandwidth  # read back from the cache


def test_a_gpu_without_a_profile_is_planned_with_h200s_scaled_to_it():
    """An H100 SXM (HBM3 at 2619 MHz on a 5120-bit bus, 132 SMs at 1980 MHz) as CUDA reports it: the
    h200 profile's copy rate scaled by 3.35 / 4.8 TB/s, its arithmetic unchanged, its fixed costs kept;
    a device that reports no memory clock is left unscaled, with the reason."""
    from types import SimpleNamespace

    from graphopt.cost.profiles import scaled_to_device

    h200 = _h200()
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000, memory_bus_width=5120,
                           multi_processor_count=132, clock_rate=1_980_000, total_memory=80 * 2**30)
    prof, how = scaled_to_device(h200, h100)
    assert prof.bandwidth == pytest.approx(h200.bandwidth * 3.352e12 / 4.8e12, rel=1e-3)
    assert prof.peak_flops == h200.peak_flops and prof.launch_overhead_s == h200.launch_overhead_s
    assert prof.op_efficiency == h200.op_efficiency and "x0.698" in how and "H100" in prof.name
    gm = capture(Lin(4096, 4096).eval(), (torch.randn(8, 4096),))  # a weight stream: memory-bound
    assert CostModel(prof).graph_cost(gm).total_s > 1.2 * CostModel(h200).graph_cost(gm).total_s
    none, why = scaled_to_device(h200, SimpleNamespace(name="x", memory_clock_rate=0, memory_bus_width=0,
                                                       multi_processor_count=0, clock_rate=0, total_memory=0))
    assert none is None and "reports no memory clock" in why


def test_custom_profile_object():
    prof = DeviceProfile(name="toy", kind="cuda", peak_flops={"float32": 1e12}, elementwise_flops=1e11,
                         bandwidth=1e11, launch_overhead_s=1e-5, memory_bytes=1e9)
    gm = capture(Lin().eval(), (torch.randn(64, 256),))
    fast = CostModel(_h200()).graph_cost(gm).total_s
    slow = CostModel(prof).graph_cost(gm).total_s
    assert slow > fast


def test_row_per_block_norms_priced_by_rows():
    """A LayerNorm over narrow rows costs at least rows * op_efficiency["row_norm"]["row_s"] on a
    profile that measured it; the same node on a profile without it is priced by its bytes alone."""
    m = nn.LayerNorm(96).eval()
    x = torch.randn(64, 56, 56, 96)
    gm = capture(m, (x,))
    ln = next(n for n in gm.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target))
    h200 = get_profile("h200")[0]
    row_s = h200.efficiency("row_norm", "row_s")
    assert row_s > 0
    rows = 64 * 56 * 56
    t = CostModel(h200).node_cost(ln).time_s
    assert t == pytest.approx(rows * row_s)
    plain = h200.with_efficiency("row_norm", None)
    assert CostModel(plain).node_cost(ln).time_s < t / 3


def test_node_prices_are_memoized_until_a_node_or_its_inputs_change(monkeypatch):
    from graphopt import ir

    gm = capture(Lin().eval(), (torch.randn(64, 256),))
    cm = CostModel(_h200())
    first = cm.graph_cost(gm)
    calls = []
    orig = CostModel._flops_bytes
    monkeypatch.setattr(CostModel, "_flops_bytes",  # ops only: placeholders and attributes cost nothing to price
                        lambda self, n: (n.op == "call_function" and calls.append(n.name)) or orig(self, n))
    again = cm.graph_cost(gm)
    assert calls == [] and again.total_s == first.total_s and again.peak_memory_bytes == first.peak_memory_bytes
    # the linear's input becomes bf16: the linear, and only what reads changed values, is priced again
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    lin = _node(gm, "linear")
    with gm.graph.inserting_after(x):
        cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    lin.replace_input_with(x, cast)
    for a in [n for n in lin.all_input_nodes if n.op == "get_attr"]:  # the parameters follow, as assign_precision would
        name = ir.register_constant(gm, a.target + "_bf16", ir.get_attr_value(gm, a.target).to(torch.bfloat16))
        with gm.graph.inserting_after(a):
            b = gm.graph.get_attr(name)
        lin.replace_input_with(a, b)
    gm.recompile()
    ir.repropagate(gm)
    calls.clear()
    changed = cm.graph_cost(gm)
    assert "linear" in calls and "relu" in calls  # relu reads the linear's new (bf16) value
    fresh = CostModel(_h200()).graph_cost(gm)
    assert [(c.node, c.bytes, c.time_s) for c in changed.nodes] == [(c.node, c.bytes, c.time_s) for c in fresh.nodes]
    assert changed.total_s == fresh.total_s
    lin_bytes = lambda g: next(c.bytes for c in g.nodes if c.node == "linear")  # noqa: E731
    assert lin_bytes(changed) < lin_bytes(first)  # bf16 operands


def test_memo_compares_symbolic_sizes_by_identity_only():
    """Comparing SymInts with == would consult (and may add guards to) the shape environment."""
    from graphopt.cost.model import _same_arg

    gm = capture(Lin().eval(), (torch.randn(8, 256),), dynamic={"x": {0: "batch"}})
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    s = x.meta["val"].shape[0]
    env = s.node.shape_env
    guards = len(env.guards)
    other = s * 1 + 0
    assert _same_arg([s, 4], [s, 4]) and not _same_arg([s], [s + 1]) and not _same_arg((s,), [s])
    assert _same_arg({"a": 1.0}, {"a": 1.0}) and not _same_arg({"a": 1}, {"a": 1.0})
    assert len(env.guards) == guards and isinstance(other, torch.SymInt)


class TinyDecoderStep(nn.Module):
    """A decode step's weight traffic: one token's embedding row, two SwiGLU blocks, the LM head."""

    def __init__(self, vocab=8192, hidden=256, ffn=512):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Linear(hidden, 2 * ffn, bias=False),
                                                   nn.Linear(ffn, hidden, bias=False)]) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for up, down in self.blocks:
            g, u = up(h).chunk(2, -1)
            h = h + down(torch.nn.functional.silu(g) * u)
        return self.head(h)


def test_a_one_token_projection_is_priced_as_its_weight_read():
    gm = capture(Lin(4096, 4096).eval().to(torch.bfloat16), (torch.randn(1, 4096, dtype=torch.bfloat16),))
    p = _h200()
    c = CostModel(p).node_cost(_node(gm, "linear"))
    weights = 2 * (4096 * 4096 + 4096)
    assert c.bound == "memory" and weights < c.bytes < 1.01 * weights
    small_m = p.op_efficiency["small_m_linear"]  # cuBLAS at a few rows, as measured on the device
    assert c.time_s == pytest.approx(c.bytes / (p.bandwidth * small_m["memory_scale"]) + small_m["fixed_s"])
    plain = CostModel(p.with_efficiency("small_m_linear", None)).node_cost(_node(gm, "linear"))
    assert plain.time_s == pytest.approx(c.bytes / p.bandwidth + p.kernel_fixed_s)


def test_explain_on_a_decode_step_shows_the_weight_read_floor():
    """The floor of a one-token step is the weights it reads: the embedding's one row, not its table."""
    import graphopt

    model = TinyDecoderStep().eval().to(torch.bfloat16)
    ids = torch.tensor([[17]])
    report = graphopt.explain(model, (ids,), target="h200", check_accuracy=False)
    p = _h200()
    table = 8192 * 256 * 2
    read = sum(t.numel() * 2 for n, t in model.named_parameters() if not n.startswith("emb")) + 256 * 2
    floor = report.cost_after["roofline_floor_ms"] / 1e3
    outputs = 8192 * 2
    assert floor == pytest.approx((read + 8 + outputs) / p.bandwidth, rel=1e-3)
    assert floor < (read + table) / p.bandwidth
    gm = capture(model, (ids,))
    cost = CostModel(p).graph_cost(gm)
    assert cost.parameter_bytes == read - 256 * 2 + table  # memory still holds the whole table


def test_a_rewrite_is_priced_as_the_nodes_it_makes_before_it_makes_them():
    """CostModel.replacement builds a rewrite's nodes in a scratch graph (values by fake-tensor
    propagation, symbolic sizes kept) and prices them as it prices the graph afterwards; scratch
    nodes are not memoized."""
    from graphopt import ir

    aten = torch.ops.aten
    gm = capture(Lin().eval(), (torch.randn(64, 256),))
    cm = CostModel(_h200())
    hints = ir.shape_hints(gm)
    lin = _node(gm, "linear")
    x, w, b = lin.args
    assert cm.price(aten.linear.default, x, w, b, hints=hints) == cm.time_of([lin], hints)
    memo = len(cm._memo)
    r = cm.replacement(hints)
    w2 = r.tensor((1024, 256), torch.float32, "cpu")  # a weight the rewrite would make: twice the rows
    y = r.call(aten.linear.default, x, w2)
    r.call(aten.relu.default, y)
    assert [tuple(n.meta["val"].shape) for n in r.nodes] == [(64, 1024), (64, 1024)]
    assert r.time() == cm.time_of(r.nodes, hints) > cm.time_of([lin], hints)
    assert len(cm._memo) == memo  # the scratch nodes left nothing behind
    img = capture(nn.Conv2d(3, 8, 3).eval(), (torch.randn(1, 3, 16, 16),))
    xi = next(n for n in img.graph.nodes if n.op == "placeholder")
    cl = cm.replacement().like(xi, memory_format=torch.channels_last)  # a value in another layout, not priced
    assert cl.meta["val"].is_contiguous(memory_format=torch.channels_last)


def test_a_symbolic_replacement_keeps_its_sizes_symbolic():
    from graphopt import ir

    gm = capture(Lin().eval(), (torch.randn(8, 256),), dynamic={"x": {0: "batch"}})
    lin = _node(gm, "linear")
    cm = CostModel(_h200())
    r = cm.replacement(ir.shape_hints(gm))
    y = r.call(torch.ops.aten.linear.default, *lin.args)
    assert ir.info(y).symbolic
    assert r.time() == cm.time_of([lin], ir.shape_hints(gm))


def test_operands_read_by_position_when_one_tensor_is_passed_twice():
    """sdpa(x, x, x) and mm(x, x): operands are read by position (ir.operand_infos), the bytes
    count each tensor once (ir.arg_infos)."""

    class SelfAttn(nn.Module):
        def forward(self, x, y):
            return torch.nn.functional.scaled_dot_product_attention(x, x, x) + torch.mm(y, y).sum()

    x, y = torch.randn(1, 2, 4, 8), torch.randn(8, 8)
    gm = capture(SelfAttn().eval(), (x, y))
    cm = CostModel(_h200())
    sd = _node(gm, "scaled_dot_product_attention")
    c = cm.node_cost(sd)
    assert c.flops == 4 * 2 * 4 * 4 * 8
    assert c.bytes == 4 * 2 * (1 * 2 * 4 * 8)  # x read once, out written once
    mm = cm.node_cost(_node(gm, "aten.mm"))
    assert mm.flops == 2 * 8 * 8 * 8


def test_a_cpu_profile_measured_under_load_is_measured_again(tmp_path, monkeypatch):
    """A cached profile whose matmul rate is far below what the machine does now was measured while
    other work shared the cores: cpu_profile() measures again and replaces the cache. One that
    matches the machine is read back as it is. The profile says when it was measured."""
    import json

    from graphopt.cost import profiles

    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    first = profiles.cpu_profile()
    assert "measured 20" in first.description and first.source["measured_at"] > 0
    (path,) = tmp_path.glob("cpu-*.json")
    # the machine's matmul rate now: the one measured, up to noise (a probe of its own would depend
    # on what else runs beside the test)
    monkeypatch.setattr(profiles, "_matmul_rate", lambda *a, **k: first.peak_flops["float32"] * 1.5)
    calls = []
    real = profiles.calibrate_cpu
    monkeypatch.setattr(profiles, "calibrate_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert profiles.cpu_profile().peak_flops == first.peak_flops and not calls  # within 2x of the machine: kept
    data = json.loads(path.read_text())
    data["peak_flops"]["float32"] /= 20  # as if measured while the cores were busy
    path.write_text(json.dumps(data))
    assert "runs at" in profiles.stale_cpu_profile(profiles._load_json(path))
    again = profiles.cpu_profile()
    assert calls == [1] and again.peak_flops["float32"] > 5 * data["peak_flops"]["float32"]
    assert json.loads(path.read_text())["peak_flops"]["float32"] == again.peak_flops["float32"]


class ChannelScale(torch.nn.Module):
    def forward(self, x, s):
        return x * s  # squeeze-and-excitation's per-channel scale


def test_a_broadcast_is_priced_at_the_strided_kernels_rate():
    """aten vectorizes a pointwise op only where every operand is laid out as its output is: one that
    broadcasts an operand (into a channels_last or an NCHW output) runs in the strided kernel a
    convolution's bias add runs in, its memory time over the profile's conv_bias_add_scale; with
    operands of one shape and layout it is a plain streaming kernel. broadcast_channels_last (the
    case fuse_channels_last_broadcasts takes) names the channels_last one only."""
    from graphopt.cost.model import broadcast_channels_last, strided_elementwise

    p = _h200()
    x, s = torch.randn(8, 64, 28, 28), torch.randn(8, 64, 1, 1)
    cl = capture(ChannelScale(), (x.contiguous(memory_format=torch.channels_last), s))
    nchw = capture(ChannelScale(), (x, s))
    same = capture(ChannelScale(), (x.contiguous(memory_format=torch.channels_last),
                                    torch.randn(8, 64, 28, 28).contiguous(memory_format=torch.channels_last)))
    a, b, c = (_node(g, "mul") for g in (cl, nchw, same))
    assert broadcast_channels_last(a) and not broadcast_channels_last(b) and not broadcast_channels_last(c)
    assert [strided_elementwise(n, "pointwise") for n in (a, b, c)] == [True, True, False]
    flat = dataclasses.replace(p, conv_bias_add_scale=1.0)
    for n in (a, b):
        assert CostModel(p).node_cost(n).memory_s == pytest.approx(
            CostModel(flat).node_cost(n).memory_s / p.conv_bias_add_scale)
    assert CostModel(p).node_cost(c).memory_s == pytest.approx(CostModel(flat).node_cost(c).memory_s)


class FactorAttention(nn.Module):
    """CoaT's factorized attention, its softmax over the tokens of k ([B, H, N, D] read from the qkv
    projection's [B, N, 3, H, D]), and a product of two differently strided operands."""

    def forward(self, qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        ks = k.softmax(dim=2)
        return q * v.transpose(-1, -2).contiguous().transpose(-1, -2), ks, v.softmax(dim=-1), q.contiguous()


def test_spatial_softmax_implicit_copies_and_strided_reads_are_priced():
    """CoaT's softmax over a dim with elements after it runs aten's spatial kernel (at the profile's
    spatial_softmax rate) after a copy of its non-contiguous input (a kernel of its own at the strided
    rate); the product of two operands strided unlike each other and the contiguous() of a permuted
    view run the strided kernel; a softmax over the last dim takes no spatial rate (but still copies
    its strided input). On the CPU none of this applies."""
    from graphopt.cost.model import implicit_copy_bytes, input_copy_s, spatial_softmax, strided_elementwise

    p = _h200()
    qkv = torch.randn(2, 50, 3, 4, 8, dtype=torch.bfloat16)
    gm = capture(FactorAttention(), (qkv,))
    sm = [n for n in gm.graph.nodes if n.op == "call_function" and "softmax" in str(n.target)]
    assert [spatial_softmax(n) for n in sm] == [True, False]
    nbytes = 2 * 50 * 4 * 8 * 2  # k read and written by the copy
    assert [implicit_copy_bytes(n) for n in sm] == [2 * nbytes, 2 * nbytes]
    k_cost, flat = CostModel(p).node_cost(sm[0]), dataclasses.replace(
        p, op_efficiency={k: v for k, v in p.op_efficiency.items() if k != "spatial_softmax"})
    plain = CostModel(flat).node_cost(sm[0])
    assert k_cost.memory_s == pytest.approx(plain.memory_s / p.efficiency("spatial_softmax", "memory_scale"))
    assert k_cost.launches == 2  # the input copy, a kernel of its own
    host, dev = CostModel(p).node_times(sm[0])  # (the queue model's times carry the copy too)
    copy_dev = p.gpu_seconds(0.0, input_copy_s(p, implicit_copy_bytes(sm[0])))
    assert copy_dev > 0 and dev == pytest.approx(p.gpu_seconds(k_cost.compute_s, k_cost.memory_s) + copy_dev)
    mul = _node(gm, "aten.mul")
    assert strided_elementwise(mul, "pointwise")
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and ("clone" in str(n.target)
                                                                         or "contiguous" in str(n.target))]
    assert copies and all(strided_elementwise(n, CostModel(p).flops_bytes(n)[3]) for n in copies)
    cpu = get_profile("cpu")[0]
    assert CostModel(cpu).node_cost(sm[0]).launches == 1


class SliceConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x):
        return self.conv(x[:, :8]), self.conv(x[:, 8:16].contiguous(memory_format=torch.channels_last))


def test_a_convolution_of_a_channel_slice_pays_the_copy_aten_makes():
    """A channel slice of a channels_last tensor is dense in no memory format: aten copies it before
    cuDNN's convolution (CoaT's split of its value heads into three depthwise convolutions), and so
    does graphopt::conv_bias_relu's cuDNN call (its price declares the copy: OpCost.copy_bytes)."""
    from graphopt.cost.model import implicit_copy_bytes

    x = torch.randn(2, 24, 6, 6).contiguous(memory_format=torch.channels_last)
    gm = capture(SliceConv().eval(), (x,))
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    assert [implicit_copy_bytes(n) for n in convs] == [2 * 2 * 8 * 6 * 6 * 4, 0.0]
    big = torch.randn(64, 24, 112, 112).contiguous(memory_format=torch.channels_last)  # (past the launch time)
    fused = capture(FusedSliceConv(), (big,))  # graphopt::conv_bias_relu calls cuDNN through aten alike
    (conv,) = [n for n in fused.graph.nodes if n.op == "call_function" and "conv_bias_relu" in str(n.target)]
    assert implicit_copy_bytes(conv) == 0.0  # (aten's rule; our op declares its copy in its own price)
    assert CostModel(_h200()).op_cost(conv).copy_bytes == 2 * 64 * 8 * 112 * 112 * 4
    cm, flat = CostModel(_h200()), CostModel(dataclasses.replace(_h200(), conv_bias_add_scale=1e9))
    assert cm.node_cost(conv).launches == 2 and cm.node_cost(conv).time_s > flat.node_cost(conv).time_s


class FusedSliceConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 1, 3, 3)), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.ops.graphopt.conv_bias_relu(x[:, :8], self.w, self.b, None, [1, 1], [1, 1], [1, 1], 8)


def test_sdpa_no_fused_kernel_takes_is_priced_as_the_math_kernel():
    """K/V broadcast over q's heads (without enable_gqa) or over its batch: CUDA's fused SDPA kernels
    take neither, the math kernel runs it (fp32 products, the scores written out), priced so; the
    same call with enable_gqa is a fused kernel again."""
    from graphopt.cost.model import sdpa_math_reason

    class Sdpa(nn.Module):
        def __init__(self, gqa):
            super().__init__()
            self.gqa = gqa

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)

    cm = CostModel(_h200())
    q = torch.randn(8, 32, 512, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.randn(8, 1, 512, 128, dtype=torch.bfloat16, device="meta")
    times = {}
    for name, gqa, k in [("broadcast", False, kv), ("gqa", True, kv), ("batch", True, kv[:1])]:
        gm = capture(Sdpa(gqa), (q, k, k))
        node = _node(gm, "scaled_dot_product_attention")
        times[name], why = cm.node_cost(node).time_s, sdpa_math_reason(node)
        assert (why is None) == (name == "gqa"), (name, why)
        assert name == "gqa" or ("without enable_gqa" if name == "broadcast" else "batch") in why
    # measured on the H200 (op_efficiency sdpa_math): 1.895 ms broadcast, 0.055 ms with enable_gqa
    assert 1.3e-3 < times["broadcast"] < 2.5e-3 and times["gqa"] < 0.1e-3
    # q, k, v of five dims (NesT's [B, H, blocks, S, D]): no fused kernel takes them either
    q5 = torch.randn(2, 4, 32, 512, 128, dtype=torch.bfloat16, device="meta")
    node5 = _node(capture(Sdpa(False), (q5, q5, q5)), "scaled_dot_product_attention")
    node4 = _node(capture(Sdpa(False), (q5[0], q5[0], q5[0])), "scaled_dot_product_attention")
    assert "4-D" in sdpa_math_reason(node5) and sdpa_math_reason(node4) is None
    assert cm.node_cost(node5).time_s > 5 * 2 * cm.node_cost(node4).time_s


def test_attention_over_many_tiny_heads_takes_at_least_its_waves_of_programs():
    """SDPA runs a program per batch x head x 128 queries, one per SM at a time: 50176 heads of 16
    positions (TNT's pixels) take 380 waves (964 us measured on an H100), whatever their few flops;
    the one-tile kernel holds 16 programs of 4 warps per SM (91 us measured). Without the profile's
    wave times the floors are gone."""
    from graphopt.cuda_ext.ops.short_attention import layout

    class Sdpa(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    prof = _h200()
    q = torch.randn(12544, 4, 16, 6, dtype=torch.bfloat16, device="meta")
    node = _node(capture(Sdpa(), (q, q, q)), "scaled_dot_product_attention")
    sdpa = CostModel(prof).node_cost(node).time_s
    assert sdpa == pytest.approx(380 * prof.attention_wave_s, rel=0.05)
    _, replayed = CostModel(prof).node_times(node, replayed=True)  # a device floor: inside a CUDA graph too
    assert replayed == pytest.approx(380 * prof.attention_wave_s, rel=0.05)
    assert CostModel(dataclasses.replace(prof, attention_wave_s=0.0)).node_cost(node).time_s < sdpa / 5
    args = list(node.args[:3]) + [None, 6 ** -0.5, False]
    short = CostModel(prof).price(torch.ops.graphopt.short_attention.default, *args, val=layout(q))
    assert short == pytest.approx(24 * prof.efficiency("short_attention", "wave_s"), rel=0.05)
    bare = prof.with_efficiency("short_attention", {k: v for k, v in prof.op_efficiency["short_attention"].items()
                                                    if k != "wave_s"})
    assert CostModel(bare).price(torch.ops.graphopt.short_attention.default, *args, val=layout(q)) < short / 2


class ReshapeAs(nn.Module):
    def forward(self, x, like):
        return x.reshape_as(like), x.t().reshape_as(like)


def test_reshape_as_is_a_view_where_reshape_is_one():
    """reshape_as prices as reshape does: free where the input's layout lets it be a view (LeViT's
    batch norms read back as [B, N, C]; before, every one was priced as a copy), a strided copy where
    it is not."""
    gm = capture(ReshapeAs(), (torch.randn(24, 16, dtype=torch.bfloat16), torch.randn(2, 12, 16)))
    view, copy = [n for n in gm.graph.nodes if n.op == "call_function" and "reshape" in str(n.target)]
    cm = CostModel(_h200())
    assert cm.node_cost(view).time_s == 0 and cm.flops_bytes(view)[3] == "free"
    assert cm.node_cost(copy).time_s > 0 and cm.flops_bytes(copy)[3] == "copy"


class Depthwise(nn.Module):
    def __init__(self, k=(7, 7), groups=64):
        super().__init__()
        self.conv = nn.Conv2d(64, 64, k, padding=(k[0] // 2, k[1] // 2), groups=groups, bias=False)

    def forward(self, x):
        return self.conv(x)


def test_depthwise_convolutions_compute_at_the_depthwise_rate():
    """A depthwise convolution over a channels_last input runs cuDNN's depthwise kernel on CUDA
    cores: its device time is at least its FLOPs at op_efficiency["depthwise_conv"]'s scale of the
    elementwise rate (nonsquare_scale for a band kernel); an NCHW one is held to the same rate (aten's
    own NCHW kernel is slower still), so the layout choice is not tilted; a grouped one of 2 channels
    a group keeps the conv fit."""
    from graphopt.cost.model import conv_device_s, depthwise_conv_s

    p = _h200()
    cl = torch.randn(64, 64, 56, 56).contiguous(memory_format=torch.channels_last)
    dw = capture(Depthwise().eval(), (cl,))
    band = capture(Depthwise((1, 11)).eval(), (cl,))
    nchw = capture(Depthwise().eval(), (torch.randn(64, 64, 56, 56),))
    grouped = capture(Depthwise(groups=32).eval(), (cl,))
    a, b, c, d = (_node(g, "conv") for g in (dw, band, nchw, grouped))
    flops = 2 * 64 * 64 * 56 * 56 * 49
    e = p.op_efficiency["depthwise_conv"]
    assert depthwise_conv_s(p, a) == pytest.approx(flops / (p.elementwise_flops * e["scale"]) + p.kernel_fixed_s)
    assert depthwise_conv_s(p, b) == pytest.approx(
        2 * 64 * 64 * 56 * 56 * 11 / (p.elementwise_flops * e["nonsquare_scale"]) + p.kernel_fixed_s)
    assert depthwise_conv_s(p, c) == pytest.approx(depthwise_conv_s(p, a)) and depthwise_conv_s(p, d) is None
    cost = CostModel(p).node_cost(a)
    assert conv_device_s(p, a, cost.compute_s, cost.memory_s, bias=False) == pytest.approx(depthwise_conv_s(p, a))
    assert depthwise_conv_s(get_profile("cpu")[0], a) is None


class Concat(nn.Module):
    def forward(self, *xs):
        return torch.cat(xs, 1)


class ConcatSlice(nn.Module):
    def forward(self, wide, a, b):
        return torch.cat([a, b, wide[:, 8:]], 1)  # the last piece a channel slice (Res2Net's last split)


def test_concatenations_are_priced_by_the_runs_they_write():
    """aten's concatenation writes each piece in runs of the piece's extent along the dim and every
    dim inside it in memory: a channel concatenation of channels_last pieces writes runs of C_piece
    elements (priced at the profile's cat_runs share for narrow, 32-byte and wide runs), an NCHW one
    runs of C_piece * H * W (long). A piece not dense in the output's format makes aten copy piece by
    piece: one kernel each, at no more than the strided rate. Without the entry (the CPU) the
    concatenation is a plain copy."""
    from graphopt.cost.model import aten_cat_s, cat_pieces, cat_run_scale

    p = _h200()
    e = p.op_efficiency["cat_runs"]
    cl = lambda c: torch.randn(2, c, 6, 6, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)  # noqa: E731
    narrow = _node(capture(Concat(), (cl(14), cl(14))), "cat")
    wide = _node(capture(Concat(), (cl(32), cl(64))), "cat")
    nchw = _node(capture(Concat(), (torch.randn(2, 14, 40, 40, dtype=torch.bfloat16),) * 2), "cat")
    assert [r for _, r, _ in cat_pieces(narrow)] == [28, 28]
    assert [r for _, r, _ in cat_pieces(wide)] == [64, 128]
    assert [r for _, r, _ in cat_pieces(nchw)] == [14 * 40 * 40 * 2] * 2
    assert [cat_run_scale(e, r) for r in (16, 28, 32, 48, 64, 112, 4096)] == \
        [e["narrow"], e["narrow"], e["32"], e["narrow"], e["wide"], e["wide"], e["long"]]
    nbytes = 2 * 14 * 36 * 2
    assert aten_cat_s(p, narrow) == (pytest.approx(2 * 2 * nbytes / (p.bandwidth * e["narrow"])), 1)
    assert CostModel(p).node_cost(narrow).memory_s == pytest.approx(aten_cat_s(p, narrow)[0])

    sliced = _node(capture(ConcatSlice(), (cl(24), cl(14), cl(14))), "cat")
    assert [d for _, _, d in cat_pieces(sliced)] == [True, True, False]
    s, k = aten_cat_s(p, sliced)
    assert k == 3 and CostModel(p).node_cost(sliced).launches == 3
    each = [(2 * 14 * 36 * 2, e["narrow"]), (2 * 14 * 36 * 2, e["narrow"]), (2 * 16 * 36 * 2, e["32"])]
    assert s == pytest.approx(sum(2 * b / (p.bandwidth * min(r, p.conv_bias_add_scale)) for b, r in each)
                              + 2 * p.kernel_fixed_s)
    cpu = get_profile("cpu")[0] if "cpu" in profile_names() else dataclasses.replace(p, kind="cpu")
    assert aten_cat_s(cpu, narrow) is None


def test_convolutions_over_channels_not_a_multiple_of_8_pay_cudnns_padding():
    """cuDNN pads a 16-bit channels_last convolution whose channels are not a multiple of 8 into
    aligned buffers: graphopt's fused call copies its input in and its output out, aten's its input
    alone, each copy at the strided rate and each buffer zeroed, plus their kernels' fixed time.
    Aligned channels, few-channel stems, 1x1, grouped and fp32 convolutions pay none."""
    from graphopt.cost.model import conv_channel_pad_s

    p = _h200()
    e = p.op_efficiency["conv_channel_pad"]
    cl = lambda c: torch.randn(2, c, 6, 6, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)  # noqa: E731

    class Ours(nn.Module):
        def forward(self, x, w, b):
            return torch.ops.graphopt.conv_bias_relu(x, w, b, None, [1, 1], [1, 1], [1, 1], 1)

    def conv(c, groups=1, dtype=torch.bfloat16, k=3):
        m = nn.Conv2d(c, c, k, padding=k // 2, groups=groups).to(dtype).to(memory_format=torch.channels_last)
        return _node(capture(m, (cl(c).to(dtype),)), "conv")

    x = 2 * 14 * 36 * 2  # bytes of the 14-channel input (and output)
    xp = x * 16 / 14
    aten = conv(14)
    assert conv_channel_pad_s(p, aten) == pytest.approx(
        (x + xp) / (p.bandwidth * p.conv_bias_add_scale) + xp / p.bandwidth + e["aten"] * p.kernel_fixed_s)
    ours = _node(capture(Ours(), (cl(14), torch.randn(14, 14, 3, 3, dtype=torch.bfloat16),
                                  torch.randn(14, dtype=torch.bfloat16))), "conv_bias_relu")
    assert conv_channel_pad_s(p, ours) == pytest.approx(
        2 * (x + xp) / (p.bandwidth * p.conv_bias_add_scale) + 2 * xp / p.bandwidth + e["ours"] * p.kernel_fixed_s)
    flat = dataclasses.replace(p, op_efficiency={k: v for k, v in p.op_efficiency.items() if k != "conv_channel_pad"})
    assert CostModel(p).node_cost(ours).time_s > CostModel(flat).node_cost(ours).time_s
    assert [conv_channel_pad_s(p, n) for n in (conv(16), conv(14, groups=14), conv(14, dtype=torch.float32),
                                                conv(14, k=1))] == [0, 0, 0, 0]
    assert conv_channel_pad_s(flat, aten) == 0


def test_grouped_convolutions_of_widths_cudnn_has_no_kernel_for_take_the_transform_path():
    """A channels_last 16-bit grouped convolution (three groups or more, not depthwise) whose group
    width is not a power of two (RegNet's 24) runs cuDNN's transform path: at least its input and
    output moved at op_efficiency["grouped_conv_transform"]'s share of the copy rate. Powers of two,
    two groups, depthwise, NCHW and fp32 convolutions keep the conv fit."""
    from graphopt.cost.model import grouped_conv_transform_s

    p = _h200()
    scale = p.op_efficiency["grouped_conv_transform"]["memory_scale"]

    def conv(c, groups, fmt=torch.channels_last, dtype=torch.bfloat16):
        m = nn.Conv2d(c, c, 3, padding=1, groups=groups, bias=False).to(dtype).to(memory_format=fmt)
        x = torch.randn(2, c, 8, 8, dtype=dtype).contiguous(memory_format=fmt)
        return _node(capture(m, (x,)), "conv")

    rg = conv(120, 5)  # 24 channels a group
    nbytes = 2 * (2 * 120 * 8 * 8 * 2)
    assert grouped_conv_transform_s(p, rg) == pytest.approx(nbytes / (p.bandwidth * scale) + p.kernel_fixed_s)
    flat = dataclasses.replace(p, op_efficiency={k: v for k, v in p.op_efficiency.items()
                                                 if k != "grouped_conv_transform"})
    assert CostModel(p).node_times(rg)[1] > CostModel(flat).node_times(rg)[1]  # (its device time)
    others = [conv(128, 4), conv(48, 2), conv(24, 24), conv(120, 5, fmt=torch.contiguous_format),
              conv(120, 5, dtype=torch.float32)]
    assert [grouped_conv_transform_s(p, n) for n in others] == [None] * 5
    assert grouped_conv_transform_s(flat, rg) is None


def test_a_graph_priced_whole_checks_each_memo_entry_once_and_a_changed_node_is_priced_again():
    """graph_cost reads each node's price several times (its cost, its memory, its floor): while it
    runs, an entry checked against the node's key once is trusted; after it, a node a pass changed
    is priced again."""
    from graphopt import ir

    gm = capture(Lin().eval(), (torch.randn(64, 256),))
    cm = CostModel(_h200())
    first = cm.graph_cost(gm).total_s
    calls = []
    key_of = cm._memo.key_of
    cm._memo.key_of = lambda n: calls.append(n) or key_of(n)
    again = cm.graph_cost(gm)
    assert again.total_s == first and again.total_s == CostModel(_h200()).graph_cost(gm).total_s
    ops = [n for n in calls if n.op == "call_function"]  # (the others have no key: never memoized)
    assert len(ops) == len(set(ops)) == 2  # each op's key made once, not once per read
    assert cm._memo.checked is None  # outside a whole-graph pricing, every read checks the key
    lin = _node(gm, "linear")
    before = cm.node_cost(lin).time_s
    x = lin.args[0]
    with gm.graph.inserting_before(lin):  # the linear now reads 4x the rows: its price must change
        cat = gm.graph.call_function(torch.ops.aten.cat.default, ([x, x, x, x],))
    lin.replace_input_with(x, cat)
    ir.repropagate(gm)
    cm.graph_cost(gm)
    assert cm.node_cost(lin).time_s == CostModel(_h200()).node_cost(lin).time_s != before


def test_bilinear_upsampling_over_channels_innermost_is_priced_at_its_measured_rate():
    """aten's NHWC bilinear kernel moves its bytes at op_efficiency["upsample_bilinear2d_nhwc"] of the copy rate
    (measured on CoaT-Tiny's 36 calls), not at the strided pointwise rate on top; an NCHW input keeps that rate."""
    import torch.nn.functional as F

    from graphopt import capture
    from graphopt.cost.model import CostModel, nhwc_upsample
    from graphopt.cost.profiles import get_profile

    class Up(torch.nn.Module):
        def forward(self, tokens, img):  # tokens past a class token, read as a channels-innermost image
            x = tokens[:, 1:].transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], 14, 14)
            return F.interpolate(x, size=(28, 28), mode="bilinear"), F.interpolate(img, size=(28, 28), mode="bilinear")

    prof = get_profile("h200")[0]
    gm = capture(Up(), (torch.randn(4, 197, 16, dtype=torch.bfloat16), torch.randn(4, 16, 14, 14, dtype=torch.bfloat16)))
    cl, nchw = [n for n in gm.graph.nodes if "upsample" in str(n.target)]
    assert nhwc_upsample(cl) and not nhwc_upsample(nchw)
    cm = CostModel(prof)
    c = cm.node_cost(cl)
    assert c.memory_s == pytest.approx(c.bytes / (prof.bandwidth * prof.efficiency("upsample_bilinear2d_nhwc", "memory_scale")),
                                       rel=1e-6)
    n = cm.node_cost(nchw)
    assert n.memory_s == pytest.approx(n.bytes / (prof.bandwidth * prof.conv_bias_add_scale), rel=1e-6)


class _Gemms(nn.Module):
    """A linear, a batched product with a weight expanded over the batch, and one with a transposed operand."""

    def __init__(self, k, n, w):
        super().__init__()
        self.lin = nn.Linear(k, n, bias=False)
        self.register_buffer("w", w)

    def forward(self, x, y):
        return self.lin(x), torch.bmm(self.w.expand(y.shape[0], -1, -1), y), torch.bmm(y.transpose(1, 2), y)


def _gemm_nodes(k, n, w, rows):
    from graphopt import ir

    x, y = torch.randn(64, k, dtype=torch.bfloat16), torch.randn(4, rows, 64, dtype=torch.bfloat16)
    gm = capture(_Gemms(k, n, w).to(torch.bfloat16), (x, y))
    return [n for n in gm.graph.nodes if ir.op_name(n) in ("linear", "bmm")]


def test_gemm_row_alignment_reads_the_leading_dimensions_as_stored():
    from graphopt.cost.model import GEMM_ALIGN_PARTIAL, gemm_alignment_key, gemm_row_alignment

    w = torch.randn(32, 196, dtype=torch.bfloat16)
    lin, bmm, bmm_t = _gemm_nodes(196, 32, w, 196)
    assert gemm_row_alignment(lin) == 4 and gemm_alignment_key(lin) == GEMM_ALIGN_PARTIAL  # K = 196
    assert gemm_row_alignment(bmm) == 4  # the expanded weight's rows are 196 long
    assert gemm_row_alignment(bmm_t) == 8  # a transposed [196, 64]: its rows are 64 apart
    padded = torch.zeros(32, 200, dtype=torch.bfloat16)[:, :196]  # the same weight, rows 200 apart
    _, bmm, _ = _gemm_nodes(196, 32, padded, 196)
    assert gemm_row_alignment(bmm) == 8 and gemm_alignment_key(bmm) is None
    lin, _, _ = _gemm_nodes(64, 195, torch.randn(32, 64, dtype=torch.bfloat16), 64)
    assert gemm_row_alignment(lin) == 1  # N = 195


def test_unaligned_gemms_are_priced_at_their_measured_rate():
    w = torch.randn(384, 196, dtype=torch.bfloat16)
    x, y = torch.randn(64 * 384, 196, dtype=torch.bfloat16), torch.randn(64, 196, 384, dtype=torch.bfloat16)
    gm = capture(_Gemms(196, 384, w).to(torch.bfloat16), (x, y))
    prof = get_profile("h200")[0]
    with_scale = CostModel(prof).graph_cost(gm)
    without = CostModel(prof.with_efficiency("gemm_align_partial", None)).graph_cost(gm)
    by = lambda gc: {c.node: c for c in gc.nodes}  # noqa: E731
    a, b = by(with_scale), by(without)
    scale = prof.efficiency("gemm_align_partial", "scale", 1.0)
    for name in ("linear", "bmm"):  # the whole kernel slower, whichever bound the roofline gives it
        assert a[name].compute_s == pytest.approx(b[name].compute_s / scale)
        assert a[name].memory_s == pytest.approx(b[name].memory_s / scale)
    assert a["bmm_1"].time_s == pytest.approx(b["bmm_1"].time_s)  # aligned rows: priced alike
