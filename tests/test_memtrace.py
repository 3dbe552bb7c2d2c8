"""graphopt.tools.memtrace: an exact live-tensor-bytes timeline on the CPU (what max_memory_allocated
measures on a GPU): new storages counted once, views and pre-existing storages not at all, frees
when the storage dies, and the backward's ops seen too."""

import pytest
import torch
import torch.nn as nn

from graphopt.errors import GraphoptError
from graphopt.tools.memtrace import MemoryTrace, trace_step


def test_counts_new_storages_once_and_frees_them():
    w = torch.randn(256, 64)  # made before the trace: not counted, nor are its views
    with MemoryTrace() as tr:
        wt = w.t().view(64, 256)
        a = torch.zeros(1000)  # 4000 bytes
        b = a.view(10, 100)[2:]  # a view: no new memory
        c = a + 1  # 4000 more
        assert tr.live == 8000 and tr.peak == 8000
        del a
        assert tr.live == 8000  # b still views a's storage
        del b
        assert tr.live == 4000  # freed with its last view
    assert wt.shape == (64, 256)
    assert tr.peak == 8000 and c.numel() == 1000


def test_peak_and_live_follow_frees():
    with MemoryTrace() as tr:
        a = torch.ones(1024)  # 4096
        b = torch.ones(2048)  # 8192
        del a
        assert tr.live == 8192
        c = torch.ones(512)  # 2048
        assert tr.live == 8192 + 2048
        del b, c
        assert tr.live == 0
    assert tr.peak == 4096 + 8192
    assert tr.top(1)[0][0] == 8192 and "ones" in tr.top(1)[0][1]


def test_backward_ops_are_traced_and_match_the_arithmetic():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=False)
    r = trace_step(lambda t: torch.relu(lin(t)), (x,), params=list(lin.parameters()))
    # forward: relu saves its output (the step's output too); the linear's output dies with the forward
    assert r["after_forward"] == 16 * 32 * 4
    # backward: relu's gradient (16x32) and the weight's fresh gradient (32x64) appear on top of them
    assert r["peak"] >= r["after_forward"] + 32 * 64 * 4
    assert r["trace"].marks[-1][0] == "backward done" and r["trace"].marks[-1][2] <= 32 * 64 * 4


def test_a_step_without_gradients_is_refused():
    with pytest.raises(GraphoptError, match="no floating output that requires grad"):
        trace_step(lambda t: t * 2, (torch.randn(4),))
