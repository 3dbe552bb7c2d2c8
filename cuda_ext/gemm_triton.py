"""Persistent bf16 GEMMs in Triton with the SwiGLU MLP's elementwise step folded in (Hopper TMA).

A SwiGLU MLP runs ``gate_up = x @ W_gu.T`` (the merged gate and up projections), then
``act = silu(gate) * up`` (a memory-bound kernel: at GLM-4's 8192 x 27392 it reads 449 MB and writes
224 MB), then ``act @ W_down.T``. ``gemm_swiglu`` drops the middle kernel: a tile of the output
multiplies matching gate and up rows of the weight into fp32 accumulators and its epilogue stores
``silu(gate) * up``; the ``[M, 2N]`` intermediate is never written. Two weight layouts:

* halves (``gemm_swiglu_halves``, the op's ``block = 0``): ``W_gu = cat([Wg, Wu])`` as the model
  holds it; each k-step loads a gate block (rows ``r``) and an up block (rows ``n + r``) through two
  TMA descriptors into two ``[BM, BN]`` accumulators. No copy of the weight.
* interleaved (``gemm_swiglu``, the op's ``block = BN``): gate and up rows interleaved in blocks of
  the tile's width once (``ops/gemm_swiglu.interleave_gate_up``, a copy), one ``[2 BN, BK]`` load and one
  ``[BM, 2 BN]`` accumulator per k-step.

``gemm`` is the same persistent loop (TMA loads, grouped tile order, one program per SM) without
the epilogue. Both take a row-major ``x`` and an ``nn.Linear``-layout weight ``[out, in]``; TMA
needs 16-byte aligned rows (K and N multiples of 8 for 2-byte dtypes).
"""
from __future__ import annotations

import torch

from .norm_triton import cached_kernel

_kernels: dict = {}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps[, GROUP_M]); BLOCK_N is the output tile's width, so the
# SwiGLU epilogue multiplies [BLOCK_M, 2 BLOCK_N] tiles. The fastest of the configurations
# benchmarks/diag_swiglu_gemm.py tried on the H200 (diag_swiglu_gemm_2026-11-30_185919.md): plain
# 803 TFLOP/s at GLM-4's 8192 x 4096 x 27392, with the SwiGLU epilogue 807 (cuBLAS: 800).
GEMM_CONFIG = (128, 256, 64, 3, 8)
# gemm_swiglu's configuration per weight block (the block is the output tile's width). Groups of
# 16 row blocks: back to back under the H200's power cap the fused GEMM ran 2.701 ms at GROUP_M = 16,
# 2.713 at 8, 2.759 at 32, 2.850 at 64 (diag_gemm_order_2026-11-30_191649.md)
SWIGLU_CONFIGS = {128: (128, 128, 64, 3, 8, 16), 64: (128, 64, 64, 4, 8, 16)}
SWIGLU_BLOCK = 128
# the op's ``block`` for the halves layout (cat([Wg, Wu]) as the model holds it), and its
# configuration: per half the interleaved kernel's [128, 128] tile, two accumulators
HALVES = 0
SWIGLU_HALVES_CONFIG = (128, 128, 64, 3, 8, 16)
SWIGLU_DTYPES = (torch.float16, torch.bfloat16)
GROUP_M = 8


def _kernel():
    return cached_kernel(_kernels, _build)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_kernel(a_desc, b_desc, u_desc, c_desc, M, N, K, SWIGLU: tl.constexpr, HALVES: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                    PROGRAMS: tl.constexpr):
        # C = A @ B.T over [BM, BN] tiles of C (N: C's columns). SWIGLU: B's rows are gate and up
        # blocks of BN interleaved (``interleave_gate_up``); a tile multiplies one [2 BN, BK] block of
        # B at a time into a [BM, 2 BN] fp32 accumulator and stores silu(gate) * up. SWIGLU and
        # HALVES: B holds the gate rows and U the up rows (two views of cat([Wg, Wu])); a tile
        # multiplies a [BN, BK] block of each into its own [BM, BN] accumulator.
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        tiles = num_pid_m * num_pid_n
        in_group = GROUP * num_pid_n  # grouped order: GROUP row blocks share a column block in L2
        tile_c = start - PROGRAMS  # the epilogue's own counter keeps the loop's prologue independent
        for tile_id in tl.range(start, tiles, PROGRAMS, flatten=True):
            first_m = (tile_id // in_group) * GROUP
            size_m = tl.minimum(num_pid_m - first_m, GROUP)
            om = (first_m + tile_id % size_m) * BM
            on = ((tile_id % in_group) // size_m) * BN
            if SWIGLU and not HALVES:
                acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
                on = on * 2
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
            if HALVES:
                acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                ok = ki * BK
                a = a_desc.load([om, ok])
                b = b_desc.load([on, ok])
                acc = tl.dot(a, b.T, acc)
                if HALVES:
                    u = u_desc.load([on, ok])
                    acc_up = tl.dot(a, u.T, acc_up)
            tile_c += PROGRAMS
            first_m = (tile_c // in_group) * GROUP
            size_m = tl.minimum(num_pid_m - first_m, GROUP)
            if HALVES:
                acc = acc * tl.sigmoid(acc) * acc_up
            elif SWIGLU:
                gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
                acc = gate * tl.sigmoid(gate) * up
            c_desc.store([(first_m + tile_c % size_m) * BM, ((tile_c % in_group) // size_m) * BN],
                         acc.to(c_desc.dtype))

    return gemm_kernel


def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _launch(swiglu: bool, a: torch.Tensor, b: torch.Tensor, n: int, config, programs: int | None,
            up: torch.Tensor | None = None) -> torch.Tensor:
    """``up``: the up rows when ``b`` holds only the gate rows (the halves layout)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, *group = config
    m, k = a.shape
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    tiles = -(-m // bm) * -(-n // bn)
    programs = min(programs or _programs(a.device), tiles)
    halves = up is not None
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [2 * bn if swiglu and not halves else bn, bk])
    u_desc = TensorDescriptor.from_tensor(up, [bn, bk]) if halves else b_desc
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    _kernel()[(programs,)](a_desc, b_desc, u_desc, c_desc, m, n, k, SWIGLU=swiglu, HALVES=halves, BM=bm, BN=bn,
                           BK=bk, GROUP=group[0] if group else GROUP_M, PROGRAMS=programs, num_stages=stages,
                           num_warps=warps)
    return out


def gemm(x: torch.Tensor, w: torch.Tensor, config=None, programs: int | None = None) -> torch.Tensor:
    """``x @ w.T`` (x: [M, K], w: [N, K])."""
    return _launch(False, x, w, w.shape[0], config or GEMM_CONFIG, programs)


def gemm_swiglu(x: torch.Tensor, w_interleaved: torch.Tensor, n: int, config=None,
                programs: int | None = None) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` ([M, n]) from ``interleave_gate_up(cat([Wg, Wu]), BN)`` with
    BN the config's block width (the output tile's)."""
    return _launch(True, x, w_interleaved, n, config or SWIGLU_CONFIGS[SWIGLU_BLOCK], programs)


def gemm_swiglu_halves(x: torch.Tensor, w_gate_up: torch.Tensor, n: int, config=None,
                       programs: int | None = None) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` ([M, n]) from ``cat([Wg, Wu])`` ([2n, K]) as it is: the gate rows
    and the up rows are read through two TMA descriptors (no reordered copy)."""
    return _launch(True, x, w_gate_up[:n], n, config or SWIGLU_HALVES_CONFIG, programs, up=w_gate_up[n:])


def supported(x: torch.Tensor, weight: torch.Tensor, n: int, block: int) -> str | None:
    """None when :func:`gemm_swiglu_triton` takes these operands, else why not."""
    if x.dtype not in SWIGLU_DTYPES or weight.dtype != x.dtype:
        return f"dtypes {x.dtype}/{weight.dtype} (float16 or bfloat16, the same for both)"
    if block != HALVES and block not in SWIGLU_CONFIGS:
        return f"block {block} (one of {sorted(SWIGLU_CONFIGS)}, or {HALVES}: the halves layout)"
    K = x.shape[-1] if x.dim() else 0
    if K % 8 or n % 8 or K == 0 or x.numel() == 0:
        return f"K={K} and n={n} must be non-zero multiples of 8 (16-byte TMA rows)"
    if block == HALVES:
        if weight.dim() != 2 or weight.shape[1] != K or weight.shape[0] != 2 * n:
            return f"weight {tuple(weight.shape)} is not cat([gate, up]) of {n} rows each"
    elif weight.dim() != 2 or weight.shape[1] != K or weight.shape[0] % (2 * block) or n > weight.shape[0] // 2:
        return f"weight {tuple(weight.shape)} is not gate and up blocks of {block} rows"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] < 9:
        return "needs a GPU with TMA (sm_90 or newer)"
    return None


def gemm_swiglu_triton(x: torch.Tensor, weight: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """``graphopt::gemm_swiglu`` (see ops/gemm_swiglu.py) on a Hopper GPU: one persistent kernel."""
    why = supported(x, weight, n, block)
    if why is not None:
        raise ValueError(f"graphopt::gemm_swiglu: unsupported {why}")
    K = x.shape[-1]
    a = x.reshape(-1, K).contiguous()
    if a.data_ptr() % 16:  # a view at an odd offset: TMA needs 16-byte aligned bases
        a = a.clone()
    w = weight.contiguous()
    if w.data_ptr() % 16:
        w = w.clone()
    out = gemm_swiglu_halves(a, w, n) if block == HALVES else gemm_swiglu(a, w, n, SWIGLU_CONFIGS[block])
    return out.view(*x.shape[:-1], n)
