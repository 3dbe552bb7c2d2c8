"""Persistent bf16 GEMMs in Triton with the SwiGLU MLP's elementwise step folded in (Hopper TMA).

A SwiGLU MLP runs ``gate_up = x @ W_gu.T`` (the merged gate and up projections), then
``act = silu(gate) * up`` (a memory-bound kernel: at GLM-4's 8192 x 27392 it reads 449 MB and writes
224 MB), then ``act @ W_down.T``. Two ways to drop the middle kernel:

* ``gemm_swiglu`` (epilogue): each output tile accumulates the gate and the up columns of one
  ``BLOCK_N``-wide slice side by side in fp32 and stores ``silu(gate) * up`` once: the
  ``[M, 2N]`` intermediate is never written.
* ``swiglu_gemm`` (prologue): the down projection loads the gate and up tiles of its A operand,
  forms ``silu(gate) * up`` in registers (rounded to bf16, as the unfused kernel stores it) and
  multiplies: the ``[M, N]`` activation is never written.

``gemm`` is the same persistent loop without the fused step, to compare Triton's GEMM with
cuBLAS's on the same shape. All three take row-major ``x`` and an ``nn.Linear``-layout weight
``[out, in]``; TMA needs 16-byte aligned rows (K and N multiples of 8 for bf16).
"""
from __future__ import annotations

import torch

from .norm_triton import cached_kernel

_kernels: dict = {}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): BLOCK_N is the width of one half for the
# SwiGLU epilogue, whose tile holds two fp32 accumulators.
DEFAULT_CONFIG = {"gemm": (128, 256, 64, 3, 8), "gemm_swiglu": (128, 128, 64, 3, 8),
                  "swiglu_gemm": (128, 256, 64, 3, 8)}
GROUP_M = 8


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_kernel(a_desc, b_desc, c_desc, M, N, K, UP, MODE: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr):
        # MODE 0: C = A @ B.T.  MODE 1 (epilogue): C = silu(A @ B[:UP].T) * (A @ B[UP:].T), columns
        # [n, n+BN) of each half per tile.  MODE 2 (prologue): C = (silu(A[:, :UP]) * A[:, UP:]) @ B.T
        # with the product rounded to A's dtype before the multiply.
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        tiles = num_pid_m * num_pid_n
        in_group = GROUP * num_pid_n  # grouped order: GROUP row blocks share a column block in L2
        tile_c = start - PROGRAMS  # the epilogue's own counter keeps the loop's prologue independent
        for tile_id in tl.range(start, tiles, PROGRAMS, flatten=True):
            first_m = (tile_id // in_group) * GROUP
            size_m = min(num_pid_m - first_m, GROUP)
            om = (first_m + tile_id % size_m) * BM
            on = ((tile_id % in_group) // size_m) * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if MODE == 1:
                acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                ok = ki * BK
                if MODE == 2:
                    g = a_desc.load([om, ok]).to(tl.float32)
                    u = a_desc.load([om, UP + ok]).to(tl.float32)
                    a = (g * tl.sigmoid(g) * u).to(a_desc.dtype)
                else:
                    a = a_desc.load([om, ok])
                b = b_desc.load([on, ok])
                acc = tl.dot(a, b.T, acc)
                if MODE == 1:
                    bu = b_desc.load([UP + on, ok])
                    acc_up = tl.dot(a, bu.T, acc_up)
            tile_c += PROGRAMS
            first_m = (tile_c // in_group) * GROUP
            size_m = min(num_pid_m - first_m, GROUP)
            if MODE == 1:
                acc = acc * tl.sigmoid(acc) * acc_up
            c_desc.store([(first_m + tile_c % size_m) * BM, ((tile_c % in_group) // size_m) * BN],
                         acc.to(c_desc.dtype))

    return gemm_kernel


def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _launch(mode: int, a: torch.Tensor, b: torch.Tensor, M: int, N: int, K: int, up: int,
            config, programs: int | None) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps = config
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    tiles = -(-M // bm) * -(-N // bn)
    programs = min(programs or _programs(a.device), tiles)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    _kernel()[(programs,)](a_desc, b_desc, c_desc, M, N, K, up, MODE=mode, BM=bm, BN=bn, BK=bk,
                           GROUP=GROUP_M, PROGRAMS=programs, num_stages=stages, num_warps=warps)
    return out


def gemm(x: torch.Tensor, w: torch.Tensor, config=None, programs: int | None = None) -> torch.Tensor:
    """``x @ w.T`` (x: [M, K], w: [N, K])."""
    return _launch(0, x, w, x.shape[0], w.shape[0], x.shape[1], 0, config or DEFAULT_CONFIG["gemm"], programs)


def gemm_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, config=None, programs: int | None = None) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` with ``w_gate_up = cat([Wg, Wu])`` ([2N, K]); returns [M, N]."""
    n = w_gate_up.shape[0] // 2
    return _launch(1, x, w_gate_up, x.shape[0], n, x.shape[1], n, config or DEFAULT_CONFIG["gemm_swiglu"], programs)


def swiglu_gemm(gate_up: torch.Tensor, w: torch.Tensor, config=None, programs: int | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ w.T`` with ``gate_up = cat([gate, up], -1)`` ([M, 2K]), w: [N, K]."""
    k = gate_up.shape[1] // 2
    return _launch(2, gate_up, w, gate_up.shape[0], w.shape[0], k, k, config or DEFAULT_CONFIG["swiglu_gemm"], programs)
