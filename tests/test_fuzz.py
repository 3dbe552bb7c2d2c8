"""Fuzzing the passes (issue 10.2): random programs from graphopt.tools.fuzz's grammar, random pass
subsets (pipeline order), cpu and h200 targets, checked against eager by the accuracy rule.
Bounded budget here; `python benchmarks/fuzz.py --examples N --seed S` is the long campaign, and
its shrunk failures live in tests/fuzz_regressions/."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from graphopt.tools import fuzz
from graphopt.pipeline import available

# signatures of known, still-open pass bugs the CI property skips (each pinned by an xfail test in
# tests/fuzz_regressions/); both bugs the first campaign found are fixed, so none today
KNOWN: set = set()

_ci = settings(max_examples=40, deadline=None, database=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _check(program, passes, target, mode):
    try:
        fuzz.check_program(program, passes, target, mode)
    except fuzz.FuzzFailure as e:
        if e.signature() in KNOWN:
            return
        raise


def test_grammar_renders_every_op():
    p = fuzz.Program(2, 4, 8, ("f32", "bf16"), (
        ("linear", 0, 16, True), ("act", 2, "gelu_tanh"), ("linear", 3, 8, False),
        ("binary", "add", 4, "value", 0), ("layer_norm", 5, True), ("rms_norm", 1),
        ("mha", 5, 2, True), ("swiglu", 7, 16), ("conv", 8, 4, 3, True, True),
        ("split", 8), ("permute", 11, (0, 2, 1, 3)), ("contiguous", 12), ("merge", 13),
        ("attention", 8, 8, 8, True), ("bmm", 15, 15), ("softmax", 16), ("matmul_w", 17, 4),
        ("cast", 18, "bf16"), ("binary", "div", 19, "param", (1, 4)), ("transpose", 20),
        ("binary", "mul", 21, "scalar", 0.5), ("act", 22, "hardswish")), (23, 7), seed=1)
    model, inputs = fuzz.build(p)
    out = model(*inputs)
    assert out[0].shape == (2, 4, 4) and out[1].dtype == torch.float32
    assert [tuple(s) for s in model.shapes][-1] == (2, 4, 4)


@_ci
@given(fuzz.programs(), fuzz.pass_subsets(), st.sampled_from(("cpu", "h200")))
def test_random_passes_keep_eager_numbers(program, passes, target):
    _check(program, passes, target, "passes")


@settings(_ci, max_examples=8)
@given(fuzz.programs(max_ops=6), fuzz.pass_subsets(available()), st.sampled_from(("cpu", "h200")))
def test_optimize_end_to_end(program, passes, target):
    _check(program, passes, target, "optimize")


@pytest.mark.slow
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz.programs(max_ops=12), fuzz.pass_subsets(), st.sampled_from(("cpu", "h200")))
def test_random_passes_long(program, passes, target):
    _check(program, passes, target, "passes")


def test_regression_file_reproduces(tmp_path):
    p = fuzz.Program(1, 4, 8, ("f32",), (("act", 0, "relu"),), (1,))
    src = fuzz.regression_source(p, ["fuse_elementwise"], "cpu", "passes", "[passes] boom", xfail=False)
    f = tmp_path / "test_r.py"
    f.write_text(src)
    ns: dict = {}
    exec(compile(src, str(f), "exec"), ns)
    assert ns["PROGRAM"] == p
    ns["test_reproduces"]()
