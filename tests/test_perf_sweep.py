"""The performance sweep's configs, its table and one config run end to end in a fresh process."""

import json
import math
import os

import pytest

from graphopt.tools import perf_sweep
from graphopt.tools.perf_sweep import PerfConfig, Row


def test_the_sweep_covers_the_families_and_architectures_it_promises():
    configs = perf_sweep.all_configs(timm_available=False)
    names = {c.name for c in configs}
    assert len(configs) >= 40
    assert len({c.name for c in configs if c.source == "hf"}) >= 15
    assert {"hf-bert", "hf-llama", "hf-t5-encoder", "hf-vit"} <= names  # encoder, decoder, seq2seq encoder, vision
    assert {c.batch for c in configs if c.source == "torchvision"} == {1, 64}
    assert len({c.key for c in configs}) == len(configs)
    with_timm = perf_sweep.all_configs(timm_available=True)
    assert {c.source for c in with_timm} == {"torchvision", "hf", "timm"}


def test_configs_parse_with_and_without_a_batch():
    assert perf_sweep.parse_configs("resnet50:8,hf-bert") == [PerfConfig("resnet50", 8), PerfConfig("hf-bert", 64)]
    with pytest.raises(ValueError, match="unknown config 'resnet5'"):
        perf_sweep.parse_configs("resnet5")
    with pytest.raises(ValueError, match="positive integer"):
        perf_sweep.parse_configs("resnet50:0")
    assert perf_sweep.main(["--configs", "nope"]) == 2
    assert perf_sweep.main(["--configs", "resnet50", "--vs", "inductor"]) == 2


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-swin", "mobilenet_v3_small"])
def test_small_builds_run_at_the_batch_asked_for(name):
    import torch

    factory = getattr(perf_sweep, perf_sweep.factory_name(name))
    model, inputs = perf_sweep.build(name, 3, small=True)
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    first = out[0] if isinstance(out, tuple) else (out.last_hidden_state if hasattr(out, "last_hidden_state") else out)
    assert first.shape[0] == 3
    assert callable(factory) and "batch" in factory.__code__.co_varnames


def test_a_bench_factory_taking_a_batch_gets_the_one_asked_for(tmp_path):
    from graphopt.tools.modelspec import load_model

    f = tmp_path / "m.py"
    f.write_text("import torch\n"
                 "def make(batch=1, seq_len=4):\n"
                 "    return torch.nn.Linear(seq_len, 2), (torch.randn(batch, seq_len),)\n"
                 "def fixed():\n"
                 "    return torch.nn.Linear(4, 2), (torch.randn(5, 4),)\n")
    _, (x,), _ = load_model(f"{f}:make", batch=7, seq_len=3)
    assert tuple(x.shape) == (7, 3)
    _, (x,), _ = load_model(f"{f}:fixed", batch=7)  # a factory without the argument builds its own
    assert tuple(x.shape) == (5, 4)


def _row(config, eager, compile_, graphopt, predicted=None, ro=None, returned="optimized", passed=True):
    return Row(config, "torchvision", 1, ms={"eager": eager, "compile": compile_, "compile-ro": ro, "graphopt": graphopt},
               accuracy={"graphopt": passed}, predicted_ms=predicted, returned=returned)


def test_the_summary_counts_against_the_best_compile_mode():
    rows = [_row("a:1", 4.0, 2.0, 1.0, predicted=1.1, ro=1.5),      # 1.5x the better compile mode (r-o)
            _row("b:64", 2.0, 1.0, 1.25, predicted=2.0),            # behind compile, prediction 60% off
            _row("c:64", 1.0, 3.0, 1.2, returned="model", passed=False),  # slower than eager
            Row("d:64", "hf", 64, status="timeout", error="over the 600 s limit")]
    rows[0].interleaved = {"eager_ms": 4.0, "graphopt_ms": 1.0, "compile-ro_ms": 1.2}  # timed again, alternating
    rows[1].interleaved = {"eager_ms": 2.0, "graphopt_ms": 1.1, "compile_ms": 1.1}
    s = perf_sweep.summary(rows)
    alt = s["alternating_vs_compile"]
    assert alt["rows"] == 2 and alt["behind"] == [] and alt["geomean"] == pytest.approx(math.sqrt(1.2))
    assert s["measured"] == 3 and s["rows"] == 4
    assert s["geomean_vs_best_compile"] == pytest.approx(math.exp((math.log(1.5) + math.log(0.8) + math.log(2.5)) / 3))
    assert s["behind_best_compile"] == ["b:64"] and s["slower_than_eager"] == ["c:64"]
    assert s["accuracy_failed"] == ["c:64"] and s["returned_the_model"] == ["c:64"]
    assert s["predicted_within_20pct"] == "1 of 2" and list(s["errors"]) == ["d:64"]
    md = perf_sweep.to_markdown(rows, {"date": "today", "device": "cpu", "dtype": "fp32", "reps": 5, "warmup": 1,
                                       "command": "perf_sweep.py", "versions": {"torch": "2.x"}})
    assert "| a:1 | 4.000 | 2.000 | 1.500 | 1.000 | 1.50× | 1.20× (ro) | 4.00× | 1.100 | 1.10 | optimized |" in md
    assert "| b:64 | 2.000 | 1.000 | — | 1.250 | 0.80× | 1.00× | 1.82× |" in md
    assert "in alternating rounds (2 rows), against the torch.compile mode run last: geometric mean 1.10×" in md
    assert "| d:64 | timeout: over the 600 s limit |" in md
    assert "behind the best torch.compile mode: 1 (b:64)" in md


def test_the_summary_names_slow_set_ups_untimed_passes_and_reverts_by_kind():
    a = _row("a:1", 4.0, 2.0, 1.0)
    a.setup_s = {"compile": 30.0, "graphopt": 12.0}  # over a third
    a.pass_ms = {"fuse_attention": 1.2, "fuse_layer_norm": None}
    a.reverted = {"fuse_elementwise": "reverted: the pass raised IndexError: list index out of range",
                  "convert_channels_last": "reverted: measured 1.300 ms against 1.100 ms before it (predicted -0.2 ms)"}
    b = _row("b:64", 2.0, 1.0, 0.9)
    b.setup_s = {"compile": 30.0, "graphopt": 9.0}
    b.reverted = {"assign_precision": "reverted: fails the accuracy rule (rmse 3 x the floor)"}
    b.held = {"fold_conv_bn": "kept: the passes with fold_conv_bn kept measured 1.9 ms, run again with it judged alone 3.8 ms"}
    b.timed = {"lower_depthwise_conv": [32, 32]}
    s = perf_sweep.summary([a, b])
    assert s["held"] == {"b:64": {"fold_conv_bn": "kept"}}
    assert s["timed_candidates"] == {"b:64": {"lower_depthwise_conv": [32, 32]}}
    assert s["setup_over_a_third_of_compile"] == ["a:1"] and s["applied_not_timed"] == {"a:1": ["fuse_layer_norm"]}
    assert s["reverted"] == {"broken graph": {"a:1": ["fuse_elementwise"]},
                             "measured slower": {"a:1": ["convert_channels_last"]},
                             "accuracy rule": {"b:64": ["assign_precision"]}}
    md = perf_sweep.to_markdown([a, b], {"date": "today", "device": "cpu", "dtype": "fp32", "reps": 5, "warmup": 1,
                                         "command": "perf_sweep.py", "versions": {}})
    assert "- passes reverted (broken graph): a:1: fuse_elementwise" in md
    assert "- graphopt's set-up over a third of torch.compile's: 1 (a:1)" in md
    assert "- passes measured slower alone and held while the others ran: b:64: fold_conv_bn (kept)" in md
    assert "(refused as slower / timed): b:64: lower_depthwise_conv 32/32" in md


@pytest.mark.slow  # 14 s on two cores (a fresh interpreter); the sweep's other tests run its parts in this process
def test_one_config_in_a_fresh_process_gives_its_row(tmp_path):
    """The child process builds the small config, runs eager and graphopt through the bench and
    hands back its row; the sweep writes the table and its JSON."""
    rows, paths = perf_sweep.sweep([PerfConfig("hf-gpt2", 2)], device="cpu", dtype=None, reps=2, warmup=1,
                                   small=True, timeout_s=300, out=tmp_path, command="test", vs=("eager",),
                                   log=lambda s: None)
    (row,) = rows
    assert row.status == "ok", row.error
    assert row.ms["eager"] > 0 and row.ms["graphopt"] > 0 and "compile" not in row.ms
    assert row.accuracy["graphopt"] is True and row.predicted_ms > 0
    assert 0 < sum(row.optimize_phases.values()) <= row.setup_s["graphopt"]  # where optimize()'s time went
    # each applied pass with the guard's measured time (None where its time budget was spent)
    assert set(row.pass_ms) == set(row.applied) and all(ms is None or ms > 0 for ms in row.pass_ms.values())
    il = row.interleaved  # eager and graphopt again, in alternating calls: the eager ratio reads them
    assert il["reps"] == 2 and row.vs("eager") == pytest.approx(il["eager_ms"] / il["graphopt_ms"])
    data = json.loads(open(paths["json"]).read())
    assert data["rows"][0]["config"] == "hf-gpt2:2" and data["summary"]["measured"] == 1
    assert "| hf-gpt2:2 |" in open(paths["markdown"]).read()


def test_the_small_sweep_caps_the_batch():
    small = perf_sweep.all_configs(timm_available=False, small=True)
    assert {c.batch for c in small} == {1, perf_sweep.SMALL_BATCH}
    assert perf_sweep.parse_configs("resnet50", small=True) == [PerfConfig("resnet50", perf_sweep.SMALL_BATCH)]


def test_configs_run_at_once_keep_their_order_and_share_one_device_lock(monkeypatch, tmp_path):
    import threading
    import time

    seen, running, most = [], [0], [0]
    guard = threading.Lock()

    def fake(cfg, *, timeout_s, lock=None, **kw):
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
            seen.append(lock)
        time.sleep(0.05 if cfg.batch == 1 else 0.15)  # the first config finishes last
        with guard:
            running[0] -= 1
        return Row(cfg.key, cfg.source, cfg.batch, ms={"eager": 2.0, "graphopt": 1.0})

    monkeypatch.setattr(perf_sweep, "run_isolated", fake)
    configs = [PerfConfig("resnet50", 64), PerfConfig("resnet18", 1), PerfConfig("hf-bert", 1)]
    rows, paths = perf_sweep.sweep(configs, device="cpu", dtype=None, reps=2, warmup=1, small=True, timeout_s=10,
                                   out=tmp_path, command="test", jobs=3, log=lambda s: None)
    assert [r.config for r in rows] == ["resnet50:64", "resnet18:1", "hf-bert:1"]
    assert most[0] > 1 and len(set(seen)) == 1 and seen[0].endswith("device.lock")
    assert "3 configs at once" in open(paths["markdown"]).read()


def test_configs_on_gpus_of_their_own_never_share_a_gpu_or_cores(monkeypatch, tmp_path):
    import threading
    import time

    held, clashes, seen = set(), [], []
    guard = threading.Lock()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)

    def fake(cfg, *, timeout_s, lock=None, env=None, **kw):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with guard:
            if gpu in held:
                clashes.append(gpu)
            held.add(gpu)
            seen.append((lock, gpu, env[perf_sweep.CORES_ENV]))
        time.sleep(0.05)
        with guard:
            held.discard(gpu)
        return Row(cfg.key, cfg.source, cfg.batch, ms={"eager": 2.0, "graphopt": 1.0})

    monkeypatch.setattr(perf_sweep, "run_isolated", fake)
    configs = [PerfConfig(n, 1) for n in ("resnet18", "resnet50", "hf-bert", "hf-gpt2", "squeezenet1_1")]
    rows, paths = perf_sweep.sweep(configs, device="cpu", dtype=None, reps=2, warmup=1, small=True, timeout_s=10,
                                   out=tmp_path, command="test", gpus=2, log=lambda s: None)
    assert [r.config for r in rows] == [c.key for c in configs] and not clashes
    assert {s[0] for s in seen} == {None}  # no device lock: nothing to share
    assert {(g, c) for _, g, c in seen} <= {("0", "0,1,2,3"), ("1", "4,5,6,7")} and len({g for _, g, _ in seen}) == 2
    header = json.loads(open(paths["json"]).read())["header"]
    assert header["gpus"] == 2 and header["jobs"] == 1
    assert "each alone on a GPU of its own" in open(paths["markdown"]).read()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the GPUs this process was given, not the first two
    assert [e["CUDA_VISIBLE_DEVICES"] for e in perf_sweep.gpu_slots(2, [0, 1])] == ["2", "3"]
    assert perf_sweep.main(["--gpus", "4", "--device", "cpu", "--configs", "resnet18:1"]) == 2  # no such GPUs


def test_the_device_lock_lets_one_holder_in_at_a_time(tmp_path):
    import threading

    from graphopt.tools.bench import DeviceLock

    path = str(tmp_path / "lock")
    first, second = DeviceLock(path), DeviceLock(path)
    entered = threading.Event()

    def take():
        with second:
            entered.set()

    first.acquire()
    t = threading.Thread(target=take)
    t.start()
    assert not entered.wait(0.3)  # held by the first
    first.release()
    assert entered.wait(5)
    t.join()
    assert second.waited_s > 0.2
    with DeviceLock(None) as free:  # no path: nothing is locked
        assert free.path is None


def test_the_lock_holder_gets_cores_of_its_own_on_a_large_host(tmp_path, monkeypatch):
    import os

    from graphopt.tools.bench import DeviceLock

    pinned = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(set(cores)), raising=False)
    lock = DeviceLock(str(tmp_path / "lock"))
    with lock:
        held = pinned[-1]
    assert pinned[0] == set(range(2, 16)) and held == {0, 1} and pinned[-1] == set(range(2, 16))


def test_runs_split_over_calls_merge_into_one_table(tmp_path):
    from dataclasses import asdict

    def write(name, rows, jobs):
        header = {"device": "cuda", "device_name": "NVIDIA H200", "date": "2026-12-02", "dtype": "bf16", "reps": 20,
                  "warmup": 3, "command": name, "jobs": jobs, "versions": {"torch": "2.11.0", "CUDA": "13.0"}}
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}))
        return str(p)

    a = write("a", [Row("resnet50:64", "torchvision", 64, ms={"eager": 4.0, "compile": 3.0, "graphopt": 2.0}),
                    Row("hf-bert:64", "hf", 64, ms={"eager": 6.0, "compile": 4.0, "graphopt": 5.0})], 4)
    b = write("b", [Row("hf-bert:64", "hf", 64, ms={"eager": 6.0, "compile": 4.0, "graphopt": 2.0})], 1)
    assert perf_sweep.main(["--merge", a, b, "--out", str(tmp_path / "out")]) == 0
    (js,) = (tmp_path / "out").glob("*.json")
    data = json.loads(js.read_text())
    assert [r["config"] for r in data["rows"]] == ["resnet50:64", "hf-bert:64"]
    assert data["rows"][1]["ms"]["graphopt"] == 2.0  # the later file's row
    assert data["summary"]["behind_best_compile"] == [] and "a.json; b.json" in data["header"]["command"]
    assert perf_sweep.main(["--merge", str(tmp_path / "missing.json")]) == 2


def test_small_builds_without_a_tiny_config_are_narrowed_too():
    """An architecture the correctness sweep has no tiny config for gets two layers and SMALL_WIDTHS
    where its config takes them (two layers of a 7B-wide decoder timed out the CPU sweep)."""
    from graphopt.tools import sweep

    names = [n for n in perf_sweep.HF if n[3:] not in sweep.HF_MODELS]
    assert names
    for name in names:
        model, _ = perf_sweep.build(name, 2, small=True)
        assert sum(p.numel() for p in model.parameters()) < 2_000_000, name


@pytest.mark.slow  # two torch.compile builds on the CPU (about 20 s)
def test_a_prewarm_compiles_each_config_cold_and_its_setup_stands_for_compile(tmp_path):
    """--prewarm-jobs: every config compiled cold first (a child per config, nothing timed); the
    timed run then compiles from Inductor's caches, and the row's compile set-up is the cold one,
    the timed run's own kept beside it."""
    logs = []
    rows, paths = perf_sweep.sweep([PerfConfig("hf-gpt2", 2)], device="cpu", dtype=None, reps=2, warmup=1,
                                   small=True, timeout_s=300, out=tmp_path, command="test", vs=("compile",),
                                   prewarm_jobs=1, log=logs.append)
    (row,) = rows
    assert row.status == "ok", row.error
    assert any(line.startswith("    prewarm hf-gpt2:2: compile ") for line in logs), logs
    assert row.setup_s["compile"] > 0 and row.compile_warm_setup_s["compile"] > 0
    assert "compiled cold" in open(paths["markdown"]).read()


def test_any_model_a_user_names_is_a_config_with_a_clear_error_for_what_is_not():
    import torch

    configs = perf_sweep.parse_configs("resnet101,hf-falcon,hf-xlm-roberta:2,hf-beit")
    assert configs == [PerfConfig("resnet101", 64), PerfConfig("hf-falcon", 8), PerfConfig("hf-xlm-roberta", 2),
                       PerfConfig("hf-beit", 64)]
    assert perf_sweep._hf_auto_config("falcon").num_hidden_layers == 4  # a 7B-class width: cut as the listed decoders
    for name, why in [("hf-t5", "encoder-decoder"), ("hf-clip", "composite"), ("hf-nope", "no model type 'nope'"),
                      ("resnet5", "not a torchvision classification model")]:
        with pytest.raises(ValueError, match=why):
            perf_sweep.parse_configs(name)
    for name, kind in [("hf-xlm-roberta", "attention_mask"), ("hf-falcon", "input_ids"), ("hf-beit", "pixel_values")]:
        factory = getattr(perf_sweep, perf_sweep.factory_name(name))  # the bench's child resolves it by name
        model, inputs = perf_sweep.build(name, 2, small=True)
        assert kind in inputs and factory.__name__ == perf_sweep.factory_name(name)
        with torch.no_grad():
            assert model(**inputs)[0].shape[0] == 2


def test_a_pass_judged_alone_is_reported_by_its_revert_line():
    """A pass the measured guard's second run undid carries the guard's verdict after its revert
    line: the table classifies it by the revert line (a measured loss), not as a broken graph."""
    from types import SimpleNamespace

    from graphopt.pipeline import PassResult
    from graphopt.tools.bench import _graphopt_extra
    from graphopt.tools.perf_sweep import revert_kind

    p = PassResult("convert_channels_last", status="reverted",
                   notes=["reverted: measured 6.2 ms against 6.1 ms before it",
                          "the passes with convert_channels_last kept measured 6.064 ms, run again with it judged "
                          "alone 6.136 ms"])
    rep = SimpleNamespace(predicted_s_after=0.0, predicted_s_before=0.0, optimize_seconds=1.0, accuracy=None,
                          passes=[p])
    note = _graphopt_extra(SimpleNamespace(report=rep))["reverted"]["convert_channels_last"]
    assert note.startswith("reverted: measured") and revert_kind(note) == "measured slower"
