# Answered: Does a checkpoint plan's predicted step memory match the traced peak (CPU)? Within 8% once the backward is walked in order; tests/passes/test_insert_checkpoints_memory.py now checks it (no result file).
"""A checkpoint plan's predicted step activations vs the traced peak, on the CPU (issue 8's memory model).

    python benchmarks/diag/diag_checkpoint_memory.py [--layers 8] [--hidden 256] [--batch 4] [--seq 256]
        [--budget 0.3] [--target cpu|h200] [--region-shares 0.5] [--backends aot,sac]

A GLM-4-9B-shaped decoder scaled down (MLP 3.34x hidden, vocab 37x hidden, bf16, SDPA) runs one
training step eagerly and once per checkpoint backend under ``graphopt.tools.memtrace.MemoryTrace``
(every storage an op makes, forward and backward, freed by a finalizer: the exact tensor peak, what
``max_memory_allocated`` measures on a GPU). It prints the traced peak and memory after the
forward next to the plan's prediction, and what was live at the peak by the op that made it.
``--region-shares 0.5`` forces big regions (one per half of the model), the shape of plan the
H200 run of 2026-11-30 had (2 regions; 9.03 GB measured vs 6.13 GB predicted).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(layers, hidden, batch, seq):
    from transformers import Glm4ForCausalLM

    from graphopt.examples import zoo

    cfg = zoo.glm4_9b_config(layers)
    cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = hidden, int(hidden * 3.34), 37 * hidden
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = max(hidden // 64, 2), 2, 64
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    model = Glm4ForCausalLM(cfg).to(torch.bfloat16).train()
    return model, (torch.randint(3, cfg.vocab_size, (batch, seq)),)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--target", default="cpu", help="profile to plan for (cpu: the kernels the trace runs)")
    ap.add_argument("--region-shares", default=None, help="comma-separated region sizes to search (default: the pass's)")
    ap.add_argument("--backends", default="aot,sac")
    args = ap.parse_args(argv)

    import graphopt
    from graphopt.tools.memtrace import trace_step

    planner = importlib.import_module("graphopt.checkpoint.planner")
    if args.region_shares:
        planner.REGION_SHARES = tuple(float(x) for x in args.region_shares.split(","))
    model, inputs = build(args.layers, args.hidden, args.batch, args.seq)
    params = list(model.parameters())

    def traced(fn):
        trace_step(fn, inputs, params=params)  # warm-up: gradients exist
        return trace_step(fn, inputs, params=params)

    mb = lambda x: x / 1e6  # noqa: E731
    r = traced(model)
    print(f"eager: traced peak {mb(r['peak']):.2f} MB, after forward {mb(r['after_forward']):.2f} MB")
    for backend in args.backends.split(","):
        t0 = time.perf_counter()
        try:
            opt = graphopt.optimize(model, inputs, training=True, memory_budget=args.budget, passes=["insert_checkpoints"],
                                    check_accuracy=False, checkpoint_backend=backend, target=args.target)
        except Exception as e:
            print(f"{backend}: {type(e).__name__}: {e}")
            continue
        model.train()
        d = opt.report.pass_result("insert_checkpoints").details
        r = traced(opt)
        tr = r["trace"]
        print(f"{backend}: {d.get('regions')} regions (optimize {time.perf_counter() - t0:.1f} s); traced peak "
              f"{mb(r['peak']):.2f} MB vs predicted step activations {mb(d['predicted_activation_bytes']):.2f} MB "
              f"({d['predicted_activation_bytes'] / r['peak'] - 1:+.1%}); after forward {mb(r['after_forward']):.2f} vs "
              f"{mb(d['predicted_held_bytes']):.2f} MB; budget {mb(d['budget_bytes']):.2f} MB of baseline "
              f"{mb(d['baseline_activation_bytes']):.2f} MB; predicted +{d['extra_ms']:.2f} ms")
        print("   live at the peak by op (MB):", {k.replace("aten.", ""): round(mb(v), 2)
                                                  for k, v in list(tr.by_op_at_peak().items())[:10]})
        print("   timeline marks (label, ops, live bytes):", tr.marks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
