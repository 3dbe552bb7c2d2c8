"""Python wrappers of the graphopt ops: calls of ``torch.ops.graphopt.*`` with defaults,
docstrings and argument checks. Any of them can be called directly or appear in an FX graph /
TorchScript.

The wrappers check what the ops' C++ side would refuse and raise KernelArgumentError (a
GraphoptError and a ValueError) in one line: on the H200 image a C++ check failing inside the
extension ended the process instead of raising (see the README's Kernels section), so a bad
call must not reach it."""
from __future__ import annotations

from typing import Sequence

import torch

from graphopt.errors import KernelArgumentError

from .pointwise import Program

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "hardswish")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _floating(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in _FLOATS:
            raise KernelArgumentError(f"graphopt::{op}: {name} is {t.dtype}; float32, float16 or bfloat16 only")


def _at_least_1d(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() < 1:
        raise KernelArgumentError(f"graphopt::{op}: {name} needs at least one dim, got a 0-d tensor")


def _residual(op: str, x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """A residual broadcasts to x's shape (the op expands it)."""
    if residual is None:
        return
    try:
        ok = tuple(torch.broadcast_shapes(tuple(residual.shape), tuple(x.shape))) == tuple(x.shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise KernelArgumentError(f"graphopt::{op}: residual shape {tuple(residual.shape)} does not broadcast to "
                                  f"x's {tuple(x.shape)}")


def _projection(op: str, x: torch.Tensor, weight: torch.Tensor, rows: str) -> None:
    """x (at least 1-D) times an ``nn.Linear``-layout weight ``[rows, K]`` of x's floating dtype."""
    _floating(op, x=x, weight=weight)
    _at_least_1d(op, "x", x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise KernelArgumentError(f"graphopt::{op}: weight must be [{rows}, K] with K = x's last dim "
                                  f"({x.shape[-1]}), got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise KernelArgumentError(f"graphopt::{op}: weight is {weight.dtype}, x is {x.dtype}")


def _norm_params(op: str, x: torch.Tensor, **params) -> None:
    _at_least_1d(op, "x", x)
    for name, p in params.items():
        if p is not None and p.numel() != x.shape[-1]:
            raise KernelArgumentError(f"graphopt::{op}: {name} must have {x.shape[-1]} elements (x's last dim), "
                                      f"got shape {tuple(p.shape)}")


def bias_act(x: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none",
             residual: torch.Tensor | None = None, bias_dim: int = -1) -> torch.Tensor:
    """``act(x + bias) + residual`` in one pass. ``bias`` is 1-D along ``x.size(bias_dim)``
    (-1 for linear outputs, 1 for NCHW convolutions); ``act`` is one of none, relu, gelu,
    gelu_tanh, silu, sigmoid, tanh, hardswish; ``residual`` has x's shape. fp32 math."""
    if act not in ACTIVATIONS:
        raise KernelArgumentError(f"graphopt::bias_act: unknown activation {act!r} ({', '.join(ACTIVATIONS)})")
    _floating("bias_act", x=x)
    if bias is not None:
        _at_least_1d("bias_act", "x", x)
        if not -x.dim() <= bias_dim < x.dim():
            raise KernelArgumentError(f"graphopt::bias_act: bias_dim {bias_dim} out of range for {x.dim()}-D x")
        if bias.dim() != 1 or bias.shape[0] != x.shape[bias_dim]:
            raise KernelArgumentError(f"graphopt::bias_act: bias must be 1-D of length {x.shape[bias_dim]} "
                                      f"(x.size({bias_dim})), got shape {tuple(bias.shape)}")
    _residual("bias_act", x, residual)
    return torch.ops.graphopt.bias_act(x, bias, act, residual, bias_dim)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``layer_norm`` over the last dim (up to 8192 wide) with fp32 statistics; on CUDA a Triton
    kernel that normalizes many rows per program (fast for narrow rows, where one block per row
    is scheduling-bound)."""
    _floating("layer_norm", x=x)
    _norm_params("layer_norm", x, weight=weight, bias=bias)
    return torch.ops.graphopt.layer_norm(x, weight, bias, eps)


def conv_bias_relu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, stride: Sequence[int] = (1, 1), padding: Sequence[int] = (0, 0),
                   dilation: Sequence[int] = (1, 1), groups: int = 1) -> torch.Tensor:
    """``relu(conv2d(x, w) + bias + z)`` as one cuDNN fused convolution on CUDA (z: an optional
    residual of the output's shape). The output is channels_last when x or w is."""
    if x.dim() != 4 or w.dim() != 4:
        raise KernelArgumentError(f"graphopt::conv_bias_relu: 2-D convolutions only (4-D x and w), got "
                                  f"{tuple(x.shape)} and {tuple(w.shape)}")
    return torch.ops.graphopt.conv_bias_relu(x, w, bias, z, list(stride), list(padding), list(dilation), groups)


def max_pool2d_nhwc(x: torch.Tensor, kernel: int, stride: int, padding: int = 0) -> torch.Tensor:
    """max_pool2d over a channels_last tensor (square window, dilation 1), channels_last out."""
    if x.dim() != 4 or not (kernel >= 1 and stride >= 1 and 0 <= 2 * padding <= kernel):
        raise KernelArgumentError(f"graphopt::max_pool2d_nhwc: needs a 4-D x, kernel >= 1, stride >= 1 and "
                         f"0 <= padding <= kernel / 2; got {tuple(x.shape)}, {kernel}, {stride}, {padding}")
    return torch.ops.graphopt.max_pool2d_nhwc(x, kernel, stride, padding)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or a copy of x); returns ``(rmsnorm(h) * weight, h)``. Numerics of
    Hugging Face's LlamaRMSNorm: fp32 statistics over h, ``weight * normed.to(x.dtype)``."""
    _floating("add_rms_norm", x=x)
    _norm_params("add_rms_norm", x, weight=weight)
    _residual("add_rms_norm", x, residual)
    return torch.ops.graphopt.add_rms_norm(x, residual, weight, eps)


def rms_norm_add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight_y: torch.Tensor, weight: torch.Tensor,
                          eps_y: float = 1e-6, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich norm in one pass: ``h = rms_norm(y) * weight_y + residual``; returns
    ``(rms_norm(h) * weight, h)``, each step rounded as :func:`add_rms_norm` rounds it (GLM-4's
    post-attention / post-MLP norm, the residual add and the next norm). On CUDA a Triton kernel."""
    _floating("rms_norm_add_rms_norm", y=y, residual=residual)
    _norm_params("rms_norm_add_rms_norm", y, weight_y=weight_y, weight=weight)
    _residual("rms_norm_add_rms_norm", y, residual)
    return torch.ops.graphopt.rms_norm_add_rms_norm(y, residual, weight_y, weight, eps_y, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or a copy of x); returns ``(layer_norm(h) * weight + bias, h)``
    over the last dim, fp32 statistics."""
    _floating("add_layer_norm", x=x)
    _norm_params("add_layer_norm", x, weight=weight, bias=bias)
    _residual("add_layer_norm", x, residual)
    return torch.ops.graphopt.add_layer_norm(x, residual, weight, bias, eps)


def linear_add_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, ln_weight: torch.Tensor | None = None,
                          ln_bias: torch.Tensor | None = None, eps: float = 1e-5,
                          splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection feeding a residual LayerNorm: ``h = x @ weight.T + bias + residual`` (rounded
    once); returns ``(layer_norm(h) * ln_weight + ln_bias, h)``. On CUDA one batched GEMM over
    ``splits`` slices of K (fp32 partial products) and one Triton kernel that sums them into the
    norm: a small-M, long-K projection fills the GPU without cuBLAS's split-K reduction kernel."""
    _projection("linear_add_layer_norm", x, weight, "N")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or x.shape[-1] % splits:
        raise KernelArgumentError(f"graphopt::linear_add_layer_norm: splits must be a positive divisor of K "
                                  f"({x.shape[-1]}), got {splits!r}")
    out_like = x.new_empty((*x.shape[:-1], weight.shape[0]), device="meta")
    _norm_params("linear_add_layer_norm", out_like, bias=bias, ln_weight=ln_weight, ln_bias=ln_bias)
    _residual("linear_add_layer_norm", out_like, residual)
    return torch.ops.graphopt.linear_add_layer_norm(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)


def gemm_swiglu(x: torch.Tensor, weight: torch.Tensor, n: int, block: int = 128) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)``, shape ``[..., n]``: a SwiGLU MLP's gate and up projections
    and its activation in one GEMM. ``weight`` is ``reference.interleave_gate_up(cat([Wg, Wu]),
    block)``: Wg and Wu in alternating blocks of ``block`` rows; or, with ``block=0``,
    ``cat([Wg, Wu])`` itself ([2n, K])."""
    _projection("gemm_swiglu", x, weight, "rows")
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


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``; shape ``[..., H]``."""
    _floating("swiglu", gate_up=gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise KernelArgumentError(f"graphopt::swiglu: last dim must be even (gate and up halves), got "
                                  f"shape {tuple(gate_up.shape)}")
    return torch.ops.graphopt.swiglu(gate_up)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` (any strides) with
    cos/sin ``[B or 1, S, R]`` (``[B or 1, 1, S, R]`` is accepted too), R even and <= D: the
    first R dims of each head rotate, the rest pass through. ``interleaved=False`` is Llama's
    rotate_half, ``True`` GLM's pairwise form. Returns contiguous ``(q_out, k_out)``."""
    _floating("rotary", q=q, k=k)
    if q.dim() != 4 or k.dim() != 4:
        raise KernelArgumentError(f"graphopt::rotary: q and k must be [B, H, S, D], got {tuple(q.shape)} and "
                                  f"{tuple(k.shape)}")
    if q.dtype != k.dtype or (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise KernelArgumentError(f"graphopt::rotary: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} "
                                  "differ in batch, positions, head dim or dtype")
    if tuple(cos.shape) != tuple(sin.shape):
        raise KernelArgumentError(f"graphopt::rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} shapes differ")
    c = cos.squeeze(1) if cos.dim() == 4 and cos.shape[1] == 1 else cos
    if c.dim() != 3 or c.shape[0] not in (1, q.shape[0]) or c.shape[1] != q.shape[2] or c.shape[2] % 2 \
            or c.shape[2] > q.shape[3]:
        raise KernelArgumentError(f"graphopt::rotary: cos/sin must be [1 or {q.shape[0]}, {q.shape[2]}, R] (or "
                                  f"[B, 1, S, R]) with R even and <= {q.shape[3]}, got {tuple(cos.shape)}")
    return torch.ops.graphopt.rotary(q, k, cos, sin, interleaved)


def softmax_mask(scores: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scores * scale + mask, -1)`` with fp32 math. ``mask`` broadcasts to scores;
    bool masks keep True positions, float masks are added. A row whose every position is
    masked (all False, or all -inf) comes out as zeros, not NaN."""
    _floating("softmax_mask", scores=scores)
    _at_least_1d("softmax_mask", "scores", scores)
    return torch.ops.graphopt.softmax_mask(scores, scale, mask)


def fused_pointwise(program: str | Program, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a pointwise program (text or :class:`~graphopt.cuda_ext.pointwise.Program`) on
    broadcasting, possibly strided inputs; returns its outputs (contiguous, broadcast shape)."""
    src = program.source if isinstance(program, Program) else program
    return torch.ops.graphopt.fused_pointwise(src, list(inputs))


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` in inference for short key sequences (at most 256 keys,
    head dim 16-128): q [B, H, Sq, D], k and v [B, Hk, Sk, D] with H a multiple of Hk (grouped
    queries), an additive float or boolean mask broadcastable to [B, H, Sq, Sk]; ``scale``
    defaults to 1/sqrt(D). On CUDA one Triton program per query tile holds every key (bf16/fp16);
    the output is [B, H, Sq, D] laid out [B, Sq, H, D]."""
    from .attention_triton import mask_problem, shape_problem

    _floating("short_attention", q=q, k=k, v=v)
    why = shape_problem(tuple(q.shape), tuple(k.shape))
    if why is None and (k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]):
        why = f"k and v must both be [{q.shape[0]}, Hk, Sk, {q.shape[3]}], got {tuple(k.shape)} and {tuple(v.shape)}"
    if why is None and mask is not None:
        why = mask_problem(mask.shape, mask.dtype, (*q.shape[:3], k.shape[2]))
    if why is not None:
        raise KernelArgumentError(f"graphopt::short_attention: {why}")
    D = q.shape[3]
    return torch.ops.graphopt.short_attention(q, k, v, mask, D ** -0.5 if scale is None else float(scale),
                                              bool(is_causal))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     kv_len: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of a few query positions q [B, Hq, Tq, D] over a key/value cache k, v
    [B, Hkv, L, D] (Hq a multiple of Hkv): ``scaled_dot_product_attention`` in inference with an
    optional bool or additive mask broadcastable to [B, Hq, Tq, L] and an optional ``kv_len``
    (int32/int64, 1 or B values, on q's device): keys at or past kv_len[b] are not read. ``scale``
    defaults to 1/sqrt(D). On CUDA split-KV Triton kernels (bf16/fp16); output [B, Hq, Tq, D]
    laid out [B, Tq, Hq, D]. See cuda_ext/decode_attention_triton.py."""
    from .decode_attention_triton import check

    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise KernelArgumentError("graphopt::decode_attention: q, k and v must be tensors")
    why = check(q, k, v, mask, kv_len)
    if why is not None:
        raise KernelArgumentError(f"graphopt::decode_attention: {why}")
    return torch.ops.graphopt.decode_attention(q, k, v, mask, kv_len,
                                               q.shape[3] ** -0.5 if scale is None else float(scale))
