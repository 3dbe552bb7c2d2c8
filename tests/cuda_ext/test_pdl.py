"""Programmatic dependent launch of graphopt's Triton kernels (cuda_ext.norm_triton.pdl): off on the
CPU, under the Triton interpreter and with GRAPHOPT_PDL=0; on the GPU a decode layer's chain of
kernels that each read what the one before wrote (a projection, rotary + cache write, decode
attention, the o projection with its residual add and norm, a sandwich norm), captured into a CUDA
graph with PDL and replayed step after step, gives bit-identical outputs and caches to the same
chain launched without it."""
import pytest
import torch

from graphopt.cuda_ext import norm_triton


def test_off_on_the_cpu_under_the_interpreter_and_when_switched_off(monkeypatch):
    assert norm_triton.pdl(torch.device("cpu")) is False
    assert norm_triton.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert norm_triton.pdl(torch.device("cuda", 0)) is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("GRAPHOPT_PDL", "0")
    assert norm_triton.pdl(torch.device("cuda", 0)) is False


def _chain(seed=0, steps=6):
    """The chain replayed ``steps`` times from one CUDA graph, each step's output the next one's
    input and its position one further: (every step's output, the caches at the end)."""
    B, H, HKV, D, L, E = 1, 8, 2, 64, 256, 512
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    w_qkv, w_o = rnd((H + 2 * HKV) * D, E) / E ** 0.5, rnd(E, H * D) / (H * D) ** 0.5
    nw, w_post, w_next = (1 + 0.1 * rnd(E) for _ in range(3))
    ang = torch.randn(L, D // 2, generator=g, device="cuda")
    cos_t, sin_t = (torch.cat([f(ang), f(ang)], -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    kc, vc = rnd(B, HKV, L, D), rnd(B, HKV, L, D)
    x, res = rnd(B, E), rnd(B, E)
    pos = torch.tensor(100, device="cuda")
    kv_len = torch.tensor([101], device="cuda", dtype=torch.int32)

    def step():
        qkv = torch.nn.functional.linear(x, w_qkv).view(B, 1, H + 2 * HKV, D).transpose(1, 2)
        q, k, v = qkv[:, :H], qkv[:, H:H + HKV], qkv[:, H + HKV:]
        cos, sin = cos_t.index_select(0, pos.view(1))[None], sin_t.index_select(0, pos.view(1))[None]
        q = torch.ops.graphopt.rotary_cache_write(q, k, v, cos, sin, kc, vc, pos, False)
        a = torch.ops.graphopt.decode_attention(q, kc, vc, None, kv_len, D ** -0.5)
        out, h = torch.ops.graphopt.gemv_add_rms_norm(a.transpose(1, 2).reshape(B, H * D), w_o, None, res, nw, 1e-6)
        y, h2 = torch.ops.graphopt.rms_norm_add_rms_norm(out, h, w_post, w_next, 1e-6, 1e-6)
        x.copy_(y)
        res.copy_(h2)
        pos.add_(1)
        kv_len.add_(1)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    state = [t.clone() for t in (kc, vc, x, res, pos, kv_len)]
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    for t, t0 in zip((kc, vc, x, res, pos, kv_len), state):
        t.copy_(t0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    outs = []
    for _ in range(steps):
        graph.replay()
        outs.append(y.clone())
    torch.cuda.synchronize()
    return outs, kc.clone(), vc.clone()


@pytest.mark.cuda
def test_a_decode_chain_replayed_with_pdl_equals_it_without(monkeypatch):
    import graphopt.cuda_ext  # noqa: F401  (registers torch.ops.graphopt)

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs a Hopper or newer GPU")
    monkeypatch.setenv("GRAPHOPT_PDL", "1")
    assert norm_triton.pdl(torch.device("cuda"))
    with_pdl = _chain()
    monkeypatch.setenv("GRAPHOPT_PDL", "0")
    without = _chain()
    for a, b in zip(with_pdl[0] + list(with_pdl[1:]), without[0] + list(without[1:])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(with_pdl[0][0], with_pdl[0][-1])  # the steps moved on


@pytest.mark.cuda
@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_launch_flag_reaches_the_compiled_kernels(monkeypatch, switch):
    """The kernels' own record: each Triton kernel of a GEMV + residual + norm call was compiled and
    launched with ``launch_pdl`` on a Hopper GPU, and without it when switched off (the chain test
    above would pass either way: kernels launched without PDL run one after another)."""
    import triton

    from graphopt.cuda_ext import gemv_triton

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs a Hopper or newer GPU")
    monkeypatch.setenv("GRAPHOPT_PDL", switch)
    seen = []
    run = triton.runtime.JITFunction.run

    def recording(self, *args, **kwargs):
        kernel = run(self, *args, **kwargs)
        seen.append((self.fn.__name__, bool(kernel.metadata.launch_pdl)))
        return kernel

    monkeypatch.setattr(triton.runtime.JITFunction, "run", recording)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    res, nw = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16), torch.rand(512, device="cuda", dtype=torch.bfloat16)
    gemv_triton.gemv_add_rms_norm_triton(x, w, None, res, nw, 1e-6)
    torch.cuda.synchronize()
    assert [name for name, _ in seen] == ["gemv_split_kernel", "gemv_norm_kernel"]
    assert all(flag == (switch == "1") for _, flag in seen)
