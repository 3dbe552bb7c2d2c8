"""Helpers shared by the tests: fp64 references and the accuracy rule."""

import copy
from collections import Counter

import torch

from graphopt import accuracy


def reference_check(model, gm, args, kwargs=None, training=False):
    """Run gm and model on args; apply the DESIGN.md accuracy rule against an fp64 copy."""
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
