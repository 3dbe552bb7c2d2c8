"""graphopt.cuda_ext: fused kernels registered as PyTorch custom ops (``torch.ops.graphopt.*``).

Importing this package makes the ops exist (``ensure_loaded``): backed by the compiled CUDA
kernels when a GPU and a CUDA toolkit are present, by the plain-torch reference
implementations otherwise. See README.md in this folder.

Ops (schemas in csrc/registration.cpp): bias_act, add_rms_norm, add_layer_norm, swiglu,
rotary, softmax_mask, fused_pointwise, conv_bias_relu, layer_norm, max_pool2d_nhwc,
short_attention, rms_norm_add_rms_norm, linear_add_layer_norm, gemm_swiglu, decode_attention.
"""
from . import reference
from ._loader import backend, backend_info, ensure_loaded
from ._schemas import schemas
from .ops import (add_layer_norm, add_rms_norm, bias_act, conv_bias_relu, decode_attention, fused_pointwise, gemm_swiglu,
                  layer_norm, linear_add_layer_norm, max_pool2d_nhwc, rms_norm_add_rms_norm, rotary, short_attention,
                  softmax_mask, swiglu)
from .pointwise import Program, ProgramError, evaluate, parse

__all__ = [
    "ensure_loaded", "backend", "backend_info", "schemas", "reference",
    "bias_act", "add_rms_norm", "add_layer_norm", "swiglu", "rotary", "softmax_mask", "fused_pointwise", "conv_bias_relu",
    "layer_norm", "max_pool2d_nhwc", "short_attention", "rms_norm_add_rms_norm", "linear_add_layer_norm",
    "gemm_swiglu", "decode_attention", "Program", "ProgramError", "parse", "evaluate",
]

ensure_loaded()
