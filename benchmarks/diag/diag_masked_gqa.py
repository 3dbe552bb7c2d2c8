# Answered: On the H200 (torch 2.11), does a masked SDPA reading K/V with enable_gqa (cuDNN's attention) beat the repeat_kv'd or broadcast call, inside a whole model with a padding mask, A/B in one process? Llama-3-8B shape 2 layers bs4 seq1024 6.029 -> 5.859 ms (0.972, outputs identical); multi-query Falcon-7B shape bs4 seq512 5.929 -> 2.888 (0.487; the math kernel before), unpadded positions within 0.0625, but rows whose every key is masked (left padding under a causal mask) differ: the math kernel gives zeros, cuDNN does not (max 1.29), so the accuracy guard may revert the pass where such rows exist (results/diag_masked_gqa_2026-12-04_195448.md, …195552.md).
"""A/B of fuse_attention's masked-GQA rule on an sm_90 profile: decoders given a padding mask, their
SDPA calls masked; A: the rule off (repeat_kv's copies stay, a multi-query call keeps its broadcast),
B: as shipped.

    python benchmarks/diag/diag_masked_gqa.py --out /tmp/out

bf16, random weights, graphopt.optimize(measure=False, check_accuracy=False) for both, each timed by
CUDA events (median of 20 after warm-up); the two outputs compared.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from _timing import cuda_median_ms  # noqa: E402


def models():
    from transformers import FalconConfig, FalconModel, LlamaConfig, LlamaModel

    yield "Llama-3-8B shape, 2 layers, bs4 seq1024", LlamaModel(LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=2, vocab_size=32000, attn_implementation="sdpa", use_cache=False)), 4, 1024
    yield "Falcon-7B shape (multi-query), 2 layers, bs4 seq512", FalconModel(FalconConfig(
        num_hidden_layers=2, attn_implementation="sdpa", use_cache=False)), 4, 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma list of model indices (0: Llama, 1: Falcon)")
    args = ap.parse_args()
    import graphopt
    import graphopt.passes.fuse_attention as fa

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    path = out / f"diag_masked_gqa_{stamp}.md"
    lines = [f"# masked GQA on sm_90, A/B ({torch.cuda.get_device_name()}, torch {torch.__version__}, bf16)", "",
             "| model | A: rule off ms | B: shipped ms | B / A | max abs diff (unpadded positions) |", "| --- | ---: | ---: | ---: | ---: |"]
    shipped = fa._masked_gqa_kernel
    only = set(filter(None, args.only.split(",")))
    for i, (name, model, batch, seq) in enumerate(models()):
        if only and str(i) not in only:
            continue
        model = model.to("cuda", torch.bfloat16).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 30000, (batch, seq), generator=g).cuda()
        mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
        mask[1, : seq // 4] = 0  # left padding on one sequence
        inputs = {"input_ids": ids, "attention_mask": mask}
        opts = dict(measure=False, check_accuracy=False)
        fa._masked_gqa_kernel = lambda ctx: fa._MASKED_GQA_KERNEL
        a = graphopt.optimize(model, inputs, **opts)
        fa._masked_gqa_kernel = shipped
        b = graphopt.optimize(model, inputs, **opts)
        with torch.no_grad():
            ya, yb = a(**inputs), b(**inputs)
            ya = ya[0] if isinstance(ya, (tuple, list)) else getattr(ya, "last_hidden_state", ya)
            yb = yb[0] if isinstance(yb, (tuple, list)) else getattr(yb, "last_hidden_state", yb)
            keep = mask.bool()  # the padded positions' outputs are not read (their rows mask every key)
            diff = (ya.float() - yb.float())[keep].abs().max().item()
            ta = cuda_median_ms(lambda: a(**inputs), reps=20, warmup=3)
            tb = cuda_median_ms(lambda: b(**inputs), reps=20, warmup=3)
        row = f"| {name} | {ta:.3f} | {tb:.3f} | {tb / ta:.3f} | {diff:.3g} |"
        print(row, flush=True)
        lines.append(row)
        path.write_text("\n".join(lines) + "\n")  # after each model: a cut-short run keeps what it measured
        del a, b, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
