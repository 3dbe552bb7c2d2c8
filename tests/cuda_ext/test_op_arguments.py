"""The Python wrappers of the bundled ops refuse bad arguments in one line (KernelArgumentError,
a GraphoptError and a ValueError) before the op is dispatched: on the H200 image a failing C++
check inside the extension ended the process instead of raising. Checked on the CPU (the checks
run before dispatch, whatever the device), each next to a call the op accepts."""

import pytest
import torch

import graphopt.cuda_ext as ce
from graphopt.errors import GraphoptError, KernelArgumentError


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


BAD = [
    ("swiglu", lambda: ce.swiglu(r(4, 7)), "last dim must be even"),
    ("swiglu", lambda: ce.swiglu(torch.ones(4, 8, dtype=torch.int32)), "float32, float16 or bfloat16"),
    ("bias_act", lambda: ce.bias_act(r(4, 8), r(8), act="mish"), "unknown activation 'mish'"),
    ("bias_act", lambda: ce.bias_act(r(4, 8), r(7), act="relu"), "bias must be 1-D of length 8"),
    ("bias_act", lambda: ce.bias_act(r(4, 8), r(8), residual=r(4, 9)), "residual shape"),
    ("bias_act", lambda: ce.bias_act(r(4, 8), r(8), bias_dim=2), "bias_dim 2 out of range"),
    ("layer_norm", lambda: ce.layer_norm(r(4, 8), r(7)), "weight must have 8 elements"),
    ("add_rms_norm", lambda: ce.add_rms_norm(r(4, 8), r(4, 8), r(16)), "weight must have 8 elements"),
    ("add_rms_norm", lambda: ce.add_rms_norm(r(4, 8), r(2, 8), r(8)), "residual shape"),
    ("add_layer_norm", lambda: ce.add_layer_norm(r(4, 8), None, r(8), r(9)), "bias must have 8 elements"),
    ("rms_norm_add_rms_norm", lambda: ce.rms_norm_add_rms_norm(r(4, 8), r(4, 8), r(7), r(8)),
     "weight_y must have 8 elements"),
    ("rms_norm_add_rms_norm", lambda: ce.rms_norm_add_rms_norm(r(4, 8), r(4, 9), r(8), r(8)), "residual shape"),
    ("linear_add_layer_norm", lambda: ce.linear_add_layer_norm(r(4, 8), r(6, 9)), "weight must be [N, K]"),
    ("linear_add_layer_norm", lambda: ce.linear_add_layer_norm(r(4, 8), r(6, 8), splits=3), "positive divisor"),
    ("linear_add_layer_norm", lambda: ce.linear_add_layer_norm(r(4, 8), r(6, 8), ln_weight=r(8)),
     "ln_weight must have 6 elements"),
    ("linear_add_layer_norm", lambda: ce.linear_add_layer_norm(r(4, 8), r(6, 8), residual=r(4, 8)), "residual shape"),
    ("linear_add_layer_norm", lambda: ce.linear_add_layer_norm(r(4, 8), r(6, 8, dtype=torch.bfloat16)),
     "weight is torch.bfloat16"),
    ("gemm_swiglu", lambda: ce.gemm_swiglu(r(4, 8), r(32, 9), 8, 8), "weight must be [rows, K]"),
    ("gemm_swiglu", lambda: ce.gemm_swiglu(r(4, 8), r(24, 8), 8, 8), "not pairs of 8-row gate and up blocks"),
    ("gemm_swiglu", lambda: ce.gemm_swiglu(r(4, 8), r(32, 8), 17, 8), "n must be in 1..16"),
    ("gemm_swiglu", lambda: ce.gemm_swiglu(r(4, 8), r(32, 8, dtype=torch.bfloat16), 8, 8), "weight is torch.bfloat16"),
    ("gemm_swiglu", lambda: ce.gemm_swiglu(r(4, 8), r(32, 8), 15, 0), "block 0 takes cat([gate, up])"),
    ("rotary", lambda: ce.rotary(r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 4, 3), r(1, 4, 3)), "R even"),
    ("rotary", lambda: ce.rotary(r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 4, 8), r(1, 4, 8)), "differ"),
    ("rotary", lambda: ce.rotary(r(2, 4, 8), r(2, 4, 8), r(1, 4, 8), r(1, 4, 8)), "must be [B, H, S, D]"),
    ("rotary", lambda: ce.rotary(r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 4, 8), r(1, 4, 6)), "shapes differ"),
    ("softmax_mask", lambda: ce.softmax_mask(r(())), "at least one dim"),
    ("conv_bias_relu", lambda: ce.conv_bias_relu(r(1, 3, 8), r(4, 3, 3)), "2-D convolutions only"),
    ("max_pool2d_nhwc", lambda: ce.max_pool2d_nhwc(r(2, 16, 6, 6), 3, 2, 2), "padding"),
]


@pytest.mark.parametrize("op,call,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_raise_one_line_errors_naming_the_op(op, call, message):
    with pytest.raises(KernelArgumentError) as e:
        call()
    text = str(e.value)
    assert isinstance(e.value, GraphoptError) and isinstance(e.value, ValueError)
    assert f"graphopt::{op}" in text and message in text and "\n" not in text


def test_the_same_ops_accept_good_arguments():
    x = r(4, 8)
    assert ce.swiglu(x).shape == (4, 4)
    assert ce.gemm_swiglu(r(2, 4, 8), r(32, 8), 12, 8).shape == (2, 4, 12)
    assert ce.gemm_swiglu(r(2, 4, 8), r(32, 8), 16, 0).shape == (2, 4, 16)
    out, h = ce.linear_add_layer_norm(x, r(6, 8), r(6), r(4, 6), r(6), r(6), splits=4)
    assert out.shape == h.shape == (4, 6)
    assert ce.bias_act(x, r(8), act="gelu", residual=r(4, 8)).shape == (4, 8)
    assert ce.bias_act(r(2, 8, 3, 3), r(8), act="relu", bias_dim=1).shape == (2, 8, 3, 3)
    assert ce.bias_act(x, None, act="relu", residual=r(1, 8)).shape == (4, 8)  # a residual that broadcasts
    assert ce.layer_norm(x, r(8), r(8)).shape == (4, 8)
    y, h = ce.add_rms_norm(x, r(4, 8), r(8))
    assert y.shape == h.shape == (4, 8)
    q, k = ce.rotary(r(2, 4, 6, 8), r(2, 2, 6, 8), r(1, 6, 4), r(1, 6, 4), interleaved=True)
    assert q.shape == (2, 4, 6, 8) and k.shape == (2, 2, 6, 8)
    q, k = ce.rotary(r(2, 4, 6, 8), r(2, 2, 6, 8), r(2, 1, 6, 8), r(2, 1, 6, 8))
    assert q.shape == (2, 4, 6, 8)
    assert ce.softmax_mask(r(2, 5), 0.5, torch.ones(2, 5, dtype=torch.bool)).shape == (2, 5)
    assert ce.max_pool2d_nhwc(r(2, 16, 6, 6), 3, 2, 1).shape == (2, 16, 3, 3)
