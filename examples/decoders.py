"""Decoder-only language models for the generation tests and benchmark, built offline with
random weights: tiny configs of five families (CPU tests) and full-size shapes (GPU benchmark).

    from graphopt.examples import decoders
    model = decoders.build(decoders.tiny_config("llama"), seed=0)                 # fp32, CPU, eval
    model = decoders.build(decoders.llama3_8b_config(), dtype=torch.bfloat16, device="cuda")

    graphopt explain graphopt.examples.decoders:llama3_8b_decode --target h200 --no-accuracy
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "tiny_config", "llama3_8b_config", "glm4_9b_config", "build", "cache_arg", "returned_cache",
           "decode_step", "llama3_8b_decode", "glm4_9b_decode", "tiny_decode"]

FAMILIES = ("glm4", "llama", "qwen2", "mistral", "gpt2")


def tiny_config(family: str, attn: str = "sdpa", vocab: int = 256, layers: int = 2):
    """A CPU-test sized config of ``family`` (hidden 64, 4 heads; GQA with 2 KV heads where the
    family has it), ``attn`` the attention implementation ("sdpa" or "eager")."""
    import transformers as tf

    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "glm4":
        from .zoo import glm4_tiny_config

        cfg = glm4_tiny_config()
        cfg.num_hidden_layers = layers
    elif family == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, **common)
    elif family == "mistral":
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=512, sliding_window=512, **common)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=512, **common)
    else:
        raise ValueError(f"unknown decoder family {family!r}; one of {', '.join(FAMILIES)}")
    cfg._attn_implementation = attn
    return cfg


def llama3_8b_config(num_layers: int = 32):
    """``LlamaConfig`` with the Llama-3-8B shape: hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    SwiGLU 14336, vocab 128256, RoPE theta 5e5, ``num_layers`` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)


def glm4_9b_config(num_layers: int = 40):
    """The GLM-4-9B shape (examples.zoo.glm4_9b_config) with ``num_layers`` layers, SDPA attention."""
    from .zoo import glm4_9b_config as glm

    cfg = glm(num_layers)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(config, *, dtype=torch.float32, device="cpu", seed: int = 0):
    """The causal LM for ``config`` with random weights (transformers' own init, seeded), built in
    ``dtype`` directly on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def cache_arg(model) -> str:
    """The name ``model.forward`` (a model or its class) takes its KV cache under: ``cache``
    (transformers 5.24) or ``past_key_values`` (5.17, before the rename)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(output):
    """The cache a model call returned (``output.cache``, or ``output.past_key_values`` on
    transformers that name it so)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def decode_step(config, *, batch: int = 1, past: int = 1024, room: int = 256, dtype=torch.bfloat16, device=None,
                seed: int = 0):
    """``(module, example_inputs)`` of one decode step as graphopt.optimize_generation optimizes
    it: the model returning only logits (graphopt.generation.LogitsStep), called with one token per
    row against a StaticCache of ``past + room`` positions holding ``past`` of them (random keys
    and values), the mask and positions of that step. ``device`` defaults to cuda when present,
    else meta (shapes only: for ``explain --target h200 --no-accuracy`` of full-size shapes)."""
    from transformers import StaticCache

    from graphopt.generation import LogitsStep

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "meta"
    model = build(config, dtype=dtype, device=device, seed=seed)
    length = past + room
    cache = StaticCache(config=model.config, max_cache_len=length)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    arg = cache_arg(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **{arg: cache})
    for layer in cache.layers:
        if device != "meta":
            for t in (layer.keys, layer.values):
                t.copy_(torch.randn(t.shape, device=device, dtype=torch.float32).to(t.dtype))
            layer.cumulative_length.fill_(past)
    inputs = {"input_ids": torch.randint(3, config.vocab_size, (batch, 1)).to(device),
              "attention_mask": torch.ones(batch, length, dtype=torch.long, device=device),
              "position_ids": torch.full((batch, 1), past, dtype=torch.long, device=device), "cache": cache}
    return LogitsStep(model, arg, {"logits_to_keep": 1}), inputs


def llama3_8b_decode():
    """A Llama-3-8B decode step, batch 1, 1024 tokens past (:func:`decode_step`)."""
    return decode_step(llama3_8b_config())


def glm4_9b_decode():
    """A GLM-4-9B (40 layers) decode step, batch 1, 1024 tokens past (:func:`decode_step`)."""
    return decode_step(glm4_9b_config())


def tiny_decode():
    """A tiny Llama decode step on the CPU in fp32, batch 2, 16 tokens past (tests)."""
    return decode_step(tiny_config("llama"), batch=2, past=16, room=8, dtype=torch.float32, device="cpu")
