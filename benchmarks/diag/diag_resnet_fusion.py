# Answered: How fast can ResNet-50's conv + bias + ReLU (+ residual) run? cuDNN's fused convolution 2.67 ms against 5.15 for separate kernels at bs64: fuse_conv_relu (results/archive/diag_resnet_fusion_2026-11-29_h200.json).
"""Diagnostic: how fast can ResNet-50's conv + bias + ReLU (+ residual) run on this GPU?

    python benchmarks/diag/diag_resnet_fusion.py [--batches 64,1] [--reps 30] [--out DIR]

Times, in bf16 channels_last (cudnn.benchmark on), ms per forward:

* ``eager``: torchvision ResNet-50 as the user hand-converts it;
* ``folded``: BatchNorm folded into the convolutions (torch.fx.experimental.optimization.fuse):
  conv (cuDNN) + bias add + ReLU as aten runs them;
* ``cudnn-fused``: the folded model with conv + bias + ReLU as ``aten.cudnn_convolution_relu`` and
  the bottleneck's conv + bias + residual + ReLU as ``aten.cudnn_convolution_add_relu`` (cuDNN's
  fused conv/bias/add/activation), each call one cuDNN operation;
* ``graphopt``: ``graphopt.optimize`` as it stands.

Each also replayed from a CUDA graph. Prints a table and max |error| vs ``folded``; writes JSON
into --out when given. A diagnostic, not a result table.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class ConvReLU(nn.Module):
    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.w, self.b = conv.weight, conv.bias
        self.args = (list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups)

    def forward(self, x):
        return torch.ops.aten.cudnn_convolution_relu(x, self.w, self.b, *self.args)


class ConvAddReLU(nn.Module):
    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.w, self.b = conv.weight, conv.bias
        self.args = (list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups)

    def forward(self, x, z):
        return torch.ops.aten.cudnn_convolution_add_relu(x, self.w, z, 1.0, self.b, *self.args)


def cudnn_fused(gm: fx.GraphModule) -> tuple[fx.GraphModule, int, int]:
    mods = dict(gm.named_modules())
    g = gm.graph
    n_relu = n_add = 0

    def is_relu(n):
        return (n.op == "call_module" and isinstance(mods.get(n.target), nn.ReLU)) or \
            (n.op == "call_function" and n.target in (torch.relu, torch.nn.functional.relu))

    def is_conv(n):
        return n.op == "call_module" and isinstance(mods.get(n.target), nn.Conv2d) and len(n.users) == 1

    for n in list(g.nodes):
        if not is_relu(n):
            continue
        src = n.args[0]
        if is_conv(src):
            name = src.target.replace(".", "_") + "_fused"
            gm.add_submodule(name, ConvReLU(mods[src.target]))
            with g.inserting_before(n):
                new = g.call_module(name, (src.args[0],))
            n.replace_all_uses_with(new)
            g.erase_node(n)
            g.erase_node(src)
            n_relu += 1
        elif (src.op == "call_function" and src.target in (operator.add, operator.iadd, torch.add)
              and len(src.users) == 1):
            a, b = src.args[0], src.args[1]
            conv, z = (a, b) if is_conv(a) else (b, a) if is_conv(b) else (None, None)
            if conv is None:
                continue
            name = conv.target.replace(".", "_") + "_fused"
            gm.add_submodule(name, ConvAddReLU(mods[conv.target]))
            with g.inserting_before(n):
                new = g.call_module(name, (conv.args[0], z))
            n.replace_all_uses_with(new)
            g.erase_node(n)
            g.erase_node(src)
            g.erase_node(conv)
            n_add += 1
    g.lint()
    gm.recompile()
    return gm, n_relu, n_add


def timed(fn, x, reps, warmup=5):
    for _ in range(warmup):
        fn(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(x)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def graphed(fn, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    static = x.clone()
    with torch.cuda.graph(g):
        out = fn(static)

    def run(inp):
        static.copy_(inp)
        g.replay()
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,1")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torchvision
    from torch.fx.experimental.optimization import fuse

    torch.backends.cudnn.benchmark = True
    dev, dt = "cuda", torch.bfloat16
    rows = []
    base = torchvision.models.resnet50().eval()
    with torch.no_grad():
        for bs in (int(b) for b in a.batches.split(",")):
            x = torch.randn(bs, 3, 224, 224, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
            eager = base.to(dev, dt).to(memory_format=torch.channels_last)
            folded = fuse(base.float().cpu()).to(dev, dt).to(memory_format=torch.channels_last)
            fused, n_relu, n_add = cudnn_fused(fuse(base.float().cpu()).to(dev, dt).to(memory_format=torch.channels_last))
            ref = folded(x).float()
            variants = {"eager": eager, "folded": folded, "cudnn-fused": fused}
            try:
                import graphopt
                t0 = time.perf_counter()
                variants["graphopt"] = graphopt.optimize(base.to(dev, dt), (x,), check_accuracy=False)
                print(f"graphopt.optimize bs{bs}: {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - a diagnostic reports and goes on
                print(f"graphopt failed: {type(e).__name__}: {e}", flush=True)
            for name, m in variants.items():
                try:
                    err = (m(x).float() - ref).abs().max().item()
                    t = timed(m, x, a.reps)
                    tg = timed(graphed(m, x), x, a.reps) if name != "graphopt" else float("nan")
                except Exception as e:  # noqa: BLE001
                    print(f"bs{bs} {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                rows.append({"batch": bs, "variant": name, "ms": t, "graphed_ms": tg, "max_err_vs_folded": err})
                print(f"bs{bs:<3} {name:12s} {t:7.3f} ms   graphed {tg:7.3f} ms   max|err| {err:.3g}"
                      + (f"   ({n_relu} conv+relu, {n_add} conv+add+relu)" if name == "cudnn-fused" else ""),
                      flush=True)
            del eager, folded, fused, variants
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "rows": rows}
        (Path(a.out) / "diag_resnet_fusion.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
