"""graphopt calibrate --corpus: op classes read from the node, the robust per-class fit, the profile
field that applies it (empty: the model as it was), and the command's one-line errors."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt import ir
from graphopt.capture import capture
from graphopt.cost.model import CostModel
from graphopt.cost.opclass import correction, curve_log_factor, lookup, op_class
from graphopt.cost.profiles import DeviceProfile, get_profile
from graphopt.tools.cli import main
from graphopt.tools.corpus import Sample, fit_curve, fit_op_classes, fit_stream, node_key
from tests.passes.test_convert_channels_last import FeatureMap


def _cpu(**kw) -> DeviceProfile:
    base = dict(name="toy-cpu", kind="cpu", peak_flops={"float32": 1e11}, elementwise_flops=1e10, bandwidth=2e10,
                launch_overhead_s=2e-6, memory_bytes=1e10)
    base.update(kw)
    return DeviceProfile(**base)


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.aligned = nn.Linear(64, 64)
        self.misaligned = nn.Linear(60, 30)
        self.narrow = nn.Linear(64, 24)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 16, 3, padding=1, groups=2)
        self.dense = nn.Conv2d(8, 16, 3, padding=1)

    def forward(self, x, y, img, q, mask):
        return (self.aligned(x), self.misaligned(y), self.narrow(x), self.depthwise(img), self.grouped(img),
                self.dense(img), F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
                F.scaled_dot_product_attention(q, q, q, attn_mask=mask > 0),
                F.scaled_dot_product_attention(q, q, q, is_causal=True), torch.softmax(x, -1), x.transpose(0, 1))


@pytest.fixture(scope="module")
def mix():
    torch.manual_seed(0)
    inputs = (torch.randn(32, 64), torch.randn(32, 60), torch.randn(2, 8, 10, 10), torch.randn(2, 4, 16, 8),
              torch.randn(2, 1, 16, 16))
    gm = capture(Mix().eval(), inputs)
    return gm


def _classes(gm, cost=None):
    cost = cost or CostModel(_cpu())
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.setdefault(str(n.target).split(".")[1], []).append(op_class(n, cost.flops_bytes(n)[3]))
    return out


def test_op_class_is_read_from_the_node(mix):
    c = _classes(mix)
    # N and K multiples of 16; N=30, K=60: not multiples of 8; N=24, K=64: multiples of 8 only
    assert c["linear"] == [("gemm", "f32", "a16", "m256"), ("gemm", "f32", "odd", "m256"),
                           ("gemm", "f32", "a8", "m256")]
    assert c["conv2d"] == [("conv", "f32", "depthwise", "nchw", "m256"), ("conv", "f32", "grouped", "nchw", "m256"),
                           ("conv", "f32", "dense", "nchw", "m256")]
    assert c["scaled_dot_product_attention"] == [("sdpa", "f32", "float", "full"), ("sdpa", "f32", "bool", "full"),
                                                 ("sdpa", "f32", "none", "causal")]
    assert c["softmax"] == [("softmax", "row64", "contig")]
    assert c["transpose"] == [("view", "transpose")]


def test_op_class_channels_last_and_small_m():
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=8).to(memory_format=torch.channels_last)
    img = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    gm = capture(nn.Sequential(conv).eval(), (img,))
    assert _classes(gm)["conv2d"] == [("conv", "f32", "depthwise", "cl", "m256")]
    gm = capture(nn.Linear(64, 64).eval(), (torch.randn(4, 64),))
    assert _classes(gm)["linear"] == [("gemm", "f32", "small_m")]


class OwnOps(nn.Module):
    """graphopt's own ops that replace a convolution, a GEMM and an attention."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Parameter(torch.randn(16, 8, 3, 3))
        self.grouped = nn.Parameter(torch.randn(16, 4, 3, 3))
        self.bias = nn.Parameter(torch.randn(16))
        self.weight = nn.Parameter(torch.randn(32, 64))

    def forward(self, img, x, q):
        from graphopt.cuda_ext import conv_bias_relu, gemv, short_attention

        conv = lambda w, groups: conv_bias_relu(img, w, self.bias, None, (1, 1), (1, 1), (1, 1), groups)  # noqa: E731
        return conv(self.dense, 1), conv(self.grouped, 2), gemv(x, self.weight), short_attention(q, q, q,
                                                                                                 is_causal=True)


def test_own_ops_carry_the_class_tags_of_the_op_they_replace():
    gm = capture(OwnOps().eval(), (torch.randn(2, 8, 10, 10), torch.randn(4, 64), torch.randn(1, 2, 8, 16)))
    c = _classes(gm)
    dense, grouped = c["conv_bias_relu"]
    assert dense == ("graphopt", "conv_bias_relu", "f32", "dense", "nchw", "m256")
    assert grouped == ("graphopt", "conv_bias_relu", "f32", "grouped", "nchw", "m256")
    assert c["gemv"] == [("graphopt", "gemv", "f32", "small_m")]
    assert c["short_attention"] == [("graphopt", "short_attention", "f32", "none", "causal")]
    # a fit of dense fused convolutions is not the grouped ones'
    fit = {"classes": {"graphopt/conv_bias_relu/f32/dense": {"knots": [-10.0], "log_factor": [1.0], "n": 9}}}
    assert lookup(fit, dense)[0] == "graphopt/conv_bias_relu/f32/dense" and lookup(fit, grouped) == (None, None)


def test_node_key_tells_shapes_and_strides_apart(mix):
    lin = [n for n in mix.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    keys = [node_key(n) for n in lin]
    assert len(set(keys)) == 3 and all("float32" in k for k in keys)
    x = torch.randn(8, 64)
    a = capture(nn.Linear(64, 64).eval(), (x,))
    b = capture(nn.Linear(64, 64).eval(), (torch.randn(8, 64),))
    c = capture(nn.Linear(64, 64).eval(), (x.t().contiguous().t(),))  # same shape, other strides
    key = lambda gm: [node_key(n) for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)


def _true_curve(x):
    # a correction known in closed form: 8x at 1 us, falling to 1x at 1 ms and flat beyond
    lo, hi = math.log(1e-6), math.log(1e-3)
    t = min(1.0, max(0.0, (x - lo) / (hi - lo)))
    return math.log(8.0) * (1 - t)


def test_fit_recovers_a_known_correction_despite_outliers():
    rng = random.Random(0)
    xs = [rng.uniform(math.log(3e-7), math.log(1e-2)) for _ in range(200)]
    ys = [_true_curve(x) + rng.gauss(0, 0.05) for x in xs]
    for i in range(0, 200, 10):  # 10% wild outliers (a timing disturbed by other work)
        ys[i] += rng.choice([3.0, -2.5])
    fit = fit_curve(xs, ys, knots=4)
    for x in (math.log(1e-6), math.log(1e-5), math.log(1e-4), math.log(1e-3), math.log(5e-3)):
        assert abs(curve_log_factor(fit, x) - _true_curve(x)) < 0.2
    # beyond the knots the curve is flat
    assert curve_log_factor(fit, math.log(1e-9)) == fit["log_factor"][0]
    assert curve_log_factor(fit, 0.0) == fit["log_factor"][-1]


def test_fit_per_class_needs_enough_samples_and_falls_back_to_the_parent():
    rng = random.Random(1)
    samples = []
    for i in range(30):  # conv/f32/dense: measured 3x the prediction, in 3 configs
        p = math.exp(rng.uniform(-12, -8))
        samples.append(Sample(f"d{i}", ("conv", "f32", "dense", "nchw"), "conv2d", p, p, [3 * p], [f"c{i % 3}"]))
    for i in range(3):  # too few depthwise shapes for a class of their own
        p = math.exp(rng.uniform(-12, -8))
        samples.append(Sample(f"w{i}", ("conv", "f32", "depthwise", "nchw"), "conv2d", p, p, [3 * p], [f"c{i}"]))
    for i in range(10):  # views: priced at nothing, measured 2 us
        samples.append(Sample(f"v{i}", ("view", "view"), "view", 0.0, 0.0, [2e-6], [f"c{i % 3}"]))
    fit = fit_op_classes(samples, min_samples=8)
    classes = fit.classes
    # the most general class that holds the correction is kept; its children add nothing and fall back to it
    assert "conv" in classes and classes["conv"]["n"] == 33 and "conv/f32/depthwise" not in fit.decisions
    assert not fit.decisions["conv/f32/dense"]["kept"] and "uses conv" in fit.decisions["conv/f32/dense"]["reason"]
    name, entry = lookup({"classes": classes}, ("conv", "f32", "depthwise", "nchw"), 1e-4)
    assert name == "conv" and correction(entry, 1e-4)[0] == pytest.approx(3.0, rel=1e-3)
    # a curve applies over the predicted times it was fitted on (a little wider), not far beyond
    lo, hi = classes["conv"]["range"]
    assert math.exp(lo) < 1e-4 < math.exp(hi)
    assert lookup({"classes": classes}, ("conv", "f32", "dense", "nchw"), 10.0) == (None, None)
    assert classes["view"]["fixed_s"] == pytest.approx(2e-6) and "view/view" not in classes
    assert correction(classes["view"], 0.0) == (1.0, 0.0, pytest.approx(2e-6))


def test_stream_fit_recovers_a_known_factor_and_per_node_time():
    rng = random.Random(2)
    pred = [math.exp(rng.uniform(-9, -2)) for _ in range(30)]
    nodes = [rng.randint(20, 1000) for _ in range(30)]
    meas = [1.1 * p + 3e-6 * n for p, n in zip(pred, nodes)]
    meas[3] *= 3.0  # one config timed under load
    factor, add = fit_stream(pred, nodes, meas)
    assert factor == pytest.approx(1.1, rel=0.02) and add == pytest.approx(3e-6, rel=0.05)


def test_config_order_and_held_out_set():
    from graphopt.tools.corpus import held_out_configs, interleaved
    from graphopt.tools.perf_sweep import all_configs

    configs = all_configs(timm_available=False, small=True)
    held = held_out_configs(configs, 4)
    assert held == {c.key for c in configs[3::4]} and held_out_configs(configs, 0) == set()
    order = interleaved(configs)
    assert sorted(c.key for c in order) == sorted(c.key for c in configs)
    assert [c.source for c in order[:4]] == ["torchvision", "hf", "torchvision", "hf"]


def _all_times(cost, gm):
    out = []
    for n in gm.graph.nodes:
        c = cost.node_cost(n)
        out.append((c.time_s, c.compute_s, c.memory_s, c.bound, cost.node_times(n)))
    ex = cost.execution_cost(gm)
    return out, ex.total_s, cost.graph_cost(gm).total_s


@pytest.mark.parametrize("profile", ["cpu", "h200"])
def test_a_profile_without_a_fit_prices_as_before(mix, profile):
    prof = _cpu() if profile == "cpu" else get_profile("h200")[0]
    assert prof.op_class_fit == {}
    plain = CostModel(prof)
    # the uncorrected pricing, by the model's own raw functions
    for n in mix.graph.nodes:
        assert plain.node_cost(n) == plain._node_cost(n)
        assert plain.node_times(n) == plain._node_times(n)
    # a fit for a class none of these nodes has changes nothing
    other = CostModel(DeviceProfile.from_dict({**prof.to_dict(), "op_class_fit": {
        "classes": {"pool": {"knots": [-10.0], "log_factor": [1.0], "n": 9}}}}))
    assert _all_times(other, mix) == _all_times(plain, mix)


def test_a_fit_applies_where_a_node_is_priced(mix):
    prof = _cpu()
    fit = {"classes": {"gemm/f32": {"knots": [-10.0], "log_factor": [math.log(2.5)], "n": 9},
                       "view": {"fixed_s": 3e-6, "n_fixed": 9, "n": 0}}}
    plain, fitted = CostModel(prof), CostModel(DeviceProfile.from_dict({**prof.to_dict(), "op_class_fit": fit}))
    for n in mix.graph.nodes:
        if n.op != "call_function":
            continue
        cls = op_class(n, plain.flops_bytes(n)[3])
        raw, got = plain.node_cost(n), fitted.node_cost(n)
        if cls[0] == "gemm":
            assert got.time_s == pytest.approx(2.5 * raw.time_s)
            assert fitted.node_loop_s(n) == pytest.approx(2.5 * plain.node_loop_s(n))
            assert (got.compute_s, got.memory_s) == (raw.compute_s, raw.memory_s)
        elif cls[0] == "view":
            assert raw.time_s == 0 and got.time_s == pytest.approx(3e-6)
            assert fitted.node_times(n) == (pytest.approx(3e-6), 0.0)
        else:
            assert got.time_s == raw.time_s and fitted.node_times(n) == plain.node_times(n)
    assert fitted.execution_cost(mix).total_s > plain.execution_cost(mix).total_s


def test_profile_with_a_fit_round_trips_through_json(tmp_path, mix):
    prof = DeviceProfile.from_dict({**_cpu().to_dict(), "op_class_fit": {
        "version": 1, "classes": {"gemm": {"knots": [-12.0, -8.0], "log_factor": [1.0, 0.1], "n": 20}},
        "corpus": {"configs": ["resnet50:4"], "samples": 20, "measured_at": "2026-12-02 05:00 UTC"}}})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    back, _ = get_profile(str(path))
    assert back == prof and back.to_dict() == prof.to_dict()
    assert _all_times(CostModel(back), mix) == _all_times(CostModel(prof), mix)


@pytest.mark.parametrize("argv, words", [
    (["calibrate", "--device", "cpu", "--configs", "resnet50"], "--configs applies to --corpus only"),
    (["calibrate", "--device", "cpu", "--holdout", "3"], "--holdout applies to --corpus only"),
    (["calibrate", "--corpus", "--device", "cpu", "--configs", "nonsense"], "unknown config 'nonsense'"),
    (["calibrate", "--corpus", "--device", "cpu", "--configs", "resnet50:x"], "positive integer"),
    (["calibrate", "--corpus", "--device", "cpu", "--holdout", "1"], "--holdout must be 0"),
    (["calibrate", "--corpus", "--device", "cpu", "--time-budget", "0"], "--time-budget must be a positive"),
    (["calibrate", "--corpus", "--device", "cpu", "--min-samples", "1"], "--min-samples must be at least 2"),
    (["calibrate", "--corpus", "--device", "cpu", "--quiet-wait", "-1"], "--quiet-wait must be 0 or more"),
    (["calibrate", "--corpus", "--device", "cpu", "--configs", "resnet50,hf-bert"], "hold none out"),
    (["calibrate", "--corpus", "--device", "cpu", "--holdout", "many"], "invalid int value"),
    (["calibrate", "--corpus", "--device", "tpu9"], "unknown device"),
])
def test_corpus_bad_arguments_are_one_line_errors(capfd, argv, words):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors (graphopt's parser: one line, exit 2)
        rc = e.code
    out, err = capfd.readouterr()
    assert rc == 2
    assert err.startswith("graphopt: error:") and len(err.strip().splitlines()) == 1 and words in err


@pytest.mark.slow
def test_corpus_end_to_end_on_the_cpu(capfd, tmp_path):
    """Three small sweep configs: two fitted (cross-validated against each other), one held out; the
    profile written loads and carries the fit, its corpus, decisions and the held-out validation;
    the samples file written beside the results refits to the same fit."""
    path = tmp_path / "cpu-fit.json"
    rc = main(["calibrate", "--corpus", "--device", "cpu", "--small", "--configs",
               "squeezenet1_1:1,hf-bert:1,resnet18:1", "--holdout", "3", "--min-samples", "3", "--time-budget", "300",
               "--quiet-wait", "0", "-o", str(path), "--results", str(tmp_path)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "[1/3] squeezenet1_1:1 (fit)" in out and "[3/3] resnet18:1 (held out)" in out
    prof, _ = get_profile(str(path))
    fit = prof.op_class_fit
    assert fit["corpus"]["configs"] == ["squeezenet1_1:1", "hf-bert:1"] and fit["folds"] == 2
    assert fit["corpus"]["held_out"] == ["resnet18:1"] and fit["validation"]["rows"] == 1
    assert fit["corpus"]["samples"] > 10 and fit["stream"]["reason"]
    assert set(fit["classes"]) | {k.removesuffix(" (fixed)") for k in fit["dropped"]} >= {"conv", "pointwise"}
    assert list(tmp_path.glob("calibrate_corpus_*[0-9].md"))
    samples, = tmp_path.glob("calibrate_corpus_*.samples.json.gz")
    again = tmp_path / "refit.json"
    assert main(["calibrate", "--corpus", "--refit", str(samples), "--min-samples", "3", "-o", str(again)]) == 0
    back = get_profile(str(again))[0].op_class_fit
    assert back["classes"] == fit["classes"] and back["stream"] == fit["stream"] and back["validation"] == fit[
        "validation"]


@pytest.mark.cuda
@pytest.mark.slow
def test_corpus_on_the_gpu_with_optimized_graphs(capfd, tmp_path):
    """The CUDA path: bf16, the shipped profile of this GPU as the base, the optimized graphs (our
    own ops) timed and fitted too."""
    path = tmp_path / "gpu-fit.json"
    rc = main(["calibrate", "--corpus", "--device", "cuda", "--small", "--optimized", "--configs",
               "resnet18:1,hf-bert:1,mobilenet_v3_small:1,hf-gpt2:1", "--holdout", "4", "--min-samples", "3",
               "-o", str(path)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    prof, _ = get_profile(str(path))
    fit = prof.op_class_fit
    assert prof.kind == "cuda" and fit["corpus"]["dtype"] == "bfloat16" and fit["corpus"]["optimized"]
    assert fit["validation"]["rows"] == 2  # hf-gpt2:1 captured and optimized
    # host issue and device time timed apart: the split fit (device factors, host corrections)
    assert fit["folds"] == 3 and fit["version"] == 3
    assert fit["device_classes"] or fit["host_classes"] or fit["dropped"]
    assert fit["corpus"]["samples_device"] > 0 and fit["corpus"]["samples_host"] > 0 and fit["corpus"]["node_timing_s"]
    assert path.with_name("gpu-fit.samples.json.gz").exists()  # no --results: beside the profile
    assert "optimized: error" not in out and out.count(" optimized ") == 4


SPLIT = {"device_classes": {"gemm": {"knots": [-10.0], "log_factor": [math.log(0.5)]}},
         "host_classes": {"gemm": {"knots": [-12.0], "log_factor": [math.log(3.0)], "add_s": 1e-6},
                          "view": {"knots": [-12.0], "log_factor": [math.log(2.0)]}}}


def test_a_split_fit_corrects_device_and_host_time_apart(mix):
    """A split fit's device factor multiplies a node's device time (eager and replayed alike), its
    host correction its host time; NodeCost moves as the node's loop time does."""
    from graphopt.cost.opclass import split_correction

    prof = get_profile("h200")[0]
    plain, fitted = CostModel(prof), CostModel(DeviceProfile.from_dict({**prof.to_dict(), "op_class_fit": SPLIT}))
    seen = set()
    for n in mix.graph.nodes:
        if n.op != "call_function":
            continue
        cls = op_class(n, plain.flops_bytes(n)[3])
        (h, d), raw = plain.node_times(n), plain.node_cost(n)
        got = fitted.node_times(n)
        assert fitted.node_times(n, replayed=True) == got
        if cls is None:
            assert got == (h, d)
            continue
        seen.add(cls[0])
        fd, fh, add = split_correction(SPLIT, cls, h, d, ir.target_name(n))
        if cls[0] == "gemm":
            assert (fd, fh, add) == (pytest.approx(0.5), pytest.approx(3.0), 1e-6)
            assert got == (pytest.approx(3.0 * h + 1e-6), pytest.approx(0.5 * d))
            assert fitted.node_cost(n).time_s == pytest.approx(raw.time_s * max(got) / max(h, d))
        elif cls[0] == "view":
            assert got == (pytest.approx(2.0 * h), 0.0) and fitted.node_cost(n).time_s == raw.time_s == 0.0
        else:
            assert got == (h, d) and fitted.node_cost(n) == raw
    assert {"gemm", "view"} <= seen
    assert fitted.execution_cost(mix, None, "graphed").device_s < plain.execution_cost(mix, None, "graphed").device_s


def test_a_host_correction_no_longer_flips_a_layout_decision():
    """A class factor fitted on nodes timed alone carries their host dispatch: read as a device
    factor it makes the big boundary copies of convert_channels_last cost 5x and the pass refuse;
    the same 5x as a host correction leaves those device-bound copies as priced, and the pass
    decides as with no fit."""
    from graphopt.pipeline import run_passes

    m = FeatureMap().eval().to(torch.bfloat16)
    x = torch.randn(32, 3, 64, 64, dtype=torch.bfloat16)
    base = get_profile("h200")[0]
    five = {"knots": [-12.0], "log_factor": [math.log(5.0)]}
    status = {}
    for name, fit in {"none": {}, "combined": {"classes": {"copy": five}},
                      "split": {"device_classes": {}, "host_classes": {"copy": five}}}.items():
        (res,) = run_passes(capture(m, (x,)), ["convert_channels_last"], target=replace(base, op_class_fit=fit))
        status[name] = res.status
    assert status == {"none": "applied", "combined": "unchanged", "split": "applied"}
