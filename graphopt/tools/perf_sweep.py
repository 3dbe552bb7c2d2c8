"""The performance sweep (issue 26, item 3): models nobody wrote a pattern for, each in a process of
its own, timed as eager, torch.compile (default, and reduce-overhead at batch 1) and graphopt, with
the accuracy rule, set-up time and peak, and graphopt's predicted time beside its measured one.

    python benchmarks/sweep.py perf                        # every config, this device (CUDA: bf16)
    python benchmarks/sweep.py perf --list
    python benchmarks/sweep.py perf --configs resnet50:64,hf-bert:1 --reps 20
    python benchmarks/sweep.py perf --small --device cpu   # the tiny CPU-sized variants (fp32)

Configs: one torchvision model per classification family at batch 64 (and batch 1 for the small
ones), Hugging Face architectures built from their configs' defaults with their default attention
(SDPA), decoders cut to a few layers, and timm models where timm is installed. ``--small`` builds
the same architectures at the correctness sweep's sizes (:mod:`graphopt.tools.sweep`), small images
and batches of at most SMALL_BATCH, so a CPU can run the sweep. Weights are random; nothing is downloaded.

Each config runs through :mod:`graphopt.tools.bench` in a fresh Python process (one model's
compilation caches, allocator state and memory stay out of the next one's numbers) under
``--timeout`` seconds; the rows are gathered into one table (``perf_sweep_<date>_<device>.md`` and
``.json``) whose summary gives the geometric mean against the best torch.compile mode, the rows
behind it, the rows slower than eager, and how many predictions fall within 20% of the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .bench import DeviceLock

# --------------------------------------------------------------------------- the configs

# one torchvision model per classification family; the small ones also at batch 1
TORCHVISION = ("alexnet", "vgg16_bn", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "densenet121",
               "googlenet", "inception_v3", "squeezenet1_1", "mobilenet_v2", "mobilenet_v3_large",
               "shufflenet_v2_x1_0", "mnasnet1_0", "efficientnet_b0", "efficientnet_v2_s", "regnet_y_1_6gf",
               "convnext_tiny", "vit_b_16", "swin_t", "maxvit_t")
TORCHVISION_BS1 = ("resnet18", "mobilenet_v3_small", "shufflenet_v2_x1_0", "efficientnet_b0", "squeezenet1_1",
                   "regnet_x_400mf")
IMAGE = {"inception_v3": 299}

# Hugging Face: (config class, model class, overrides of the config's defaults, input kind, batch)
SEQ = 128
_CUT = {"num_hidden_layers": 4}  # decoders: the default (7B-class) width, four layers
HF = {
    "hf-bert": ("BertConfig", "BertModel", {}, "text_mask", 64),
    "hf-roberta": ("RobertaConfig", "RobertaModel", {}, "text_mask", 64),
    "hf-distilbert": ("DistilBertConfig", "DistilBertModel", {}, "text_mask", 64),
    "hf-albert": ("AlbertConfig", "AlbertModel", {"hidden_size": 768, "num_attention_heads": 12,
                                                  "intermediate_size": 3072}, "text_mask", 64),
    "hf-electra": ("ElectraConfig", "ElectraModel", {}, "text_mask", 64),
    "hf-deberta-v2": ("DebertaV2Config", "DebertaV2Model", {"num_hidden_layers": 6}, "text_mask", 16),
    "hf-mobilebert": ("MobileBertConfig", "MobileBertModel", {}, "text_mask", 16),
    "hf-gpt2": ("GPT2Config", "GPT2Model", {"use_cache": False}, "text", 16),
    "hf-opt": ("OPTConfig", "OPTModel", {"use_cache": False}, "text", 16),
    "hf-llama": ("LlamaConfig", "LlamaModel", {**_CUT, "use_cache": False}, "text", 8),
    "hf-mistral": ("MistralConfig", "MistralModel", {**_CUT, "use_cache": False}, "text", 8),
    "hf-qwen2": ("Qwen2Config", "Qwen2Model", {**_CUT, "use_cache": False}, "text", 8),
    "hf-qwen3": ("Qwen3Config", "Qwen3Model", {**_CUT, "use_cache": False}, "text", 8),
    "hf-gemma": ("GemmaConfig", "GemmaModel", {**_CUT, "use_cache": False}, "text", 8),
    "hf-phi": ("PhiConfig", "PhiModel", {**_CUT, "use_cache": False}, "text", 8),
    "hf-gpt-neox": ("GPTNeoXConfig", "GPTNeoXModel", {**_CUT, "use_cache": False}, "text", 8),
    "hf-t5-encoder": ("T5Config", "T5EncoderModel", {"d_model": 768, "d_ff": 3072, "num_heads": 12,
                                                      "num_layers": 12}, "text_mask", 32),
    "hf-vit": ("ViTConfig", "ViTModel", {}, "image", 64),
    "hf-dinov2": ("Dinov2Config", "Dinov2Model", {"image_size": 224}, "image", 64),
    "hf-swin": ("SwinConfig", "SwinModel", {"embed_dim": 96, "depths": [2, 2, 6, 2],
                                            "num_heads": [3, 6, 12, 24]}, "image", 64),
    "hf-convnext": ("ConvNextConfig", "ConvNextModel", {}, "image", 64),
}
HF_BS1 = ("hf-bert", "hf-gpt2", "hf-vit")
HF_TEXT_BATCH, IMAGE_BATCH = 8, 64  # a config outside the lists: a decoder's batch, any other's
# a Hugging Face architecture outside the list at a 7B-class width (hidden size at least this) is cut
# to _CUT's layers, as the listed decoders are
WIDE = 2048
TIMM = ("resnet50d", "efficientnet_b3", "convnext_small", "regnety_032", "deit_small_patch16_224")


@dataclass(frozen=True)
class PerfConfig:
    name: str  # torchvision name, "hf-..." or "timm-..."
    batch: int

    @property
    def key(self) -> str:
        return f"{self.name}:{self.batch}"

    @property
    def source(self) -> str:
        return "hf" if self.name.startswith("hf-") else "timm" if self.name.startswith("timm-") else "torchvision"


SMALL_BATCH = 4  # --small: the batch of the configs above 1
SMALL_ENV = "GRAPHOPT_PERF_SWEEP_SMALL"  # "1": the factories build the small variants (the bench's child)
CORES_ENV = "GRAPHOPT_PERF_SWEEP_CORES"  # the cores a child (prewarm, or timed with --gpus) runs on (comma list)
# --small, a Hugging Face architecture the correctness sweep has no tiny config for: these widths,
# where its config has the field
SMALL_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 256, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16, "head_dim": 16}


def all_configs(timm_available: bool | None = None, small: bool = False) -> list[PerfConfig]:
    """Every config; ``small``: batches above 1 become SMALL_BATCH (the CPU-sized sweep)."""
    if timm_available is None:
        timm_available = _has("timm")
    out = [PerfConfig(n, 64) for n in TORCHVISION] + [PerfConfig(n, 1) for n in TORCHVISION_BS1]
    out += [PerfConfig(n, spec[4]) for n, spec in HF.items()] + [PerfConfig(n, 1) for n in HF_BS1]
    if timm_available:
        out += [PerfConfig(f"timm-{n}", 64) for n in TIMM]
    return [PerfConfig(c.name, min(c.batch, SMALL_BATCH)) for c in out] if small else out


def parse_configs(text: str | None, small: bool = False) -> list[PerfConfig]:
    """'resnet50:64,hf-bert:1' -> configs (a name without a batch takes the sweep's batch for it).
    Besides the sweep's own configs, any model a user could name (:func:`other_model`): a torchvision
    classification model, ``timm-<name>``, or ``hf-<model_type>`` built from transformers' defaults."""
    known: dict = {}
    for c in all_configs(timm_available=True, small=small):
        known.setdefault(c.name, c.batch)  # a name listed twice (bs64, then bs1): its first batch
    if not text:
        return all_configs(small=small)
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, batch = item.partition(":")
        if batch and not (batch.isdigit() and int(batch) > 0):
            raise ValueError(f"batch of '{item}' must be a positive integer")
        if name not in known:
            why = other_model(name)
            if why:
                raise ValueError(f"unknown config '{name}': {why}; --list shows the sweep's own")
            known[name] = default_batch(name)
        b = int(batch) if batch else known[name]
        out.append(PerfConfig(name, min(b, SMALL_BATCH) if small else b))
    return out


def other_model(name: str) -> str | None:
    """Why ``name`` names no model outside the sweep's list (None: it does): ``timm-<name>`` where timm
    has that model, ``hf-<model_type>`` where transformers has that architecture, or a torchvision
    classification model."""
    if name.startswith("timm-"):
        if not _has("timm"):
            return "timm is not installed"
        import timm

        return None if timm.is_model(name[5:]) else f"timm has no model '{name[5:]}'"
    if name.startswith("hf-"):
        from transformers import CONFIG_MAPPING

        if name[3:] not in CONFIG_MAPPING:
            return f"transformers has no model type '{name[3:]}'"
        return _hf_kind(_hf_auto_config(name[3:]))[1] or None
    import torchvision

    if name in torchvision.models.list_models(module=torchvision.models):
        return None
    return "not a torchvision classification model, timm-<name> or hf-<model_type>"


def default_batch(name: str) -> int:
    """The batch of a config outside the sweep's list when none is given: a decoder's HF_TEXT_BATCH,
    IMAGE_BATCH otherwise (the sweep's batches for its own decoders and the rest)."""
    if name.startswith("hf-") and _hf_kind(_hf_auto_config(name[3:]))[0] == "text":
        return HF_TEXT_BATCH
    return IMAGE_BATCH


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------- building a model

def build(name: str, batch: int, small: bool = False):
    """(model, example_inputs) of a sweep config, random weights, fp32 on the CPU (the bench
    converts dtype and device)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name.startswith("hf-"):
        return _build_hf(name, batch, small, gen)
    if name.startswith("timm-"):
        import timm

        model = timm.create_model(name[5:], pretrained=False).eval()
        default = model.default_cfg.get("input_size", (3, 224, 224))[-1]
        if not small:
            return model, (torch.randn(batch, 3, default, default, generator=gen),)
        sizes = [64, default]  # a model built for one image size (a fixed patch grid) takes only that
    else:
        import torchvision

        kw = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
        model = torchvision.models.get_model(name, weights=None, **kw).eval()
        if not small:
            size = IMAGE.get(name, 224)
            return model, (torch.randn(batch, 3, size, size, generator=gen),)
        from .sweep import IMAGE_SIZES

        sizes = IMAGE_SIZES
    for size in sizes:  # the smallest image the model takes
        x = torch.randn(batch, 3, size, size, generator=gen)
        try:
            with torch.no_grad():
                model(x[:1])
            return model, (x,)
        except Exception:  # noqa: BLE001 - too small for this model: the next size
            continue
    raise RuntimeError(f"{name}: no image size in {tuple(sizes)} runs")


def _build_hf(name: str, batch: int, small: bool, gen: torch.Generator):
    import transformers

    from . import sweep

    if name not in HF:
        return _build_hf_auto(name[3:], batch, small, gen)
    cfg_name, model_name, overrides, kind, _ = HF[name]
    tiny = sweep.HF_MODELS.get(name[3:])
    if small and tiny is not None:
        kw, seq, vocab, image = dict(tiny[2]), sweep.SEQ, sweep.VOCAB, 32
        kw.pop("attn_implementation", None)
    else:
        kw, seq, image = dict(overrides), SEQ, None
        vocab = None
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    cfg = model = None
    if small and tiny is None:  # no tiny config in the correctness sweep: shrink the defaults
        kw.update(num_hidden_layers=2)
        wide = cfg_cls(**kw)
        try:  # the widths too, where the architecture takes them (a 2-layer 7B-wide decoder is 4 GB)
            cfg = cfg_cls(**{**kw, **{k: v for k, v in SMALL_WIDTHS.items() if hasattr(wide, k)}})
            model = model_cls(cfg)
        except Exception:  # noqa: BLE001 - sizes that depend on each other: two layers at full width
            cfg, model = wide, None
    cfg = cfg or cfg_cls(**kw)
    if vocab is None:
        vocab = getattr(cfg, "vocab_size", None) or 1000
    if image is None:
        image = getattr(cfg, "image_size", 224)
        image = image if isinstance(image, int) else image[0]
    model = (model if model is not None else model_cls(cfg)).eval()
    if kind == "image":
        return model, {"pixel_values": torch.randn(batch, 3, image, image, generator=gen)}
    return model, _hf_inputs(kind, batch, seq, vocab, image, 3, gen)


def _hf_inputs(kind: str, batch: int, seq: int, vocab: int, image: int, channels: int, gen) -> dict:
    if kind == "image":
        return {"pixel_values": torch.randn(batch, channels, image, image, generator=gen)}
    ids = torch.randint(3, min(vocab, 30000), (batch, seq), generator=gen)
    if kind == "text":
        return {"input_ids": ids}
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[:, seq - seq // 8:] = 0  # right padding: the mask matters
    return {"input_ids": ids, "attention_mask": mask}


def _hf_auto_config(model_type: str, small: bool = False):
    """transformers' default config of ``model_type``, at the sweep's sizes: a 7B-class width (hidden
    size WIDE or more) cut to _CUT's layers, no cache; ``small``: two layers and SMALL_WIDTHS where
    the config has those fields."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    if small:
        fields = cfg.to_dict()
        kw = {k: v for k, v in {**SMALL_WIDTHS, "num_hidden_layers": 2, "image_size": 64}.items() if k in fields}
        kw.update({k: 0 for k in ("pad_token_id", "bos_token_id", "eos_token_id") if fields.get(k) is not None})
        try:
            cfg = AutoConfig.for_model(model_type, **kw)
        except Exception:  # noqa: BLE001 - widths of another type or that depend on each other: the layers only
            cfg = AutoConfig.for_model(model_type, **{k: v for k, v in kw.items() if k == "num_hidden_layers"})
    if getattr(cfg, "hidden_size", 0) >= WIDE and getattr(cfg, "num_hidden_layers", 0) > _CUT["num_hidden_layers"]:
        cfg.num_hidden_layers = _CUT["num_hidden_layers"]
        for attr in ("layer_types", "mlp_only_layers"):  # per-layer lists some decoders keep in step with the count
            v = getattr(cfg, attr, None)
            if isinstance(v, list) and len(v) > cfg.num_hidden_layers:
                setattr(cfg, attr, v[:cfg.num_hidden_layers])
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    return cfg


def _hf_kind(cfg) -> tuple[str, str]:
    """(input kind, why not) of a transformers config: "text" for a decoder (a causal LM that is not
    also a masked LM: input ids alone), "text_mask" for an encoder (ids and a padding mask), "image"
    for a vision model (pixel values); ("", why) for what the sweep cannot feed (a composite of text
    and vision, an encoder-decoder)."""
    from transformers.models.auto import modeling_auto as ma

    t = cfg.model_type
    if getattr(cfg, "is_encoder_decoder", False):
        return "", f"'{t}' is an encoder-decoder (the sweep feeds one input: name its encoder's model type)"
    if any(hasattr(cfg, f) for f in ("text_config", "vision_config")):
        return "", f"'{t}' is a composite of sub-models (name one of them)"
    if getattr(cfg, "image_size", None) and getattr(cfg, "num_channels", None):
        return "image", ""  # (a vision model may have a vocabulary too: BEiT's masked image modelling)
    if getattr(cfg, "vocab_size", None):
        decoder = t in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and t not in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES
        return ("text" if decoder else "text_mask"), ""
    return "", f"'{t}' takes neither token ids nor images"


def _build_hf_auto(model_type: str, batch: int, small: bool, gen: torch.Generator):
    """A transformers architecture outside the sweep's list, from its default config (_hf_auto_config;
    ``small``: SMALL_WIDTHS and two layers, as the listed ones without a tiny config)."""
    from transformers import AutoModel

    cfg = _hf_auto_config(model_type, small)
    kind, why = _hf_kind(cfg)
    if not kind:
        raise ValueError(why)
    image = getattr(cfg, "image_size", 224)
    image = image if isinstance(image, int) else image[0]
    model = AutoModel.from_config(cfg).eval()
    return model, _hf_inputs(kind, batch, SEQ, getattr(cfg, "vocab_size", 0) or 1000, image,
                             getattr(cfg, "num_channels", 3), gen)


# the bench resolves "graphopt.tools.perf_sweep:<factory>": a factory per config, named after it
def factory_name(name: str) -> str:
    """The factory's attribute name of a config: "-" spelled "__" (names use single underscores)."""
    return "model_" + name.replace("-", "__")


def __getattr__(attr: str):
    if attr.startswith("model_"):
        name = attr[len("model_"):].replace("__", "-")
        if name in {c.name for c in all_configs(timm_available=True)} or not other_model(name):
            small = os.environ.get(SMALL_ENV) == "1"

            def make(batch: int | None = None, _n=name, _small=small):
                return build(_n, batch or 1, _small)

            make.__name__ = attr
            return make
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


# --------------------------------------------------------------------------- one config, one process

@dataclass
class Row:
    config: str
    source: str
    batch: int
    status: str = "ok"  # ok | error | timeout
    error: str = ""
    ms: dict = field(default_factory=dict)  # variant -> median ms
    # eager, graphopt and the last torch.compile variant built timed again in alternating calls after the
    # variants: {"eager_ms", "graphopt_ms", "compile_ms" or "compile-ro_ms", ...}
    interleaved: dict = field(default_factory=dict)
    accuracy: dict = field(default_factory=dict)  # variant -> passed (True/False/None)
    setup_s: dict = field(default_factory=dict)
    setup_peak_gb: dict = field(default_factory=dict)
    predicted_ms: float | None = None
    returned: str | None = None  # the measured guard: "optimized" | "model" | None (not measured)
    guard_note: str = ""
    applied: list = field(default_factory=list)
    optimize_phases: dict = field(default_factory=dict)  # optimize()'s wall time per phase (graphopt.timing)
    pass_ms: dict = field(default_factory=dict)  # applied pass -> its measured ms (the guard's), None: not timed
    reverted: dict = field(default_factory=dict)  # reverted pass -> the one line of its revert
    held: dict = field(default_factory=dict)  # pass measured slower alone and held -> the guard's verdict
    timed: dict = field(default_factory=dict)  # pass -> [candidates refused, timed] on the device before applying
    # torch.compile's set-up where a prewarm compiled the config first (sweep(prewarm_jobs=...)): the
    # cold compile's seconds stand in setup_s, the timed run's own (warm cache) ones here
    compile_warm_setup_s: dict = field(default_factory=dict)
    seconds: float = 0.0

    def best_compile(self) -> tuple[str, float] | None:
        opts = [(v, self.ms[v]) for v in ("compile", "compile-ro") if self.ms.get(v)]
        return min(opts, key=lambda kv: kv[1]) if opts else None

    def vs_compile_alternating(self) -> tuple[str, float] | None:
        """(torch.compile variant, graphopt's speed-up over it) from the alternating rounds, where the
        bench timed one there."""
        il, g = self.interleaved, self.interleaved.get("graphopt_ms")
        for v in ("compile-ro", "compile"):
            if g and il.get(f"{v}_ms"):
                return v, il[f"{v}_ms"] / g
        return None

    def vs(self, peer: str) -> float | None:
        """Graphopt's speed-up over ``peer`` ("best-compile": the faster torch.compile mode); over
        eager from the interleaved timing where there is one."""
        il = self.interleaved
        if peer == "eager" and il.get("eager_ms") and il.get("graphopt_ms"):
            return il["eager_ms"] / il["graphopt_ms"]
        g = self.ms.get("graphopt")
        p = self.ms.get(peer) if peer != "best-compile" else (self.best_compile() or (None, None))[1]
        return p / g if g and p else None


def peers(cfg: PerfConfig, device: str, vs: tuple | None = None) -> tuple:
    """The variants beside graphopt: eager and torch.compile, and reduce-overhead at batch 1 on CUDA
    (where launch overhead is what it removes); ``vs`` narrows them (eager always runs)."""
    out = ("eager", "compile", "compile-ro") if cfg.batch == 1 and device.startswith("cuda") else ("eager", "compile")
    return out if vs is None else tuple(v for v in out if v == "eager" or v in vs)


def run_one(cfg: PerfConfig, *, device: str, dtype: str | None, reps: int, warmup: int, small: bool,
            out_dir: Path, vs: tuple | None = None) -> Row:
    """The config through graphopt.tools.bench in this process (the child's side)."""
    from .bench import BenchConfig, run

    if small:
        os.environ[SMALL_ENV] = "1"
    vs = peers(cfg, device, vs)
    spec = f"{__name__}:{factory_name(cfg.name)}"
    t0 = time.perf_counter()
    res = run([BenchConfig(spec, cfg.batch, None, vs, interleave=True)], dtype=dtype, device=device, reps=reps, warmup=warmup,
              out_dir=out_dir, progress=False, tag=f"perf_one_{cfg.name}_bs{cfg.batch}")
    row = Row(cfg.key, cfg.source, cfg.batch, seconds=time.perf_counter() - t0)
    r = res.results[0]
    if r.error:
        row.status, row.error = "error", r.error
    for v in r.variants:
        if v.status != "ok":
            row.ms[v.variant] = None
            if v.variant in ("eager", "graphopt"):
                row.status, row.error = "error", f"{v.variant}: {v.error}"
            continue
        row.ms[v.variant] = v.ms
        row.accuracy[v.variant] = (v.accuracy or {}).get("passed")
        row.setup_s[v.variant] = v.setup_s
        row.setup_peak_gb[v.variant] = v.setup_peak_bytes / 1e9 if v.setup_peak_bytes else None
        if v.variant == "graphopt":
            row.predicted_ms = v.extra.get("predicted_ms")
            speed = v.extra.get("speed") or {}
            row.returned = speed.get("returned") if speed.get("measured") else None
            row.guard_note = speed.get("note", "")
            row.applied = v.extra.get("applied", [])
            row.optimize_phases = v.extra.get("optimize_phases") or {}
            row.pass_ms = v.extra.get("pass_ms") or {}
            row.reverted = v.extra.get("reverted") or {}
            row.held = v.extra.get("held") or {}
            row.timed = v.extra.get("timed_candidates") or {}
            row.interleaved = v.extra.get("interleaved") or {}
    return row


def _child(flag: str, cfg: PerfConfig, row: Path, kw: dict, *extra: str) -> list[str]:
    """The command line of a child process (``--one`` or ``--prewarm-one``) for ``cfg``, writing to ``row``."""
    cmd = [sys.executable, "-m", __name__, flag, cfg.key, "--device", kw["device"], "--row", str(row), *extra]
    if kw.get("dtype"):
        cmd += ["--dtype", kw["dtype"]]
    if kw.get("small"):
        cmd.append("--small")
    if kw.get("vs") is not None:
        cmd += ["--vs", ",".join(kw["vs"])]
    return cmd


def run_isolated(cfg: PerfConfig, *, timeout_s: float, **kw) -> Row:
    """run_one in a fresh interpreter (``python -m graphopt.tools.perf_sweep --one``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = _child("--one", cfg, out, kw, "--reps", str(kw["reps"]), "--warmup", str(kw["warmup"]),
                     "--out", str(kw["out_dir"]))
        env = dict(os.environ)
        if kw.get("lock"):
            env[DeviceLock.ENV] = kw["lock"]
        env.update(kw.get("env") or {})
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as e:
            out_text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            done = [ln.strip() for ln in out_text.splitlines() if ln.strip()]
            last = f"; the last variant done: {done[-1][:160]}" if done else ""
            return Row(cfg.key, cfg.source, cfg.batch, "timeout", f"over the {timeout_s:.0f} s limit{last}",
                       seconds=time.perf_counter() - t0)
        if out.exists():
            return Row(**json.loads(out.read_text()))
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return Row(cfg.key, cfg.source, cfg.batch, "error", f"the worker exited {p.returncode}: {tail}",
                   seconds=time.perf_counter() - t0)


def prewarm_one(cfg: PerfConfig, *, device: str, dtype: str | None, small: bool, vs: tuple | None = None) -> dict:
    """torch.compile's first call of each compile variant of ``cfg`` (the child's side of a prewarm):
    the model prepared as the bench prepares it, compiled cold; Inductor's on-disk caches keep what it
    built, so the config's timed run compiles from them. Returns {variant: seconds of the cold first call}."""
    from .bench import _sync, parse_dtype, prepare_model

    if small:
        os.environ[SMALL_ENV] = "1"
    dev = torch.device(device)
    dt = parse_dtype(dtype or ("bf16" if dev.type == "cuda" else "fp32"))
    model, args, kwargs, _, _ = prepare_model(f"{__name__}:{factory_name(cfg.name)}", cfg.batch, None, dt, dev)
    setup = {}
    for variant in peers(cfg, device, vs):
        if variant not in ("compile", "compile-ro"):
            continue
        torch.compiler.reset()
        t0 = time.perf_counter()
        fn = torch.compile(model, mode="reduce-overhead" if variant == "compile-ro" else None)
        with torch.inference_mode():
            fn(*args, **kwargs)
        _sync(dev)
        setup[variant] = time.perf_counter() - t0
        del fn
    torch.compiler.reset()
    return setup


def prewarm(configs: list[PerfConfig], *, jobs: int, timeout_s: float, log=print, **kw) -> dict:
    """Compile every config cold, ``jobs`` at once, each child on cores of its own (a share of this
    process's), nothing timed: {config key: {variant: cold set-up seconds}} (a config whose child
    failed is left out; its timed run then compiles cold)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    shares = core_shares(max(1, jobs))
    free = list(range(max(1, jobs)))  # slots: which share of the cores a child gets
    slot_lock = threading.Lock()
    done: dict = {}

    def one(cfg: PerfConfig) -> None:
        with slot_lock:
            slot = free.pop()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "setup.json"
                cmd = _child("--prewarm-one", cfg, out, kw)
                env = {**os.environ, **shares[slot]}
                t0 = time.perf_counter()
                try:
                    subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
                except subprocess.TimeoutExpired:
                    pass
                if out.exists():
                    done[cfg.key] = json.loads(out.read_text())
                log(f"    prewarm {cfg.key}: " + (", ".join(f"{v} {s:.1f} s" for v, s in done[cfg.key].items())
                                                    if cfg.key in done else "failed (its timed run compiles cold)")
                    + f" ({time.perf_counter() - t0:.0f} s)")
        finally:
            with slot_lock:
                free.append(slot)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in [pool.submit(one, cfg) for cfg in configs]:
            f.result()
    return done


# --------------------------------------------------------------------------- the table

def revert_kind(note: str) -> str:
    """Why a pass was undone, from its one-line revert note (graphopt.pipeline): the measured guard
    timed it slower, it failed the accuracy rule, or the graph it left was broken (it raised, or
    an invariant check failed)."""
    if note.startswith("reverted: measured "):
        return "measured slower"
    if note.startswith("reverted: fails the accuracy rule"):
        return "accuracy rule"
    return "broken graph"


def summary(rows: list[Row]) -> dict:
    done = [r for r in rows if r.status == "ok" and r.ms.get("graphopt")]
    ratios = [r.vs("best-compile") for r in done if r.vs("best-compile")]
    pred = [r for r in done if r.predicted_ms]
    within = [r for r in pred if abs(r.predicted_ms / r.ms["graphopt"] - 1) <= 0.2]
    alternating = [(r.config, a[1]) for r in done if (a := r.vs_compile_alternating())]
    return {
        "rows": len(rows), "measured": len(done),
        "geomean_vs_best_compile": math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None,
        "behind_best_compile": [r.config for r in done if (r.vs("best-compile") or 2) < 1.0],
        "alternating_vs_compile": {
            "rows": len(alternating),
            "geomean": math.exp(statistics.fmean(math.log(x) for _, x in alternating)) if alternating else None,
            "behind": [c for c, x in alternating if x < 1.0]},
        "slower_than_eager": [r.config for r in done if (r.vs("eager") or 2) < 1.0],
        "accuracy_failed": [r.config for r in done if r.accuracy.get("graphopt") is False],
        "returned_the_model": [r.config for r in done if r.returned == "model"],
        "predicted_within_20pct": f"{len(within)} of {len(pred)}",
        "setup_over_a_third_of_compile": [r.config for r in done if r.setup_s.get("graphopt") and r.setup_s.get("compile")
                                          and r.setup_s["graphopt"] > r.setup_s["compile"] / 3],
        "applied_not_timed": {r.config: [p for p, ms in r.pass_ms.items() if ms is None] for r in done
                              if any(ms is None for ms in r.pass_ms.values())},
        "reverted": {kind: {r.config: [p for p, note in r.reverted.items() if revert_kind(note) == kind] for r in done
                            if any(revert_kind(note) == kind for note in r.reverted.values())}
                     for kind in ("broken graph", "measured slower", "accuracy rule")},
        # passes measured slower alone, held while the others ran: kept (the passes after them built on
        # them) or judged alone in a second run of the pipeline
        "held": {r.config: {p: v.split(":", 1)[0] for p, v in r.held.items()} for r in done if r.held},
        "timed_candidates": {r.config: r.timed for r in done if r.timed},
        "errors": {r.config: r.error for r in rows if r.status != "ok"},
    }


def _ms(v) -> str:
    from .bench import _fmt_ms

    return _fmt_ms(v) or "—"


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}×"


def to_markdown(rows: list[Row], header: dict) -> str:
    s = summary(rows)
    lines = [f"# graphopt performance sweep: {header.get('device_name', header.get('device'))}, {header['date']}", "",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in (header.get("versions") or {}).items() if v),
             f"- dtype {header['dtype']}; median of {header['reps']} calls after {header['warmup']} warm-up, "
             f"each config in a fresh process{' (small CPU-sized variants)' if header.get('small') else ''}; "
             "'vs eager' from eager and graphopt timed again in alternating calls (a drift of the machine "
             "between the variants lands on both); 'vs compile, alternating': the last torch.compile mode run "
             "(reduce-overhead where both ran, 'ro') timed in those same rounds",
             *([f"- {header['jobs']} configs at once: each one's device work (fp64 reference, timing, graphopt's "
                "optimize) held a lock on the device and two host cores of its own; torch.compile's compilation overlapped with the others (its "
                "set-up time ran on a shared host, and its first call and autotuning on the device could fall "
                "inside another config's timing: eager and torch.compile times of this table are noisier than "
                "those of a run with --jobs 1)"] if (header.get("jobs") or 1) > 1 else []),
             *([f"- {header['gpus']} configs at once, each alone on a GPU of its own (the same model of GPU) and "
                "on its own share of the host's cores: no config's work shared a device with another's"]
               if header.get("gpus") else []),
             *([f"- torch.compile's set-up: each config was first compiled cold, {header['prewarm_jobs']} at once "
                "on cores of their own, nothing timed meanwhile; the table's compile set-up is that cold compile's, "
                "and the timed runs compiled from Inductor's caches (their own set-up is in the JSON, "
                "compile_warm_setup_s)"] if header.get("prewarm_jobs") else []),
             f"- command: {header['command']}", "",
             "| config | eager ms | compile ms | compile-ro ms | graphopt ms | vs best compile | "
             "vs compile, alternating | vs eager | predicted ms | pred / measured | guard | "
             "setup s (compile / graphopt) | accuracy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.config} | {r.status}: {r.error[:140]} |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        g = r.ms.get("graphopt")
        pe = f"{r.predicted_ms / g:.2f}" if r.predicted_ms and g else "—"
        guard = r.returned or "not measured"
        setup = f"{_ms(r.setup_s.get('compile'))} / {_ms(r.setup_s.get('graphopt'))}"
        acc = "ok" if r.accuracy.get("graphopt") else "FAIL" if r.accuracy.get("graphopt") is False else "—"
        alt = r.vs_compile_alternating()
        alt = "—" if alt is None else f"{alt[1]:.2f}×{' (ro)' if alt[0] == 'compile-ro' else ''}"
        lines.append(f"| {r.config} | {_ms(r.ms.get('eager'))} | {_ms(r.ms.get('compile'))} | "
                     f"{_ms(r.ms.get('compile-ro'))} | {_ms(g)} | {_x(r.vs('best-compile'))} | {alt} | "
                     f"{_x(r.vs('eager'))} | "
                     f"{_ms(r.predicted_ms)} | {pe} | {guard} | {setup} | {acc} |")
    gm = s["geomean_vs_best_compile"]
    lines += ["", "## Summary", "",
              f"- rows measured: {s['measured']} of {s['rows']}",
              f"- geometric mean, graphopt against the best torch.compile mode: {_x(gm)}",
              f"- behind the best torch.compile mode: {len(s['behind_best_compile'])} "
              f"({', '.join(s['behind_best_compile']) or 'none'})",
              f"- in alternating rounds ({s['alternating_vs_compile']['rows']} rows), against the torch.compile mode "
              f"run last: geometric mean {_x(s['alternating_vs_compile']['geomean'])}, behind on "
              f"{len(s['alternating_vs_compile']['behind'])} ({', '.join(s['alternating_vs_compile']['behind']) or 'none'})",
              f"- slower than eager: {len(s['slower_than_eager'])} ({', '.join(s['slower_than_eager']) or 'none'})",
              f"- graphopt failing the accuracy rule: {', '.join(s['accuracy_failed']) or 'none'}",
              f"- the measured guard returned the model as given: {', '.join(s['returned_the_model']) or 'none'}",
              f"- predictions within 20% of the measurement: {s['predicted_within_20pct']}",
              f"- graphopt's set-up over a third of torch.compile's: {len(s['setup_over_a_third_of_compile'])} "
              f"({', '.join(s['setup_over_a_third_of_compile']) or 'none'})",
              "- applied passes without a measured time: "
              + ("; ".join(f"{c}: {', '.join(ps)}" for c, ps in s["applied_not_timed"].items()) or "none")]
    for kind, by_row in s["reverted"].items():
        lines.append(f"- passes reverted ({kind}): "
                     + ("; ".join(f"{c}: {', '.join(ps)}" for c, ps in by_row.items()) or "none"))
    lines.append("- passes measured slower alone and held while the others ran: "
                 + ("; ".join(f"{c}: " + ", ".join(f"{p} ({v})" for p, v in ps.items()) for c, ps in s["held"].items())
                    or "none"))
    lines.append("- lowering candidates timed on the device before they applied (refused as slower / timed): "
                 + ("; ".join(f"{c}: " + ", ".join(f"{p} {n[0]}/{n[1]}" for p, n in ps.items())
                              for c, ps in s["timed_candidates"].items()) or "none"))
    if s["errors"]:
        lines += [f"- not measured: {len(s['errors'])} ({', '.join(s['errors'])})"]
    return "\n".join(lines) + "\n"


def core_shares(n: int, cores: list[int] | None = None) -> list[dict]:
    """For ``n`` children run at once, each one's environment entry naming a share of ``cores``
    (default: this process's) of its own (``CORES_ENV``; none where the cores are unknown or spent)."""
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = max(1, len(cores) // n) if cores else 0
    return [{CORES_ENV: ",".join(map(str, part))} if (part := cores[i * share:(i + 1) * share]) else {}
            for i in range(n)]


def pin_to_given_cores() -> None:
    """A child: run on the cores its parent gave it (``CORES_ENV``), if any."""
    cores = os.environ.get(CORES_ENV)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


def gpu_slots(gpus: int, cores: list[int] | None = None) -> list[dict]:
    """The environment of each of ``gpus`` children run at once, one per GPU: CUDA_VISIBLE_DEVICES
    names its GPU alone (the g-th of those this process was given) and it runs on a share of the
    cores of its own (:func:`core_shares`)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [{"CUDA_VISIBLE_DEVICES": visible[g] if g < len(visible) else str(g), **share}
            for g, share in enumerate(core_shares(gpus, cores))]


def sweep(configs: list[PerfConfig], *, device: str, dtype: str | None, reps: int, warmup: int, small: bool,
          timeout_s: float, out: Path, command: str, vs: tuple | None = None, jobs: int = 1,
          prewarm_jobs: int = 0, gpus: int = 0, log=print) -> tuple[list[Row], dict]:
    """Each config in a process of its own; ``jobs`` of them at once, their device work serialized by a
    :class:`~graphopt.tools.bench.DeviceLock` (torch.compile's compilation, first call included,
    overlaps with the others' timing: a screen, noisier than one at a time). ``gpus``: instead, that
    many configs at once, each alone on a GPU of its own and on its own share of the host's cores
    (:func:`gpu_slots`): every row is timed as in a run of one config at a time. ``prewarm_jobs``: first
    compile every config cold, that many at once with nothing timed (:func:`prewarm`), so the timed
    runs compile from Inductor's caches; a row's compile set-up is then the cold compile's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from .bench import environment, result_stem

    dev = torch.device(device)
    header = environment(dev)
    if gpus:
        jobs = gpus
    header.update(dtype=dtype or ("bf16" if dev.type == "cuda" else "fp32"), reps=reps, warmup=warmup, small=small,
                  command=command, jobs=1 if gpus else jobs, gpus=gpus, prewarm_jobs=prewarm_jobs)
    stem = result_stem(header, "perf_sweep")
    out.mkdir(parents=True, exist_ok=True)
    slots: list[Row | None] = [None] * len(configs)
    written = threading.Lock()

    cold: dict = {}
    if prewarm_jobs and any(v in peers(c, device, vs) for c in configs for v in ("compile", "compile-ro")):
        log(f"prewarm: compiling {len(configs)} config(s) cold, {prewarm_jobs} at once")
        cold = prewarm(configs, jobs=prewarm_jobs, timeout_s=timeout_s, log=log, device=device, dtype=dtype,
                       small=small, vs=vs)

    free = gpu_slots(gpus) if gpus else []
    slot_lock = threading.Lock()

    def one(i: int, cfg: PerfConfig, scratch: str, lock: str | None) -> None:
        log(f"[{i + 1}/{len(configs)}] {cfg.key} ...")
        env = None
        if gpus:
            with slot_lock:
                env = free.pop()
        try:
            row = run_isolated(cfg, timeout_s=timeout_s, device=device, dtype=dtype, reps=reps, warmup=warmup,
                               small=small, out_dir=scratch, vs=vs, lock=lock, env=env)
        finally:
            if env is not None:
                with slot_lock:
                    free.append(env)
        for variant, seconds in cold.get(cfg.key, {}).items():
            if row.setup_s.get(variant) is not None:
                row.compile_warm_setup_s[variant] = row.setup_s[variant]
                row.setup_s[variant] = seconds
        with written:
            slots[i] = row
            log(f"    {cfg.key}: {row.status} {row.error[:160]}" if row.status != "ok" else
                f"    {cfg.key}: graphopt {_ms(row.ms.get('graphopt'))} ms, eager {_ms(row.ms.get('eager'))}, "
                f"compile {_ms(row.ms.get('compile'))}, compile-ro {_ms(row.ms.get('compile-ro'))} "
                f"({row.seconds:.0f} s)")
            _write_table(out, stem, header, [r for r in slots if r is not None])

    paths = _write_table(out, stem, header, [])  # (rewritten as each row lands)
    with tempfile.TemporaryDirectory() as scratch:
        lock = str(Path(scratch) / "device.lock") if jobs > 1 and not gpus else None
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for f in [pool.submit(one, i, cfg, scratch, lock) for i, cfg in enumerate(configs)]:
                f.result()
    return [r for r in slots if r is not None], paths


def _write_table(out: Path, stem: str, header: dict, rows: list[Row]) -> dict:
    """``<stem>.json`` (header, rows, summary) and ``<stem>.md`` in ``out``; their paths."""
    paths = {"json": str(out / f"{stem}.json"), "markdown": str(out / f"{stem}.md")}
    Path(paths["json"]).write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows],
                                               "summary": summary(rows)}, indent=1, default=str))
    Path(paths["markdown"]).write_text(to_markdown(rows, header))
    return paths


def merge(paths: list[Path], out: Path) -> dict:
    """One table from the JSON files of several sweep runs (a sweep split over calls): rows in file order,
    a config met again replaced where it stood; the header is the first file's with every command."""
    from .bench import result_stem

    runs = [json.loads(Path(p).read_text()) for p in paths]
    if not runs:
        raise ValueError("no files")
    header = dict(runs[0]["header"], command="merged from: " + "; ".join(Path(p).name for p in paths),
                  jobs=max(run["header"].get("jobs") or 1 for run in runs),
                  gpus=max(run["header"].get("gpus") or 0 for run in runs))
    rows = {r["config"]: Row(**r) for run in runs for r in run["rows"]}
    out.mkdir(parents=True, exist_ok=True)
    return _write_table(out, result_stem(header, "perf_sweep"), header, list(rows.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=None, help="comma list of NAME[:BATCH] (default: every config); NAME: "
                    "a config of --list, any torchvision classification model, timm-<name> or hf-<model_type>")
    ap.add_argument("--list", action="store_true", help="list the configs and exit")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--small", action="store_true", help="the CPU-sized variants of the same architectures "
                                                      f"(batches above 1 become {SMALL_BATCH})")
    ap.add_argument("--vs", default=None, help="the peers to run beside graphopt, of eager,compile,compile-ro "
                                               "(default: all that apply; eager always runs)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per config")
    ap.add_argument("--jobs", type=int, default=1, help="configs run at once; their device work takes turns "
                                                        "but torch.compile's compilation overlaps (a screen)")
    ap.add_argument("--gpus", type=int, default=0,
                    help="run this many configs at once, each alone on a GPU of its own (CUDA_VISIBLE_DEVICES) and "
                         "on its own share of the cores: rows timed as with --jobs 1, in 1/N of the time")
    ap.add_argument("--prewarm-jobs", type=int, default=0,
                    help="first compile every config cold with torch.compile, this many at once, nothing timed; "
                         "the timed runs (one at a time with --jobs 1) then compile from Inductor's caches")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="one table from the JSON of several runs (a config in a later file replaces it)")
    ap.add_argument("--out", default=str(Path("benchmarks") / "results"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one config
    ap.add_argument("--prewarm-one", default=None, help=argparse.SUPPRESS)  # the child: compile one config
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.merge:
        try:
            paths = merge([Path(p) for p in a.merge], Path(a.out))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --merge: {e}", file=sys.stderr)
            return 2
        print(Path(paths["markdown"]).read_text())
        print(f"wrote {paths['markdown']}")
        return 0
    if a.list:
        for c in all_configs(small=a.small):
            print(f"{c.source:12s} {c.key}")
        print("also: any torchvision classification model, timm-<name>, hf-<model_type> (transformers' defaults)")
        return 0
    try:
        configs = parse_configs(a.one or a.prewarm_one or a.configs, small=a.small)
        vs = tuple(v.strip() for v in a.vs.split(",") if v.strip()) if a.vs else None
        bad = [v for v in vs or () if v not in ("eager", "compile", "compile-ro")]
        if bad:
            raise ValueError(f"--vs takes eager, compile, compile-ro; got {', '.join(bad)}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.prewarm_one:
        pin_to_given_cores()
        Path(a.row).write_text(json.dumps(prewarm_one(configs[0], device=device, dtype=a.dtype, small=a.small, vs=vs)))
        return 0
    if a.gpus and a.gpus > (torch.cuda.device_count() if device.startswith("cuda") else 0):
        print(f"error: --gpus {a.gpus}: this machine has {torch.cuda.device_count()} GPU(s) for --device {device}",
              file=sys.stderr)
        return 2
    if a.one:
        pin_to_given_cores()
        row = run_one(configs[0], device=device, dtype=a.dtype, reps=a.reps, warmup=a.warmup, small=a.small,
                      out_dir=Path(a.out), vs=vs)
        Path(a.row).write_text(json.dumps(asdict(row), default=str))
        return 0
    command = " ".join(["sweep.py perf"] + (sys.argv[1:] if argv is None else list(argv)))
    rows, paths = sweep(configs, device=device, dtype=a.dtype, reps=a.reps, warmup=a.warmup, small=a.small,
                        timeout_s=a.timeout, out=Path(a.out), command=command, vs=vs, jobs=max(1, a.jobs),
                        prewarm_jobs=max(0, a.prewarm_jobs), gpus=max(0, a.gpus))
    print(to_markdown(rows, {**json.loads(Path(paths["json"]).read_text())["header"]}))
    print(f"wrote {paths['markdown']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
