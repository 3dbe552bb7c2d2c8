# Answered: Where does a training step's wall time go by phase, and what do CUDA graphs of its forward and backward take off? BERT-base bs32 s512: eager 32.4-36.0 ms, graphopt without graphs 57.5 (host-bound: its custom ops' Python autograd), with its training graphs 28.2-29.1, torch.compile reduce-overhead 28.1; dropout 0.1: 32.0 against 35.9; GPT-2 eager 40.1, graphopt 25.9, 60.8 without graphs (results/diag_train_graphs_bert_2026-12-03_164412.md, …165607.md, …171710.md, …171734.md, …gpt2_…165636.md).
"""Where a training step's wall time goes by phase (gradients zeroed, forward, backward), and what
replaying the forward and the backward as CUDA graphs would take off it.

    python benchmarks/diag/diag_train_graphs.py --config bert --out /tmp/out [--layers N]

Each step is timed with CUDA events at the phase boundaries (the device idle before the step), so a
phase's time is the device's wall time from its first launch to its last kernel's end: host-bound
launch gaps count. Variants: eager; ``cudagraphs`` (torch.compile's backend that traces the step with
AOTAutograd and replays forward and backward as CUDA graphs, no Inductor); graphopt
(optimize(training=True), guard off: forward and backward replayed as CUDA graphs where the runner
decides so), ``graphopt-eager`` (the same module with set_cuda_graphs(False)), ``graphopt+cudagraphs``
(graphopt's module under the cudagraphs backend); torch.compile reduce-overhead (Inductor + CUDA
graphs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parents[1]), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from checkpoint_bench import _outs, free  # noqa: E402
from training_bench import ARCHS, build  # noqa: E402


def phases(fn, params, grads_out, reps: int, warmup: int) -> dict:
    def step(ev=None):
        if ev:
            ev[0].record()
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        if ev:
            ev[1].record()
        outs = _outs(fn())
        if ev:
            ev[2].record()
        torch.autograd.backward(outs, grads_out)
        if ev:
            ev[3].record()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    rows = []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        step(ev)
        ev[3].synchronize()
        rows.append([ev[i].elapsed_time(ev[i + 1]) for i in range(3)])
        torch.cuda.synchronize()
    med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
    return {"zero_ms": med(0), "forward_ms": med(1), "backward_ms": med(2),
            "step_ms": statistics.median(sum(r) for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bert", choices=sorted(ARCHS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--variants", default="eager,graphopt,graphopt-eager,compile-ro")
    ap.add_argument("--dropout", type=float, default=None, help="every nn.Dropout's p (default: the bench's 0)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import graphopt

    dev = torch.device("cuda")
    arch = ARCHS[args.config]
    model, inputs, cfg, batch, seq = build(arch, False, dev, torch.bfloat16, args.layers)
    if args.dropout is not None:
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = args.dropout
    params = list(model.parameters())
    outs = _outs(model(**inputs))
    gen = torch.Generator(device=dev).manual_seed(1234)
    grads_out = [torch.randn(o.shape, dtype=o.dtype, device=dev, generator=gen) for o in outs]
    del outs
    drop = f", dropout {args.dropout}" if args.dropout else ""
    res = {"config": args.config, "shape": f"{arch.member}, {cfg.num_hidden_layers} layers, bs{batch} seq{seq}{drop}",
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}
    opt = None
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        try:
            if v == "eager":
                fn = lambda: model(**inputs)  # noqa: E731
            elif v == "cudagraphs":
                cm = torch.compile(model, backend="cudagraphs")
                fn = lambda: cm(**inputs)  # noqa: E731
            elif v == "compile-ro":
                cm = torch.compile(model, mode="reduce-overhead")
                fn = lambda: cm(**inputs)  # noqa: E731
            elif v.startswith("graphopt"):
                if opt is None:
                    opt = graphopt.optimize(model, inputs, training=True, check_accuracy=False)
                    model.train()
                if v.endswith("+cudagraphs"):
                    co = torch.compile(opt, backend="cudagraphs")
                    fn = lambda: co(**inputs)  # noqa: E731
                else:
                    opt.set_cuda_graphs(False if v == "graphopt-eager" else "auto")
                    fn = lambda: opt(**inputs)  # noqa: E731
            else:
                raise SystemExit(f"unknown variant {v}")
            r = phases(fn, params, grads_out, args.reps, args.warmup)
        except Exception as e:  # noqa: BLE001 (a variant that fails is reported)
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        r["wall_s"] = time.perf_counter() - t0
        label = v if v not in res["variants"] else f"{v} #{sum(k.split(' #')[0] == v for k in res['variants']) + 1}"
        res["variants"][label] = r
        print(v, {k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()}, flush=True)
        torch._dynamo.reset()
        free()
    lines = [f"# Training step by phase: {res['config']} ({res['shape']})", "",
             f"{res['device']} · torch {res['torch']} · {res['date']} · median of {args.reps} steps after {args.warmup}", "",
             "| variant | step ms | zero grads | forward | backward |", "| --- | ---: | ---: | ---: | ---: |"]
    for v, r in res["variants"].items():
        if "error" in r:
            lines.append(f"| {v} | {r['error']} | | | |")
        else:
            lines.append(f"| {v} | {r['step_ms']:.2f} | {r['zero_ms']:.2f} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} |")
    base = Path(args.out) / f"diag_train_graphs_{args.config}_{time.strftime('%Y-%m-%d_%H%M%S', time.gmtime())}"
    base.with_suffix(".json").write_text(json.dumps(res, indent=1))
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
