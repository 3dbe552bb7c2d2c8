"""graphopt.tools.bench and `graphopt bench`: the harness runs on the CPU with tiny models; these
tests check its records, files, failure handling and accuracy sampling, never its timings."""

import io
import json

import pytest
import torch
from rich.console import Console

from graphopt.tools import bench
from graphopt.tools.bench import BenchConfig, _check, _sample, parse_dtype, parse_vs, run, time_call
from graphopt.tools.cli import main


def _console():
    return Console(file=io.StringIO(), width=160)


def _run(configs, tmp_path=None, **kw):
    kw.setdefault("reps", 2)
    kw.setdefault("warmup", 1)
    kw.setdefault("device", "cpu")
    return run(configs, out_dir=tmp_path, console=_console(), progress=False, **kw)


def test_parse_vs_and_dtype():
    assert parse_vs("compile") == ("eager", "compile", "graphopt")
    assert parse_vs("compile-ro,eager,graphopt-reuse") == ("eager", "compile-ro", "graphopt", "graphopt-reuse")
    with pytest.raises(ValueError, match="unknown variant"):
        parse_vs("eager,inductor")
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError):
        parse_dtype("int3")


def test_time_call_counts_reps():
    calls = []
    times = time_call(lambda: calls.append(1), reps=4, warmup=2, device="cpu")
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


def test_run_mlp_writes_json_and_markdown(tmp_path):
    res = _run([BenchConfig("mlp", batch=4, vs=("eager", "graphopt-reuse"))], tmp_path)
    (r,) = res.results
    assert r.title == "mlp bs4" and [v.variant for v in r.variants] == ["eager", "graphopt", "graphopt-reuse"]
    for v in r.variants:
        assert v.status == "ok", v.error
        assert v.ms > 0 and v.reps == 2
        assert v.accuracy["passed"] is True
    g = r.get("graphopt")
    assert g.setup_s > 0 and g.extra["cuda_graph"].startswith("CUDA graph: off")
    assert r.speedup("graphopt", "eager") == pytest.approx(r.get("eager").ms / g.ms)
    data = json.loads((tmp_path / (res.paths["json"].split("/")[-1])).read_text())
    assert {"date", "device_name", "versions", "dtype", "reps"} <= set(data["header"])
    assert data["header"]["versions"]["torch"] == torch.__version__
    assert data["results"][0]["variants"][1]["variant"] == "graphopt"
    assert "graphopt" in data["results"][0]["speedups"]
    md = (tmp_path / res.paths["markdown"].split("/")[-1]).read_text()
    assert "| config | variant | ms | × eager |" in md and "mlp bs4" in md and "torch " in md
    assert "| setup s | setup peak | peak mem | accuracy |" in md  # building's memory apart from running's
    assert res.paths["json"].endswith(".json") and "_cpu_torch-" in res.paths["json"] and "/bench_" in res.paths["json"]
    out = _console()
    res.render(out)
    text = out.file.getvalue()
    assert "graphopt" in text and "eager fp32" in text


def test_a_failing_variant_is_a_row_not_the_end(monkeypatch, tmp_path):
    def broken_compile(*a, **k):
        raise RuntimeError("BackendCompilerFailed: no compiler here\nsecond line")

    monkeypatch.setattr(torch, "compile", broken_compile)
    res = _run([BenchConfig("mlp", batch=2, vs=("eager", "compile"))], tmp_path)
    r = res.results[0]
    assert r.get("compile").status == "error" and "BackendCompilerFailed" in r.get("compile").error
    assert "second line" not in r.get("compile").error
    assert r.get("graphopt").status == "ok" and r.get("eager").status == "ok"
    rows = res.rows()
    assert any(row["ms"] == "error" for row in rows)
    assert "compile" in res.to_markdown()


def test_unknown_model_is_recorded(tmp_path):
    res = _run([BenchConfig("no-such-model"), BenchConfig("mlp", batch=2, vs=("eager",))], tmp_path)
    bad, good = res.results
    assert bad.error and "unknown model" in bad.error and all(v.status == "error" for v in bad.variants)
    assert good.get("graphopt").status == "ok"
    assert "no-such-model" in res.to_markdown()


def test_budget_skips_but_still_reports():
    res = _run([BenchConfig("mlp", batch=2, vs=("eager",))], None, budget_s=0.0)
    (r,) = res.results
    assert all(v.status == "skipped" for v in r.variants)
    assert res.paths == {}
    out = _console()
    res.render(out)
    assert "skipped" in out.file.getvalue()


def test_one_build_per_model_and_batch_slices():
    calls = []
    real = bench.prepare_model

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    bench.prepare_model, saved = counting, bench.prepare_model
    try:
        res = _run([BenchConfig("mlp", batch=4, vs=("eager",)), BenchConfig("mlp", batch=2, vs=("eager",))])
    finally:
        bench.prepare_model = saved
    assert len(calls) == 1 and calls[0][1] == 4
    a, b = res.results
    assert a.title == "mlp bs4" and b.title == "mlp bs2"
    assert any("first 2 rows" in n for n in b.notes)
    assert all(v.status == "ok" for r in res.results for v in r.variants)


def test_sampling_and_accuracy_rule():
    ref64 = torch.randn(1000, dtype=torch.float64)
    eager = ref64.float()
    s_ref, s_eager = _sample(ref64, 100), _sample(eager, 100)
    assert s_ref.sampled == [(0, 10)] and s_ref.leaves[0].numel() == 100
    assert torch.equal(s_ref.leaves[0], ref64[::10])
    assert _check(_sample(eager, 100), s_ref, s_eager)["passed"] is True
    bad = eager.clone()
    bad[::10] += 1.0
    res = _check(_sample(bad, 100), s_ref, s_eager)
    assert res["passed"] is False and res["how"] == "fail"
    res = _check(_sample(eager[:999], 100), s_ref, s_eager)
    assert res["passed"] is False and "shapes" in res["reason"]
    assert _check(s_eager, None, s_eager)["passed"] is None
    # bf16 outputs keep their dtype so the rule uses the bf16 tolerance
    assert _sample(eager.bfloat16(), 100).leaves[0].dtype == torch.bfloat16


def test_cnn_detection_and_labels():
    assert bench._is_cnn("resnet50", None) and not bench._is_cnn("bert-tiny", None)
    cnn = torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3) for _ in range(3)])
    assert bench._is_cnn("file.py:make", cnn)
    assert bench._label("eager", torch.bfloat16, True) == "eager bf16 (hand-converted, channels_last)"
    assert bench._label("compile-ro", torch.bfloat16, False) == "torch.compile reduce-overhead"


def test_channels_last_for_cnns_in_low_precision():
    model, args, kwargs, name, cl = bench.prepare_model("shape-branch", 2, None, torch.bfloat16, torch.device("cpu"))
    assert not cl  # a toy, not a zoo "cnn"
    model, args, kwargs, name, cl = bench.prepare_model("shape-branch", 2, None, torch.float32, torch.device("cpu"))
    assert not cl and args[0].dtype == torch.float32


def test_channels_last_leaves_5d_tensors(tmp_path):
    # a CNN with a Conv3d (timm's LambdaLayer): Module.to(memory_format=channels_last) raises on its 5-D weight
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.convs = torch.nn.Sequential(*[torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(3)])\n"
        "        self.c3 = torch.nn.Conv3d(1, 2, (1, 3, 3), padding=(0, 1, 1))\n"
        "    def forward(self, x):\n"
        "        y = self.convs(x)\n"
        "        return y + self.c3(y.unsqueeze(1)).sum(1)\n"
        "def make(batch=2):\n"
        "    return M(), (torch.randn(batch, 4, 8, 8),)\n")
    model, args, kwargs, name, cl = bench.prepare_model(f"{tmp_path / 'm.py'}:make", 2, None, torch.bfloat16,
                                                        torch.device("cpu"))
    assert cl and args[0].is_contiguous(memory_format=torch.channels_last)
    assert model.convs[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model.c3.weight.dim() == 5 and model.c3.weight.is_contiguous()
    assert model(*args).shape == (2, 4, 8, 8)


def test_cli_bench(tmp_path, capsys):
    rc = main(["bench", "mlp", "--vs", "eager", "--reps", "3", "--warmup", "1", "--batch", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "mlp bs4" in out and "graphopt" in out
    assert len(list(tmp_path.glob("*.json"))) == 1 and len(list(tmp_path.glob("*.md"))) == 1


def test_cli_bench_bad_args(capsys):
    assert main(["bench", "mlp", "--vs", "eager,jit", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphopt: error:") and "unknown variant" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "mlp", "--reps", "0", "--no-save"]) == 2


def _run_models():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run_models.py"
    spec = importlib.util.spec_from_file_location("run_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_models_selection(capsys):
    rm = _run_models()
    full = rm.select(None, None, False, False)
    assert [(c.model, c.batch) for c in full] == [("resnet50", 1), ("resnet50", 64), ("bert-base", 1),
                                                  ("bert-base", 64), ("vit_b_16", 64), ("glm4-9b-4l", 1),
                                                  ("glm4-9b-4l", 8)]
    assert all(c.vs[0] == "eager" for c in full) and "compile-ro" in full[0].vs and "compile-ro" not in full[1].vs
    sub = rm.select(None, "resnet50:1,bert-base:1", True, True)
    assert [(c.model, c.batch) for c in sub] == [("resnet50", 1), ("bert-base", 1)]
    assert all("compile-ro" not in c.vs for c in sub)
    assert rm.select("glm4-9b-4l", None, False, True)[1].optimize_kwargs is None
    assert rm.select("glm4-9b-4l", None, False, False)[1].optimize_kwargs == {"check_accuracy": False}
    with pytest.raises(SystemExit):
        rm.select("nope", None, False, False)
    assert rm.main(["--list", "--only", "vit_b_16"]) == 0
    assert "vit_b_16 bs64: eager, compile" in capsys.readouterr().out


@pytest.mark.cuda
def test_setup_and_timed_peaks_apart(tmp_path):
    """On a GPU the build's peak (graphopt's fp64 accuracy guard) and the timed calls' peak are two numbers."""
    res = _run([BenchConfig("mlp", batch=4, vs=("eager",))], tmp_path, device="cuda")
    g = res.results[0].get("graphopt")
    assert g.status == "ok" and g.setup_peak_bytes and g.peak_mem_bytes
    assert g.setup_peak_bytes >= g.peak_mem_bytes * 0.5


def test_the_alternating_rounds_time_the_last_compile_variant_too():
    from graphopt.tools.bench import VariantResult, _build, _interleaved

    calls = []
    vr = VariantResult("graphopt", "graphopt")
    _interleaved(lambda x: calls.append("eager"), lambda x: calls.append("graphopt"), (1,), {}, vr,
                 device=torch.device("cpu"), reps=3, warmup=1, compiled=("compile-ro", lambda x: calls.append("ro")))
    il = vr.extra["interleaved"]
    assert il["reps"] == 3 and il["compile-ro_ms"] > 0 and il["graphopt_ms"] > 0
    assert calls[-6:] == ["eager", "graphopt", "ro"] * 2  # one round after another, each calling all three
    state = {}
    m = torch.nn.Linear(2, 2)
    built = _build("compile", m, (torch.randn(1, 2),), {}, state, {}, "linear")
    assert state["compiled"] == ("compile", built)  # what the rounds time beside graphopt
