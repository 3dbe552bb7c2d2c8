"""Partitioning a graph across devices: the stage planner and the single-process placement.

The planner splits the topological order of a captured graph's compute nodes into contiguous
stages, one per device, by dynamic programming over cut positions. A stage's predicted time is
its nodes' cost-model time on its device's profile plus the transfer of the tensors crossing its
two boundaries at the link's bandwidth; the plan minimizes the slowest stage's time (the
pipeline's throughput), subject to each device's memory: the parameters the stage reads, its
activations times the micro-batches the schedule keeps in flight, and the boundary buffers.
Among plans whose slowest stage is within 0.1 % of the best, the one with the fewest bytes
crossing its cuts wins.

The example inputs the graph was captured with are one micro-batch: the pipeline runs the
graph once per micro-batch, so the stage times are per micro-batch.

Running a plan: graphopt.runtime.placement (one process) and graphopt.runtime.distributed
(one process per device).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from . import ir
from .cost.model import CostModel
from .cost.profiles import DeviceProfile, get_profile
from .errors import BudgetError, GraphoptError

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
MAX_CUTS = 3000  # more candidate cut positions than this: an even subset (the DP is O(S · cuts²))
TIE_TOLERANCE = 1e-3  # plans whose slowest stage is within 0.1 % of the best count as tied
TRAINING_FACTOR = 3.0  # forward + backward ≈ 3 × forward (backward computes two GEMMs per forward GEMM)


# --------------------------------------------------------------------------- devices


@dataclass
class Device:
    name: str  # "cuda:0", "cpu"
    profile: DeviceProfile
    memory_bytes: float  # the profile's memory or the memory_cap

    @property
    def kind(self) -> str:
        return torch.device(self.name).type


def resolve_devices(devices, target=None, memory_cap=None) -> list[Device]:
    """``devices``: a list of device names ("cuda:0", "cpu"), a comma-separated string, or a
    count (that many GPUs: cuda:0..N-1). CUDA devices get ``target``'s profile when given (so a
    machine without a GPU can plan for one), else their own; "cpu" gets the CPU profile.
    ``memory_cap``: bytes per device (a number, or one per device) instead of the profiles'."""
    if isinstance(devices, bool) or devices is None:
        raise GraphoptError(f"devices must be a list of devices or a count, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise GraphoptError(f"devices must be at least 1, got {devices}")
        devices = [f"cuda:{i}" for i in range(devices)]
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    devices = [str(d) for d in devices]
    if not devices:
        raise GraphoptError("devices is empty")
    caps = memory_cap if isinstance(memory_cap, (list, tuple)) else [memory_cap] * len(devices)
    if len(caps) != len(devices):
        raise GraphoptError(f"memory_cap has {len(caps)} values for {len(devices)} devices")
    out = []
    for name, cap in zip(devices, caps):
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError):
            raise GraphoptError(f"unknown device '{name}' in devices") from None
        if dev.type == "cuda" and dev.index is None:
            raise GraphoptError(f"device '{name}' needs an index (cuda:0, cuda:1, …)")
        if dev.type not in ("cuda", "cpu"):
            raise GraphoptError(f"unsupported device type '{dev.type}' in devices (cuda:N or cpu)")
        if dev.type == "cpu":
            prof, _ = get_profile("cpu")
        elif target is not None and str(target) != "cpu":
            prof, _ = get_profile(target)
        else:
            prof, _ = get_profile(str(dev))
        if cap is not None and cap <= 0:
            raise GraphoptError(f"memory_cap must be positive, got {cap}")
        out.append(Device(str(dev), prof, float(cap) if cap is not None else float(prof.memory_bytes)))
    return out


def link_bandwidth(a: Device, b: Device) -> tuple[float, str]:
    """(bytes/s, link name) between two devices: NVLink between GPUs (the profiles'
    ``link_bandwidth["nvlink"]``), PCIe host↔device between a CPU and a GPU, the CPU's memory
    bandwidth between two CPU stages (one host)."""
    if a.kind == "cuda" and b.kind == "cuda":
        bw = min(a.profile.link_bandwidth.get("nvlink", 0) or 0, b.profile.link_bandwidth.get("nvlink", 0) or 0)
        if bw > 0:
            return bw, "nvlink"
        bw = min(a.profile.link_bandwidth.get("pcie_h2d", 25e9), b.profile.link_bandwidth.get("pcie_h2d", 25e9))
        return bw, "pcie"
    if a.kind == "cuda" or b.kind == "cuda":
        return host_bandwidth(a if a.kind == "cuda" else b), "pcie_h2d"
    return a.profile.bandwidth, "host memory"


def host_bandwidth(gpu: Device) -> float:
    """Bytes/s between a GPU and host memory (the profile's ``link_bandwidth["pcie_h2d"]``)."""
    return gpu.profile.link_bandwidth.get("pcie_h2d", 25e9)


# --------------------------------------------------------------------------- plan records


@dataclass
class Stage:
    index: int
    device: str
    profile: str
    start: int  # compute-node positions [start, end)
    end: int
    nodes: list  # node names
    params: list  # get_attr targets this stage reads
    param_bytes: float
    compute_s: float  # per micro-batch, forward (× TRAINING_FACTOR when training)
    transfer_s: float  # its boundaries' transfer at the link bandwidth
    time_s: float
    activation_bytes: float  # per micro-batch
    in_flight: int  # micro-batches whose activations it holds at once
    memory_bytes: float
    memory_cap: float
    bytes_in: float
    bytes_out: float

    def as_dict(self) -> dict:
        return {
            "stage": self.index, "device": self.device, "profile": self.profile, "nodes": len(self.nodes),
            "first_node": self.nodes[0] if self.nodes else None, "last_node": self.nodes[-1] if self.nodes else None,
            "parameters": len(self.params), "parameter_bytes": self.param_bytes,
            "predicted_compute_ms": self.compute_s * 1e3, "predicted_transfer_ms": self.transfer_s * 1e3,
            "predicted_ms": self.time_s * 1e3, "activation_bytes": self.activation_bytes, "in_flight": self.in_flight,
            "predicted_memory_bytes": self.memory_bytes, "memory_cap_bytes": self.memory_cap,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
        }


@dataclass
class StagePlan:
    stages: list[Stage]
    boundaries: list[dict]  # per cut: {"after_node", "bytes", "tensors", "link", "transfer_ms"}
    schedule: str
    microbatches: int
    training: bool
    bubble_fraction: float
    predicted_step_s: float  # all micro-batches through the pipeline
    single_device_s: float  # the same micro-batches on the first device alone
    notes: list[str] = field(default_factory=list)
    stage_of: dict = field(default_factory=dict, repr=False)  # node name -> stage index
    virtual_stages: int = 1  # stages per device (interleaved1f1b: stage k on device k % devices)
    # per physical device: {"device", "stages", "predicted_ms" (its stages' sum per micro-batch),
    # "predicted_memory_bytes" (its stages' + its runtime reserve), "runtime_reserve_bytes", "memory_cap_bytes"}
    device_summary: list = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return len(self.stages) // self.virtual_stages

    def stages_on(self, device_index: int) -> list[int]:
        """The stage indices device ``device_index`` (0 … devices-1) holds, in order."""
        return list(range(device_index, len(self.stages), self.num_devices))

    @property
    def predicted_speedup(self) -> float:
        return self.single_device_s / self.predicted_step_s if self.predicted_step_s else float("nan")

    def as_dict(self) -> dict:
        return {
            "schedule": self.schedule, "microbatches": self.microbatches, "training": self.training,
            "virtual_stages": self.virtual_stages, "devices": self.device_summary,
            "stages": [s.as_dict() for s in self.stages], "boundaries": self.boundaries,
            "bubble_fraction": self.bubble_fraction, "predicted_step_ms": self.predicted_step_s * 1e3,
            "single_device_ms": self.single_device_s * 1e3, "predicted_speedup": self.predicted_speedup,
            "notes": self.notes,
        }


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a pipeline over ``stages`` devices: (S-1)/(M+S-1) for GPipe and 1F1B;
    (S-1)/(v·M+S-1) for interleaved 1F1B with v stages per device, whose warm-up and drain pass
    through stages 1/v as long (Narayanan et al., "Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM", SC 2021, arXiv:2104.04473, §2.2.2: bubble time
    (p-1)·(t_f+t_b)/v against an ideal m·(t_f+t_b), a fraction (p-1)/(v·m) of the ideal)."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def in_flight(stage: int, stages: int, microbatches: int, schedule: str, training: bool,
              virtual_stages: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once: one for inference; all M
    for GPipe training (every forward before any backward); S - stage (at most M) for 1F1B.
    Interleaved 1F1B (``stages`` devices, stage k on device k % S): the forwards
    torch.distributed.pipelining's ScheduleInterleaved1F1B runs on that device before its first
    backward, plus the one it runs next — (v-1)·R + 2·(S-1-d) + 1 (R = M / max(1, M // S)
    micro-batches per round), taken R at a time by each of its stages in turn."""
    if not training:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved1f1b":
        S, v, M = stages, virtual_stages, microbatches
        d, local = stage % S, stage // S
        per_round = M // max(1, M // S)
        forwards = min(M * v, (v - 1) * per_round + 2 * (S - 1 - d) + 1)
        return min(M, sum(1 for f in range(forwards) if (f // per_round) % v == local))
    return min(microbatches, stages - stage)


# --------------------------------------------------------------------------- graph analysis


class _Analysis:
    """Positions, crossing bytes per cut, liveness and parameter use of one graph."""

    def __init__(self, gm: fx.GraphModule, hints: dict):
        c = lambda v: float(ir.concrete(v, hints))  # noqa: E731
        self.gm = gm
        nodes = list(gm.graph.nodes)
        self.order = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        N = self.N = len(self.order)
        pos = {n: i for i, n in enumerate(self.order)}
        for n in self.placeholders:
            pos[n] = -1
        pos[self.output] = N
        self.pos = pos
        self.size = {n: sum(c(t.nbytes) for t in ir.infos(n)) for n in nodes if n.op != "output"}
        # a cut c sits before position c (c = 0..N); value v crosses cut c iff pos(v) < c <= last use
        cross = np.zeros(N + 2)
        bad = np.zeros(N + 2)  # non-tensor values (tuples, symbolic ints) crossing: not a valid cut
        nonfloat = np.zeros(N + 2)  # integer/bool tensors crossing: no cut for training (see below)
        self.last_use: dict = {}
        for v in self.placeholders + self.order:
            users = [u for u in v.users]
            if not users:
                continue
            last = max(pos[u] for u in users)
            self.last_use[v] = last
            lo, hi = pos[v] + 1, last
            if hi < lo:
                continue
            lo = max(lo, 0)
            if isinstance(v.meta.get("val"), torch.Tensor):
                cross[lo] += self.size[v]
                cross[hi + 1] -= self.size[v]
                if not v.meta["val"].is_floating_point():
                    nonfloat[lo] += 1
                    nonfloat[hi + 1] -= 1
            else:
                bad[lo] += 1
                bad[hi + 1] -= 1
        self.cross = np.cumsum(cross)[: N + 1]
        self.cross[0] = 0.0  # the inputs are where the caller put them
        self.cross[N] = 0.0  # the outputs stay on the last stage
        self.valid = np.cumsum(bad)[: N + 1] == 0
        self.valid[0] = self.valid[N] = True
        # torch.distributed.pipelining (torch 2.11) gives every received activation
        # requires_grad=True when training, which integer and bool tensors cannot have
        self.float_only = np.cumsum(nonfloat)[: N + 1] == 0
        self.float_only[0] = self.float_only[N] = True
        # liveness (inference activation peak): a value is live from its producer to its last
        # reader; views alias their base (no bytes of their own)
        live = np.zeros(N + 1)
        produced = np.zeros(N)
        cost = CostModel(_NULL_PROFILE)
        base: dict = {}
        for n in self.order:
            kind = cost.flops_bytes(n)[3]
            if kind == "free" and n.all_input_nodes and n.all_input_nodes[0].op != "get_attr":
                src = n.all_input_nodes[0]
                base[n] = base.get(src, src)
        last_root: dict = {}
        for v, last in self.last_use.items():
            r = base.get(v, v)
            last_root[r] = max(last_root.get(r, -1), last)
        for v in self.placeholders + self.order:
            if v in base or v not in last_root:
                continue
            lo, hi = max(pos[v], 0), min(last_root[v], N - 1)
            live[lo] += self.size[v]
            live[hi + 1] -= self.size[v]
            if pos[v] >= 0:
                produced[pos[v]] += self.size[v]
        self.live = np.cumsum(live)[:N]
        self.produced_prefix = np.concatenate([[0.0], np.cumsum(produced)])
        # parameters (and buffers, constants): the positions that read each one
        self.attrs = [n for n in nodes if n.op == "get_attr"]
        self.attr_uses = {a: sorted({pos[u] for u in a.users if u.op != "output"}) for a in self.attrs}
        self.out_bytes = sum(self.size.get(a, 0.0) for a in self.output.all_input_nodes)

    def crossing_nodes(self, cut: int) -> list:
        """The values crossing cut ``cut``, in graph order (placeholders first)."""
        if cut <= 0 or cut >= self.N:
            return []
        return [v for v in self.placeholders + self.order
                if v in self.last_use and self.pos[v] < cut <= self.last_use[v]]

    def param_matrix(self, cuts: np.ndarray) -> np.ndarray:
        """P[a, b]: bytes of the distinct parameters read by positions [cuts[a], cuts[b]).
        A stage starting at i reads parameter p iff p's first use at or after i comes before
        the stage's end: one sorted pass over the (use position, parameter) pairs per start."""
        C = len(cuts)
        pairs = sorted((p, k) for k, a in enumerate(self.attrs) for p in self.attr_uses[a] if 0 <= p < self.N)
        pos = np.array([p for p, _ in pairs], dtype=np.int64)
        aid = np.array([k for _, k in pairs], dtype=np.int64)
        sizes = np.array([self.size[a] for a in self.attrs], dtype=np.float64)
        P = np.zeros((C, C))
        for ci, i in enumerate(cuts):
            m = pos >= i
            ids, first = np.unique(aid[m], return_index=True)
            # the first cut index whose position is past the parameter's first use
            end = np.searchsorted(cuts, pos[m][first], side="right")
            acc = np.zeros(C + 1)
            np.add.at(acc, end, sizes[ids])
            P[ci] = np.cumsum(acc)[:C]
        return P


_NULL_PROFILE = DeviceProfile(name="null", kind="cpu", peak_flops={"float32": 1.0}, elementwise_flops=1.0,
                              bandwidth=1.0, launch_overhead_s=0.0, memory_bytes=0.0)


def _compute_prefix(an: _Analysis, profile: DeviceProfile, hints: dict) -> np.ndarray:
    cost = CostModel(profile)
    t = np.array([float(ir.concrete(cost.node_cost(n).time_s, hints)) for n in an.order])
    return np.concatenate([[0.0], np.cumsum(t)])


# --------------------------------------------------------------------------- backward costs

# (op signature, profile name) -> (backward seconds, ATen ops it dispatches), or (None, None) (not traceable)
_BACKWARD_MEMO: dict = {}


def _requires_grad(an: "_Analysis", gm: fx.GraphModule) -> dict:
    """Which values carry gradients in a training step: trainable parameters and what is computed
    from them (the graph's inputs do not need gradients; a stage's received activations are
    computed from the earlier stages' parameters, so they do)."""
    rg: dict = {}
    for a in an.attrs:
        val = ir.get_attr_value(gm, a.target)
        rg[a] = isinstance(val, nn.Parameter) and val.requires_grad
    for p in an.placeholders:
        rg[p] = False
    for n in an.order:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        floating = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
        rg[n] = floating and any(rg.get(x, False) for x in n.all_input_nodes)
    return rg


def _backward_key(node: fx.Node, rg: dict, profile: DeviceProfile) -> tuple | None:
    """The memo key of ``node``'s backward: op, argument structure, each argument's shape, strides,
    dtype, device and whether it needs a gradient; None for symbolic shapes (not traced)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((list(node.args), dict(node.kwargs)))

    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor) or any(not isinstance(d, int) for d in v.shape):
                raise _Untraceable
            return ("T", tuple(v.shape), tuple(v.stride()), str(v.dtype), v.device.type,
                    bool(rg.get(a, False) and v.is_floating_point()))
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Untraceable
        return repr(a)

    try:
        return (str(node.target), str(spec), tuple(sig(a) for a in leaves), profile.name)
    except _Untraceable:
        return None


def _backward_seconds(node: fx.Node, rg: dict, profile: DeviceProfile, hints: dict) -> float | None:
    """Predicted seconds of ``node``'s backward: the ATen ops autograd runs for it, traced with
    FakeTensors (make_fx of the op and torch.autograd.grad for the inputs that need gradients,
    less the op's own forward trace) and priced by the cost model. None when it cannot be traced
    (symbolic shapes, an op without a derivative formula)."""
    return _backward_cost(node, rg, profile, hints)[0]


def _backward_ops(node: fx.Node, rg: dict, profile: DeviceProfile, hints: dict) -> int | None:
    """ATen ops in ``node``'s traced backward, or None when it cannot be traced."""
    return _backward_cost(node, rg, profile, hints)[1]


def _backward_cost(node: fx.Node, rg: dict, profile: DeviceProfile, hints: dict) -> tuple:
    """(seconds, ATen ops) of ``node``'s traced backward (:func:`_backward_seconds`), memoized
    per op signature and profile; (None, None) when it cannot be traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree

    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None, None
    leaves, spec = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    tpos = [i for i, a in enumerate(leaves) if isinstance(a, fx.Node)]
    tensors = [leaves[i] for i in tpos]
    key = _backward_key(node, rg, profile)
    if key is None:
        return None, None
    if key in _BACKWARD_MEMO:
        return _BACKWARD_MEMO[key]
    grad_in = [j for j, a in enumerate(tensors) if key[2][tpos[j]][5]]
    out_val = node.meta.get("val")
    outs = [v for v in (out_val if isinstance(out_val, (tuple, list)) else [out_val])
            if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not grad_in or not outs:
        _BACKWARD_MEMO[key] = (0.0, 0)
        return 0.0, 0
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty_strided(tuple(t.meta["val"].shape), tuple(t.meta["val"].stride()),
                                     dtype=t.meta["val"].dtype, device=t.meta["val"].device) for t in tensors]
        gouts = [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device) for v in outs]
    n_in = len(tensors)

    def call(xs):
        filled = list(leaves)
        for j, i in enumerate(tpos):
            filled[i] = xs[j]
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return node.target(*args, **kwargs)

    def forward(*xs):
        return call(xs)

    def joint(*xs):
        ins = [x.detach().requires_grad_(j in grad_in) for j, x in enumerate(xs[:n_in])]
        res = [o for o in pytree.tree_leaves(call(ins)) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        pairs = [(o, g) for o, g in zip(res, xs[n_in:]) if o.requires_grad]
        if not pairs:
            return []
        return torch.autograd.grad([o for o, _ in pairs], [ins[j] for j in grad_in], [g for _, g in pairs],
                                   allow_unused=True)

    cost = CostModel(profile)

    def priced(g: fx.GraphModule) -> float:
        return sum(float(ir.concrete(cost.node_cost(n).time_s, hints)) for n in g.graph.nodes)

    try:
        with mode:
            fwd = make_fx(forward, tracing_mode="fake")(*fakes)
            both = make_fx(joint, tracing_mode="fake")(*fakes, *gouts)
        cost = (max(0.0, priced(both) - priced(fwd)), max(0, _aten_ops(both) - _aten_ops(fwd)))
    except Exception:  # noqa: BLE001 - an op whose backward cannot be traced is priced by the factor
        cost = (None, None)
    _BACKWARD_MEMO[key] = cost
    return cost


def _aten_ops(g: fx.GraphModule) -> int:
    return sum(1 for n in g.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))


class _Untraceable(Exception):
    pass


def _host_train_prefix(an: "_Analysis", gm: fx.GraphModule, profile: DeviceProfile, hints: dict,
                       rg: dict | None = None) -> np.ndarray | None:
    """Prefix sums of each node's host seconds in an eager training step: the ATen ops its forward
    and its traced backward dispatch (an untraceable backward counts as two ops per forward op),
    plus one gradient accumulation per trainable parameter at its first reader, each
    ``profile.host_train_op_s``. None when the profile has no such measurement (or is a CPU's,
    whose compute is host time already)."""
    h = profile.host_train_op_s
    if not h or profile.kind == "cpu":
        return None
    rg = _requires_grad(an, gm) if rg is None else rg
    ops = np.zeros(an.N)
    for idx, n in enumerate(an.order):
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        b = _backward_ops(n, rg, profile, hints) if rg.get(n, False) else 0
        ops[idx] = 1 + (2 if b is None else b)
    for a, uses in an.attr_uses.items():
        val = ir.get_attr_value(gm, a.target)
        if uses and isinstance(val, nn.Parameter) and val.requires_grad:
            ops[uses[0]] += 1
    return np.concatenate([[0.0], np.cumsum(ops * h)])


def _training_prefix(an: "_Analysis", gm: fx.GraphModule, profile: DeviceProfile, hints: dict,
                     forward: np.ndarray, rg: dict | None = None) -> tuple[np.ndarray, int]:
    """Prefix sums of each compute node's forward + backward seconds (its backward traced and
    priced, :func:`_backward_seconds`; an untraceable one at (TRAINING_FACTOR - 1) × its forward),
    + the gradient sums autograd adds where a value feeds several nodes that need its gradient.
    Returns (prefix, nodes priced by the factor)."""
    rg = _requires_grad(an, gm) if rg is None else rg
    fwd = np.diff(forward)
    out = np.empty(an.N)
    fallback = 0
    for idx, n in enumerate(an.order):
        b = _backward_seconds(n, rg, profile, hints) if rg.get(n, False) else 0.0
        if b is None and fwd[idx] == 0:  # no kernel (getitem of a tuple, a view): no backward kernel either
            b = 0.0
        if b is None:
            b = (TRAINING_FACTOR - 1.0) * fwd[idx]
            fallback += 1
        # autograd sums the gradients of a value read by k nodes that need them: k - 1 adds
        readers = sum(1 for u in n.users if rg.get(u, False))
        if rg.get(n, False) and readers > 1:
            b += (readers - 1) * (3.0 * an.size[n] / profile.bandwidth + profile.kernel_fixed_s)
        out[idx] = fwd[idx] + b
    return np.concatenate([[0.0], np.cumsum(out)]), fallback


# --------------------------------------------------------------------------- the planner


def plan_stages(gm: fx.GraphModule, devices: list[Device], *, hints: dict | None = None, schedule: str = "gpipe",
                microbatches: int = 1, training: bool = False, loss_s: dict | None = None,
                virtual_stages: int | None = None, loss_bytes: float = 0.0,
                outputs_on_host: bool = False) -> StagePlan:
    """Contiguous stages over ``gm``'s topological order minimizing the pipeline's predicted step
    within each device's memory. Raises BudgetError naming the shortfall when no split fits.
    ``loss_s``: {profile name: seconds} of the loss the last stage computes per micro-batch,
    forward and backward (:func:`loss_seconds`); ``loss_bytes``: what it allocates at its peak
    beyond its input (:func:`loss_memory_bytes`), on the last stage. ``outputs_on_host``
    (inference): the last stage copies each micro-batch's outputs to host memory as it makes them
    (``Pipeline(outputs_to_host=True)``), so its device holds one micro-batch's outputs, not the
    whole batch's and their concatenation; the copy is priced at the host link's bandwidth.

    gpipe / 1f1b: one stage per device (the slowest stage's time is minimized, by dynamic
    programming). interleaved1f1b: ``virtual_stages`` (v, default 2) stages per device, S·v
    contiguous stages, stage k on device k % S; a device's time is the sum of its stages', its
    memory the sum of its stages' + its runtime workspace; the objective is the interleaved
    schedule's step, M · (slowest device) + (S − 1) · (slowest stage) (searched exhaustively over
    the cut positions, on an even subset with a local refinement when there are too many)."""
    if schedule not in SCHEDULES:
        raise GraphoptError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise GraphoptError(f"microbatches must be a positive integer, got {microbatches!r}")
    if outputs_on_host and training:
        raise GraphoptError("outputs_on_host is for inference: in training the loss is computed from the last "
                            "stage's outputs on its device")
    S = len(devices)
    v = check_interleaving(schedule, S, microbatches, virtual_stages)
    K = S * v  # stages (virtual stages when interleaved)
    hints = ir.shape_hints(gm) if hints is None else hints
    an = _Analysis(gm, hints)
    N = an.N
    cuts = np.flatnonzero(an.valid)  # candidate cut positions, 0 and N included
    if len(cuts) - 1 < K:
        raise GraphoptError(f"the graph has {N} compute nodes and {len(cuts) - 2} places it can be cut; "
                            f"it cannot be split into {K} stages")
    sdev = [devices[k % S] for k in range(K)]  # the device of each stage
    prefix = {}
    host = {}  # training: host seconds per node (None where the profile has no host measurement)
    fallback = 0
    rg = _requires_grad(an, gm) if training else None
    for d in devices:
        if d.profile.name not in prefix:
            prefix[d.profile.name] = _compute_prefix(an, d.profile, hints)
            if training:  # forward + each node's traced backward
                prefix[d.profile.name], fallback = _training_prefix(an, gm, d.profile, hints, prefix[d.profile.name],
                                                                    rg)
                host[d.profile.name] = _host_train_prefix(an, gm, d.profile, hints, rg)
    links = [link_bandwidth(sdev[k], sdev[k + 1]) for k in range(K - 1)]
    reserve = [runtime_reserve(d, training) for d in devices]
    # tied parameters: in training a parameter read by two stages would need its gradients summed
    # across devices; graphopt refuses such cuts (they are forbidden, and if nothing is left the
    # error names the parameter)
    forbid = np.zeros(N + 1, dtype=bool)
    tied = []
    if training:
        for a, uses in an.attr_uses.items():
            if uses and uses[-1] > uses[0] and isinstance(ir.get_attr_value(gm, a.target), nn.Parameter) \
                    and ir.get_attr_value(gm, a.target).requires_grad:
                forbid[uses[0] + 1: uses[-1] + 1] = True
                tied.append((a, uses))
    if training:
        cuts = np.array([c for c in cuts if an.float_only[c]])
        if len(cuts) - 1 < K:
            raise GraphoptError(f"training across {K} stages: integer or bool tensors (masks, positions) cross every "
                                "place the graph could be cut, and the pipeline cannot send them in training; with "
                                "Hugging Face models use attn_implementation='eager' (its mask is a float tensor)")
    cand = np.array([c for c in cuts if not forbid[c] or c in (0, N)])
    if len(cand) - 1 < K:
        name = max(tied, key=lambda t: t[1][-1] - t[1][0])[0].target if tied else "?"
        raise GraphoptError(f"training across {K} stages: parameter {name} is read at both ends of the graph "
                            "(tied weights) and its gradients would have to be summed across devices, which "
                            "graphopt refuses; untie it, or partition for inference")
    if len(cand) > MAX_CUTS:  # very large graphs: an even subset of the cut positions
        keep = np.unique(np.linspace(0, len(cand) - 1, MAX_CUTS).round().astype(int))
        cand = cand[keep]
    Pc = an.param_matrix(cand)
    cidx = np.full(N + 1, -1)
    cidx[cand] = np.arange(len(cand))
    P = lambda i, j: Pc[cidx[i], cidx[j]]  # noqa: E731  bytes of the parameters read by positions [i, j)

    def stage_terms(k: int, i: np.ndarray, j: int):
        """(time, memory, …) of stage k covering [i, j) for a vector of starts i (memory without
        the device's runtime workspace, which is counted once per device)."""
        d = sdev[k]
        pre = prefix[d.profile.name]
        compute = pre[j] - pre[i]
        if k == K - 1 and loss_s:
            compute = compute + loss_s.get(d.profile.name, 0.0)
        if k == K - 1 and outputs_on_host and d.kind != "cpu":
            compute = compute + an.out_bytes / host_bandwidth(d)
        params = P(i, j)
        if training:
            # gradient accumulation over the micro-batches: the first backward's gradients are
            # stolen, each later one is added in place (read two, write one), and the schedule
            # scales them once a step (read one, write one): averaged per micro-batch
            compute = compute + params * (3.0 * (microbatches - 1) + 2.0) / microbatches / d.profile.bandwidth
            hp = host.get(d.profile.name)
            if hp is not None:  # the host issues every op: a stage of small micro-batches waits on it
                compute = np.maximum(compute, hp[j] - hp[i] + d.profile.host_train_call_s)
        tin = np.where(i > 0, an.cross[i] / links[k - 1][0], 0.0) if k > 0 else np.zeros(len(i))
        tout = an.cross[j] / links[k][0] if k < K - 1 and j < N else 0.0
        transfer = (tin + tout) * (2.0 if training else 1.0)  # activations forward, gradients back
        time = compute + transfer
        fl = in_flight(k, S, microbatches, schedule, training, v)
        if training:
            act = an.produced_prefix[j] - an.produced_prefix[i] + an.cross[i]
        else:
            # the running max of live bytes over [i, j), for every i at once
            seg = an.live[:j]
            act = np.maximum.accumulate(seg[::-1])[::-1][i] if j > 0 else np.zeros(len(i))
        pbytes = params * (2.0 if training else 1.0)  # weights (+ their gradients)
        # torch.distributed.pipelining allocates a receive buffer per micro-batch for the stage's
        # inputs, and keeps every micro-batch's outputs in its forward cache until the next step
        # (training: a gradient receive buffer per micro-batch instead); a plan with two of each
        # came out short of the measured peaks on two H200s
        buffers = float(microbatches) * (an.cross[i] + an.cross[j]) if K > 1 else np.zeros(len(i))
        # the last stage keeps every micro-batch's outputs for the merge (one is in ``act`` already),
        # and the merge (a concatenation) allocates the whole batch's outputs while they are alive
        outputs = an.out_bytes * (2 * microbatches - 1) if k == K - 1 and microbatches > 1 and not outputs_on_host \
            else 0.0
        if k == K - 1 and training:
            outputs = outputs + loss_bytes
        memory = pbytes + act * fl + buffers + outputs
        return time, memory, compute, transfer, act, fl, params

    if v == 1:
        bounds = _dp_one_per_device(an, cand, S, stage_terms, devices, reserve)
    else:
        bounds = _search_interleaved(an, cand, S, v, microbatches, stage_terms, devices, reserve)
    if bounds is None:
        raise _no_fit(an, cand, S, v, stage_terms, devices, reserve, training, P(0, N))

    stage_of: dict = {}
    stages = []
    for k in range(K):
        i, j = bounds[k], bounds[k + 1]
        time, memory, compute, transfer, act, fl, _ = stage_terms(k, np.array([i]), j)
        nodes = an.order[i:j]
        for n in nodes:
            stage_of[n.name] = k
        params = [a.target for a, uses in an.attr_uses.items() if any(i <= p < j for p in uses)]
        mem = float(memory[0]) + (reserve[k % S] if v == 1 else 0.0)
        stages.append(Stage(
            index=k, device=sdev[k].name, profile=sdev[k].profile.name, start=i, end=j,
            nodes=[n.name for n in nodes], params=params, param_bytes=float(P(i, j)),
            compute_s=float(compute[0]), transfer_s=float(transfer[0]), time_s=float(time[0]),
            activation_bytes=float(act[0]), in_flight=fl, memory_bytes=mem,
            memory_cap=sdev[k].memory_bytes, bytes_in=float(an.cross[i]), bytes_out=float(an.cross[j]),
        ))
    per_device = []
    for d in range(S):
        mine = [s for s in stages if s.index % S == d]
        per_device.append({"device": devices[d].name, "stages": [s.index for s in mine],
                           "predicted_ms": sum(s.time_s for s in mine) * 1e3,
                           "predicted_memory_bytes": sum(s.memory_bytes for s in mine) + (reserve[d] if v > 1 else 0.0),
                           "runtime_reserve_bytes": reserve[d], "memory_cap_bytes": devices[d].memory_bytes})
    boundaries = []
    for k in range(K - 1):
        cut = bounds[k + 1]
        bw, link = links[k]
        crossing = an.crossing_nodes(cut)
        boundaries.append({"after_node": an.order[cut - 1].name, "bytes": float(an.cross[cut]),
                           "tensors": [x.name for x in crossing], "link": link,
                           "from": sdev[k].name, "to": sdev[k + 1].name,
                           "transfer_ms": float(an.cross[cut]) / bw * 1e3})
    slowest = max(s.time_s for s in stages)
    if v == 1:
        step = (microbatches + S - 1) * slowest
    else:
        step = microbatches * max(x["predicted_ms"] for x in per_device) / 1e3 + (S - 1) * slowest
    single = float(microbatches * (prefix[devices[0].profile.name][N]
                                   + (loss_s or {}).get(devices[0].profile.name, 0.0)))
    notes = []
    if v > 1:
        notes.append(f"interleaved 1F1B: {v} stages per device (device d holds stages d, d+{S}, …); bubble "
                     f"(S-1)/(v·M+S-1) = {bubble_fraction(S, microbatches, v):.0%} (Narayanan et al. 2021, §2.2.2)")
    if training:
        notes.append("training step predicted as the forward + each node's backward (traced with fake tensors, priced "
                     "by the cost model; autograd's gradient sums included"
                     + (f"; {fallback} node(s) not traceable priced at {TRAINING_FACTOR - 1:g}× their forward"
                        if fallback else "")
                     + ") + the gradient accumulation over micro-batches; memory counts weights + gradients (optimizer "
                     "state is not in the graph) and every tensor a stage produces as saved for backward")
        hosts = {d.profile.name: d.profile.host_train_op_s for d in devices if host.get(d.profile.name) is not None}
        if hosts:
            calls = {d.profile.name: d.profile.host_train_call_s for d in devices}
            notes.append("a training stage costs the longer of its device time and its host time: the ATen ops its "
                         "forward and backward dispatch, " + ", ".join(f"{v * 1e6:.1f} µs each + {calls[k] * 1e6:.0f} "
                                                                        f"µs per call on {k}" for k, v in hosts.items())
                         + " (host_train_op_s and host_train_call_s, measured by graphopt calibrate)")
    if any(reserve):
        notes.append(f"each device reserves {fmt_bytes(max(reserve))} of runtime workspace (cuBLAS, per thread)")
    if outputs_on_host:
        notes.append(f"the last stage copies each micro-batch's outputs ({fmt_bytes(an.out_bytes)}) to host memory as it "
                     "makes them: its device holds one micro-batch's outputs, and the merged outputs are on the host"
                     + (f" (priced at {host_bandwidth(sdev[-1]) / 1e9:.0f} GB/s)" if sdev[-1].kind != "cpu" else ""))
    if loss_s:
        notes.append(f"the loss on the last stage is costed: {max(loss_s.values()) * 1e3:.3f} ms per micro-batch "
                     f"(forward + backward), {fmt_bytes(loss_bytes)} at its peak")
    if tied:
        notes.append("parameters read by several nodes far apart (tied weights) keep those nodes on one stage: "
                     + ", ".join(a.target for a, _ in tied[:4]))
    shared = [a.target for a, uses in an.attr_uses.items() if len({stage_of[an.order[p].name] for p in uses}) > 1]
    if shared:
        notes.append(f"{len(shared)} parameter(s)/buffer(s) read by more than one stage are copied to each: "
                     + ", ".join(shared[:4]) + ("…" if len(shared) > 4 else ""))
    return StagePlan(stages=stages, boundaries=boundaries, schedule=schedule, microbatches=microbatches,
                     training=training, bubble_fraction=bubble_fraction(S, microbatches, v), predicted_step_s=step,
                     single_device_s=single, notes=notes, stage_of=stage_of, virtual_stages=v,
                     device_summary=per_device)


def check_interleaving(schedule: str, devices: int, microbatches: int, virtual_stages) -> int:
    """The stages per device for ``schedule`` (1 for gpipe/1f1b, ``virtual_stages`` or 2 for
    interleaved1f1b); refuses what the interleaved schedule cannot run, in one line."""
    if schedule != "interleaved1f1b":
        if virtual_stages not in (None, 1):
            raise GraphoptError(f"virtual_stages={virtual_stages} needs schedule='interleaved1f1b' "
                                f"({schedule} runs one stage per device)")
        return 1
    v = 2 if virtual_stages is None else virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise GraphoptError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if devices < 2:
        raise GraphoptError("interleaved1f1b needs at least 2 devices")
    if microbatches % devices:
        raise GraphoptError(f"interleaved1f1b needs the micro-batches to be a multiple of the devices "
                            f"({microbatches} micro-batches on {devices} devices)")
    return v


def usable_bytes(device: Device) -> float:
    """The memory a plan may fill on ``device``: its cap less the profile's allocator headroom (a
    fraction of it kept free for the caching allocator's block rounding and transients no plan
    sees)."""
    return device.memory_bytes * (1.0 - float(getattr(device.profile, "allocator_headroom", 0.0) or 0.0))


def runtime_reserve(device: Device, training: bool) -> float:
    """Bytes the runtime takes on ``device`` beside the graph's tensors: the profile's per-thread
    GEMM workspace, twice when training (autograd runs the backward on a thread of its own)."""
    return float(device.profile.runtime_workspace_bytes) * (2.0 if training else 1.0)


def _dp_one_per_device(an, cand, S, stage_terms, devices, reserve, overflow=False):
    """One stage per device: the split of the candidate cuts minimizing the slowest stage (or,
    with ``overflow``, the largest memory overflow), ties broken by crossing bytes. Returns the
    cut positions or None when nothing fits."""
    C = len(cand)
    INF = float("inf")
    f = np.full((S + 1, C), INF)
    g = np.full((S + 1, C), INF)
    arg = np.zeros((S + 1, C), dtype=int)
    f[0, 0] = 0.0
    g[0, 0] = 0.0
    for k in range(1, S + 1):
        for cj in range(k, C):
            if k == S and cj != C - 1:
                continue
            ci = np.arange(k - 1, cj)
            prev = f[k - 1, ci]
            ok = np.isfinite(prev)
            if not ok.any():
                continue
            time, memory, *_ = stage_terms(k - 1, cand[ci], cand[cj])
            need = memory + reserve[k - 1] - usable_bytes(devices[k - 1])
            val, feas = (need, np.ones(len(ci), dtype=bool)) if overflow else (time, need <= 0)
            tot = np.maximum(prev, val)
            tot[~(ok & feas)] = INF
            best = tot.min()
            if not np.isfinite(best):
                continue
            near = tot <= best + abs(best) * TIE_TOLERANCE + 1e-15
            traffic = np.where(near, g[k - 1, ci] + an.cross[cand[ci]], INF)
            pick = int(np.argmin(traffic))
            f[k, cj], g[k, cj], arg[k, cj] = tot[pick], traffic[pick], ci[pick]
    if not np.isfinite(f[S, C - 1]):
        return None
    bounds = [C - 1]
    for k in range(S, 0, -1):
        bounds.append(arg[k, bounds[-1]])
    return [int(cand[b]) for b in reversed(bounds)]


INTERLEAVED_WORK = 4e7  # (cut tuples) × (last two cuts' grid) the exhaustive interleaved search may visit
PAIR_WINDOW = 4  # candidates either side of two neighbouring cuts the refinement moves together


def _search_interleaved(an, cand, S, v, M, stage_terms, devices, reserve, overflow=False):
    """S·v stages, stage k on device k % S: the cuts minimizing M · max_d T_d + (S − 1) · max_k t_k
    (T_d: the sum of device d's stage times) with every device's summed memory within its cap
    (or, with ``overflow``, minimizing the largest memory overflow). Exhaustive over the candidate
    cuts (the last two cuts vectorized over a grid); with more candidates than INTERLEAVED_WORK
    allows, exhaustive over an even subset, then exhaustive again over the candidates around the
    chosen cuts, then one cut at a time."""
    K = S * v
    caps = np.array([usable_bytes(d) for d in devices]) - np.array(reserve)

    def score(time_d, tmax, mem_d, cross):
        over = np.max(np.stack(np.broadcast_arrays(*[mem_d[d] - caps[d] for d in range(S)])), axis=0)
        if overflow:
            return over, cross
        step = M * np.max(np.stack(np.broadcast_arrays(*time_d)), axis=0) + (S - 1) * tmax
        return np.where(over <= 0, step, np.inf), cross

    def grid(sub):
        """(T, Mem) matrices [stage][i, j] over the candidate indices ``sub`` (inf where j <= i)."""
        C = len(sub)
        T = np.full((K, C, C), np.inf)
        Mm = np.full((K, C, C), np.inf)
        pos = cand[sub]
        for k in range(K):
            for cj in range(1, C):
                t, m, *_ = stage_terms(k, pos[:cj], pos[cj])
                T[k, :cj, cj] = t
                Mm[k, :cj, cj] = m
        return T, Mm

    def exhaustive(sub):
        C = len(sub)
        T, Mm = grid(sub)
        crossv = an.cross[cand[sub]]
        best = (np.inf, np.inf, None)
        for head in itertools.combinations(range(1, C - 1), K - 3):
            fixed = (0,) + head
            time_d = [0.0] * S
            mem_d = [0.0] * S
            tmax, cross = 0.0, float(sum(crossv[c] for c in head))
            for k in range(K - 3):
                t = T[k, fixed[k], fixed[k + 1]]
                time_d[k % S] += t
                mem_d[k % S] += Mm[k, fixed[k], fixed[k + 1]]
                tmax = max(tmax, t)
            if not np.isfinite(tmax):
                continue
            a = fixed[-1]
            # stage K-3: [a, b); K-2: [b, c); K-1: [c, end) — b along rows, c along columns
            t1, m1 = T[K - 3, a, :][:, None], Mm[K - 3, a, :][:, None]
            t2, m2 = T[K - 2], Mm[K - 2]
            t3, m3 = T[K - 1, :, C - 1][None, :], Mm[K - 1, :, C - 1][None, :]
            td = list(time_d)
            md = list(mem_d)
            for k, t, m in ((K - 3, t1, m1), (K - 2, t2, m2), (K - 1, t3, m3)):
                td[k % S] = td[k % S] + t
                md[k % S] = md[k % S] + m
            tm = np.maximum(np.maximum(np.maximum(tmax, t1), t2), t3)
            val, _ = score(td, tm, md, None)
            val = np.where(np.isfinite(tm), val, np.inf)
            lo = val.min()
            if not np.isfinite(lo):
                continue
            traffic = cross + crossv[:, None] + crossv[None, :]
            near = val <= lo + abs(lo) * TIE_TOLERANCE + 1e-15
            b, c = np.unravel_index(int(np.argmin(np.where(near, traffic, np.inf))), val.shape)
            cand_best = (float(val[b, c]), float(traffic[b, c]), fixed + (int(b), int(c), C - 1))
            if cand_best[0] < best[0] - abs(best[0]) * TIE_TOLERANCE or \
                    (cand_best[0] <= best[0] + abs(best[0]) * TIE_TOLERANCE and cand_best[1] < best[1]):
                best = cand_best
        return best

    def evaluate(idx):
        """(score, traffic) of one tuple of candidate indices (stage bounds)."""
        td, md, tmax = [0.0] * S, [0.0] * S, 0.0
        for k in range(K):
            i, j = cand[idx[k]], cand[idx[k + 1]]
            if j <= i:
                return np.inf, np.inf
            t, m, *_ = stage_terms(k, np.array([i]), j)
            td[k % S] += float(t[0])
            md[k % S] += float(m[0])
            tmax = max(tmax, float(t[0]))
        val, _ = score([np.float64(x) for x in td], tmax, [np.float64(x) for x in md], None)
        return float(val), float(sum(an.cross[cand[c]] for c in idx[1:-1]))

    C = len(cand)
    def fits(n):
        return math.comb(max(n - 2, 0), K - 3) * n * n <= INTERLEAVED_WORK

    sub_n = C
    while sub_n > K + 1 and not fits(sub_n):
        sub_n = max(K + 1, int(sub_n * 0.8))
    sub = np.unique(np.linspace(0, C - 1, sub_n).round().astype(int))
    _, _, coarse = exhaustive(sub)
    if coarse is None:
        return None
    idx = [int(sub[x]) for x in coarse]
    if len(sub) < C:
        # zoom in: every candidate between each chosen cut's neighbours in the subset, searched
        # exhaustively together (narrower windows when their union is still too large) …
        for _ in range(3):
            width = max(int(sub[1] - sub[0]) if len(sub) > 1 else 1, 1)
            while True:
                near = {0, C - 1}
                for c in idx[1:-1]:
                    near.update(range(max(1, c - width), min(C - 1, c + width + 1)))
                zoom = np.array(sorted(near))
                if fits(len(zoom)) or width <= 1:
                    break
                width = max(1, width // 2)
            _, _, got = exhaustive(zoom)
            if got is None or [int(zoom[x]) for x in got] == idx:
                break
            idx = [int(zoom[x]) for x in got]
        # … then move one cut at a time while it helps, and two neighbouring cuts together (within a
        # few candidates of where they are) where no single move does: an interleaved plan's devices
        # sum several stages, so a better split can need two cuts to move at once
        cur = evaluate(idx)

        def better(got, cur):
            return got[0] < cur[0] - abs(cur[0]) * 1e-12 or (got[0] <= cur[0] and got[1] < cur[1])

        for _ in range(50):
            moved = False
            for t in range(1, K):
                for c in range(idx[t - 1] + 1, idx[t + 1]):
                    if c == idx[t]:
                        continue
                    trial = idx[:t] + [c] + idx[t + 1:]
                    got = evaluate(trial)
                    if better(got, cur):
                        idx, cur, moved = trial, got, True
            if not moved:
                w = PAIR_WINDOW
                for t in range(1, K - 1):
                    for a in range(max(idx[t - 1] + 1, idx[t] - w), min(idx[t + 2] - 1, idx[t] + w + 1)):
                        for b in range(max(a + 1, idx[t + 1] - w), min(idx[t + 2], idx[t + 1] + w + 1)):
                            trial = idx[:t] + [a, b] + idx[t + 2:]
                            if trial == idx:
                                continue
                            got = evaluate(trial)
                            if better(got, cur):
                                idx, cur, moved = trial, got, True
            if not moved:
                break
        if not np.isfinite(cur[0]) and not overflow:
            return None
    return [int(cand[x]) for x in idx]


def _no_fit(an, cand, S, v, stage_terms, devices, reserve, training, total_param_bytes) -> BudgetError:
    """The BudgetError for a graph no split fits: each device's need, availability and shortfall
    for the split that comes closest."""
    K = S * v
    if v == 1:
        close = _dp_one_per_device(an, cand, S, stage_terms, devices, reserve, overflow=True)
    else:
        close = _search_interleaved(an, cand, S, v, 1, stage_terms, devices, reserve, overflow=True)
    need = [reserve[d] for d in range(S)]
    for k in range(K):
        _, memory, *_ = stage_terms(k, np.array([close[k]]), close[k + 1])
        need[k % S] += float(memory[0])
    parts = []
    for d in range(S):
        have = usable_bytes(devices[d])
        parts.append(f"{devices[d].name} needs {fmt_bytes(need[d])}, has {fmt_bytes(have)}"
                     + (f" (short {fmt_bytes(need[d] - have)})" if need[d] > have else ""))
    total = total_param_bytes * (2.0 if training else 1.0)
    what = f"{S} stage(s)" if v == 1 else f"{K} stages ({v} per device)"
    return BudgetError(f"no split into {what} fits the devices' memory: best split {'; '.join(parts)} "
                       f"(parameters{' + gradients' if training else ''} alone {fmt_bytes(total)}); "
                       "add devices, raise memory_cap, or use more micro-batches")


def _trace_loss(loss_fn, output, target) -> fx.GraphModule:
    """``loss_fn(output, target)`` and its gradient with respect to ``output``, traced with
    FakeTensors (make_fx) into ATen ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731

    def step(out, tgt):
        out = out.detach().requires_grad_(out.is_floating_point())
        loss = loss_fn(out, tgt)
        return torch.autograd.grad(loss, out) if loss.requires_grad else (loss,)

    try:
        with mode:
            return make_fx(step, tracing_mode="fake")(fake(output), fake(target))
    except Exception as e:  # noqa: BLE001 - a loss we cannot trace is left out of the plan, and said so
        raise GraphoptError(f"could not trace loss_fn to cost it: {type(e).__name__}: {str(e).splitlines()[0][:120]}") from e


def loss_seconds(loss_fn, output, target, devices: list[Device]) -> dict:
    """Predicted seconds of ``loss_fn(output, target)``, forward and backward (the gradient of the
    loss with respect to ``output``), per profile: traced with FakeTensors (make_fx) into ATen ops
    the cost model prices. ``output``/``target``: tensors (real, fake or meta) of one
    micro-batch's shapes."""
    g = _trace_loss(loss_fn, output, target)
    out = {}
    for d in devices:
        if d.profile.name not in out:
            cost = CostModel(d.profile)
            out[d.profile.name] = sum(float(ir.concrete(cost.node_cost(n).time_s)) for n in g.graph.nodes)
    return out


def loss_memory_bytes(loss_fn, output, target) -> float:
    """Bytes the loss's forward and backward allocate beyond their inputs at their peak (the
    liveness peak of the traced graph less its inputs: an fp32 cross-entropy over a large
    vocabulary holds the upcast logits, their log-softmax and their gradient)."""
    g = _trace_loss(loss_fn, output, target)
    peak = CostModel(_NULL_PROFILE).memory(g)[0]
    inputs = sum(sum(float(ir.concrete(t.nbytes)) for t in ir.infos(n)) for n in g.graph.nodes if n.op == "placeholder")
    return max(0.0, float(peak) - inputs)


def equal_split(gm: fx.GraphModule, stages: int) -> list[int]:
    """Cut positions of the naive split into equal node counts (for comparison and tests)."""
    n = len([x for x in gm.graph.nodes if x.op not in ("placeholder", "get_attr", "output")])
    return [round(k * n / stages) for k in range(stages + 1)]


def crossing_bytes(gm: fx.GraphModule, cut: int, hints: dict | None = None) -> float:
    """Bytes of the tensors crossing a cut before compute position ``cut``."""
    an = _Analysis(gm, ir.shape_hints(gm) if hints is None else hints)
    return float(an.cross[cut])


# --------------------------------------------------------------------------- stage modules (pipeline)
