"""Python-side registrations on the graphopt ops: the schema definitions when the CUDA
extension is not loaded, the CPU (reference) implementations, the CUDA implementations that
are written in Python (fused_pointwise through Triton; everything through the reference when
the CUDA kernels are unavailable) and the Meta/fake implementations."""
from __future__ import annotations

import torch

from . import decode_attention_triton, reference
from ._schemas import NAMESPACE, schemas

_libs: list[torch.library.Library] = []   # keep the registrations alive
_done = {"defined": False, "impls": False}


def op_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", "")
        return True
    except RuntimeError:
        return False


def define_schemas() -> None:
    """Define every op from the schema strings of registration.cpp (reference backend)."""
    if _done["defined"]:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    tags = (torch.Tag.pt2_compliant_tag,)
    for name, schema in schemas().items():
        lib.define(schema, tags=tags)
    _libs.append(lib)
    _done["defined"] = True


# ---- fake (meta) implementations ----------------------------------------------------------
def _fake_bias_act(x, bias, act, residual, bias_dim=-1):
    return x.new_empty(x.shape)


def _fake_add_rms_norm(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _fake_add_layer_norm(x, residual, weight, bias, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _fake_rms_norm_add_rms_norm(y, residual, weight_y, weight, eps_y, eps):
    return y.new_empty(y.shape), y.new_empty(y.shape)


def _fake_linear_add_layer_norm(x, weight, bias, residual, ln_weight, ln_bias, eps, splits):
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: "graphopt::linear_add_layer_norm: weight must be [N, K] with K = x's last dim")
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def _fake_gemm_swiglu(x, weight, n, block):
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: "graphopt::gemm_swiglu: weight must be [rows, K] with K = x's last dim")
    return x.new_empty((*x.shape[:-1], n))


def _fake_swiglu(gate_up):
    torch._check(gate_up.shape[-1] % 2 == 0, lambda: "graphopt::swiglu: last dim must be even")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _fake_rotary(q, k, cos, sin, interleaved):
    return reference.rotary_layout(q), reference.rotary_layout(k)


def _fake_softmax_mask(scores, scale, mask):
    return scores.new_empty(scores.shape)


def _fake_fused_pointwise(program, inputs):
    from .pointwise import broadcast_shape, dense_order, empty_in_order, parse

    p = parse(program)
    shape = broadcast_shape(inputs)
    device = next((t.device for t in inputs if t.device.type != "cpu"), inputs[0].device if inputs else None)
    order = dense_order(inputs, shape)
    return [empty_in_order(shape, order, d, device) for d in p.output_dtypes()]


def _fake_layer_norm(x, weight, bias, eps):
    return x.new_empty(x.shape)


def _fake_conv_bias_relu(x, w, bias, z, stride, padding, dilation, groups):
    torch._check(x.dim() == 4 and w.dim() == 4, lambda: "graphopt::conv_bias_relu: 2-D convolutions only")
    shape = [x.shape[0], w.shape[0]]
    for i in range(2):
        k = dilation[i] * (w.shape[2 + i] - 1) + 1
        shape.append((x.shape[2 + i] + 2 * padding[i] - k) // stride[i] + 1)
    return x.new_empty(shape).contiguous(memory_format=reference.conv_layout(x, w))


def _fake_max_pool2d_nhwc(x, kernel, stride, padding):
    torch._check(x.dim() == 4, lambda: "graphopt::max_pool2d_nhwc: x must be [N, C, H, W]")
    ho = (x.shape[2] + 2 * padding - kernel) // stride + 1
    wo = (x.shape[3] + 2 * padding - kernel) // stride + 1
    return x.new_empty((x.shape[0], x.shape[1], ho, wo)).contiguous(memory_format=torch.channels_last)


def _fake_short_attention(q, k, v, mask, scale, is_causal):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "graphopt::short_attention: q, k and v must be [batch, heads, sequence, head_dim]")
    return reference.short_attention_layout(q)


FAKES = {
    "bias_act": _fake_bias_act, "add_rms_norm": _fake_add_rms_norm, "add_layer_norm": _fake_add_layer_norm,
    "swiglu": _fake_swiglu, "rotary": _fake_rotary, "softmax_mask": _fake_softmax_mask,
    "fused_pointwise": _fake_fused_pointwise, "conv_bias_relu": _fake_conv_bias_relu,
    "layer_norm": _fake_layer_norm, "max_pool2d_nhwc": _fake_max_pool2d_nhwc,
    "short_attention": _fake_short_attention, "rms_norm_add_rms_norm": _fake_rms_norm_add_rms_norm,
    "linear_add_layer_norm": _fake_linear_add_layer_norm, "gemm_swiglu": _fake_gemm_swiglu,
    "decode_attention": decode_attention_triton.fake,
}
REFERENCES = {
    "bias_act": reference.bias_act, "add_rms_norm": reference.add_rms_norm,
    "add_layer_norm": reference.add_layer_norm, "swiglu": reference.swiglu, "rotary": reference.rotary,
    "softmax_mask": reference.softmax_mask, "fused_pointwise": reference.fused_pointwise,
    "conv_bias_relu": reference.conv_bias_relu, "layer_norm": reference.layer_norm,
    "max_pool2d_nhwc": reference.max_pool2d_nhwc, "short_attention": reference.short_attention,
    "rms_norm_add_rms_norm": reference.rms_norm_add_rms_norm,
    "linear_add_layer_norm": reference.linear_add_layer_norm, "gemm_swiglu": reference.gemm_swiglu,
    "decode_attention": reference.decode_attention,
}


def _pointwise_cuda(program, inputs):
    from .pointwise_triton import fused_pointwise_triton

    return fused_pointwise_triton(program, inputs)


def _layer_norm_cuda(x, weight, bias, eps):
    from .norm_triton import layer_norm_triton

    return layer_norm_triton(x, weight, bias, eps)


def _rms_norm_add_rms_norm_cuda(y, residual, weight_y, weight, eps_y, eps):
    from .norm_triton import MAX_HIDDEN, rms_norm_add_rms_norm_triton

    if y.dim() == 0 or y.shape[-1] > MAX_HIDDEN:  # wider rows: correct, slower
        return reference.rms_norm_add_rms_norm(y, residual, weight_y, weight, eps_y, eps)
    return rms_norm_add_rms_norm_triton(y, residual, weight_y, weight, eps_y, eps)


def _linear_add_layer_norm_cuda(x, weight, bias, residual, ln_weight, ln_bias, eps, splits):
    from .norm_triton import linear_add_layer_norm_triton, split_k_supported

    if split_k_supported(x, weight, splits) is not None:  # fp64, wide rows, K not divisible: correct, slower
        return reference.linear_add_layer_norm(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)
    return linear_add_layer_norm_triton(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)


def _gemm_swiglu_cuda(x, weight, n, block):
    from .gemm_triton import gemm_swiglu_triton, supported

    if supported(x, weight, n, block) is not None:  # before sm_90, fp32, unaligned rows: correct, slower
        return reference.gemm_swiglu(x, weight, n, block)
    return gemm_swiglu_triton(x, weight, n, block)


def _short_attention_cuda(q, k, v, mask, scale, is_causal):
    from .attention_triton import attention_triton, supported

    if supported(tuple(q.shape), tuple(k.shape), q.dtype) is not None:  # fp32, long or odd shapes: correct, slower
        return reference.short_attention(q, k, v, mask, scale, is_causal)
    return attention_triton(q, k, v, mask, scale, is_causal)


def register_impls(cuda_kernels: bool, pointwise_triton: bool) -> None:
    """CPU = reference for every op; CUDA = reference too unless the kernels are loaded;
    fused_pointwise on CUDA = Triton when available; fake impls for all."""
    if _done["impls"]:
        return
    missing = set(schemas()) - set(FAKES)
    assert not missing, f"ops without a Python registration: {missing}"
    lib = torch.library.Library(NAMESPACE, "IMPL")
    for name in schemas():
        lib.impl(name, REFERENCES[name], "CPU")
        if name == "fused_pointwise":
            lib.impl(name, _pointwise_cuda if pointwise_triton else REFERENCES[name], "CUDA")
        elif name == "layer_norm":  # a Triton kernel, like fused_pointwise
            lib.impl(name, _layer_norm_cuda if pointwise_triton else REFERENCES[name], "CUDA")
        elif name == "short_attention":  # likewise
            lib.impl(name, _short_attention_cuda if pointwise_triton else REFERENCES[name], "CUDA")
        elif name == "rms_norm_add_rms_norm":  # likewise
            lib.impl(name, _rms_norm_add_rms_norm_cuda if pointwise_triton else REFERENCES[name], "CUDA")
        elif name == "linear_add_layer_norm":  # a batched GEMM (cuBLAS) and a Triton norm
            lib.impl(name, _linear_add_layer_norm_cuda if pointwise_triton else REFERENCES[name], "CUDA")
        elif name == "gemm_swiglu":  # a Triton GEMM
            lib.impl(name, _gemm_swiglu_cuda if pointwise_triton else REFERENCES[name], "CUDA")
        elif name == "decode_attention":  # two Triton kernels (split keys, combine)
            lib.impl(name, decode_attention_triton.cuda_impl if pointwise_triton else REFERENCES[name], "CUDA")
        elif not cuda_kernels:
            lib.impl(name, REFERENCES[name], "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{name}", FAKES[name], lib=lib)
    _libs.append(lib)
    _done["impls"] = True
