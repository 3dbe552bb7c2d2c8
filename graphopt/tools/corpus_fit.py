"""The fit of ``graphopt calibrate --corpus``, from the corpus's records alone (no graph, no device).

Records (:class:`Corpus`, saved as the samples file the command writes beside its results, read
back by ``--refit``): the base profile; one :class:`Shape` per deduplicated op shape (its class
path, op and uncorrected predicted time); per timed graph (:class:`RunRecord`) its steps in order as
the cost model's queue sees them (graphopt.cost.model.queue_inputs: host and device seconds,
launches, host sync, left after a replay; a classed node's shape and measured time alone) with
its copies in and out and its measured whole call. A whole call under any class fit is replayed
from them through the cost model's own queue (graphopt.cost.model.queue_cost), so the fit and its
validation need only the records, and a refit gives what the device run gave.

The fit (:func:`fit_op_classes`), per class path prefix with at least ``min_samples`` shapes, parents
first: ln(measured / predicted) against ln(predicted seconds), piecewise linear (:func:`fit_curve`),
fitted as a change to what the class would otherwise get (its nearest kept ancestor's curve, or
none) and shrunk toward that by its signal to noise (a correction fitted on few or noisy shapes
moves less); a class the model prices at nothing gets a fixed time per node, shrunk alike. A
correction is kept only where it lowers the class's error cross-validated by config (folds of the
fitted configs; each held-out config's error the time-weighted mean |ln(predicted / measured)| of
its nodes of the class, predicted by the fit of the other folds) by ``MIN_GAIN`` of it and at least
``MIN_GAIN_ABS``; else the
class falls back to its parent's, and the decision says why. No class below a memory-layout fork
(:func:`_layout_forks`) is fitted. The stream terms (whole call ~
factor * corrected nodes + seconds per corrected node: :func:`fit_stream`) are cross-validated the
same way on whole calls and kept only where they lower that error. The replay rule
(:func:`fit_replay_rule`; graphopt.cost.opclass.REPLAY_RULES) says what a correction does to a
node's device time inside a CUDA-graph replay, chosen the same way on replayed whole calls.

Where the corpus timed each node's host issue and device time apart (a GPU: the steps' ``host_m``
and ``device_m``), the fit is split (:func:`fit_split`): a device factor per class against the
device time alone and a host correction per class and op against the host issue time, each
decided as above over the same folds; the device factor applies as is in a replay.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from ..cost.model import QueueInputs, QueueStep, queue_cost
from ..cost.opclass import (CHANNELS_LAST, REPLAY_RULES, SEP, class_correction, class_name, corrected_times,
                            covers, curve_log_factor, host_path, is_split, lookup, replay_rule, split_correction,
                            split_times)
from ..cost.profiles import DeviceProfile
from ..errors import CorpusFileError, GraphoptError

FORMAT = "graphopt calibrate --corpus samples"
VERSION = 1
MIN_SAMPLES = 8
PER_KNOT = 8
MAX_KNOTS = 5
MAX_FOLDS = 10  # folds of the fitted configs for cross-validation (one config per fold up to this many)
# the cut in cross-validated error a correction must bring to be kept: this share of the error, and at
# least MIN_GAIN_ABS (in ln: a change within the timing noise is none)
MIN_GAIN = 0.02
MIN_GAIN_ABS = 0.005
NOISE_FLOOR = 0.05  # the least spread (ln) of a class's points around its curve: timing noise
DIGITS = 6  # significant digits of the seconds a samples file keeps


# ------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Shape:
    """One deduplicated op shape: its class path, op, and uncorrected predicted time (NodeCost's
    ``time_s``: what a class fit is read at)."""

    cls: tuple
    op: str
    time_s: float


class Step(NamedTuple):
    """One step of a timed graph (graphopt.cost.model.QueueStep, uncorrected): the shape of a
    classed node (-1: none) and its measured time alone (None: not timed): its loop time
    (``measured_s``) and, where the corpus timed them (a GPU), its host issue time (``host_m``)
    and its device time queued behind a GPU sleep (``device_m``)."""

    shape: int
    host_s: float
    device_s: float
    launches: int
    sync: bool
    tail: bool
    measured_s: float | None
    host_m: float | None = None
    device_m: float | None = None


@dataclass
class RunRecord:
    """One timed graph: its config, source ("captured" | "optimized"), whether it was held out,
    how its calls ran ("eager" | "graphed"), its measured whole call, steps and replay copies."""

    config: str
    source: str
    held_out: bool
    execution: str
    whole_s: float | None
    steps: list
    copies_in: list = field(default_factory=list)
    copies_out: list = field(default_factory=list)


@dataclass
class Corpus:
    """What a corpus run measured, all a fit and its validation need."""

    profile: DeviceProfile  # the base profile (no op class fit)
    shapes: list
    runs: list
    info: dict = field(default_factory=dict)  # configs, held out, device, dtype, timing, errors...
    header: dict = field(default_factory=dict)  # the measuring run's environment (graphopt.tools.bench)
    command: str = ""

    def to_dict(self) -> dict:
        classes, ops = {}, {}
        shapes = [[classes.setdefault(class_name(s.cls), len(classes)), ops.setdefault(s.op, len(ops)), _r(s.time_s)]
                  for s in self.shapes]
        runs = [{"config": r.config, "source": r.source, "held_out": r.held_out, "execution": r.execution,
                 "whole_s": None if r.whole_s is None else _r(r.whole_s),
                 "copies_in": [[_r(h), _r(d)] for h, d in r.copies_in],
                 "copies_out": [[_r(h), _r(d)] for h, d in r.copies_out],
                 "steps": [_step_row(s) for s in r.steps]}
                for r in self.runs]
        return {"format": FORMAT, "version": VERSION, "command": self.command, "header": self.header,
                "corpus": self.info, "profile": replace(self.profile, op_class_fit={}).to_dict(),
                "classes": list(classes), "ops": list(ops), "shapes": shapes, "runs": runs}

    @classmethod
    def from_dict(cls, d: dict, where: str = "the samples") -> "Corpus":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CorpusFileError(f"{where} is not a corpus samples file (written by graphopt calibrate --corpus)")
        if d.get("version") != VERSION:
            raise CorpusFileError(f"{where} is a version {d.get('version')!r} samples file; this graphopt reads "
                                  f"version {VERSION}")
        try:
            profile = DeviceProfile.from_dict(d["profile"])
            names, ops = [str(c) for c in d["classes"]], [str(o) for o in d["ops"]]
            shapes = [Shape(tuple(names[_index(c, len(names), "class")].split(SEP)), ops[_index(o, len(ops), "op")],
                            _seconds(t, "a shape's predicted time")) for c, o, t in d["shapes"]]
            runs = []
            for r in d["runs"]:
                steps = [_step(row, len(shapes)) for row in r["steps"]]
                whole = r["whole_s"]
                runs.append(RunRecord(str(r["config"]), str(r["source"]), bool(r["held_out"]), str(r["execution"]),
                                      None if whole is None else _seconds(whole, "a whole call"), steps,
                                      [(_seconds(h, "a copy"), _seconds(dv, "a copy")) for h, dv in r["copies_in"]],
                                      [(_seconds(h, "a copy"), _seconds(dv, "a copy")) for h, dv in r["copies_out"]]))
                if runs[-1].execution not in ("eager", "graphed"):
                    raise ValueError(f"execution {runs[-1].execution!r}")
            info, header = dict(d.get("corpus") or {}), dict(d.get("header") or {})
        except CorpusFileError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else (str(e).splitlines()[0] if str(e) else
                                                                         type(e).__name__)
            raise CorpusFileError(f"{where} is corrupt: {what}") from None
        return cls(profile, shapes, runs, info, header, str(d.get("command") or ""))

    def save(self, path) -> Path:
        """Write the records as JSON (gzip-compressed where the name ends in .gz)."""
        path = Path(path)
        data = json.dumps(self.to_dict(), separators=(",", ":"), default=str).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
        except OSError as e:
            raise GraphoptError(f"cannot write {path}: {e.strerror or e}") from None
        return path

    @classmethod
    def load(cls, path) -> "Corpus":
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CorpusFileError(f"cannot read samples file {path}: {e.strerror or e}") from None
        try:
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            d = json.loads(raw.decode())
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorpusFileError(f"{path} is not a corpus samples file (not gzip'd JSON: "
                                  f"{str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None
        return cls.from_dict(d, str(path))


def _r(v: float) -> float:
    return float(f"{float(v):.{DIGITS}g}")


def _opt(v):
    return None if v is None else _r(v)


def _step_row(s: Step) -> list:
    """A step as the samples file keeps it: [shape, host, device, launches, flags, measured]
    and, where measured, [measured host, measured device]."""
    row = [s.shape, _r(s.host_s), _r(s.device_s), s.launches, int(s.sync) | 2 * int(s.tail), _opt(s.measured_s)]
    if s.host_m is not None or s.device_m is not None:
        row += [_opt(s.host_m), _opt(s.device_m)]
    return row


def _step(row, shapes: int) -> Step:
    if len(row) not in (6, 8):
        raise ValueError(f"a step of {len(row)} fields")
    s, h, dv, n, f, m = row[:6]
    hm, dm = row[6:] if len(row) == 8 else (None, None)
    seconds = lambda v, what: None if v is None else _seconds(v, what)  # noqa: E731
    return Step(_index(s, shapes, "shape", -1), _seconds(h, "host time"), _seconds(dv, "device time"), int(n),
                bool(f & 1), bool(f & 2), seconds(m, "a measured time"), seconds(hm, "a measured host time"),
                seconds(dm, "a measured device time"))


def _index(v, n: int, what: str, low: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v < n:
        raise ValueError(f"{what} index {v!r} out of range")
    return v


def _seconds(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} of {v!r} seconds")
    return float(v)


def loop_s(kind: str, host: float, dev: float) -> float:
    """A node's predicted time run back to back (CostModel.node_loop_s): host + device on a CPU,
    the longer of the two on a GPU."""
    return host + dev if kind == "cpu" else max(host, dev)


class _Corrections:
    """A class fit's correction of each shape, looked up once per shape (a split fit's once per
    shape and uncorrected times)."""

    def __init__(self, fit: dict, shapes: list):
        self.fit, self.shapes, self.memo = fit, shapes, {}
        self.replay = replay_rule(fit)
        self.split = is_split(fit)

    def times(self, s: Step, replay: str | None = None) -> tuple[float, float]:
        """(host, device) seconds of step ``s`` under the fit, as CostModel.node_times gives them
        (``replay``: the combined fit's rule inside a CUDA-graph replay; a split fit's device
        factor applies as is)."""
        if s.shape < 0:
            return s.host_s, s.device_s
        if self.split:
            key = (s.shape, s.host_s, s.device_s)
            c = self.memo.get(key)
            if c is None:
                sh = self.shapes[s.shape]
                c = self.memo[key] = split_correction(self.fit, sh.cls, s.host_s, s.device_s, sh.op)
            return split_times(c, s.host_s, s.device_s)
        return corrected_times(self(s.shape), s.host_s, s.device_s, replay)

    def __call__(self, shape: int) -> tuple:
        c = self.memo.get(shape)
        if c is None:
            s = self.shapes[shape]
            c = self.memo[shape] = class_correction(self.fit, s.cls, s.time_s) if self.fit else (1.0, 0.0, None)
        return c

    def entry(self, shape: int) -> tuple:
        s = self.shapes[shape]
        return lookup(self.fit, s.cls, s.time_s) if self.fit else (None, None)

    def split_entry(self, s: Step, key: str) -> tuple:
        """(class name, entry) of a split fit's ``key`` table ("device_classes" / "host_classes")
        that corrects step ``s``."""
        sh = self.shapes[s.shape]
        if key == "host_classes":
            return lookup(self.fit, host_path(sh.cls, sh.op), s.host_s, key) if s.host_s > 0 else (None, None)
        return lookup(self.fit, sh.cls, s.device_s, key) if s.device_s > 0 else (None, None)


def predicted_whole(corpus: Corpus, run: RunRecord, corr: _Corrections) -> float:
    """The predicted whole call of ``run`` under a class fit: its steps corrected as
    CostModel.node_times corrects them, through the cost model's queue."""
    steps = []
    replay = corr.replay if run.execution == "graphed" and corpus.profile.kind != "cpu" else None
    for s in run.steps:
        h, d = corr.times(s, None if s.tail else replay)
        steps.append(QueueStep(s.shape, h, d, s.launches, s.sync, s.tail))
    return float(queue_cost(corpus.profile, QueueInputs(run.execution, steps, run.copies_in, run.copies_out)).total_s)


def predicted_nodes(corpus: Corpus, run: RunRecord, corr: _Corrections) -> list[tuple[int, float, float]]:
    """(shape, predicted seconds alone, measured seconds) of each timed classed node of ``run``."""
    kind, out = corpus.profile.kind, []
    for s in run.steps:
        if s.shape >= 0 and s.measured_s is not None:
            h, d = corr.times(s)
            out.append((s.shape, loop_s(kind, h, d), s.measured_s))
    return out


def _curve_nodes(run: RunRecord, corr: _Corrections) -> int:
    """How many of a run's nodes a curve of the fit corrects (a split fit: a host curve, where
    the stream's seconds per node go)."""
    n = 0
    for s in run.steps:
        if corr.split:
            n += s.shape >= 0 and corr.split_entry(s, "host_classes")[1] is not None
        elif s.shape >= 0 and corr.shapes[s.shape].time_s > 0:
            _, entry = corr.entry(s.shape)
            n += entry is not None and bool(entry.get("knots"))
    return n


# ------------------------------------------------------------------------------------ samples


@dataclass
class Sample:
    """One deduplicated op shape of the fitted configs: its class, the uncorrected prediction
    (``predicted_s``: the node's NodeCost time; ``predicted_loop_s``: CostModel.node_loop_s, what
    the node's time alone is compared with), and its measurements, each with its config."""

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

    def by_config(self, configs=None) -> dict:
        """{config: its measurements} (only ``configs`` where given)."""
        out: dict[str, list] = {}
        for m, c in zip(self.measured, self.configs):
            if configs is None or c in configs:
                out.setdefault(c, []).append(m)
        return out

    def as_dict(self) -> dict:
        return {"key": self.key, "class": class_name(self.cls), "op": self.op, "predicted_s": self.predicted_s,
                "predicted_loop_s": self.predicted_loop_s, "measured_s": self.measured_s, "count": len(self.measured),
                "configs": sorted(set(self.configs))}


def _fitted_steps(corpus: Corpus):
    """(run, step) for every classed step (a shape of the corpus) of the fitted (not held-out) runs."""
    for r in corpus.runs:
        if not r.held_out:
            for s in r.steps:
                if s.shape >= 0:
                    yield r, s


def training_samples(corpus: Corpus) -> list[Sample]:
    """The timed classed nodes of the fitted (not held-out) runs, one Sample per shape."""
    kind, by = corpus.profile.kind, {}
    for r, s in _fitted_steps(corpus):
        if s.measured_s is not None:
            smp = by.get(s.shape)
            if smp is None:
                sh = corpus.shapes[s.shape]
                smp = by[s.shape] = Sample(str(s.shape), sh.cls, sh.op, sh.time_s, loop_s(kind, s.host_s, s.device_s))
            smp.measured.append(s.measured_s)
            smp.configs.append(r.config)
    return list(by.values())


# GPU time a node's device-time loop is queued behind, per call (graphopt.tools.measure._NodeTimer's
# sleep: ~0.1 ms): a node whose host issue takes longer may have left the device waiting, so its
# device time is not used
DEVICE_COVERED_HOST_S = 8e-5


def device_usable(s: Step) -> bool:
    """Does step ``s`` give a device sample: a measured device time of a node that launches a
    kernel priced above 0, whose host issue did not outrun the sleep its device loop waited
    behind."""
    return (s.device_m is not None and s.device_m > 0 and s.device_s > 0 and bool(s.launches)
            and s.host_m is not None and s.host_m <= DEVICE_COVERED_HOST_S)


def host_usable(s: Step) -> bool:
    """Does step ``s`` give a host sample: a measured host issue time of a node priced some host
    time that does not wait for the device."""
    return s.host_m is not None and s.host_m > 0 and s.host_s > 0 and not s.sync


def has_split(corpus: Corpus) -> bool:
    """Did the corpus time its nodes' host issue and device time apart (a GPU corpus written
    since the samples file has those fields)?"""
    return corpus.profile.kind != "cpu" and any(
        s.host_m is not None for r in corpus.runs if not r.held_out for s in r.steps)


def split_samples(corpus: Corpus) -> tuple[list[Sample], list[Sample]]:
    """The timed classed nodes of the fitted runs, one Sample per shape, for the split fit: device
    (predicted: the uncorrected device time; measured: the device time alone; nodes priced at no
    device time, and those whose host issue outran the sleep the device loop waits behind, left
    out) and host (class path and op: graphopt.cost.opclass.host_path; predicted: the uncorrected
    host time; measured: the host issue time; ops that make the host wait for the device left
    out)."""
    dev: dict[int, Sample] = {}
    host: dict[int, Sample] = {}
    for r, s in _fitted_steps(corpus):
        if s.host_m is None:
            continue
        sh = corpus.shapes[s.shape]
        if device_usable(s):
            smp = dev.get(s.shape) or dev.setdefault(s.shape, Sample(str(s.shape), sh.cls, sh.op, s.device_s,
                                                                     s.device_s))
            smp.measured.append(s.device_m)
            smp.configs.append(r.config)
        if host_usable(s):
            smp = host.get(s.shape) or host.setdefault(s.shape, Sample(str(s.shape), host_path(sh.cls, sh.op),
                                                                       sh.op, s.host_s, s.host_s))
            smp.measured.append(s.host_m)
            smp.configs.append(r.config)
    return list(dev.values()), list(host.values())


# ------------------------------------------------------------------------------------ curves


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


def _spread(residuals) -> float:
    r = list(residuals)
    med = statistics.median(r)
    return max(NOISE_FLOOR, 1.4826 * statistics.median(abs(x - med) for x in r))


def _shrink(mean_sq: float, sigma: float, n: int) -> float:
    """The share of a fitted change kept: its mean square against the variance of its level
    (sigma^2 / n): a change fitted on few or noisy points moves less."""
    return mean_sq / (mean_sq + sigma * sigma / n) if mean_sq > 0 else 0.0


def _curve_entry(xs, ys, base, *, per_knot: int, max_knots: int) -> dict:
    """A class's curve: the change from ``base`` (x -> the ln factor the class gets without its
    own fit) fitted on (xs, ys), shrunk (:func:`_shrink`), added to ``base`` at its knots."""
    offs = [base(x) for x in xs]
    d = fit_curve(xs, [y - o for y, o in zip(ys, offs)], min(max_knots, 1 + len(xs) // per_knot))
    change = [curve_log_factor(d, x) for x in xs]
    sigma = _spread(y - o - c for y, o, c in zip(ys, offs, change))
    shrink = _shrink(sum(c * c for c in change) / len(change), sigma, len(xs))
    return {"knots": d["knots"], "log_factor": [base(k) + shrink * v for k, v in zip(d["knots"], d["log_factor"])],
            "range": [min(xs), max(xs)], "n": len(xs), "shrink": shrink}


def _fixed_entry(ms, base: float) -> dict:
    """A fixed time per node: the median of ``ms``, shrunk toward ``base`` alike."""
    med = statistics.median(ms)
    sigma = 1.4826 * statistics.median(abs(m - med) for m in ms) or 1e-12
    shrink = _shrink((med - base) ** 2, sigma, len(ms))
    return {"fixed_s": base + shrink * (med - base), "n_fixed": len(ms), "shrink_fixed": shrink}


# ------------------------------------------------------------------------------------ the class fit


@dataclass
class ClassFit:
    """The kept class fits (``classes``), every candidate's decision (``decisions``: class ->
    {"kind", "kept", "reason", "n", "configs", "cv_without", "cv_with"}), and, per fold of
    ``folds`` (sets of configs), the kept classes as fitted without that fold. A split fit
    (``host`` set) holds the device factors here and the host corrections in ``host``, both over
    the same folds."""

    classes: dict
    decisions: dict
    folds: list
    fold_classes: list
    host: "ClassFit | None" = None

    @property
    def empty(self) -> bool:
        return not self.classes and not (self.host is not None and self.host.classes)

    def fit_dict(self, fold: int | None = None) -> dict:
        """The profile's op class fit tables of the fit (``fold``: as fitted without that fold)."""
        pick = lambda f: f.classes if fold is None else f.fold_classes[fold]  # noqa: E731
        if self.host is None:
            return {"classes": pick(self)}
        return {"device_classes": pick(self), "host_classes": pick(self.host)}


def _folds(configs, max_folds: int) -> list[set]:
    configs = sorted(configs)
    k = min(len(configs), max_folds)
    return [set(configs[i::k]) for i in range(k)] if k >= 2 else []


def _ancestors(path: tuple):
    for i in range(len(path) - 1, 0, -1):
        yield class_name(path[:i])


def _base_curve(kept: dict, path: tuple):
    """x -> the ln factor a node of ``path`` gets from its nearest kept strict ancestor whose
    curve covers it (0: none)."""
    def base(x: float) -> float:
        for name in _ancestors(path):
            e = kept.get(name)
            if e is not None and e.get("knots") and covers(e, math.exp(x)):
                return curve_log_factor(e, x)
        return 0.0
    return base


def _base_fixed(kept: dict, path: tuple) -> float:
    for name in _ancestors(path):
        e = kept.get(name)
        if e is not None and e.get("fixed_s") is not None:
            return e["fixed_s"]
    return 0.0


def _fallback_name(kept: dict, path: tuple, kind: str) -> str:
    for name in _ancestors(path):
        e = kept.get(name)
        if e is not None and (e.get("knots") if kind == "curve" else e.get("fixed_s") is not None):
            return name
    return "no correction"


def _better(with_: float, without: float) -> bool:
    """Does a cross-validated error ``with_`` improve on ``without`` by the margins of MIN_GAIN?"""
    return with_ < without - max(MIN_GAIN * without, MIN_GAIN_ABS)


def _curve_error(items, predict) -> float:
    """Time-weighted mean |ln(predicted / measured)| of (x, y, weight) items."""
    return sum(w * abs(y - predict(x)) for x, y, w in items) / sum(w for _, _, w in items)


def _fixed_error(items, pred: float) -> float:
    """sum |predicted - measured| / sum measured over (measured, count) items."""
    return sum(c * abs(pred - m) for m, c in items) / sum(c * m for m, c in items)


def _own_curve(entry: dict | None, base):
    if entry is None:
        return base
    return lambda x: curve_log_factor(entry, x) if covers(entry, math.exp(x)) else base(x)


def _layout_forks(paths) -> set:
    """The class paths whose next tag is a memory layout the layout pass chooses between: those
    with a channels_last child ("conv/bf16/dense" over its "cl" and "nchw" children). A correction
    below such a fork would price one layout apart from the other from nodes timed alone in
    different graphs; what choosing a layout costs and enables (the conversions, the fusions a
    layout allows) is not in those timings, so corrections stop at the fork."""
    return {p[:-1] for p in paths if len(p) > 1 and p[-1] == CHANNELS_LAST}


def fit_op_classes(samples, *, min_samples: int = MIN_SAMPLES, per_knot: int = PER_KNOT,
                   max_knots: int = MAX_KNOTS, max_folds: int = MAX_FOLDS, configs=None) -> ClassFit:
    """The class fits of ``samples`` (see the module docstring): candidates are the class path
    prefixes with at least ``min_samples`` shapes, decided parents first; the folds are the
    samples' configs (at most ``max_folds``: configs dealt round-robin in sorted order), and a
    fold's fit of a class needs ``min_samples`` less the share a fold holds out. A sample the model
    prices at nothing (NodeCost 0 and node_loop_s 0) counts toward its class's fixed time; one
    with a zero NodeCost but a host time (a view on a GPU) is left out. ``configs``: the configs
    the folds are dealt from (default: the samples'), so that two fits share their folds."""
    curves: dict[tuple, list] = {}
    zeros: dict[tuple, list] = {}
    fixed_configs = configs is not None
    configs = set(configs or ())
    for s in samples:
        if s.measured_s <= 0:
            continue
        if not fixed_configs:
            configs.update(s.configs)
        if s.predicted_s > 0 and s.predicted_loop_s > 0:
            into = curves
        elif s.predicted_s == 0 and s.predicted_loop_s == 0:
            into = zeros
        else:
            continue
        for i in range(1, len(s.cls) + 1):
            into.setdefault(s.cls[:i], []).append(s)
    folds = _folds(configs, max_folds)
    # the shapes a fold's fit needs: min_samples less the share a fold holds out
    fold_min = max(2, math.ceil(min_samples * (len(folds) - 1) / len(folds))) if folds else min_samples
    kept: dict[str, dict] = {}
    fold_kept: list[dict] = [{} for _ in folds]
    decisions: dict[str, dict] = {}
    order = sorted({(p, "curve") for p, v in curves.items() if len(v) >= min_samples}
                   | {(p, "fixed") for p, v in zeros.items() if len(v) >= min_samples},
                   key=lambda pk: (len(pk[0]), class_name(pk[0]), pk[1]))
    layout_forks = _layout_forks(set(curves) | set(zeros))
    for path, kind in order:
        name = class_name(path)
        group = curves[path] if kind == "curve" else zeros[path]
        seen = sorted({c for s in group for c in s.configs})
        decision = {"kind": kind, "n": len(group), "configs": len(seen), "cv_without": None, "cv_with": None}
        decisions[name if kind == "curve" else f"{name} (fixed)"] = decision
        fallback = _fallback_name(kept, path, kind)
        fork = next((path[:i] for i in range(1, len(path)) if path[:i] in layout_forks), None)
        if fork is not None:
            decision.update(kept=False, reason=f"one memory layout of {class_name(fork)}: a correction per layout "
                                               f"would move the layout pass's choice, which nodes timed alone do not "
                                               f"measure; uses {fallback}")
            continue
        if len(seen) < 2 or not folds:
            decision.update(kept=False, reason=f"measured in {len(seen)} config{'s' if len(seen) != 1 else ''} "
                                               f"only: a fit cannot be checked across configs; uses {fallback}")
            continue
        fold_entries, without, with_ = [], [], []
        for fold, fk in zip(folds, fold_kept):
            train = [(s, ms) for s in group
                     if (ms := [m for c, v in s.by_config().items() if c not in fold for m in v])]
            by_cfg: dict[str, list] = {}
            for s in group:
                for c, v in s.by_config(fold).items():
                    by_cfg.setdefault(c, []).append((s, v))
            if kind == "curve":
                base = _base_curve(fk, path)
                entry = None
                if len(train) >= fold_min:
                    entry = _curve_entry([math.log(s.predicted_s) for s, _ in train],
                                         [math.log(statistics.median(ms) / s.predicted_loop_s) for s, ms in train],
                                         base, per_knot=per_knot, max_knots=max_knots)
                own = _own_curve(entry, base)
                for items in by_cfg.values():
                    pts = [(math.log(s.predicted_s), math.log(statistics.median(v) / s.predicted_loop_s), sum(v))
                           for s, v in items]
                    without.append(_curve_error(pts, base))
                    with_.append(_curve_error(pts, own))
            else:
                base_s = _base_fixed(fk, path)
                entry = _fixed_entry([statistics.median(ms) for _, ms in train], base_s) if (
                    len(train) >= fold_min) else None
                for items in by_cfg.values():
                    pts = [(statistics.median(v), len(v)) for _, v in items]
                    without.append(_fixed_error(pts, base_s))
                    with_.append(_fixed_error(pts, entry["fixed_s"] if entry else base_s))
            fold_entries.append(entry)
        cv_without, cv_with = statistics.fmean(without), statistics.fmean(with_)
        decision.update(cv_without=cv_without, cv_with=cv_with, folds=len(without))
        if not _better(cv_with, cv_without):
            how = ("worse: the fit does not generalize across configs" if _better(cv_without, cv_with) else
                   f"no better than without it (a kept fit cuts it by {MIN_GAIN:.0%}, at least {MIN_GAIN_ABS})")
            decision.update(kept=False, reason=f"cross-validated error {cv_without:.3f} -> {cv_with:.3f} over "
                                               f"{len(without)} held-out config(s), {how}; uses {fallback}")
            continue
        decision.update(kept=True, reason=f"cross-validated error {cv_without:.3f} -> {cv_with:.3f} over "
                                          f"{len(without)} held-out config(s) (without it: {fallback})")
        if kind == "curve":
            pts = [(math.log(s.predicted_s), math.log(s.measured_s / s.predicted_loop_s)) for s in group]
            base = _base_curve(kept, path)
            entry = _curve_entry([x for x, _ in pts], [y for _, y in pts], base, per_knot=per_knot,
                                 max_knots=max_knots)
            entry["abs_log_error_before"] = statistics.median(abs(y) for _, y in pts)
            entry["abs_log_error_after"] = statistics.median(abs(y - curve_log_factor(entry, x)) for x, y in pts)
            entry["cv"] = [cv_without, cv_with]
        else:
            entry = _fixed_entry([s.measured_s for s in group], _base_fixed(kept, path))
            entry["cv_fixed"] = [cv_without, cv_with]
        kept.setdefault(name, {"n": 0}).update(entry)
        for fk, fe in zip(fold_kept, fold_entries):
            if fe is not None:
                fk.setdefault(name, {"n": 0}).update(fe)
    return ClassFit(kept, decisions, folds, fold_kept)


# ------------------------------------------------------------------------------------ stream terms


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


def with_stream(classes: dict, factor: float, add_s: float) -> dict:
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


def with_stream_fit(fit: dict, factor: float, add_s: float) -> dict:
    """An op class fit with the stream terms folded in: a combined fit's classes as
    :func:`with_stream`; a split fit's device curves times ``factor``, ``add_s`` on every host
    curve."""
    if not is_split(fit):
        return dict(fit, classes=with_stream(fit.get("classes") or {}, factor, add_s))
    dev = {k: dict(e, log_factor=[v + math.log(factor) for v in e["log_factor"]]) if "log_factor" in e else dict(e)
           for k, e in (fit.get("device_classes") or {}).items()}
    host = {k: dict(e, add_s=add_s) if "log_factor" in e else dict(e)
            for k, e in (fit.get("host_classes") or {}).items()}
    return dict(fit, device_classes=dev, host_classes=host)


def without_stream(fit: dict) -> dict:
    """A profile's op class fit with its stream terms taken out (each node alone)."""
    stream = fit.get("stream") or {}
    factor = stream.get("factor", 1.0) or 1.0
    if is_split(fit):
        dev = {k: dict(e, log_factor=[v - math.log(factor) for v in e["log_factor"]]) if "log_factor" in e else
               dict(e) for k, e in (fit.get("device_classes") or {}).items()}
        host = {k: {f: v for f, v in e.items() if f != "add_s"} for k, e in (fit.get("host_classes") or {}).items()}
        return {"device_classes": dev, "host_classes": host}
    out = {}
    for k, e in (fit.get("classes") or {}).items():
        e = dict(e)
        if "log_factor" in e:
            e["log_factor"] = [v - math.log(factor) for v in e["log_factor"]]
            e.pop("add_s", None)
        if "fixed_s" in e:
            e["fixed_s"] = e["fixed_s"] / factor
        out[k] = e
    return {"classes": out}


def fit_replay_rule(corpus: Corpus, fit: ClassFit) -> dict:
    """The replay rule (graphopt.cost.opclass.REPLAY_RULES: what a class correction, fitted on
    nodes timed alone from the host, does to a node's device time inside a CUDA-graph replay),
    chosen on the fitted configs' replayed whole calls cross-validated by ``fit``'s folds: "full"
    unless another rule cuts that error (the margins of MIN_GAIN); with each rule's error."""
    runs = [r for r in corpus.runs if not r.held_out and r.whole_s and r.execution == "graphed"]
    out = {"rule": "full", "calls": 0, "cv": None}
    if fit.host is not None:
        out["reason"] = "split fit: the device factors are fitted on device time alone and apply as is"
        return out
    if not fit.classes or corpus.profile.kind == "cpu":
        out["reason"] = "no fitted class or no replay on this device: the correction applies as is"
        return out
    errs = {rule: [] for rule in REPLAY_RULES}
    for fold, classes in zip(fit.folds, fit.fold_classes):
        for r in runs:
            if r.config in fold:
                for rule in REPLAY_RULES:
                    p = predicted_whole(corpus, r, _Corrections({"classes": classes, "replay": rule}, corpus.shapes))
                    errs[rule].append(abs(math.log(max(p, 1e-12) / r.whole_s)))
    if not errs["full"]:
        out["reason"] = "no replayed whole call of a fitted config: the correction applies as is"
        return out
    cv = {rule: statistics.fmean(v) for rule, v in errs.items()}
    best = min(REPLAY_RULES, key=lambda rule: (cv[rule], REPLAY_RULES.index(rule)))
    rule = best if best != "full" and _better(cv[best], cv["full"]) else "full"
    out.update(rule=rule, calls=len(errs["full"]), cv=cv,
               reason=f"cross-validated error of {len(errs['full'])} replayed whole call(s): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in cv.items()) + f"; {rule}")
    return out


def _stream_terms(corpus: Corpus, runs: list, fit: dict) -> tuple[float, float, int] | None:
    corr = _Corrections(fit, corpus.shapes)
    pts = [(predicted_whole(corpus, r, corr), _curve_nodes(r, corr), r.whole_s) for r in runs]
    pts = [p for p in pts if p[0] > 0]
    if len(pts) < 2:
        return None
    factor, add = fit_stream([p for p, _, _ in pts], [n for _, n, _ in pts], [m for _, _, m in pts])
    return factor, add, len(pts)


def fit_stream_terms(corpus: Corpus, fit: ClassFit, replay: str = "full") -> dict:
    """The stream terms over the fitted runs' whole calls (:func:`fit_stream`), kept only where
    they lower the whole-call error cross-validated by ``fit``'s folds (each fold's class fits
    and stream terms fitted without it); with the cross-validated whole-call error of the
    uncorrected model, the class fits alone and with the stream terms."""
    runs = [r for r in corpus.runs if not r.held_out and r.whole_s]
    out = {"factor": 1.0, "add_s": 0.0, "configs": 0, "kept": False, "cv": None}
    full = _stream_terms(corpus, runs, dict(fit.fit_dict(), replay=replay)) if not fit.empty else None
    if full is None:
        out["reason"] = "no fitted class or fewer than 2 whole calls: no stream terms"
        return out
    none, cls, strm = [], [], []
    plain = _Corrections({}, corpus.shapes)
    for i, fold in enumerate(fit.folds):
        train = [r for r in runs if r.config not in fold]
        test = [r for r in runs if r.config in fold]
        fd = dict(fit.fit_dict(i), replay=replay)
        terms = _stream_terms(corpus, train, fd) if test else None
        if terms is None:
            continue
        c_cls = _Corrections(fd, corpus.shapes)
        c_str = _Corrections(with_stream_fit(fd, terms[0], terms[1]), corpus.shapes)
        for r in test:
            none.append(abs(math.log(max(predicted_whole(corpus, r, plain), 1e-12) / r.whole_s)))
            cls.append(abs(math.log(max(predicted_whole(corpus, r, c_cls), 1e-12) / r.whole_s)))
            strm.append(abs(math.log(max(predicted_whole(corpus, r, c_str), 1e-12) / r.whole_s)))
    factor, add, used = full
    if not cls:
        out["reason"] = f"fitted {factor:.3f}x + {add * 1e6:.2f} us but no fold could check it: not kept"
        return out
    cv = {"calls": len(cls), "uncorrected": statistics.fmean(none), "classes": statistics.fmean(cls),
          "classes_and_stream": statistics.fmean(strm)}
    out["cv"] = cv
    if _better(cv["classes_and_stream"], cv["classes"]):
        out.update(factor=factor, add_s=add, configs=used, kept=True,
                   reason=f"{factor:.3f}x + {add * 1e6:.2f} us: cross-validated whole-call error "
                          f"{cv['classes']:.3f} -> {cv['classes_and_stream']:.3f}")
    else:
        out["reason"] = (f"fitted {factor:.3f}x + {add * 1e6:.2f} us, dropped: cross-validated whole-call error "
                         f"{cv['classes']:.3f} -> {cv['classes_and_stream']:.3f}, no better")
    return out


# ------------------------------------------------------------------------------------ the profile


def fit_profile(corpus: Corpus, *, min_samples: int = MIN_SAMPLES, max_folds: int = MAX_FOLDS,
                refit_from: str | None = None) -> tuple[DeviceProfile, ClassFit]:
    """The corpus's base profile with the class fits and the stream terms (the profile ``graphopt
    calibrate --corpus`` writes), and the class fit with its decisions."""
    samples = training_samples(corpus)
    if not samples:
        raise GraphoptError("the corpus holds no timed node of a fitted config: nothing to fit")
    if has_split(corpus):
        fit = fit_split(corpus, min_samples=min_samples, max_folds=max_folds)
    else:
        fit = fit_op_classes(samples, min_samples=min_samples, max_folds=max_folds)
    replay = fit_replay_rule(corpus, fit)
    stream = fit_stream_terms(corpus, fit, replay["rule"])
    info = dict(corpus.info, samples=len(samples))
    if fit.host is not None:
        dev, host = split_samples(corpus)
        info.update(samples_device=len(dev), samples_host=len(host))
    if refit_from:
        info["refit_from"] = refit_from
    dropped = {k: d["reason"] for k, d in fit.decisions.items() if not d["kept"]}
    tables = with_stream_fit(fit.fit_dict(), stream["factor"], stream["add_s"])
    op_fit = {"version": 3 if fit.host is not None else 2, **tables,
              "replay": replay["rule"], "replay_fit": replay,
              "min_samples": min_samples, "stream": stream, "dropped": dropped,
              "folds": len(fit.folds), "corpus": info}
    return replace(corpus.profile, op_class_fit=op_fit), fit


def fit_split(corpus: Corpus, *, min_samples: int = MIN_SAMPLES, max_folds: int = MAX_FOLDS) -> ClassFit:
    """The split fit (:func:`split_samples`): a device factor per class against the device time
    alone, a host correction per class and op against the host issue time, each decided as
    :func:`fit_op_classes` decides, over the same folds of the fitted configs; the decisions
    named "device: <class>" and "host: <class>"."""
    dev, host = split_samples(corpus)
    configs = {c for s in dev + host for c in s.configs}
    dfit = fit_op_classes(dev, min_samples=min_samples, max_folds=max_folds, configs=configs)
    hfit = fit_op_classes(host, min_samples=min_samples, max_folds=max_folds, configs=configs)
    decisions = {f"device: {k}": d for k, d in dfit.decisions.items()}
    decisions.update({f"host: {k}": d for k, d in hfit.decisions.items()})
    return ClassFit(dfit.classes, decisions, dfit.folds, dfit.fold_classes, hfit)


# ------------------------------------------------------------------------------------ validation


def evaluate(corpus: Corpus, after: DeviceProfile) -> dict:
    """Prediction against measurement on the held-out runs, before (the base profile) and after
    the fit: per run the whole-call error and the rank correlation over its timed classed nodes
    (Spearman: all of them; ``costed``: those predicted above 0), and per class (the one the fit
    used) the median |ln(predicted / measured)| over the held-out nodes, each node alone (the
    fit's stream terms taken out); a split fit's classes as "device: <class>" (device time alone)
    and "host: <class>" (host issue time), over the nodes the split fit's samples would use."""
    from .measure import spearman

    before_c = _Corrections({}, corpus.shapes)
    after_c = _Corrections(after.op_class_fit, corpus.shapes)
    alone_c = _Corrections(without_stream(after.op_class_fit), corpus.shapes)
    rows, per_class = [], {}
    for r in corpus.runs:
        if not r.held_out or not r.whole_s:
            continue
        row = {"config": r.config, "source": r.source, "execution": r.execution, "measured_ms": r.whole_s * 1e3}
        for tag, corr in (("before", before_c), ("after", after_c)):
            pred = predicted_whole(corpus, r, corr)
            row[f"predicted_ms_{tag}"] = pred * 1e3
            row[f"error_pct_{tag}"] = (pred - r.whole_s) / r.whole_s * 100
            nodes = predicted_nodes(corpus, r, corr)
            row["nodes"] = len(nodes)
            row[f"spearman_{tag}"] = spearman([p for _, p, _ in nodes], [m for _, _, m in nodes])
            costed = [(p, m) for _, p, m in nodes if p > 0]
            row[f"spearman_costed_{tag}"] = spearman([p for p, _ in costed], [m for _, m in costed])
        if alone_c.split:
            _split_errors(corpus, r, alone_c, per_class)
            rows.append(row)
            continue
        alone = predicted_nodes(corpus, r, alone_c)
        for (shape, pb, m), (_, pa, _) in zip(predicted_nodes(corpus, r, before_c), alone):
            if m <= 0:
                continue
            name = alone_c.entry(shape)[0] or f"{class_name(corpus.shapes[shape].cls)} (not fitted)"
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


def _split_errors(corpus: Corpus, run: RunRecord, corr: _Corrections, per_class: dict) -> None:
    """Add ``run``'s nodes to ``per_class``: each node's device time alone and host issue time,
    uncorrected and under the split fit ``corr``, by the class that corrects it."""
    for s in run.steps:
        if s.shape < 0 or s.host_m is None:
            continue
        h, d = corr.times(s)
        path = corpus.shapes[s.shape].cls
        if device_usable(s):
            name = corr.split_entry(s, "device_classes")[0] or f"{class_name(path)} (not fitted)"
            c = per_class.setdefault(f"device: {name}", {"n": 0, "before": [], "after": []})
            c["n"] += 1
            c["before"].append(abs(math.log(s.device_s / s.device_m)))
            c["after"].append(abs(math.log(max(d, 1e-15) / s.device_m)))
        if host_usable(s):
            name = corr.split_entry(s, "host_classes")[0] or f"{class_name(path)} (not fitted)"
            c = per_class.setdefault(f"host: {name}", {"n": 0, "before": [], "after": []})
            c["n"] += 1
            c["before"].append(abs(math.log(s.host_s / s.host_m)))
            c["after"].append(abs(math.log(max(h, 1e-15) / s.host_m)))
