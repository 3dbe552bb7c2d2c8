"""Device profiles: peak FLOP/s per dtype, memory bandwidth, launch overhead, memory size.

Shipped profiles live in ``profiles/*.json`` (each says which numbers were measured and which
come from a datasheet). The CPU profile is measured on the spot (a small matmul, a large copy,
a tiny op) and cached in ``~/.cache/graphopt`` keyed by host, core count and torch version.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..errors import GraphoptError

log = logging.getLogger("graphopt.profiles")

_DIR = Path(__file__).with_name("profiles")


@dataclass
class DeviceProfile:
    name: str
    kind: str  # "cuda" | "cpu"
    peak_flops: dict  # dtype name -> FLOP/s for dense matmul-like work
    elementwise_flops: float  # FLOP/s for pointwise / reduction arithmetic
    bandwidth: float  # bytes/s, device memory
    launch_overhead_s: float  # per kernel (per op on the CPU: dispatch overhead)
    memory_bytes: float
    description: str = ""
    source: dict = field(default_factory=dict)
    link_bandwidth: dict = field(default_factory=dict)
    sm_count: int = 0
    # how much slower tensor-core convolutions run on NCHW than on channels_last inputs
    # (1.0 = no difference, or not measured on this device)
    conv_nchw_slowdown: float = 1.0
    # per kernel inside a replayed CUDA graph (graphopt.runtime.cuda_graphs): the launch cost a graph leaves
    launch_overhead_graph_s: float = 1e-6
    # fitted by `graphopt calibrate` on model-shaped work (1.0 / 0.0: not measured, ideal roofline):
    # a GEMM takes flops / (peak * matmul_scale) + matmul_fixed_s, a convolution likewise with the
    # conv_ pair, and a memory-bound kernel bytes / bandwidth + kernel_fixed_s
    matmul_scale: float = 1.0
    matmul_fixed_s: float = 0.0
    conv_scale: float = 1.0
    conv_fixed_s: float = 0.0
    # set: a convolution takes compute / conv_scale and memory / conv_memory_scale, overlapped or
    # summed (conv_overlap), + conv_fixed_s; None: the roofline max above
    conv_memory_scale: float | None = None
    # with conv_memory_scale: True prices max(compute / conv_scale, memory / conv_memory_scale) +
    # conv_fixed_s (compute and memory traffic overlap), False their sum
    conv_overlap: bool = False
    # fraction of the copy bandwidth aten's copy kernels reach when the input, read in the output's
    # order, comes in runs under 16 bytes (1.0: not measured)
    narrow_copy_scale: float = 1.0
    # fraction of the copy bandwidth aten's separate bias add after a cuDNN convolution reaches
    # (a broadcast over the channels of a channels_last output; 1.0: not measured)
    conv_bias_add_scale: float = 1.0
    # input channels cuDNN's implicit GEMM takes per kernel tap: an ungrouped convolution over fewer
    # (C_in < chunk) runs its compute at C_in / chunk of the rate (0: not measured)
    conv_channel_chunk: int = 0
    # how much slower cuDNN runs a channels_last convolution whose input channels are not a multiple
    # of 8 (ResNet's 3-channel stem) than the conv fit (with the channel chunk) predicts (1.0: not measured)
    conv_narrow_input_slowdown: float = 1.0
    kernel_fixed_s: float = 0.0
    # an aten convolution (conv2d + its bias kernel, cuDNN's algorithm choice with
    # cudnn.benchmark as set) against the fused conv + bias + ReLU the conv fit measures
    # (1.0: not measured)
    conv_unfused_slowdown: float = 1.0
    # scaled_dot_product_attention likewise: flops / (peak * attention_scale) + attention_fixed_s,
    # fitted on BERT/ViT/GLM-shaped attention (short sequences run far below the GEMM rate);
    # None: not measured, attention runs at the GEMM efficiency. With attention_memory_scale:
    # max(flops / (peak * attention_scale), bytes / (bandwidth * attention_memory_scale))
    # + attention_fixed_s (a short-sequence call with a mask moves more than it computes), and with
    # attention_tile the flops of sequences padded up to whole tiles of that many positions
    attention_scale: float | None = None
    attention_fixed_s: float | None = None
    attention_memory_scale: float | None = None
    attention_tile: int = 0
    # device seconds of one wave of an SDPA kernel's programs (one program per batch x head x
    # attention_tile queries, one resident per SM): the least time of a call with many tiny heads,
    # whatever its flops (TNT's 50176 heads of 16 positions). 0: no such floor
    attention_wave_s: float = 0.0
    # host (CPU) time to run one fx node that launches no kernel (an ATen view or metadata op,
    # dispatched from the GraphModule's generated code); a kernel node's host time is its
    # launch_overhead_s. Used by the host/device queue model of eager execution
    # (CostModel.execution_cost). Default: a typical value; `graphopt calibrate` measures it.
    host_node_s: float = 2.5e-6
    # host seconds per call of an op ({op name: s}, measured by `graphopt calibrate` on tiny
    # tensors): the host time of that op's node in the queue model instead of launches *
    # launch_overhead_s (SDPA, composite and custom ops dispatch more than one tiny kernel)
    host_op_s: dict = field(default_factory=dict)
    # host seconds per ATen op of an eager training step: a captured GraphModule's forward and
    # autograd's backward, gradient accumulation included (measure_host_train_op_s: a host-bound
    # step of tiny tensors, its wall time over the ops it dispatched). graphopt.partition prices a
    # training stage as the longer of its device time and its ops times this (a stage of small
    # micro-batches is host-bound). 0: not measured, no host term. host_train_call_s: the fixed
    # host seconds of one stage call (forward + backward) beyond its ops (the same measurement at
    # two sizes, the intercept)
    host_train_op_s: float = 0.0
    host_train_call_s: float = 0.0
    # bytes the runtime allocates through the caching allocator per thread that launches GEMMs:
    # torch gives every (cuBLAS handle, stream) pair a workspace (CUBLAS_WORKSPACE_CONFIG; 32 MiB by
    # default on sm90, which cuBLASLt shares); handles are per thread, so a training step has two
    # (the forward's thread and autograd's device thread). Used by graphopt.partition's memory plan
    runtime_workspace_bytes: float = 0.0
    # the bf16 GEMM rate a device sustains under back-to-back load, as a fraction of peak_flops (a
    # GPU at its power limit lowers its clock within a fraction of a second; the profile's notes
    # say where it was measured). `explain` shows the roofline floor at this rate
    # beside the peak-rate floor; 1.0: not measured (or no such cap)
    matmul_sustained_fraction: float = 1.0
    # the GPU's compute capability [major, minor] (empty: not known, or a CPU); sm_90 and newer have
    # the Tensor Memory Accelerator graphopt's Triton GEMM (gemm_swiglu) loads through
    compute_capability: list = field(default_factory=list)
    # fraction of a device's memory (or memory_cap) the partitioner leaves unplanned: the caching
    # allocator's block rounding and transients no plan sees (0: plan up to the cap)
    allocator_headroom: float = 0.0
    # corrections measured for one op or kernel family, by key ({key: {field: value}}; a key
    # absent: not measured). A key an op's cost function names as its efficiency prices it as
    # max(flops / (peak * scale), bytes / (bandwidth * memory_scale)) + fixed_s (gpu_seconds);
    # other fields are read by the code that names them. Keys in use:
    #   "short_attention": scale, fixed_s: graphopt::short_attention (the one-tile Triton kernel),
    #       the flops of its padded tiles; absent, passes/lower_attention.py leaves SDPA be
    #   "row_norm": row_s: norm kernels that give each row its own thread block (aten's LayerNorm,
    #       graphopt's add_layer_norm / add_rms_norm) take at least rows * row_s (block
    #       scheduling bounds them when rows are narrow)
    #   "batch_norm": memory_scale, memory_scale_cl: the fraction of the copy bandwidth aten's BatchNorm
    #       in inference reaches over a 4-D input, NCHW and channels_last (its transform kernels)
    #   "pool": memory_scale: the fraction of the copy bandwidth aten's pooling kernels reach
    #       (max_pool2d over channels_last bf16 reads each input element once per window it is in)
    #   "small_m_linear": memory_scale, fixed_s: cuBLAS's linear/mm/addmm of at most 16 rows (a
    #       decode step's weight streams), whole calls (split-K reduction included); absent, they
    #       are priced as any matmul
    #   "gemv": memory_scale, fixed_s: graphopt::gemv (the split-K Triton GEMV); absent,
    #       passes/lower_gemv.py leaves cuBLAS be (both fitted by benchmarks/diag/diag_decode_gemm.py)
    #   "group_norm": block_bytes_per_s, apply_memory_scale: aten's GroupNorm (cost.model.aten_group_norm_s);
    #       absent, passes/lower_group_norm.py leaves it be
    #   "group_norm_kernel": memory_scale: graphopt::group_norm
    #   "sdpa_math": matmul_scale, score_passes: SDPA's math kernel (cost.model.sdpa_math_s)
    #   "gemm_align1": scale: cuBLAS's 16-bit GEMMs with a row of odd length (its align1 fallback
    #       kernel, cost.model.gemm_row_alignment 1); "gemm_align_partial": scale: those whose rows are
    #       4- or 8-byte aligned only (K = 196); absent, priced as any matmul and passes/align_gemm.py
    #       pads nothing for them
    op_efficiency: dict = field(default_factory=dict)
    # corrections per op class fitted by `graphopt calibrate --corpus` on op shapes of the performance
    # sweep's models timed alone on this device (graphopt.cost.opclass: the class of a node, the form
    # of a fit): {"classes": {class path: {"knots", "log_factor", "range", "add_s", "n", ...} or
    # {"fixed_s", "n_fixed"}}, "stream": the per-node terms of a model's stream, "corpus": which
    # configs, dtype, how many samples, when, "validation": the held-out configs' accuracy before
    # and after}. Empty: no correction (the model as it was)
    op_class_fit: dict = field(default_factory=dict)

    def efficiency(self, key: str, name: str, default=None):
        """Field ``name`` of the profile's ``op_efficiency[key]``, or ``default`` if not measured."""
        return self.op_efficiency.get(key, {}).get(name, default)

    def with_efficiency(self, key: str, entry: dict | None) -> "DeviceProfile":
        """A copy with ``op_efficiency[key]`` set to ``entry`` (None: removed)."""
        table = {k: dict(v) for k, v in self.op_efficiency.items() if k != key}
        if entry is not None:
            table[key] = dict(entry)
        return replace(self, op_efficiency=table)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        """A profile from its JSON form; the per-op fields of older profiles (``norm_row_s``,
        ``pool_bandwidth_scale``, ``short_attention_scale``, ``short_attention_fixed_s``) move
        into ``op_efficiency``."""
        data = dict(data)
        table = {k: dict(v) for k, v in (data.pop("op_efficiency", None) or {}).items()}
        for old, (key, name, unmeasured) in LEGACY_FIELDS.items():
            if old in data:
                v = data.pop(old)
                if v != unmeasured and name not in table.get(key, {}):
                    table.setdefault(key, {})[name] = v
        return cls(**data, op_efficiency=table)

    def matmul_rate(self, dtype: torch.dtype, allow_tf32: bool | None = None) -> float:
        name = str(dtype).replace("torch.", "")
        if dtype == torch.float32:
            if allow_tf32 is None:
                allow_tf32 = torch.backends.cuda.matmul.allow_tf32 if self.kind == "cuda" else False
            if allow_tf32 and "tf32" in self.peak_flops:
                return self.peak_flops["tf32"]
        if name in self.peak_flops:
            return self.peak_flops[name]
        return self.peak_flops.get("float32", min(self.peak_flops.values()))

    def gpu_seconds(self, compute_s, memory_s, kind: str = "memory"):
        """Device time of one kernel: the roofline max of its compute and memory time, with the
        fitted efficiency of its kind ("matmul", "conv", "attention", a key of ``op_efficiency``,
        or a memory-bound kernel)."""
        if kind == "conv":
            if self.conv_memory_scale is not None:
                if self.conv_overlap:
                    return _max(compute_s / self.conv_scale, memory_s / self.conv_memory_scale) + self.conv_fixed_s
                return compute_s / self.conv_scale + memory_s / self.conv_memory_scale + self.conv_fixed_s
            compute_s = compute_s / self.conv_scale + self.conv_fixed_s
        elif kind == "matmul":
            compute_s = compute_s / self.matmul_scale + self.matmul_fixed_s
        elif kind in self.op_efficiency:
            e = self.op_efficiency[kind]
            return _max(compute_s / e.get("scale", 1.0), memory_s / e.get("memory_scale", 1.0)) + e.get("fixed_s", 0.0)
        elif kind == "attention":
            if self.attention_scale is None:
                compute_s = compute_s / self.matmul_scale + self.matmul_fixed_s
            elif self.attention_memory_scale is not None:
                return (_max(compute_s / self.attention_scale, memory_s / self.attention_memory_scale)
                        + (self.attention_fixed_s or 0.0))
            else:
                compute_s = compute_s / self.attention_scale + (self.attention_fixed_s or 0.0)
        return _max(compute_s, memory_s + self.kernel_fixed_s)

    def kernel_seconds(self, compute_s, memory_s, kind: str = "memory", launches: int = 1):
        """Wall time of a kernel launched eagerly. On a GPU the host enqueues kernels while earlier
        ones run, so a kernel costs the longer of its device time and its launch cost; on the CPU
        the op's dispatch and its work add up."""
        gpu = self.gpu_seconds(compute_s, memory_s, kind)
        launch = launches * self.launch_overhead_s
        if self.kind == "cpu" or not launches:
            return gpu + launch
        return _max(gpu, launch)

    def to_dict(self) -> dict:
        return asdict(self)


def _max(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b)
    import sympy

    return sympy.Max(a, b)


# fields of older profile JSONs -> (op_efficiency key, field, the value that meant "not measured");
# an op whose correction was once a profile field registers its old names (register_legacy_field)
LEGACY_FIELDS = {
    "norm_row_s": ("row_norm", "row_s", 0.0),
    "pool_bandwidth_scale": ("pool", "memory_scale", 1.0),
}


def register_legacy_field(old: str, key: str, name: str, unmeasured) -> None:
    """Load an older profile's field ``old`` into ``op_efficiency[key][name]`` (``unmeasured``: the
    value that meant "not measured", loaded as no entry)."""
    LEGACY_FIELDS[old] = (key, name, unmeasured)


def _load_json(path: Path) -> DeviceProfile:
    return DeviceProfile.from_dict(json.loads(path.read_text()))


def shipped() -> dict[str, Path]:
    return {p.stem: p for p in sorted(_DIR.glob("*.json"))}


def _cache_dir() -> Path:
    return Path(os.environ.get("GRAPHOPT_CACHE_DIR", Path.home() / ".cache" / "graphopt"))


def calibrate_cpu(quick: bool = True) -> DeviceProfile:
    """Measure this CPU: fp32 matmul rate, copy bandwidth, per-op dispatch overhead."""
    threads = torch.get_num_threads()

    def best(fn, reps):
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    load = _load_per_core()
    n = 384 if quick else 1024
    flops = _matmul_rate(n, reps=5)
    bf = torch.randn(n, n).bfloat16()
    t_bf = best(lambda: torch.mm(bf, bf), 3)
    bf_flops = 2 * n**3 / t_bf
    m = (1 << 22) if quick else (1 << 24)
    src = torch.randn(m)
    dst = torch.empty_like(src)
    t_cp = best(lambda: dst.copy_(src), 5)
    bw = 2 * src.numel() * 4 / t_cp
    tiny = torch.randn(4)
    t_op = best(lambda: [torch.add(tiny, tiny) for _ in range(100)], 5) / 100
    slowdown = _cpu_conv_nchw_slowdown(best)
    host_node = measure_host_node_s(torch.device("cpu"))
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16e9
    return DeviceProfile(
        name="cpu",
        kind="cpu",
        peak_flops={"float32": flops, "float64": flops / 2, "bfloat16": bf_flops, "float16": bf_flops / 2},
        elementwise_flops=flops / 8,
        bandwidth=bw,
        launch_overhead_s=t_op,
        memory_bytes=float(mem),
        description=f"{platform.processor() or platform.machine()}, {threads} threads, measured "
                    f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                    + (f" at a load of {load:.2f} per core" if load is not None else ""),
        source={"all": "measured", "measured_at": time.time(), "load_per_core": load,
                "conv_nchw_slowdown": "measured: ResNet-shaped fp32 convolutions (oneDNN), "
                                                          "NCHW time / channels_last time",
                "host_node": "measured: per node of a GraphModule of back-to-back views (aten.t/unsqueeze/view)"},
        conv_nchw_slowdown=slowdown,
        host_node_s=host_node,
    )


def view_chain(n: int, *, launches: bool = False):
    """A GraphModule of ``n`` back-to-back nodes on one input ``x`` of shape (4, 4): views
    (aten.t, aten.unsqueeze, aten.view, aten.squeeze, cycling) or, with ``launches``, tiny kernels
    (aten.add.Tensor(y, y)). What `graphopt calibrate` times to measure the host cost of an fx
    node (``host_node_s``) and of a kernel launch."""
    import torch.fx as fx

    aten = torch.ops.aten
    g = fx.Graph()
    y = g.placeholder("x")
    for i in range(n):
        if launches:
            y = g.call_function(aten.add.Tensor, (y, y))  # zeros stay zeros
        else:
            step = i % 4
            if step == 0:
                y = g.call_function(aten.t.default, (y,))
            elif step == 1:
                y = g.call_function(aten.unsqueeze.default, (y, 0))
            elif step == 2:
                y = g.call_function(aten.view.default, (y, [4, 1, 4]))
            else:
                y = g.call_function(aten.squeeze.dim, (y, 1))
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


def measure_host_seconds(device: torch.device, *, launches: bool = False, n: int = 400, reps: int = 5) -> float:
    """Host seconds per node of :func:`view_chain` on ``device``: the time the host takes to issue
    ``n`` back-to-back nodes (perf_counter around the call, before any synchronization: the
    device runs the kernels asynchronously, so this is the host's issue time alone, while the
    queue of n < 1024 launches never fills), the best of ``reps`` calls."""
    gm = view_chain(n, launches=launches)
    x = torch.zeros(4, 4, device=device)
    cuda = device.type == "cuda"
    with torch.inference_mode():
        gm(x)
        if cuda:
            torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            gm(x)
            best = min(best, time.perf_counter() - t0)
            if cuda:
                torch.cuda.synchronize(device)
    return best / n


def measure_host_node_s(device: torch.device) -> float:
    """``host_node_s``: host time of one fx node that launches no kernel (see measure_host_seconds)."""
    return measure_host_seconds(device, launches=False)


def _cpu_conv_nchw_slowdown(best) -> float:
    """How much slower oneDNN runs ResNet-shaped fp32 convolutions on NCHW than on channels_last
    tensors here (a 1x1 and a 3x3 at batch 2; 1.0 when channels_last is not faster)."""
    import torch.nn.functional as F

    nchw = nhwc = 0.0
    for cin, hw, cout, k in ((256, 56, 64, 1), (64, 56, 64, 3), (512, 28, 128, 1)):
        x, w = torch.randn(2, cin, hw, hw), torch.randn(cout, cin, k, k)
        xc, wc = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
        with torch.no_grad():
            nchw += best(lambda: F.conv2d(x, w, padding=k // 2), 3)
            nhwc += best(lambda: F.conv2d(xc, wc, padding=k // 2), 3)
    return max(1.0, round(nchw / nhwc, 3)) if nhwc > 0 else 1.0


PROBE_N = 384  # the matmul calibrate_cpu times and cpu_profile's probe times again
REMEASURE_RATIO = 2.0  # the machine now multiplies more than this much faster: the cached profile is re-measured


def _square(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)


def _matmul_rate(n: int = PROBE_N, reps: int = 3) -> float:
    """fp32 FLOP/s of an n x n matmul here, the best of ``reps`` calls."""
    a, b = _square(n)
    torch.mm(a, b)
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        t = min(t, time.perf_counter() - t0)
    return 2 * n**3 / t


def _load_per_core() -> float | None:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def stale_cpu_profile(prof: DeviceProfile) -> str | None:
    """Why a cached CPU profile no longer describes this machine, or None: the matmul it timed runs
    more than REMEASURE_RATIO times faster now (it was measured while other work shared the cores).
    A machine busier now than then keeps its profile: the next quiet call re-measures it."""
    then = prof.peak_flops.get("float32") or 0.0
    now = _matmul_rate()
    if then > 0 and now > REMEASURE_RATIO * then:
        return (f"its {PROBE_N}x{PROBE_N} matmul ran at {then / 1e9:.1f} GFLOP/s ({prof.description}); "
                f"it runs at {now / 1e9:.1f} now")
    return None


def cpu_cache_path() -> Path:
    """Where this machine's CPU profile is cached (per machine, core count, thread count and
    torch version)."""
    # v2: the profile also holds the measured NCHW convolution slowdown (one cached without
    # host_node_s loads the default: the CPU model does not charge it)
    key = f"cpu-v2-{platform.node()}-{os.cpu_count()}-{torch.get_num_threads()}-{torch.__version__}.json"
    return _cache_dir() / key


def cpu_profile() -> DeviceProfile:
    """This CPU's profile: measured at first use and cached per machine, core count, thread count
    and torch version; a cached one measured while other work slowed the machine (see
    :func:`stale_cpu_profile`) is measured again and the cache replaced."""
    path = cpu_cache_path()
    if path.exists():
        try:
            cached = _load_json(path)
        except Exception:
            cached = None
        if cached is not None:
            why = stale_cpu_profile(cached)
            if why is None:
                return cached
            log.info("re-measuring the CPU profile: %s", why)
            if cached.op_class_fit:
                log.warning("the CPU profile is measured again (%s); its op class fit, made against the old "
                            "numbers, is dropped: run `graphopt calibrate --corpus` again", why)
    prof = calibrate_cpu()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof.to_dict(), indent=1))
    except OSError:
        pass
    return prof


# the datasheet figures of the H200 SXM the shipped h200 profile was measured on: its rates scale by a
# GPU's own to plan for one without a profile (the copy rate by the memory's peak rate, the arithmetic
# by SMs x clock)
H200_PEAK_BANDWIDTH = 4.8e12
H200_SM_CLOCK_KHZ = 132 * 1_980_000


def scaled_to_device(prof: DeviceProfile, props) -> tuple[DeviceProfile | None, str]:
    """``prof`` (the h200 profile) with its copy rate scaled by the device's peak memory rate
    (``2 x memory clock x bus width``, as CUDA reports them) against H200_PEAK_BANDWIDTH and its
    FLOP rates by SMs x clock against H200_SM_CLOCK_KHZ; fixed costs (launches, per-kernel times)
    and op efficiencies as they are. (None, why) where the device reports none of that."""
    mem_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus = getattr(props, "memory_bus_width", 0) or 0
    sms, clock = getattr(props, "multi_processor_count", 0) or 0, getattr(props, "clock_rate", 0) or 0
    if not (mem_khz and bus and sms and clock):
        return None, "the device reports no memory clock, bus width, SM count or clock to scale by"
    peak = 2 * mem_khz * 1e3 * bus / 8
    mem, comp = peak / H200_PEAK_BANDWIDTH, sms * clock / H200_SM_CLOCK_KHZ
    out = replace(prof, name=f"h200 scaled to {props.name}", bandwidth=prof.bandwidth * mem,
                  peak_flops={k: v * comp for k, v in prof.peak_flops.items()},
                  elementwise_flops=prof.elementwise_flops * comp, memory_bytes=float(props.total_memory),
                  sm_count=sms, description=f"{prof.description} Scaled to {props.name}: copy rate x{mem:.3f} "
                  f"(peak memory rate {peak / 1e12:.2f} TB/s), arithmetic x{comp:.3f} ({sms} SMs at "
                  f"{clock / 1e3:.0f} MHz); `graphopt calibrate` measures a profile of its own.")
    return out, f"copy rate x{mem:.3f}, arithmetic x{comp:.3f}"


def profile_names() -> list[str]:
    return sorted(list(shipped()) + ["cpu"])


def get_profile(target: "str | torch.device | DeviceProfile | None" = None) -> tuple[DeviceProfile, str]:
    """Resolve a profile from a name ("h200", "a100", "cpu"), a device, or None (the device
    the model will run on). Returns (profile, note) where note explains any substitution."""
    if isinstance(target, DeviceProfile):
        return target, ""
    if target is None:
        target = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(target, str) and target.lower() in shipped():
        return _load_json(shipped()[target.lower()]), ""
    if isinstance(target, str) and target.lower() == "cpu":
        return cpu_profile(), ""
    if isinstance(target, str) and Path(target).suffix == ".json":
        path = Path(target)
        if not path.exists():
            raise GraphoptError(f"profile file {target} does not exist")
        return _load_json(path), ""
    try:
        dev = torch.device(target)
    except (RuntimeError, TypeError):
        raise GraphoptError(
            f"unknown device or profile '{target}'; choose one of {', '.join(profile_names())} or a device like cuda:0"
        ) from None
    if dev.type == "cpu":
        return cpu_profile(), ""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GraphoptError(f"device {dev} requested but CUDA is not available here; use --target h200 to plan for a GPU you don't have")
        name = torch.cuda.get_device_name(dev).lower()
        for key in shipped():
            if key in name:
                return _load_json(shipped()[key]), ""
        prof = _load_json(shipped()["h200"])
        scaled, how = scaled_to_device(prof, torch.cuda.get_device_properties(dev))
        if scaled is None:
            return prof, f"no profile for '{name}'; planning with h200's numbers ({how})"
        return scaled, f"no profile for '{name}'; planning with h200's numbers scaled to it ({how})"
    raise GraphoptError(f"unsupported device type '{dev.type}'")
