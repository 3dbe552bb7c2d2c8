"""ir.reshape_is_view: torch's rule for when a reshape returns a view (the cost model prices those free)."""

import random

import sympy
import torch

from graphopt import ir


def test_reshape_is_view_agrees_with_torch_view():
    rng = random.Random(0)
    for _ in range(400):
        t = torch.empty([rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 5))])
        perm = list(range(t.dim()))
        rng.shuffle(perm)
        t = t.permute(perm)
        if rng.random() < 0.3 and t.shape[-1] > 1:
            t = t[..., ::2]
        shape = list(t.shape)
        if len(shape) > 1 and rng.random() < 0.6:
            i = rng.randrange(len(shape) - 1)
            shape[i:i + 2] = [shape[i] * shape[i + 1]]
        if rng.random() < 0.3:
            shape = [1] + shape
        try:
            t.view(shape)
            viewable = True
        except RuntimeError:
            viewable = False
        assert ir.reshape_is_view(ir.tensor_info(t), shape) == viewable, (tuple(t.shape), t.stride(), shape)


def test_symbolic_or_strideless_shapes_are_not_claimed_as_views():
    assert not ir.reshape_is_view(ir.TensorInfo((2, 3), torch.float32, torch.device("cpu"), None), (6,))
    s = sympy.Symbol("s")
    assert not ir.reshape_is_view(ir.TensorInfo((s, 3), torch.float32, torch.device("cpu"), (3, 1)), (3 * s,))
