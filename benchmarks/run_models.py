"""The issue-5 model table: eager (hand-converted bf16), torch.compile and graphopt side by side.

    python benchmarks/run_models.py                          # the whole set, bf16, on cuda
    python benchmarks/run_models.py --only resnet50,bert-base --budget-s 450
    python benchmarks/run_models.py --configs resnet50:1,bert-base:1 --reps 30
    python benchmarks/run_models.py --list

Runs, in this order (bs1 latency first: it is the issue's target):

    resnet50 bs1, resnet50 bs64, bert-base bs1 seq128, bert-base bs64 seq128, vit_b_16 bs64,
    glm4-9b-4l bs1 seq1024, glm4-9b-4l bs8 seq1024

each against eager and torch.compile, the bs1 configs also against torch.compile
mode="reduce-overhead" and graphopt with uncloned outputs (the clone's cost). A model is built
once for all its configs (bs1 uses the first row of the larger batch's inputs). One combined
table is printed at the end (also when a config fails) and written as JSON + Markdown under
benchmarks/results/models_<date>_<gpu>_torch-<ver>_cuda-<ver>.{json,md}, rewritten after every
variant. A thin script over graphopt.tools.bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphopt.tools.bench import DEFAULT_OUT, BenchConfig, parse_dtype, run  # noqa: E402

BASE = ("eager", "compile")
LATENCY = ("eager", "compile", "compile-ro", "graphopt-reuse")
# (model, batch, seq_len, variants, optimize kwargs)
SUITE = [
    ("resnet50", 1, None, LATENCY, None),
    ("resnet50", 64, None, BASE, None),
    ("bert-base", 1, 128, LATENCY, None),
    ("bert-base", 64, 128, BASE, None),
    ("vit_b_16", 64, None, BASE, None),
    ("glm4-9b-4l", 1, 1024, LATENCY, None),
    # graphopt's own guard compares 1.2e9-element logits in fp64 on the host after every pass
    # (minutes, tens of GB of RAM); the bench still checks the result against fp64. --guard restores it.
    ("glm4-9b-4l", 8, 1024, BASE, {"check_accuracy": False}),
]


def select(only: str | None, configs: str | None, no_ro: bool, guard: bool) -> list[BenchConfig]:
    chosen = []
    names = {m for m, *_ in SUITE}
    want_models = [t.strip() for t in only.split(",") if t.strip()] if only else None
    want_cfgs = None
    if configs:
        want_cfgs = set()
        for item in configs.split(","):
            name, _, bs = item.strip().partition(":")
            if not bs.isdigit():
                raise SystemExit(f"run_models: --configs takes MODEL:BATCH items, got '{item}'")
            want_cfgs.add((name, int(bs)))
    for group in (want_models or []) + [n for n, _ in (want_cfgs or [])]:
        if group not in names:
            raise SystemExit(f"run_models: unknown model '{group}'; the set is {', '.join(sorted(names))}")
    suite = list(SUITE)
    seqs = {m: seq for m, _, seq, _, _ in SUITE}
    for name, batch in sorted(want_cfgs or ()):  # a batch the suite does not list: latency variants at bs1
        if (name, batch) not in {(m, b) for m, b, *_ in SUITE}:
            suite.append((name, batch, seqs[name], LATENCY if batch == 1 else BASE, None))
    for model, batch, seq, vs, okw in suite:
        if want_models is not None and model not in want_models:
            continue
        if want_cfgs is not None and (model, batch) not in want_cfgs:
            continue
        if no_ro:
            vs = tuple(v for v in vs if v != "compile-ro")
        chosen.append(BenchConfig(model, batch, seq, vs, None if guard else okw))
    return chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated models from the set (resnet50,bert-base,vit_b_16,glm4-9b-4l)")
    p.add_argument("--configs", help="comma-separated MODEL:BATCH, e.g. resnet50:1,bert-base:1")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--device", default=None, help="default cuda")
    p.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 50)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no variant after this many seconds; the rest are recorded as skipped")
    p.add_argument("--no-compile-ro", action="store_true", help="leave out torch.compile reduce-overhead")
    p.add_argument("--guard", action="store_true", help="keep graphopt's accuracy guard on for every config")
    p.add_argument("--out", default=str(ROOT / DEFAULT_OUT), help="results folder (default benchmarks/results)")
    p.add_argument("--list", action="store_true", help="print the selected configs and exit")
    args = p.parse_args(argv)
    configs = select(args.only, args.configs, args.no_compile_ro, args.guard)
    if args.list or not configs:
        for c in configs:
            print(f"{c.model} bs{c.batch}" + (f" seq{c.seq_len}" if c.seq_len else "") + f": {', '.join(c.vs)}"
                  + (f"  optimize{c.optimize_kwargs}" if c.optimize_kwargs else ""))
        return 0 if configs else 2
    import signal

    from rich.console import Console

    def _interrupt(signum, frame):  # a SIGTERM (a job's time limit) ends the run like Ctrl-C: table still printed
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    console = Console() if Console().is_terminal else Console(width=180)
    result = run(configs, dtype=parse_dtype(args.dtype), device=args.device, reps=args.reps, warmup=args.warmup,
                 budget_s=args.budget_s, out_dir=args.out, console=console, tag="models",
                 command="python benchmarks/run_models.py " + " ".join(sys.argv[1:] if argv is None else argv))
    console.print()
    result.render(console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
