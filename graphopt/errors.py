"""Error types. Every user-facing failure is a ``GraphoptError`` with a one-line message
that says what to change; the CLI prints the message and exits 2."""

import os

_OFF = ("", "0", "false", "no", "off")


def traceback_requested() -> bool:
    """Whether ``GRAPHOPT_TRACEBACK`` asks for tracebacks and torch's own diagnostics: any value
    but unset, empty, 0, false, no or off (case-insensitive)."""
    return os.environ.get("GRAPHOPT_TRACEBACK", "").strip().lower() not in _OFF


# how long a reason or note in a report may be (explain prints one line per reason)
LINE_LIMIT = 300


def one_line(text, limit: int = LINE_LIMIT) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters ("…" marks a cut, and a
    dropped rest of several lines). For reasons and notes: the full text goes to the IR dump."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return ""
    first = lines[0]
    if len(first) > limit:
        return first[: limit - 1].rstrip() + "…"
    return first + (" …" if len(lines) > 1 else "")


class GraphoptError(Exception):
    """Base class of every error graphopt raises on purpose. ``detail``: a longer text (a graph
    dump, a traceback) kept apart from the one-line message, for the IR dump or a debugger."""

    exit_code = 2

    def __init__(self, *args, detail: str = ""):
        super().__init__(*args)
        self.detail = detail

    def __str__(self) -> str:  # keep messages to one line
        return " ".join(str(a) for a in self.args).replace("\n", " ").strip()


class CaptureError(GraphoptError):
    """The model could not be captured as a graph (neither torch.export nor symbolic_trace).

    ``partial_graph``: the graph torch.export had traced when it stopped, as code, or None."""

    partial_graph: str | None = None


class UnsupportedOpError(GraphoptError):
    """The graph holds an operator a pass or the cost model cannot handle."""


class BudgetError(GraphoptError):
    """A memory or time budget cannot be met. ``minimum``: the least budget that can be met, in
    the budget's unit (bytes for memory), where the raiser knows it; else None."""

    def __init__(self, *args, detail: str = "", minimum: float | None = None):
        super().__init__(*args, detail=detail)
        self.minimum = minimum


class ArtifactError(GraphoptError):
    """A file given to graphopt.load is not a graphopt artifact, or is corrupt."""


class ModelSpecError(GraphoptError):
    """A MODEL argument (file.py:factory, package.module:factory or zoo name) is wrong."""


class PassConfigError(GraphoptError):
    """Unknown pass names, bad pipeline order, or options for passes that don't exist."""


class KernelBuildError(GraphoptError):
    """The bundled CUDA kernels failed to compile."""


class AccuracyError(GraphoptError):
    """An optimized module fails the accuracy rule and nothing could be reverted."""


class ReferenceRunError(AccuracyError):
    """The accuracy guard could not run the model as given or in float64 on the example inputs
    (an op with a fixed dtype, a tensor kept where graphopt cannot convert it); the message names
    the run and torch's error, and ``check_accuracy=False`` optimizes without the guard."""


class GuardError(GraphoptError):
    """An optimized module was called with inputs it was not specialized for."""


class KernelArgumentError(GraphoptError, ValueError):
    """A bundled op (graphopt.cuda_ext.ops) was called with arguments it does not accept."""


class GenerationError(GraphoptError):
    """graphopt.optimize_generation or Generator.generate was given a model or arguments it
    cannot serve (a prompt longer than max_length, more prompts than max_batch_size, ...)."""


class CorpusFileError(GraphoptError):
    """A corpus samples file (``graphopt calibrate --corpus --refit FILE``) is missing, is not one,
    or is corrupt."""
