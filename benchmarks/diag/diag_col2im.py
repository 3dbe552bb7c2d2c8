# Answered: Is graphopt::col2im (lower_col2im) faster than aten's fold with the copies around it, and than Inductor's, on fold shapes beyond VOLO's, and is it priced right? (results/diag_col2im_<date>.md)
"""Folds (``F.fold``) as models write them, each way of running them, and the cost model's price.

    python benchmarks/diag/diag_col2im.py --out DIR [--no-compile]

Each case is a small module: the windows made (a permute of a product, or a contiguous tensor), the
fold, and its reader (a permute to channels_last read by a linear, or an NCHW add). Timed replayed
from a CUDA graph (µs per call, median), bf16: eager (aten's copy of the permute, col2im and the
reader's copy), graphopt after ``lower_col2im`` alone (the graph the pass makes, run as
optimize() would), torch.compile (default mode) of the module, and the cost model's prediction of
the eager and rewritten graphs on this device's profile. Every result is checked against float64
("err": largest error over the largest reference value).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import rel_err, replayed_us, out_dir, table_lines, write_rows  # noqa: E402

BF = torch.bfloat16


class PermutedFold(nn.Module):
    """VOLO's outlooker tail: ``(a @ v).permute(0, 1, 4, 3, 2).reshape(B, C*k*k, L)``, folded, read
    as channels_last (``y.permute(0, 2, 3, 1)``) by a linear."""

    def __init__(self, size, k, pad, stride, C):
        super().__init__()
        self.size, self.k, self.pad, self.stride = size, k, pad, stride
        self.proj = nn.Linear(C, C)

    def forward(self, prod):  # prod [B, heads, L, k*k, C/heads]
        B, h, L, kk, d = prod.shape
        y = prod.permute(0, 1, 4, 3, 2).reshape(B, h * d * kk, L)
        y = F.fold(y, self.size, self.k, padding=self.pad, stride=self.stride)
        return self.proj(y.permute(0, 2, 3, 1))


class PlainFold(nn.Module):
    """A computed [N, C*kh*kw, L] tensor folded and added to an NCHW tensor."""

    def __init__(self, size, k, pad, stride, dil=1):
        super().__init__()
        self.kw = dict(output_size=size, kernel_size=k, padding=pad, stride=stride, dilation=dil)

    def forward(self, cols, r):
        return F.fold(cols * 0.5, **self.kw) + r


def _windows(n, k, p, s, d=1):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _volo(B, size, k, p, s, heads, d):
    L = _windows(size, k, p, s) ** 2
    return PermutedFold((size, size), k, p, s, heads * d), (torch.randn(B, heads, L, k * k, d),)


def _plain(B, C, size, k, p, s, dil=1):
    L = _windows(size, k, p, s, dil) ** 2
    return PlainFold((size, size), k, p, s, dil), (torch.randn(B, C * k * k, L), torch.randn(B, C, size, size))


CASES = [("VOLO-D1 outlooker fold (k3 s2 p1)", lambda: _volo(64, 28, 3, 1, 2, 6, 32)),
         ("VOLO-D1 bs8", lambda: _volo(8, 28, 3, 1, 2, 6, 32)),
         ("outlooker, 16 heads of 16 (k3 s1 p1)", lambda: _volo(16, 32, 3, 1, 1, 16, 16)),
         ("overlapping stride-1 fold (k3 p1), NCHW", lambda: _plain(16, 64, 56, 3, 1, 1)),
         ("patches back to an image (k16 s16)", lambda: _plain(64, 3, 224, 16, 0, 16)),
         ("overlapping patches (k7 s4 p3)", lambda: _plain(32, 64, 56, 7, 3, 4)),
         ("dilated (k3 d2 p2)", lambda: _plain(16, 32, 64, 3, 2, 1, 2))]


def node_times(gm, xs, cm) -> list:
    """[(node, op, kernel µs, predicted µs)] for each node of ``gm`` that launches kernels
    (profile_model.node_runs: the graph run node by node under the profiler)."""
    from profile_model import node_runs

    return [(name, op, ms * 1e3, pred * 1e3) for ms, name, op, _, pred in node_runs(gm, list(xs), cm)]


def row_for(name, make, dev, compile_too, passes=("lower_col2im",), nodes=False):
    import graphopt
    from graphopt.cost.model import CostModel
    from graphopt.cost.profiles import get_profile
    from graphopt.pipeline import run_passes

    torch.manual_seed(0)
    model, inputs = make()
    ref = model.double()(*(x.double() for x in inputs))
    model = model.to(dev, BF).eval()
    xs = tuple(x.to(dev, BF) for x in inputs)
    prof = get_profile(dev)[0]
    row = {"case": name, "shape": " ".join(str(tuple(x.shape)) for x in xs)}
    with torch.no_grad():
        row["eager_us"] = replayed_us(lambda: model(*xs))
        row["eager_err"] = rel_err(model(*xs), ref.to(dev))
        gm = graphopt.capture(model, xs)
        cm = CostModel(prof)
        row["pred_eager_us"] = float(cm.execution_cost(gm, mode="graphed", reuse_outputs=True).total_s) * 1e6
        if nodes:
            row["eager_nodes"] = node_times(gm, xs, cm)
        res = run_passes(gm, list(passes), target=prof)
        row["applied"] = ",".join(r.status for r in res)
        row["pred_ours_us"] = float(cm.execution_cost(gm, mode="graphed", reuse_outputs=True).total_s) * 1e6
        if nodes:
            row["ours_nodes"] = node_times(gm, xs, cm)
        run = lambda: gm(*xs)  # noqa: E731
        row["ours_us"] = replayed_us(run)
        out = run()
        row["ours_err"] = rel_err(out[0] if isinstance(out, (tuple, list)) else out, ref.to(dev))
        if compile_too:
            torch._dynamo.reset()
            cm_ = torch.compile(model)
            cm_(*xs)
            row["compile_us"] = replayed_us(lambda: cm_(*xs))
    return row


def _f(key):
    return lambda r: (f"{r[key]:.1f}" if isinstance(r.get(key), float) and key.endswith("_us")
                      else f"{r[key]:.1e}" if isinstance(r.get(key), float) else str(r.get(key, "—")))


def run_cases(doc, argv, cases, passes, stem, title) -> int:
    """Time each case (eager, graphopt after ``passes`` alone, compile), price it, write DIR/stem_<date>.md;
    with ``--nodes`` also each node's kernel time beside its price, in both graphs."""
    argv = list(argv or sys.argv[1:])
    compile_too = "--no-compile" not in argv
    nodes = "--nodes" in argv
    args = [a for a in argv if a not in ("--no-compile", "--nodes")]
    out = out_dir(doc, args)
    dev = torch.device("cuda")
    rows: list = []
    for name, make in cases:
        row = {"case": name}
        try:  # not under inference mode: the capture exports the module
            row.update(row_for(name, make, dev, compile_too, passes, nodes))
        except Exception as e:  # noqa: BLE001 - a diagnostic keeps the other cases
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = [("case", _f("case"), False), ("inputs", _f("shape"), False), ("eager µs", _f("eager_us"), True),
            ("graphopt µs", _f("ours_us"), True), ("compile µs", _f("compile_us"), True),
            ("predicted eager µs", _f("pred_eager_us"), True), ("predicted graphopt µs", _f("pred_ours_us"), True),
            ("pass", _f("applied"), False), ("eager err", _f("eager_err"), True), ("graphopt err", _f("ours_err"), True),
            ("note", lambda r: "", False)]
    props = torch.cuda.get_device_properties(dev)
    head = (f"{props.name}, torch {torch.__version__}, bf16; µs per call replayed from a CUDA graph (median); "
            f"graphopt = the captured graph after {', '.join(passes)} alone.")
    lines = table_lines(title, head, cols, rows)
    if nodes:
        lines += ["", "## Each node alone (run node by node, kernel µs under the profiler) against its price", "",
                  "| case | graph | node | op | kernel µs | predicted µs |", "| --- | --- | --- | --- | ---: | ---: |"]
        for r in rows:
            for g in ("eager", "ours"):
                for node, op, us, pred in r.get(f"{g}_nodes", []):
                    lines.append(f"| {r['case'][:40]} | {g} | {node} | `{op}` | {us:.1f} | {pred:.1f} |")
    write_rows(out, stem, rows, lines)
    return 0


def main(argv=None) -> int:
    return run_cases(__doc__, argv, CASES, ("lower_col2im",), "diag_col2im",
                     "# Folds: aten, graphopt::col2im, torch.compile")


if __name__ == "__main__":
    sys.exit(main())
