"""benchmarks/training_bench.py on the CPU: a tiny run writes its JSON and Markdown with every
variant measured, the gradients judged against float64, and verdicts computed from the numbers."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("training_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_every_variant_and_the_verdicts(tmp_path, capsys):
    bench = _load()
    # two layers reach a 0.7 budget (0.3 needs the tiny configs' six)
    assert bench.main(["--tiny", "--configs", "gpt2", "--layers", "2", "--budget", "0.7", "--reps", "1",
                       "--warmup", "1", "--no-guard", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert "[gpt2] graphopt_budget: optimized" in capsys.readouterr().out
    version = re.sub(r"[^A-Za-z0-9._-]+", "-", torch.__version__)
    (js,) = tmp_path.glob(f"training_*_cpu_torch-{version}.json")
    (md,) = tmp_path.glob(f"training_*_cpu_torch-{version}.md")
    result = json.loads(js.read_text())
    assert result["header"]["versions"]["torch"] and result["header"]["versions"]["transformers"]
    assert result["settings"]["budget"] == 0.7 and result["errors"] == []
    (row,) = result["rows"]
    assert (row["arch"], row["layers"], row["batch"], row["seq"]) == ("gpt2", 2, 2, 64)
    for key in ("eager", "hf_checkpointing", "graphopt", "graphopt_budget"):
        v = row[key]
        assert "error" not in v, v
        assert v["ms"] > 0 and v["activation_gb"] > 0, (key, v)
    assert row["graphopt"]["speedup"] == pytest.approx(row["eager"]["ms"] / row["graphopt"]["ms"])
    assert row["graphopt_budget"]["checkpoint"]["status"] == "applied"
    # the checkpointed step holds less than eager's (the exact tensor trace on the CPU)
    assert row["graphopt_budget"]["activation_gb"] < row["eager"]["activation_gb"]
    assert row["reference"]["dtype"] == "float64" and row["reference"]["chunks"] == 2
    for key in ("graphopt", "graphopt_budget"):
        grads = row[key]["gradients"]
        assert grads["passed"], grads
        assert grads["tensors"] > 20 and grads["tol"] == 1e-2 and grads["k"] == 3.0
    v = row["verdicts"]
    assert v["gradients"]["verdict"] == "MET"
    assert v["speed"]["verdict"] == ("MET" if row["graphopt"]["speedup"] >= 1.15 else "MISSED")
    faster = row["graphopt_budget"]["ms"] < row["hf_checkpointing"]["ms"]
    smaller = row["graphopt_budget"]["activation_gb"] <= row["hf_checkpointing"]["activation_gb"]
    assert v["budget"]["verdict"] == ("MET" if faster and smaller else "MISSED")
    text = md.read_text()
    assert "| gpt2 | GPT-2 small (tiny), 2 layers, bs2 seq64 |" in text
    assert "gpt2 gradients: MET" in text


def _row(**variants):
    row = {"eager": {"ms": 10.0, "activation_gb": 8.0}}
    row.update(variants)
    return row


def _ok(ms, act, passed=True, reason=""):
    return {"ms": ms, "activation_gb": act, "speedup": 10.0 / ms, "gradients": {"passed": passed, "reason": reason}}


def test_verdicts_follow_the_measurements():
    bench = _load()
    met = bench.verdicts(_row(graphopt=_ok(8.5, 8.0), graphopt_budget=_ok(11.0, 2.0), hf_checkpointing=_ok(12.0, 2.0)))
    assert {k: met[k]["verdict"] for k in ("speed", "budget", "gradients")} == {"speed": "MET", "budget": "MET",
                                                                                "gradients": "MET"}
    assert met["all"] == "MET"
    # 1.14x; the budget variant faster but holding more than HF's checkpointing; one gradient failing
    missed = bench.verdicts(_row(graphopt=_ok(8.8, 8.0), graphopt_budget=_ok(11.0, 2.1, False, "output 0: rmse"),
                                 hf_checkpointing=_ok(12.0, 2.0)))
    assert missed["speed"]["verdict"] == missed["budget"]["verdict"] == missed["gradients"]["verdict"] == "MISSED"
    assert "output 0: rmse" in missed["gradients"]["why"] and missed["all"] == "MISSED"
    # a variant that failed or was not run misses, saying why
    failed = bench.verdicts(_row(graphopt={"error": "BudgetError: x"}, hf_checkpointing=_ok(12.0, 2.0)))
    assert failed["speed"]["verdict"] == "MISSED" and "BudgetError" in failed["speed"]["why"]
    assert failed["budget"]["verdict"] == "MISSED" and "not run" in failed["budget"]["why"]


def test_time_budget_spent_skips_what_is_left(tmp_path):
    bench = _load()
    assert bench.main(["--tiny", "--configs", "bert,gpt2", "--budget-s", "0", "--device", "cpu", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("training_*.json")
    rows = json.loads(js.read_text())["rows"]
    assert [r["arch"] for r in rows] == ["bert", "gpt2"]
    assert all("time budget (0 s) spent" in r["skipped"] for r in rows)
    assert "| bert | BERT-base |" in next(tmp_path.glob("training_*.md")).read_text()


def test_bad_config_is_refused(tmp_path):
    bench = _load()
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--configs", "gpt3", "--out", str(tmp_path)])


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_fp64_reference_by_rows_equals_the_whole_batch(arch):
    bench = _load()
    model, inputs, _, batch, _ = bench.build(bench.ARCHS[arch], True, torch.device("cpu"), torch.bfloat16, layers=1)
    outs = bench._outs(model(**inputs))
    gen = torch.Generator().manual_seed(0)
    grads_out = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    whole = bench.fp64_step(model, inputs, grads_out, rows=batch)
    rows = bench.fp64_step(model, inputs, grads_out, rows=1)
    assert len(whole[1]) == len(list(model.parameters())) and all(p.grad is None for p in model.parameters())
    for a, b in zip(whole[0] + whole[1], rows[0] + rows[1]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
