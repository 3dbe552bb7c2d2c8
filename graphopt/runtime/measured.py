"""Timing on the device a module runs on, for optimize()'s measured guard.

:class:`Timer` times calls the way a caller sees them: on a GPU with CUDA events around each call
(the device idle before it, so host launch time counts as it does for one call), on the CPU with
``perf_counter``; the median over ``reps`` calls after ``warmup`` calls. :meth:`Timer.compare`
times two or more callables in interleaved rounds (a, b, a, b, ...), so a drift of the machine
(clock, another process) lands on all of them alike, and gives each one's median.

:func:`slower` is the guard's rule: a candidate is slower than a baseline when its median exceeds
the baseline's by more than ``margin`` (2%: the run-to-run spread of one call on an idle GPU).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

MARGIN = 0.02


@dataclass
class Timing:
    median_s: float
    samples: list = field(default_factory=list)

    @property
    def spread(self) -> float:
        """(max - min) / median over the samples: how noisy this measurement was."""
        if not self.samples or self.median_s <= 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.median_s

    def as_dict(self) -> dict:
        return {"median_ms": self.median_s * 1e3, "reps": len(self.samples), "spread": self.spread}


def slower(candidate: Timing, baseline: Timing, margin: float = MARGIN) -> bool:
    return candidate.median_s > baseline.median_s * (1.0 + margin)


class Timer:
    """Times calls on ``device``. ``reps`` adapts to the call's length: at least ``min_reps``,
    and as many more as fit in ``target_s`` per measurement, at most ``max_reps``."""

    def __init__(self, device: torch.device | str, *, warmup: int = 2, min_reps: int = 5, max_reps: int = 25,
                 target_s: float = 0.25):
        self.device = torch.device(device)
        self.warmup, self.min_reps, self.max_reps, self.target_s = warmup, min_reps, max_reps, target_s
        self.spent_s = 0.0  # wall time spent timing (warm-up included)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _once(self, fn) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._sync()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def _reps(self, first_s: float) -> int:
        if first_s <= 0:
            return self.max_reps
        return int(min(self.max_reps, max(self.min_reps, self.target_s // first_s)))

    def time(self, fn) -> Timing:
        return self.compare(fn)[0]

    def compare(self, *fns) -> list[Timing]:
        """Each callable's median over interleaved rounds (warm-up calls first, untimed)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for fn in fns:
                for _ in range(self.warmup):
                    fn()
            first = [self._once(fn) for fn in fns]
            reps = self._reps(max(first))
            samples = [[f] for f in first]
            for _ in range(reps - 1):
                for i, fn in enumerate(fns):
                    samples[i].append(self._once(fn))
        self._sync()
        self.spent_s += time.perf_counter() - t0
        return [Timing(statistics.median(s), s) for s in samples]
