"""graphopt calibrate --corpus from its records: the samples file (written, read back, refit), the
cross-validated class fit (kept only where it generalizes across configs, shrunk on few shapes),
the stream terms' check, whole calls replayed through the cost model's own queue, and a bad
samples file's one-line error."""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from graphopt import ir
from graphopt.capture import capture
from graphopt.cost.model import CostModel
from graphopt.cost.opclass import class_correction, lookup
from graphopt.cost.profiles import DeviceProfile, get_profile
from graphopt.errors import CorpusFileError
from graphopt.tools.cli import main
from graphopt.tools.corpus import ConfigRun, record_run, refit
from graphopt.tools.corpus_fit import (Corpus, RunRecord, Shape, Step, _Corrections, _curve_entry, _fixed_entry,
                                       evaluate, fit_curve, fit_profile, predicted_whole)


def _toy(kind: str = "cpu") -> DeviceProfile:
    return DeviceProfile(name="toy", kind=kind, peak_flops={"float32": 1e11}, elementwise_flops=1e10, bandwidth=2e10,
                         launch_overhead_s=2e-6, memory_bytes=1e10)


def _corpus(classes: dict, *, configs: int = 6, per: int = 12, stream: float = 1.0, noise: float = 0.03,
            held=(), seed: int = 0, times=None) -> Corpus:
    """A corpus whose truth is known: per config, ``per`` shapes of each class with predicted
    times drawn from ``times(config index)`` (ln seconds range), measured at
    exp(classes[cls](ln predicted, config index)) times the prediction (with ``noise``), the whole
    call ``stream`` times the sum of its nodes."""
    rng = random.Random(seed)
    shapes, runs = [], []
    for ci in range(configs):
        cfg = f"c{ci}:1"
        steps, total = [], 0.0
        for cls, truth in classes.items():
            lo, hi = times(ci) if times else (-12.0, -8.0)
            for _ in range(per):
                t = math.exp(rng.uniform(lo, hi))
                shapes.append(Shape(cls, "op", t))
                m = t * math.exp(truth(math.log(t), ci) + rng.gauss(0, noise))
                steps.append(Step(len(shapes) - 1, 0.0, t, 1, False, False, m))
                total += m
        runs.append(RunRecord(cfg, "captured", cfg in held, "eager", total * stream, steps))
    return Corpus(_toy(), shapes, runs, {"configs": [r.config for r in runs if not r.held_out],
                                         "held_out": list(held), "dtype": "float32"}, {}, "synthetic")


def _same(a, b, rel: float = 1e-6) -> bool:
    """Equal, floats within ``rel``: the same fit run twice in one process has differed in its last
    digits (up to 2e-9 relative, the BLAS summing in another order), never in more."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return a == pytest.approx(b, rel=rel, abs=1e-15)
    return a == b


def _factor(prof, path, t) -> float:
    return class_correction(prof.op_class_fit, path, t)[0]


def test_refit_reproduces_a_known_correction(tmp_path):
    gemm = ("gemm", "f32", "a16")
    corpus = _corpus({gemm: lambda x, c: math.log(2.0), ("pointwise", "float"): lambda x, c: 0.0})
    prof, fit = fit_profile(corpus)
    # measured 2x across every config: kept at the most general class that holds it, factor 2
    assert fit.decisions["gemm"]["kept"] and "gemm" in fit.classes
    for t in (1e-5, 1e-4):
        assert _factor(prof, gemm, t) == pytest.approx(2.0, rel=0.05)
    # the pointwise class is measured as predicted: no correction survives cross-validation
    assert not fit.decisions["pointwise"]["kept"] and _factor(prof, ("pointwise", "float"), 1e-4) == 1.0
    # saved and read back, the refit gives the same profile
    path = corpus.save(tmp_path / "run.samples.json.gz")
    back = Corpus.load(path)
    assert _same(fit_profile(back)[0].op_class_fit, fit_profile(Corpus.from_dict(corpus.to_dict()))[0].op_class_fit)


def test_a_class_whose_fit_does_not_generalize_across_configs_is_dropped():
    grouped = ("conv", "f32", "grouped")
    # conv/f32/dense: 1.5x in every config; the grouped shapes: 3x in even configs at small times,
    # 1/3x in odd ones at large times: one curve fits them all in sample, none predicts a config left out
    truth = {("conv", "f32", "dense"): lambda x, c: math.log(1.5),
             grouped: lambda x, c: math.log(3.0) if c % 2 == 0 else -math.log(3.0)}
    corpus = _corpus(truth, configs=4, per=10, noise=0.01)
    for r in corpus.runs:  # grouped shapes of odd configs sit at large predicted times
        ci = int(r.config[1])
        for k, s in enumerate(r.steps):
            sh = corpus.shapes[s.shape]
            if sh.cls == grouped:
                t = sh.time_s * (math.exp(5.0) if ci % 2 else 1.0)
                corpus.shapes[s.shape] = Shape(grouped, "op", t)
                r.steps[k] = s._replace(device_s=t, measured_s=t * s.measured_s / sh.time_s)
        r.whole_s = sum(s.measured_s for s in r.steps)
    prof, fit = fit_profile(corpus)
    d = fit.decisions["conv/f32/grouped"]
    assert not d["kept"] and "does not generalize" in d["reason"] and d["cv_with"] > d["cv_without"]
    assert "conv/f32/grouped" not in prof.op_class_fit["classes"]
    assert prof.op_class_fit["dropped"]["conv/f32/grouped"] == d["reason"]
    # the dense ones' correction is kept (on the most general class holding it)
    assert _factor(prof, ("conv", "f32", "dense"), 1e-4) == pytest.approx(1.5, rel=0.1)
    assert lookup(prof.op_class_fit, grouped, 1e-4)[0] != "conv/f32/grouped"


def test_no_correction_prices_one_memory_layout_apart_from_the_other():
    # NCHW convolutions measured alone at a third of their price, channels_last ones as priced: a
    # fit per layout would make NCHW look cheap and move convert_channels_last's choice, which the
    # nodes timed alone never compared (on an H200 such a fit refused channels_last on ResNet-50
    # given in NCHW: 3.1x slower, benchmarks/results/diag_nchw_profiles_2026-12-04_064702.json)
    nchw, cl = ("conv", "f32", "dense", "nchw", "mbig"), ("conv", "f32", "dense", "cl", "mbig")
    bn_cl, bn_contig = ("norm", "batch_norm", "cl"), ("norm", "batch_norm", "contig")
    corpus = _corpus({nchw: lambda x, c: -math.log(3.0), cl: lambda x, c: 0.0,
                      bn_cl: lambda x, c: math.log(2.0), bn_contig: lambda x, c: 0.0}, configs=5, noise=0.01)
    prof, fit = fit_profile(corpus)
    for name in ("conv/f32/dense/nchw", "conv/f32/dense/nchw/mbig", "conv/f32/dense/cl", "norm/batch_norm/cl"):
        d = fit.decisions[name]
        assert not d["kept"] and d["reason"].startswith("one memory layout of "), (name, d["reason"])
    assert "conv/f32/dense" in fit.decisions["conv/f32/dense/nchw"]["reason"]
    # both layouts get the same correction (the class above the fork's, or none)
    for t in (1e-5, 1e-4):
        assert _factor(prof, nchw, t) == pytest.approx(_factor(prof, cl, t))
        assert _factor(prof, bn_cl, t) == pytest.approx(_factor(prof, bn_contig, t))
    # the split fit (a GPU corpus: device and host apart) stops at the fork on both sides
    corpus = _split_corpus({nchw: -math.log(3.0), cl: 0.0}, {nchw: math.log(2.0), cl: 0.0}, configs=5)
    _, fit = fit_profile(corpus)
    for side in ("device", "host"):
        d = fit.decisions[f"{side}: conv/f32/dense/nchw"]
        assert not d["kept"] and d["reason"].startswith("one memory layout of "), (side, d["reason"])
    # a class with no channels_last member is fitted per tag as before
    corpus = _corpus({("softmax", "row64", "contig"): lambda x, c: math.log(2.0),
                      ("softmax", "row64", "strided"): lambda x, c: 0.0}, configs=5, noise=0.01)
    _, fit = fit_profile(corpus)
    assert fit.decisions["softmax/row64/contig"]["kept"]


def test_a_class_seen_in_one_config_cannot_be_checked_and_is_dropped():
    corpus = _corpus({("gemm", "f32"): lambda x, c: math.log(2.0)}, configs=3)
    corpus.runs[0].steps += [Step(len(corpus.shapes) + i, 0.0, 1e-5, 1, False, False, 4e-5) for i in range(10)]
    corpus.shapes += [Shape(("pool", "max"), "op", 1e-5) for _ in range(10)]
    _, fit = fit_profile(corpus)
    assert not fit.decisions["pool"]["kept"] and "measured in 1 config only" in fit.decisions["pool"]["reason"]


def test_few_or_noisy_shapes_shrink_the_correction_toward_the_parents():
    rng = random.Random(0)
    few_x = [rng.uniform(-12, -8) for _ in range(8)]
    few_y = [0.2 + rng.gauss(0, 0.6) for _ in few_x]
    raw = fit_curve(few_x, few_y, 2)
    few = _curve_entry(few_x, few_y, lambda x: 0.0, per_knot=8, max_knots=5)
    assert 0 < few["shrink"] < 0.8
    assert all(abs(v) < abs(r) for v, r in zip(few["log_factor"], raw["log_factor"]))
    many_x = [rng.uniform(-12, -8) for _ in range(200)]
    many = _curve_entry(many_x, [0.2 + rng.gauss(0, 0.05) for _ in many_x], lambda x: 0.0, per_knot=8,
                        max_knots=5)
    assert many["shrink"] > 0.99 and all(v == pytest.approx(0.2, abs=0.03) for v in many["log_factor"])
    # a child's change is shrunk toward its parent's curve, not toward no correction
    child = _curve_entry(few_x, [y + 1.0 for y in few_y], lambda x: 1.0, per_knot=8, max_knots=5)
    assert child["shrink"] == pytest.approx(few["shrink"])
    assert child["log_factor"] == pytest.approx([v + 1.0 for v in few["log_factor"]])
    # a fixed time alike
    assert _fixed_entry([2e-6] * 10, 0.0)["fixed_s"] == pytest.approx(2e-6)
    noisy = _fixed_entry([rng.uniform(0.0, 4e-6) for _ in range(3)], 1e-6)
    assert noisy["shrink_fixed"] < 1.0


def test_stream_terms_are_kept_only_where_they_help_whole_calls():
    truth = {("gemm", "f32"): lambda x, c: math.log(2.0)}
    prof, _ = fit_profile(_corpus(truth, stream=1.4))
    st = prof.op_class_fit["stream"]
    assert st["kept"] and st["factor"] == pytest.approx(1.4, rel=0.05)
    assert st["cv"]["classes_and_stream"] < st["cv"]["classes"] < st["cv"]["uncorrected"]
    # whole calls that are the sum of their nodes: the fitted factor is ~1 and is not kept
    prof, _ = fit_profile(_corpus(truth, stream=1.0))
    st = prof.op_class_fit["stream"]
    assert not st["kept"] and (st["factor"], st["add_s"]) == (1.0, 0.0) and "no better" in st["reason"]


def test_held_out_validation_from_the_records():
    truth = {("gemm", "f32"): lambda x, c: math.log(2.0)}
    corpus = _corpus(truth, configs=8, held=("c3:1", "c7:1"))
    prof, _ = fit_profile(corpus)
    assert set(prof.op_class_fit["corpus"]["configs"]) == {f"c{i}:1" for i in (0, 1, 2, 4, 5, 6)}
    v = evaluate(corpus, prof)
    s = v["summary"]
    assert s["rows"] == 2 and s["within_20pct_before"] == 0 and s["within_20pct_after"] == 2
    assert v["classes"]["gemm"]["abs_log_error_after"] < 0.1 < v["classes"]["gemm"]["abs_log_error_before"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.conv = nn.Conv2d(8, 16, 3, padding=1, groups=2)

    def forward(self, x, img):
        y = self.lin(x).relu().transpose(0, 1).contiguous()
        return y * 2, self.conv(img).sum(), img.relu()


FIT = {"classes": {"gemm": {"knots": [-14.0, -10.0], "log_factor": [math.log(2.0), 0.1], "range": [-16.0, -9.0],
                            "add_s": 1e-6},
                   "pointwise": {"knots": [-12.0], "log_factor": [math.log(0.7)], "add_s": 2e-6},
                   "view": {"fixed_s": 3e-6, "n_fixed": 9, "n": 0}}}


SPLIT = {"device_classes": {"gemm": {"knots": [-14.0, -10.0], "log_factor": [math.log(0.5), 0.1],
                                     "range": [-16.0, -9.0]},
                            "pointwise": {"knots": [-12.0], "log_factor": [math.log(0.7)]}},
         "host_classes": {"gemm": {"knots": [-13.0], "log_factor": [math.log(3.0)], "add_s": 1e-6},
                          "view": {"knots": [-13.0], "log_factor": [math.log(2.0)]}}}


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return capture(Net().eval(), (torch.randn(32, 64), torch.randn(2, 8, 10, 10)))


@pytest.mark.parametrize("profile, mode", [("cpu", "eager"), ("h200", "eager"), ("h200", "graphed")])
@pytest.mark.parametrize("reuse", [False, True])
def test_a_record_replays_the_cost_models_whole_call(monkeypatch, net, profile, mode, reuse):
    """A whole call replayed from a graph's record, under any class fit and replay rule, is what
    CostModel.execution_cost gives for the graph (the left-after-replay tail included)."""
    tail_nodes = ir.tail_nodes
    monkeypatch.setattr(ir, "tail_nodes", lambda gm, min_bytes=0: tail_nodes(gm, 0))
    gm = net
    base = replace(get_profile(profile)[0], op_class_fit={})
    run = ConfigRun("net:1", False, gm=gm, hints=ir.shape_hints(gm), execution=mode, reuse_outputs=reuse,
                    node_s={n.name: 1e-5 for n in gm.graph.nodes if n.op == "call_function"}, whole_s=1e-3)
    record, new = record_run(run, CostModel(base), {}, table := [])
    assert new == len(table) > 5 and (mode != "graphed" or reuse or any(s.tail for s in record.steps))
    corpus = Corpus.from_dict(Corpus(base, table, [record]).to_dict())  # as the samples file holds it
    fits = [{}, FIT] + [dict(FIT, replay=rule) for rule in ("lower", "none")] + [SPLIT]
    for fit in fits:
        want = CostModel(replace(base, op_class_fit=fit)).execution_cost(gm, None, mode, reuse_outputs=reuse).total_s
        got = predicted_whole(corpus, corpus.runs[0], _Corrections(fit, corpus.shapes))
        assert got == pytest.approx(want, rel=1e-5)


def test_a_samples_file_stays_small():
    rng = random.Random(0)
    shapes = [Shape(("conv", "bf16", "dense", "cl", "mbig"), "aten.convolution.default", math.exp(rng.uniform(-13, -6)))
              for _ in range(2000)]
    runs = [RunRecord(f"model{i}:64", "captured", i % 4 == 3, "eager", 1e-2,
                      [Step(rng.randrange(2000) if k % 3 else -1, rng.uniform(1e-6, 1e-5), rng.uniform(1e-6, 1e-3),
                            1, False, False, rng.uniform(1e-6, 1e-3) if k % 3 else None) for k in range(300)])
            for i in range(42)]
    data = gzip.compress(json.dumps(Corpus(_toy("cuda"), shapes, runs).to_dict(), separators=(",", ":")).encode())
    assert len(data) < 1_000_000


def test_refit_cli_round_trips(tmp_path, capfd):
    corpus = _corpus({("gemm", "f32"): lambda x, c: math.log(2.0)}, configs=5, held=("c4:1",), stream=1.2)
    path = corpus.save(tmp_path / "calibrate_corpus_x.samples.json.gz")
    out = tmp_path / "fit.json"
    rc = main(["calibrate", "--corpus", "--refit", str(path), "-o", str(out), "--results", str(tmp_path / "r")])
    o, err = capfd.readouterr()
    assert rc == 0, err
    prof, _ = get_profile(str(out))
    want, _ = fit_profile(Corpus.load(path))
    assert _same(prof.op_class_fit["classes"], want.op_class_fit["classes"])
    assert prof.op_class_fit["corpus"]["refit_from"] == str(path)
    assert prof.op_class_fit["validation"]["rows"] == 1
    report = (tmp_path / "r" / "calibrate_corpus_x_refit.md").read_text()
    assert "| gemm |" in report and "kept" in report and "c4:1" in report
    assert json.loads((tmp_path / "r" / "calibrate_corpus_x_refit.json").read_text())["refit"]["command"]
    # with no --results, the report goes beside the samples file
    assert _same(refit(path, out=tmp_path / "again.json", say=lambda m: None)["fit"]["classes"],
                 prof.op_class_fit["classes"])
    assert (tmp_path / "calibrate_corpus_x_refit.md").exists()


def _bad_files(tmp_path):
    good = _corpus({("gemm", "f32"): lambda x, c: 0.5}, configs=3).to_dict()
    cases = {"missing.json.gz": None, "text.json": b"not json at all", "gz.json.gz": gzip.compress(b"{\"a\": ")}
    cases["other.json"] = json.dumps({"format": "something else"}).encode()
    cases["future.json"] = json.dumps(dict(good, version=99)).encode()
    cases["index.json"] = json.dumps(dict(good, shapes=[[7, 0, 1e-5]])).encode()
    cases["negative.json"] = json.dumps(dict(good, runs=[dict(good["runs"][0], whole_s=-1.0)])).encode()
    cases["fields.json"] = json.dumps({k: v for k, v in good.items() if k != "runs"}).encode()
    out = {}
    for name, data in cases.items():
        p = tmp_path / name
        if data is not None:
            p.write_bytes(data)
        out[name] = p
    return out


WHY = {"missing.json.gz": "cannot read samples file", "text.json": "not a corpus samples file",
       "gz.json.gz": "not a corpus samples file", "other.json": "not a corpus samples file",
       "future.json": "version 99", "index.json": "corrupt: class index 7", "negative.json": "corrupt: a whole call",
       "fields.json": "corrupt: missing field 'runs'"}


def test_a_bad_samples_file_is_a_one_line_error(tmp_path, capfd):
    for name, path in _bad_files(tmp_path).items():
        with pytest.raises(CorpusFileError, match=WHY[name]):
            Corpus.load(path)
        rc = main(["calibrate", "--corpus", "--refit", str(path), "-o", str(tmp_path / "p.json")])
        _, err = capfd.readouterr()
        assert rc == 2 and len(err.strip().splitlines()) == 1 and WHY[name] in err, (name, err)


@pytest.mark.parametrize("argv, words", [
    (["calibrate", "--refit", "x.json.gz"], "--refit applies to --corpus only"),
    (["calibrate", "--corpus", "--refit", "x.json.gz", "--device", "cpu"], "--device does not apply to --refit"),
    (["calibrate", "--corpus", "--refit", "x.json.gz", "--configs", "resnet50"], "--configs does not apply"),
    (["calibrate", "--corpus", "--refit", "x.json.gz", "--min-samples", "1"], "--min-samples must be at least 2"),
])
def test_refit_arguments_are_one_line_errors(capfd, argv, words):
    rc = main(argv)
    _, err = capfd.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err


def test_corrections_fitted_alone_apply_to_a_replay_by_its_rule():
    from graphopt.cost.opclass import corrected_times

    corr = (3.0, 1e-6, None)
    assert corrected_times(corr, 2e-6, 1e-5) == pytest.approx((7e-6, 3e-5))
    assert corrected_times(corr, 2e-6, 1e-5, "full") == pytest.approx((7e-6, 3e-5))
    assert corrected_times(corr, 2e-6, 1e-5, "none") == pytest.approx((7e-6, 1e-5))
    assert corrected_times(corr, 2e-6, 1e-5, "lower") == pytest.approx((7e-6, 1e-5))
    assert corrected_times((0.5, 0.0, None), 2e-6, 1e-5, "lower") == pytest.approx((1e-6, 5e-6))


def test_the_replay_rule_is_chosen_on_replayed_whole_calls():
    # nodes timed alone run 3x their predicted device time (host dispatch); replayed, the graph takes
    # the predicted device times: the fit keeps the 3x for eager calls and not inside a replay
    corpus = _corpus({("pointwise", "float"): lambda x, c: math.log(3.0)}, configs=6, held=("c5:1",))
    prof = _toy("cuda")
    corpus.profile = replace(prof, launch_overhead_graph_s=0.0)
    for r in list(corpus.runs):
        dev = sum(s.device_s for s in r.steps)
        corpus.runs.append(RunRecord(r.config, "optimized", r.held_out, "graphed",
                                     dev + corpus.profile.launch_overhead_s, list(r.steps)))
    prof, fit = fit_profile(corpus)
    assert prof.op_class_fit["replay"] in ("none", "lower")
    cv = prof.op_class_fit["replay_fit"]["cv"]
    assert cv["none"] < cv["full"]
    rows = {(r["config"], r["source"]): r for r in evaluate(corpus, prof)["rows"]}
    assert abs(rows[("c5:1", "optimized")]["error_pct_after"]) < 5
    assert abs(rows[("c5:1", "captured")]["error_pct_after"]) < 10
    # an old fit without the rule applies its factor in a replay as before
    assert _Corrections({"classes": fit.classes}, corpus.shapes).replay == "full"


# ------------------------------------------------------------------------------------ split fit


def _split_corpus(dev_truth: dict, host_truth: dict, *, configs: int = 6, per: int = 12, noise: float = 0.03,
                  held=(), seed: int = 0) -> Corpus:
    """A GPU corpus whose nodes were timed apart (host issue and device time alone), with known
    truth: a node of class ``cls`` runs exp(dev_truth[cls]) times its predicted device time and
    issues in exp(host_truth[cls]) times its predicted host time (``noise`` on both). Per config an
    eager captured graph (its whole call the eager queue of the true times) and a replayed one
    (its whole call the true device times after one launch)."""
    from graphopt.cost.model import QueueInputs, QueueStep, queue_cost

    rng = random.Random(seed)
    prof = replace(_toy("cuda"), launch_overhead_graph_s=0.0)
    shapes, runs = [], []
    for ci in range(configs):
        cfg = f"c{ci}:1"
        steps, true = [], []
        for cls in dev_truth:
            for _ in range(per):
                dev, host = math.exp(rng.uniform(-13.0, -8.0)), prof.launch_overhead_s * rng.choice((1.0, 1.5))
                shapes.append(Shape(cls, f"aten.{cls[-1]}", max(dev, host)))
                dm = dev * math.exp(dev_truth[cls] + rng.gauss(0, noise))
                hm = host * math.exp(host_truth[cls] + rng.gauss(0, noise))
                steps.append(Step(len(shapes) - 1, host, dev, 1, False, False, max(hm, dm), hm, dm))
                true.append(QueueStep(None, hm, dm, 1))
        eager = queue_cost(prof, QueueInputs("eager", true, [], [])).total_s
        runs.append(RunRecord(cfg, "captured", cfg in held, "eager", eager, steps))
        runs.append(RunRecord(cfg, "optimized", cfg in held, "graphed", prof.launch_overhead_s +
                              sum(t.device_s for t in true), list(steps)))
    return Corpus(prof, shapes, runs, {"configs": [f"c{i}:1" for i in range(configs) if f"c{i}:1" not in held],
                                       "held_out": list(held), "dtype": "bfloat16"}, {}, "synthetic")


GEMM, PW = ("gemm", "bf16", "a16"), ("pointwise", "float", "same", "add")


def test_the_split_fit_recovers_device_and_host_corrections_apart():
    from graphopt.cost.opclass import split_correction

    # device: gemms run at 0.6x their predicted time, pointwise ops as predicted; host: every op
    # issues in 3x its predicted time (what a node timed alone carries, not what a replay pays)
    corpus = _split_corpus({GEMM: math.log(0.6), PW: 0.0}, {GEMM: math.log(3.0), PW: math.log(3.0)}, configs=8,
                           held=("c3:1", "c7:1"))
    prof, fit = fit_profile(corpus)
    f = prof.op_class_fit
    assert f["version"] == 3 and "classes" not in f and fit.host is not None
    assert f["corpus"]["samples_device"] == f["corpus"]["samples_host"] == 2 * 12 * 6
    assert fit.decisions["device: gemm"]["kept"] and not fit.decisions["device: pointwise"]["kept"]
    assert "cross-validated error" in fit.decisions["device: pointwise"]["reason"]
    assert any(k.startswith("host: ") and d["kept"] for k, d in fit.decisions.items())
    for dev in (1e-5, 1e-4):
        fd, fh, add = split_correction(f, GEMM, 2e-6, dev, "aten.a16")
        assert fd == pytest.approx(0.6, rel=0.05) and fh == pytest.approx(3.0, rel=0.05) and add == 0.0
        fd, fh, _ = split_correction(f, PW, 2e-6, dev, "aten.add")
        assert fd == 1.0 and fh == pytest.approx(3.0, rel=0.05)
    assert f["replay"] == "full" and "split fit" in f["replay_fit"]["reason"]
    # held out: the eager calls (host-bound queue) and the replays (device time) predicted from them
    v = evaluate(corpus, prof)
    rows = {(r["config"], r["source"]): r for r in v["rows"]}
    for cfg in ("c3:1", "c7:1"):
        assert abs(rows[(cfg, "captured")]["error_pct_after"]) < 5 < abs(rows[(cfg, "captured")]["error_pct_before"])
        assert abs(rows[(cfg, "optimized")]["error_pct_after"]) < 5 < abs(rows[(cfg, "optimized")]["error_pct_before"])
    assert v["classes"]["device: gemm"]["abs_log_error_after"] < 0.1 < v["classes"]["device: gemm"][
        "abs_log_error_before"]
    assert any(k.startswith("host: ") and c["abs_log_error_after"] < 0.1 < c["abs_log_error_before"]
               for k, c in v["classes"].items())


def test_split_samples_round_trip_and_old_samples_still_refit(tmp_path):
    corpus = _split_corpus({GEMM: math.log(0.6)}, {GEMM: math.log(3.0)}, configs=5, held=("c4:1",))
    back = Corpus.load(corpus.save(tmp_path / "split.samples.json.gz"))
    assert back.runs[0].steps[0].host_m == pytest.approx(corpus.runs[0].steps[0].host_m, rel=1e-5)
    assert back.runs[0].steps[0].device_m == pytest.approx(corpus.runs[0].steps[0].device_m, rel=1e-5)
    assert fit_profile(back)[0].op_class_fit["device_classes"]
    # a samples file written before the host and device times were kept: the combined fit, as before
    old = corpus.to_dict()
    for r in old["runs"]:
        r["steps"] = [s[:6] for s in r["steps"]]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    prof, fit = fit_profile(Corpus.load(path))
    assert fit.host is None and prof.op_class_fit["version"] == 2 and "device_classes" not in prof.op_class_fit
    assert fit.decisions["gemm"]["kept"] and prof.op_class_fit["classes"]
    # a step of the wrong length is a one-line error
    bad = corpus.to_dict()
    bad["runs"][0]["steps"][0] = bad["runs"][0]["steps"][0][:7]
    with pytest.raises(CorpusFileError, match="a step of 7 fields"):
        Corpus.from_dict(bad)


def test_a_split_refit_writes_both_tables_and_its_report(tmp_path, capfd):
    corpus = _split_corpus({GEMM: math.log(0.6)}, {GEMM: math.log(3.0)}, configs=5, held=("c4:1",))
    path = corpus.save(tmp_path / "calibrate_corpus_s.samples.json.gz")
    out = tmp_path / "fit.json"
    assert main(["calibrate", "--corpus", "--refit", str(path), "-o", str(out), "--results", str(tmp_path)]) == 0
    o, _ = capfd.readouterr()
    assert "(device and host apart)" in o
    prof, _ = get_profile(str(out))
    assert prof.op_class_fit["device_classes"] and prof.op_class_fit["host_classes"]
    report = (tmp_path / "calibrate_corpus_s_refit.md").read_text()
    assert "| device: gemm |" in report and "split fit on" in report and "host: gemm" in report
