"""Where does a decode step's time go above its weight-read floor? One CUDA-graph replay of the
decode step as graphopt.optimize_generation builds it, profiled kernel by kernel.

    python benchmarks/diag/diag_decode_step.py --out DIR                        # Llama-3-8B, batch 1, past 1024
    python benchmarks/diag/diag_decode_step.py --model glm4-9b --batch 8 --out DIR
    python benchmarks/diag/diag_decode_step.py --tiny --out DIR                 # CPU/GPU dry run of the script

What it measures (random bf16 weights, the model's full depth unless --layers):
- the copy bandwidth (a 1 GiB device copy, eager, timed by CUDA events) and the step's floor: the
  bytes of every weight but the input embedding table (plus B of its rows), plus the K/V cache
  bytes the step reads at this past length, over that bandwidth;
- the step: the generator's ``DecodeState.step()`` (one replay), median of --steps CUDA-event
  timings, and the same with the host work ``generate()`` adds per token (argmax, token copy,
  position add);
- one replay under torch.profiler (CUPTI reports the kernels a graph launches): per kernel
  type (GEMM, split-K reduce, attention, norm, rotary, cache write, SwiGLU, elementwise...) the
  kernels per replay, per layer and their µs, the sum of kernel time against the replay's
  span (the rest is the gaps between kernels), and the 25 costliest kernel names;
- each GEMM of the step: the graph's ``linear`` nodes in order matched to the replay's GEMM
  kernels in order (a split-K reduce kernel counted with its GEMM), grouped by weight shape: µs
  in the step, weight GB/s and its fraction of the copy bandwidth, and µs above the weight read
  at the copy rate. When the kernels do not match the nodes one to one the table says so and
  lists GEMM kernels by name instead;
- the cost model's view of the same graph (``explain``): kernels per op type and their predicted
  µs under CUDA-graph launch costs, so the measured and predicted breakdowns sit side by side.

Without kernel records (an old CUPTI) it times the graph's nodes one by one instead
(graphopt.tools.measure.measure_nodes: each node's op back to back in a stream, not in a graph).
Writes diag_decode_step_<date>.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import collections
import copy
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _timing import copy_bandwidth as cuda_copy_bandwidth, write_rows  # noqa: E402

# kernel name -> type, first match wins
KERNEL_TYPES = [
    ("gemm split-K reduce", r"splitKreduce|split_k_reduce|reduce_splitk|gemv_reduce"),
    ("attention", r"decode_split|decode_combine|flash|fmha|attention|sdpa|cudnn"),
    ("rotary + cache write", r"rotary_cache"),
    ("rotary", r"rotary"),
    ("cache write (index_copy_)", r"index_copy|indexFunc|index_put|scatter"),
    ("norm", r"norm_vec|norm_reg|norm_loop|ln_rows|rms_add_rms|rms_norm|layer_norm|rmsnorm|layernorm"),
    ("swiglu", r"swiglu|silu"),
    ("gemm", r"gemm|gemv|xmma|nvjet|cutlass|cublas|sm90_|sm80_|ampere_|hopper_"),
    ("fused pointwise", r"pw_kernel|fused_pointwise|triton_"),
    ("position add (foreach)", r"multi_tensor_apply|foreach"),
    ("embedding", r"embedding|indexSelect"),
    ("cat / copy", r"CatArray|cat_|copy_kernel|direct_copy"),
    ("reduce (argmax, amax...)", r"reduce_kernel|argmax|ArgMax"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def kernel_type(name: str) -> str:
    for kind, pat in KERNEL_TYPES:
        if re.search(pat, name, re.IGNORECASE):
            return kind
    return "other"


def short(name: str, n: int = 90) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= n else name[:n - 1] + "…"


def build(args, device):
    from graphopt.examples import decoders

    if args.tiny:
        cfg = decoders.tiny_config("llama", layers=args.layers or 2)
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    elif args.model == "llama3-8b":
        cfg = decoders.llama3_8b_config(args.layers or 32)
        cfg._attn_implementation = "sdpa"
        dtype = torch.bfloat16
    elif args.model == "glm4-9b":
        cfg = decoders.glm4_9b_config(args.layers or 40)
        dtype = torch.bfloat16
    else:
        raise SystemExit(f"unknown --model {args.model!r}: llama3-8b or glm4-9b")
    return decoders.build(cfg, dtype=dtype, device=device, seed=0)


def copy_bandwidth(device) -> float:
    if device.type != "cuda":
        src = torch.randn(1 << 24, device=device)
        dst = torch.empty_like(src)
        t = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        return 2 * src.numel() * 4 * 10 / (time.perf_counter() - t)
    with torch.cuda.device(device):
        return cuda_copy_bandwidth()


def floors(model, batch: int, past: int, bw: float) -> dict:
    emb = model.get_input_embeddings().weight
    w = sum(p.numel() * p.element_size() for p in model.parameters()) - emb.numel() * emb.element_size() \
        + batch * emb.shape[1] * emb.element_size()
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * heads * head_dim * emb.element_size() * batch * past
    return {"weight_bytes": w, "kv_bytes": kv, "floor_weights_ms": w / bw * 1e3, "floor_ms": (w + kv) / bw * 1e3}


def median_ms(fn, device, reps: int) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize(device)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def profile_kernels(fn, device, replays: int) -> tuple[list, float]:
    """(kernel records [(name, start_us, dur_us)] of ``replays`` calls of ``fn`` in time order,
    their span in µs)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize(device)
    kernels = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            if re.search(r"memcpy|memset", e.name, re.IGNORECASE):
                continue
            kernels.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
    kernels.sort(key=lambda k: k[1])
    span = (kernels[-1][1] + kernels[-1][2] - kernels[0][1]) if kernels else 0.0
    return kernels, span


def linear_nodes(gm) -> list:
    """(node name, N, K, weight bytes) of every GEMM node in graph order (aten linear/mm/addmm)."""
    aten = torch.ops.aten
    gemv = torch.ops.graphopt.gemv.default
    linear_like = (aten.linear.default, gemv)
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (*linear_like, aten.mm.default, aten.addmm.default,
                                                       aten.matmul.default):
            continue
        w = n.args[1] if n.target in (*linear_like, aten.mm.default, aten.matmul.default) else n.args[2]
        wv = w.meta.get("val") if hasattr(w, "meta") else None
        if not isinstance(wv, torch.Tensor) or wv.dim() != 2:
            continue
        nbytes = wv.numel() * wv.element_size()
        if n.target in linear_like and len(n.args) > 2 and n.args[2] is not None:
            nbytes += n.args[2].meta["val"].numel() * wv.element_size()
        N, K = (wv.shape[0], wv.shape[1]) if n.target in linear_like else (wv.shape[1], wv.shape[0])
        out.append((n.name, int(N), int(K), int(nbytes)))
    return out


def predicted_breakdown(gm, target: str) -> tuple[dict, float]:
    """{op: [kernels, predicted µs]} of the graph under CUDA-graph launch costs, and the total."""
    import dataclasses

    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile

    prof, _ = get_profile(target)
    prof = dataclasses.replace(prof, launch_overhead_s=prof.launch_overhead_graph_s)
    cm = CostModel(prof)
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    total = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        c = cm.node_cost(n).evaluated()
        if not c.launches:
            continue
        name = getattr(n.target, "__name__", str(n.target))
        out[name][0] += int(c.launches)
        out[name][1] += float(c.time_s) * 1e6
        total += float(c.time_s) * 1e6
    return dict(out), total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="a 2-layer tiny Llama (dry run of the script)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--past", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50, help="timed steps (median)")
    p.add_argument("--replays", type=int, default=3, help="replays profiled")
    p.add_argument("--target", default="h200", help="cost profile for the predicted breakdown (a name or a JSON)")
    p.add_argument("--profile-for-plan", action="store_true",
                   help="optimize with --target too (e.g. the h200_decode_fit.json diag_decode_gemm.py writes), not "
                        "the device's profile")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import graphopt

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    model = build(args, device)
    layers = model.config.num_hidden_layers
    bw = copy_bandwidth(device)
    fl = floors(model, args.batch, args.past, bw)
    room = args.steps + 4 * (args.replays + 8) + 16
    opts = {"target": args.target} if args.profile_for_plan else {}
    gen = graphopt.optimize_generation(model, max_batch_size=args.batch, max_length=args.past + room,
                                       check_accuracy=not args.no_accuracy, **opts)
    state = gen.decode_state(args.batch)
    opt, runner = state.module, state.runner
    print(f"[{time.perf_counter() - t0:6.1f}s] optimized: {runner.decision.note()}", flush=True)

    def reset():
        for layer in state.cache.layers:
            layer.cumulative_length.fill_(args.past)
        state.position_ids.fill_(args.past)
        state.attention_mask.fill_(1)

    def step():
        return state.step()

    def token_step():  # what generate() adds per token around the replay
        logits = state.step()
        tok = torch.argmax(logits[:, -1].to(dtype=torch.float32, copy=True), dim=-1)
        state.input_ids.copy_(tok[:, None])
        state.position_ids.add_(1)

    reset()
    step_ms = median_ms(step, device, args.steps)
    reset()
    token_ms = median_ms(token_step, device, args.steps)
    reset()
    rows = [{"kind": "meta", "model": "tiny-llama" if args.tiny else args.model, "layers": layers,
             "planned_with": args.target if args.profile_for_plan else "the device's profile",
             "batch": args.batch, "past": args.past, "copy_gbps": bw / 1e9, "device": str(device),
             "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "cuda_graph": runner.decision.note(), "step_ms": step_ms,
             "token_ms": token_ms, "replays": runner.stats["replays"], **fl}]
    lines = [f"# Decode step breakdown: {rows[0]['model']} ({layers} layers), batch {args.batch}, past {args.past}", "",
             f"{rows[0]['gpu']} · torch {torch.__version__} · copy {bw / 1e9:.0f} GB/s · planned with "
             f"{rows[0]['planned_with']} · {runner.decision.note()}", "",
             f"- step (one replay): **{step_ms:.3f} ms**; with generate()'s per-token host work: {token_ms:.3f} ms",
             f"- floor: weights {fl['floor_weights_ms']:.3f} ms + KV = **{fl['floor_ms']:.3f} ms**; "
             f"step / floor = **{step_ms / fl['floor_ms']:.3f}x** (issue 28: <= 1.15x); "
             f"above the floor: {(step_ms - fl['floor_ms']) * 1e3:.0f} µs", ""]

    gemms = linear_nodes(opt.graph_module)
    kernels = []
    if device.type == "cuda" and runner.decision.on:
        kernels, span = profile_kernels(step, device, args.replays)
        reset()
    if kernels:
        per = len(kernels) / args.replays
        busy = sum(k[2] for k in kernels) / args.replays
        by_type: dict = collections.defaultdict(lambda: [0, 0.0])
        by_name: dict = collections.defaultdict(lambda: [0, 0.0])
        for name, _, dur in kernels:
            by_type[kernel_type(name)][0] += 1
            by_type[kernel_type(name)][1] += dur
            by_name[name][0] += 1
            by_name[name][1] += dur
        wall = span / args.replays
        lines += [f"## Kernels in one replay ({per:.0f} kernels, {per / layers:.1f} per layer)", "",
                  f"Kernel time {busy:.0f} µs of a {wall:.0f} µs replay span ({span:.0f} µs over {args.replays} "
                  f"replays, including the host gap between replays): {wall - busy:.0f} µs between kernels, "
                  f"{(wall - busy) / max(per, 1):.2f} µs per kernel.", "",
                  "| kernel type | per replay | per layer | µs per replay | µs per kernel | share of kernel time |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for kind, (n, us) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| {kind} | {n / args.replays:.0f} | {n / args.replays / layers:.2f} | {us / args.replays:.1f} | "
                         f"{us / n:.2f} | {us / max(busy * args.replays, 1e-9):.1%} |")
            rows.append({"kind": "kernel_type", "type": kind, "per_replay": n / args.replays,
                         "us_per_replay": us / args.replays})
        lines += ["", "| kernel | per replay | µs per replay | µs each |", "| --- | ---: | ---: | ---: |"]
        for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
            lines.append(f"| `{short(name)}` | {n / args.replays:.0f} | {us / args.replays:.1f} | {us / n:.2f} |")
            rows.append({"kind": "kernel", "name": name, "per_replay": n / args.replays, "us_per_replay": us / args.replays})
        lines += [""]

        # GEMMs: the replay's GEMM kernels (a split-K reduce joins the GEMM before it) in order
        first = kernels[:round(per)]
        calls = []
        for name, _, dur in first:
            kind = kernel_type(name)
            if kind == "gemm":
                calls.append([name, dur])
            elif kind == "gemm split-K reduce" and calls:
                calls[-1][1] += dur
                calls[-1][0] += " + splitKreduce"
        gemm_us = sum(c[1] for c in calls)
        ideal_us = sum(g[3] for g in gemms) / bw * 1e6
        lines += [f"## GEMMs ({len(calls)} GEMM kernels in a replay, {len(gemms)} GEMM nodes in the graph)", "",
                  f"GEMM time {gemm_us:.0f} µs against {ideal_us:.0f} µs to read their weights at the copy rate "
                  f"({ideal_us / max(gemm_us, 1e-9):.1%} of it); everything else: {step_ms * 1e3 - gemm_us:.0f} µs of the "
                  f"{step_ms * 1e3:.0f} µs step.", ""]
        if len(calls) == len(gemms):
            shapes: dict = collections.defaultdict(list)
            for (node, N, K, nbytes), (kname, dur) in zip(gemms, calls):
                shapes[(N, K, nbytes)].append((dur, kname))
            lines += ["| weight [N, K] | calls | µs each (median) | GB/s | of copy rate | µs above the read | kernel |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
            for (N, K, nbytes), got in sorted(shapes.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
                med = statistics.median(d for d, _ in got)
                gbps = nbytes / (med * 1e-6) / 1e9
                lines.append(f"| {N} x {K} | {len(got)} | {med:.2f} | {gbps:.0f} | {gbps * 1e9 / bw:.1%} | "
                             f"{med - nbytes / bw * 1e6:.2f} | `{short(got[0][1], 60)}` |")
                rows.append({"kind": "gemm", "N": N, "K": K, "weight_bytes": nbytes, "calls": len(got), "us": med,
                             "gbps": gbps, "of_copy": gbps * 1e9 / bw, "kernel": got[0][1]})
        else:
            lines += ["The GEMM kernels do not match the graph's GEMM nodes one to one; by kernel name:", "",
                      "| kernel | calls | µs each (median) |", "| --- | ---: | ---: |"]
            named: dict = collections.defaultdict(list)
            for kname, dur in calls:
                named[kname].append(dur)
            for kname, durs in sorted(named.items(), key=lambda kv: -sum(kv[1])):
                lines.append(f"| `{short(kname)}` | {len(durs)} | {statistics.median(durs):.2f} |")
        lines += [""]
    else:
        from graphopt.tools.measure import graph_inputs, measure_nodes

        why = "no GPU" if device.type != "cuda" else ("no CUDA graph" if not runner.decision.on
                                                       else "the profiler reported no kernels")
        inputs = {"input_ids": state.input_ids, "attention_mask": state.attention_mask,
                  "position_ids": state.position_ids, "cache": copy.deepcopy(state.cache)}
        flat = graph_inputs(opt.graph_module, (), inputs)
        times = measure_nodes(opt.graph_module, flat, device, reps=3)
        by_op: dict = collections.defaultdict(lambda: [0, 0.0])
        for n in opt.graph_module.graph.nodes:
            if n.name in times and n.op == "call_function":
                key = getattr(n.target, "__name__", str(n.target))
                by_op[key][0] += 1
                by_op[key][1] += times[n.name] * 1e6
        lines += [f"## Nodes timed one by one ({why}: each op back to back in a stream, not in a graph)", "",
                  "| op | nodes | µs |", "| --- | ---: | ---: |"]
        for op, (n, us) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
            if us > 0:
                lines.append(f"| {op} | {n} | {us:.1f} |")
                rows.append({"kind": "node_op", "op": op, "nodes": n, "us": us})
        lines += [""]

    pred, total = predicted_breakdown(opt.graph_module, args.target)
    kern = sum(v[0] for v in pred.values())
    lines += [f"## Predicted ({args.target} profile, CUDA-graph launch costs): {total:.0f} µs, {kern} kernels "
              f"({kern / layers:.1f} per layer)", "", "| op | kernels | predicted µs |", "| --- | ---: | ---: |"]
    for op, (n, us) in sorted(pred.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {op} | {n} | {us:.1f} |")
        rows.append({"kind": "predicted", "op": op, "kernels": n, "us": us})
    lines += ["", "Passes: " + ", ".join(f"{r.name} {r.status} ({len(r.rewrites)})" for r in opt.report.applied())]
    write_rows(args.out, "diag_decode_step", rows, lines)


if __name__ == "__main__":
    main()
