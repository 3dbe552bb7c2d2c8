"""The Report as text: print(report), repr, render() outside a terminal, the roofline floor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from rich.console import Console

import graphopt
from graphopt.capture import capture
from graphopt.cost.model import CostModel
from graphopt.cost.profiles import get_profile
from graphopt.examples import zoo


@pytest.fixture(scope="module")
def report():
    model, inputs = zoo.get("mlp")
    return graphopt.optimize(model, inputs).report


def test_str_is_a_short_summary_and_repr_one_line(report):
    text = str(report)
    lines = text.splitlines()
    assert 3 <= len(lines) <= 6 and len(text) < 1000
    assert "PassResult" not in text and "predicted" in text and "accuracy vs fp64 reference: passed" in text
    assert "fuse_bias_act" in text  # the pass that changed the graph
    r = repr(report)
    assert "\n" not in r and len(r) < 200 and r.startswith("<Report") and "PassResult" not in r


def test_render_outside_a_terminal_uses_120_columns(report, capsys, monkeypatch):
    """render() with no console, output piped: 120 columns, not rich's 80, so no cell is cut."""
    monkeypatch.delenv("COLUMNS", raising=False)
    report.render(verbose=True)
    out = capsys.readouterr().out
    assert all(len(line) <= 120 for line in out.splitlines())
    table = [line for line in out.splitlines() if "merge_sibling_linears" in line]
    assert table and "…" not in table[0]
    assert max(len(line) for line in out.splitlines()) > 80  # the width was used


def test_roofline_floor_above_the_prediction_says_so(report):
    rep = copy.copy(report)
    rep.cost_after = dict(report.cost_after, roofline_floor_ms=report.predicted_s_after * 1e3 * 2)
    console = Console(record=True, width=200)
    rep.render(console)
    line = next(t for t in console.export_text().splitlines() if t.startswith("roofline floor"))
    assert "above the prediction" in line
    console = Console(record=True, width=200)
    report.render(console)
    assert "above the prediction" not in console.export_text()


class _Lookup(nn.Module):
    """A large embedding table read a few rows at a time, then a small projection."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50_000, 64)
        self.proj = nn.Linear(64, 64)

    def forward(self, ids):
        return self.proj(self.table(ids))


@pytest.mark.parametrize("target", ["cpu", "h200"])
def test_roofline_floor_reads_only_the_gathered_rows_of_a_table(target):
    """The floor's compulsory bytes count the rows an embedding gathers, not its whole table,
    so the floor stays under the predicted time (it was 12.8 MB of table for 8 rows)."""
    gm = capture(_Lookup().eval(), (torch.randint(0, 50_000, (2, 4)),))
    profile, _ = get_profile(target)
    cost = CostModel(profile).graph_cost(gm)
    table_bytes = 50_000 * 64 * 4
    assert cost.roofline_floor_s < table_bytes / profile.bandwidth
    assert 0 < cost.roofline_floor_s <= cost.total_s
    _, params, compulsory = CostModel(profile).memory(gm)
    assert params > table_bytes and compulsory < table_bytes / 100
