"""The Report: what each pass did, predicted before/after, what was rejected and why.

``explain`` renders only these records (passes never print). ``to_json`` gives the stable
machine-readable form written by ``graphopt explain --json``.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .errors import one_line
from .pipeline import PassResult


def _mb(nbytes: float) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}"


def default_console():
    """A rich Console for reports: the terminal's width, or 120 columns when the output is not a
    terminal (rich would otherwise wrap and cut at 80)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)


@dataclass(repr=False)
class Report:
    model: str
    device: str
    target: str
    profile: dict
    capture: dict
    predicted_s_before: float
    predicted_s_after: float
    cost_before: dict
    cost_after: dict
    passes: list[PassResult]
    accuracy: dict
    kernel_backend: str
    optimize_seconds: float
    notes: list[str] = field(default_factory=list)
    top_nodes: list[dict] = field(default_factory=list)
    measured: dict | None = None
    partition: dict | None = None  # the stage plan (graphopt.partition.StagePlan.as_dict()) for devices=
    # predicted execution (CostModel.execution_cost): {"before": eager, "after": {"eager", "graphed"},
    # "mode": the one calls use}; predicted_s_before/after are its "before" and "after"[mode]
    execution: dict | None = None
    # optimize()'s wall time per phase (graphopt.timing; exclusive, summing to optimize_seconds)
    optimize_phases: dict = field(default_factory=dict)
    # what optimize() held beside the model: {"model_bytes", the constants account
    # (graphopt.setup_memory.ConstantAccount.as_dict), "setup_peak_bytes", "setup_start_bytes",
    # "setup_peak_source": "measured" (torch.cuda.max_memory_allocated) or "account" (model + constants)}
    memory: dict | None = None
    # the measured guard (graphopt.runtime.measured): the captured graph's, the optimized module's and
    # the model's measured ms, which one calls run ("returned"), or why nothing was timed
    speed: dict | None = None
    setup_peak_bytes: float | None = None  # memory["setup_peak_bytes"]

    # ------------------------------------------------------------------ data

    def pass_result(self, name: str) -> PassResult:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(name)

    def rewrites(self, name: str) -> int:
        return len(self.pass_result(name).rewrites)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "target": self.target,
            "profile": self.profile,
            "capture": self.capture,
            "kernel_backend": self.kernel_backend,
            "predicted_ms_before": self.predicted_s_before * 1e3,
            "predicted_ms_after": self.predicted_s_after * 1e3,
            "cost_before": self.cost_before,
            "cost_after": self.cost_after,
            "accuracy": self.accuracy,
            "optimize_seconds": self.optimize_seconds,
            "optimize_phases": self.optimize_phases,
            "passes": [p.as_dict() for p in self.passes],
            "top_nodes": self.top_nodes,
            "notes": self.notes,
            "measured": self.measured,
            "partition": self.partition,
            "execution": self.execution,
            "memory": self.memory,
            "setup_peak_bytes": self.setup_peak_bytes,
            "speed": self.speed,
        }

    def memory_summary(self) -> str:
        """One line: optimize()'s peak and the constants the passes added (``memory``)."""
        m = self.memory or {}
        parts = []
        if m.get("setup_peak_bytes") is not None:
            if m.get("setup_peak_source") == "measured":
                start = m.get("setup_start_bytes") or 0
                parts.append(f"optimize() peaked at {_mb(m['setup_peak_bytes'])} on {self.device} "
                             f"({_mb(m['setup_peak_bytes'] - start)} above the {_mb(start)} allocated before it)")
            else:
                parts.append(f"peak resident {_mb(m['setup_peak_bytes'])} (model + constants; the accuracy guard's "
                             "temporaries not counted off the GPU)")
        if "model_bytes" in m:
            parts.append(f"model {_mb(m['model_bytes'])}")
        limit = m.get("limit_bytes")
        parts.append(f"constants added {_mb(m.get('added_bytes', 0.0))} (limit "
                     f"{'none' if limit is None else _mb(limit)}, weight_copies={m.get('weight_copies')!r})")
        if m.get("refused"):
            parts.append(f"{m['refused']} weight-copying rewrite(s) refused ({_mb(m.get('refused_bytes', 0.0))})")
        return "; ".join(parts)

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.as_dict(), indent=indent, default=str)

    # ------------------------------------------------------------------ text

    def _mode_words(self) -> str:
        """How the predicted call runs, before → after: "eager, host-bound, GPU busy 66% → CUDA
        graph replay, device-bound", or how a CPU profile runs it."""
        ex = self.execution or {}
        if not (ex.get("before") and ex.get("mode") in ex.get("after", {})):
            return ""
        b, a = ex["before"], ex["after"][ex["mode"]]
        if b["mode"] == "serial":
            return "ops one after another on the CPU"
        busy = lambda e: "" if e.get("busy") is None else f", GPU busy {e['busy']:.0%}"  # noqa: E731
        return (f"{b['mode']}, {b['bound']}-bound{busy(b)} → "
                f"{'CUDA graph replay' if a['mode'] == 'graphed' else a['mode']}, {a['bound']}-bound{busy(a)}")

    def _speedup(self) -> float:
        return self.predicted_s_before / self.predicted_s_after if self.predicted_s_after else float("nan")

    def _floor(self) -> str:
        """The roofline floor, at the sustained GEMM rate too where that differs; said to be above
        the prediction when it is (the prediction then prices some node below the peak rates)."""
        ca = self.cost_after
        floor_s = ca["roofline_floor_ms"] / 1e3
        text = f"roofline floor {_ms(floor_s)} ms"
        if (ca.get("roofline_floor_sustained_ms") or 0) > 1.01 * ca["roofline_floor_ms"]:
            text += f" ({_ms(ca['roofline_floor_sustained_ms'] / 1e3)} at the sustained GEMM rate)"
        if self.predicted_s_after and floor_s > 1.0001 * self.predicted_s_after:
            text += " (above the prediction: the cost model prices some node faster than the profile's peak rates)"
        return text

    def applied(self) -> list[PassResult]:
        """The passes that changed the graph or planned something (applied, planned, reverted)."""
        return [p for p in self.passes if p.status in ("applied", "planned", "reverted")]

    def __repr__(self) -> str:
        acc = self.accuracy
        verdict = ("passed" if acc.get("passed") else "failed") if acc.get("checked") else "not checked"
        return (f"<Report {self.model} on {self.device} (profile {self.target}): predicted "
                f"{_ms(self.predicted_s_before)} → {_ms(self.predicted_s_after)} ms, "
                f"{len(self.applied())} of {len(self.passes)} passes applied, accuracy {verdict}>")

    def __str__(self) -> str:
        """A few lines for ``print(report)``; ``render()`` prints the full report."""
        acc = self.accuracy
        if acc.get("checked"):
            verdict = (f"{'passed' if acc['passed'] else 'FAILED'} (max |err| {acc.get('max_abs_err', 0):.3g}, "
                       f"rmse {acc.get('rmse', 0):.3g})")
        else:
            verdict = f"not checked ({acc.get('reason', '')})"
        done = ", ".join(f"{p.name} ({p.status}, {len(p.rewrites)} rewrite{'s' if len(p.rewrites) != 1 else ''})"
                         for p in self.applied()) or "none"
        mode = self._mode_words()
        return "\n".join([
            f"graphopt report: {self.model} on {self.device}, cost profile {self.target}, "
            f"captured with {self.capture.get('method')}, kernels: {self.kernel_backend}",
            f"predicted {_ms(self.predicted_s_before)} ms → {_ms(self.predicted_s_after)} ms per call "
            f"({self._speedup():.2f}×{'; ' + mode if mode else ''}); {self._floor()}",
            f"passes that changed the graph: {done}",
            f"accuracy vs fp64 reference: {verdict}",
            f"optimized in {self.optimize_seconds:.2f} s; report.render() for each pass, report.to_json() for everything",
        ])

    # ------------------------------------------------------------------ rendering

    def render(self, console=None, max_rejected: int = 8, max_rewrites: int = 6, verbose: bool = False) -> None:
        """Print the report. By default: the passes that changed the graph, each pass's rewrites
        per pattern and its refusals per reason, the predictions and the accuracy. ``verbose``:
        every pass in the table, the matched nodes of each rewrite (``max_rewrites`` per pattern),
        each refusal (``max_rejected`` per pass), the costliest nodes and every phase of
        optimize()'s time. Without a ``console``, a terminal's width, else 120 columns."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        console = console or default_console()
        console.print(
            f"[bold]graphopt explain[/bold] {self.model}  device [cyan]{self.device}[/cyan]  "
            f"cost profile [cyan]{self.target}[/cyan]  captured with {self.capture.get('method')}  "
            f"kernels: {self.kernel_backend}"
        )
        shown = self.passes if verbose else self.applied()
        style = {"applied": "green", "planned": "cyan", "reverted": "red", "skipped": "yellow", "disabled": "dim",
                 "unchanged": "dim"}
        if shown:
            table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
            timed = any("measured_ms" in p.details for p in shown)
            cols = [("pass", "left"), ("status", "left"), ("rewrites", "right"), ("rejected", "right"),
                    ("Δ predicted ms", "right")] + ([("Δ measured ms", "right")] if timed else []) + [
                    ("peak MB", "right"), ("took", "right")]
            for col, just in cols:
                table.add_column(col, justify=just, no_wrap=True)
            for p in shown:
                delta = (p.predicted_s_after - p.predicted_s_before) * 1e3
                row = [p.name, f"[{style.get(p.status, '')}]{p.status}[/]", str(len(p.rewrites)), str(len(p.rejected)),
                       "0" if delta == 0 else f"{delta:+.3f}".replace("-", "−")]
                if timed:
                    d = p.details
                    row.append(f"{d['measured_ms'] - d['measured_before_ms']:+.3f}".replace("-", "−")
                               if "measured_ms" in d else "—" if "not_timed" in d else "")
                row += [f"{p.peak_bytes_before / 1e6:.0f}→{p.peak_bytes_after / 1e6:.0f}", f"{p.seconds:.2f}s"]
                table.add_row(*row)
            console.print(table)
        rest = len(self.passes) - len(shown)
        if rest:
            console.print(f"{rest} other passes changed nothing (--verbose lists every pass)", style="dim")
        width = max((len(p.name) for p in self.passes), default=0)
        wrap_at = max(40, console.size.width - width - 2)
        for p in self.passes:
            first = True
            for text, line_style in self._pass_lines(p, verbose, max_rewrites, max_rejected):
                indent = "    " if text.startswith("    ") else ""
                for piece in textwrap.wrap(text, wrap_at, subsequent_indent=indent + "  ", break_on_hyphens=False):
                    console.print(Text.assemble((f"{p.name if first else '':<{width}}  ", "bold"),
                                                (piece, line_style)), soft_wrap=True)
                    first = False
            if p.details.get("checkpoint"):
                self._render_checkpoints(console, p.details)
        cb, ca = self.cost_before, self.cost_after
        share = ca.get("bound_share", {})
        mode = self._mode_words()
        console.print(
            f"[bold]predicted[/bold] {_ms(self.predicted_s_before)} ms → {_ms(self.predicted_s_after)} ms per call "
            f"({self._speedup():.2f}×" + (f"; {mode})" if mode else ")"))
        console.print(
            f"{self._floor()}   kernels {cb['kernel_launches']} → {ca['kernel_launches']}   "
            f"peak memory {_mb(cb['peak_memory_bytes'])} → {_mb(ca['peak_memory_bytes'])}"
        )
        console.print(
            "[bold]bottleneck[/bold] (share of predicted time after optimizing): "
            f"compute-bound {share.get('compute', 0):.0%}, memory-bound {share.get('memory', 0):.0%}, "
            f"launch-bound {share.get('launch', 0):.0%}"
        )
        if self.top_nodes and verbose:
            console.print("[bold]costliest nodes[/bold]: " + ", ".join(
                f"{t['node']} ({t['op']}, {t['ms']:.3f} ms, {t['bound']})" for t in self.top_nodes[:5]))
        acc = self.accuracy
        if acc.get("checked"):
            mark = "[green]passed[/green]" if acc["passed"] else "[red]FAILED[/red]"
            console.print(f"[bold]accuracy[/bold] vs fp64 reference: {mark} "
                          f"(max |err| {acc.get('max_abs_err', 0):.3g}, rmse {acc.get('rmse', 0):.3g}; "
                          f"checked {acc.get('mode', 'after each pass')})")
        else:
            console.print(f"[bold]accuracy[/bold] not checked: {acc.get('reason', '')}")
        if self.memory:
            console.print(f"[bold]set-up memory[/bold] {self.memory_summary()}")
        if self.speed and self.speed.get("measured"):
            s = self.speed
            line = (f"[bold]measured[/bold] captured graph {s.get('captured_ms') or 0:.3f} ms → after the passes "
                    f"{s.get('passes_ms') or 0:.3f} ms")
            if s.get("model_ms") is not None:
                line += (f"; the module {s.get('optimized_ms'):.3f} ms against the model as given "
                         f"{s.get('model_ms'):.3f} ms: calls run {'the model' if s.get('returned') == 'model' else 'the module'}")
            console.print(line + f" ({s.get('timing_s', 0):.1f} s of timing)")
        if self.measured:
            self._render_measured(console)
        if self.partition:
            self._render_partition(console)
        for note in self.notes:
            console.print(f"• {one_line(note)}")
        if self.optimize_phases:
            from .timing import format_phases

            console.print(f"optimized in {self.optimize_seconds:.2f} s: "
                          f"{format_phases(self.optimize_phases, limit=8 if verbose else 2)}")
        else:
            console.print(f"optimized in {self.optimize_seconds:.2f} s")

    @staticmethod
    def _pass_lines(p: PassResult, verbose: bool, max_rewrites: int, max_rejected: int,
                    max_reasons: int = 3) -> list[tuple[str, str]]:
        """(text, style) lines for one pass: its rewrites per pattern, its refusals per reason (most
        common first; verbose: each refusal, the nodes each rewrite matched and the gain the
        candidates were ranked by), its notes (those of a pass that did nothing and refused
        nothing only when verbose)."""
        out: list[tuple[str, str]] = []
        groups: dict[str, list] = {}
        for r in p.rewrites:
            groups.setdefault(r.pattern, []).append(r)
        for pattern, rs in groups.items():
            if not verbose:
                out.append((f"✓ {len(rs)} × {pattern}", ""))
                continue
            gain = sum(r.predicted_gain_s for r in rs)  # what ranking the candidates predicted, node by node
            sign = "−" if gain >= 0 else "+"
            out.append((f"✓ {len(rs)} × {pattern}  (ranked at {sign}{abs(gain) * 1e3:.3f} ms)", ""))
            for r in rs[:max_rewrites]:
                repl = ", ".join(r.replacement) if r.replacement else "(removed)"
                out.append((f"    {', '.join(r.matched)} → {repl}", "dim"))
            if len(rs) > max_rewrites:
                out.append((f"    … {len(rs) - max_rewrites} more", "dim"))
        if verbose:
            out += [(f"✗ {r.candidate}: {one_line(r.reason)}", "yellow") for r in p.rejected[:max_rejected]]
            if len(p.rejected) > max_rejected:
                out.append((f"✗ … {len(p.rejected) - max_rejected} more rejected (see --json)", "yellow"))
        else:
            reasons: dict[str, list[str]] = {}
            for r in p.rejected:
                reasons.setdefault(one_line(r.reason), []).append(r.candidate)
            ordered = sorted(reasons.items(), key=lambda kv: -len(kv[1]))
            for reason, cands in ordered[:max_reasons]:
                what = cands[0] if len(cands) == 1 else f"{len(cands)} candidates"
                out.append((f"✗ {what}: {reason}", "yellow"))
            if len(ordered) > max_reasons:
                n = sum(len(c) for _, c in ordered[max_reasons:])
                out.append((f"✗ … {n} more for {len(ordered) - max_reasons} other reasons (--verbose)", "yellow"))
        if p.status in ("applied", "planned", "reverted") or p.rejected or verbose:
            out += [(f"• {one_line(note)}", "") for note in p.notes]
        return out

    def _render_partition(self, console) -> None:
        """The stage table of partition_devices: per stage and per boundary."""
        from rich.table import Table

        plan = self.partition
        v = plan.get("virtual_stages", 1)
        t = Table(header_style="bold", title=f"partition: {len(plan['stages'])} stages"
                                             + (f" ({v} per device)" if v > 1 else "") + f", {plan['schedule']}, "
                                             f"{plan['microbatches']} micro-batch(es)"
                                             + (", training" if plan["training"] else ""))
        for col, just in (("stage", "right"), ("device", "left"), ("nodes", "right"), ("params", "right"),
                          ("param MB", "right"), ("predicted ms/mb", "right"), ("of which transfer", "right"),
                          ("memory MB", "right"), ("cap MB", "right"), ("MB out", "right")):
            t.add_column(col, justify=just, no_wrap=True)
        for s in plan["stages"]:
            t.add_row(str(s["stage"]), s["device"], str(s["nodes"]), str(s["parameters"]),
                      f"{s['parameter_bytes'] / 1e6:.1f}", f"{s['predicted_ms']:.3f}", f"{s['predicted_transfer_ms']:.3f}",
                      f"{s['predicted_memory_bytes'] / 1e6:.1f}", f"{s['memory_cap_bytes'] / 1e6:.0f}",
                      f"{s['bytes_out'] / 1e6:.2f}")
        console.print(t)
        for i, b in enumerate(plan["boundaries"]):
            console.print(f"  cut {i}|{i + 1} after {b['after_node']}: {b['bytes'] / 1e6:.3f} MB in "
                          f"{len(b['tensors'])} tensor(s) over {b['link']} ({b['transfer_ms']:.3f} ms)")
        for d in plan.get("devices") or []:
            console.print(f"  {d['device']}: stage(s) {', '.join(map(str, d['stages']))}, {d['predicted_ms']:.3f} ms per "
                          f"micro-batch, memory {d['predicted_memory_bytes'] / 1e6:.1f} MB (runtime reserve "
                          f"{d['runtime_reserve_bytes'] / 1e6:.1f}) of {d['memory_cap_bytes'] / 1e6:.0f} MB")
        formula = "(S-1)/(v·M+S-1)" if v > 1 else "(S-1)/(M+S-1)"
        console.print(f"  bubble {formula} = {plan['bubble_fraction']:.0%}; predicted step "
                      f"{plan['predicted_step_ms']:.3f} ms vs {plan['single_device_ms']:.3f} ms on one device "
                      f"({plan['predicted_speedup']:.2f}×)")

    def _render_checkpoints(self, console, d: dict, max_layers: int = 12) -> None:
        """insert_checkpoints: activation memory and peak before/after, the budget, per layer."""
        from rich.table import Table

        after = d.get("predicted_saved_bytes", d["baseline_saved_bytes"])
        console.print(
            f"  activation memory (saved for backward) {_mb(d['baseline_saved_bytes'])} → {_mb(after)}"
            f" (+{_mb(d.get('recompute_transient_bytes', 0))} while a region is recomputed), budget {_mb(d['budget_bytes'])}"
            f" ({d['budget']}); training step: activations {_mb(d['baseline_activation_bytes'])} → "
            f"{_mb(d.get('predicted_activation_bytes', d['baseline_activation_bytes']))}, peak "
            f"{_mb(d['baseline_peak_bytes'])} → {_mb(d.get('predicted_peak_bytes', d['baseline_peak_bytes']))}; "
            f"predicted extra time +{d.get('extra_ms', 0):.3f} ms in {d.get('regions', 0)} checkpointed region(s)")
        if str(d.get("backend", "")).startswith("aot"):
            console.print(f"  backend {d['backend']} (AOTAutograd graph rewrite, {d.get('aot_regions', 0)} region(s)): forward "
                          f"saves {_mb(d.get('aot_saved_bytes', 0))} in {d.get('aot_saved_values', 0)} values, backward "
                          f"reruns {d.get('aot_recomputed_ops', 0)} forward ops")
        elif d.get("backend") == "sac":
            console.print(f"  backend sac (torch.utils.checkpoint, selective policy): {d.get('backend_reason', '')}")
        rows = d.get("by_layer") or []
        if not rows:
            return
        table = Table(show_lines=False, header_style="bold", box=None, padding=(0, 1))
        for col in ("layer", "saved", "saved MB", "recomputed", "recomputed MB", "recomputed nodes"):
            table.add_column(col, justify="left" if col in ("layer", "recomputed nodes") else "right")
        for r in rows[:max_layers]:
            table.add_row(r["layer"], str(r["saved"]), f"{r['saved_bytes'] / 1e6:.1f}", str(r["recomputed"]),
                          f"{r['recomputed_bytes'] / 1e6:.1f}", ", ".join(r["recomputed_nodes"][:5]))
        console.print(table)
        if len(rows) > max_layers:
            console.print(f"  … {len(rows) - max_layers} more layers (see --json)", style="dim")

    def _render_measured(self, console, max_nodes: int = 20) -> None:
        """``explain --measure``: predicted vs measured, whole graph and per node, and the busy fraction."""
        from rich.table import Table

        m = self.measured
        f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        pct = lambda v: "n/a on CPU" if v is None and str(m.get("device", "")).startswith("cpu") else (  # noqa: E731
            "n/a" if v is None else f"{v:.0%}")
        err = lambda v: "" if v is None else f" ({v:+.0f}%)"  # noqa: E731
        rho = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        console.print(f"[bold]measured[/bold] on {m.get('device')} ({m.get('timing', '')}): "
                      f"before {f(m.get('before_ms'))} ms (predicted {f(m.get('predicted_before_ms'))}"
                      f"{err(m.get('error_before_pct'))}) → after {f(m.get('after_ms'))} ms "
                      f"(predicted {f(m.get('predicted_after_ms'))}{err(m.get('error_after_pct'))}, "
                      f"{m.get('execution_after', 'eager')}; the graph run eagerly {f(m.get('after_graph_ms'))} ms, "
                      f"predicted {f(m.get('predicted_after_graph_ms'))}{err(m.get('error_after_graph_pct'))})")
        loop = ""
        if m.get("busy_loop_after") is not None:
            loop = (f"; calls back to back: before {pct(m.get('busy_loop_before'))} → "
                    f"after {pct(m.get('busy_loop_after'))}")
        console.print(f"[bold]GPU busy[/bold] (kernel time / wall time): one call on an idle GPU: before "
                      f"{pct(m.get('busy_before'))} → after {pct(m.get('busy_after'))}{loop}   rank correlation over nodes (Spearman): before "
                      f"{rho(m.get('spearman_before'))}, after {rho(m.get('spearman_after'))}")
        nodes = m.get("nodes") or []
        if nodes:
            t = Table(header_style="bold", title="costliest nodes after optimizing: predicted vs measured")
            for col, just in (("node", "left"), ("op", "left"), ("bound", "left"), ("predicted ms", "right"),
                              ("measured ms", "right"), ("measured/predicted", "right")):
                t.add_column(col, justify=just, no_wrap=True)
            for r in nodes[:max_nodes]:
                ratio = r["measured_ms"] / r["predicted_ms"] if r.get("predicted_ms") else None
                t.add_row(r["node"], r["op"], r.get("bound", ""), f"{r['predicted_ms']:.4f}", f"{r['measured_ms']:.4f}",
                          "—" if ratio is None else f"{ratio:.2f}×")
            console.print(t)
        for note in m.get("notes") or []:
            console.print(f"  • {note}", style="dim")
