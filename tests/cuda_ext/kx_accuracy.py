"""The DESIGN.md accuracy rule, local to the kernel tests (graphopt.accuracy will replace it).

pass if allclose(out, ref, atol=tol, rtol=tol), else if
rmse(out, ref64) <= k * rmse(eager, ref64) + tol / 10 (k = 2 fp32, 3 bf16/fp16);
tol 1e-4 fp32 inference, 1e-3 fp32 training, 1e-2 bf16/fp16. NaN never passes."""
from __future__ import annotations

import torch


def tol_for(dtype: torch.dtype, training: bool = False) -> float:
    if dtype in (torch.bfloat16, torch.float16):
        return 1e-2
    if dtype == torch.float64:
        return 1e-10
    return 1e-3 if training else 1e-4


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def check(out: torch.Tensor, ref64: torch.Tensor, eager: torch.Tensor | None = None, *, dtype=None,
          training: bool = False, what: str = "") -> None:
    """Assert the accuracy rule; ``ref64`` is the fp64 reference, ``eager`` the composite the op
    replaces, run in the op's dtype. Every element is compared (unwritten memory shows)."""
    dtype = dtype or out.dtype
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    o, r = out.detach().double().cpu(), ref64.detach().double().cpu()
    bad_nan = torch.isnan(o) & ~torch.isnan(r)
    assert not bad_nan.any(), f"{what}: {int(bad_nan.sum())} NaN in the output where the reference has none"
    tol = tol_for(dtype, training)
    if torch.allclose(o, r, atol=tol, rtol=tol, equal_nan=True):
        return
    k = 2.0 if dtype in (torch.float32, torch.float64) else 3.0
    finite = torch.isfinite(r)
    e_out = _rmse(o[finite], r[finite])
    assert eager is not None, f"{what}: not allclose at tol {tol} (rmse {e_out:.3g}) and no eager result given"
    e_eager = _rmse(eager.detach().double().cpu()[finite], r[finite])
    assert e_out <= k * e_eager + tol / 10, (
        f"{what}: rmse {e_out:.3g} > {k} x eager rmse {e_eager:.3g} + {tol / 10:g} "
        f"(max abs err {(o - r)[finite].abs().max().item():.3g})")
