"""Breadth: the model sweep (issue 10), the performance sweep (``perf``) and the fuzz campaign (``fuzz``).

The model sweep: every torchvision classification model and the Hugging Face list, random weights,
optimized on the CPU in fp32, judged by the accuracy rule against fp64.

    python benchmarks/sweep.py --all                      # full sweep, prints a table, writes the CSV
    python benchmarks/sweep.py --models resnet18,bert     # some models
    python benchmarks/sweep.py --all --update             # rewrite tests/sweep_expected.csv
    python benchmarks/sweep.py --list

    python benchmarks/sweep.py perf [--configs resnet50:64,hf-bert] [--small --device cpu]   # speed (--help)
    python benchmarks/sweep.py fuzz --examples 500 --seed 1    # random programs x pass subsets (--help)

Each model runs in a forked worker under --timeout seconds (default 240). Exits 1 when a status
differs from the committed CSV (unless --update), listing the differences.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.tools import sweep  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["perf"]:
        from graphopt.tools import perf_sweep

        return perf_sweep.main(argv[1:])
    if argv[:1] == ["fuzz"]:
        from graphopt.tools import fuzz

        return fuzz.campaign(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--models", help="comma-separated sweep names (torchvision names, HF: " + ",".join(sweep.HF_MODELS) + ")")
    g.add_argument("--all", action="store_true", help="every model (the default)")
    g.add_argument("--list", action="store_true", help="list the model names and exit")
    ap.add_argument("--csv", type=Path, default=None, help="write this run's rows here (default: benchmarks/results/sweep_latest.csv)")
    ap.add_argument("--update", action="store_true", help=f"merge this run into {sweep.EXPECTED_CSV.relative_to(ROOT)}")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per model (0: no limit, no worker process)")
    ap.add_argument("--plan", default=None, metavar="TARGET",
                    help="instead of optimize(): every pass but assign_precision in strict mode, priced for TARGET "
                         "(e.g. h200), so a pass that breaks a graph fails the model (run on the CPU)")
    a = ap.parse_args(argv)
    if a.list:
        for s in sweep.all_specs():
            print(f"{s.source:12s} {s.name}")
        return 0
    try:
        specs = sweep.get_specs(a.models.split(",") if a.models else None)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    if a.plan:
        from graphopt.cost.profiles import get_profile
        from graphopt.errors import GraphoptError

        try:
            get_profile(a.plan)
        except (GraphoptError, KeyError, OSError) as e:
            print(f"error: --plan {a.plan}: {e}", file=sys.stderr)
            return 2
    rows = sweep.sweep(specs, timeout_s=a.timeout or None, log=lambda s: print(s, flush=True), plan=a.plan)
    out = a.csv or ROOT / "benchmarks" / "results" / "sweep_latest.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep.write_csv(rows, out)
    print(f"\nwrote {out}")
    for (src, st), n in sorted(sweep.counts(rows).items()):
        print(f"  {src:12s} {st:14s} {n}")
    expected = sweep.read_csv() if sweep.EXPECTED_CSV.exists() else {}
    if a.update and a.plan:
        print("error: --update records optimize()'s statuses; not with --plan", file=sys.stderr)
        return 2
    if a.update:
        merged = sweep.merge(expected, rows)
        import csv
        with open(sweep.EXPECTED_CSV, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sweep.FIELDS, lineterminator="\n")
            w.writeheader()
            w.writerows(merged)
        print(f"updated {sweep.EXPECTED_CSV}")
        return 0
    diffs = [d for d in (sweep.difference(r, expected) for r in rows) if d]
    for d in diffs:
        print(d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
