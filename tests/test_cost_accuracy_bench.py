"""benchmarks/cost_model_accuracy.py dry run on the CPU: it writes its JSON and Markdown table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_model_accuracy.py"


def _load():
    spec = importlib.util.spec_from_file_location("cost_model_accuracy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_writes_the_table(tmp_path, capsys):
    bench = _load()
    assert bench.main(["--tiny", "--models", "mlp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[1/1] mlp" in out and "wrote" in out
    (md,) = tmp_path.glob("cost_model_accuracy_*_cpu.md")
    (js,) = tmp_path.glob("cost_model_accuracy_*_cpu.json")
    text = md.read_text()
    assert "| mlp | — | — | eager |" in text  # the whole-call table
    assert "Spearman costed" in text and "Spearman heavy" in text
    row = json.loads(js.read_text())["results"][0]
    assert "error" not in row, row
    assert row["module"]["execution"] == "eager" and row["module"]["measured_ms"] > 0
    assert row["module"]["predicted_ms"] > 0 and row["eager_graph"]["predicted_ms"] > 0
    assert row["nodes_costed"] >= 3 and row["nodes"] and all(r["measured_ms"] > 0 for r in row["nodes"])
    assert {"predicted_host_ms", "predicted_device_ms", "measured_host_ms"} <= set(row["nodes"][0])
    assert row["by_op"] and row["busy_before"] is None  # no GPU: no busy fraction


def test_bad_model_spec_is_refused():
    bench = _load()
    with pytest.raises(SystemExit, match="bad model"):
        bench.main(["--tiny", "--models", "mlp@x3"])
