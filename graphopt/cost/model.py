"""Roofline cost model: FLOPs and bytes per node from its shapes, time on a device profile.

gpu(node)  = max(FLOPs / (peak(dtype) * scale) + fixed, bytes / bandwidth + kernel_fixed)
time(node) = max(gpu(node), launches * launch_overhead)      (GPU: launches overlap running kernels)
           = gpu(node) + launches * launch_overhead          (CPU: dispatch and work add up)

scale/fixed are the profile's fitted GEMM and convolution efficiencies (`graphopt calibrate`;
1 and 0 in a profile that was not calibrated: the ideal roofline). A profile with an op class fit
(``op_class_fit``, `graphopt calibrate --corpus`) makes each node's time its class's fitted factor
times the time above, plus the fit's per-node stream term (graphopt.cost.opclass;
:meth:`CostModel._class_correction`); a split fit (device and host timed apart) multiplies the
device time by its class's device factor and the host time by its host correction
(:meth:`CostModel._split_times`).

Whole-graph time of an execution (:meth:`CostModel.execution_cost`): a host/device queue
(:func:`queue_cost` over the steps :meth:`CostModel.queue_inputs` gives).

eager (GPU):  the host issues the nodes in order, each costing host time: a kernel node its
              op's measured host time (host_op_s, from `graphopt calibrate`) or launches *
              launch_overhead_s, a node that launches none (a view or metadata op) host_node_s
              (or its host_op_s), Python builtins (getitem) and placeholders nothing. A
              kernel starts at max(its issue time, the previous kernel's end) and runs gpu(node);
              an op that synchronizes with the host (.item(), nonzero) makes the host wait for
              the device. Time = max(host end, device end): host-bound graphs cost their host time.
graphed:      one replayed CUDA graph: the host copies the inputs into the static buffers, launches
              the replay and clones the outputs (each a launch); inside the graph a kernel costs
              max(gpu(node), launches * launch_overhead_graph_s) and views cost nothing.
CPU:          the ops run synchronously: sum of launch + work over the nodes (views free, as the
              planner prices them: ``host_node_s`` is measured on the CPU too but not charged).

The per-node ``NodeCost.time_s`` above is what one node costs in a loop of itself (the steady
state of the queue for one kernel: the longer of its device and its launch time); the passes
compare those. ``execution_cost`` is what optimize() reports as the predicted time.

Shapes may be symbolic (sympy); every quantity is then a sympy expression, evaluated with the
example sizes (``hints``) when a number is needed. The estimates depend only on the graph and
the profile, so they are reproducible and testable on the CPU.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .. import ir, timing
from ..errors import GraphoptError
from . import ops as op_costs
from .opclass import SOFTMAX_OPS, is_split, split_times
from .profiles import DeviceProfile
from .replacement import Replacement, is_scratch

aten = torch.ops.aten

# ops that produce views or metadata only: no kernel, no bytes
VIEW_OPS = {
    "view", "_unsafe_view", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "select",
    "slice", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach", "as_strided",
    "unflatten", "narrow", "diagonal", "view_as", "expand_as", "_assert_tensor_metadata",
    "sym_size", "sym_stride", "sym_numel", "lift_fresh", "_assert_scalar", "sym_constrain_range_for_size",
    "numpy_T", "view_as_real", "view_as_complex", "_reshape_alias", "dropout", "feature_dropout", "unfold",
}
# ops that may or may not copy: a view when their input is contiguous / already matches
MAYBE_VIEW_OPS = {"reshape", "reshape_as", "flatten", "contiguous", "to", "_to_copy", "type_as"}
MATMUL_OPS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "addbmm", "_addmm_activation"}
ADD_FIRST = {"addmm", "_addmm_activation", "baddbmm", "addbmm"}
# a mixture of experts' GEMMs, one per group of rows (transformers' grouped_mm_fallback: the same product where
# torch has no grouped kernel, as on the CPU: a graph captured there is priced as the GPU's would be)
GROUPED_MM_OPS = {"_grouped_mm", "_scaled_grouped_mm", "grouped_mm_fallback"}
# the rate of aten's grouped GEMM over the profile's GEMM rate where a profile has no op_efficiency["grouped_mm"]:
# Mixtral bs8's eight grouped GEMMs run node by node on an H100 took 6.115 ms against 4.153 priced at the GEMM
# rate (benchmarks/results/profile_hf-mixtral_bs8_2026-12-07_h100.md; its dense linears 0.88 of their price)
GROUPED_MM_SCALE = 0.68
CONV_OPS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose2d", "cudnn_convolution"}
ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"}
# their backward kernels (the first input is the output's gradient, then query, key, value):
# FlashAttention's backward recomputes Q·Kᵀ and computes dV, dP, dQ and dK, five products where
# the forward has two, so 2.5 × the forward's FLOPs (Dao, FlashAttention-2, 2023, §3.1.2)
ATTENTION_BACKWARD_OPS = {"_scaled_dot_product_flash_attention_backward",
                          "_scaled_dot_product_efficient_attention_backward",
                          "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
                          "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward"}
# arithmetic per output element for pointwise and reduction-like ops (rough FLOP weights)
FLOP_WEIGHT = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 6, "exp": 4, "log": 4, "pow": 4, "rsqrt": 2,
    "sqrt": 2, "erf": 8, "softmax": 5, "_softmax": 5, "log_softmax": 6, "_log_softmax": 6,
    "layer_norm": 8, "native_layer_norm": 8, "batch_norm": 4, "group_norm": 8, "rms_norm": 6,
    "hardswish": 4, "cos": 4, "sin": 4,
}


@dataclass
class NodeCost:
    node: str
    op: str
    flops: object  # int/float or sympy expression
    bytes: object
    launches: int
    compute_s: object
    memory_s: object
    time_s: object  # includes launch overhead
    bound: str  # "compute" | "memory" | "launch" | "free"
    # the least device time of its kernels, beyond the roofline of compute_s and memory_s (waves of
    # tiny programs, a kernel per sample, element loads of gathered inputs): replayed too
    device_floor_s: object = 0.0

    def evaluated(self, hints=None) -> "NodeCost":
        c = lambda v: ir.concrete(v, hints)  # noqa: E731
        compute, memory = c(self.compute_s), c(self.memory_s)
        return NodeCost(self.node, self.op, c(self.flops), c(self.bytes), self.launches, compute, memory,
                        c(self.time_s), self.bound, c(self.device_floor_s))


@dataclass
class GraphCost:
    total_s: float
    nodes: list  # NodeCost, evaluated
    flops: float
    bytes: float
    launches: int
    roofline_floor_s: float
    bound_share: dict  # "compute"/"memory"/"launch" -> share of predicted time
    peak_memory_bytes: float
    parameter_bytes: float
    symbolic_total: object = None  # sympy expression when shapes are symbolic
    # the floor with GEMMs at the rate the device sustains (profile.matmul_sustained_fraction)
    roofline_floor_sustained_s: float | None = None

    def as_dict(self):
        return {
            "predicted_ms": self.total_s * 1e3,
            "roofline_floor_ms": self.roofline_floor_s * 1e3,
            "roofline_floor_sustained_ms": (None if self.roofline_floor_sustained_s is None
                                            else self.roofline_floor_sustained_s * 1e3),
            "flops": self.flops,
            "bytes": self.bytes,
            "kernel_launches": self.launches,
            "bound_share": self.bound_share,
            "peak_memory_bytes": self.peak_memory_bytes,
            "parameter_bytes": self.parameter_bytes,
            "symbolic_predicted_s": None if self.symbolic_total is None else str(self.symbolic_total),
        }


@dataclass
class ExecutionCost:
    """Predicted time of one call of a graph run a given way (see the module docstring)."""

    mode: str  # "eager" | "graphed" | "serial" (CPU)
    total_s: float
    host_s: float  # time the host spends issuing (or, on the CPU, running) the call
    device_s: float  # device busy time (sum of kernel times)
    launches: int  # kernels the host launches per call (1 replay + copies for a graph)
    nodes: list = None  # per node: {"node", "op", "host_s", "device_s", "start_s", "end_s"} (eager)

    @property
    def busy(self) -> float | None:
        """Predicted GPU busy fraction (device time / wall time); None for serial CPU execution."""
        if self.mode == "serial" or self.total_s <= 0:
            return None
        return min(1.0, self.device_s / self.total_s)

    @property
    def bound(self) -> str:
        if self.mode == "serial":
            return "serial"
        return "host" if self.host_s >= self.device_s else "device"

    def as_dict(self) -> dict:
        return {"mode": self.mode, "predicted_ms": self.total_s * 1e3, "host_ms": self.host_s * 1e3,
                "device_ms": self.device_s * 1e3, "launches": self.launches, "busy": self.busy, "bound": self.bound}


EXECUTION_MODES = ("eager", "graphed")


@dataclass
class QueueStep:
    """One node's part in a call (CostModel.queue_inputs): ``node`` (an fx.Node, or any label),
    its host and device seconds, kernel launches, whether it makes the host wait for the device,
    and whether a CUDA graph replay leaves it to an eager call after the replay (``tail``)."""

    node: object
    host_s: float
    device_s: float
    launches: int
    sync: bool = False
    tail: bool = False


@dataclass
class QueueInputs:
    """The steps of one call and, replayed, its copies in and out ((host, device) seconds each)."""

    mode: str
    steps: list
    copies_in: list
    copies_out: list


def queue_cost(profile: DeviceProfile, q: QueueInputs) -> ExecutionCost:
    """The host/device queue of the module docstring over ``q``'s steps: a CPU profile's serial
    sum, an eager call's issue order, or a replayed graph (copies in, one replay of the non-tail
    steps, the tail steps, copies out)."""
    p, steps = profile, q.steps
    if p.kind == "cpu":
        host = sum(s.host_s for s in steps)
        dev = sum(s.device_s for s in steps)
        return ExecutionCost("serial", host + dev, host, dev, sum(s.launches for s in steps))
    if q.mode == "eager":
        t_host = t_dev = busy = 0.0
        rows = []
        for s in steps:
            t_host += s.host_s
            start = t_dev
            if s.launches:
                start = max(t_host, t_dev)
                t_dev = start + s.device_s
                busy += s.device_s
            if s.sync:
                t_host = max(t_host, t_dev)
            rows.append({"node": getattr(s.node, "name", s.node), "op": ir.op_name(s.node) if isinstance(
                s.node, fx.Node) else "", "host_s": s.host_s, "device_s": s.device_s, "issued_s": t_host,
                "start_s": start, "end_s": t_dev})
        return ExecutionCost("eager", max(t_host, t_dev), sum(s.host_s for s in steps), busy,
                             sum(s.launches for s in steps), rows)
    # graphed: copy-ins, one replay, the ops left outside the graph (ir.tail_nodes: big outputs made
    # after the replay instead of cloned), clones, each issued by the host like an eager kernel
    body = sum(max(s.device_s, s.launches * p.launch_overhead_graph_s) for s in steps if s.launches and not s.tail)
    items = list(q.copies_in) + [(p.launch_overhead_s, body)]
    items += [(s.launches * p.launch_overhead_s, s.device_s) for s in steps if s.tail]
    items += list(q.copies_out)
    t_host = t_dev = 0.0
    for h, d in items:
        t_host += h
        t_dev = max(t_host, t_dev) + d
    return ExecutionCost("graphed", max(t_host, t_dev), sum(h for h, _ in items), sum(d for _, d in items), len(items))


def _smax(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b)
    return sympy.Max(a, b)


def _prod(xs):
    out = 1
    for x in xs:
        out = out * x
    return out


POOL_OPS = {"max_pool2d", "avg_pool2d", "max_pool2d_with_indices"}
# aten's norm kernels with one thread block per row (see norm_rows_seconds)
ROW_BLOCK_NORMS = {"aten::layer_norm", "aten::native_layer_norm"}


# 2-D projections cuBLASLt may split along K (see cublas_split_k); with a ReLU/GELU epilogue too
SPLIT_K_OPS = {"linear", "mm", "addmm", "_addmm_activation"}
SPLIT_K_CHOICES = (2, 3, 4, 6, 8)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cublas_split_k(profile: DeviceProfile, M, N, K) -> bool:
    """Whether cuBLASLt is expected to run an M x N x K projection as split-K (its GEMM kernel
    writing fp32 partial products, then ``splitKreduce_kernel``): when the output has fewer than
    half as many 64 x 32 tiles as the GPU has SMs and K is at least 4 N: the rule reproduces which
    projections cuBLASLt split on the H200 (``benchmarks/diag/diag_splitk.py``, ``diag_busy.py``;
    BERT-base bs1's FFN down projection, 128 x 768 x 3072, is one). Symbolic sizes: not split."""
    sms = profile.sm_count
    if profile.kind != "cuda" or not sms:
        return False
    try:
        M, N, K = int(M), int(N), int(K)
    except TypeError:
        return False
    return M > 0 and _cdiv(M, 64) * _cdiv(N, 32) * 2 < sms and K >= 4 * N


def split_k_slices(profile: DeviceProfile, M: int, N: int, K: int) -> int:
    """How many slices of K a batched GEMM over them should use so that the slices' 64 x 64 output
    tiles come closest to one per SM (1: no split that keeps each slice at least 256 deep and
    16-byte aligned in 16-bit types). BERT-base bs1's down projection: 24 tiles, 6 slices (144),
    the count ``benchmarks/diag/diag_splitk.py`` measured fastest."""
    sms = profile.sm_count or 0
    tiles = _cdiv(int(M), 64) * _cdiv(int(N), 64)
    best, best_d = 1, abs(tiles - sms)
    for s in SPLIT_K_CHOICES:
        if K % s or (K // s) % 8 or K // s < 256:
            continue
        d = abs(s * tiles - sms)
        if d < best_d:
            best, best_d = s, d
    return best


def split_k_reduce_node_seconds(profile: DeviceProfile, node: fx.Node) -> float:
    """Device seconds of the split-K reduction kernel cuBLASLt runs after projection ``node``
    (linear / mm / addmm): it reads the fp32 partial products of the slices (as many as
    :func:`split_k_slices` would choose) and writes the output; 0 where cuBLAS is not expected to
    split K (:func:`cublas_split_k`). Its wall time in an eager loop is
    ``profile.kernel_seconds(0, this - kernel_fixed_s)``."""
    if ir.op_name(node) not in SPLIT_K_OPS:
        return 0.0
    mnk = _gemm_mnk(node)
    if mnk is None or not cublas_split_k(profile, *mnk):
        return 0.0
    M, N, K = mnk
    s = max(split_k_slices(profile, M, N, K), 2)
    return profile.gpu_seconds(0.0, (s * 4 + ir.infos(node)[0].dtype.itemsize) * M * N / profile.bandwidth)


def norm_rows_seconds(profile: DeviceProfile, x: ir.TensorInfo, key: str = "row_norm"):
    """The block-scheduling floor of a one-block-per-row norm over x's last dim: rows * the
    profile's ``op_efficiency[key]["row_s"]`` (0 where the profile has not measured it)."""
    row_s = profile.efficiency(key, "row_s", 0.0)
    if not row_s or not x.shape:
        return 0.0
    return x.numel / x.shape[-1] * row_s


class CostModel:
    """Estimates the time of nodes and graphs on one device profile."""

    def __init__(self, profile: DeviceProfile):
        self.profile = profile
        # node -> (what its price was computed from, (flops_bytes, NodeCost)): a pipeline prices
        # the whole graph after every pass that changes a few nodes (graph_cost, execution_cost)
        self._memo = _Memo(self._memo_key)  # node -> (flops_bytes, NodeCost or None)
        self._op_memo = _Memo(self._memo_key)  # graphopt node -> its OpCost
        self._class_memo = _Memo(self._memo_key)  # node -> its op class correction

    @contextlib.contextmanager
    def _pricing_whole_graph(self):
        """While the graph is priced as it is, each node's memo entries are checked against its key
        once (a graph_cost reads each node's price three times: its cost, its memory, its floor)."""
        memos = (self._memo, self._op_memo, self._class_memo)
        if self._memo.checked is not None:
            yield
            return
        for m in memos:
            m.checked = set()
        try:
            yield
        finally:
            for m in memos:
                m.checked = None

    def _memo_key(self, node: fx.Node):
        """Everything a call_function node's price reads: its target and arguments, its own and
        its inputs' ``meta["val"]`` (by identity: propagation replaces a value, never edits it)
        and cuDNN's TF32 switch; None (not memoized) for other nodes and for the scratch nodes a
        pass prices a candidate with (they are dropped right after)."""
        if node.op != "call_function" or is_scratch(node):
            return None
        return (node.target, node.args, node.kwargs, node.meta.get("val"),
                tuple(a.meta.get("val") for a in node.all_input_nodes), torch.backends.cudnn.allow_tf32)

    # ------------------------------------------------------------------ pricing rewrites (the passes' API)

    def time_of(self, nodes, hints: dict | None = None) -> float:
        """Predicted seconds of ``nodes`` (each node's ``NodeCost.time_s``, evaluated with
        ``hints``): what a pass weighs a candidate's matched nodes and its replacement with."""
        return sum(ir.concrete(self.node_cost(n).time_s, hints) for n in nodes)

    def replacement(self, hints: dict | None = None) -> Replacement:
        """A builder for the nodes a rewrite would make, priced by this model before the rewrite
        (graphopt.cost.replacement): a candidate's gain is ``time_of(matched) - r.time()``."""
        return Replacement(self, hints)

    def price(self, target, *args, hints: dict | None = None, val=None, **kwargs) -> float:
        """Predicted seconds of one ``target(*args, **kwargs)`` node a rewrite would make."""
        r = self.replacement(hints)
        r.call(target, *args, val=val, **kwargs)
        return r.time()

    # ------------------------------------------------------------------ device facts (for legality and reports)

    @property
    def device_name(self) -> str:
        return self.profile.name

    @property
    def device_kind(self) -> str:
        """"cuda" or "cpu"."""
        return self.profile.kind

    @property
    def compute_capability(self) -> tuple:
        """(major, minor) of the GPU; () when not known or a CPU."""
        return tuple(self.profile.compute_capability or ())

    @property
    def launch_overhead_s(self) -> float:
        return self.profile.launch_overhead_s

    @property
    def conv_nchw_slowdown(self) -> float:
        """How much slower convolutions run on NCHW than on channels_last inputs (1.0: no measured
        difference, so the layout pass leaves NCHW)."""
        return self.profile.conv_nchw_slowdown

    @property
    def narrow_conv_slow_path(self) -> bool:
        """Whether this device measured a slow path for convolutions over few input channels (a
        GPU with a per-tap channel chunk or a narrow-input slowdown)."""
        p = self.profile
        return p.kind == "cuda" and (p.conv_narrow_input_slowdown > 1.0 or bool(p.conv_channel_chunk))

    @property
    def allocator_headroom(self) -> float:
        """Fraction of device memory the caching allocator's rounding and transients take."""
        return float(self.profile.allocator_headroom or 0.0)

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """Peak matmul FLOP/s in ``dtype``."""
        return self.profile.matmul_rate(dtype)

    def measured(self, op: str) -> bool:
        """Whether the profile has a fitted efficiency for the op ``op`` (its ``op_efficiency``
        entry's ``scale``, ``memory_scale`` or ``block_bytes_per_s``): an op whose kernel was never timed
        on this device is not planned onto it."""
        return any(self.profile.efficiency(op, k) is not None for k in ("scale", "memory_scale", "block_bytes_per_s"))

    def fit_covers(self, op: str, nbytes) -> bool:
        """Whether ``nbytes`` is at least the smallest size the op's fit was measured over (its
        ``op_efficiency`` entry's ``min_bytes``; an entry without one covers any size): below it the
        fit's fixed time is an extrapolation."""
        lo = self.profile.efficiency(op, "min_bytes")
        return lo is None or ir.concrete(nbytes, {}) >= lo

    def slow_aten_batch_norm(self, node: fx.Node) -> bool:
        """Whether ``node`` is aten's BatchNorm in inference, measured on this device below the copy
        rate for its input's layout (``op_efficiency["batch_norm"]``): a pointwise kernel of ours can pay
        even for it alone."""
        layout = inference_batch_norm_layout(node) if self.profile.kind == "cuda" else None
        if layout is None:
            return False
        return self.profile.efficiency("batch_norm", "memory_scale_cl" if layout == "cl" else "memory_scale", 1.0) < 1.0

    def conv_layout_penalized(self, x: ir.TensorInfo | None) -> bool:
        """Does a convolution over ``x`` pay the device's NCHW slowdown? (see conv_layout_penalized)"""
        return conv_layout_penalized(x, self.profile)

    def cublas_split_k(self, M, N, K) -> bool:
        """Does cuBLASLt split K for this projection on this device? (see cublas_split_k)"""
        return cublas_split_k(self.profile, M, N, K)

    def split_k_slices(self, M, N, K) -> int:
        """K slices a batched GEMM over them should use on this device (see split_k_slices)."""
        return split_k_slices(self.profile, M, N, K)

    # ------------------------------------------------------------------ per node

    def op_cost(self, node: fx.Node) -> op_costs.OpCost:
        """The OpCost of a node calling one of graphopt's ops (``torch.ops.graphopt.*``), from the
        cost function its module registered (graphopt.cost.ops)."""
        key, hit, found = self._op_memo.get(node)
        if found:
            return hit
        fn = op_costs.op_cost_fn(ir.op_name(node))
        out = fn(op_costs.op_call(node), self.profile)
        self._op_memo.put(node, key, out)
        return out

    def flops_bytes(self, node: fx.Node) -> tuple[object, object, int, str]:
        """(flops, bytes, kernel launches, kind) of one node; kind in matmul/pointwise/free/..."""
        key, hit, found = self._memo.get(node)
        if found:
            return hit[0]
        out = self._flops_bytes(node)
        self._memo.put(node, key, (out, None))
        return out

    def _flops_bytes(self, node: fx.Node) -> tuple[object, object, int, str]:
        if node.op == "call_module":  # a region a pass wrapped (insert_checkpoints) prices itself
            owner = node.graph.owning_module
            try:
                mod = owner.get_submodule(node.target) if owner is not None else None
            except AttributeError:  # not a module (export's _guards_fn)
                mod = None
            cost = getattr(mod, "cost", None)
            if isinstance(cost, dict) and "time_s" in cost:
                return cost["flops"], cost["bytes"], cost["launches"], "region"
        if node.op != "call_function":
            return 0, 0, 0, "free"
        name = ir.op_name(node)
        outs = ir.infos(node)
        if not outs and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            # an in-place op that returns nothing (_foreach_add_): one kernel reading and writing what it writes
            written = [i for i in (ir.info(w) for w in ir.written_args(node)) if i is not None]
            if written:
                return sum(w.numel for w in written), 2 * sum(w.nbytes for w in written), 1, "pointwise"
        if not outs:
            return 0, 0, 0, "free"
        if ir.op_namespace(node) == op_costs.NAMESPACE:  # our ops price themselves (graphopt.cost.ops)
            c = self.op_cost(node)
            return c.flops, c.bytes, c.launches, c.kind
        ins = ir.operand_infos(node)  # by position (an operand passed twice counts twice)
        out_bytes = sum(o.nbytes for o in outs)
        in_bytes = sum(i.nbytes for i in ir.arg_infos(node))  # each tensor read once
        if name in VIEW_OPS or name == "getitem":
            return 0, 0, 0, "free"
        if name in MAYBE_VIEW_OPS:
            src = ins[0] if ins else None
            same = src is not None and outs[0].dtype == src.dtype and outs[0].device == src.device
            if same and (name not in ("contiguous", "reshape", "reshape_as", "flatten") or ir.is_contiguous(src)
                         or (name != "contiguous" and ir.reshape_is_view(src, outs[0].shape))):
                return 0, 0, 0, "free"
            return 0, (src.nbytes if src else 0) + out_bytes, 1, "copy"
        if name in MATMUL_OPS:
            # addmm-style ops take the bias first: the reduction dim is the first matrix's last
            k = (ins[1] if name in ADD_FIRST and len(ins) > 2 else ins[0]).shape[-1]
            out = outs[0]
            flops = 2 * out.numel * k
            return flops, in_bytes + out_bytes, 1, "matmul"
        if name in GROUPED_MM_OPS and len(ins) >= 2:
            return grouped_mm_flops(ins[0], ins[1], outs[0]), in_bytes + out_bytes, 1, "matmul"
        if name in CONV_OPS:
            flops, nbytes = conv_flops_bytes(ins, outs)
            return flops, nbytes, 1, "matmul"
        if name in ATTENTION_OPS:
            q, k = ins[0], ins[1]
            b_h = _prod(q.shape[:-2])
            sq, d = q.shape[-2], q.shape[-1]
            sk = k.shape[-2]
            causal = bool(node.kwargs.get("is_causal", False) or _positional(node, "is_causal") is True)
            flops = 4 * b_h * sq * sk * d
            if causal:
                flops = flops / 2
            return flops, in_bytes + out_bytes, 1, "matmul"
        if name in ATTENTION_BACKWARD_OPS and len(ins) >= 3:
            q, k = ins[1], ins[2]
            b_h = _prod(q.shape[:-2])
            causal = bool(node.kwargs.get("is_causal", False))
            flops = 10 * b_h * q.shape[-2] * k.shape[-2] * q.shape[-1]
            if causal:
                flops = flops / 2
            return flops, in_bytes + out_bytes, 1, "matmul"
        if name == "embedding":
            return 0, 2 * out_bytes + (ins[1].nbytes if len(ins) > 1 else 0), 1, "gather"
        if name in ("max_pool2d", "avg_pool2d", "max_pool2d_with_indices", "adaptive_avg_pool2d"):
            window = 1
            ks = node.args[1] if len(node.args) > 1 else None
            if name == "adaptive_avg_pool2d":
                window = ins[0].numel / max(outs[0].numel, 1) if ins else 1
            elif isinstance(ks, (list, tuple)):
                window = _prod(ks)
            return outs[0].numel * window, in_bytes + out_bytes, 1, "reduction"
        weight = FLOP_WEIGHT.get(name, 1)
        numel = _prod([o.numel for o in outs[:1]])
        if name in COPY_THEN_IN_PLACE:  # aten clones the input, then runs the in-place op on the clone
            return numel * weight, in_bytes + 3 * out_bytes, 2, "pointwise"
        if name in ("softmax", "_softmax", "log_softmax", "layer_norm", "batch_norm", "group_norm", "sum", "mean",
                      "amax", "var", "rms_norm", "native_layer_norm", "cumsum", "argmax", "max", "min"):
            kind = "reduction"
        else:
            kind = "pointwise"
        # inputs that are broadcast (fewer elements) are read once
        return numel * weight, in_bytes + out_bytes, 1, kind

    def node_cost(self, node: fx.Node) -> NodeCost:
        key, hit, found = self._memo.get(node)
        if found and hit[1] is not None:
            return hit[1]
        out = self._node_cost(node)
        if self.profile.op_class_fit and is_split(self.profile.op_class_fit):
            out = self._split_node_cost(node, out)
        elif self.profile.op_class_fit:
            factor, add, fixed = self._class_correction(node, out)
            if fixed is not None:
                out = NodeCost(out.node, out.op, out.flops, out.bytes, out.launches, 0.0, 0.0, fixed, "launch")
            elif factor != 1.0 or add:  # (compute_s and memory_s stay the roofline's terms)
                out = NodeCost(out.node, out.op, out.flops, out.bytes, out.launches, out.compute_s, out.memory_s,
                               out.time_s * factor + add, out.bound, out.device_floor_s)
        self._memo.put(node, key, (self.flops_bytes(node), out))
        return out

    def _split_node_cost(self, node: fx.Node, raw: NodeCost) -> NodeCost:
        """NodeCost under a split fit: the uncorrected time scaled as the fit changes the node's
        loop time (the longer of its host and device time on a GPU, their sum on a CPU), so a
        device factor moves the device-bound part and a host correction the host-bound part."""
        if node.op != "call_function" or not _dispatches(node):
            return raw
        host, dev = self._node_times(node, raw)
        h, d = _num(host), _num(dev)
        hc, dc = self._split_times(node, h, d)
        loop = h + d if self.profile.kind == "cpu" else max(h, d)
        if loop <= 0 or (hc, dc) == (h, d):
            return raw
        after = hc + dc if self.profile.kind == "cpu" else max(hc, dc)
        return NodeCost(raw.node, raw.op, raw.flops, raw.bytes, raw.launches, raw.compute_s, raw.memory_s,
                        raw.time_s * (after / loop), raw.bound, raw.device_floor_s)

    def _split_times(self, node: fx.Node, host, dev) -> tuple:
        """(host, device) seconds of a node under the profile's split fit
        (graphopt.cost.opclass.split_correction: a device factor read at its uncorrected device
        time, a host correction read at its uncorrected host time)."""
        key, corr, found = self._class_memo.get(node)
        if not found:
            from .opclass import op_class, split_correction

            path = op_class(node, self.flops_bytes(node)[3]) if node.op == "call_function" else None
            corr = (1.0, 1.0, 0.0) if path is None else split_correction(self.profile.op_class_fit, path, _num(host),
                                                                          _num(dev), ir.target_name(node))
            self._class_memo.put(node, key, corr)
        return split_times(corr, host, dev)

    def _class_correction(self, node: fx.Node, raw: NodeCost | None = None) -> tuple[float, float, float | None]:
        """(factor, added seconds, fixed seconds or None): the profile's corpus fit for the node's
        op class (graphopt.cost.opclass.class_correction), read at its uncorrected time
        ``raw.time_s`` (computed if not given). The one place a fit enters: node_cost makes the
        node's time time * factor + added (for a node it prices at nothing: the fixed time),
        node_times multiplies its host and device time alike and adds the added seconds to the
        host's. (1.0, 0.0, None) without a fit for its class."""
        key, hit, found = self._class_memo.get(node)
        if found:
            return hit
        from .opclass import class_correction, op_class

        path = op_class(node, self.flops_bytes(node)[3]) if node.op == "call_function" else None
        out = (1.0, 0.0, None)
        if path is not None:
            if raw is None:
                raw = self._node_cost(node)
            out = class_correction(self.profile.op_class_fit, path, _num(raw.time_s))
        self._class_memo.put(node, key, out)
        return out

    def _node_cost(self, node: fx.Node) -> NodeCost:
        flops, nbytes, launches, kind = self.flops_bytes(node)
        p = self.profile
        if node.op == "call_function" and ir.op_namespace(node) == op_costs.NAMESPACE and kind != "free":
            return self._op_node_cost(node, self.op_cost(node))
        if kind == "region":  # its nodes' times plus their recomputation in backward
            cost = node.graph.owning_module.get_submodule(node.target).cost
            t = cost["time_s"] + cost["recompute_s"]
            return NodeCost(node.name, "checkpoint_region", flops, nbytes, launches, 0.0, t, t, "memory")
        if kind == "free":
            return NodeCost(node.name, ir.op_name(node), 0, 0, 0, 0.0, 0.0, 0.0, "free")
        eff = "memory"
        align, align_scale = None, 1.0
        if kind == "matmul":
            dtype = ir.operand_infos(node)[0].dtype
            rate = p.matmul_rate(dtype)
            eff = _efficiency_kind(node)
            if eff == "matmul" and SMALL_M_LINEAR in p.op_efficiency and small_m(node):
                eff = SMALL_M_LINEAR  # a decode step's weight stream, at the rate measured for it
            elif eff == "matmul" and (align := gemm_alignment_key(node)) in p.op_efficiency:
                align_scale = p.efficiency(align, "scale", 1.0)  # cuBLAS's kernels for rows not 16-byte aligned
                rate = rate * align_scale
            elif eff == "matmul" and ir.op_name(node) in GROUPED_MM_OPS:  # CUTLASS's grouped kernel, one tile set a group
                rate = rate * p.efficiency("grouped_mm", "scale", GROUPED_MM_SCALE)
            if eff == "conv":
                rate = conv_rate(p, node)
                if p.kind == "cuda":  # aten's convolution, not cuDNN's fused one the conv fit measures
                    rate = rate / p.conv_unfused_slowdown
            elif eff == "attention" and p.attention_tile:
                rate = rate / attention_tile_waste(node, p.attention_tile)
        else:
            rate = p.elementwise_flops
        compute = flops / rate
        memory = nbytes / p.bandwidth
        if align_scale < 1.0 and align == GEMM_ALIGN_PARTIAL:  # measured as the whole kernel's slowdown, either bound
            memory = memory / align_scale
        nhwc_up = p.efficiency("upsample_bilinear2d_nhwc", "memory_scale") if p.kind == "cuda" else None
        if p.narrow_copy_scale < 1.0 and ir.op_name(node) in COPY_OPS and narrow_copy(node):
            memory = memory / p.narrow_copy_scale
        elif nhwc_up is not None and nhwc_upsample(node):  # aten's NHWC kernel, at its own measured rate
            memory = memory / nhwc_up
        elif p.kind == "cuda" and p.conv_bias_add_scale < 1.0 and strided_elementwise(node, kind):
            memory = memory / p.conv_bias_add_scale  # aten's strided kernel, measured on a convolution's bias add
        cat = aten_cat_s(p, node) if p.kind == "cuda" else None
        if cat is not None:  # aten's concatenation kernel, by the runs it writes (or a copy per piece)
            memory, launches = cat
        if ir.op_name(node) in POOL_OPS:
            memory = memory / p.efficiency("pool", "memory_scale", 1.0)
        elif ir.op_name(node) == "col2im":  # aten's kernel: a thread per output pixel gathers its windows' taps
            memory = memory / p.efficiency("col2im", "memory_scale", 1.0)
        bn = inference_batch_norm_layout(node) if p.kind == "cuda" else None
        if bn is not None:  # aten's transform kernel, at the rate measured for the layout
            memory = memory / p.efficiency("batch_norm", "memory_scale_cl" if bn == "cl" else "memory_scale", 1.0)
        if ir.op_name(node) == "native_layer_norm_backward":  # its weight gradients' column reduction
            memory = memory / p.efficiency("layer_norm_backward", "memory_scale", 1.0)
        if outer_sum(node):  # a bias gradient: aten's reduction over the leading dims
            memory = memory / p.efficiency("bias_grad_sum", "memory_scale", 1.0)
        copy_s = input_copy_s(p, implicit_copy_bytes(node))  # the input copy aten makes first, a kernel of its own
        dev_floor = 0.0
        if p.kind == "cuda" and spatial_softmax(node):  # aten's softmax over a dim other than the innermost
            memory = memory / p.efficiency("spatial_softmax", "memory_scale", 1.0)
        gn = aten_group_norm_s(p, node)
        math_path = p.kind == "cuda" and kind == "matmul" and sdpa_math_reason(node) is not None
        if math_path:  # SDPA's math fallback: its products, then the score matrix's memory passes
            mm, mem, launches = sdpa_math_s(p, node)
            gpu = _num(p.gpu_seconds(mm, 0.0, "matmul") + p.gpu_seconds(0.0, mem) + (launches - 2) * p.kernel_fixed_s)
            t = _smax(gpu, launches * p.launch_overhead_s)
            compute, memory = mm, mem
        elif gn is not None:  # aten's two kernels: statistics one block a row, then a strided apply
            t = _smax(gn[0], p.launch_overhead_s) + _smax(gn[1], p.launch_overhead_s)
            gpu = _num(gn[0] + gn[1])
            launches = 2
        elif eff == "conv" and p.kind == "cuda":  # cuDNN's slow paths, and aten's bias add: a kernel of its own
            dev = conv_device_s(p, node, compute, memory, bias=False)
            bias_dev = conv_bias_add_s(p, node)
            gpu = _num(dev + bias_dev)
            t = _smax(dev, launches * p.launch_overhead_s) if launches else dev
            if bias_dev:
                t = t + _smax(bias_dev, p.launch_overhead_s)
                launches += 1
        else:
            t = p.kernel_seconds(compute, memory, eff, launches)
            if f"{ir.op_namespace(node)}::{ir.op_name(node)}" in ROW_BLOCK_NORMS:
                t = _smax(t, norm_rows_seconds(p, ir.operand_infos(node)[0]))
            elif ir.op_name(node) == "native_layer_norm_backward":
                t = _smax(t, norm_rows_seconds(p, ir.operand_infos(node)[1], "layer_norm_backward"))
            gpu = _num(p.gpu_seconds(compute, memory, eff))
            per_sample = im2col_samples(node) if p.kind == "cuda" else 0
            if per_sample > 1:  # aten's CUDA im2col: a kernel per sample, each at least the fixed kernel time
                launches = per_sample
                gpu = dev_floor = gpu + (per_sample - 1) * p.kernel_fixed_s
                t = _smax(gpu, launches * p.launch_overhead_s)
            if eff == "attention" and p.attention_wave_s:
                dev_floor = attention_waves(node, p) * p.attention_wave_s
                t, gpu = _smax(t, dev_floor), max(gpu, dev_floor)
        if copy_s:
            t, gpu, launches = _with_copy(p, copy_s, t, gpu, launches)
        if kind == "matmul" and eff != SMALL_M_LINEAR:  # (the small-M fit times whole calls, reduction included)
            red = split_k_reduce_node_seconds(p, node)
            if red:  # cuBLASLt's reduction kernel after the GEMM
                t = t + p.kernel_seconds(0.0, red - p.kernel_fixed_s)
                gpu = gpu + red
                launches += 1
        launch = launches * p.launch_overhead_s
        c, m = _num(compute), _num(memory)
        if launch >= gpu:
            bound = "launch"
        elif c >= m:
            bound = "compute"
        else:
            bound = "memory"
        return NodeCost(node.name, ir.op_name(node), flops, nbytes, launches, compute, memory, t, bound, dev_floor)

    def _op_node_cost(self, node: fx.Node, c: op_costs.OpCost) -> NodeCost:
        """NodeCost of one of our ops from its OpCost (see graphopt.cost.ops)."""
        p = self.profile
        launches = c.launches
        if c.rate is not None:
            rate = c.rate
        elif c.kind == "matmul":
            rate = p.matmul_rate(ir.operand_infos(node)[0].dtype)
        else:
            rate = p.elementwise_flops
        compute = c.flops / rate
        memory = c.bytes / p.bandwidth + c.extra_s
        if c.slowdown != 1.0:
            compute, memory = compute * c.slowdown, memory * c.slowdown
        launch = launches * p.launch_overhead_s
        if c.time_s is not None:  # its kernels priced one by one: launch-bound when they all are
            t = c.time_s
            bound = "launch" if launch >= _num(t) else ("compute" if _num(compute) >= _num(memory) else "memory")
            return NodeCost(node.name, ir.op_name(node), c.flops, c.bytes, launches, compute, memory, t, bound)
        if c.efficiency == "conv" and p.kind == "cuda":
            dev = conv_device_s(p, node, compute, memory, bias=False)
            gpu = _num(dev)
            t = _smax(dev, launch) if launches else dev
        else:
            t = p.kernel_seconds(compute, memory, c.efficiency, launches)
            if c.floor_s is not None:
                t = _smax(t, c.floor_s)
            gpu = _num(p.gpu_seconds(compute, memory, c.efficiency))
            if c.device_floor_s:
                t, gpu = _smax(t, c.device_floor_s), max(gpu, _num(c.device_floor_s))
        copy_s = input_copy_s(p, c.copy_bytes)
        if copy_s:  # the op's library call copies an input it cannot read as laid out
            t, gpu, launches = _with_copy(p, copy_s, t, gpu, launches)
        if launch >= gpu:
            bound = "launch"
        elif _num(compute) >= _num(memory):
            bound = "compute"
        else:
            bound = "memory"
        return NodeCost(node.name, ir.op_name(node), c.flops, c.bytes, launches, compute, memory, t, bound,
                        c.device_floor_s or 0.0)

    # ------------------------------------------------------------------ per graph

    @timing.timed("cost model")
    def graph_cost(self, gm: fx.GraphModule, hints: dict | None = None) -> GraphCost:
        with self._pricing_whole_graph():
            return self._graph_cost(gm, hints)

    def _graph_cost(self, gm: fx.GraphModule, hints: dict | None) -> GraphCost:
        if hints is None:
            hints = ir.shape_hints(gm)
        raw = [self.node_cost(n) for n in gm.graph.nodes]
        symbolic_total = None
        if any(not isinstance(c.time_s, (int, float)) for c in raw):
            symbolic_total = sum((c.time_s for c in raw), sympy.Integer(0))
        nodes = [c.evaluated(hints) for c in raw]
        total = sum(c.time_s for c in nodes)
        flops = sum(c.flops for c in nodes)
        nbytes = sum(c.bytes for c in nodes)
        launches = sum(c.launches for c in nodes)
        share = {"compute": 0.0, "memory": 0.0, "launch": 0.0}
        for c in nodes:
            if c.bound in share:
                share[c.bound] += c.time_s
        if total > 0:
            share = {k: v / total for k, v in share.items()}
        peak, params, compulsory = self.memory(gm, hints)
        matmul_t, other_t = self._floor_compute(gm, nodes)
        floor = max(matmul_t + other_t, compulsory / self.profile.bandwidth)
        frac = self.profile.matmul_sustained_fraction
        sustained = max(matmul_t / frac + other_t, compulsory / self.profile.bandwidth) if frac < 1.0 else None
        return GraphCost(total, nodes, flops, nbytes, launches, floor, share, peak, params, symbolic_total, sustained)

    # ------------------------------------------------------------------ execution (host/device queue)

    def node_times(self, node: fx.Node, replayed: bool = False) -> tuple[object, object]:
        """(host seconds, device seconds) of one node run eagerly: a kernel node costs the host
        its launches (``host_op_s[op]`` where the profile measured that op, else launches *
        launch_overhead_s) and the device its roofline time; a node with no kernel costs the host
        ``host_node_s`` on a GPU (an ATen view / metadata op; ``host_op_s`` of a view op where
        measured; 0 on a CPU profile, as NodeCost prices it); placeholders, outputs, get_attr and
        Python builtins (getitem) cost nothing. The profile's op class fit multiplies both and adds
        its stream term to the host's (a node priced at nothing takes its class's fixed time as
        host time); ``replayed``: inside a CUDA-graph replay, where the fit's replay rule decides
        what it does to the device time (graphopt.cost.opclass.REPLAY_RULES). A split fit corrects
        host and device time apart, replayed or not (:meth:`_split_times`)."""
        host, dev = self._node_times(node)
        if self.profile.op_class_fit and _dispatches(node) and node.op == "call_function":
            from .opclass import corrected_times, replay_rule

            if is_split(self.profile.op_class_fit):
                return self._split_times(node, host, dev)

            return corrected_times(self._class_correction(node), host, dev,
                                   replay_rule(self.profile.op_class_fit) if replayed else None)
        return host, dev

    def _node_times(self, node: fx.Node, cost: NodeCost | None = None) -> tuple[object, object]:
        """node_times without the op class fit (``cost``: the node's uncorrected NodeCost, where
        the caller has it)."""
        if not _dispatches(node):
            return 0.0, 0.0
        flops, nbytes, launches, kind = self.flops_bytes(node)
        p = self.profile
        if kind == "free" or not launches:
            if p.kind != "cuda":
                return 0.0, 0.0
            name = ir.op_name(node)
            return (p.host_op_s.get(name, p.host_node_s) if name in VIEW_OPS else p.host_node_s), 0.0
        c = cost if cost is not None else self.node_cost(node)
        if kind == "region":
            return launches * p.launch_overhead_s, c.time_s
        host = launches * p.launch_overhead_s
        if p.kind == "cuda" and p.host_op_s:
            host = p.host_op_s.get(ir.op_name(node), host)
        if ir.op_namespace(node) == op_costs.NAMESPACE:
            eff = self.op_cost(node).efficiency
        else:
            eff = _efficiency_kind(node) if kind == "matmul" else "memory"
        copy_s = input_copy_s(p, self.op_cost(node).copy_bytes if ir.op_namespace(node) == op_costs.NAMESPACE
                              else implicit_copy_bytes(node))
        copy = (p.launch_overhead_s, p.gpu_seconds(0.0, copy_s)) if copy_s else (0.0, 0.0)
        if eff == "conv" and p.kind == "cuda":
            return host + copy[0], conv_device_s(p, node, c.compute_s, c.memory_s) + copy[1]
        dev = p.gpu_seconds(c.compute_s, c.memory_s, eff)
        if c.device_floor_s:  # (a kernel per sample, waves of tiny programs, gathered loads)
            dev = _smax(dev, c.device_floor_s)
        return host + copy[0], dev + copy[1]

    def node_loop_s(self, node: fx.Node, hints=None) -> float:
        """Predicted seconds per run of one node run many times back to back (how
        graphopt.tools.measure times a node): on a GPU the longer of its host and device time (a
        queue of one op), on the CPU their sum. Includes ``wrap``-style higher-order ops' bodies."""
        host, dev = 0.0, 0.0
        for _, h, d, _, _ in self._steps(node.graph.owning_module, hints, only=node):
            host, dev = host + h, dev + d
        return host + dev if self.profile.kind == "cpu" else max(host, dev)

    def _steps(self, gm: fx.GraphModule, hints, only: fx.Node | None = None, replayed: set | None = None):
        """(node, host_s, device_s, launches, syncs) per node in order, evaluated with ``hints``;
        a higher-order op with a GraphModule operand (torch.export's wrap_with_set_grad_enabled,
        cond, ...) yields the steps of its body, after its own host dispatch. ``replayed``: the
        nodes of a CUDA-graph replay (their times as :meth:`node_times` gives them replayed)."""
        c = lambda v: float(ir.concrete(v, hints))  # noqa: E731
        for n in ([only] if only is not None else gm.graph.nodes):
            sub = _hop_body(n)
            if sub is not None:
                yield n, (self.profile.host_node_s if self.profile.kind == "cuda" else 0.0), 0.0, 0, False
                yield from self._steps(sub, hints, replayed=None if replayed is None or n not in replayed else
                                       set(sub.graph.nodes))
                continue
            host, dev = self.node_times(n, replayed=replayed is not None and n in replayed)
            launches = self.flops_bytes(n)[2] if n.op in ("call_function", "call_module") else 0
            yield n, c(host), c(dev), launches, ir.host_sync(n)

    def queue_inputs(self, gm: fx.GraphModule, hints: dict | None = None, mode: str = "eager", *,
                     reuse_outputs: bool = False) -> "QueueInputs":
        """What :func:`queue_cost` needs to time one call of ``gm`` run ``mode``: every node's
        step (:meth:`_steps`: host and device seconds, launches, host sync; whether a replay
        leaves it to an eager call after it) and, replayed, the input copies in and the output
        clones out."""
        if mode not in EXECUTION_MODES:
            raise GraphoptError(f"execution mode must be one of {', '.join(EXECUTION_MODES)}, got {mode!r}")
        if hints is None:
            hints = ir.shape_hints(gm)
        p = self.profile
        tail = set() if (reuse_outputs or mode != "graphed" or p.kind == "cpu") else set(ir.tail_nodes(gm))
        replayed = {n for n in gm.graph.nodes if n not in tail} if mode == "graphed" and p.kind != "cpu" else None
        steps = [QueueStep(n, h, d, launches, sync, n in tail)
                 for n, h, d, launches, sync in self._steps(gm, hints, replayed=replayed)]
        copies_in, copies_out = [], []
        if mode == "graphed" and p.kind != "cpu":
            copy = lambda t: (p.launch_overhead_s,  # noqa: E731
                              p.gpu_seconds(0.0, 2 * float(ir.concrete(t.nbytes, hints)) / p.bandwidth))
            copies_in = [copy(t) for n in gm.graph.nodes if n.op == "placeholder" for t in ir.infos(n)]
            if not reuse_outputs:
                out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
                copies_out = [copy(t) for a in out.all_input_nodes if a not in tail for t in ir.infos(a)]
        return QueueInputs(mode, steps, copies_in, copies_out)

    @timing.timed("cost model")
    def execution_cost(self, gm: fx.GraphModule, hints: dict | None = None, mode: str = "eager", *,
                       reuse_outputs: bool = False) -> ExecutionCost:
        """Predicted time of one call of ``gm`` run ``mode`` ("eager": node by node, the host
        issuing kernels to the device's queue; "graphed": replayed as one CUDA graph, inputs
        copied in and outputs cloned unless ``reuse_outputs``). On a CPU profile both are the
        serial sum of host and work per node. See the module docstring for the model."""
        with self._pricing_whole_graph():
            return queue_cost(self.profile, self.queue_inputs(gm, hints, mode, reuse_outputs=reuse_outputs))

    def matmul_floor_s(self, node: fx.Node, flops) -> float:
        """Seconds of a matmul-like node's ``flops`` at the profile's peak rate for its operands' dtype."""
        return flops / self.profile.matmul_rate(ir.operand_infos(node)[0].dtype)

    def _floor_compute(self, gm, nodes) -> tuple[float, float]:
        """(seconds of the matmul-like flops at the peak rate, seconds of the rest)."""
        mm = other = 0.0
        by_name = {n.name: n for n in gm.graph.nodes}
        for c in nodes:
            if c.bound == "free" or c.flops == 0:
                continue
            node = by_name.get(c.node)
            _, _, _, kind = self.flops_bytes(node)
            if kind == "region":  # a checkpoint region: its GEMMs' flops at the GEMM rate
                cost = node.graph.owning_module.get_submodule(node.target).cost
                mm_flops = min(float(cost.get("matmul_flops", 0.0)), float(c.flops))
                mm += float(cost.get("matmul_floor_s", 0.0))
                other += (c.flops - mm_flops) / self.profile.elementwise_flops
            elif kind == "matmul":
                mm += self.matmul_floor_s(node, c.flops)
            else:
                other += c.flops / self.profile.elementwise_flops
        return mm, other

    def memory(self, gm: fx.GraphModule, hints=None) -> tuple[float, float, float]:
        """(predicted peak bytes of one forward, parameter+buffer bytes, compulsory bytes).

        Liveness over the topological order: a tensor lives from its producer to its last
        reader; views keep their base alive; parameters live throughout. Compulsory bytes: what
        the parameters, buffers and inputs must be read for (:func:`bytes_read`) plus the outputs."""
        c = lambda v: ir.concrete(v, hints)  # noqa: E731
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        base: dict[fx.Node, fx.Node] = {}
        size: dict[fx.Node, float] = {}
        params = 0.0
        inputs = 0.0
        for n in nodes:
            infos = ir.infos(n)
            nbytes = sum(c(t.nbytes) for t in infos)
            if n.op == "get_attr":
                params += nbytes
                inputs += bytes_read(n, nbytes, hints)
                continue
            if n.op == "placeholder":
                inputs += bytes_read(n, nbytes, hints)
            kind = self.flops_bytes(n)[3] if n.op == "call_function" else "input"
            if kind == "free" and n.all_input_nodes:
                src = n.all_input_nodes[0]
                base[n] = base.get(src, src)
            else:
                size[n] = nbytes
        last_use: dict[fx.Node, int] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                root = base.get(a, a)
                last_use[root] = max(last_use.get(root, 0), index[n])
        for n in nodes:  # the caller holds the inputs for the whole call
            if n.op == "placeholder":
                last_use[n] = len(nodes)
        out_node = nodes[-1]
        outputs = 0.0
        for a in out_node.all_input_nodes:
            root = base.get(a, a)
            last_use[root] = len(nodes)
            outputs += size.get(root, 0.0)
        live = 0.0
        peak = 0.0
        frees: dict[int, float] = {}
        for i, n in enumerate(nodes):
            if n in size:
                live += size[n]
                end = last_use.get(n, i)
                frees[end] = frees.get(end, 0.0) + size[n]
            peak = max(peak, live)
            live -= frees.pop(i, 0.0)
        return peak + params, params, inputs + outputs


# ops that read only the rows their index selects from their first argument
GATHER_OPS = {"embedding", "index_select"}


def bytes_read(node: fx.Node, nbytes: float, hints=None) -> float:
    """Bytes of a parameter, buffer or input (``nbytes`` in all) a graph must read: all of them,
    except where every reader gathers rows from it (an embedding table: the rows looked up, at most
    the whole) and where nothing reads it (nothing). A decode step reads one row of its embedding."""
    if not node.users:
        return 0.0
    rows = 0.0
    for u in node.users:
        if not (u.op == "call_function" and ir.op_name(u) in GATHER_OPS and u.args and u.args[0] is node
                and all(a is not node for a in u.args[1:])):
            return nbytes
        rows += sum(float(ir.concrete(t.nbytes, hints)) for t in ir.infos(u))
    return min(rows, nbytes)


class _Memo:
    """node -> (key, value): an entry holds while the node's key (``key_of``: CostModel._memo_key) is
    the same; a node with no key (None) is never memoized. With ``checked`` a set (a graph priced
    whole, unchanged meanwhile), an entry checked against its key once is trusted for the rest."""

    def __init__(self, key_of):
        self.key_of = key_of
        self.entries: dict = {}
        self.checked: set | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, node: fx.Node):
        """(the node's key, its value, found)."""
        if self.checked is not None and node in self.checked:
            key, value = self.entries[node]
            return key, value, True
        key = self.key_of(node)
        hit = self.entries.get(node) if key is not None else None
        if hit is not None and _same(hit[0], key):
            if self.checked is not None:
                self.checked.add(node)
            return key, hit[1], True
        return key, None, False

    def put(self, node: fx.Node, key, value) -> None:
        if key is None:
            return
        self.entries[node] = (key, value)
        if self.checked is not None:
            self.checked.add(node)


def _same(a: tuple, b: tuple) -> bool:
    """Two memo keys equal: values by identity, arguments structurally (_same_arg)."""
    return (a[0] is b[0] and a[3] is b[3] and a[5] == b[5] and len(a[4]) == len(b[4])
            and all(x is y for x, y in zip(a[4], b[4])) and _same_arg(a[1], b[1]) and _same_arg(a[2], b[2]))


def _same_arg(a, b) -> bool:
    """Argument equality with no side effects: nodes, tensors and symbolic sizes by identity
    (comparing two SymInts with == would ask the shape environment, and may add a guard)."""
    if a is b:  # an unchanged node keeps its args tuple
        return True
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_arg(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same_arg(a[k], b[k]) for k in a)
    if isinstance(a, (fx.Node, torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) or type(a) is not type(b):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an argument type without a plain ==: recompute
        return False


def _gemm_mnk(node: fx.Node):
    """(M, N, K) of a 2-D projection (linear over any leading dims, mm, addmm), or None."""
    ins, outs = ir.operand_infos(node), ir.infos(node)
    if not outs or not ins or not outs[0].shape:
        return None
    name = ir.op_name(node)
    a = ins[1] if name in ADD_FIRST and len(ins) > 2 else ins[0]
    if not a.shape:
        return None
    N = outs[0].shape[-1]
    return outs[0].numel // N if N else 0, N, a.shape[-1]


# op_efficiency key of cuBLAS's projections of at most SMALL_M_ROWS rows (a decode step's tokens):
# {"memory_scale", "fixed_s"} fitted by benchmarks/diag/diag_decode_gemm.py; absent, they are priced
# as any matmul
SMALL_M_LINEAR = "small_m_linear"
PROJECTIONS = ("linear", "mm", "addmm")  # the 2-D projections _gemm_mnk sizes
SMALL_M_ROWS = 16


def small_m(node: fx.Node) -> bool:
    """A linear/mm/addmm of at most SMALL_M_ROWS rows (static)."""
    if ir.op_name(node) not in PROJECTIONS:
        return False
    mnk = _gemm_mnk(node)
    return mnk is not None and isinstance(mnk[0], int) and 0 < mnk[0] <= SMALL_M_ROWS


# op_efficiency keys of cuBLAS's 16-bit GEMMs whose rows are not 16-byte aligned: a leading dimension
# (the stride between rows as stored) of an input or of the result that is not a multiple of 8 elements.
# {"scale"}: the rate multiplier measured for them. GEMM_ALIGN1: some row's length is odd (cuBLAS's align1
# fallback kernel); GEMM_ALIGN_PARTIAL: every row even, some 4- or 8-byte aligned only (K or N = 196).
# Absent, such GEMMs are priced as any matmul.
GEMM_ALIGN1 = "gemm_align1"
GEMM_ALIGN_PARTIAL = "gemm_align_partial"
BATCHED_GEMMS = ("bmm", "baddbmm")


def leading_dim(ti: ir.TensorInfo | None):
    """The stride between the rows of a matrix (a tensor's last two dims) as cuBLAS reads it: the
    stride of the dim without unit stride (a transposed matrix's rows are its columns); the last dim's
    size where neither dim has unit stride (the GEMM copies it to rows first) or strides are unknown."""
    if ti is None or not ti.shape:
        return None
    if ti.stride is None or len(ti.shape) < 2:
        return ti.shape[-1]
    (r, c), (sr, sc) = ti.shape[-2:], ti.stride[-2:]
    if sc == 1 or c == 1:
        return sr if r != 1 else c
    if sr == 1 or r == 1:
        return sc
    return c


def projection_input_ld(ti: ir.TensorInfo):
    """A projection's input as the 2-D [M, K] matrix it multiplies: its rows' stride where the leading
    dims flatten to a view with unit-stride rows, else K (aten copies it to contiguous rows)."""
    k = ti.shape[-1]
    if len(ti.shape) < 2 or ti.stride is None or ti.stride[-1] != 1:
        return k
    m = math.prod(ti.shape[:-1]) if all(isinstance(d, int) for d in ti.shape[:-1]) else None
    if m is None or not ir.reshape_is_view(ti, (m, k)):
        return k
    return ti.stride[-2] if ti.shape[-2] != 1 else k


def gemm_row_alignment(node: fx.Node):
    """gcd(8, the leading dimension of each input matrix and of the result) of a 16-bit linear, mm,
    addmm, bmm or baddbmm: 8 where every row is 16-byte aligned, 4 or 2 where some are 8- or 4-byte
    aligned only, 1 where one is odd. None for other nodes and dtypes, symbolic row lengths or strides,
    and projections of at most SMALL_M_ROWS rows (a decode step's weight stream has its own price)."""
    name = ir.op_name(node)
    if name not in PROJECTIONS and name not in BATCHED_GEMMS:
        return None
    ins, outs = ir.operand_infos(node), ir.infos(node)
    if not outs or outs[0] is None or not outs[0].shape:
        return None
    if name in ADD_FIRST:
        ins = ins[1:]
    if len(ins) < 2 or ins[0] is None or ins[1] is None or ins[0].dtype not in (torch.float16, torch.bfloat16):
        return None
    if name in PROJECTIONS:
        mnk = _gemm_mnk(node)
        if mnk is None or (isinstance(mnk[0], int) and mnk[0] <= SMALL_M_ROWS):
            return None  # (a symbolic M, a batch of any size, counts as more rows, as in small_m)
        lds = [projection_input_ld(ins[0]), leading_dim(ins[1]), outs[0].shape[-1]]
    else:
        lds = [leading_dim(ins[0]), leading_dim(ins[1]), outs[0].shape[-1]]
    if not all(isinstance(v, int) for v in lds):
        return None
    return math.gcd(8, *lds)


def gemm_align1(node: fx.Node) -> bool:
    """A 16-bit projection (gemm_row_alignment) with an odd row: cuBLAS's align1 fallback kernel."""
    return gemm_alignment_key(node) == GEMM_ALIGN1


def gemm_alignment_key(node: fx.Node) -> str | None:
    """The op_efficiency key that prices a 16-bit GEMM with rows not 16-byte aligned, or None. An odd
    row is priced at the align1 rate in projections alone, where it was measured; a batched product
    with one (window attention's 49 x 49, not timed) at the partial rate measured on bmm, the least
    slowdown less alignment could bring."""
    al = gemm_row_alignment(node)
    if al is None or al == 8:
        return None
    return GEMM_ALIGN1 if al == 1 and ir.op_name(node) in PROJECTIONS else GEMM_ALIGN_PARTIAL


def grouped_mm_flops(a, b, out) -> object:
    """Multiply-adds x 2 of torch._grouped_mm(a, b, offs): each output element is a dot product of
    a's last dim (the rows a 2-D a holds belong to one group each, a 3-D b holds every group's
    matrix), except where both are 2-D: the groups split that shared dim, the output stacks one
    matrix per group and each element sums over its group's share of it."""
    k = a.shape[-1]
    if len(a.shape) == 2 and len(b.shape) == 2 and len(out.shape) == 3:
        return 2 * (out.numel // out.shape[0]) * k
    return 2 * out.numel * k


def _efficiency_kind(node: fx.Node) -> str:
    """Which fitted efficiency an aten matmul-like node runs at: "conv", "attention" or "matmul"."""
    name = ir.op_name(node)
    if name in CONV_OPS:
        return "conv"
    if name in ATTENTION_OPS or name in ATTENTION_BACKWARD_OPS:
        return "attention"
    return "matmul"


def _dispatches(node: fx.Node) -> bool:
    """Does running the node cost host time: an op or module call, not a placeholder, output,
    get_attr or Python builtin (operator.getitem on a tuple, SymInt arithmetic)?"""
    if node.op not in ("call_function", "call_module"):
        return False
    t = node.target
    if node.op == "call_function" and not isinstance(
            t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return getattr(t, "__module__", None) not in ("_operator", "operator", "math", "builtins")
    return True


def _hop_body(node: fx.Node) -> fx.GraphModule | None:
    """The GraphModule a higher-order op (torch.ops.higher_order.*) runs, if any."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    owner = node.graph.owning_module
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr" and owner is not None:
            try:
                obj = owner.get_submodule(str(a.target))
            except AttributeError:
                continue
            if isinstance(obj, fx.GraphModule):
                return obj
    return None


def _positional(node: fx.Node, name: str):
    """A schema argument passed by position (its index differs between the SDPA overloads)."""
    if isinstance(node.target, torch._ops.OpOverload):
        for i, a in enumerate(node.target._schema.arguments):
            if a.name == name:
                return node.args[i] if i < len(node.args) else None
    return None


def is_channels_last(t: ir.TensorInfo | None) -> bool:
    """A 4-D tensor whose channel dim is the innermost in memory (NHWC)."""
    if t is None or t.stride is None or len(t.shape) != 4:
        return False
    return t.stride[1] == 1 and t.shape[1] != 1


# out-of-place ops aten runs as a clone of the input and the in-place op on it (two kernels)
COPY_THEN_IN_PLACE = {"masked_fill"}
COPY_OPS = {"clone", "contiguous", "_to_copy", "copy", "copy_", "constant_pad_nd"}


def outer_sum(node: fx.Node) -> bool:
    """A sum over leading dims only, the last kept (a linear layer's bias gradient, ``g.sum(0)``):
    aten reduces it across rows, a kernel the profile measures apart (``bias_grad_sum``)."""
    if node.op != "call_function" or ir.op_name(node) != "sum" or len(node.args) < 2:
        return False
    x = ir.info(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    dims = node.args[1]
    if x is None or len(x.shape) < 2 or not isinstance(dims, (list, tuple)) or not dims:
        return False
    nd = len(x.shape)
    return all(isinstance(d, int) for d in dims) and (nd - 1) not in {d % nd for d in dims}


def narrow_copy(node: fx.Node) -> bool:
    """A copy whose input, read in the output's memory order, comes in runs under 16 bytes (the
    space-to-depth regrouping, a channel pad of a 3-channel image): aten's copy kernel moves it at
    a fraction of the copy rate (profile.narrow_copy_scale)."""
    ins, out = ir.operand_infos(node), ir.info(node)
    if not ins or out is None or out.stride is None or ins[0].stride is None or len(ins[0].shape) != len(out.shape):
        return False
    x = ins[0]
    try:
        dims = [d for d in range(len(out.shape)) if int(out.shape[d]) > 1]
        if not dims:
            return False
        inner = min(dims, key=lambda d: int(out.stride[d]))  # the output's fastest-moving dim
        run = int(x.shape[inner]) if int(x.stride[inner]) == 1 else 1
        if run == int(out.shape[inner]) and int(out.stride[inner]) == 1 and x.stride == out.stride:
            return False  # laid out alike: a plain streaming copy
        return run * x.dtype.itemsize < 16
    except TypeError:  # symbolic sizes
        return False


def conv_device_s(profile: DeviceProfile, node: fx.Node, compute_s, memory_s, bias: bool = True):
    """Device time of a convolution on a CUDA profile: the conv fit, times the measured slowdown of
    a channels_last input whose channels are not a multiple of 8, plus (``bias``) aten's bias kernel."""
    t = profile.gpu_seconds(compute_s, memory_s, "conv")
    if profile.conv_narrow_input_slowdown > 1.0 and narrow_conv_input(node):
        t = t * profile.conv_narrow_input_slowdown
    t = t + conv_channel_pad_s(profile, node)
    gt = grouped_conv_transform_s(profile, node)
    if gt is not None:  # cuDNN's transform path for group widths its grouped kernels do not take
        t = _smax(t, gt)
    dw = depthwise_conv_s(profile, node)
    if dw is not None:  # cuDNN's depthwise kernels compute on CUDA cores, not tensor cores
        t = _smax(t, dw)
    return t + conv_bias_add_s(profile, node) if bias else t


def depthwise_conv_s(profile: DeviceProfile, node: fx.Node):
    """Device time of a depthwise convolution (one input channel per group, as many groups as
    channels) at the rate cuDNN's depthwise kernels compute at over channels_last inputs:
    ``op_efficiency["depthwise_conv"]``'s ``scale`` of the profile's elementwise FLOP rate, its
    ``nonsquare_scale`` for a kernel that is not square (InceptionNeXt's 1 x 11 bands run a slower
    grouped kernel), plus the fixed time of a kernel. An NCHW input is held to the same rate, a
    bound from below: aten's own NCHW depthwise kernel measured 1.8-4.5x slower than cuDNN's
    channels_last one on square kernels (the eager rows of the same profiles), so pricing only the
    channels_last form would favour NCHW. None where the profile has no such entry or the node is
    no such convolution."""
    e = profile.op_efficiency.get("depthwise_conv") if profile.kind == "cuda" else None
    ins = ir.operand_infos(node)
    if not e or len(ins) < 2 or len(ins[0].shape) != 4 or len(ins[1].shape) != 4:
        return None
    x, w = ins[0], ins[1]
    try:
        if int(w.shape[1]) != 1 or int(w.shape[0]) != int(x.shape[1]):
            return None
        square = int(w.shape[2]) == int(w.shape[3])
    except TypeError:  # symbolic channels
        return None
    scale = e.get("scale", 1.0) if square else e.get("nonsquare_scale", e.get("scale", 1.0))
    flops = conv_flops_bytes(ins, ir.infos(node))[0]
    return flops / (profile.elementwise_flops * scale) + profile.kernel_fixed_s


def conv_flops_bytes(ins: list, outs: list) -> tuple[object, object]:
    """(FLOPs, bytes) of a convolution over ``ins`` = [x, w, ...] giving ``outs``: 2 x its
    output's elements x the weight's elements per output channel; every input and output moved
    once, except that a kernel smaller than its stride (ResNet's 1x1 stride-2 downsample) reads
    only the input pixels its windows cover."""
    x, w, out = ins[0], ins[1], outs[0]
    flops = 2 * out.numel * _prod(w.shape[1:])  # Cin/groups * kh * kw
    in_bytes = sum(i.nbytes for i in ins)
    if len(x.shape) == 4 == len(out.shape) == len(w.shape) and not (x.symbolic or out.symbolic or w.symbolic):
        touched = x.shape[0] * x.shape[1] * out.shape[2] * out.shape[3] * w.shape[2] * w.shape[3] * x.dtype.itemsize
        if touched < x.nbytes:
            in_bytes = in_bytes - x.nbytes + touched
    return flops, in_bytes + sum(o.nbytes for o in outs)


def conv_rate(profile: DeviceProfile, node: fx.Node):
    """FLOP/s a cuDNN (oneDNN on the CPU) convolution node runs at before the conv fit: the matmul
    rate of its dtype (cuDNN's own TF32 switch for fp32), over the NCHW slowdown where its layout
    pays it and, on CUDA, over the channel padding of a convolution over few input channels."""
    dtype = ir.operand_infos(node)[0].dtype
    rate = profile.matmul_rate(dtype)
    if dtype == torch.float32 and profile.kind == "cuda":  # cuDNN has its own TF32 switch (on by default)
        rate = profile.matmul_rate(dtype, allow_tf32=torch.backends.cudnn.allow_tf32)
    if conv_layout_penalized(ir.operand_infos(node)[0], profile):
        rate = rate / profile.conv_nchw_slowdown
    if profile.kind == "cuda":
        rate = rate / conv_channel_padding(node, profile)
    return rate


def im2col_samples(node: fx.Node) -> int:
    """The kernels aten's CUDA im2col launches: one per sample of a batched (4-D) input; 0 for any
    other node or a symbolic batch."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten" or ir.op_name(node) != "im2col":
        return 0
    ins = ir.operand_infos(node)
    if not ins or len(ins[0].shape) != 4:
        return 0
    try:
        return int(ins[0].shape[0])
    except TypeError:
        return 0


def attention_waves(node: fx.Node, p: DeviceProfile) -> int:
    """Waves of an SDPA kernel's programs, one per batch x head x ``attention_tile`` queries and one
    resident per SM (0 for symbolic or unknown shapes)."""
    infos = ir.operand_infos(node)
    if not infos or len(infos[0].shape) < 2 or not p.sm_count:
        return 0
    try:
        q = [int(x) for x in infos[0].shape]
    except TypeError:
        return 0
    tile = p.attention_tile or 128
    programs = _prod(q[:-2]) * -(-q[-2] // tile)
    return -(-programs // p.sm_count)


def attention_tile_waste(node: fx.Node, tile: int) -> float:
    """The work an SDPA kernel does over sequences padded up to whole tiles of ``tile`` positions,
    per unit of the work the call asks for: (ceil(Sq / tile) * tile / Sq) * (same for Sk); ViT's
    197 positions run as 256 (1.69x). 1.0 for symbolic lengths."""
    infos = ir.operand_infos(node)
    if len(infos) < 2 or len(infos[0].shape) < 2 or len(infos[1].shape) < 2:
        return 1.0
    try:
        sq, sk = int(infos[0].shape[-2]), int(infos[1].shape[-2])
    except TypeError:
        return 1.0
    if sq < 1 or sk < 1:
        return 1.0
    return (-(-sq // tile) * tile / sq) * (-(-sk // tile) * tile / sk)


def conv_channel_padding(node: fx.Node, profile: DeviceProfile) -> float:
    """How much of its tensor-core work an ungrouped convolution wastes on input channels: cuDNN's
    implicit GEMM steps through each kernel tap ``conv_channel_chunk`` input channels at a time,
    so a convolution over fewer channels runs at C_in / chunk of the rate (ResNet's 3-channel stem,
    the 16-channel space-to-depth stem). 1.0 without a measured chunk, for grouped convolutions
    and for C_in >= chunk."""
    infos = ir.operand_infos(node)
    if not profile.conv_channel_chunk or len(infos) < 2 or len(infos[0].shape) != 4 or len(infos[1].shape) != 4:
        return 1.0
    try:
        cin, cin_w = int(infos[0].shape[1]), int(infos[1].shape[1])
    except TypeError:  # symbolic channels
        return 1.0
    if cin != cin_w:  # grouped (or depthwise)
        return 1.0
    return channel_chunk_factor(profile.conv_channel_chunk, cin)


def channel_chunk_factor(chunk: int, cin: int) -> float:
    """chunk / C_in for an ungrouped convolution over fewer than ``chunk`` input channels, else 1.0
    (no chunk measured: 0). The one formula the cost model and calibrate's fit share."""
    return chunk / cin if chunk and 0 < cin < chunk else 1.0


def narrow_conv_input(node: fx.Node) -> bool:
    """A 2-D convolution over a channels_last input whose channel count is not a multiple of 8
    (ResNet's 3-channel stem): cuDNN runs it on a slow path (profile.conv_narrow_input_slowdown)."""
    x = ir.operand_infos(node)[0] if ir.operand_infos(node) else None
    if x is None or len(x.shape) != 4 or not is_channels_last(x):
        return False
    try:
        return int(x.shape[1]) % 8 != 0
    except TypeError:  # a symbolic channel count
        return False


def _cl16_conv(profile: DeviceProfile, node: fx.Node, key: str):
    """(the profile's ``op_efficiency[key]``, x, w, out) of a 2-D convolution over a 16-bit
    channels_last input on a CUDA profile with that entry; None otherwise."""
    e = profile.op_efficiency.get(key) if profile.kind == "cuda" else None
    ins, outs = ir.operand_infos(node), ir.infos(node)
    if not e or len(ins) < 2 or not outs or len(ins[0].shape) != 4 or len(ins[1].shape) != 4:
        return None
    if ins[0].dtype.itemsize != 2 or not is_channels_last(ins[0]):
        return None
    return e, ins[0], ins[1], outs[0]


def grouped_conv_transform_s(profile: DeviceProfile, node: fx.Node):
    """Device time of a grouped 16-bit convolution over a channels_last input (three groups or more,
    not depthwise) whose group width is not a power of two (RegNet's 24 channels a group): cuDNN has
    no grouped kernel for it and runs a transform path (three tensorTransformGeneric kernels and
    memsets around the convolution) that moves its input and output at
    ``op_efficiency["grouped_conv_transform"]["memory_scale"]`` of the copy rate. None on other
    profiles and for other convolutions (two groups: cuDNN splits some into two convolutions, and
    measured from 0.03 to 0.16 of the copy rate)."""
    found = _cl16_conv(profile, node, "grouped_conv_transform")
    if found is None:
        return None
    e, x, w, out = found
    try:
        cin, gw_in, cout = int(x.shape[1]), int(w.shape[1]), int(w.shape[0])
        groups = cin // gw_in if gw_in else 0
        if groups < 3 or gw_in < 2 or cout % groups:
            return None
        pow2 = lambda v: v & (v - 1) == 0  # noqa: E731
        if pow2(gw_in) and pow2(cout // groups):
            return None
        nbytes = float(x.nbytes) + float(out.nbytes)
    except TypeError:  # symbolic sizes
        return None
    return nbytes / (profile.bandwidth * e["memory_scale"]) + profile.kernel_fixed_s


def conv_channel_pad_s(profile: DeviceProfile, node: fx.Node):
    """Device time of the padding cuDNN does around an ungrouped 16-bit convolution over a
    channels_last input of at least 8 channels where the input or output channels are not a
    multiple of 8 (Res2Net's 14- and 28-channel splits): it copies the input into a zeroed buffer
    of whole 8-channel groups (and, in graphopt's fused call, the output back out of one), each copy
    a strided kernel at the profile's ``conv_bias_add_scale`` and each buffer a memset, plus the
    fixed time of ``op_efficiency["conv_channel_pad"]``'s kernel counts (``ours`` / ``aten``). 0 on
    other profiles and for other convolutions: few-channel stems run kernels of their own, and 1x1
    ones (squeeze-and-excitation's over one pixel included) were not measured to pad."""
    found = _cl16_conv(profile, node, "conv_channel_pad")
    if found is None:
        return 0.0
    e, x, w, out = found
    try:
        cin, cout = int(x.shape[1]), int(w.shape[0])
        if int(w.shape[1]) != cin or cin < 8 or (cin % 8 == 0 and cout % 8 == 0) \
                or int(w.shape[2]) * int(w.shape[3]) == 1:
            return 0.0
        pad = lambda t, c: float(t.nbytes) * (-(-c // 8) * 8) / c  # noqa: E731
        ours = ir.op_namespace(node) == op_costs.NAMESPACE
        copied = float(x.nbytes) + pad(x, cin) + ((float(out.nbytes) + pad(out, cout)) if ours else 0.0)
        zeroed = pad(x, cin) + (pad(out, cout) if ours else 0.0)
    except TypeError:  # symbolic sizes
        return 0.0
    kernels = e.get("ours" if ours else "aten", 0)
    return copied / (profile.bandwidth * profile.conv_bias_add_scale) + zeroed / profile.bandwidth \
        + kernels * profile.kernel_fixed_s


def conv_bias_add_s(profile: DeviceProfile, node: fx.Node):
    """Device time of the kernel aten runs after a cuDNN convolution to add its bias (aten's
    cudnn_convolution takes none): read and write the output once at the profile's measured
    ``conv_bias_add_scale`` of the copy rate. 0 for graphopt's ops (its fused convolution adds the
    bias in cuDNN), a convolution without a bias, and off CUDA (oneDNN applies the bias in the
    convolution)."""
    if profile.kind != "cuda" or ir.op_namespace(node) == op_costs.NAMESPACE or ir.op_name(node) not in CONV_OPS:
        return 0.0
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    out = ir.info(node)
    if bias is None or out is None:
        return 0.0
    return 2 * out.nbytes / (profile.bandwidth * profile.conv_bias_add_scale) + profile.kernel_fixed_s


def aten_group_norm_s(profile: DeviceProfile, node: fx.Node):
    """(statistics, apply) device seconds of aten's GroupNorm on a CUDA profile that measured it
    (``op_efficiency["group_norm"]``), else None: the statistics kernel gives each (sample, group)
    row one block, which streams its row at ``block_bytes_per_s``, in waves of one block per SM;
    the apply kernel moves x in and out at ``apply_memory_scale`` of the copy rate."""
    block = profile.efficiency("group_norm", "block_bytes_per_s", 0.0)
    if profile.kind != "cuda" or not block or ir.op_name(node) not in ("group_norm", "native_group_norm"):
        return None
    x = ir.info(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    groups = node.args[1] if len(node.args) > 1 else None
    if ir.op_name(node) == "native_group_norm":
        groups = node.args[6] if len(node.args) > 6 else None
    if x is None or not isinstance(groups, int) or len(x.shape) < 2 or x.symbolic:
        return None
    rows = x.shape[0] * groups
    waves = -(-rows // max(profile.sm_count or 1, 1))
    stats = waves * (x.nbytes / rows) / block + profile.kernel_fixed_s
    apply = 2 * x.nbytes / (profile.bandwidth * profile.efficiency("group_norm", "apply_memory_scale", 1.0))
    return stats, apply + profile.kernel_fixed_s


def sdpa_math_reason(node: fx.Node) -> str | None:
    """Why torch's CUDA dispatch of this ``scaled_dot_product_attention`` finds no fused kernel and
    runs the math fallback (bf16/fp16 upcast to fp32, the score matrix written out), else None.
    The fused kernels (flash, memory-efficient, cuDNN) take q, k, v with the same batch and, unless
    ``enable_gqa``, the same head count: k/v broadcast over q's heads (multi-query attention written
    with one K/V head) or batch take the math kernel; so do q, k, v that are not 4-D (NesT's
    [B, H, T, N, D] blocks: the fused kernels take [B, H, S, D] only)."""
    if node.op != "call_function" or ir.op_name(node) != "scaled_dot_product_attention" or len(node.args) < 3:
        return None
    q, k, v = (ir.info(a) if isinstance(a, fx.Node) else None for a in node.args[:3])
    if q is None or k is None or v is None or q.symbolic or k.symbolic or v.symbolic:
        return None
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        if len(q.shape) >= 2 and len(k.shape) >= 2 and len(v.shape) >= 2:
            return f"q, k, v of {len(q.shape)}, {len(k.shape)}, {len(v.shape)} dims: the fused kernels take 4-D ones"
        return None
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        return f"k/v batch {k.shape[0]} broadcast over q's {q.shape[0]}: only the math kernel broadcasts"
    gqa = bool(node.kwargs.get("enable_gqa", False))
    if (k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]) and not gqa:
        return (f"{q.shape[1]} query heads over {k.shape[1]} key heads without enable_gqa: only the math "
                "kernel broadcasts")
    return None


def sdpa_math_s(profile: DeviceProfile, node: fx.Node) -> tuple[float, float, int]:
    """(matmul seconds, memory seconds, kernels) of SDPA's math fallback on a GPU: q, k, v cast to
    fp32, the two batched products at the fp32 rate (no TF32), the scores written, masked,
    softmaxed and read back in fp32, the output cast back; the profile's ``op_efficiency["sdpa_math"]``
    scales the products' rate and counts the passes over the scores where measured."""
    q, k, v = (ir.info(a) for a in node.args[:3])
    out = ir.info(node)
    sq, d, sk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    bh = 1
    for n in (out.shape if out is not None else q.shape)[:-2]:  # batch, heads, NesT's blocks: each a product
        bh *= n
    flops = 2 * bh * sq * sk * (d + dv)
    scores = bh * sq * sk * 4
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    mi = ir.info(mask) if isinstance(mask, fx.Node) else None
    causal = bool(node.kwargs.get("is_causal", False) or _positional(node, "is_causal") is True)
    casts = sum(t.numel * (t.dtype.itemsize + 8) for t in (q, k, v) if t.dtype != torch.float32)
    # scores: written by the product, read and written by the mask and by the softmax, read by the
    # product; more where the profile measured the kernel (op_efficiency "sdpa_math")
    passes = profile.efficiency("sdpa_math", "score_passes", 4 + (2 if (mi is not None or causal) else 0))
    nbytes = casts + passes * scores + (mi.nbytes if mi is not None else 0) + (out.numel * 10 if out is not None else 0)
    kernels = 4 + (1 if (mi is not None or causal) else 0) + sum(1 for t in (q, k, v) if t.dtype != torch.float32)
    rate = profile.matmul_rate(torch.float32, allow_tf32=False) * profile.efficiency("sdpa_math", "matmul_scale", 1.0)
    return flops / rate, nbytes / profile.bandwidth, kernels


def broadcast_channels_last(node: fx.Node) -> bool:
    """An aten pointwise op writing a channels_last 4-D tensor with an operand it broadcasts (a
    per-channel scale, squeeze-and-excitation's [N, C, 1, 1]): aten runs it in the strided,
    unvectorized kernel it runs a convolution's bias add in (the profile's ``conv_bias_add_scale``)."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten":
        return False
    out = ir.info(node)
    if out is None or not is_channels_last(out) or ir.is_contiguous(out):
        return False
    try:
        numel = out.numel
        return any(isinstance(a, fx.Node) and ir.info(a) is not None and 1 < ir.info(a).numel < numel
                   for a in node.args)
    except TypeError:  # symbolic sizes
        return False


def _dense_order(t: ir.TensorInfo) -> bool:
    """Non-overlapping and dense: some order of the dims lays it out contiguously."""
    dims = sorted((d for d in range(len(t.shape)) if int(t.shape[d]) > 1), key=lambda d: int(t.stride[d]))
    step = 1
    for d in dims:
        if int(t.stride[d]) != step:
            return False
        step *= int(t.shape[d])
    return True


def cat_pieces(node: fx.Node) -> list[tuple[float, int, bool]] | None:
    """(bytes, run bytes, dense) of each non-empty piece of an aten concatenation: the run is how
    many contiguous bytes of the output one piece fills before the next piece's (the piece's extent
    along the dim and every dim inside it in the output's memory order: a channel concatenation of
    channels_last tensors writes runs of C_piece elements, an NCHW one runs of C_piece * H * W);
    dense: the piece is laid out as the output's memory order would lay it out. None for anything
    else (stack, symbolic sizes, unknown strides)."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten" or ir.op_name(node) not in ("cat", "concat") \
            or not node.args or not isinstance(node.args[0], (list, tuple)):
        return None
    out = ir.info(node)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if out is None or out.stride is None or not isinstance(dim, int) or not out.shape:
        return None
    try:
        nd = len(out.shape)
        d = dim % nd
        order = sorted(range(nd), key=lambda e: (int(out.stride[e]), -e))  # innermost first
        inner = order[:order.index(d)]
        outer = any(int(out.shape[e]) > 1 for e in order[order.index(d) + 1:])  # a dim outside d: runs end
        pieces = []
        for a in node.args[0]:
            i = ir.info(a) if isinstance(a, fx.Node) else None
            if i is None or i.stride is None or len(i.shape) != nd:
                return None
            if int(i.numel) == 0:
                continue
            step, dense = 1, True
            for e in order:
                if int(i.shape[e]) > 1 and int(i.stride[e]) != step:
                    dense = False
                step *= int(i.shape[e])
            run = (math.prod(int(i.shape[e]) for e in inner) * int(i.shape[d]) if outer else int(i.numel)) \
                * i.dtype.itemsize
            pieces.append((float(i.nbytes), run, dense))
        return pieces
    except TypeError:  # symbolic sizes
        return None


def cat_run_scale(e: dict, run: int) -> float:
    """The share of the copy rate aten's concatenation kernel writes runs of ``run`` bytes at
    (``op_efficiency["cat_runs"]``): ``long`` from ``long_bytes`` up, ``wide`` for runs of at least
    64 bytes in whole 16-byte vectors, ``32`` for 32-byte runs, ``narrow`` for the rest."""
    if run >= e.get("long_bytes", 4096):
        return e.get("long", 1.0)
    if run >= 64 and run % 16 == 0:
        return e.get("wide", 1.0)
    if run % 32 == 0:
        return e.get("32", 1.0)
    return e.get("narrow", 1.0)


def aten_cat_s(profile: DeviceProfile, node: fx.Node) -> tuple[float, int] | None:
    """(memory seconds, kernels) of an aten concatenation on a CUDA profile with a ``cat_runs``
    entry: one batched kernel that reads each piece and writes it at the rate of its runs
    (cat_run_scale); where a piece is not dense in the output's memory format (a channel slice:
    Res2Net's last split) aten copies piece by piece instead, a strided copy kernel each at no more
    than the profile's ``conv_bias_add_scale``. None where neither applies."""
    e = profile.op_efficiency.get("cat_runs")
    pieces = cat_pieces(node) if e else None
    if not pieces:
        return None
    each = not all(dense for _, _, dense in pieces)
    s = 0.0
    for nbytes, run, _ in pieces:
        scale = cat_run_scale(e, run)
        if each:
            scale = min(scale, profile.conv_bias_add_scale)
        s += 2 * nbytes / (profile.bandwidth * scale)
    if each:
        return s + (len(pieces) - 1) * profile.kernel_fixed_s, len(pieces)
    return s, 1


def nhwc_upsample(node: fx.Node) -> bool:
    """aten's bilinear upsampling of a 4-D input whose channels are innermost (stride 1): CUDA runs
    its NHWC kernel (``upsample_bilinear2d_nhwc_out_frame``), priced at ``op_efficiency
    ["upsample_bilinear2d_nhwc"]`` where the profile measured it."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten" or ir.op_name(node) != "upsample_bilinear2d":
        return False
    x = ir.info(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    return x is not None and x.stride is not None and len(x.shape) == 4 and x.stride[1] == 1 and x.shape[1] > 1


def strided_elementwise(node: fx.Node, kind: str) -> bool:
    """An aten pointwise op or copy that CUDA runs in its strided, unvectorized kernel: aten's
    TensorIterator vectorizes only where every operand is laid out as the output is and the output
    is dense, so a broadcast operand, a transposed or sliced read (a reshape's copy, a strided
    product) or a channel pad take the kernel that computes each element's offsets, priced at the
    profile's ``conv_bias_add_scale`` (measured on a convolution's bias add, that kernel's broadcast
    case). Single-element operands (scalars) do not count; concatenations have a kernel of their own, and
    col2im its own measured rate (``op_efficiency["col2im"]``, which already holds its strided reads)."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten" or kind not in ("pointwise", "copy") \
            or ir.op_name(node) in ("cat", "stack", "concat", "col2im"):
        return False
    out = ir.info(node)
    if out is None or out.stride is None:
        return False
    try:
        if not _dense_order(out):
            return True
        big = [d for d in range(len(out.shape)) if int(out.shape[d]) > 1]
        for a in node.all_input_nodes:
            i = ir.info(a)
            if i is None or int(i.numel) <= 1:
                continue
            if i.device != out.device:
                return False  # a transfer between devices: the copy engine's rate
            if i.stride is None or tuple(i.shape) != tuple(out.shape) or \
                    any(int(i.stride[d]) != int(out.stride[d]) for d in big):
                return True
        return False
    except TypeError:  # symbolic sizes
        return False


def _reduced_dim(node: fx.Node) -> int | None:
    x = ir.operand_infos(node)[0] if ir.operand_infos(node) else None
    dim = _positional(node, "dim")
    if x is None or not isinstance(dim, int) or not x.shape:
        return None
    return dim % len(x.shape)


def spatial_softmax(node: fx.Node) -> bool:
    """aten's softmax or log-softmax over a dim with more than one element after it (a softmax over
    the tokens of [B, H, N, D], CoaT's factorized attention): CUDA runs its spatial kernel, at the
    profile's ``op_efficiency["spatial_softmax"]["memory_scale"]`` of the copy rate."""
    if node.op != "call_function" or ir.op_name(node) not in SOFTMAX_OPS:
        return False
    d = _reduced_dim(node)
    if d is None:
        return False
    try:
        return math.prod(int(s) for s in ir.operand_infos(node)[0].shape[d + 1:]) > 1
    except TypeError:
        return False


def inference_batch_norm_layout(node: fx.Node) -> str | None:
    """"cl" or "nchw" for aten's BatchNorm in inference (running statistics) over a 4-D input
    channels_last or not, else None: CUDA runs it as a transform kernel per layout whose rates
    the profile measures (``op_efficiency["batch_norm"]``)."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten":
        return None
    name = ir.op_name(node)
    if name in ("batch_norm", "native_batch_norm"):
        # (the cost layer sits below graphopt.matcher's get_arg: the argument read here)
        if (node.args[5] if len(node.args) > 5 else node.kwargs.get("training", True)) is not False:
            return None
    elif name != "_native_batch_norm_legit_no_training":
        return None
    x = ir.operand_infos(node)[0] if ir.operand_infos(node) else None
    if x is None or x.stride is None or len(x.shape) != 4:
        return None
    return "cl" if is_channels_last(x) else "nchw"


def implicit_copy_bytes(node: fx.Node) -> float:
    """Bytes of the copy an aten op makes of an input its kernel cannot read as laid out (read and
    written): softmax and layer norm take a contiguous input, a convolution one dense in its memory
    format (conv_input_copy_bytes)."""
    if node.op != "call_function" or ir.op_namespace(node) != "aten":
        return 0.0
    name = ir.op_name(node)
    ins = ir.operand_infos(node)
    if not ins or ins[0].stride is None:
        return 0.0
    x = ins[0]
    try:
        if name in SOFTMAX_OPS or name in ("layer_norm", "native_layer_norm", "im2col", "col2im"):
            return 0.0 if ir.is_contiguous(x) else 2.0 * float(x.nbytes)
    except TypeError:  # symbolic sizes
        return 0.0
    if name in ("matmul", "bmm", "linear"):
        return matmul_copy_bytes(node)
    return conv_input_copy_bytes(x) if name in CONV_OPS else 0.0


def matmul_copy_bytes(node: fx.Node) -> float:
    """Bytes (read and written) of the copies aten's matmul/bmm/linear makes of operands cuBLAS cannot
    read as laid out: a batched operand whose batch dims do not fold into one stride (``matmul`` folds
    them with a reshape: a permuted q of ``[B, heads, tokens, dim]`` read through a qkv projection's
    layout is copied), a left operand whose rows do not fold over a 2-D right one (a linear's weight:
    CaiT's talking-heads projection over a permuted score tensor), or a matrix with no unit stride in
    its last two dims."""
    name = ir.op_name(node)
    mats = ir.operand_infos(node)[:2]
    if len(mats) != 2 or any(m is None or m.stride is None or len(m.shape) < 2 for m in mats):
        return 0.0
    try:
        shapes = [tuple(int(v) for v in m.shape) for m in mats]
        strides = [tuple(int(v) for v in m.stride) for m in mats]
    except TypeError:  # symbolic sizes
        return 0.0
    total = 0.0
    for i, (shape, st) in enumerate(zip(shapes, strides)):
        if name in ("matmul", "linear") and i == 0 and len(shapes[1]) == 2 and len(shape) > 2:
            folds = _folds(shape[:-1], st[:-1])  # [.., M, K] read as [rows, K]
        else:
            folds = name == "bmm" or _folds(shape[:-2], st[:-2])
        unit = st[-1] == 1 or shape[-1] == 1 or st[-2] == 1 or shape[-2] == 1
        if not (folds and unit):
            total += 2.0 * float(mats[i].nbytes)
    return total


def _folds(shape, stride) -> bool:
    """The dims of ``shape`` (of size over 1) merge into one by a view: each one's stride is the
    next one's stride times its size, none expanded."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    if any(stride[d] == 0 for d in dims):
        return len(dims) == 0
    return all(stride[a] == stride[b] * shape[b] for a, b in zip(dims, dims[1:]))


def conv_input_copy_bytes(x: ir.TensorInfo | None) -> float:
    """Bytes (read and written) of the copy cuDNN's convolution call makes of a 4-D input that is
    dense in neither memory format (a channel slice of a channels_last tensor: Res2Net's, CoaT's);
    aten's call and our fused convolution's alike."""
    if x is None or x.stride is None or len(x.shape) != 4:
        return 0.0
    try:
        n, c, h, w = (int(s) for s in x.shape)
        cl = (h * w * c, 1, w * c, c)
        fits = ir.is_contiguous(x) or all(int(x.stride[d]) == cl[d] for d in range(4) if int(x.shape[d]) > 1)
        return 0.0 if fits else 2.0 * float(x.nbytes)
    except TypeError:  # symbolic sizes
        return 0.0


def _with_copy(profile: DeviceProfile, copy_s, t, gpu, launches) -> tuple:
    """(eager time, device time, launches) of a node with its input copy (``copy_s`` memory
    seconds, input_copy_s) as a kernel of its own before it."""
    return t + profile.kernel_seconds(0.0, copy_s), gpu + _num(profile.gpu_seconds(0.0, copy_s)), launches + 1


def input_copy_s(profile: DeviceProfile, nbytes) -> float:
    """Memory seconds of an input copy an op's kernel call makes first (implicit_copy_bytes; an op of
    ours declares its own, OpCost.copy_bytes), at the strided kernel's rate; 0 off CUDA."""
    if profile.kind != "cuda" or not nbytes:
        return 0.0
    return nbytes / (profile.bandwidth * min(1.0, profile.conv_bias_add_scale))


def conv_layout_penalized(x: ir.TensorInfo | None, profile: DeviceProfile) -> bool:
    """Convolutions on an NCHW input pay the profile's measured slowdown (tensor-core convolutions
    on a GPU; oneDNN's on the CPU)."""
    if profile.conv_nchw_slowdown <= 1.0 or x is None or len(x.shape) != 4 or is_channels_last(x):
        return False
    if profile.kind == "cpu":  # oneDNN: measured for fp32 by the CPU profile
        return x.dtype.is_floating_point
    if x.dtype in (torch.bfloat16, torch.float16):
        return True
    return x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32


def _num(v) -> float:
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except TypeError:
        # symbolic: compare at a nominal size of 1024 for every symbol
        return float(v.subs({s: 1024 for s in v.free_symbols}))
