"""Helpers shared by the tests: fp64 references and the accuracy rule."""

import contextlib
import copy
from collections import Counter

import torch

from graphopt import accuracy


def reference_check(model, gm, args, kwargs=None, training=False):
    """Run gm and model on args; apply the accuracy rule (docs/design.md) against an fp64 copy."""
    kwargs = kwargs or {}
    with torch.no_grad():
        eager = model(*args, **kwargs)
        out = gm(*args, **kwargs)
    ref64 = accuracy.fp64_reference(model, tuple(args), kwargs)
    return accuracy.check(out, ref64, eager, training=training)


def resnet18(batch, res, dtype=torch.float32):
    """torchvision's ResNet-18 (20 convolutions; BatchNorm statistics from one training-mode forward
    of the input), eval mode, and an input of ``batch`` images of ``res`` pixels: the tests' stand-in
    for ResNet-50 at a fraction of its CPU time."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x = torch.randn(batch, 3, res, res)
    with torch.no_grad():
        model.train()(x)
    return model.eval().to(dtype), (x.to(dtype),)


def op_counts(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def fresh(model):
    return copy.deepcopy(model)


# The process that runs Triton kernels in its interpreter for this test process (started at the first
# call): Triton's interpreter must be on before triton is imported (tl.sum and the other library
# functions), so not here; one process serves every call, since starting one (torch, triton, graphopt)
# took as long as most of the calls' cases.
_INTERPRETER_LOOP = r"""
import contextlib, importlib, io, json, sys, traceback
for line in sys.stdin:
    module, name = line.strip().split(":")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            getattr(importlib.import_module(module), name)()
        ok = "interpreter cases ok" in out.getvalue()
    except BaseException:
        ok = False
        out.write(traceback.format_exc())
    sys.__stdout__.write("@@result " + json.dumps({"ok": ok, "out": out.getvalue()[-3000:]}) + "\n")
    sys.__stdout__.flush()
"""
_interpreter: dict = {}


def _interpreter_process():
    import atexit
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    proc = _interpreter.get("proc")
    if proc is not None and proc.poll() is None:
        return proc
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-u", "-c", _INTERPRETER_LOOP], cwd=root, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    _interpreter.update(proc=proc, log=log)
    atexit.register(proc.kill)
    return proc


def skip_old_interpreter() -> None:
    """Skip a test of a Triton kernel whose loops have runtime bounds under triton older than 3.7: its
    interpreter fails inside its own __index__ on such bounds. The cuda-marked tests run the kernel
    itself on that version (the H200 image's)."""
    import pytest

    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run this kernel's loops")


def run_in_triton_interpreter(function: str, timeout: float = 300) -> None:
    """Run ``module:function`` (e.g. ``tests.cuda_ext.test_norm_triton:interpreter_cases``) with
    Triton's interpreter on, in this test process's interpreter process (a fresh one if the last
    one died); the function prints "interpreter cases ok"."""
    import select
    import time

    import pytest

    pytest.importorskip("triton")
    proc = _interpreter_process()
    proc.stdin.write(function + "\n")
    proc.stdin.flush()
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if line.startswith("@@result "):
            break
        if not line and (not ready or proc.poll() is not None):  # timed out, or the process died
            proc.kill()
            proc.wait()
            _interpreter.pop("proc")  # the next call starts another
            log = _interpreter["log"]
            log.seek(0)
            pytest.fail(f"{function}: the interpreter process {'timed out' if not ready else 'died'}: "
                        f"{log.read()[-3000:]}")
    import json

    res = json.loads(line[len("@@result "):])
    assert res["ok"], res["out"]


def fused_programs_in_triton_interpreter(gm, xs, monkeypatch) -> tuple:
    """Run ``gm`` on ``xs``; each graphopt.fused_pointwise call is run again by the generated Triton
    kernel under Triton's interpreter (CPU) and must give the reference's values and strides.
    Returns (the graph's outputs, the programs' (text, inputs) in call order)."""
    from graphopt.cuda_ext import pointwise_triton as pwt

    ran = []

    class Check(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            out = super().call_function(target, args, kwargs)
            if target is torch.ops.graphopt.fused_pointwise.default:
                monkeypatch.setenv("TRITON_INTERPRET", "1")
                got = pwt.fused_pointwise_triton(*args)
                monkeypatch.delenv("TRITON_INTERPRET")
                for g, want in zip(got, out):
                    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
                    assert g.stride() == want.stride()
                ran.append(args)
            return out

    return Check(gm).run(*xs), ran


def cuda_graph_of(call):
    """(a CUDA graph ``call()`` was captured into, the outputs of the captured call), warmed up on a
    side stream first, as capture requires."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = call()
    return g, out


def same_when_graphed(call):
    """``call()`` (an op returning a tensor or tensors) gives bit-identical results eagerly and
    replayed from a CUDA graph it was captured into (:func:`cuda_graph_of`)."""
    def tensors(v):
        return v if isinstance(v, (tuple, list)) else (v,)

    eager = tensors(call())
    g, out = cuda_graph_of(call)
    graphed = tensors(out)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ training steps vs fp64
def loss_of(out) -> torch.Tensor:
    """A scalar loss from a model's output (a HF output's logits, a tuple's first tensor), in fp64."""
    out = out.logits if hasattr(out, "logits") else out
    out = out if isinstance(out, torch.Tensor) else out[0]
    return out.double().pow(2).mean()


def train_step(fn, params, args, seed=0, loss=loss_of) -> list:
    """One training step of ``fn`` under ``seed``: [loss, the gradient of each of ``params``]
    (gradients cleared first; zeros for a parameter the loss does not reach)."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    value = loss(fn(*args))
    value.backward()
    return [value.detach()] + [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


class _Float64Casts(torch.overrides.TorchFunctionMode):
    """The float64 copy's run: a forward's own casts to float32 (``t.float()`` of a diffusion model's
    integer timesteps) made to float64 (graphopt.accuracy.widened_cast), as the guard's reference does,
    instead of meeting float64 weights in float32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = accuracy.widened_cast(func, args, kwargs, torch.float64)
        return func(*args, **kwargs) if out is None else out


def _double(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def step_check(model, opt, args, seed=0, loss=loss_of, buffers=True, layouts=False):
    """One training step of ``opt`` (which trains ``model``'s parameters) against an eager copy of
    ``model`` and an fp64 copy under the same seed (dropout draws the same masks in fp64), by the
    accuracy rule: the loss, every parameter's gradient and (``buffers``) the buffers after the
    step (BatchNorm statistics; counters exactly). Returns the eager copy after its step.

    ``layouts``: ``opt`` runs its convolutions in channels_last, so the eager model in channels_last
    is a yardstick too: per output, the larger of the two layouts' errors against float64. On the CPU
    the layout picks oneDNN's kernel, and its channels_last weight gradient for a 3-channel
    convolution on two threads is 1e-2 from float64 on this repository's machine (1e-5 on one
    thread, and in NCHW), which no rewrite of graphopt's can avoid."""
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    cl = copy.deepcopy(model).to(memory_format=torch.channels_last) if layouts else None
    ours = train_step(opt, list(model.parameters()), args, seed, loss)
    eager = train_step(ref, list(ref.parameters()), args, seed, loss)
    with _Float64Casts():
        gold = train_step(ref64, list(ref64.parameters()), _double(args), seed, loss)
    if buffers:
        ours, eager, gold = ours + list(model.buffers()), eager + list(ref.buffers()), gold + list(ref64.buffers())
    if cl is not None:
        cl_args = tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4
                        else a for a in args)
        other = train_step(cl, list(cl.parameters()), cl_args, seed, loss) + (list(cl.buffers()) if buffers else [])
        err = lambda t, g: float((t.double() - g.double()).abs().max()) if t.is_floating_point() else 0.0  # noqa: E731
        eager = [c if err(c, g) > err(e, g) else e for e, c, g in zip(eager, other, gold)]
    res = accuracy.check(ours, gold, eager, training=True)
    assert res.passed, res.reason
    return ref


def sgd_check(model, opt, args, steps=3, lr=0.1, clip=1.0, loss=loss_of):
    """``steps`` SGD steps (gradient norm clipped to ``clip``, seed i at step i) through ``opt`` on
    ``model``'s parameters, through an eager copy and through an fp64 copy: the parameters after
    them by the accuracy rule (training tolerance)."""
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    for fn, owner, a in ((opt, model, args), (ref, ref, args), (ref64, ref64, _double(args))):
        sgd = torch.optim.SGD(owner.parameters(), lr=lr)
        for i in range(steps):
            with _Float64Casts() if owner is ref64 else contextlib.nullcontext():
                train_step(fn, list(owner.parameters()), a, seed=i, loss=loss)
            assert torch.isfinite(torch.nn.utils.clip_grad_norm_(owner.parameters(), clip))
            sgd.step()
    res = accuracy.check(list(model.parameters()), list(ref64.parameters()), list(ref.parameters()), training=True)
    assert res.passed, res.reason


def tiny_llama_training():
    """(a 2-layer transformers LlamaForCausalLM of hidden size 32 in train mode, SDPA attention, seeded
    weights; input ids [2, 16]): the training tests' tiny decoder."""
    import transformers as T

    cfg = T.LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                        intermediate_size=64, vocab_size=64, pad_token_id=0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).train()
    return model, torch.randint(1, 64, (2, 16))


def sm90_global_accesses(fn, values: dict, pointers, floats=()) -> tuple[set, set]:
    """The kinds of global loads and stores (``ld.global.v4.b32``, ...) in the PTX a Triton kernel
    ``fn`` compiles to for sm_90, on any machine: ``values`` its compile-time constants (and the
    integer arguments the launcher would specialize, a stride of 1), ``pointers`` its bf16 pointer
    arguments (16-byte aligned, as the launcher specializes them), ``floats`` its fp32 scalars; every
    other argument an i32."""
    import re

    import pytest

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    sig, consts, attrs = {}, {}, {}
    for i, prm in enumerate(fn.params):
        n = prm.name
        if n in pointers:
            sig[n], attrs[(i,)] = "*bf16", [["tt.divisibility", 16]]
        elif n in values:
            sig[n], consts[(i,)] = "constexpr", values[n]
        else:
            sig[n] = "fp32" if n in floats else "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return set(re.findall(r"ld\.global[^ \t]*", ptx)), set(re.findall(r"st\.global[^ \t]*", ptx))


def stand_in_sm90(monkeypatch) -> None:
    """Triton and torch.cuda answering as on an H100 (an sm_90 target, device 0, 132 SMs), on any machine:
    graphopt's launches on fake CUDA tensors then reach Triton's compile with a GPU's arguments."""
    import pytest

    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class StandIn:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    class Props:
        multi_processor_count, major, minor, name, total_memory = 132, 9, 0, "stand-in", 80 << 30

    monkeypatch.setattr(driver, "_active", StandIn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: Props())


def compiles_asked(monkeypatch, op, calls) -> list:
    """The Triton compiles that precompile's warm-ups of graphopt ``op`` ask for on a stand-in sm_90
    (:func:`stand_in_sm90`), as (kernel, its source's cache key, the specialization key) in launch order,
    recorded instead of run; one node per entry of ``calls``: a function of nothing, run under a
    FakeTensorMode, giving a node's arguments (tensors as CUDA fakes). Every node is warmed
    (precompile's record of signatures already seen is set aside)."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime.jit import JITFunction

    from graphopt.runtime import precompile as pc

    stand_in_sm90(monkeypatch)
    monkeypatch.setattr(pc, "_done", set())
    asked = []

    def record(self, key, *args, **kwargs):
        asked.append((self.fn.__qualname__, self.cache_key, repr(key)))
        return None

    g = fx.Graph()
    outs = []
    with FakeTensorMode():
        for i, make in enumerate(calls):
            args = []
            for j, a in enumerate(make()):
                if isinstance(a, torch.Tensor):
                    ph = g.placeholder(f"a{i}_{j}")
                    ph.meta["val"] = a
                    a = ph
                args.append(a)
            outs.append(g.call_function(op, tuple(args)))
    g.output(tuple(outs))
    todo, left = pc.plan(fx.GraphModule(torch.nn.Module(), g), pc.triton_ops())
    assert len(todo) == len(calls) and not left, left
    monkeypatch.setattr(JITFunction, "_do_compile", record)
    out = pc.Precompiled()
    with pc.warm_launches():
        pc.run_on_fakes(todo, out)
    assert len(asked) == len(calls) and not out.left, out.left
    return asked


def assert_refuses(op, args, bad, match) -> None:
    """``op(*args)`` with the arguments ``bad(args)`` maps ({position: value}) put in their places raises
    KernelArgumentError matching ``match`` (a bundled op's wrapper checking what its kernel takes)."""
    import pytest

    from graphopt.errors import KernelArgumentError

    args = list(args)
    for i, v in bad(args).items():
        args[i] = v
    with pytest.raises(KernelArgumentError, match=match):
        op(*args)
