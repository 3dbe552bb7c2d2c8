"""The ``graphopt`` command line: explain / export / zoo / passes, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt import accuracy
from graphopt.tools.cli import main
from graphopt.examples import zoo
from graphopt.pipeline import assemble

# the declared pipeline, less entries whose pass is not built yet
PIPELINE = [p.name for p in assemble()]


@pytest.fixture(autouse=True)
def _no_traceback_env(monkeypatch):
    monkeypatch.delenv("GRAPHOPT_TRACEBACK", raising=False)
    monkeypatch.delenv("TORCH_LOGS", raising=False)


def run(capfd, *argv):
    """main() in process; capfd (file-descriptor level) also sees what torch's loggers write."""
    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return rc, out, err


def explain_json(capfd, tmp_path, *argv):
    path = tmp_path / "report.json"
    rc, out, err = run(capfd, "explain", *argv, "--json", path)
    assert rc == 0, err
    return json.loads(path.read_text()), out


def by_name(report):
    return {p["name"]: p for p in report["passes"]}


# ----------------------------------------------------------------------------- explain


def test_explain_mlp_json_schema(capfd, tmp_path):
    report, out = explain_json(capfd, tmp_path, "mlp", "--verbose")
    assert report["model"] == "mlp"
    assert report["device"] == "cpu"
    for key in ("predicted_ms_before", "predicted_ms_after"):
        assert isinstance(report[key], float) and report[key] > 0
    assert report["predicted_ms_after"] <= report["predicted_ms_before"]
    assert report["accuracy"]["passed"] is True
    names = [p["name"] for p in report["passes"]]
    assert names == list(PIPELINE)
    for p in report["passes"]:
        assert p["status"] in {"applied", "unchanged", "skipped", "reverted", "disabled"}
        assert type(p["rewrites"]) is int and p["rewrites"] >= 0
        assert isinstance(p["predicted_ms_before"], float) and isinstance(p["predicted_ms_after"], float)
        assert isinstance(p["rejected"], list)
        for r in p["rejected"]:
            assert set(r) >= {"candidate", "reason"} and r["reason"]
    # with --verbose the table printed on stdout shows every pass, then the summary lines
    for name in PIPELINE:
        assert name in out
    for words in ("predicted", "roofline floor", "peak memory", "bottleneck", "compute-bound", "memory-bound",
                  "launch-bound", "accuracy vs fp64 reference: passed"):
        assert words in out, words


def test_explain_for_the_h200_shows_the_floor_at_the_sustained_gemm_rate(capfd):
    """Planning for the H200 from this machine: the summary gives the roofline floor at the peak
    rate and at the rate the GPU sustains under its power limit (the profile's measurement)."""
    assert main(["explain", "mlp", "--target", "h200", "--no-accuracy", "--batch", "8192"]) == 0
    out = " ".join(capfd.readouterr().out.split())  # rich wraps the summary line
    assert "roofline floor" in out and "at the sustained GEMM rate" in out
    # a launch-bound batch: the two floors agree, and only one is shown
    assert main(["explain", "mlp", "--target", "h200", "--no-accuracy"]) == 0
    out = " ".join(capfd.readouterr().out.split())
    assert "roofline floor" in out and "sustained GEMM rate" not in out


def test_explain_default_model_is_resnet50_with_53_folds(capfd, tmp_path):
    """No MODEL: the bundled default (resnet50, batch 1 to keep the test quick; assign_precision
    left out: its bf16 search over resnet50 on the CPU profile costs minutes and ends unchanged)."""
    assert zoo.DEFAULT == "resnet50"
    report, out = explain_json(capfd, tmp_path, "--batch", 1, "--disable", "assign_precision")
    assert report["model"] == "resnet50"
    fold = by_name(report)["fold_conv_bn"]
    assert fold["status"] == "applied" and fold["rewrites"] == 53
    assert report["accuracy"]["passed"] is True
    assert "fold_conv_bn" in out and "53" in out


def test_explain_passes_and_disable(capfd, tmp_path):
    report, _ = explain_json(capfd, tmp_path, "shape-branch")
    assert by_name(report)["fold_conv_bn"]["status"] == "applied"
    assert by_name(report)["fold_conv_bn"]["rewrites"] == 2

    only, _ = explain_json(capfd, tmp_path, "shape-branch", "--passes", "fold_conv_bn")
    assert [p["name"] for p in only["passes"]] == ["fold_conv_bn"]
    assert only["passes"][0]["rewrites"] == 2

    off, _ = explain_json(capfd, tmp_path, "shape-branch", "--disable", "fold_conv_bn,fold_constants")
    passes = by_name(off)
    assert [p["name"] for p in off["passes"]] == list(PIPELINE)
    for name in ("fold_conv_bn", "fold_constants"):
        assert passes[name]["status"] == "disabled" and passes[name]["rewrites"] == 0
    assert off["predicted_ms_after"] > report["predicted_ms_after"]  # the folds were what saved time


def test_explain_file_factory(capfd, tmp_path):
    f = tmp_path / "mymodel.py"
    f.write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (torch.randn(4, 8),)
    """))
    report, _ = explain_json(capfd, tmp_path, f"{f}:make")
    assert report["model"] == f"{f}:make"
    assert report["accuracy"]["passed"] is True


# ----------------------------------------------------------------------------- bad inputs

FACTORIES = textwrap.dedent("""
    import sys
    import torch

    def boom():
        raise RuntimeError("weights not found\\nsecond line of the message")

    def exits():
        sys.exit(3)

    def not_a_tuple():
        return torch.nn.Linear(4, 2)

    def three():
        return torch.nn.Linear(4, 2), (torch.randn(3, 4),), "extra"

    def not_a_module():
        return "model", (torch.randn(3, 4),)

    def wrong_shape():
        return torch.nn.Linear(4, 2), (torch.randn(3, 5),)

    CONSTANT = 3
""")


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


BAD = {
    "unknown zoo name": (["explain", "no-such-model"], "unknown model"),
    "file without factory part": (["explain", "factories.py"], "no factory"),
    "missing file": (["explain", "nope.py:f"], "does not exist"),
    "file without that factory": (["explain", "factories.py:missing"], "no function 'missing'"),
    "not callable": (["explain", "factories.py:CONSTANT"], "not a function"),
    "factory raises": (["explain", "factories.py:boom"], "raised RuntimeError: weights not found"),
    "factory exits": (["explain", "factories.py:exits"], "raised SystemExit"),
    "factory returns a module": (["explain", "factories.py:not_a_tuple"], "must return (model, example_inputs)"),
    "factory returns 3 things": (["explain", "factories.py:three"], "must return (model, example_inputs)"),
    "factory returns a non-module": (["explain", "factories.py:not_a_module"], "torch.nn.Module"),
    "inputs do not fit the model": (["explain", "factories.py:wrong_shape"], "cannot capture"),
    "file with a syntax error": (["explain", "broken.py:f"], "SyntaxError"),
    "module that does not import": (["explain", "no_such_pkg.models:make"], "cannot import module 'no_such_pkg.models'"),
    "module without that factory": (["explain", "json:no_such_factory"], "no function"),
    "unknown pass": (["explain", "mlp", "--passes", "fold_everything"], "unknown pass fold_everything"),
    "unknown disabled pass": (["explain", "mlp", "--disable", "fold_conv_bn,nope"], "unknown pass nope"),
    "unknown device": (["explain", "mlp", "--device", "tpu9"], "unknown device 'tpu9'"),
    "bad batch": (["explain", "mlp", "--batch", "0"], "batch"),
    "unknown target": (["explain", "mlp", "--target", "nope"], "nope"),
    "json not writable": (["explain", "mlp", "--json", "factories.py/x.json"], "cannot write"),
    "export not writable": (["export", "mlp", "-o", "factories.py/x.pt"], "cannot write"),
    "export without -o": (["export", "mlp"], "-o"),
    "unknown command": (["frobnicate"], "invalid choice"),
}


def _assert_one_line_error(rc, err, expect):
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("graphopt: error: ")
    assert expect in lines[0], lines[0]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2(case, capfd, factories):
    argv, expect = BAD[case]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors exit through sys.exit(2)
        rc = e.code
    _, err = capfd.readouterr()
    _assert_one_line_error(rc, err, expect)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capfd):
    rc, _, err = run(capfd, "explain", "mlp", "--device", "cuda")
    _assert_one_line_error(rc, err, "CUDA is not available")


def test_graphopt_traceback_env_shows_the_traceback(monkeypatch, capfd):
    monkeypatch.setenv("GRAPHOPT_TRACEBACK", "1")
    with pytest.raises(graphopt.ModelSpecError):
        main(["explain", "no-such-model"])


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_graphopt_traceback_env_off_values_keep_the_one_line_error(monkeypatch, capfd, value):
    monkeypatch.setenv("GRAPHOPT_TRACEBACK", value)
    rc, _, err = run(capfd, "explain", "no-such-model")
    _assert_one_line_error(rc, err, "unknown model")


DATA_DEPENDENT = textwrap.dedent("""
    import torch

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:
                return y * 2
            return y - 1

    def make():
        return Branchy(), (torch.randn(4, 8),)
""")


def test_capture_error_is_one_line_and_the_partial_graph_goes_to_dump_ir(capfd, tmp_path):
    """torch.export prints the graph it had traced before raising; the CLI's stderr is still the
    one-line CaptureError, and --dump-ir keeps that graph in a file."""
    f = tmp_path / "branchy.py"
    f.write_text(DATA_DEPENDENT)
    rc, out, err = run(capfd, "explain", f"{f}:make")
    _assert_one_line_error(rc, err, "cannot capture Branchy")
    assert "branchy.py:11" in err and "def forward" not in out + err
    dump = tmp_path / "dump"
    rc, out, err = run(capfd, "explain", f"{f}:make", "--dump-ir", dump)
    lines = err.strip().splitlines()
    assert rc == 2 and lines[0].startswith("graphopt: error: cannot capture Branchy") and len(lines) == 2
    assert str(dump / "capture_failed.py") in lines[1]
    assert "aten.linear.default" in (dump / "capture_failed.py").read_text()


CONV_STACK = textwrap.dedent("""
    import torch

    def make():
        layers = []
        for _ in range(6):
            layers += [torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers).eval(), (torch.randn(1, 4, 8, 8),)
""")


def test_explain_is_concise_by_default_and_verbose_on_request(capfd, tmp_path):
    """The default output groups rewrites per pattern and refusals per reason, without node
    names, and lists only the passes that changed something; --verbose has every pass and node."""
    f = tmp_path / "convs.py"
    f.write_text(CONV_STACK)
    rc, out, _ = run(capfd, "explain", f"{f}:make", "--no-accuracy")
    assert rc == 0
    assert "6 × conv+batchnorm" in out and "conv2d_3" not in out and "batch_norm_3" not in out
    assert "fuse_rotary" not in out and "other passes changed nothing" in out
    assert "predicted" in out and out.count(" ms → ") == 1  # one predicted total
    assert len(out.splitlines()) < 30
    assert all(len(line) <= 120 for line in out.splitlines())
    rc, verbose, _ = run(capfd, "explain", f"{f}:make", "--no-accuracy", "--verbose")
    assert rc == 0 and "conv2d_3" in verbose and all(name in verbose for name in PIPELINE)
    assert "costliest nodes" in verbose


def test_console_script_one_line_error(factories):
    """The installed console script: exit status 2 and a single stderr line on a real process's
    stderr (torch's loggers included: this model's capture failure makes torch log a traceback)."""
    exe = shutil.which("graphopt", path=str(Path(sys.executable).parent)) or shutil.which("graphopt")
    assert exe, "the graphopt console script is not installed"
    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHOPT_TRACEBACK", "TORCH_LOGS")}
    proc = subprocess.run([exe, "explain", "factories.py:wrong_shape"], cwd=factories, env=env,
                          capture_output=True, text=True, timeout=300)
    _assert_one_line_error(proc.returncode, proc.stderr, "cannot capture")
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- zoo, passes, export


def test_zoo_lists_every_model(capfd):
    rc, out, _ = run(capfd, "zoo")
    assert rc == 0
    first_cells = [line.split("│")[1].split() for line in out.splitlines() if line.count("│") > 2]
    listed = {cell[0] for cell in first_cells if cell}
    assert set(zoo.names()) <= listed
    assert f"{zoo.DEFAULT} (default)" in out


def test_passes_lists_the_pipeline_in_order(capfd):
    rc, out, _ = run(capfd, "passes")
    assert rc == 0
    positions = [out.find(name) for name in PIPELINE]
    assert all(p >= 0 for p in positions) and positions == sorted(positions)


@pytest.mark.parametrize("suffix,fmt,kind", [(".pt", None, "torchscript"), (".pt2", None, "pt2"),
                                             (".bin", "pt2", "pt2")])
def test_export_mlp(capfd, tmp_path, suffix, fmt, kind):
    path = tmp_path / f"mlp{suffix}"
    rc, out, err = run(capfd, "export", "mlp", "-o", path, *(["--format", fmt] if fmt else []))
    assert rc == 0, err
    assert path.exists() and str(path) in out
    loaded = graphopt.load(path)
    assert loaded.meta["artifact"] == kind
    assert loaded.report["model"] == "mlp"
    model, inputs = zoo.get("mlp")
    with torch.no_grad():
        out, eager = loaded(*inputs), model(*inputs)
    # the accuracy rule at the precision the optimizer chose (assign_precision may pick bf16)
    chosen = next((p.get("details", {}).get("dtype") for p in loaded.report["passes"]
                   if p["name"] == "assign_precision" and p["status"] == "applied"), None)
    res = accuracy.check(out, accuracy.fp64_reference(model, tuple(inputs), {}), eager,
                         **({"dtype": getattr(torch, chosen)} if chosen else {}))
    assert res.passed, res.reason


def test_no_command_prints_help(capfd):
    rc, out, _ = run(capfd)
    assert rc == 2 and "explain" in out
