"""Where optimize() spends its time: wall time per phase (capture, fake propagation, cost model,
pass bodies, accuracy checks, lowering...).

``optimize`` activates a :class:`PhaseTimer`; code anywhere below it marks its own work with
``with timing.phase("fake propagation"):``, a no-op when no timer is active (a pass test, a
benchmark calling ``ir.repropagate`` directly). Phases nest and are *exclusive*: a phase's time
excludes the phases opened inside it, so the phases sum to the total and nothing is counted twice
(a pass body that re-propagates shapes is charged "passes" only for its own work).

:func:`progress` names each step as optimize() starts it (capture, the accuracy guard's reference
runs, pass i of n, a measurement on the device, lowering) on the ``graphopt.progress`` logger at
INFO: silent unless a handler is configured; the CLI shows it as a status line.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from typing import Iterator

PROGRESS = logging.getLogger("graphopt.progress")

_ACTIVE: contextvars.ContextVar["PhaseTimer | None"] = contextvars.ContextVar("graphopt_phase_timer", default=None)


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [name, seconds spent in phases nested in it]
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._stack.append([name, 0.0])
        try:
            yield
        finally:
            _, nested = self._stack.pop()
            dt = time.perf_counter() - t0
            self.seconds[name] = self.seconds.get(name, 0.0) + dt - nested
            if self._stack:
                self._stack[-1][1] += dt

    @contextlib.contextmanager
    def active(self) -> Iterator["PhaseTimer"]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def total(self) -> float:
        return time.perf_counter() - self._t0

    def as_dict(self, total: float | None = None) -> dict[str, float]:
        """Phases by time spent, largest first, with "other" (the unmarked rest) where a total is given."""
        out = dict(sorted(self.seconds.items(), key=lambda kv: -kv[1]))
        if total is not None:
            out["other"] = max(0.0, total - sum(self.seconds.values()))
        return out


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Charge the enclosed work to ``name`` in the active optimize()'s timer (if any)."""
    timer = _ACTIVE.get()
    if timer is None:
        yield
        return
    with timer.phase(name):
        yield


def progress(message: str, *args) -> None:
    """Announce the step starting now (``message % args``, formatted only if a handler takes it)."""
    PROGRESS.info(message, *args)


def format_phases(phases: dict[str, float], limit: int = 8) -> str:
    """``capture: torch.export 1.52 s, fake propagation 0.61 s, ...`` (largest first)."""
    items = [(k, v) for k, v in phases.items() if v >= 0.005]
    items.sort(key=lambda kv: -kv[1])
    shown = items[:limit]
    rest = sum(v for _, v in items[limit:])
    text = ", ".join(f"{k} {v:.2f} s" for k, v in shown)
    if rest:
        text += f", {len(items) - limit} more {rest:.2f} s"
    return text


def timed(name: str):
    """Decorator: charge every call of the function to phase ``name``."""
    import functools

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _ACTIVE.get() is None:
                return fn(*args, **kwargs)
            with phase(name):
                return fn(*args, **kwargs)

        return wrapper

    return deco
