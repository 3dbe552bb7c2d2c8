"""Optimize a zoo model for inference, print what graphopt did, and check the outputs.

    python examples/optimize_resnet.py                # resnet50, batch 1, CPU
    python examples/optimize_resnet.py --device cuda --batch 64 --model convnext_tiny
"""

from __future__ import annotations

import argparse

import torch

import graphopt
from graphopt.examples import zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50", choices=zoo.names())
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    model, inputs = zoo.get(args.model, batch=args.batch, device=args.device)
    out = graphopt.optimize(model, inputs, device=args.device)
    print(out.report)

    with torch.no_grad():
        ref, got = model(*inputs), out(*inputs)
    ref = ref if torch.is_tensor(ref) else ref[0]
    got = got if torch.is_tensor(got) else got[0]
    err = (got.float() - ref.float()).abs().max().item()
    print(f"max |optimized - eager| = {err:.3e}  (allclose 1e-4: {torch.allclose(got, ref, atol=1e-4, rtol=1e-4)})")


if __name__ == "__main__":
    main()
