"""optimize()'s host time by phase on a 40-layer GLM-4-structured decoder with narrow widths (hidden 256,
bf16, batch 1, 128 tokens, planned for the H200), on the CPU: a proxy of the full GLM-4-9B's set-up time
(issue 29's 12 s target) whose graph has the real model's 40 layers of nodes. Prints the second call's
phases (the first pays first-use costs). Answered: which host phases the set-up time is spent in, and an
A/B of a change (run it in two checkouts with PYTHONPATH set to each).

    PYTHONPATH=$PWD python benchmarks/diag/diag_setup_glm40.py [--layers 40]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphopt  # noqa: E402
from graphopt.examples.zoo import LogitsOnly  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=40)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, Glm4Config

    cfg = Glm4Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
                     max_position_embeddings=4096, rms_norm_eps=1.5625e-07, attention_bias=True,
                     tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = LogitsOnly(AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()).eval()
    ids = torch.randint(0, 1000, (1, 128))
    graphopt.optimize(model, (ids,), target="h200")  # first use
    t0 = time.perf_counter()
    opt = graphopt.optimize(model, (ids,), target="h200")
    print(f"total {time.perf_counter() - t0:.2f} s")
    for k, v in sorted(opt.report.optimize_phases.items(), key=lambda x: -x[1]):
        print(f"  {k:40s} {v:.2f}")
    print("accuracy", opt.report.accuracy.get("passed"), opt.report.accuracy.get("mode"),
          "applied", [r.name for r in opt.report.passes if r.status == "applied"])


if __name__ == "__main__":
    main()
