"""Training steps on five transformer architectures (issue 29): graphopt against eager bf16 and the
model's own gradient checkpointing, with the gradients judged against float64.

    python benchmarks/training_bench.py --out DIR [--configs qwen2,llama,glm4,gpt2,bert] [--tiny]
                                        [--layers N] [--reps 20] [--warmup 3] [--budget 0.3]
                                        [--budget-s S] [--fp64-rows N] [--no-guard] [--device cuda|cpu]

On the H200 (the JSON and Markdown are rewritten after every variant; --budget-s stops starting new ones):

    python -m graphopt build-kernels && python benchmarks/training_bench.py --out $OUT --budget-s 450

Architectures (Hugging Face base models, random weights from transformers' own init, bf16, SDPA
attention, dropout off, no KV cache; the per-layer shapes of one real member, fewer layers):

* ``qwen2``: the Qwen2.5-3B shape (Qwen2 architecture: hidden 2048, 16 heads, 2 KV heads, SwiGLU
  11008, q/k/v bias), 6 layers, batch 4, seq 2048 (issue 29's own case).
* ``llama``: the Llama-3-8B shape (``examples.decoders.llama3_8b_config``), 4 layers, batch 2, seq 2048.
* ``glm4``: the GLM-4-9B shape (``examples.decoders.glm4_9b_config``), 4 layers, batch 2, seq 2048.
* ``gpt2``: GPT-2 small (``GPT2Config()``, 12 layers), batch 16, seq 1024.
* ``bert``: BERT-base (``BertConfig()``, 12 layers), batch 32, seq 512, right-padded attention mask
  (``examples.zoo``'s BERT inputs).

``--tiny``: the same architectures at CPU sizes (hidden 64, 6 layers, batch 2, seq 64), for a dry run
and the tests.

Variants, each on the same model object and inputs:

* ``eager``: the bf16 model.
* ``hf_checkpointing``: the model with its own per-layer checkpointing (transformers'
  ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``, non-reentrant).
* ``graphopt``: ``graphopt.optimize(model, inputs, training=True)``.
* ``graphopt_budget``: the same with ``memory_budget=--budget`` (0.3: a fraction of the baseline
  step's activation memory as graphopt predicts it).

A step is: the parameters' gradients zeroed in place, the forward, and the backward of
``loss = sum_i <out_i, g_i>`` over the floating outputs (last hidden state; BERT's pooler output
too) for fixed random ``g_i`` made once (``torch.autograd.backward(outs, gs)``); no optimizer
step. ms/step is the median of --reps steps timed one at a time with CUDA events after --warmup
steps; activation memory is ``torch.cuda.max_memory_allocated()`` during one step minus
``torch.cuda.memory_allocated()`` before it (on the CPU: graphopt.tools.memtrace's live tensor
bytes). Both come from ``checkpoint_bench.Stepper`` / ``checkpoint_bench.measure``.

Gradients: one step of each graphopt variant, its outputs and every parameter's gradient judged by the
accuracy rule (``graphopt.accuracy.check``, bf16: tol 1e-2, k 3) against a float64 copy of the same
model on the same inputs and output gradients, eager bf16 as the yardstick. The float64 step runs a
few batch rows at a time (``--fp64-rows``) and sums the parameters' gradients over the chunks (the
loss is a sum over rows and no layer mixes rows), so it fits beside the model at the full config.

Targets (issue 29's "done when"), each MET or MISSED from the measurements:
speed: graphopt at least 1.15x faster per step than eager; budget: graphopt at the memory budget
faster than the model's own checkpointing at no more activation memory; gradients: both graphopt
variants pass the accuracy rule.

Writes ``training_<date>_<device>_torch-<ver>[_cuda-<ver>].json`` and ``.md`` into --out, rewritten
after every variant (a run cut short keeps what it measured); --budget-s: variants that would start
later are recorded as skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from checkpoint_bench import Stepper, _outs, free, gb, measure  # noqa: E402

from graphopt import accuracy  # noqa: E402
from graphopt.tools import bench  # noqa: E402

SPEED_TARGET = 1.15
TINY_LAYERS = 6  # the fewest layers at which every tiny config reaches a 0.3 budget


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- architectures


def _qwen2_config(tiny: bool):
    from graphopt.examples import decoders

    if tiny:
        return decoders.tiny_config("qwen2", layers=TINY_LAYERS)
    from transformers import Qwen2Config

    # Qwen/Qwen2.5-3B: 36 layers in the real model
    return Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=6,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)


def _llama_config(tiny: bool):
    from graphopt.examples import decoders

    return decoders.tiny_config("llama", layers=TINY_LAYERS) if tiny else decoders.llama3_8b_config(4)


def _glm4_config(tiny: bool):
    from graphopt.examples import decoders

    return decoders.tiny_config("glm4", layers=TINY_LAYERS) if tiny else decoders.glm4_9b_config(4)


def _gpt2_config(tiny: bool):
    from graphopt.examples import decoders

    if tiny:
        return decoders.tiny_config("gpt2", layers=TINY_LAYERS)
    from transformers import GPT2Config

    return GPT2Config()  # GPT-2 small: 12 layers, hidden 768, 12 heads


def _bert_config(tiny: bool):
    from transformers import BertConfig

    if tiny:  # examples.zoo's BERT inputs draw ids from 1000 up
        return BertConfig(num_hidden_layers=TINY_LAYERS, hidden_size=64, num_attention_heads=4, intermediate_size=160,
                          vocab_size=2048)
    return BertConfig()  # bert-base-uncased: 12 layers, hidden 768, 12 heads


@dataclass(frozen=True)
class Arch:
    name: str
    member: str  # the real model whose per-layer shape the full config has
    config: Callable  # tiny -> a transformers config
    batch: int
    seq: int
    masked: bool = False  # the inputs carry a right-padded attention mask


ARCHS = {a.name: a for a in (
    Arch("qwen2", "Qwen2.5-3B", _qwen2_config, 4, 2048),
    Arch("llama", "Llama-3-8B", _llama_config, 2, 2048),
    Arch("glm4", "GLM-4-9B", _glm4_config, 2, 2048),
    Arch("gpt2", "GPT-2 small", _gpt2_config, 16, 1024),
    Arch("bert", "BERT-base", _bert_config, 32, 512, masked=True),
)}
TINY_BATCH, TINY_SEQ = 2, 64


def _no_dropout(cfg) -> None:
    """Every dropout probability of ``cfg`` set to 0: steps are deterministic, so one step's gradients
    can be compared with float64's."""
    for key, value in list(cfg.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)


def build(arch: Arch, tiny: bool, device: torch.device, dtype: torch.dtype, layers: int | None = None, seed: int = 0):
    """(model in train mode, keyword inputs, config, batch, seq) for ``arch`` (``layers`` layers instead
    of its own count), random weights (seeded transformers init) built in ``dtype`` on ``device``."""
    from transformers import AutoModel

    from graphopt.examples import zoo

    cfg = arch.config(tiny)
    if layers is not None:
        cfg.num_hidden_layers = layers
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    _no_dropout(cfg)
    batch, seq = (TINY_BATCH, TINY_SEQ) if tiny else (arch.batch, arch.seq)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModel.from_config(cfg, dtype=dtype)
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    if arch.masked:
        ids, mask = zoo._bert_inputs(batch, seq, cfg.vocab_size, gen)
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    else:
        inputs = {"input_ids": torch.randint(3, min(cfg.vocab_size, 30000), (batch, seq), generator=gen).to(device)}
    return model, inputs, cfg, batch, seq


def describe(arch: Arch, cfg, model, batch: int, seq: int, tiny: bool) -> dict:
    get = lambda k: getattr(cfg, k, None)  # noqa: E731
    return {"arch": arch.name, "shape_of": arch.member + (" (tiny)" if tiny else ""), "model": type(model).__name__,
            "layers": get("num_hidden_layers"), "hidden": get("hidden_size"), "heads": get("num_attention_heads"),
            "kv_heads": get("num_key_value_heads") or get("num_attention_heads"),
            "intermediate": get("intermediate_size") or get("n_inner") or 4 * get("hidden_size"),
            "vocab": get("vocab_size"), "batch": batch, "seq": seq, "masked": arch.masked,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


# --------------------------------------------------------------------------- checkpointing toggles


def hf_checkpointing(model, on: bool) -> None:
    """The model's own per-layer checkpointing (non-reentrant), on or off: transformers 5.24 names it
    activation_checkpointing_*, earlier versions gradient_checkpointing_*."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()


# --------------------------------------------------------------------------- gradients


def one_step(fn, params, grads_out):
    """(outputs, gradients) of one step of ``fn()`` (zeros for a parameter the loss does not reach);
    the parameters' ``.grad`` are left cleared."""
    for p in params:
        p.grad = None
    outs = _outs(fn())
    torch.autograd.backward(outs, grads_out)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return [o.detach() for o in outs], grads


def fp64_step(model, inputs: dict, grads_out, rows: int):
    """The step's outputs and parameter gradients from a float64 copy of ``model``, run ``rows`` batch
    rows at a time (gradients summed over the chunks, outputs concatenated), kept in float32
    (accuracy.reference_dtype of a bf16 result)."""
    m64 = copy.deepcopy(model).double()
    m64.train()
    p64 = list(m64.parameters())
    batch = next(iter(inputs.values())).shape[0]
    parts = []
    for s in range(0, batch, rows):
        kw = {k: v[s:s + rows] for k, v in inputs.items()}
        outs = _outs(m64(**kw))
        torch.autograd.backward(outs, [g[s:s + rows].double() for g in grads_out])
        parts.append([o.detach().float() for o in outs])
        del outs
    outs = [torch.cat(chunk) for chunk in zip(*parts)]
    grads = [p.grad.float() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
             for p in p64]
    del m64, p64, parts
    return outs, grads


def grad_check(fn, params, names, grads_out, eager, gold, dtype) -> dict:
    """One step of ``fn`` judged by the accuracy rule against ``gold`` (float64 outputs + gradients),
    ``eager`` (the eager step's) the yardstick."""
    outs, grads = one_step(fn, params, grads_out)
    res = accuracy.check(outs + grads, gold[0] + gold[1], eager[0] + eager[1], training=True, dtype=dtype)
    labels = [f"output {i}" for i in range(len(outs))] + names
    how: dict = {}
    for leaf in res.leaves:
        how[leaf.how] = how.get(leaf.how, 0) + 1
    failed = [{"tensor": labels[leaf.index], "rmse": leaf.rmse, "eager_rmse": leaf.eager_rmse, "max_abs_err": leaf.max_abs_err}
              for leaf in res.leaves if not leaf.passed][:8]
    ratios = [leaf.rmse / leaf.eager_rmse for leaf in res.leaves if leaf.eager_rmse]
    del outs, grads
    return {"passed": res.passed, "reason": res.reason, "tensors": len(res.leaves), "how": how, "failed": failed,
            "worst_rmse_vs_eager": max(ratios) if ratios else None, "tol": accuracy.tolerance(dtype, True),
            "k": accuracy.k_factor(dtype)}


# --------------------------------------------------------------------------- one architecture


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _timed_variant(fn, params, grads_out, args, eager: dict | None):
    """(ms/step and activation memory of ``fn``'s step, the output gradients it used): ``grads_out``
    None makes them (checkpoint_bench.Stepper's fixed random ones)."""
    stepper = Stepper(fn, (), params)
    stepper.grads_out = grads_out
    cuda = torch.cuda.is_available() and any(p.is_cuda for p in params)
    for p in params:  # gradients exist before any variant is measured (a training loop's steady state), so
        if p.requires_grad and p.grad is None:  # the first variant's held memory is not their allocation
            p.grad = torch.zeros_like(p)
    if cuda:
        free()
        held = torch.cuda.memory_reserved()
    act, after, ms = measure(stepper, args.warmup, args.reps)
    out = {"ms": ms, "activation_gb": gb(act), "after_forward_gb": gb(after), "step_gb": gb(act)}
    if cuda:  # what stays reserved between steps once the cache is emptied: a replayed step's graph pool
        free()
        out["held_gb"] = gb(torch.cuda.memory_reserved() - held)
        if act is not None:  # a step's memory: its activations wherever they live (a replayed step's: its pool)
            out["step_gb"] += max(out["held_gb"], 0.0)
    if eager is not None:
        out["speedup"] = eager["ms"] / ms
        if eager.get("activation_gb") and act is not None:
            out["memory_ratio"] = gb(act) / eager["activation_gb"]
    return out, stepper.grads_out


def _checkpoint_plan(opt) -> dict:
    try:
        res = opt.report.pass_result("insert_checkpoints")
    except KeyError:
        return {"status": "not run"}
    d = res.details
    return {"status": res.status, "backend": d.get("backend"), "regions": d.get("regions"),
            "budget_gb": gb(d.get("budget_bytes")),
            "predicted_baseline_activation_gb": gb(d.get("baseline_activation_bytes")),
            "predicted_activation_gb": gb(d.get("predicted_activation_bytes")),
            "predicted_extra_ms": d.get("extra_ms"), "reason": d.get("reason") or d.get("backend_reason")}


def run_arch(arch: Arch, args, device, dtype, started: float, save: Callable[[dict], None]) -> dict:
    import graphopt

    def spent() -> str | None:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            return f"time budget ({args.budget_s:.0f} s) spent"
        return None

    if spent():
        row = {"arch": arch.name, "shape_of": arch.member, "skipped": spent()}
        log(f"[{arch.name}] skipped: {row['skipped']}")
        save(row)
        return row
    log(f"[{arch.name}] building the {arch.member} shape" + (" (tiny)" if args.tiny else ""))
    model, inputs, cfg, batch, seq = build(arch, args.tiny, device, dtype, args.layers)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    row = describe(arch, cfg, model, batch, seq, args.tiny)
    row["budget"] = args.budget
    save(row)

    def call(fn):
        return lambda: fn(**inputs)

    def late(label: str) -> bool:
        why = spent()
        if why:
            row[label] = {"skipped": why}
            log(f"[{arch.name}] {label}: skipped, {why}")
            save(row)
        return why is not None

    # the fixed output gradients: made by the eager stepper on its first step, then shared by every variant
    row["eager"], grads_out = _timed_variant(call(model), params, None, args, None)
    eager = row["eager"]
    log(f"[{arch.name}] eager: {eager['ms']:.2f} ms/step, activations {eager['activation_gb']} GB")
    save(row)

    if not late("hf_checkpointing"):
        try:
            hf_checkpointing(model, True)
            row["hf_checkpointing"] = _timed_variant(call(model), params, grads_out, args, eager)[0]
            log(f"[{arch.name}] hf checkpointing: {row['hf_checkpointing']['ms']:.2f} ms/step, activations "
                f"{row['hf_checkpointing']['activation_gb']} GB")
        except Exception as e:  # noqa: BLE001 - keep the other variants
            traceback.print_exc()
            row["hf_checkpointing"] = {"error": _error(e)}
        finally:
            hf_checkpointing(model, False)
        free()
        save(row)

    gold = eager_step = None
    if not late("reference"):
        t0 = time.perf_counter()
        eager_step = one_step(call(model), params, grads_out)
        rows = args.fp64_rows or max(1, batch // 4)
        gold = fp64_step(model, inputs, grads_out, rows)
        row["reference"] = {"dtype": "float64", "kept_in": "float32", "rows_per_chunk": rows, "chunks": -(-batch // rows),
                            "seconds": time.perf_counter() - t0}
        log(f"[{arch.name}] float64 reference: {rows} rows at a time, {row['reference']['seconds']:.1f} s")
        free()
        save(row)

    for label, extra in (("graphopt", {}), ("graphopt_budget", {"memory_budget": args.budget})):
        if late(label):
            continue
        opt = None
        try:
            t0 = time.perf_counter()
            opt = graphopt.optimize(model, inputs, training=True, check_accuracy=not args.no_guard, **extra)
            optimize_s = time.perf_counter() - t0
            model.train()
            info = bench._graphopt_extra(opt)
            v = _timed_variant(call(opt), params, grads_out, args, eager)[0]
            v.update(optimize_s=optimize_s, applied=info["applied"], guard=info["guard"],
                     setup_peak_gb=gb((info.get("setup_memory") or {}).get("setup_peak_bytes")),
                     checkpoint=_checkpoint_plan(opt))
            if gold is not None:
                v["gradients"] = grad_check(call(opt), params, names, grads_out, eager_step, gold, dtype)
            row[label] = v
            log(f"[{arch.name}] {label}: optimized in {optimize_s:.1f} s ({', '.join(v['applied'])}), "
                f"{v['ms']:.2f} ms/step ({v['speedup']:.3f}x eager), activations {v['activation_gb']} GB"
                + (f", gradients {'pass' if v['gradients']['passed'] else 'FAIL: ' + v['gradients']['reason']}"
                   if "gradients" in v else ""))
        except Exception as e:  # noqa: BLE001 - keep the other variants
            traceback.print_exc()
            row[label] = {"error": _error(e)}
            log(f"[{arch.name}] {label}: FAILED {row[label]['error']}")
        del opt
        free()
        save(row)

    row["verdicts"] = verdicts(row)
    save(row)
    return row


# --------------------------------------------------------------------------- verdicts


def verdicts(row: dict) -> dict:
    """Each target MET or MISSED, with why (a variant that failed or was not run misses)."""
    def state(v):
        if v is None:
            return "not run"
        return v.get("error") or v.get("skipped")

    out = {}
    e, g, b, h = (row.get(k) for k in ("eager", "graphopt", "graphopt_budget", "hf_checkpointing"))
    why = state(e) or state(g)
    if why:
        out["speed"] = {"verdict": "MISSED", "why": f"not measured: {why}"}
    else:
        sp = g["speedup"]
        out["speed"] = {"verdict": "MET" if sp >= SPEED_TARGET else "MISSED",
                        "why": f"{sp:.3f}x eager (target {SPEED_TARGET}x)"}
    why = state(b) or state(h)
    if why:
        out["budget"] = {"verdict": "MISSED", "why": f"not measured: {why}"}
    else:
        faster = b["ms"] < h["ms"]
        key = "step_gb" if "step_gb" in b and "step_gb" in h else "activation_gb"
        within = b[key] is not None and h[key] is not None and b[key] <= h[key]
        out["budget"] = {"verdict": "MET" if faster and within else "MISSED",
                         "why": f"{b['ms']:.2f} vs {h['ms']:.2f} ms/step, {_num(b[key], '{:.4g}')} vs "
                                f"{_num(h[key], '{:.4g}')} GB " + ("a step (activations + held)" if key == "step_gb"
                                                                   else "activations")}
    checks = []
    for label, v in (("graphopt", g), ("graphopt_budget", b)):
        why = state(v)
        if why:
            checks.append(f"{label} not checked: {why}")
        elif "gradients" not in v:
            checks.append(f"{label} not checked: no float64 reference")
        elif not v["gradients"]["passed"]:
            checks.append(f"{label}: {v['gradients']['reason']}")
    out["gradients"] = {"verdict": "MISSED" if checks else "MET",
                        "why": "; ".join(checks) if checks else "both variants pass the accuracy rule"}
    out["all"] = "MET" if all(out[k]["verdict"] == "MET" for k in ("speed", "budget", "gradients")) else "MISSED"
    return out


# --------------------------------------------------------------------------- output


def _num(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _cell(v: dict | None, key: str, fmt="{:.2f}") -> str:
    if v is None:
        return "—"
    if "error" in v:
        return "failed"
    if "skipped" in v:
        return "skipped"
    return _num(v.get(key), fmt)


def markdown(result: dict) -> str:
    h = result["header"]
    s = result["settings"]
    ver = h["versions"]
    lines = [f"# Training steps: graphopt against eager bf16 and the model's own checkpointing ({h['date']}, "
             f"{h['device_name']})", "",
             f"torch {ver['torch']}, CUDA {ver.get('CUDA')}, transformers {ver.get('transformers')}, triton "
             f"{ver.get('triton')}, graphopt {ver.get('graphopt')}, python {ver.get('python')}.", "",
             f"{s['dtype']}, Hugging Face base models with random weights, SDPA attention, dropout off. A step: gradients "
             "zeroed in place, forward, backward of sum_i <out_i, g_i> for fixed random g_i; no optimizer step. "
             f"ms/step: median of {s['reps']} steps after {s['warmup']} warm-up steps, each timed alone. Activations: "
             "peak allocated during one step minus allocated before it (a step replayed from CUDA graphs keeps its "
             "activations in the graphs' memory, allocated at its first call: the detail column gives what a "
             "variant holds between steps, reserved after emptying the cache; every parameter's .grad exists "
             "before a variant is measured). Step GB: the two together, what "
             "the budget target compares. graphopt = optimize(model, inputs, "
             f"training=True{'' if s['guard'] else ', check_accuracy=False'}); @{s['budget']} adds memory_budget="
             f"{s['budget']}; HF ckpt = the model's own per-layer checkpointing (non-reentrant). Gradients: outputs "
             "and every parameter's gradient of one step by the accuracy rule against a float64 copy of the same "
             "model and inputs (run a few batch rows at a time, gradients summed), eager bf16 as the yardstick.", "",
             f"Targets: speed = graphopt >= {SPEED_TARGET}x eager; budget = graphopt @{s['budget']} faster than HF ckpt "
             "at no more step memory; gradients = both graphopt variants pass the rule.", "",
             f"| arch | shape | eager ms | graphopt ms | speed-up | speed | @{s['budget']} ms | HF ckpt ms | "
             f"eager step GB | @{s['budget']} step GB | HF ckpt step GB | budget | gradients | all |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['arch']} | {r['shape_of']} | " + " | ".join([""] * 11) + f" | skipped: {r['skipped']} |")
            continue
        v = r.get("verdicts", {})
        shape = f"{r['shape_of']}, {r['layers']} layers, bs{r['batch']} seq{r['seq']}"
        e, g, b, hf = (r.get(k) for k in ("eager", "graphopt", "graphopt_budget", "hf_checkpointing"))
        verdict = lambda k: v.get(k, {}).get("verdict", "—")  # noqa: E731
        lines.append(f"| {r['arch']} | {shape} | {_cell(e, 'ms')} | {_cell(g, 'ms')} | {_cell(g, 'speedup', '{:.3f}x')} | "
                     f"{verdict('speed')} | {_cell(b, 'ms')} | {_cell(hf, 'ms')} | {_cell(e, 'step_gb', '{:.3f}')} | "
                     f"{_cell(b, 'step_gb', '{:.3f}')} | {_cell(hf, 'step_gb', '{:.3f}')} | {verdict('budget')} | "
                     f"{verdict('gradients')} | {v.get('all', 'incomplete')} |")
    lines += ["", "| arch | variant | ms/step | vs eager | act GB | act / eager | after fwd GB | optimize s | detail |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in result["rows"]:
        if "skipped" in r:
            continue
        for key, name in (("eager", "eager"), ("hf_checkpointing", "HF ckpt"), ("graphopt", "graphopt"),
                          ("graphopt_budget", f"graphopt @{s['budget']}")):
            v = r.get(key)
            if v is None:
                continue
            if "error" in v or "skipped" in v:
                lines.append(f"| {r['arch']} | {name} | | | | | | | {'FAILED: ' + v['error'] if 'error' in v else v['skipped']} |")
                continue
            detail = []
            if (v.get("held_gb") or 0) >= 0.01:
                detail.append(f"{v['held_gb']:.3f} GB held between steps (reserved after emptying the cache: "
                              "a replayed step's graph pool, where its activations live, outside the act GB column)")
            if "applied" in v:
                detail.append("passes: " + (", ".join(v["applied"]) or "none"))
                cp = v.get("checkpoint") or {}
                if cp.get("status") == "applied":
                    detail.append(f"checkpoints: {cp.get('backend')}, {cp.get('regions')} regions, predicted "
                                  f"{_num(cp.get('predicted_activation_gb'), '{:.3f}')} of "
                                  f"{_num(cp.get('predicted_baseline_activation_gb'), '{:.3f}')} GB (budget "
                                  f"{_num(cp.get('budget_gb'), '{:.3f}')})")
                elif cp.get("status") not in (None, "not run", "unchanged") or key == "graphopt_budget":
                    detail.append(f"checkpoints: {cp.get('status')}" + (f" ({cp['reason']})" if cp.get("reason") else ""))
                gr = v.get("gradients")
                if gr is not None:
                    detail.append(f"gradients {'pass' if gr['passed'] else 'FAIL'} ({gr['tensors']} tensors: "
                                  + ", ".join(f"{n} {k}" for k, n in sorted(gr["how"].items()))
                                  + (f"; worst rmse {gr['worst_rmse_vs_eager']:.2f}x eager's" if gr.get("worst_rmse_vs_eager") else "")
                                  + (f"; {gr['reason']}" if not gr["passed"] else "") + ")")
            lines.append(f"| {r['arch']} | {name} | {_num(v['ms'])} | {_num(v.get('speedup'), '{:.3f}x')} | "
                         f"{_num(v['activation_gb'], '{:.3f}')} | {_num(v.get('memory_ratio'), '{:.2f}')} | "
                         f"{_num(v['after_forward_gb'], '{:.3f}')} | {_num(v.get('optimize_s'), '{:.1f}')} | {'; '.join(detail)} |")
    refs = [r for r in result["rows"] if "reference" in r and "chunks" in r["reference"]]
    if refs:
        lines += ["", "Float64 references: " + "; ".join(
            f"{r['arch']} {r['reference']['chunks']} chunks of {r['reference']['rows_per_chunk']} rows "
            f"({r['reference']['seconds']:.1f} s)" for r in refs) + "."]
    for r in result["rows"]:
        for k, v in r.get("verdicts", {}).items():
            if k != "all":
                lines.append(f"- {r['arch']} {k}: {v['verdict']} ({v['why']})")
    if result.get("errors"):
        lines += [""] + [f"- error: {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the JSON + Markdown")
    ap.add_argument("--configs", default=",".join(ARCHS), help=f"comma-separated subset of {','.join(ARCHS)}")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized configs (a dry run)")
    ap.add_argument("--reps", type=int, default=20, help="timed steps per variant (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="layers of every config (default: each config's own)")
    ap.add_argument("--budget", type=float, default=0.3, help="graphopt's memory_budget for the budget variant")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds after which variants not yet started are recorded as skipped")
    ap.add_argument("--fp64-rows", type=int, default=None,
                    help="batch rows per float64 reference chunk (default: a quarter of the batch, at least 1)")
    ap.add_argument("--no-guard", action="store_true", help="optimize with check_accuracy=False (faster set-up)")
    ap.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in ARCHS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {','.join(ARCHS)}")
    if not 0 < args.budget <= 1:
        ap.error("--budget is a fraction in (0, 1]")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16
    header = bench.environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / bench.result_stem(header, "training")
    result = {"header": header, "settings": {"dtype": "bf16", "reps": args.reps, "warmup": args.warmup,
                                              "budget": args.budget, "tiny": args.tiny, "layers": args.layers, "guard": not args.no_guard,
                                              "speed_target": SPEED_TARGET, "configs": configs,
                                              "optimizer_step": False, "loss": "sum_i <out_i, g_i>"},
              "rows": [], "errors": []}

    def save(row: dict | None = None) -> None:
        if row is not None and row not in result["rows"]:
            result["rows"].append(row)
        # (the stem holds dots, "torch-2.11.0-cu130": names are appended, never with_suffix)
        Path(f"{base}.json").write_text(json.dumps(result, indent=1, default=str))
        Path(f"{base}.md").write_text(markdown(result))

    log(f"training bench on {header['device_name']}: torch {header['versions']['torch']}, transformers "
        f"{header['versions']['transformers']}; configs {','.join(configs)}")
    started = time.perf_counter()
    for name in configs:
        try:
            run_arch(ARCHS[name], args, device, dtype, started, save)
        except Exception as e:  # noqa: BLE001 - keep the other architectures
            traceback.print_exc()
            result["errors"].append(f"{name}: {_error(e)}")
        free()  # the architecture's model and references went with run_arch's frame
        save()
    result["seconds"] = time.perf_counter() - started
    save()
    log(markdown(result))
    log(f"wrote {base}.json and .md in {result['seconds']:.0f} s")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
