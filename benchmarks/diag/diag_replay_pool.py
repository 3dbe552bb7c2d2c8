"""Answers: why does a memory-budgeted training step replayed from CUDA graphs hold 2-3x its budget?
Builds one training_bench config (GPT-2 small by default), optimizes it with ``memory_budget`` and
``cuda_graphs=True`` (the replay forced), runs steps with the allocator's history recorded, and
reports the graph pool's segments between steps: bytes still allocated (active) against free but
kept (inactive: fragmentation or blocks the capture never reused), and the largest active blocks
with the Python frames that allocated them. The same for the unbudgeted step.

    python benchmarks/diag/diag_replay_pool.py --config gpt2 --out DIR

Writes diag_replay_pool_<date>.md under --out.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _frames(block) -> str:
    keep = []
    for f in block.get("frames", []):
        name = f.get("filename", "")
        if ("graphopt" in name or "fx" in name or "_functorch" in name or "autograd" in name) and "diag_" not in name:
            keep.append(f"{Path(name).name}:{f.get('line')} {f.get('name')}")
        if len(keep) >= 4:
            break
    return " < ".join(keep) or "(no frames)"


def pools_report(label: str) -> list[str]:
    snap = torch.cuda.memory._snapshot()
    by_pool = collections.defaultdict(lambda: [0, 0, 0])
    blocks = []
    for seg in snap["segments"]:
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if pid == (0, 0):
            continue
        rec = by_pool[pid]
        rec[0] += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                rec[1] += b["size"]
                blocks.append((b["size"], pid, _frames(b)))
            else:
                rec[2] += b["size"]
    lines = [f"### {label}", "", "| pool | segments GB | active GB | inactive GB |", "| --- | ---: | ---: | ---: |"]
    for pid, (tot, act, ina) in by_pool.items():
        lines.append(f"| {pid} | {tot / 1e9:.3f} | {act / 1e9:.3f} | {ina / 1e9:.3f} |")
    lines += ["", "Largest active blocks in graph pools, grouped by allocating frames:", "",
              "| MB (sum) | blocks | frames |", "| ---: | ---: | --- |"]
    grouped = collections.defaultdict(lambda: [0, 0])
    for size, _, fr in blocks:
        grouped[fr][0] += size
        grouped[fr][1] += 1
    for fr, (size, n) in sorted(grouped.items(), key=lambda kv: -kv[1][0])[:15]:
        lines.append(f"| {size / 1e6:.1f} | {n} | {fr} |")
    return lines + [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import graphopt
    from checkpoint_bench import _outs
    from training_bench import ARCHS, build

    dev = torch.device("cuda")
    m, inp, cfg, b, s = build(ARCHS[a.config], False, dev, torch.bfloat16)
    params = list(m.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    lines = [f"# Graph pools of a replayed training step: {a.config} (bs{b} seq{s}), {torch.cuda.get_device_name()}",
             "", f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}", ""]

    def step(fn):
        for p in params:
            p.grad.zero_()
        outs = _outs(fn(**inp))
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    for label, kw in ((f"memory_budget={a.budget}, cuda_graphs=True", {"memory_budget": a.budget}),
                      ("no budget, cuda_graphs=True", {})):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        opt = graphopt.optimize(m, inp, training=True, check_accuracy=False, cuda_graphs=True, **kw)
        m.train()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        for _ in range(3):
            step(opt)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        ck = next((r.details for r in opt.report.passes if r.name == "insert_checkpoints" and r.details), {})
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        if ck.get("budget_bytes"):
            lines.append(f"- {label}: budget {ck['budget_bytes'] / 1e9:.3f} GB, planned activations "
                         f"{ck.get('predicted_activation_bytes', 0) / 1e9:.3f} GB; the parameters' gradients "
                         f"{grads / 1e9:.3f} GB")
        lines.append(f"- {label}: allocated {torch.cuda.memory_allocated() / 1e9:.3f} GB, reserved "
                     f"{torch.cuda.memory_reserved() / 1e9:.3f} GB between steps; {opt._lower_note}")
        lines += pools_report(label)
        torch.cuda.memory._record_memory_history(enabled=None)
        print("\n".join(lines[-25:]), flush=True)
        del opt
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"diag_replay_pool_{dt.datetime.now(dt.timezone.utc):%Y-%m-%d_%H%M%S}.md"
    path.write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
