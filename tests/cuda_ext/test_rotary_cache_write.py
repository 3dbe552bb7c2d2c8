"""graphopt::rotary_cache_write: the reference is rotary + index_copy_ (float64); the Triton kernel
under Triton's interpreter (fp32/fp16/bf16, both rotary forms, partial rotary, a 0-dim start and
explicit positions, q as a strided slice of a merged projection, positions past the cache) against
the float64 reference, every cache element outside the written rows left as it was; the wrapper's
refusals; fake and opcheck; on the GPU the kernel in bf16 and replayed from a CUDA graph."""
import pytest
import torch

from graphopt import cuda_ext as ops
from graphopt.cuda_ext import rotary_cache_write_triton as rcw
from graphopt.cuda_ext.ops import rotary as rot
from graphopt.cuda_ext.ops import rotary_cache_write as op
from graphopt.errors import KernelArgumentError
from tests.helpers import run_in_triton_interpreter

# B, Hq, Hkv, T, D, Dv, R, L, interleaved, pos kind ("start" 0-dim, "list" [T]), merged (q/k/v slices of one projection)
CASES = [
    (1, 4, 2, 1, 16, 16, 16, 12, False, "start", True),    # a decode step of a merged QKV projection
    (2, 8, 2, 1, 64, 64, 32, 20, True, "start", False),    # GLM: partial interleaved rotary
    (2, 4, 4, 3, 32, 16, 32, 9, False, "list", False),     # 3 positions, v narrower than k
    (1, 2, 1, 5, 24, 24, 8, 7, True, "list", True),        # positions past the cache's end are not written
    (3, 6, 3, 2, 128, 128, 128, 40, False, "start", True),  # Llama's head dim
]


def _inputs(B, H, Hk, T, D, Dv, R, L, inter, kind, merged, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + 31 * B + 7 * T + D)
    if merged:  # [B, T, Hq*D + Hk*D + Hk*Dv] split and viewed as heads, as a merged projection is
        qkv = torch.randn(B, T, H * D + Hk * D + Hk * Dv, generator=g)
        q = qkv[..., :H * D].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., H * D:H * D + Hk * D].view(B, T, Hk, D).transpose(1, 2)
        v = qkv[..., H * D + Hk * D:].view(B, T, Hk, Dv).transpose(1, 2)
    else:
        q, k, v = (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g),
                   torch.randn(B, Hk, T, Dv, generator=g))
    ang = torch.randn(1, T, R // 2, generator=g) * 3
    ang = torch.cat([ang, ang], -1) if not inter else ang.repeat_interleave(2, -1)
    cos, sin = ang.cos(), ang.sin()
    kc, vc = torch.randn(B, Hk, L, D, generator=g), torch.randn(B, Hk, L, Dv, generator=g)
    if kind == "start":
        pos = torch.tensor(int(torch.randint(0, L - T + 1, (), generator=g)))
    else:
        pos = torch.randperm(L + 3, generator=g)[:T]  # distinct positions, some maybe past the end
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return [to(q), to(k), to(v), to(cos), to(sin), to(kc), to(vc), pos.to(device), inter]


def _ref64(args, before):
    """rotary in float64, then the rows written into the caches as they were ``before``, as
    index_copy_ writes them (positions past the end skipped)."""
    q, k, v, cos, sin, _, _, pos, inter = args
    kc, vc = (t.double().clone() for t in before)
    q_out, k_rot = rot.reference(q.double(), k.double(), cos.double(), sin.double(), inter)
    idx = op.positions(pos, k.shape[2])
    for t in range(k.shape[2]):
        if 0 <= int(idx[t]) < kc.shape[2]:
            kc[:, :, int(idx[t])] = k_rot[:, :, t]
            vc[:, :, int(idx[t])] = v.double()[:, :, t]
    return q_out, kc, vc


def _check(args, before, q_out, tol):
    """q_out and the caches args[5], args[6] (written) against the float64 reference from the
    caches ``before`` the call."""
    q_ref, kc_ref, vc_ref = _ref64(args, before)
    assert q_out.dtype == args[0].dtype and q_out.shape == args[0].shape
    assert q_out.stride() == rot.layout(args[0]).stride()
    torch.testing.assert_close(q_out.double(), q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(args[5].double(), kc_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(args[6].double(), vc_ref, rtol=0, atol=0)  # v is copied, not computed


@pytest.mark.parametrize("case", CASES)
def test_reference_is_rotary_then_index_copy(case):
    args = _inputs(*case, torch.float64)
    before = [args[5].clone(), args[6].clone()]
    q_out = op.reference(*args)
    _check(args, before, q_out, 1e-12)
    idx = op.positions(args[7], case[3])
    untouched = [j for j in range(case[7]) if j not in set(idx.tolist())]
    assert torch.equal(args[5][:, :, untouched], before[0][:, :, untouched])


def interpreter_cases():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        for case in CASES:
            args = _inputs(*case, dtype)
            before = [args[5].clone(), args[6].clone()]
            out = rcw.rotary_cache_write_triton(*args[:9], torch.full_like(rot.layout(args[0]), float("nan")))
            _check(args, before, out, tol)
            idx = set(op.positions(args[7], case[3]).tolist())
            untouched = [j for j in range(case[7]) if j not in idx]
            assert torch.equal(args[5][:, :, untouched], before[0][:, :, untouched])
            assert torch.equal(args[6][:, :, untouched], before[1][:, :, untouched])
    print("interpreter cases ok")


def test_kernel_in_interpreter():
    run_in_triton_interpreter("tests.cuda_ext.test_rotary_cache_write:interpreter_cases")


def test_cost_counts_the_rows_written_not_the_caches():
    import torch.fx as fx

    from graphopt.cost.ops import op_call

    args = _inputs(1, 32, 8, 1, 128, 128, 128, 4096, False, "start", False, torch.bfloat16)
    g = fx.Graph()
    nodes = []
    for i, a in enumerate(args[:8]):
        n = g.placeholder(f"a{i}")
        n.meta["val"] = a
        nodes.append(n)
    call = g.call_function(torch.ops.graphopt.rotary_cache_write.default, (*nodes, False))
    call.meta["val"] = rot.layout(args[0])
    c = op.cost(op_call(call), None)
    row = 2 * 128
    assert c.bytes == (32 + 8 + 8) * row * 2 + 2 * 128 * 2 * 1 + 8 and c.launches == 1


@pytest.mark.parametrize("bad,match", [
    (lambda a: {0: a[0][0]}, "must be \\[B, H"),
    (lambda a: {1: a[1].half()}, "differ in batch"),
    (lambda a: {2: a[2][:, :1]}, "v .* must be"),
    (lambda a: {5: a[5][..., :8]}, "k_cache"),
    (lambda a: {6: a[6][:, :, :5]}, "v_cache"),
    (lambda a: {5: a[5].half()}, "the caches"),
    (lambda a: {4: a[4][..., :4]}, "shapes differ"),
    (lambda a: {3: a[3][..., :3], 4: a[4][..., :3]}, "R even"),
    (lambda a: {7: torch.tensor([1.0])}, "pos must be"),
    (lambda a: {7: torch.tensor([1, 2])}, "pos must be"),
])
def test_wrapper_refuses_bad_arguments(bad, match):
    args = _inputs(2, 4, 2, 1, 16, 16, 16, 10, False, "start", False, torch.float32)
    for i, x in bad(args).items():
        args[i] = x
    with pytest.raises(KernelArgumentError, match=match):
        ops.rotary_cache_write(*args)


def test_wrapper_refuses_a_cache_sharing_memory_with_its_source():
    args = _inputs(1, 2, 2, 1, 16, 16, 16, 1, False, "start", False, torch.float32)
    args[5] = args[1]  # k written into itself
    with pytest.raises(KernelArgumentError, match="shares memory"):
        ops.rotary_cache_write(*args)


def test_conformance():
    from kx_conformance import check_op

    check_op("rotary_cache_write", tuple(_inputs(2, 4, 2, 1, 16, 16, 16, 10, False, "start", True, torch.float32)))
    check_op("rotary_cache_write", tuple(_inputs(1, 2, 1, 3, 16, 8, 8, 6, True, "list", False, torch.float32)))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES + [(1, 32, 8, 1, 128, 128, 128, 4352, False, "start", True),
                                          (8, 32, 2, 1, 128, 128, 64, 1100, True, "start", True)])
def test_kernel_on_gpu(case):
    args = _inputs(*case, torch.bfloat16, device="cuda")
    before = [args[5].clone(), args[6].clone()]
    out = ops.rotary_cache_write(*args)
    _check(args, before, out, 2e-2)


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph_follows_the_position():
    args = _inputs(2, 32, 8, 1, 128, 128, 128, 64, False, "start", True, torch.bfloat16, device="cuda")
    q, k, v, cos, sin, kc, vc, pos, inter = args
    f = lambda: torch.ops.graphopt.rotary_cache_write(q, k, v, cos, sin, kc, vc, pos, inter)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    for p in (3, 40, 63):
        pos.fill_(p)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        before = [kc.clone(), vc.clone()]
        g.replay()
        torch.cuda.synchronize()
        _check(args, before, out, 2e-2)
