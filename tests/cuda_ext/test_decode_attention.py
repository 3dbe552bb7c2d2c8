"""graphopt::decode_attention: the reference against SDPA in float64, the split-KV Triton kernels on
the CPU through Triton's interpreter (fp16) against the float64 reference and, marked cuda, on the
GPU in bf16 (also replayed from a CUDA graph with kv_len changing between replays); the wrapper's
argument checks."""
import math

import pytest
import torch
import torch.nn.functional as F

from graphopt.cuda_ext import decode_attention_triton as dat
from graphopt import cuda_ext as ops
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter, skip_old_interpreter

# B, Hq, Hkv, Tq, L, D, mask kind, kv_len kind, splits
CASES = [
    (1, 4, 4, 1, 37, 64, None, None, 1),              # no grouping, keys not a block multiple, one kernel
    (2, 8, 2, 1, 100, 64, "causal", "rows", 3),       # GQA 4, a bool mask from cache positions, kv_len per row
    (1, 8, 1, 4, 75, 32, "float", "one", 4),          # GQA 8, 4 query positions, an additive padding mask
    (2, 16, 2, 1, 130, 128, "causal_inf", "rows", 5),  # GQA 8, head dim 128, an additive -inf mask
    (1, 2, 2, 3, 50, 80, "causal", None, 2),          # head dim 80 (padded to 128), the mask alone bounds
    (2, 4, 1, 2, 70, 16, "per_head", "rows", 7),      # a [B, Hq, Tq, L] bool mask, more splits than blocks
    (2, 4, 4, 2, 290, 32, None, None, 1),             # one split of five key blocks: the running maximum
    (1, 8, 2, 1, 333, 64, "float", "one", 2),         # two splits of three blocks each
]


def _positions(B, L, Tq, g):
    """The cache position of each batch row's first query: the past length."""
    return torch.randint(0, L - Tq + 1, (B,), generator=g)


def _inputs(B, H, Hk, T, L, D, kind, kvk, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + B * 1000 + L)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hk, L, D, generator=g), torch.randn(B, Hk, L, D, generator=g)
    pos = _positions(B, L, T, g)
    qpos = pos[:, None] + torch.arange(T)[None, :]                       # [B, T]
    causal = torch.arange(L)[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, T, L]
    mask = None
    if kind == "causal":
        mask = causal
    elif kind == "causal_inf":
        mask = torch.zeros(B, 1, T, L).masked_fill(~causal, -math.inf)
    elif kind == "float":  # Hugging Face's padding mask with finfo.min, and a causal bound
        keep = (torch.rand(B, 1, 1, L, generator=g) > 0.3) & causal
        keep[..., 0] = True
        mask = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(dtype).min)
    elif kind == "per_head":
        mask = (torch.rand(B, H, T, L, generator=g) > 0.4) & causal
    kv_len = None
    if kvk == "rows":
        kv_len = (pos + T).to(torch.int32)
    elif kvk == "one":
        kv_len = (pos.max() + T).reshape(1)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    mask = None if mask is None else (mask.to(device) if mask.dtype == torch.bool else to(mask))
    return to(q), to(k), to(v), mask, None if kv_len is None else kv_len.to(device)


def _sdpa64(q, k, v, mask, kv_len):
    """SDPA in float64 over keys bounded by kv_len (folded into the mask)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    L = k.shape[2]
    keep = torch.ones(1, 1, 1, L, dtype=torch.bool, device=q.device)
    if kv_len is not None:
        keep = keep & (torch.arange(L, device=q.device) < kv_len.reshape(-1, 1, 1, 1).long())
    bias = torch.zeros((), dtype=torch.float64, device=q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            bias = mask.double()
    m = torch.zeros(keep.shape, dtype=torch.float64, device=q.device).masked_fill(~keep, -math.inf) + bias
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m, scale=q.shape[-1] ** -0.5)


def _check(out, q, k, v, mask, kv_len, tol):
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # [B, Tq, H, D] in memory
    torch.testing.assert_close(out.double(), _sdpa64(q, k, v, mask, kv_len), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_sdpa(case):
    q, k, v, mask, kv_len = _inputs(*case[:8], torch.float64)
    out = dat.reference(q, k, v, mask, kv_len, q.shape[-1] ** -0.5)
    _check(out, q, k, v, mask, kv_len, 1e-10)


@pytest.mark.parametrize("case", [c for c in CASES if c[7] is not None])
def test_kv_len_bounds_the_work_not_the_answer(case):
    """Where the mask excludes every key at or past kv_len, the bound changes nothing."""
    q, k, v, mask, kv_len = _inputs(*case[:8], torch.float64)
    s = q.shape[-1] ** -0.5
    torch.testing.assert_close(dat.reference(q, k, v, mask, kv_len, s), dat.reference(q, k, v, mask, None, s),
                               rtol=1e-12, atol=1e-12)


def test_every_key_excluded_gives_zeros():
    q, k, v, _, _ = _inputs(2, 4, 2, 1, 20, 16, None, None, torch.float64)
    out = dat.reference(q, k, v, None, torch.tensor([0, 20]), 0.25)
    assert (out[0] == 0).all() and (out[1] != 0).any()


def interpreter_cases():
    for case in CASES:
        q, k, v, mask, kv_len = _inputs(*case[:8], torch.float16)
        out = torch.full_like(q, float("nan"))  # poison: the kernel must write every element
        out = dat.decode_attention_triton(q, k, v, mask, kv_len, q.shape[-1] ** -0.5, splits=case[8])
        _check(out, q, k, v, mask, kv_len, 5e-3)
    # the split counters the last split of each head resets: all zero between calls
    from graphopt.cuda_ext import norm_triton

    assert all(int(c.abs().sum()) == 0 for c in norm_triton._counters.values()) and norm_triton._counters
    # the second-kernel combine (where one program would hold too many partial outputs)
    for case in [c for c in CASES if (c[8] or 1) > 1][:2]:
        q, k, v, mask, kv_len = _inputs(*case[:8], torch.float16)
        out = dat.decode_attention_triton(q, k, v, mask, kv_len, q.shape[-1] ** -0.5, splits=case[8],
                                          fused_combine=False)
        _check(out, q, k, v, mask, kv_len, 5e-3)
    # kv_len 0 for one row (every key excluded: zeros) and past the cache's end (clipped) for the other
    q, k, v, _, _ = _inputs(2, 4, 2, 1, 40, 32, None, None, torch.float16)
    kv_len = torch.tensor([0, 1000])
    for s in (1, 3):
        out = dat.decode_attention_triton(q, k, v, None, kv_len, 32 ** -0.5, splits=s)
        assert (out[0] == 0).all()
        _check(out, q, k, v, None, kv_len, 5e-3)
    # K/V read through the strides of a larger cache (a slice of a [B, L, Hkv, D] buffer)
    big = torch.randn(1, 90, 4, 64).half()
    k, v = big[:, :60].transpose(1, 2), big[:, 30:].transpose(1, 2)
    q = torch.randn(1, 8, 1, 64).half()
    _check(dat.decode_attention_triton(q, k, v, None, None, 0.125, splits=2), q, k, v, None, None, 5e-3)
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    skip_old_interpreter()
    run_in_triton_interpreter("tests.cuda_ext.test_decode_attention:interpreter_cases")


def test_splits_fill_the_device():
    # Llama-3-8B at bs1 (8 KV heads): 17 splits of a 4352-key cache, combined by the last of them;
    # at bs32 256 programs, one split
    assert dat.plan((1, 32, 1, 128), (1, 8, 4352, 128))["splits"] == 17
    assert dat.plan((1, 32, 1, 128), (1, 8, 4352, 128))["fused"]
    assert dat.plan((32, 32, 1, 128), (32, 8, 4352, 128))["splits"] == 1
    # GLM-4 at bs1 (2 KV heads): 66 splits fill the SMs; a split keeps at least one key block
    assert dat.plan((1, 32, 1, 128), (1, 2, 4352, 128))["splits"] == 66
    assert dat.plan((1, 32, 1, 128), (1, 2, 300, 128))["splits"] == 5
    # GLM-4's 16 rows x 66 splits of partial outputs are more than one program combines fast: a second
    # kernel does; Llama's 4 rows x 17 splits of head dim 128 are combined by the last split
    assert not dat.plan((1, 32, 1, 128), (1, 2, 4352, 128))["fused"]
    assert not dat.combine_fused(16, 32, 128) and dat.combine_fused(4, 32, 128) and dat.combine_fused(16, 8, 64)
    assert dat.plan((1, 32, 1, 128), (1, 2, 300, 128))["BLOCK_M"] == 16


def test_cost_counts_the_cache_and_the_partials():
    flops, nbytes, launches = dat.cost((1, 32, 1, 128), (1, 8, 4352, 128), 2, 4352, 0)
    kv = 2 * 8 * 4352 * 128 * 2
    part = 2 * 4 * 32 * 17 * 130
    assert launches == 1 and nbytes == kv + 2 * 32 * 128 * 2 + 4352 + part
    assert flops == 4 * 32 * 4352 * 128
    assert dat.cost((32, 32, 1, 128), (32, 8, 4352, 128), 2, 0, 0)[2] == 1


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[0], k, v), "must be \\[batch"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)), "multiple"),
    (lambda q, k, v: (q, k, v[..., :8]), "k and v must both be"),
    (lambda q, k, v: (q, k, v, torch.zeros(2, 3, 1, 30)), "broadcast"),
    (lambda q, k, v: (q, k, v, torch.zeros(2, 1, 1, 30, dtype=torch.int32)), "bool or float"),
    (lambda q, k, v: (q, k, v, None, torch.tensor([3, 4, 5])), "kv_len"),
    (lambda q, k, v: (q, k, v, None, torch.tensor([3.0])), "kv_len"),
    (lambda q, k, v: (q.int(), k, v), "one floating dtype"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    q, k, v, _, _ = _inputs(2, 4, 2, 1, 30, 16, None, None, torch.float32)
    with pytest.raises(KernelArgumentError, match=match):
        ops.decode_attention(*bad(q, k, v))


def test_wrapper_defaults_to_one_over_sqrt_d():
    q, k, v, mask, kv_len = _inputs(2, 4, 2, 1, 30, 16, "causal", "rows", torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ops.decode_attention(q, k, v, mask, kv_len), ref)


GPU_CASES = CASES + [
    (1, 32, 8, 1, 4352, 128, "causal", "rows", None),   # Llama-3-8B, a 4096 + 256 static cache
    (8, 32, 2, 1, 4352, 128, "causal", "rows", None),   # GLM-4, batch 8
    (4, 32, 8, 4, 1100, 128, "float", "one", None),     # speculative decoding: 4 positions
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_on_gpu(case, dtype):
    from conftest import poison_allocator

    q, k, v, mask, kv_len = _inputs(*case[:8], dtype, device="cuda")
    poison_allocator("cuda")
    out = dat.decode_attention_triton(q, k, v, mask, kv_len, q.shape[-1] ** -0.5, splits=case[8])
    _check(out, q, k, v, mask, kv_len, 2e-2 if dtype == torch.bfloat16 else 5e-3)
    # no worse than SDPA's own kernels on the same inputs, against float64
    ref = _sdpa64(q, k, v, mask, kv_len)
    L = k.shape[2]
    keep = torch.ones(1, 1, 1, L, dtype=torch.bool, device="cuda")
    if kv_len is not None:
        keep = keep & (torch.arange(L, device="cuda") < kv_len.reshape(-1, 1, 1, 1).long())
    m = keep & mask if mask is not None and mask.dtype == torch.bool else keep
    if mask is not None and mask.dtype != torch.bool:
        m = torch.zeros(m.shape, dtype=dtype, device="cuda").masked_fill(~m, -math.inf) + mask
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    assert (out.double() - ref).abs().max() <= 2 * (sdpa.double() - ref).abs().max() + 1e-3


@pytest.mark.cuda
def test_kernel_replayed_from_a_cuda_graph_follows_kv_len():
    """Captured once, replayed with a growing past: the bound and the mask are read at replay."""
    B, H, Hk, L, D = 2, 32, 8, 1024, 128
    q, k, v, _, _ = _inputs(B, H, Hk, 1, L, D, None, None, torch.bfloat16, device="cuda")
    kv_len = torch.zeros(B, dtype=torch.int64, device="cuda")
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bool, device="cuda")
    f = lambda: torch.ops.graphopt.decode_attention(q, k, v, mask, kv_len, D ** -0.5)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    for past in ((5, 17), (300, 64), (1023, 700)):
        n = torch.tensor(past, device="cuda") + 1
        kv_len.copy_(n)
        mask.copy_(torch.arange(L, device="cuda")[None, None, None, :] < n[:, None, None, None])
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        _check(out, q, k, v, mask, kv_len, 2e-2)


def test_split_counters_outgrown_stay_allocated(monkeypatch):
    """A counter buffer a larger call outgrows is kept (a CUDA graph captured with it holds its
    address); calls that fit reuse the current one."""
    from graphopt.cuda_ext import norm_triton

    monkeypatch.setattr(norm_triton, "_counters", {})
    monkeypatch.setattr(norm_triton, "_counters_kept", [])
    dev = torch.device("cpu")
    small = norm_triton.split_counters(dev, 10)
    assert small.numel() == 256 and int(small.abs().sum()) == 0
    assert norm_triton.split_counters(dev, 200) is small
    big = norm_triton.split_counters(dev, 1000)
    assert big.numel() == 1000 and norm_triton._counters_kept == [small]
