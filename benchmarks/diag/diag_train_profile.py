# Answered: Where does a training step's time go, by kernel class? BERT-base bs32 seq512: eager 31.9 ms (GEMMs 12.2, attention 5.0, aten's LayerNorm backward 2.75 of which its weight-gradient kernel 1.99, bias-gradient sums 2.39), torch.compile 29.1, graphopt 32.2; @0.3 47.8, its AOT regions on the memory-efficient attention (results/diag_train_profile_bert_2026-12-03_122855.md). GPT-2: fuse_layer_norm takes 1.1 ms of kernel time off (…gpt2_…132106.md; its step times, after 3 warm-up steps, were host-bound: use --warmup 6). GLM-4: fused_norm_backward 40.1/40.3 against aten's 41.2/41.7 ms (…glm4_…132557_fused.md … 132654_aten.md).
"""Training step breakdown by kernel class, one process, all variants on the same model and inputs.

    python benchmarks/diag/diag_train_profile.py --config bert --out /tmp/out [--layers N]

Variants: eager (SDPA's default backend), eager with each SDPA backend forced (a backend that
refuses the inputs is reported, not run), torch.compile (default mode), graphopt
(optimize(training=True), guard off). For each: median ms/step and one profiled step's device time
grouped by kernel class (GEMM, attention forward/backward, norms, elementwise, reductions, ...).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parents[1]), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from checkpoint_bench import Stepper, free, step_ms  # noqa: E402
from training_bench import ARCHS, build  # noqa: E402

CLASSES = [  # first match wins
    ("attention", r"fmha|flash|attention|cudnn_generated|sdpa|softmax"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|cublas|sm90_|matmul"),
    ("norm", r"layer_norm|LayerNorm|rms|norm"),
    ("reduce", r"reduce|Reduce"),
    ("embedding", r"embedding|index|scatter|gather"),
    ("triton", r"^triton_"),
    ("copy/cat", r"copy|Cat|cat_|transpose"),
    ("elementwise", r"elementwise|vectorized|unrolled|foreach|fill"),
]


def classify(name: str) -> str:
    for label, pat in CLASSES:
        if re.search(pat, name):
            if label == "attention":
                return label + (" bwd" if re.search(r"cutlassB|bwd|backward|bprop|dq_|dkdv|dot_do_o", name) else " fwd")
            return label
    return "other"


def profile_step(stepper):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stepper()
        torch.cuda.synchronize()
    by_class: dict = {}
    by_kernel: dict = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = e.device_time / 1e3
        c = by_class.setdefault(classify(e.name), [0.0, 0])
        c[0] += ms
        c[1] += 1
        k = by_kernel.setdefault(e.name[:110], [0.0, 0])
        k[0] += ms
        k[1] += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    return {"classes": {k: {"ms": v[0], "kernels": v[1]} for k, v in by_class.items()},
            "total_ms": sum(v[0] for v in by_class.values()),
            "top": [{"name": k, "ms": v[0], "calls": v[1]} for k, v in top]}


def run_variant(label, fn, params, grads_out, reps, warmup, ctx=None):
    stepper = Stepper(fn, (), params)
    stepper.grads_out = grads_out
    try:
        if ctx is not None:
            ctx.__enter__()
        for _ in range(warmup):
            stepper()
        ms = statistics.median(step_ms(stepper, reps, True))
        prof = profile_step(stepper)
    except Exception as e:  # a forced SDPA backend that refuses the inputs
        return {"variant": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return {"variant": label, "ms": ms, **prof}, stepper.grads_out


def markdown(res: dict) -> str:
    rows = [r for r in res["variants"] if "ms" in r]
    classes = sorted({c for r in rows for c in r["classes"]}, key=lambda c: -max(r["classes"].get(c, {"ms": 0})["ms"] for r in rows))
    out = [f"# Training step by kernel class: {res['config']} ({res['shape']})", "",
           f"{res['device']} · torch {res['torch']} · {res['date']}", "",
           "| variant | ms/step | kernel ms | " + " | ".join(classes) + " |",
           "| --- | ---: | ---: | " + " | ".join("---:" for _ in classes) + " |"]
    for r in rows:
        out.append(f"| {r['variant']} | {r['ms']:.2f} | {r['total_ms']:.2f} | "
                   + " | ".join(f"{r['classes'].get(c, {'ms': 0})['ms']:.2f}" for c in classes) + " |")
    for r in res["variants"]:
        if "error" in r:
            out.append(f"\n- {r['variant']}: {r['error']}")
    for r in rows:
        out += ["", f"## {r['variant']}: top kernels", "", "| kernel | calls | ms |", "| --- | ---: | ---: |"]
        out += [f"| `{k['name']}` | {k['calls']} | {k['ms']:.3f} |" for k in r["top"]]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bert", choices=sorted(ARCHS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="eager,sdpa-efficient,sdpa-cudnn,sdpa-flash,compile,graphopt,graphopt@0.3")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import graphopt
    from graphopt.tools import bench

    dev = torch.device("cuda")
    arch = ARCHS[args.config]
    model, inputs, cfg, batch, seq = build(arch, False, dev, torch.bfloat16, args.layers)
    params = list(model.parameters())
    res = {"config": args.config, "shape": f"{arch.member}, {cfg.num_hidden_layers} layers, bs{batch} seq{seq}",
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": []}
    grads_out = None
    backends = {"sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-math": SDPBackend.MATH}
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        if v == "eager" or v in backends:
            ctx = sdpa_kernel([backends[v]]) if v in backends else None
            r = run_variant(v, lambda: model(**inputs), params, grads_out, args.reps, args.warmup, ctx)
        elif v == "compile":
            cm = torch.compile(model)
            r = run_variant(v, lambda: cm(**inputs), params, grads_out, args.reps, args.warmup)
        elif v.startswith("graphopt"):  # graphopt, graphopt@0.3 (a memory budget), graphopt-no:PASS+PASS (disabled)
            budget = {"memory_budget": float(v.split("@")[1])} if "@" in v else {}
            if "-no:" in v:
                budget["disable"] = v.split("-no:")[1].split("@")[0].split("+")
            opt = graphopt.optimize(model, inputs, training=True, check_accuracy=False, **budget)
            model.train()
            applied = bench._graphopt_extra(opt)["applied"]
            r = run_variant(v, lambda: opt(**inputs), params, grads_out, args.reps, args.warmup)
            if isinstance(r, tuple):
                r[0]["passes"] = applied
        else:
            raise SystemExit(f"unknown variant {v}")
        if isinstance(r, tuple):
            r, grads_out = r
        r["wall_s"] = time.perf_counter() - t0
        res["variants"].append(r)
        print(v, {k: (round(x, 3) if isinstance(x, float) else x) for k, x in r.items() if k in ("ms", "total_ms", "error", "passes")},
              {c: round(d["ms"], 2) for c, d in r.get("classes", {}).items()}, flush=True)
        free()
    base = Path(args.out) / f"diag_train_profile_{args.config}_{time.strftime('%Y-%m-%d_%H%M%S', time.gmtime())}"
    base.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    base.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
