"""Models outside the sweep, on the CPU: torchvision models not in ``graphopt.tools.perf_sweep.TORCHVISION`` /
``TORCHVISION_BS1`` (random weights, fp32, eval mode, small inputs): segmentation (a dict out), video (5-D
clips), classification families the sweep lists leave out, optical flow (RAFT) and detection (lists of
images in, lists of dicts out, data-dependent control flow). Per model, as diag_outside_timm.py does:
``plan``, the passes a GPU plan applies (``sweep.strict_plan`` priced for the H200, a pass that breaks the
graph raises) and the accuracy rule; ``optimize``, ``graphopt.optimize`` with its defaults; ``train``,
``optimize(training=True)`` and with ``memory_budget``, the output (a dict's tensors concatenated) and every
parameter gradient against a float64 copy by the accuracy rule (models whose output is a tensor or a dict of
tensors). Besides: the passes each applied (and any reverted, with why), and for a model that does not
optimize, the form of the error: a one-line GraphoptError, or something else, and what went to stderr.

    python benchmarks/diag/diag_outside_torchvision.py [--only a,b] [--group seg,video,...] [--no-train] --out DIR

Writes outside_torchvision_<UTC date>_cpu.md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_outside_models import add_row, plan_cells, train, write_table  # noqa: E402

from graphopt.tools import sweep  # noqa: E402

SEG = dict(weights=None, weights_backbone=None, num_classes=4)
DET = dict(weights=None, weights_backbone=None, num_classes=3)
SMALL_RCNN = dict(min_size=128, max_size=128)  # GeneralizedRCNNTransform resizes to these
# name -> (group, torchvision module, constructor kwargs, input shapes (one per positional arg; "list" wraps
#          one image in a list, as detection models take them), whether to train)
MODELS = {
    # segmentation: OrderedDict(out=, aux=)
    "fcn_resnet50": ("seg", "segmentation", dict(SEG, aux_loss=True), [(2, 3, 64, 64)], True),
    "deeplabv3_mobilenet_v3_large": ("seg", "segmentation", dict(SEG, aux_loss=True), [(2, 3, 64, 64)], True),
    "lraspp_mobilenet_v3_large": ("seg", "segmentation", SEG, [(2, 3, 64, 64)], True),
    "deeplabv3_resnet50": ("seg", "segmentation", dict(SEG, aux_loss=True), [(2, 3, 64, 64)], True),
    # video: [B, C, T, H, W]
    "r3d_18": ("video", "video", dict(num_classes=10), [(1, 3, 8, 64, 64)], True),
    "mc3_18": ("video", "video", dict(num_classes=10), [(1, 3, 8, 64, 64)], True),
    "r2plus1d_18": ("video", "video", dict(num_classes=10), [(1, 3, 8, 64, 64)], True),
    "s3d": ("video", "video", dict(num_classes=10), [(1, 3, 16, 224, 224)], True),  # its 2x7x7 pool: >= 16x224x224
    "mvit_v2_s": ("video", "video", dict(num_classes=10), [(1, 3, 8, 64, 64)], True),  # built at 8x64x64, see build
    "swin3d_t": ("video", "video", dict(num_classes=10), [(1, 3, 8, 64, 64)], True),
    # classification families the sweep's lists leave out (googlenet, inception_v3, maxvit_t,
    # efficientnet_v2_s and convnext_tiny are in them)
    "regnet_y_400mf": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "regnet_x_800mf": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "mnasnet0_5": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "shufflenet_v2_x0_5": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "squeezenet1_0": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "efficientnet_b1": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "resnet34": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "densenet169": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "convnext_small": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "swin_v2_t": ("cls", "", dict(num_classes=10), [(2, 3, 64, 64)], True),
    "vit_b_32": ("cls", "", dict(num_classes=10, image_size=64), [(2, 3, 64, 64)], True),
    # optical flow: (image1, image2) -> a list of flows, one per update
    "raft_small": ("flow", "optical_flow", dict(weights=None), [(1, 3, 128, 128), (1, 3, 128, 128)], False),
    # detection: [image] -> [dict(boxes=, labels=, scores=, ...)]
    "fasterrcnn_mobilenet_v3_large_320_fpn": ("det", "detection", DET, ["list"], False),
    "retinanet_resnet50_fpn": ("det", "detection", dict(DET, **SMALL_RCNN), ["list"], False),
    "ssdlite320_mobilenet_v3_large": ("det", "detection", DET, ["list"], False),
    "keypointrcnn_resnet50_fpn": ("det", "detection", dict(DET, num_classes=2, num_keypoints=5, **SMALL_RCNN),
                                  ["list"], False),
}


def _constructor(name):
    import torchvision

    group, module, kw, _, _ = MODELS[name]
    fn = getattr(getattr(torchvision.models, module) if module else torchvision.models, name)
    if name == "mvit_v2_s":  # mvit_v2_s fixes 16x224x224 in its call to _mvit; a smaller clip through it
        from torchvision.models.video import mvit

        def small(**k):
            orig = mvit._mvit
            mvit._mvit = lambda *a, **kk: orig(*a, **{**kk, "spatial_size": (64, 64), "temporal_size": 8})
            try:
                return fn(**k)
            finally:
                mvit._mvit = orig
        return small, dict(kw, weights=None)
    return fn, kw if "weights" in kw else dict(kw, weights=None)


def build(name):
    fn, kw = _constructor(name)
    torch.manual_seed(0)
    model = fn(**kw).eval()
    gen = torch.Generator().manual_seed(0)
    args = []
    for shape in MODELS[name][3]:
        if shape == "list":
            args.append([torch.rand(3, 160, 128, generator=gen)])  # one image, values in [0, 1] as torchvision's
        else:
            args.append(torch.randn(*shape, generator=gen))
    return model, tuple(args)


# --------------------------------------------------------------------------- what each run did

_SEEN: dict = {}


def _record_passes():
    """Record the passes each plan and optimize call applied (and reverted): sweep.run_one discards them."""
    import graphopt

    orig_plan, orig_opt = sweep.strict_plan, graphopt.optimize

    def plan(*a, **k):
        gm, applied = orig_plan(*a, **k)
        _SEEN["plan"] = applied
        return gm, applied

    def optimize(*a, **k):
        opt = orig_opt(*a, **k)
        if not k:  # optimize with its defaults (not the training runs)
            _SEEN["optimize"] = [p.name for p in opt.report.passes if p.status == "applied"]
            _SEEN["reverted"] = [f"{p.name} ({next((n for n in p.notes if 'revert' in n), '')[:160]})"
                                 for p in opt.report.passes if p.status == "reverted"]
        return opt

    sweep.strict_plan, graphopt.optimize = plan, optimize


_SHORT = {"eliminate_dead_code": "dce", "eliminate_common_subexpressions": "cse", "fold_conv_bn": "conv_bn",
          "convert_channels_last": "NHWC", "fold_constants": "const", "eliminate_permutes": "perm"}


def _names(xs):
    return ", ".join(_SHORT.get(x, x) for x in xs) if xs else "none"


def error_form(name):
    """optimize() once more, stderr (the file descriptor) caught: whether it raises, what, and how."""
    import graphopt
    from graphopt.errors import GraphoptError

    model, inputs = build(name)
    with tempfile.TemporaryFile(mode="w+") as err:
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(err.fileno(), 2)
        try:
            try:
                graphopt.optimize(model, inputs)
                exc = None
            except Exception as e:  # noqa: BLE001 - what we look at
                exc = e
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        noise = [ln for ln in err.read().splitlines() if ln.strip()]
    if exc is None:
        form = "no error"
    else:
        text = str(exc)
        kind = "GraphoptError" if isinstance(exc, GraphoptError) else "NOT a GraphoptError"
        form = (f"{type(exc).__name__} ({kind}, {len(text.splitlines())} line(s), {len(text)} chars): "
                f"{text.splitlines()[0][:160] if text else ''}")
    return form + f"; stderr {len(noise)} line(s)" + (f", first: {noise[0][:100]}" if noise else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--group", default="", help="comma-separated subset of seg,video,cls,flow,det")
    p.add_argument("--budget", type=float, default=0.6, help="memory_budget of the second training variant")
    p.add_argument("--no-train", default="", nargs="?", const="all",
                   help="plan and optimize only (for every model, or the comma-separated ones given)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    groups = [g for g in args.group.split(",") if g]
    names = [n for n in names if not groups or MODELS[n][0] in groups]
    no_train = set(MODELS) if args.no_train == "all" else set(args.no_train.split(","))
    import torchvision

    _record_passes()
    stamp = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# torchvision models outside the sweep, on the CPU ({stamp:%Y-%m-%d %H:%M} UTC)", "",
             f"torch {torch.__version__}, torchvision {torchvision.__version__}; random weights, fp32, eval mode; "
             "inputs in the script's MODELS. plan: the H200 plan's passes in strict mode + the accuracy rule; "
             "optimize: defaults; train: training=True, then "
             f"memory_budget={args.budget}, output (a dict's tensors concatenated) and every parameter gradient by "
             "the rule against float64 (only models whose output is a tensor or a dict of tensors). passes: "
             "those applied by the plan / by optimize, and those optimize reverted. error: for a model that did "
             "not optimize, optimize() again: the exception's type and lines, and what went to stderr.", "",
             "| model | group | plan (h200) | optimize | passes (plan / optimize / reverted) | train | train + budget "
             "| error |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        t0 = time.perf_counter()
        make = lambda n=name: build(n)  # noqa: E731
        _SEEN.clear()
        cells = plan_cells(name, "torchvision", make)
        passes = (f"{_names(_SEEN.get('plan'))} / {_names(_SEEN.get('optimize'))} / "
                  f"{'; '.join(_SEEN.get('reverted') or []) or 'none'}")
        trains = (["—", "—"] if not MODELS[name][4] or name in no_train else train(name, args.budget, make))
        form = "—" if all(c.startswith("pass") for c in cells) else error_form(name)
        add_row(lines, name, [MODELS[name][0], *cells, passes, *trains, form], t0)
    write_table(lines, Path(args.out) / f"outside_torchvision_{stamp:%Y-%m-%d_%H%M%S}_cpu.md")


if __name__ == "__main__":
    main()
