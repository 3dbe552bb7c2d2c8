"""The model sweep's fast subset (issue 10): each model's status must equal the committed
tests/sweep_expected.csv. The full sweep is `python benchmarks/sweep.py --all`."""

import pytest

from graphopt.tools import sweep

FAST = ["resnet18", "mobilenet_v3_small", "squeezenet1_0", "shufflenet_v2_x0_5", "regnet_y_400mf",
        "efficientnet_b0", "bert", "llama", "gpt2", "vit"]


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


def test_difference_names_regressions_and_improvements():
    exp = {"m": {"name": "m", "source": "hf", "status": "fail_accuracy", "seconds": "1", "message": "rmse 1"}}
    assert sweep.difference(sweep.Row("m", "hf", "fail_accuracy", 1.0, "rmse 2"), exp) is None
    better = sweep.difference(sweep.Row("m", "hf", "pass", 1.0), exp)
    assert "unexpected improvement" in better and "--update" in better
    exp["m"]["status"] = "pass"
    worse = sweep.difference(sweep.Row("m", "hf", "fail_to_run", 1.0, "ValueError: x"), exp)
    assert "regression" in worse and "ValueError: x" in worse
