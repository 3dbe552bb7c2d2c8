"""Measured time against the cost model's predictions.

    from graphopt.tools.measure import measure_nodes, accuracy_table, busy_fraction, measure_report
    times = measure_nodes(gm, flat_inputs, device, reps=5)     # {node name: seconds}
    table = accuracy_table(gm, (args, kwargs), CostModel(profile))

* :func:`measure_nodes` runs the graph node by node (a ``torch.fx.Interpreter``), each
  ``call_function`` node timed alone: on CUDA its op is called ``inner`` (10) times back to back
  between two CUDA events after a synchronization, nothing inside (a node then costs what it
  costs in a stream of ops: the longer of its device time and its host dispatch + launch), and
  the host's issue time of that loop is kept too; ``perf_counter`` on the CPU; the median over
  ``reps`` runs.
* :func:`accuracy_table`: per node predicted (``CostModel.node_loop_s``) vs measured, Spearman
  over the nodes with a nonzero predicted time and over the "heavy" ones (measured above 3x the
  launch overhead), and the whole call timed as one call against ``CostModel.execution_cost``
  (the eager host/device queue, or a graphed replay when ``call`` replays one).
* :func:`busy_fraction`: GPU kernel time / wall time of a call, and of calls back to back (torch.profiler: the union of the
  device activity intervals over a few calls, divided by the median unprofiled wall time of a
  call). ``None`` on the CPU.
* :func:`measure_report`: what ``graphopt explain --measure`` puts in ``Report.measured``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.fx as fx

from .. import ir

__all__ = ["measure_nodes", "measure_call", "accuracy_table", "spearman", "busy_fraction", "graph_inputs",
           "measure_report"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(gm: fx.GraphModule, flat_inputs) -> torch.device:
    for x in flat_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    for p in gm.parameters():
        return p.device
    for b in gm.buffers():
        return b.device
    return torch.device("cpu")


def graph_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The graph's placeholder values for a call ``gm(*args, **kwargs)`` (the pytree order a
    torch.export module flattens its inputs in)."""
    from ..capture import flat_tensors

    codegen = gm.graph._codegen
    if type(codegen).__name__ == "_PyTreeCodeGen":
        try:
            return list(codegen.process_inputs(*args, **kwargs))
        except Exception:  # noqa: BLE001 - fall back to the plain flattening
            pass
    return list(flat_tensors(args, kwargs))


class _NodeTimer(fx.Interpreter):
    """Times each call_function node. The node's arguments are fetched once; on a GPU its op then
    runs ``inner`` times back to back between two CUDA events, with no synchronization inside
    (the graph is functional, so a rerun computes the same value): a node costs what it costs in a
    stream of ops, the longer of its device time and its host time (dispatch + launch), and a tiny
    node measures its real launch-bound time, with no interpreter overhead and nothing
    subtracted. The host's issue time of the same loop (perf_counter, before the closing event
    is waited on) is kept too. On the CPU the op runs once, timed with perf_counter.

    ``device_times`` (GPU): each node's loop is timed a second time queued behind a GPU sleep, so
    the host has issued every call before the first one starts and the events measure the device
    work alone (``self.device_s``): the device time the cost model predicts, without the host
    time that bounds a small node's loop."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, inner: int = 10, device_times: bool = False):
        super().__init__(gm)
        self.device = device
        self.inner = max(1, inner)
        self.device_times = device_times and device.type == "cuda"
        self.times: dict[str, float] = {}
        self.host: dict[str, float] = {}
        self.device_s: dict[str, float] = {}

    def run_node(self, n: fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        fn = n.target
        dev = self.device
        if dev.type == "cuda":
            out = fn(*args, **kwargs)
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(self.inner):
                fn(*args, **kwargs)
            host = time.perf_counter() - t0
            end.record()
            end.synchronize()
            self.times[n.name] = start.elapsed_time(end) / 1e3 / self.inner
            self.host[n.name] = host / self.inner
            if self.device_times:
                # ~0.1 ms of GPU time per call for the host to enqueue it (fused_pointwise's
                # Triton launcher, the slowest, takes ~70 us)
                torch.cuda._sleep(200_000 * self.inner)
                start.record()
                for _ in range(self.inner):
                    fn(*args, **kwargs)
                end.record()
                end.synchronize()
                self.device_s[n.name] = start.elapsed_time(end) / 1e3 / self.inner
        else:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.times[n.name] = self.host[n.name] = time.perf_counter() - t
        return out


def measure_nodes(gm: fx.GraphModule, flat_inputs, device=None, reps: int = 5, warmup: int = 1, *,
                  inner: int = 10, detail: bool = False, device_times: bool = False, best: bool = False) -> dict:
    """Seconds per ``call_function`` node of ``gm`` ({node name: median over ``reps`` runs}, each
    run timing ``inner`` back-to-back calls of the node on a GPU, see _NodeTimer).
    ``flat_inputs``: the placeholder values in order (see :func:`graph_inputs`). ``detail``:
    ``{name: (seconds per call, host issue seconds per call)}`` instead, with a third element, the
    device seconds per call (queued behind a GPU sleep, see _NodeTimer), when ``device_times``
    (None off a GPU). ``best``: the least of the runs instead of the median (other work sharing
    the machine only adds time)."""
    flat_inputs = list(flat_inputs)
    device = torch.device(device) if device is not None else _device_of(gm, flat_inputs)
    samples: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}
    dev: dict[str, list[float]] = {}
    with torch.inference_mode():
        for i in range(warmup + max(1, reps)):
            timer = _NodeTimer(gm, device, inner, device_times=device_times)
            timer.run(*flat_inputs)
            _sync(device)
            if i >= warmup:
                for k, v in timer.times.items():
                    samples.setdefault(k, []).append(v)
                    host.setdefault(k, []).append(timer.host[k])
                    if k in timer.device_s:
                        dev.setdefault(k, []).append(timer.device_s[k])
    stat = min if best else statistics.median
    if detail and device_times:
        return {k: (stat(v), stat(host[k]), stat(dev[k]) if k in dev else None) for k, v in samples.items()}
    if detail:
        return {k: (stat(v), stat(host[k])) for k, v in samples.items()}
    return {k: stat(v) for k, v in samples.items()}


def measure_call(fn, device, reps: int = 10, warmup: int = 3, *, best: bool = False) -> float:
    """Median seconds of one call of ``fn`` (graphopt.tools.bench.time_call: CUDA events / perf_counter);
    ``best``: the least of the ``reps`` calls."""
    from .bench import time_call

    with torch.inference_mode():
        times = time_call(fn, reps=reps, warmup=warmup, device=torch.device(device))
    return min(times) if best else statistics.median(times)


# ------------------------------------------------------------------------------------ statistics


def _ranks(xs: list[float]) -> list[float]:
    """Ranks from 1, ties get their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        avg = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[order[k]] = avg
        i = j + 1
    return ranks


def spearman(a, b) -> float | None:
    """Spearman rank correlation of two equally long sequences (Pearson on average ranks);
    None with fewer than 2 points or a constant sequence."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} vs {len(b)} values")
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return cov / (va * vb) ** 0.5


# ------------------------------------------------------------------------------------ tables


def accuracy_table(gm: fx.GraphModule, inputs, cost_model, hints: dict | None = None, *, reps: int = 5,
                   whole_reps: int = 10, device=None, call=None, execution: str = "eager",
                   heavy_factor: float = 3.0, inner: int = 10) -> dict:
    """Per node predicted vs measured, and the whole call predicted vs measured.

    Per node: measured = seconds per call of the node run ``inner`` times back to back (see
    :func:`measure_nodes`); predicted = ``cost_model.node_loop_s`` (the longer of the node's host
    and device time on a GPU, their sum on the CPU; a view costs the host ``host_node_s``).
    Two rank correlations (Spearman): ``spearman`` over every node with a nonzero predicted time
    ("costed nodes"), ``spearman_heavy`` over the nodes measured above ``heavy_factor`` x the
    profile's launch overhead ("heavy nodes": those whose device time shows above launch noise).

    Whole: ``call`` (default ``gm(*args, **kwargs)``, run eagerly) timed as one call, against
    ``cost_model.execution_cost(gm, hints, execution)`` ("eager", or "graphed" when ``call``
    replays a CUDA graph). ``inputs``: the example inputs (a tensor, a tuple of args, a dict of
    kwargs or ``(args, kwargs)``)."""
    from ..capture import split_inputs

    args, kwargs = split_inputs(inputs)
    flat = graph_inputs(gm, args, kwargs)
    device = torch.device(device) if device is not None else _device_of(gm, flat)
    hints = hints if hints is not None else ir.shape_hints(gm)
    cost = cost_model.graph_cost(gm, hints)
    ex = cost_model.execution_cost(gm, hints, execution)
    measured = measure_nodes(gm, flat, device, reps=reps, inner=inner, detail=True, device_times=True)
    by_name = {n.name: n for n in gm.graph.nodes}
    profile = cost_model.profile
    rows = []
    for c in cost.nodes:
        if c.node not in measured:
            continue
        node = by_name[c.node]
        host, dev = cost_model.node_times(node)
        loop_s, host_s, dev_s = measured[c.node]
        rows.append({"node": c.node, "op": c.op, "bound": c.bound,
                     "predicted_ms": float(cost_model.node_loop_s(node, hints)) * 1e3,
                     "measured_ms": loop_s * 1e3,
                     "predicted_host_ms": float(ir.concrete(host, hints)) * 1e3,
                     "predicted_device_ms": float(ir.concrete(dev, hints)) * 1e3,
                     "measured_host_ms": host_s * 1e3,
                     "measured_device_ms": dev_s * 1e3 if dev_s is not None else None,
                     "launches": c.launches})
    costed = [r for r in rows if r["predicted_ms"] > 0]
    threshold_ms = heavy_factor * profile.launch_overhead_s * 1e3
    heavy = [r for r in costed if r["measured_ms"] > threshold_ms]
    kernels = [r for r in rows if r["launches"] > 0]
    rho = spearman([r["predicted_ms"] for r in costed], [r["measured_ms"] for r in costed])
    rho_heavy = spearman([r["predicted_ms"] for r in heavy], [r["measured_ms"] for r in heavy])
    rho_kernels = spearman([r["predicted_ms"] for r in kernels], [r["measured_ms"] for r in kernels])
    # device time alone (queued timing) against the predicted device time, over the nodes that
    # launch a kernel: the roofline's ranking without the host cost that ties small nodes
    dk = [r for r in kernels if r["measured_device_ms"] is not None and r["predicted_device_ms"] > 0]
    rho_device = spearman([r["predicted_device_ms"] for r in dk], [r["measured_device_ms"] for r in dk])
    fn = call if call is not None else (lambda: gm(*args, **kwargs))
    whole = measure_call(fn, device, reps=whole_reps)
    pred = float(ex.total_s)
    views = [r["measured_host_ms"] for r in rows if r["launches"] == 0 and r["op"] != "getitem"]
    launched = [r["measured_host_ms"] / r["launches"] for r in rows if r["launches"] > 0]
    return {
        "device": str(device),
        "profile": profile.name,
        "execution": execution,
        "nodes_total": len(rows),
        "nodes_costed": len(costed),
        "nodes_heavy": len(heavy),
        "heavy_threshold_ms": threshold_ms,
        "spearman": rho,
        "spearman_heavy": rho_heavy,
        "spearman_kernels": rho_kernels,
        "spearman_device": rho_device,
        "nodes_device": len(dk),
        "predicted_ms": pred * 1e3,
        "predicted_host_ms": ex.host_s * 1e3,
        "predicted_device_ms": ex.device_s * 1e3,
        "predicted_busy": ex.busy,
        "predicted_node_sum_ms": float(cost.total_s) * 1e3,
        "measured_ms": whole * 1e3,
        "node_sum_ms": sum(r["measured_ms"] for r in rows),
        "error_pct": (pred - whole) / whole * 100 if whole > 0 else None,
        # the host cost per fx node measured inside this graph (medians): compare with the
        # profile's host_node_s and launch_overhead_s
        "measured_host_node_us": statistics.median(views) * 1e3 if views else None,
        "measured_host_launch_us": statistics.median(launched) * 1e3 if launched else None,
        "nodes": rows,
    }


# ------------------------------------------------------------------------------------ busy fraction


def _device_intervals(prof) -> list[tuple[float, float]]:
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            tr = e.time_range
            if tr.end > tr.start:
                out.append((float(tr.start), float(tr.end)))
    return out


def _union(intervals) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _loop_seconds(fn, device, calls: int) -> float:
    """Seconds per call of ``calls`` calls issued back to back (one pair of CUDA events around all
    of them): the host may run ahead of the device, as in a serving loop."""
    with torch.inference_mode(), torch.cuda.device(device):
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls


def busy_fraction(fn, device, calls: int = 5, reps: int = 10, warmup: int = 3, loop_calls: int = 20) -> dict:
    """GPU busy fraction of ``fn``: device activity (kernels, copies; the union of their intervals,
    from torch.profiler over ``calls`` calls) per call / median wall time of one unprofiled call
    started on an idle device ("busy": what a caller waiting for each result sees), and / the time
    per call of ``loop_calls`` calls back to back ("busy_loop": the steady state of a serving
    loop, where the host's issue time overlaps the previous call's kernels).
    ``{"busy": None, "reason": ...}`` on the CPU or when the profiler saw no kernel."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"busy": None, "busy_loop": None, "reason": "n/a on CPU"}
    from torch.profiler import ProfilerActivity, profile

    wall = measure_call(fn, device, reps=reps, warmup=warmup)
    try:
        loop = _loop_seconds(fn, device, loop_calls)
        with torch.inference_mode():
            fn()
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize(device)
        intervals = _device_intervals(prof)
    except Exception as e:  # noqa: BLE001 - a profiler failure is a missing number, not a failed explain
        return {"busy": None, "busy_loop": None, "reason": f"torch.profiler failed: {type(e).__name__}: {str(e)[:160]}",
                "wall_ms": wall * 1e3}
    if not intervals:
        return {"busy": None, "busy_loop": None, "reason": "the profiler recorded no device activity", "wall_ms": wall * 1e3}
    kernel_s = _union(intervals) / 1e6 / calls
    return {"busy": min(1.0, kernel_s / wall) if wall > 0 else None,
            "busy_loop": min(1.0, kernel_s / loop) if loop > 0 else None, "kernel_ms": kernel_s * 1e3,
            "wall_ms": wall * 1e3, "loop_ms": loop * 1e3, "kernels_per_call": len(intervals) / calls}


# ------------------------------------------------------------------------------------ explain --measure


def module_execution(opt) -> str:
    """How calls of an OptimizedModule run: "graphed" (CUDA graph replay, outputs cloned),
    "graphed_reuse_outputs" or "eager"."""
    runner = getattr(opt, "runner", None)
    if runner is None or not runner.active or opt._modules.get("placed") is not None:
        return "eager"
    return "graphed_reuse_outputs" if getattr(runner, "reuse_outputs", False) else "graphed"


def measure_report(opt, model, inputs, *, profile=None, reps: int = 5, top: int = 20) -> dict:
    """Fill ``opt.report.measured``: the captured-before graph (captured again with
    graphopt.capture) and the optimized graph measured node by node and whole, beside the cost
    model's predictions, and the GPU busy fraction of the eager graph and of the optimized module.
    ``profile``: the cost profile to predict with (a name, a .json path or a DeviceProfile;
    default: the report's target). Per-pass measurement is not done (before/after only)."""
    from ..capture import capture, split_inputs
    from ..cost.model import CostModel
    from ..cost.profiles import get_profile

    args, kwargs = split_inputs(inputs)
    report = opt.report
    profile, _ = get_profile(profile if profile is not None else report.target)
    cost = CostModel(profile)
    was_training = model.training
    model.eval()
    try:
        before_gm = capture(model, (args, kwargs))
    finally:
        model.train(was_training)
    device = _device_of(before_gm, graph_inputs(before_gm, args, kwargs))
    before = accuracy_table(before_gm, (args, kwargs), cost, reps=reps, device=device)
    after_gm = opt.graph_module
    after = accuracy_table(after_gm, (args, kwargs), cost, hints=ir.shape_hints(after_gm), reps=reps, device=device)
    module_ms = measure_call(lambda: opt(*args, **kwargs), device, reps=10) * 1e3
    mode = module_execution(opt)
    module_pred_ms = cost.execution_cost(after_gm, ir.shape_hints(after_gm), "graphed" if mode != "eager" else "eager",
                                         reuse_outputs=mode == "graphed_reuse_outputs").total_s * 1e3
    bb = busy_fraction(lambda: before_gm(*args, **kwargs), device)
    ba = busy_fraction(lambda: opt(*args, **kwargs), device)
    rows = sorted(after["nodes"], key=lambda r: -r["predicted_ms"])[:top]
    notes = ["per pass: not measured (before/after only)"]
    if device.type == "cpu" and profile.kind != "cpu":
        notes.append(f"predicted with the {profile.name} profile, measured on the CPU")
    measured = {
        "device": str(device),
        "timing": "CUDA events around 10 back-to-back runs of each node" if device.type == "cuda" else "perf_counter",
        "before_ms": before["measured_ms"],
        "after_ms": module_ms,
        "after_graph_ms": after["measured_ms"],
        "predicted_before_ms": before["predicted_ms"],
        "predicted_after_ms": module_pred_ms,
        "execution_after": mode,
        "predicted_after_graph_ms": after["predicted_ms"],
        "error_after_graph_pct": after["error_pct"],
        "error_before_pct": before["error_pct"],
        "error_after_pct": (module_pred_ms - module_ms) / module_ms * 100 if module_ms > 0 else None,
        "spearman_before": before["spearman"],
        "spearman_after": after["spearman"],
        "busy_before": bb.get("busy"),
        "busy_after": ba.get("busy"),
        "busy_loop_before": bb.get("busy_loop"),
        "busy_loop_after": ba.get("busy_loop"),
        "busy_detail": {"before": bb, "after": ba},
        "per_pass": None,
        "nodes": rows,
        "notes": notes,
    }
    report.measured = measured
    return measured
