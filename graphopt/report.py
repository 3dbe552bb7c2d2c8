"""The Report: what each pass did, predicted before/after, what was rejected and why.

``explain`` renders only these records (passes never print). ``to_json`` gives the stable
machine-readable form written by ``graphopt explain --json``.
"""

from __future__ import annotations

import json
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


@dataclass
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
        }

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.as_dict(), indent=indent, default=str)

    # ------------------------------------------------------------------ rendering

    def render(self, console=None, max_rejected: int = 8, max_rewrites: int = 6) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        speed = self.predicted_s_before / self.predicted_s_after if self.predicted_s_after else float("nan")
        console.print(
            f"[bold]graphopt explain[/bold] {self.model}  device [cyan]{self.device}[/cyan]  "
            f"cost profile [cyan]{self.target}[/cyan]  captured with {self.capture.get('method')}  "
            f"kernels: {self.kernel_backend}"
        )
        table = Table(show_lines=False, header_style="bold")
        for col, just in (("pass", "left"), ("status", "left"), ("rewrites", "right"), ("rejected", "right"),
                          ("predicted ms", "right"), ("peak MB", "right"), ("took", "right")):
            table.add_column(col, justify=just, no_wrap=True)
        style = {"applied": "green", "planned": "cyan", "reverted": "red", "skipped": "yellow", "disabled": "dim", "unchanged": "dim"}
        for p in self.passes:
            table.add_row(
                p.name, f"[{style.get(p.status, '')}]{p.status}[/]", str(len(p.rewrites)), str(len(p.rejected)),
                f"{_ms(p.predicted_s_before)}→{_ms(p.predicted_s_after)}",
                f"{p.peak_bytes_before / 1e6:.0f}→{p.peak_bytes_after / 1e6:.0f}",
                f"{p.seconds:.2f}s",
            )
        console.print(table)
        for p in self.passes:
            if not (p.rewrites or p.rejected or p.notes):
                continue
            console.print(f"[bold]{p.name}[/bold]")
            groups: dict[str, list] = {}
            for r in p.rewrites:
                groups.setdefault(r.pattern, []).append(r)
            for pattern, rs in groups.items():
                gain = sum(r.predicted_gain_s for r in rs)
                sign = "−" if gain >= 0 else "+"
                console.print(f"  ✓ {len(rs)} × {pattern}  (predicted {sign}{abs(gain) * 1e3:.3f} ms)")
                for r in rs[:max_rewrites]:
                    repl = ", ".join(r.replacement) if r.replacement else "(removed)"
                    console.print(f"      {', '.join(r.matched)} → {repl}", style="dim")
                if len(rs) > max_rewrites:
                    console.print(f"      … {len(rs) - max_rewrites} more", style="dim")
            for r in p.rejected[:max_rejected]:
                console.print(f"  ✗ {r.candidate}: {one_line(r.reason)}", style="yellow")
            if len(p.rejected) > max_rejected:
                console.print(f"  ✗ … {len(p.rejected) - max_rejected} more rejected (see --json)", style="yellow")
            for note in p.notes:
                console.print(f"  • {one_line(note)}")
            if p.details.get("checkpoint"):
                self._render_checkpoints(console, p.details)
        cb, ca = self.cost_before, self.cost_after
        share = ca.get("bound_share", {})
        ex = self.execution or {}
        how = ""
        if ex.get("before") and ex.get("mode") in ex.get("after", {}) and ex["before"]["mode"] != "serial":
            b, a = ex["before"], ex["after"][ex["mode"]]
            busy = lambda e: "" if e.get("busy") is None else f", GPU busy {e['busy']:.0%}"  # noqa: E731
            how = (f" ({b['mode']}, {b['bound']}-bound{busy(b)} → "
                   f"{'CUDA graph replay' if a['mode'] == 'graphed' else a['mode']}, {a['bound']}-bound{busy(a)})")
        console.print(
            f"[bold]predicted[/bold] {_ms(self.predicted_s_before)} ms → {_ms(self.predicted_s_after)} ms "
            f"({speed:.2f}×){how}   roofline floor {_ms(ca['roofline_floor_ms'] / 1e3)} ms"
            + (f" ({_ms(ca['roofline_floor_sustained_ms'] / 1e3)} at the sustained GEMM rate)"
               if (ca.get("roofline_floor_sustained_ms") or 0) > 1.01 * ca["roofline_floor_ms"] else "") + "   "
            f"kernels {cb['kernel_launches']} → {ca['kernel_launches']}   "
            f"peak memory {_mb(cb['peak_memory_bytes'])} → {_mb(ca['peak_memory_bytes'])}"
        )
        console.print(
            "[bold]bottleneck[/bold] (share of predicted time after optimizing): "
            f"compute-bound {share.get('compute', 0):.0%}, memory-bound {share.get('memory', 0):.0%}, "
            f"launch-bound {share.get('launch', 0):.0%}"
        )
        if self.top_nodes:
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
        if self.measured:
            self._render_measured(console)
        if self.partition:
            self._render_partition(console)
        for note in self.notes:
            console.print(f"• {one_line(note)}")
        if self.optimize_phases:
            from .timing import format_phases

            console.print(f"optimized in {self.optimize_seconds:.2f} s: {format_phases(self.optimize_phases)}")
        else:
            console.print(f"optimized in {self.optimize_seconds:.2f} s")

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
