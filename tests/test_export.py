"""Export round trips: TorchScript and .pt2 artifacts reload (in a fresh process too), give the
optimized module's outputs, carry the report, and foreign or damaged files raise ArtifactError."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from torch.utils import _pytree as pytree

import graphopt
from graphopt import accuracy
from graphopt.examples import zoo
from tests.helpers import resnet18

export_mod = importlib.import_module("graphopt.export")  # graphopt.export is the function


def _flat(out) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _optimized(name, batch=None, **kw):
    model, inputs = resnet18(1, 224) if name == "resnet18" else zoo.get(name, batch=batch)
    opt = graphopt.optimize(model, inputs, **kw)
    assert opt.report.accuracy["passed"], opt.report.accuracy
    with torch.no_grad():
        out = opt(*inputs)
    return model, inputs, opt, out


def _assert_matches(loaded_out, opt_out, model=None, inputs=None):
    """The artifact gives the optimized module's outputs: in this process the same kernels run
    (fp32 assert_close); from a fresh process (``model``, ``inputs`` given) they may run on another
    number of CPU threads, so its outputs are judged by the accuracy rule against fp64."""
    got, want = _flat(loaded_out), _flat(opt_out)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
    if model is None:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        return
    with torch.no_grad():
        eager = _flat(model(*inputs))
    res = accuracy.check(got, _flat(accuracy.fp64_reference(model, tuple(inputs), {})), eager)
    assert res.passed, res.reason


# ----------------------------------------------------------------------------- artifacts


@pytest.fixture(scope="module")
def art_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="module")
def r18(art_dir):
    # a CNN's artifact: ResNet-18 at 224 px, batch 1 (ResNet-50 took three times as long to optimize,
    # export and reload; its 53 folds: test_fold_conv_bn, test_cli's explain of the default model).
    # precision="fp32": on the CPU profile assign_precision's bf16 search over a ResNet costs
    # minutes and ends unchanged; this test is about the artifact, not that search
    model, inputs, opt, out = _optimized("resnet18", precision="fp32")
    paths = {fmt: graphopt.export(opt, art_dir / f"resnet18.{fmt}") for fmt in ("pt", "pt2")}
    return model, inputs, opt, out, paths


@pytest.fixture(scope="module")
def glm(art_dir):
    # planned for the H200 so the graph holds graphopt's own ops (torch.ops.graphopt.*, CPU
    # implementations here): the fresh process must have them registered by `import graphopt`
    model, inputs, opt, out = _optimized("glm4-tiny", target="h200")
    ops = {str(n.target) for n in opt.graph_module.graph.nodes if n.op == "call_function"}
    assert any(o.startswith("graphopt.") for o in ops), sorted(ops)
    paths = {fmt: graphopt.export(opt, art_dir / f"glm4-tiny.{fmt}") for fmt in ("pt", "pt2")}
    return model, inputs, opt, out, paths


@pytest.fixture(scope="module")
def mlp(art_dir):
    model, inputs, opt, out = _optimized("mlp")
    paths = {fmt: graphopt.export(opt, art_dir / f"mlp.{fmt}") for fmt in ("pt", "pt2")}
    return model, inputs, opt, out, paths


# One fresh interpreter loads every artifact (a process per artifact would cost seconds each).
# It never imports the zoo or transformers itself: graphopt.load must find what it needs.
# First, with transformers blocked, the GLM artifact must come back as a flat tuple with a note;
# then, unblocked, every artifact through graphopt.load and the TorchScript ones through plain
# torch.jit.load after `import graphopt`.
_FRESH = textwrap.dedent("""
    import json, sys
    import torch
    sys.modules["transformers"] = None          # as if transformers were not installed
    import graphopt
    jobs = json.loads(sys.argv[1])
    res = {}
    def flat(out):
        from torch.utils import _pytree as pytree
        return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]

    inputs = torch.load(jobs["glm_pt"][1], weights_only=True)
    m = graphopt.load(jobs["glm_pt"][0])
    out = m(*inputs)
    res["no_transformers"] = {"type": type(out).__name__, "flat": flat(out), "notes": m.notes}

    del sys.modules["transformers"]
    assert not any(k.startswith("transformers") for k in sys.modules)
    for key, (path, inputs_path) in jobs.items():
        inputs = torch.load(inputs_path, weights_only=True)
        m = graphopt.load(path)
        out = m(*inputs)
        r = {"type": type(out).__name__, "flat": flat(out), "notes": m.notes, "report": json.dumps(m.report),
             "meta": json.dumps(m.meta)}
        # the KV cache (the output's ``cache``, ``past_key_values`` before transformers 5.24)
        cache = next((v for v in out.values() if type(v).__name__.endswith("Cache")), None) if isinstance(out, dict) else None
        if cache is not None:
            r["cache_type"] = type(cache).__name__
            r["cache_layers"] = len(cache.layers)
            r["logits"] = out.logits
        if path.endswith(".pt"):
            plain = torch.jit.load(path)
            r["jit_flat"] = flat(plain(*flat(inputs)))
        res[key] = r
    torch.save(res, sys.argv[2])
""")


@pytest.fixture(scope="module")
def fresh(art_dir, r18, glm, mlp):
    jobs = {}
    for name, (_, inputs, _, _, paths) in (("resnet18", r18), ("glm", glm), ("mlp", mlp)):
        inputs_path = art_dir / f"{name}_inputs.pt"
        torch.save(tuple(inputs), inputs_path)
        for fmt, path in paths.items():
            jobs[f"{name}_{fmt}"] = [str(path), str(inputs_path)]
    script, out_path = art_dir / "fresh.py", art_dir / "fresh_out.pt"
    script.write_text(_FRESH)
    proc = subprocess.run([sys.executable, str(script), json.dumps(jobs), str(out_path)], cwd=art_dir,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path, weights_only=False)


# ----------------------------------------------------------------------------- resnet18


def test_resnet_torchscript_fresh_process(r18, fresh):
    model, inputs, opt, out, _ = r18
    r = fresh["resnet18_pt"]
    assert r["type"] == "Tensor"
    _assert_matches(r["flat"], out, model, inputs)
    # plain torch.jit.load (after `import graphopt`) takes and returns flat tensors
    _assert_matches(r["jit_flat"], out, model, inputs)
    assert json.loads(r["meta"])["artifact"] == "torchscript"


def test_resnet_pt2_fresh_process(r18, fresh):
    model, inputs, opt, out, _ = r18
    r = fresh["resnet18_pt2"]
    assert r["type"] == "Tensor"
    _assert_matches(r["flat"], out, model, inputs)
    assert json.loads(r["meta"])["artifact"] == "pt2"


@pytest.mark.parametrize("fmt", ["pt", "pt2"])
def test_resnet_report_embedded(r18, fresh, fmt):
    _, _, opt, _, _ = r18
    report = json.loads(fresh[f"resnet18_{fmt}"]["report"])
    assert report == json.loads(opt.report.to_json())
    folds = [p for p in report["passes"] if p["name"] == "fold_conv_bn"]
    assert len(folds) == 1 and folds[0]["status"] == "applied" and folds[0]["rewrites"] == 20
    assert report["accuracy"]["passed"] is True


# ----------------------------------------------------------------------------- glm4-tiny


@pytest.mark.parametrize("fmt", ["pt", "pt2"])
def test_glm4_tiny_fresh_process_same_output_structure(glm, fresh, fmt):
    """graphopt.load in a fresh process gives back what the optimized module returns: a
    CausalLMOutputWithPast with a DynamicCache (importing the transformers modules the stored
    tree spec names), with the same logits and cache tensors."""
    model, inputs, opt, out, _ = glm
    assert type(out).__name__ == "CausalLMOutputWithPast"
    r = fresh[f"glm_{fmt}"]
    assert r["notes"] == []
    assert r["type"] == type(out).__name__
    cache = out[1]  # logits, then the cache (named past_key_values or cache by transformers version)
    assert r["cache_type"] == type(cache).__name__ == "DynamicCache"
    assert r["cache_layers"] == len(cache.layers) == model.config.num_hidden_layers
    assert r["logits"].shape == out.logits.shape
    _assert_matches(r["flat"], out, model, inputs)  # the logits and the cache tensors
    assert [p["name"] for p in json.loads(r["report"])["passes"]] == [p.name for p in opt.report.passes]


def test_glm4_tiny_plain_jit_load(glm, fresh):
    model, inputs, _, out, _ = glm
    _assert_matches(fresh["glm_pt"]["jit_flat"], out, model, inputs)


def test_glm4_tiny_without_transformers_is_flat_and_says_so(glm, fresh):
    model, inputs, _, out, _ = glm
    r = fresh["no_transformers"]
    assert r["type"] == "tuple"
    assert any("out_spec" in n and "flat tuple" in n and "transformers" in n for n in r["notes"]), r["notes"]
    _assert_matches(r["flat"], out, model, inputs)


# ----------------------------------------------------------------------------- in process


@pytest.mark.parametrize("fmt", ["pt", "pt2"])
def test_in_process_round_trip_and_guard(mlp, fmt):
    model, inputs, opt, out, paths = mlp
    loaded = graphopt.load(paths[fmt])
    assert isinstance(loaded, torch.nn.Module)
    assert loaded.meta["artifact"] == ("torchscript" if fmt == "pt" else "pt2")
    assert [p["name"] for p in loaded.report["passes"]] == [p.name for p in opt.report.passes]
    with torch.no_grad():
        _assert_matches(loaded(*inputs), out)
    (x,) = inputs
    for bad in ((torch.randn(x.shape[0] + 1, x.shape[1]),), (x.double(),), (x, x)):
        with pytest.raises(graphopt.GuardError) as ei:
            loaded(*bad)
        assert "\n" not in str(ei.value)


@pytest.mark.parametrize("fmt", ["pt", "pt2"])
def test_dynamic_batch_survives_export(tmp_path, fmt):
    model, inputs = zoo.get("mlp")
    opt = graphopt.optimize(model, inputs, dynamic={"x": {0: "batch"}})
    loaded = graphopt.load(graphopt.export(opt, tmp_path / f"dyn.{fmt}"))
    for batch in (3, 11):
        x = torch.randn(batch, inputs[0].shape[1])
        with torch.no_grad():
            _assert_matches(loaded(x), opt(x))
            res = accuracy.check(loaded(x), accuracy.fp64_reference(model, (x,), {}), model(x))
            assert res.passed, res.reason
    with pytest.raises(graphopt.GuardError):
        loaded(torch.randn(3, inputs[0].shape[1] + 1))


class _Shuffle(torch.nn.Module):
    """A channel shuffle: its views compute with the batch size (a symbolic size in the graph)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        b = x.shape[0]
        y = self.lin(x).view(b, 2, 4).transpose(1, 2).reshape(b, 8)
        return torch.relu(y) * x


def test_dynamic_size_arithmetic_survives_torchscript(tmp_path):
    """A graph that computes with a dynamic dim's size (aten.sym_size feeding a view) exports as
    TorchScript that computes it at run time: scripted, not traced with the example's batch baked in
    (which failed inside the TorchScript interpreter on any other batch)."""
    torch.manual_seed(0)
    model, x = _Shuffle().eval(), torch.randn(2, 8)
    opt = graphopt.optimize(model, (x,), dynamic={"x": {0: "batch"}}, check_accuracy=False)
    assert any(n.target is torch.ops.aten.sym_size.int for n in opt.graph_module.graph.nodes)
    loaded = graphopt.load(graphopt.export(opt, tmp_path / "dyn.pt"))
    assert loaded.meta["torchscript"] == "script"
    for batch in (2, 5):
        xb = torch.randn(batch, 8)
        with torch.no_grad():
            _assert_matches(loaded(xb), opt(xb))


class _Counting(_Shuffle):
    """The shuffle, counting its calls in a buffer and scaling its input in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        x.mul_(2)
        return super().forward(x)


def test_exporting_leaves_the_models_buffers_and_the_example_as_they_were(tmp_path):
    """The runs that check a TorchScript artifact (scripted against the graph) each get their own
    inputs and leave the buffers the graph writes as they were: the graph writing its input in place
    does not make the two runs differ (which refused the script), and the model's counter is not
    advanced by export."""
    torch.manual_seed(0)
    model, x = _Counting().eval(), torch.randn(2, 8)
    opt = graphopt.optimize(model, (x.clone(),), dynamic={"x": {0: "batch"}}, check_accuracy=False, measure=False)
    example = [t.clone() for t in opt._example_flat]
    loaded = graphopt.load(graphopt.export(opt, tmp_path / "counting.pt"))
    assert loaded.meta["torchscript"] == "script"
    assert int(model.calls) == 0 and torch.equal(opt._example_flat[0], example[0])
    xb = torch.randn(3, 8)
    with torch.no_grad():
        _assert_matches(loaded(xb.clone()), opt(xb.clone()))


def test_traced_artifact_refuses_dynamic_dims_it_baked():
    """Where only a trace works, one that fixed a dynamic dim's size is refused in one line."""
    torch.manual_seed(0)
    model, x = _Shuffle().eval(), torch.randn(2, 8)
    opt = graphopt.optimize(model, (x,), dynamic={"x": {0: "batch"}}, check_accuracy=False)
    flat = export_mod._flat_graph_module(opt.graph_module)
    with torch.no_grad():
        traced = torch.jit.trace(flat, (x,), check_trace=False, strict=False)
    with pytest.raises(graphopt.GraphoptError, match="dynamic dims") as ei:
        export_mod._check_trace_dynamic(flat, traced, [x], {0: {0}})
    assert "\n" not in str(ei.value)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, k: int = 2, flag: bool = True):
        y = self.lin(x) * k
        return y.relu() if flag else y


def test_scalar_inputs_are_guarded_constants_of_the_artifact(tmp_path):
    """Python scalars torch.export made constants of the graph: TorchScript exports (it could not
    trace a tuple holding ints), and either artifact refuses another value with GuardError, as the
    optimized module does (the .pt2 raised torch's AssertionError)."""
    torch.manual_seed(0)
    model, x = _Scaled().eval(), torch.randn(2, 8)
    opt = graphopt.optimize(model, (x, 3, True), check_accuracy=False, measure=False)
    for fmt in ("pt", "pt2"):
        loaded = graphopt.load(graphopt.export(opt, tmp_path / f"scaled.{fmt}"))
        with torch.no_grad():
            _assert_matches(loaded(x, 3, True), opt(x, 3, True))
        for k, flag in ((5, True), (3, False), (3.0, True)):
            with pytest.raises(graphopt.GuardError, match="constant"):
                loaded(x, k, flag)


class _TwoIndexInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, ids=None, positions=None):
        return self.emb(ids) + 2 * self.emb(positions)


def test_loaded_module_takes_keyword_inputs_in_any_order(tmp_path):
    """Keyword inputs named in another order than the example's, or passed by position, reach the
    artifact's flat inputs by name (two int64 inputs of one shape were swapped silently: the guard
    saw nothing wrong)."""
    torch.manual_seed(0)
    model = _TwoIndexInputs().eval()
    ids, pos = torch.randint(0, 16, (2, 5)), torch.arange(5).expand(2, 5).contiguous()
    opt = graphopt.optimize(model, {"positions": pos, "ids": ids}, check_accuracy=False, measure=False)
    with torch.no_grad():
        want = model(ids=ids, positions=pos)
    for fmt in ("pt", "pt2"):
        loaded = graphopt.load(graphopt.export(opt, tmp_path / f"kw.{fmt}"))
        with torch.no_grad():
            for args, kwargs in (((), {"ids": ids, "positions": pos}), ((ids, pos), {}), ((ids,), {"positions": pos})):
                _assert_matches(loaded(*args, **kwargs), want)
        with pytest.raises(graphopt.GuardError):
            loaded(ids)


def test_low_precision_graph_round_trip(tmp_path):
    """A graph assign_precision lowered to bf16 (casts and bf16 constants inside) exports and
    reloads with the same outputs, in the model's output dtype."""
    model, inputs, opt, out = _optimized("mlp", precision="bf16")
    assert opt.report.pass_result("assign_precision").status == "applied"
    for fmt in ("pt", "pt2"):
        loaded = graphopt.load(graphopt.export(opt, tmp_path / f"bf16.{fmt}"))
        with torch.no_grad():
            got = loaded(*inputs)
        assert got.dtype == torch.float32
        _assert_matches(got, out)


def test_export_refuses_what_it_cannot_write(mlp, tmp_path):
    model, inputs, opt, _, _ = mlp
    with pytest.raises(graphopt.GraphoptError, match="format"):
        graphopt.export(opt, tmp_path / "x.pt", format="onnx")
    with pytest.raises(graphopt.GraphoptError, match="graphopt.optimize"):
        graphopt.export(model, tmp_path / "x.pt")
    (tmp_path / "file").write_text("")
    with pytest.raises(graphopt.GraphoptError, match="cannot write"):
        graphopt.export(opt, tmp_path / "file" / "x.pt")  # parent is a file
    (tmp_path / "d.pt2").mkdir()
    with pytest.raises(graphopt.GraphoptError, match="cannot write .*d.pt2: it is a directory$"):
        graphopt.export(opt, tmp_path / "d.pt2")


def test_artifact_from_a_newer_graphopt(mlp, tmp_path, monkeypatch):
    _, _, opt, _, _ = mlp
    monkeypatch.setattr(export_mod, "FORMAT_VERSION", 99)
    path = graphopt.export(opt, tmp_path / "future.pt")
    monkeypatch.setattr(export_mod, "FORMAT_VERSION", 1)
    with pytest.raises(graphopt.ArtifactError, match="newer graphopt"):
        graphopt.load(path)


# ----------------------------------------------------------------------------- foreign files


class _Plain(torch.nn.Module):
    def forward(self, x):
        return x + 1


def _make_foreign(kind: str, tmp_path, mlp_paths):
    p = tmp_path / f"{kind}.pt"
    if kind == "text":
        p.write_text("this is not a model\n")
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "tensor":
        torch.save(torch.ones(3), p)
    elif kind == "state_dict":
        torch.save(torch.nn.Linear(2, 2).state_dict(), p)
    elif kind == "plain_jit":
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(p))
    elif kind == "plain_pt2":
        p = tmp_path / "plain.pt2"
        torch.export.save(torch.export.export(_Plain(), (torch.ones(2),)), str(p))
    elif kind == "zip_with_junk_meta":
        with zipfile.ZipFile(p, "w") as z:
            z.writestr(f"x/{export_mod.META}", "not json")
    elif kind in ("truncated", "truncated_tail"):
        data = mlp_paths["pt"].read_bytes()
        p.write_bytes(data[: len(data) // 2] if kind == "truncated" else data[:-10])
    elif kind in ("corrupt_pt", "corrupt_pt2"):
        src = mlp_paths["pt" if kind == "corrupt_pt" else "pt2"]
        data = bytearray(src.read_bytes())
        mid = len(data) // 2
        data[mid: mid + 64] = bytes((b ^ 0xFF) for b in data[mid: mid + 64])
        p = tmp_path / src.name
        p.write_bytes(bytes(data))
    elif kind == "missing":
        p = tmp_path / "does_not_exist.pt"
    elif kind == "directory":
        p = tmp_path / "adir.pt"
        p.mkdir()
    else:  # pragma: no cover
        raise AssertionError(kind)
    return p


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.* deprecation, for the plain_jit file
@pytest.mark.parametrize("kind", ["text", "empty", "tensor", "state_dict", "plain_jit", "plain_pt2",
                                  "zip_with_junk_meta", "truncated", "truncated_tail", "corrupt_pt",
                                  "corrupt_pt2", "missing", "directory"])
def test_load_foreign_or_damaged_raises_artifact_error(kind, tmp_path, mlp):
    path = _make_foreign(kind, tmp_path, mlp[4])
    with pytest.raises(graphopt.ArtifactError) as ei:
        graphopt.load(path)
    msg = str(ei.value)
    assert "\n" not in msg and path.name in msg
    assert isinstance(ei.value, graphopt.GraphoptError)
