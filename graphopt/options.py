"""optimize()'s options, declared once and validated once (:class:`OptimizeOptions`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import GraphoptError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
CHECKPOINT_BACKENDS = ("auto", "aot", "sac")
ON_NEW_SHAPE = ("error", "reoptimize")


@dataclass(frozen=True)
class OptimizeOptions:
    """What :func:`graphopt.optimize` was asked to do (its keyword arguments), checked when made:
    a bad value raises GraphoptError before anything is captured.

    device: where the model runs (default: where its parameters are); it must match the model.
    target: a cost profile to plan for ("h200", "a100", "cpu", a .json); default: ``device``'s.
    passes / disable: pass ids to run / to leave out (``graphopt.pipeline.PIPELINE`` lists them), a list
      or one comma-separated string.
    training: capture and optimize a graph for training (inference-only passes are skipped;
      parameters stay the model's own objects so optimizers built on ``model.parameters()`` work).
    dynamic: ``{"arg": {axis: "name"}}`` dims left symbolic (the cost model keeps sympy formulas).
    precision: "auto" (bf16 — fp16 before Ampere — where the cost model predicts a gain, sensitive
      ops kept in fp32, guarded by the accuracy rule), "bf16", "fp16", or "fp32" (leave dtypes).
    calibration_data: more example inputs (a list, each like ``example_inputs``) the precision
      guard also checks.
    cuda_graphs: "auto" (replay CUDA graphs for static-shape inference on CUDA), True or False.
    on_new_shape: "error" (a call with another shape/dtype/device raises GuardError) or
      "reoptimize" (optimize again for it, with these options but the calibration batches, which
      the new graph does not take; up to 8 cached specializations, with a warning).
    check_accuracy: compare the optimized graph with an fp64 reference (the accuracy rule); when
      the result fails, the pipeline runs again checking after each pass and reverts the passes
      that fail.
    verify: check the graph's invariants after every pass (a pass that breaks them is reverted).
    dump_dir: write the graph after each pass as ``NNN_<pass>.py``.
    model_name: the model's name in the report (default: its class name).
    memory_budget: training only: fit a step's activation memory (saved tensors, outputs, the
      backward's working set) into this budget by recomputing the cheapest activations in backward
      (pass insert_checkpoints): a fraction 0 < f <= 1 of the captured graph's step activation
      memory (the model's, before fusions change it), bytes, or a size string ("8GB", "512MB"); held parsed (a float fraction or int bytes).
    checkpoint_backend: how the recomputation runs: "auto" (the AOTAutograd graph rewrite where it
      traces the graph, else the selective checkpoint), "aot" (the rewrite, or an error) or "sac"
      (torch.utils.checkpoint regions with a selective policy).
    devices: partition across devices (``["cuda:0", "cuda:1"]``, ``["cuda:0", "cpu"]``, or a count
      of GPUs): the partition_devices pass plans cost-balanced stages within each device's memory
      (``memory_cap`` bytes per device overrides the profiles'), the report gets the stage table,
      and where the devices exist the module runs placed across them (graphopt.partition); the
      example inputs are one micro-batch of a ``schedule`` ("gpipe"/"1f1b"/"interleaved1f1b": with
      ``virtual_stages`` (default 2) non-adjacent stages per device) pipeline of ``microbatches``
      (run multi-process with graphopt.runtime.distributed). ``partition_devices`` holds them
      resolved (graphopt.partition.Device, with their profiles).
    weight_copies: how much memory the constants the passes add may take (merged, converted,
      folded weights: copies beside the model the caller keeps): "auto" (a quarter of the model's
      bytes, or 4% of its device's memory where that is more, at most half the memory free when
      optimize() starts), "allow", "none", a fraction of the model's bytes or a size ("4GB"). A
      rewrite beyond it is refused with the reason in the report (graphopt.setup_memory); the
      report's ``memory`` says what was added and, on a GPU, optimize()'s measured peak.
    measure: time what optimize() returns on the device it runs on (graphopt.runtime.measured):
      every pass that changed the graph is timed against the graph before it and undone when it
      measures slower (its first rewrites kept where they alone are faster), and the module is
      timed against the model as given, which it stands in for where the module is slower. "auto"
      (the default): for inference on the model's own device (not for ``target=`` another device,
      training or dynamic shapes); the environment variable GRAPHOPT_MEASURE=0 or 1 overrides
      "auto"; True / False.
    """

    device: str | torch.device | None = None
    target: str | None = None
    passes: tuple | None = None
    disable: tuple = ()
    training: bool = False
    dynamic: dict | None = None
    precision: str = "auto"
    calibration_data: list | None = None
    cuda_graphs: bool | str = "auto"
    on_new_shape: str = "error"
    check_accuracy: bool = True
    verify: bool = True
    dump_dir: Path | None = None
    model_name: str | None = None
    memory_budget: float | int | str | None = None
    checkpoint_backend: str = "auto"
    devices: list | int | str | None = None
    memory_cap: float | list | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    virtual_stages: int | None = None
    weight_copies: float | int | str = "auto"
    measure: bool | str = "auto"
    partition_devices: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if self.precision not in PRECISIONS:
            raise GraphoptError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.checkpoint_backend not in CHECKPOINT_BACKENDS:
            raise GraphoptError(f"checkpoint_backend must be 'auto', 'aot' or 'sac', got {self.checkpoint_backend!r}")
        if self.on_new_shape not in ON_NEW_SHAPE:
            raise GraphoptError(f"on_new_shape must be 'error' or 'reoptimize', got {self.on_new_shape!r}")
        if self.passes is not None:
            set_("passes", _pass_names("passes", self.passes))
        set_("disable", _pass_names("disable", self.disable or ()))
        from .replay import replay_mode

        replay_mode(self.cuda_graphs)  # (raises for a value it does not know)
        if self.calibration_data is not None and not isinstance(self.calibration_data, (list, tuple)):
            raise GraphoptError(f"calibration_data must be a list of example inputs (each like example_inputs), "
                                f"got {type(self.calibration_data).__name__}")
        if self.dump_dir is not None:
            set_("dump_dir", Path(self.dump_dir))
        if self.memory_budget is not None:
            from .cost.activations import parse_memory_budget

            if not self.training:
                raise GraphoptError("memory_budget applies to training; pass training=True (inference saves no "
                                    "activations)")
            set_("memory_budget", parse_memory_budget(self.memory_budget))
        if self.measure not in ("auto", True, False):
            raise GraphoptError(f"measure must be 'auto', True or False, got {self.measure!r}")
        if not (isinstance(self.weight_copies, str) and self.weight_copies in ("auto", "allow", "none")):
            from .cost.activations import parse_memory_budget

            try:
                parse_memory_budget(self.weight_copies)
            except GraphoptError:
                raise GraphoptError(f"weight_copies must be 'auto', 'allow', 'none', a fraction in (0, 1] of the model's "
                                    f"bytes or a size like 4GB, got {self.weight_copies!r}") from None
        if self.devices is not None:
            from .partition import SCHEDULES, check_interleaving, resolve_devices

            if self.schedule not in SCHEDULES:
                raise GraphoptError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
            if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
                raise GraphoptError(f"microbatches must be a positive integer, got {self.microbatches!r}")
            resolved = tuple(resolve_devices(self.devices, self.target, self.memory_cap))
            check_interleaving(self.schedule, len(resolved), self.microbatches, self.virtual_stages)
            set_("partition_devices", resolved)

    @classmethod
    def of(cls, options: dict) -> "OptimizeOptions":
        """From optimize()'s keyword arguments; an unknown name is a GraphoptError."""
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = [k for k in options if k not in known]
        if unknown:
            raise GraphoptError(f"optimize() has no option {', '.join(map(repr, unknown))}; its options: "
                                f"{', '.join(known)}")
        return cls(**options)


def _pass_names(option: str, value) -> tuple:
    """Pass ids as a tuple: from a list or tuple of names, or one string of comma-separated names
    (as the CLI takes them)."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise GraphoptError(f"{option} must be pass ids (a list of names or 'a,b'), got {value!r}")
    return tuple(value)

