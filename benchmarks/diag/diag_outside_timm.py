"""Models outside the sweep, on the CPU: timm architectures not in ``graphopt.tools.perf_sweep.TIMM`` (random
weights, fp32, batch 2, small images where the model takes any size). Per model, as diag_outside_models.py
does for transformers: ``plan``, the passes a GPU plan applies (``sweep.strict_plan`` priced for the H200, a
pass that breaks the graph raises) and the accuracy rule; ``optimize``, ``graphopt.optimize`` with its
defaults; ``train``, ``optimize(training=True)`` and with ``memory_budget``, the output and every parameter
gradient against a float64 copy by the accuracy rule.

    python benchmarks/diag/diag_outside_timm.py [--only a,b] [--no-train] --out DIR

Writes outside_timm_<UTC date>_cpu.md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_outside_models import add_row, plan_cells, train, write_table  # noqa: E402

# name -> (create_model kwargs, image side); transformers-style models take img_size where they fix it
MODELS = {
    # convolutional
    "ghostnet_100": ({}, 96), "mixnet_s": ({}, 96), "rexnet_100": ({}, 96), "hrnet_w18_small": ({}, 96),
    "dla34": ({}, 96), "dpn68": ({}, 96), "res2net50_14w_8s": ({}, 96), "skresnet18": ({}, 96),
    "cspresnet50": ({}, 96), "ese_vovnet19b_dw": ({}, 96), "nf_resnet26": ({}, 96), "repvgg_a0": ({}, 96),
    "lcnet_050": ({}, 96), "tinynet_e": ({}, 96), "selecsls42b": ({}, 96), "hgnetv2_b0": ({}, 96),
    "resnest14d": ({}, 96), "ecaresnet26t": ({}, 96), "gcresnet33ts": ({}, 96), "xception41": ({}, 96),
    "fastvit_t8": ({}, 96), "edgenext_xx_small": ({}, 96), "mobilevitv2_050": ({}, 96),
    "inception_next_tiny": ({}, 96), "mambaout_femto": ({}, 96), "rdnet_tiny": ({}, 96),
    "efficientvit_b0": ({}, 96), "repghostnet_050": ({}, 96), "mobilenetv4_conv_small": ({}, 96),
    # attention and token mixers
    "maxvit_nano_rw_256": ({"img_size": 128}, 128), "swinv2_cr_tiny_ns_224": ({"img_size": 112}, 112),
    "pvt_v2_b0": ({}, 96), "levit_128s": ({"img_size": 128}, 128), "xcit_nano_12_p16_224": ({"img_size": 96}, 96),
    "cait_xxs24_224": ({"img_size": 96}, 96), "coat_lite_tiny": ({"img_size": 96}, 96),
    "resmlp_12_224": ({"img_size": 96}, 96), "gmlp_ti16_224": ({"img_size": 96}, 96),
    "twins_svt_small": ({"img_size": 96}, 96), "tnt_s_patch16_224": ({"img_size": 96}, 96),
    "volo_d1_224": ({"img_size": 96}, 96), "eva02_tiny_patch14_224": ({"img_size": 98}, 98),
    "vit_small_patch16_rope_224": ({"img_size": 96}, 96),
    "hiera_tiny_224": ({}, 224), "davit_tiny": ({}, 96), "focalnet_tiny_srf": ({}, 96),
    "tiny_vit_5m_224": ({}, 224), "caformer_s18": ({}, 96), "crossvit_tiny_240": ({"img_size": 240}, 240),
    "efficientformerv2_s0": ({"img_size": 96}, 96), "nextvit_small": ({}, 96), "fastvit_mci0": ({}, 96),
}


def build(name):
    import timm

    kw, side = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kw).eval()
    return model, (torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(0)),)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--budget", type=float, default=0.6, help="memory_budget of the second training variant")
    p.add_argument("--no-train", action="store_true", help="plan and optimize only")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    import timm

    stamp = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# timm models outside the sweep, on the CPU ({stamp:%Y-%m-%d %H:%M} UTC)", "",
             f"torch {torch.__version__}, timm {timm.__version__}; random weights, fp32, batch 2. plan: the H200 "
             "plan's passes in strict mode + the accuracy rule; optimize: defaults; train: training=True, then "
             f"memory_budget={args.budget}, output and every parameter gradient by the rule against float64.", "",
             "| model | plan (h200) | optimize | train | train + budget |", "| --- | --- | --- | --- | --- |"]
    for name in names:
        t0 = time.perf_counter()
        make = lambda n=name: build(n)  # noqa: E731
        cells = plan_cells(name, "timm", make) + (["—", "—"] if args.no_train else train(name, args.budget, make))
        add_row(lines, name, cells, t0)
    write_table(lines, Path(args.out) / f"outside_timm_{stamp:%Y-%m-%d_%H%M%S}_cpu.md")


if __name__ == "__main__":
    main()
