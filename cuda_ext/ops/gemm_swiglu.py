"""graphopt::gemm_swiglu: ``silu(x @ Wg.T) * (x @ Wu.T)``, shape ``[..., n]``: a SwiGLU MLP's gate and
up projections and its activation in one GEMM, accumulated in fp32 and rounded once.

``weight`` is ``cat([Wg, Wu])`` itself with ``block = 0`` (the model's merged gate/up weight, no
copy: the kernel loads the gate and up rows of a tile with two TMA descriptors), or
``interleave_gate_up(cat([Wg, Wu]), block)``: Wg and Wu in alternating blocks of ``block`` rows
(each half zero-padded to a multiple of ``block``). CUDA kernel: ``gemm_triton.py``,
a persistent Triton GEMM with TMA loads whose epilogue applies the activation, on an sm_90+ GPU
for fp16/bf16 with K and n multiples of 8 and a block of 64 or 128; elsewhere the reference.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphopt.cost.opclass import dtype_of, gemm_tags
from graphopt.cost.ops import OpCost
from graphopt.errors import KernelArgumentError

from ..common import check_projection, compute_dtype, fresh
from ..gemm_triton import SWIGLU_BLOCK, SWIGLU_CONFIGS
from ..registry import define_op

SCHEMA = "gemm_swiglu(Tensor x, Tensor weight, int n, int block) -> Tensor"
# the profile's op_efficiency key for the halves layout (block 0), whose kernel runs slower than
# the interleaved one's (two accumulators and two TMA loads per k-step)
HALVES_EFFICIENCY = "gemm_swiglu_halves"
# the kernel's output tile at SWIGLU_BLOCK: BLOCK_M rows by 2 BLOCK_N columns of the gate+up product
TILE = (SWIGLU_CONFIGS[SWIGLU_BLOCK][0], 2 * SWIGLU_CONFIGS[SWIGLU_BLOCK][1])


def interleave_gate_up(w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """``cat([Wg, Wu])`` ([2n, K], an ``nn.Linear`` weight) reordered as ``block`` rows of Wg,
    ``block`` rows of Wu, the next ``block`` of each, ...; each half zero-padded to a multiple of
    ``block`` rows: the weight layout ``gemm_swiglu`` takes."""
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2 or block < 1:
        raise ValueError(f"interleave_gate_up: need a [2n, K] weight and block >= 1, got {tuple(w_gate_up.shape)}, {block}")
    n, k = w_gate_up.shape[0] // 2, w_gate_up.shape[1]
    pad = -n % block
    halves = [F.pad(h, (0, 0, 0, pad)) for h in (w_gate_up[:n], w_gate_up[n:])]
    return torch.stack([h.reshape(-1, block, k) for h in halves], 1).reshape(-1, k).contiguous()


def reference(x: torch.Tensor, weight: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` ([..., n]): a SwiGLU MLP's gate and up projections and its
    activation, the projections never rounded. ``weight`` holds Wg and Wu as
    :func:`interleave_gate_up` lays them out (blocks of ``block`` rows), or, with ``block = 0``, as
    ``cat([Wg, Wu])`` ([2n, K], the model's merged gate/up weight as it is)."""
    K = x.shape[-1] if x.dim() else 0
    if block == 0:
        if weight.dim() != 2 or weight.shape[1] != K or n < 1 or weight.shape[0] != 2 * n:
            raise ValueError(f"graphopt::gemm_swiglu: weight {tuple(weight.shape)} is not cat([gate, up]) over K={K} "
                             f"with n={n} rows each (block 0)")
        gate_w, up_w = weight[:n], weight[n:]
    else:
        if (weight.dim() != 2 or weight.shape[1] != K or block < 1 or weight.shape[0] % (2 * block)
                or not 0 < n <= weight.shape[0] // 2):
            raise ValueError(f"graphopt::gemm_swiglu: weight {tuple(weight.shape)} is not gate and up blocks of "
                             f"{block} rows over K={K} holding n={n} outputs")
        blocks = weight.reshape(-1, 2, block, K)
        gate_w, up_w = blocks[:, 0].reshape(-1, K)[:n], blocks[:, 1].reshape(-1, K)[:n]
    ct = compute_dtype(x.dtype)
    xc = x.to(ct)
    gate = F.linear(xc, gate_w.to(ct))
    up = F.linear(xc, up_w.to(ct))
    return fresh((F.silu(gate) * up).to(x.dtype), x)


def fake(x, weight, n, block):
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: "graphopt::gemm_swiglu: weight must be [rows, K] with K = x's last dim")
    return x.new_empty((*x.shape[:-1], n))


def cuda(x, weight, n, block):
    from ..gemm_triton import gemm_swiglu_triton, supported

    if supported(x, weight, n, block) is not None:  # before sm_90, fp32, unaligned rows: correct, slower
        return reference(x, weight, n, block)
    return gemm_swiglu_triton(x, weight, n, block)


def persistent_rounds_factor(profile, M, N, tile=TILE) -> float:
    """How much longer a persistent GEMM (one program per SM, output tiles dealt round-robin) takes
    than its work at the full rate: its ceil(tiles / SMs) rounds over tiles / SMs, the last round
    part idle. cuBLAS picks tile shapes and split strategies that avoid most of this, so the cost
    model prices cuBLAS without it. Fitted on the H200 (diag_swiglu_gemm_2026-11-30_185919.md): GLM-4's
    8192 x 4096 x 27392 (51.9 rounds: 1.002) ran 0.99x cuBLAS's time, its 1024-row form (6.5 rounds:
    1.079) 1.08x. 1.0 for symbolic sizes or an unknown SM count."""
    sms = profile.sm_count or 0
    try:
        tiles = -(-int(M) // tile[0]) * -(-int(N) // tile[1])
    except TypeError:
        return 1.0
    if not sms or not tiles:
        return 1.0
    return -(-tiles // sms) * sms / tiles


def cost(call, profile):
    """The GEMM over every (padded) gate and up row of the weight at the matmul efficiency, slowed
    by the persistent kernel's last round of tiles; in the halves layout (block 0) each half is
    padded to the tile's half, at the profile's measured ``op_efficiency["gemm_swiglu_halves"]``
    rate where it has one."""
    x, w = call.info("x"), call.info("weight")
    rows = w.shape[0]
    efficiency = "matmul"
    if call.arg("block") == 0:
        half = TILE[1] // 2
        rows = 2 * -(-call.arg("n") // half) * half
        if profile.efficiency(HALVES_EFFICIENCY, "scale") is not None:  # measured: two accumulators per tile
            efficiency = HALVES_EFFICIENCY
    return OpCost(2 * x.numel * rows, call.in_bytes + call.out_bytes, kind="matmul", efficiency=efficiency,
                  slowdown=persistent_rounds_factor(profile, x.numel // x.shape[-1], w.shape[0]))


def op_class(call):
    """The class of the gate and up projection it replaces (x's rows by the weight's rows)."""
    x, w = call.info("x"), call.info("weight")
    return gemm_tags(dtype_of(x), math.prod(x.shape[:-1]), w.shape[0], x.shape[-1])


def gemm_swiglu(x: torch.Tensor, weight: torch.Tensor, n: int, block: int = 128) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)``, shape ``[..., n]``: a SwiGLU MLP's gate and up projections
    and its activation in one GEMM. ``weight`` is ``interleave_gate_up(cat([Wg, Wu]), block)``: Wg
    and Wu in alternating blocks of ``block`` rows; or, with ``block=0``, ``cat([Wg, Wu])`` itself
    ([2n, K])."""
    check_projection("gemm_swiglu", x, weight, "rows")
    if isinstance(block, int) and not isinstance(block, bool) and block == 0:
        if not isinstance(n, int) or n < 1 or weight.shape[0] != 2 * n:
            raise KernelArgumentError(f"graphopt::gemm_swiglu: block 0 takes cat([gate, up]) with n rows each; "
                                      f"weight has {weight.shape[0]} rows, n={n!r}")
        return torch.ops.graphopt.gemm_swiglu(x, weight, n, block)
    if not isinstance(block, int) or block < 1 or weight.shape[0] % (2 * block):
        raise KernelArgumentError(f"graphopt::gemm_swiglu: weight's {weight.shape[0]} rows are not pairs of "
                                  f"{block}-row gate and up blocks")
    if not isinstance(n, int) or not 0 < n <= weight.shape[0] // 2:
        raise KernelArgumentError(f"graphopt::gemm_swiglu: n must be in 1..{weight.shape[0] // 2} (the weight's "
                                  f"gate rows), got {n!r}")
    return torch.ops.graphopt.gemm_swiglu(x, weight, n, block)


def example() -> tuple:
    """The arguments of a small fp32 call on the CPU (the cost tests' graph calls every op with its own)."""
    return (torch.randn(24, 32), torch.randn(64, 32), 24, 16)


OP = define_op(SCHEMA, reference=reference, fake=fake, wrapper=gemm_swiglu, cost=cost, kernel="gemm_triton.py",
               cuda=cuda, op_class=op_class, example=example)
