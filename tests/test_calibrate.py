"""graphopt calibrate on the CPU: a loadable profile, positive rates, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from graphopt.tools.calibrate import _shipped_for, calibrate, keep_shipped_prices
from graphopt.tools.cli import main
from graphopt.cost.profiles import DeviceProfile, get_profile


def _positive(p: DeviceProfile):
    assert p.peak_flops and all(v > 0 for v in p.peak_flops.values())
    assert p.elementwise_flops > 0 and p.bandwidth > 0 and p.launch_overhead_s > 0 and p.memory_bytes > 0
    assert all(v > 0 for v in p.link_bandwidth.values())


def test_calibrate_cpu_quick_roundtrip(capfd, tmp_path):
    path = tmp_path / "prof.json"
    rc = main(["calibrate", "--device", "cpu", "--quick", "-o", str(path)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    data = json.loads(path.read_text())
    assert "measured by graphopt calibrate on" in json.dumps(data["source"])
    prof, _ = get_profile(str(path))
    assert prof.kind == "cpu" and prof.to_dict() == data
    _positive(prof)
    assert "sdpa" in prof.peak_flops


def test_calibrate_function():
    _positive(calibrate("cpu", quick=True))


def test_calibrate_bad_device(capfd):
    import torch

    bad = ["tpu9", "nonsense:0"] + ([] if torch.cuda.is_available() else ["cuda"])
    for dev in bad:
        rc = main(["calibrate", "--device", dev])
        out, err = capfd.readouterr()
        assert rc == 2
        assert err.startswith("graphopt: error:") and len(err.strip().splitlines()) == 1


def test_explain_with_calibrated_profile(capfd, tmp_path):
    path = tmp_path / "prof.json"
    assert main(["calibrate", "--device", "cpu", "--quick", "-o", str(path)]) == 0
    assert main(["explain", "mlp", "--no-accuracy", "--target", str(path)]) == 0
    capfd.readouterr()


@pytest.mark.cuda
def test_calibrate_cuda_quick(tmp_path):
    prof = calibrate("cuda", quick=True)
    _positive(prof)
    for key in ("bfloat16", "float16", "float32", "tf32", "float64", "sdpa"):
        assert key in prof.peak_flops
    assert "pcie_h2d" in prof.link_bandwidth and prof.launch_overhead_graph_s > 0
    assert 0 < prof.host_node_s < prof.launch_overhead_s and "host_node" in prof.source
    assert {"linear", "scaled_dot_product_attention", "layer_norm"} <= set(prof.host_op_s)
    assert 0 < prof.attention_scale <= 1 and prof.attention_fixed_s >= 0
    sa = prof.op_efficiency["short_attention"]  # lower_attention's fit
    assert 0 < sa["scale"] <= 1 and sa["fixed_s"] >= 0
    assert 0 < prof.op_efficiency["pool"]["memory_scale"] <= 1
    base = _shipped_for(torch.cuda.get_device_name())
    if base is not None:  # every price of the shipped profile this run does not measure is kept
        assert set(base.op_efficiency) <= set(prof.op_efficiency)
        assert prof.op_efficiency["row_norm"] == base.op_efficiency["row_norm"]
    assert 0.3 < prof.matmul_sustained_fraction <= 1  # the GEMM rate under back-to-back load
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert get_profile(str(path))[0].to_dict() == prof.to_dict()


def test_a_calibrated_profile_keeps_the_shipped_prices_it_does_not_measure():
    """calibrate measures some op_efficiency entries (pool, short_attention); every other entry of
    the shipped profile for the GPU (depthwise convolutions, concatenations, ...) is kept as it was,
    with its source saying so; a measured one is not overwritten."""
    base = get_profile("h200")[0]
    op_eff, source = {"pool": {"memory_scale": 0.5}}, {}
    keep_shipped_prices(op_eff, source, base)
    assert set(op_eff) == set(base.op_efficiency) | {"pool"} and op_eff["pool"] == {"memory_scale": 0.5}
    assert op_eff["cat_runs"] == base.op_efficiency["cat_runs"] and op_eff["cat_runs"] is not base.op_efficiency["cat_runs"]
    assert "kept from the shipped h200 profile" in source["depthwise_conv"] and "pool" not in source


def test_efficiency_fit_recovers_a_known_line():
    """The GEMM/conv efficiency fit: t = flops / (peak * scale) + fixed, and a fixed time is never
    negative (refit through the origin)."""
    from graphopt.tools.calibrate import _fit_efficiency, fit_line

    peak = 800e12
    samples = [(f, f / (peak * 0.8) + 4e-6) for f in (1e9, 1e10, 1e11, 1e12)]
    scale, fixed = _fit_efficiency(samples, peak)
    assert abs(scale - 0.8) < 1e-6 and abs(fixed - 4e-6) < 1e-9
    a, b = fit_line([1.0, 2.0, 3.0], [1.0, 3.0, 5.5])  # intercept would be negative
    assert b == 0.0 and a > 0


def test_host_costs_measured_and_roundtrip(tmp_path):
    """The host/device queue's inputs: host_node_s (back-to-back views in a GraphModule) and the
    per-op host times; both travel through the profile JSON, and a profile without them loads
    the defaults."""
    import torch

    from graphopt.tools.calibrate import host_costs, host_op_costs
    from graphopt.cost.profiles import view_chain

    x = torch.randn(4, 4)
    assert torch.equal(view_chain(8)(x), x) and torch.equal(view_chain(4)(x), x.t())
    assert sum(1 for n in view_chain(12).graph.nodes if n.op == "call_function") == 12
    node_s, launch_s = host_costs("cpu")
    assert 0 < node_s < 1e-3 and 0 < launch_s < 1e-3
    ops = host_op_costs("cpu", n=3, reps=1)
    assert {"linear", "layer_norm", "scaled_dot_product_attention", "add"} <= set(ops)
    assert all(v > 0 for v in ops.values())
    prof = calibrate("cpu", quick=True)
    assert prof.host_node_s > 0 and "host_node" in prof.source
    prof.host_op_s = ops
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    back = get_profile(str(path))[0]
    assert back.host_node_s == prof.host_node_s and back.host_op_s == ops
    data = prof.to_dict()
    del data["host_node_s"], data["host_op_s"]
    path.write_text(json.dumps(data))
    old = get_profile(str(path))[0]
    assert old.host_node_s == DeviceProfile.__dataclass_fields__["host_node_s"].default and old.host_op_s == {}


def test_fit_conv_recovers_conv_efficiency():
    """Samples made by the cost model's additive conv formula (compute-heavy 3x3s, memory-heavy
    1x1s) give back the scales and fixed time they were made with, and the profile prices them so."""
    import dataclasses

    from graphopt.tools.calibrate import fit_conv
    from graphopt.cost.profiles import get_profile

    peak, bw = 776e12, 4.2e12
    scale, mscale, fixed = 0.62, 0.8, 4e-6
    shapes = [(14.8e9, 60e6), (6.6e9, 128e6), (29.6e9, 30e6), (3.3e9, 110e6), (14.8e9, 20e6), (1.0e9, 200e6)]
    for overlap in (False, True):
        comb = max if overlap else (lambda a, b: a + b)
        samples = [(f, b, comb(f / (peak * scale), b / (bw * mscale)) + fixed) for f, b in shapes]
        got = fit_conv(samples, peak, bw)
        assert got[3] is overlap and got[:3] == pytest.approx((scale, mscale, fixed), abs=0.011)
        prof = dataclasses.replace(get_profile("h200")[0], peak_flops={"bfloat16": peak}, bandwidth=bw,
                                   conv_scale=got[0], conv_memory_scale=got[1], conv_fixed_s=got[2], conv_overlap=got[3])
        for f, b, t in samples:
            assert prof.gpu_seconds(f / peak, b / bw, "conv") == pytest.approx(t, rel=0.03)
    # the sum form prices more than the overlapped one
    f, b, _ = samples[1]
    summed = dataclasses.replace(prof, conv_overlap=False)
    assert prof.gpu_seconds(f / peak, b / bw, "conv") < summed.gpu_seconds(f / peak, b / bw, "conv")


def test_fit_channel_chunk():
    """Few-channel samples made with compute at C_in / 64 of the rate give back a chunk of 64; none
    (or samples the plain fit explains) give 0."""
    from graphopt.tools.calibrate import fit_channel_chunk

    peak, bw, fit = 776e12, 4.2e12, (1.0, 1.0, 4.5e-6, False)
    few = [(f, b, f * (64 / cin) / peak + b / bw + fit[2], cin) for f, b, cin in
           ((26.3e9, 130e6, 16), (14.8e9, 60e6, 32), (3.0e9, 100e6, 8))]
    assert fit_channel_chunk(few, fit, peak, bw) == 64
    plain = [(f, b, f / peak + b / bw + fit[2], cin) for f, b, _, cin in few]
    assert fit_channel_chunk(plain, fit, peak, bw) in (0, 16)  # 16 wastes nothing on 16+ channels but 8
    assert fit_channel_chunk([], fit, peak, bw) == 0


def test_conv_samples_sort_shapes_by_input_channels(monkeypatch):
    """calibrate's convolution samples: shapes over >= 64 channels feed the conv fit, 8-63 channels
    the channel-chunk fit, channel counts that are not a multiple of 8 the narrow-input factor."""
    import graphopt.tools.calibrate as cal

    monkeypatch.setattr(cal, "CONV_SHAPES", [(2, 64, 8, 8, 64, 3, 1), (2, 3, 16, 16, 8, 7, 2), (2, 16, 8, 8, 16, 3, 1),
                                             (2, 128, 4, 4, 64, 1, 1)])
    cs = cal._conv_samples(torch.device("cpu"), torch.float32, quick=False)
    assert len(cs["samples"]) == 2 and [s[3] for s in cs["narrow"]] == [3] and [s[3] for s in cs["few"]] == [16]
    assert all(f > 0 and b > 0 and t > 0 for f, b, t in cs["samples"])
    assert cs["unfused"] == 1.0 and cs["bias_add_scale"] is None  # measured on a GPU only
    fit = cal.fit_conv(cs["samples"], 1e12, 1e11)
    assert len(fit) == 4 and 0 < fit[0] <= 1 and 0 < fit[1] <= 1
    assert cal.fit_channel_chunk(cs["few"], fit, 1e12, 1e11) in (0, 16, 32, 64, 128, 256)


def test_attention_fit_recovers_the_max_form_and_prices_like_the_cost_model():
    """calibrate's attention fit (the max form over tile-padded FLOPs and bytes) recovers the
    parameters of samples generated from it, and a profile holding them prices an SDPA node the
    way the samples were generated (the cost model pads the same tiles)."""
    import dataclasses

    import torch.nn.functional as F

    from graphopt import capture
    from graphopt.tools.calibrate import ATTENTION_SHAPES, attention_work, fit_conv
    from graphopt.cost.model import CostModel

    prof = get_profile("h200")[0]
    peak, bw = prof.peak_flops["bfloat16"], prof.bandwidth
    scale, mem, fixed = 0.47, 0.48, 8.5e-6

    def seconds(work, nbytes):
        return max(work / (peak * scale), nbytes / (bw * mem)) + fixed

    samples = []
    for b, h, s, d, kind in ATTENTION_SHAPES:
        nbytes = 4 * b * h * s * d * 2 + (b * s * s * 2 if kind == "mask" else 0)
        work = attention_work(b, h, s, s, d, kind == "causal")
        samples.append((work, nbytes, seconds(work, nbytes)))
    got = fit_conv(samples, peak, bw, forms=(True,))
    assert got[3] is True
    assert got[0] == pytest.approx(scale, abs=0.011) and got[1] == pytest.approx(mem, abs=0.011)
    assert got[2] == pytest.approx(fixed, abs=0.6e-6)

    fitted = dataclasses.replace(prof, attention_scale=scale, attention_memory_scale=mem, attention_fixed_s=fixed,
                                 attention_tile=128)

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q = torch.randn(2, 4, 197, 64, dtype=torch.bfloat16)  # 197 positions: padded to 256
    gm = capture(Attn(), (q, q.clone(), q.clone()))
    node = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    cost = CostModel(fitted).node_cost(node)
    want = seconds(attention_work(2, 4, 197, 197, 64, False), 4 * q.nbytes)
    assert prof.kind == "cuda" and float(cost.time_s) == pytest.approx(max(want, fitted.launch_overhead_s), rel=1e-6)


def test_host_time_per_op_of_a_training_step(tmp_path):
    """host_train_op_s: a host-bound training step's wall time over its ops, counted as the
    partition planner counts them; it travels through the profile JSON (absent: 0, no host term)."""
    import torch

    from graphopt.tools.calibrate import measure_host_train_op_s

    h, call = measure_host_train_op_s(torch.device("cpu"), steps=3, reps=1)
    assert 1e-8 < h < 1e-3 and 0 <= call < 0.1
    prof = get_profile("h200")[0]
    prof.host_train_op_s, prof.host_train_call_s = h, call
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    back = get_profile(str(path))[0]
    assert (back.host_train_op_s, back.host_train_call_s) == (h, call)
    data = prof.to_dict()
    del data["host_train_op_s"], data["host_train_call_s"]
    path.write_text(json.dumps(data))
    assert get_profile(str(path))[0].host_train_op_s == 0.0 == get_profile(str(path))[0].host_train_call_s


def test_gemm_partial_alignment_scale_is_a_rate_ratio():
    from graphopt.tools.calibrate import _gemm_partial_alignment_scale

    scale = _gemm_partial_alignment_scale(torch.device("cpu"), torch.float32, quick=True)
    assert 0.0 < scale <= 1.0


def test_gemm_partial_alignment_scale_compares_rates_per_flop(monkeypatch):
    """The scale is the 196-wide GEMMs' rate over the 200-wide ones', per FLOP, averaged over K and N."""
    from graphopt.tools import calibrate as cal

    times = iter([2.0, 1.0, 1.0, 1.0])  # K: 196 twice as slow as 200; N: alike in time
    monkeypatch.setattr(cal, "_best_seconds", lambda fn, device, iters: next(times))
    scale = cal._gemm_partial_alignment_scale(torch.device("cpu"), torch.float32, quick=True)
    assert scale == pytest.approx(((1 / 200) / (2 / 196) + (1 / 200) / (1 / 196)) / 2)
