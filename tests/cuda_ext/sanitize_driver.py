"""Small driver that runs every CUDA kernel once at odd and edge sizes, all dtypes; run under
compute-sanitizer (memcheck, racecheck) by cuda_ext/gpu_check.sh. Not a pytest file."""
import torch

import graphopt.cuda_ext as ce
from graphopt.cuda_ext.ops.gemm_swiglu import interleave_gate_up

assert ce.backend() == "cuda", ce.backend_info()
dev = "cuda"
for dt in (torch.float32, torch.bfloat16, torch.float16):
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    for shape in [(1,), (7,), (3, 1023), (2, 4104), (5, 3, 9)]:
        x = r(*shape)
        ce.bias_act(x, r(shape[-1]), "gelu_tanh", r(*shape))
        ce.bias_act(x, None, "relu", None)
    ce.bias_act(r(2, 3, 5, 7), r(3), "silu", None, 1)
    ce.bias_act(r(2, 16, 4, 4), r(16), "gelu", None, 1)
    for h in (1, 7, 1023, 4096, 4097, 16384, 20000):
        x, res = r(3, h), r(3, h)
        ce.add_rms_norm(x, res, r(h), 1e-6)
        ce.add_rms_norm(x, None, torch.randn(h, device=dev), 1e-6)
        ce.add_layer_norm(x, res, r(h), r(h), 1e-5)
        ce.add_layer_norm(x, None, None, None, 1e-5)
        ce.rms_norm_add_rms_norm(x, res, r(h), r(h), 1e-6, 1e-5)
    for M, N, K, s in [(1, 1, 1, 1), (7, 33, 96, 3), (128, 768, 3072, 6), (197, 768, 3072, 4), (3, 8192, 64, 2)]:
        ce.linear_add_layer_norm(r(1, M, K), r(N, K), r(N), r(1, M, N), r(N), r(N), 1e-5, s)
        ce.linear_add_layer_norm(r(M, K), r(N, K), None, None, None, None, 1e-5, s)
    for shape in [(2,), (3, 14), (5, 2046), (2, 8192), (3, 8194)]:
        ce.swiglu(r(*shape))
    for M, K, n in [(1, 8, 8), (129, 72, 136), (300, 4096, 264)]:  # bf16/fp16: the Triton GEMM; fp32: reference
        ce.gemm_swiglu(r(M, K), interleave_gate_up(r(2 * n, K), 128), n, 128)
        ce.gemm_swiglu(r(M, K), r(2 * n, K), n, 0)  # the halves layout
    for shape, k, st, pd in [((2, 64, 13, 11), 3, 2, 1), ((1, 3, 7, 7), 3, 2, 1), ((1, 40, 9, 9), 5, 3, 2)]:
        ce.max_pool2d_nhwc(r(*shape).contiguous(memory_format=torch.channels_last), k, st, pd)
        ce.max_pool2d_nhwc(r(*shape), k, st, pd)
        ce.avg_pool2d_nhwc(r(*shape).contiguous(memory_format=torch.channels_last), k, st, pd, True)
        ce.avg_pool2d_nhwc(r(*shape), k, st, pd, False)
    for B, Hq, Hk, S, D, R in [(2, 4, 2, 7, 64, 64), (1, 3, 1, 1, 10, 4), (2, 4, 2, 33, 128, 64)]:
        q, k = r(B, S, Hq, D).transpose(1, 2), r(B, S, Hk, D).transpose(1, 2)
        ce.rotary(q, k, r(1, S, R), r(1, S, R), True)
        ce.rotary(q, k, r(B, S, R), r(B, S, R), False)
    for shape in [(1, 1, 1, 1), (2, 3, 5, 7), (2, 2, 9, 4096), (1, 2, 3, 20000)]:
        sc = r(*shape)
        ce.softmax_mask(sc, 0.5, torch.rand(shape[0], 1, 1, shape[-1], device=dev) > 0.3)
        ce.softmax_mask(sc, 0.5, r(shape[0], 1, shape[-2], shape[-1]))
        ce.softmax_mask(sc, 0.5, None)
    p = ce.Program()
    a, b = p.input(), p.input()
    p.output(p.gelu_tanh(a + b), dt)
    ce.fused_pointwise(p, [r(3, 1023), r(1023)])
    ce.fused_pointwise(p, [r(33, 5).t(), r(1)])
# persistent kernels with several rows per CTA / warp (rows past the resident grid), heads split
# over blockIdx.y, rank-3 pointwise tiles; every launch variant
import ctypes  # noqa: E402

setv = ctypes.CDLL(ce.backend_info()["library"]).graphopt_set_variant
r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
for v in (0, 1, 2, 3):
    setv(0, v)
    for h in (768, 4096, 8192):
        x, res = r(2000, h), r(2000, h)
        ce.add_rms_norm(x, res, r(h), 1e-6)
        ce.add_layer_norm(x, res, r(h), r(h), 1e-5)
setv(0, 0)
for v in (0, 1):
    setv(1, v)
    ce.softmax_mask(r(3, 2000, 128), 0.5, torch.rand(3, 1, 128, device=dev) > 0.3)
    ce.softmax_mask(r(2, 1500, 1024), 0.5, r(2, 1, 1024))
    setv(2, v)
    for interleaved in (True, False):
        q, k = r(1, 3, 13, 128).transpose(1, 2), r(1, 3, 2, 128).transpose(1, 2)
        ce.rotary(q, k, r(1, 3, 64), r(1, 3, 64), interleaved)
setv(1, 0)
setv(2, 0)
p = ce.Program()
a, b = p.input(), p.input()
p.output(p.gelu_tanh(a + b), torch.bfloat16)
ce.fused_pointwise(p, [r(3, 5, 70), r(3, 1, 70)])
# short_attention: ragged query tiles, keys that are not a power of 2 (masked loads), GQA, masks
for B, H, Hk, SQ, SK, D in [(1, 4, 4, 37, 37, 64), (2, 4, 2, 5, 256, 40), (3, 2, 1, 70, 129, 128)]:
    q, k, v = r(B, H, SQ, D), r(B, Hk, SK, D), r(B, Hk, SK, D)
    ce.short_attention(q, k, v, None, None, True)
    ce.short_attention(q, k, v, torch.rand(B, 1, SQ, SK, device=dev) > 0.3)
    ce.short_attention(q, k, v, r(B, 1, 1, SK))
# decode_attention: one and several splits, empty splits (kv_len short or 0), odd lengths, GQA, masks
for B, H, Hk, T, L, D in [(2, 8, 2, 1, 333, 128), (1, 32, 8, 4, 100, 64), (3, 4, 4, 2, 70, 80)]:
    q, k, v = r(B, H, T, D), r(B, Hk, L, D), r(B, Hk, L, D)
    n = torch.randint(0, L + 5, (B,), device=dev)
    ce.decode_attention(q, k, v, None, n)
    ce.decode_attention(q, k, v, torch.rand(B, 1, T, L, device=dev) > 0.3)
    ce.decode_attention(q, k, v, r(B, H, T, L), n[:1].to(torch.int32))
torch.cuda.synchronize()
print("sanitize_driver: ok")
