"""Multi-process pipelines: graphopt's stage plan run by ``torch.distributed.pipelining``.

One process per device (``torchrun --nproc-per-node N script.py``, or :func:`spawn`): every rank
captures the same graph at the micro-batch size, builds the same :class:`StagePlan` (the planner
is deterministic), keeps its own stage (graphopt.runtime.placement.stage_modules: inputs are the tensors
crossing its left cut, outputs those crossing its right cut) and runs it as a
``torch.distributed.pipelining.PipelineStage`` under ``ScheduleGPipe`` or ``Schedule1F1B``; with
``schedule="interleaved1f1b"`` each rank keeps ``virtual_stages`` (default 2) non-adjacent stages
(rank r: stages r, r + world, …) under ``ScheduleInterleaved1F1B``.
NCCL on GPUs, gloo on the CPU. Training: ``loss_fn(output, target)`` on the last stage;
gradients land on each stage's parameters (the model's own objects), averaged over micro-batches
as for the whole batch.

    import graphopt.runtime.distributed as gd
    rank, world, device = gd.init()                  # reads torchrun's environment
    model, batch = build(device)                     # the same model on every rank
    pipe = gd.Pipeline(model, batch, microbatches=8, schedule="1f1b", loss_fn=loss)
    out = pipe.step(batch, target=labels)            # the last rank gets the outputs
"""

from __future__ import annotations

import inspect
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from .. import ir
from ..capture import capture, flat_tensors, split_inputs
from ..errors import GraphoptError
from ..partition import StagePlan, check_interleaving, loss_memory_bytes, loss_seconds, plan_stages, resolve_devices
from .placement import stage_modules

# NVLink SHARP / multicast stay off in every process graphopt starts (the lent machines ask it)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _safe_env() -> None:
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)


def init(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun (or :func:`spawn`) set up: NCCL when CUDA is present,
    else gloo. Returns (rank, world size, this rank's device)."""
    _safe_env()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return rank, world, torch.device(f"cuda:{local}")
    return rank, world, torch.device("cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, backend, args):
    _safe_env()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, nprocs: int, *args, backend: str = "gloo", start_method: str = "spawn") -> None:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` processes on this machine with a process
    group initialized (free local port). ``fn`` must be importable (a module-level function).
    ``start_method="forkserver"`` forks the processes from one server process, which imports the
    modules named by ``multiprocessing.set_forkserver_preload`` once for all of them (a spawned
    process imports torch and graphopt itself: seconds each)."""
    import torch.multiprocessing as mp

    _safe_env()
    mp.start_processes(_entry, args=(fn, nprocs, free_port(), backend, args), nprocs=nprocs, join=True,
                       start_method=start_method)


def microbatch(example_inputs, microbatches: int):
    """The first micro-batch of a batch (every tensor split along dim 0)."""
    args, kwargs = split_inputs(example_inputs)
    flat = [x for x in flat_tensors(args, kwargs) if isinstance(x, torch.Tensor)]
    if not flat or flat[0].dim() == 0:
        raise GraphoptError("pipelining needs batched tensor inputs (split along dim 0)")
    batch = flat[0].shape[0]
    if batch % microbatches:
        raise GraphoptError(f"batch {batch} does not split into {microbatches} equal micro-batches")
    size = batch // microbatches
    cut = lambda x: x[:size] if isinstance(x, torch.Tensor) and x.dim() > 0 else x  # noqa: E731
    return pytree.tree_map(cut, (args, kwargs))


class _OutputsToHost(nn.Module):
    """The last stage, its outputs written to host memory as each micro-batch's are made.

    With ``rows`` on, micro-batch i's outputs are copied straight into rows [i·n, (i+1)·n) of one
    batch-sized host buffer per output (pinned for a GPU's outputs, so the copy runs at the link's
    rate), and the schedule's merge (``merge_spec``) returns those buffers instead of concatenating
    the chunks: a language model's concatenated logits can take longer than the pipeline's step
    (``benchmarks/diag/diag_host_outputs.py``). Rows need the forward calls of a step to be the
    micro-batches in order, which holds after the first step (the first may also run torch's shape
    inference), so the first step copies each micro-batch's outputs on their own and the merge
    concatenates them. Meta tensors pass through uncounted; an output that is not batched along dim
    0 in contiguous rows is copied on its own and concatenated."""

    def __init__(self, inner: nn.Module, microbatches: int):
        super().__init__()
        self.inner = inner
        self.microbatches = microbatches
        self.rows = False
        self.calls = 0
        self._batch: list = []

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten(self.inner(*args, **kwargs))
        if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves):
            return pytree.tree_unflatten(leaves, spec)
        i = self.calls % self.microbatches
        self.calls += 1
        if i == 0:
            self._batch = [None] * len(leaves)
        out = []
        for j, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                out.append(x)
                continue
            pin = x.device.type != "cpu"
            if not self.rows or x.dim() == 0 or not x.is_contiguous():
                out.append(torch.empty_like(x, device="cpu", pin_memory=pin).copy_(x))
                continue
            n = x.shape[0]
            if i == 0:
                self._batch[j] = torch.empty((n * self.microbatches, *x.shape[1:]), dtype=x.dtype, device="cpu",
                                             pin_memory=pin)
            out.append(self._batch[j][i * n:(i + 1) * n].copy_(x))
        return pytree.tree_unflatten(out, spec)

    def _merge(self, acc, chunk):
        """Reducer over one output's micro-batch chunks: the batch buffer the chunks are rows of, or
        (an output copied on its own) their concatenation (a non-tensor or 0-dim output: the first)."""
        base = getattr(chunk, "_base", None)
        if base is not None and any(base is b for b in self._batch):
            return base
        if acc is None:
            return chunk
        if not isinstance(chunk, torch.Tensor) or chunk.dim() == 0:
            return acc
        return torch.cat([acc, chunk])

    def merge_spec(self, outputs: int):
        """The schedule's ``output_merge_spec`` for a stage with ``outputs`` flat outputs."""
        from torch.distributed.pipelining.microbatch import _CustomReducer

        one = lambda: _CustomReducer(None, self._merge)  # noqa: E731
        return one() if outputs == 1 else tuple(one() for _ in range(outputs))


class Pipeline:
    """This rank's stage of a pipeline over the process group's ranks.

    model: the same model (same weights) on every rank, on this rank's device.
    example_inputs: one global batch (a tensor, a tuple, or a dict); the graph is captured at
      its micro-batch size (batch / microbatches).
    schedule: "gpipe", "1f1b" or "interleaved1f1b" (``virtual_stages`` stages per rank, default 2;
      the micro-batches must be a multiple of the ranks). loss_fn: ``loss_fn(output, target) -> scalar`` (training; the
      last stage applies it per micro-batch; with ``example_target`` (one global batch's target) its
      cost is added to the last stage's in the plan). devices: the stage devices (default: this rank's
      device type, one per rank); target / memory_cap: as for ``optimize(devices=...)``.
    passes: graphopt passes to run on the captured graph before planning (default none).
    outputs_to_host: inference only: the last stage copies each micro-batch's outputs to host memory
      as it makes them, and ``step`` returns the merged outputs there; its GPU then holds one
      micro-batch's outputs instead of the whole batch's and their concatenation (a language model's
      logits), at the price of the copies (planned at the host link's rate).
    """

    def __init__(self, model: nn.Module, example_inputs, *, microbatches: int = 4, schedule: str = "gpipe",
                 loss_fn=None, example_target=None, devices=None, target=None, memory_cap=None, passes=(),
                 group=None, device: torch.device | None = None, virtual_stages: int | None = None,
                 outputs_to_host: bool = False):
        if outputs_to_host and loss_fn is not None:
            raise GraphoptError("outputs_to_host is for inference: in training the loss is computed from the last "
                                "stage's outputs on its device")
        if not dist.is_initialized():
            raise GraphoptError("graphopt.runtime.distributed.Pipeline needs a process group: run under torchrun and "
                                "call graphopt.runtime.distributed.init() first (or use graphopt.runtime.distributed.spawn)")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world < 2:
            raise GraphoptError("a pipeline needs at least 2 processes (one per stage)")
        if device is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = torch.device(device)
        if devices is None:
            devices = [f"cuda:{r}" for r in range(self.world)] if self.device.type == "cuda" else ["cpu"] * self.world
        if len(devices) != self.world:
            raise GraphoptError(f"{len(devices)} devices for {self.world} processes; one stage per process")
        self.training = loss_fn is not None
        self.outputs_to_host = bool(outputs_to_host)
        self.microbatches = microbatches
        if schedule == "1f1b" and microbatches < self.world:
            raise GraphoptError(f"1F1B needs at least as many micro-batches as stages ({microbatches} < {self.world})")
        check_interleaving(schedule, self.world, microbatches, virtual_stages)
        mb_args, mb_kwargs = microbatch(example_inputs, microbatches)
        was = model.training
        model.train(self.training)
        try:
            gm = capture(model, (mb_args, mb_kwargs))
        finally:
            model.train(was)
        if passes:
            from ..pipeline import run_passes

            run_passes(gm, list(passes), target=target or ("h200" if self.device.type == "cuda" else "cpu"),
                       training=self.training)
        self._out_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
        devs = resolve_devices(devices, target, memory_cap)
        # every rank must cut at the same places: plan with rank 0's profiles (a CPU profile is
        # measured per process at first use, and two measurements never agree exactly)
        box = [devs]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        devs = box[0]
        loss_s, loss_bytes = None, 0.0
        if loss_fn is not None and example_target is not None:
            out_node = next(n for n in gm.graph.nodes if n.op == "output")
            out_val = [a.meta.get("val") for a in out_node.all_input_nodes]
            (tgt,), _ = microbatch(example_target, microbatches)
            out_one = out_val[0] if len(out_val) == 1 else tuple(out_val)
            loss_s = loss_seconds(loss_fn, out_one, tgt, devs)
            loss_bytes = loss_memory_bytes(loss_fn, out_one, tgt)
        self.plan: StagePlan = plan_stages(gm, devs, hints=ir.shape_hints(gm), schedule=schedule,
                                           microbatches=microbatches, training=self.training, loss_s=loss_s,
                                           virtual_stages=virtual_stages, loss_bytes=loss_bytes,
                                           outputs_on_host=self.outputs_to_host)
        mods = stage_modules(gm, self.plan)
        #: this rank's stage indices and their GraphModules (one, or virtual_stages when interleaved)
        self.stage_indices = self.plan.stages_on(self.rank)
        self.modules = [mods[k].to(self.device) for k in self.stage_indices]
        del mods
        #: this rank's stage module (an nn.ModuleList of them when interleaved)
        self.module = self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)
        del gm
        self._group, self._loss_fn = group, loss_fn
        self.set_schedule(schedule)

    def set_schedule(self, schedule: str) -> None:
        """Run the same stages under another schedule ("gpipe" | "1f1b" for a plan of one stage
        per rank; "interleaved1f1b" for a plan of several; the plan keeps the memory terms of the
        schedule it was made for)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if schedule not in ("gpipe", "1f1b", "interleaved1f1b"):
            raise GraphoptError(f"schedule must be gpipe, 1f1b or interleaved1f1b, got {schedule!r}")
        if schedule == "1f1b" and self.microbatches < self.world:
            raise GraphoptError(f"1F1B needs at least as many micro-batches as stages ({self.microbatches} < {self.world})")
        v = self.plan.virtual_stages
        if (schedule == "interleaved1f1b") != (v > 1):
            raise GraphoptError(f"the plan has {v} stage(s) per rank; {schedule} runs "
                                + ("several: build the Pipeline with schedule='interleaved1f1b'" if v == 1 else
                                   "one: build the Pipeline with schedule='gpipe' or '1f1b'"))
        if v > 1:
            check_interleaving(schedule, self.world, self.microbatches, v)
        self.schedule_name = schedule
        K = self.plan.num_stages
        self._to_host = None
        mods = list(self.modules)
        if self.outputs_to_host and K - 1 in self.stage_indices:
            at = self.stage_indices.index(K - 1)
            mods[at] = self._to_host = _OutputsToHost(mods[at], self.microbatches)
        self.stages = [PipelineStage(m, k, K, self.device, group=self._group) for m, k in zip(mods, self.stage_indices)]
        self.stage = self.stages[0]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}[schedule]
        # torch >= 2.7 averages gradients over micro-batches (scale_grads); older ones sum them
        self._scale_by_hand = "scale_grads" not in inspect.signature(cls.__init__).parameters
        merge = {}
        if self._to_host is not None:
            out = next(n for n in self._to_host.inner.graph.nodes if n.op == "output").args[0]
            merge["output_merge_spec"] = self._to_host.merge_spec(len(out) if isinstance(out, (list, tuple)) else 1)
        self.schedule = cls(self.stages if v > 1 else self.stage, self.microbatches, loss_fn=self._loss_fn, **merge)

    def named_parameters(self):
        """(name, parameter) of this rank's stages, named as in the model."""
        for m in self.modules:
            yield from m.named_parameters()

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def step(self, inputs=None, target=None, losses: list | None = None):
        """One pipeline step over a global batch: the first rank passes ``inputs`` (like the
        example inputs), the last rank ``target`` when training. Returns the merged outputs on
        the last rank (structured like the model's), None elsewhere. Training accumulates
        gradients into the stage's parameters (zero them between steps)."""
        args = []
        if self.is_first:
            if inputs is None:
                raise GraphoptError("the first rank must pass the batch's inputs to step()")
            a, k = split_inputs(inputs)
            args = [x for x in flat_tensors(a, k)]
        kw = {}
        if self.is_last and self.training:
            if target is None:
                raise GraphoptError("training: the last rank must pass target= to step()")
            kw = {"target": target, "losses": losses}
        if self.training:
            out = self.schedule.step(*args, **kw)
            if self._scale_by_hand:
                for p in self.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.microbatches)
        else:
            if self._to_host is not None:
                self._to_host.calls = 0
            with torch.no_grad():
                out = self.schedule.step(*args, **kw)
            if self._to_host is not None:
                if self._to_host.rows and self._to_host.calls != self.microbatches:
                    raise GraphoptError(f"outputs_to_host: the last stage ran {self._to_host.calls} forwards for "
                                        f"{self.microbatches} micro-batches in one step, so its outputs' rows are not "
                                        "known; this torch's pipelining schedule is not supported with outputs_to_host")
                self._to_host.rows = True  # the first step ran torch's shape inference, if it runs one
        if not self.is_last:
            return None
        if self._out_spec is not None and out is not None:
            leaves = list(out) if isinstance(out, (list, tuple)) else [out]
            if self._out_spec.num_leaves == len(leaves):
                return pytree.tree_unflatten(leaves, self._out_spec)
        return out
