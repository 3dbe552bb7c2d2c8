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
