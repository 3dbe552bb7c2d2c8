"""graphopt::short_attention: the reference against SDPA in float64, the Triton kernel on the CPU
through Triton's interpreter (fp16: the interpreter's bf16 dot is not usable) and, marked cuda,
on the GPU in bf16/fp16; the wrapper's argument checks."""
import math

import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext as ce
from graphopt.cuda_ext import attention_triton, reference
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter

# B, H, Hk, Sq, Sk, D, mask kind, causal
CASES = [
    (1, 4, 4, 37, 37, 64, "float", False),   # rows and keys that are not tile multiples
    (2, 4, 2, 20, 33, 32, "bool", False),    # grouped queries, a boolean mask per query row
    (1, 2, 2, 70, 70, 128, None, True),      # causal, the widest head
    (1, 3, 1, 5, 200, 40, "float", False),   # few queries over many keys, head dim not a power of 2
    (3, 2, 2, 16, 256, 16, "float", True),   # the most keys one tile holds, fewer queries than keys
    (5, 4, 4, 16, 16, 6, None, False),       # a head dim under 16 and not a multiple of 8 (TNT's pixels)
    (2, 2, 2, 49, 49, 12, "bool", False),    # a head dim of 12 (padded to 16 in registers)
]


def _inputs(B, H, Hk, SQ, SK, D, kind, dtype, device="cpu"):
    g = torch.Generator().manual_seed(B * 1000 + SQ)
    q = torch.randn(B, H, SQ, D, generator=g)
    k, v = torch.randn(B, Hk, SK, D, generator=g), torch.randn(B, Hk, SK, D, generator=g)
    mask = None
    if kind == "float":  # a padding mask with finfo.min, as Hugging Face builds it, [B, 1, 1, Sk]
        keep = torch.rand(B, 1, 1, SK, generator=g) > 0.3
        keep[..., 0] = True
        mask = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)
    elif kind == "bool":
        mask = torch.rand(B, 1, SQ, SK, generator=g) > 0.3
        mask[..., 0] = True
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), None if mask is None else mask.to(device)


def _sdpa64(q, k, v, mask, causal):
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    if causal and m is not None:  # SDPA takes one or the other: the triangle folded into the mask
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        m = m & tri if m.dtype == torch.bool else m.masked_fill(~tri, -math.inf)
        causal = False
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m, is_causal=causal, scale=q.shape[-1] ** -0.5)


def _check(out, q, k, v, mask, causal, tol):
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # [B, S, H, D] in memory
    torch.testing.assert_close(out.double(), _sdpa64(q, k, v, mask, causal), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_sdpa(case):
    B, H, Hk, SQ, SK, D, kind, causal = case
    q, k, v, mask = _inputs(*case[:7], torch.float32)
    _check(reference.short_attention(q, k, v, mask, D ** -0.5, causal), q, k, v, mask, causal, 1e-5)
    qb, kb, vb, mb = _inputs(*case[:7], torch.bfloat16)
    _check(reference.short_attention(qb, kb, vb, mb, D ** -0.5, causal), qb, kb, vb, mb, causal, 3e-2)


def test_a_row_with_every_key_masked_gives_zeros_as_in_sdpa():
    q, k, v, _ = _inputs(1, 2, 2, 4, 8, 16, None, torch.float32)
    mask = torch.ones(1, 1, 4, 8, dtype=torch.bool)
    mask[0, 0, 2] = False
    out = reference.short_attention(q, k, v, mask, 0.25, False)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    assert (out[0, :, 2] == 0).all() and (ref[0, :, 2] == 0).all()
    torch.testing.assert_close(out, ref)
    fmask = torch.zeros(1, 1, 4, 8).masked_fill(~mask, -math.inf)  # the same with an additive -inf mask
    torch.testing.assert_close(reference.short_attention(q, k, v, fmask, 0.25, False), ref)


def interpreter_cases():
    for case in CASES:
        q, k, v, mask = _inputs(*case[:7], torch.float16)
        out = attention_triton.attention_triton(q, k, v, mask, case[5] ** -0.5, case[7])
        _check(out, q, k, v, mask, case[7], 5e-3)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_short_attention:interpreter_cases")


def test_blocks_fill_the_device():
    assert attention_triton.blocks(1, 12, 128, 128, 64) == (16, 128, 4)   # BERT bs1: 96 programs of 16 rows
    assert attention_triton.blocks(8, 12, 128, 128, 64) == (64, 128, 4)   # 192 programs of 64 rows
    assert attention_triton.blocks(1, 12, 197, 197, 64) == (16, 256, 4)   # ViT: a 256-key tile
    assert attention_triton.blocks(8, 12, 197, 197, 64) == (64, 256, 8)   # a 64x256 score tile: 8 warps
    assert attention_triton.blocks(12544, 4, 16, 16, 6) == (16, 16, 4)   # 16 queries: a 16-row tile, not 64


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[0], k, v, None), "must be \\[batch"),
    (lambda q, k, v: (q, k[:, :3], v[:, :3], None), "multiple"),
    (lambda q, k, v: (q, torch.cat([k] * 5, 2), torch.cat([v] * 5, 2), None), "at most 256 keys"),
    (lambda q, k, v: (q, k, v, torch.zeros(2, 2, 3)), "broadcast"),
    (lambda q, k, v: (q.int(), k, v, None), "float32, float16 or bfloat16"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    q, k, v, _ = _inputs(1, 4, 4, 8, 60, 16, None, torch.float32)
    with pytest.raises(KernelArgumentError, match=match):
        ce.short_attention(*bad(q, k, v))


def test_wrapper_defaults_to_one_over_sqrt_d():
    q, k, v, _ = _inputs(1, 2, 2, 6, 6, 16, None, torch.float32)
    torch.testing.assert_close(ce.short_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [(1, 12, 12, 128, 128, 64, "float", False), (8, 12, 12, 197, 197, 64, None, False)])
def test_kernel_on_gpu(case, dtype):
    q, k, v, mask = _inputs(*case[:7], dtype, device="cuda")
    out = torch.ops.graphopt.short_attention(q, k, v, mask, case[5] ** -0.5, case[7])
    _check(out, q, k, v, mask, case[7], 2e-2 if dtype == torch.bfloat16 else 5e-3)
    # no worse than SDPA's own bf16/fp16 kernels against float64
    ref = _sdpa64(q, k, v, mask, case[7])
    m = mask
    if case[7] and m is not None:
        m = mask.masked_fill(~torch.ones(case[3], case[4], dtype=torch.bool, device="cuda").tril(), -math.inf)
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(case[1] // case[2], 1),
                                          v.repeat_interleave(case[1] // case[2], 1), attn_mask=m,
                                          is_causal=case[7] and m is None)
    assert (out.double() - ref).abs().max() <= 2 * (sdpa.double() - ref).abs().max() + 1e-3


@pytest.mark.cuda
def test_kernel_in_a_cuda_graph():
    q, k, v, mask = _inputs(1, 12, 12, 128, 128, 64, "float", torch.bfloat16, device="cuda")
    f = lambda: torch.ops.graphopt.short_attention(q, k, v, mask, 0.125, False)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    _check(out, q, k, v, mask, False, 2e-2)
    assert not math.isnan(out.float().sum().item())
