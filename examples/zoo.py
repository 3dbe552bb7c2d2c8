"""The bundled model zoo: named models with example inputs, built offline with random weights.

    from graphopt.examples import zoo
    model, inputs = zoo.get("resnet50", batch=8)
    out = model(*inputs)

Every model is built on the CPU in fp32 from code (torchvision ``weights=None``, transformers
configs written here; nothing is downloaded), seeded so that the same ``seed`` gives the same
weights and inputs, then moved to ``device``/``dtype`` and put in ``eval()`` mode.
``device="meta"`` builds directly on the meta device (shapes only, no memory): use it to inspect
the full-size models without allocating them.

The transformers models use ``attn_implementation="eager"`` so their graphs hold the explicit
matmul → softmax → matmul attention that the fusion passes rewrite (SDPA would hide it in one
op); their configs are otherwise the library defaults (``use_cache`` included, so the decoder
returns a ``DynamicCache``).

No parameter is left constant: zero biases, zero-initialised heads (torchvision's ViT head is all
zeros, which would make its output identically zero) and all-ones norm weights get small random
values around their initial value. Models with BatchNorm have their running statistics calibrated on random data (one forward in
train mode, cumulative averages) and their affine parameters perturbed, so that conv+bn folding
has non-trivial statistics to fold and activations stay in a range fp16/bf16 can hold.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["ZooModel", "DEFAULT", "names", "entry", "get", "glm4_9b_config", "glm4_tiny_config", "LogitsOnly",
           "next_token_loss",
           "glm4_partial_rotary_factor"]

DEFAULT = "resnet50"


@dataclass(frozen=True)
class ZooModel:
    name: str  # e.g. "resnet50"
    description: str  # one line, shapes included
    family: str  # "cnn" | "vit" | "encoder" | "decoder" | "toy"
    cpu_friendly: bool  # small enough for CPU tests (< ~2 s forward on 2 cores)
    default_batch: int
    default_seq_len: int | None = None  # text models only


# --------------------------------------------------------------------------------------------
# helpers


def _calibrate_bn(model: nn.Module, make_input: Callable[[int], torch.Tensor], batch: int = 4) -> None:
    """Give every BatchNorm realistic running stats and a non-trivial affine transform."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration forward
    model.train()
    with torch.no_grad():
        model(make_input(batch))
    for m, mom in zip(bns, saved):
        m.momentum = mom
        with torch.no_grad():
            m.weight.uniform_(0.8, 1.2)
            m.bias.normal_(0.0, 0.05)
    model.eval()


def _no_constant_params(model: nn.Module) -> None:
    """Replace every constant parameter (zero biases, all-ones norm weights, zero-initialised heads
    and class tokens) with small random values around it, so that a rewrite that drops a bias or a
    norm weight changes the output instead of hiding behind a zero or a one."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            first = p.reshape(-1)[0]
            if p.numel() > 1 and not bool((p == first).all()):
                continue
            c = float(first)
            if c == 0.0:
                p.normal_(0.0, 0.02)
            else:
                p.copy_(c * (1.0 + 0.1 * torch.randn_like(p)))


def _image(batch: int, size: int, gen: torch.Generator, channels: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=gen)


def _on(meta: bool):
    """Context for building a model: the meta device (no memory) or the default (CPU)."""
    return torch.device("meta") if meta else contextlib.nullcontext()


def _check_pos(name: str, **kw: int | None) -> None:
    for k, v in kw.items():
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}: {k} must be a positive int, got {v!r}")


# --------------------------------------------------------------------------------------------
# torchvision models


def _torchvision(ctor_name: str, size: int = 224, calibrate: bool = True):
    def build(batch: int, seq_len, gen: torch.Generator, meta: bool):
        import torchvision.models as tvm

        with _on(meta):
            model = getattr(tvm, ctor_name)(weights=None)
        if calibrate and not meta:
            _calibrate_bn(model, lambda b: _image(b, size, gen))
        return model, (_image(batch, size, gen),)

    return build


def _vit_tiny(batch: int, seq_len, gen: torch.Generator, meta: bool):
    from torchvision.models.vision_transformer import VisionTransformer

    with _on(meta):
        model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                  hidden_dim=64, mlp_dim=128, num_classes=10)
    return model, (_image(batch, 32, gen),)


# --------------------------------------------------------------------------------------------
# transformers models


def _bert_inputs(batch: int, seq_len: int, vocab: int, gen: torch.Generator):
    """[CLS] + random word ids + right padding; row i keeps a different length, row 0 is padded
    by an eighth of the sequence so the mask always matters."""
    ids = torch.randint(1000, vocab, (batch, seq_len), generator=gen)
    ids[:, 0] = 101  # [CLS]
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for i in range(batch):
        pad = (max(1, seq_len // 8) + 3 * i) % seq_len  # 0 <= pad < seq_len, first token kept
        if pad:
            mask[i, seq_len - pad:] = 0
            ids[i, seq_len - pad:] = 0  # [PAD]
    return ids, mask


def _bert(tiny: bool):
    def build(batch: int, seq_len: int, gen: torch.Generator, meta: bool):
        from transformers import BertConfig, BertModel

        if tiny:
            cfg = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                             intermediate_size=512, attn_implementation="eager")
        else:
            cfg = BertConfig(attn_implementation="eager")  # defaults = bert-base-uncased shape
        with _on(meta):
            model = BertModel(cfg)
        return model, _bert_inputs(batch, seq_len, cfg.vocab_size, gen)

    return build


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM returning only its logits (no KV cache): what a pipeline stage or a
    training loop wants from it."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


def next_token_loss(logits, ids):
    """Next-token cross-entropy on the shifted logits, in fp32."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def glm4_9b_config(num_layers: int = 4):
    """``Glm4Config`` with the GLM-4-9B shape (THUDM/glm-4-9b-chat-hf), ``num_layers`` layers.

    hidden 4096, 32 heads, 2 KV heads, head_dim 128, SwiGLU intermediate 13696, vocab 151552,
    RoPE theta 1e4 over half of each head (partial_rotary_factor 0.5), RMSNorm eps 1.5625e-7,
    bias on q/k/v.
    """
    from transformers import Glm4Config

    return Glm4Config(
        vocab_size=151552, hidden_size=4096, intermediate_size=13696,
        num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, hidden_act="silu", max_position_embeddings=131072,
        rms_norm_eps=1.5625e-07, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=151329, bos_token_id=151331, eos_token_id=[151329, 151336, 151338],
        attn_implementation="eager",
    )


def glm4_tiny_config():
    """Same structure as :func:`glm4_9b_config`, CPU-test sized."""
    from transformers import Glm4Config

    return Glm4Config(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=512, rms_norm_eps=1.5625e-07, attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager",
    )


def glm4_partial_rotary_factor(config) -> float:
    """The fraction of each head that RoPE rotates, wherever this transformers version keeps it
    (``config.rope_parameters["partial_rotary_factor"]`` in 5.x, ``config.partial_rotary_factor``
    in older layouts)."""
    rp = getattr(config, "rope_parameters", None) or {}
    if "partial_rotary_factor" in rp:
        return float(rp["partial_rotary_factor"])
    return float(getattr(config, "partial_rotary_factor", 1.0))


def _glm4(tiny: bool):
    def build(batch: int, seq_len: int, gen: torch.Generator, meta: bool):
        from transformers import Glm4ForCausalLM

        cfg = glm4_tiny_config() if tiny else glm4_9b_config(4)
        with _on(meta):
            model = Glm4ForCausalLM(cfg)
        # ordinary text ids: below every special token (3.. for tiny, < 151329 for full size)
        lo, hi = (3, cfg.vocab_size) if tiny else (0, 151329)
        ids = torch.randint(lo, hi, (batch, seq_len), generator=gen)
        ids[:, 0] = cfg.bos_token_id
        return model, (ids,)

    return build


# --------------------------------------------------------------------------------------------
# toys


class ShapeBranch(nn.Module):
    """conv+bn+relu stem, then Python control flow on the input's *shape* (static at capture):
    wide inputs are pooled down first, narrow ones are upsampled."""

    def __init__(self, channels: int = 16, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(channels * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        if x.shape[-1] > 32:
            x = nn.functional.max_pool2d(x, 2)
        else:
            x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def _shape_branch(batch: int, seq_len, gen: torch.Generator, meta: bool):
    with _on(meta):
        model = ShapeBranch()
    if not meta:
        _calibrate_bn(model, lambda b: _image(b, 64, gen))
    return model, (_image(batch, 64, gen),)


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _mlp(batch: int, seq_len, gen: torch.Generator, meta: bool):
    with _on(meta):
        model = MLP()
    return model, (torch.randn(batch, 64, generator=gen),)


# --------------------------------------------------------------------------------------------
# the registry

_ENTRIES: dict[str, tuple[ZooModel, Callable]] = {}


def _register(m: ZooModel, build: Callable) -> None:
    _ENTRIES[m.name] = (m, build)


_register(ZooModel("resnet50", "ResNet-50 (torchvision, weights=None, BN calibrated): float (B,3,224,224) -> (B,1000); 53 conv+bn pairs",
                   "cnn", True, 1), _torchvision("resnet50"))
_register(ZooModel("mobilenet_v3_large", "MobileNetV3-Large (torchvision, weights=None, BN calibrated): float (B,3,224,224) -> (B,1000); depthwise convs, hardswish, SE blocks",
                   "cnn", True, 1), _torchvision("mobilenet_v3_large"))
_register(ZooModel("convnext_tiny", "ConvNeXt-T (torchvision, weights=None): float (B,3,224,224) -> (B,1000); 7x7 depthwise convs, LayerNorm, permutes",
                   "cnn", True, 1), _torchvision("convnext_tiny", calibrate=False))
_register(ZooModel("vit_b_16", "ViT-B/16 (torchvision, weights=None): float (B,3,224,224) -> (B,1000); 12 layers, hidden 768, 12 heads, 197 tokens",
                   "vit", True, 1), _torchvision("vit_b_16", calibrate=False))
_register(ZooModel("vit-tiny", "tiny torchvision VisionTransformer: float (B,3,32,32) -> (B,10); patch 8, 2 layers, hidden 64, 2 heads, 17 tokens",
                   "vit", True, 2), _vit_tiny)
_register(ZooModel("bert-base", "BertModel(BertConfig()) base, eager attention: input_ids + attention_mask int64 (B,S=128) with right padding -> last_hidden_state (B,S,768), pooler_output (B,768)",
                   "encoder", True, 1, 128), _bert(tiny=False))
_register(ZooModel("bert-tiny", "BertModel 2 layers, hidden 128, 2 heads, eager attention: input_ids + attention_mask int64 (B,S=32) with right padding -> last_hidden_state (B,S,128), pooler_output (B,128)",
                   "encoder", True, 2, 32), _bert(tiny=True))
_register(ZooModel("glm4-9b-4l", "Glm4ForCausalLM, GLM-4-9B shape cut to 4 layers (hidden 4096, 32 heads, 2 KV heads, head_dim 128, SwiGLU 13696, vocab 151552, partial RoPE 0.5), eager attention: input_ids int64 (B,S=1024) -> logits (B,S,151552) + DynamicCache; ~2.06B params",
                   "decoder", False, 1, 1024), _glm4(tiny=False))
_register(ZooModel("glm4-tiny", "Glm4ForCausalLM, GLM-4 structure at hidden 64, 4 heads, 2 KV heads, 2 layers, SwiGLU 160, vocab 256, eager attention: input_ids int64 (B,S=16) -> logits (B,S,256) + DynamicCache",
                   "decoder", True, 2, 16), _glm4(tiny=True))
_register(ZooModel("shape-branch", "toy CNN with Python control flow on the input width (pool if W > 32 else upsample) and two conv+bn+relu: float (B,3,64,64) -> (B,10)",
                   "toy", True, 2), _shape_branch)
_register(ZooModel("mlp", "toy MLP 64 -> 128 -> 128 -> 10 (ReLU, GELU): float (B,64) -> (B,10)",
                   "toy", True, 8), _mlp)


def names() -> list[str]:
    """Zoo model names, in registry order (CNNs, ViTs, encoders, decoders, toys)."""
    return list(_ENTRIES)


def entry(name: str) -> ZooModel:
    try:
        return _ENTRIES[name][0]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; choose one of: {', '.join(_ENTRIES)}") from None


def get(name: str, *, batch: int | None = None, seq_len: int | None = None,
        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        seed: int = 0) -> tuple[nn.Module, tuple]:
    """Build zoo model ``name``: returns ``(model, example_inputs)``.

    The model is in ``eval()`` mode on ``device`` with floating parameters in ``dtype``; inputs are
    random (never zeros), int64 ids for text models, floating inputs in ``dtype``. The same ``seed``
    gives the same weights and inputs; the caller's global RNG state is left as it was.
    ``seq_len`` applies to text models only (ignored by the others).
    """
    m = entry(name)
    _check_pos(name, batch=batch, seq_len=seq_len)
    build = _ENTRIES[name][1]
    batch = batch if batch is not None else m.default_batch
    seq_len = seq_len if seq_len is not None else m.default_seq_len
    device = torch.device(device)
    meta = device.type == "meta"
    gen = torch.Generator().manual_seed(seed + 1)  # inputs (and calibration data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # weights
        model, inputs = build(batch, seq_len, gen, meta)
        if not meta:
            _no_constant_params(model)
    model = model.to(device=device, dtype=dtype).eval()
    inputs = tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                   for t in inputs)
    return model, inputs
