"""Answers: how much of a decoder's capture does torch.export spend on grad-mode regions, and what does
an inference capture (export under no_grad, the model's switches to the mode in force skipped) save?
A 40-layer GLM-4-9B-shaped decoder with a small hidden size (export's time is per op, not per byte), on
the CPU; capture with inference=False and True alternately, ``--rounds`` rounds, and the time inside
torch's replace_set_grad_with_hop_pass.

    python benchmarks/diag/diag_export_grad.py --out DIR

Writes diag_export_grad_<date>_torch-<version>.md under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/out")
    a = ap.parse_args()
    import torch._export.passes.replace_set_grad_with_hop_pass as rs
    from transformers import AutoModelForCausalLM

    from graphopt.capture import capture
    from graphopt.examples.zoo import LogitsOnly, glm4_9b_config

    cfg = glm4_9b_config(num_layers=a.layers)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 256, 512, 2, 1
    cfg.head_dim, cfg.vocab_size, cfg.pad_token_id = 128, 1000, 0
    model = LogitsOnly(AutoModelForCausalLM.from_config(cfg).eval()).eval()
    ids = torch.randint(0, 1000, (1, 64))
    spent = [0.0]
    real = rs.replace_set_grad_with_hop_pass

    def timed_pass(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    rs.replace_set_grad_with_hop_pass = timed_pass
    rows = {False: [], True: []}
    for _ in range(a.rounds):
        for inference in (False, True):
            spent[0] = 0.0
            t = time.perf_counter()
            gm = capture(model, ((ids,), {}), inference=inference)
            rows[inference].append((time.perf_counter() - t, spent[0], len(gm.graph.nodes)))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    lines = [f"# Capture of a {a.layers}-layer GLM-4-shaped decoder (hidden 256) on the CPU, torch {torch.__version__} ({stamp})",
             "", f"Median of {a.rounds} alternating rounds.", "",
             "| capture | s | of it in replace_set_grad_with_hop_pass, s | nodes |", "| --- | ---: | ---: | ---: |"]
    for inference, rs_ in rows.items():
        lines.append(f"| {'inference (no_grad, redundant switches skipped)' if inference else 'grad mode on (as before)'} | "
                     f"{statistics.median(r[0] for r in rs_):.2f} | {statistics.median(r[1] for r in rs_):.2f} | {rs_[0][2]} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"diag_export_grad_{stamp}_torch-{torch.__version__.split('+')[0]}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
