"""What optimize() holds in memory beside the model: the account of the constants the passes add.

Rewrites that copy weights (merge_sibling_linears' concatenations, fold_conv_bn's folded weights,
convert_channels_last's NHWC weights, assign_precision's converted weights, fold_constants'
computed tensors) store new constants in the optimized graph. The caller keeps the model, so each
copy is resident twice for as long as both live: on a model that fills most of a GPU, a copy of
every layer's weights is what stops it from being optimized at all.

:class:`ConstantAccount` keeps the bytes of constants the graph has added beyond the model's own
parameters and buffers (recounted after every pass) against a limit, the ``weight_copies`` option
of optimize():

- ``"auto"`` (default): at most ``AUTO_MODEL_FRACTION`` of the model's parameter and buffer bytes,
  or what the model leaves of ``AUTO_DEVICE_FRACTION`` of its device's memory where that is more (a
  small model keeps all its rewrites; a large one's copies stay a fifth of its weights, which with
  the guard's own memory keeps optimize()'s peak within 1.3x of one eager call's on a decoder that
  fills a GPU), and never more than ``AUTO_FREE_FRACTION`` of the memory free on the device when
  optimize() starts (the rest is the accuracy guard's);
- ``"allow"``: no limit; ``"none"``: no rewrite that adds a constant;
- a fraction ``0 < f <= 1`` of the model's bytes, or a size (bytes, ``"4GB"``, ``"512MB"``).

A rewrite that would pass the limit is refused with the reason in the report (a pass may fall back
to a form without the copy: assign_precision then casts the weight in the graph at each call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .errors import GraphoptError

AUTO_MODEL_FRACTION = 0.2
AUTO_DEVICE_FRACTION = 0.04
AUTO_FREE_FRACTION = 0.5
SETTINGS = ("auto", "allow", "none")


def _fmt(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


@dataclass
class ConstantAccount:
    """Bytes of constants the passes added to the graph, against ``limit`` (None: no limit)."""

    limit: float | None = None
    setting: str = "allow"  # how the limit was set (the option as given), for the reasons
    used: float = 0.0  # bytes of added constants the graph reads now
    peak: float = 0.0  # the most ``used`` reached
    refused: int = 0  # rewrites refused for the limit
    refused_bytes: float = 0.0
    reserved: float = 0.0  # constants held outside the graph meanwhile (a result kept aside), counted in ``used``

    def refusal(self, nbytes: float) -> str:
        """Why a rewrite adding ``nbytes`` of constants is refused ("" when it fits; it is then charged)."""
        if nbytes <= 0:
            return ""
        if self.limit is not None and self.used + nbytes > self.limit:
            self.refused += 1
            self.refused_bytes += nbytes
            return (f"would copy {_fmt(nbytes)} of weights into new constants ({_fmt(self.used)} added so far, limit "
                    f"{_fmt(self.limit)}: weight_copies={self.setting!r})")
        self.charge(nbytes)
        return ""

    def charge(self, nbytes: float) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def recount(self, gm: fx.GraphModule) -> None:
        """``used`` from the graph itself: the bytes of graphopt's constants its get_attr nodes read
        (and ``reserved``)."""
        self.used = self.reserved + added_constant_bytes(gm)
        self.peak = max(self.peak, self.used)

    def as_dict(self) -> dict:
        return {"weight_copies": self.setting, "limit_bytes": self.limit, "added_bytes": self.used,
                "added_peak_bytes": self.peak, "refused": self.refused, "refused_bytes": self.refused_bytes}


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - no storage (a subclass): keyed by the tensor
        return id(t)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001
        return t.numel() * t.element_size()


def added_constant_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the constants graphopt stored on ``gm`` (``_graphopt_*`` buffers) that a get_attr node
    reads and that share no storage with the model's own parameters and buffers."""
    from . import ir

    own = {_storage_key(t) for name, t in (*gm.named_parameters(), *gm.named_buffers())
           if not name.rsplit(".", 1)[-1].startswith("_graphopt_")}
    seen, total = set(), 0
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not str(n.target).startswith("_graphopt_"):
            continue
        try:
            t = ir.get_attr_value(gm, n.target)
        except AttributeError:
            continue
        if not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        if key in own or key in seen:
            continue
        seen.add(key)
        total += _nbytes(t)
    return total


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage once)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += _nbytes(t)
    return total


def device_memory(device: torch.device) -> float | None:
    """Total memory of ``device`` (a GPU's, the host's for the CPU); None where unknown (meta)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        return float(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def device_free(device: torch.device) -> float | None:
    """Memory free on ``device`` now: a GPU's free memory plus what the caching allocator holds
    unused; the host's available memory for the CPU; None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: float(line.split()[1]) * 1024 for line in f}
            return info.get("MemAvailable", info.get("MemFree"))
        except (OSError, ValueError, IndexError):
            return None
    return None


def account(weight_copies, model: torch.nn.Module, device: torch.device) -> ConstantAccount:
    """The account for optimize()'s ``weight_copies`` option (see the module docstring)."""
    setting = weight_copies
    if isinstance(weight_copies, str) and weight_copies in SETTINGS:
        if weight_copies == "allow":
            return ConstantAccount(None, "allow")
        if weight_copies == "none":
            return ConstantAccount(0.0, "none")
        mem = device_memory(device)
        if mem is None:
            return ConstantAccount(None, "auto")
        own = model_bytes(model)
        limit = max(AUTO_MODEL_FRACTION * own, AUTO_DEVICE_FRACTION * mem - own)
        free = device_free(device)
        if free is not None:
            limit = min(limit, AUTO_FREE_FRACTION * free)
        return ConstantAccount(limit, "auto")
    from .cost.activations import parse_memory_budget

    try:
        value = parse_memory_budget(weight_copies)
    except GraphoptError:
        raise GraphoptError(f"weight_copies must be 'auto', 'allow', 'none', a fraction in (0, 1] of the model's bytes "
                            f"or a size like 4GB, got {weight_copies!r}") from None
    limit = float(value) * model_bytes(model) if isinstance(value, float) else float(value)
    return ConstantAccount(limit, str(setting))
