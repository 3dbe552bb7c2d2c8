"""``graphopt calibrate --corpus``: fit the cost model's per-op-class corrections on the op shapes of
the performance sweep's models, timed alone on this device.

    graphopt calibrate --corpus --device cpu --small                  # CPU: into the cached CPU profile
    graphopt calibrate --corpus --device cuda --configs resnet50,hf-bert -o h200-fit.json

1. Corpus: each config of the performance sweep (graphopt.tools.perf_sweep) is built and prepared
   as the sweep's bench prepares it (dtype, device, channels_last for CNNs in 16-bit types),
   captured as optimize() captures (graphopt.capture), and every ``call_function`` node is timed
   alone (graphopt.tools.measure.measure_nodes); the whole captured graph is timed as one call too
   (measure_call). Nodes are deduplicated by op and the shapes, strides and dtypes of their
   tensor arguments and their other arguments; the measurements of one shape are pooled (median).
   With ``optimized``, the graph optimize() returns is timed the same way (graphopt's own ops).
2. Classes: each node's op class (graphopt.cost.opclass.op_class), a path of tags.
3. Fit: for every class path prefix with at least ``min_samples`` shapes, ln(measured / predicted)
   as a piecewise-linear function of ln(predicted seconds) (one knot, and one more per ``per_knot``
   shapes, at most ``max_knots``; it applies over the predicted times of its shapes), fitted by
   iteratively reweighted least squares with Huber weights (robust to outliers), a small penalty
   on the curve's bends; a class the model prices at nothing (views on the CPU) gets the median
   measured time as a fixed time per node. Then the stream terms, common to the fitted classes:
   whole call ~ factor * corrected prediction + seconds per corrected node, over the fitted
   configs' whole calls (:func:`fit_stream`): a node in a model's stream costs more than the same
   node timed alone (on a CPU the frees of its inputs and outputs are not in its own time).
4. Validation held out: every ``holdout``-th config (in the sweep's order) is measured but left
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
from ..cost.opclass import class_name, lookup, op_class
from ..cost.profiles import DeviceProfile
from ..errors import GraphoptError

__all__ = ["Sample", "ConfigRun", "build_corpus", "fit_curve", "fit_op_classes", "evaluate", "fit_profile",
           "node_key"]

MIN_SAMPLES = 8
PER_KNOT = 8
MAX_KNOTS = 5


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
class Sample:
    """One deduplicated op shape: its class, the uncorrected prediction (``predicted_s``: the
    node's NodeCost time; ``predicted_loop_s``: CostModel.node_loop_s, what measure_nodes' time is
    compared with), and its measurements."""

    key: str
    cls: tuple
    op: str
    predicted_s: float
    predicted_loop_s: float
    measured: list = field(default_factory=list)
    configs: list = field(default_factory=list)

    @property
    def measured_s(self) -> float:
        return statistics.median(self.measured)

    def as_dict(self) -> dict:
        return {"key": self.key, "class": class_name(self.cls), "op": self.op, "predicted_s": self.predicted_s,
                "predicted_loop_s": self.predicted_loop_s, "measured_s": self.measured_s, "count": len(self.measured),
                "configs": sorted(set(self.configs))}


@dataclass
class ConfigRun:
    """One config of the corpus: its graph (kept for predictions; its tensors moved to the meta
    device once timed), the measured time of each node and of the whole call."""

    config: str
    held_out: bool
    source: str = "captured"  # "captured" | "optimized"
    gm: fx.GraphModule | None = None
    hints: dict = field(default_factory=dict)
    execution: str = "eager"  # how its calls run: "eager", or a CUDA graph replay ("graphed")
    reuse_outputs: bool = False
    node_s: dict = field(default_factory=dict)
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


def _hollow(gm: fx.GraphModule) -> None:
    """Move a timed graph's tensors to the meta device (the cost model reads only the nodes'
    metadata): a corpus of full-size models does not hold them all in memory."""
    gm.to("meta")
    for mod in gm.modules():
        for name, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                setattr(mod, name, v.to("meta"))


def _add_samples(corpus: dict, gm: fx.GraphModule, cost: CostModel, hints: dict, times: dict, config: str) -> int:
    new = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name not in times:
            continue
        path = op_class(n, cost.flops_bytes(n)[3])
        if path is None:
            continue
        key = node_key(n)
        s = corpus.get(key)
        if s is None:
            s = corpus[key] = Sample(key, path, ir.target_name(n), float(ir.concrete(cost.node_cost(n).time_s, hints)),
                                     float(cost.node_loop_s(n, hints)))
            new += 1
        s.measured.append(times[n.name])
        s.configs.append(config)
    return new


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


def _time_graph(run: ConfigRun, call, flat, device, cost: CostModel, corpus: dict | None, reps: int,
                whole_reps: int) -> None:
    from .measure import measure_call, measure_nodes

    run.hints = ir.shape_hints(run.gm)
    run.node_s = measure_nodes(run.gm, flat, device, reps=reps, best=True)
    run.whole_s = measure_call(call, device, reps=whole_reps, best=True)
    run.nodes = len(run.node_s)
    if corpus is not None:
        run.new_shapes = _add_samples(corpus, run.gm, cost, run.hints, run.node_s, run.config)


def held_out_configs(configs, holdout: int) -> set:
    """The keys of every ``holdout``-th config (0: none)."""
    return {c.key for i, c in enumerate(configs) if holdout and i % holdout == holdout - 1}


def build_corpus(configs, base: DeviceProfile, *, device, dtype, small: bool, held_out=frozenset(),
                 time_budget_s: float = 600.0, reps: int = 7, whole_reps: int = 10, optimized: bool = False,
                 quiet_wait_s: float = 30.0, log=print) -> tuple[dict, list[ConfigRun]]:
    """Build, capture and time each config (see the module docstring) until ``time_budget_s``
    seconds have passed (no config is started after that); each node's time and the whole call's
    are the best of ``reps`` / ``whole_reps`` runs (on a CPU after waiting up to ``quiet_wait_s``
    for other processes to quieten). Returns (samples by key, runs); the samples hold the fitted
    configs' nodes only, not those of the configs whose keys are in ``held_out``. A config that
    fails to build, capture or run is recorded with its error and skipped."""
    from .. import api
    from ..capture import capture
    from .bench import _load
    from .measure import graph_inputs, module_execution
    from .perf_sweep import factory_name

    device = torch.device(device)
    cost = CostModel(base)
    corpus: dict[str, Sample] = {}
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
                model, args, kwargs, _, _ = _load(f"graphopt.tools.perf_sweep:{factory_name(cfg.name)}", cfg.batch,
                                                  None, dtype, device)
            gm = capture(model, (args, kwargs))
            run.gm = gm
            if device.type == "cpu":
                run.load = wait_for_quiet(quiet_wait_s, log=log)
                if quiet_wait_s > 0 and run.load is not None and run.load >= QUIET_CORES:
                    log(f"    the CPU stays busy ({run.load:.1f} cores used by other work): timing the rest "
                        "without waiting")
                    quiet_wait_s = 0.0
            _time_graph(run, lambda: gm(*args, **kwargs), graph_inputs(gm, args, kwargs), device, cost,
                        None if held else corpus, reps, whole_reps)
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
                            cost, None if held else corpus, reps, whole_reps)
            except Exception as e:  # noqa: BLE001 - as above
                orun.error, orun.gm = _why(e), None
            orun.seconds = time.perf_counter() - t1
        for r in (run, orun):
            if r is not None and r.gm is not None:
                _hollow(r.gm)
        model = gm = opt = None  # (the graphs are hollow: free the model, its copies and the module)
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
                f"{run.seconds:.1f} s; corpus {len(corpus)} shapes, "
                f"{time.perf_counter() - t_start:.0f} s in all")
    return corpus, runs


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


# ------------------------------------------------------------------------------------ the fit


def _knots(xs: list[float], k: int) -> list[float]:
    s = sorted(xs)
    if k <= 1 or s[0] == s[-1]:
        return [statistics.median(s)]
    out = []
    for j in range(k):
        q = s[round(j * (len(s) - 1) / (k - 1))]
        if not out or q > out[-1] + 1e-9:
            out.append(q)
    return out


def _basis(x: float, knots: list[float]) -> list[float]:
    row = [0.0] * len(knots)
    if len(knots) == 1 or x <= knots[0]:
        row[0] = 1.0
    elif x >= knots[-1]:
        row[-1] = 1.0
    else:
        j = max(i for i in range(len(knots) - 1) if knots[i] <= x)
        t = (x - knots[j]) / (knots[j + 1] - knots[j])
        row[j], row[j + 1] = 1 - t, t
    return row


def fit_curve(xs, ys, knots: int, weights=None, smooth: float = 1.0, iters: int = 30) -> dict:
    """ys ~ g(xs), g piecewise linear between ``knots`` knots at quantiles of xs (flat beyond):
    iteratively reweighted least squares with Huber weights (1.345 robust sigmas, sigma from the
    median absolute deviation of the residuals), ``smooth`` times the squared second differences
    of the knot values added to the loss. Returns {"knots", "log_factor"}."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    w0 = [1.0] * len(xs) if weights is None else [float(w) for w in weights]
    kn = _knots(xs, knots)
    A = torch.tensor([_basis(x, kn) for x in xs], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    base_w = torch.tensor(w0, dtype=torch.float64)
    K = len(kn)
    D = torch.zeros(max(K - 2, 0), K, dtype=torch.float64)
    for i in range(K - 2):
        D[i, i], D[i, i + 1], D[i, i + 2] = 1.0, -2.0, 1.0
    P = smooth * D.T @ D + 1e-9 * torch.eye(K, dtype=torch.float64)
    w = base_w.clone()
    v = torch.zeros(K, dtype=torch.float64)
    for _ in range(iters):
        Aw = A * w[:, None]
        v_new = torch.linalg.solve(Aw.T @ A + P, Aw.T @ y)
        r = y - A @ v_new
        mad = float((r - r.median()).abs().median()) * 1.4826
        delta = 1.345 * max(mad, 0.02)
        w = base_w * torch.where(r.abs() <= delta, torch.ones_like(r), delta / r.abs().clamp_min(1e-12))
        done = float((v_new - v).abs().max()) < 1e-7
        v = v_new
        if done:
            break
    return {"knots": kn, "log_factor": [float(a) for a in v]}


def _prefixes(path: tuple):
    for i in range(1, len(path) + 1):
        yield path[:i]


def fit_op_classes(samples, *, min_samples: int = MIN_SAMPLES, per_knot: int = PER_KNOT,
                   max_knots: int = MAX_KNOTS) -> dict:
    """{class name: entry} for every class path prefix of the samples with at least
    ``min_samples`` shapes (see the module docstring). A sample the model prices at nothing
    (NodeCost 0 and node_loop_s 0) counts toward its class's fixed time; one with a zero NodeCost
    but a host time (a view on a GPU: host_node_s, measured by calibrate) is left out."""
    curves: dict[tuple, list] = {}
    zeros: dict[tuple, list] = {}
    for s in samples:
        m = s.measured_s
        if m <= 0:
            continue
        if s.predicted_s > 0 and s.predicted_loop_s > 0:
            point = (math.log(s.predicted_s), math.log(m / s.predicted_loop_s))
            for p in _prefixes(s.cls):
                curves.setdefault(p, []).append(point)
        elif s.predicted_s == 0 and s.predicted_loop_s == 0:
            for p in _prefixes(s.cls):
                zeros.setdefault(p, []).append(m)
    out: dict[str, dict] = {}
    for p, pts in curves.items():
        if len(pts) < min_samples:
            continue
        k = min(max_knots, 1 + len(pts) // per_knot)
        xs = [x for x, _ in pts]
        fit = dict(fit_curve(xs, [y for _, y in pts], k), range=[min(xs), max(xs)])
        before = statistics.median(abs(y) for _, y in pts)
        from ..cost.opclass import curve_log_factor

        after = statistics.median(abs(y - curve_log_factor(fit, x)) for x, y in pts)
        out[class_name(p)] = {**fit, "n": len(pts), "abs_log_error_before": before, "abs_log_error_after": after}
    for p, ms in zeros.items():
        if len(ms) < min_samples:
            continue
        entry = out.setdefault(class_name(p), {"n": 0})
        entry["fixed_s"] = statistics.median(ms)
        entry["n_fixed"] = len(ms)
    return out


def _with_stream(classes: dict, factor: float, add_s: float) -> dict:
    """The class fits with the stream terms folded in: every curve's factor times ``factor`` and
    ``add_s`` added per node; every fixed time times ``factor``."""
    out = {}
    for k, e in classes.items():
        e = dict(e)
        if "log_factor" in e:
            e["log_factor"] = [v + math.log(factor) for v in e["log_factor"]]
            e["add_s"] = add_s
        if "fixed_s" in e:
            e["fixed_s"] = e["fixed_s"] * factor
        out[k] = e
    return out


def _with_fit(base: DeviceProfile, fit: dict) -> DeviceProfile:
    return replace(base, op_class_fit=fit)


def _predicted_whole(run: ConfigRun, cost: CostModel) -> float:
    return float(cost.execution_cost(run.gm, run.hints, run.execution, reuse_outputs=run.reuse_outputs).total_s)


def _curve_nodes(run: ConfigRun, cost: CostModel) -> int:
    """How many of a graph's nodes a curve of the cost model's fit corrects."""
    from ..cost.opclass import covers

    fit, n = cost.profile.op_class_fit, 0
    for node in run.gm.graph.nodes:
        if node.op != "call_function":
            continue
        path = op_class(node, cost.flops_bytes(node)[3])
        raw = float(ir.concrete(cost._node_cost(node).time_s, run.hints))
        _, entry = lookup(fit, path, raw) if path is not None else (None, None)
        n += entry is not None and raw > 0 and covers(entry, raw) and bool(entry.get("knots"))
    return n


def fit_stream(predicted, nodes, measured, iters: int = 20) -> tuple[float, float]:
    """(factor, seconds per node) with measured ~ factor * predicted + seconds * nodes over whole
    calls, relative errors, Huber-weighted (a few configs timed under load do not pull it);
    seconds per node at least 0 (else refitted as the factor alone)."""
    P = torch.tensor(predicted, dtype=torch.float64)
    N = torch.tensor(nodes, dtype=torch.float64)
    W = torch.tensor(measured, dtype=torch.float64)
    A, y = torch.stack([P / W, N / W], 1), torch.ones_like(W)
    w = torch.ones_like(W)
    sol = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for _ in range(iters):
        Aw = A * w[:, None]
        sol = torch.linalg.lstsq(Aw.T @ A, Aw.T @ y).solution
        if sol[1] < 0:
            f = float((Aw[:, 0] @ y) / (Aw[:, 0] @ A[:, 0]))
            sol = torch.tensor([f, 0.0], dtype=torch.float64)
        r = y - A @ sol
        delta = 1.345 * max(float((r - r.median()).abs().median()) * 1.4826, 0.02)
        w = torch.where(r.abs() <= delta, torch.ones_like(r), delta / r.abs().clamp_min(1e-12))
    return max(float(sol[0]), 1e-3), float(sol[1])


def fit_profile(base: DeviceProfile, samples, runs, *, min_samples: int = MIN_SAMPLES, corpus_info: dict | None = None,
                ) -> DeviceProfile:
    """``base`` with the op class fit of ``samples`` and the stream terms from the whole calls of
    the fitted configs of ``runs`` (:func:`fit_stream`): the profile ``graphopt calibrate
    --corpus`` writes."""
    base = replace(base, op_class_fit={})
    samples = list(samples)
    classes = fit_op_classes(samples, min_samples=min_samples)
    fitted = [r for r in runs if not r.held_out and r.gm is not None and r.whole_s]
    factor, add_s, used = 1.0, 0.0, 0
    if classes and fitted:
        cost = CostModel(_with_fit(base, {"classes": classes}))
        pred = [_predicted_whole(r, cost) for r in fitted]
        keep = [i for i, p in enumerate(pred) if p > 0]
        if keep:
            factor, add_s = fit_stream([pred[i] for i in keep], [_curve_nodes(fitted[i], cost) for i in keep],
                                       [fitted[i].whole_s for i in keep])
            used = len(keep)
    fit = {"version": 1, "classes": _with_stream(classes, factor, add_s), "min_samples": min_samples,
           "stream": {"factor": factor, "add_s": add_s, "configs": used},
           "corpus": dict(corpus_info or {}, samples=len(samples))}
    return _with_fit(base, fit)


# ------------------------------------------------------------------------------------ validation


def evaluate(runs, before: DeviceProfile, after: DeviceProfile) -> dict:
    """Prediction against measurement on the held-out runs, before and after the fit: per run
    the whole-call error and the rank correlation over its timed nodes (Spearman: every timed
    op node; ``costed``: those predicted above 0), and per class the median |ln(predicted /
    measured)| over the held-out nodes, each node alone (the fit's stream terms taken out)."""
    from .measure import spearman

    cb, ca = CostModel(before), CostModel(after)
    rows, per_class = [], {}
    stream = after.op_class_fit.get("stream") or {}
    for r in runs:
        if not r.held_out or r.gm is None or not r.whole_s:
            continue
        row = {"config": r.config, "source": r.source, "execution": r.execution, "measured_ms": r.whole_s * 1e3,
               "nodes": 0}
        for tag, cost in (("before", cb), ("after", ca)):
            pred = _predicted_whole(r, cost)
            row[f"predicted_ms_{tag}"] = pred * 1e3
            row[f"error_pct_{tag}"] = (pred - r.whole_s) / r.whole_s * 100
            ps, ms = [], []
            for n in r.gm.graph.nodes:
                if n.op != "call_function" or n.name not in r.node_s or op_class(n, cost.flops_bytes(n)[3]) is None:
                    continue
                ps.append(float(cost.node_loop_s(n, r.hints)))
                ms.append(r.node_s[n.name])
            row["nodes"] = len(ps)
            row[f"spearman_{tag}"] = spearman(ps, ms)
            costed = [(p, m) for p, m in zip(ps, ms) if p > 0]
            row[f"spearman_costed_{tag}"] = spearman([p for p, _ in costed], [m for _, m in costed])
        for n in r.gm.graph.nodes:
            if n.op != "call_function" or n.name not in r.node_s:
                continue
            path = op_class(n, cb.flops_bytes(n)[3])
            m = r.node_s[n.name]
            if path is None or m <= 0:
                continue
            pb, pa = float(cb.node_loop_s(n, r.hints)), float(ca.node_loop_s(n, r.hints))
            name, entry = lookup(after.op_class_fit, path, float(ir.concrete(cb.node_cost(n).time_s, r.hints)))
            if entry is not None:  # the node alone: without the stream terms (a node in a model's stream)
                pa = (pa - (entry.get("add_s", 0.0) if pb > 0 else 0.0)) / stream.get("factor", 1.0)
            name = name or f"{class_name(path)} (not fitted)"
            c = per_class.setdefault(name, {"n": 0, "before": [], "after": []})
            c["n"] += 1
            if pb > 0:
                c["before"].append(abs(math.log(pb / m)))
            if pa > 0:
                c["after"].append(abs(math.log(pa / m)))
        rows.append(row)
    classes = {k: {"n": v["n"], "abs_log_error_before": statistics.median(v["before"]) if v["before"] else None,
                   "abs_log_error_after": statistics.median(v["after"]) if v["after"] else None}
               for k, v in sorted(per_class.items(), key=lambda kv: -kv[1]["n"])}

    def count(tag, test):
        return sum(1 for row in rows if row.get(tag) is not None and test(row[tag]))

    summary = {"rows": len(rows)}
    for tag in ("before", "after"):
        summary[f"within_20pct_{tag}"] = count(f"error_pct_{tag}", lambda e: abs(e) <= 20)
        summary[f"spearman_ge_0.9_{tag}"] = count(f"spearman_{tag}", lambda s: s >= 0.9)
        errs = [abs(row[f"error_pct_{tag}"]) for row in rows]
        summary[f"median_abs_error_pct_{tag}"] = statistics.median(errs) if errs else None
        rhos = [row[f"spearman_{tag}"] for row in rows if row[f"spearman_{tag}"] is not None]
        summary[f"median_spearman_{tag}"] = statistics.median(rhos) if rhos else None
    return {"summary": summary, "rows": rows, "classes": classes}


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
               "optimized": False, "base": None, "results": None, "quiet_wait": 30.0}


def refuse_corpus_options(args) -> None:
    """One-line error for a --corpus option given without --corpus."""
    for name, default in CORPUS_ONLY.items():
        if getattr(args, name, default) != default:
            raise GraphoptError(f"--{name.replace('_', '-')} applies to --corpus only")


def _fmt(v, digits: int = 2, suffix: str = "") -> str:
    return "—" if v is None else f"{v:.{digits}f}{suffix}"


def to_markdown(result: dict) -> str:
    h, s = result["header"], result["validation"]["summary"]
    c = result["corpus"]
    lines = [f"# Cost model corpus fit: {h.get('device_name', h.get('device'))}, {h['date']}", "",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in (h.get("versions") or {}).items() if v),
             f"- command: {result['command']}",
             f"- corpus: {c['samples']} op shapes from {len(c['configs'])} configs ({c['dtype']}"
             f"{', small variants' if c['small'] else ''}{', optimized graphs too' if c['optimized'] else ''}), "
             f"{c['timing']}; built in {c['seconds']:.0f} s"
             + (f"; other processes used {c['others_cores']:.1f} cores (median) while it was timed"
                if c.get("others_cores") is not None else ""),
             f"- held out (not in the fit): {', '.join(c['held_out']) or 'none'}",
             f"- in a model's stream a node costs {result['fit']['stream']['factor']:.3f}× its time alone + "
             f"{result['fit']['stream']['add_s'] * 1e6:.2f} µs (fitted on {result['fit']['stream']['configs']} "
             "configs' whole calls)", "",
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
    lines += ["", "## Per class, held-out nodes alone (median |ln(predicted / measured)|)", "",
              "| class (the fit used) | nodes | before | after |", "| --- | ---: | ---: | ---: |"]
    for k, v in result["validation"]["classes"].items():
        lines.append(f"| {k} | {v['n']} | {_fmt(v['abs_log_error_before'])} | {_fmt(v['abs_log_error_after'])} |")
    lines += ["", "## Fitted classes (training error, median |ln(measured / predicted)|)", "",
              "| class | shapes | knots (ln s) | factor at the knots | before | after | fixed µs |",
              "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for k, e in result["fit"]["classes"].items():
        knots = ", ".join(f"{x:.1f}" for x in e.get("knots", []))
        fac = ", ".join(f"{math.exp(v):.2f}" for v in e.get("log_factor", []))
        lines.append(f"| {k} | {e.get('n', 0) or e.get('n_fixed', 0)} | {knots} | {fac} | "
                     f"{_fmt(e.get('abs_log_error_before'))} | {_fmt(e.get('abs_log_error_after'))} | "
                     f"{_fmt(e['fixed_s'] * 1e6 if 'fixed_s' in e else None)} |")
    if c.get("errors"):
        lines += ["", "Configs not measured: " + "; ".join(f"{k}: {v}" for k, v in c["errors"].items())]
    return "\n".join(lines) + "\n"


def run_cli(args) -> int:
    """``graphopt calibrate --corpus ...`` (see the module docstring): build the corpus, fit,
    validate on the held-out configs, write the profile (and, with --results, the table)."""
    import json
    import sys
    from pathlib import Path

    from ..cost.profiles import cpu_cache_path, get_profile
    from .bench import environment, result_stem
    from .calibrate import _resolve
    from .cli import DTYPES
    from .perf_sweep import parse_configs

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
        print(f"note: {note}")
    if args.output:
        out = Path(args.output)
    elif device.type == "cpu" and args.base is None:
        out = cpu_cache_path()
    else:
        out = Path(f"{base.name}-calibrated.json")
    say = lambda m: print(m, flush=True)  # noqa: E731
    say(f"corpus on {device} ({str(dtype)[6:]}): {len(configs)} config(s), every {args.holdout or '-'}th held out, "
        f"at most {args.time_budget:.0f} s")
    t0 = time.perf_counter()
    reps, whole = (3, 5) if args.quick else (7, 10)
    samples, runs = build_corpus(configs, replace(base, op_class_fit={}), device=device, dtype=dtype, small=args.small,
                                 held_out=held, time_budget_s=args.time_budget, reps=reps, whole_reps=whole,
                                 optimized=args.optimized, quiet_wait_s=args.quiet_wait, log=say)
    built = time.perf_counter() - t0
    measured = [r for r in runs if r.source == "captured" and not r.error]
    if not samples:
        raise GraphoptError("no config could be measured here: " + "; ".join(f"{r.config}: {r.error}" for r in runs))
    from .bench import utc_now

    date = utc_now()
    loads = [r.load for r in measured if r.load is not None]
    info = {"configs": [r.config for r in measured if not r.held_out],
            "held_out": [r.config for r in measured if r.held_out],
            "device": str(device), "dtype": str(dtype)[6:], "small": bool(args.small),
            "optimized": bool(args.optimized),
            "torch": torch.__version__, "measured_at": date, "seconds": built,
            "timing": f"each node alone, best of {reps} runs (graphopt.tools.measure.measure_nodes); "
                      f"whole call best of {whole}",
            "errors": {r.config: r.error for r in runs if r.error},
            "others_cores": statistics.median(loads) if loads else None}
    say(f"fitting {len(samples)} shapes")
    prof = fit_profile(base, list(samples.values()), runs, min_samples=args.min_samples, corpus_info=info)
    validation = evaluate(runs, replace(base, op_class_fit={}), prof)
    prof.op_class_fit["validation"] = validation["summary"]
    prof.source = dict(prof.source, op_class_fit=(
        f"measured by graphopt calibrate --corpus on {date}: {len(samples)} op shapes from "
        f"{len(info['configs'])} sweep configs ({info['dtype']})"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(prof.to_dict(), indent=1))
    except OSError as e:
        raise GraphoptError(f"cannot write {out}: {e.strerror or e}") from None
    header = environment(device)
    from_cli = sys.argv[1:2] == ["calibrate"]
    command = "graphopt " + " ".join(sys.argv[1:]) if from_cli else "graphopt calibrate --corpus"
    result = {"header": header, "command": command, "corpus": info | {"samples": len(samples)},
              "fit": {k: v for k, v in prof.op_class_fit.items() if k != "validation"}, "validation": validation}
    s = validation["summary"]
    classes = len(prof.op_class_fit["classes"])
    say(f"{classes} class fit(s) from {len(samples)} shapes; in a model's stream a node costs "
        f"{prof.op_class_fit['stream']['factor']:.3f}x + {prof.op_class_fit['stream']['add_s'] * 1e6:.2f} us")
    if s["rows"]:
        say(f"held out ({s['rows']} graph(s)): whole call within ±20%: {s['within_20pct_before']} -> "
            f"{s['within_20pct_after']}; median |error| {_fmt(s['median_abs_error_pct_before'], 1, '%')} -> "
            f"{_fmt(s['median_abs_error_pct_after'], 1, '%')}; Spearman over nodes >= 0.9: "
            f"{s['spearman_ge_0.9_before']} -> {s['spearman_ge_0.9_after']}; median "
            f"{_fmt(s['median_spearman_before'])} -> {_fmt(s['median_spearman_after'])}")
    if args.results:
        d = Path(args.results)
        stem = result_stem(header, "calibrate_corpus")
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
            (d / f"{stem}.md").write_text(to_markdown(result))
        except OSError as e:
            raise GraphoptError(f"cannot write into {d}: {e.strerror or e}") from None
        say(f"wrote {d / (stem + '.md')}")
    say(f"wrote {out}")
    return 0
