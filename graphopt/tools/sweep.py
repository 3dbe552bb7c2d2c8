"""The model sweep (issue 10, item 1): every torchvision classification model and a list of
Hugging Face architectures built from tiny configs with random weights, optimized on the CPU in
fp32 and compared with eager by the accuracy rule.

Each model ends as one of

* ``pass``           optimize() ran and its output meets the accuracy rule (fp64 reference)
* ``fail_accuracy``  it ran but the output breaks the rule (the message says by how much)
* ``capture_error``  graphopt.CaptureError (its message)
* ``fail_to_run``    any other exception (type and first line)
* ``skipped``        not run: too big for a CPU sweep, or over the per-model time limit

``benchmarks/sweep.py`` is the command; ``tests/test_sweep.py`` runs a fast subset against the
committed ``tests/sweep_expected.csv``. Nothing is downloaded: weights are random.
"""

from __future__ import annotations

import csv
import io
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

STATUSES = ("pass", "fail_accuracy", "capture_error", "fail_to_run", "skipped")
FIELDS = ("name", "source", "status", "seconds", "message")
EXPECTED_CSV = Path(__file__).resolve().parents[2] / "tests" / "sweep_expected.csv"

# torchvision models whose float64 reference and per-pass accuracy checks do not fit a CPU sweep's
# time budget (parameters above this many millions are skipped with that reason)
MAX_TV_PARAMS_M = float(os.environ.get("GRAPHOPT_SWEEP_MAX_PARAMS_M", "1000"))  # CPU sweep: skip bigger models
# image sizes tried in order: the smallest the model accepts is used (ViT/Swin/MaxViT need 224)
IMAGE_SIZES = (64, 224, 299)


@dataclass
class Row:
    name: str
    source: str
    status: str
    seconds: float
    message: str = ""

    def as_csv(self) -> dict:
        return {"name": self.name, "source": self.source, "status": self.status,
                "seconds": f"{self.seconds:.1f}", "message": self.message}


@dataclass
class Spec:
    name: str
    source: str  # "torchvision" | "hf"
    build: Callable[[], tuple]  # -> (model, example_inputs)


def _one_line(text: str, limit: int = 300) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line[:limit]


# --------------------------------------------------------------------------- torchvision

def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


class Skip(Exception):
    """Raised by a builder: the model is not run, with this reason."""


def _tv_build(name: str):
    def build():
        import torchvision

        torch.manual_seed(0)
        try:  # count parameters without allocating them
            with torch.device("meta"):
                params = sum(p.numel() for p in torchvision.models.get_model(name, weights=None).parameters())
        except Exception:  # an initializer that reads values (RegNet): count a real build
            params = sum(p.numel() for p in torchvision.models.get_model(name, weights=None).parameters())
        if params / 1e6 > MAX_TV_PARAMS_M:
            raise Skip(f"{params / 1e6:.0f}M parameters, over the CPU sweep's {MAX_TV_PARAMS_M:.0f}M limit")
        kw = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
        model = torchvision.models.get_model(name, weights=None, **kw).eval()
        gen = torch.Generator().manual_seed(0)
        err = None
        for size in IMAGE_SIZES:
            x = torch.randn(1, 3, size, size, generator=gen)
            try:
                with torch.no_grad():
                    model(x)
                return model, (x,)
            except Exception as e:  # too small for this model: try the next size
                err = e
        raise RuntimeError(f"no image size in {IMAGE_SIZES} runs eagerly: {_one_line(err)}")

    return build


# --------------------------------------------------------------------------- Hugging Face

SEQ = 16
VOCAB = 256
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the small vocabulary
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64)
_DECODER = dict(_TEXT, num_key_value_heads=2, use_cache=False)  # GQA: 4 query heads, 2 kv heads
_VISION = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=128)

# name -> (config class, model class, config kwargs, input kind)
HF_MODELS: dict[str, tuple[str, str, dict, str]] = {
    "bert": ("BertConfig", "BertModel", _TEXT, "text_mask"),
    "roberta": ("RobertaConfig", "RobertaModel", _TEXT, "text_mask"),
    "distilbert": ("DistilBertConfig", "DistilBertModel",
                   dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                        max_position_embeddings=64), "text_mask"),
    "albert": ("AlbertConfig", "AlbertModel", dict(_TEXT, embedding_size=32), "text_mask"),
    "electra": ("ElectraConfig", "ElectraModel", dict(_TEXT, embedding_size=32), "text_mask"),
    "deberta-v2": ("DebertaV2Config", "DebertaV2Model", dict(_TEXT, relative_attention=True,
                                                             position_buckets=8, pos_att_type=["p2c", "c2p"]),
                   "text_mask"),
    "gpt2": ("GPT2Config", "GPT2Model", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                             use_cache=False, **_TOKENS), "text"),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXModel", dict(_TEXT, use_cache=False), "text"),
    "llama": ("LlamaConfig", "LlamaModel", _DECODER, "text"),
    "mistral": ("MistralConfig", "MistralModel", dict(_DECODER, sliding_window=None), "text"),
    "qwen2": ("Qwen2Config", "Qwen2Model", _DECODER, "text"),
    "gemma": ("GemmaConfig", "GemmaModel", dict(_DECODER, head_dim=16), "text"),
    "phi": ("PhiConfig", "PhiModel", dict(_TEXT, use_cache=False), "text"),
    "glm4": ("Glm4Config", "Glm4Model", dict(_DECODER, head_dim=16, **_TOKENS), "text"),
    "t5": ("T5Config", "T5Model", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                        num_decoder_layers=2, num_heads=4, use_cache=False), "seq2seq"),
    "bart": ("BartConfig", "BartModel", dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                             encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=128, decoder_ffn_dim=128,
                                             max_position_embeddings=64, use_cache=False), "seq2seq"),
    "vit": ("ViTConfig", "ViTModel", _VISION, "image"),
    "deit": ("DeiTConfig", "DeiTModel", _VISION, "image"),
    "swin": ("SwinConfig", "SwinModel", dict(image_size=32, patch_size=4, num_channels=3, embed_dim=16,
                                             depths=[1, 1], num_heads=[2, 2], window_size=4), "image"),
    "convnext": ("ConvNextConfig", "ConvNextModel", dict(num_channels=3, num_stages=2, hidden_sizes=[16, 32],
                                                         depths=[1, 1], image_size=32), "image"),
}


def _hf_inputs(kind: str, gen: torch.Generator) -> dict:
    if kind == "image":
        return {"pixel_values": torch.randn(1, 3, 32, 32, generator=gen)}
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=gen)
    if kind == "text":
        return {"input_ids": ids}
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[:, -3:] = 0  # right padding: the mask matters
    if kind == "text_mask":
        return {"input_ids": ids, "attention_mask": mask}
    dec = torch.randint(3, VOCAB, (1, SEQ // 2), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}


def _hf_build(name: str):
    cfg_name, model_name, cfg_kw, kind = HF_MODELS[name]

    def build():
        import transformers

        torch.manual_seed(0)
        cls = getattr(transformers, cfg_name)
        try:
            cfg = cls(**cfg_kw, attn_implementation="eager")
        except TypeError:  # a config that does not take the option
            cfg = cls(**cfg_kw)
        model = getattr(transformers, model_name)(cfg).eval()
        return model, _hf_inputs(kind, torch.Generator().manual_seed(0))

    return build


# --------------------------------------------------------------------------- running

def all_specs() -> list[Spec]:
    specs = [Spec(n, "torchvision", _tv_build(n)) for n in torchvision_names()]
    specs += [Spec(n, "hf", _hf_build(n)) for n in HF_MODELS]
    return specs


def get_specs(names: list[str] | None = None) -> list[Spec]:
    specs = all_specs()
    if not names:
        return specs
    by = {s.name: s for s in specs}
    unknown = [n for n in names if n not in by]
    if unknown:
        raise KeyError(f"unknown sweep model(s) {', '.join(unknown)}; known: {', '.join(by)}")
    return [by[n] for n in names]


def strict_plan(model, inputs, target: str):
    """``model`` captured and run through every pass but assign_precision in strict mode (a pass that
    raises or breaks an invariant raises instead of being reverted), priced with ``target``'s cost
    profile as optimize() plans for CUDA-graph replay on that device: (the graph, the applied passes).
    On the CPU this exercises the passes a GPU plan applies, kernels replaced by their references."""
    import dataclasses

    from graphopt import capture, ir
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import PassContext, PassManager, assemble, available

    gm = capture(model, inputs)
    prof = get_profile(target)[0]
    if prof.kind == "cuda":
        prof = dataclasses.replace(prof, launch_overhead_s=prof.launch_overhead_graph_s)
    ctx = PassContext(profile=prof, cost=CostModel(prof), hints=ir.shape_hints(gm), strict=True)
    results = PassManager(assemble([p for p in available() if p != "assign_precision"])).run(gm, ctx)
    return gm, [r.name for r in results if r.status == "applied"]


def _seeded(fn, args, kwargs, seed: int = 0):
    """``fn(*args, **kwargs)`` from the RNG state of ``seed``, the global state left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)


def run_one(spec: Spec, plan: str | None = None) -> Row:
    """Build, optimize (CPU, fp32, default options) and judge one model, in this process. ``plan``:
    instead of optimize(), the passes in strict mode priced for that target (:func:`strict_plan`); a
    pass that breaks the graph is then a ``fail_to_run``."""
    import graphopt
    from graphopt import accuracy
    from graphopt.capture import split_inputs
    from graphopt.errors import CaptureError

    t0 = time.perf_counter()

    def row(status, msg=""):
        return Row(spec.name, spec.source, status, time.perf_counter() - t0, _one_line(msg))

    try:
        model, inputs = spec.build()
    except Skip as e:
        return row("skipped", str(e))
    except Exception as e:
        return row("fail_to_run", f"building the model: {type(e).__name__}: {_one_line(e)}")
    try:
        if plan:
            opt = strict_plan(model, inputs, plan)[0]
        else:
            opt = graphopt.optimize(model, inputs)  # default options: CPU, fp32 model
        args, kwargs = split_inputs(inputs)
        with torch.no_grad():  # each run from one RNG state: a model drawing at inference draws the same
            eager = _seeded(model, args, kwargs)
            out = _seeded(opt, args, kwargs)
        ref = _seeded(lambda *a, **k: accuracy.fp64_reference(model, a, k), args, kwargs)
        res = accuracy.check(out, ref, eager)
    except CaptureError as e:
        return row("capture_error", str(e))
    except Exception as e:
        if os.environ.get("GRAPHOPT_SWEEP_TRACEBACK"):
            traceback.print_exc()
        return row("fail_to_run", f"{type(e).__name__}: {_one_line(e)}")
    if not res.passed:
        return row("fail_accuracy", res.reason)
    return row("pass")


def _child(spec: Spec, conn, plan: str | None = None) -> None:
    try:
        r = run_one(spec, plan)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        r = Row(spec.name, spec.source, "fail_to_run", 0.0, f"{type(e).__name__}: {_one_line(e)}")
    conn.send(r)
    conn.close()


def run_isolated(spec: Spec, timeout_s: float, plan: str | None = None) -> Row:
    """run_one in a forked child with a time limit (a hung or huge model costs only its limit)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    p = ctx.Process(target=_child, args=(spec, send, plan), daemon=True)
    p.start()
    send.close()
    result = None
    if recv.poll(timeout_s):
        try:
            result = recv.recv()
        except EOFError:
            result = None
    p.join(5)
    if p.is_alive():
        p.kill()
        p.join()
    if result is None:
        took = time.perf_counter() - t0
        if took >= timeout_s:
            return Row(spec.name, spec.source, "skipped", took, f"over the {timeout_s:.0f} s per-model time limit")
        return Row(spec.name, spec.source, "fail_to_run", took, f"the worker died (exit code {p.exitcode})")
    return result


def sweep(specs: list[Spec], timeout_s: float | None = 300.0, log=None, plan: str | None = None) -> list[Row]:
    rows = []
    for s in specs:
        r = run_isolated(s, timeout_s, plan) if timeout_s else run_one(s, plan)
        if log:
            log(f"{r.source:12s} {r.name:24s} {r.status:14s} {r.seconds:7.1f}s  {r.message}")
        rows.append(r)
    return rows


def write_csv(rows: list[Row], path: Path | str | None = None) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r.as_csv())
    text = buf.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def read_csv(path: Path | str = EXPECTED_CSV) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}


def merge(expected: dict[str, dict], rows: list[Row]) -> list[dict]:
    """The expected table with these rows replaced/added (keeps the sweep's order for new ones)."""
    out = dict(expected)
    for r in rows:
        out[r.name] = r.as_csv()
    return list(out.values())


def difference(row: Row, expected: dict[str, dict]) -> str | None:
    """None when ``row``'s status is the committed one; else what changed (a regression, or an
    unexpected improvement that needs the CSV updated) and the command that updates it."""
    if row.name not in expected:
        return f"{row.name}: no expected status; add it: python benchmarks/sweep.py --models {row.name} --update"
    want = expected[row.name]
    if row.status == want["status"]:
        return None
    update = f"python benchmarks/sweep.py --models {row.name} --update"
    if row.status == "pass":
        return (f"{row.name}: unexpected improvement: expected {want['status']} ({want['message']}), now passes; "
                f"update the CSV: {update}")
    return f"{row.name}: regression: expected {want['status']}, got {row.status}: {row.message} (if intended: {update})"


def counts(rows) -> dict[tuple[str, str], int]:
    c: dict[tuple[str, str], int] = {}
    for r in rows:
        src, st = (r.source, r.status) if isinstance(r, Row) else (r["source"], r["status"])
        c[(src, st)] = c.get((src, st), 0) + 1
    return c
