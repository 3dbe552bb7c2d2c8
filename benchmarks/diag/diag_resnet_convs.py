# Answered: Which ResNet-50 convolutions are slow as lowered? The 3-channel stem and the downsample convs' separate bias add: conv_space_to_depth and fuse_conv_relu's bias move (results/archive/diag_resnet_convs_2026-11-30_025546.md).
"""Every convolution of the optimized ResNet-50, timed alone in the forms graphopt could lower it to.

    python benchmarks/diag/diag_resnet_convs.py [--model resnet50] [--batch 64] [--out DIR] [--reps 5] [--inner 20]

Builds the model as ``graphopt bench`` does (bf16, channels_last on CUDA), optimizes it, and for each
``conv2d`` / ``graphopt::conv_bias_relu`` node of the result times (CUDA events around ``--inner``
back-to-back calls, median of ``--reps``), on random inputs with the node's shapes and strides:

* ``asis``: the node as lowered;
* ``nobias``: the same convolution with its bias dropped (aten's convolution adds a bias in a
  separate kernel; a bias that can move into a fused consumer's bias costs nothing);
* ``bench``: ``asis`` with ``torch.backends.cudnn.benchmark`` on (cuDNN times its algorithms);
* for an input channel count that is not a multiple of 8: the input and weight zero-padded to 4
  and to 8 channels (``pad4``/``pad8``, the pad kernel included and given alone as ``pad_cost``),
  and the input in NCHW (``nchw``).

Also the cost model's prediction for each node (``--profile``, default the device's). Writes
``diag_resnet_convs_<date>.json`` and ``.md`` under ``--out`` (default benchmarks/results). On the
CPU it runs (slowly, use ``--batch 2``) as a dry run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _time(fn, device, reps, inner) -> float:
    """Median milliseconds per call of ``fn`` (``inner`` back-to-back calls between two events)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / inner)
        else:
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t) * 1e3 / inner)
    return statistics.median(out)


def _rand_like_meta(val, device):
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device)
    if t.dtype.is_floating_point:
        t.normal_()
    return t


def _conv_nodes(gm):
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target))
        if n.target is aten.conv2d.default or "conv_bias_relu" in name:
            yield n


def _spec(n):
    from graphopt.passes._fusion_meta import conv_pair

    g = torch.ops.graphopt
    x, w = n.args[0].meta["val"], n.args[1].meta["val"]
    fused = n.target is g.conv_bias_relu.default
    a = list(n.args) + [None] * 8
    if fused:
        bias, z, stride, padding, dilation, groups = a[2], a[3], a[4], a[5], a[6], a[7]
    else:
        bias, stride, padding, dilation, groups = a[2], a[3] or [1, 1], a[4] or [0, 0], a[5] or [1, 1], a[6] or 1
        z = None
    return {"node": n.name, "op": "conv_bias_relu" if fused else "conv2d", "x": tuple(x.shape), "w": tuple(w.shape),
            "x_channels_last": x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(),
            "bias": bias is not None, "residual": z is not None, "stride": conv_pair(stride, 1),
            "padding": conv_pair(padding, 0), "dilation": conv_pair(dilation, 1), "groups": groups, "dtype": str(x.dtype).replace("torch.", ""),
            "out": tuple(n.meta["val"].shape)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args(argv)

    from graphopt import ir
    from graphopt.api import optimize
    from graphopt.tools.bench import prepare_model
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, margs, mkw, name, _ = prepare_model(args.model, args.batch, None, dtype, device)
    opt = optimize(model, (margs, mkw), target=args.profile, check_accuracy=False, model_name=name)
    gm = opt.graph_module
    cost = CostModel(get_profile(args.profile if args.profile else device)[0])
    g = getattr(torch.ops, "graphopt", None)
    hints = ir.shape_hints(gm)
    rows = []
    nodes = list(_conv_nodes(gm))
    print(f"{name} bs{args.batch}: {len(nodes)} convolutions", flush=True)
    with torch.inference_mode():
        for i, n in enumerate(nodes):
            s = _spec(n)
            x = _rand_like_meta(n.args[0].meta["val"], device)
            w = _rand_like_meta(n.args[1].meta["val"], device)
            b = torch.randn(s["w"][0], device=device, dtype=x.dtype) if s["bias"] else None
            z = _rand_like_meta(n.args[3].meta["val"], device) if s["residual"] else None
            st, pd, dl, gr = s["stride"], s["padding"], s["dilation"], s["groups"]

            if s["op"] == "conv_bias_relu":
                def run(x=x, w=w, b=b, z=z):
                    return g.conv_bias_relu.default(x, w, b, z, st, pd, dl, gr)

                def run_nobias(x=x, w=w, z=z):
                    return g.conv_bias_relu.default(x, w, None, z, st, pd, dl, gr)
            else:
                def run(x=x, w=w, b=b):
                    return aten.conv2d.default(x, w, b, st, pd, dl, gr)

                def run_nobias(x=x, w=w):
                    return aten.conv2d.default(x, w, None, st, pd, dl, gr)
            r = dict(s)
            r["predicted_ms"] = float(cost.node_loop_s(n, hints)) * 1e3
            r["asis_ms"] = _time(run, device, args.reps, args.inner)
            r["nobias_ms"] = _time(run_nobias, device, args.reps, args.inner) if s["bias"] else None
            prev = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = True
            try:
                r["bench_ms"] = _time(run, device, args.reps, args.inner)
            finally:
                torch.backends.cudnn.benchmark = prev
            cin = s["x"][1]
            if cin % 8:
                r["nchw_ms"] = _time(lambda: aten.conv2d.default(x.contiguous(), w, b, st, pd, dl, gr), device,
                                     args.reps, args.inner)
                for to in (4, 8):
                    pad = to - cin % to
                    wp = F.pad(w, (0, 0, 0, 0, 0, pad)).contiguous(memory_format=torch.channels_last)
                    r[f"pad_cost{to}_ms"] = _time(lambda: aten.constant_pad_nd(x, [0, 0, 0, 0, 0, pad]), device,
                                                  args.reps, args.inner)
                    xp = aten.constant_pad_nd(x, [0, 0, 0, 0, 0, pad])
                    if s["op"] == "conv_bias_relu":
                        r[f"pad{to}_ms"] = _time(lambda: g.conv_bias_relu.default(
                            aten.constant_pad_nd(x, [0, 0, 0, 0, 0, pad]), wp, b, z, st, pd, dl, gr),
                            device, args.reps, args.inner)
                        ref = run().float()
                        got = g.conv_bias_relu.default(xp, wp, b, z, st, pd, dl, gr).float()
                    else:
                        r[f"pad{to}_ms"] = _time(lambda: aten.conv2d.default(
                            aten.constant_pad_nd(x, [0, 0, 0, 0, 0, pad]), wp, b, st, pd, dl, gr),
                            device, args.reps, args.inner)
                        ref = run().float()
                        got = aten.conv2d.default(xp, wp, b, st, pd, dl, gr).float()
                    r[f"pad{to}_maxdiff"] = float((ref - got).abs().max())
            rows.append(r)
            print(f"  [{i + 1}/{len(nodes)}] {s['node']:28s} x{s['x']} w{s['w']} s{st} "
                  f"asis {r['asis_ms']:.4f} nobias {r['nobias_ms'] or 0:.4f} bench {r['bench_ms']:.4f} "
                  f"pred {r['predicted_ms']:.4f}" + (f" pad8 {r.get('pad8_ms', 0):.4f} nchw {r.get('nchw_ms', 0):.4f}"
                                                      if cin % 8 else ""), flush=True)
            del x, w, b, z
    now = _dt.datetime.now(_dt.timezone.utc)
    header = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "model": name, "batch": args.batch, "dtype": str(dtype), "reps": args.reps, "inner": args.inner}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"diag_resnet_convs_{now.strftime('%Y-%m-%d_%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1, default=str))
    cols = ["node", "op", "x", "w", "stride", "bias", "residual", "predicted_ms", "asis_ms", "nobias_ms", "bench_ms",
            "nchw_ms", "pad4_ms", "pad8_ms", "pad_cost8_ms", "pad8_maxdiff"]
    lines = [f"# {name} bs{args.batch} convolutions alone, {header['date']}, {header['device']}", "",
             f"torch {header['torch']}, cuDNN {header['cudnn']}, {dtype}; ms per call (median of {args.reps} x "
             f"{args.inner} back-to-back calls, CUDA events).", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r.get(c):.4f}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                       for c in cols) + " |")
    tot = {k: sum(r[k] for r in rows if r.get(k) is not None) for k in ("asis_ms", "bench_ms", "predicted_ms")}
    lines += ["", f"Sum over convolutions: as lowered {tot['asis_ms']:.3f} ms, cudnn.benchmark {tot['bench_ms']:.3f} ms, "
              f"predicted {tot['predicted_ms']:.3f} ms."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    print(f"wrote {out / stem}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
