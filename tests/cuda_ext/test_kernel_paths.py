"""The launch paths of the bandwidth-bound kernels (cuda_ext/README.md, "kernel shapes"): every
vector count class of the persistent norm kernel, rows past the persistent grid (a CTA or warp
normalizes several rows, with the next row's loads in flight), heads split over blockIdx.y when
tokens are few, head counts that are not multiples of the heads-in-flight unroll, and every launch
variant (``graphopt_set_variant``) giving the same result. Against fp64 with the accuracy rule,
outputs poisoned first. The fused_pointwise launch-plan cache and the hardware-tanh source run
under the Triton interpreter here."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

import graphopt.cuda_ext as ce
from graphopt.cuda_ext import pointwise_triton as pwt
from graphopt.cuda_ext import reference as ref
from graphopt.cuda_ext.pointwise import Program, parse

import kx_eager as eager
from kx_accuracy import check
from conftest import DEVICES, HAS_CUDA, poison_allocator

FAMILY = {"norm": 0, "softmax": 1, "rotary": 2}
VARIANTS = {"norm": [0, 1, 2, 3], "softmax": [0, 1], "rotary": [0, 1]}


def rnd(*shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def f64(t):
    return None if t is None else t.detach().to(torch.float64)


def _setter():
    lib = ce.backend_info().get("library")
    if ce.backend() != "cuda" or not lib:
        pytest.skip("the compiled extension is not loaded")
    return ctypes.CDLL(lib).graphopt_set_variant


def _variants(family, device):
    """(variant, setter) pairs: every variant on CUDA with the compiled kernels, just 0 elsewhere."""
    if torch.device(device).type != "cuda" or ce.backend() != "cuda":
        return [(0, None)]
    f = _setter()
    return [(v, f) for v in VARIANTS[family]]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_variant_setter_rejects_unknown_family():
    f = _setter()
    assert f(7, 0) == -1 and f(0, -1) == -1
    assert f(0, 0) >= 0


# ---------------------------------------------------------------------------- norms
# hidden sizes: 16-bit vectors 1 (<= 256 vectors), <= 512 (one vector per thread by default), <= 1024
# (two per thread), <= 2048 (four per thread); plus a tail that is not a multiple of the vector width
NORM_CASES = [(1000, 8), (700, 2048), (300, 4096), (50, 8192), (20, 16384), (40, 4100)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_norm_paths_and_variants(device, dtype):
    cases = NORM_CASES if torch.device(device).type == "cuda" else [(3, 4096), (2, 4100)]
    for rows, hidden in cases:
        x = rnd(rows, hidden, dtype=dtype, device=device, scale=2) + 0.5
        r = rnd(rows, hidden, dtype=dtype, device=device)
        w = (1 + 0.1 * rnd(hidden)).to(device=device, dtype=dtype)
        b = (0.1 * rnd(hidden)).to(device=device, dtype=dtype)
        ro, rh = ref.add_rms_norm(f64(x), f64(r), f64(w), 1e-6)
        eo, eh = eager.add_rms_norm(x, r, w, 1e-6)
        lo, lh = ref.add_layer_norm(f64(x), f64(r), f64(w), f64(b), 1e-5)
        elo, _ = eager.add_layer_norm(x, r, w, b, 1e-5)
        for v, setv in _variants("norm", device):
            if setv:
                setv(FAMILY["norm"], v)
            try:
                poison_allocator(device)
                out, h = torch.ops.graphopt.add_rms_norm(x, r, w, 1e-6)
                check(h, rh, eh, what=f"rms h {rows}x{hidden} v{v}")
                check(out, ro, eo, what=f"rms {rows}x{hidden} v{v}")
                poison_allocator(device)
                out, h = torch.ops.graphopt.add_layer_norm(x, r, w, b, 1e-5)
                check(h, lh, eh, what=f"ln h {rows}x{hidden} v{v}")
                check(out, lo, elo, what=f"ln {rows}x{hidden} v{v}")
            finally:
                if setv:
                    setv(FAMILY["norm"], 0)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_large_mean_two_pass(device):
    """Rows with a large common offset: the centered second pass keeps the variance accurate."""
    x = rnd(64, 4096, device=device) + 300.0
    w = torch.ones(4096, device=device)
    out, _ = torch.ops.graphopt.add_layer_norm(x, None, w, None, 1e-5)
    check(out, ref.add_layer_norm(f64(x), None, f64(w), None, 1e-5)[0],
          eager.add_layer_norm(x, None, w, None, 1e-5)[0])


# ---------------------------------------------------------------------------- softmax
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softmax_rows_past_the_persistent_grid(device, dtype):
    big = torch.device(device).type == "cuda"
    for shape, kind in [((4, 8, 700, 128), "bool"), ((2, 16, 300, 1024), "float"), ((3, 700, 2048), None),
                        ((2, 5, 9, 520), "bool")] if big else [((2, 2, 5, 128), "bool"), ((2, 3, 64), "float")]:
        sc = rnd(*shape, dtype=dtype, device=device, scale=3)
        S = shape[-1]
        mask = None
        if kind == "bool":
            mask = torch.rand(shape[0], 1, 1, S, device=device) > 0.3
            mask[0, 0, 0, :] = False  # batch 0: every row fully masked -> zeros
        elif kind == "float":
            mask = torch.where(torch.rand(shape[0], 1, shape[-2], S, device=device) > 0.2, 0.0, -1e4).to(dtype)
        r = ref.softmax_mask(f64(sc), 0.088, f64(mask) if mask is not None and mask.dtype != torch.bool else mask)
        e = eager.softmax_mask(sc, 0.088, mask)
        for v, setv in _variants("softmax", device):
            if setv:
                setv(FAMILY["softmax"], v)
            try:
                poison_allocator(device)
                y = torch.ops.graphopt.softmax_mask(sc, 0.088, mask)
                if kind == "bool":
                    assert torch.equal(y[0], torch.zeros_like(y[0]))
                check(y, r, e, what=f"{shape} {kind} v{v}")
            finally:
                if setv:
                    setv(FAMILY["softmax"], 0)


# ---------------------------------------------------------------------------- rotary
def _cos_sin(B, S, R, device, dtype, interleaved):
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    pos = torch.rand(B, S, dtype=torch.float64).cumsum(-1) * 7
    f = pos[..., None] * inv
    emb = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_head_loops_and_splits(device, dtype, interleaved):
    big = torch.device(device).type == "cuda"
    # (B, Hq, Hk, S, D, R, Bc): few tokens (heads split over blockIdx.y), head counts not multiples
    # of 4 or 8, many tokens (no split), GLM's partial shape, per-batch cos/sin
    cases = [(1, 5, 3, 3, 64, 64, 1), (2, 13, 1, 40, 128, 64, 2), (1, 32, 2, 4100, 128, 64, 1),
             (2, 7, 7, 17, 96, 32, 1)] if big else [(1, 5, 3, 3, 64, 64, 1), (2, 7, 7, 5, 96, 32, 2)]
    for B, Hq, Hk, S, D, R, Bc in cases:
        q = rnd(B, S, Hq, D, dtype=dtype, device=device).transpose(1, 2)
        k = rnd(B, Hk, S, D, dtype=dtype, device=device)  # contiguous k, transposed q
        cos, sin = _cos_sin(Bc, S, R, device, dtype, interleaved)
        rq, rk = ref.rotary(f64(q), f64(k), f64(cos), f64(sin), interleaved)
        eq, ek = eager.rotary(q, k, cos, sin, interleaved)
        for v, setv in _variants("rotary", device):
            if setv:
                setv(FAMILY["rotary"], v)
            try:
                poison_allocator(device)
                qo, ko = torch.ops.graphopt.rotary(q, k, cos, sin, interleaved)
                # transposed q: output in its [B, S, H, D] order; contiguous k: contiguous output
                assert qo.transpose(1, 2).is_contiguous() and ko.is_contiguous()
                check(qo, rq, eq, what=f"q {B, Hq, S, D, R} v{v}")
                check(ko, rk, ek, what=f"k {B, Hk, S, D, R} v{v}")
            finally:
                if setv:
                    setv(FAMILY["rotary"], 0)
        # q and k as slices of a merged QKV projection ([B, S, (Hq + 2 Hk) * D], GLM's merged
        # linear): still [B, S, H, D]-ordered outputs, dense
        qkv = rnd(B, S, (Hq + 2 * Hk) * D, dtype=dtype, device=device)
        qs = qkv[..., :Hq * D].view(B, S, Hq, D).transpose(1, 2)
        ks = qkv[..., Hq * D:(Hq + Hk) * D].view(B, S, Hk, D).transpose(1, 2)
        qo, ko = torch.ops.graphopt.rotary(qs, ks, cos, sin, interleaved)
        assert qo.transpose(1, 2).is_contiguous() and ko.transpose(1, 2).is_contiguous()
        rq, rk = ref.rotary(f64(qs), f64(ks), f64(cos), f64(sin), interleaved)
        check(qo, rq, eager.rotary(qs, ks, cos, sin, interleaved)[0], what=f"merged q {B, Hq, S, D, R}")
        check(ko, rk, eager.rotary(qs, ks, cos, sin, interleaved)[1], what=f"merged k {B, Hk, S, D, R}")


# ---------------------------------------------------------------------------- fused_pointwise
def _gelu_prog():
    p = Program()
    a, b, c = p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(a + b) * c, "bf16")
    return p


def test_fast_tanh_source():
    """16-bit outputs on the GPU: tanh through tanh.approx.f32 (inline asm); the portable formula
    otherwise. Both sources are valid Python."""
    p = _gelu_prog()
    args = ((torch.bfloat16,) * 3, 2, False, (True, False, True), True)
    fast = pwt.generate(parse(p.source), *args, fast=True)
    slow = pwt.generate(parse(p.source), *args, fast=False)
    assert "tanh.approx.f32" in fast and "tl.exp" not in fast
    assert "inline_asm" not in slow and "tl.exp" in slow
    compile(fast, "fast", "exec")
    compile(slow, "slow", "exec")


def test_launch_plan_is_cached_per_layout(triton_interpreter):
    p = Program()
    a, b = p.input(), p.input()
    p.output(p.silu(a) * b, "f32")
    x, bias = torch.randn(6, 33), torch.randn(33)
    pwt._plans.clear()
    (o1,) = pwt.fused_pointwise_triton(p.source, [x, bias])
    (o2,) = pwt.fused_pointwise_triton(p.source, [x + 1, bias])  # same layout: the same plan
    assert len(pwt._plans) == 1
    (o3,) = pwt.fused_pointwise_triton(p.source, [x.t().contiguous().t(), bias.view(1, 33)])  # new layout
    assert len(pwt._plans) == 2
    torch.testing.assert_close(o1, F.silu(x) * bias)
    torch.testing.assert_close(o2, F.silu(x + 1) * bias)
    torch.testing.assert_close(o3, F.silu(x) * bias)
    with pytest.raises(ValueError, match="reads 2 inputs"):
        pwt.fused_pointwise_triton(p.source, [x])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pointwise_broadcast_fast_tanh_cuda(dtype):
    """The benchmark's shape class (full-size a, c; a broadcast bias row b) at odd sizes, with the
    hardware tanh for 16-bit outputs, against fp64."""
    p = Program()
    a, b, c = p.input(), p.input(), p.input()
    out_dt = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
    p.output(p.gelu_tanh(a + b) * c, out_dt)
    for rows, cols in [(1, 1), (3, 1023), (257, 4097), (64, 8192)]:
        xa = rnd(rows, cols, dtype=dtype, device="cuda", scale=2)
        xb = rnd(cols, dtype=dtype, device="cuda")
        xc = rnd(rows, cols, dtype=dtype, device="cuda")
        poison_allocator("cuda")
        (o,) = ce.fused_pointwise(p.source, [xa, xb, xc])
        r = F.gelu(f64(xa) + f64(xb), approximate="tanh") * f64(xc)
        e = F.gelu(xa + xb, approximate="tanh") * xc
        check(o, r, e, what=f"{rows}x{cols}")


def test_rank3_broadcast_uses_row_tiles(triton_interpreter):
    """Rank 3 after coalescing with broadcast inputs: [BM, BN] tiles whose row offsets take one
    div/mod per tile row; full-size inputs at the flat index. Short last dims keep the flat walk."""
    p = Program()
    a, b, c = p.input(), p.input(), p.input()
    p.output(p.gelu_tanh(a + b) * c, "f32")
    src = pwt.generate(parse(p.source), (torch.float32,) * 3, 3, False, (True, False, False), tile2d=True)
    assert "BM: tl.constexpr" in src and "o0 = offs" in src and "rem = r\n" in src
    for ins in [[torch.randn(3, 5, 70), torch.randn(3, 1, 70), torch.randn(5, 1)],     # per-batch row, per-s scale
                [torch.randn(2, 3, 4, 130), torch.randn(2, 1, 4, 1), torch.randn(130)],
                [torch.randn(4, 3, 7), torch.randn(4, 1, 7), torch.randn(3, 1)]]:       # last dim 7: flat walk
        pwt._plans.clear()
        (o,) = pwt.fused_pointwise_triton(p.source, ins)
        torch.testing.assert_close(o, F.gelu(ins[0] + ins[1], approximate="tanh") * ins[2], rtol=1e-5, atol=1e-5)
        (plan,) = pwt._plans.values()
        assert plan.spec[5] == (ins[0].shape[-1] >= 64)
