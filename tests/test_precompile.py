"""graphopt.runtime.precompile: the Triton kernels a graph's first call would compile, compiled
ahead on a thread pool. On the CPU: which nodes it runs, on what fake tensors, and how a launch
becomes a warm-up; on a GPU (cuda): the first call after it compiles nothing."""
import uuid

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

import graphopt.cuda_ext  # noqa: F401  (defines the graphopt ops)
from graphopt.cuda_ext.pointwise import Program
from graphopt.runtime import precompile as pc


def _pointwise_graph(program: str, *vals):
    """A graph calling graphopt::fused_pointwise(program, [x, y]) with ``vals`` as the inputs' values."""
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(len(vals))]
    for x, v in zip(xs, vals):
        x.meta["val"] = v
    call = g.call_function(torch.ops.graphopt.fused_pointwise.default, (program, xs))
    out = g.call_function(lambda t: t[0], (call,))
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)


def _program(scale: float) -> str:
    p = Program()
    x, y = p.input(), p.input()
    p.output(p.relu(x * scale + y), torch.float32)
    return p.source


def test_plan_takes_each_node_signature_once_and_names_what_it_leaves():
    base = torch.empty(1 + 4 * 8, dtype=torch.float32)
    x = base[1:].view(4, 8)  # a view at an offset of 4 bytes: part of the signature
    y = torch.empty(8, dtype=torch.float32)
    seen = []
    impls = {"fused_pointwise": lambda *a: seen.append(a)}
    prog = _program(float(uuid.uuid4().int % 1000) + 0.5)
    todo, left = pc.plan(_pointwise_graph(prog, x, y), impls, device_type="cpu")
    assert len(todo) == 1 and not left
    name, impl, args, _ = todo[0]
    assert args[0] == prog and args[1][0] is x and args[1][1] is y
    # the same signature again (the guard lowers a graph per pass): nothing to do
    assert pc.plan(_pointwise_graph(prog, x, y), impls, device_type="cpu") == ([], {})
    # another alignment is another specialization
    todo2, _ = pc.plan(_pointwise_graph(prog, torch.empty(4, 8), y), impls, device_type="cpu")
    assert len(todo2) == 1
    # an input without a recorded value: left, with the reason
    gm = _pointwise_graph(_program(3.25), x, y)
    next(iter(gm.graph.nodes)).meta.pop("val")
    todo3, left3 = pc.plan(gm, impls, device_type="cpu")
    assert todo3 == [] and "no shapes recorded for x0" in next(iter(left3.values()))
    # tensors on another device: not this pass's business
    assert pc.plan(_pointwise_graph(_program(4.75), x, y), impls, device_type="cuda") == ([], {})


def test_run_on_fakes_keeps_shapes_strides_and_offsets_and_names_a_failure():
    base = torch.zeros(3 + 6 * 5, dtype=torch.bfloat16)
    x = base[3:].view(5, 6).t()  # strided, at an offset
    got = []

    def impl(program, inputs):
        got.append(program)
        for t, like in zip(inputs, (x,)):
            assert isinstance(t, FakeTensor)
            assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == \
                (like.shape, like.stride(), like.storage_offset(), like.dtype)
        return [torch.empty_like(inputs[0])]

    def reads_a_value(program, inputs):
        return inputs[0].sum().item()

    out = pc.Precompiled()
    pc.run_on_fakes([("a", impl, ("p", [x]), {}), ("b", reads_a_value, ("p", [x]), {})], out)
    assert got == ["p"] and out.nodes == 1
    assert list(out.left) == ["b"] and out.left["b"].startswith("DataDependentOutputException")
    assert torch.count_nonzero(base) == 0  # the caller's tensor untouched


def test_warm_launches_turn_a_launch_into_a_warm_up_on_this_thread_only(monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction, MockTensor

    calls = []

    def recorder(self, *args, grid, warmup, **kwargs):
        calls.append((args, grid, warmup, kwargs))
        return "kernel"

    monkeypatch.setattr(JITFunction, "run", recorder)
    t = torch.empty(10, dtype=torch.float16)[3:]  # 6 bytes past an aligned base
    with pc.warm_launches():
        assert JITFunction.run(None, t, 7, grid=(2,), warmup=False, BLOCK=64) == "kernel"
    args, grid, warmup, kwargs = calls[-1]
    assert warmup is True and grid == (2,) and kwargs == {"BLOCK": 64} and args[1] == 7
    assert isinstance(args[0], MockTensor) and args[0].dtype == torch.float16 and args[0].data_ptr() == 6
    aligned = torch.empty(8, dtype=torch.float32)
    with pc.warm_launches():
        JITFunction.run(None, aligned, grid=(1,), warmup=False)
    assert calls[-1][0][0].data_ptr() == 0
    # another thread's context ending (here: a nested one) leaves this one's in place
    with pc.warm_launches():
        with pc.warm_launches():
            pass
        JITFunction.run(None, aligned, grid=(1,), warmup=False)
        assert calls[-1][2] is True
    # outside the context: launches go through unchanged, and the class has its method back
    JITFunction.run(None, aligned, grid=(1,), warmup=False)
    assert calls[-1][2] is False and calls[-1][0][0] is aligned
    assert JITFunction.run is recorder


def test_no_precompilation_without_a_gpu_or_with_no_threads(monkeypatch):
    gm = _pointwise_graph(_program(5.5), torch.empty(2, 2), torch.empty(2))
    monkeypatch.setenv(pc.THREADS_ENV, "0")
    assert pc.threads() == 0 and pc.precompile(gm).note == f"{pc.THREADS_ENV}=0"
    monkeypatch.setenv(pc.THREADS_ENV, "3")
    assert pc.threads() == 3
    if not torch.cuda.is_available():
        assert pc.precompile(gm).note == "no CUDA device"


@pytest.mark.cuda
def test_the_first_call_after_precompile_compiles_nothing():
    from triton import knobs

    from graphopt.runtime.cuda_graphs import lower

    dev = torch.device("cuda")
    x = torch.randn(64, 96, device=dev)
    y = torch.randn(96, device=dev)
    xs = torch.randn(33, 17, device=dev)[1:, 1:]  # another specialization: odd sizes and strides, an offset
    ys = torch.randn(16, device=dev)
    scales = [1.0 + (uuid.uuid4().int % 10**6) / 8.0 for _ in range(2)]  # programs no earlier test compiled
    cases = [(x, y), (xs, ys)]
    gms = [_pointwise_graph(_program(s), a, b) for s, (a, b) in zip(scales, cases)]
    res = [pc.precompile(gm, pool=4) for gm in gms]
    assert [r.nodes for r in res] == [1, 1] and all(r.kernels == 1 for r in res) and not any(r.left for r in res)
    compiled, loaded = [], []

    def hook(*args, **kwargs):
        compiled.append(kwargs.get("fn"))
        return False  # (and compile)

    old = knobs.runtime.jit_cache_hook, knobs.runtime.kernel_load_start_hook
    knobs.runtime.jit_cache_hook = hook
    knobs.runtime.kernel_load_start_hook = lambda *args, **kwargs: loaded.append(args)
    try:
        for gm, s, (a, b) in zip(gms, scales, cases):
            torch.testing.assert_close(gm(a, b), torch.relu(a * s + b))
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.kernel_load_start_hook = old
    # neither compiled nor loaded (its launcher built) at the call: precompile did both
    assert compiled == [] and loaded == []
    # lower() precompiles what it is given (here: already compiled, so nothing to do)
    runner = lower(gms[0], [x, y], cuda_graphs=False)
    assert runner.precompiled is not None and runner.precompiled.kernels == 0


def test_a_kernel_buffer_made_on_fake_tensors_is_not_kept(monkeypatch):
    # the decode attention's split counters are kept for the process: one made while precompile runs a
    # dispatch on fake tensors must not become the buffer later real calls get
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from graphopt.cuda_ext import norm_triton

    monkeypatch.setattr(norm_triton, "_counters", {})
    with FakeTensorMode():
        assert is_fake(norm_triton.split_counters(torch.device("cpu"), 8))
    assert norm_triton._counters == {}
    real = norm_triton.split_counters(torch.device("cpu"), 8)
    assert not is_fake(real) and norm_triton.split_counters(torch.device("cpu"), 8) is real


def test_a_failure_around_the_dispatches_leaves_the_kernels_to_their_first_launches(monkeypatch):
    triton_async = pytest.importorskip("triton.runtime._async_compile")
    from triton.runtime.jit import JITFunction

    class Held:  # the caller holds its own AsyncCompileMode open: Triton refuses a second
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError("Another AsyncCompileMode is already active")

        def __exit__(self, *exc):
            return False

    ran = []
    monkeypatch.setattr(pc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pc, "plan", lambda gm, impls: ([("n", lambda *a: ran.append(a), (), {})], {}))
    monkeypatch.setattr(triton_async, "AsyncCompileMode", Held)
    run = JITFunction.run
    out = pc.precompile(_pointwise_graph(_program(6.5), torch.empty(2, 2), torch.empty(2)), pool=2)
    assert out.note == "not run: RuntimeError: Another AsyncCompileMode is already active"
    assert ran == [] and out.nodes == 0 and JITFunction.run is run
