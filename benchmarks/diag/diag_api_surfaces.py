"""Do export/load, dynamic=, on_new_shape, training steps and the caller's state hold on CPU models outside the sweep? After the fixes on branch hunt-a (a .pt baked a dynamic batch, dynamic dims and artifacts' inputs by keyword/positional order, buffers written by optimize() and export, reoptimize per batch size, scalar inputs of artifacts, a budget minimum above the baseline) every cell passes on shufflenet, mpnet, deberta-v2 and opt (no result file).

Cells, each judged by the accuracy rule against float64 (eager fp32 the yardstick):

- ``export``: ``optimize(dynamic=batch[, seq])``, calls at other sizes, then ``.pt`` and ``.pt2`` artifacts
  reloaded and called at another size (and with keyword inputs in another order);
- ``train``: ``training=True``, 3 steps of SGD with momentum and of AdamW through the optimized module
  against eager and float64 copies (parameters, losses and buffers: BatchNorm statistics), dropout 0;
  ``--budget`` adds ``memory_budget``; the model's state is checked unchanged by optimize();
- ``reopt``: ``on_new_shape="reoptimize"`` at new shapes (with a dynamic batch: one specialization per
  new sequence length).

    python benchmarks/diag/diag_api_surfaces.py [--only export,train,reopt] [--models a,b] [--budget 0.5]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt import accuracy  # noqa: E402

V = 256
_TXT = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, pad_token_id=0)
_NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _hf(cfg, cls, kw, seq_dynamic=True):
    def make(train=False):
        import transformers as T

        torch.manual_seed(0)
        model = getattr(T, cls)(getattr(T, cfg)(**kw))
        return model.train(train), "text", seq_dynamic
    return make


def _tv(name, **kw):
    def make(train=False):
        import torchvision

        torch.manual_seed(0)
        return getattr(torchvision.models, name)(num_classes=10, **kw).train(train), "image", False
    return make


MODELS = {
    "shufflenet": _tv("shufflenet_v2_x0_5"),
    "mnasnet": _tv("mnasnet0_5"),
    "squeezenet": _tv("squeezenet1_1"),
    "regnet": _tv("regnet_x_400mf"),
    "googlenet": _tv("googlenet", aux_logits=False, init_weights=True),
    "deberta-v2": _hf("DebertaV2Config", "DebertaV2Model",
                      dict(_TXT, relative_attention=True, pos_att_type=["p2c", "c2p"], **_NO_DROP), False),
    "funnel": _hf("FunnelConfig", "FunnelBaseModel", dict(vocab_size=V, d_model=64, n_head=4, d_head=16, d_inner=128,
                                                          block_sizes=[1, 1], hidden_dropout=0.0,
                                                          attention_dropout=0.0, activation_dropout=0.0), False),
    "xlm-roberta": _hf("XLMRobertaConfig", "XLMRobertaModel", dict(_TXT, **_NO_DROP)),
    "mpnet": _hf("MPNetConfig", "MPNetModel", dict(_TXT, **_NO_DROP)),
    "bloom": _hf("BloomConfig", "BloomModel", dict(vocab_size=V, hidden_size=64, n_layer=2, n_head=4, use_cache=False,
                                                   hidden_dropout=0.0, attention_dropout=0.0)),
    "gpt-neox": _hf("GPTNeoXConfig", "GPTNeoXModel", dict(_TXT, use_cache=False, hidden_dropout=0.0,
                                                          attention_dropout=0.0)),
    "opt": _hf("OPTConfig", "OPTModel", dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                             num_attention_heads=4, max_position_embeddings=64,
                                             word_embed_proj_dim=64, use_cache=False, dropout=0.0,
                                             attention_dropout=0.0)),
    "mistral": _hf("MistralConfig", "MistralModel", dict(_TXT, num_key_value_heads=2, head_dim=16, use_cache=False)),
    "olmo": _hf("OlmoConfig", "OlmoModel", dict(_TXT, num_key_value_heads=2, use_cache=False)),
}


def _inputs(kind, b, s, gen):
    if kind == "image":
        return (torch.randn(b, 3, s, s, generator=gen),), {}
    mask = torch.ones(b, s, dtype=torch.long)
    if b > 1:
        mask[1, :2] = 0
    return (), {"input_ids": torch.randint(3, V, (b, s), generator=gen), "attention_mask": mask}


def _rule(model, out, args, kwargs):
    with torch.no_grad():
        eager = model(*args, **kwargs)
    res = accuracy.check(out, accuracy.fp64_reference(model, args, kwargs), eager)
    return "ok" if res.passed else "FAIL " + res.reason[:120]


def export_cell(name):
    model, kind, seq = MODELS[name]()
    gen = torch.Generator().manual_seed(0)
    size = 32 if kind == "image" else 12
    args, kwargs = _inputs(kind, 2, size, gen)
    dims = {0: "batch", 1: "seq"} if seq else {0: "batch"}
    dynamic = {"x": {0: "batch"}} if kind == "image" else {k: dims for k in kwargs}
    opt = graphopt.optimize(model, (args, kwargs), dynamic=dynamic)
    sizes = [(3, size), (1, size)] + ([(3, size - 3)] if seq else [])
    out = {}
    for b, s in sizes:
        a, k = _inputs(kind, b, s, gen)
        with torch.no_grad():
            out[f"opt {b}x{s}"] = _rule(model, opt(*a, **k), a, k)
    tmp = tempfile.mkdtemp()
    for ext in ("pt", "pt2"):
        try:
            loaded = graphopt.load(graphopt.export(opt, os.path.join(tmp, f"{name}.{ext}")))
        except graphopt.GraphoptError as e:
            out[ext] = f"refused: {e}"
            continue
        b, s = sizes[-1]
        a, k = _inputs(kind, b, s, gen)
        k = dict(reversed(list(k.items())))  # keyword inputs in another order than the example's
        with torch.no_grad():
            out[f"{ext} {b}x{s}"] = _rule(model, loaded(*a, **k), a, k)
    return out


def _loss(out):
    out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    out = out if isinstance(out, torch.Tensor) else out[0]
    return out.double().pow(2).mean()


def _steps(fn, owner, args, kwargs, which, n=3):
    opt = (torch.optim.SGD(owner.parameters(), lr=0.05, momentum=0.9) if which == "sgd"
           else torch.optim.AdamW(owner.parameters(), lr=1e-3))
    losses = []
    for i in range(n):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        loss = _loss(fn(*args, **kwargs))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses + list(owner.parameters()) + list(owner.buffers())


def _state(model, tensors):
    return [(t, t.detach().clone(), t.requires_grad, t.dtype, t.stride())
            for t in (*model.parameters(), *model.buffers(), *tensors)]


def _unchanged(before, model, tensors):
    now = list((*model.parameters(), *model.buffers(), *tensors))
    return len(now) == len(before) and all(
        t is b[0] and torch.equal(t, b[1]) and (t.requires_grad, t.dtype, t.stride()) == b[2:]
        for t, b in zip(now, before))


def train_cell(name, budget=None):
    out = {}
    for which in ("sgd", "adamw"):
        model, kind, _ = MODELS[name](train=True)
        gen = torch.Generator().manual_seed(0)
        args, kwargs = _inputs(kind, 4 if kind == "image" else 2, 32 if kind == "image" else 12, gen)
        ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
        tensors = [*args, *kwargs.values()]
        before = _state(model, tensors)
        opts = {"memory_budget": budget} if budget else {}
        try:
            opt = graphopt.optimize(model, (args, kwargs), training=True, **opts)
        except graphopt.BudgetError as e:
            out[which] = f"BudgetError (minimum {e.minimum})"
            continue
        same = _unchanged(before, model, tensors)
        ours = _steps(opt, model, args, kwargs, which)
        eager = _steps(ref, ref, args, kwargs, which)
        d = lambda x: x.double() if x.is_floating_point() else x  # noqa: E731
        gold = _steps(ref64, ref64, tuple(map(d, args)), {k: d(v) for k, v in kwargs.items()}, which)
        res = accuracy.check(ours, gold, eager, training=True)
        out[which] = ("ok" if res.passed else "FAIL " + res.reason[:120]) + ("" if same else " (optimize CHANGED state)")
    return out


def reopt_cell(name):
    model, kind, seq = MODELS[name]()
    gen = torch.Generator().manual_seed(0)
    size = 32 if kind == "image" else 12
    args, kwargs = _inputs(kind, 2, size, gen)
    dynamic = None if kind == "image" else {k: {0: "batch"} for k in kwargs}
    opt = graphopt.optimize(model, (args, kwargs), dynamic=dynamic, on_new_shape="reoptimize")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for b, s in ((3, size), (2, size + 8), (4, size + 8), (3, size)):
            a, k = _inputs(kind, b, s, gen)
            with torch.no_grad():
                out[f"{b}x{s}"] = _rule(model, opt(*a, **k), a, k)
    out["specializations"] = len(opt.__dict__.get("_specializations", {}))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="export,train,reopt")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget", type=float, default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    cells = {"export": export_cell, "train": lambda n: train_cell(n, args.budget), "reopt": reopt_cell}
    for name in args.models.split(","):
        for cell in args.only.split(","):
            t0 = time.time()
            try:
                res = cells[cell](name)
            except Exception as e:  # noqa: BLE001 (a diag: report and go on)
                traceback.print_exc()
                res = {"EXC": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            print(f"{name:12s} {cell:7s} {res} {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
