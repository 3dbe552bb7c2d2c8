import torch

from graphopt import accuracy


def test_allclose_passes_and_tolerances():
    ref = torch.randn(100, dtype=torch.float64)
    out = ref.float() + 5e-5
    r = accuracy.check(out, ref, ref.float())
    assert r.passed and r.leaves[0].how == "allclose" and r.leaves[0].tol == 1e-4
    assert accuracy.tolerance(torch.bfloat16) == 1e-2
    assert accuracy.tolerance(torch.float32, training=True) == 1e-3


def test_rmse_fallback_relative_to_eager_error():
    ref = torch.randn(1000, dtype=torch.float64) * 100
    eager = (ref + torch.randn(1000, dtype=torch.float64) * 0.1).float()
    close = (ref + torch.randn(1000, dtype=torch.float64) * 0.12).float()
    far = (ref + torch.randn(1000, dtype=torch.float64) * 1.0).float()
    assert accuracy.check(close, ref, eager).leaves[0].how == "rmse"
    assert not accuracy.check(far, ref, eager).passed


def test_nan_never_passes_and_ints_exact():
    ref = torch.randn(10, dtype=torch.float64)
    bad = ref.float().clone()
    bad[3] = float("nan")
    assert not accuracy.check(bad, ref, bad).passed
    ids = torch.arange(5)
    assert accuracy.check(ids, ids, ids).passed
    assert not accuracy.check(ids + 1, ids, ids).passed


def test_nested_outputs_and_count_mismatch():
    ref = (torch.randn(3, dtype=torch.float64), {"a": torch.randn(2, dtype=torch.float64)})
    out = (ref[0].float(), {"a": ref[1]["a"].float()})
    assert accuracy.check(out, ref, out).passed
    r = accuracy.check((ref[0].float(),), ref, None)
    assert not r.passed and "outputs" in r.reason


def test_matmul_floor_rounds_only_matmul_inputs():
    """The low-precision yardstick: linear/matmul/conv inputs rounded to bf16, arithmetic in fp32,
    everything else (here the add and the exp) untouched."""
    import torch.nn as nn

    from graphopt.accuracy import matmul_floor

    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    ones = torch.ones(8, 8)

    class M(nn.Module):
        def forward(self, t):
            return torch.exp(lin(t) * 0.1) + t[:, :8] @ ones / 3

    got = matmul_floor(M(), (x,), {}, torch.bfloat16)
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    with torch.no_grad():
        exp = torch.exp((r(x) @ r(lin.weight).t() + r(lin.bias)) * 0.1) + r(x[:, :8]) @ r(ones) / 3
        plain = M()(x)
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)
    assert got.dtype == torch.float32
    assert not torch.allclose(got, plain, rtol=1e-6, atol=1e-6)  # the rounding did happen
