"""graphopt.runtime.training_graphs: a training step's forward and backward replayed as captured
graphs. On the CPU against the emulated backend (a replay re-runs the captured function into the
same static tensors): gradients and outputs equal to the graph run eagerly over several steps,
with gradients zeroed in place, set to None or accumulated; the fallbacks (two forwards before a
backward, autocast, a graph that writes a buffer, regions under torch.utils.checkpoint), AOT checkpoint
regions replayed with the step when forced; the real CUDA capture is
marked cuda."""

import copy
import warnings

import pytest
import torch
from torch import nn

from graphopt.capture import capture
from graphopt.runtime.cuda_graphs import decide, lower


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(2, 2)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        return self.b(h) * y, h.sum(-1)


def _step(fn, params, x, y, zero):
    if zero == "in_place":
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
    elif zero == "none":
        for p in params:
            p.grad = None
    o1, o2 = fn(x, y)
    (o1.square().sum() + o2.sum()).backward()
    return o1.detach().clone(), o2.detach().clone()


def _pair():
    torch.manual_seed(0)
    m = TwoOut()
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    gm = capture(m, (x, y))
    ref = copy.deepcopy(gm)
    return gm, ref, lower(gm, [x, y], training=True, backend="emulate")


@pytest.mark.parametrize("zero", ["in_place", "none", "accumulate"])
def test_replayed_steps_match_eager(zero):
    gm, ref, runner = _pair()
    assert runner.decision.on and runner.decision.training
    for it in range(4):
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        how = "skip" if zero == "accumulate" and it % 2 else ("in_place" if zero == "accumulate" else zero)
        ours = _step(runner, list(gm.parameters()), x, y, how)
        theirs = _step(ref, list(ref.parameters()), x, y, how)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for (n, p), q in zip(gm.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None, n
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)
    t = runner._train
    assert t.stats["captures"] == 1 and t.stats["replays"] == 8 and runner.stats["eager_calls"] == 0
    # a gradient autograd accumulated is never the static buffer the next replay writes
    static = {g.data_ptr() for g in t.steps[next(iter(t.steps))].static_grads if g is not None}
    assert not any(p.grad is not None and p.grad.data_ptr() in static for p in gm.parameters())


def test_input_that_requires_grad_gets_its_gradient():
    gm, ref, runner = _pair()
    for _ in range(2):
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        _step(runner, list(gm.parameters()), xa, y, "none")
        _step(ref, list(ref.parameters()), xb, y, "none")
        torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=1e-6)


def test_two_forwards_before_a_backward_run_eagerly():
    gm, ref, runner = _pair()
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    first = runner(x, y)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        second = runner(2 * x, y)
    assert any("backward has not run" in str(m.message) for m in w)
    (first[0].sum() + second[0].sum()).backward()
    ref(x, y)[0].sum().backward()
    ref(2 * x, y)[0].sum().backward()
    for p, q in zip(gm.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)
    del first, second
    out = runner(x, y)  # the forward's node freed without a backward: replays again
    assert runner._train.stats["replays"] == 3 and out[0].requires_grad  # forward, its backward, forward


def test_autocast_runs_eagerly():
    gm, ref, runner = _pair()
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as w, torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        runner(x, y)
    assert any("autocast" in str(m.message) for m in w) and runner._train.stats["captures"] == 0


def _checkpointed(backend: str, budget: float = 0.6):
    import graphopt

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]).train()
    x = torch.randn(512, 256)
    gm = graphopt.optimize(m, (x,), training=True, memory_budget=budget, check_accuracy=False,
                           checkpoint_backend=backend, cuda_graphs=False).graph_module
    assert sum(n.op == "call_module" and not n.target.startswith("_guards") for n in gm.graph.nodes) >= 2
    return gm, x


def test_training_graphs_off_for_buffer_writes_and_torch_checkpoint_regions():
    bn = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    x = torch.randn(4, 8)
    d = decide(capture(bn, (x,)), [x], training=True, device_type="cpu")
    assert not d.on and "in place" in d.why
    gm, x = _checkpointed("sac", 0.75)  # regions under torch.utils.checkpoint: recomputed from Python hooks
    d = decide(gm, [x], training=True, device_type="cpu")
    assert not d.on and "torch.utils.checkpoint" in d.why


def _same_steps(runner, gm, ref, device: str, tol: float) -> None:
    """Three steps on new inputs: the runner's outputs and gradients equal to ``ref``'s (the graph run eagerly)."""
    for _ in range(3):
        xs = torch.randn(512, 256, device=device)
        outs = []
        for fn, params in ((runner, list(gm.parameters())), (ref, list(ref.parameters()))):
            for p in params:
                p.grad = None
            out = fn(xs)
            out.square().mean().backward()
            outs.append([out.detach()] + [p.grad for p in params])
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_aot_checkpoint_regions_are_replayed_when_forced_and_match_eager():
    """A step whose regions are AOT-compiled (a forward graph, a backward graph that recomputes) runs
    eagerly by default (its memory budget first); forced, it is captured whole: outputs and gradients
    equal to the same graph run eagerly, step after step."""
    gm, x = _checkpointed("aot")
    d = decide(gm, [x], training=True, device_type="cpu")  # by default the memory budget comes first
    assert not d.on and "memory budget comes first" in d.why and "cuda_graphs=True" in d.why
    ref = copy.deepcopy(gm)
    runner = lower(gm, [x], training=True, backend="emulate", cuda_graphs=True)
    assert runner.decision.on and runner.decision.training, runner.decision.why
    _same_steps(runner, gm, ref, "cpu", 1e-6)
    assert runner._train.stats["captures"] == 1 and runner._train.stats["replays"] >= 5


@pytest.mark.cuda
def test_cuda_training_graphs_match_eager_and_replay():
    torch.manual_seed(0)
    m = TwoOut().cuda()
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 4, device="cuda")
    gm = capture(m, (x, y))
    ref = copy.deepcopy(gm)
    runner = lower(gm, [x, y], training=True)
    assert runner.decision.on and runner.decision.training
    for it in range(4):
        xs, ys = torch.randn(64, 8, device="cuda"), torch.randn(64, 4, device="cuda")
        ours = _step(runner, list(gm.parameters()), xs, ys, "in_place" if it != 2 else "skip")
        theirs = _step(ref, list(ref.parameters()), xs, ys, "in_place" if it != 2 else "skip")
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for p, q in zip(gm.parameters(), ref.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert runner._train.stats["captures"] == 1 and runner.stats["eager_calls"] == 0


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4096,), 2.0))

    def forward(self, x):
        return torch.nn.functional.dropout(x * self.w, 0.5, training=True)


def test_training_graph_with_dropout_is_replayed():
    x = torch.randn(4096)
    d = decide(capture(Drop().train(), (x,)), [x], training=True, device_type="cpu")
    assert d.on and d.training


@pytest.mark.cuda
def test_cuda_dropout_draws_new_masks_and_its_backward_uses_them():
    """Each replay draws a new mask; the gradient of sum(dropout(x * w)) is x * mask / (1 - p), which
    times w is the output itself: the backward replay read the mask its forward drew."""
    m = Drop().cuda()
    x = torch.randn(4096, device="cuda")
    gm = capture(m, (x,))
    runner = lower(gm, [x], training=True)
    assert runner.decision.on
    outs = []
    for _ in range(3):
        gm.w.grad = None
        y = runner(x)
        y.sum().backward()
        torch.testing.assert_close(gm.w.grad * 2.0, y, rtol=0, atol=0)
        assert 0.4 < (y == 0).float().mean().item() < 0.6
        outs.append(y)
    assert not torch.equal(outs[1], outs[2]) and runner._train.stats["captures"] == 1


def test_a_parameter_unfrozen_later_gets_its_gradient():
    gm, ref, runner = _pair()
    gm.a.weight.requires_grad_(False)
    ref.a.weight.requires_grad_(False)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    _step(runner, list(gm.parameters()), x, y, "none")
    assert gm.a.weight.grad is None
    gm.a.weight.requires_grad_(True)
    ref.a.weight.requires_grad_(True)
    _step(runner, list(gm.parameters()), x, y, "none")
    _step(ref, list(ref.parameters()), x, y, "none")
    torch.testing.assert_close(gm.a.weight.grad, ref.a.weight.grad, rtol=0, atol=1e-6)
    assert runner._train.stats["captures"] == 2


@pytest.mark.cuda
def test_cuda_failed_capture_leaves_the_generator_usable():
    """A capture that fails mid-way (here a host sync inside it) must not leave the CUDA generator in
    capture mode: random ops after it still run."""
    from graphopt.runtime.training_graphs import capture_step_cuda

    w = torch.randn(64, device="cuda", requires_grad=True)

    def forward():
        out = torch.nn.functional.dropout(w * 2.0, 0.5)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing
        return out

    def grads(outs, grad_outs):
        return torch.autograd.grad(outs, (w,), grad_outs)

    with pytest.raises(Exception):
        capture_step_cuda(forward, grads, torch.cuda.graph_pool_handle(), torch.device("cuda"), 1)
    assert torch.rand(4, device="cuda").shape == (4,)
    assert torch.nn.functional.dropout(torch.ones(1024, device="cuda"), 0.5).eq(0).any()


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_cuda_checkpointed_step_is_captured_and_matches_eager():
    """A memory-budgeted step (AOT regions recomputing in the backward) captured as CUDA graphs:
    outputs and gradients as the graph run eagerly, over steps with new inputs."""
    import graphopt

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]).cuda().train()
    x = torch.randn(512, 256, device="cuda")
    gm = graphopt.optimize(m, (x,), training=True, memory_budget=0.6, check_accuracy=False, measure=False,
                           checkpoint_backend="aot", cuda_graphs=False).graph_module
    assert any(n.op == "call_module" and n.target.startswith("ckpt_aot") for n in gm.graph.nodes)
    ref = copy.deepcopy(gm)
    runner = lower(gm, [x], training=True, cuda_graphs=True)
    assert runner.decision.on and runner.decision.training, runner.decision.why
    _same_steps(runner, gm, ref, "cuda", 1e-5)
    train = runner._train
    assert train.stats["captures"] == 1 and runner.stats["eager_calls"] == 0, (train.disabled, train.capture_traceback)


@pytest.mark.cuda
def test_cuda_capture_with_an_earlier_graph_kept_alive():
    """A caller that keeps an eager call's output (its autograd graph holds the parameters' gradient
    accumulators, made on the default stream) still gets its step captured: the captured backward
    takes the gradients at views of the parameters and never reaches those accumulators."""
    torch.manual_seed(0)
    m = TwoOut().cuda()
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 4, device="cuda")
    gm = capture(m, (x, y))
    kept = gm(x, y)  # eager, on the default stream, kept alive through the capture
    runner = lower(gm, [x, y], training=True)
    o1, o2 = runner(x, y)
    (o1.square().sum() + o2.sum()).backward()
    train = runner._train
    assert train.stats["captures"] == 1 and runner.stats["eager_calls"] == 0, (train.disabled, train.capture_traceback)
    assert kept[0].requires_grad


@pytest.fixture(scope="module")
def two_training_graphs():
    """A plain training graph and one with AOT checkpoint regions, with example inputs."""
    gm, x = _checkpointed("aot")
    return [(_pair()[0], [torch.randn(5, 8), torch.randn(5, 4)]), (gm, [x])]


@pytest.mark.parametrize("cuda_graphs", ["auto", True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_the_passes_view_of_a_replay_is_decides(two_training_graphs, cuda_graphs, dynamic):
    """graphopt.replay.training_replay_refusal (what a training pass asks before pricing a rewrite as
    replayed) gives decide's verdict and reason, devices aside: forced replay of dynamic shapes is
    replayed in both (one graph per shape); auto refuses it in both, with the same words."""
    from graphopt.replay import training_replay_refusal

    for gm, inputs in two_training_graphs:
        d = decide(gm, inputs, training=True, device_type="cpu", cuda_graphs=cuda_graphs, dynamic=dynamic)
        why = training_replay_refusal(gm, cuda_graphs=cuda_graphs, dynamic=dynamic)
        assert (why is None) == d.on and (why is None or why == d.why), (why, d.why)
