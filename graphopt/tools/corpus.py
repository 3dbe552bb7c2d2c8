"""``graphopt calibrate --corpus``: fit the cost model's per-op-class corrections on the op shapes of
the performance sweep's models, timed alone on this device.

    graphopt calibrate --corpus --device cpu --small                  # CPU: into the cached CPU profile
    graphopt calibrate --corpus --device cuda --configs resnet50,hf-bert -o h200-fit.json
    graphopt calibrate --corpus --refit RUN.samples.json.gz -o fit.json   # refit a run's samples, anywhere

1. Corpus: each config of the performance sweep (graphopt.tools.perf_sweep) is built and prepared
   as the sweep's bench prepares it (dtype, device, channels_last for CNNs in 16-bit types),
   captured as optimize() captures (graphopt.capture), and every ``call_function`` node is timed
   alone (graphopt.tools.measure.measure_nodes: on a GPU its loop time, its host issue time and
   its device time queued behind a GPU sleep); the whole captured graph is timed as one call too
   (measure_call). Nodes are deduplicated by op and the shapes, strides and dtypes of their
   tensor arguments and their other arguments. With ``optimized``, the graph optimize() returns
   is timed the same way (graphopt's own ops).
2. Classes: each node's op class (graphopt.cost.opclass.op_class), a path of tags.
3. Records: each timed graph becomes a record of its steps as the cost model's queue prices them
   uncorrected, with each classed node's shape and measured time and the measured whole call
   (graphopt.tools.corpus_fit.Corpus); the records are saved as the samples file (gzip'd JSON)
   beside the results, and everything below is computed from them, so ``--refit`` repeats it on
   any machine.
4. Fit (graphopt.tools.corpus_fit): per class path prefix, a piecewise-linear correction of
   ln(measured / predicted) against ln(predicted seconds), robust, shrunk toward the parent's, kept
   only where it lowers the class's error cross-validated by config; where the samples hold host
   and device times (a GPU), two such fits apart: a device factor against the device time alone
   (what a CUDA-graph replay pays) and a host correction per class and op against the host issue
   time (what eager execution's host pays). Then the stream terms (whole call ~ factor * corrected
   prediction + seconds per corrected node), kept only where they lower the cross-validated
   whole-call error.
5. Validation held out: every ``holdout``-th config (in the sweep's order) is measured but left
   out of the fit; the report gives, on those configs only, the whole-call prediction error and
   the rank correlation over nodes before and after the fit, and the error per class.

The configs run in turns from each source (torchvision, Hugging Face, timm) when none are named,
so that a time budget that stops early leaves every kind of model in the corpus.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from .. import ir
from ..cost.model import CostModel
from ..cost.opclass import op_class
from ..cost.profiles import DeviceProfile
from ..errors import GraphoptError
from .corpus_fit import (MIN_SAMPLES, Corpus, RunRecord, Sample, Shape, Step, evaluate, fit_curve, fit_op_classes,
                         fit_profile, fit_stream)

__all__ = ["Sample", "ConfigRun", "build_corpus", "record_run", "fit_curve", "fit_op_classes", "fit_stream",
           "evaluate", "fit_profile", "node_key", "refit"]


# ------------------------------------------------------------------------------------ the corpus


def _sig(v) -> str:
    if isinstance(v, fx.Node):
        val = v.meta.get("val")
        if isinstance(val, torch.Tensor):
            t = ir.tensor_info(val)
            return f"T{list(t.shape)}:{list(t.stride) if t.stride is not None else '-'}:{str(t.dtype)[6:]}"
        if isinstance(val, (tuple, list)):
            return "(" + ",".join(_sig(x) if isinstance(x, torch.Tensor) else repr(x) for x in val) + ")"
        return repr(val)
    if isinstance(v, torch.Tensor):
        return f"T{list(v.shape)}:{list(v.stride())}:{str(v.dtype)[6:]}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_sig(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}={_sig(x)}" for k, x in sorted(v.items())) + "}"
    return repr(v)


def node_key(node: fx.Node) -> str:
    """What makes two nodes the same corpus sample: the op, and the shapes, strides and dtypes of
    its tensor arguments and the values of its other arguments."""
    return f"{node.target}|{_sig(list(node.args))}|{_sig(dict(node.kwargs))}"


@dataclass
class ConfigRun:
    """One config of the corpus: its graph (until it is recorded), the measured time of each node
    and of the whole call."""

    config: str
    held_out: bool
    source: str = "captured"  # "captured" | "optimized"
    gm: fx.GraphModule | None = None
    hints: dict = field(default_factory=dict)
    execution: str = "eager"  # how its calls run: "eager", or a CUDA graph replay ("graphed")
    reuse_outputs: bool = False
    node_s: dict = field(default_factory=dict)
    # per node, where timed apart (a GPU): host issue seconds and device seconds alone
    node_host_s: dict = field(default_factory=dict)
    node_device_s: dict = field(default_factory=dict)
    timing_s: float = 0.0  # seconds spent timing its nodes (the device-time loop included)
    whole_s: float | None = None
    nodes: int = 0
    new_shapes: int = 0
    seconds: float = 0.0
    error: str = ""
    load: float | None = None  # cores other processes used when it was timed (CPU)


@contextlib.contextmanager
def _small_env(small: bool):
    from .perf_sweep import SMALL_ENV

    old = os.environ.get(SMALL_ENV)
    os.environ[SMALL_ENV] = "1" if small else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SMALL_ENV, None)
        else:
            os.environ[SMALL_ENV] = old


def record_run(run: ConfigRun, cost: CostModel, shapes: dict, table: list) -> tuple[RunRecord, int]:
    """The record of a timed graph (graphopt.tools.corpus_fit.RunRecord): its steps as ``cost``
    (without a class fit) queues them, each classed node with its shape and its measured time
    alone; a shape not seen before is appended to ``table`` and indexed in ``shapes`` (node key ->
    index). Returns the record and how many shapes were new."""
    gm, hints = run.gm, run.hints
    q = cost.queue_inputs(gm, hints, run.execution, reuse_outputs=run.reuse_outputs)
    steps, new = [], 0
    for st in q.steps:
        n, shape, measured, host_m, device_m = st.node, -1, None, None, None
        path = op_class(n, cost.flops_bytes(n)[3]) if n.op == "call_function" else None
        if path is not None:
            key = node_key(n)
            shape = shapes.get(key)
            if shape is None:
                shape = shapes[key] = len(table)
                table.append(Shape(path, ir.target_name(n), float(ir.concrete(cost.node_cost(n).time_s, hints))))
                new += 1
            if n.graph is gm.graph:  # (measure_nodes times the graph's own nodes, not a body's)
                measured = run.node_s.get(n.name)
                host_m, device_m = run.node_host_s.get(n.name), run.node_device_s.get(n.name)
        elif not (st.host_s or st.device_s or st.launches or st.sync or st.tail):
            continue
        steps.append(Step(shape, float(st.host_s), float(st.device_s), int(st.launches), bool(st.sync),
                          bool(st.tail), measured, host_m, device_m))
    return RunRecord(run.config, run.source, run.held_out, run.execution, run.whole_s, steps,
                     [tuple(map(float, c)) for c in q.copies_in], [tuple(map(float, c)) for c in q.copies_out]), new


def others_busy(interval: float = 0.5) -> float | None:
    """Cores' worth of CPU time other processes used over ``interval`` seconds (/proc/stat's busy
    time less this process's own); None where /proc/stat cannot be read."""
    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")

    try:
        b0, p0, t0 = busy(), time.process_time(), time.perf_counter()
        time.sleep(interval)
        b1, p1, t1 = busy(), time.process_time(), time.perf_counter()
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, (b1 - b0) - (p1 - p0)) / (t1 - t0)


QUIET_CORES = 0.3  # other processes' use of the CPU under which it counts as quiet


def wait_for_quiet(max_wait_s: float, threshold: float = QUIET_CORES, log=print) -> float | None:
    """On a shared CPU: wait (at most ``max_wait_s``) until other processes use under
    ``threshold`` cores; returns what they used when timing starts."""
    t0 = time.perf_counter()
    load = others_busy()
    said = False
    while load is not None and load >= threshold and time.perf_counter() - t0 < max_wait_s:
        if not said:
            log(f"    other work uses {load:.1f} core(s): waiting up to {max_wait_s:.0f} s for the CPU to quieten")
            said = True
        time.sleep(1.0)
        load = others_busy()
    return load


def _time_graph(run: ConfigRun, call, flat, device, cost: CostModel, shapes: dict, table: list, records: list,
                reps: int, whole_reps: int) -> None:
    from .measure import measure_call, measure_nodes

    run.hints = ir.shape_hints(run.gm)
    t0 = time.perf_counter()
    timed = measure_nodes(run.gm, flat, device, reps=reps, best=True, detail=True, device_times=True)
    run.timing_s = time.perf_counter() - t0
    run.node_s = {k: v[0] for k, v in timed.items()}
    if device.type == "cuda":  # (on the CPU the host time is the loop time and there is no device time)
        run.node_host_s = {k: v[1] for k, v in timed.items()}
        run.node_device_s = {k: v[2] for k, v in timed.items() if v[2] is not None}
    run.whole_s = measure_call(call, device, reps=whole_reps, best=True)
    run.nodes = len(run.node_s)
    record, run.new_shapes = record_run(run, cost, shapes, table)
    records.append(record)


def held_out_configs(configs, holdout: int) -> set:
    """The keys of every ``holdout``-th config (0: none)."""
    return {c.key for i, c in enumerate(configs) if holdout and i % holdout == holdout - 1}


def build_corpus(configs, base: DeviceProfile, *, device, dtype, small: bool, held_out=frozenset(),
                 time_budget_s: float = 600.0, reps: int = 7, whole_reps: int = 10, optimized: bool = False,
                 quiet_wait_s: float = 30.0, log=print) -> tuple[Corpus, list[ConfigRun]]:
    """Build, capture and time each config (see the module docstring) until ``time_budget_s``
    seconds have passed (no config is started after that); each node's time and the whole call's
    are the best of ``reps`` / ``whole_reps`` runs (on a CPU after waiting up to ``quiet_wait_s``
    for other processes to quieten); on a GPU each node's host issue time and its device time
    alone are kept too (the device time is a second timing loop per node and run, queued behind a
    GPU sleep: it costs time the budget counts, reported as each config's timing seconds).
    Returns the corpus (``base``, the shapes and a record of every timed graph; those of the
    configs whose keys are in ``held_out`` marked held out) and the runs. A config that fails to build, capture or run is recorded with its error and
    skipped."""
    from .. import api
    from ..capture import capture
    from .bench import prepare_model
    from .measure import graph_inputs, module_execution
    from .perf_sweep import factory_name

    device = torch.device(device)
    base = replace(base, op_class_fit={})
    cost = CostModel(base)
    shapes: dict[str, int] = {}
    table: list[Shape] = []
    records: list[RunRecord] = []
    runs: list[ConfigRun] = []
    t_start = time.perf_counter()
    for i, cfg in enumerate(configs):
        if time.perf_counter() - t_start > time_budget_s:
            log(f"time budget of {time_budget_s:.0f} s spent: {len(configs) - i} config(s) not measured "
                f"({', '.join(c.key for c in configs[i:])})")
            break
        held = cfg.key in held_out
        t0 = time.perf_counter()
        run = ConfigRun(cfg.key, held)
        runs.append(run)
        model = gm = opt = orun = None
        try:
            with _small_env(small):
                model, args, kwargs, _, _ = prepare_model(f"graphopt.tools.perf_sweep:{factory_name(cfg.name)}", cfg.batch,
                                                  None, dtype, device)
            gm = capture(model, (args, kwargs))
            run.gm = gm
            if device.type == "cpu":
                run.load = wait_for_quiet(quiet_wait_s, log=log)
                if quiet_wait_s > 0 and run.load is not None and run.load >= QUIET_CORES:
                    log(f"    the CPU stays busy ({run.load:.1f} cores used by other work): timing the rest "
                        "without waiting")
                    quiet_wait_s = 0.0
            _time_graph(run, lambda: gm(*args, **kwargs), graph_inputs(gm, args, kwargs), device, cost, shapes, table,
                        records, reps, whole_reps)
        except Exception as e:  # noqa: BLE001 - one config that does not run here is a row with its error
            run.error, run.gm = _why(e), None
        if optimized and not run.error:
            t1 = time.perf_counter()
            orun = ConfigRun(cfg.key, held, "optimized")
            runs.append(orun)
            try:
                opt = api.optimize(model, (args, kwargs), measure=False, check_accuracy=False)
                how = module_execution(opt)
                orun.gm, orun.execution = opt.graph_module, "eager" if how == "eager" else "graphed"
                orun.reuse_outputs = how == "graphed_reuse_outputs"
                _time_graph(orun, lambda: opt(*args, **kwargs), graph_inputs(opt.graph_module, args, kwargs), device,
                            cost, shapes, table, records, reps, whole_reps)
            except Exception as e:  # noqa: BLE001 - as above
                orun.error, orun.gm = _why(e), None
            orun.seconds = time.perf_counter() - t1
        for r in (run, orun):
            if r is not None:
                r.gm = None  # (recorded: free the graph, the model, its copies and the module)
        model = gm = opt = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        run.seconds = time.perf_counter() - t0
        role = "held out" if held else "fit"
        if run.error:
            log(f"[{i + 1}/{len(configs)}] {cfg.key} ({role}): error {run.error}")
        else:
            extra = "" if orun is None else (f", optimized: error {orun.error}" if orun.error else
                                             f", optimized {orun.nodes} nodes ({orun.new_shapes} new)")
            log(f"[{i + 1}/{len(configs)}] {cfg.key} ({role}): {run.nodes} nodes ({run.new_shapes} new shapes){extra}, "
                f"whole {run.whole_s * 1e3:.3f} ms"
                f"{f' (others used {run.load:.1f} cores)' if (run.load or 0.0) >= QUIET_CORES else ''}; "
                f"{run.seconds:.1f} s (timing nodes {run.timing_s + (orun.timing_s if orun else 0.0):.1f} s); "
                f"corpus {len(table)} shapes, "
                f"{time.perf_counter() - t_start:.0f} s in all")
    return Corpus(base, table, records), runs


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def interleaved(configs) -> list:
    """The configs taken in turn from each source (torchvision, hf, timm), so that a time budget
    that stops the corpus early leaves every kind of model in it."""
    by: dict[str, list] = {}
    for c in configs:
        by.setdefault(c.source, []).append(c)
    queues, out = list(by.values()), []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def check_options(*, holdout: int, time_budget_s: float, min_samples: int, quiet_wait_s: float = 0.0) -> None:
    if holdout < 0 or holdout == 1:
        raise GraphoptError(f"--holdout must be 0 (none) or at least 2 (every N-th config held out), got {holdout}")
    if not time_budget_s > 0:
        raise GraphoptError(f"--time-budget must be a positive number of seconds, got {time_budget_s:g}")
    if min_samples < 2:
        raise GraphoptError(f"--min-samples must be at least 2, got {min_samples}")
    if quiet_wait_s < 0:
        raise GraphoptError(f"--quiet-wait must be 0 or more seconds, got {quiet_wait_s:g}")


# ------------------------------------------------------------------------------------ the command


CORPUS_ONLY = {"configs": None, "small": False, "dtype": None, "time_budget": 600.0, "holdout": 4, "min_samples": 8,
               "optimized": False, "base": None, "results": None, "quiet_wait": 30.0, "refit": None}
# what measures on a device: not for --refit, whose samples file holds what was measured
MEASURING = {"device": None, "quick": False, "configs": None, "small": False, "dtype": None, "time_budget": 600.0,
             "holdout": 4, "optimized": False, "base": None, "quiet_wait": 30.0}
SAMPLES_SUFFIX = ".samples.json.gz"


def refuse_corpus_options(args) -> None:
    """One-line error for a --corpus option given without --corpus."""
    for name, default in CORPUS_ONLY.items():
        if getattr(args, name, default) != default:
            raise GraphoptError(f"--{name.replace('_', '-')} applies to --corpus only")


def _fmt(v, digits: int = 2, suffix: str = "") -> str:
    return "—" if v is None else f"{v:.{digits}f}{suffix}"


def to_markdown(result: dict) -> str:
    h, s = result["header"], result["validation"]["summary"]
    c, fit = result["corpus"], result["fit"]
    stream = fit["stream"]
    lines = [f"# Cost model corpus fit: {h.get('device_name') or c.get('device') or '?'}, "
             f"{h.get('date') or c.get('measured_at') or '?'}",
             "", "- versions: " + ", ".join(f"{k} {v}" for k, v in (h.get("versions") or {}).items() if v),
             f"- command: {result['command']}"]
    if result.get("refit"):
        lines.append(f"- refit: {result['refit']['command']} on {result['refit']['date']} (graphopt "
                     f"{result['refit'].get('graphopt', '?')})")
    lines += [f"- corpus: {c['samples']} op shapes from {len(c.get('configs', []))} configs ({c.get('dtype')}"
              f"{', small variants' if c.get('small') else ''}"
              f"{', optimized graphs too' if c.get('optimized') else ''}), "
              f"{c.get('timing') or 'timing not recorded'}; built in {c.get('seconds') or 0:.0f} s"
              + (f" ({c['node_timing_s']:.0f} s of it timing nodes)" if c.get("node_timing_s") else "")
              + (f"; split fit on {c['samples_device']} device and {c['samples_host']} host samples"
                 if "samples_device" in c else "")
              + (f"; other processes used {c['others_cores']:.1f} cores (median) while it was timed"
                 if c.get("others_cores") is not None else ""),
              f"- samples: {result.get('samples_file') or '—'} (`graphopt calibrate --corpus --refit FILE` refits "
              "them on any machine)",
              f"- held out (not in the fit): {', '.join(c.get('held_out', [])) or 'none'}",
              f"- stream terms: {stream['reason']}" + (
                  f" (fitted on {stream['configs']} whole calls)" if stream.get("kept") else ""),
              f"- in a CUDA-graph replay (device time): {(fit.get('replay_fit') or {}).get('reason') or 'full'}",
              "",
              "## Held-out configs", "",
              "| | before | after |", "| --- | ---: | ---: |",
              f"| whole call predicted within ±20% | {s['within_20pct_before']} of {s['rows']} | "
              f"{s['within_20pct_after']} of {s['rows']} |",
              f"| median abs whole-call error | {_fmt(s['median_abs_error_pct_before'], 1, '%')} | "
              f"{_fmt(s['median_abs_error_pct_after'], 1, '%')} |",
              f"| Spearman over nodes ≥ 0.9 | {s['spearman_ge_0.9_before']} of {s['rows']} | "
              f"{s['spearman_ge_0.9_after']} of {s['rows']} |",
              f"| median Spearman over nodes | {_fmt(s['median_spearman_before'])} | "
              f"{_fmt(s['median_spearman_after'])} |",
              "", "| config | graph | measured ms | predicted before | error before | predicted after | error after | "
                  "Spearman before | after | nodes |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["validation"]["rows"]:
        lines.append(f"| {r['config']} | {r['source']} | {r['measured_ms']:.3f} | {r['predicted_ms_before']:.3f} | "
                     f"{r['error_pct_before']:+.0f}% | {r['predicted_ms_after']:.3f} | {r['error_pct_after']:+.0f}% | "
                     f"{_fmt(r['spearman_before'])} | {_fmt(r['spearman_after'])} | {r['nodes']} |")
    cv = stream.get("cv")
    lines += ["", f"## Cross-validated on the fitted configs ({fit.get('folds', 0)} folds by config)", "",
              "Each fold's configs predicted by the fit of the others; whole calls: mean |ln(predicted / measured)|."
              " Classes: per held-out config the time-weighted mean |ln(predicted / measured)| of its nodes of the "
              "class, without the class's own correction (its parent's, or none) and with it.", ""]
    if cv:
        lines += ["| whole calls | uncorrected | class fits | class fits + stream terms |",
                  "| ---: | ---: | ---: | ---: |",
                  f"| {cv['calls']} | {cv['uncorrected']:.3f} | {cv['classes']:.3f} | {cv['classes_and_stream']:.3f} |"]
        if cv["classes"] > cv["uncorrected"]:
            lines.append("")
            lines.append(f"Warning: the class fits make the cross-validated whole-call error worse "
                         f"({cv['uncorrected']:.3f} -> {cv['classes']:.3f}) though each kept one lowers its class's.")
    else:
        lines.append("Whole calls: not cross-validated (" + stream["reason"] + ").")
    lines += ["", "| class | shapes | configs | error without | with | decision |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    for k, d in sorted(result.get("decisions", {}).items()):
        lines.append(f"| {k} | {d['n']} | {d['configs']} | {_fmt(d.get('cv_without'), 3)} | "
                     f"{_fmt(d.get('cv_with'), 3)} | {'kept' if d['kept'] else 'dropped'}: {d['reason']} |")
    lines += ["", "## Per class, held-out nodes alone (median |ln(predicted / measured)|)", "",
              "| class (the fit used) | nodes | before | after |", "| --- | ---: | ---: | ---: |"]
    for k, v in result["validation"]["classes"].items():
        lines.append(f"| {k} | {v['n']} | {_fmt(v['abs_log_error_before'])} | {_fmt(v['abs_log_error_after'])} |")
    lines += ["", "## Kept classes (training error, median |ln(measured / predicted)|)", "",
              "| class | shapes | knots (ln s) | factor at the knots | shrink | before | after | fixed µs |",
              "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    tables = ([("device: ", fit.get("device_classes") or {}), ("host: ", fit.get("host_classes") or {})]
              if "device_classes" in fit or "host_classes" in fit else [("", fit.get("classes") or {})])
    for k, e in ((p + k, e) for p, t in tables for k, e in t.items()):
        knots = ", ".join(f"{x:.1f}" for x in e.get("knots", []))
        fac = ", ".join(f"{math.exp(v):.2f}" for v in e.get("log_factor", []))
        lines.append(f"| {k} | {e.get('n', 0) or e.get('n_fixed', 0)} | {knots} | {fac} | "
                     f"{_fmt(e.get('shrink', e.get('shrink_fixed')))} | "
                     f"{_fmt(e.get('abs_log_error_before'))} | {_fmt(e.get('abs_log_error_after'))} | "
                     f"{_fmt(e['fixed_s'] * 1e6 if 'fixed_s' in e else None)} |")
    if c.get("errors"):
        lines += ["", "Configs not measured: " + "; ".join(f"{k}: {v}" for k, v in c["errors"].items())]
    return "\n".join(lines) + "\n"


def _command() -> str:
    import sys

    return "graphopt " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "graphopt calibrate --corpus"


def _write(path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise GraphoptError(f"cannot write {path}: {e.strerror or e}") from None


def fit_and_write(corpus: Corpus, *, out, results_dir, stem: str, min_samples: int, samples_file, say=print,
                  refit: dict | None = None) -> dict:
    """Fit ``corpus`` (graphopt.tools.corpus_fit.fit_profile), validate on its held-out runs,
    write the profile to ``out`` and, with ``results_dir``, the report (``<stem>.md``/``.json``).
    Returns the report."""
    import json

    say(f"fitting {sum(1 for r in corpus.runs if not r.held_out)} fitted graph(s), "
        f"{len(corpus.shapes)} shapes, cross-validated by config")
    prof, fit = fit_profile(corpus, min_samples=min_samples, refit_from=str(samples_file) if refit else None)
    validation = evaluate(corpus, prof)
    prof.op_class_fit["validation"] = validation["summary"]
    info = prof.op_class_fit["corpus"]
    prof.source = dict(prof.source, op_class_fit=(
        f"measured by graphopt calibrate --corpus on {info.get('measured_at', '?')}"
        + (f", refit on {refit['date']}" if refit else "")
        + f": {info['samples']} op shapes from {len(info.get('configs', []))} sweep configs ({info.get('dtype')})"))
    _write(out, json.dumps(prof.to_dict(), indent=1))
    result = {"header": corpus.header, "command": corpus.command, "corpus": info, "samples_file": str(samples_file),
              "fit": {k: v for k, v in prof.op_class_fit.items() if k not in ("validation", "corpus")},
              "decisions": fit.decisions, "validation": validation}
    if refit:
        result["refit"] = refit
    s, stream = validation["summary"], prof.op_class_fit["stream"]
    dropped = sum(1 for d in fit.decisions.values() if not d["kept"])
    kept = len(fit.classes) + (len(fit.host.classes) if fit.host is not None else 0)
    say(f"{kept} class fit(s) kept{' (device and host apart)' if fit.host is not None else ''}, {dropped} dropped "
        f"(cross-validated by config over {len(fit.folds)} folds); stream terms: {stream['reason']}; in a replay: "
        f"{prof.op_class_fit['replay_fit']['reason']}")
    if s["rows"]:
        say(f"held out ({s['rows']} graph(s)): whole call within ±20%: {s['within_20pct_before']} -> "
            f"{s['within_20pct_after']}; median |error| {_fmt(s['median_abs_error_pct_before'], 1, '%')} -> "
            f"{_fmt(s['median_abs_error_pct_after'], 1, '%')}; Spearman over nodes >= 0.9: "
            f"{s['spearman_ge_0.9_before']} -> {s['spearman_ge_0.9_after']}; median "
            f"{_fmt(s['median_spearman_before'])} -> {_fmt(s['median_spearman_after'])}")
    if results_dir is not None:
        from pathlib import Path

        d = Path(results_dir)
        _write(d / f"{stem}.json", json.dumps(result, indent=1, default=str))
        _write(d / f"{stem}.md", to_markdown(result))
        say(f"wrote {d / (stem + '.md')}")
    say(f"wrote {out}")
    return result


def refit(samples_file, *, out=None, results_dir=None, min_samples: int = MIN_SAMPLES, say=print) -> dict:
    """``graphopt calibrate --corpus --refit SAMPLES_FILE``: the fit and its report from a samples
    file alone (no device): the profile to ``out``, the report into ``results_dir`` (default: the
    samples file's folder) as ``<its stem>_refit.md/.json``."""
    from pathlib import Path

    from .. import __version__
    from .bench import utc_now

    samples_file = Path(samples_file)
    corpus = Corpus.load(samples_file)
    name = samples_file.name
    stem = (name[:-len(SAMPLES_SUFFIX)] if name.endswith(SAMPLES_SUFFIX) else samples_file.stem) + "_refit"
    say(f"refit from {samples_file}: {len(corpus.runs)} timed graph(s) of {corpus.info.get('device', '?')} "
        f"({corpus.header.get('device_name', '?')})")
    out = Path(out) if out is not None else Path(f"{corpus.profile.name}-calibrated.json")
    return fit_and_write(corpus, out=out, results_dir=samples_file.parent if results_dir is None else results_dir,
                         stem=stem, min_samples=min_samples, samples_file=samples_file, say=say,
                         refit={"command": _command(), "date": utc_now(), "graphopt": __version__})


def run_cli(args) -> int:
    """``graphopt calibrate --corpus ...`` (see the module docstring): build the corpus, save its
    samples, fit, validate on the held-out configs, write the profile (and, with --results, the
    table); with ``--refit FILE``, the same from a samples file."""
    from pathlib import Path

    from ..cost.profiles import cpu_cache_path, get_profile
    from .bench import environment, result_stem, utc_now
    from .calibrate import _resolve
    from .cli import DTYPES
    from .perf_sweep import parse_configs

    say = lambda m: print(m, flush=True)  # noqa: E731
    if getattr(args, "refit", None):
        for name, default in MEASURING.items():
            if getattr(args, name, default) != default:
                raise GraphoptError(f"--{name.replace('_', '-')} does not apply to --refit (the samples file holds "
                                    "what was measured)")
        if args.min_samples < 2:
            raise GraphoptError(f"--min-samples must be at least 2, got {args.min_samples}")
        refit(args.refit, out=args.output, results_dir=args.results, min_samples=args.min_samples, say=say)
        return 0
    device = _resolve(args.device)
    check_options(holdout=args.holdout, time_budget_s=args.time_budget, min_samples=args.min_samples,
                  quiet_wait_s=args.quiet_wait)
    try:
        configs = parse_configs(args.configs, small=args.small)
    except ValueError as e:
        raise GraphoptError(f"--configs: {e}") from None
    held = held_out_configs(configs, args.holdout)
    if not args.configs:
        configs = interleaved(configs)
    if args.holdout and len(configs) < args.holdout:
        raise GraphoptError(f"{len(configs)} config(s) hold none out at --holdout {args.holdout}: give at least "
                            f"{args.holdout}, or --holdout 0")
    if args.dtype:
        dtype = getattr(torch, DTYPES[args.dtype])
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base, note = get_profile(args.base or ("cpu" if device.type == "cpu" else device))
    if note:
        say(f"note: {note}")
    if args.output:
        out = Path(args.output)
    elif device.type == "cpu" and args.base is None:
        out = cpu_cache_path()
    else:
        out = Path(f"{base.name}-calibrated.json")
    say(f"corpus on {device} ({str(dtype)[6:]}): {len(configs)} config(s), every {args.holdout or '-'}th held out, "
        f"at most {args.time_budget:.0f} s")
    t0 = time.perf_counter()
    reps, whole = (3, 5) if args.quick else (7, 10)
    corpus, runs = build_corpus(configs, replace(base, op_class_fit={}), device=device, dtype=dtype,
                                small=args.small, held_out=held, time_budget_s=args.time_budget, reps=reps,
                                whole_reps=whole, optimized=args.optimized, quiet_wait_s=args.quiet_wait, log=say)
    built = time.perf_counter() - t0
    measured = [r for r in runs if r.source == "captured" and not r.error]
    if not corpus.runs:
        raise GraphoptError("no config could be measured here: " + "; ".join(f"{r.config}: {r.error}" for r in runs))
    loads = [r.load for r in measured if r.load is not None]
    corpus.info = {"configs": [r.config for r in measured if not r.held_out],
                   "held_out": [r.config for r in measured if r.held_out],
                   "device": str(device), "dtype": str(dtype)[6:], "small": bool(args.small),
                   "optimized": bool(args.optimized),
                   "torch": torch.__version__, "measured_at": utc_now(), "seconds": built,
                   "timing": f"each node alone, best of {reps} runs (graphopt.tools.measure.measure_nodes"
                             + ("; its loop, host issue and device time queued behind a GPU sleep"
                                if device.type == "cuda" else "") + f"); whole call best of {whole}",
                   "node_timing_s": sum(r.timing_s for r in runs),
                   "errors": {r.config: r.error for r in runs if r.error},
                   "others_cores": statistics.median(loads) if loads else None}
    corpus.header, corpus.command = environment(device), _command()
    stem = result_stem(corpus.header, "calibrate_corpus")
    samples_file = (Path(args.results) / f"{stem}{SAMPLES_SUFFIX}" if args.results else
                    out.with_name(out.name.removesuffix(".json") + SAMPLES_SUFFIX))
    corpus.save(samples_file)  # first: a fit that fails leaves the measurements to refit
    say(f"wrote {samples_file} ({samples_file.stat().st_size / 1e3:.0f} kB)")
    corpus = Corpus.from_dict(corpus.to_dict())  # the fit sees what the file holds, as a refit will
    fit_and_write(corpus, out=out, results_dir=args.results, stem=stem, min_samples=args.min_samples,
                  samples_file=samples_file, say=say)
    return 0
