"""Reference implementations of every ``graphopt`` op in plain torch.

They define what each op computes. Tests run them on fp64 inputs as ground truth; the CPU
implementation of every op is the reference (registered for ``DispatchKey::CPU``, and for
``CUDA`` too when the CUDA kernels are unavailable). For bf16/fp16 inputs the math is done in
fp32 and rounded once, except where the op's contract reproduces a model's intermediate
roundings (``add_rms_norm`` follows Hugging Face's LlamaRMSNorm). Outputs are always fresh,
contiguous tensors (custom ops may not return views of their inputs).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .decode_attention_triton import reference as decode_attention  # noqa: F401  (the op's own module)

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "hardswish")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other floating type computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fresh(t: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """A contiguous result that shares no storage with any input."""
    t = t.contiguous()
    for i in inputs:
        if i is not None and t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr():
            return t.clone()
    return t


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "none":
        return x
    if act == "relu":
        return torch.relu(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "silu":
        return F.silu(x)
    if act == "sigmoid":
        return torch.sigmoid(x)
    if act == "tanh":
        return torch.tanh(x)
    if act == "hardswish":
        return F.hardswish(x)
    raise ValueError(f"graphopt::bias_act: unknown activation {act!r} (one of {', '.join(ACTIVATIONS)})")


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str, residual: torch.Tensor | None,
             bias_dim: int = -1) -> torch.Tensor:
    """y = act(x + bias) + residual; bias is 1-D along ``x.size(bias_dim)``."""
    ct = compute_dtype(x.dtype)
    y = x.to(ct)
    if bias is not None:
        d = bias_dim % x.dim()
        if bias.dim() != 1 or bias.numel() != x.shape[d]:
            raise ValueError(f"graphopt::bias_act: bias must be 1-D of length {x.shape[d]}, got {tuple(bias.shape)}")
        shape = [1] * x.dim()
        shape[d] = -1
        y = y + bias.to(ct).view(shape)
    y = activation(y, act)
    if residual is not None:
        y = y + residual.to(ct)
    return _fresh(y.to(x.dtype), x, bias, residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """layer_norm over the last dim, fp32 statistics, one rounding to x's dtype."""
    ct = compute_dtype(x.dtype)
    h = x.shape[-1:] if x.dim() else (1,)
    y = F.layer_norm(x.to(ct), h, None if weight is None else weight.to(ct), None if bias is None else bias.to(ct),
                     eps)
    return _fresh(y.to(x.dtype), x)


def conv_layout(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    """The layout cuDNN gives a convolution's output: channels_last when x or w is in it."""
    cl = torch.channels_last
    return cl if any(t.dim() == 4 and t.is_contiguous(memory_format=cl) and not t.is_contiguous()
                     for t in (x, w)) else torch.contiguous_format


def conv_bias_relu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor | None,
                   stride: list, padding: list, dilation: list, groups: int) -> torch.Tensor:
    """relu(conv2d(x, w) + bias + z), in x's dtype and the layout cuDNN would give it."""
    ct = compute_dtype(x.dtype)
    y = F.conv2d(x.to(ct), w.to(ct), None if bias is None else bias.to(ct), stride, padding, dilation, groups)
    if z is not None:
        y = y + z.to(ct)
    return torch.relu(y).to(x.dtype).contiguous(memory_format=conv_layout(x, w))


def max_pool2d_nhwc(x: torch.Tensor, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """max_pool2d(x, kernel, stride, padding) (square, dilation 1, floor; padding left out of the
    window, a NaN in it gives NaN), channels_last out."""
    if x.dim() != 4:
        raise ValueError(f"graphopt::max_pool2d_nhwc: x must be [N, C, H, W], got {tuple(x.shape)}")
    if not (kernel >= 1 and stride >= 1 and 0 <= 2 * padding <= kernel):
        raise ValueError(f"graphopt::max_pool2d_nhwc: needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel / 2, "
                         f"got {kernel}, {stride}, {padding}")
    return F.max_pool2d(x, kernel, stride, padding).contiguous(memory_format=torch.channels_last)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x's dtype, as the model's residual stream is);
    out = weight * (h_fp32 * rsqrt(mean(h_fp32^2) + eps)).to(x.dtype), returned in x's dtype."""
    h = x + residual.to(x.dtype) if residual is not None else x
    ct = compute_dtype(x.dtype)
    hf = h.to(ct)
    var = hf.pow(2).mean(-1, keepdim=True)
    normed = (hf * torch.rsqrt(var + eps)).to(x.dtype)
    out = (weight.to(ct) * normed.to(ct)).to(x.dtype)
    return _fresh(out, x, residual, weight), _fresh(h, x, residual)


def rms_norm_add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight_y: torch.Tensor, weight: torch.Tensor,
                          eps_y: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich norm's two RMSNorms around a residual add: ``y' = rms_norm(y) * weight_y``, then
    ``h = y' + residual`` and ``(rms_norm(h) * weight, h)``, each step rounded as
    :func:`add_rms_norm` rounds it (GLM-4's post-sublayer norm, then the next sublayer's)."""
    yn, _ = add_rms_norm(y, None, weight_y, eps_y)
    return add_rms_norm(yn, residual, weight, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; out = layer_norm(h) over the last dim (fp32 statistics, one rounding)."""
    h = x + residual.to(x.dtype) if residual is not None else x
    ct = compute_dtype(x.dtype)
    out = F.layer_norm(h.to(ct), (x.shape[-1],), None if weight is None else weight.to(ct),
                       None if bias is None else bias.to(ct), eps)
    return _fresh(out.to(x.dtype), x, residual), _fresh(h, x, residual)


def linear_add_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          residual: torch.Tensor | None, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                          eps: float, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection feeding a residual LayerNorm: ``h = x @ weight.T + bias + residual``, rounded to
    x's dtype once (the projection is not rounded before the add, one rounding fewer than
    linear -> add_layer_norm); returns ``(layer_norm(h) * ln_weight + ln_bias, h)`` over the last
    dim, fp32 statistics. ``splits`` (a divisor of K) is how many slices of K the CUDA kernel
    multiplies on their own (partial sums in fp32, added by the norm): numerics only."""
    K = x.shape[-1] if x.dim() else 0
    if splits < 1 or K % splits:
        raise ValueError(f"graphopt::linear_add_layer_norm: splits {splits} does not divide K={K}")
    ct = compute_dtype(x.dtype)
    y = F.linear(x.to(ct), weight.to(ct), None if bias is None else bias.to(ct))
    if residual is not None:
        y = y + residual.to(ct)
    h = y.to(x.dtype)
    out = F.layer_norm(h.to(ct), (h.shape[-1],), None if ln_weight is None else ln_weight.to(ct),
                       None if ln_bias is None else ln_bias.to(ct), eps)
    return _fresh(out.to(x.dtype), x, residual), _fresh(h, x, residual)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up where gate, up = gate_up.chunk(2, -1)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"graphopt::swiglu: last dim must be even, got {tuple(gate_up.shape)}")
    ct = compute_dtype(gate_up.dtype)
    g, u = gate_up.to(ct).chunk(2, dim=-1)
    return _fresh((F.silu(g) * u).to(gate_up.dtype), gate_up)


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


def gemm_swiglu(x: torch.Tensor, weight: torch.Tensor, n: int, block: int) -> torch.Tensor:
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
    return _fresh((F.silu(gate) * up).to(x.dtype), x)


def _rotary_table(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        if t.shape[1] != 1:
            raise ValueError(f"graphopt::rotary: 4-D cos/sin must be [B, 1, S, R], got {tuple(t.shape)}")
        t = t.squeeze(1)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"graphopt::rotary: cos/sin must be [B or 1, S, R], got {tuple(t.shape)}")
    return t.to(like.dtype)  # the model casts cos/sin to the activation dtype


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_layout(x: torch.Tensor) -> torch.Tensor:
    """An empty output for rotary(x): dense in [B, S, H, D] order when x's heads are closer in memory
    than its positions (a projection viewed as heads and transposed, the usual spelling, or a slice
    of a merged QKV projection), so attention over it writes its output in that order and the heads
    merge back without a copy; else contiguous [B, H, S, D].
    The CUDA op (registration.cpp rotary_out) and the fake op follow the same rule."""
    if x.dim() == 4 and x.stride(3) == 1 and x.stride(1) < x.stride(2):
        return x.new_empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3])).transpose(1, 2)
    return x.new_empty(x.shape)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R = cos.size(-1) dims of every head; dims R..D pass through.
    q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B or 1, S, R] (or [B or 1, 1, S, R])."""
    c, s = _rotary_table(cos, q), _rotary_table(sin, q)
    R = c.shape[-1]
    if R % 2 or R > q.shape[-1]:
        raise ValueError(f"graphopt::rotary: rotary dim {R} must be even and <= head dim {q.shape[-1]}")
    ct = compute_dtype(q.dtype)
    cf, sf = c.to(ct).unsqueeze(1), s.to(ct).unsqueeze(1)  # [B, 1, S, R]

    def one(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(ct)
        xr, xp = xf[..., :R], xf[..., R:]
        out = torch.cat((xr * cf + _rotate(xr, interleaved) * sf, xp), dim=-1)
        return rotary_layout(x).copy_(out)

    return one(q), one(k)


def softmax_mask(scores: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(scores * scale + mask, -1) in fp32 (fp64 for fp64 scores). A bool mask keeps
    True positions; a float mask is added. Rows with every position masked give zeros."""
    ct = compute_dtype(scores.dtype)
    s = scores.to(ct) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, -math.inf)
        else:
            s = s + mask.to(ct)
    mx = s.amax(dim=-1, keepdim=True)
    p = torch.softmax(s, dim=-1)
    p = torch.where(mx == -math.inf, torch.zeros((), dtype=ct, device=p.device), p)
    return _fresh(p.to(scores.dtype), scores)


def short_attention_layout(q: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, S, D] output laid out [B, S, H, D] in memory (the view the kernel returns)."""
    B, H, S, D = q.shape
    return q.new_empty((B, S, H, D)).transpose(1, 2)


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    is_causal: bool) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale)`` in
    inference, as the one-tile kernel computes it: scores in fp32 (fp64 for fp64 inputs), a bool
    mask keeps True positions, a float mask is added, ``is_causal`` keeps key j for query i when
    j <= i; the unnormalized probabilities are rounded to v's dtype before the product with v;
    query heads h read key/value head h // (Hq / Hk). A row with every key masked out gives zeros,
    as SDPA does. Output [B, H, Sq, D] laid out [B, Sq, H, D]."""
    ct = compute_dtype(q.dtype)
    H, Hk = q.shape[1], k.shape[1]
    if H != Hk:
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = (q.to(ct) @ k.to(ct).transpose(-1, -2)) * scale
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        keep = keep.tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask.to(ct)
    s = s.masked_fill(~keep, -math.inf)
    mx = s.amax(dim=-1, keepdim=True)
    mx = torch.where(mx == -math.inf, torch.zeros((), dtype=ct, device=q.device), mx)
    p = torch.exp(s - mx).masked_fill(~keep, 0.0)
    den = p.sum(-1, keepdim=True)
    o = (p.to(v.dtype).to(ct) @ v.to(ct)) / torch.where(den > 0, den, torch.ones((), dtype=ct, device=q.device))
    return short_attention_layout(q).copy_(o)


def fused_pointwise(program: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate a pointwise program (see graphopt.cuda_ext.pointwise) with torch ops."""
    from .pointwise import broadcast_shape, dense_order, empty_in_order, evaluate

    outs = [_fresh(o, *inputs) for o in evaluate(program, inputs)]
    order = dense_order(inputs, broadcast_shape(inputs)) if inputs else None
    if order is None:
        return outs
    return [empty_in_order(o.shape, order, o.dtype, o.device).copy_(o) for o in outs]
