"""Helpers shared by the tests: fp64 references and the accuracy rule."""

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


def op_counts(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def fresh(model):
    return copy.deepcopy(model)


def run_in_triton_interpreter(function: str) -> None:
    """Run ``module:function`` (e.g. ``tests.cuda_ext.test_norm_triton:interpreter_cases``) in a
    fresh process with Triton's interpreter on (it must be on before triton is imported for
    tl.sum and the other library functions to work); the function prints "interpreter cases ok"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    module, name = function.split(":")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", f"from {module} import {name} as f; f()"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "interpreter cases ok" in r.stdout, r.stderr[-3000:]


def same_when_graphed(call):
    """``call()`` (an op returning a tensor or tensors) gives bit-identical results eagerly and
    replayed from a CUDA graph it was captured into (warmed up on a side stream first, as capture
    requires)."""
    def tensors(v):
        return v if isinstance(v, (tuple, list)) else (v,)

    eager = tensors(call())
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        graphed = tensors(call())
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


def _double(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def step_check(model, opt, args, seed=0, loss=loss_of, buffers=True):
    """One training step of ``opt`` (which trains ``model``'s parameters) against an eager copy of
    ``model`` and an fp64 copy under the same seed (dropout draws the same masks in fp64), by the
    accuracy rule: the loss, every parameter's gradient and (``buffers``) the buffers after the
    step (BatchNorm statistics; counters exactly). Returns the eager copy after its step."""
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    ours = train_step(opt, list(model.parameters()), args, seed, loss)
    eager = train_step(ref, list(ref.parameters()), args, seed, loss)
    gold = train_step(ref64, list(ref64.parameters()), _double(args), seed, loss)
    if buffers:
        ours, eager, gold = ours + list(model.buffers()), eager + list(ref.buffers()), gold + list(ref64.buffers())
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
