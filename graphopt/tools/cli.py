"""The ``graphopt`` command line.

    graphopt explain [MODEL] [--device D] [--target T] [--json PATH] [--passes a,b] [--disable a,b] [-v]
    graphopt export  [MODEL] -o out.pt [--format torchscript|pt2]
    graphopt zoo
    graphopt passes
    graphopt build-kernels [--arch sm_90] [--force]
    graphopt bench   [MODEL...] [--vs eager,compile,compile-ro] [--dtype bf16] [--batch N] [--reps N] [--out DIR]

User mistakes print one line on stderr and exit 2, never a traceback (set GRAPHOPT_TRACEBACK=1
to see one; 0, false, no and off leave it off). ``explain`` prints the passes that changed the
graph and why others refused; ``-v`` prints every pass, node and refusal.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from .. import timing
from ..errors import CaptureError, GraphoptError, traceback_requested

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        sys.stderr.write(f"graphopt: error: {message}\n")
        sys.exit(2)


def _csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _bytes(text: str) -> float:
    units = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "b": 1}
    t = text.strip().lower()
    for u, f in units.items():
        if t.endswith(u):
            try:
                return float(t[: -len(u)]) * f
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or e.g. 40GB, 512MB)") from None


def _add_model_args(p):
    p.add_argument("model", nargs="?", help="FILE.py:FACTORY, package.module:FACTORY or a zoo name (default: the bundled default)")
    p.add_argument("--device", help="device to run on (cpu, cuda, cuda:1); default: cuda if present, else cpu")
    p.add_argument("--batch", type=int, help="batch size for zoo models")
    p.add_argument("--seq-len", type=int, help="sequence length for zoo text models")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype zoo models are built in (default fp32)")
    p.add_argument("--passes", help="comma-separated pass ids to run (default: the whole pipeline)")
    p.add_argument("--disable", help="comma-separated pass ids to leave out")
    p.add_argument("--target", help="plan for this cost profile (h200, a100, cpu or a .json) instead of --device's")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="mixed precision (default auto: bf16 where the cost model predicts a gain)")
    p.add_argument("--no-accuracy", action="store_true", help="skip the fp64 accuracy guard")
    p.add_argument("--weight-copies", default="auto", metavar="W",
                   help="memory the passes' weight copies may take: auto (default), allow, none, a fraction of the "
                        "model's bytes (0.1) or a size (4GB)")
    p.add_argument("--dump-ir", metavar="DIR", help="write the graph after each pass to DIR/NNN_<pass>.py")
    p.add_argument("--devices", help="partition across devices: cuda:0,cuda:1 | cuda:0,cpu | a GPU count (with --target h200 "
                                     "a machine without GPUs plans for them)")
    p.add_argument("--memory-cap", type=_bytes, help="memory per device for --devices (bytes, or 40GB / 512MB)")
    p.add_argument("--microbatches", type=int, default=1, help="pipeline micro-batches for --devices (the example batch is one)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved1f1b"], default="gpipe",
                   help="pipeline schedule for --devices (interleaved1f1b: --virtual-stages stages per device)")
    p.add_argument("--virtual-stages", type=int, help="stages per device for --schedule interleaved1f1b (default 2)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphopt", description="torch.fx graph optimizer: explain, export and inspect models")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    p = sub.add_parser("explain", help="optimize a model and print what each pass did")
    _add_model_args(p)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every pass, the nodes each rewrite matched, each refusal, the costliest nodes")
    p.add_argument("--bisect", action="store_true",
                   help="find the first pass, and the first rewrite in it, that breaks the accuracy rule")
    p.add_argument("--measure", action="store_true",
                   help="also time the graph before and after, node by node and whole, beside the predictions (graphopt/tools/measure.py)")
    p.add_argument("--training", action="store_true", help="optimize the training graph (model.train(); backward on its outputs)")
    p.add_argument("--memory-budget", metavar="B",
                   help="with --training: fit saved activations into B: a fraction of the baseline (0.4) or a size (8GB, 512MB, bytes)")
    p.add_argument("--checkpoint-backend", choices=("auto", "aot", "sac"), default="auto",
                   help="with --memory-budget: recompute by an AOTAutograd graph rewrite (aot), torch.utils.checkpoint "
                        "with a selective policy (sac), or aot where it traces (auto)")
    p = sub.add_parser("export", help="optimize a model and save a TorchScript or .pt2 artifact")
    _add_model_args(p)
    p.add_argument("-o", "--output", required=True, help="output path (.pt for TorchScript, .pt2 for torch.export)")
    p.add_argument("--format", choices=["torchscript", "pt2"], help="default: from the suffix")
    p = sub.add_parser("bench", help="time eager, torch.compile and graphopt side by side (graphopt/tools/bench.py)")
    p.add_argument("models", nargs="*", metavar="MODEL", help="zoo names or FILE.py:FACTORY (default: resnet50)")
    p.add_argument("--vs", default="eager,compile", help="peers: eager,compile,compile-ro,graphopt-reuse (eager and graphopt always run)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--batch", type=int, help="batch size for zoo models")
    p.add_argument("--seq-len", type=int, help="sequence length for zoo text models")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if present)")
    p.add_argument("--reps", type=int, help="timed calls per variant (default 50 on CUDA, 10 on the CPU)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 10 on CUDA, 2 on the CPU)")
    p.add_argument("--budget-s", type=float, help="start no variant after this many seconds (the rest are recorded as skipped)")
    p.add_argument("--no-guard", action="store_true", help="optimize without graphopt's fp64 accuracy guard (the bench still checks accuracy)")
    p.add_argument("--out", metavar="DIR", help="where the JSON + Markdown go (default benchmarks/results)")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    p = sub.add_parser("build-kernels", help="compile the bundled CUDA kernels now (else on first import on a GPU)")
    p.add_argument("--arch", help="comma-separated archs, e.g. sm_80,sm_90 (default: the GPU found)")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    p = sub.add_parser("calibrate", help="measure this device and write a cost profile JSON (graphopt/tools/calibrate.py)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if present)")
    p.add_argument("-o", "--output", help="profile path (default: <name>-calibrated.json)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    p.add_argument("--corpus", action="store_true",
                   help="fit per-op-class corrections on the performance sweep's op shapes timed on this device "
                        "(graphopt/tools/corpus.py) into the profile instead: the cached CPU profile, or -o on CUDA")
    g = p.add_argument_group("with --corpus")
    g.add_argument("--configs", help="comma list of NAME[:BATCH] of the performance sweep (default: all of them)")
    g.add_argument("--small", action="store_true", help="the sweep's CPU-sized variants (small images and batches)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on the CPU")
    g.add_argument("--time-budget", type=float, default=600.0, metavar="S",
                   help="start no config after S seconds (default 600)")
    g.add_argument("--holdout", type=int, default=4, metavar="N",
                   help="keep every N-th config out of the fit and report the accuracy on those (default 4; 0: none)")
    g.add_argument("--min-samples", type=int, default=8, metavar="N",
                   help="shapes a class needs to be corrected (default 8)")
    g.add_argument("--optimized", action="store_true",
                   help="also time the graphs optimize() returns (graphopt's own ops), fitted and validated alike")
    g.add_argument("--base", metavar="PROFILE",
                   help="the profile to correct (h200, cpu, a .json; default: this device's)")
    g.add_argument("--results", metavar="DIR",
                   help="also write the validation table (Markdown + JSON) into DIR, and the samples file (else it "
                        "goes beside the profile)")
    g.add_argument("--quiet-wait", type=float, default=30.0, metavar="S",
                   help="on the CPU, wait up to S seconds for other processes to quieten before timing (default 30)")
    g.add_argument("--refit", metavar="SAMPLES_FILE",
                   help="fit and validate again from the samples file a corpus run wrote (no device; -o, --results, "
                        "--min-samples apply)")
    sub.add_parser("zoo", help="list the bundled models")
    sub.add_parser("passes", help="list the passes in pipeline order")
    return parser


def _resolve_device(name: str | None):
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise GraphoptError(f"unknown device '{name}'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GraphoptError(f"--device {name}: CUDA is not available here (use --target h200 to plan for a GPU)")
    return str(dev)


def _load(args):
    import torch

    from .modelspec import load_model

    device = _resolve_device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    model, inputs, name = load_model(args.model, batch=args.batch, seq_len=args.seq_len, dtype=dtype, device=device)
    if args.model and ":" in args.model:
        model, inputs = _to_device(model, inputs, device)
    return model, inputs, name, device


def _to_device(model, inputs, device):
    import torch
    from torch.utils import _pytree as pytree

    if any(p.device.type == "meta" for p in model.parameters()):
        return model, inputs  # built on meta (shapes only, for --target): nothing to move
    model = model.to(device)
    inputs = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, inputs)
    return model, inputs


def _devices(text: str | None):
    if text is None:
        return None
    return int(text) if text.strip().isdigit() else _csv(text)


def _optimize(args):
    from ..api import optimize

    model, inputs, name, device = _load(args)
    opt = optimize(model, inputs, target=args.target, passes=_csv(args.passes), disable=_csv(args.disable) or (),
                   check_accuracy=not args.no_accuracy, dump_dir=args.dump_ir, model_name=name,
                   precision=args.precision, devices=_devices(args.devices), memory_cap=args.memory_cap,
                   microbatches=args.microbatches, schedule=args.schedule, virtual_stages=args.virtual_stages,
                   training=getattr(args, "training", False),
                   memory_budget=getattr(args, "memory_budget", None),
                   checkpoint_backend=getattr(args, "checkpoint_backend", "auto"),
                   weight_copies=args.weight_copies)
    args._model = model  # explain --measure captures it again for the before graph
    return opt, inputs


def _console():
    from ..report import default_console

    return default_console()


def cmd_explain(args) -> int:
    if getattr(args, "bisect", False):
        from .bisect import bisect

        model, inputs, name, _ = _load(args)
        with _progress_line():
            result = bisect(model, inputs, target=args.target, passes=_csv(args.passes),
                            disable=_csv(args.disable) or (), precision=args.precision)
        console = _console()
        for pass_name, status in result.checked:
            console.print(f"  {pass_name}: {status}")
        console.print(f"[bold]{name}[/bold]: {result.summary()}")
        return 1 if result.pass_name else 0
    with _progress_line():
        opt, inputs = _optimize(args)
        if getattr(args, "measure", False):
            from .measure import measure_report

            timing.progress("explain --measure: timing the graphs whole and node by node")
            measure_report(opt, args._model, inputs, profile=args.target)
    opt.report.render(_console(), verbose=args.verbose)
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(opt.report.to_json())
        except OSError as e:
            raise GraphoptError(f"cannot write {args.json}: {e.strerror or e}") from None
    return 0 if opt.report.accuracy.get("passed", True) else 1


def cmd_export(args) -> int:
    from ..export import export

    with _progress_line():
        opt, inputs = _optimize(args)
        timing.progress("writing %s", args.output)
        path = export(opt, args.output, format=args.format, example_inputs=inputs)
    _console().print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); load with graphopt.load('{path}')")
    return 0


def cmd_zoo(args) -> int:
    from rich.table import Table

    from ..examples import zoo

    t = Table("name", "family", "cpu", "description", header_style="bold")
    for n in zoo.names():
        e = zoo.entry(n)
        t.add_row(n + (" (default)" if n == zoo.DEFAULT else ""), e.family, "yes" if e.cpu_friendly else "", e.description)
    _console().print(t)
    return 0


def cmd_passes(args) -> int:
    from rich.table import Table

    from ..pipeline import available, registry

    reg = registry()
    t = Table("#", "pass", "family", "inference only", "what it does", header_style="bold")
    for i, name in enumerate(available(), 1):
        cls = reg[name]
        t.add_row(str(i), name, cls.family, "yes" if cls.inference_only else "", cls.description)
    _console().print(t)
    return 0


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch's own loggers print multi-line tracebacks (fake-tensor dispatch failures during
    capture) before graphopt turns the failure into its one-line error; the CLI keeps stderr to
    that line. GRAPHOPT_TRACEBACK=1 or TORCH_LOGS leave torch's logging alone."""
    if traceback_requested() or os.environ.get("TORCH_LOGS"):
        yield
        return
    loggers = [logging.getLogger("torch")] + [
        lg for name, lg in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(lg, logging.Logger)]
    saved = [(lg, lg.level) for lg in loggers]
    for lg, level in saved:
        if level != logging.NOTSET or lg.name == "torch":
            lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


class _StatusLine(logging.Handler):
    """``graphopt.progress`` records (graphopt.timing.progress) shown as a status line: the step
    under way and the seconds since the command started, counted as the line is redrawn."""

    def __init__(self, status):
        super().__init__(logging.INFO)
        self.status, self.t0, self.step = status, time.perf_counter(), "starting"
        status.update(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.step = record.getMessage()
            self.status.update(self)
        except Exception:  # a display failure never stops the command
            self.handleError(record)

    def __rich__(self):
        from rich.text import Text

        return Text(f"graphopt: {self.step}  [{time.perf_counter() - self.t0:.0f} s]")


@contextlib.contextmanager
def _progress_line():
    """While a command optimizes a model: the step under way as a transient status line on stderr,
    where stderr is a terminal (nothing in a pipe or a log, nothing left on screen afterwards)."""
    from rich.console import Console

    PROGRESS = timing.PROGRESS
    err = Console(stderr=True)
    if not err.is_terminal:
        yield
        return
    saved = PROGRESS.level, PROGRESS.propagate
    with err.status("graphopt: starting") as status:
        handler = _StatusLine(status)
        PROGRESS.addHandler(handler)
        PROGRESS.setLevel(logging.INFO)
        PROGRESS.propagate = False  # (shown here, not again by a root handler)
        try:
            yield
        finally:
            PROGRESS.removeHandler(handler)
            PROGRESS.setLevel(saved[0])
            PROGRESS.propagate = saved[1]


def cmd_bench(args) -> int:
    from .bench import run_cli

    return run_cli(args)


def cmd_calibrate(args) -> int:
    from .calibrate import run_cli

    return run_cli(args)


def cmd_build_kernels(args) -> int:
    from rich.progress import Progress

    from ..cuda_ext import build

    archs = _csv(args.arch)
    with Progress(transient=False) as progress:
        task = progress.add_task("building cuda_ext", total=None)

        def update(done, total, message):
            progress.update(task, completed=done, total=total, description=message[:60])

        path = build.build_kernels(progress_callback=update, arch_list=archs, force=args.force)
    _console().print(f"kernels built: {path}")
    return 0


COMMANDS = {"build-kernels": cmd_build_kernels, "explain": cmd_explain, "export": cmd_export, "zoo": cmd_zoo, "passes": cmd_passes, "bench": cmd_bench,
            "calibrate": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        with _quiet_torch_logs():
            return COMMANDS[args.command](args)
    except GraphoptError as e:
        if traceback_requested():
            raise
        sys.stderr.write(f"graphopt: error: {e}\n")
        dump = getattr(args, "dump_ir", None)
        if isinstance(e, CaptureError) and e.partial_graph and dump:
            path = Path(dump) / "capture_failed.py"
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(e.partial_graph)
                sys.stderr.write(f"graphopt: the graph torch.export had traced is in {path}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("graphopt: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
