# Answered: Do lower_depthwise_conv and lower_upsample keep the numbers on models no test was written for (ten timm and torchvision models, planned for the H200 on the CPU, the accuracy guard on)? Yes, every one (results/lowerings_unseen_2026-12-07_cpu.md). With --passes: the same for hoist_slices, fuse_elementwise's new ops and fuse_rotary's [B, S, H, D] form on models they were not written for (results/fusions_unseen_2026-12-07_cpu.md).
"""optimize() each model with ``target="h200"`` and the accuracy guard on, on the CPU (the two ops run
their reference implementations there), and print each lowering's status, its rewrites and
refusals, and the accuracy verdict.

    python benchmarks/diag/diag_lowerings_unseen.py [--passes P1,P2] [timm-NAME | hf-TYPE | seg-NAME ...]
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODELS = ["timm-mobilevit_xxs", "timm-efficientformerv2_s0", "timm-repvit_m1", "timm-convnextv2_atto",
          "timm-ghostnetv2_100", "timm-rexnet_100", "timm-fastvit_t8", "timm-edgenext_xx_small",
          "seg-lraspp_mobilenet_v3_large", "seg-deeplabv3_mobilenet_v3_large"]
PASSES = ("lower_depthwise_conv", "lower_upsample")


def build(name: str):
    torch.manual_seed(0)
    if name.startswith("seg-"):
        import torchvision

        fn = getattr(torchvision.models.segmentation, name[4:])
        return fn(weights=None, weights_backbone=None).eval(), (torch.randn(2, 3, 96, 128),)
    from graphopt.tools.perf_sweep import build as sweep_build

    return sweep_build(name, 2, small=name.startswith("hf-"))


def main(argv=None) -> int:
    import graphopt

    warnings.filterwarnings("ignore")
    args = list(argv or sys.argv[1:])
    passes = PASSES
    if "--passes" in args:
        i = args.index("--passes")
        passes = tuple(args[i + 1].split(","))
        del args[i:i + 2]
    for name in args or MODELS:
        model, inputs = build(name)
        report = graphopt.optimize(model, inputs, target="h200").report
        for p in report.passes:
            if p.name in passes:
                refused = sorted({r.reason for r in p.rejected})
                print(f"{name}: {p.name} {p.status}, {len(p.rewrites)} rewrites"
                      f"{', refused: ' + '; '.join(refused) if refused else ''}", flush=True)
        print(f"{name}: accuracy {'passed' if report.accuracy['passed'] else 'FAILED'} "
              f"(max abs err {report.accuracy['max_abs_err']:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
