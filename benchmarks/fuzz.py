"""Fuzz campaign (issue 10.2): random programs x random pass subsets x targets, many examples.

    python benchmarks/fuzz.py --examples 500 --seed 1 [--mode passes|optimize|both] [--no-write]

Each distinct failure (stage, pass, error type) is shrunk by hypothesis to a minimal program
and written as tests/fuzz_regressions/test_<hash>.py (marked xfail(strict=True) until the pass
is fixed); later rounds treat already-found signatures as known and keep searching. Half the
programs in mode "passes" run with ``ignore_cost``: every rewrite a pass finds legal applies, so
legality (and the order rewrites apply in) is tested apart from the cost model's choices.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, settings, seed as hseed, strategies as st  # noqa: E402

from graphopt.tools import fuzz  # noqa: E402
from graphopt.pipeline import available  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "fuzz_regressions"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("passes", "optimize", "both"), default="both")
    ap.add_argument("--max-ops", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="report failures, write no regression files")
    args = ap.parse_args(argv)

    known: dict = {}  # signature -> (program, passes, target, mode, message)
    done = [0]
    last: list = []
    modes = ("passes", "optimize") if args.mode == "both" else (args.mode,)
    t0 = time.time()
    for rnd in range(20):
        left = args.examples - done[0]
        if left <= 0:
            break

        @hseed(args.seed * 1000 + rnd)
        @settings(max_examples=left, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  report_multiple_bugs=False, print_blob=False)
        @given(fuzz.programs(args.max_ops), fuzz.pass_subsets(fuzz.strict_passes()), fuzz.pass_subsets(available()),
               st.sampled_from(("cpu", "h200")), st.sampled_from(modes), st.booleans())
        def prop(program, strict_subset, any_subset, target, mode, ignore_cost):
            done[0] += 1
            passes = strict_subset if mode == "passes" else any_subset
            ignore_cost = ignore_cost and mode == "passes"  # every legal rewrite, whatever its predicted gain
            try:
                fuzz.check_program(program, passes, target, mode, ignore_cost=ignore_cost)
            except fuzz.FuzzFailure as e:
                if e.signature() in known:
                    return  # already found; keep looking for others
                last[:] = [e.signature(), (program, passes, target, mode, str(e), ignore_cost)]
                raise

        last.clear()
        try:
            prop()
            break  # a clean round: budget spent with nothing new
        except fuzz.FuzzFailure:
            sig, found = last  # the final call hypothesis makes replays the shrunk example
            known[sig] = found
            program, passes, target, mode, msg, ignore_cost = found
            print(f"\nFAILURE {sig}\n  program: {program!r}\n  passes: {passes} target: {target} mode: {mode}"
                  f"{' ignore_cost' if ignore_cost else ''}\n  error: {msg.splitlines()[0]}", flush=True)
            if not args.no_write:
                OUT.mkdir(exist_ok=True)
                path = OUT / f"test_{fuzz.failure_id(program, passes, target, mode, ignore_cost)}.py"
                path.write_text(fuzz.regression_source(program, passes, target, mode, msg, ignore_cost=ignore_cost))
                print(f"  wrote {path.relative_to(OUT.parent.parent)}", flush=True)
    print(f"\n{done[0]} examples (incl. shrinking) in {time.time() - t0:.0f} s; {len(known)} distinct failures")
    return 1 if known else 0


if __name__ == "__main__":
    sys.exit(main())
