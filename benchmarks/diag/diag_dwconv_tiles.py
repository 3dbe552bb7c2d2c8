# Answered: How fast graphopt::dwconv2d runs each of diag_dwconv's cases with each channel block (16, 32, 64, 128 channels by 2048 / that many output pixels a program), against the block it picks: is its error against its price (1.2-1.6x where it picked 32 channels by 64 pixels, 2x and more where it picked 128 by 16, ConvMixer's 7x7 among them) the tile's? (results/diag_dwconv_tiles_<date>.md)
"""graphopt::dwconv2d with its channel block forced, on diag_dwconv's cases.

    python benchmarks/diag/diag_dwconv_tiles.py --out DIR

Each case's module is captured and run through ``fuse_bias_act`` and ``lower_depthwise_conv`` (as
diag_dwconv does); the graph is then timed replayed from a CUDA graph (µs per call, median, bf16) with
``dwconv_triton.block_c`` returning each channel block in turn (the kernel compiles one variant a
block), beside the block it picks itself and the cost model's price of the kernel.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import out_dir, rel_err, replayed_us, table_lines, write_rows  # noqa: E402
from diag_dwconv import CASES  # noqa: E402

BLOCKS = (16, 32, 64, 128)


def row_for(name, make) -> dict:
    import graphopt
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.cuda_ext import dwconv_triton
    from graphopt.pipeline import run_passes

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, inputs = make()
    ref = model.double()(*(x.double() for x in inputs)).to(dev)
    model = model.to(dev, torch.bfloat16).eval()
    xs = tuple(x.to(dev, torch.bfloat16) for x in inputs)
    row = {"case": name}
    with torch.no_grad():
        gm = graphopt.capture(model, xs)
        prof = get_profile(dev)[0]
        res = run_passes(gm, ["fuse_bias_act", "lower_depthwise_conv"], target=prof)
        if res[-1].status != "applied":
            row["error"] = f"lower_depthwise_conv {res[-1].status}"
            return row
        cm = CostModel(prof)
        row["pred_us"] = sum(float(c.time_s) for c in cm.graph_cost(gm).nodes if "dwconv2d" in c.op) * 1e6
        conv = next(n for n in gm.graph.nodes if "dwconv2d" in str(n.target))
        row["picked"] = dwconv_triton.block_c(int(conv.meta["val"].shape[1]))
        picker = dwconv_triton.block_c
        try:
            for bc in BLOCKS:
                dwconv_triton.block_c = lambda C, bc=bc: bc
                row[f"us_{bc}"] = replayed_us(lambda: gm(*xs))
                out = gm(*xs)
                row[f"err_{bc}"] = rel_err(out[0] if isinstance(out, (tuple, list)) else out, ref)
        finally:
            dwconv_triton.block_c = picker
    return row


def main(argv=None) -> int:
    out = out_dir(__doc__, argv)
    rows = []
    for name, make in CASES:
        try:
            rows.append(row_for(name, make))
        except Exception as e:  # noqa: BLE001 - a diagnostic keeps the other cases
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"})
        print(rows[-1], flush=True)
    f = lambda k, fmt="{:.1f}": (lambda r: fmt.format(r[k]))  # noqa: E731
    cols = ([("case", f("case", "{}"), False), ("picked block", f("picked", "{}"), True),
             ("predicted µs (the kernel)", f("pred_us"), True)]
            + [(f"µs at {bc}", f(f"us_{bc}"), True) for bc in BLOCKS]
            + [("largest error", lambda r: f"{max(r[f'err_{bc}'] for bc in BLOCKS):.1e}", True)])
    props = torch.cuda.get_device_properties(0)
    head = (f"{props.name}, torch {torch.__version__}, bf16; the captured graph after fuse_bias_act and "
            "lower_depthwise_conv, µs per call replayed from a CUDA graph (median), the channel block forced "
            "(output pixels a program: 2048 / block).")
    write_rows(out, "diag_dwconv_tiles", rows, table_lines("# graphopt::dwconv2d by channel block", head, cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
