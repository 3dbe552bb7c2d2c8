import pytest
import torch

from graphopt import accuracy


def test_allclose_passes_and_tolerances():
    ref = torch.randn(100, dtype=torch.float64)
    out = ref.float() + 5e-5
    r = accuracy.check(out, ref, ref.float())
    assert r.passed and r.leaves[0].how == "allclose" and r.leaves[0].tol == 1e-4
    assert accuracy.tolerance(torch.bfloat16) == 1e-2
    assert accuracy.tolerance(torch.float32, training=True) == 1e-3


def test_rmse_fallback_relative_to_eager_error():
    ref = torch.randn(1000, dtype=torch.float64) * 100
    eager = (ref + torch.randn(1000, dtype=torch.float64) * 0.1).float()
    close = (ref + torch.randn(1000, dtype=torch.float64) * 0.12).float()
    far = (ref + torch.randn(1000, dtype=torch.float64) * 1.0).float()
    assert accuracy.check(close, ref, eager).leaves[0].how == "rmse"
    assert not accuracy.check(far, ref, eager).passed


def test_nan_never_passes_and_ints_exact():
    ref = torch.randn(10, dtype=torch.float64)
    bad = ref.float().clone()
    bad[3] = float("nan")
    assert not accuracy.check(bad, ref, bad).passed
    ids = torch.arange(5)
    assert accuracy.check(ids, ids, ids).passed
    assert not accuracy.check(ids + 1, ids, ids).passed


def test_nested_outputs_and_count_mismatch():
    ref = (torch.randn(3, dtype=torch.float64), {"a": torch.randn(2, dtype=torch.float64)})
    out = (ref[0].float(), {"a": ref[1]["a"].float()})
    assert accuracy.check(out, ref, out).passed
    r = accuracy.check((ref[0].float(),), ref, None)
    assert not r.passed and "outputs" in r.reason


def test_matmul_floor_rounds_only_matmul_inputs():
    """The low-precision yardstick: linear/matmul/conv inputs rounded to bf16, arithmetic in fp32,
    everything else (here the add and the exp) untouched."""
    import torch.nn as nn

    from graphopt.accuracy import matmul_floor

    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    ones = torch.ones(8, 8)

    class M(nn.Module):
        def forward(self, t):
            return torch.exp(lin(t) * 0.1) + t[:, :8] @ ones / 3

    got = matmul_floor(M(), (x,), {}, torch.bfloat16)
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    with torch.no_grad():
        exp = torch.exp((r(x) @ r(lin.weight).t() + r(lin.bias)) * 0.1) + r(x[:, :8]) @ r(ones) / 3
        plain = M()(x)
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)
    assert got.dtype == torch.float32
    assert not torch.allclose(got, plain, rtol=1e-6, atol=1e-6)  # the rounding did happen


def _rule_unchunked(out, ref, eager, tol, k):
    """The rule written out on whole float64 tensors (what the chunked pass must equal)."""
    o, r = out.double(), ref.double()
    if torch.isnan(o).any() and not torch.isnan(r).any():
        return False, None, None
    fin = torch.isfinite(r)
    d = (o - r)[fin]
    err = float(torch.sqrt((d * d).mean())) if d.numel() else 0.0
    mx = float(d.abs().max()) if d.numel() else 0.0
    if torch.allclose(o, r, atol=tol, rtol=tol, equal_nan=True):
        return True, err, mx
    e = (eager.double() - r)[fin]
    eager_err = float(torch.sqrt((e * e).mean()))
    return err <= k * eager_err + tol / 10, err, mx


def test_chunked_comparison_equals_the_whole_tensor_rule(monkeypatch):
    monkeypatch.setattr(accuracy, "_CHUNK", 7)  # many chunks, a ragged last one
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 23, dtype=torch.float64, generator=g) * 10
    ref[1, 2] = float("inf")  # a non-finite reference element is left out of rmse and max |err|
    eager = (ref + 0.05 * torch.randn(ref.shape, dtype=torch.float64, generator=g)).float()
    for scale, expect in ((1e-6, True), (0.06, True), (2.0, False)):
        out = (ref + scale * torch.randn(ref.shape, dtype=torch.float64, generator=g)).float()
        leaf = accuracy.check(out, ref, eager).leaves[0]
        passed, err, mx = _rule_unchunked(out, ref, eager, 1e-4, 2.0)
        assert leaf.passed == passed == expect
        assert abs(leaf.rmse - err) <= 1e-9 * max(1.0, err) and abs(leaf.max_abs_err - mx) <= 1e-9 * max(1.0, mx)


def test_a_nan_output_fails_in_any_chunk(monkeypatch):
    monkeypatch.setattr(accuracy, "_CHUNK", 4)
    ref = torch.randn(30, dtype=torch.float64)
    out = ref.float().clone()
    out[29] = float("nan")  # in the last, short chunk
    assert not accuracy.check(out, ref, ref.float()).passed


def test_eager_rmse_cached_across_checks(monkeypatch):
    ref = torch.randn(200, dtype=torch.float64)
    eager = (ref + 0.1 * torch.randn(200, dtype=torch.float64)).float()
    out = (ref + 0.1 * torch.randn(200, dtype=torch.float64)).float()
    cache: dict = {}
    first = accuracy.check(out, ref, eager, cache=cache)
    assert first.leaves[0].how == "rmse" and len(cache) == 1
    calls = []
    real = accuracy._stats
    monkeypatch.setattr(accuracy, "_stats", lambda *a: calls.append(a[0]) or real(*a))
    second = accuracy.check(out, ref, eager, cache=cache)
    assert second.leaves[0].eager_rmse == first.leaves[0].eager_rmse
    assert len(calls) == 1 and calls[0] is out  # the output's pass only; the eager rmse came from the cache


class _WidenedCasts(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made = accuracy.widened_cast(func, args, kwargs, torch.float64)
        return made if made is not None else func(*args, **kwargs)


def _deepcopy_reference(model, args, kwargs):
    """What fp64_reference computed before it stopped copying the model: a float64 copy, whose casts
    to the default dtype (a norm's float32 statistics) are to float64."""
    import copy

    from torch.utils import _pytree as pytree

    ref = copy.deepcopy(model).double()
    a, k = pytree.tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                           (args, kwargs))
    with torch.no_grad(), _WidenedCasts():
        return ref(*a, **k)


@pytest.mark.parametrize("name", ["bert-tiny", "glm4-tiny", "mlp"])
def test_fp64_reference_equals_a_float64_copy_of_the_model(name):
    from graphopt.examples import zoo

    model, inputs = zoo.get(name)
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    args = args if isinstance(args, tuple) else (args,)
    got = accuracy.flatten_outputs(accuracy.fp64_reference(model, args, kwargs))
    want = accuracy.flatten_outputs(_deepcopy_reference(model, args, kwargs))
    assert len(got) == len(want) and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
    assert all(p.dtype != torch.float64 for p in model.parameters())


def test_fp64_reference_holds_one_weight_in_float64_at_a_time_and_leaves_the_model_alone():
    from graphopt.tools.memtrace import MemoryTrace

    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(8)] + [torch.nn.BatchNorm1d(256)]
    model = torch.nn.Sequential(*layers).train()
    x = torch.randn(4, 256)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    with MemoryTrace(record_ops=False) as tr:
        ref = accuracy.fp64_reference(model, (x,), {})
    assert ref.dtype == torch.float64
    weights64 = sum(p.numel() for p in model.parameters()) * 8
    assert tr.peak < weights64 / 3  # a float64 copy of the model would be all of it
    for k, v in model.state_dict().items():  # BatchNorm's running stats and step counter untouched
        assert torch.equal(v, stats[k]), k
    want = _deepcopy_reference(model, (x,), {})
    assert torch.equal(ref, want)


def test_fp64_reference_converts_large_weights_by_blocks(monkeypatch):
    """A projection or embedding over a weight above the block size gives what a float64 copy of
    the model gives, without a float64 copy of that weight."""
    from graphopt.tools.memtrace import MemoryTrace

    torch.manual_seed(0)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 64)
            self.head = torch.nn.Linear(64, 1000)

        def forward(self, ids):
            return self.head(torch.relu(self.embed(ids)))

    model, ids = LM(), torch.randint(0, 1000, (2, 5))
    monkeypatch.setattr(accuracy._Float64State, "CHUNK_BYTES", 64 * 8 * 100)  # blocks of 100 rows
    with MemoryTrace(record_ops=False) as tr:
        ref = accuracy.fp64_reference(model, (ids,), {})
    want = _deepcopy_reference(model, (ids,), {})
    assert ref.dtype == torch.float64 and torch.allclose(ref, want, rtol=1e-12, atol=1e-12)
    assert tr.peak < 1000 * 64 * 8  # never the whole head or embedding in float64


class _LM(torch.nn.Module):
    """An embedding and a projection over weights above the block size (a decoder's ends)."""

    def __init__(self, then=None):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)
        self.head = torch.nn.Linear(64, 1000)
        self.then = then
        self.seen = {}

    def forward(self, ids):
        h = torch.relu(self.embed(ids))
        self.seen.update(weight_dtype=self.head.weight.dtype, weight_shape=tuple(self.head.weight.shape))
        out = self.head(h)
        self.seen.update(out_dtype=out.dtype, out_shape=tuple(out.shape), out_device=out.device)
        return out if self.then is None else self.then(out)


def test_large_outputs_are_written_in_their_narrow_dtype_block_by_block(monkeypatch):
    """A projection whose result has the shape of an output named in narrow_outputs writes it, block by
    block, in that dtype; the model sees the float64 tensor it would have had, metadata included."""
    from graphopt.tools.memtrace import MemoryTrace

    torch.manual_seed(0)
    model, ids = _LM(), torch.randint(0, 1000, (2, 5))
    monkeypatch.setattr(accuracy._Float64State, "CHUNK_BYTES", 64 * 8 * 100)  # blocks of 100 rows
    want = _deepcopy_reference(model, (ids,), {})
    with MemoryTrace(record_ops=False) as tr, torch.no_grad(), \
            accuracy._Float64State(model, narrow_outputs={(2, 5, 1000): torch.float32}):
        out = model(ids.clone())
        seen = dict(model.seen)
    assert out.dtype == torch.float32 and torch.equal(out, want.float())
    assert seen == {"weight_dtype": torch.float64, "weight_shape": (1000, 64), "out_dtype": torch.float64,
                    "out_shape": (2, 5, 1000), "out_device": torch.device("cpu")}
    assert model.seen == {}  # what the run stored in the model's Python-side state is undone on exit
    assert tr.peak < 1000 * 64 * 8 and all(p.dtype == torch.float32 for p in model.parameters())


def test_a_narrowed_output_an_op_reads_comes_back_in_float64_and_its_shape_is_made_wide_again(monkeypatch):
    torch.manual_seed(0)
    model, ids = _LM(then=lambda t: torch.tanh(t / 4) * 4), torch.randint(0, 1000, (2, 5))
    monkeypatch.setattr(accuracy._Float64State, "CHUNK_BYTES", 64 * 8 * 100)
    want = _deepcopy_reference(model, (ids,), {})
    state = accuracy._Float64State(model, narrow_outputs={(2, 5, 1000): torch.float32})
    with torch.no_grad(), state:
        out = model(ids)
    assert out.dtype == torch.float64 and torch.allclose(out, want, rtol=1e-6, atol=1e-6)  # through float32
    assert state.narrow_outputs == {}


def test_fp64_reference_keeps_a_large_low_precision_output_in_float32(monkeypatch):
    """like= and large_bytes: an output whose float64 form is above large_bytes is kept in float32 for a
    bf16 eager output (written so by its projection, or narrowed at the end), float64 for an fp32 one."""
    torch.manual_seed(0)
    model, ids = _LM(), torch.randint(0, 1000, (2, 5))
    monkeypatch.setattr(accuracy._Float64State, "CHUNK_BYTES", 64 * 8 * 100)
    want = _deepcopy_reference(model, (ids,), {})
    with torch.no_grad():
        eager = model(ids)
    ref = accuracy.fp64_reference(model, (ids,), {}, large_bytes=1000, like=eager.bfloat16())
    assert ref.dtype == torch.float32 and torch.equal(ref, want.float())
    ref = accuracy.fp64_reference(model, (ids,), {}, large_bytes=1000, like=eager)
    assert ref.dtype == torch.float64 and torch.allclose(ref, want, rtol=1e-12, atol=1e-12)
    small = torch.nn.Linear(8, 300)  # its weight is not large: the output is narrowed at the end
    x = torch.randn(4, 8)
    ref = accuracy.fp64_reference(small, (x,), {}, large_bytes=1000, like=small(x).half())
    assert ref.dtype == torch.float32 and torch.equal(ref, accuracy.fp64_reference(small, (x,), {}).float())
    assert accuracy.reference_dtype(torch.float16) == torch.float32
    assert accuracy.reference_dtype(torch.float32) == torch.float64


def test_comparison_against_a_reference_on_another_device_or_dtype():
    """The rule gives the same answer from a float32 copy of a bf16 output's reference."""
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(3000, dtype=torch.float64, generator=g)
    eager = (ref + 0.01 * torch.randn(3000, dtype=torch.float64, generator=g)).bfloat16()
    out = (ref + 0.012 * torch.randn(3000, dtype=torch.float64, generator=g)).bfloat16()
    a, b = accuracy.check(out, ref, eager).leaves[0], accuracy.check(out, ref.float(), eager).leaves[0]
    assert a.passed == b.passed and a.how == b.how == "rmse"
    assert abs(a.rmse - b.rmse) < 1e-6 * a.rmse and abs(a.eager_rmse - b.eager_rmse) < 1e-6 * a.eager_rmse


def test_comparison_chunks_stay_a_fraction_of_the_output(monkeypatch):
    from graphopt.tools.memtrace import MemoryTrace

    monkeypatch.setattr(accuracy, "_MIN_CHUNK", 1000)
    ref = torch.randn(400_000, dtype=torch.float64)
    out = ref.float() + 1e-3
    with MemoryTrace(record_ops=False) as tr:
        accuracy.check(out, ref, out)
    assert tr.peak < ref.numel() * 8  # float64 temporaries of an eighth of the output at a time


def test_page_locked_offloads_are_unlocked_once(monkeypatch):
    """The guard's host copies are page-locked in place (cudaHostRegister on zeroed pages) and kept
    until release_host_memory unregisters each once; where registering fails they stay pageable and
    nothing is unregistered."""
    from graphopt import accuracy

    class FakeCudart:
        def __init__(self, err):
            self.err, self.calls = err, []

        def cudaHostRegister(self, ptr, nbytes, flags):
            self.calls.append(("register", ptr, nbytes))
            return self.err

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(accuracy, "_registered", [])
    fake = FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = accuracy._page_locked_empty((3, 5), torch.float32, torch.device("cpu"))
    assert t.device.type == "cpu" and torch.equal(t, torch.zeros(3, 5))
    assert fake.calls == [("register", t.data_ptr(), 60)]
    accuracy.release_host_memory()
    accuracy.release_host_memory()
    assert fake.calls[1:] == [("unregister", t.data_ptr())] and accuracy._registered == []
    failing = FakeCudart(1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: failing)
    accuracy._page_locked_empty((4,), torch.bfloat16, torch.device("cpu"))
    accuracy.release_host_memory()
    assert [c[0] for c in failing.calls] == ["register"]


@pytest.mark.cuda
def test_offloaded_reference_is_page_locked_and_compares_as_on_the_device():
    """A GPU output moved to the host lands in registered (page-locked) memory; the rule's chunked
    statistics from it equal those with both on the device; release_host_memory unlocks it."""
    from graphopt import accuracy

    g = torch.Generator(device="cuda").manual_seed(0)
    ref = torch.randn(3_000_000, device="cuda", generator=g)
    out = (ref + 1e-3 * torch.randn(ref.shape, device="cuda", generator=g)).bfloat16()
    host = accuracy.offload([ref], 0)[0]
    try:
        assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, ref.cpu())
        on_dev = [t.tolist() for t in accuracy._stats(out, ref, 1e-2)]
        from_host = [t.tolist() for t in accuracy._stats(out, host, 1e-2)]
        assert on_dev[1:] == from_host[1:] and abs(on_dev[0][0] - from_host[0][0]) <= 1e-9 * on_dev[0][0]
    finally:
        accuracy.release_host_memory()
    assert accuracy._registered == [] and not host.is_pinned()


def _grouped_cases():
    g = torch.Generator().manual_seed(0)
    ends = torch.tensor([3, 7, 12], dtype=torch.int32)
    k_ends = torch.tensor([4, 8, 12], dtype=torch.int32)
    return [
        (torch.randn(12, 8, generator=g), torch.randn(3, 8, 8, generator=g), ends),      # rows cut into groups
        (torch.randn(3, 4, 8, generator=g), torch.randn(3, 8, 8, generator=g), None),    # batched
        (torch.randn(4, 12, generator=g), torch.randn(12, 8, generator=g), k_ends),      # a shared K cut
        (torch.randn(3, 4, 8, generator=g), torch.randn(8, 12, generator=g), k_ends),    # columns cut
    ]


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm")
def test_grouped_mm_as_plain_matmuls_equals_torchs():
    from graphopt.accuracy import _grouped_mm_plain

    for a, b, offs in _grouped_cases():
        kw = {} if offs is None else {"offs": offs}
        torch.testing.assert_close(_grouped_mm_plain(a, b, offs), torch.nn.functional.grouped_mm(a, b, **kw))


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm")
def test_fp64_reference_runs_a_mixture_of_experts_grouped_mm():
    """grouped_mm has no float64 kernel (transformers' MoE layers call it): the reference runs it as
    per-group float64 matmuls instead of failing the whole accuracy check."""
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 8, 8) / 3)

        def forward(self, x, offs):
            return torch.nn.functional.grouped_mm(x, self.w.transpose(-2, -1), offs=offs)

    m = Experts()
    x, offs = torch.randn(12, 8), torch.tensor([3, 7, 12], dtype=torch.int32)
    with pytest.raises(RuntimeError):  # what the reference met before
        torch.nn.functional.grouped_mm(x.double(), m.w.double().transpose(-2, -1), offs=offs)
    ref = accuracy.fp64_reference(m, (x, offs), {})
    w = m.w.detach().double().transpose(-2, -1)
    want = torch.cat([x[:3].double() @ w[0], x[3:7].double() @ w[1], x[7:].double() @ w[2]])
    assert ref.dtype == torch.float64 and m.w.dtype == torch.float32
    torch.testing.assert_close(ref, want, rtol=1e-12, atol=1e-12)


def test_fp64_reference_makes_the_forwards_default_dtype_tensors_in_float64():
    """A float tensor the forward makes without a dtype is made in float64 in the reference, as when
    float64 is the default: XGLM clamps its scores with torch.full((), torch.finfo(scores.dtype).min),
    which does not fit the float32 default in a float64 run (the reference, and so optimize(), failed);
    factories of integers stay integers."""
    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            s = self.lin(x) + torch.tensor([0.0, 0.5, -0.5, 1.0])
            s = torch.max(s, torch.full((), torch.finfo(s.dtype).min))
            return s * torch.arange(0, 4.0) + torch.arange(4) + torch.ones(4), torch.zeros(2, dtype=torch.int32)

    torch.manual_seed(0)
    m, x = Clamped(), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="overflow"):  # what a plain float64 copy meets
        m.double()(x.double())
    m.float()
    ref, ints = accuracy.fp64_reference(m, (x,), {})
    assert ref.dtype == torch.float64 and ints.dtype == torch.int32
    want = m(x)[0].double()
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    import graphopt

    opt = graphopt.optimize(m, (x,), measure=False)
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"]


def test_fp64_reference_casts_to_the_default_dtype_in_float64():
    """A forward's casts to float32 (an integer grid made a float, RAFT's coordinates; a norm's
    statistics computed in float32, as transformers' RMSNorm does) cast to float64 in the reference:
    a plain float64 copy fails on the first (a float32 input to a float64 convolution) and rounds the
    second to float32; casts to other dtypes stay."""
    class Grid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 3, 1)

        def forward(self, x):
            ys, xs = torch.meshgrid(torch.arange(4), torch.arange(5), indexing="ij")
            grid = torch.stack([ys, xs]).float()[None].expand(x.shape[0], -1, -1, -1)
            h = self.conv(x) + self.conv(grid)
            var = h.to(torch.float32).pow(2).mean(1, keepdim=True)
            return (h * torch.rsqrt(var + 1e-6)).to(h.dtype), h.to(torch.int64), h.to(dtype=torch.float16)

    torch.manual_seed(0)
    m, x = Grid(), torch.randn(2, 2, 4, 5)
    with pytest.raises(RuntimeError, match="type"):  # what a plain float64 copy meets
        Grid().double()(x.double())
    ref, ints, half = accuracy.fp64_reference(m, (x,), {})
    assert ref.dtype == torch.float64 and ints.dtype == torch.int64 and half.dtype == torch.float16
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(5), indexing="ij")
    w, b = m.conv.weight.double(), m.conv.bias.double()
    grid = torch.stack([ys, xs]).double()[None].expand(2, -1, -1, -1)
    h = torch.nn.functional.conv2d(x.double(), w, b) + torch.nn.functional.conv2d(grid, w, b)
    torch.testing.assert_close(ref, h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6), rtol=1e-12, atol=1e-12)
    import graphopt

    opt = graphopt.optimize(m, (x,), measure=False)
    assert opt.report.accuracy["checked"] and opt.report.accuracy["passed"]
