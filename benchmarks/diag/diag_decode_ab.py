"""Answers: does a pass (or set of passes) make a decode step faster on the device, measured A/B in one
process? Builds the model once and two generators from it, one with graphopt's default pipeline and
one with ``--disable`` passes left out (or, with ``--env-b NAME=VALUE``, the same pipeline built, captured
and warmed up with that environment variable set: a kernel switch such as GRAPHOPT_PDL=0), and times their decode steps (one CUDA-graph replay each)
alternately, ``--rounds`` rounds of ``--steps`` steps: the two medians and their ratio come from the
same machine, the same weights and the same minutes, so day-to-day differences between machines
(the copy rate varies by a few percent) do not decide the verdict.

    python benchmarks/diag/diag_decode_ab.py --model glm4-9b --disable fuse_gemv_swiglu --out DIR
    python benchmarks/diag/diag_decode_ab.py --model glm4-9b --env-b GRAPHOPT_PDL=0 --out DIR

Writes diag_decode_ab_<date>.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks", ROOT / "benchmarks" / "diag"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from diag_decode_step import build, copy_bandwidth, floors  # noqa: E402


def step_times_ms(state, past: int, steps: int) -> list[float]:
    """``steps`` CUDA-event timings of one decode step each, the cache reset to ``past`` first."""
    for layer in state.cache.layers:
        layer.cumulative_length.fill_(past)
    state.position_ids.fill_(past)
    state.attention_mask.fill_(1)
    for _ in range(3):
        state.step()
    torch.cuda.synchronize()
    out = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        state.step()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--past", type=int, default=1024)
    p.add_argument("--disable", default="", help="comma-separated passes left out of variant B")
    p.add_argument("--env-b", default="", help="NAME=VALUE set while variant B is built, captured and warmed up")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import graphopt

    device = torch.device("cuda")
    model = build(args, device)
    bw = copy_bandwidth(device)
    fl = floors(model, args.batch, args.past, bw)
    room = args.rounds * (args.steps + 3) + 16
    off = [s for s in args.disable.split(",") if s]
    env = dict([args.env_b.split("=", 1)]) if args.env_b else {}
    if not off and not env:
        raise SystemExit("--disable or --env-b: variant B must differ from the default")
    b_name = " ".join((["without " + "+".join(off)] if off else []) + [f"{k}={v}" for k, v in env.items()])
    gens, notes = {}, {}
    for name, opts, b_env in (("default", {}, {}), (b_name, {"disable": off} if off else {}, env)):
        t0 = time.perf_counter()
        saved = {k: os.environ.get(k) for k in b_env}
        os.environ.update(b_env)
        try:
            gen = graphopt.optimize_generation(model, max_batch_size=args.batch, max_length=args.past + room,
                                               check_accuracy=False, **opts)
            gens[name] = gen.decode_state(args.batch)
            step_times_ms(gens[name], args.past, 2)  # captured and warmed up under b_env
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        notes[name] = f"optimized in {time.perf_counter() - t0:.1f} s"
        print(f"{name}: {notes[name]}", flush=True)
    times: dict = {k: [] for k in gens}
    for _ in range(args.rounds):
        for name, state in gens.items():
            times[name] += step_times_ms(state, args.past, args.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    a, b = med.values()
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = {"model": "tiny-llama" if args.tiny else args.model, "batch": args.batch, "past": args.past,
            "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "copy_gbps": bw / 1e9,
            "floor_ms": fl["floor_ms"], "rounds": args.rounds, "steps_per_round": args.steps, "disabled": off,
            "env_b": env}
    rows = [{"variant": k, "median_ms": med[k], "over_floor": med[k] / fl["floor_ms"], "note": notes[k],
             "min_ms": min(times[k]), "max_ms": max(times[k])} for k in gens]
    out = Path(args.out)
    (out / f"diag_decode_ab_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Decode step A/B: {meta['model']}, batch {args.batch}, past {args.past} "
             f"({meta['gpu']}, torch {meta['torch']}, copy {bw / 1e9:.0f} GB/s, floor {fl['floor_ms']:.3f} ms)", "",
             f"{args.rounds} alternating rounds of {args.steps} steps each; one step = one CUDA-graph replay.", "",
             "| variant | median ms | × floor | min | max |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['variant']} | {r['median_ms']:.3f} | {r['over_floor']:.3f} | {r['min_ms']:.3f} | "
              f"{r['max_ms']:.3f} |" for r in rows]
    lines += ["", f"default / ({b_name}): **{a / b:.3f}**"]
    (out / f"diag_decode_ab_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
