"""The model sweep's fast subset (issue 10): each model's status must equal the committed
tests/sweep_expected.csv. The full sweep is `python benchmarks/sweep.py --all`."""

import pytest

from graphopt.tools import sweep

# the three slowest CNNs (4-5 s each on two cores) run with the slow tests; the other CNNs keep the
# torchvision rows in the CPU suite
FAST = ["resnet18", "mobilenet_v3_small", "squeezenet1_0",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("shufflenet_v2_x0_5", "regnet_y_400mf", "efficientnet_b0")),
        "bert", "llama", "gpt2", "vit"]


@pytest.fixture(scope="module")
def expected():
    return sweep.read_csv()


def test_expected_csv_is_well_formed(expected):
    assert len([r for r in expected.values() if r["source"] == "hf"]) >= 15
    assert {r["status"] for r in expected.values()} <= set(sweep.STATUSES)
    specs = sweep.all_specs()
    assert {s.name for s in specs if s.source == "hf"} == {n for n, r in expected.items() if r["source"] == "hf"}
    # another torchvision may list other models: every one listed here must have an expected status
    missing = [s.name for s in specs if s.name not in expected]
    assert not missing, (f"no expected status for {', '.join(missing)}: "
                         f"python benchmarks/sweep.py --models {','.join(missing)} --update")


@pytest.mark.parametrize("name", FAST)
def test_sweep_status_matches_expected(name, expected):
    (spec,) = sweep.get_specs([name])
    row = sweep.run_one(spec)
    msg = sweep.difference(row, expected)
    assert msg is None, msg


def test_a_strict_plan_row_fails_when_a_pass_breaks_the_graph(monkeypatch):
    """--plan: a pass that breaks (here: raises) is not reverted; the model's row fails with why."""
    from graphopt.pipeline import assemble

    (spec,) = sweep.get_specs(["resnet18"])
    assert sweep.run_one(spec, plan="h200").status == "pass"

    def broken(self, gm, ctx):
        raise RuntimeError("planted: the graph is broken")

    monkeypatch.setattr(type(assemble(["fold_conv_bn"])[0]), "run", broken)
    row = sweep.run_one(spec, plan="h200")
    assert row.status == "fail_to_run" and "planted" in row.message, row


def test_difference_names_regressions_and_improvements():
    exp = {"m": {"name": "m", "source": "hf", "status": "fail_accuracy", "seconds": "1", "message": "rmse 1"}}
    assert sweep.difference(sweep.Row("m", "hf", "fail_accuracy", 1.0, "rmse 2"), exp) is None
    better = sweep.difference(sweep.Row("m", "hf", "pass", 1.0), exp)
    assert "unexpected improvement" in better and "--update" in better
    exp["m"]["status"] = "pass"
    worse = sweep.difference(sweep.Row("m", "hf", "fail_to_run", 1.0, "ValueError: x"), exp)
    assert "regression" in worse and "ValueError: x" in worse


def _strict_gpu_plan(model, inputs):
    """Every pass but assign_precision, strict (a pass that breaks the graph raises), on the H200
    profile as optimize() plans it for CUDA-graph replay on a GPU; the result judged by the
    accuracy rule against fp64."""
    import torch

    from graphopt import accuracy
    from graphopt.capture import split_inputs

    args, kwargs = split_inputs(inputs)
    with torch.no_grad():
        eager = model(*args, **kwargs)
    ref = accuracy.fp64_reference(model, args, kwargs)
    gm, applied = sweep.strict_plan(model, inputs, "h200")
    with torch.no_grad():
        res = accuracy.check(gm(*args, **kwargs), ref, eager)
    assert res.passed, res.reason
    return applied


@pytest.mark.parametrize("name", ["swin", "gpt2"])
def test_gpu_plan_applies_without_breaking_the_graph(name):
    (spec,) = sweep.get_specs([name])
    applied = _strict_gpu_plan(*spec.build())
    assert "fuse_layer_norm" in applied


@pytest.mark.slow
def test_swin_t_at_224_gpu_plan():
    """torchvision's swin_t at 224 planned for a GPU: its patch-embedding LayerNorm feeds the
    first block's LayerNorm, and both take the many-rows kernel (a use-before-def once)."""
    import torch

    (spec,) = sweep.get_specs(["swin_t"])
    model, _ = spec.build()
    applied = _strict_gpu_plan(model, (torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0)),))
    assert "fuse_layer_norm" in applied
