"""optimize()'s set-up memory and time on models that fill a GPU: the full GLM-4-9B shape at bs1 and
bs8 and a Qwen2-32B shape at bs1 (seq 1024, bf16, random weights), against one eager call.

    python benchmarks/setup_memory_bench.py [--compile] [--only glm4-9b-bs1,glm4-9b-bs8,qwen2-32b-bs1]
                                           [--seq 1024] [--reps 20] [--budget-s 540] [--out benchmarks/results]

Each model is built directly on the GPU in bf16 (transformers' own init run there; nothing is made
on the CPU), wrapped to return its logits (``use_cache=False``). Per variant, with the device's
peak statistic reset before each step (``torch.cuda.max_memory_allocated``, the weights included):

* eager: one call's peak; median ms of ``--reps`` calls;
* graphopt: ``graphopt.optimize(model, (ids,))``'s peak and wall time (and the report's constants
  added / refused, its accuracy check, its phases), then the first call and the median ms of
  ``--reps`` calls;
* torch.compile (default mode), with ``--compile``: first call (compilation) time and peak, median ms.
  A compilation that would start after ``--budget-s`` of the run is skipped (estimated
  ``COMPILE_S_PER_LAYER`` seconds a layer) and recorded as such.

The models are freed between variants (del, gc, empty_cache). Writes
``setup_memory_<date>_<gpu>.{json,md}`` under ``--out`` after every variant, with versions.
Estimated on one H200: GLM-4-9B ~40 s a batch size, Qwen2-32B ~80 s (~3 min in all); ``--compile``
adds ~70 s a GLM batch size and ~2 min for Qwen2-32B (~8 min in all).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COMPILE_S_PER_LAYER = 1.8  # the estimate --budget-s uses (issue 29: GLM-4-9B's 40 layers compiled in ~70 s)

VARIANTS = {  # name: (model, batch)
    "glm4-9b-bs1": ("glm4-9b", 1),
    "glm4-9b-bs8": ("glm4-9b", 8),
    "qwen2-32b-bs1": ("qwen2-32b", 1),
}


def config(name: str):
    if name == "glm4-9b":
        from graphopt.examples.zoo import glm4_9b_config

        cfg = glm4_9b_config(num_layers=40)
        return cfg, 151329  # ids below the special tokens
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                      num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager")
    return cfg, 151643


def build(name: str):
    """The model on the GPU in bf16, built there (transformers' init on the device), every 1-D
    parameter (norm weights, biases) perturbed so none is a constant."""
    from transformers import AutoModelForCausalLM

    from graphopt.examples.zoo import LogitsOnly

    cfg, vocab = config(name)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            lm = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(default)
    lm = lm.to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.02)
    return LogitsOnly(lm).eval(), vocab, cfg.num_hidden_layers


def free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def dropped(fn):
    """fn with its result dropped (a call whose peak is measured without keeping its output)."""
    def call():
        fn()
    return call


def peak_of(fn):
    """(result, peak bytes allocated while fn ran, seconds)."""
    free()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated(), time.perf_counter() - t0


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gb(x) -> str:
    return "—" if x is None else f"{x / 1e9:.2f}"


def write(out: Path, stem: str, env: dict, rows: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1, default=str))
    lines = [f"# optimize()'s set-up memory on models that fill a GPU ({env['device_name']})", "",
             f"{env['date']}; " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ". Peaks are "
             "`torch.cuda.max_memory_allocated` (weights included) with the statistic reset before each step; ms are "
             "medians of single calls (CUDA events).", "",
             "| variant | weights GB | eager peak GB | eager ms | optimize peak GB | / eager peak | optimize s | "
             "constants added GB | refused | guard | graphopt ms | compile peak GB | compile s | compile ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r.get('error')} |" + " |" * 12)
            continue
        ratio = r["optimize_peak"] / r["eager_peak"] if r.get("optimize_peak") and r.get("eager_peak") else None
        f = lambda k, fmt="{:.2f}": "—" if r.get(k) is None else fmt.format(r[k])  # noqa: E731
        lines.append(
            f"| {r['variant']} | {gb(r.get('weights'))} | {gb(r.get('eager_peak'))} | {f('eager_ms')} | "
            f"{gb(r.get('optimize_peak'))} | {'—' if ratio is None else f'{ratio:.2f}x'} | {f('optimize_s', '{:.1f}')} | "
            f"{gb(r.get('constants_added'))} | {r.get('refused', '—')} | {r.get('guard', '—')} | {f('graphopt_ms')} | "
            f"{gb(r.get('compile_peak'))} | {f('compile_s', '{:.1f}')} | {r.get('compile_ms', '—') if isinstance(r.get('compile_ms'), str) else f('compile_ms')} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(VARIANTS), help=f"comma-separated variants ({', '.join(VARIANTS)})")
    p.add_argument("--compile", action="store_true", help="also time torch.compile (default mode)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=540.0, help="skip compilations that would start after this")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    import graphopt
    from graphopt import setup_memory
    from graphopt.tools.bench import environment

    t_run = time.perf_counter()
    env = environment(torch.device("cuda"))
    gpu = re.sub(r"[^a-z0-9]+", "-", env["device_name"].lower()).strip("-")
    stem = f"setup_memory_{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d_%H%M%S')}_{gpu}"
    out = Path(a.out)
    rows: list = []
    built = model = None  # built: (model name, model, vocab, layers)
    for variant in names:
        mname, batch = VARIANTS[variant]
        row: dict = {"variant": variant, "batch": batch, "seq": a.seq}
        rows.append(row)
        try:
            if built is None or built[0] != mname:
                built = model = None
                free()
                t0 = time.perf_counter()
                model, vocab, layers = build(mname)
                built = (mname, model, vocab, layers)
                print(f"[{variant}] built {mname} in {time.perf_counter() - t0:.1f} s", flush=True)
            _, model, vocab, layers = built
            row["weights"] = setup_memory.model_bytes(model)
            ids = torch.randint(0, vocab, (batch, a.seq), device="cuda")

            def eager_call():
                with torch.inference_mode():
                    return model(ids)

            _, row["eager_peak"], _ = peak_of(dropped(eager_call))
            row["eager_ms"] = median_ms(eager_call, a.reps)
            print(f"[{variant}] eager: peak {gb(row['eager_peak'])} GB, {row['eager_ms']:.2f} ms", flush=True)

            opt, row["optimize_peak"], row["optimize_s"] = peak_of(lambda: graphopt.optimize(model, (ids,)))
            rep = opt.report
            mem = rep.memory or {}
            row.update(constants_added=mem.get("added_bytes"), refused=mem.get("refused"),
                       report_setup_peak=rep.setup_peak_bytes, memory=mem, phases=rep.optimize_phases,
                       guard="passed" if rep.accuracy.get("passed") else (rep.accuracy.get("reason") or "failed")[:80],
                       applied=[q.name for q in rep.passes if q.status == "applied"],
                       held={q.name: q.details["held_verdict"] for q in rep.passes if "held_verdict" in q.details})
            print(f"[{variant}] optimize: peak {gb(row['optimize_peak'])} GB "
                  f"({row['optimize_peak'] / row['eager_peak']:.2f}x eager), {row['optimize_s']:.1f} s; "
                  f"{rep.memory_summary()}; guard {row['guard']}", flush=True)

            def opt_call():
                with torch.inference_mode():
                    return opt(ids)

            _, row["graphopt_first_peak"], row["graphopt_first_s"] = peak_of(dropped(opt_call))
            row["graphopt_ms"] = median_ms(opt_call, a.reps)
            print(f"[{variant}] graphopt: {row['graphopt_ms']:.2f} ms", flush=True)
            del opt, rep
            free()

            if a.compile:
                est = COMPILE_S_PER_LAYER * layers
                if time.perf_counter() - t_run + est > a.budget_s:
                    row["compile_ms"] = f"skipped (~{est:.0f} s left the --budget-s)"
                else:
                    torch.compiler.reset()
                    compiled = torch.compile(model)

                    def compiled_call():
                        with torch.inference_mode():
                            return compiled(ids)

                    _, row["compile_peak"], row["compile_s"] = peak_of(dropped(compiled_call))
                    row["compile_ms"] = median_ms(compiled_call, a.reps)
                    print(f"[{variant}] torch.compile: {row['compile_s']:.1f} s, peak {gb(row['compile_peak'])} GB, "
                          f"{row['compile_ms']:.2f} ms", flush=True)
                    del compiled
                    torch.compiler.reset()
                    free()
        except Exception as e:  # noqa: BLE001 - a failing variant is a row, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"[{variant}] error: {row['error']}", flush=True)
            free()
        write(out, stem, env, rows)
        next_model = VARIANTS[names[names.index(variant) + 1]][0] if variant != names[-1] else None
        if built is not None and next_model != built[0]:
            built = model = None
            free()
    print(f"wrote {out / stem}.{{json,md}} in {time.perf_counter() - t_run:.0f} s", flush=True)
    print((out / f"{stem}.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
