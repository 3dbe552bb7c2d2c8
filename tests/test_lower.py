"""graphopt.runtime.cuda_graphs: the CUDA-graph runner.

On the CPU: the runner falls back cleanly, the on/off decision says why, and the cache/guard/
aliasing logic runs against the emulated backend (capture = run once and keep the outputs as the
static outputs; replay = run again into those same tensors). The real CUDA path is marked cuda.
"""

import dataclasses
import warnings

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

import graphopt
from graphopt import GraphoptError, accuracy
from graphopt.capture import capture
from graphopt.cost.profiles import get_profile
from graphopt.examples import zoo
from graphopt.runtime.cuda_graphs import Decision, Runner, decide, launch_savings_s, lower


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _gm(model, *inputs, **kw):
    return capture(model.eval(), tuple(inputs), **kw)


def _same(a, b, tol=1e-6):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert torch.allclose(x.double(), y.double(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------- decisions


def test_cpu_runner_falls_back_with_same_outputs():
    model = Small()
    x = torch.randn(3, 8)
    gm = _gm(model, x)
    runner = lower(gm, [x])
    assert not runner.decision.on
    assert runner.decision.note() == "CUDA graph: off (the model runs on the CPU)"
    with torch.no_grad():
        _same(runner(x), model(x))
        x2 = torch.randn(3, 8)
        _same(runner(x2), model(x2))
    assert runner.stats["eager_calls"] >= 1 and runner.stats["captures"] == 0 and runner.num_graphs == 0


def test_decide_off_when_disabled():
    x = torch.randn(2, 8)
    d = decide(_gm(Small(), x), [x], cuda_graphs=False, device_type="cpu")
    assert not d.on and "disabled" in d.why


def test_decide_on_for_static_inference_graph():
    x = torch.randn(2, 8)
    d = decide(_gm(Small(), x), [x], device_type="cpu")
    assert d.on and "static shapes" in d.why and d.device == torch.device("cpu")


def test_decide_off_for_random_ops():
    class Drop(nn.Module):
        def forward(self, x):
            return torch.rand_like(x) * x

    x = torch.randn(2, 8)
    d = decide(_gm(Drop(), x), [x], device_type="cpu")
    assert not d.on and "random op" in d.why and "rand_like" in d.why


def test_eval_dropout_is_not_random():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).eval()
    x = torch.randn(2, 8)
    assert decide(_gm(model, x), [x], device_type="cpu").on


def test_decide_off_for_host_sync_ops():
    g = fx.Graph()
    xn = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.nonzero.default, (xn,)))
    gm = fx.GraphModule(nn.Module(), g)
    x = torch.randn(4, 4)
    d = decide(gm, [x], device_type="cpu")
    assert not d.on and "nonzero" in d.why


def test_repeat_interleave_with_int_repeats_is_static():
    # GLM's rotary tables: repeat_interleave(t, 2, dim=-1) has a static size; Tensor repeats do not
    g = fx.Graph()
    xn = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.repeat_interleave.self_int, (xn, 2, -1)))
    x = torch.randn(4, 4)
    assert decide(fx.GraphModule(nn.Module(), g), [x], device_type="cpu").on
    g2 = fx.Graph()
    rn = g2.placeholder("r")
    g2.output(g2.call_function(torch.ops.aten.repeat_interleave.Tensor, (rn,)))
    d = decide(fx.GraphModule(nn.Module(), g2), [torch.tensor([1, 2])], device_type="cpu")
    assert not d.on and "repeat_interleave" in d.why


def test_histc_with_a_range_is_replayed():
    # an MoE router's tokens per expert: histc(ids, bins, min, max) bins on the device; with no
    # range (min == max, the default) torch reads the data's min and max back to the host first
    def histc_graph(*args):
        g = fx.Graph()
        xn = g.placeholder("x")
        g.output(g.call_function(torch.ops.aten.histc.default, (xn, *args)))
        return fx.GraphModule(nn.Module(), g)

    x = torch.tensor([0.0, 3.0, 3.0, 7.0])
    assert decide(histc_graph(8, 0, 7), [x], device_type="cpu").on
    for args in [(8,), (8, 0, 0), (8, 2.0, 2.0)]:
        d = decide(histc_graph(*args), [x], device_type="cpu")
        assert not d.on and "histc" in d.why, args


def _writes_input():
    """x -> x.add_(1) (returned) and x * 2 (read after the write): a graph that writes its input."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    y = g.call_function(torch.ops.aten.add_.Tensor, (x, 1.0))
    z = g.call_function(torch.ops.aten.mul.Tensor, (y, w))
    g.output((y, z))
    return fx.GraphModule(nn.Module(), g)


def test_decide_on_for_input_mutation_binds_the_written_input():
    gm = _writes_input()
    d = decide(gm, [torch.randn(3), torch.randn(3)], device_type="cpu")
    assert d.on and "bound by address" in d.why


def test_replay_writes_the_callers_tensor_once_per_call_and_hands_it_back():
    """The written input is bound: no static copy in or out, the warm-up is the first call itself
    (run once), later calls replay; the output that is the input comes back as the caller's
    tensor; another tensor there captures another graph."""
    gm = _writes_input()
    x, w = torch.zeros(3), torch.full((3,), 2.0)
    runner = lower(gm, [x, w], backend="emulate")
    assert runner.bound_inputs == {0}
    for step in range(1, 4):
        y, z = runner(x, w)
        assert y is x and torch.equal(x, torch.full((3,), float(step)))  # written once per call
        assert torch.equal(z, 2.0 * step * torch.ones(3))
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 2 and runner.stats["eager_calls"] == 1
    other = torch.zeros(3)
    y, _ = runner(other, w)
    assert y is other and torch.equal(other, torch.ones(3)) and torch.equal(x, torch.full((3,), 3.0))
    assert runner.stats["captures"] == 2


def test_bind_inputs_reads_every_input_in_place():
    gm = _writes_input()
    x, w = torch.zeros(3), torch.full((3,), 2.0)
    runner = lower(gm, [x, w], backend="emulate", bind_inputs=True)
    runner(x, w)
    runner(x, w)
    w.fill_(3.0)  # read where it is: no copy into a static buffer
    _, z = runner(x, w)
    assert torch.equal(z, 9.0 * torch.ones(3)) and runner.stats["captures"] == 1


def test_decide_dynamic_needs_force_and_training_replays_both_passes():
    x = torch.randn(4, 8)
    gm = _gm(Small(), x, dynamic={"x": {0: "batch"}})
    d = decide(gm, [x], device_type="cpu")
    assert not d.on and "dynamic shapes" in d.why
    assert decide(gm, [x], cuda_graphs=True, device_type="cpu").on
    gm2 = _gm(Small(), x)
    d = decide(gm2, [x], training=True, device_type="cpu")
    assert d.on and d.training and "forward and backward" in d.why
    assert not decide(gm2, [x], device_type="cpu").training


def test_decide_off_for_mixed_devices():
    x = torch.randn(2, 8)
    gm = _gm(Small(), x)
    d = decide(gm, [x.to("meta")], device_type="meta")
    assert not d.on and "mixed" in d.why


def test_decide_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    x = torch.randn(2, 8)
    d = decide(_gm(Small(), x), [x], device_type="cuda")
    assert not d.on and "CPU" in d.why


def test_bad_mode_and_backend():
    x = torch.randn(2, 8)
    gm = _gm(Small(), x)
    with pytest.raises(GraphoptError, match="cuda_graphs must be"):  # (set_cuda_graphs's too: one line)
        lower(gm, [x], cuda_graphs="sometimes")
    with pytest.raises(ValueError):
        lower(gm, [x], backend="tpu")
    with pytest.raises(ValueError):
        Runner(gm, decide(gm, [x], device_type="cpu"), max_graphs=0, backend="emulate")


def test_launch_savings_uses_profile_field():
    prof, _ = get_profile("h200")
    assert 0 < prof.launch_overhead_graph_s < prof.launch_overhead_s  # measured: 1.06 us vs 7.6 us
    assert launch_savings_s(100, prof) == pytest.approx(100 * (prof.launch_overhead_s - prof.launch_overhead_graph_s))
    assert launch_savings_s(0, prof) == 0.0


def test_optimized_module_reports_the_decision():
    model, inputs = zoo.get("mlp")
    opt = graphopt.optimize(model, inputs)
    notes = [n for n in opt.report.notes if n.startswith("CUDA graph:")]
    assert notes == ["CUDA graph: off (the model runs on the CPU)"]
    opt.set_cuda_graphs(False)
    notes = [n for n in opt.report.notes if n.startswith("CUDA graph:")]
    assert notes == ["CUDA graph: off (disabled (cuda_graphs=False))"]
    with torch.no_grad():
        _same(opt(*inputs), model(*inputs), tol=1e-5)


# ---------------------------------------------------------------------------------- emulated replay


def _emulated(model, x, **kw):
    gm = _gm(model, x)
    return lower(gm, [x], backend="emulate", **kw)


def test_emulated_replay_equals_eager_and_uses_the_cache():
    model = Small().eval()
    x = torch.randn(3, 8)
    runner = _emulated(model, x)
    assert runner.decision.on
    with torch.no_grad():
        for _ in range(3):
            xi = torch.randn(3, 8)
            _same(runner(xi), model(xi))
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 3 and runner.num_graphs == 1


def test_new_shape_recaptures_and_lru_evicts():
    model = Small().eval()
    x = torch.randn(1, 8)
    gm = capture(model, (x,), strategy="symbolic_trace")  # shape-generic graph
    runner = lower(gm, [x], backend="emulate", max_graphs=2)
    with torch.no_grad():
        for b in (1, 2):
            xi = torch.randn(b, 8)
            _same(runner(xi), model(xi))
        assert runner.num_graphs == 2 and runner.stats["captures"] == 2
        runner(torch.randn(1, 8))  # hit: 1 becomes most recent
        assert runner.stats["captures"] == 2
        xi = torch.randn(3, 8)
        _same(runner(xi), model(xi))  # evicts 2 (least recently used)
        assert runner.num_graphs == 2 and runner.stats["evictions"] == 1
        runner(torch.randn(1, 8))
        assert runner.stats["captures"] == 3
        runner(torch.randn(2, 8))  # was evicted: captured again
        assert runner.stats["captures"] == 4


def test_outputs_do_not_alias_across_calls_by_default():
    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x)
    with torch.no_grad():
        a_in, b_in = torch.randn(2, 8), torch.randn(2, 8)
        a = runner(a_in)
        a_copy = a.clone()
        b = runner(b_in)
    assert torch.equal(a, a_copy), "the first output changed when the graph was replayed again"
    assert a.data_ptr() != b.data_ptr()


def test_reuse_outputs_returns_the_static_buffers():
    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x, reuse_outputs=True)
    with torch.no_grad():
        a = runner(torch.randn(2, 8))
        b = runner(torch.randn(2, 8))
    assert a.data_ptr() == b.data_ptr()  # the documented trade: valid until the next call


def test_inputs_are_copied_into_static_buffers():
    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x)
    with torch.no_grad():
        runner(x)
        entry = next(iter(runner._graphs.values()))
        buf = entry.static_inputs[0]
        assert buf.data_ptr() != x.data_ptr()
        y = torch.randn(2, 8).t().contiguous().t()  # another layout, same shape
        _same(runner(y), model(y))
        assert torch.equal(buf, y)


def test_grad_enabled_call_runs_eagerly_with_one_warning():
    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out1 = runner(x)
        out2 = runner(x)
    assert out1.requires_grad and out2.requires_grad  # autograd history kept
    assert sum("grad-enabled" in str(m.message) for m in w) == 1
    assert runner.stats["captures"] == 0 and runner.stats["eager_calls"] == 2
    for p in model.parameters():
        p.requires_grad_(False)
    runner2 = _emulated(model, x)
    _same(runner2(x), model(x))  # grad mode on but nothing requires grad: replay is fine
    assert runner2.stats["captures"] == 1


def test_inference_mode_calls():
    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x)
    with torch.inference_mode():
        a = runner(x)
        b = runner(torch.randn(2, 8))
    with torch.no_grad():  # static buffers were made outside inference mode: still writable
        c = runner(x)
    _same(a, c)
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 3
    assert not torch.equal(a, b)


def test_input_on_another_device_falls_back():
    model = Small().eval()
    x = torch.randn(2, 8)
    gm = _gm(model, x)
    decision = dataclasses.replace(decide(gm, [x], device_type="cpu"), device=torch.device("meta"))
    runner = Runner(gm, decision, backend="emulate")
    with warnings.catch_warnings(record=True) as w, torch.no_grad():
        warnings.simplefilter("always")
        _same(runner(x), model(x))
    assert any("is on cpu" in str(m.message) for m in w)
    assert runner.stats["captures"] == 0


def test_capture_failure_disables_and_stays_correct():
    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x)

    def boom(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner._backend.capture = boom
    with warnings.catch_warnings(record=True) as w, torch.no_grad():
        warnings.simplefilter("always")
        _same(runner(x), model(x))
        _same(runner(x), model(x))
    assert not runner.active and "capture failed" in runner._disabled
    assert sum("capture failed" in str(m.message) for m in w) == 1


def test_kwargs_and_non_tensor_inputs_are_part_of_the_key():
    class Scale(nn.Module):
        def forward(self, x, k: int = 2, y=None):
            return x * k + (0 if y is None else y)

    x = torch.randn(3)
    runner = Runner(Scale(), Decision(True, "test", "on", torch.device("cpu")), backend="emulate")
    with torch.no_grad():
        _same(runner(x), x * 2)
        y = torch.randn(3)
        _same(runner(x, y=y), x * 2 + y)
        _same(runner(x, 3), x * 3)
        _same(runner(x, 3), x * 3)
    assert runner.num_graphs == 3 and runner.stats["replays"] == 4
    with torch.no_grad():
        _same(runner(x, 2), x * 2)


def test_deepcopy_and_reset_drop_graphs():
    import copy

    model = Small().eval()
    x = torch.randn(2, 8)
    runner = _emulated(model, x)
    with torch.no_grad():
        runner(x)
    assert runner.num_graphs == 1
    clone = copy.deepcopy(runner)
    assert clone.num_graphs == 0 and clone.decision == runner.decision and clone.gm is not runner.gm
    runner.reset()
    assert runner.num_graphs == 0


# ---------------------------------------------------------------------------------- CUDA


def _check_rule(out, model, args, kwargs=None):
    kwargs = kwargs or {}
    with torch.no_grad():
        eager = model(*args, **kwargs)
    ref64 = accuracy.fp64_reference(model, tuple(args), kwargs)
    res = accuracy.check(out, ref64, eager)
    assert res.passed, res.reason


@pytest.mark.cuda
@pytest.mark.parametrize("name,batch,dtype", [("resnet50", 2, torch.float32), ("resnet50", 2, torch.bfloat16),
                                              ("glm4-tiny", 2, torch.float32), ("bert-tiny", 2, torch.float32)])
def test_cuda_replay_equals_eager(name, batch, dtype):
    model, inputs = zoo.get(name, batch=batch, dtype=dtype, device="cuda")
    # fp32 stays fp32 here (precision="auto" may lower it to bf16 on the GPU): this test is about
    # replay being exact, judged by the model's own dtype
    opt = graphopt.optimize(model, inputs, precision="fp32")
    assert opt.runner.decision.on, opt.runner.decision.why
    assert any(n.startswith("CUDA graph: on") for n in opt.report.notes)
    with torch.no_grad():
        outs = [opt(*inputs) for _ in range(3)]
    assert opt.runner.stats["captures"] == 1 and opt.runner.stats["replays"] == 3
    for out in outs:
        _check_rule(out, model, inputs)
    with torch.inference_mode():
        _check_rule(opt(*inputs), model, inputs)


@pytest.mark.cuda
def test_cuda_new_shape_recaptures_and_lru():
    model = Small().cuda().eval()
    x = torch.randn(1, 8, device="cuda")
    gm = capture(model, (x,), strategy="symbolic_trace")
    runner = lower(gm, [x], max_graphs=2)
    assert runner.decision.on
    with torch.no_grad():
        for b in (1, 2, 1, 3, 2):
            xi = torch.randn(b, 8, device="cuda")
            _same(runner(xi), model(xi), tol=1e-5)
    assert runner.stats["captures"] == 4 and runner.stats["evictions"] == 2 and runner.num_graphs == 2


@pytest.mark.cuda
def test_cuda_outputs_do_not_alias_by_default():
    model, inputs = zoo.get("glm4-tiny", batch=2, device="cuda")
    opt = graphopt.optimize(model, inputs)
    other = (torch.randint(3, 256, inputs[0].shape, device="cuda"),)
    with torch.no_grad():
        a = opt(*inputs)
        a_logits = a.logits.clone()
        b = opt(*other)
        torch.cuda.synchronize()
    assert torch.equal(a.logits, a_logits)
    assert a.logits.data_ptr() != b.logits.data_ptr()
    opt.set_cuda_graphs("auto", reuse_outputs=True)
    with torch.no_grad():
        c = opt(*inputs)
        d = opt(*other)
    assert c.logits.data_ptr() == d.logits.data_ptr()


@pytest.mark.cuda
def test_cuda_to_resets_and_grad_falls_back():
    model, inputs = zoo.get("resnet50", batch=1, device="cuda")
    # fp32 and no folding: the graph reads the model's own parameters, which require grad
    opt = graphopt.optimize(model, inputs, precision="fp32", passes=["eliminate_dead_code"])
    with torch.no_grad():
        opt(*inputs)
    assert opt.runner.num_graphs == 1
    opt.to("cuda")
    assert opt.runner.num_graphs == 0
    with pytest.warns(RuntimeWarning, match="grad-enabled"):
        out = opt(*inputs)
    assert out.requires_grad


@pytest.mark.cuda
def test_cuda_graphs_off_for_cpu_tensors_in_graph():
    class CpuIdx(nn.Module):
        def forward(self, x):
            return x * torch.arange(x.shape[-1]).to(x.device)

    x = torch.randn(2, 4, device="cuda")
    gm = capture(CpuIdx(), (x,))
    d = decide(gm, [x])
    assert not d.on and "cpu" in d.why


@pytest.mark.cuda
def test_cuda_graphs_off_when_cloning_outputs_costs_more_than_launches_save():
    class Big(nn.Module):
        def forward(self, x):
            return (x * 2).expand(64, -1, -1).contiguous()  # 2 kernels, a 256 MB output

    x = torch.randn(1024, 1024, device="cuda")
    opt = graphopt.optimize(Big(), (x,), check_accuracy=False)
    assert not opt.runner.decision.on
    assert any("to clone" in n for n in opt.report.notes)
    opt.set_cuda_graphs(True, reuse_outputs=True)
    assert opt.runner.decision.on


@pytest.mark.cuda
def test_ranged_histc_replays_on_the_device():
    """An MoE router's histc(ids, bins, min, max) captures in a CUDA graph (no host read-back) and
    each replay counts the tokens of its own call's input."""

    class Router(nn.Module):
        def forward(self, logits):
            ids = logits.topk(2, dim=-1).indices.reshape(-1).sort().values
            counts = torch.histc(ids.float(), bins=8, min=0, max=7)
            return counts.cumsum(0, dtype=torch.int32), ids

    x = torch.randn(64, 8, device="cuda")
    gm = capture(Router(), (x,))
    runner = lower(gm, [x], cuda_graphs=True)
    assert runner.decision.on, runner.decision.why
    for seed in range(4):
        y = torch.randn(64, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        offs, ids = runner(y)
        want = torch.bincount(ids.cpu(), minlength=8).cumsum(0).to(torch.int32)
        assert torch.equal(offs.cpu(), want) and torch.equal(ids, Router()(y)[1])
    assert runner.stats["replays"] >= 2


def test_sdpa_without_dropout_is_not_random():
    """SDPA is tagged nondeterministic_seeded for its dropout; with dropout_p = 0 it draws nothing,
    so it must not keep a graph from CUDA-graph replay (nor from constant folding or the guard)."""
    import torch.nn.functional as F

    from graphopt import ir

    class Attn(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)

    q = torch.randn(1, 2, 4, 8)
    for p, random in ((0.0, False), (0.1, True)):
        gm = capture(Attn(p).eval(), (q, q, q))
        sd = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot" in str(n.target)]
        assert sd and all(ir.is_random(n) == random for n in sd), (p, [n.args for n in sd])


# ---------------------------------------------------------------------------------- outputs made after the replay


class Head(nn.Module):
    """A language-model head: a small trunk, then a wide projection whose output is returned
    (the logits), plus a small second output."""

    def __init__(self, vocab=300):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.lm = nn.Linear(16, vocab, bias=False)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return {"logits": self.lm(h), "pooled": h.mean(1)}


def test_a_big_output_is_made_after_the_replay_not_cloned():
    from graphopt.runtime.cuda_graphs import tail_nodes

    model, x = Head().eval(), torch.randn(4, 8)
    runner = _emulated(model, x, tail_min_bytes=4 * 300 * 4)  # the logits qualify, the pooled output does not
    (node,) = tail_nodes(runner.gm, 4 * 300 * 4)
    assert node.meta["val"].shape == (4, 300)
    assert runner.tail is not None and runner.tail.nodes == [node] and runner.tail.keep == [1]
    with torch.no_grad():
        first_in = torch.randn(4, 8)
        a = runner(first_in)
        a_logits = a["logits"].clone()
        b = runner(torch.randn(4, 8))
        _same(a, model(first_in))
        assert torch.equal(a["logits"], a_logits)  # kept by the caller, not overwritten by the next replay
        assert a["logits"].data_ptr() != b["logits"].data_ptr()
        entry = next(iter(runner._graphs.values()))
        # the graph's static outputs: the pooled output, then the tail's inputs (h and the weight)
        assert len(entry.out_leaves) == 3 and entry.out_leaves[2] is model.lm.weight
        assert all(o.data_ptr() != a["logits"].data_ptr() for o in entry.out_leaves)
    assert runner.stats["replays"] == 2
    split = runner.tail
    runner.reset()  # after parameters moved: the split's head holds the constants it was built with
    assert runner.tail is not split and runner.tail.nodes == [node]


def test_small_outputs_views_and_reused_outputs_stay_in_the_graph():
    from graphopt.runtime.cuda_graphs import tail_nodes

    model, x = Head().eval(), torch.randn(4, 8)
    assert _emulated(model, x).tail is None  # 4.8 KB of logits: under TAIL_MIN_BYTES, cloned
    assert _emulated(model, x, tail_min_bytes=1, reuse_outputs=True).tail is None

    class ViewOut(nn.Module):  # the output is a view of an op's result: the op stays in the graph
        def forward(self, x):
            return (x * 2).reshape(-1)

    gm = _gm(ViewOut(), x)
    assert [n.target for n in tail_nodes(gm, 1)] == []

    class Reread(nn.Module):  # the big op's output is read again by another output
        def forward(self, x):
            y = x @ x.t()
            return y, y.sum()

    assert [str(n.target) for n in tail_nodes(_gm(Reread(), x), 1)] == ["aten.sum.default"]  # not the product


def test_graphed_cost_counts_the_tail_as_an_eager_kernel_not_a_clone():
    """Planned for the H200 on this CPU: the cost model's graphed time counts the tail as an
    eager kernel, not a clone (the GLM-4 logits case, scaled down)."""
    from graphopt.cost.model import CostModel
    from graphopt.runtime.cuda_graphs import tail_nodes

    model, x = Head(vocab=1 << 20).eval(), torch.randn(4, 8)  # 16 MiB of fp32 logits
    gm = _gm(model, x)
    (node,) = tail_nodes(gm)
    p, _ = get_profile("h200")
    cm = CostModel(p)
    graphed = cm.execution_cost(gm, mode="graphed").total_s
    reuse = cm.execution_cost(gm, mode="graphed", reuse_outputs=True).total_s
    clone_s = p.gpu_seconds(0.0, 2 * (4 << 22) / p.bandwidth)
    assert graphed < reuse + clone_s  # the 16 MiB clone is not charged
    assert graphed > reuse  # the eager launch of the projection is


@pytest.mark.cuda
def test_cuda_logits_made_after_the_replay():
    """A real CUDA graph with its wide projection left outside: same results as eager, the
    caller's logits survive the next call, and the report says how the outputs come out."""
    model = Head(vocab=1 << 16).cuda().eval()  # 4 x 65536 fp32 logits: 1 MiB
    x = torch.randn(4, 8, device="cuda")
    gm = capture(model, (x,))
    runner = lower(gm, [x], tail_min_bytes=1 << 20)
    assert runner.decision.on and runner.tail is not None
    with torch.no_grad():
        xa, xb = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
        a = runner(xa)
        keep = a["logits"].clone()
        b = runner(xb)
        torch.cuda.synchronize()
        _same(a, model(xa), tol=1e-5)
        _same(b, model(xb), tol=1e-5)
    assert torch.equal(a["logits"], keep) and runner.stats["captures"] == 1
